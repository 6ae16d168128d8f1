// Kernels of the cached decoder (decode_ops.h): cache writes and moves, the row gather for
// logits, and flash-decoding attention of new tokens against their slot's cached keys.
#include <algorithm>
#include <cmath>
#include <cfloat>
#include <climits>
#include <cstdlib>
#include <limits>
#include <string>

#include "backend/cuda/check.h"
#include "backend/cuda/decode_ops.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/tensor_core.cuh"
#include "backend/cuda/warp.cuh"

namespace talon::cuda {

namespace {

constexpr int kWarp = 32;
constexpr int kThreads = 128;               // 4 warps per attention block
constexpr int kMaxPairs = 16;               // (query head, dim) pairs per thread: G * hd <= 2048
constexpr float kLog2e = 1.4426950408889634f;


__global__ void kv_write_kernel(bf16* kc, bf16* vc, const bf16* qkv, int64_t ld, const DecodeRow* rows, int64_t nh,
                                int64_t nkv, int64_t hd, CacheMap cache) {
  allow_dependents();
  grid_dependency_wait();  // launched dependent (launch.cuh)
  const int64_t r = blockIdx.x, kvd = nkv * hd;
  const DecodeRow row = rows[r];
  const int64_t dst = cache.row(row.slot, row.end - 1) * kvd;
  const bf16* src = qkv + r * ld + nh * hd;
  for (int64_t i = threadIdx.x; i < kvd; i += blockDim.x) {
    kc[dst + i] = src[i];
    vc[dst + i] = src[kvd + i];
  }
}

// Block (row, hb): heads hb * HB .. hb * HB + HB - 1 of the nh q heads and nkv k heads, HB =
// blockDim.y; thread (x, y) rotates pairs (i, i + hd/2), i = x, x + blockDim.x, ... of head
// hb * HB + y, angle pos * inv_freq[i] in fp32 as rope_kernel computes it; a k head's threads
// also write its rotated k and its v head into the cache.
__global__ void rope_kv_write_kernel(bf16* kc, bf16* vc, bf16* qkv, int64_t ld, const int32_t* pos,
                                     const float* inv_freq, const DecodeRow* rows, int nh, int nkv, int hd,
                                     CacheMap cache) {
  allow_dependents();
  grid_dependency_wait();  // launched dependent (launch.cuh)
  const int64_t r = blockIdx.x;
  const int h = blockIdx.y * blockDim.y + threadIdx.y, half = hd / 2;
  if (h >= nh + nkv) return;
  bf16* hp = qkv + r * ld + int64_t(h) * hd;
  const float p = float(pos[r]);
  int64_t dst = -1;
  if (h >= nh) {
    const DecodeRow row = rows[r];
    dst = (cache.row(row.slot, row.end - 1) * nkv + (h - nh)) * hd;
  }
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    float sn, cs;
    sincosf(float(1.f) * p * inv_freq[i], &sn, &cs);
    const float a = __bfloat162float(hp[i]), b = __bfloat162float(hp[i + half]);
    const bf16 x0 = __float2bfloat16(a * cs - b * sn), x1 = __float2bfloat16(b * cs + a * sn);
    hp[i] = x0;
    hp[i + half] = x1;
    if (dst >= 0) {
      const bf16* vp = hp + int64_t(nkv) * hd;  // the v head of this k head
      kc[dst + i] = x0;
      kc[dst + i + half] = x1;
      vc[dst + i] = vp[i];
      vc[dst + i + half] = vp[i + half];
    }
  }
}

// Block (row r, head block hb, split z): query heads h0 .. h0 + G - 1 of kv head kh, keys
// [lo + z * split_len, min(end, lo + (z + 1) * split_len)) in tiles of kDecodeTile.
// Shared memory: q [G, hd] fp32 (pre-scaled by log2(e) / sqrt(hd), softmax in the exp2
// domain), scores/probabilities [G, kDecodeTile] fp32, running max / sum / correction [3, G],
// then the K and V tiles [kDecodeTile, hdp] bf16 (rows padded by 16 bytes so that the
// 16-byte row reads of a quarter warp hit distinct banks).
// Each thread owns (head, dim) pairs tid, tid + 128, ... of the unnormalised output. The
// split's result goes to part[(r * nh + h) * n_splits + z] as [hd values, max, sum].
template <bool kVec>
__global__ void __launch_bounds__(kThreads) decode_attention_kernel(
    float* part, const bf16* qkv, int64_t ld, const bf16* kc, const bf16* vc, const DecodeRow* rows,
    const uint64_t* masks, int nh, int nkv, int hd, CacheMap cache, int n_splits, int split_len, int G, bf16* out,
    int* counters, const int32_t* row_idx) {
  allow_dependents();
  grid_dependency_wait();  // launched dependent (launch.cuh)
  constexpr int T = kDecodeTile;
  const int r = row_idx ? row_idx[blockIdx.x] : int(blockIdx.x), split = blockIdx.z, tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
  const int group = nh / nkv, chunks = group / G;
  const int kh = blockIdx.y / chunks, h0 = kh * group + (blockIdx.y % chunks) * G;
  const int hdp = kVec ? hd + 8 : hd + 2;
  const DecodeRow row = rows[r];
  extern __shared__ __align__(16) float smem[];
  float* qs = smem;
  float* ps = qs + G * hd;
  float* ms = ps + G * T;
  float* ls = ms + G;
  float* cs = ls + G;
  bf16* ks = reinterpret_cast<bf16*>(smem + ((G * hd + G * T + 3 * G + 3) / 4) * 4);
  bf16* vs = ks + T * hdp;

  const float scale = rsqrtf(float(hd)) * kLog2e;
  for (int i = tid; i < G * hd; i += kThreads)
    qs[i] = __bfloat162float(qkv[int64_t(r) * ld + int64_t(h0) * hd + i]) * scale;
  if (tid < G) {
    ms[tid] = -INFINITY;
    ls[tid] = 0.f;
  }
  float o[kMaxPairs];
#pragma unroll
  for (int k = 0; k < kMaxPairs; ++k) o[k] = 0.f;

  const int64_t kvd = int64_t(nkv) * hd;
  // Key t of the slot at kbase + cache.row(slot, t) * kvd (paged or flat, ops.h: CacheMap).
  const bf16* kbase = kc + int64_t(kh) * hd;
  const bf16* vbase = vc + int64_t(kh) * hd;
  const int k0 = row.lo + split * split_len, k1 = min(row.end, k0 + split_len);
  for (int t0 = k0; t0 < k1; t0 += T) {
    const int nt = min(T, k1 - t0);
    if constexpr (kVec) {
      // 16-byte asynchronous copies (cp.async, bypassing L1): every load of the tile is in
      // flight before the first one is waited for.
      const int cpr = hd / 8;  // 16-byte chunks per row
      for (int i = tid; i < nt * cpr; i += kThreads) {
        const int j = i / cpr, c = i % cpr;
        const int64_t off = cache.row(row.slot, t0 + j) * kvd + c * 8;
        cp_async16(ks + j * hdp + c * 8, kbase + off);
        cp_async16(vs + j * hdp + c * 8, vbase + off);
      }
      cp_async_commit();
      cp_async_wait<0>();
    } else {
      for (int i = tid; i < nt * hd; i += kThreads) {
        const int j = i / hd, d = i % hd;
        const int64_t off = cache.row(row.slot, t0 + j) * kvd + d;
        ks[j * hdp + d] = kbase[off];
        vs[j * hdp + d] = vbase[off];
      }
    }
    __syncthreads();
    // Scores of (head g, key j) pairs; keys past the tile or hidden by the tree are -inf.
    for (int i = tid; i < G * T; i += kThreads) {
      const int g = i / T, j = i % T, key = t0 + j;
      float sc = -INFINITY;
      bool visible = j < nt;
      if (visible && key >= row.len && row.mask >= 0) {
        const int a = key - row.len;
        visible = (masks[row.mask + a / 64] >> (a % 64)) & 1ull;
      }
      if (visible) {
        const float* q = qs + g * hd;
        const bf16* kr = ks + j * hdp;
        float d = 0.f;
        if constexpr (kVec) {
          for (int c = 0; c < hd; c += 8) {
            // 8 bf16 keys: the low half of each 32-bit word is the even element.
            const uint4 u = *reinterpret_cast<const uint4*>(kr + c);
            const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
            for (int e = 0; e < 4; ++e)
              d += q[c + 2 * e] * __uint_as_float(w[e] << 16) + q[c + 2 * e + 1] * __uint_as_float(w[e] & 0xffff0000u);
          }
        } else {
          for (int c = 0; c < hd; ++c) d += q[c] * __bfloat162float(kr[c]);
        }
        sc = d;
      }
      ps[i] = sc;
    }
    __syncthreads();
    // Online softmax: one warp per head updates max and sum and turns scores into weights.
    for (int g = warp; g < G; g += kThreads / kWarp) {
      float* pg = ps + g * T;
      float mx = -INFINITY;
      for (int j = lane; j < T; j += kWarp) mx = fmaxf(mx, pg[j]);
      mx = warp_max(mx);
      const float m_old = ms[g], m_new = fmaxf(m_old, mx);
      float sum = 0.f;
      for (int j = lane; j < T; j += kWarp) {
        const float p = m_new == -INFINITY ? 0.f : exp2f(pg[j] - m_new);
        pg[j] = p;
        sum += p;
      }
      sum = warp_sum(sum);
      if (lane == 0) {
        const float corr = m_old == -INFINITY ? 0.f : exp2f(m_old - m_new);
        cs[g] = corr;
        ls[g] = ls[g] * corr + sum;
        ms[g] = m_new;
      }
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kMaxPairs; ++k) {
      const int i = tid + k * kThreads;
      if (i < G * hd) {
        const int g = i / hd, d = i % hd;
        const float* pg = ps + g * T;
        float acc = o[k] * cs[g];
        for (int j = 0; j < nt; ++j) acc += pg[j] * __bfloat162float(vs[j * hdp + d]);
        o[k] = acc;
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int k = 0; k < kMaxPairs; ++k) {
    const int i = tid + k * kThreads;
    if (i < G * hd) {
      const int g = i / hd, d = i % hd;
      part[((int64_t(r) * nh + h0 + g) * n_splits + split) * (hd + 2) + d] = o[k];
    }
  }
  if (tid < G) {
    float* p = part + ((int64_t(r) * nh + h0 + tid) * n_splits + split) * (hd + 2) + hd;
    p[0] = ms[tid];
    p[1] = ls[tid];
  }
  if (counters == nullptr) return;  // decode_combine_kernel merges the splits
  // The last split block of (row, head block) to finish merges every split of its heads
  // (as decode_combine_kernel does), then re-arms the counter for the next launch.
  __shared__ int last;
  __threadfence();
  __syncthreads();
  int* counter = counters + int64_t(r) * gridDim.y + blockIdx.y;
  if (tid == 0) last = atomicAdd(counter, 1) == n_splits - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  // Each head's split weights exp2(m - M) / L into shared memory (the K tile's space, free
  // now: [G, n_splits] floats, within it by the launcher's check), one warp per head; then
  // every thread sums its (head, dim) outputs over the splits with independent loads.
  float* wts = reinterpret_cast<float*>(ks);
  for (int g = warp; g < G; g += kThreads / kWarp) {
    const float* p = part + (int64_t(r) * nh + h0 + g) * n_splits * (hd + 2);
    float M = -INFINITY;
    for (int z = lane; z < n_splits; z += kWarp) {
      const float m = __ldcg(p + z * (hd + 2) + hd);
      wts[g * n_splits + z] = m;
      M = fmaxf(M, m);
    }
    M = warp_max(M);
    float L = 0.f;
    for (int z = lane; z < n_splits; z += kWarp) {
      const float m = wts[g * n_splits + z];
      const float e = m == -INFINITY ? 0.f : exp2f(m - M);
      wts[g * n_splits + z] = e;
      L += __ldcg(p + z * (hd + 2) + hd + 1) * e;
    }
    L = warp_sum(L);
    __syncwarp();
    for (int z = lane; z < n_splits; z += kWarp) wts[g * n_splits + z] /= L;
  }
  __syncthreads();
  for (int i = tid; i < G * hd; i += kThreads) {
    const int g = i / hd, d = i % hd;
    const float* p = part + (int64_t(r) * nh + h0 + g) * n_splits * (hd + 2) + d;
    const float* wg = wts + g * n_splits;
    float acc = 0.f;
#pragma unroll 8
    for (int z = 0; z < n_splits; ++z) acc += __ldcg(p + z * (hd + 2)) * wg[z];
    out[(int64_t(r) * nh + h0 + g) * hd + d] = __float2bfloat16(acc);
  }
  if (tid == 0) *counter = 0;
}

constexpr int kPad = 8;  // bf16 elements of padding per shared row of the verify kernel
constexpr int kVerifyKeys = 64;  // keys per tile of the verify kernel

// Dynamic shared memory of verify_attention_kernel<D, S>: S stages of K and V tiles.
__host__ __device__ constexpr size_t verify_smem_bytes(int D, int S) { return size_t(2) * S * kVerifyKeys * (D + kPad) * 2; }

template <int D_, int S_>
struct VerifyShape {
  static constexpr int D = D_, S = S_;
};

// Key-tile stages of the verify kernel: double buffering. Three stages measured the same
// on the H200 (8B shape, 256 slots at 2048: 25.9 ms a step either way).
constexpr int kVerifyStages = 2;

// One warp's 16 query vectors (its A fragments qf; this lane's rows g and g + 8 have key
// ranges my_lo / my_end and tree masks my_mask) against NB blocks of 16 keys in shared memory
// (kt / vt: rows 0 .. 16 NB - 1, key key0 + j at row j; keys >= k1 are zero rows): S = QK^T on
// tensor cores, hidden keys to -inf, the online softmax (running max m_run and sum l_run of
// the lane's two rows, log2 domain), and O += P V with P as a hi + lo pair of bf16 terms.
template <int D, int NB>
__device__ __forceinline__ void attend_key_blocks(float (&o)[D / 8][4], float (&m_run)[2], float (&l_run)[2],
                                                  const uint32_t (&qf)[D / 16][4], const bf16 (*kt)[D + kPad],
                                                  const bf16 (*vt)[D + kPad], int key0, int k1, const int (&my_lo)[2],
                                                  const int (&my_end)[2], const int (&my_mask)[2], int len,
                                                  const uint64_t* masks, float scale_log2, int lane) {
  const int t = lane % 4;
  float sc[2 * NB][4];
#pragma unroll
  for (int i = 0; i < 2 * NB; ++i) sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = 0.f;
#pragma unroll
  for (int kc2 = 0; kc2 < D / 16; ++kc2) {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      uint32_t b0, b1, b2, b3;
      ldmatrix_x4(b0, b1, b2, b3, &kt[nb * 16 + (lane % 8) + 8 * (lane / 16)][kc2 * 16 + 8 * ((lane / 8) % 2)]);
      mma_bf16(sc[2 * nb], qf[kc2], b0, b1);
      mma_bf16(sc[2 * nb + 1], qf[kc2], b2, b3);
    }
  }
  float mx[2] = {-FLT_MAX, -FLT_MAX};
#pragma unroll
  for (int n8 = 0; n8 < 2 * NB; ++n8)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e / 2, key = key0 + n8 * 8 + 2 * t + (e % 2);
      bool visible = key < k1 && key >= my_lo[r] && key < my_end[r];
      if (visible && key >= len && my_mask[r] >= 0) {
        const int a = key - len;
        visible = (masks[my_mask[r] + a / 64] >> (a % 64)) & 1ull;
      }
      const float v = visible ? sc[n8][e] * scale_log2 : -INFINITY;
      sc[n8][e] = v;
      mx[r] = fmaxf(mx[r], v);
    }
  float corr[2];
  online_softmax_step(mx, m_run, l_run, corr);
  uint32_t pf[NB][4], pl[NB][4];
  probs_hi_lo(sc, m_run, l_run, pf, pl);  // hidden keys: exp2(-inf) = 0
  scale_rows(o, corr);
#pragma unroll
  for (int kc2 = 0; kc2 < NB; ++kc2) {
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t b0, b1, b2, b3;
      ldmatrix_x4_trans(b0, b1, b2, b3, &vt[kc2 * 16 + (lane % 8) + 8 * ((lane / 8) % 2)][dp * 16 + 8 * (lane / 16)]);
      mma_bf16(o[2 * dp], pf[kc2], b0, b1);
      mma_bf16(o[2 * dp + 1], pf[kc2], b2, b3);
      mma_bf16(o[2 * dp], pl[kc2], b0, b1);
      mma_bf16(o[2 * dp + 1], pl[kc2], b2, b3);
    }
  }
}

