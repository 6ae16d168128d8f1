// Mixture-of-experts on one GPU, for the DeepSeek-V3 / Kimi-K2 family (model/deepseek.h):
// routing on the device, tokens grouped by expert, and the experts' SwiGLU MLPs as grouped
// GEMMs (one launch per matrix for all experts of a layer, not one per expert), with int4
// group-quantized weights dequantized inside the GEMM's tile loads (never the whole matrix).
// The CPU twin is cpu::moe_router_forward plus CpuDeepseekModel's per-expert MLP; the
// contract is the same: out[n] = sum over the token's experts e, in expert-id order, of
// w[n, e] * expert_e(xn[n]) (shared experts are a dense MLP added by the caller).
//
// Status: arithmetic on CUDA cores (fp32 FMA on bf16 / int4 operands, tiles of 16 routed
// rows x 64 outputs); the tensor-core version and expert parallelism across GPUs are next.
#pragma once
#include <cstdint>

#include "backend/cuda/ops.h"

namespace talon::cuda {

struct MoeRouting {
  int n_experts = 0, top_k = 0;
  bool sigmoid = false;  // scoring: sigmoid, else softmax
  enum class Method { Greedy, GroupLimitedGreedy, NoauxTc } method = Method::Greedy;
  int n_group = 1, topk_group = 1;
  bool norm_topk = false;
  float routed_scale = 1.f;
};

// The stacked weights of one matrix kind (gate, up or down) for all E experts, logical shape
// [E, O, I]: bf16 `w` [E, O, I], or int4 `packed` int32 [E, O, ceil(I/8)] (element 8j+k of a
// row in bits 4k..4k+3, stored as q + 8) with bf16 `scale` [E, O, ceil(I/group)].
struct ExpertMatrix {
  const bf16* w = nullptr;
  const int32_t* packed = nullptr;
  const bf16* scale = nullptr;
  int64_t O = 0, I = 0, group = 0;
};

struct MoeExperts {
  ExpertMatrix gate, up, down;  // [E, Im, H], [E, Im, H], [E, H, Im]
};

// Device scratch of moe_forward for up to n_tokens tokens (allocated by the caller's arena).
struct MoeScratch {
  int32_t *idx, *order, *pos, *offsets, *tiles, *n_tiles;
  float *weights, *g, *u, *y;
  bf16* act;
  int64_t capacity = 0;  // tokens
};
// Sizes (in elements) of each scratch buffer for n tokens: see moe_scratch_elems.
struct MoeScratchSizes {
  int64_t idx, order, pos, offsets, tiles, weights, g, y, act;
};
MoeScratchSizes moe_scratch_elems(int64_t n_tokens, const MoeRouting& r, int64_t H, int64_t Im);

// idx[N, K] (ascending expert ids per token) and weights[N, K] from router logits [N, E]
// (fp32) and the noaux_tc correction bias [E] (or null), as cpu::moe_router_forward.
void moe_route(int32_t* idx, float* weights, const float* logits, const float* bias, int64_t N, const MoeRouting& r,
               cudaStream_t s);

// out[N, H] (fp32) = the routed experts' weighted sum for xn[N, H] (bf16) and router logits
// [N, E] (fp32). Overwrites out.
void moe_forward(float* out, const bf16* xn, const float* router_logits, const float* bias, int64_t N, int64_t H,
                 const MoeRouting& r, const MoeExperts& ex, const MoeScratch& sc, cudaStream_t s);

}  // namespace talon::cuda
