// Top-k with log-softmax per row (decode_ops.h: topk_logsoftmax).
#include <cfloat>
#include <climits>
#include <cstdint>

#include "backend/cuda/check.h"
#include "backend/cuda/decode_ops.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/warp.cuh"

namespace talon::cuda {

namespace {

constexpr int kTopkThreads = 256;

// (value, index) ordering of the top-k: larger value first, then the lower index.
__device__ bool before(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }

template <typename Op>
__device__ float block_reduce(float v, Op op, float* sh) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) sh[w] = v;
  __syncthreads();
  v = sh[0];
  for (int i = 1; i < kTopkThreads / 32; ++i) v = op(v, sh[i]);
  return v;
}

__global__ void topk_kernel(int32_t* ids, float* lp, const float* logits, int V, int k) {
  allow_dependents();
  grid_dependency_wait();  // launched dependent (launch.cuh)
  __shared__ float shf[kTopkThreads / 32];
  __shared__ float shv[kTopkThreads / 32];
  __shared__ int shi[kTopkThreads / 32];
  const float* x = logits + size_t(blockIdx.x) * size_t(V);
  float m = -INFINITY;
  for (int i = threadIdx.x; i < V; i += kTopkThreads) m = fmaxf(m, x[i]);
  m = block_reduce(m, [](float a, float b) { return fmaxf(a, b); }, shf);
  float z = 0.f;
  for (int i = threadIdx.x; i < V; i += kTopkThreads) z += expf(x[i] - m);
  z = block_reduce(z, [](float a, float b) { return a + b; }, shf);
  const float lse = m + logf(z);
  // Round r picks the best element strictly after the previous pick in the ordering.
  float pv = INFINITY;
  int pi = -1;
  for (int r = 0; r < k; ++r) {
    float bv = -INFINITY;
    int bi = INT_MAX;
    for (int i = threadIdx.x; i < V; i += kTopkThreads) {
      const float v = x[i];
      if ((v < pv || (v == pv && i > pi)) && before(v, i, bv, bi)) bv = v, bi = i;
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (before(ov, oi, bv, bi)) bv = ov, bi = oi;
    }
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) shv[w] = bv, shi[w] = bi;
    __syncthreads();
    bv = shv[0], bi = shi[0];
    for (int j = 1; j < kTopkThreads / 32; ++j)
      if (before(shv[j], shi[j], bv, bi)) bv = shv[j], bi = shi[j];
    if (threadIdx.x == 0) {
      ids[size_t(blockIdx.x) * k + r] = bi;
      lp[size_t(blockIdx.x) * k + r] = bv - lse;
    }
    pv = bv, pi = bi;
  }
}

// The same results as topk_kernel (the max and the sum of exponentials in its order, the same
// picks) from two passes over the row instead of k + 2, with kBatch loads in flight per thread
// instead of one round trip per value. While finding the max, each thread keeps its own best
// kList (value, index) pairs in order, which hold every pick it can make; each warp then merges
// its lanes' lists into its own top k (k rounds of shuffles, the owner of each pick popping
// it), and warp 0 merges the warps' lists the same way. One block barrier in all.
template <int kList>
__global__ void __launch_bounds__(kTopkThreads) topk_list_kernel(int32_t* ids, float* lp, const float* logits, int V,
                                                                 int k) {
  allow_dependents();
  grid_dependency_wait();  // launched dependent (launch.cuh)
  constexpr int kBatch = 8, kWarps = kTopkThreads / 32;
  __shared__ float shf[kWarps];
  __shared__ float wv[kWarps][kList];
  __shared__ int wi[kWarps][kList];
  const float* x = logits + size_t(blockIdx.x) * size_t(V);
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  float lv[kList];
  int li[kList];
#pragma unroll
  for (int j = 0; j < kList; ++j) lv[j] = -INFINITY, li[j] = INT_MAX;
  float m = -INFINITY;
  for (int base = threadIdx.x; base < V; base += kBatch * kTopkThreads) {
    float v[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) v[u] = base + u * kTopkThreads < V ? x[base + u * kTopkThreads] : -INFINITY;
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = base + u * kTopkThreads;
      if (i >= V) break;
      m = fmaxf(m, v[u]);
      if (!before(v[u], i, lv[kList - 1], li[kList - 1])) continue;
      float cv = v[u];  // insert in order: the worse entries move down one place
      int ci = i;
#pragma unroll
      for (int j = 0; j < kList; ++j)
        if (before(cv, ci, lv[j], li[j])) {
          const float tv = lv[j];
          const int ti = li[j];
          lv[j] = cv, li[j] = ci;
          cv = tv, ci = ti;
        }
    }
  }
  m = block_reduce(m, [](float a, float b) { return fmaxf(a, b); }, shf);
  float z = 0.f;
  for (int base = threadIdx.x; base < V; base += kBatch * kTopkThreads) {
    float v[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) v[u] = base + u * kTopkThreads < V ? x[base + u * kTopkThreads] : 0.f;
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
      if (base + u * kTopkThreads < V) z += expf(v[u] - m);
  }
  z = block_reduce(z, [](float a, float b) { return a + b; }, shf);
  const float lse = m + logf(z);
  // The best of the lanes' heads (every lane gets it); its owner pops it.
  auto warp_pick = [&](float& hv, int& hi, auto pop) {
    float bv = hv;
    int bi = hi;
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (before(ov, oi, bv, bi)) bv = ov, bi = oi;
    }
    if (hi == bi && bi != INT_MAX) pop();
    hv = bv, hi = bi;
  };
  for (int r = 0; r < k; ++r) {
    float hv = lv[0];
    int hi = li[0];
    warp_pick(hv, hi, [&] {
#pragma unroll
      for (int j = 0; j + 1 < kList; ++j) lv[j] = lv[j + 1], li[j] = li[j + 1];
      lv[kList - 1] = -INFINITY, li[kList - 1] = INT_MAX;
    });
    if (lane == 0) wv[w][r] = hv, wi[w][r] = hi;
  }
  __syncthreads();
  if (w != 0) return;
  int at = 0;  // lane j < kWarps walks warp j's list
  for (int r = 0; r < k; ++r) {
    float hv = lane < kWarps && at < k ? wv[lane][at] : -INFINITY;
    int hi = lane < kWarps && at < k ? wi[lane][at] : INT_MAX;
    warp_pick(hv, hi, [&] { ++at; });
    if (lane == 0) {
      ids[size_t(blockIdx.x) * k + r] = hi;
      lp[size_t(blockIdx.x) * k + r] = hv - lse;
    }
  }
}

