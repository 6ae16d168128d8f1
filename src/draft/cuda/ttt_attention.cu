// Fused tensor-core kernels for the causal part of the draft trainer's attention (see
// ttt_attention.h). The structure follows the engine's flash attention (attention.cu):
// 4 warps per block, 16 rows per warp, bf16 mma.sync m16n8k16 with fp32 accumulators, and
// score accumulators reused in registers as the A operand of the next product (the
// accumulator layout of two adjacent 8-column tiles is the A layout of one 16-wide k slice).
//  * forward, per (64-row query tile, head): online softmax over key tiles, O_c and lse_c;
//  * dq, per (query tile, head): S and dP recomputed per key tile, dQ += dS K0;
//  * dkv, per (64-row key tile, kv head): the key tile stays in shared memory while every
//    later query tile of the sample, for each head of the group, streams past it: S^T = K Q^T
//    and dP^T = V dO^T give P^T and dS^T, then dV += P^T dO and dK += dS^T Q. Each block owns
//    its key rows, so dK and dV are accumulated without atomics, and the result does not
//    depend on scheduling.
// Query-side kernels visit their tiles last-first (the longest rows first), the dkv kernel
// first-first (the keys with the most queries first), so the heavy blocks start early.
#include "draft/cuda/ttt_attention.h"

#include <cfloat>
#include <cmath>
#include <string>

#include "backend/cuda/check.h"
#include "backend/cuda/tensor_core.cuh"

namespace talon::cuda {

namespace {

using bf16 = __nv_bfloat16;
constexpr int kRows = 64;  // rows per tile: 16 per warp
constexpr int kThreads = 128;
constexpr int kPad = 8;  // bf16 elements of padding per shared-memory row (bank conflicts)
constexpr float kLog2e = 1.4426950408889634f;

// Rows [r0, r0 + R) of a head slice (D columns, row stride ld) into shared memory with row
// pitch D + kPad; rows at or past `rows` are zero.
template <int D>
__device__ __forceinline__ void stage(bf16* dst, const bf16* base, int64_t ld, int64_t r0, int64_t rows, int R) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  for (int i = threadIdx.x; i < R * kChunks; i += kThreads) {
    const int r = i / kChunks, c = (i % kChunks) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r0 + r < rows) v = *reinterpret_cast<const uint4*>(base + (r0 + r) * ld + c);
    *reinterpret_cast<uint4*>(dst + r * (D + kPad) + c) = v;
  }
}

// As stage(), through cp.async (no registers; completes at cp_async_wait): rows past `rows` are
// zero-filled by the copy itself.
template <int D>
__device__ __forceinline__ void stage_async(bf16* dst, const bf16* base, int64_t ld, int64_t r0, int64_t rows, int R) {
  constexpr int kChunks = D / 8;
  for (int i = threadIdx.x; i < R * kChunks; i += kThreads) {
    const int r = i / kChunks, c = (i % kChunks) * 8;
    const bool in = r0 + r < rows;
    const bf16* src = in ? base + (r0 + r) * ld + c : base;
    cp_async16(dst + r * (D + kPad) + c, src, in);
  }
}

// A fragment (16 x 16, rows row0.., k slice kc) from a row-major tile in shared memory.
template <int D>
__device__ __forceinline__ void frag_a(uint32_t (&f)[4], const bf16* sm, int row0, int kc, int lane) {
  ldmatrix_x4(f[0], f[1], f[2], f[3],
              sm + (row0 + (lane % 8) + 8 * ((lane / 8) % 2)) * (D + kPad) + kc * 16 + 8 * (lane / 16));
}

