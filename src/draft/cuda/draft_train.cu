#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "backend/cuda/check.h"
#include "backend/cuda/cudnn_sdpa.h"
#include "util/threads.h"
#include "backend/cuda/device.h"
#include "backend/cuda/lt_products.h"
#include "draft/batch_tokens.h"
#include "draft/cuda/draft_engine.h"
#include "draft/cuda/ttt_attention.h"
#include "draft/cuda/train_kernels.cuh"
#include "backend/cuda/kernels/cast.cuh"
#include "backend/cuda/kernels/convert.cuh"
#include "backend/cuda/kernels/reduce.cuh"
#include "backend/cuda/kernels/rmsnorm.cuh"
#include "backend/cuda/kernels/rope.cuh"
#include "backend/cuda/kernels/swiglu.cuh"
#include "backend/cuda/warp.cuh"

namespace talon::cuda {

std::vector<int64_t> draft_tensor_sizes(const DraftDims& d) {
  const int64_t qd = d.nh * d.hd, kvd = d.nkv * d.hd, H = d.H;
  // fc, in_ln, hidden_norm, wq, wk, wv, wo, post_ln, gate, up, down, norm, lm_head
  std::vector<int64_t> n = {H * 3 * H, H, H, qd * 2 * H, kvd * 2 * H, kvd * 2 * H, H * qd, H, d.I * H, d.I * H, H * d.I,
                            H, d.Vd * H};
  if (d.peagle) n.insert(n.end(), {3 * H, d.V * H});  // mask_hidden, embed
  return n;
}

namespace {

enum T : int { FC, IN_LN, HNORM, WQ, WK, WV, WO, POST_LN, GATE, UP, DOWN, NORM, LM, MASKH, EMBED };



// Merges every thread's (maximum, sum of exp relative to it, first index of the maximum)
// into the whole block's; every thread gets the result.
__device__ void merge_softmax_state(float& m, float& z, int64_t& i, float om, float oz, int64_t oi) {
  if (om == -INFINITY) return;  // the other part saw nothing
  if (m == -INFINITY) {
    m = om, z = oz, i = oi;
    return;
  }
  const float M = fmaxf(m, om);
  z = z * expf(m - M) + oz * expf(om - M);
  if (om > m || (om == m && oi < i)) i = oi;
  m = M;
}
// One value x at index c into a softmax state (maximum m, sum z of exp relative to it, first
// index of the maximum): the sum is rescaled whenever the maximum grows.
__device__ __forceinline__ void softmax_visit(float x, int64_t c, float& m, float& z, int64_t& i) {
  if (x > m) {
    z = z * expf(m - x) + 1.f;
    m = x;
    i = c;
  } else {
    z += expf(x - m);
  }
}
__device__ void block_softmax_state(float& m, float& z, int64_t& i, float* shm, float* shz, int64_t* shi) {
  for (int o = 16; o > 0; o >>= 1)
    merge_softmax_state(m, z, i, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, z, o),
                        __shfl_xor_sync(0xffffffffu, i, o));
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = blockDim.x >> 5;
  __syncthreads();
  if (l == 0) shm[w] = m, shz[w] = z, shi[w] = i;
  __syncthreads();
  if (w == 0) {
    m = l < nw ? shm[l] : -INFINITY;
    z = l < nw ? shz[l] : 0.f;
    i = l < nw ? shi[l] : INT64_MAX;
    for (int o = 16; o > 0; o >>= 1)
      merge_softmax_state(m, z, i, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, z, o),
                          __shfl_xor_sync(0xffffffffu, i, o));
    if (l == 0) shm[32] = m, shz[32] = z, shi[32] = i;
  }
  __syncthreads();
  m = shm[32], z = shz[32], i = shi[32];
}

// The bits of bf16(x) on the host, rounded to nearest even like __float2bfloat16_rn (NaN kept a NaN).
uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// ---------------------------------------------------------------- row ops
// dst[r] = table[toks[r]] for rows of H bf16 values, the table in mapped host memory (read over
// the bus): 16-byte loads where the rows allow, else 2-byte ones.
__global__ void host_rows_kernel(__nv_bfloat16* dst, const uint16_t* table, const int32_t* toks, int64_t H) {
  const int64_t r = blockIdx.x;
  const uint16_t* src = table + int64_t(toks[r]) * H;
  uint16_t* out = reinterpret_cast<uint16_t*>(dst) + r * H;
  if (H % 8 == 0) {
    const uint4* s4 = reinterpret_cast<const uint4*>(src);
    uint4* d4 = reinterpret_cast<uint4*>(out);
    for (int64_t i = threadIdx.x; i < H / 8; i += blockDim.x) d4[i] = s4[i];
  } else {
    for (int64_t i = threadIdx.x; i < H; i += blockDim.x) out[i] = src[i];
  }
}

// E[n, :] = embed[token fed at step k]: x[t+1+k] of the row's own sample, 0 past its end. With
// rowmap, E's row n is the batch row rowmap[n] (the compacted rows of a step after the first).
template <class Emb>
__global__ void gather_kernel(float* E, const Emb* embed, const int32_t* ids, const int32_t* pos,
                              const int32_t* len, int64_t H, int k, int32_t fixed, const int32_t* rowmap) {
  const int64_t n = blockIdx.x, r = rowmap ? rowmap[n] : n;
  const int tp = pos[r] + 1 + k;
  // P-EAGLE (fixed >= 0): the mask token at every step after the first.
  const int64_t tok = k > 0 && fixed >= 0 ? fixed : tp < len[r] ? ids[r + 1 + k] : 0;
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) E[n * H + c] = load_f(embed + tok * H + c);
}

// out[0..n) = bf16(in[0..n)), rounded to nearest even (the rounding cuBLAS applies to fp32
// operands under CUBLAS_COMPUTE_32F_FAST_16BF).
void cast_bf16(__nv_bfloat16* out, const float* in, int64_t n, cudaStream_t s) { cast(out, in, n, s); }


// out[i, :] = x[rows[i], :] for one block per i (C columns).
template <class Out>
__global__ void rows_gather_kernel(Out* out, const float* x, const int32_t* rows, int64_t C) {
  const float* xr = x + int64_t(rows[blockIdx.x]) * C;
  Out* o = out + int64_t(blockIdx.x) * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) store_as(o + c, xr[c]);
}

// out[n, :] = y[slot[n], :], or 0 where slot[n] < 0, for one block per row n (C columns).
__global__ void rows_scatter_kernel(float* out, const float* y, const int32_t* slot, int64_t C) {
  const int32_t j = slot[blockIdx.x];
  float* o = out + int64_t(blockIdx.x) * C;
  const float* yr = y + int64_t(j < 0 ? 0 : j) * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) o[c] = j < 0 ? 0.f : yr[c];
}

// out[i, :] = in[src[i], :], or zeros where src[i] < 0, for one block per row i (C values of X,
// copied as they are): the compaction of a step's rows (src: the kept rows) and its inverse
// (src: each batch row's compacted row, -1 for a row left out).
template <class X>
__global__ void rows_move_kernel(X* out, const X* in, const int32_t* src, int64_t C) {
  allow_dependents();
  grid_dependency_wait();  // launched dependent with kDependTrain (launch.cuh)
  const int32_t j = src[blockIdx.x];
  X* o = out + int64_t(blockIdx.x) * C;
  const X* x = in + int64_t(j < 0 ? 0 : j) * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    if (j < 0)
      store_as(o + c, 0.f);
    else
      o[c] = x[c];
  }
}

// RoPE of one row's pair (x[e], x[e + hd/2]) at angle sign * (p) * inv_freq[e], in the order
// and precision of rope_kernel (fp64 angle and rotation, then fp32): the fused kernels below
// give the bits of rope_kernel followed by row moves and casts.
__device__ __forceinline__ void rope_pair(float a, float b, double sign, int32_t p, float inv_freq, float* ra,
                                          float* rb) {
  double sn, cs;
  sincos(sign * double(p) * double(inv_freq), &sn, &cs);
  const double x = a, y = b;
  *ra = float(x * cs - y * sn);
  *rb = float(y * cs + x * sn);
}

// The forward's q, k, v after their products, as the attention reads them: for batch row n
// (a block), from row m = map ? map[n] : n of the products' outputs qc, kc, vc (zeros where
// m < 0; their rows lq and lkv apart): q as bf16 with RoPE, keys fp32 with RoPE, values fp32
// (copied unless vc is vo; without a map kc may be ko, rotated in place), and where kb / vb
// are given (step 0, whose keys and values every later step attends to), the keys' and values'
// bf16 copies too. The bits of expand (move_rows), then rope_kernel into q's bf16 copy and in
// place on the keys, then casts (GpuDraftOptions::fused_rope_rows).
__global__ void qkv_rope_rows_kernel(__nv_bfloat16* qo, float* ko, float* vo, __nv_bfloat16* kb, __nv_bfloat16* vb,
                                     const float* qc, const float* kc, const float* vc, int64_t lq, int64_t lkv,
                                     const int32_t* map, const int32_t* pos, int offset, const float* inv_freq, int nh,
                                     int nkv, int hd) {
  allow_dependents();
  grid_dependency_wait();  // launched dependent with kDependTrain (launch.cuh)
  const int64_t n = blockIdx.x;
  const int32_t m = map ? map[n] : int32_t(n);
  const int half = hd / 2;
  const int64_t qd = int64_t(nh) * hd, kvd = int64_t(nkv) * hd;
  const int32_t p = pos[n] + offset;
  for (int j = threadIdx.x; j < (nh + nkv) * half; j += blockDim.x) {
    const int h = j / half, e = j % half;
    const bool isq = h < nh;
    const int64_t c = int64_t(isq ? h : h - nh) * hd + e;
    const float* x = isq ? qc + int64_t(m) * lq + c : kc + int64_t(m) * lkv + c;
    const float a = m < 0 ? 0.f : x[0], b = m < 0 ? 0.f : x[half];
    float ra, rb;
    rope_pair(a, b, 1.0, p, inv_freq[e], &ra, &rb);
    if (isq) {
      qo[n * qd + c] = __float2bfloat16_rn(ra);
      qo[n * qd + c + half] = __float2bfloat16_rn(rb);
    } else {
      ko[n * kvd + c] = ra;
      ko[n * kvd + c + half] = rb;
      if (kb) {
        kb[n * kvd + c] = __float2bfloat16_rn(ra);
        kb[n * kvd + c + half] = __float2bfloat16_rn(rb);
      }
    }
  }
  if (vc != vo || vb)
    for (int64_t c = threadIdx.x; c < kvd; c += blockDim.x) {
      const float v = m < 0 ? 0.f : vc[int64_t(m) * lkv + c];
      if (vc != vo) vo[n * kvd + c] = v;
      if (vb) vb[n * kvd + c] = __float2bfloat16_rn(v);
    }
}

// The q|k|v backward's operand in one pass: row i of out (bf16, rows of qd + 2 kvd) from batch
// row n = src ? src[i] : i of dq and dK (each rotated back: RoPE with sign -1) and of dV. The
// bits of rope_kernel in place on dq and dK, compact (move_rows) and cast_rows_bf16
// (GpuDraftOptions::fused_rope_rows).
__global__ void qkv_grad_rows_kernel(__nv_bfloat16* out, const float* dq, const float* dk, const float* dv,
                                     const int32_t* src, const int32_t* pos, int offset, const float* inv_freq, int nh,
                                     int nkv, int hd) {
  allow_dependents();
  grid_dependency_wait();  // launched dependent with kDependTrain (launch.cuh)
  const int64_t i = blockIdx.x;
  const int64_t n = src ? src[i] : i;
  const int half = hd / 2;
  const int64_t qd = int64_t(nh) * hd, kvd = int64_t(nkv) * hd;
  __nv_bfloat16* o = out + i * (qd + 2 * kvd);
  const int32_t p = pos[n] + offset;
  for (int j = threadIdx.x; j < (nh + nkv) * half; j += blockDim.x) {
    const int h = j / half, e = j % half;
    const bool isq = h < nh;
    const int64_t c = int64_t(isq ? h : h - nh) * hd + e;
    const float* x = isq ? dq + n * qd + c : dk + n * kvd + c;
    float ra, rb;
    rope_pair(x[0], x[half], -1.0, p, inv_freq[e], &ra, &rb);
    __nv_bfloat16* y = o + (isq ? 0 : qd) + c;
    y[0] = __float2bfloat16_rn(ra);
    y[half] = __float2bfloat16_rn(rb);
  }
  for (int64_t c = threadIdx.x; c < kvd; c += blockDim.x) o[qd + kvd + c] = __float2bfloat16_rn(dv[n * kvd + c]);
}

// out[n, :] = row[:] for n < N (C columns).
__global__ void broadcast_row_kernel(float* out, const float* row, int64_t N, int64_t C) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < N * C) out[i] = row[i % C];
}

// P-EAGLE's embedding gradient of the first step: for the i-th distinct token tok[i], its row of
// g += the sum of dE's rows rows[off[i] .. off[i+1]) (ascending), in that order: no atomics, so
// the same bits on every run. One block per distinct token.
__global__ void embed_scatter_kernel(float* g, const float* dE, const int32_t* tok, const int32_t* off,
                                     const int32_t* rows, int64_t H) {
  const int32_t a = off[blockIdx.x], b = off[blockIdx.x + 1];
  float* gr = g + int64_t(tok[blockIdx.x]) * H;
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
    double t = 0;  // fp64, as colsum_kernel: a frequent token sums thousands of rows
    for (int32_t j = a; j < b; ++j) t += double(dE[int64_t(rows[j]) * H + c]);
    gr[c] += float(t);
  }
}

// ---------------------------------------------------------------- attention
// Step k: a query at row n sees step-0 keys of its sample at positions <= its own, and
// the key at row n of each step 1..k. One warp per (row, head); online softmax.
constexpr int kMaxHdPerLane = 8;  // head_dim <= 256

struct AttnArgs {
  const float* q;     // [N, nh*hd] this step's queries (after RoPE); null when they are bf16 (qb)
  const float* keys;  // [K, N, nkv*hd]
  const float* vals;
  int64_t N, step_stride;  // step_stride = N*nkv*hd (of the buffers: max_rows*kvd)
  int nh, nkv, hd, k;
  float scale;
  const int32_t* pos;
  const int32_t* len;
  const __nv_bfloat16* qb;  // the queries when they are stored as bf16 (the fused path), else null
};
// Element i of the queries, whichever way they are stored.
__device__ __forceinline__ float q_at(const AttnArgs& a, int64_t i) { return a.qb ? __bfloat162float(a.qb[i]) : a.q[i]; }

