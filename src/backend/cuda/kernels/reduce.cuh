// Block-wide reductions for the kernels of kernels/ (a block is a multiple of 32 threads).
// Summed in the same order on every run.
#pragma once
#include <cmath>
#include <cstdint>

#include "backend/cuda/warp.cuh"

namespace talon::cuda {
namespace {

// Sum over the block; every thread gets the result. sh: 33 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* sh) {
  v = warp_sum(v);
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = blockDim.x >> 5;
  __syncthreads();
  if (l == 0) sh[w] = v;
  __syncthreads();
  if (w == 0) {
    float x = l < nw ? sh[l] : 0.f;
    x = warp_sum(x);
    if (l == 0) sh[32] = x;
  }
  __syncthreads();
  return sh[32];
}

// Maximum over the block and the lowest index holding it (std::max_element's choice); every
// thread gets both. shv, shi: 33 entries of shared memory each.
__device__ __forceinline__ void block_argmax(float& v, int64_t& i, float* shv, int64_t* shi) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
  }
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = blockDim.x >> 5;
  __syncthreads();
  if (l == 0) shv[w] = v, shi[w] = i;
  __syncthreads();
  if (w == 0) {
    v = l < nw ? shv[l] : -INFINITY;
    i = l < nw ? shi[l] : INT64_MAX;
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, v, o);
      const int64_t oi = __shfl_xor_sync(0xffffffffu, i, o);
      if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
    }
    if (l == 0) shv[32] = v, shi[32] = i;
  }
  __syncthreads();
  v = shv[32];
  i = shi[32];
}

// dw[c] += sum_n rows[n, c] (fp32 or fp64 rows): 32 columns per block of 32 x 8 threads, 8 row
// lanes each summing every 8th row (fp64), then the 8 partials in lane order; a fixed order for
// every element.
template <class T>
__global__ void colsum_kernel(float* dw, const T* rows, int64_t N, int64_t C) {
  allow_dependents();
  grid_dependency_wait();  // launched dependent with kDependTrain (launch.cuh)
  __shared__ double part[8][33];
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  double s = 0;
  if (c < C)
    for (int64_t n = threadIdx.y; n < N; n += 8) s += double(rows[n * C + c]);
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    double t = 0;
    for (int y = 0; y < 8; ++y) t += part[y][threadIdx.x];
    dw[c] += float(t);
  }
}

}  // namespace
}  // namespace talon::cuda
