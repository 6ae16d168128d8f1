// Internal to the CUDA backend: the DeepSeek-family weights on one GPU (or one rank's share of
// them, cuda_model.h: DeepseekParallel) and the two halves of a layer that the packed
// forward (cuda_deepseek.cpp) and the cached decoder (cuda_deepseek_decoder.cpp) share: the
// MLA projections before attention, and the MLP or mixture of experts after it.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "backend/cuda/cuda_model.h"
#include "backend/cuda/device.h"
#include "backend/cuda/moe.h"
#include "backend/cuda/moe_weights.h"
#include "backend/cuda/ops.h"
#include "model/checkpoint.h"

namespace talon::cuda {

// One layer, bf16 unless said. kv_b is [nh (nope + vd), kvr]: per head, nope rows of W_UK
// then vd rows of W_UV (the absorbed form reads them in place).
struct DeepseekLayerDev {
  bf16 *attn_norm, *mlp_norm, *q_a_norm = nullptr, *kv_a_norm;
  bf16 *q = nullptr, *q_a = nullptr, *kv_a, *kv_b, *o;
  bf16 *gu = nullptr, *down = nullptr;  // dense MLP, or the shared experts (null when none)
  int64_t inter = 0;
  bool moe = false;
  float* router = nullptr;  // [E, H] fp32
  MoeLayerDev experts;
};

struct DeepseekDevWeights {
  int64_t nh = 0;  // attention heads on this rank
  bf16 *embed = nullptr, *lm_head = nullptr, *final_norm = nullptr;
  float* inv_freq = nullptr;  // RoPE frequencies of the rope part
  std::vector<DeepseekLayerDev> layers;
};

// Dequantizes (FP8 block, plain) to bf16 and uploads this rank's share; int4 experts stay int4.
DeepseekDevWeights upload_deepseek_weights(const Checkpoint& ckpt, DeviceArena& arena, const DeepseekParallel& par);

// The MLA inputs of layer L for N rows of the fp32 residual x: xn = attn_norm(x) (bf16);
// q [N, nh qk] (through q_a, its norm and q_b, or q_proj); ckv = kv_a(xn) [N, kvr + rope]
// (k_pe unrotated at column kvr); lat = kv_a_norm(ckv[:, :kvr]) [N, kvr]. t32 is fp32 scratch
// of N * max(q_lora_rank, kvr).
struct MlaBuffers {
  bf16 *xn, *qa, *q, *ckv, *lat;
  float* t32;
};
void mla_project(const DeepseekLayerDev& L, const ModelConfig& c, int64_t nh, float* x, const MlaBuffers& b,
                 int64_t N, Gemm& gemm, cudaStream_t s);

// x += the layer's MLP of mlp_norm(x): the dense MLP, or the routed experts (`routed`, given
// the router logits in b.rlog and the normalized input in b.xn, fills b.moe_out; null:
// moe_forward on this GPU) plus the shared experts. `reduce` sums an fp32 partial [n] over a
// tensor-parallel group in place (null: one GPU).
struct MlpBuffers {
  bf16 *xn, *gu, *act;
  float *xn32, *rlog, *moe_out, *part;
  const MoeScratch* moe;
};
void deepseek_mlp(const DeepseekLayerDev& L, const ModelConfig& c, float* x, const MlpBuffers& b, int64_t N,
                  Gemm& gemm, cudaStream_t s, const std::function<void()>& routed = nullptr,
                  const std::function<void(float*, int64_t)>& reduce = nullptr);

// Scratch of moe_forward for up to n tokens of routing r (experts of width Im), from `arena`.
void alloc_moe_scratch(MoeScratch& m, DeviceArena& arena, int64_t n, const MoeRouting& r, int64_t H, int64_t Im);

}  // namespace talon::cuda
