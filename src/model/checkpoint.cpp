#include "model/checkpoint.h"

#include <cstring>
#include <map>
#include <mutex>
#include <set>

#include "io/gguf.h"
#include "io/safetensors.h"
#include "model/random_checkpoint.h"
#include "util/error.h"

namespace talon {

std::vector<float> weight_to_f32(const WeightRef& w) {
  if (!w.data) return {};
  int64_t n = 1;
  for (auto d : w.shape) n *= d;
  std::vector<float> out(static_cast<size_t>(n));
  convert_to_f32(w.dtype, w.data, out.data(), out.size());
  return out;
}

using json = nlohmann::json;

int64_t CkptTensor::numel() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

const CkptTensor* Checkpoint::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

void Checkpoint::index() {
  index_.clear();
  for (size_t i = 0; i < tensors_.size(); ++i) {
    auto [it, fresh] = index_.emplace(tensors_[i].name, i);
    if (!fresh) fail("{}: tensor '{}' appears twice ({} and {})", source_, tensors_[i].name,
                     tensors_[it->second].file, tensors_[i].file);
  }
}

namespace {

// ---------------------------------------------------------------- HF directory
class HfCheckpoint : public Checkpoint {
 public:
  explicit HfCheckpoint(const fs::path& dir) {
    source_ = dir.string();
    const fs::path cfg_path = dir / "config.json";
    if (!fs::exists(cfg_path)) fail("{}: no config.json in the model directory", source_);
    const std::string text = read_text_file(cfg_path);
    json cfg = json::parse(text, nullptr, false);
    if (cfg.is_discarded()) fail("{}: not valid JSON", cfg_path.string());
    config_ = parse_hf_config(cfg, cfg_path.string());

    std::vector<fs::path> shards;
    const fs::path idx_path = dir / "model.safetensors.index.json";
    std::map<std::string, std::string> weight_map;
    if (fs::exists(idx_path)) {
      json idx = json::parse(read_text_file(idx_path), nullptr, false);
      if (idx.is_discarded()) fail("{}: not valid JSON", idx_path.string());
      auto wm = idx.find("weight_map");
      if (!idx.is_object() || wm == idx.end() || !wm->is_object())
        fail("{}: missing object field 'weight_map'", idx_path.string());
      std::set<std::string> files;
      for (auto it = wm->begin(); it != wm->end(); ++it) {
        if (!it.value().is_string()) fail("{}: weight_map['{}'] must be a file name", idx_path.string(), it.key());
        std::string f = it.value().get<std::string>();
        if (f.find('/') != std::string::npos || f == ".." || f.empty())
          fail("{}: weight_map['{}'] = '{}' is not a plain file name", idx_path.string(), it.key(), f);
        weight_map[it.key()] = f;
        files.insert(f);
      }
      for (auto& f : files) shards.push_back(dir / f);
      info_["index"] = idx_path.filename().string();
    } else if (fs::exists(dir / "model.safetensors")) {
      shards.push_back(dir / "model.safetensors");
    } else {
      fail("{}: neither model.safetensors nor model.safetensors.index.json found", source_);
    }
    for (auto& p : shards) {
      if (!fs::exists(p)) fail("{}: shard listed in the index does not exist", p.string());
      files_.push_back(std::make_unique<st::File>(p));
    }
    for (auto& f : files_) {
      const std::string fname = f->path().filename().string();
      for (auto& t : f->tensors()) {
        if (!weight_map.empty()) {
          auto it = weight_map.find(t.name);
          if (it == weight_map.end())
            fail("{}: tensor '{}' is not listed in model.safetensors.index.json", f->path().string(), t.name);
          if (it->second != fname)
            fail("{}: tensor '{}' found here but the index places it in '{}'", f->path().string(), t.name, it->second);
        }
        // DeepSeek-family checkpoints may hold quantized weights: F8_E4M3 (block FP8) and the
        // I32 / I64 tensors of compressed-tensors int4 packing (model/quant.h).
        const bool quant_ok = is_deepseek(config_.arch) &&
                              (t.dtype == DType::F8_E4M3 || t.dtype == DType::I32 || t.dtype == DType::I64);
        if (t.dtype != DType::F32 && t.dtype != DType::BF16 && t.dtype != DType::F16 && !quant_ok)
          fail("{}: tensor '{}': dtype {} unsupported (expected F32, BF16 or F16{})", f->path().string(), t.name,
               dtype_name(t.dtype), is_deepseek(config_.arch) ? ", or F8_E4M3 / I32 / I64 quantized weights" : "");
        tensors_.push_back({t.name, std::string(dtype_name(t.dtype)), t.shape, f->path().string()});
        views_.push_back(&t);
      }
    }
    for (auto& [name, file] : weight_map) {
      bool found = false;
      for (auto& t : tensors_) found = found || t.name == name;
      if (!found) fail("{}: index lists tensor '{}' in '{}' but that file lacks it", idx_path.string(), name, file);
    }
    index();
    info_["format"] = "hf-safetensors";
    info_["shards"] = shards.size();
  }

