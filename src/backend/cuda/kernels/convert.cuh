// Element loads and stores in fp32 arithmetic for kernels templated on storage type: fp32 as
// is, bf16 widened exactly and rounded to nearest even when stored (the rounding cuBLAS
// applies to fp32 operands in its bf16 modes), so every kernel rounds the same way.
#pragma once
#include <cuda_bf16.h>

#include <type_traits>

namespace talon::cuda {
namespace {

template <class T>
__device__ __forceinline__ float load_f(const T* p) {
  if constexpr (std::is_same_v<T, float>)
    return *p;
  else
    return __bfloat162float(*p);
}

template <class T>
__device__ __forceinline__ void store_as(T* p, float v) {
  if constexpr (std::is_same_v<T, float>)
    *p = v;
  else
    *p = __float2bfloat16_rn(v);
}

}  // namespace
}  // namespace talon::cuda