// Block (tile, kv head kh, split z): the tile's query vectors (decode_ops.h: AttentionTile)
// against keys [klo + z * split_len, ...) of the union [klo, kend) of its rows' key ranges
// (the last split runs to kend), in tiles of kKeys keys, S - 1 tiles loading ahead of the
// one in use. Each vector's keys are its row's: [lo, end), pending ones (>= len) only where
// its tree mask has the bit. The partial result goes to part as decode_attention_kernel
// writes it: unnormalised output, max (log2 domain of the scaled scores, -inf when no key
// was visible), sum.
// Two ways to share the work among the 4 warps:
// * a tile of more than 16 vectors: warp w takes vectors 16w .. 16w + 15 against every key
//   (warps past the tile's vectors only help with the loads);
// * a tile of at most 16 vectors (a lone row's query heads of one kv head, as in batched
//   decoding, or a short chain): every warp takes all of them, against its own quarter of
//   each key tile, and the four partial softmaxes merge at the end through shared memory.
template <int D, int S>
__global__ void __launch_bounds__(kThreads) verify_attention_kernel(
    float* part, const bf16* qkv, int64_t ld, const bf16* kc, const bf16* vc, const DecodeRow* rows,
    const uint64_t* masks, const AttentionTile* tiles, int nh, int nkv, CacheMap cache, int n_splits, int split_len,
    float scale_log2, bf16* out) {
  allow_dependents();
  grid_dependency_wait();  // launched dependent (launch.cuh)
  constexpr int kM = kTileVectors, kKeys = kVerifyKeys, kWarps = kThreads / 32;
  static_assert(kM <= kKeys && kKeys == 16 * kWarps, "the Q tile is staged in the first K buffer; 16 keys a warp");
  static_assert(verify_smem_bytes(D, S) >= size_t(kWarps * 16 * (D + 2)) * 4, "the split-keys merge fits the buffers");
  // S stages of K and V tiles in dynamic shared memory (verify_smem_bytes): ks[S][kKeys][D +
  // kPad], then vs likewise. Stage 0's K buffer stages the Q tile first; the split-keys merge
  // reuses the whole buffer at the end.
  extern __shared__ __align__(16) unsigned char vsmem[];
  auto ks = reinterpret_cast<bf16(*)[kKeys][D + kPad]>(vsmem);
  auto vs = reinterpret_cast<bf16(*)[kKeys][D + kPad]>(vsmem + size_t(S) * kKeys * (D + kPad) * sizeof(bf16));
  __shared__ int v_lo[kM], v_end[kM], v_mask[kM];
  __shared__ int s_range[2];
  const AttentionTile tile = tiles[blockIdx.x];
  const int kh = blockIdx.y, z = blockIdx.z, group = nh / nkv, nv = tile.n_rows * group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const bool split_keys = nv - tile.first_vector <= 16;
  const int qrow0 = split_keys ? 0 : warp * 16;  // this warp's first vector in the tile
  const DecodeRow first = rows[tile.first_row];
  const int len = first.len;
  const int64_t kvd = int64_t(nkv) * D;
  const bf16* kbase = kc + int64_t(kh) * D;  // key t at + cache.row(first.slot, t) * kvd
  const bf16* vbase = vc + int64_t(kh) * D;

  if (threadIdx.x == 0) {
    s_range[0] = INT_MAX;
    s_range[1] = 0;
  }
  __syncthreads();
  if (threadIdx.x < kM) {
    const int v = tile.first_vector + int(threadIdx.x);
    int lo = 0, end = 0, mask = -1;  // vectors past the group see no key
    if (v < nv) {
      const DecodeRow rw = rows[tile.first_row + v / group];
      lo = rw.lo, end = rw.end, mask = rw.mask;
      atomicMin(&s_range[0], lo);
      atomicMax(&s_range[1], end);
    }
    v_lo[threadIdx.x] = lo, v_end[threadIdx.x] = end, v_mask[threadIdx.x] = mask;
  }
  // The Q tile through the K buffer: vector v's head slice of its row (zero past the group).
  constexpr int kChunks = D / 8;
  for (int i = threadIdx.x; i < kM * kChunks; i += kThreads) {
    const int vi = i / kChunks, c = (i % kChunks) * 8, v = tile.first_vector + vi;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (v < nv)
      val = *reinterpret_cast<const uint4*>(qkv + int64_t(tile.first_row + v / group) * ld +
                                            int64_t(kh * group + v % group) * D + c);
    *reinterpret_cast<uint4*>(&ks[0][vi][c]) = val;
  }
  __syncthreads();
  const bool active = split_keys || tile.first_vector + qrow0 < nv;
  uint32_t qf[D / 16][4];
  if (active) {
#pragma unroll
    for (int kc2 = 0; kc2 < D / 16; ++kc2)
      ldmatrix_x4(qf[kc2][0], qf[kc2][1], qf[kc2][2], qf[kc2][3],
                  &ks[0][qrow0 + (lane % 8) + 8 * ((lane / 8) % 2)][kc2 * 16 + 8 * (lane / 16)]);
  }
  const int klo = s_range[0], kend = s_range[1];
  const int k0 = klo + z * split_len, k1 = z == n_splits - 1 ? kend : min(kend, k0 + split_len);
  // This thread's two vectors (rows g and g + 8 of its warp's 16).
  int my_lo[2], my_end[2], my_mask[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int vi = qrow0 + g + 8 * r;
    my_lo[r] = v_lo[vi], my_end[r] = v_end[vi], my_mask[r] = v_mask[vi];
  }
  __syncthreads();  // the Q tile is in registers; ks is free for keys

  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m_run[2] = {-FLT_MAX, -FLT_MAX}, l_run[2] = {0.f, 0.f};

  // Key tile `it` goes to stage it % S, S - 1 tiles ahead of the one in use, so that the
  // copies of the next tiles are in flight while this one is multiplied. Keys past k1 are
  // zero-filled, so that a masked key's value cannot turn 0 * v into NaN.
  const int n_iter = k1 > k0 ? (k1 - k0 + kKeys - 1) / kKeys : 0;
  auto load = [&](int it) {
    const int t0 = k0 + it * kKeys, nt = min(kKeys, k1 - t0), st = it % S;
    for (int i = threadIdx.x; i < kKeys * kChunks; i += kThreads) {
      const int j = i / kChunks, c = (i % kChunks) * 8;
      const int64_t off = cache.row(first.slot, j < nt ? t0 + j : t0) * kvd + c;
      cp_async16(&ks[st][j][c], kbase + off, j < nt);
      cp_async16(&vs[st][j][c], vbase + off, j < nt);
    }
  };
#pragma unroll
  for (int it = 0; it < S - 1; ++it) {
    if (it < n_iter) load(it);
    cp_async_commit();
  }
  for (int it = 0; it < n_iter; ++it) {
    const int t0 = k0 + it * kKeys, st = it % S;
    // Stage (it + S - 1) % S was last read in iteration it - 1, which ended in a barrier.
    if (it + S - 1 < n_iter) load(it + S - 1);
    cp_async_commit();
    cp_async_wait<S - 1>();  // this thread's copies of tile `it` have landed ...
    __syncthreads();         // ... and everyone's
    if (split_keys)
      attend_key_blocks<D, 1>(o, m_run, l_run, qf, ks[st] + warp * 16, vs[st] + warp * 16, t0 + warp * 16, k1, my_lo,
                              my_end, my_mask, len, masks, scale_log2, lane);
    else if (active)
      attend_key_blocks<D, kKeys / 16>(o, m_run, l_run, qf, ks[st], vs[st], t0, k1, my_lo, my_end, my_mask, len, masks,
                                       scale_log2, lane);
    __syncthreads();
  }
  cp_async_wait<0>();  // only empty groups can be left; the buffers are free from here on
  if (!active) return;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
  }
  auto row_head = [&](int vi) {  // vector vi of the tile: row * nh + its query head
    const int v = tile.first_vector + vi;
    return (int64_t(tile.first_row) + v / group) * nh + int64_t(kh) * group + v % group;
  };
  auto out_of = [&](int vi) { return part + (row_head(vi) * n_splits + z) * (D + 2); };  // its [D + 2] partial
  auto out_row = [&](int vi) { return out + row_head(vi) * D; };  // with `out`: its normalised [D] output
  if (!split_keys) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int vi = qrow0 + g + 8 * r;
      if (tile.first_vector + vi >= nv) continue;
      if (out) {
        bf16* q = out_row(vi);
        const float inv = l_run[r] > 0.f ? 1.f / l_run[r] : 0.f;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt)
          *reinterpret_cast<uint32_t*>(q + dt * 8 + 2 * t) = pack_bf16(o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv);
        continue;
      }
      float* p = out_of(vi);
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        p[dt * 8 + 2 * t] = o[dt][2 * r];
        p[dt * 8 + 2 * t + 1] = o[dt][2 * r + 1];
      }
      if (t == 0) {
        p[D] = l_run[r] > 0.f ? m_run[r] : -INFINITY;
        p[D + 1] = l_run[r];
      }
    }
    return;
  }
  // Split keys: warp w's [16, D] output and (max, sum) per vector into shared memory, then
  // each (vector, dim) sums the warps' outputs scaled by exp2(m_w - M) (0 for a warp that saw
  // no key of the vector).
  float* so = reinterpret_cast<float*>(vsmem);  // [kWarps][16][D]
  float* sm = so + kWarps * 16 * D;             // [kWarps][16] maxima, then [kWarps][16] sums
  float* sl = sm + kWarps * 16;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float* orow = so + (warp * 16 + g + 8 * r) * D;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      orow[dt * 8 + 2 * t] = o[dt][2 * r];
      orow[dt * 8 + 2 * t + 1] = o[dt][2 * r + 1];
    }
    if (t == 0) {
      sm[warp * 16 + g + 8 * r] = l_run[r] > 0.f ? m_run[r] : -INFINITY;
      sl[warp * 16 + g + 8 * r] = l_run[r];
    }
  }
  __syncthreads();
  const int n_out = min(16, nv - tile.first_vector);
  // Vector vi's maximum M over the warps, and its merged output dim d (d == D: the sum).
  auto merged = [&](int vi, int d, float& M) {
    M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm[w * 16 + vi]);
    float acc = 0.f;
    if (M != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float m = sm[w * 16 + vi];
        const float e = m == -INFINITY ? 0.f : exp2f(m - M);
        acc += e * (d < D ? so[(w * 16 + vi) * D + d] : sl[w * 16 + vi]);
      }
    }
    return acc;
  };
  if (out) {
    for (int i = threadIdx.x; i < n_out * D; i += kThreads) {
      const int vi = i / D, d = i % D;
      float M;
      const float acc = merged(vi, d, M), L = merged(vi, D, M);
      out_row(vi)[d] = __float2bfloat16(L > 0.f ? acc / L : 0.f);
    }
    return;
  }
  for (int i = threadIdx.x; i < n_out * (D + 2); i += kThreads) {
    const int vi = i / (D + 2), d = i % (D + 2);
    float M;
    const float acc = merged(vi, min(d, D), M);
    out_of(vi)[d] = d == D ? M : acc;
  }
}