  WeightRef weight(const CkptTensor& t) const override {
    const st::TensorView* v = views_[size_t(&t - tensors_.data())];
    return {v->dtype, v->data, v->shape};
  }

 private:
  std::vector<std::unique_ptr<st::File>> files_;
  std::vector<const st::TensorView*> views_;  // parallel to tensors_
};

// ---------------------------------------------------------------- GGUF
// GGUF names -> HF names for the llama-family layouts.
std::string gguf_to_hf_name(const std::string& g) {
  static const std::map<std::string, std::string> top = {
      {"token_embd.weight", "model.embed_tokens.weight"},
      {"output_norm.weight", "model.norm.weight"},
      {"output.weight", "lm_head.weight"},
      {"rope_freqs.weight", "rope_freqs.weight"}};
  if (auto it = top.find(g); it != top.end()) return it->second;
  static const std::map<std::string, std::string> blk = {
      {"attn_norm.weight", "input_layernorm.weight"},
      {"attn_q.weight", "self_attn.q_proj.weight"},
      {"attn_k.weight", "self_attn.k_proj.weight"},
      {"attn_v.weight", "self_attn.v_proj.weight"},
      {"attn_q.bias", "self_attn.q_proj.bias"},
      {"attn_k.bias", "self_attn.k_proj.bias"},
      {"attn_v.bias", "self_attn.v_proj.bias"},
      {"attn_output.weight", "self_attn.o_proj.weight"},
      {"attn_q_norm.weight", "self_attn.q_norm.weight"},
      {"attn_k_norm.weight", "self_attn.k_norm.weight"},
      {"ffn_norm.weight", "post_attention_layernorm.weight"},
      {"ffn_gate.weight", "mlp.gate_proj.weight"},
      {"ffn_up.weight", "mlp.up_proj.weight"},
      {"ffn_down.weight", "mlp.down_proj.weight"}};
  if (g.rfind("blk.", 0) == 0) {
    size_t dot = g.find('.', 4);
    if (dot != std::string::npos) {
      std::string layer = g.substr(4, dot - 4);
      if (auto it = blk.find(g.substr(dot + 1)); it != blk.end())
        return "model.layers." + layer + "." + it->second;
    }
  }
  return "gguf:" + g;  // unknown: kept visible so the unused-tensor check names it
}

class GgufCheckpoint : public Checkpoint {
 public:
  explicit GgufCheckpoint(const fs::path& path) : file_(path) {
    source_ = path.string();
    const std::string arch = file_.get_string("general.architecture");
    auto key = [&](const char* k) { return arch + "." + k; };
    ModelConfig& c = config_;
    if (arch == "llama") c.arch = Arch::Llama;
    else if (arch == "qwen2") c.arch = Arch::Qwen2;
    else if (arch == "qwen3") c.arch = Arch::Qwen3;
    else fail("{}: unknown general.architecture '{}' (supported: llama, qwen2, qwen3)", source_, arch);
    c.n_layers = file_.get_int(key("block_count"));
    c.hidden = file_.get_int(key("embedding_length"));
    c.intermediate = file_.get_int(key("feed_forward_length"));
    c.n_heads = file_.get_int(key("attention.head_count"));
    c.n_kv_heads = file_.get_int_opt(key("attention.head_count_kv")).value_or(c.n_heads);
    TALON_CHECK(c.n_heads > 0, "{}: {} must be positive", source_, key("attention.head_count"));
    c.head_dim = file_.get_int_opt(key("attention.key_length")).value_or(c.hidden / c.n_heads);
    c.max_position = file_.get_int_opt(key("context_length")).value_or(0);
    c.rms_eps = file_.get_float_opt(key("attention.layer_norm_rms_epsilon")).value_or(1e-5);
    c.rope.theta = file_.get_float_opt(key("rope.freq_base")).value_or(10000.0);
    if (auto st = file_.get_string_opt(key("rope.scaling.type")); st && *st != "none") {
      TALON_CHECK(*st == "linear", "{}: unsupported {} '{}'", source_, key("rope.scaling.type"), *st);
      c.rope.type = "linear";
      c.rope.factor = file_.get_float(key("rope.scaling.factor"));
    }
    c.qkv_bias = c.arch == Arch::Qwen2;
    c.qk_norm = c.arch == Arch::Qwen3;
    if (auto v = file_.get_int_opt(key("vocab_size"))) {
      c.vocab = *v;
    } else {
      const gguf::TensorInfo* emb = file_.find_tensor("token_embd.weight");
      TALON_CHECK(emb && emb->ne.size() == 2, "{}: tensor 'token_embd.weight' missing or not 2-D", source_);
      c.vocab = emb->ne[1];
    }
    c.tied_embeddings = file_.find_tensor("output.weight") == nullptr;

    for (auto& t : file_.tensors()) {
      TALON_CHECK(gguf::type_supported(t.type), "{}: tensor '{}': type {} cannot be dequantised", source_, t.name,
                  gguf::type_name(t.type));
      CkptTensor ct;
      ct.name = gguf_to_hf_name(t.name);
      ct.stored_type = gguf::type_name(t.type);
      ct.shape.assign(t.ne.rbegin(), t.ne.rend());
      ct.file = source_;
      tensors_.push_back(std::move(ct));
    }
    index();
    // llama.cpp stores llama3-style RoPE scaling as per-frequency divisors.
    if (const CkptTensor* rf = find("rope_freqs.weight")) {
      TALON_CHECK(rf->numel() == c.head_dim / 2, "{}: tensor 'rope_freqs.weight': expected {} values, got {}", source_,
                  c.head_dim / 2, rf->numel());
      c.rope.freq_factors.resize(size_t(rf->numel()));
      file_.dequantize(file_.tensors()[size_t(rf - tensors_.data())], c.rope.freq_factors.data());
    }
    c.validate(source_);
    info_["format"] = "gguf";
    info_["gguf_version"] = file_.version();
    info_["general.name"] = file_.get_string_opt("general.name").value_or("");
    info_["tokenizer.ggml.model"] = file_.get_string_opt("tokenizer.ggml.model").value_or("");
    if (auto* v = file_.find("tokenizer.ggml.tokens"); v && v->kind == gguf::Value::Kind::ARRAY)
      info_["tokenizer.tokens"] = v->as_array().size();
    if (auto* v = file_.find("tokenizer.ggml.merges"); v && v->kind == gguf::Value::Kind::ARRAY)
      info_["tokenizer.merges"] = v->as_array().size();
    if (auto t = file_.get_string_opt("tokenizer.chat_template")) info_["chat_template_chars"] = t->size();
    std::map<std::string, int> types;
    for (auto& t : file_.tensors()) types[gguf::type_name(t.type)]++;
    info_["tensor_types"] = types;
    owned_.resize(tensors_.size());
  }