// acc[n-tile][4] += A B^T for the NT/8 n-tiles whose rows of B are sm's rows 0..NT (B's k
// dimension along sm's columns): the score product S = Q K^T with K's rows in shared memory.
template <int D, int NT>
__device__ __forceinline__ void scores(float (&acc)[NT / 8][4], const uint32_t (*a)[4], const bf16* sm, int lane) {
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc)
#pragma unroll
    for (int nb = 0; nb < NT / 16; ++nb) {
      uint32_t b0, b1, b2, b3;
      ldmatrix_x4(b0, b1, b2, b3, sm + (nb * 16 + (lane % 8) + 8 * (lane / 16)) * (D + kPad) + kc * 16 + 8 * ((lane / 8) % 2));
      mma_bf16(acc[2 * nb], a[kc], b0, b1);
      mma_bf16(acc[2 * nb + 1], a[kc], b2, b3);
    }
}

// acc[D/8][4] += A X with A given as KT/16 register fragments (k = sm's rows 0..KT) and X
// the row-major tile in shared memory: O += P V, dQ += dS K, dV += P^T dO, dK += dS^T Q.
template <int D, int KT>
__device__ __forceinline__ void times_tile(float (&acc)[D / 8][4], const uint32_t (*a)[4], const bf16* sm, int lane) {
#pragma unroll
  for (int kc = 0; kc < KT / 16; ++kc)
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t b0, b1, b2, b3;
      ldmatrix_x4_trans(b0, b1, b2, b3,
                        sm + (kc * 16 + (lane % 8) + 8 * ((lane / 8) % 2)) * (D + kPad) + dp * 16 + 8 * (lane / 16));
      mma_bf16(acc[2 * dp], a[kc], b0, b1);
      mma_bf16(acc[2 * dp + 1], a[kc], b2, b3);
    }
}

// Accumulators of NT columns as KT = NT A fragments (bf16).
template <int NT>
__device__ __forceinline__ void to_frags(uint32_t (&f)[NT / 16][4], const float (&x)[NT / 8][4]) {
#pragma unroll
  for (int nt = 0; nt < NT / 8; ++nt) {
    f[nt / 2][(nt % 2) * 2 + 0] = pack_bf16(x[nt][0], x[nt][1]);
    f[nt / 2][(nt % 2) * 2 + 1] = pack_bf16(x[nt][2], x[nt][3]);
  }
}

template <int N1, int N2>
__device__ __forceinline__ void zero(float (&x)[N1][N2]) {
#pragma unroll
  for (int i = 0; i < N1; ++i)
#pragma unroll
    for (int j = 0; j < N2; ++j) x[i][j] = 0.f;
}

// Rows [r0, r0 + 64) of a head slice as this warp's A fragments (its 16 rows), staged
// through the shared tile sm.
template <int D>
__device__ __forceinline__ void load_frags(uint32_t (&f)[D / 16][4], bf16* sm, const bf16* base, int64_t ld,
                                           int64_t r0, int64_t rows, int warp, int lane) {
  stage<D>(sm, base, ld, r0, rows, kRows);
  __syncthreads();
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc) frag_a<D>(f[kc], sm, warp * 16, kc, lane);
  __syncthreads();
}