// One block per (row, head): merges the splits' partial outputs by their maxima. The
// splits' (max, sum) pairs go to shared memory first (one load per thread, all in flight),
// then each thread sums its output dims over the splits with independent loads.
__global__ void decode_combine_kernel(bf16* out, const float* part, int hd, int n_splits) {
  allow_dependents();  // the o product prefetches its weights meanwhile (warp.cuh)
  grid_dependency_wait();  // launched dependent (launch.cuh)
  extern __shared__ float wsh[];  // [n_splits] weights, then 2 for M and L
  const int64_t rh = blockIdx.x;
  const float* p = part + rh * n_splits * (hd + 2);
  float m_local = -INFINITY;
  for (int s = threadIdx.x; s < n_splits; s += blockDim.x) {
    const float m = p[s * (hd + 2) + hd];
    wsh[s] = m;
    m_local = fmaxf(m_local, m);
  }
  __shared__ float red[32];
  m_local = warp_max(m_local);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = m_local;
  __syncthreads();
  float M = -INFINITY;
  for (int w = 0; w < int(blockDim.x / 32); ++w) M = fmaxf(M, red[w]);
  float l_local = 0.f;
  for (int s = threadIdx.x; s < n_splits; s += blockDim.x) {
    const float m = wsh[s];
    const float e = m == -INFINITY ? 0.f : exp2f(m - M);
    wsh[s] = e;
    l_local += p[s * (hd + 2) + hd + 1] * e;
  }
  __syncthreads();  // every thread has read red[] and written its weights
  l_local = warp_sum(l_local);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = l_local;
  __syncthreads();
  float L = 0.f;
  for (int w = 0; w < int(blockDim.x / 32); ++w) L += red[w];
  const float inv = 1.f / L;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0.f;
#pragma unroll 8
    for (int s = 0; s < n_splits; ++s) acc += p[s * (hd + 2) + d] * wsh[s];
    out[rh * hd + d] = __float2bfloat16(acc * inv);
  }
}

