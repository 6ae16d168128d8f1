// CUDA kernels of the DeepSeek-family forward (cuda_deepseek.cpp): multi-head latent
// attention in its expanded form, and the fp32 router.
#pragma once
#include <cstdint>

#include "backend/cuda/decode_ops.h"
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

// ---- MLA in its absorbed form, for the cached decoder (mla_decode.cu, cuda_deepseek_decoder.cpp).
// The latent cache of a layer is one bf16 buffer [rows, kvr + rope], row j of slot s at
// map.row(s, j) (paged, ops.h: CacheMap): per token the normalized latent c, then k_pe with
// RoPE applied; rows follow decode_ops.h (DecodeRow). A
// query row holds, per head, [q_lat | q_pe]: q_lat = W_UK(h)^T q_nope(h) (kvr values) and the
// rotated q_pe (rope values), fp32.

// For each of the N rows: the rotated q_pe of every head into qd[n, h, kvr ..] (row stride
// ldqd floats, head stride kvr + rope) from q [N, ldq] (head h at h (nope + rope), q_pe after
// its nope part); and the row's cache entry [lat(n) | rotated k_pe(n)] (k_pe at column kvr of
// ckv rows of ld_ckv) at cache row rows[n].end - 1 of its slot. RoPE as mla_assemble.
void mla_decode_prepare(float* qd, int64_t ldqd, const bf16* q, int64_t ldq, const bf16* ckv, int64_t ld_ckv,
                        const bf16* lat, const int32_t* pos, const float* inv_freq, const DecodeRow* rows, bf16* cache,
                        int64_t N, int64_t nh, int64_t nope, int64_t rope, int64_t kvr, CacheMap map,
                        bool interleaved, float attn_factor, cudaStream_t s);

// out[N, nh, kvr] (bf16) = per row and head, softmax(scale * [q_lat | q_pe] . [c | k_pe]) over
// the row's keys (DecodeRow: [lo, end), pending ones by its mask) times c, with the keys cut
// into n_splits pieces of split_len (decode_splits with nkv = mla_head_blocks(nh)) merged by
// decode_combine. qd [N, nh, kvr + rope] fp32; part holds N * nh * n_splits * (kvr + 2) floats.
// kvr <= 512.
void mla_decode_attention(bf16* out, float* part, const float* qd, const bf16* cache, const DecodeRow* rows,
                          const uint64_t* masks, int64_t N, int64_t nh, int64_t kvr, int64_t rope, CacheMap map,
                          int64_t n_splits, int64_t split_len, float scale, cudaStream_t s);
// Blocks per (row, split) of mla_decode_attention: the heads go in groups of up to 16.
int64_t mla_head_blocks(int64_t nh);

}  // namespace talon::cuda
