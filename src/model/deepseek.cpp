#include "model/deepseek.h"

#include <cstring>
#include <set>

#include "io/safetensors.h"
#include "util/error.h"

namespace talon {

namespace {

bool is_float(DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F16; }

// Collects problems while binding; throws them all at the end.
class Binder {
 public:
  explicit Binder(const Checkpoint& ck) : ck_(ck), c_(ck.config()) {}

  // A float tensor (norm, router, bias) of exactly this shape.
  void tensor(const std::string& name, const std::vector<int64_t>& shape, WeightRef* slot) {
    const CkptTensor* t = get(name, shape);
    if (!t) return;
    if (!is_float(ck_.weight(*t).dtype)) {
      problem("tensor '{}' in {}: dtype {} unsupported here (expected F32, BF16 or F16)", name, t->file, t->stored_type);
      return;
    }
    *slot = ck_.weight(*t);
  }

  // A linear layer `<p>.weight` [O, I]: plain, FP8 block or int4 pack-quantized.
  void linear(const std::string& p, int64_t O, int64_t I, QuantWeight* q) {
    q->rows = O;
    q->cols = I;
    const CkptTensor* w = ck_.find(p + ".weight");
    if (!w && ck_.find(p + ".weight_packed")) return int4(p, O, I, q);
    if (!w) {
      problem("missing tensor '{}.weight' (expected shape {})", p, st::shape_str({O, I}));
      return;
    }
    used_.insert(w->name);
    if (w->shape != std::vector<int64_t>{O, I}) {
      problem("tensor '{}' in {}: expected shape {}, got {}", w->name, w->file, st::shape_str({O, I}),
              st::shape_str(w->shape));
      return;
    }
    WeightRef ref = ck_.weight(*w);
    if (is_float(ref.dtype)) {
      q->kind = QuantWeight::Kind::Plain;
      q->w = ref;
      return;
    }
    if (ref.dtype != DType::F8_E4M3) {
      problem("tensor '{}' in {}: dtype {} unsupported (expected F32, BF16, F16 or F8_E4M3)", w->name, w->file,
              w->stored_type);
      return;
    }
    // FP8 block: the block comes from quantization_config.weight_block_size.
    const auto& d = c_.ds;
    if (d.quant_method != "fp8") {
      problem("tensor '{}' in {} is F8_E4M3 but config.json has no quantization_config with quant_method 'fp8' "
              "and weight_block_size", w->name, w->file);
      return;
    }
    const std::vector<int64_t> sshape{(O + d.fp8_block_out - 1) / d.fp8_block_out,
                                      (I + d.fp8_block_in - 1) / d.fp8_block_in};
    const CkptTensor* s = get(p + ".weight_scale_inv", sshape);
    if (!s) return;
    WeightRef sref = ck_.weight(*s);
    if (!is_float(sref.dtype)) {
      problem("tensor '{}' in {}: dtype {} unsupported (expected F32, BF16 or F16)", s->name, s->file, s->stored_type);
      return;
    }
    q->kind = QuantWeight::Kind::Fp8Block;
    q->w = ref;
    q->scale = sref;
    q->block_rows = d.fp8_block_out;
    q->block_cols = d.fp8_block_in;
  }

  void finish(const char* what) {
    // DeepSeek-V3 checkpoints carry their multi-token-prediction module as extra layers
    // model.layers.L.* (num_nextn_predict_layers); the forward does not use them.
    auto mtp_layer = [&](const std::string& n) {
      if (!n.starts_with("model.layers.")) return false;
      const size_t a = 13, e = n.find('.', a);
      if (e == std::string::npos || e == a) return false;
      for (size_t i = a; i < e; ++i)
        if (n[i] < '0' || n[i] > '9') return false;
      if (e - a > 9) return true;  // past any layer count (and past what stoll takes)
      return std::stoll(n.substr(a, e - a)) >= c_.n_layers;
    };
    auto ignorable = [&](const std::string& n) {
      return n.ends_with("rotary_emb.inv_freq") || (c_.tied_embeddings && n == "lm_head.weight") || mtp_layer(n);
    };
    for (auto& t : ck_.tensors())
      if (!used_.count(t.name) && !ignorable(t.name))
        problem("unused tensor '{}' {} in {} (not part of the {} layout)", t.name, st::shape_str(t.shape), t.file, what);
    if (problems_.empty()) return;
    std::string msg = fmt::format("{}: {} problem(s) binding {} weights:", ck_.source(), problems_.size(), what);
    const size_t shown = std::min<size_t>(problems_.size(), 10);
    for (size_t i = 0; i < shown; ++i) msg += (i ? "; " : " ") + problems_[i];
    if (shown < problems_.size()) msg += fmt::format("; ... and {} more", problems_.size() - shown);
    throw Error(msg);
  }

