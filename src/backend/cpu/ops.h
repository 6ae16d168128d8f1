// CPU reference ops: fp32, readable, deterministic. This is the specification the
// CUDA backend is tested against (tests/backend).
//
// Conventions (as in llm.c): outputs first, then inputs, then sizes. Shapes are
// written as comments, row-major, `N` = packed tokens of a batch. Each output
// element is reduced in a fixed order that does not depend on the thread count or on
// how a batch is packed, so the same sample gives the same bits in any batch.
#pragma once
#include <cstdint>

#include "util/dtype.h"

namespace talon::cpu {

// out[N, O] = in[N, K] @ w[O, K]^T (+ bias[O]). `w` may be F32, BF16 or F16; it is
// widened to fp32 (exactly) before use. `bias` may be null.
void matmul_forward(float* out, const float* in, const void* w, DType w_dtype, const float* bias,
                    int64_t N, int64_t K, int64_t O);

// out[N, C] = in[N, C] / sqrt(mean(in^2) + eps) * weight[C]. out may alias in.
void rmsnorm_forward(float* out, const float* in, const float* weight, int64_t N, int64_t C, float eps);

// out[N, C] = table[ids[n], :] (table F32/BF16/F16 [V, C]); ids are checked against V.
void embedding_forward(float* out, const int32_t* ids, const void* table, DType t_dtype, int64_t N, int64_t C,
                       int64_t V);

// In place on x[N, n_heads, head_dim]: rotate the pair (i, i + head_dim/2) of each head by
// angle pos[n] * inv_freq[i] (the "rotate_half" layout HF uses).
void rope_forward(float* x, const int32_t* pos, const float* inv_freq, int64_t N, int64_t n_heads,
                  int64_t head_dim);

// Causal grouped-query attention over packed sequences.
// out[N, nh*hd]; q[N, nh*hd]; k, v[N, nkv*hd]; sequence s covers rows
// [seq_start[s], seq_start[s+1]). Query head h reads kv head h / (nh / nkv).
// window > 0 restricts keys to those with q_pos - k_pos < window.
void attention_forward(float* out, const float* q, const float* k, const float* v, const int64_t* seq_start,
                       int64_t n_seqs, int64_t nh, int64_t nkv, int64_t hd, int64_t window);

// out[n] = silu(gate[n]) * up[n].
void swiglu_forward(float* out, const float* gate, const float* up, int64_t n);

// out[n] += in[n].
void residual_forward(float* out, const float* in, int64_t n);

}  // namespace talon::cpu
