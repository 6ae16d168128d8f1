// Shared by the GPU benchmarks: a CUDA call that must succeed (else the message and exit 1), and
// device allocations for them (never freed before exit unless the caller does).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#define BENCH_CK(x)                                                 \
  do {                                                              \
    cudaError_t e_ = (x);                                           \
    if (e_ != cudaSuccess) {                                        \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                 \
    }                                                               \
  } while (0)

namespace talon::bench {
template <typename T>
T* dalloc(size_t n) {
  void* p = nullptr;
  BENCH_CK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  return static_cast<T*>(p);
}
}  // namespace talon::bench