// Key and value tiles [j0, j0 + TN) for j0 = 0, TN, ... up to row `last`, through double
// buffers kb, vb ([2][TN][D + kPad] each): the next tile's copies run while body(j0, ks, vs)
// uses this one.
template <int D, int TN, class Body>
__device__ __forceinline__ void stream_kv(bf16* kb, bf16* vb, const bf16* kbase, const bf16* vbase, int64_t kvd,
                                          int64_t len, int64_t last, Body&& body) {
  constexpr int64_t kBuf = int64_t(TN) * (D + kPad);
  const int64_t n_it = last / TN + 1;
  stage_async<D>(kb, kbase, kvd, 0, len, TN);
  stage_async<D>(vb, vbase, kvd, 0, len, TN);
  cp_async_commit();
  for (int64_t it = 0; it < n_it; ++it) {
    const int64_t j0 = it * TN;
    const int buf = int(it & 1);
    if (it + 1 < n_it) {
      stage_async<D>(kb + (buf ^ 1) * kBuf, kbase, kvd, j0 + TN, len, TN);
      stage_async<D>(vb + (buf ^ 1) * kBuf, vbase, kvd, j0 + TN, len, TN);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    body(j0, kb + buf * kBuf, vb + buf * kBuf);
    __syncthreads();  // before the next iteration's copies overwrite this buffer
  }
}

struct Tile {
  int64_t s0, len, r0;  // the sample's first row and length; the tile's first row in it
};
__device__ __forceinline__ Tile tile_at(const TttFlashArgs& a, int64_t i) {
  const int seq = a.tiles[2 * i];
  const int64_t s0 = a.seq_start[seq];
  return {s0, a.seq_start[seq + 1] - s0, a.tiles[2 * i + 1]};
}

// ------------------------------------------------------------------ forward
// Shared memory of the query-side kernels: key and value tiles, double buffered (the next
// tile's copies run while this one is used); the first two key buffers also stage Q (and dO).
template <int D, int TN>
constexpr size_t query_side_smem() {
  static_assert(2 * TN >= kRows, "the key buffers stage a query tile");
  return size_t(4 * TN) * (D + kPad) * sizeof(bf16);
}

template <int D, int TN>
__global__ void __launch_bounds__(kThreads) forward_kernel(float* out, float* lse, TttFlashArgs a, float scale_log2) {
  static_assert(TN % 16 == 0 && TN <= kRows, "key tile");
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* kb = reinterpret_cast<bf16*>(smem);  // [2][TN][D + kPad]
  bf16* vb = kb + 2 * TN * (D + kPad);
  const Tile tl = tile_at(a, a.n_tiles - 1 - blockIdx.x);
  const int64_t s0 = tl.s0, len = tl.len, q0 = tl.r0;
  const int h = blockIdx.y, kh = h / (a.nh / a.nkv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t qd = int64_t(a.nh) * D, kvd = int64_t(a.nkv) * D;
  const bf16* kbase = a.k0 + s0 * kvd + int64_t(kh) * D;
  const bf16* vbase = a.v0 + s0 * kvd + int64_t(kh) * D;

  uint32_t qf[D / 16][4];
  load_frags<D>(qf, kb, a.q + s0 * qd + int64_t(h) * D, qd, q0, len, warp, lane);

  float o[D / 8][4];
  zero(o);
  float m_run[2] = {-FLT_MAX, -FLT_MAX}, l_run[2] = {0.f, 0.f};
  const int64_t qi[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
  const int64_t q_last = (q0 + kRows < len ? q0 + kRows : len) - 1;
  stream_kv<D, TN>(kb, vb, kbase, vbase, kvd, len, q_last, [&](int64_t j0, const bf16* ks, const bf16* vs) {
    float s[TN / 8][4];
    zero(s);
    scores<D, TN>(s, qf, ks, lane);
    const bool need_mask = j0 + TN - 1 > q0 || j0 + TN > len;
    float mx[2] = {-FLT_MAX, -FLT_MAX};
#pragma unroll
    for (int nt = 0; nt < TN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2;
        float v = s[nt][e] * scale_log2;
        if (need_mask) {
          const int64_t kj = j0 + nt * 8 + 2 * t + (e % 2);
          if (kj > qi[r] || kj >= len) v = -INFINITY;
        }
        s[nt][e] = v;
        mx[r] = fmaxf(mx[r], v);
      }
    float corr[2];
    online_softmax_step(mx, m_run, l_run, corr);
#pragma unroll
    for (int nt = 0; nt < TN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[nt][e] = exp2f(s[nt][e] - m_run[e / 2]);  // masked: exp2(-inf) = 0
        l_run[e / 2] += s[nt][e];
      }
    scale_rows(o, corr);
    uint32_t pf[TN / 16][4];
    to_frags<TN>(pf, s);
    times_tile<D, TN>(o, pf, vs, lane);
  });
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (qi[r] >= len) continue;
    const float inv = 1.f / l_run[r];
    float* op = out + (s0 + qi[r]) * qd + int64_t(h) * D;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      *reinterpret_cast<float2*>(op + dt * 8 + 2 * t) = make_float2(o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv);
    if (t == 0) lse[(s0 + qi[r]) * a.nh + h] = (m_run[r] + log2f(l_run[r])) / kLog2e;
  }
}

// ------------------------------------------------------------------ dq
template <int D, int TN>
__global__ void __launch_bounds__(kThreads) dq_kernel(float* dq, const float* lse, const float* Dd, TttFlashArgs a,
                                                      float scale_log2, float scale) {
  static_assert(TN % 16 == 0 && TN <= kRows, "key tile");
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* kb = reinterpret_cast<bf16*>(smem);  // [2][TN][D + kPad]; stages Q and dO first
  bf16* vb = kb + 2 * TN * (D + kPad);
  const Tile tl = tile_at(a, a.n_tiles - 1 - blockIdx.x);
  const int64_t s0 = tl.s0, len = tl.len, q0 = tl.r0;
  const int h = blockIdx.y, kh = h / (a.nh / a.nkv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t qd = int64_t(a.nh) * D, kvd = int64_t(a.nkv) * D;
  const bf16* kbase = a.k0 + s0 * kvd + int64_t(kh) * D;
  const bf16* vbase = a.v0 + s0 * kvd + int64_t(kh) * D;

  uint32_t qf[D / 16][4], of[D / 16][4];
  load_frags<D>(qf, kb, a.q + s0 * qd + int64_t(h) * D, qd, q0, len, warp, lane);
  load_frags<D>(of, kb, a.dO + s0 * qd + int64_t(h) * D, qd, q0, len, warp, lane);

  const int64_t qi[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
  float l2[2], dr[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const bool in = qi[r] < len;
    l2[r] = in ? lse[(s0 + qi[r]) * a.nh + h] * kLog2e : INFINITY;
    dr[r] = in ? Dd[(s0 + qi[r]) * a.nh + h] : 0.f;
  }
  float acc[D / 8][4];
  zero(acc);
  const int64_t q_last = (q0 + kRows < len ? q0 + kRows : len) - 1;
  stream_kv<D, TN>(kb, vb, kbase, vbase, kvd, len, q_last, [&](int64_t j0, const bf16* ks, const bf16* vs) {
    float s[TN / 8][4], dp[TN / 8][4];
    zero(s);
    zero(dp);
    scores<D, TN>(s, qf, ks, lane);
    scores<D, TN>(dp, of, vs, lane);
#pragma unroll
    for (int nt = 0; nt < TN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2;
        const int64_t kj = j0 + nt * 8 + 2 * t + (e % 2);
        const float p = kj <= qi[r] && kj < len ? exp2f(s[nt][e] * scale_log2 - l2[r]) : 0.f;
        s[nt][e] = p * (dp[nt][e] - dr[r]) * scale;  // dS
      }
    uint32_t sf[TN / 16][4];
    to_frags<TN>(sf, s);
    times_tile<D, TN>(acc, sf, ks, lane);
  });
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (qi[r] >= len) continue;
    float* op = dq + (s0 + qi[r]) * qd + int64_t(h) * D;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      *reinterpret_cast<float2*>(op + dt * 8 + 2 * t) = make_float2(acc[dt][2 * r], acc[dt][2 * r + 1]);
  }
}

// ------------------------------------------------------------------ dK, dV
// One block per (key tile, kv head, head of its group): the group's heads are split over
// blocks for balance (the first key tiles meet every later query), each writing its own
// partial dK/dV, which dkv_sum_kernel then adds up in a fixed order.
template <int D, int TQ>
constexpr size_t dkv_smem() {
  return size_t(2 * kRows + 4 * TQ) * (D + kPad) * sizeof(bf16) + 4 * TQ * sizeof(float);
}

template <int D, int TQ>
__global__ void __launch_bounds__(kThreads) dkv_kernel(float* part, const float* lse, const float* Dd, TttFlashArgs a,
                                                       float scale_log2, float scale) {
  static_assert(TQ % 16 == 0 && TQ <= kRows && kRows % TQ == 0, "query tile");
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* ksm = reinterpret_cast<bf16*>(smem);
  bf16* vsm = ksm + kRows * (D + kPad);
  bf16* qb = vsm + kRows * (D + kPad);  // [2][TQ][D + kPad]
  bf16* ob = qb + 2 * TQ * (D + kPad);  // [2][TQ][D + kPad]
  float* lb = reinterpret_cast<float*>(ob + 2 * TQ * (D + kPad));  // [2][TQ]
  float* db = lb + 2 * TQ;                                          // [2][TQ]
  const Tile tl = tile_at(a, blockIdx.x);
  const int64_t s0 = tl.s0, len = tl.len, k0 = tl.r0;
  const int kh = blockIdx.y, grp = a.nh / a.nkv, hg = blockIdx.z, h = kh * grp + hg;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t qd = int64_t(a.nh) * D, kvd = int64_t(a.nkv) * D;
  const bf16* qbase = a.q + s0 * qd + int64_t(h) * D;
  const bf16* obase = a.dO + s0 * qd + int64_t(h) * D;
  const int64_t kr[2] = {k0 + warp * 16 + g, k0 + warp * 16 + g + 8};
  // The next query tile's copies (cp.async), and its rows' lse and D: thread i < TQ reads
  // row i's into registers when the tile's copies are issued and stores them (lse in the
  // log2 domain) only after the current tile's products, so the loads' latency is hidden
  // behind them instead of stalling the block.
  static_assert(TQ <= kThreads, "one thread per query row of a tile");
  const auto issue = [&](int64_t i0, int buf) {
    stage_async<D>(qb + buf * TQ * (D + kPad), qbase, qd, i0, len, TQ);
    stage_async<D>(ob + buf * TQ * (D + kPad), obase, qd, i0, len, TQ);
  };
  float l_next = 0.f, d_next = 0.f;
  bool in_next = false;
  const auto fetch = [&](int64_t i0) {
    const int i = threadIdx.x;
    in_next = i < TQ && i0 + i < len;
    if (in_next) {
      l_next = lse[(s0 + i0 + i) * a.nh + h];
      d_next = Dd[(s0 + i0 + i) * a.nh + h];
    }
  };
  const auto put = [&](int buf) {
    if (threadIdx.x < TQ) {
      lb[buf * TQ + threadIdx.x] = in_next ? l_next * kLog2e : INFINITY;
      db[buf * TQ + threadIdx.x] = in_next ? d_next : 0.f;
    }
  };
  stage_async<D>(ksm, a.k0 + s0 * kvd + int64_t(kh) * D, kvd, k0, len, kRows);
  stage_async<D>(vsm, a.v0 + s0 * kvd + int64_t(kh) * D, kvd, k0, len, kRows);
  issue(k0, 0);
  cp_async_commit();
  fetch(k0);
  put(0);
  float dk[D / 8][4], dv[D / 8][4];
  zero(dk);
  zero(dv);
  const int64_t n_it = (len - k0 + TQ - 1) / TQ;
  for (int64_t it = 0; it < n_it; ++it) {
    const int64_t i0 = k0 + it * TQ;
    const int buf = int(it & 1);
    if (it + 1 < n_it) {
      issue(i0 + TQ, buf ^ 1);
      cp_async_commit();
      fetch(i0 + TQ);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16* qs = qb + buf * TQ * (D + kPad);
    const bf16* os = ob + buf * TQ * (D + kPad);
    const float* ls = lb + buf * TQ;
    const float* dsm = db + buf * TQ;
    float s[TQ / 8][4], dp[TQ / 8][4];
    zero(s);
    zero(dp);
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
      uint32_t af[1][4];
      frag_a<D>(af[0], ksm, warp * 16, kc, lane);
#pragma unroll
      for (int nb = 0; nb < TQ / 16; ++nb) {
        uint32_t b0, b1, b2, b3;
        ldmatrix_x4(b0, b1, b2, b3, qs + (nb * 16 + (lane % 8) + 8 * (lane / 16)) * (D + kPad) + kc * 16 + 8 * ((lane / 8) % 2));
        mma_bf16(s[2 * nb], af[0], b0, b1);
        mma_bf16(s[2 * nb + 1], af[0], b2, b3);
      }
      frag_a<D>(af[0], vsm, warp * 16, kc, lane);
#pragma unroll
      for (int nb = 0; nb < TQ / 16; ++nb) {
        uint32_t b0, b1, b2, b3;
        ldmatrix_x4(b0, b1, b2, b3, os + (nb * 16 + (lane % 8) + 8 * (lane / 16)) * (D + kPad) + kc * 16 + 8 * ((lane / 8) % 2));
        mma_bf16(dp[2 * nb], af[0], b0, b1);
        mma_bf16(dp[2 * nb + 1], af[0], b2, b3);
      }
    }
    // s: P^T, dp: dS^T (rows: this warp's keys; columns: the tile's queries).
#pragma unroll
    for (int nt = 0; nt < TQ / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qc = nt * 8 + 2 * t + (e % 2);
        const float p = i0 + qc >= kr[e / 2] ? exp2f(s[nt][e] * scale_log2 - ls[qc]) : 0.f;
        s[nt][e] = p;
        dp[nt][e] = p * (dp[nt][e] - dsm[qc]) * scale;
      }
    uint32_t pf[TQ / 16][4], sf[TQ / 16][4];
    to_frags<TQ>(pf, s);
    to_frags<TQ>(sf, dp);
    times_tile<D, TQ>(dv, pf, os, lane);
    times_tile<D, TQ>(dk, sf, qs, lane);
    if (it + 1 < n_it) put(buf ^ 1);  // read by the next iteration, after the barrier
    __syncthreads();  // before the next iteration's copies overwrite this buffer
  }
  // part: [2][grp][N][nkv * D], dK partials then dV partials.
  const int64_t plane = a.n_rows * kvd;
  float* pk = part + int64_t(hg) * plane;
  float* pv = part + int64_t(grp + hg) * plane;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (kr[r] >= len) continue;
    const int64_t o = (s0 + kr[r]) * kvd + int64_t(kh) * D;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      *reinterpret_cast<float2*>(pk + o + dt * 8 + 2 * t) = make_float2(dk[dt][2 * r], dk[dt][2 * r + 1]);
      *reinterpret_cast<float2*>(pv + o + dt * 8 + 2 * t) = make_float2(dv[dt][2 * r], dv[dt][2 * r + 1]);
    }
  }
}

// dK[i] += sum_g part[0][g][i], dV[i] += sum_g part[1][g][i], heads in order.
__global__ void dkv_sum_kernel(float* dK, float* dV, const float* part, int64_t plane, int grp) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= plane) return;
  float k = dK[i], v = dV[i];
  for (int g = 0; g < grp; ++g) {
    k += part[int64_t(g) * plane + i];
    v += part[int64_t(grp + g) * plane + i];
  }
  dK[i] = k;
  dV[i] = v;
}