__global__ void attn_forward_kernel(float* out, float* lse, AttnArgs a) {
  const int64_t gw = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (gw >= a.N * a.nh) return;
  const int64_t n = gw / a.nh;
  const int h = int(gw % a.nh), kh = h / (a.nh / a.nkv);
  const int64_t qd = int64_t(a.nh) * a.hd, kvd = int64_t(a.nkv) * a.hd;
  float qv[kMaxHdPerLane], acc[kMaxHdPerLane];
  for (int i = 0; i < kMaxHdPerLane; ++i) {
    const int d = lane + 32 * i;
    qv[i] = d < a.hd ? a.q[n * qd + h * a.hd + d] : 0.f;
    acc[i] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  auto visit = [&](const float* kp, const float* vp) {
    float s = 0;
    for (int i = 0; i < kMaxHdPerLane; ++i) {
      const int d = lane + 32 * i;
      if (d < a.hd) s += qv[i] * kp[d];
    }
    s = warp_sum(s) * a.scale;
    const float mn = fmaxf(m, s), corr = expf(m - mn), pe = expf(s - mn);
    l = l * corr + pe;
    for (int i = 0; i < kMaxHdPerLane; ++i) {
      const int d = lane + 32 * i;
      if (d < a.hd) acc[i] = acc[i] * corr + pe * vp[d];
    }
    m = mn;
  };
  const int64_t p0 = n - a.pos[n];
  for (int64_t p = p0; p <= n; ++p) visit(a.keys + p * kvd + kh * a.hd, a.vals + p * kvd + kh * a.hd);
  for (int j = 1; j <= a.k; ++j)
    visit(a.keys + j * a.step_stride + n * kvd + kh * a.hd, a.vals + j * a.step_stride + n * kvd + kh * a.hd);
  for (int i = 0; i < kMaxHdPerLane; ++i) {
    const int d = lane + 32 * i;
    if (d < a.hd) out[n * qd + h * a.hd + d] = acc[i] / l;
  }
  if (lane == 0) lse[n * a.nh + h] = m + logf(l);
}

// D[n, h] = dot(dO, O) per head.
template <class T>
__global__ void attn_delta_kernel(float* D, const float* dO, const T* O, int64_t N, int nh, int hd) {
  const int64_t gw = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (gw >= N * nh) return;
  float s = 0;
  for (int d = lane; d < hd; d += 32) s += dO[gw * hd + d] * load_f(O + gw * hd + d);
  s = warp_sum(s);
  if (lane == 0) D[gw] = s;
}

// dq for every (row, head): sum over its keys of ds * k, ds = p * (dO.v - D) * scale.
__global__ void attn_dq_kernel(float* dq, const float* dO, const float* lse, const float* D, AttnArgs a) {
  const int64_t gw = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (gw >= a.N * a.nh) return;
  const int64_t n = gw / a.nh;
  const int h = int(gw % a.nh), kh = h / (a.nh / a.nkv);
  const int64_t qd = int64_t(a.nh) * a.hd, kvd = int64_t(a.nkv) * a.hd;
  float qv[kMaxHdPerLane], go[kMaxHdPerLane], acc[kMaxHdPerLane];
  for (int i = 0; i < kMaxHdPerLane; ++i) {
    const int d = lane + 32 * i;
    qv[i] = d < a.hd ? a.q[n * qd + h * a.hd + d] : 0.f;
    go[i] = d < a.hd ? dO[n * qd + h * a.hd + d] : 0.f;
    acc[i] = 0.f;
  }
  const float L = lse[gw], Dv = D[gw];
  auto visit = [&](const float* kp, const float* vp) {
    float s = 0, dp = 0;
    for (int i = 0; i < kMaxHdPerLane; ++i) {
      const int d = lane + 32 * i;
      if (d < a.hd) s += qv[i] * kp[d], dp += go[i] * vp[d];
    }
    s = warp_sum(s) * a.scale;
    dp = warp_sum(dp);
    const float ds = expf(s - L) * (dp - Dv) * a.scale;
    for (int i = 0; i < kMaxHdPerLane; ++i) {
      const int d = lane + 32 * i;
      if (d < a.hd) acc[i] += ds * kp[d];
    }
  };
  const int64_t p0 = n - a.pos[n];
  for (int64_t p = p0; p <= n; ++p) visit(a.keys + p * kvd + kh * a.hd, a.vals + p * kvd + kh * a.hd);
  for (int j = 1; j <= a.k; ++j)
    visit(a.keys + j * a.step_stride + n * kvd + kh * a.hd, a.vals + j * a.step_stride + n * kvd + kh * a.hd);
  for (int i = 0; i < kMaxHdPerLane; ++i) {
    const int d = lane + 32 * i;
    if (d < a.hd) dq[n * qd + h * a.hd + d] = acc[i];
  }
}

// dK/dV of one key (step j's key at row p; j = 0: queried by rows p.. of its sample,
// j >= 1: by row p only), summed over the queries of this step and the heads sharing it.
// One warp per (key row, kv head[, j]); adds into dK, dV.
__global__ void attn_dkv_kernel(float* dK, float* dV, const float* dO, const float* lse, const float* D, AttnArgs a,
                                bool diagonal) {
  const int64_t gw = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  const int64_t per_step = a.N * a.nkv;
  if (gw >= (diagonal ? a.k : 1) * per_step) return;
  const int j = diagonal ? 1 + int(gw / per_step) : 0;
  const int64_t p = (gw % per_step) / a.nkv;
  const int kh = int(gw % a.nkv), grp = a.nh / a.nkv;
  const int64_t qd = int64_t(a.nh) * a.hd, kvd = int64_t(a.nkv) * a.hd;
  const float* kp = a.keys + j * a.step_stride + p * kvd + kh * a.hd;
  const float* vp = a.vals + j * a.step_stride + p * kvd + kh * a.hd;
  float kv[kMaxHdPerLane], vv[kMaxHdPerLane], dk[kMaxHdPerLane], dv[kMaxHdPerLane];
  for (int i = 0; i < kMaxHdPerLane; ++i) {
    const int d = lane + 32 * i;
    kv[i] = d < a.hd ? kp[d] : 0.f;
    vv[i] = d < a.hd ? vp[d] : 0.f;
    dk[i] = dv[i] = 0.f;
  }
  const int64_t t_end = diagonal ? p + 1 : p - a.pos[p] + a.len[p];
  for (int64_t t = p; t < t_end; ++t)
    for (int h = kh * grp; h < (kh + 1) * grp; ++h) {
      const float* qp = a.q + t * qd + h * a.hd;
      const float* gp = dO + t * qd + h * a.hd;
      float s = 0, dp = 0;
      for (int i = 0; i < kMaxHdPerLane; ++i) {
        const int d = lane + 32 * i;
        if (d < a.hd) s += qp[d] * kv[i], dp += gp[d] * vv[i];
      }
      s = warp_sum(s) * a.scale;
      dp = warp_sum(dp);
      const float pr = expf(s - lse[t * a.nh + h]);
      const float ds = pr * (dp - D[t * a.nh + h]) * a.scale;
      for (int i = 0; i < kMaxHdPerLane; ++i) {
        const int d = lane + 32 * i;
        if (d < a.hd) dv[i] += pr * gp[d], dk[i] += ds * qp[d];
      }
    }
  float* dkp = dK + j * a.step_stride + p * kvd + kh * a.hd;
  float* dvp = dV + j * a.step_stride + p * kvd + kh * a.hd;
  for (int i = 0; i < kMaxHdPerLane; ++i) {
    const int d = lane + 32 * i;
    if (d < a.hd) dkp[d] += dk[i], dvp[d] += dv[i];
  }
}

// ---------------------------------------------------------------- attention on tensor cores
// Per sample of T rows, step k and group member g (heads h = kh*grp + g, one per kv head),
// S_kh = scale * Q_h K0_kh^T is computed by cuBLAS (row t: query t against the sample's
// step-0 keys, T x T); the diagonal keys of steps 1..k are K extra scores per (row, head)
// in sd[(n*nh + h)*K + j]. P V, dP = dO V^T, dQ = dS K, dK += dS^T Q and dV += P^T dO are
// cuBLAS products too; masking, softmax and the diagonal terms are the kernels below.
//
// The diagonal kernels write their multiply-adds out (__fmaf_rn, __fmul_rn): two kernels that
// do the same arithmetic in the same order then give the same bits, where the compiler's own
// contraction of a*b + c*d may fuse either product (it differed between the unrolled
// diag_merge_regs_kernel and diag_merge_kernel).

// scale * q_{n,h} . k^j_{n,kh}: the score of row n's diagonal key of step j, for head h;
// called by the whole warp, every lane gets it.
__device__ __forceinline__ float diag_score(const AttnArgs& a, int64_t n, int h, int j, int lane) {
  const int kh = h / (a.nh / a.nkv);
  const int64_t qd = int64_t(a.nh) * a.hd, kvd = int64_t(a.nkv) * a.hd;
  const float* kp = a.keys + j * a.step_stride + n * kvd + kh * a.hd;
  float s = 0;
  for (int d = lane; d < a.hd; d += 32) s = __fmaf_rn(q_at(a, n * qd + h * a.hd + d), kp[d], s);
  return warp_sum(s) * a.scale;
}

// sd[n, h, j] = scale * q_{n,h} . k^j_{n,kh} for j = 1..k; one warp per (row, head).
__global__ void diag_scores_kernel(float* sd, AttnArgs a, int K) {
  const int64_t gw = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (gw >= a.N * a.nh) return;
  for (int j = 1; j <= a.k; ++j) {
    const float s = diag_score(a, gw / a.nh, int(gw % a.nh), j, lane);
    if (lane == 0) sd[gw * K + j] = s;
  }
}

// One block per (query t of the query block b0.. of the sample, head): softmax over
// S_h[t, 0..t] and the diagonal scores. S holds the query block's rows only ([nkv, blk, T],
// row t at (kh * blk + t - b0) * T). With lse_in null it computes and stores lse; S becomes
// P in place (0 above the diagonal up to the block's last key, the keys the products read)
// unless keep_f32 is false, P is also written as bf16 to Pb
// when given, and sd becomes the diagonal probabilities.
__global__ void tc_softmax_kernel(float* S, __nv_bfloat16* Pb, bool keep_f32, float* sd, float* lse,
                                  const float* lse_in, int64_t r0, int64_t T, int64_t b0, int64_t blk, int nh, int grp,
                                  int g, int k, int K) {
  __shared__ float sh[33];
  const int64_t t = b0 + blockIdx.x, kend = b0 + gridDim.x;  // query t; the block's keys end at kend
  const int h = int(blockIdx.y) * grp + g;
  const int64_t off = (int64_t(blockIdx.y) * blk + blockIdx.x) * T;
  float* row = S + off;
  float* dg = sd + ((r0 + t) * nh + h) * K;
  float L;
  if (lse_in) {
    L = lse_in[(r0 + t) * nh + h];
  } else {
    float m = -INFINITY;
    for (int64_t p = threadIdx.x; p <= t; p += blockDim.x) m = fmaxf(m, row[p]);
    for (int j = 1 + threadIdx.x; j <= k; j += blockDim.x) m = fmaxf(m, dg[j]);
    // block max
    m = warp_max(m);
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = blockDim.x >> 5;
    if (l == 0) sh[w] = m;
    __syncthreads();
    if (w == 0) {
      float x = l < nw ? sh[l] : -INFINITY;
      x = warp_max(x);
      if (l == 0) sh[32] = x;
    }
    __syncthreads();
    m = sh[32];
    float z = 0;
    for (int64_t p = threadIdx.x; p <= t; p += blockDim.x) z += expf(row[p] - m);
    for (int j = 1 + threadIdx.x; j <= k; j += blockDim.x) z += expf(dg[j] - m);
    z = block_sum(z, sh);
    L = m + logf(z);
    if (threadIdx.x == 0) lse[(r0 + t) * nh + h] = L;
  }
  __nv_bfloat16* brow = Pb ? Pb + off : nullptr;
  for (int64_t p = threadIdx.x; p < kend; p += blockDim.x) {
    const float v = p <= t ? expf(row[p] - L) : 0.f;
    if (keep_f32) row[p] = v;
    if (brow) brow[p] = __float2bfloat16_rn(v);
  }
  __syncthreads();
  for (int j = 1 + threadIdx.x; j <= k; j += blockDim.x) dg[j] = expf(dg[j] - L);
}

// out[n, h, :] += sum_j pd[n, h, j] * v^j[n, kh, :]  (mode 0), or
// dq[n, h, :] += sum_j dsd[n, h, j] * k^j[n, kh, :]    (mode 1, same loop over keys).
__global__ void diag_accumulate_kernel(float* out, const float* pd, AttnArgs a, int K, bool use_keys) {
  const int64_t gw = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (gw >= a.N * a.nh || a.k == 0) return;
  const int64_t n = gw / a.nh;
  const int h = int(gw % a.nh), kh = h / (a.nh / a.nkv);
  const int64_t qd = int64_t(a.nh) * a.hd, kvd = int64_t(a.nkv) * a.hd;
  const float* src = use_keys ? a.keys : a.vals;
  for (int d = lane; d < a.hd; d += 32) {
    float acc = out[n * qd + h * a.hd + d];
    for (int j = 1; j <= a.k; ++j)
      acc = __fmaf_rn(pd[gw * K + j], src[j * a.step_stride + n * kvd + kh * a.hd + d], acc);
    out[n * qd + h * a.hd + d] = acc;
  }
}

// dpd[n, h, j] = dO_{n,h} . v^j_{n,kh}; then dS in place: dP -> P * (dP - D) * scale for
// the sample's rows (0 above the diagonal), and the diagonal dsd = pd * (dpd - D) * scale.
__global__ void diag_dp_kernel(float* dsd, const float* pd, const float* dO, const float* D, AttnArgs a, int K) {
  const int64_t gw = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (gw >= a.N * a.nh) return;
  const int64_t n = gw / a.nh;
  const int h = int(gw % a.nh), kh = h / (a.nh / a.nkv);
  const int64_t qd = int64_t(a.nh) * a.hd, kvd = int64_t(a.nkv) * a.hd;
  for (int j = 1; j <= a.k; ++j) {
    const float* vp = a.vals + j * a.step_stride + n * kvd + kh * a.hd;
    float s = 0;
    for (int d = lane; d < a.hd; d += 32) s = __fmaf_rn(dO[n * qd + h * a.hd + d], vp[d], s);
    s = warp_sum(s);
    if (lane == 0) dsd[gw * K + j] = pd[gw * K + j] * (s - D[gw]) * a.scale;
  }
}

// dS = P * (dP - D) * scale below the diagonal, 0 above it up to the query block's last key
// (same layout as tc_softmax_kernel): in place over dP, or as bf16 into
// dSb when given (dS is then only the operand of the dQ and dK products).
__global__ void tc_ds_kernel(float* dP, __nv_bfloat16* dSb, const float* P, const float* D, int64_t r0, int64_t T,
                             int64_t b0, int64_t blk, int nh, int grp, int g, float scale) {
  const int64_t t = b0 + blockIdx.x, kend = b0 + gridDim.x;
  const int h = int(blockIdx.y) * grp + g;
  const int64_t off = (int64_t(blockIdx.y) * blk + blockIdx.x) * T;
  const float Dv = D[(r0 + t) * nh + h];
  for (int64_t p = threadIdx.x; p < kend; p += blockDim.x) {
    const float v = p <= t ? P[off + p] * (dP[off + p] - Dv) * scale : 0.f;
    if (dSb)
      dSb[off + p] = __float2bfloat16_rn(v);
    else
      dP[off + p] = v;
  }
}

// dK^j[n, kh, :] += sum_{h in group} dsd[n,h,j] q_{n,h};  dV^j[n, kh, :] += sum_h pd[n,h,j] dO_{n,h}
// for j = 1..k; one warp per (row, kv head), through every j: the row's q and dO are read from
// memory once (then from L1) instead of once a step.
__global__ void diag_dkv_kernel(float* dK, float* dV, const float* dsd, const float* pd, const float* dO, AttnArgs a,
                                int K) {
  const int64_t gw = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (gw >= a.N * a.nkv) return;
  const int64_t n = gw / a.nkv;
  const int kh = int(gw % a.nkv), grp = a.nh / a.nkv;
  const int64_t qd = int64_t(a.nh) * a.hd, kvd = int64_t(a.nkv) * a.hd;
  for (int d = lane; d < a.hd; d += 32)
    for (int j = 1; j <= a.k; ++j) {
      float dk = 0, dv = 0;
      for (int h = kh * grp; h < (kh + 1) * grp; ++h) {
        const int64_t w = (n * a.nh + h) * K + j;
        dk = __fmaf_rn(dsd[w], q_at(a, n * qd + h * a.hd + d), dk);
        dv = __fmaf_rn(pd[w], dO[n * qd + h * a.hd + d], dv);
      }
      dK[j * a.step_stride + n * kvd + kh * a.hd + d] += dk;
      dV[j * a.step_stride + n * kvd + kh * a.hd + d] += dv;
    }
}

// One step's key, value, dK and dV rows at `at` (a lane's P head dims; 0 past the head), for
// diag_backward_kernel's loads ahead.
template <int P>
__device__ __forceinline__ void diag_step_rows(const AttnArgs& a, const float* dK, const float* dV, int64_t at,
                                               int lane, float* k, float* v, float* dk, float* dv) {
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int d = lane + 32 * i;
    const bool in = d < a.hd;
    k[i] = in ? a.keys[at + d] : 0.f;
    v[i] = in ? a.vals[at + d] : 0.f;
    dk[i] = in ? dK[at + d] : 0.f;
    dv[i] = in ? dV[at + d] : 0.f;
  }
}

// The diagonal keys' backward of step k in one pass, one warp per (row, kv head): for each
// j = 1..k and head h of the group, p = exp(scale q_h . k^j - lse_h) (the merged row's
// probability of key j), dp = dO_h . v^j, ds = p (dp - D_h) scale; then dq_h += ds k^j (j in
// order), dK^j += sum_h ds q_h and dV^j += sum_h p dO_h (heads in order). The same arithmetic,
// in the same order, as diag_probs, diag_dp, diag_accumulate and diag_dkv one after another,
// with q, dO, dq, k^j and v^j read once. P: head dims a lane (hd <= 32 P); G: heads a group at
// most; PF: the next step's rows loaded ahead.
template <int P, int G, bool PF>
__global__ void diag_backward_kernel(float* dq, float* dK, float* dV, const float* lse, const float* dO, const float* D,
                                     AttnArgs a) {
  allow_dependents();
  grid_dependency_wait();  // launched dependent with kDependTrain (launch.cuh)
  const int64_t gw = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (gw >= a.N * a.nkv || a.k == 0) return;
  const int64_t n = gw / a.nkv;
  const int kh = int(gw % a.nkv), grp = a.nh / a.nkv;
  const int64_t qd = int64_t(a.nh) * a.hd, kvd = int64_t(a.nkv) * a.hd;
  float qv[G][P], ov[G][P], acc[G][P], L[G], Dv[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const int64_t h = int64_t(kh) * grp + g, at = n * qd + h * a.hd;
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const int d = lane + 32 * i;
      const bool in = g < grp && d < a.hd;
      qv[g][i] = in ? q_at(a, at + d) : 0.f;
      ov[g][i] = in ? dO[at + d] : 0.f;
      acc[g][i] = in ? dq[at + d] : 0.f;
    }
    L[g] = g < grp ? lse[n * a.nh + h] : 0.f;
    Dv[g] = g < grp ? D[n * a.nh + h] : 0.f;
  }
  // PF: step j + 1's key and value rows and its dK / dV rows are loaded while step j computes
  // (each warp owns its dK / dV rows, so reading them early is safe); the same arithmetic.
  float kn[P], vn[P], dkn[P], dvn[P];
  if (PF) diag_step_rows<P>(a, dK, dV, a.step_stride + n * kvd + kh * a.hd, lane, kn, vn, dkn, dvn);
  for (int j = 1; j <= a.k; ++j) {
    const int64_t at = j * a.step_stride + n * kvd + kh * a.hd;
    float kv[P], vv[P], dk[P], dv[P], dko[P], dvo[P];
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const int d = lane + 32 * i;
      if (PF) {
        kv[i] = kn[i];
        vv[i] = vn[i];
        dko[i] = dkn[i];
        dvo[i] = dvn[i];
      } else {
        kv[i] = d < a.hd ? a.keys[at + d] : 0.f;
        vv[i] = d < a.hd ? a.vals[at + d] : 0.f;
      }
      dk[i] = dv[i] = 0.f;
    }
    if (PF && j < a.k) diag_step_rows<P>(a, dK, dV, at + a.step_stride, lane, kn, vn, dkn, dvn);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (g >= grp) break;  // the same for the whole warp
      float sc = 0.f, dp = 0.f;
#pragma unroll
      for (int i = 0; i < P; ++i) {
        sc = __fmaf_rn(qv[g][i], kv[i], sc);
        dp = __fmaf_rn(ov[g][i], vv[i], dp);
      }
      sc = warp_sum(sc) * a.scale;
      dp = warp_sum(dp);
      const float p = expf(sc - L[g]), ds = p * (dp - Dv[g]) * a.scale;
#pragma unroll
      for (int i = 0; i < P; ++i) {
        acc[g][i] = __fmaf_rn(ds, kv[i], acc[g][i]);
        dk[i] = __fmaf_rn(ds, qv[g][i], dk[i]);
        dv[i] = __fmaf_rn(p, ov[g][i], dv[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const int d = lane + 32 * i;
      if (d < a.hd) {
        if (PF) {
          dK[at + d] = dko[i] + dk[i];
          dV[at + d] = dvo[i] + dv[i];
        } else {
          dK[at + d] += dk[i];
          dV[at + d] += dv[i];
        }
      }
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const int64_t at = n * qd + (int64_t(kh) * grp + g) * a.hd;
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const int d = lane + 32 * i;
      if (g < grp && d < a.hd) dq[at + d] = acc[g][i];
    }
  }
}

// With the fused kernels (ttt_attention.h): out and lse hold the causal part (O_c, lse_c);
// fold in the diagonal keys of steps 1..k: L = log(exp(lse_c) + sum_j exp(s_j)),
// out = exp(lse_c - L) O_c + sum_j exp(s_j - L) v^j, lse = L. sd keeps the scores s_j.
// One warp per (row, head).
// oc: the causal part's output; the merged output goes to out, or as bf16 to out_b when given
// (out may be oc itself).
// cuDNN's bf16 gradients of the causal part: dq = dQ (overwritten), dK0 += dK, dV0 += dV.
__global__ void cudnn_grads_kernel(float* dq, float* dk, float* dv, const __nv_bfloat16* gq, const __nv_bfloat16* gk,
                                   const __nv_bfloat16* gv, int64_t nq, int64_t nkv) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < nq) dq[i] = __bfloat162float(gq[i]);
  if (i < nkv) {
    dk[i] += __bfloat162float(gk[i]);
    dv[i] += __bfloat162float(gv[i]);
  }
}

// oc: the causal part's output, fp32 or bf16 (cuDNN's); it may be out_b itself (each element is
// read and then written by the same lane).
template <class OC>
__global__ void diag_merge_kernel(const OC* oc, float* out, __nv_bfloat16* out_b, float* lse, float* sd, AttnArgs a,
                                  int K) {
  const int64_t gw = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (gw >= a.N * a.nh || a.k == 0) return;
  const int64_t n = gw / a.nh;
  const int h = int(gw % a.nh), kh = h / (a.nh / a.nkv);
  const int64_t qd = int64_t(a.nh) * a.hd, kvd = int64_t(a.nkv) * a.hd;
  const float lc = lse[gw];
  float m = lc;
  for (int j = 1; j <= a.k; ++j) {
    const float s = diag_score(a, n, h, j, lane);
    if (lane == 0) sd[gw * K + j] = s;
    m = fmaxf(m, s);
  }
  __syncwarp();
  float z = expf(lc - m);
  for (int j = 1; j <= a.k; ++j) z += expf(sd[gw * K + j] - m);
  const float L = m + logf(z), wc = expf(lc - L);
  for (int d = lane; d < a.hd; d += 32) {
    float acc = __fmul_rn(wc, load_f(oc + n * qd + h * a.hd + d));
    for (int j = 1; j <= a.k; ++j)
      acc = __fmaf_rn(expf(sd[gw * K + j] - L), a.vals[j * a.step_stride + n * kvd + kh * a.hd + d], acc);
    if (out_b)
      out_b[n * qd + h * a.hd + d] = __float2bfloat16_rn(acc);
    else
      out[n * qd + h * a.hd + d] = acc;
  }
  if (lane == 0) lse[gw] = L;
}

// diag_merge_kernel with a lane's P head dims (hd <= 32 P) of q, of the causal output and of the
// k <= KM diagonal keys' and values' rows in registers, all loaded before the first is used: one
// round of loads in flight a warp instead of one a key (the merge is bound by memory latency).
// The same arithmetic in the same order (dot products over i, then j; z, L, the output's sum
// over j), so the same bits.
template <int P, int KM, class OC>
__global__ void diag_merge_regs_kernel(const OC* oc, float* out, __nv_bfloat16* out_b, float* lse, float* sd,
                                       AttnArgs a, int K) {
  allow_dependents();
  grid_dependency_wait();  // launched dependent with kDependTrain (launch.cuh)
  const int64_t gw = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (gw >= a.N * a.nh || a.k == 0) return;
  const int64_t n = gw / a.nh;
  const int h = int(gw % a.nh), kh = h / (a.nh / a.nkv), k = a.k;
  const int64_t qd = int64_t(a.nh) * a.hd, kvd = int64_t(a.nkv) * a.hd;
  const int64_t qat = n * qd + h * a.hd, kvat = n * kvd + kh * a.hd;
  float qv[P], ocv[P], kv[KM][P], vv[KM][P];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int d = lane + 32 * i;
    qv[i] = d < a.hd ? q_at(a, qat + d) : 0.f;
    ocv[i] = d < a.hd ? load_f(oc + qat + d) : 0.f;
  }
#pragma unroll
  for (int j = 0; j < KM; ++j)
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const int d = lane + 32 * i;
      const bool in = j < k && d < a.hd;
      const int64_t at = int64_t(j + 1) * a.step_stride + kvat + d;
      kv[j][i] = in ? a.keys[at] : 0.f;
      vv[j][i] = in ? a.vals[at] : 0.f;
    }
  const float lc = lse[gw];
  float sc[KM] = {}, m = lc;
#pragma unroll
  for (int j = 0; j < KM; ++j) {
    if (j >= k) break;  // the same for the whole warp
    float t = 0;
#pragma unroll
    for (int i = 0; i < P; ++i)
      if (lane + 32 * i < a.hd) t = __fmaf_rn(qv[i], kv[j][i], t);
    sc[j] = warp_sum(t) * a.scale;
    if (lane == 0) sd[gw * K + j + 1] = sc[j];
    m = fmaxf(m, sc[j]);
  }
  float z = expf(lc - m);
#pragma unroll
  for (int j = 0; j < KM; ++j) {
    if (j >= k) break;
    z += expf(sc[j] - m);
  }
  const float L = m + logf(z), wc = expf(lc - L);
  float e[KM];
#pragma unroll
  for (int j = 0; j < KM; ++j) e[j] = j < k ? expf(sc[j] - L) : 0.f;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int d = lane + 32 * i;
    if (d >= a.hd) break;
    float acc = __fmul_rn(wc, ocv[i]);
#pragma unroll
    for (int j = 0; j < KM; ++j) {
      if (j >= k) break;
      acc = __fmaf_rn(e[j], vv[j][i], acc);
    }
    if (out_b)
      out_b[qat + d] = __float2bfloat16_rn(acc);
    else
      out[qat + d] = acc;
  }
  if (lane == 0) lse[gw] = L;
}

// pd[n, h, j] = exp(scale q_{n,h} . k^j_{n,kh} - lse[n, h]) for j = 1..k: the diagonal
// probabilities, given the whole row's log-sum-exp. One warp per (row, head).
__global__ void diag_probs_kernel(float* pd, const float* lse, AttnArgs a, int K) {
  const int64_t gw = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (gw >= a.N * a.nh) return;
  for (int j = 1; j <= a.k; ++j) {
    const float s = diag_score(a, gw / a.nh, int(gw % a.nh), j, lane);
    if (lane == 0) pd[gw * K + j] = expf(s - lse[gw]);
  }
}

// ---------------------------------------------------------------- target side and loss
// Values 4q..4q+3 of an fp32 or bf16 row (16- or 8-byte aligned), and one value, as floats.
__device__ __forceinline__ float4 load4(const float* p, int64_t q) { return reinterpret_cast<const float4*>(p)[q]; }
__device__ __forceinline__ float4 load4(const __nv_bfloat16* p, int64_t q) {
  const uint2 u = reinterpret_cast<const uint2*>(p)[q];
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ float load1(const float* p) { return *p; }
__device__ __forceinline__ float load1(const __nv_bfloat16* p) { return __bfloat162float(*p); }

// One block per row of full target logits, of batch row rows[row0 + blockIdx.x]: the
// full-vocab argmax decides in_vocab; the distribution over the kept ids is P
// (renormalised; fp32, or bf16 with bf16 operands), its argmax tgt_arg. One read of the row
// (float4 loads when V allows) finds the full maximum and, over the kept ids (t2d), the
// softmax state (maximum, sum of exp relative to it, first column holding it); a second,
// over the kept ids only, writes P.
template <class PT>
__global__ void target_row_kernel(PT* P, int32_t* tgt_arg, uint8_t* in_vocab, float* ent, const float* full,
                                  const int64_t* kept, const uint8_t* t2d, int64_t V, int64_t Vd, const int32_t* rows,
                                  int64_t row0) {
  __shared__ float shv[33], shz[33];
  __shared__ int64_t shi[33];
  const int64_t r = rows[row0 + blockIdx.x];  // the batch row of full's row blockIdx.x
  const float* f = full + blockIdx.x * V;
  float v = -INFINITY, mv = -INFINITY, z = 0.f;
  int64_t i = INT64_MAX, mc = INT64_MAX;
  const auto visit = [&](float x, int64_t c, bool kept_id) {
    if (x > v) v = x, i = c;
    if (kept_id) softmax_visit(x, c, mv, z, mc);
  };
  if ((V & 3) == 0) {
    const float4* f4 = reinterpret_cast<const float4*>(f);
    const uchar4* t4 = reinterpret_cast<const uchar4*>(t2d);
    for (int64_t q = threadIdx.x; q < V / 4; q += blockDim.x) {
      const float4 x = f4[q];
      const uchar4 t = t4[q];
      visit(x.x, 4 * q, t.x), visit(x.y, 4 * q + 1, t.y), visit(x.z, 4 * q + 2, t.z), visit(x.w, 4 * q + 3, t.w);
    }
  } else {
    for (int64_t c = threadIdx.x; c < V; c += blockDim.x) visit(f[c], c, t2d[c]);
  }
  block_argmax(v, i, shv, shi);
  if (threadIdx.x == 0) in_vocab[r] = t2d[i];
  block_softmax_state(mv, z, mc, shv, shz, shi);
  PT* pr = P + r * Vd;
  for (int64_t d = threadIdx.x; d < Vd; d += blockDim.x) store_as(pr + d, expf(f[kept[d]] - mv) / z);
  if (threadIdx.x == 0) {  // the kept index of column mc (kept ascends)
    int64_t lo = 0, hi = Vd - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (kept[mid] < mc) lo = mid + 1;
      else hi = mid;
    }
    tgt_arg[r] = int32_t(lo);
  }
  if (!ent) return;
  // -sum p log p over P as stored (bf16 or fp32), the P the cross-entropy reads: cross-entropy
  // minus it is that P's KL. Each thread reads back what it stored.
  const float lz = logf(z);
  float e = 0;
  for (int64_t d = threadIdx.x; d < Vd; d += blockDim.x) e += load_f(pr + d) * (f[kept[d]] - mv - lz);
  e = block_sum(e, shv);
  if (threadIdx.x == 0) ent[r] = -e;
}

