// Internal to the CUDA backend: the host side of programmatic dependent launch (warp.cuh has
// the device side). A kernel launched with launch_dependent may start while the kernel before
// it on the stream still runs, once every block of that kernel has called allow_dependents()
// (or ended). So every kernel launched this way calls grid_dependency_wait() before it touches
// anything another kernel writes or reads (only weights, which no kernel writes, may be read
// before it), and calls allow_dependents() itself so that the kernel after it can start early
// in turn: a kernel that waits for the one before it is already resident when that one ends.
#pragma once
#include <cuda_runtime.h>

#include "backend/cuda/check.h"
#include "backend/cuda/ops.h"

namespace talon::cuda {

// `kind`: one of ops.h's kDepend* bits, which TALON_CUDA_PDL switches.
template <class... P, class... A>
void launch_dependent(unsigned kind, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                      A... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = dependent_launch_enabled(kind) ? 1 : 0;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, P(args)...));
  CUDA_LAUNCH_CHECK();
}

}  // namespace talon::cuda
