#include "model/config.h"

#include "util/error.h"
#include "util/file.h"

namespace talon {

using json = nlohmann::json;

const char* arch_name(Arch a) {
  switch (a) {
    case Arch::Llama: return "llama";
    case Arch::Mistral: return "mistral";
    case Arch::Qwen2: return "qwen2";
    case Arch::Qwen3: return "qwen3";
  }
  return "?";
}

json ModelConfig::to_json() const {
  return {{"arch", arch_name(arch)},
          {"num_hidden_layers", n_layers},
          {"hidden_size", hidden},
          {"intermediate_size", intermediate},
          {"num_attention_heads", n_heads},
          {"num_key_value_heads", n_kv_heads},
          {"head_dim", head_dim},
          {"vocab_size", vocab},
          {"rms_norm_eps", rms_eps},
          {"rope", {{"theta", rope.theta}, {"type", rope.type}, {"factor", rope.factor},
                    {"low_freq_factor", rope.low_freq_factor}, {"high_freq_factor", rope.high_freq_factor},
                    {"original_max_position_embeddings", rope.original_max_position},
                    {"freq_factors", rope.freq_factors}}},
          {"tie_word_embeddings", tied_embeddings},
          {"qkv_bias", qkv_bias},
          {"qk_norm", qk_norm},
          {"sliding_window", sliding_window}};
}

std::string ModelConfig::hash() const {
  std::string s = to_json().dump();
  return sha256_hex(s.data(), s.size());
}

void ModelConfig::validate(const std::string& src) const {
  auto pos = [&](const char* f, int64_t v) {
    TALON_CHECK(v > 0, "{}: '{}' must be positive, got {}", src, f, v);
  };
  pos("num_hidden_layers", n_layers);
  pos("hidden_size", hidden);
  pos("intermediate_size", intermediate);
  pos("num_attention_heads", n_heads);
  pos("num_key_value_heads", n_kv_heads);
  pos("head_dim", head_dim);
  pos("vocab_size", vocab);
  TALON_CHECK(n_heads % n_kv_heads == 0, "{}: num_attention_heads {} is not a multiple of num_key_value_heads {}",
              src, n_heads, n_kv_heads);
  TALON_CHECK(head_dim % 2 == 0, "{}: head_dim {} must be even for RoPE", src, head_dim);
  TALON_CHECK(rms_eps > 0, "{}: rms_norm_eps must be positive", src);
  TALON_CHECK(rope.theta > 0, "{}: rope theta must be positive", src);
  TALON_CHECK(rope.type == "default" || rope.type == "linear" || rope.type == "llama3",
              "{}: unsupported RoPE type '{}' (supported: default, linear, llama3)", src, rope.type);
  if (rope.type != "default") TALON_CHECK(rope.factor > 0, "{}: rope factor must be positive", src);
  if (rope.type == "llama3") {
    TALON_CHECK(rope.high_freq_factor > rope.low_freq_factor,
                "{}: llama3 rope: high_freq_factor {} must exceed low_freq_factor {}", src,
                rope.high_freq_factor, rope.low_freq_factor);
    TALON_CHECK(rope.original_max_position > 0, "{}: llama3 rope: original_max_position_embeddings must be positive", src);
  }
}

namespace {

int64_t req_int(const json& j, const char* key, const std::string& src) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) fail("{}: missing field '{}'", src, key);
  if (!it->is_number_integer()) fail("{}: field '{}' must be an integer, got {}", src, key, it->dump());
  return it->get<int64_t>();
}

int64_t opt_int(const json& j, const char* key, int64_t dflt, const std::string& src) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  if (!it->is_number_integer()) fail("{}: field '{}' must be an integer, got {}", src, key, it->dump());
  return it->get<int64_t>();
}

double opt_num(const json& j, const char* key, double dflt, const std::string& src) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  if (!it->is_number()) fail("{}: field '{}' must be a number, got {}", src, key, it->dump());
  return it->get<double>();
}

bool opt_bool(const json& j, const char* key, bool dflt, const std::string& src) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  if (!it->is_boolean()) fail("{}: field '{}' must be true or false, got {}", src, key, it->dump());
  return it->get<bool>();
}

