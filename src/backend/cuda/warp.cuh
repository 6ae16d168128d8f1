// Internal to the CUDA backend: full-warp reductions (butterfly over __shfl_xor_sync, so
// every lane ends with the result, summed in the same order on every run).
#pragma once

namespace talon::cuda {
namespace {

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

}  // namespace
}  // namespace talon::cuda
