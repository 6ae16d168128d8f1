// Top-k with log-softmax per row (decode_ops.h: topk_logsoftmax).
#include <cfloat>
#include <climits>
#include <cstdint>

#include "backend/cuda/check.h"
#include "backend/cuda/decode_ops.h"

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

constexpr int kArgmaxThreads = 512;

// One block per row: each thread scans 8-element chunks (16-byte loads when the row is
// aligned), then a warp and a block reduction under the (value desc, index asc) order.
__global__ void __launch_bounds__(kArgmaxThreads) argmax_kernel(int32_t* ids, const bf16* logits, int V) {
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
  argmax_kernel<<<unsigned(rows), kArgmaxThreads, 0, s>>>(ids, logits, int(V));
  CUDA_LAUNCH_CHECK();
}

void topk_logsoftmax(int32_t* ids, float* lp, const float* logits, int64_t rows, int64_t V, int k, cudaStream_t s) {
  if (rows == 0 || k <= 0) return;
  if (k > V) fail_msg("topk_logsoftmax: k " + std::to_string(k) + " > V " + std::to_string(V));
  topk_kernel<<<unsigned(rows), kTopkThreads, 0, s>>>(ids, lp, logits, int(V), k);
  CUDA_LAUNCH_CHECK();
}

}  // namespace talon::cuda