// Step k, logits row i = row0 + blockIdx.x of the step's list, batch row n = rows[i] (target
// row n+1+k): cross-entropy against P, hit, counts (sel[n] when given: P-EAGLE's elements;
// else the row's target is in its sample, loss-masked and in_vocab); with scale, the logits become
// d(objective)/d(logits) in place, or that gradient goes to grad_b as bf16 when given (it
// is then only the operand of the lm_head's two products). logits and grad_b hold one chunk
// of rows, from row0 (row blockIdx.x there); row_scale, ce, hit and counts are indexed by
// batch row. Logits are fp32, or bf16 (LT) as the bf16 product rounds them; only fp32 logits
// take the gradient in place.
template <class PT, class LT>
__global__ void loss_kernel(LT* logits, const PT* P, const int32_t* tgt_arg, const uint8_t* in_vocab,
                            const uint8_t* mask, const int32_t* pos, const int32_t* len, int64_t Vd, int k,
                            const int32_t* rows, int64_t row0, const float* row_scale, __nv_bfloat16* grad_b,
                            float* ce, uint8_t* hit, uint8_t* counts, const uint8_t* sel) {
  allow_dependents();
  grid_dependency_wait();  // launched dependent with kDependTrain (launch.cuh)
  __shared__ float shv[33], shz[33];
  __shared__ int64_t shi[33];
  const int64_t n = rows[row0 + blockIdx.x], tr = n + 1 + k;
  const bool cnt = sel ? sel[n] != 0 : pos[n] + 1 + k < len[n] && mask[tr] && in_vocab[tr];
  LT* lg = logits + int64_t(blockIdx.x) * Vd;
  // One read of the row for its maximum, first argmax and sum of exp (an online softmax:
  // the sum rescaled whenever the maximum grows), four values a load when rows allow.
  const bool v4 = (Vd & 3) == 0;
  float mx = -INFINITY, z = 0.f;
  int64_t arg = INT64_MAX;
  const auto visit = [&](float v, int64_t d) { softmax_visit(v, d, mx, z, arg); };
  if (v4) {
    for (int64_t q = threadIdx.x; q < Vd / 4; q += blockDim.x) {
      const float4 x = load4(lg, q);
      visit(x.x, 4 * q), visit(x.y, 4 * q + 1), visit(x.z, 4 * q + 2), visit(x.w, 4 * q + 3);
    }
  } else {
    for (int64_t d = threadIdx.x; d < Vd; d += blockDim.x) visit(load1(lg + d), d);
  }
  block_softmax_state(mx, z, arg, shv, shz, shi);
  const float lz = mx + logf(z);
  // One more read for the cross-entropy against P and, with row_scale, the gradient
  // (softmax - P) * scale over the logits or into grad_b.
  const PT* pr = P + (cnt ? tr : 0) * Vd;
  const float sc = row_scale ? row_scale[n] : 0.f;
  __nv_bfloat16* gb = grad_b ? grad_b + int64_t(blockIdx.x) * Vd : nullptr;
  float c = 0;
  const auto visit2 = [&](float x, float p) {
    if (cnt) c -= p * (x - lz);
    return cnt ? (expf(x - lz) - p) * sc : 0.f;
  };
  if (cnt || row_scale) {
    if (v4) {
      for (int64_t q = threadIdx.x; q < Vd / 4; q += blockDim.x) {
        const float4 x = load4(lg, q), p = cnt ? load4(pr, q) : make_float4(0.f, 0.f, 0.f, 0.f);
        const float4 g = make_float4(visit2(x.x, p.x), visit2(x.y, p.y), visit2(x.z, p.z), visit2(x.w, p.w));
        if (!row_scale) continue;
        if (gb) {
          reinterpret_cast<__nv_bfloat162*>(gb + 4 * q)[0] = __floats2bfloat162_rn(g.x, g.y);
          reinterpret_cast<__nv_bfloat162*>(gb + 4 * q)[1] = __floats2bfloat162_rn(g.z, g.w);
        } else if constexpr (std::is_same_v<LT, float>) {
          reinterpret_cast<float4*>(lg)[q] = g;
        }
      }
    } else {
      for (int64_t d = threadIdx.x; d < Vd; d += blockDim.x) {
        const float g = visit2(load1(lg + d), cnt ? load1(pr + d) : 0.f);
        if (!row_scale) continue;
        if (gb)
          gb[d] = __float2bfloat16_rn(g);
        else if constexpr (std::is_same_v<LT, float>)
          lg[d] = g;
      }
    }
  }
  c = block_sum(c, shv);
  if (threadIdx.x == 0) {
    ce[n] = cnt ? c : 0.f;
    counts[n] = cnt;
    hit[n] = cnt && arg == tgt_arg[tr];
  }
}

