// CUDA kernels of the DeepSeek-family forward (cuda_deepseek.cpp): multi-head latent
// attention in its expanded form, and the fp32 router.
#pragma once
#include <cstdint>

#include "backend/cuda/ops.h"

namespace talon::cuda {

// The fused attention input [N, 3 nh qk] for attention_forward with head size qk = nope +
// rope: q (scaled by q_scale) and k = [k_nope(h) | k_pe] with RoPE on their rope parts
// (interleaved adjacent pairs or (i, i + rope/2), cos/sin times attn_factor, as
// cpu::rope_strided_forward), and v padded with zeros from vd to qk.
// q: [N, nh qk]; kv: [N, nh (nope + vd)] (kv_b's output); ckv: [N, ld_ckv], k_pe at column kvr.
void mla_assemble(bf16* qkv, const bf16* q, const bf16* kv, const bf16* ckv, int64_t ld_ckv, int64_t kvr,
                  const int32_t* pos, const float* inv_freq, int64_t N, int64_t nh, int64_t nope, int64_t rope,
                  int64_t vd, bool interleaved, float attn_factor, float q_scale, cudaStream_t s);

// out[N, nh vd] = the first vd values of each head of in[N, nh qk].
void unpad_heads(bf16* out, const bf16* in, int64_t N, int64_t nh, int64_t qk, int64_t vd, cudaStream_t s);

// out[N, C] (fp32) = x / rms(x) * w, all in fp32 (the router's input).
void rmsnorm_f32(float* out, const float* x, const bf16* w, int64_t N, int64_t C, float eps, cudaStream_t s);

// logits[N, E] = x[N, H] @ W[E, H]^T in fp32 (routing is decided in fp32, as transformers).
void router_logits_f32(float* logits, const float* x, const float* W, int64_t N, int64_t E, int64_t H, cudaStream_t s);

// x[n] += y[n] (fp32).
void add_f32(float* x, const float* y, int64_t n, cudaStream_t s);

}  // namespace talon::cuda
