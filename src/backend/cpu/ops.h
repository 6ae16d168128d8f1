// CPU reference ops: fp32, readable, deterministic. This is the specification the
// CUDA backend is tested against (tests/backend).
//
// Conventions (as in llm.c): outputs first, then inputs, then sizes. Shapes are
// written as comments, row-major, `N` = packed tokens of a batch. Each output
// element is reduced in a fixed order that does not depend on the thread count or on
// how a batch is packed, so the same sample gives the same bits in any batch.
#pragma once
#include <cstdint>
#include <vector>

#include "model/moe_routing.h"
#include "util/dtype.h"

namespace talon {
struct Capture;
}

namespace talon::cpu {

// Work (multiply-adds, element updates) below which a loop stays on the calling thread
// (`#pragma omp ... if (work >= kParallelMinWork)`): for tiny models and single decode rows
// a parallel region's fork and barrier cost more than the loop itself, and on a machine
// shared with other busy processes far more.
constexpr int64_t kParallelMinWork = int64_t(1) << 15;

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
// One query row of one head: out[dv] = sum_j softmax_j(scale * q . k_j) v_j over the keys
// rows[0..n) (or, when rows is null, the rows first .. first+n-1) of k and v, whose rows are
// k_stride / v_stride elements apart (pointers already at the head's offset). Scores in
// fp32 in key order, softmax denominator and weighted sum in fp64. Every CPU attention
// (packed, cached, tree, MLA, draft) computes a row through this, so they round alike.
// p and acc are scratch (resized here).
void attend_row(float* out, const float* q, const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                const int64_t* rows, int64_t first, int64_t n, int64_t dk, int64_t dv, float scale,
                std::vector<float>& p, std::vector<double>& acc);

void attention_forward(float* out, const float* q, const float* k, const float* v, const int64_t* seq_start,
                       int64_t n_seqs, int64_t nh, int64_t nkv, int64_t hd, int64_t window);

// RoPE on a strided sub-block (DeepSeek MLA: the rope part of each head). x points at the
// first rope element of head 0 of row 0; head h of row n starts at x + n*row_stride +
// h*head_stride and has `dim` rope values. interleaved: rotate adjacent pairs (2i, 2i+1)
// by angle pos*inv_freq[i] (DeepSeek's layout); else the pairs (i, i + dim/2) (rotate_half).
// cos and sin are multiplied by `attn_factor` (YaRN's magnitude scale; 1 otherwise).
void rope_strided_forward(float* x, const int32_t* pos, const float* inv_freq, int64_t N, int64_t n_heads,
                          int64_t row_stride, int64_t head_stride, int64_t dim, bool interleaved, float attn_factor);

// Causal multi-head attention with different key and value widths (MLA after expansion).
// out[N, nh*dv]; q, k[N, nh*dk]; v[N, nh*dv]; logits are q.k * scale.
void attention_mha_forward(float* out, const float* q, const float* k, const float* v, const int64_t* seq_start,
                           int64_t n_seqs, int64_t nh, int64_t dk, int64_t dv, float scale);

// MoE router: picks `topk` of E experts per token from router logits[N, E] (fp32).
//   scores = softmax(logits) or sigmoid(logits)
//   greedy:               the top-k scores
//   group_limited_greedy: experts of the topk_group groups with the largest max score
//   noaux_tc:             choice = scores + bias; groups ranked by the sum of their top-2
//                         choices; top-k choices within the kept groups
// Weights are the chosen *scores* (the bias only steers selection), divided by their sum
// (+1e-20) when `norm`, times `scale`. idx[N, topk] is sorted by expert id (the order the
// MoE sums in); ties go to the lower expert id.
void moe_router_forward(int32_t* idx, float* weights, const float* logits, const float* bias, int64_t N, int64_t E,
                        int64_t topk, MoeScoring scoring, MoeTopk method, int64_t n_group, int64_t topk_group,
                        bool norm, float scale);

// Copies x[N, H] (the residual stream) to every capture slot of `layer_id`: batch row r
// goes to output row dst[r], as fp32 or bf16 (Capture::dtype).
void capture_rows(const Capture& cap, int layer_id, const float* x, int64_t N, int64_t H, const int64_t* dst);

// out[n] = silu(gate[n]) * up[n].
void swiglu_forward(float* out, const float* gate, const float* up, int64_t n);

// out[n] += in[n].
void residual_forward(float* out, const float* in, int64_t n);

}  // namespace talon::cpu