// n zeroed values of device memory. The zeros are written on the engine's stream s, and are in
// place when this returns: a plain cudaMemset goes to the legacy default stream, which the
// engine's non-blocking streams do not wait for (nor it for them), so a buffer grown in the
// middle of a run (a bf16 copy, score buffers) could be cleared after the first product on s
// had already written it; with other work on the GPU that happened.
template <class X>
X* dalloc(size_t n, size_t& total, cudaStream_t s) {
  X* p = nullptr;
  if (n == 0) n = 1;
  CUDA_CHECK(cudaMalloc(&p, n * sizeof(X)));
  CUDA_CHECK(cudaMemsetAsync(p, 0, n * sizeof(X), s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  total += n * sizeof(X);
  return p;
}

}  // namespace

struct DraftEngine::Impl {
  // The GPU: streams, the cuBLAS handle (s, copy_s and blas below are its) and the event
  // aux_ready. Made after the options are checked; destroyed last.
  std::unique_ptr<Device> dev;
  int device = 0;
  DraftDims d;
  DraftMath math;
  // chunk: rows of full target logits per product in prepare() (into full, which lies in the
  // gate/up block); lrows: rows of draft logits per product in run() (into logits, in dact).
  int64_t R = 0, N = 0, qd = 0, kvd = 0, chunk = 0, lrows = 0;
  size_t bytes = 0;
  cudaStream_t s = nullptr;
  cublasHandle_t blas = nullptr;
  // GpuDraftOptions::products other than cublas: the products with bf16 operands through
  // cuBLASLt with a fixed per-shape rule (destroyed before dev).
  std::unique_ptr<LtProducts> lt_products;
  std::vector<void*> owned;
  std::vector<int64_t> sizes, offs;
  // Target.
  float *embed = nullptr, *fnorm = nullptr, *lm = nullptr, *inv = nullptr;
  __nv_bfloat16* embed_b = nullptr;  // with bf16 operands the target embedding is held as bf16 only
  // --gpu-batch-embeddings: the target's embedding stays on the host as bf16 (host_embed [V, H],
  // pinned and mapped into the device's address space); prepare() sends the batch's distinct
  // tokens up (emb_toks, through the pinned emb_stage) and a kernel on the copy stream reads their
  // rows from host memory into emb_rows (row 0: token 0, what a step past a sample's end reads),
  // so no host thread copies rows; the batch's ids go up as row numbers (cids), which gather()
  // then reads in place of embed_b and ids.
  bool batch_embed = false;
  uint16_t* host_embed = nullptr;  // pinned, mapped
  const uint16_t* host_embed_d = nullptr;  // its device-side address
  std::vector<int32_t> emb_slot;  // [V]: batch_tokens' scratch
  BatchTokens emb_batch;
  __nv_bfloat16* emb_rows = nullptr;
  int32_t *emb_stage = nullptr, *emb_toks = nullptr;
  int32_t* cids = nullptr;
  int64_t* kept;
  uint8_t* t2d;
  // Parameters, gradients, moments: one buffer each, tensors at offs[i].
  float *W, *G, *M, *Vm;
  double* partial;
  // Batch.
  int32_t *ids, *pos, *len, *tgt_arg;
  uint8_t *mask, *in_vocab, *hit, *cnt;
  float *aux, *hidden, *P = nullptr, *hn, *full, *rs, *ce;
  __nv_bfloat16* Ph = nullptr;  // the target distribution as bf16 instead of P, with bf16 operands
  // Per step (K copies; gs has K + 1).
  std::vector<float*> gs, xin, q, att, lse, hm, ga, up, fn;
  // With bf16 operands, ga and up stored as bf16 instead; with GpuDraftOptions::fused_products
  // side by side in each row ([R, 2I]: gate then up, upb[k] = gab[k] + I) so that one product
  // makes both (w_gu_adjacent: W_gate and W_up are one [2I, H] matrix in W, Wb and G), else in
  // [R, I] blocks of their own, a product each. gu_fused: the backward writes dgate|dup the same
  // way into the lent block's part that holds dga and dup and runs one product for dhm and one
  // for d[W_gate; W_up] instead of two each (no fp32 accumulation of dhm in between).
  std::vector<__nv_bfloat16*> gab, upb;
  bool w_gu_adjacent = false, gu_fused = false;
  // With bf16 operands and W_q, W_k, W_v one [qd + 2 kvd, 2H] matrix in W, Wb and G: the
  // backward casts dq|dk|dv side by side into that part (idle by then) and runs one product for
  // dxin and one for d[W_q; W_k; W_v] instead of three each.
  bool qkv_fused = false;
  int64_t gu_ld() const { return w_gu_adjacent ? 2 * d.I : d.I; }
  float *keys, *vals, *dK, *dV;
  // Scratch.
  float *E, *tmp, *act, *logits, *dfn, *dg2, *dact, *dga, *dup, *dhm, *dg1, *datt, *D, *dq, *dxin, *dg, *dgn;
  double* wpart;  // the RMSNorm backward's weight parts (rmsnorm_backward_groups(R) x H)
  // Attention: score buffers for one causal query block [nkv, blk, T] (grown to the longest
  // sample), the diagonal scores/probabilities and their gradients [R, nh, K].
  float *Sb = nullptr, *dPb = nullptr, *sd = nullptr, *dsd = nullptr;
  __nv_bfloat16 *Pb = nullptr, *dSb = nullptr;  // with bf16 operands: P and dS as the products read them
  int64_t s_cap = 0;
  bool loop_attention = false;  // --gpu-attention loop: the fp32 warp kernels
  // The fused tensor-core kernels of ttt_attention.h for the causal part (the default with
  // bf16 operands and a head size they support; --gpu-attention blocks: the cuBLAS
  // products over score buffers instead). Their tile list is made per batch in prepare().
  bool flash_attention = false;
  // --gpu-attention cudnn: the causal part through cuDNN's fused attention (backend/cuda/cudnn_sdpa.h)
  // instead; the diagonal keys as with the fused kernels. cudnn_grads: its bf16 dQ, dK0, dV0 in
  // the backward (in dact's memory when they fit, like dkv_part).
  bool cudnn_attention = false;
  // auto: cuDNN for a batch whose bucket's workspace fits cudnn_cap bytes (the idle block lent
  // to it, or GpuDraftOptions::cudnn_auto_bytes), the fused kernels for the others; prepare()
  // sets cudnn_attention per batch. cudnn_batches counts the batches it took.
  bool cudnn_auto = false;
  int64_t cudnn_cap = 0, cudnn_batches = 0;
  std::string note;  // a fallback to report once (take_note)
  std::unique_ptr<CudnnSdpa> cudnn;
  __nv_bfloat16* cudnn_grads = nullptr;
  int64_t* seq_start_d = nullptr;
  int32_t* tiles_d = nullptr;
  int64_t n_tiles = 0;
  float* dkv_part = nullptr;  // [2, nh/nkv, R, kvd]: per-head partial dK0/dV0 of the fused backward
  std::vector<int64_t> h_seq_start;
  std::vector<int32_t> h_tiles;
  // Query-block size of the causal skipping (--gpu-attn-block; 0: whole samples).
  int64_t attn_block = 1024;
  // With DraftMath::BF16, every product reads bf16 operands from memory (the weights' bf16
  // copy Wb, refreshed after each update; the target lm_head's copy lmb; activations as bf16
  // twins, written so by the kernel that makes them or cast from fp32 just before use) with
  // fp32 accumulation and fp32 outputs. Same rounding as cuBLAS's bf16 compute mode on fp32
  // operands (to nearest even), so the same numbers up to summation order; Hopper's bf16
  // kernels need bf16 in memory to run at bf16 rate. --gpu-fp32-operands keeps fp32
  // operands in memory and lets cuBLAS round them (the slower, older path).
  bool bf16_operands = false;
  // When a run has a backward, each step's loss gradient goes through the lm_head as soon
  // as the forward has the logits (dW_lm accumulated there, d fn written over fn[k], which
  // nothing else reads later), so the backward does not recompute the [N, Vd] logits; dW_lm
  // then sums the steps first to last. --gpu-lm-grad-in-backward recomputes them in
  // the backward instead, last step first like the CPU reference.
  bool lm_backward_in_forward = true;
  // Activations only ever read as products' operands are stored as bf16 only (in their
  // buffers, which are allocated at half size): with bf16 operands, xin (unless
  // norm_before_residual, whose residual reads xin's second half), hm, and act, dga, dup.
  // The bits are those of casting an fp32 copy, which is what they replace.
  bool xin_bf16 = false, hm_bf16 = false;
  // With the fused attention kernels, the queries (after RoPE) and the attention output are
  // stored as bf16 only as well: every kernel that reads them takes bf16 (the fused kernels,
  // the diagonal-key kernels, D = rowsum(dO * O)), and the products read them as operands.
  bool qa_bf16 = false;
  __nv_bfloat16 *Wb = nullptr, *lmb = nullptr;
  __nv_bfloat16* lgb = nullptr;  // with bf16 operands: the loss gradient over the draft vocab [R, Vd]
  int64_t w_total = 0;
  __nv_bfloat16* cast_buf[2] = {nullptr, nullptr};
  int64_t cast_cap[2] = {0, 0};
  // bf16 twins of fp32 activations that several products read (see Twin); twin_buf[i] is
  // the storage of the i-th twin made by a cast.
  struct TwinReg {
    const float* p;
    int64_t n;
    const __nv_bfloat16* b;
    bool cast;  // b is twin_buf storage
  };
  std::vector<TwinReg> twins;
  std::vector<__nv_bfloat16*> twin_buf;
  std::vector<int64_t> twin_cap;
  int n_cast_twins = 0;
  // Pinned host staging for a batch's features, and the stream that uploads aux while the
  // target distribution runs on s.
  float *host_aux = nullptr, *host_hidden = nullptr;
  bool host_pin_failed = false;
  cudaStream_t copy_s = nullptr;
  cudaEvent_t aux_ready = nullptr;
  // A batch's small host arrays (ids, positions, row maps, row weights) go up through pinned
  // staging: a copy from pageable memory waits for the stream first, which left the device idle
  // while the host prepared the next batch. The staging fills from its start at each prepare(),
  // once the copies of the last batch are done (staged: recorded after each copy).
  uint8_t* stage = nullptr;
  size_t stage_cap = 0, stage_off = 0;
  cudaEvent_t staged = nullptr;
  void upload(void* dst, const void* src, size_t n) {
    if (n == 0) return;
    if (stage_off + n > stage_cap) {  // a larger staging, once the copies reading this one are done
      CUDA_CHECK(cudaStreamSynchronize(s));
      if (stage) CUDA_CHECK(cudaFreeHost(stage));
      stage = nullptr;
      stage_cap = std::max(2 * stage_cap, n + 4096);
      CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&stage), stage_cap, cudaHostAllocDefault));
      stage_off = 0;
    }
    std::memcpy(stage + stage_off, src, n);
    CUDA_CHECK(cudaMemcpyAsync(dst, stage + stage_off, n, cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaEventRecord(staged, s));
    stage_off = (stage_off + n + 15) / 16 * 16;
  }
  // Called before a batch's first upload().
  void restart_staging() {
    CUDA_CHECK(cudaEventSynchronize(staged));
    stage_off = 0;
  }
  // Pinned host room for a batch's row statistics (ce [K N] floats, then hit and counts [K N]
  // bytes each): read back right after the forward without holding the host (a copy to pageable
  // memory returns only once the device has got there), handed out after run()'s one sync.
  uint8_t* stats_host = nullptr;
  void take_stats(DraftRowStats& out, size_t kn) const {
    out.ce.resize(kn);
    out.hit.resize(kn);
    out.counts.resize(kn);
    std::memcpy(out.ce.data(), stats_host, kn * 4);
    std::memcpy(out.hit.data(), stats_host + kn * 4, kn);
    std::memcpy(out.counts.data(), stats_host + kn * 5, kn);
  }
  // The end of run(): its statistics now (one sync), or once `ran` has passed (finish_run()).
  void end_run(DraftRowStats& out, size_t kn, bool wait) {
    if (!wait) {
      CUDA_CHECK(cudaEventRecord(ran, s));
      kn_pending = kn;
      return;
    }
    CUDA_CHECK(cudaStreamSynchronize(s));
    take_stats(out, kn);
    collect();
  }
  // --gpu-profile: GPU time per phase, from events between marks.
  bool profiling = false;
  std::vector<std::pair<std::string, cudaEvent_t>> marks;
  std::vector<std::pair<std::string, double>> prof_ms;
  void mark(const char* phase) {
    if (!profiling) return;
    cudaEvent_t e;
    CUDA_CHECK(cudaEventCreate(&e));
    CUDA_CHECK(cudaEventRecord(e, s));
    marks.push_back({phase, e});
  }
  void collect() {  // after a stream sync
    if (!profiling || marks.empty()) return;
    for (size_t i = 0; i + 1 < marks.size(); ++i) {
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, marks[i].second, marks[i + 1].second));
      auto it = std::find_if(prof_ms.begin(), prof_ms.end(), [&](auto& x) { return x.first == marks[i].first; });
      if (it == prof_ms.end()) prof_ms.push_back({marks[i].first, double(ms)});
      else it->second += double(ms);
    }
    for (auto& m : marks) cudaEventDestroy(m.second);
    marks.clear();
  }
  std::vector<std::pair<int64_t, int64_t>> seqs;  // (first row, length)
  // The batch's target_rows() (trows, on the device too) and loss_rows() (lr; its rows and
  // slots on the device as lrow, lslot [K, N]): the target side and the draft logits are
  // only made for them. The host copies stay until the next prepare() (their uploads read
  // them).
  std::vector<int32_t> trows;
  LossRows lr;
  int32_t *trow_d = nullptr, *lrow_d = nullptr, *lslot_d = nullptr;
  // Rows no later loss reads (GpuDraftOptions::row_cut; the CPU reference's ttt_forward cuts
  // the same rows): a row none of whose steps 1..K-1 counts (prompt rows, most of all) cannot
  // change a loss, a metric or a gradient from step 1 on, so steps 1..K-1 run only the N1 rows
  // some of those steps count (cut, when that is fewer than N). Their products, norms, MLP and
  // residual stream hold the kept rows in order, compacted (crow: each compacted row's batch
  // row; cinv: each batch row's compacted row or -1). The attention keeps the batch layout (its
  // causal keys are step 0's, every row's): a step's queries and diagonal keys are expanded
  // into it with zeros in the rows left out, which read finite values and pass back zero
  // gradients, and its output is compacted again for the products. clrow [K, N]: the loss rows
  // of each step as compacted rows; clslot [K, N]: each compacted row's loss slot or -1 (rc:
  // their host copies, which the uploads read; rc.cut: rows are cut in this batch). gsc:
  // step 1's input, the compacted copy of step 0's output (in hidden's memory, idle in run()).
  // cbuf: the compacted attention output in the backward (in dact when it fits).
  // Step 0 runs every row up to its attention (their keys and values are every later step's
  // causal keys); after it, with rc.cut0 (EAGLE-3 only), only its N0 rows (RowCut::crow0:
  // its own loss rows and the kept rows), compacted the same way (crow0_d, cinv0_d; clrow0_d,
  // clslot0_d: step 0's loss rows and slots in that numbering). c10_d maps step 1's input
  // rows into them, cinv10_d step 1's gradient back.
  bool row_cut = false;
  bool fused_diag = true;  // GpuDraftOptions::fused_diag_backward
  bool diag_regs = true;   // GpuDraftOptions::diag_rows_in_registers
  bool fused_rope = true;  // GpuDraftOptions::fused_rope_rows
  // With fused_rope and bf16 queries: step 0's keys and values as bf16 (R x kvd each), written
  // by its forward's qkv_rope_rows_kernel; the attention of every step reads them (kv0_twin)
  // instead of casting the fp32 ones again at each call.
  __nv_bfloat16 *kb0 = nullptr, *vb0 = nullptr;
  // The forward's q, k and v as one product (GpuDraftOptions::qkv_forward_product, with
  // qkv_fused, fused_rope and bf16 queries): its rows go to dga's part, which the setup sizes
  // for them, and qkv_rope_rows_kernel reads them from there.
  bool qkv_forward = false;
  bool head_groups = false;  // GpuDraftOptions::cudnn_head_groups (for setup())
  RowCut rc;
  int64_t N1 = 0, N0 = 0;  // kept rows (N without a cut); step 0's rows after its attention
  int64_t Nr = 0;  // rows of the part of the step being run (N; N1 after step 0; N0 after step 0's attention)
  int32_t *crow_d = nullptr, *cinv_d = nullptr, *clrow_d = nullptr, *clslot_d = nullptr;
  int32_t *crow0_d = nullptr, *cinv0_d = nullptr, *clrow0_d = nullptr, *clslot0_d = nullptr, *c10_d = nullptr,
          *cinv10_d = nullptr;
  float *gsc = nullptr, *cbuf = nullptr;
  int64_t row_steps = 0;  // DraftEngine::row_steps
  double product_flops = 0;  // DraftEngine::product_flops
  bool cut_step(int k) const { return rc.cut && k > 0; }
  bool cut0(int k) const { return rc.cut0 && k == 0 && !d.peagle; }
  // Step k's rows after its attention are compacted (the kept rows, or step 0's N0).
  bool post_cut(int k) const { return cut_step(k) || cut0(k); }
  // Nr for step k up to its attention, and after it.
  void rows_for(int k) { Nr = cut_step(k) ? N1 : N; }
  void rows_after_attention(int k) { Nr = cut0(k) ? N0 : cut_step(k) ? N1 : N; }
  // out[i] = in[src[i]] (zeros where src[i] < 0) for n rows of C values of X.
  template <class X>
  void move_rows(X* out, const X* in, const int32_t* src, int64_t n, int64_t C) {
    if (n <= 0) return;
    launch_dependent(kDependTrain, rows_move_kernel<X>, dim3(unsigned(n)), dim3(256), 0, s, out, in, src, C);
  }
  // Batch rows to the N1 kept rows, and back (zeros in the rows left out).
  void compact(float* out, const float* in, int64_t C) { move_rows(out, in, crow_d, N1, C); }
  void expand(float* out, const float* in, int64_t C) { move_rows(out, in, cinv_d, N, C); }
  // Step k's compacted rows after its attention: each one's batch row, and each batch row's
  // compacted row or -1.
  const int32_t* post_crow(int k) const { return cut0(k) ? crow0_d : crow_d; }
  const int32_t* post_cinv(int k) const { return cut0(k) ? cinv0_d : cinv_d; }
  // Step k's attention output as the products read it: att[k] itself, or its rows after the
  // attention compacted into out (as stored: bf16 with qa_bf16).
  float* att_rows(int k, float* out) {
    if (!post_cut(k)) return att[size_t(k)];
    const int64_t n = cut0(k) ? N0 : N1;
    if (qa_bf16)
      move_rows(bf16_in(out), bf16_in(att[size_t(k)]), post_crow(k), n, qd);
    else
      move_rows(out, att[size_t(k)], post_crow(k), n, qd);
    return out;
  }
  // P-EAGLE: the target distribution's entropy per batch row (ent, and its host copy from
  // prepare()); null for EAGLE-3, whose loss does not read it.
  float* ent = nullptr;
  std::vector<float> h_ent;
  // P-EAGLE (d.peagle). gm [R, H]: fc(mask_hidden) in every row, the input of every step after
  // the first (mrow [H]: that row); gmsum [H]: its gradient summed over rows and steps; gemb
  // [H]: the mask token's embedding gradient, summed likewise; sel [K, R]: the batch's elements
  // with a loss (DraftBatch::counts). The first step's tokens grouped by id for its embedding
  // gradient: distinct ids etok [n_etok], their rows erow[eoff[i] .. eoff[i+1]).
  float *gm = nullptr, *mrow = nullptr, *gmsum = nullptr, *gemb = nullptr;
  uint8_t* sel = nullptr;
  int32_t *etok = nullptr, *eoff = nullptr, *erow = nullptr;
  int64_t n_etok = 0;
  std::vector<int32_t> h_etok, h_eoff, h_erow;
  // The hidden input of step k: the previous step's output (EAGLE-3; step 0's compacted when
  // rows are cut), or P-EAGLE's gm (the same in every row).
  float* gin(int k) { return d.peagle && k > 0 ? gm : rc.cut && k == 1 ? gsc : gs[size_t(k)]; }

  // Everything allocated so far is freed, also when the constructor threw halfway.
  ~Impl() {
    if (!dev) return;
    cudaSetDevice(device);
    cudaStreamSynchronize(s);
    if (copy_s) cudaStreamSynchronize(copy_s);
    for (void* x : owned) cudaFree(x);
    free_scores();
    for (auto* c : twin_buf)
      if (c) cudaFree(c);
    for (auto* c : cast_buf)
      if (c) cudaFree(c);
    if (host_aux) cudaFreeHost(host_aux);
    if (emb_stage) cudaFreeHost(emb_stage);
    if (stage) cudaFreeHost(stage);
    if (stats_host) cudaFreeHost(stats_host);
    if (norm_host) cudaFreeHost(norm_host);
    if (host_embed) cudaFreeHost(host_embed);
    if (host_hidden) cudaFreeHost(host_hidden);
    for (auto& m : marks) cudaEventDestroy(m.second);
  }

  template <class X>
  X* alloc(size_t n) {
    X* p = dalloc<X>(n, bytes, s);
    owned.push_back(p);
    return p;
  }
  float* w(int t) { return W + offs[size_t(t)]; }
  float* g(int t) { return G + offs[size_t(t)]; }

  cublasComputeType_t compute() const {
    return math == DraftMath::F32 || bf16_operands ? CUBLAS_COMPUTE_32F
           : math == DraftMath::TF32               ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                   : CUBLAS_COMPUTE_32F_FAST_16BF;
  }
  cudaDataType_t operand_type() const { return bf16_operands ? CUDA_R_16BF : CUDA_R_32F; }
  // Elements a column-major operand op(X) of r x c with leading dimension ld spans in memory.
  static int64_t span(cublasOperation_t op, int64_t r, int64_t c, int64_t ld) {
    if (r <= 0 || c <= 0) return 0;
    return op == CUBLAS_OP_N ? (c - 1) * ld + r : (r - 1) * ld + c;
  }
  // The pointer a product reads for the fp32 operand p spanning n elements: p itself, or
  // with bf16 operands its bf16 twin (a weight's copy, or a cast into scratch `slot`).
  const void* operand(const float* p, int64_t n, int slot) {
    if (!bf16_operands) return p;
    const auto in = [p](const float* base, int64_t count) {
      const auto x = reinterpret_cast<uintptr_t>(p), b0 = reinterpret_cast<uintptr_t>(base);
      return x >= b0 && x < b0 + uintptr_t(count) * sizeof(float);
    };
    if (in(W, w_total)) return Wb + (p - W);
    for (auto it = twins.rbegin(); it != twins.rend(); ++it)
      if (in(it->p, it->n) && p + n <= it->p + it->n) return it->b + (p - it->p);
    return cast_into(cast_buf[slot], cast_cap[slot], p, n);
  }
  // bf16(p[0..n)) into buf (capacity cap, grown when short; the stream is drained before the
  // old storage is freed); returns buf.
  __nv_bfloat16* cast_into(__nv_bfloat16*& buf, int64_t& cap, const float* p, int64_t n) {
    if (n > cap) {
      if (buf) {
        CUDA_CHECK(cudaStreamSynchronize(s));
        cudaFree(buf);
        bytes -= size_t(cap) * 2;
      }
      buf = dalloc<__nv_bfloat16>(size_t(n), bytes, s);
      cap = n;
    }
    cast_bf16(buf, p, n, s);
    return buf;
  }
  // A bf16 twin of the fp32 activation p[0..n) for the products of one scope, made by a cast
  // or given (b: bf16 values a kernel wrote in place of fp32 ones). A product whose operand
  // lies inside p[0..n) reads the twin instead of casting it again. Scoped, last made first
  // undone; nothing happens with fp32 operands.
  struct Twin {
    Impl& I;
    bool on = false;
    Twin(Impl& im, const float* p, int64_t n) : I(im) {
      if (!I.bf16_operands || n <= 0) return;
      const size_t i = size_t(I.n_cast_twins);
      if (I.twin_buf.size() <= i) {
        I.twin_buf.push_back(nullptr);
        I.twin_cap.push_back(0);
      }
      I.twins.push_back({p, n, I.cast_into(I.twin_buf[i], I.twin_cap[i], p, n), true});
      ++I.n_cast_twins;
      on = true;
    }
    Twin(Impl& im, const float* p, int64_t n, const __nv_bfloat16* b) : I(im) {
      if (!I.bf16_operands || n <= 0) return;
      if (!b) fail_msg("draft on GPU: a bf16 twin without storage");
      I.twins.push_back({p, n, b, false});
      on = true;
    }
    ~Twin() {
      if (!on) return;
      if (I.twins.back().cast) --I.n_cast_twins;
      I.twins.pop_back();
    }
    Twin(const Twin&) = delete;
    Twin& operator=(const Twin&) = delete;
  };
  // Where a kernel writes an activation that is only ever a product's operand: the fp32
  // buffer itself, or with bf16 operands the same memory holding bf16 values.
  __nv_bfloat16* bf16_in(float* p) const { return reinterpret_cast<__nv_bfloat16*>(p); }
  // After the weights change: their bf16 copy.
  void refresh_weight_copy() {
    if (!bf16_operands) return;
    cast_bf16(Wb, W, w_total, s);
  }
  // The clipping factor clip_grad_norm_start() found, on the device (*dscale, 1 where no clip
  // was needed), not yet applied to G while scale_pending: AdamW applies it as it reads the
  // gradients; anything else that reads or adds to G applies it first (scale_grads), and
  // zeroing G drops it. The norm goes to norm_host (mapped pinned memory) and `normed` is
  // recorded after it, so the host reads it without holding the device.
  float* dscale = nullptr;
  bool scale_pending = false;
  double* norm_host = nullptr;
  cudaEvent_t normed = nullptr;
  bool norm_started = false;
  // run(..., wait = false): the run's statistics are read once `ran` has passed (finish_run());
  // until then no other batch may start (kn_pending: their count, K x N >= 1; 0: none pending).
  cudaEvent_t ran = nullptr;
  size_t kn_pending = 0;
  // Step 0's input, fc(aux) into gs[0], made by prepare() while the host builds the batch's row
  // maps (the device would idle there otherwise); run() makes it again if the weights changed
  // in between (weights_version counts their updates) or it was used already.
  bool fc_ready = false;
  uint64_t weights_version = 0, fc_version = 0;
  void fc_forward() {
    CUDA_CHECK(cudaStreamWaitEvent(s, aux_ready, 0));
    linear(gs[0], d.H, aux, 3 * d.H, w(FC), N, 3 * d.H, d.H);
    fc_ready = true;
    fc_version = weights_version;
  }
  void scale_grads() {
    if (!scale_pending) return;
    for (int t = 0; t < int(sizes.size()); ++t) {
      scale_at_kernel<<<nblocks(sizes[size_t(t)], 256), 256, 0, s>>>(g(t), dscale, sizes[size_t(t)]);
      CUDA_LAUNCH_CHECK();
    }
    scale_pending = false;
  }
  // GpuDraftOptions::fresh_grads: per tensor, whether its range of G awaits this run's first
  // product (its contents are stale until then); n_fresh of them.
  bool fresh_grads = false;
  std::vector<uint8_t> fresh;
  int64_t n_fresh = 0;
  // The tensors whose gradient only products write, each product a whole [O, K] matrix.
  bool product_written(int t) const {
    switch (t) {
      case FC:
      case WQ:
      case WK:
      case WV:
      case WO:
      case GATE:
      case UP:
      case DOWN:
        return true;
      case LM:
        return !d.peagle;  // (P-EAGLE's lm_head is frozen: nothing writes it)
      default:
        return false;
    }
  }
  void zero_grad(size_t t) { CUDA_CHECK(cudaMemsetAsync(G + offs[t], 0, size_t(sizes[t]) * 4, s)); }
  // G for a run that starts the gradients anew: all of it zeroed, or with fresh_grads only the
  // tensors that are not product_written (the others wait for their first product).
  void start_grads(int64_t total) {
    if (!fresh_grads) {
      CUDA_CHECK(cudaMemsetAsync(G, 0, size_t(total) * 4, s));
      return;
    }
    fresh.assign(sizes.size(), 0);
    n_fresh = 0;
    for (size_t t = 0; t < sizes.size(); ++t) {
      if (product_written(int(t))) {
        fresh[t] = 1;
        ++n_fresh;
      } else {
        zero_grad(t);
      }
    }
  }
  // The end of a backward: the ranges no product wrote are zeroed.
  void finish_grads() {
    if (n_fresh == 0) return;
    for (size_t t = 0; t < fresh.size(); ++t)
      if (fresh[t]) {
        zero_grad(t);
        fresh[t] = 0;
      }
    n_fresh = 0;
  }
  // The beta a product into C (column-major [m, n], ldc) should use: 0 where it is the first
  // product into fresh tensors and writes all of them (every overlapping tensor fresh and
  // inside the written range, C contiguous, k > 0); otherwise the given beta, after zeroing the
  // overlapping fresh tensors it would add to.
  float first_write(float* C, int64_t m, int64_t n, int64_t k, int64_t ldc, float beta) {
    if (n_fresh == 0 || C < G || C >= G + w_total || m <= 0 || n <= 0) return beta;
    const int64_t lo = C - G, hi = lo + (n - 1) * ldc + m;
    bool whole = beta == 1.f && ldc == m && k > 0;
    std::vector<size_t> hit;  // the overlapping fresh tensors
    for (size_t t = 0; t < sizes.size(); ++t) {
      const int64_t a = offs[t], b = offs[t] + sizes[t];
      if (b <= lo || a >= hi) continue;
      if (!fresh[t]) {
        whole = false;
        continue;
      }
      hit.push_back(t);
      if (a < lo || b > hi) whole = false;
    }
    for (size_t t : hit) {
      if (!whole) zero_grad(t);
      fresh[t] = 0;
    }
    n_fresh -= int64_t(hit.size());
    return whole && !hit.empty() ? 0.f : beta;
  }
  // Column-major C[m, n] (ldc) = alpha op(A) op(B) + beta C, fp32 C; A and B through operand().
  void gemm(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, const float* A, int64_t lda,
            const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
    gemm_raw(ta, tb, m, n, k, operand(A, span(ta, m, k, lda), 0), lda, operand(B, span(tb, k, n, ldb), 1), ldb, beta,
             C, ldc);
  }
  // As gemm, with A and B already of operand_type().
  void gemm_raw(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, const void* a,
                int64_t lda, const void* b, int64_t ldb, float beta, float* C, int64_t ldc) {
    const float alpha = 1.f;
    beta = first_write(C, m, n, k, ldc, beta);
    product_flops += 2.0 * double(m) * double(n) * double(k);
    if (lt_products) return lt_products->run(ta, tb, m, n, k, a, lda, b, ldb, beta, C, CUDA_R_32F, ldc, s);
    CUBLAS_CHECK(cublasGemmEx(blas, ta, tb, int(m), int(n), int(k), &alpha, a, operand_type(), int(lda), b,
                              operand_type(), int(ldb), &beta, C, CUDA_R_32F, int(ldc), compute(),
                              CUBLAS_GEMM_DEFAULT));
  }
  // Row-major y[N, O] (ld ldy) = beta*y + x[N, K] (ld ldx) @ w[O, K]^T
  void linear(float* y, int64_t ldy, const float* x, int64_t ldx, const float* wt, int64_t n, int64_t K, int64_t O,
              float beta = 0.f) {
    gemm(CUBLAS_OP_T, CUBLAS_OP_N, O, n, K, wt, K, x, ldx, beta, y, ldy);
  }
  // As linear() with beta 0, y stored as bf16 (fp32 accumulation, rounded once); bf16 operands.
  void linear_bf16(__nv_bfloat16* y, int64_t ldy, const float* x, int64_t ldx, const float* wt, int64_t n, int64_t K,
                   int64_t O) {
    const float alpha = 1.f, beta = 0.f;
    product_flops += 2.0 * double(O) * double(n) * double(K);
    const void* a = operand(wt, span(CUBLAS_OP_T, O, K, K), 0);
    const void* b = operand(x, span(CUBLAS_OP_N, K, n, ldx), 1);
    if (lt_products)
      return lt_products->run(CUBLAS_OP_T, CUBLAS_OP_N, O, n, K, a, K, b, ldx, beta, y, CUDA_R_16BF, ldy, s);
    CUBLAS_CHECK(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, int(O), int(n), int(K), &alpha, a, CUDA_R_16BF, int(K), b,
                              CUDA_R_16BF, int(ldx), &beta, y, CUDA_R_16BF, int(ldy), CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT));
  }
  // dx[N, K] (ld lddx) = beta*dx + dy[N, O] @ w[O, K]
  void linear_dx(float* dx, int64_t lddx, const float* dy, const float* wt, int64_t n, int64_t K, int64_t O,
                 float beta) {
    gemm(CUBLAS_OP_N, CUBLAS_OP_N, K, n, O, wt, K, dy, O, beta, dx, lddx);
  }
  // dw[O, K] += dy[N, O]^T @ x[N, K] (ld ldx)
  void linear_dw(float* dw, const float* dy, const float* x, int64_t ldx, int64_t n, int64_t K, int64_t O) {
    gemm(CUBLAS_OP_N, CUBLAS_OP_T, K, O, n, x, ldx, dy, O, 1.f, dw, K);
  }
  void rmsnorm(float* out, int64_t ldo, const float* x, int64_t ldx, const float* wt, int64_t C, float eps,
               int64_t n) {
    if (n == 0) return;
    rmsnorm_forward<float, const float, void>(out, NormRows{ldo}, x, NormRows{ldx}, nullptr, wt, n, C, eps, s);
    CUDA_LAUNCH_CHECK();
  }
  void rmsnorm(__nv_bfloat16* out, int64_t ldo, const float* x, int64_t ldx, const float* wt, int64_t C, float eps,
               int64_t n) {
    if (n == 0) return;
    rmsnorm_forward<__nv_bfloat16, const float, void>(out, NormRows{ldo}, x, NormRows{ldx}, nullptr, wt, n, C, eps, s);
    CUDA_LAUNCH_CHECK();
  }
  // dx = res + the input gradient (res: null, dx itself, or rows laid out as dx), and the
  // weight gradient dw += ... (dx may be null).
  void rmsnorm_backward(float* dx, int64_t lddx, const float* res, float* dw, const float* dout, int64_t ldd,
                        const float* x, int64_t ldx, const float* wt, int64_t C) {
    mark("backward: RMSNorm backward");
    cuda::rmsnorm_backward(dx, lddx, res, dw, wpart, dout, ldd, x, ldx, wt, Nr, C, d.eps, s);
    CUDA_LAUNCH_CHECK();
    mark("backward: products and norms");
  }
  // The bf16 twins of step k's xin and hm: their own storage when they are stored as bf16,
  // else a cast.
  Twin xin_twin(int k) {
    float* x = xin[size_t(k)];
    return xin_bf16 ? Twin(*this, x, Nr * 2 * d.H, bf16_in(x)) : Twin(*this, x, Nr * 2 * d.H);
  }
  Twin hm_twin(int k) {
    float* x = hm[size_t(k)];
    return hm_bf16 ? Twin(*this, x, Nr * d.H, bf16_in(x)) : Twin(*this, x, Nr * d.H);
  }
  // gate and up of step k: ga, up = hm @ W^T (as bf16 with bf16 operands).
  void gate_up(int k) {
    const int64_t H = d.H, Id = d.I;
    const size_t ks = size_t(k);
    const Twin th = hm_twin(k);
    if (bf16_operands && w_gu_adjacent) {
      linear_bf16(gab[ks], 2 * Id, hm[ks], H, w(GATE), Nr, H, 2 * Id);
    } else if (bf16_operands) {
      linear_bf16(gab[ks], Id, hm[ks], H, w(GATE), Nr, H, Id);
      linear_bf16(upb[ks], Id, hm[ks], H, w(UP), Nr, H, Id);
    } else {
      linear(ga[ks], Id, hm[ks], H, w(GATE), Nr, H, Id);
      linear(up[ks], Id, hm[ks], H, w(UP), Nr, H, Id);
    }
  }
  // act = silu(ga) * up of step k, and its backward (dga, dup); bf16 with bf16 operands.
  void swiglu(float* act, int k) {
    const size_t ks = size_t(k);
    if (bf16_operands)
      launch_swiglu_forward(bf16_in(act), gab[ks], upb[ks], gu_ld(), Nr, d.I, s);
    else
      launch_swiglu_forward(act, ga[ks], up[ks], d.I, Nr, d.I, s);
  }
  // With gu_fused, dgate|dup rows of 2I at bf16_in(dga) (dup's argument unused).
  void swiglu_backward(float* dga, float* dup, const float* dact, int k) {
    const size_t ks = size_t(k);
    if (gu_fused)
      launch_swiglu_backward(bf16_in(dga), bf16_in(dga) + d.I, dact, gab[ks], upb[ks], gu_ld(), 2 * d.I, Nr, d.I, s);
    else if (bf16_operands)
      launch_swiglu_backward(bf16_in(dga), bf16_in(dup), dact, gab[ks], upb[ks], gu_ld(), d.I, Nr, d.I, s);
    else
      launch_swiglu_backward(dga, dup, dact, ga[ks], up[ks], d.I, d.I, Nr, d.I, s);
  }
  // E = the embeddings of the tokens step k feeds.
  void gather(int k) {
    const int32_t fixed = d.peagle ? d.mask_token : -1;
    const int32_t* map = cut_step(k) ? crow_d : nullptr;
    if (batch_embed)
      gather_kernel<<<unsigned(Nr), 256, 0, s>>>(E, emb_rows, cids, pos, len, d.H, k, fixed, map);
    else if (embed_b)
      gather_kernel<<<unsigned(Nr), 256, 0, s>>>(E, embed_b, ids, pos, len, d.H, k, fixed, map);
    else
      gather_kernel<<<unsigned(Nr), 256, 0, s>>>(E, embed, ids, pos, len, d.H, k, fixed, map);
    CUDA_LAUNCH_CHECK();
  }
  // RoPE of step k over x in place, or into out_b as bf16 (x left as it was); sign -1 rotates
  // a gradient back.
  void rope(float* x, int64_t heads, int k, double sign, __nv_bfloat16* out_b = nullptr) {
    const int64_t ld = heads * d.hd;
    if (out_b)
      launch_rope(out_b, ld, x, ld, pos, k, inv, sign, N, heads, d.hd, s);
    else
      launch_rope(x, ld, x, ld, pos, k, inv, sign, N, heads, d.hd, s);
  }
  AttnArgs attn_args(int k) {
    return AttnArgs{qa_bf16 ? nullptr : q[size_t(k)],
                    keys,
                    vals,
                    N,
                    R * kvd,
                    int(d.nh),
                    int(d.nkv),
                    int(d.hd),
                    k,
                    float(1.0 / std::sqrt(double(d.hd))),
                    pos,
                    len,
                    qa_bf16 ? bf16_in(q[size_t(k)]) : nullptr};
  }
  // Step 0's keys or values (x: keys or vals) as the attention's operands read them: the copy
  // step 0's forward wrote (b: kb0, vb0) or a cast.
  Twin kv0_twin(float* x, const __nv_bfloat16* b) {
    return b ? Twin(*this, x, N * (d.nkv * d.hd), b) : Twin(*this, x, N * (d.nkv * d.hd));
  }
  // The bf16 twins of step k's queries and attention output: their own storage when they are
  // stored as bf16 (make these before any cast twin of the same scope, see xin_twin), else casts.
  Twin q_twin(int k) {
    float* x = q[size_t(k)];
    return qa_bf16 ? Twin(*this, x, N * qd, bf16_in(x)) : Twin(*this, x, N * qd);
  }
  // The products' view of step k's attention output x (att[k], or its compacted rows: att_rows).
  Twin att_twin(float* x) { return qa_bf16 ? Twin(*this, x, Nr * qd, bf16_in(x)) : Twin(*this, x, Nr * qd); }
  // out = g1 of step k = r + o_proj(att[k]), r = gin(k) (or hidden_norm(gin(k)), the second
  // half of xin[k], with norm_before_residual); the product goes to tmp first (out may be
  // tmp). The forward and the backward's recompute both come here: the same product on the
  // same operands, so the same bits.
  // a: the attention output as the products read it (att_rows).
  // With step 0's rows cut after its attention, r's rows are picked from the batch's (crow0).
  void g1_into(int k, float* out, float* a) {
    const size_t ks = size_t(k);
    {
      const Twin ta = att_twin(a);
      linear(tmp, d.H, a, qd, w(WO), Nr, qd, d.H);
    }
    const int32_t* rmap = cut0(k) ? crow0_d : nullptr;
    if (d.norm_before_residual)
      add_rows_kernel<<<nblocks(Nr * d.H, 256), 256, 0, s>>>(out, xin[ks] + d.H, 2 * d.H, rmap, tmp, Nr, d.H);
    else
      add_rows_kernel<<<nblocks(Nr * d.H, 256), 256, 0, s>>>(out, gin(k), d.H, rmap, tmp, Nr, d.H);
    CUDA_LAUNCH_CHECK();
  }
  // f(P) with the target distribution as it is stored: bf16 (Ph) or fp32 (P).
  template <class F>
  void with_target_dist(F&& f) {
    if (Ph)
      f(Ph);
    else
      f(P);
  }
  // Step k's draft logits and loss for the rows that count at step k (lr), lrows of them at a
  // time (the logits scratch holds one chunk). Those rows of fn[k] are gathered into E first
  // (idle then: the next gather(k) remakes it), as bf16 with bf16 operands. With `grad`,
  // d(objective)/d(logits) goes back through the lm_head: dW_lm += over the gathered rows,
  // their d fn into tmp (idle too), then scattered into dfn (zero on the other rows; dfn may
  // be fn[k] itself, read only by the gather). With bf16 operands the gradient of every
  // gathered row is kept in lgb as bf16 and each of the two products runs once over them;
  // with fp32 operands the gradient replaces the chunk's logits and the products run per
  // chunk.
  void lm_head_step(int k, bool grad, float* dfn, const char* phase, const char* back_phase) {
    const int64_t Vd = d.Vd, H = d.H, nk = lr.count[size_t(k)];
    // rows: the batch rows (the loss reads the target side by them); at, the rows of fn[k].
    const int32_t* rows = lrow_d + k * N;
    const int32_t* at = cut0(k) ? clrow0_d : cut_step(k) ? clrow_d + k * N : rows;
    const bool whole = grad && bf16_operands;
    mark(phase);
    if (nk > 0) {
      if (bf16_operands)
        rows_gather_kernel<<<unsigned(nk), 256, 0, s>>>(bf16_in(E), fn[size_t(k)], at, H);
      else
        rows_gather_kernel<<<unsigned(nk), 256, 0, s>>>(E, fn[size_t(k)], at, H);
      CUDA_LAUNCH_CHECK();
    }
    const Twin te(*this, E, nk * H, bf16_in(E));
    for (int64_t r0 = 0; r0 < nk; r0 += lrows) {
      const int64_t n = std::min(lrows, nk - r0);
      mark(phase);
      // With bf16 operands the logits are stored as bf16 (their gradient goes to lgb), as
      // the field's trainers keep them under autocast.
      const auto loss = [&](auto* lg) {
        with_target_dist([&](auto* p) {
          using PT = std::remove_cv_t<std::remove_pointer_t<decltype(p)>>;
          using LT = std::remove_cv_t<std::remove_pointer_t<decltype(lg)>>;
          launch_dependent(kDependTrain, loss_kernel<PT, LT>, dim3(unsigned(n)), dim3(512), 0, s, lg, p, tgt_arg,
                           in_vocab, mask, pos, len, Vd, k, rows, r0, grad ? rs + k * N : nullptr,
                           whole ? lgb + r0 * Vd : nullptr, ce + k * N, hit + k * N, cnt + k * N,
                           d.peagle ? sel + k * N : nullptr);
        });
      };
      if (bf16_operands) {
        linear_bf16(bf16_in(logits), Vd, E + r0 * H, H, w(LM), n, H, Vd);
        loss(bf16_in(logits));
      } else {
        linear(logits, Vd, E + r0 * H, H, w(LM), n, H, Vd);
        loss(logits);
      }
      CUDA_LAUNCH_CHECK();
      if (grad && !whole) {
        mark(back_phase);
        if (!d.peagle) linear_dw(g(LM), logits, E + r0 * H, H, n, H, Vd);  // P-EAGLE's lm_head is frozen
        linear_dx(tmp + r0 * H, H, logits, w(LM), n, H, Vd, 0.f);
      }
    }
    if (!grad) return;
    mark(back_phase);
    if (whole && nk > 0) {  // dW_lm[Vd, H] += lgb^T E (not for P-EAGLE's frozen one);  tmp[nk, H] = lgb W_lm
      if (!d.peagle) gemm_raw(CUBLAS_OP_N, CUBLAS_OP_T, H, Vd, nk, operand(E, nk * H, 1), H, lgb, Vd, 1.f, g(LM), H);
      gemm_raw(CUBLAS_OP_N, CUBLAS_OP_N, H, nk, Vd, operand(w(LM), Vd * H, 0), H, lgb, Vd, 0.f, tmp, H);
    }
    const int32_t* slots = cut0(k) ? clslot0_d : (cut_step(k) ? clslot_d : lslot_d) + k * N;
    rows_scatter_kernel<<<unsigned(Nr), 256, 0, s>>>(dfn, tmp, slots, H);
    CUDA_LAUNCH_CHECK();
  }

  // Column-major strided-batched C = alpha op(A) op(B) + beta C (cuBLAS conventions).
  void gemm_sb(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, float alpha,
               const float* A, int64_t lda, int64_t sA, const float* B, int64_t ldb, int64_t sB, float beta, float* C,
               int64_t ldc, int64_t sC, int64_t batch) {
    const void* a = operand(A, (batch - 1) * sA + span(ta, m, k, lda), 0);
    const void* b = operand(B, (batch - 1) * sB + span(tb, k, n, ldb), 1);
    CUBLAS_CHECK(cublasGemmStridedBatchedEx(blas, ta, tb, int(m), int(n), int(k), &alpha, a, operand_type(), int(lda),
                                            sA, b, operand_type(), int(ldb), sB, &beta, C, CUDA_R_32F, int(ldc), sC,
                                            int(batch), compute(), CUBLAS_GEMM_DEFAULT));
  }
  void free_scores() {
    for (float* p : {Sb, dPb})
      if (p) cudaFree(p);
    for (__nv_bfloat16* p : {Pb, dSb})
      if (p) cudaFree(p);
    bytes -= size_t(s_cap) * ((Sb ? 4 : 0) + (dPb ? 4 : 0) + (Pb ? 2 : 0) + (dSb ? 2 : 0));
    Sb = dPb = nullptr;
    Pb = dSb = nullptr;
    s_cap = 0;
  }
  // Score buffers for one query block of blk rows against T keys, per kv head.
  void ensure_scores(int64_t blk, int64_t T) {
    const int64_t need = d.nkv * blk * T;
    if (need <= s_cap) return;
    CUDA_CHECK(cudaStreamSynchronize(s));
    free_scores();
    Sb = dalloc<float>(size_t(need), bytes, s);
    dPb = dalloc<float>(size_t(need), bytes, s);
    if (bf16_operands) {
      Pb = dalloc<__nv_bfloat16>(size_t(need), bytes, s);
      dSb = dalloc<__nv_bfloat16>(size_t(need), bytes, s);
    }
    s_cap = need;
  }
  // Causal key blocks: queries [b0, b0 + nb) of a sample attend to step-0 keys [0, b0 + nb)
  // only. Each query block's scores are made, normalised and used before the next block's,
  // in buffers of [nkv, blk, T]; the score tiles above the block's last key are never
  // computed (about (1 + T/blk) / (2 T/blk) of the T x T work is left).
  int64_t attn_blk(int64_t T) const { return attn_block > 0 ? std::min(attn_block, T) : T; }
  // Rows b0..b0+nb (queries) of S_kh for heads kh*grp + g of the sample at rows r0..r0+T,
  // against keys 0..b0+nb, into the block buffer out: scale * Q K0^T; or, with values,
  // dP = dO V0^T (dO in place of Q).
  void scores(float* out, const float* qrows, const float* kvrows, int64_t T, int64_t blk, int g, float alpha,
              int64_t b0, int64_t nb) {
    const int64_t grp = d.nh / d.nkv;
    gemm_sb(CUBLAS_OP_T, CUBLAS_OP_N, b0 + nb, nb, d.hd, alpha, kvrows, kvd, d.hd, qrows + b0 * qd + g * d.hd, qd,
            grp * d.hd, 0.f, out, T, blk * T, d.nkv);
  }
  // Rows b0..b0+nb of out (heads kh*grp + g, row stride qd) = M X0[0..b0+nb), M the block
  // buffer of P or dS and X0 the sample's step-0 values or keys.
  void times_kv(float* out, const float* M, const float* kvrows, int64_t T, int64_t blk, int g, int64_t b0,
                int64_t nb) {
    const int64_t grp = d.nh / d.nkv;
    gemm_sb(CUBLAS_OP_N, CUBLAS_OP_N, d.hd, nb, b0 + nb, 1.f, kvrows, kvd, d.hd, M, T, blk * T, 0.f,
            out + b0 * qd + g * d.hd, qd, grp * d.hd, d.nkv);
  }
  // dX0[0..b0+nb) += M^T Y[rows b0..b0+nb) (dK0 with dS and Q, dV0 with P and dO).
  void kv_grad(float* dx, const float* M, const float* yrows, int64_t T, int64_t blk, int g, int64_t b0, int64_t nb) {
    const int64_t grp = d.nh / d.nkv;
    gemm_sb(CUBLAS_OP_N, CUBLAS_OP_T, d.hd, b0 + nb, nb, 1.f, yrows + b0 * qd + g * d.hd, qd, grp * d.hd, M, T,
            blk * T, 1.f, dx, kvd, d.hd, d.nkv);
  }
  // Arguments of the fused kernels for step k (bf16 twins of q, the step-0 keys and values,
  // and dO when given, made by the caller's Twins).
  TttFlashArgs flash_args(int k, const float* dO) {
    const auto bf = [&](const float* p, int64_t n) { return static_cast<const __nv_bfloat16*>(operand(p, n, 0)); };
    return TttFlashArgs{bf(q[size_t(k)], N * qd), bf(keys, N * kvd), bf(vals, N * kvd), dO ? bf(dO, N * qd) : nullptr,
                        seq_start_d, tiles_d, n_tiles, N, int(d.nh), int(d.nkv), int(d.hd),
                        float(1.0 / std::sqrt(double(d.hd)))};
  }
  // The diagonal keys of step a.k folded into the causal part (diag_merge_kernel): with the rows in
  // registers where the head size (up to 128) and the step (up to 8) allow, unless diag_regs is
  // off (GpuDraftOptions::diag_rows_in_registers).
  template <class OC>
  void diag_merge(const OC* oc, float* out, __nv_bfloat16* out_b, float* out_lse, const AttnArgs& a) {
    const unsigned wb = nblocks(N * d.nh * 32, 256);
    const int K = int(d.K);
    const bool regs = diag_regs && a.k <= 8 && d.hd <= 128;
    // (registers for 4 steps' rows where that is enough, so more warps fit an SM)
    const auto go = [&](auto kernel) {
      launch_dependent(kDependTrain, kernel, dim3(wb), dim3(256), 0, s, oc, out, out_b, out_lse, sd, a, K);
    };
    if (regs && a.k <= 4 && d.hd <= 64)
      go(diag_merge_regs_kernel<2, 4, OC>);
    else if (regs && a.k <= 4)
      go(diag_merge_regs_kernel<4, 4, OC>);
    else if (regs && d.hd <= 64)
      go(diag_merge_regs_kernel<2, 8, OC>);
    else if (regs)
      go(diag_merge_regs_kernel<4, 8, OC>);
    else {
      diag_merge_kernel<<<wb, 256, 0, s>>>(oc, out, out_b, out_lse, sd, a, K);
      CUDA_LAUNCH_CHECK();
    }
  }
  void attention_forward(int k, float* out_att, float* out_lse) {
    const AttnArgs a = attn_args(k);
    const int64_t grp = d.nh / d.nkv, K = d.K;
    const unsigned wb = nblocks(N * d.nh * 32, 256);
    const Twin tq = q_twin(k), tk = kv0_twin(keys, kb0), tv = kv0_twin(vals, vb0);
    if (cudnn_attention) {
      // cuDNN writes the causal part as bf16 straight into the output, which the merge then
      // overwrites element by element.
      __nv_bfloat16* ob = bf16_in(out_att);
      const TttFlashArgs fa = flash_args(k, nullptr);
      cudnn->forward(ob, out_lse, fa.q, fa.k0, fa.v0);
      if (k > 0) {
        diag_merge(ob, out_att, ob, out_lse, a);
      }
      return;
    }
    if (flash_attention) {
      // With bf16 storage the causal part goes to datt (idle in the forward) and the merged
      // output to out_att as bf16.
      float* oc = qa_bf16 ? datt : out_att;
      __nv_bfloat16* ob = qa_bf16 ? bf16_in(out_att) : nullptr;
      ttt_flash_forward(oc, out_lse, flash_args(k, nullptr), s);
      if (k > 0) {
        diag_merge(oc, out_att, ob, out_lse, a);
      } else if (ob) {
        cast_bf16(ob, oc, N * qd, s);
      }
      return;
    }
    diag_scores_kernel<<<wb, 256, 0, s>>>(sd, a, int(K));
    CUDA_LAUNCH_CHECK();
    for (auto [r0, T] : seqs) {
      const int64_t blk = attn_blk(T);
      ensure_scores(blk, T);
      const Twin tp(*this, Sb, d.nkv * blk * T, Pb);
      const float *qs = q[size_t(k)] + r0 * qd, *ks = keys + r0 * kvd, *vs = vals + r0 * kvd;
      for (int g = 0; g < grp; ++g)
        for (int64_t b0 = 0; b0 < T; b0 += blk) {
          const int64_t nb = std::min(blk, T - b0);
          scores(Sb, qs, ks, T, blk, g, a.scale, b0, nb);
          tc_softmax_kernel<<<dim3(unsigned(nb), unsigned(d.nkv)), 256, 0, s>>>(
              Sb, Pb, !bf16_operands, sd, out_lse, nullptr, r0, T, b0, blk, int(d.nh), int(grp), g, k, int(K));
          CUDA_LAUNCH_CHECK();
          times_kv(out_att + r0 * qd, Sb, vs, T, blk, g, b0, nb);
        }
    }
    diag_accumulate_kernel<<<wb, 256, 0, s>>>(out_att, sd, a, int(K), false);
    CUDA_LAUNCH_CHECK();
  }
  // Given dO = datt and D, writes dq and adds into dK/dV of steps 0..k.
  void attention_backward(int k) {
    const AttnArgs a = attn_args(k);
    const int64_t K = d.K;
    const unsigned wb = nblocks(N * d.nh * 32, 256);
    {
      const Twin tq = q_twin(k), tk = kv0_twin(keys, kb0), tv = kv0_twin(vals, vb0), to(*this, datt, N * qd);
      if (cudnn_attention) {
        // The gradients of the causal part given the merged output and log-sum-exp (exact:
        // P = exp(S - lse) over the causal keys, D = rowsum(dO * O) of the whole row).
        const TttFlashArgs fa = flash_args(k, datt);
        __nv_bfloat16 *gq = cudnn_grads, *gk = gq + N * qd, *gv = gk + N * kvd;
        cudnn->backward(gq, gk, gv, fa.q, fa.k0, fa.v0, bf16_in(att[size_t(k)]), fa.dO, lse[size_t(k)]);
        cudnn_grads_kernel<<<nblocks(N * qd, 256), 256, 0, s>>>(dq, dK, dV, gq, gk, gv, N * qd, N * kvd);
        CUDA_LAUNCH_CHECK();
      } else if (flash_attention) {
        const TttFlashArgs fa = flash_args(k, datt);
        ttt_flash_dq(dq, lse[size_t(k)], D, fa, s);
        ttt_flash_dkv(dK, dV, dkv_part, lse[size_t(k)], D, fa, s);
      } else {
        causal_backward_blocks(k, a);
      }
    }
    if (k == 0 || diag_backward(k, a)) return;
    if (cudnn_attention || flash_attention) {  // sd: the diagonal probabilities (the score-buffer
      diag_probs_kernel<<<wb, 256, 0, s>>>(sd, lse[size_t(k)], a, int(K));  // path's softmax leaves them)
      CUDA_LAUNCH_CHECK();
    }
    diag_dp_kernel<<<wb, 256, 0, s>>>(dsd, sd, datt, D, a, int(K));
    CUDA_LAUNCH_CHECK();
    diag_accumulate_kernel<<<wb, 256, 0, s>>>(dq, dsd, a, int(K), true);
    CUDA_LAUNCH_CHECK();
    diag_dkv_kernel<<<nblocks(N * d.nkv * 32, 256), 256, 0, s>>>(dK, dV, dsd, sd, datt, a, int(K));
    CUDA_LAUNCH_CHECK();
  }
  // The diagonal keys' backward in one kernel (diag_backward_kernel) where the head size and
  // group allow; false: the caller runs the separate kernels.
  bool diag_backward(int k, const AttnArgs& a) {
    if (!fused_diag) return false;
    return diag_regs ? diag_backward_as<true>(k, a) : diag_backward_as<false>(k, a);
  }
  // PF: GpuDraftOptions::diag_rows_in_registers (the next step's rows loaded ahead).
  template <bool PF>
  bool diag_backward_as(int k, const AttnArgs& a) {
    const int64_t grp = d.nh / d.nkv;
    const unsigned wb = nblocks(N * d.nkv * 32, 256);
    const float* lk = lse[size_t(k)];
    const auto go = [&](auto kernel) {
      launch_dependent(kDependTrain, kernel, dim3(wb), dim3(256), 0, s, dq, dK, dV, lk, datt, D, a);
      return true;
    };
    if (d.hd <= 64 && grp <= 4) return go(diag_backward_kernel<2, 4, PF>);
    if (d.hd <= 128 && grp <= 4) return go(diag_backward_kernel<4, 4, PF>);
    if (d.hd <= 128 && grp <= 8) return go(diag_backward_kernel<4, 8, PF>);
    return false;
  }
  // The score-buffer path of attention_backward's causal part (its twins made by the caller):
  // dq, dK0, dV0 through cuBLAS products, and sd left as the diagonal probabilities.
  void causal_backward_blocks(int k, const AttnArgs& a) {
    const int64_t grp = d.nh / d.nkv, K = d.K;
    diag_scores_kernel<<<nblocks(N * d.nh * 32, 256), 256, 0, s>>>(sd, a, int(K));
    CUDA_LAUNCH_CHECK();
    for (auto [r0, T] : seqs) {
      const int64_t blk = attn_blk(T);
      ensure_scores(blk, T);
      const Twin tp(*this, Sb, d.nkv * blk * T, Pb), tds(*this, dPb, d.nkv * blk * T, dSb);
      const float *qs = q[size_t(k)] + r0 * qd, *dos = datt + r0 * qd, *ks = keys + r0 * kvd, *vs = vals + r0 * kvd;
      for (int g = 0; g < grp; ++g)
        for (int64_t b0 = 0; b0 < T; b0 += blk) {
          const int64_t nb = std::min(blk, T - b0);
          const dim3 grid(unsigned(nb), unsigned(d.nkv));
          scores(Sb, qs, ks, T, blk, g, a.scale, b0, nb);
          scores(dPb, dos, vs, T, blk, g, 1.f, b0, nb);
          tc_softmax_kernel<<<grid, 256, 0, s>>>(Sb, Pb, true, sd, nullptr, lse[size_t(k)], r0, T, b0, blk, int(d.nh),
                                                 int(grp), g, k, int(K));
          CUDA_LAUNCH_CHECK();
          tc_ds_kernel<<<grid, 256, 0, s>>>(dPb, dSb, Sb, D, r0, T, b0, blk, int(d.nh), int(grp), g, a.scale);
          CUDA_LAUNCH_CHECK();
          // dQ rows = dS K0;  dK0 += dS^T Q;  dV0 += P^T dO
          times_kv(dq + r0 * qd, dPb, ks, T, blk, g, b0, nb);
          kv_grad(dK + r0 * kvd, dPb, qs, T, blk, g, b0, nb);
          kv_grad(dV + r0 * kvd, Sb, dos, T, blk, g, b0, nb);
        }
    }
  }
};