__global__ void offset_ids_kernel(int32_t* out, const int32_t* in, const int64_t* offsets, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = int32_t(in[i] + offsets[in[i]]);
}

__global__ void gather_rows_kernel(bf16* out, const bf16* in, const int32_t* idx, int64_t C) {
  const int64_t i = blockIdx.x;
  const bf16* src = in + int64_t(idx[i]) * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) out[i * C + c] = src[c];
}

// One block per buffer; pairs in order, a barrier between them.
__global__ void kv_move_kernel(bf16* const* caches, const int32_t* pairs, int64_t n_pairs, int64_t row_elems) {
  bf16* buf = caches[blockIdx.x];
  for (int64_t p = 0; p < n_pairs; ++p) {
    const bf16* src = buf + int64_t(pairs[2 * p]) * row_elems;
    bf16* dst = buf + int64_t(pairs[2 * p + 1]) * row_elems;
    for (int64_t i = threadIdx.x; i < row_elems; i += blockDim.x) dst[i] = src[i];
    __syncthreads();
  }
}

}  // namespace

DecodeSplits decode_splits(int64_t max_keys, int64_t N, int64_t nkv, int multiprocessors) {
  const int64_t T = kDecodeTile;
  int64_t pow2 = 1;
  while (pow2 * 2 <= max_keys) pow2 *= 2;
  const int64_t gran = std::max<int64_t>(256, pow2 / 8);
  const int64_t key_cap = (std::max<int64_t>(max_keys, 1) + gran - 1) / gran * gran;
  const int64_t n_tiles = key_cap / T;
  int64_t splits = std::clamp<int64_t>((4 * multiprocessors + N * nkv - 1) / (N * nkv), 1, n_tiles);
  const int64_t split_len = (n_tiles + splits - 1) / splits * T;
  splits = (key_cap + split_len - 1) / split_len;
  return {splits, split_len};
}

