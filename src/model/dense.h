// Weight table of the dense decoder family (llama, mistral, qwen2, qwen3): the tensor
// names and shapes each architecture must provide, checked against the checkpoint.
// MoE / MLA layer kinds (DeepSeek) get their own tables beside this one.
#pragma once
#include <string>
#include <vector>

#include "model/checkpoint.h"

namespace talon {

struct DenseLayer {
  WeightRef attn_norm;             // [H]
  WeightRef wq, wk, wv, wo;        // [nh*hd, H], [nkv*hd, H], [nkv*hd, H], [H, nh*hd]
  WeightRef bq, bk, bv;            // qwen2: [nh*hd], [nkv*hd], [nkv*hd]; else empty
  WeightRef q_norm, k_norm;        // qwen3: [hd]; else empty
  WeightRef mlp_norm;              // [H]
  WeightRef w_gate, w_up, w_down;  // [I, H], [I, H], [H, I]
};

struct DenseWeights {
  WeightRef embed;       // [V, H]
  std::vector<DenseLayer> layers;
  WeightRef final_norm;  // [H]
  WeightRef lm_head;     // [V, H] (the embedding when tied)
};

// One expected tensor: name, shape, and where it binds.
struct WeightSpec {
  std::string name;
  std::vector<int64_t> shape;
  WeightRef* slot;
};

std::vector<WeightSpec> dense_weight_table(const ModelConfig& c, DenseWeights& w);

// Binds every tensor of the table; fails listing every missing tensor, every shape
// mismatch ("expected [a, b], got [c, d]") and every tensor the model does not use.
DenseWeights bind_dense_weights(const Checkpoint& ckpt);

}  // namespace talon
