// Element-wise casts between fp32 and bf16 for every caller: the target's logits and captured
// hidden states, the draft trainer's bf16 operand copies. fp32 -> bf16 rounds to nearest even
// (convert.cuh), and runs 4 values a thread over the aligned bulk when the pointers allow.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/check.h"
#include "backend/cuda/kernels/convert.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/warp.cuh"

namespace talon::cuda {
namespace {

template <class Out, class In>
__global__ void cast_kernel(Out* out, const In* in, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) store_as(out + i, load_f(in + i));
}

// Four fp32 values as four bf16 ones (round to nearest even), packed for one 8-byte store.
__device__ __forceinline__ uint2 pack4_bf16(float4 v) {
  const __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y), b = __floats2bfloat162_rn(v.z, v.w);
  uint2 o;
  o.x = *reinterpret_cast<const uint32_t*>(&a);
  o.y = *reinterpret_cast<const uint32_t*>(&b);
  return o;
}

// fp32 -> bf16, 4 values a thread (in 16-byte, out 8-byte aligned).
__global__ void cast_bf16_x4_kernel(__nv_bfloat16* out, const float* in, int64_t n4) {
  allow_dependents();
  grid_dependency_wait();  // launched dependent with kDependTrain (launch.cuh)
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n4) return;
  reinterpret_cast<uint2*>(out)[i] = pack4_bf16(reinterpret_cast<const float4*>(in)[i]);
}

// out[0..n) = in[0..n) as Out, on stream s.
template <class Out, class In>
void cast(Out* out, const In* in, int64_t n, cudaStream_t s) {
  if (n <= 0) return;
  int64_t done = 0;
  if constexpr (std::is_same_v<Out, __nv_bfloat16> && std::is_same_v<In, float>) {
    if ((reinterpret_cast<uintptr_t>(in) % 16) == 0 && (reinterpret_cast<uintptr_t>(out) % 8) == 0 && n >= 4) {
      const int64_t n4 = n / 4;
      launch_dependent(kDependTrain, cast_bf16_x4_kernel, dim3(unsigned((n4 + 255) / 256)), dim3(256), 0, s, out, in,
                       n4);
      done = n4 * 4;
    }
  }
  if (done < n) {
    cast_kernel<<<unsigned((n - done + 255) / 256), 256, 0, s>>>(out + done, in + done, n - done);
    CUDA_LAUNCH_CHECK();
  }
}

// Rows of a matrix: out[r * ldo + c] = bf16(in[r * ldi + c]) for r < rows, c < cols (what
// gathers several matrices into one operand, side by side in each row). 4 values a thread
// where cols, both strides and the pointers allow; the same rounding either way.
__global__ void cast_rows_bf16_x4_kernel(__nv_bfloat16* out, int64_t ldo, const float* in, int64_t ldi, int64_t rows,
                                         int64_t c4) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * c4) return;
  const int64_t r = i / c4, c = (i % c4) * 4;
  *reinterpret_cast<uint2*>(out + r * ldo + c) = pack4_bf16(*reinterpret_cast<const float4*>(in + r * ldi + c));
}

__global__ void cast_rows_bf16_kernel(__nv_bfloat16* out, int64_t ldo, const float* in, int64_t ldi, int64_t rows,
                                      int64_t cols) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * cols) return;
  const int64_t r = i / cols, c = i % cols;
  store_as(out + r * ldo + c, in[r * ldi + c]);
}

inline void cast_rows_bf16(__nv_bfloat16* out, int64_t ldo, const float* in, int64_t ldi, int64_t rows, int64_t cols,
                           cudaStream_t s) {
  if (rows <= 0 || cols <= 0) return;
  const bool x4 = cols % 4 == 0 && ldi % 4 == 0 && ldo % 4 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(out) % 8 == 0;
  const int64_t n = x4 ? rows * (cols / 4) : rows * cols;
  if (x4)
    cast_rows_bf16_x4_kernel<<<unsigned((n + 255) / 256), 256, 0, s>>>(out, ldo, in, ldi, rows, cols / 4);
  else
    cast_rows_bf16_kernel<<<unsigned((n + 255) / 256), 256, 0, s>>>(out, ldo, in, ldi, rows, cols);
  CUDA_LAUNCH_CHECK();
}

}  // namespace
}  // namespace talon::cuda