void kv_cache_write(bf16* kc, bf16* vc, const bf16* qkv, int64_t ld, const DecodeRow* rows, int64_t N, int64_t nh,
                    int64_t nkv, int64_t hd, CacheMap cache, cudaStream_t s) {
  if (N == 0) return;
  launch_dependent(kDependRope, kv_write_kernel, dim3(unsigned(N)), dim3(128), 0, s, kc, vc, qkv, ld, rows, nh, nkv, hd,
                   cache);
}

void rope_kv_cache_write(bf16* kc, bf16* vc, bf16* qkv, int64_t ld, const int32_t* pos, const float* inv_freq,
                         const DecodeRow* rows, int64_t N, int64_t nh, int64_t nkv, int64_t hd, CacheMap cache,
                         cudaStream_t s) {
  if (N == 0) return;
  // A thread per pair of up to 256 pairs a block, heads side by side: at 256 rows of the 8B
  // shape, a block per (row, head) spent 12 us a layer on 10,240 blocks of 64 threads.
  const int64_t tx = std::min<int64_t>(128, std::max<int64_t>(32, hd / 2)), ty = std::max<int64_t>(1, 256 / tx);
  const dim3 grid(unsigned(N), unsigned((nh + nkv + ty - 1) / ty));
  launch_dependent(kDependRope, rope_kv_write_kernel, grid, dim3(unsigned(tx), unsigned(ty)), 0, s, kc, vc, qkv, ld,
                   pos, inv_freq, rows, int(nh), int(nkv), int(hd), cache);
}