DraftEngine::DraftEngine(int device, const DraftDims& dd, DraftMath math, const float* embed, const float* final_norm,
                         const float* lm_head, const int64_t* kept, const uint8_t* t2d, const float* inv_freq,
                         int64_t max_rows, const eagle3::GpuDraftOptions& opt)
    : p_(std::make_unique<Impl>()) {
  Impl& I = *p_;
  I.device = device;
  I.d = dd;
  I.math = math;
  I.R = max_rows;
  I.qd = dd.nh * dd.hd;
  I.kvd = dd.nkv * dd.hd;
  if (dd.hd > 32 * kMaxHdPerLane || dd.hd % 2 != 0)
    fail_msg("draft on GPU: head_dim " + std::to_string(dd.hd) + " is not supported (even, at most 256)");
  if (dd.nkv <= 0 || dd.nh % dd.nkv != 0) fail_msg("draft on GPU: heads must be a multiple of kv heads");
  if (dd.peagle && (dd.mask_token < 0 || dd.mask_token >= dd.V))
    fail_msg("draft on GPU: P-EAGLE's mask token " + std::to_string(dd.mask_token) + " is outside the vocabulary of " +
             std::to_string(dd.V));
  // Options, checked before anything is allocated.
  I.bf16_operands = math == DraftMath::BF16 && !opt.fp32_operands;
  const std::string& att_s = opt.attention;
  if (att_s != "auto" && att_s != "loop" && att_s != "blocks" && att_s != "flash" && att_s != "cudnn")
    fail_msg("--gpu-attention: expected auto, flash, cudnn, blocks or loop, got '" + att_s + "'");
  I.loop_attention = att_s == "loop";
  // cuDNN's deterministic backward (cuDNN 9.19 on Hopper) takes a workspace of samples x heads x
  // S^2 x 2 bytes for a batch's bucket (samples and the longest sample S, each rounded up to a
  // power of two): 1.1 GiB for one sample of 4096 rows of the 8B draft, 17 GiB for one sample of
  // the default 16384-token budget. So auto takes it per batch, where that fits memory lent to it
  // (below), and the fused kernels elsewhere; `cudnn` takes it for every batch.
  I.cudnn_attention = att_s == "cudnn";
  if (I.cudnn_attention) {
    if (!I.bf16_operands || dd.hd % 8 != 0)
      fail_msg("--gpu-attention cudnn needs bf16 math on bf16 operands and a head size that is a multiple of 8 "
               "(head size " + std::to_string(dd.hd) + ")");
    std::string why;
    if (!cudnn_sdpa_available(&why)) fail_msg("--gpu-attention cudnn: " + why);
  }
  // The fused kernels read bf16 operands; elsewhere (exact fp32, unsupported head sizes) the
  // score-buffer products run.
  I.flash_attention = !I.loop_attention && !I.cudnn_attention && att_s != "blocks" && I.bf16_operands &&
                      ttt_flash_supported(dd.hd);
  if (att_s == "flash" && !I.flash_attention)
    fail_msg("--gpu-attention flash needs bf16 math on bf16 operands and a head size that is a multiple of 16 up "
             "to 128 (head size " + std::to_string(dd.hd) + ")");
  // cuDNN's shape for the causal part (cudnn_sdpa_unsupported also says whether cuDNN loads).
  const SdpaShape sdpa_shape{int(dd.nh), int(dd.nkv), int(dd.hd), float(1.0 / std::sqrt(double(dd.hd))), max_rows};
  I.cudnn_auto = att_s == "auto" && I.flash_attention && opt.cudnn_auto_bytes != 0 &&
                 cudnn_sdpa_unsupported(sdpa_shape).empty();
  if (opt.batch_embeddings && opt.device_embeddings)
    fail_msg("--gpu-batch-embeddings and --gpu-device-embeddings: choose one");
  if (opt.batch_embeddings && (!I.bf16_operands || dd.peagle))
    fail_msg(dd.peagle ? "--gpu-batch-embeddings: P-EAGLE trains its embedding, which stays on the device"
                       : "--gpu-batch-embeddings needs bf16 math on bf16 operands");
  if (opt.logit_rows < 0)
    fail_msg("--gpu-logit-rows: expected a number of rows >= 1 (0: automatic), got " + std::to_string(opt.logit_rows));
  if (opt.attn_block < -1)
    fail_msg("--gpu-attn-block: expected a block size >= 0 (0: no skipping), got " + std::to_string(opt.attn_block));
  const int64_t logit_rows = opt.logit_rows;
  if (opt.attn_block >= 0) I.attn_block = opt.attn_block;
  I.dev = std::make_unique<Device>(device, "draft trainer", /*copy_stream=*/true);
  I.s = I.dev->stream();
  I.copy_s = I.dev->copy_stream();
  I.blas = I.dev->blas();
  if (opt.products != "cublas" && opt.products != "auto" && opt.products != "first" && opt.products != "waves" &&
      opt.products != "timed")
    fail_msg("--gpu-products: expected auto, cublas, first, waves or timed, got '" + opt.products + "'");
  // auto: timed where the operands are bf16, cublas otherwise (the only rule fp32 operands allow)
  const std::string products = opt.products != "auto" ? opt.products : I.bf16_operands ? "timed" : "cublas";
  if (products != "cublas") {
    if (!I.bf16_operands) fail_msg("--gpu-products " + products + " needs bf16 math on bf16 operands");
    I.lt_products = std::make_unique<LtProducts>(products == "first"   ? LtProducts::Rule::First
                                                 : products == "waves" ? LtProducts::Rule::Waves
                                                                       : LtProducts::Rule::Timed);
  }
  I.aux_ready = I.dev->event(0);
  I.staged = I.dev->event(1);
  const int64_t H = dd.H, V = dd.V, Vd = dd.Vd, R = max_rows, K = dd.K;
  CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&I.stats_host), size_t(K * R) * 6, cudaHostAllocDefault));
  CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&I.norm_host), sizeof(double), cudaHostAllocMapped));
  I.normed = I.dev->event(2);
  I.ran = I.dev->event(3);
  // Uploads go on the engine's stream (ordered after the zeroing of their buffers), drained at
  // once: the host arrays are the caller's.
  auto up_bytes = [&](void* dst, const void* src, size_t bytes) {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, I.s));
    CUDA_CHECK(cudaStreamSynchronize(I.s));
  };
  auto up = [&](float* dst, const float* src, int64_t n) {
    up_bytes(dst, src, size_t(n) * 4);
  };
  if (I.bf16_operands) {  // the target's embedding and lm_head as bf16 only
    const int64_t chunk = std::min<int64_t>(V * H, int64_t(32) << 20);
    float* stage = nullptr;
    CUDA_CHECK(cudaMalloc(&stage, size_t(chunk) * 4));
    const std::unique_ptr<float, cudaError_t (*)(void*)> stage_owner(stage, cudaFree);
    const auto up_bf16 = [&](__nv_bfloat16* dst, const float* src) {  // through stage, 32M values at a time
      for (int64_t o = 0; o < V * H; o += chunk) {
        const int64_t n = std::min(chunk, V * H - o);
        CUDA_CHECK(cudaMemcpy(stage, src + o, size_t(n) * 4, cudaMemcpyHostToDevice));
        cast(dst + o, stage, n, cudaStream_t{});  // the legacy default stream, then the sync below
        CUDA_CHECK(cudaDeviceSynchronize());
      }
    };
    // On the host, the batch's rows on the device: asked for, or by default (EAGLE-3) where
    // the pinned host copy can be had.
    if (!dd.peagle && (opt.batch_embeddings || !opt.device_embeddings)) {
      if (cudaHostAlloc(reinterpret_cast<void**>(&I.host_embed), size_t(V * H) * 2, cudaHostAllocMapped) != cudaSuccess) {
        (void)cudaGetLastError();  // not sticky
        I.host_embed = nullptr;  // by default it then stays on the device (setup() says so)
        if (opt.batch_embeddings)
          fail_msg("--gpu-batch-embeddings: could not pin " + std::to_string(V * H * 2 >> 20) +
                   " MiB of host memory for the embedding");
      }
    }
    if (I.host_embed) {
      I.batch_embed = true;
      void* mapped = nullptr;
      CUDA_CHECK(cudaHostGetDevicePointer(&mapped, I.host_embed, 0));
      I.host_embed_d = static_cast<const uint16_t*>(mapped);
      parallel_for_chunks(size_t(V), 8, 1024, [&](size_t v) {
        for (int64_t c = 0; c < H; ++c) I.host_embed[v * size_t(H) + size_t(c)] = bf16_bits(embed[v * size_t(H) + size_t(c)]);
      });
      I.emb_slot.assign(size_t(V), -1);
      I.emb_rows = I.alloc<__nv_bfloat16>(size_t((R + 1) * H));
      I.emb_toks = I.alloc<int32_t>(size_t(R + 1));
      CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&I.emb_stage), size_t(R + 1) * 4, cudaHostAllocDefault));
      I.cids = I.alloc<int32_t>(size_t(R));
    } else if (!dd.peagle) {  // P-EAGLE reads its own (trained) embedding, a weight
      I.embed_b = I.alloc<__nv_bfloat16>(size_t(V * H));
      up_bf16(I.embed_b, embed);
    }
    I.lmb = I.alloc<__nv_bfloat16>(size_t(V * H));
    up_bf16(I.lmb, lm_head);
  } else {
    if (!dd.peagle) {
      I.embed = I.alloc<float>(size_t(V * H));
      up(I.embed, embed, V * H);
    }
    I.lm = I.alloc<float>(size_t(V * H));
    up(I.lm, lm_head, V * H);
  }
  I.fnorm = I.alloc<float>(size_t(H));
  up(I.fnorm, final_norm, H);
  I.inv = I.alloc<float>(size_t(dd.hd / 2));
  up(I.inv, inv_freq, dd.hd / 2);
  I.kept = I.alloc<int64_t>(size_t(Vd));
  up_bytes(I.kept, kept, size_t(Vd) * 8);
  I.t2d = I.alloc<uint8_t>(size_t(V));
  up_bytes(I.t2d, t2d, size_t(V));

  I.sizes = draft_tensor_sizes(dd);
  int64_t total = 0;
  for (auto n : I.sizes) {
    I.offs.push_back(total);
    total += (n + 63) / 64 * 64;
  }
  I.W = I.alloc<float>(size_t(total));
  I.w_total = total;
  if (I.bf16_operands) I.Wb = I.alloc<__nv_bfloat16>(size_t(total));
  I.w_gu_adjacent = I.bf16_operands && opt.fused_products && I.offs[UP] == I.offs[GATE] + I.sizes[GATE] &&
                    I.sizes[GATE] == dd.I * dd.H;
  I.G = I.alloc<float>(size_t(total));
  I.M = I.alloc<float>(size_t(total));
  I.Vm = I.alloc<float>(size_t(total));
  I.partial = I.alloc<double>(I.sizes.size() * size_t(kNormBlocks));
  I.dscale = I.alloc<float>(1);
  if (dd.peagle) {
    I.embed = I.W + I.offs[EMBED];
    I.gm = I.alloc<float>(size_t(R * H));
    I.mrow = I.alloc<float>(size_t(H));
    I.gmsum = I.alloc<float>(size_t(H));
    I.gemb = I.alloc<float>(size_t(H));
    I.sel = I.alloc<uint8_t>(size_t(K * R));
    I.etok = I.alloc<int32_t>(size_t(R));
    I.eoff = I.alloc<int32_t>(size_t(R + 1));
    I.erow = I.alloc<int32_t>(size_t(R));
  }

  const int64_t Idim = dd.I, qd = I.qd, kvd = I.kvd;
  I.ids = I.alloc<int32_t>(size_t(R));
  I.pos = I.alloc<int32_t>(size_t(R));
  I.len = I.alloc<int32_t>(size_t(R));
  I.tgt_arg = I.alloc<int32_t>(size_t(R));
  I.trow_d = I.alloc<int32_t>(size_t(R));
  I.lrow_d = I.alloc<int32_t>(size_t(K * R));
  I.lslot_d = I.alloc<int32_t>(size_t(K * R));
  I.mask = I.alloc<uint8_t>(size_t(R));
  I.in_vocab = I.alloc<uint8_t>(size_t(R));
  if (dd.peagle) I.ent = I.alloc<float>(size_t(R));  // only P-EAGLE's loss reads the entropy
  I.hit = I.alloc<uint8_t>(size_t(K * R));
  I.cnt = I.alloc<uint8_t>(size_t(K * R));
  I.ce = I.alloc<float>(size_t(K * R));
  I.rs = I.alloc<float>(size_t(K * R));
  I.aux = I.alloc<float>(size_t(R * 3 * H));
  I.hidden = I.alloc<float>(size_t(R * H));
  // The target distribution: bf16 with bf16 operands (the soft labels rounded once; half
  // the memory), else fp32.
  if (I.bf16_operands)
    I.Ph = I.alloc<__nv_bfloat16>(size_t(R * Vd));
  else
    I.P = I.alloc<float>(size_t(R * Vd));
  // Logits are made a chunk of rows at a time, in memory that is idle then (below): the
  // target's full logits 1024 rows at a time (prepare), the draft's as many rows as fit
  // (run); or --gpu-logit-rows rows of either.
  I.chunk = std::min<int64_t>(R, logit_rows > 0 ? logit_rows : 1024);
  I.hn = I.alloc<float>(size_t(I.chunk * H));
  for (int64_t k = 0; k <= K; ++k) I.gs.push_back(I.alloc<float>(size_t(R * H)));
  I.xin_bf16 = I.bf16_operands && !dd.norm_before_residual;
  I.hm_bf16 = I.bf16_operands;
  I.qa_bf16 = I.flash_attention || I.cudnn_attention;
  // Floats for n values stored as fp32, or as bf16 when `half`.
  const auto floats = [](int64_t n, bool half) { return size_t(half ? (n + 1) / 2 : n); };
  for (int64_t k = 0; k < K; ++k) {
    I.xin.push_back(I.alloc<float>(floats(R * 2 * H, I.xin_bf16)));
    I.q.push_back(I.alloc<float>(floats(R * qd, I.qa_bf16)));
    I.att.push_back(I.alloc<float>(floats(R * qd, I.qa_bf16)));
    I.lse.push_back(I.alloc<float>(size_t(R * dd.nh)));
    I.hm.push_back(I.alloc<float>(floats(R * H, I.hm_bf16)));
    I.fn.push_back(I.alloc<float>(size_t(R * H)));
  }
  // The gate and up products of every step in one block: [K][R][gate, up][I] when one product
  // makes both (w_gu_adjacent), else [K][gate, up][R, I]. Only run() uses it, so prepare() makes
  // the target's full logits there.
  const int64_t mlp_elems = 2 * K * R * Idim;
  void* mlp = nullptr;
  if (I.bf16_operands)
    mlp = I.alloc<__nv_bfloat16>(size_t(mlp_elems));
  else
    mlp = I.alloc<float>(size_t(mlp_elems));
  for (int64_t k = 0; k < K; ++k) {
    if (I.bf16_operands) {
      I.gab.push_back(static_cast<__nv_bfloat16*>(mlp) + (2 * k) * R * Idim);
      I.upb.push_back(I.w_gu_adjacent ? I.gab.back() + Idim
                                      : static_cast<__nv_bfloat16*>(mlp) + (2 * k + 1) * R * Idim);
    } else {
      I.ga.push_back(static_cast<float*>(mlp) + (2 * k) * R * Idim);
      I.up.push_back(static_cast<float*>(mlp) + (2 * k + 1) * R * Idim);
    }
  }
  const int64_t mlp_floats = I.bf16_operands ? mlp_elems / 2 : mlp_elems;
  I.full = I.chunk * V <= mlp_floats ? static_cast<float*>(mlp) : I.alloc<float>(size_t(I.chunk * V));
  I.keys = I.alloc<float>(size_t(K * R * kvd));
  I.vals = I.alloc<float>(size_t(K * R * kvd));
  I.dK = I.alloc<float>(size_t(K * R * kvd));
  I.dV = I.alloc<float>(size_t(K * R * kvd));
  if (I.cudnn_attention || I.cudnn_auto) {
    // Under auto, cuDNN failing to start leaves the run to the fused kernels, with a note; asked
    // for by name, it is an error.
    try {
      I.cudnn = std::make_unique<CudnnSdpa>(sdpa_shape, I.s);
    } catch (const std::exception& e) {
      if (!I.cudnn_auto) throw;
      I.cudnn_auto = false;
      I.note = std::string("cuDNN's attention could not start (") + e.what() + "); the fused kernels take every batch";
    }
  }
  {
    // Buffers idle whenever the attention runs, forward or backward, side by side in one block:
    // E (the step's embeddings: read by the input norm before the attention, remade after it),
    // lgb (the loss gradient, made and used by lm_head_step), dg2 (read before the MLP's
    // backward), dga, dup (inside it) and dhm (read by the post-attention norm's backward). With
    // fused_products dga and dup share one part that also holds dgate|dup rows of 2I (gu_fused)
    // and dq|dk|dv rows (qkv_fused, after the MLP's backward). The block is also lent to cuDNN
    // as its workspace, grown to the workspace of one sample of R rows where that adds at most
    // kMaxLentGrowth (the 8B draft at 4096 rows: 0.65 GiB); a batch whose bucket needs more
    // than the block gets a workspace of cuDNN's own.
    const auto bytes_of = [](int64_t floats_n) { return (floats_n * 4 + 255) / 256 * 256; };
    // fused_products (bf16 operands only): dga and dup in one part (dup_at: its offset, in bf16
    // values), also sized for dgate|dup rows of 2I and dq|dk|dv rows.
    const bool fuse = I.bf16_operands && opt.fused_products;
    const int64_t dup_at = (R * Idim + 63) / 64 * 64;
    // (fp32 rows of qd + 2 kvd with the forward's q|k|v product: qkv_forward)
    const int64_t gu_part =
        std::max(dup_at + R * Idim, R * (qd + 2 * kvd) * (opt.fused_rope_rows && opt.qkv_forward_product ? 2 : 1));
    const int64_t parts[] = {
        bytes_of(R * H),
        I.bf16_operands ? bytes_of((R * Vd + 1) / 2) : 0,
        bytes_of(R * H),
        fuse ? bytes_of(int64_t(floats(gu_part, true))) : bytes_of(int64_t(floats(R * Idim, I.bf16_operands))),
        fuse ? 0 : bytes_of(int64_t(floats(R * Idim, I.bf16_operands))),
        bytes_of(R * H)};
    int64_t total = 0;
    for (int64_t b : parts) total += b;
    constexpr int64_t kMaxLentGrowth = int64_t(1) << 30;
    int64_t ws = 0;
    if (I.cudnn) {
      try {
        ws = I.cudnn->workspace_bytes(1, R);
      } catch (const std::exception&) {
        if (!I.cudnn_auto) throw;  // under auto: no growth; each batch's bucket is asked in prepare()
      }
    }
    const int64_t size = ws > total && ws - total <= kMaxLentGrowth ? ws : total;
    // GpuDraftOptions::cudnn_head_groups: buckets whose backward needs more than the block (or
    // cudnn_auto_bytes, where set) split it over head groups instead.
    if (I.cudnn && opt.cudnn_head_groups) {
      I.cudnn->set_backward_limit(opt.cudnn_auto_bytes > 0 ? opt.cudnn_auto_bytes : size);
      I.head_groups = true;
    }
    auto* block = I.alloc<unsigned char>(size_t(size));
    float* at[6];
    int64_t o = 0;
    for (int i = 0; i < 6; ++i) {
      at[i] = reinterpret_cast<float*>(block + o);
      o += parts[i];
    }
    I.E = at[0];
    if (I.bf16_operands) I.lgb = I.bf16_in(at[1]);
    I.dg2 = at[2];
    I.dga = at[3];
    I.dup = fuse ? reinterpret_cast<float*>(I.bf16_in(at[3]) + dup_at) : at[4];
    I.gu_fused = fuse && I.w_gu_adjacent;
    I.qkv_fused = fuse && I.offs[WK] == I.offs[WQ] + I.sizes[WQ] && I.offs[WV] == I.offs[WK] + I.sizes[WK] &&
                  I.sizes[WQ] == qd * 2 * H && I.sizes[WK] == kvd * 2 * H;
    I.dhm = at[5];
    I.qkv_forward = I.qkv_fused && opt.fused_rope_rows && opt.qkv_forward_product && I.qa_bf16;
    if (I.cudnn) I.cudnn->set_workspace(block, size);
    I.cudnn_cap = opt.cudnn_auto_bytes > 0 ? opt.cudnn_auto_bytes : size;
  }
  I.tmp = I.alloc<float>(size_t(R * H));
  I.act = I.alloc<float>(floats(R * Idim, I.bf16_operands));
  I.lm_backward_in_forward = !opt.lm_grad_in_backward;
  I.fresh_grads = opt.fresh_grads;
  if (!I.lm_backward_in_forward) I.dfn = I.alloc<float>(size_t(R * H));  // else d fn goes over fn[k]
  // dact is only live inside the MLP's backward. Its memory also holds, when they fit: the
  // draft logits (each step's loss, before the MLP's backward; in the forward too), the
  // fused attention's per-head partials (after it), then dxin (the attention input's
  // gradient, after the attention's backward) and beside it wpart (the RMSNorm backward's
  // scratch, which runs with dxin as its input; the final norm's runs before the MLP).
  I.dact = I.alloc<float>(size_t(R * Idim));
  {
    int64_t fit = R * Idim / Vd;  // rows of draft logits dact holds
    if (fit >= 128) fit = fit / 128 * 128;
    I.lrows = std::min(R, logit_rows > 0 ? logit_rows : std::max<int64_t>(fit, 1));
    I.logits = I.lrows * Vd <= R * Idim ? I.dact : I.alloc<float>(size_t(I.lrows * Vd));
  }
  I.dg1 = I.alloc<float>(size_t(R * H));
  I.datt = I.alloc<float>(size_t(R * qd));
  I.D = I.alloc<float>(size_t(R * dd.nh));
  I.dq = I.alloc<float>(size_t(R * qd));
  I.dxin = R * 2 * H <= R * Idim ? I.dact : I.alloc<float>(size_t(R * 2 * H));
  I.dg = I.alloc<float>(size_t(R * H));
  I.dgn = I.alloc<float>(size_t(R * H));
  {
    const int64_t parts = 2 * rmsnorm_backward_groups(R) * H;  // floats of fp64 weight parts
    const bool beside_dxin = I.dxin == I.dact && R * 2 * H + parts <= R * Idim;
    I.wpart = reinterpret_cast<double*>(beside_dxin ? I.dact + R * 2 * H : I.alloc<float>(size_t(parts)));
  }
  I.sd = I.alloc<float>(size_t(R * dd.nh * K));
  I.dsd = I.alloc<float>(size_t(R * dd.nh * K));
  I.seq_start_d = I.alloc<int64_t>(size_t(R + 1));
  I.tiles_d = I.alloc<int32_t>(size_t(2 * (R / 64 + R + 1)));
  if (I.flash_attention) {
    const int64_t n = 2 * (dd.nh / dd.nkv) * R * I.kvd;
    I.dkv_part = n <= R * Idim ? I.dact : I.alloc<float>(size_t(n));
  }
  if (I.cudnn) {  // in dact beside dkv_part: only one of the two routes runs in a batch
    const int64_t n = (R * qd + 2 * R * I.kvd + 1) / 2;  // floats for the bf16 dQ, dK0, dV0
    I.cudnn_grads = I.bf16_in(n <= R * Idim ? I.dact : I.alloc<float>(size_t(n)));
  }
  I.row_cut = opt.row_cut;
  I.fused_diag = opt.fused_diag_backward;
  I.diag_regs = opt.diag_rows_in_registers;
  I.fused_rope = opt.fused_rope_rows;
  if (I.fused_rope && I.qa_bf16 && I.bf16_operands) {
    I.kb0 = I.alloc<__nv_bfloat16>(size_t(R * kvd));
    I.vb0 = I.alloc<__nv_bfloat16>(size_t(R * kvd));
  }
  if (I.row_cut && K > 1) {
    I.crow_d = I.alloc<int32_t>(size_t(R));
    I.cinv_d = I.alloc<int32_t>(size_t(R));
    for (int32_t** m : {&I.crow0_d, &I.cinv0_d, &I.clrow0_d, &I.clslot0_d, &I.c10_d, &I.cinv10_d})
      *m = I.alloc<int32_t>(size_t(R));
    I.clrow_d = I.alloc<int32_t>(size_t(K * R));
    I.clslot_d = I.alloc<int32_t>(size_t(K * R));
    I.gsc = I.hidden;  // only prepare() reads hidden
    // The compacted attention output of the backward (att_rows) is live from the recompute of
    // g1 to o_proj's weight gradient, across the post-attention norm's backward (wpart) and
    // before dact's next users (the attention's partials, dxin).
    const int64_t need = I.qa_bf16 ? (R * qd + 1) / 2 : R * qd;
    const float* wp = reinterpret_cast<const float*>(I.wpart);
    const bool wpart_in_dact = wp >= I.dact && wp < I.dact + R * Idim;
    const int64_t room = wpart_in_dact ? wp - I.dact : R * Idim;
    I.cbuf = need <= room ? I.dact : I.alloc<float>(size_t(need));
  }
  I.profiling = opt.profile;
}

