// CUDA kernels of the cached decoder (cuda_decoder.cpp, decode_attention.cu).
//
// KV cache layout: one bf16 buffer per layer and per K / V, [rows, nkv, hd]: row `j` of slot
// `s` at cache.row(s, j) * nkv * hd (ops.h: CacheMap; the decoders page their caches, the
// draft's caches are flat, [n_slots, max_len, nkv, hd]). A forward packs every request's
// new tokens into N rows; row r's new key and value go to cache row
// `rows[r].end - 1` of its slot (= committed length + index within its request), so
// pending tokens sit right after the committed prefix, in request order.
//
// Row r of a forward attends to cache rows [lo, end) of its slot: rows below `len` are
// committed; rows at or above it are the request's pending tokens, all of them visible
// for a chain (mask < 0), else only those whose bit (j - len) is set in the bitmask at
// masks[mask ...] (its ancestors and itself, already filtered by the sliding window).
#pragma once
#include <cstdint>
#include <vector>

#include "backend/cuda/ops.h"

namespace talon::cuda {

struct DecodeRow {
  int32_t slot;
  int32_t lo, len, end;  // keys: cache rows [lo, end); rows >= len are pending
  int32_t mask;          // offset into the masks (64-bit words), -1 for a chain
};

// Keys per tile of the decode-attention kernel; a split covers a multiple of it.
inline constexpr int kDecodeTile = 64;

// How decode_attention cuts the key range of N rows with at most max_keys keys each:
// enough (row, kv head, split) blocks to fill the GPU several times over, for the key count
// rounded up to a step of at least 256 keys and an eighth of its power of two, so that one
// launch shape (and a CUDA graph holding it) serves the next steps of a growing context,
// with at most ~1/8 of the blocks idle (splits past a row's keys are empty).
struct DecodeSplits {
  int64_t splits, split_len;
};
DecodeSplits decode_splits(int64_t max_keys, int64_t N, int64_t nkv, int multiprocessors);

// kc / vc[rows[r].slot, rows[r].end - 1, :, :] = k / v of row r (k at column nh*hd of the
// fused qkv rows, v after it), for all N rows.
void kv_cache_write(bf16* kc, bf16* vc, const bf16* qkv, int64_t ld, const DecodeRow* rows, int64_t N, int64_t nh,
                    int64_t nkv, int64_t hd, CacheMap cache, cudaStream_t s);

// RoPE of each row's q and k heads in place in the fused qkv rows (the rotation of
// ops.h: rope_forward, fp32 angles), then kv_cache_write of the rotated k and of v: one
// launch instead of three.
void rope_kv_cache_write(bf16* kc, bf16* vc, bf16* qkv, int64_t ld, const int32_t* pos, const float* inv_freq,
                         const DecodeRow* rows, int64_t N, int64_t nh, int64_t nkv, int64_t hd, CacheMap cache,
                         cudaStream_t s);

// Verify attention: rows of one forward that share a slot and a committed length (a
// request's chain or tree of pending tokens) attend to the same committed prefix. Reading it
// once per row costs the prefix bytes times the row count; a tile of such rows reads each
// key once for all of them. A tile holds up to kTileVectors query vectors of one row group:
// vector v of the group is query head (v % group) of kv head blockIdx.y, row first_row + v /
// group (group = nh / nkv), and S = Q K^T, O += P V run on tensor cores (mma.sync bf16,
// fp32 accumulators, P kept as a hi + lo pair of bf16 terms, as in attention.cu).
inline constexpr int kTileVectors = 64;
struct AttentionTile {
  int32_t first_row, n_rows, first_vector, unused;
};
// Which rows of a forward go through the per-row kernel (`single`) and which through tiles,
// and the key splits of both (decode_splits over the blocks of a kv head: single rows plus
// tiles, for the most keys any of them spans; a tile spans its rows' union). Groups of at least
// two rows become tiles when `tiles_ok` and the head size has a tile kernel
// (verify_attention_supported), and so do lone rows when there are enough of them (below);
// every other row stays single. No tiles: every row is single,
// and callers pass decode_attention no AttentionWork, so it runs the per-row kernel as before.
struct AttentionPlan {
  std::vector<int32_t> single;
  std::vector<AttentionTile> tiles;
  int64_t max_keys = 0;
  DecodeSplits splits{1, 0};
};
bool verify_attention_supported(int64_t hd);
// False when TALON_CUDA_VERIFY_TILES=0 is set: every row through the per-row kernel.
bool verify_tiles_enabled();
// Lone rows (one-token steps of distinct slots) go through tiles too when there are at least
// `lone_tiles` of them. One row's query heads of a kv head fill a tile only partly (its four
// warps then split the keys), yet the tensor-core kernel beat the per-row kernel's CUDA-core
// products at every batch measured (H200: 8B one token 4.98 -> 4.85 ms, 256 slots x 2048
// 49.7 -> 25.9 ms; SmolLM2 one token 0.876 -> 0.758 ms), hence a default of 1.
// lone_tile_rows() is that count: kLoneTileRows, or TALON_CUDA_LONE_TILES=n (0: never).
inline constexpr int64_t kLoneTileRows = 1;
int64_t lone_tile_rows();
AttentionPlan plan_attention(const DecodeRow* rows, int64_t N, int64_t nh, int64_t nkv, int64_t hd, bool tiles_ok,
                             int multiprocessors, int64_t lone_tiles = lone_tile_rows());
// The plan's lists on the device, for decode_attention.
struct AttentionWork {
  const int32_t* single = nullptr;
  int64_t n_single = 0;
  const AttentionTile* tiles = nullptr;
  int64_t n_tiles = 0;
};

// Attention of N query rows (q at column 0 of the fused qkv) against the cache, flash-
// decoding style: the key range of each row is cut into n_splits pieces of split_len keys
// (a multiple of kDecodeTile); each (row, kv head, split) block handles all the query heads
// of that kv head (GQA: each key is read once for the whole group), keeping an online
// softmax in fp32; then a combine pass merges the splits into out[N, nh * hd] (bf16).
// part must hold N * nh * n_splits * (hd + 2) floats. With `counters` (N * nh ints, zero
// before the first call; each launch leaves them zero) there is no combine pass: the last
// block of each (row, kv head) to finish merges its heads' splits (one launch, not two).
// With `work` (a plan_attention of these rows, on the device), the per-row kernel runs only
// over work->single and the tiles go through the verify kernel (see AttentionTile); both
// write the same partial results, merged by one combine pass (counters are then unused).
void decode_attention(bf16* out, float* part, const bf16* qkv, int64_t ld, const bf16* kc, const bf16* vc,
                      const DecodeRow* rows, const uint64_t* masks, int64_t N, int64_t nh, int64_t nkv, int64_t hd,
                      CacheMap cache, int64_t n_splits, int64_t split_len, cudaStream_t s, int* counters = nullptr,
                      const AttentionWork* work = nullptr);

// The combine pass of decode_attention on its own: out[rh, :hd] (bf16) = the splits of part
// [rows_heads, n_splits, hd + 2] (unnormalised output, max in the log2 domain, sum) merged.
void decode_combine(bf16* out, const float* part, int64_t rows_heads, int64_t hd, int64_t n_splits, cudaStream_t s);

// out[i] = in[i] + offsets[in[i]] for n ids (a draft vocabulary's ids to target ids).
void offset_ids(int32_t* out, const int32_t* in, const int64_t* offsets, int64_t n, cudaStream_t s);

// out[i, :] = in[idx[i], :] for n rows of C bf16 values (the rows that need logits).
void gather_rows(bf16* out, const bf16* in, const int32_t* idx, int64_t n, int64_t C, cudaStream_t s);

// Per row of logits [rows, V] (fp32): ids[r, 0..k) = the k largest (descending, ties to the
// lower index) and lp[r, 0..k) their log-softmax values over the row. k <= V.
void topk_logsoftmax(int32_t* ids, float* lp, const float* logits, int64_t rows, int64_t V, int k, cudaStream_t s);

// ids[r] = argmax of row r of logits [rows, V] (bf16), ties to the lower index: the greedy
// token, the same one the host's argmax picks over these values converted to fp32 (exactly
// representable). NaN entries are never picked; a row of NaNs gives 0.
void argmax_rows(int32_t* ids, const bf16* logits, int64_t rows, int64_t V, cudaStream_t s);

// Sampling parameters as sample_rows reads them, from device memory (so that one CUDA graph
// of a forward serves any parameters).
struct DeviceSampling {
  double temperature;  // <= 0: the argmax
  double top_p;        // 1: off
  int64_t top_k;       // 0 or >= V: off
  int64_t search_only = 0;  // 1: top-p's threshold by the bit-by-bit search alone (tests)
};

// ids[r] = the token drawn from row r of logits [rows, V] (bf16) with uniforms[r] in [0, 1):
// the host's draw(sampling_distribution(row, p), u) (model/sampling.h) over these values
// converted to fp32, up to the order of fp64 additions (see sample.cu). Deterministic: the
// same row, parameters and u give the same id in any batch. NaN entries are never picked.
void sample_rows(int32_t* ids, const bf16* logits, int64_t rows, int64_t V, const DeviceSampling* params,
                 const double* uniforms, cudaStream_t s);

// Speculative sampling of one drafted chain (model/decode.h: Decoder::forward_accept_chain) from
// its verify forward's logits [k + 1, V] (bf16, row i: after chain token i): while q[i][d] > 0
// and u[t] < min(1, p_i(d) / q[i][d]) for draft token d = draft[i] (t: tests made so far), keep
// it; at the first rejection draw from max(0, p_i - q[i]) (p_i when that has no mass), after k
// kept from p_k, with u[t]. p_i: the host's sampling_distribution of row i for temperature > 0,
// top_p, top_k. q [k, V] fp64, u [k + 1] fp64, draft [k]; out [2] = kept, next. counts: 65,536
// ints of scratch. One block (accept.cu); deterministic.
void accept_chain(int32_t* out, const bf16* logits, int64_t V, int k, const int32_t* draft, const double* q,
                  const double* u, double temperature, double top_p, int64_t top_k, int* counts, cudaStream_t s);

// Speculative sampling of a picked (top-k) tree (model/decode.h: Decoder::forward_accept_tree)
// from its verify forward's logits [n, V] (bf16, row i: after tree token i), tokens [n] and
// parents [n] (row 0 the root): from row 0, children tried in row order, a child with token t
// kept when p(t) > 0 and u[j] * mass < p(t), else t leaves p (mass -= p(t)); where none is kept,
// next = the draw over what is left of p with the next uniform. out [2 + n]: the path's length
// L, next, then the path's L rows. u [n] fp64; counts: 65,536 ints of scratch. One block
// (accept.cu); deterministic.
void accept_tree(int32_t* out, const bf16* logits, int64_t V, int n, const int32_t* tokens, const int32_t* parents,
                 const double* u, double temperature, double top_p, int64_t top_k, int* counts, cudaStream_t s);

// For each (src, dst) pair of physical cache rows (CacheMap::row), in order, copies that
// row of every buffer in `caches` (a device array of n_bufs pointers: every layer's K and
// V). Pairs run one after another within a buffer, so a commit's path can move down onto
// rows that earlier pairs read from.
void kv_cache_move(bf16* const* caches, int64_t n_bufs, const int32_t* pairs, int64_t n_pairs, int64_t row_elems,
                   cudaStream_t s);

}  // namespace talon::cuda
