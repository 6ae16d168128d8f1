// CUDA ops for the dense decoder family: bf16 activations and weights, fp32 accumulation,
// fp32 residual stream. Each op has a CPU twin in src/backend/cpu/ops.h and is tested
// against it by tests/backend/test_cuda_ops.cpp. Launchers return after enqueueing on
// `stream`; arguments are outputs, inputs, then sizes. Row strides (`ld*`) are in
// elements, so fused projections (q|k|v, gate|up) are consumed in place.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace talon::cuda {

using bf16 = __nv_bfloat16;

// out[N, C] (fp32) = table[ids[n], :] (bf16 [V, C]). Out-of-range ids write NaN rows
// (ids are validated on the host before they get here).
void embedding_forward(float* out, const int32_t* ids, const bf16* table, int64_t N, int64_t C, int64_t V,
                       cudaStream_t s);

// Optionally x[N, C] += add[N, C] (fp32 += bf16; add may be null), then
// out[N, C] (bf16) = x / rms(x) * w. One block per row. Row r of out starts at r * ld_out
// (0: C), e.g. one half of a wider row.
void add_rmsnorm_forward(bf16* out, float* x, const bf16* add, const bf16* w, int64_t N, int64_t C, float eps,
                         cudaStream_t s, int64_t ld_out = 0);

// In place on rows of width `n_heads*hd` at stride `ld`: RMSNorm over each head's hd
// values (qwen3 q/k norm), w[hd].
void head_rmsnorm_forward(bf16* x, int64_t ld, const bf16* w, int64_t N, int64_t n_heads, int64_t hd, float eps,
                          cudaStream_t s);

// In place: rotate pairs (i, i + hd/2) of each head by pos[n] * inv_freq[i].
void rope_forward(bf16* x, int64_t ld, const int32_t* pos, const float* inv_freq, int64_t N, int64_t n_heads,
                  int64_t hd, cudaStream_t s);

// y[n, o] += b[o] for rows at stride ld.
void bias_forward(bf16* y, int64_t ld, const bf16* b, int64_t N, int64_t O, cudaStream_t s);

// out[N, I] = silu(gu[n, 0:I]) * gu[n, I:2I] (gu is the fused gate|up projection [N, 2I]).
void swiglu_forward(bf16* out, const bf16* gu, int64_t N, int64_t I, cudaStream_t s);

// Causal GQA attention over packed sequences, online softmax in fp32 (no T x T matrix).
// q/k/v rows at stride ld (fused qkv: q at column 0, k at nh*hd, v at (nh+nkv)*hd).
// seq_start[S+1] and the row -> sequence map are device arrays. out[N, nh*hd].
void attention_forward(bf16* out, const bf16* qkv, int64_t ld, const int64_t* seq_start, const int32_t* row_seq,
                       int64_t N, int64_t nh, int64_t nkv, int64_t hd, int64_t window, cudaStream_t s);

// The same on tensor cores (src/backend/cuda/attention.cu) for head_dim 64, 128 and 192:
// 64-row query tiles listed by attention_tiles() as (sequence, first row) pairs.
bool flash_attention_supported(int64_t hd);
std::vector<int32_t> attention_tiles(const int64_t* host_seq_start, int64_t n_seqs);
int64_t attention_max_tiles(int64_t n_tokens, int64_t n_seqs);
void flash_attention_forward(bf16* out, const bf16* qkv, int64_t ld, const int64_t* seq_start, const int32_t* tiles,
                             int64_t n_tiles, int64_t nh, int64_t nkv, int64_t hd, int64_t window, cudaStream_t s);

// dst[i] += src[i] for n values, bf16 (added in fp32, rounded once) or fp32.
void accumulate(void* dst, const void* src, int64_t n, bool bf16, cudaStream_t s);

// fp32 -> bf16 and bf16 -> fp32 conversions.
void f32_to_bf16(bf16* out, const float* in, int64_t n, cudaStream_t s);
void bf16_to_f32(float* out, const bf16* in, int64_t n, cudaStream_t s);