void check_args(const TttFlashArgs& a) {
  if (!ttt_flash_supported(a.hd))
    fail_msg("draft attention: head_dim " + std::to_string(a.hd) + " unsupported by the fused kernels");
  if (a.nkv <= 0 || a.nh % a.nkv != 0) fail_msg("draft attention: heads not a multiple of kv heads");
}

// Calls f with std::integral_constant<int, hd> for the supported head sizes.
template <class F>
void with_hd(int hd, F&& f) {
  switch (hd) {
    case 16: f(std::integral_constant<int, 16>{}); break;
    case 32: f(std::integral_constant<int, 32>{}); break;
    case 48: f(std::integral_constant<int, 48>{}); break;
    case 64: f(std::integral_constant<int, 64>{}); break;
    case 80: f(std::integral_constant<int, 80>{}); break;
    case 96: f(std::integral_constant<int, 96>{}); break;
    case 112: f(std::integral_constant<int, 112>{}); break;
    default: f(std::integral_constant<int, 128>{}); break;
  }
}

}  // namespace

bool ttt_flash_supported(int64_t hd) { return hd > 0 && hd <= 128 && hd % 16 == 0; }

std::vector<int32_t> ttt_flash_tiles(const std::vector<std::pair<int64_t, int64_t>>& seqs) {
  std::vector<int32_t> t;
  for (size_t s = 0; s < seqs.size(); ++s)
    for (int64_t r = 0; r < seqs[s].second; r += kRows) {
      t.push_back(int32_t(s));
      t.push_back(int32_t(r));
    }
  return t;
}