bool verify_attention_supported(int64_t hd) { return hd == 64 || hd == 128; }

bool verify_tiles_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("TALON_CUDA_VERIFY_TILES");
    return !(e && std::string(e) == "0");
  }();
  return on;
}

int64_t lone_tile_rows() {
  static const int64_t n = [] {
    const char* e = std::getenv("TALON_CUDA_LONE_TILES");
    if (!e || !*e) return kLoneTileRows;
    char* end = nullptr;
    const long long v = std::strtoll(e, &end, 10);
    if (*end != '\0' || v < 0) fail_msg(std::string("TALON_CUDA_LONE_TILES: expected a whole number >= 0, got '") + e + "'");
    return v == 0 ? std::numeric_limits<int64_t>::max() : int64_t(v);
  }();
  return n;
}

AttentionPlan plan_attention(const DecodeRow* rows, int64_t N, int64_t nh, int64_t nkv, int64_t hd, bool tiles_ok,
                             int multiprocessors, int64_t lone_tiles) {
  AttentionPlan p;
  tiles_ok = tiles_ok && verify_attention_supported(hd);
  const int64_t group = nkv > 0 ? nh / nkv : 1;
  auto group_end = [&](int64_t r) {
    int64_t e = r + 1;
    while (e < N && rows[e].slot == rows[r].slot && rows[e].len == rows[r].len) ++e;
    return e;
  };
  int64_t lone = 0;
  for (int64_t r = 0; r < N;) {
    const int64_t e = group_end(r);
    lone += e - r == 1;
    r = e;
  }
  const int64_t min_rows = lone >= lone_tiles ? 1 : 2;
  for (int64_t r = 0; r < N;) {
    const int64_t e = group_end(r);
    const int64_t n = e - r;
    if (tiles_ok && n >= min_rows) {
      int64_t lo = rows[r].lo, end = rows[r].end;
      for (int64_t i = r; i < e; ++i) lo = std::min<int64_t>(lo, rows[i].lo), end = std::max<int64_t>(end, rows[i].end);
      p.max_keys = std::max(p.max_keys, end - lo);
      for (int64_t v = 0; v < n * group; v += kTileVectors)
        p.tiles.push_back({int32_t(r), int32_t(n), int32_t(v), 0});
    } else {
      for (int64_t i = r; i < e; ++i) {
        p.single.push_back(int32_t(i));
        p.max_keys = std::max<int64_t>(p.max_keys, rows[i].end - rows[i].lo);
      }
    }
    r = e;
  }
  p.splits = decode_splits(p.max_keys, int64_t(p.single.size() + p.tiles.size()), nkv, multiprocessors);
  return p;
}