// RoPE settings: transformers 5 writes `rope_parameters` (with rope_theta inside);
// 4.x writes top-level `rope_theta` and an optional `rope_scaling` (`rope_type` or the
// older `type`). Either may appear; rope_parameters wins where both do.
RopeConfig parse_rope(const json& j, const std::string& src) {
  RopeConfig r;
  r.theta = opt_num(j, "rope_theta", 10000.0, src);
  const json* s = nullptr;
  std::string which;
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    auto it = j.find(key);
    if (it != j.end() && !it->is_null()) {
      if (!it->is_object()) fail("{}: field '{}' must be an object, got {}", src, key, it->dump());
      s = &*it;
      which = key;
      break;
    }
  }
  if (!s) return r;
  const std::string ctx = src + ": " + which;
  r.theta = opt_num(*s, "rope_theta", r.theta, ctx);
  std::string type = "default";
  for (const char* key : {"rope_type", "type"}) {
    auto it = s->find(key);
    if (it != s->end() && !it->is_null()) {
      if (!it->is_string()) fail("{}: '{}' must be a string", ctx, key);
      type = it->get<std::string>();
      break;
    }
  }
  r.type = type;
  if (type == "default") return r;
  r.factor = opt_num(*s, "factor", 1.0, ctx);
  if (type == "llama3") {
    r.low_freq_factor = opt_num(*s, "low_freq_factor", 1.0, ctx);
    r.high_freq_factor = opt_num(*s, "high_freq_factor", 4.0, ctx);
    r.original_max_position = opt_int(*s, "original_max_position_embeddings", 8192, ctx);
  } else if (type != "linear") {
    fail("{}: unsupported rope_type '{}' (supported: default, linear, llama3)", ctx, type);
  }
  return r;
}

}  // namespace

ModelConfig parse_hf_config(const json& j, const std::string& src) {
  if (!j.is_object()) fail("{}: config must be a JSON object", src);
  ModelConfig c;
  std::string mt;
  if (auto it = j.find("model_type"); it != j.end() && it->is_string()) mt = it->get<std::string>();
  std::string archs;
  if (auto it = j.find("architectures"); it != j.end() && it->is_array() && !it->empty() && (*it)[0].is_string())
    archs = (*it)[0].get<std::string>();
  if (mt == "llama" || archs == "LlamaForCausalLM") c.arch = Arch::Llama;
  else if (mt == "mistral" || archs == "MistralForCausalLM") c.arch = Arch::Mistral;
  else if (mt == "qwen2" || archs == "Qwen2ForCausalLM") c.arch = Arch::Qwen2;
  else if (mt == "qwen3" || archs == "Qwen3ForCausalLM") c.arch = Arch::Qwen3;
  else
    fail("{}: unknown architecture (model_type '{}', architectures[0] '{}'); supported: llama, mistral, qwen2, qwen3",
         src, mt, archs);

  c.n_layers = req_int(j, "num_hidden_layers", src);
  c.hidden = req_int(j, "hidden_size", src);
  c.intermediate = req_int(j, "intermediate_size", src);
  c.n_heads = req_int(j, "num_attention_heads", src);
  c.n_kv_heads = opt_int(j, "num_key_value_heads", c.n_heads, src);
  TALON_CHECK(c.n_heads > 0, "{}: 'num_attention_heads' must be positive, got {}", src, c.n_heads);
  c.head_dim = opt_int(j, "head_dim", c.hidden / c.n_heads, src);
  c.vocab = req_int(j, "vocab_size", src);
  c.max_position = opt_int(j, "max_position_embeddings", 0, src);
  c.rms_eps = opt_num(j, "rms_norm_eps", 1e-6, src);
  c.rope = parse_rope(j, src);
  c.tied_embeddings = opt_bool(j, "tie_word_embeddings", false, src);
  c.qkv_bias = c.arch == Arch::Qwen2 || opt_bool(j, "attention_bias", false, src);
  c.qk_norm = c.arch == Arch::Qwen3;
  if (c.arch == Arch::Llama || c.arch == Arch::Mistral) {
    TALON_CHECK(!opt_bool(j, "mlp_bias", false, src), "{}: mlp_bias=true is not supported", src);
  }
  // Sliding-window attention: Mistral v0.1 uses it; Qwen2 only when use_sliding_window.
  bool sw = c.arch == Arch::Mistral || (c.arch == Arch::Qwen2 && opt_bool(j, "use_sliding_window", false, src));
  if (sw) c.sliding_window = opt_int(j, "sliding_window", 0, src);
  TALON_CHECK(c.sliding_window >= 0, "{}: sliding_window must be >= 0", src);
  c.validate(src);
  return c;
}

}  // namespace talon