  WeightRef weight(const CkptTensor& t) const override {
    const size_t i = size_t(&t - tensors_.data());
    const gguf::TensorInfo& gt = file_.tensors()[i];
    if (gt.type == gguf::GgmlType::F32 || gt.type == gguf::GgmlType::F16 || gt.type == gguf::GgmlType::BF16) {
      if (!needs_unpermute(t.name)) {
        DType d = gt.type == gguf::GgmlType::F32 ? DType::F32 : gt.type == gguf::GgmlType::F16 ? DType::F16 : DType::BF16;
        // GGUF data is aligned to general.alignment; F32 needs 4-byte alignment for direct use.
        return {d, file_.tensor_data(gt), t.shape};
      }
    }
    std::lock_guard lk(mu_);
    if (owned_[i].empty()) {
      std::vector<float> buf(size_t(t.numel()));
      file_.dequantize(gt, buf.data());
      if (needs_unpermute(t.name)) buf = unpermute(buf, t);
      owned_[i] = std::move(buf);
    }
    return {DType::F32, owned_[i].data(), t.shape};
  }

 private:
  // llama.cpp's converter reorders the rows of q_proj/k_proj of llama models so that
  // its RoPE can rotate adjacent pairs; HF rotates halves. Undo it.
  bool needs_unpermute(const std::string& name) const {
    return config_.arch == Arch::Llama &&
           (name.ends_with("self_attn.q_proj.weight") || name.ends_with("self_attn.k_proj.weight"));
  }
  std::vector<float> unpermute(const std::vector<float>& w, const CkptTensor& t) const {
    const int64_t rows = t.shape[0], cols = t.shape.size() > 1 ? t.shape[1] : 1;
    const int64_t hd = config_.head_dim, half = hd / 2;
    TALON_CHECK(rows % hd == 0, "{}: tensor '{}': {} rows is not a multiple of head_dim {}", source_, t.name, rows, hd);
    std::vector<float> out(w.size());
    for (int64_t h = 0; h < rows / hd; ++h)
      for (int64_t j = 0; j < half; ++j)
        for (int64_t s = 0; s < 2; ++s) {
          const float* src = &w[size_t((h * hd + 2 * j + s) * cols)];
          std::copy(src, src + cols, &out[size_t((h * hd + s * half + j) * cols)]);
        }
    return out;
  }

  gguf::File file_;
  mutable std::mutex mu_;
  mutable std::vector<std::vector<float>> owned_;
};

}  // namespace

std::unique_ptr<Checkpoint> open_checkpoint(const fs::path& path) {
  if (is_random_model_spec(path.string())) return open_random_model_spec(path.string());
  if (!fs::exists(path)) fail("{}: no such file or directory{}", path.string(), hub_id_hint(path));
  if (fs::is_directory(path)) return std::make_unique<HfCheckpoint>(path);
  if (path.extension() == ".gguf") return std::make_unique<GgufCheckpoint>(path);
  // Sniff the magic so a renamed GGUF still loads.
  MappedFile m(path);
  if (m.size() >= 4 && std::memcmp(m.data(), "GGUF", 4) == 0) return std::make_unique<GgufCheckpoint>(path);
  fail("{}: not a model directory (config.json + safetensors) or a GGUF file", path.string());
}

}  // namespace talon