void decode_attention(bf16* out, float* part, const bf16* qkv, int64_t ld, const bf16* kc, const bf16* vc,
                      const DecodeRow* rows, const uint64_t* masks, int64_t N, int64_t nh, int64_t nkv, int64_t hd,
                      CacheMap cache, int64_t n_splits, int64_t split_len, cudaStream_t s, int* counters,
                      const AttentionWork* work) {
  if (N == 0) return;
  if (work && work->n_tiles > 0 && !verify_attention_supported(hd))
    fail_msg("verify attention: head_dim " + std::to_string(hd) + " unsupported");
  const int64_t n_rows_blocks = work ? work->n_single : N;
  const int32_t* row_idx = work ? work->single : nullptr;
  if (work) counters = nullptr;
  if (hd > 256) fail_msg("decode attention: head_dim " + std::to_string(hd) + " > 256 unsupported");
  // Query heads per block: the largest divisor of the group size with G * hd <= 2048 (at
  // most 8 heads), so each thread holds at most kMaxPairs outputs.
  const int64_t group = nh / nkv;
  int64_t G = 1;
  for (int64_t g = 1; g <= group; ++g)
    if (group % g == 0 && g * hd <= kMaxPairs * kThreads && g <= 8) G = g;
  const bool vec = hd % 8 == 0;
  const int64_t hdp = vec ? hd + 8 : hd + 2;
  const size_t smem = size_t((G * hd + G * kDecodeTile + 3 * G + 3) / 4 * 4) * 4 + size_t(2 * kDecodeTile * hdp) * 2;
  const dim3 grid(unsigned(n_rows_blocks), unsigned(nkv * (group / G)), unsigned(n_splits));
  auto launch = [&](auto kernel) {
    if (smem > 48 * 1024)
      CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    launch_dependent(kDependAttention, kernel, grid, dim3(kThreads), smem, s, part, qkv, ld, kc, vc, rows, masks,
                     int(nh), int(nkv), int(hd), cache, int(n_splits), int(split_len), int(G), out, counters, row_idx);
  };
  // The in-kernel merge keeps [G, n_splits] weights where the K tile was.
  if (counters && size_t(G * n_splits) * 4 > size_t(kDecodeTile * hdp) * 2) counters = nullptr;
  if (n_rows_blocks > 0) {
    if (vec) launch(decode_attention_kernel<true>);
    else launch(decode_attention_kernel<false>);
  }
  // Every row in tiles and one key split: the tiles write the normalised output themselves
  // and no combine pass runs (at 256 slots of the 8B shape the pass took 14 us a layer).
  const bool direct = work && work->n_single == 0 && n_splits == 1;
  if (work && work->n_tiles > 0) {
    if (ld % 8 != 0) fail_msg("verify attention: row stride must be a multiple of 8 elements");
    const dim3 tgrid(unsigned(work->n_tiles), unsigned(nkv), unsigned(n_splits));
    const float scale_log2 = float(1.0 / std::sqrt(double(hd)) * double(kLog2e));
    auto run = [&](auto tag) {
      constexpr int D = decltype(tag)::D, S = decltype(tag)::S;
      constexpr size_t smem = verify_smem_bytes(D, S);
      // Above 48 KiB a kernel must opt in: once per instantiation (not a stream operation,
      // so graph capture is unaffected).
      static const bool opted = [] {
        CUDA_CHECK(cudaFuncSetAttribute(verify_attention_kernel<D, S>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        int(smem)));
        return true;
      }();
      (void)opted;
      launch_dependent(kDependAttention, verify_attention_kernel<D, S>, tgrid, dim3(kThreads), smem, s, part, qkv, ld,
                       kc, vc, rows, masks, work->tiles, int(nh), int(nkv), cache, int(n_splits), int(split_len),
                       scale_log2, direct ? out : nullptr);
    };
    if (hd == 64) run(VerifyShape<64, kVerifyStages>{});
    else run(VerifyShape<128, kVerifyStages>{});
  }
  if (counters || direct) return;
  launch_dependent(kDependCombine, decode_combine_kernel, dim3(unsigned(N * nh)), dim3(hd > 64 ? 128 : 64),
                   size_t(n_splits) * 4, s, out, part, int(hd), int(n_splits));
}

