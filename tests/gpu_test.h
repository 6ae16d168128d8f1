// For tests of CUDA code: they skip (not fail) on machines without a GPU, such as CI.
#pragma once
#include <cuda_runtime.h>
#include <gtest/gtest.h>

namespace talon::testing {

inline bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

}  // namespace talon::testing

#define REQUIRE_GPU() \
  if (!talon::testing::have_gpu()) GTEST_SKIP() << "no CUDA device on this machine"