 private:
  template <typename... Args>
  void problem(fmt::format_string<Args...> f, Args&&... args) {
    problems_.push_back(fmt::format(f, std::forward<Args>(args)...));
  }

  const CkptTensor* get(const std::string& name, const std::vector<int64_t>& shape) {
    const CkptTensor* t = ck_.find(name);
    if (!t) {
      problem("missing tensor '{}' (expected shape {})", name, st::shape_str(shape));
      return nullptr;
    }
    used_.insert(name);
    if (t->shape != shape) {
      problem("tensor '{}' in {}: expected shape {}, got {}", name, t->file, st::shape_str(shape), st::shape_str(t->shape));
      return nullptr;
    }
    return t;
  }

  void int4(const std::string& p, int64_t O, int64_t I, QuantWeight* q) {
    const int64_t g = c_.ds.int4_group;
    if (c_.ds.quant_method != "compressed-tensors" || g <= 0) {
      used_.insert(p + ".weight_packed");
      problem("tensor '{}.weight_packed' is int4 pack-quantized but config.json has no compressed-tensors "
              "quantization_config with a group_size", p);
      return;
    }
    const CkptTensor* pk = get(p + ".weight_packed", {O, (I + 7) / 8});
    const CkptTensor* sc = get(p + ".weight_scale", {O, (I + g - 1) / g});
    const CkptTensor* sh = get(p + ".weight_shape", {2});
    if (!pk || !sc || !sh) return;
    WeightRef pr = ck_.weight(*pk), sr = ck_.weight(*sc), hr = ck_.weight(*sh);
    if (pr.dtype != DType::I32) return problem("tensor '{}' in {}: dtype {}, expected I32", pk->name, pk->file, pk->stored_type);
    if (!is_float(sr.dtype))
      return problem("tensor '{}' in {}: dtype {}, expected BF16, F16 or F32", sc->name, sc->file, sc->stored_type);
    if (hr.dtype != DType::I64 && hr.dtype != DType::I32)
      return problem("tensor '{}' in {}: dtype {}, expected I64 or I32", sh->name, sh->file, sh->stored_type);
    int64_t dims[2];
    for (int k = 0; k < 2; ++k) {
      if (hr.dtype == DType::I64) {
        std::memcpy(&dims[k], static_cast<const char*>(hr.data) + 8 * k, 8);
      } else {
        int32_t v;
        std::memcpy(&v, static_cast<const char*>(hr.data) + 4 * k, 4);
        dims[k] = v;
      }
    }
    if (dims[0] != O || dims[1] != I)
      return problem("tensor '{}' in {}: holds [{}, {}], expected [{}, {}]", sh->name, sh->file, dims[0], dims[1], O, I);
    q->kind = QuantWeight::Kind::Int4Group;
    q->w = pr;
    q->scale = sr;
    q->group = g;
  }