// Decoding's skinny products (gemv.cu): out[N, O] = in[N, K] @ w[O, K]^T for
// 1 <= N <= kSkinnyMaxRows, one warp per output column, fp32 accumulation. False (nothing
// launched) when the shape or alignment does not fit: K % 8 != 0 or pointers not 16-byte
// aligned.
inline constexpr int64_t kSkinnyMaxRows = 8;
// Gemm::forward takes the skinny kernel up to this many rows: measured on an H200 at the
// Llama-3.1-8B shape, it beats cuBLASLt at one row (a whole decode step 5.37 -> 4.98 ms) but
// not from two rows on, where its per-row fp32 dot products, not the weight bytes, set the
// time (a 4-token verify 7.2 ms against cuBLASLt's ~5.6).
inline constexpr int64_t kSkinnyAutoRows = 1;
// The most rows Gemm::forward gives the skinny kernel: TALON_CUDA_GEMV_ROWS (1..kSkinnyMaxRows),
// default kSkinnyAutoRows. Small models may gain from more (not measured yet: SmolLM2's
// 2-8 token verifies take cuBLASLt and cost ~1.6x a token).
int64_t skinny_auto_rows();
bool skinny_gemm(bf16* out, const bf16* in, const bf16* w, int64_t N, int64_t K, int64_t O, cudaStream_t s);
bool skinny_gemm(float* out, const bf16* in, const bf16* w, int64_t N, int64_t K, int64_t O, cudaStream_t s);

// Products of 1 to kSkinnyMaxRows rows with the layer's small neighbours folded in (gemv.cu),
// for decoding one token or verifying a short chain (dense_block.cpp): instead of norm ->
// product or product -> residual add as two launches, the input rows are formed by every
// block in shared memory and the output can go straight into the residual stream. Inputs
// (per row):
//   Plain:  in (bf16, K values);
//   Norm:   rmsnorm(x) * norm_w of the fp32 row x (K values, eps), rounded to bf16, the
//           formula of rmsnorm_forward;
//   Swiglu: silu(gate) * up of the bf16 row in = [gate K | up K], rounded to bf16, the formula
//           of swiglu_forward.
// Output: out[o] = bf16(acc), or residual[o] += bf16(acc) (fp32 residual; the branch output
// rounded to bf16 as the unfused path adds it). Exactly one of out and residual is set. False
// (nothing launched) when K is not a multiple of 8, K > kSkinnyFusedMaxK (the staged row must
// fit in shared memory), or a pointer is not 16-byte aligned.
enum class SkinnyIn { Plain, Norm, Swiglu };
inline constexpr int64_t kSkinnyFusedMaxK = 16384;  // 32 KiB of staged bf16
// RoPE and the cache write of a decoder's fused q|k|v product (decode_ops.h:
// rope_kv_cache_write) as the product's epilogue: out is then the q|k|v rows (nh q heads, nkv
// k heads, nkv v heads of hd values), O = (nh + 2 nkv) hd. Each block computes four rotation
// pairs (i, i + hd/2) of one q or k head, or eight v columns, and writes what
// rope_kv_cache_write writes, with its arithmetic: q and k rotated in out, the rotated k and
// the v of row r at cache row rows[r].end - 1 of slot rows[r].slot. Saves that launch.
struct DecodeRow;

// Where a slot's cache rows live in a cache buffer. Paged (the decoders' caches,
// model/kv_pages.h): row j of slot s at physical row pages[s * max_pages + j / kPageRows] *
// kPageRows + j % kPageRows. Flat (pages null: the draft's and DFlash's own caches, and a
// plain max_len converts to one): at s * max_len + j.
inline constexpr int kPageRows = 64;
struct CacheMap {
  int64_t max_len = 0;
  const int32_t* pages = nullptr;  // device [n_slots, max_pages], or null
  int32_t max_pages = 0;
  CacheMap() = default;
  CacheMap(int64_t flat_max_len) : max_len(flat_max_len) {}  // NOLINT: a flat cache
  CacheMap(const int32_t* table, int64_t pages_per_slot)
      : max_len(pages_per_slot * kPageRows), pages(table), max_pages(int32_t(pages_per_slot)) {}
#ifdef __CUDACC__
  __device__ __forceinline__ int64_t row(int slot, int64_t j) const {
    return pages ? int64_t(pages[int64_t(slot) * max_pages + j / kPageRows]) * kPageRows + j % kPageRows
                 : int64_t(slot) * max_len + j;
  }
#endif
};

