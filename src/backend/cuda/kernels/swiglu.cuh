// SwiGLU, forward and backward, for every caller on the GPU: the target's MLP (the fused
// gate|up projection, bf16), the MoE experts (fp32 gate and up, bf16 out) and the draft
// trainer (separate gate and up, fp32 or bf16, and the backward). The CPU twin is
// swiglu_forward in src/backend/cpu/ops.h (the specification):
//   act = silu(g) * u = g / (1 + exp(-g)) * u,
//   backward: du = dact * g * sg,  dg = dact * u * sg * (1 + g (1 - sg)),  sg = 1 / (1 + exp(-g)).
// Operands are N rows of I values; gate and up rows start every ld elements (ld = I for
// separate buffers, 2I for the fused gate|up rows, where up = gate + I); act is contiguous
// [N, I], the gradients rows start every ldd elements (I, or 2I for a fused dgate|dup layout
// that one product reads as the gradient of the fused gate|up product). bf16 operands with I
// and ld multiples of 8 and 16-byte aligned pointers go 8 values a thread (16-byte accesses;
// the same arithmetic, so the same bits as the one-value kernels).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "backend/cuda/check.h"
#include "backend/cuda/kernels/convert.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/warp.cuh"

namespace talon::cuda {
namespace {

__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.f + expf(-g)) * u; }

__device__ __forceinline__ void swiglu_grad(float d, float g, float u, float* dg, float* du) {
  const float sg = 1.f / (1.f + expf(-g));
  *du = d * g * sg;
  *dg = d * u * sg * (1.f + g * (1.f - sg));
}

template <class A, class T>
__global__ void swiglu_forward_kernel(A* act, const T* g, const T* u, int64_t ld, int64_t N, int64_t I) {
  allow_dependents();  // the down product prefetches its weights meanwhile (warp.cuh)
  grid_dependency_wait();  // launched dependent (launch.cuh)
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= N * I) return;
  const int64_t at = (idx / I) * ld + idx % I;
  store_as(act + idx, silu_times(load_f(g + at), load_f(u + at)));
}

template <class T>
__global__ void swiglu_backward_kernel(T* dg, T* du, const float* dact, const T* g, const T* u, int64_t ld, int64_t ldd,
                                       int64_t N, int64_t I) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= N * I) return;
  const int64_t at = (idx / I) * ld + idx % I, to = (idx / I) * ldd + idx % I;
  float a, b;
  swiglu_grad(dact[idx], load_f(g + at), load_f(u + at), &a, &b);
  store_as(dg + to, a);
  store_as(du + to, b);
}

__device__ __forceinline__ void unpack8(float (&f)[8], uint4 v) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 x = __bfloat1622float2(h[j]);
    f[2 * j] = x.x;
    f[2 * j + 1] = x.y;
  }
}
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  uint4 v;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) h[j] = __floats2bfloat162_rn(f[2 * j], f[2 * j + 1]);
  return v;
}

// One thread per 8 values: vector v of the [N, I/8] grid (ld8 = ld / 8, I8 = I / 8).
__global__ void swiglu_forward_x8_kernel(__nv_bfloat16* act, const __nv_bfloat16* g, const __nv_bfloat16* u,
                                         int64_t ld8, int64_t N, int64_t I8) {
  allow_dependents();
  grid_dependency_wait();
  const int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (v >= N * I8) return;
  const int64_t at = (v / I8) * ld8 + v % I8;
  float a[8], b[8], o[8];
  unpack8(a, reinterpret_cast<const uint4*>(g)[at]);
  unpack8(b, reinterpret_cast<const uint4*>(u)[at]);
#pragma unroll
  for (int j = 0; j < 8; ++j) o[j] = silu_times(a[j], b[j]);
  reinterpret_cast<uint4*>(act)[v] = pack8(o);
}

__global__ void swiglu_backward_x8_kernel(__nv_bfloat16* dg, __nv_bfloat16* du, const float* dact,
                                          const __nv_bfloat16* g, const __nv_bfloat16* u, int64_t ld8, int64_t ldd8,
                                          int64_t N, int64_t I8) {
  allow_dependents();
  grid_dependency_wait();  // launched dependent with kDependTrain (launch.cuh)
  const int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (v >= N * I8) return;
  const int64_t at = (v / I8) * ld8 + v % I8, to = (v / I8) * ldd8 + v % I8;
  float a[8], b[8], d[8], og[8], ou[8];
  unpack8(a, reinterpret_cast<const uint4*>(g)[at]);
  unpack8(b, reinterpret_cast<const uint4*>(u)[at]);
  const float4 d0 = reinterpret_cast<const float4*>(dact)[2 * v], d1 = reinterpret_cast<const float4*>(dact)[2 * v + 1];
  d[0] = d0.x, d[1] = d0.y, d[2] = d0.z, d[3] = d0.w, d[4] = d1.x, d[5] = d1.y, d[6] = d1.z, d[7] = d1.w;
#pragma unroll
  for (int j = 0; j < 8; ++j) swiglu_grad(d[j], a[j], b[j], &og[j], &ou[j]);
  reinterpret_cast<uint4*>(dg)[to] = pack8(og);
  reinterpret_cast<uint4*>(du)[to] = pack8(ou);
}

inline bool swiglu_vec8(const void* a, const void* b, const void* c, int64_t ld, int64_t I) {
  const auto al = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  return ld % 8 == 0 && I % 8 == 0 && al(a) && al(b) && al(c);
}

inline unsigned swiglu_blocks(int64_t n) { return unsigned((n + 255) / 256); }

// act[N, I] = silu(g) * u on stream s.
template <class A, class T>
void launch_swiglu_forward(A* act, const T* g, const T* u, int64_t ld, int64_t N, int64_t I, cudaStream_t s) {
  if (N <= 0 || I <= 0) return;
  if constexpr (std::is_same_v<A, __nv_bfloat16> && std::is_same_v<T, __nv_bfloat16>) {
    if (swiglu_vec8(act, g, u, ld, I)) {
      launch_dependent(kDependNorm, swiglu_forward_x8_kernel, dim3(swiglu_blocks(N * I / 8)), dim3(256), 0, s, act, g,
                       u, ld / 8, N, I / 8);
      return;
    }
  }
  launch_dependent(kDependNorm, swiglu_forward_kernel<A, T>, dim3(swiglu_blocks(N * I)), dim3(256), 0, s, act, g, u, ld,
                   N, I);
}

// dg, du (N rows of I, every ldd) = the gradients of act = silu(g) * u given dact [N, I] (fp32),
// on stream s.
template <class T>
void launch_swiglu_backward(T* dg, T* du, const float* dact, const T* g, const T* u, int64_t ld, int64_t ldd, int64_t N,
                            int64_t I, cudaStream_t s) {
  if (N <= 0 || I <= 0) return;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (swiglu_vec8(dg, du, dact, ldd, I) && swiglu_vec8(g, u, dact, ld, I)) {
      launch_dependent(kDependTrain, swiglu_backward_x8_kernel, dim3(swiglu_blocks(N * I / 8)), dim3(256), 0, s, dg, du,
                       dact, g, u, ld / 8, ldd / 8, N, I / 8);
      return;
    }
  }
  swiglu_backward_kernel<<<swiglu_blocks(N * I), 256, 0, s>>>(dg, du, dact, g, u, ld, ldd, N, I);
  CUDA_LAUNCH_CHECK();
}

}  // namespace
}  // namespace talon::cuda