  const Checkpoint& ck_;
  const ModelConfig& c_;
  std::set<std::string> used_;
  std::vector<std::string> problems_;
};

}  // namespace

std::vector<DeepseekTensorSpec> deepseek_weight_table(const ModelConfig& c, DeepseekWeights& w) {
  const DeepseekConfig& d = c.ds;
  const int64_t H = c.hidden, V = c.vocab, nh = c.n_heads, qk = d.qk_head_dim();
  const int64_t E = d.n_routed_experts, Im = d.moe_intermediate_size;
  std::vector<DeepseekTensorSpec> t;
  auto tensor = [&](std::string name, std::vector<int64_t> shape, WeightRef* slot) {
    t.push_back({std::move(name), std::move(shape), slot, nullptr, false});
  };
  auto linear = [&](std::string name, int64_t O, int64_t I, QuantWeight* slot, bool expert = false) {
    t.push_back({std::move(name), {O, I}, nullptr, slot, expert});
  };
  tensor("model.embed_tokens.weight", {V, H}, &w.embed);
  w.layers.assign(size_t(c.n_layers), DeepseekLayer{});
  for (int64_t l = 0; l < c.n_layers; ++l) {
    DeepseekLayer& L = w.layers[size_t(l)];
    const std::string p = "model.layers." + std::to_string(l) + ".";
    tensor(p + "input_layernorm.weight", {H}, &L.attn_norm);
    tensor(p + "post_attention_layernorm.weight", {H}, &L.mlp_norm);
    if (d.q_lora_rank > 0) {
      linear(p + "self_attn.q_a_proj", d.q_lora_rank, H, &L.q_a);
      tensor(p + "self_attn.q_a_layernorm.weight", {d.q_lora_rank}, &L.q_a_norm);
      linear(p + "self_attn.q_b_proj", nh * qk, d.q_lora_rank, &L.q_b);
    } else {
      linear(p + "self_attn.q_proj", nh * qk, H, &L.q_proj);
    }
    linear(p + "self_attn.kv_a_proj_with_mqa", d.kv_lora_rank + d.qk_rope_head_dim, H, &L.kv_a);
    tensor(p + "self_attn.kv_a_layernorm.weight", {d.kv_lora_rank}, &L.kv_a_norm);
    linear(p + "self_attn.kv_b_proj", nh * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank, &L.kv_b);
    linear(p + "self_attn.o_proj", H, nh * d.v_head_dim, &L.o_proj);
    auto mlp = [&](const std::string& m, int64_t I, DeepseekMlp* out, bool expert) {
      linear(m + "gate_proj", I, H, &out->gate, expert);
      linear(m + "up_proj", I, H, &out->up, expert);
      linear(m + "down_proj", H, I, &out->down, expert);
    };
    L.moe = l >= d.first_k_dense_replace;
    if (!L.moe) {
      mlp(p + "mlp.", c.intermediate, &L.dense, false);
      continue;
    }
    tensor(p + "mlp.gate.weight", {E, H}, &L.router);
    if (d.topk_method == MoeTopk::NoauxTc) tensor(p + "mlp.gate.e_score_correction_bias", {E}, &L.router_bias);
    L.experts.resize(size_t(E));
    for (int64_t e = 0; e < E; ++e) mlp(p + "mlp.experts." + std::to_string(e) + ".", Im, &L.experts[size_t(e)], true);
    if (d.n_shared_experts > 0) mlp(p + "mlp.shared_experts.", Im * d.n_shared_experts, &L.shared, false);
  }
  tensor("model.norm.weight", {H}, &w.final_norm);
  if (!c.tied_embeddings) tensor("lm_head.weight", {V, H}, &w.lm_head);
  return t;
}

DeepseekWeights bind_deepseek_weights(const Checkpoint& ckpt) {
  const ModelConfig& c = ckpt.config();
  TALON_CHECK(is_deepseek(c.arch), "{}: bind_deepseek_weights on a {} model", ckpt.source(), arch_name(c.arch));
  DeepseekWeights w;
  Binder b(ckpt);
  for (const DeepseekTensorSpec& s : deepseek_weight_table(c, w)) {
    if (s.linear)
      b.linear(s.name, s.shape[0], s.shape[1], s.linear);
    else
      b.tensor(s.name, s.shape, s.tensor);
  }
  b.finish(arch_name(c.arch));
  if (c.tied_embeddings) w.lm_head = w.embed;
  return w;
}

}  // namespace talon