void ttt_flash_forward(float* out, float* lse, const TttFlashArgs& a, cudaStream_t s) {
  if (a.n_tiles == 0) return;
  check_args(a);
  const dim3 grid(unsigned(a.n_tiles), unsigned(a.nh));
  const float sl2 = a.scale * kLog2e;
  with_hd(a.hd, [&](auto hd) {
    constexpr int Dh = decltype(hd)::value;
    constexpr size_t bytes = query_side_smem<Dh, 64>();
    CUDA_CHECK(cudaFuncSetAttribute(forward_kernel<Dh, 64>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    forward_kernel<Dh, 64><<<grid, kThreads, bytes, s>>>(out, lse, a, sl2);
  });
  CUDA_LAUNCH_CHECK();
}

void ttt_flash_dq(float* dq, const float* lse, const float* D, const TttFlashArgs& a, cudaStream_t s) {
  if (a.n_tiles == 0) return;
  check_args(a);
  const dim3 grid(unsigned(a.n_tiles), unsigned(a.nh));
  const float sl2 = a.scale * kLog2e;
  with_hd(a.hd, [&](auto hd) {
    constexpr int Dh = decltype(hd)::value;
    constexpr int TN = Dh > 64 ? 32 : 64;  // registers: Q, dO, dQ and two score tiles per warp
    constexpr size_t bytes = query_side_smem<Dh, TN>();
    CUDA_CHECK(cudaFuncSetAttribute(dq_kernel<Dh, TN>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    dq_kernel<Dh, TN><<<grid, kThreads, bytes, s>>>(dq, lse, D, a, sl2, a.scale);
  });
  CUDA_LAUNCH_CHECK();
}

void ttt_flash_dkv(float* dK, float* dV, float* part, const float* lse, const float* D, const TttFlashArgs& a,
                   cudaStream_t s) {
  if (a.n_tiles == 0) return;
  check_args(a);
  const int grp = a.nh / a.nkv;
  const dim3 grid(unsigned(a.n_tiles), unsigned(a.nkv), unsigned(grp));
  const float sl2 = a.scale * kLog2e;
  with_hd(a.hd, [&](auto hd) {
    constexpr int Dh = decltype(hd)::value;
    constexpr int TQ = 32;
    constexpr size_t bytes = dkv_smem<Dh, TQ>();
    CUDA_CHECK(cudaFuncSetAttribute(dkv_kernel<Dh, TQ>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    dkv_kernel<Dh, TQ><<<grid, kThreads, bytes, s>>>(part, lse, D, a, sl2, a.scale);
  });
  CUDA_LAUNCH_CHECK();
  const int64_t plane = a.n_rows * a.nkv * a.hd;
  dkv_sum_kernel<<<unsigned((plane + 255) / 256), 256, 0, s>>>(dK, dV, part, plane, grp);
  CUDA_LAUNCH_CHECK();
}

}  // namespace talon::cuda