constexpr int kArgmaxThreads = 512;

// One block per row: each thread scans 8-element chunks (16-byte loads when the row is
// aligned), then a warp and a block reduction under the (value desc, index asc) order.
__global__ void __launch_bounds__(kArgmaxThreads) argmax_kernel(int32_t* ids, const bf16* logits, int V) {
  allow_dependents();
  grid_dependency_wait();  // launched dependent (launch.cuh)
  __shared__ float shv[kArgmaxThreads / 32];
  __shared__ int shi[kArgmaxThreads / 32];
  const bf16* x = logits + size_t(blockIdx.x) * size_t(V);
  float bv = -INFINITY;
  int bi = INT_MAX;
  auto take = [&](float v, int i) {
    if (before(v, i, bv, bi)) bv = v, bi = i;
  };
  const bool aligned = (reinterpret_cast<uintptr_t>(x) % 16) == 0;
  const int vec = aligned ? V / 8 : 0;
  for (int c = threadIdx.x; c < vec; c += kArgmaxThreads) {
    const uint4 u = reinterpret_cast<const uint4*>(x)[c];
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      take(__uint_as_float(w[e] << 16), c * 8 + 2 * e);
      take(__uint_as_float(w[e] & 0xffff0000u), c * 8 + 2 * e + 1);
    }
  }
  for (int i = vec * 8 + threadIdx.x; i < V; i += kArgmaxThreads) take(__bfloat162float(x[i]), i);
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (before(ov, oi, bv, bi)) bv = ov, bi = oi;
  }
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shv[w] = bv, shi[w] = bi;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int j = 1; j < kArgmaxThreads / 32; ++j)
      if (before(shv[j], shi[j], bv, bi)) bv = shv[j], bi = shi[j];
    ids[blockIdx.x] = bi == INT_MAX ? 0 : bi;
  }
}

}  // namespace

void argmax_rows(int32_t* ids, const bf16* logits, int64_t rows, int64_t V, cudaStream_t s) {
  if (rows == 0) return;
  launch_dependent(kDependPick, argmax_kernel, dim3(unsigned(rows)), dim3(kArgmaxThreads), 0, s, ids, logits, int(V));
}

void topk_logsoftmax(int32_t* ids, float* lp, const float* logits, int64_t rows, int64_t V, int k, cudaStream_t s) {
  if (rows == 0 || k <= 0) return;
  if (k > V) fail_msg("topk_logsoftmax: k " + std::to_string(k) + " > V " + std::to_string(V));
  // Up to 16 picks from the per-thread lists (two passes over the row); more: k + 2 passes.
  auto go = [&](auto kernel) {
    launch_dependent(kDependPick, kernel, dim3(unsigned(rows)), dim3(kTopkThreads), 0, s, ids, lp, logits, int(V), k);
  };
  if (k <= 4)
    go(topk_list_kernel<4>);
  else if (k <= 8)
    go(topk_list_kernel<8>);
  else if (k <= 16)
    go(topk_list_kernel<16>);
  else
    go(topk_kernel);
}

}  // namespace talon::cuda
