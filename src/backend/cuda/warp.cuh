// Internal to the CUDA backend: full-warp reductions (butterfly over __shfl_xor_sync, so
// every lane ends with the result, summed in the same order on every run), and the device
// side of programmatic dependent launch.
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

// Programmatic dependent launch (Hopper): a kernel launched with launch_dependent (launch.cuh)
// may start while the kernel before it on the stream is still running; it must call
// grid_dependency_wait() before it reads anything that kernel wrote (the wait returns once
// that kernel has finished and its writes are visible). allow_dependents() lets such a
// successor launch as soon as every block of this kernel has called it. Both are no-ops on
// GPUs before sm_90, where launch_dependent never sets the attribute.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace
}  // namespace talon::cuda