DraftEngine::~DraftEngine() = default;  // Impl frees what it holds

// What memory p points into, as CUDA knows it (unregistered when it does not).
static cudaMemoryType memory_type(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: an unknown pointer is simply ordinary memory
    return cudaMemoryTypeUnregistered;
  }
  return a.type;
}

bool is_pinned_host(const void* p) { return memory_type(p) == cudaMemoryTypeHost; }
bool is_device_memory(const void* p) { return memory_type(p) == cudaMemoryTypeDevice; }

size_t DraftEngine::device_bytes() const { return p_->bytes; }
std::string DraftEngine::setup() const {
  const Impl& I = *p_;
  const std::string att =
      I.loop_attention ? "fp32 warps"
      : I.cudnn_auto   ? "cuDNN's fused attention for batches whose workspace fits " +
                           std::to_string((I.cudnn_cap + (1 << 20) - 1) >> 20) + " MiB" +
                           (I.head_groups ? " (its backward in head groups)" : "") + ", fused kernels for the others"
      : I.cudnn_attention
          ? std::string("cuDNN's fused attention") + (I.head_groups ? " (its backward in head groups where the "
                                                                      "lent workspace is short)"
                                                                    : "")
      : I.flash_attention ? "fused kernels"
                          : "score-buffer products";
  const char* emb = I.d.peagle ? "trained on the device" : I.batch_embed ? "on the host, batch rows uploaded" : "on the device";
  return "attention: " + att + "; embedding " + emb;
}
int64_t DraftEngine::cudnn_batches() const { return p_->cudnn_batches; }
std::string DraftEngine::take_note() { return std::exchange(p_->note, std::string()); }
int64_t DraftEngine::row_steps() const { return p_->row_steps; }
eagle3::ProductPlans DraftEngine::product_plans() const {
  if (!p_->lt_products) return {};
  const LtProducts& l = *p_->lt_products;
  const auto [checking, timing] = l.in_progress();
  return {int64_t(l.plans()),   int64_t(l.moved()),    int64_t(l.families()),
          int64_t(l.decided()), int64_t(checking), int64_t(timing)};
}
double DraftEngine::product_flops() const { return p_->product_flops; }
std::pair<float*, float*> DraftEngine::host_features() {
  Impl& I = *p_;
  if (!I.host_aux && !I.host_pin_failed) {
    CUDA_CHECK(cudaSetDevice(I.device));
    void *a = nullptr, *h = nullptr;
    if (cudaHostAlloc(&a, size_t(I.R * 3 * I.d.H) * 4, cudaHostAllocPortable) != cudaSuccess ||
        cudaHostAlloc(&h, size_t(I.R * I.d.H) * 4, cudaHostAllocPortable) != cudaSuccess) {
      (void)cudaGetLastError();  // not sticky: the caller stages in pageable memory instead
      if (a) cudaFreeHost(a);
      I.host_pin_failed = true;
    } else {
      I.host_aux = static_cast<float*>(a);
      I.host_hidden = static_cast<float*>(h);
    }
  }
  CUDA_CHECK(cudaEventSynchronize(I.aux_ready));  // no upload still reads them
  return {I.host_aux, I.host_hidden};
}
float* DraftEngine::grad_data() {
  CUDA_CHECK(cudaSetDevice(p_->device));
  p_->scale_grads();
  return p_->G;
}
int64_t DraftEngine::grad_elems() const { return p_->offs.back() + (p_->sizes.back() + 63) / 64 * 64; }
cudaStream_t DraftEngine::stream() const { return p_->s; }
int DraftEngine::device() const { return p_->device; }
void DraftEngine::zero_grads() {
  CUDA_CHECK(cudaSetDevice(p_->device));
  p_->scale_pending = false;
  p_->n_fresh = 0;  // all of G zeroed: nothing waits for a first product
  p_->fresh.assign(p_->fresh.size(), 0);
  CUDA_CHECK(cudaMemsetAsync(p_->G, 0, size_t(grad_elems()) * 4, p_->s));
}

