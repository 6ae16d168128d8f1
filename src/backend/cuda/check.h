// Every CUDA / cuBLAS call goes through these: a failure throws talon::Error naming the
// call, file and line. TALON_CUDA_SYNC=1 in the environment synchronises after every
// launch so an asynchronous fault is reported at the kernel that caused it.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <string>

namespace talon::cuda {

bool debug_sync();
// Throw talon::Error (defined in a host .cpp: nvcc cannot compile fmt's compile-time
// format checks, so .cu files format nothing themselves).
[[noreturn]] void fail_cuda(const char* lib, int code, const char* what, const char* expr, const char* file, int line);
[[noreturn]] void fail_msg(const std::string& msg);

#define CUDA_CHECK(expr)                                                                              \
  do {                                                                                                \
    cudaError_t e_ = (expr);                                                                          \
    if (e_ != cudaSuccess)                                                                            \
      ::talon::cuda::fail_cuda("CUDA", int(e_), cudaGetErrorString(e_), #expr, __FILE__, __LINE__);    \
  } while (0)

#define CUBLAS_CHECK(expr)                                                                                  \
  do {                                                                                                      \
    cublasStatus_t s_ = (expr);                                                                             \
    if (s_ != CUBLAS_STATUS_SUCCESS)                                                                        \
      ::talon::cuda::fail_cuda("cuBLAS", int(s_), cublasLtGetStatusString(s_), #expr, __FILE__, __LINE__);  \
  } while (0)

#define CUDA_LAUNCH_CHECK()                                 \
  do {                                                      \
    CUDA_CHECK(cudaGetLastError());                         \
    if (::talon::cuda::debug_sync()) CUDA_CHECK(cudaDeviceSynchronize()); \
  } while (0)

}  // namespace talon::cuda
