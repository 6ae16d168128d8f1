#include "model/dense.h"

#include <set>

#include "io/safetensors.h"
#include "util/error.h"

namespace talon {

std::vector<WeightSpec> dense_weight_table(const ModelConfig& c, DenseWeights& w) {
  const int64_t H = c.hidden, I = c.intermediate, V = c.vocab, hd = c.head_dim;
  const int64_t qd = c.n_heads * hd, kvd = c.n_kv_heads * hd;
  std::vector<WeightSpec> t;
  w.layers.resize(size_t(c.n_layers));
  t.push_back({"model.embed_tokens.weight", {V, H}, &w.embed});
  for (int64_t l = 0; l < c.n_layers; ++l) {
    DenseLayer& L = w.layers[size_t(l)];
    const std::string p = "model.layers." + std::to_string(l) + ".";
    t.push_back({p + "input_layernorm.weight", {H}, &L.attn_norm});
    t.push_back({p + "self_attn.q_proj.weight", {qd, H}, &L.wq});
    t.push_back({p + "self_attn.k_proj.weight", {kvd, H}, &L.wk});
    t.push_back({p + "self_attn.v_proj.weight", {kvd, H}, &L.wv});
    if (c.qkv_bias) {
      t.push_back({p + "self_attn.q_proj.bias", {qd}, &L.bq});
      t.push_back({p + "self_attn.k_proj.bias", {kvd}, &L.bk});
      t.push_back({p + "self_attn.v_proj.bias", {kvd}, &L.bv});
    }
    if (c.qk_norm) {
      t.push_back({p + "self_attn.q_norm.weight", {hd}, &L.q_norm});
      t.push_back({p + "self_attn.k_norm.weight", {hd}, &L.k_norm});
    }
    t.push_back({p + "self_attn.o_proj.weight", {H, qd}, &L.wo});
    t.push_back({p + "post_attention_layernorm.weight", {H}, &L.mlp_norm});
    t.push_back({p + "mlp.gate_proj.weight", {I, H}, &L.w_gate});
    t.push_back({p + "mlp.up_proj.weight", {I, H}, &L.w_up});
    t.push_back({p + "mlp.down_proj.weight", {H, I}, &L.w_down});
  }
  t.push_back({"model.norm.weight", {H}, &w.final_norm});
  if (!c.tied_embeddings) t.push_back({"lm_head.weight", {V, H}, &w.lm_head});
  return t;
}

DenseWeights bind_dense_weights(const Checkpoint& ckpt) {
  DenseWeights w;
  auto table = dense_weight_table(ckpt.config(), w);
  std::set<std::string> used;
  std::vector<std::string> problems;
  for (auto& spec : table) {
    const CkptTensor* t = ckpt.find(spec.name);
    if (!t) {
      problems.push_back(fmt::format("missing tensor '{}' (expected shape {})", spec.name, st::shape_str(spec.shape)));
      continue;
    }
    used.insert(spec.name);
    if (t->shape != spec.shape) {
      problems.push_back(fmt::format("tensor '{}' in {}: expected shape {}, got {}", spec.name, t->file,
                                     st::shape_str(spec.shape), st::shape_str(t->shape)));
      continue;
    }
    *spec.slot = ckpt.weight(*t);
  }
  // Tensors that carry no weights the model needs.
  auto ignorable = [&](const std::string& n) {
    return n.ends_with("rotary_emb.inv_freq") || n == "rope_freqs.weight" ||
           (ckpt.config().tied_embeddings && n == "lm_head.weight");
  };
  for (auto& t : ckpt.tensors())
    if (!used.count(t.name) && !ignorable(t.name))
      problems.push_back(fmt::format("unused tensor '{}' {} in {} (not part of the {} layout)", t.name,
                                     st::shape_str(t.shape), t.file, arch_name(ckpt.config().arch)));
  if (!problems.empty()) {
    std::string msg = fmt::format("{}: {} problem(s) binding {} weights:", ckpt.source(), problems.size(),
                                  arch_name(ckpt.config().arch));
    const size_t shown = std::min<size_t>(problems.size(), 10);
    for (size_t i = 0; i < shown; ++i) msg += (i ? "; " : " ") + problems[i];
    if (shown < problems.size()) msg += fmt::format("; ... and {} more", problems.size() - shown);
    throw Error(msg);
  }
  if (ckpt.config().tied_embeddings) w.lm_head = w.embed;
  return w;
}

}  // namespace talon
