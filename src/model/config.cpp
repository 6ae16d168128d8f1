#include "model/config.h"

#include <cmath>

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
    case Arch::DeepseekV2: return "deepseek_v2";
    case Arch::DeepseekV3: return "deepseek_v3";
  }
  return "?";
}

json ModelConfig::to_json() const {
  json j = {{"arch", arch_name(arch)},
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
  if (is_deepseek(arch)) {
    j["rope"]["yarn"] = {{"beta_fast", rope.beta_fast}, {"beta_slow", rope.beta_slow}, {"mscale", rope.mscale},
                         {"mscale_all_dim", rope.mscale_all_dim}, {"attention_factor", rope.attention_factor}};
    j["deepseek"] = {{"q_lora_rank", ds.q_lora_rank},
                     {"kv_lora_rank", ds.kv_lora_rank},
                     {"qk_nope_head_dim", ds.qk_nope_head_dim},
                     {"qk_rope_head_dim", ds.qk_rope_head_dim},
                     {"v_head_dim", ds.v_head_dim},
                     {"rope_interleave", ds.rope_interleave},
                     {"n_routed_experts", ds.n_routed_experts},
                     {"n_shared_experts", ds.n_shared_experts},
                     {"num_experts_per_tok", ds.num_experts_per_tok},
                     {"moe_intermediate_size", ds.moe_intermediate_size},
                     {"first_k_dense_replace", ds.first_k_dense_replace},
                     {"moe_layer_freq", ds.moe_layer_freq},
                     {"routed_scaling_factor", ds.routed_scaling_factor},
                     {"scoring_func", moe_scoring_name(ds.scoring_func)},
                     {"topk_method", moe_topk_name(ds.topk_method)},
                     {"n_group", ds.n_group},
                     {"topk_group", ds.topk_group},
                     {"norm_topk_prob", ds.norm_topk_prob},
                     {"softmax_scale", ds.softmax_scale},
                     {"quant_method", ds.quant_method},
                     {"fp8_block", {ds.fp8_block_out, ds.fp8_block_in}},
                     {"int4_group", ds.int4_group}};
  }
  return j;
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
  TALON_CHECK(rope.type == "default" || rope.type == "linear" || rope.type == "llama3" || rope.type == "yarn",
              "{}: unsupported RoPE type '{}' (supported: default, linear, llama3, yarn)", src, rope.type);
  TALON_CHECK(rope.type != "yarn" || is_deepseek(arch),
              "{}: unsupported rope_type 'yarn' for {} (YaRN is supported for the DeepSeek family only)", src,
              arch_name(arch));
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

}  // namespace

double yarn_mscale(double scale, double mscale) { return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

namespace {

// RoPE settings: transformers 5 writes `rope_parameters` (with rope_theta inside);
// 4.x writes top-level `rope_theta` and an optional `rope_scaling` (`rope_type` or the
// older `type`). Either may appear; rope_parameters wins where both do.
RopeConfig parse_rope(const json& j, const std::string& src, bool allow_yarn) {
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
  if (type == "yarn") {
    if (!allow_yarn)
      fail("{}: unsupported rope_type 'yarn' (YaRN is supported for the DeepSeek family only)", ctx);
    // YaRN: `factor` may be absent (then max_position_embeddings / original, as transformers).
    r.original_max_position = opt_int(*s, "original_max_position_embeddings", 0, ctx);
    TALON_CHECK(r.original_max_position > 0, "{}: yarn needs a positive 'original_max_position_embeddings'", ctx);
    r.factor = opt_num(*s, "factor", 0.0, ctx);
    if (r.factor == 0.0) r.factor = double(opt_int(j, "max_position_embeddings", 0, src)) / double(r.original_max_position);
    r.beta_fast = opt_num(*s, "beta_fast", 32.0, ctx);
    r.beta_slow = opt_num(*s, "beta_slow", 1.0, ctx);
    if (r.beta_fast == 0) r.beta_fast = 32.0;  // transformers: `or 32` / `or 1`
    if (r.beta_slow == 0) r.beta_slow = 1.0;
    r.mscale = opt_num(*s, "mscale", 0.0, ctx);
    r.mscale_all_dim = opt_num(*s, "mscale_all_dim", 0.0, ctx);
    // cos/sin scale: an explicit attention_factor, else mscale(f, mscale) / mscale(f, mscale_all_dim)
    // when both are set (non-zero), else mscale(f, 1).
    double af = opt_num(*s, "attention_factor", 0.0, ctx);
    if (af == 0.0)
      af = (r.mscale != 0 && r.mscale_all_dim != 0) ? yarn_mscale(r.factor, r.mscale) / yarn_mscale(r.factor, r.mscale_all_dim)
                                                    : yarn_mscale(r.factor, 1.0);
    r.attention_factor = af;
    return r;
  }
  if (type == "llama3") {
    r.low_freq_factor = opt_num(*s, "low_freq_factor", 1.0, ctx);
    r.high_freq_factor = opt_num(*s, "high_freq_factor", 4.0, ctx);
    r.original_max_position = opt_int(*s, "original_max_position_embeddings", 8192, ctx);
  } else if (type != "linear") {
    fail("{}: unsupported rope_type '{}' (supported: default, linear, llama3, yarn)", ctx, type);
  }
  return r;
}

}  // namespace

namespace {

std::string opt_str(const json& j, const char* key, const std::string& dflt, const std::string& src) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  if (!it->is_string()) fail("{}: field '{}' must be a string, got {}", src, key, it->dump());
  return it->get<std::string>();
}

// quantization_config: DeepSeek-V3's block FP8 ({"quant_method": "fp8", "weight_block_size":
// [128, 128]}) or compressed-tensors int4 pack-quantized (Kimi-K2-Thinking: config_groups.*.
// weights {num_bits 4, type int, symmetric, strategy group, group_size 32}).
void parse_quant(const json& j, DeepseekConfig& d, const std::string& src) {
  auto it = j.find("quantization_config");
  if (it == j.end() || it->is_null()) return;
  const std::string ctx = src + ": quantization_config";
  if (!it->is_object()) fail("{} must be an object", ctx);
  const json& q = *it;
  d.quant_method = opt_str(q, "quant_method", "", ctx);
  if (d.quant_method == "fp8") {
    auto bs = q.find("weight_block_size");
    if (bs == q.end() || !bs->is_array() || bs->size() != 2 || !(*bs)[0].is_number_integer() ||
        !(*bs)[1].is_number_integer())
      fail("{}: 'weight_block_size' must be [rows, cols] (only block-wise FP8 is supported)", ctx);
    d.fp8_block_out = (*bs)[0].get<int64_t>();
    d.fp8_block_in = (*bs)[1].get<int64_t>();
    TALON_CHECK(d.fp8_block_out > 0 && d.fp8_block_in > 0, "{}: 'weight_block_size' must be positive", ctx);
    const std::string fmt = opt_str(q, "fmt", "e4m3", ctx);
    TALON_CHECK(fmt == "e4m3", "{}: fmt '{}' unsupported (supported: e4m3)", ctx, fmt);
  } else if (d.quant_method == "compressed-tensors") {
    const std::string format = opt_str(q, "format", "", ctx);
    TALON_CHECK(format == "pack-quantized", "{}: format '{}' unsupported (supported: pack-quantized)", ctx, format);
    auto groups = q.find("config_groups");
    if (groups == q.end() || !groups->is_object() || groups->empty())
      fail("{}: missing object 'config_groups'", ctx);
    for (auto g = groups->begin(); g != groups->end(); ++g) {
      const std::string gctx = ctx + ".config_groups." + g.key() + ".weights";
      auto w = g.value().find("weights");
      if (w == g.value().end() || !w->is_object()) fail("{}: missing object", gctx);
      const int64_t bits = opt_int(*w, "num_bits", 0, gctx);
      TALON_CHECK(bits == 4, "{}: num_bits {} unsupported (supported: 4)", gctx, bits);
      TALON_CHECK(opt_str(*w, "type", "int", gctx) == "int", "{}: 'type' must be 'int'", gctx);
      TALON_CHECK(opt_bool(*w, "symmetric", true, gctx), "{}: asymmetric (zero-point) int4 is unsupported", gctx);
      const std::string strategy = opt_str(*w, "strategy", "", gctx);
      TALON_CHECK(strategy == "group", "{}: strategy '{}' unsupported (supported: group)", gctx, strategy);
      const int64_t gs = opt_int(*w, "group_size", 0, gctx);
      TALON_CHECK(gs > 0, "{}: 'group_size' must be positive", gctx);
      TALON_CHECK(d.int4_group == 0 || d.int4_group == gs, "{}: group_size {} differs from another group's {}", gctx, gs,
                  d.int4_group);
      d.int4_group = gs;
    }
  } else {
    fail("{}: quant_method '{}' unsupported (supported: fp8, compressed-tensors)", ctx, d.quant_method);
  }
}

// The DeepSeek-V2/V3 (Kimi-K2) fields. `c` already holds the common ones.
void parse_deepseek(const json& j, ModelConfig& c, const std::string& src) {
  DeepseekConfig& d = c.ds;
  const bool v3 = c.arch == Arch::DeepseekV3;
  d.q_lora_rank = opt_int(j, "q_lora_rank", 0, src);
  d.kv_lora_rank = req_int(j, "kv_lora_rank", src);
  d.qk_nope_head_dim = req_int(j, "qk_nope_head_dim", src);
  d.qk_rope_head_dim = req_int(j, "qk_rope_head_dim", src);
  d.v_head_dim = req_int(j, "v_head_dim", src);
  // transformers' DeepseekV2 always rotates adjacent pairs (complex form); V3 has a flag.
  d.rope_interleave = v3 ? opt_bool(j, "rope_interleave", true, src) : true;
  d.n_routed_experts = req_int(j, "n_routed_experts", src);
  d.n_shared_experts = opt_int(j, "n_shared_experts", 0, src);
  d.num_experts_per_tok = req_int(j, "num_experts_per_tok", src);
  d.moe_intermediate_size = req_int(j, "moe_intermediate_size", src);
  d.first_k_dense_replace = opt_int(j, "first_k_dense_replace", 0, src);
  d.moe_layer_freq = opt_int(j, "moe_layer_freq", 1, src);
  d.routed_scaling_factor = opt_num(j, "routed_scaling_factor", 1.0, src);
  // Defaults follow transformers' configs: V2 softmax + greedy, V3 sigmoid + noaux_tc.
  const std::string scoring = opt_str(j, "scoring_func", v3 ? "sigmoid" : "softmax", src);
  const std::string topk = opt_str(j, "topk_method", v3 ? "noaux_tc" : "greedy", src);
  TALON_CHECK(scoring == "softmax" || scoring == "sigmoid",
              "{}: 'scoring_func' '{}' unsupported (supported: softmax, sigmoid)", src, scoring);
  TALON_CHECK(topk == "greedy" || topk == "group_limited_greedy" || topk == "noaux_tc",
              "{}: 'topk_method' '{}' unsupported (supported: greedy, group_limited_greedy, noaux_tc)", src, topk);
  d.scoring_func = scoring == "sigmoid" ? MoeScoring::Sigmoid : MoeScoring::Softmax;
  d.topk_method = topk == "noaux_tc"               ? MoeTopk::NoauxTc
                  : topk == "group_limited_greedy" ? MoeTopk::GroupLimitedGreedy
                                                   : MoeTopk::Greedy;
  d.n_group = opt_int(j, "n_group", 1, src);
  d.topk_group = opt_int(j, "topk_group", 1, src);
  d.norm_topk_prob = opt_bool(j, "norm_topk_prob", v3, src);
  parse_quant(j, d, src);

  // MLA: every head has its own k and v after the kv_b expansion; RoPE covers the rope part.
  c.n_kv_heads = c.n_heads;
  c.head_dim = d.qk_rope_head_dim;
  const double base = 1.0 / std::sqrt(double(d.qk_head_dim()));
  d.softmax_scale = base;
  if (c.rope.type == "yarn" && c.rope.mscale_all_dim != 0) {
    const double m = yarn_mscale(c.rope.factor, c.rope.mscale_all_dim);
    d.softmax_scale = base * m * m;
  }

  auto pos = [&](const char* f, int64_t v) { TALON_CHECK(v > 0, "{}: '{}' must be positive, got {}", src, f, v); };
  pos("kv_lora_rank", d.kv_lora_rank);
  pos("qk_nope_head_dim", d.qk_nope_head_dim);
  pos("qk_rope_head_dim", d.qk_rope_head_dim);
  pos("v_head_dim", d.v_head_dim);
  pos("n_routed_experts", d.n_routed_experts);
  pos("num_experts_per_tok", d.num_experts_per_tok);
  pos("moe_intermediate_size", d.moe_intermediate_size);
  pos("n_group", d.n_group);
  pos("topk_group", d.topk_group);
  TALON_CHECK(d.q_lora_rank >= 0, "{}: 'q_lora_rank' must be positive or null, got {}", src, d.q_lora_rank);
  TALON_CHECK(d.n_shared_experts >= 0, "{}: 'n_shared_experts' must be >= 0, got {}", src, d.n_shared_experts);
  TALON_CHECK(d.first_k_dense_replace >= 0 && d.first_k_dense_replace <= c.n_layers,
              "{}: 'first_k_dense_replace' {} must be in [0, num_hidden_layers {}]", src, d.first_k_dense_replace,
              c.n_layers);
  TALON_CHECK(d.moe_layer_freq == 1, "{}: 'moe_layer_freq' {} unsupported (only 1: every layer from "
              "first_k_dense_replace on is MoE)", src, d.moe_layer_freq);
  TALON_CHECK(d.num_experts_per_tok <= d.n_routed_experts, "{}: 'num_experts_per_tok' {} exceeds 'n_routed_experts' {}",
              src, d.num_experts_per_tok, d.n_routed_experts);
  TALON_CHECK(d.n_routed_experts % d.n_group == 0, "{}: 'n_routed_experts' {} is not a multiple of 'n_group' {}", src,
              d.n_routed_experts, d.n_group);
  TALON_CHECK(d.topk_group <= d.n_group, "{}: 'topk_group' {} exceeds 'n_group' {}", src, d.topk_group, d.n_group);
  if (d.topk_method == MoeTopk::NoauxTc)  // a group's score is the sum of its top-2 experts
    TALON_CHECK(d.n_routed_experts / d.n_group >= 2, "{}: noaux_tc needs >= 2 experts per group ('n_routed_experts' "
                "{} / 'n_group' {})", src, d.n_routed_experts, d.n_group);
  if (d.topk_method != MoeTopk::Greedy)
    TALON_CHECK(d.num_experts_per_tok <= d.topk_group * (d.n_routed_experts / d.n_group),
                "{}: 'num_experts_per_tok' {} exceeds the experts of 'topk_group' {} groups", src,
                d.num_experts_per_tok, d.topk_group);
  TALON_CHECK(!opt_bool(j, "attention_bias", false, src), "{}: 'attention_bias' true is unsupported for {}", src,
              arch_name(c.arch));
  const std::string act = opt_str(j, "hidden_act", "silu", src);
  TALON_CHECK(act == "silu", "{}: 'hidden_act' '{}' unsupported (supported: silu)", src, act);
}

}  // namespace

ModelConfig parse_hf_config(const json& j_in, const std::string& src) {
  if (!j_in.is_object()) fail("{}: config must be a JSON object", src);
  // Multimodal wrappers (Kimi-K2.5 style) nest the language model's config under
  // "text_config"; the quantization_config may stay at the top level.
  const json* jp = &j_in;
  json merged;
  if (auto tc = j_in.find("text_config"); tc != j_in.end() && tc->is_object() && !j_in.contains("num_hidden_layers")) {
    merged = *tc;
    if (!merged.contains("quantization_config") && j_in.contains("quantization_config"))
      merged["quantization_config"] = j_in["quantization_config"];
    jp = &merged;
  }
  const json& j = *jp;
  const std::string src_text = jp == &j_in ? src : src + " (text_config)";
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
  else if (mt == "deepseek_v2" || archs == "DeepseekV2ForCausalLM") c.arch = Arch::DeepseekV2;
  else if (mt == "deepseek_v3" || mt == "kimi_k2" || archs == "DeepseekV3ForCausalLM") c.arch = Arch::DeepseekV3;
  else
    fail("{}: unknown architecture (model_type '{}', architectures[0] '{}'); supported: llama, mistral, qwen2, qwen3, "
         "deepseek_v2, deepseek_v3, kimi_k2",
         src_text, mt, archs);
  const std::string& srcx = src_text;

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
  c.rope = parse_rope(j, src, is_deepseek(c.arch));
  c.tied_embeddings = opt_bool(j, "tie_word_embeddings", false, src);
  c.qkv_bias = c.arch == Arch::Qwen2 || (!is_deepseek(c.arch) && opt_bool(j, "attention_bias", false, src));
  c.qk_norm = c.arch == Arch::Qwen3;
  if (c.arch == Arch::Llama || c.arch == Arch::Mistral) {
    TALON_CHECK(!opt_bool(j, "mlp_bias", false, src), "{}: mlp_bias=true is not supported", src);
  }
  // Sliding-window attention: Mistral v0.1 uses it; Qwen2 only when use_sliding_window.
  bool sw = c.arch == Arch::Mistral || (c.arch == Arch::Qwen2 && opt_bool(j, "use_sliding_window", false, src));
  if (sw) c.sliding_window = opt_int(j, "sliding_window", 0, src);
  TALON_CHECK(c.sliding_window >= 0, "{}: sliding_window must be >= 0", src);
  if (is_deepseek(c.arch)) {
    c.qkv_bias = false;
    parse_deepseek(j, c, srcx);
  }
  c.validate(srcx);
  return c;
}

}  // namespace talon