void decode_combine(bf16* out, const float* part, int64_t rows_heads, int64_t hd, int64_t n_splits, cudaStream_t s) {
  if (rows_heads == 0) return;
  launch_dependent(kDependCombine, decode_combine_kernel, dim3(unsigned(rows_heads)), dim3(hd > 64 ? 128 : 64),
                   size_t(n_splits) * 4, s, out, part, int(hd), int(n_splits));
}

void offset_ids(int32_t* out, const int32_t* in, const int64_t* offsets, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  offset_ids_kernel<<<unsigned((n + 127) / 128), 128, 0, s>>>(out, in, offsets, n);
  CUDA_LAUNCH_CHECK();
}

void gather_rows(bf16* out, const bf16* in, const int32_t* idx, int64_t n, int64_t C, cudaStream_t s) {
  if (n == 0) return;
  gather_rows_kernel<<<unsigned(n), 256, 0, s>>>(out, in, idx, C);
  CUDA_LAUNCH_CHECK();
}

void kv_cache_move(bf16* const* caches, int64_t n_bufs, const int32_t* pairs, int64_t n_pairs, int64_t row_elems,
                   cudaStream_t s) {
  if (n_pairs == 0 || n_bufs == 0) return;
  kv_move_kernel<<<unsigned(n_bufs), 256, 0, s>>>(caches, pairs, n_pairs, row_elems);
  CUDA_LAUNCH_CHECK();
}

}  // namespace talon::cuda
