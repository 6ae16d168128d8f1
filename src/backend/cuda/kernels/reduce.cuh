// Block-wide reductions for the kernels of kernels/ (a block is a multiple of 32 threads).
// Summed in the same order on every run.
#pragma once
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

}  // namespace
}  // namespace talon::cuda
