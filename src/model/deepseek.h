// Weight table of the DeepSeek-V2/V3 family (Kimi-K2 included): multi-head latent
// attention (MLA) and mixture-of-experts layers, in HF naming, checked against the
// checkpoint like bind_dense_weights (every missing, misshaped and unused tensor listed).
//
// Per layer l (prefix model.layers.l.):
//   input_layernorm.weight [H], post_attention_layernorm.weight [H]
//   self_attn: q_proj [nh*qk, H] (q_lora_rank null) or q_a_proj [qr, H], q_a_layernorm [qr],
//              q_b_proj [nh*qk, qr]; kv_a_proj_with_mqa [kvr + rope, H], kv_a_layernorm [kvr],
//              kv_b_proj [nh*(nope + v), kvr], o_proj [H, nh*v]   (qk = nope + rope)
//   l < first_k_dense_replace: mlp.{gate,up}_proj [I, H], mlp.down_proj [H, I]
//   else: mlp.gate.weight [E, H], mlp.gate.e_score_correction_bias [E] (noaux_tc),
//         mlp.experts.e.{gate,up}_proj [Im, H], down_proj [H, Im],
//         mlp.shared_experts.{gate,up}_proj [Im*ns, H], down_proj [H, Im*ns] (ns > 0)
// Linear weights may be stored plain (F32/BF16/F16), FP8 block-quantized
// (`.weight` F8_E4M3 + `.weight_scale_inv`) or int4 pack-quantized (`.weight_packed`,
// `.weight_scale`, `.weight_shape`); see model/quant.h.
#pragma once
#include <string>
#include <vector>

#include "model/checkpoint.h"
#include "model/quant.h"

namespace talon {

struct DeepseekMlp {
  QuantWeight gate, up, down;  // [I, H], [I, H], [H, I]
};

struct DeepseekLayer {
  WeightRef attn_norm, mlp_norm;   // [H]
  QuantWeight q_proj;              // plain q (q_lora_rank null); else empty
  QuantWeight q_a;                 // [qr, H]
  WeightRef q_a_norm;              // [qr]
  QuantWeight q_b;                 // [nh*qk, qr]
  QuantWeight kv_a;                // [kvr + rope, H]
  WeightRef kv_a_norm;             // [kvr]
  QuantWeight kv_b;                // [nh*(nope + v), kvr]
  QuantWeight o_proj;              // [H, nh*v]
  bool moe = false;
  DeepseekMlp dense;               // !moe
  WeightRef router;                // [E, H]
  WeightRef router_bias;           // [E] (noaux_tc); else empty
  std::vector<DeepseekMlp> experts;
  DeepseekMlp shared;              // empty when n_shared_experts == 0
};

struct DeepseekWeights {
  WeightRef embed;  // [V, H]
  std::vector<DeepseekLayer> layers;
  WeightRef final_norm;  // [H]
  WeightRef lm_head;     // [V, H] (the embedding when tied)
};

// One entry of the layout above, in checkpoint order. A float tensor (norm, router, bias)
// binds to `tensor` with exactly `shape`; a linear layer's `name` is its prefix (`.weight`
// or the quantized forms are appended), `shape` its logical [O, I], and it binds to
// `linear`. `routed_expert`: a routed expert's projection (these are the int4 ones in
// compressed-tensors checkpoints).
struct DeepseekTensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  WeightRef* tensor = nullptr;
  QuantWeight* linear = nullptr;
  bool routed_expert = false;
};

// The layout for config `c`, with `w` sized to it (layers, experts) and every entry
// pointing into `w`. bind_deepseek_weights fills it from a checkpoint; the random
// checkpoint (model/random_checkpoint.h) writes its tensor list from it.
std::vector<DeepseekTensorSpec> deepseek_weight_table(const ModelConfig& c, DeepseekWeights& w);

DeepseekWeights bind_deepseek_weights(const Checkpoint& ckpt);

}  // namespace talon