void DraftEngine::set_weights(const std::vector<const float*>& w) {
  CUDA_CHECK(cudaSetDevice(p_->device));
  copy_tensors(p_->W, p_->offs, p_->sizes, unconst(w), false, p_->s);
  p_->refresh_weight_copy();
  ++p_->weights_version;
}
void DraftEngine::get_weights(const std::vector<float*>& w) {
  CUDA_CHECK(cudaSetDevice(p_->device));
  CUDA_CHECK(cudaStreamSynchronize(p_->s));
  copy_tensors(p_->W, p_->offs, p_->sizes, w, true, p_->s);
}
void DraftEngine::get_grads(const std::vector<float*>& g) {
  CUDA_CHECK(cudaSetDevice(p_->device));
  p_->scale_grads();
  CUDA_CHECK(cudaStreamSynchronize(p_->s));
  copy_tensors(p_->G, p_->offs, p_->sizes, g, true, p_->s);
}
void DraftEngine::set_moments(const std::vector<const float*>& m, const std::vector<const float*>& v) {
  CUDA_CHECK(cudaSetDevice(p_->device));
  copy_tensors(p_->M, p_->offs, p_->sizes, unconst(m), false, p_->s);
  copy_tensors(p_->Vm, p_->offs, p_->sizes, unconst(v), false, p_->s);
}
void DraftEngine::get_moments(const std::vector<float*>& m, const std::vector<float*>& v) {
  CUDA_CHECK(cudaSetDevice(p_->device));
  CUDA_CHECK(cudaStreamSynchronize(p_->s));
  copy_tensors(p_->M, p_->offs, p_->sizes, m, true, p_->s);
  copy_tensors(p_->Vm, p_->offs, p_->sizes, v, true, p_->s);
}

LossRows loss_rows(int64_t K, int64_t N, const uint8_t* mask, const int32_t* pos, const int32_t* len,
                   const uint8_t* in_vocab) {
  LossRows r;
  r.rows.assign(size_t(K * N), 0);
  r.slot.assign(size_t(K * N), -1);
  r.count.assign(size_t(K), 0);
  for (int64_t k = 0; k < K; ++k) {
    int32_t* rows = r.rows.data() + k * N;
    int32_t* slot = r.slot.data() + k * N;
    int64_t c = 0;
    for (int64_t n = 0; n + 1 + k < N; ++n) {
      const int64_t tr = n + 1 + k;
      if (int64_t(pos[n]) + 1 + k < int64_t(len[n]) && mask[tr] && in_vocab[tr]) {
        rows[c] = int32_t(n);
        slot[n] = int32_t(c);
        ++c;
      }
    }
    r.count[size_t(k)] = c;
  }
  return r;
}

RowCut row_cut(const LossRows& lr, int64_t K, int64_t N) {
  RowCut rc;
  rc.cinv.assign(size_t(N), -1);
  for (int64_t k = 1; k < K; ++k)
    for (int64_t c = 0; c < lr.count[size_t(k)]; ++c) rc.cinv[size_t(lr.rows[size_t(k * N + c)])] = 0;
  for (int64_t n = 0; n < N; ++n)
    if (rc.cinv[size_t(n)] == 0) {
      rc.cinv[size_t(n)] = int32_t(rc.crow.size());
      rc.crow.push_back(int32_t(n));
    }
  if (rc.crow.empty() && N > 0) {  // no later step counts: one row, so that no launch is empty
    rc.crow.push_back(0);
    rc.cinv[0] = 0;
  }
  rc.cut = int64_t(rc.crow.size()) < N;
  if (!rc.cut) return rc;
  const int64_t n1 = int64_t(rc.crow.size());
  rc.clrow.assign(size_t(K * N), 0);
  rc.clslot.assign(size_t(K * N), -1);
  for (int64_t k = 1; k < K; ++k) {
    for (int64_t c = 0; c < lr.count[size_t(k)]; ++c)
      rc.clrow[size_t(k * N + c)] = rc.cinv[size_t(lr.rows[size_t(k * N + c)])];
    for (int64_t c = 0; c < n1; ++c) rc.clslot[size_t(k * N + c)] = lr.slot[size_t(k * N + rc.crow[size_t(c)])];
  }
  // Step 0 after its attention: its own loss rows and the kept rows.
  rc.cinv0.assign(size_t(N), -1);
  for (int64_t c = 0; c < lr.count[0]; ++c) rc.cinv0[size_t(lr.rows[size_t(c)])] = 0;
  for (int32_t n : rc.crow) rc.cinv0[size_t(n)] = 0;
  for (int64_t n = 0; n < N; ++n)
    if (rc.cinv0[size_t(n)] == 0) {
      rc.cinv0[size_t(n)] = int32_t(rc.crow0.size());
      rc.crow0.push_back(int32_t(n));
    }
  rc.cut0 = int64_t(rc.crow0.size()) < N;
  if (!rc.cut0) return rc;
  for (int64_t c = 0; c < lr.count[0]; ++c) rc.clrow0.push_back(rc.cinv0[size_t(lr.rows[size_t(c)])]);
  for (int32_t n : rc.crow0) {
    rc.clslot0.push_back(lr.slot[size_t(n)]);
    rc.cinv10.push_back(rc.cinv[size_t(n)]);
  }
  for (int32_t n : rc.crow) rc.c10.push_back(rc.cinv0[size_t(n)]);
  return rc;
}

std::vector<int32_t> target_rows(int64_t N, const uint8_t* mask, const int32_t* pos) {
  std::vector<int32_t> t;
  for (int64_t n = 0; n < N; ++n)
    if (mask[n] && pos[n] >= 1) t.push_back(int32_t(n));
  return t;
}

std::vector<uint8_t> DraftEngine::prepare(const DraftBatch& b) {
  Impl& I = *p_;
  CUDA_CHECK(cudaSetDevice(I.device));
  if (I.kn_pending) fail_msg("draft on GPU: a batch was prepared before the last run's finish_run()");
  CUDA_CHECK(cudaEventSynchronize(I.aux_ready));  // the last batch's upload (run() waited for it)
  I.restart_staging();
  if (b.N > I.R || b.N <= 0)
    fail_msg("draft on GPU: batch of " + std::to_string(b.N) + " rows, buffers hold " + std::to_string(I.R));
  I.N = b.N;
  const int64_t N = b.N, H = I.d.H, V = I.d.V;
  I.seqs.clear();
  for (int64_t n = 0; n < N; n += b.len[n]) {
    if (b.pos[n] != 0 || b.len[n] <= 0 || n + b.len[n] > N) fail_msg("draft on GPU: batch rows are not whole samples");
    I.seqs.push_back({n, b.len[n]});
  }
  if (I.flash_attention || I.cudnn_attention) {  // read by the fused attention kernels
    I.h_seq_start.clear();
    int64_t longest = 0;
    for (auto [r0, T] : I.seqs) {
      I.h_seq_start.push_back(r0);
      longest = std::max(longest, T);
    }
    I.h_seq_start.push_back(N);
    if (I.cudnn_auto) {
      // The bucket's plans are built on first sight (and kept); a bucket cuDNN cannot plan for
      // hands this and every later batch to the fused kernels.
      try {
        I.cudnn_attention = I.cudnn->workspace_bytes(int64_t(I.seqs.size()), longest) <= I.cudnn_cap;
      } catch (const std::exception& e) {
        I.cudnn_auto = I.cudnn_attention = false;
        I.note = std::string("cuDNN's attention could not plan a batch (") + e.what() +
                 "); the fused kernels take every batch from here on";
      }
    }
    if (I.cudnn_attention) ++I.cudnn_batches;
    I.h_tiles = ttt_flash_tiles(I.seqs);
    I.n_tiles = int64_t(I.h_tiles.size() / 2);
    I.upload(I.seq_start_d, I.h_seq_start.data(), I.h_seq_start.size() * 8);
    I.upload(I.tiles_d, I.h_tiles.data(), I.h_tiles.size() * 4);
    if (I.cudnn_attention) I.cudnn->set_batch(I.h_seq_start, I.seq_start_d);
  }
  auto cp = [&](void* dst, const void* src, size_t n) { I.upload(dst, src, n); };
  cp(I.ids, b.ids, size_t(N) * 4);
  if (I.batch_embed) {
    // The batch's distinct tokens, token 0 first, go up on the copy stream and their rows are read
    // from the mapped host table there (with aux, which run() waits for before its first gather).
    // The last batch's upload has finished (aux_ready above), so the staging is free.
    batch_tokens(b.ids, N, V, I.emb_slot, I.emb_batch);
    const std::vector<int32_t>& toks = I.emb_batch.toks;
    std::memcpy(I.emb_stage, toks.data(), toks.size() * 4);
    CUDA_CHECK(cudaMemcpyAsync(I.emb_toks, I.emb_stage, toks.size() * 4, cudaMemcpyHostToDevice, I.copy_s));
    host_rows_kernel<<<unsigned(toks.size()), 128, 0, I.copy_s>>>(I.emb_rows, I.host_embed_d, I.emb_toks, H);
    CUDA_LAUNCH_CHECK();
    cp(I.cids, I.emb_batch.index.data(), size_t(N) * 4);
  }
  cp(I.pos, b.pos, size_t(N) * 4);
  cp(I.len, b.len, size_t(N) * 4);
  cp(I.mask, b.mask, size_t(N));
  // aux is first read by run()'s fc product: it uploads on the copy stream while the target
  // distribution runs (asynchronously when it is pinned: the staging of host_features(), or
  // the caller's own pinned parts).
  if (b.parts.empty()) {
    // The features are not staged (pinned memory, when they are in it, is the caller's).
    CUDA_CHECK(cudaMemcpyAsync(I.hidden, b.hidden, size_t(N * H) * 4, cudaMemcpyDefault, I.s));
    CUDA_CHECK(cudaMemcpyAsync(I.aux, b.aux, size_t(N * 3 * H) * 4, cudaMemcpyHostToDevice, I.copy_s));
  } else {
    int64_t r = 0;
    for (const DraftBatch::Part& p : b.parts) {
      if (p.rows <= 0 || r + p.rows > N || !p.aux || !p.hidden) fail_msg("draft on GPU: feature parts do not tile the batch");
      // Pinned host or device memory (cudaMemcpyDefault tells them apart).
      CUDA_CHECK(cudaMemcpyAsync(I.hidden + r * H, p.hidden, size_t(p.rows * H) * 4, cudaMemcpyDefault, I.s));
      CUDA_CHECK(cudaMemcpyAsync(I.aux + r * 3 * H, p.aux, size_t(p.rows * 3 * H) * 4, cudaMemcpyDefault, I.copy_s));
      r += p.rows;
    }
    if (r != N) fail_msg("draft on GPU: feature parts do not tile the batch");
  }
  CUDA_CHECK(cudaEventRecord(I.aux_ready, I.copy_s));
  // The target side of the rows a loss can read only (the others' in_vocab stays 0),
  // gathered a chunk at a time into hn and normalised there.
  I.trows = target_rows(N, b.mask, b.pos);
  const int64_t nt = int64_t(I.trows.size());
  if (nt > 0) cp(I.trow_d, I.trows.data(), size_t(nt) * 4);
  CUDA_CHECK(cudaMemsetAsync(I.in_vocab, 0, size_t(N), I.s));
  if (I.ent) CUDA_CHECK(cudaMemsetAsync(I.ent, 0, size_t(N) * 4, I.s));
  I.mark("target distribution (full logits, P)");
  for (int64_t r0 = 0; r0 < nt; r0 += I.chunk) {
    const int64_t n = std::min(I.chunk, nt - r0);
    rows_gather_kernel<<<unsigned(n), 256, 0, I.s>>>(I.hn, I.hidden, I.trow_d + r0, H);
    CUDA_LAUNCH_CHECK();
    I.rmsnorm(I.hn, H, I.hn, H, I.fnorm, H, I.d.target_eps, n);
    if (I.bf16_operands)  // the target lm_head is on the device as bf16 only
      I.gemm_raw(CUBLAS_OP_T, CUBLAS_OP_N, V, n, H, I.lmb, H, I.operand(I.hn, Impl::span(CUBLAS_OP_N, H, n, H), 1), H,
                 0.f, I.full, V);
    else
      I.linear(I.full, V, I.hn, H, I.lm, n, H, V);
    I.with_target_dist([&](auto* p) {
      target_row_kernel<<<unsigned(n), 512, 0, I.s>>>(p, I.tgt_arg, I.in_vocab, I.ent,
                                                       I.full, I.kept, I.t2d, V, I.d.Vd, I.trow_d, r0);
    });
    CUDA_LAUNCH_CHECK();
  }
  I.mark("forward: products and norms");
  I.fc_forward();  // queued ahead of the wait below
  I.mark("end");
  std::vector<uint8_t> iv(static_cast<size_t>(N));
  CUDA_CHECK(cudaMemcpyAsync(iv.data(), I.in_vocab, size_t(N), cudaMemcpyDeviceToHost, I.s));
  if (I.ent) {
    I.h_ent.resize(size_t(N));
    CUDA_CHECK(cudaMemcpyAsync(I.h_ent.data(), I.ent, size_t(N) * 4, cudaMemcpyDeviceToHost, I.s));
  }
  CUDA_CHECK(cudaStreamSynchronize(I.s));
  I.collect();
  // Each step's rows that count, for run() (uploaded on the stream run() uses).
  const int64_t K = I.d.K;
  if (!I.d.peagle) {
    I.lr = loss_rows(K, N, b.mask, b.pos, b.len, iv.data());
  } else {
    // The batch's elements (each must read a loss-masked target row of its own sample), and the
    // first step's rows grouped by the token they feed, for its embedding gradient.
    if (!b.counts) fail_msg("draft on GPU: a P-EAGLE batch needs its elements (DraftBatch::counts)");
    LossRows& r = I.lr;
    r.rows.assign(size_t(K * N), 0);
    r.slot.assign(size_t(K * N), -1);
    r.count.assign(size_t(K), 0);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n) {
        if (!b.counts[k * N + n]) continue;
        if (int64_t(b.pos[n]) + 1 + k >= int64_t(b.len[n]) || !b.mask[n + 1 + k])
          fail_msg("draft on GPU: P-EAGLE element (row " + std::to_string(n) + ", depth " + std::to_string(k) +
                   ") has no loss-masked target row in its sample");
        const int64_t c = r.count[size_t(k)]++;
        r.rows[size_t(k * N + c)] = int32_t(n);
        r.slot[size_t(k * N + n)] = int32_t(c);
      }
    cp(I.sel, b.counts, size_t(K * N));
    std::vector<std::pair<int32_t, int32_t>> tr;  // (token, row) of rows whose next token is in the sample
    for (int64_t n = 0; n < N; ++n)
      if (b.pos[n] + 1 < b.len[n]) tr.push_back({b.ids[n + 1], int32_t(n)});
    std::sort(tr.begin(), tr.end());
    I.h_etok.clear();
    I.h_eoff.clear();
    I.h_erow.clear();
    for (size_t i = 0; i < tr.size(); ++i) {
      if (i == 0 || tr[i].first != tr[i - 1].first) {
        I.h_etok.push_back(tr[i].first);
        I.h_eoff.push_back(int32_t(i));
      }
      I.h_erow.push_back(tr[i].second);
    }
    I.h_eoff.push_back(int32_t(tr.size()));
    I.n_etok = int64_t(I.h_etok.size());
    if (I.n_etok > 0) {
      cp(I.etok, I.h_etok.data(), I.h_etok.size() * 4);
      cp(I.erow, I.h_erow.data(), I.h_erow.size() * 4);
    }
    cp(I.eoff, I.h_eoff.data(), I.h_eoff.size() * 4);
  }
  cp(I.lrow_d, I.lr.rows.data(), size_t(K * N) * 4);
  cp(I.lslot_d, I.lr.slot.data(), size_t(K * N) * 4);
  // The rows steps 1..K-1 keep: those some of those steps count (Impl::row_cut).
  I.rc = I.row_cut && K > 1 ? row_cut(I.lr, K, N) : RowCut{};
  I.N1 = I.rc.cut ? int64_t(I.rc.crow.size()) : N;
  I.Nr = N;
  if (I.rc.cut) {
    cp(I.crow_d, I.rc.crow.data(), size_t(I.N1) * 4);
    cp(I.cinv_d, I.rc.cinv.data(), size_t(N) * 4);
    cp(I.clrow_d, I.rc.clrow.data(), size_t(K * N) * 4);
    cp(I.clslot_d, I.rc.clslot.data(), size_t(K * N) * 4);
  }
  I.N0 = I.rc.cut0 ? int64_t(I.rc.crow0.size()) : N;
  if (I.rc.cut0) {
    cp(I.crow0_d, I.rc.crow0.data(), size_t(I.N0) * 4);
    cp(I.cinv0_d, I.rc.cinv0.data(), size_t(N) * 4);
    if (!I.rc.clrow0.empty()) cp(I.clrow0_d, I.rc.clrow0.data(), I.rc.clrow0.size() * 4);
    cp(I.clslot0_d, I.rc.clslot0.data(), size_t(I.N0) * 4);
    cp(I.c10_d, I.rc.c10.data(), size_t(I.N1) * 4);
    cp(I.cinv10_d, I.rc.cinv10.data(), size_t(I.N0) * 4);
  }
  return iv;
}

const std::vector<float>& DraftEngine::target_entropy() const { return p_->h_ent; }