struct SkinnyRope {
  const int32_t* pos = nullptr;  // [rows]
  const float* inv_freq = nullptr;  // [hd / 2]
  const DecodeRow* rows = nullptr;  // [rows]
  bf16 *kc = nullptr, *vc = nullptr;
  int nh = 0, nkv = 0, hd = 0;
  CacheMap cache;
};
struct SkinnyFused {
  SkinnyIn kind = SkinnyIn::Plain;
  const bf16* in = nullptr;      // Plain, Swiglu
  const float* x = nullptr;      // Norm
  const bf16* norm_w = nullptr;  // Norm
  float eps = 0.f;
  bf16* out = nullptr;
  float* residual = nullptr;
  int64_t rows = 1;  // 1..kSkinnyMaxRows rows, each laid out as the one-row case, one after another
  // Norm or Plain inputs with `out` only: the RoPE + cache-write epilogue (refused when O, hd
  // or the outputs do not fit it: hd a multiple of 8, O = (nh + 2 nkv) hd).
  const SkinnyRope* rope = nullptr;
};
// Whether `rows` rows of K inputs can go through skinny_fused (their staged bf16 copies,
// rows x K values, must fit in kSkinnyFusedMaxK).
bool skinny_fused_fits(int64_t K, int64_t rows = 1);
bool skinny_fused(const SkinnyFused& f, const bf16* w, int64_t K, int64_t O, cudaStream_t s);
// Whether Gemm takes skinny products at all (TALON_CUDA_GEMV=0 turns them off) and whether the
// dense stack folds norms, residual adds and SwiGLU into them for forwards of a few rows
// (TALON_CUDA_FUSE=0 turns that off).
bool skinny_enabled();
bool skinny_fusion_enabled();
// The most rows a forward may have to be folded (TALON_CUDA_FUSE_ROWS, 1..kSkinnyMaxRows,
// default kSkinnyFoldRows; 1 folds one-token forwards only). Every block forms every row's
// input, so the prologue grows with the rows: SmolLM2 on an H200 (bench/RESULTS.md,
// 2026-12-05), verifies of 2 / 4 / 8 tokens 1.040 / 1.056 / 1.055 ms unfolded against
// 0.743 / 0.901 / 1.418 folded (the prologue's loads all in flight; before that 4 tokens took
// 1.138 and 8 took 1.729).
inline constexpr int64_t kSkinnyFoldRows = 4;
int64_t skinny_fusion_rows();
// Whether the decode path's kernels launch as programmatic dependents of the kernel before them
// (launch.cuh; Hopper's griddepcontrol: a product's weights stream while that kernel finishes,
// a small kernel is resident when it ends), by kind: on GPUs of compute capability 9.0 and up,
// for the kinds in TALON_CUDA_PDL (a mask of the kDepend* bits below; 0: none), default
// kDependDefault. set_dependent_launches sets the mask for the launches that follow (tests and
// benchmarks; graphs captured before keep what they were captured with).
inline constexpr unsigned kDependProduct = 1;     // skinny products
inline constexpr unsigned kDependNorm = 2;        // RMSNorm, SwiGLU
inline constexpr unsigned kDependRope = 4;        // RoPE + cache write, cache write
inline constexpr unsigned kDependAttention = 8;   // decode and verify attention
inline constexpr unsigned kDependCombine = 16;    // the key splits' combine
inline constexpr unsigned kDependPick = 32;       // argmax, top-k, sampling
// The draft trainers' own kernels (row moves, casts, the loss, the diagonal keys, the RMSNorm
// and SwiGLU backward, the weight-part sums, the gradient norm's sums and factor, AdamW).
// Measured on an H100 (bench/RESULTS.md, 2026-12-07 sixth session; talon_bench_train, 8B draft
// shape, two alternating rounds, TALON_CUDA_PDL=39 -> 103): 2048 tokens 36,087 / 36,121 ->
// 36,530 / 36,576 tok/s, 4096 tokens 37,799 / 37,752 -> 37,605 / 38,072; the traced step's
// idle 1.68 -> 1.37 ms in 602 -> 402 gaps.
inline constexpr unsigned kDependTrain = 64;
inline constexpr unsigned kDependAll = 127;
// Everything but the attention and its combine (103). Measured on an H100 (bench/RESULTS.md,
// 2026-12-06 fourth session; greedy ms, products only -> this -> all 63, before kDependTrain
// existed): the 8B step at context 2048 5.99 -> 5.95-5.96 -> 5.90; SmolLM2 one token 0.663 ->
// 0.660 -> 0.678, its 4-token verify 0.90 -> 0.90 -> 1.02 with the attention dependent.
inline constexpr unsigned kDependDefault = kDependAll & ~(kDependAttention | kDependCombine);
bool dependent_launch_enabled(unsigned kind);
void set_dependent_launches(unsigned mask);

// out[N, O] (bf16) = in[N, K] (bf16) @ w[O, K]^T, fp32 accumulation, through cuBLASLt; up to
// kSkinnyAutoRows rows through skinny_gemm instead (TALON_CUDA_GEMV=0 in the environment:
// cuBLASLt for every shape).
class Gemm {
 public:
  Gemm();
  ~Gemm();
  void forward(bf16* out, const bf16* in, const bf16* w, int64_t N, int64_t K, int64_t O, cudaStream_t s);
  // The same with an fp32 output (no bf16 rounding of the result).
  void forward(float* out, const bf16* in, const bf16* w, int64_t N, int64_t K, int64_t O, cudaStream_t s);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace talon::cuda