void DraftEngine::run(const std::vector<float>& row_scale, bool backward, bool zero_grads, DraftRowStats& out,
                      bool wait) {
  Impl& I = *p_;
  CUDA_CHECK(cudaSetDevice(I.device));
  if (I.kn_pending) fail_msg("draft on GPU: run() again before the last run's finish_run()");
  const DraftDims& d = I.d;
  const int64_t N = I.N, H = d.H, Id = d.I, qd = I.qd, kvd = I.kvd, K = d.K;
  const cudaStream_t s = I.s;
  if (backward && int64_t(row_scale.size()) != K * N) fail_msg("draft on GPU: row_scale must have K*N entries");
  I.row_steps += N + (K - 1) * I.N1;
  if (backward)
    I.upload(I.rs, row_scale.data(), size_t(K * N) * 4);
  const unsigned warps_blocks = nblocks(N * d.nh * 32, 256);
  const bool fused_lm = backward && I.lm_backward_in_forward;
  const int64_t total = grad_elems();
  if (backward) {  // G is zeroed below, or this run adds to it: a pending clipping factor goes first
    if (zero_grads)
      I.scale_pending = false;
    else
      I.scale_grads();
  }
  I.finish_grads();  // (a run cut short by an error may have left some)
  if (fused_lm && zero_grads) I.start_grads(total);
  // The loss kernel fills these for the rows that count only.
  CUDA_CHECK(cudaMemsetAsync(I.ce, 0, size_t(K * N) * 4, s));
  CUDA_CHECK(cudaMemsetAsync(I.hit, 0, size_t(K * N), s));
  CUDA_CHECK(cudaMemsetAsync(I.cnt, 0, size_t(K * N), s));

  // Forward. g1 = r + o_proj(att) of step k is made in gs[k + 1], and the down product adds
  // to it in place (beta 1): g2 = g1 + down(...). The backward recomputes each step's g1.
  I.mark("forward: products and norms");
  if (!I.fc_ready || I.fc_version != I.weights_version) I.fc_forward();
  I.fc_ready = false;
  if (d.peagle && K > 1) {  // every later step reads fc(mask_hidden) in every row
    I.linear(I.mrow, H, I.w(MASKH), 3 * H, I.w(FC), 1, 3 * H, H);
    broadcast_row_kernel<<<nblocks(N * H, 256), 256, 0, s>>>(I.gm, I.mrow, N, H);
    CUDA_LAUNCH_CHECK();
  }
  for (int k = 0; k < K; ++k) {
    float* xin = I.xin[size_t(k)];
    I.rows_for(k);
    const int64_t Nk = I.Nr;  // rows of the products, norms and MLP (N1 after step 0 when cut)
    const bool cut = I.cut_step(k);
    I.mark("forward: products and norms");
    I.gather(k);
    if (I.xin_bf16) {  // bf16 rows of 2H: the second half starts H bf16 values in
      I.rmsnorm(I.bf16_in(xin), 2 * H, I.E, H, I.w(IN_LN), H, d.eps, Nk);
      I.rmsnorm(I.bf16_in(xin) + H, 2 * H, I.gin(k), H, I.w(HNORM), H, d.eps, Nk);
    } else {
      I.rmsnorm(xin, 2 * H, I.E, H, I.w(IN_LN), H, d.eps, Nk);
      I.rmsnorm(xin + H, 2 * H, I.gin(k), H, I.w(HNORM), H, d.eps, Nk);
    }
    float* kk = I.keys + k * I.R * kvd;
    float* vv = I.vals + k * I.R * kvd;
    {
      const Impl::Twin tx = I.xin_twin(k);
      // With bf16 storage the queries' fp32 product goes to dq (idle in the forward) and RoPE
      // writes them to q[k] as bf16. With rows cut, the products' compacted rows (queries in
      // datt, keys and values in this step's dK and dV, all idle in the forward) are expanded
      // into the batch layout the attention reads.
      float* qo = I.qa_bf16 ? I.dq : I.q[size_t(k)];
      float *qc = cut ? I.datt : qo, *kc = cut ? I.dK + k * I.R * kvd : kk, *vc = cut ? I.dV + k * I.R * kvd : vv;
      int64_t lq = qd, lkv = kvd;
      if (I.qkv_forward) {  // one product, [Nk, qd + 2 kvd] into dga's part (idle until the MLP's backward)
        lq = lkv = qd + 2 * kvd;
        qc = I.dga;
        kc = qc + qd;
        vc = kc + kvd;
        I.linear(qc, lq, xin, 2 * H, I.w(WQ), Nk, 2 * H, lq);
      } else {
        I.linear(qc, qd, xin, 2 * H, I.w(WQ), Nk, 2 * H, qd);
        I.linear(kc, kvd, xin, 2 * H, I.w(WK), Nk, 2 * H, kvd);
        I.linear(vc, kvd, xin, 2 * H, I.w(WV), Nk, 2 * H, kvd);
      }
      if (I.fused_rope && I.qa_bf16) {  // expand, RoPE and the queries' bf16 copy in one pass
        launch_dependent(kDependTrain, qkv_rope_rows_kernel, dim3(unsigned(N)), dim3(256), 0, s,
                         I.bf16_in(I.q[size_t(k)]), kk, vv, k == 0 ? I.kb0 : nullptr, k == 0 ? I.vb0 : nullptr, qc, kc,
                         vc, lq, lkv, cut ? I.cinv_d : nullptr, I.pos, k, I.inv, int(d.nh), int(d.nkv), int(d.hd));
      } else {
        if (cut) {
          I.expand(qo, I.datt, qd);
          I.expand(kk, kc, kvd);
          I.expand(vv, vc, kvd);
        }
        if (I.qa_bf16)
          I.rope(I.dq, d.nh, k, 1.0, I.bf16_in(I.q[size_t(k)]));
        else
          I.rope(I.q[size_t(k)], d.nh, k, 1.0);
        I.rope(kk, d.nkv, k, 1.0);
      }
    }
    I.mark("forward: attention");
    if (I.loop_attention) {
      attn_forward_kernel<<<warps_blocks, 256, 0, s>>>(I.att[size_t(k)], I.lse[size_t(k)], I.attn_args(k));
      CUDA_LAUNCH_CHECK();
    } else {
      I.attention_forward(k, I.att[size_t(k)], I.lse[size_t(k)]);
    }
    I.mark("forward: products and norms");
    // (With rows cut, the output's compacted rows go to datt, idle again after the attention.)
    I.rows_after_attention(k);
    const int64_t Np = I.Nr;  // rows from here on (N0 at step 0 when cut, N1 after it)
    float* const g1 = I.gs[size_t(k) + 1];
    I.g1_into(k, g1, I.att_rows(k, I.datt));
    if (I.hm_bf16)
      I.rmsnorm(I.bf16_in(I.hm[size_t(k)]), H, g1, H, I.w(POST_LN), H, d.eps, Np);
    else
      I.rmsnorm(I.hm[size_t(k)], H, g1, H, I.w(POST_LN), H, d.eps, Np);
    I.gate_up(k);
    {
      const Impl::Twin ta(I, I.act, Np * Id, I.bf16_in(I.act));
      I.swiglu(I.act, k);
      I.linear(g1, H, I.act, Id, I.w(DOWN), Np, Id, H, 1.f);  // g2, in place
    }
    I.rmsnorm(I.fn[size_t(k)], H, I.gs[size_t(k) + 1], H, I.w(NORM), H, d.eps, Np);
    // With fused_lm the loss gradient goes through the lm_head right away, d fn over fn[k]
    // (the products read the rows that count from their gathered copy).
    I.lm_head_step(k, fused_lm, I.fn[size_t(k)], "forward: draft logits and loss", "forward: lm_head backward");
    if (k == 0 && I.rc.cut && !d.peagle) {  // step 1's input: the kept rows of step 0's output
      if (I.cut0(0))
        I.move_rows(I.gsc, I.gs[1], I.c10_d, I.N1, H);
      else
        I.compact(I.gsc, I.gs[1], H);
    }
  }
  const size_t kn = size_t(K * N);
  CUDA_CHECK(cudaMemcpyAsync(I.stats_host, I.ce, kn * 4, cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaMemcpyAsync(I.stats_host + kn * 4, I.hit, kn, cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaMemcpyAsync(I.stats_host + kn * 5, I.cnt, kn, cudaMemcpyDeviceToHost, s));
  if (!backward) {
    I.mark("end");
    I.end_run(out, kn, wait);
    return;
  }

  // Backward, last step first (as the CPU reference).
  if (zero_grads && !fused_lm) I.start_grads(total);
  CUDA_CHECK(cudaMemsetAsync(I.dK, 0, size_t(K * I.R * kvd) * 4, s));
  CUDA_CHECK(cudaMemsetAsync(I.dV, 0, size_t(K * I.R * kvd) * 4, s));
  CUDA_CHECK(cudaMemsetAsync(I.dgn, 0, size_t(N * H) * 4, s));  // P-EAGLE: stays 0 (no recurrence)
  if (d.peagle) {
    CUDA_CHECK(cudaMemsetAsync(I.gmsum, 0, size_t(H) * 4, s));
    CUDA_CHECK(cudaMemsetAsync(I.gemb, 0, size_t(H) * 4, s));
  }
  for (int k = int(K) - 1; k >= 0; --k) {
    const size_t ks = size_t(k);
    float* xin = I.xin[ks];
    I.rows_after_attention(k);
    const int64_t Np = I.Nr;  // rows after the attention (N0 at step 0 when cut, N1 after it)
    const bool cut = I.cut_step(k), post_cut = I.post_cut(k);
    float* dfn = I.fn[ks];  // with fused_lm, the forward left d fn here
    if (!fused_lm) {  // logits = lm_head(norm(g2))
      dfn = I.dfn;
      I.lm_head_step(k, true, dfn, "backward: draft logits and loss gradient", "backward: products and norms");
    }
    I.mark("backward: products and norms");
    I.rmsnorm_backward(I.dg2, H, I.dgn, I.g(NORM), dfn, H, I.gs[ks + 1], H, I.w(NORM), H);
    // g2 = g1 + down(silu(gate(hm)) * up(hm))
    {
      const Impl::Twin ta(I, I.act, Np * Id, I.bf16_in(I.act)), td(I, I.dg2, Np * H);
      I.swiglu(I.act, k);
      I.linear_dx(I.dact, Id, I.dg2, I.w(DOWN), Np, Id, H, 0.f);
      I.linear_dw(I.g(DOWN), I.dg2, I.act, Id, Np, Id, H);
    }
    if (I.gu_fused) {  // dgate|dup rows of 2I: one product for dhm, one for d[W_gate; W_up]
      const Impl::Twin th = I.hm_twin(k);
      I.swiglu_backward(I.dga, I.dup, I.dact, k);
      const __nv_bfloat16* dgu = I.bf16_in(I.dga);
      I.gemm_raw(CUBLAS_OP_N, CUBLAS_OP_N, H, Np, 2 * Id, I.operand(I.w(GATE), 2 * Id * H, 0), H, dgu, 2 * Id, 0.f,
                 I.dhm, H);
      I.gemm_raw(CUBLAS_OP_N, CUBLAS_OP_T, H, 2 * Id, Np, I.operand(I.hm[ks], Np * H, 0), H, dgu, 2 * Id, 1.f,
                 I.g(GATE), H);
    } else {
      const Impl::Twin tg(I, I.dga, Np * Id, I.bf16_in(I.dga)), tu(I, I.dup, Np * Id, I.bf16_in(I.dup)),
          th = I.hm_twin(k);
      I.swiglu_backward(I.dga, I.dup, I.dact, k);
      I.linear_dx(I.dhm, H, I.dga, I.w(GATE), Np, H, Id, 0.f);
      I.linear_dx(I.dhm, H, I.dup, I.w(UP), Np, H, Id, 1.f);
      I.linear_dw(I.g(GATE), I.dga, I.hm[ks], H, Np, H, Id);
      I.linear_dw(I.g(UP), I.dup, I.hm[ks], H, Np, H, Id);
    }
    // g1, recomputed into tmp (idle here) rather than kept from the forward. With rows cut the
    // products read the attention output's compacted rows (in cbuf), and datt's compacted rows
    // (in dq, idle until the attention's backward) are expanded into the batch layout.
    I.mark("backward: products and norms");
    float* ak = I.att_rows(k, I.cbuf);
    I.g1_into(k, I.tmp, ak);
    I.rmsnorm_backward(I.dg1, H, I.dg2, I.g(POST_LN), I.dhm, H, I.tmp, H, I.w(POST_LN), H);
    // g1 = r + o_proj(att)
    {
      const Impl::Twin ta = I.att_twin(ak), t1(I, I.dg1, Np * H);
      I.linear_dx(post_cut ? I.dq : I.datt, qd, I.dg1, I.w(WO), Np, qd, H, 0.f);
      I.linear_dw(I.g(WO), I.dg1, ak, qd, Np, qd, H);
    }
    if (post_cut) I.move_rows(I.datt, I.dq, I.post_cinv(k), N, qd);
    I.rows_for(k);
    const int64_t Nk = I.Nr;  // rows up to the attention (N1 after step 0 when cut)
    const AttnArgs a = I.attn_args(k);
    I.mark("backward: attention");
    if (I.qa_bf16)
      attn_delta_kernel<<<warps_blocks, 256, 0, s>>>(I.D, I.datt, I.bf16_in(I.att[ks]), N, int(d.nh), int(d.hd));
    else
      attn_delta_kernel<<<warps_blocks, 256, 0, s>>>(I.D, I.datt, I.att[ks], N, int(d.nh), int(d.hd));
    CUDA_LAUNCH_CHECK();
    if (!I.loop_attention) {
      I.attention_backward(k);
    } else {
      attn_dq_kernel<<<warps_blocks, 256, 0, s>>>(I.dq, I.datt, I.lse[ks], I.D, a);
      CUDA_LAUNCH_CHECK();
      attn_dkv_kernel<<<nblocks(N * d.nkv * 32, 256), 256, 0, s>>>(I.dK, I.dV, I.datt, I.lse[ks], I.D, a, false);
      CUDA_LAUNCH_CHECK();
      if (k > 0) {
        attn_dkv_kernel<<<nblocks(int64_t(k) * N * d.nkv * 32, 256), 256, 0, s>>>(I.dK, I.dV, I.datt, I.lse[ks], I.D,
                                                                                  a, true);
        CUDA_LAUNCH_CHECK();
      }
    }
    I.mark("backward: products and norms");
    float* dKk = I.dK + k * I.R * kvd;
    float* dVk = I.dV + k * I.R * kvd;
    const int64_t C = qd + 2 * kvd;
    // With qkv_fused, b holds [Nk, C]: dq | dk | dv (with fused_rope rotated back, the kept rows
    // and the bf16 cast in one pass).
    __nv_bfloat16* const b = I.bf16_in(I.dga);
    if (I.qkv_fused && I.fused_rope) {
      launch_dependent(kDependTrain, qkv_grad_rows_kernel, dim3(unsigned(Nk)), dim3(256), 0, s, b, I.dq, dKk, dVk,
                       cut ? I.crow_d : nullptr, I.pos, k, I.inv, int(d.nh), int(d.nkv), int(d.hd));
    } else {
      I.rope(I.dq, d.nh, k, -1.0);
      I.rope(dKk, d.nkv, k, -1.0);
      // The gradients the products read: dq, dK and dV of step k, or with rows cut their kept rows,
      // compacted into datt and into this step's keys and values (no step left reads them).
      float* gq = I.dq;
      if (cut) {
        gq = I.datt;
        I.compact(gq, I.dq, qd);
        I.compact(I.keys + k * I.R * kvd, dKk, kvd);
        I.compact(I.vals + k * I.R * kvd, dVk, kvd);
        dKk = I.keys + k * I.R * kvd;
        dVk = I.vals + k * I.R * kvd;
      }
      if (I.qkv_fused) {
        cast_rows_bf16(b, C, gq, qd, Nk, qd, s);
        cast_rows_bf16(b + qd, C, dKk, kvd, Nk, kvd, s);
        cast_rows_bf16(b + qd + kvd, C, dVk, kvd, Nk, kvd, s);
      } else {
        const Impl::Twin tq(I, gq, Nk * qd), tk(I, dKk, Nk * kvd), tv(I, dVk, Nk * kvd), tx = I.xin_twin(k);
        I.linear_dx(I.dxin, 2 * H, gq, I.w(WQ), Nk, 2 * H, qd, 0.f);
        I.linear_dx(I.dxin, 2 * H, dKk, I.w(WK), Nk, 2 * H, kvd, 1.f);
        I.linear_dx(I.dxin, 2 * H, dVk, I.w(WV), Nk, 2 * H, kvd, 1.f);
        I.linear_dw(I.g(WQ), gq, xin, 2 * H, Nk, 2 * H, qd);
        I.linear_dw(I.g(WK), dKk, xin, 2 * H, Nk, 2 * H, kvd);
        I.linear_dw(I.g(WV), dVk, xin, 2 * H, Nk, 2 * H, kvd);
      }
    }
    if (I.qkv_fused) {
      const Impl::Twin tx = I.xin_twin(k);
      I.gemm_raw(CUBLAS_OP_N, CUBLAS_OP_N, 2 * H, Nk, C, I.operand(I.w(WQ), C * 2 * H, 0), 2 * H, b, C, 0.f, I.dxin,
                 2 * H);
      I.gemm_raw(CUBLAS_OP_N, CUBLAS_OP_T, 2 * H, C, Nk, I.operand(xin, Nk * 2 * H, 0), 2 * H, b, C, 1.f, I.g(WQ),
                 2 * H);
    }
    // xin = [in_ln(e), hidden_norm(g)]; r = g or hidden_norm(g).
    I.gather(k);
    if (!d.peagle) {
      I.rmsnorm_backward(nullptr, 0, nullptr, I.g(IN_LN), I.dxin, 2 * H, I.E, H, I.w(IN_LN), H);
    } else {
      // The embedding is trained: dE into tmp (idle since the post-attention norm's
      // backward), summed into the mask token's row (later steps) or each token's (the first).
      I.rmsnorm_backward(I.tmp, H, nullptr, I.g(IN_LN), I.dxin, 2 * H, I.E, H, I.w(IN_LN), H);
      if (k > 0) {
        colsum_kernel<<<nblocks(H, 32), dim3(32, 8), 0, s>>>(I.gemb, I.tmp, Nk, H);
      } else if (I.n_etok > 0) {
        embed_scatter_kernel<<<unsigned(I.n_etok), 256, 0, s>>>(I.g(EMBED), I.tmp, I.etok, I.eoff, I.erow, H);
      }
      CUDA_LAUNCH_CHECK();
    }
    // dg = dg1 (the residual's gradient) + the hidden norm's; with the norm before the residual,
    // dg1 goes through the norm too. At step 0 with rows cut after its attention, dg1 is
    // expanded to every row first (into dgn, which the final norm's backward has read).
    const float* dr = I.dg1;
    if (I.cut0(k)) {
      I.move_rows(I.dgn, I.dg1, I.cinv0_d, N, H);
      dr = I.dgn;
    }
    if (d.norm_before_residual) {
      I.rmsnorm_backward(I.dg, H, nullptr, I.g(HNORM), I.dxin + H, 2 * H, I.gin(k), H, I.w(HNORM), H);
      I.rmsnorm_backward(I.dg, H, I.dg, I.g(HNORM), dr, H, I.gin(k), H, I.w(HNORM), H);
    } else {
      I.rmsnorm_backward(I.dg, H, dr, I.g(HNORM), I.dxin + H, 2 * H, I.gin(k), H, I.w(HNORM), H);
    }
    if (k == 0) {
      I.linear_dw(I.g(FC), I.dg, I.aux, 3 * H, N, 3 * H, H);
    } else if (!d.peagle) {
      if (k == 1 && I.cut0(0))  // into step 0's rows after its attention (zero where not kept)
        I.move_rows(I.dgn, I.dg, I.cinv10_d, I.N0, H);
      else if (k == 1 && I.rc.cut)
        I.expand(I.dgn, I.dg, H);  // step 0 runs every row: zero for the rows left out
      else
        std::swap(I.dg, I.dgn);
    } else {  // dg is the gradient of gm's rows, all fc(mask_hidden)
      colsum_kernel<<<nblocks(H, 32), dim3(32, 8), 0, s>>>(I.gmsum, I.dg, Nk, H);
      CUDA_LAUNCH_CHECK();
    }
  }
  if (d.peagle && K > 1) {
    // gm = fc(mask_hidden) in every row: d fc += gmsum mask_hidden^T, d mask_hidden += fc^T gmsum;
    // the mask token's embedding row takes the later steps' sum.
    I.linear_dw(I.g(FC), I.gmsum, I.w(MASKH), 3 * H, 1, 3 * H, H);
    I.linear_dx(I.g(MASKH), 3 * H, I.gmsum, I.w(FC), 1, 3 * H, H, 1.f);
    float* me = I.g(EMBED) + int64_t(d.mask_token) * H;
    add_rows_kernel<<<nblocks(H, 256), 256, 0, s>>>(me, me, H, nullptr, I.gemb, 1, H);
    CUDA_LAUNCH_CHECK();
  }
  I.finish_grads();
  I.mark("end");
  I.end_run(out, kn, wait);
}

void DraftEngine::finish_run(DraftRowStats& out) {
  Impl& I = *p_;
  if (!I.kn_pending) fail_msg("draft on GPU: finish_run() with no run started");
  CUDA_CHECK(cudaSetDevice(I.device));
  CUDA_CHECK(cudaEventSynchronize(I.ran));
  I.take_stats(out, std::exchange(I.kn_pending, size_t(0)));
  I.collect();
}

std::vector<std::pair<std::string, double>> DraftEngine::profile() const { return p_->prof_ms; }

void DraftEngine::clip_grad_norm_start(double max_norm) {
  Impl& I = *p_;
  CUDA_CHECK(cudaSetDevice(I.device));
  I.scale_grads();
  const int nt = int(I.sizes.size());  // P-EAGLE's frozen lm_head has a zero gradient
  for (int t = 0; t < nt; ++t) {
    launch_dependent(kDependTrain, sumsq_kernel, dim3(kNormBlocks), dim3(256), 0, I.s, I.partial + t * kNormBlocks,
                     I.g(t), I.sizes[size_t(t)]);
  }
  launch_dependent(kDependTrain, norm_finish_kernel, dim3(1), dim3(256), 0, I.s, I.partial, nt * kNormBlocks, max_norm,
                   I.norm_host, I.dscale);
  CUDA_CHECK(cudaEventRecord(I.normed, I.s));
  I.scale_pending = true;  // (1 where the norm is within max_norm: the same bits)
  I.norm_started = true;
}

double DraftEngine::grad_norm() {
  Impl& I = *p_;
  if (!I.norm_started) fail_msg("draft on GPU: grad_norm() before any clip_grad_norm_start()");
  CUDA_CHECK(cudaSetDevice(I.device));
  CUDA_CHECK(cudaEventSynchronize(I.normed));
  return *I.norm_host;
}

double DraftEngine::clip_grad_norm(double max_norm) {
  clip_grad_norm_start(max_norm);
  return grad_norm();
}

void DraftEngine::adamw(double lr, double beta1, double beta2, double eps, double weight_decay,
                        const std::vector<uint8_t>& decay_on, int64_t t_after) {
  Impl& I = *p_;
  if (decay_on.size() != I.sizes.size())
    fail_msg("draft on GPU: " + std::to_string(decay_on.size()) + " weight-decay flags, expected " +
             std::to_string(I.sizes.size()));
  CUDA_CHECK(cudaSetDevice(I.device));
  const double bc1 = 1.0 - std::pow(beta1, double(t_after)), bc2 = 1.0 - std::pow(beta2, double(t_after));
  ++I.weights_version;
  for (int t = 0; t < int(I.sizes.size()); ++t) {
    if (I.d.peagle && t == LM) continue;  // frozen
    const float decay = decay_on[size_t(t)] ? float(1.0 - lr * weight_decay) : 1.0f;
    const int64_t n = I.sizes[size_t(t)], o = I.offs[size_t(t)];
    const float* at = I.scale_pending ? I.dscale : nullptr;  // the clipping factor, on the device
    const AdamWArgs a{decay, float(lr / bc1), float(std::sqrt(bc2)), float(beta1), float(beta2), float(eps), 1.f, at};
    adamw_update(I.W + o, I.M + o, I.Vm + o, I.G + o, n, a, I.bf16_operands ? I.Wb + o : nullptr, I.s);
    CUDA_LAUNCH_CHECK();
  }
  // The gradients stay as they were (unclipped) with the factor still pending, as after any
  // clip_grad_norm(): get_grads() and further accumulation apply it first. The update is not
  // waited for: the host goes on to the next batch meanwhile, and every later use of the
  // weights is ordered after it on the stream (the copies to the host wait for it).
}

}  // namespace talon::cuda
