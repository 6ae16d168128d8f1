// Kernels the GPU draft trainers share (draft_train.cu, dflash_train.cu): a strided add, and the optimizer's sum of squares, scaling and
// AdamW update; and the copies of their flat tensor buffers to and from the host. Every
// reduction has a fixed order (the same bits on every run). Included by .cu files only; each
// gets its own copy.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/kernels/reduce.cuh"  // colsum_kernel
#include "backend/cuda/launch.cuh"
#include "backend/cuda/warp.cuh"

namespace talon::cuda {
namespace {

inline unsigned nblocks(int64_t n, int per) { return unsigned((n + per - 1) / per); }

// out = a's rows map[0..N) (row stride lda; a's first N rows when map is null) + b
__global__ void add_rows_kernel(float* out, const float* a, int64_t lda, const int32_t* map, const float* b, int64_t N,
                                int64_t C) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N * C) return;
  const int64_t r = i / C;
  out[i] = a[(map ? int64_t(map[r]) : r) * lda + i % C] + b[i];
}


constexpr int kNormBlocks = 240;

// partial[block] = the block's share of sum(g^2), in a fixed order. float4 loads where g is
// 16-byte aligned (every tensor of the trainers' flat buffers is), the tail one by one.
__global__ void sumsq_kernel(double* partial, const float* g, int64_t n) {
  allow_dependents();
  grid_dependency_wait();  // launched dependent with kDependTrain (launch.cuh)
  __shared__ double sh[256];
  double s = 0;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t n4 = uintptr_t(g) % 16 == 0 ? n / 4 : 0;
  const float4* g4 = reinterpret_cast<const float4*>(g);
  for (int64_t i = tid; i < n4; i += stride) {
    const float4 v = g4[i];
    s += double(v.x) * double(v.x) + double(v.y) * double(v.y) + double(v.z) * double(v.z) + double(v.w) * double(v.w);
  }
  for (int64_t i = n4 * 4 + tid; i < n; i += stride) s += double(g[i]) * double(g[i]);
  sh[threadIdx.x] = s;
  __syncthreads();
  for (int o = blockDim.x / 2; o > 0; o >>= 1) {
    if (threadIdx.x < o) sh[threadIdx.x] += sh[threadIdx.x + o];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = sh[0];
}

// The global norm from sumsq_kernel's n partial sums (a fixed order: the same bits every run
// and on every GPU given the same partials) into *norm, and the clipping factor into *scale:
// max_norm / (norm + 1e-6) where that is below 1 (max_norm > 0), else 1. One block of 256.
__global__ void norm_finish_kernel(const double* partial, int n, double max_norm, double* norm, float* scale) {
  allow_dependents();
  grid_dependency_wait();  // launched dependent with kDependTrain (launch.cuh)
  __shared__ double sh[256];
  double acc = 0;
  for (int i = int(threadIdx.x); i < n; i += 256) acc += partial[i];
  sh[threadIdx.x] = acc;
  __syncthreads();
  for (int o = 128; o > 0; o >>= 1) {
    if (int(threadIdx.x) < o) sh[threadIdx.x] += sh[threadIdx.x + o];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const double nr = sqrt(sh[0]);
    float f = 1.f;
    if (max_norm > 0) {
      const double coef = max_norm / (nr + 1e-6);
      if (coef < 1.0) f = float(coef);
    }
    *norm = nr;
    *scale = f;
  }
}

__global__ void scale_kernel(float* x, float s, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= s;
}
// As scale_kernel, the factor read from the device (*s).
__global__ void scale_at_kernel(float* x, const float* s, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= *s;
}

// One AdamW update of one value. The gradient is read times gscale (the clipping factor,
// applied here instead of in a pass of its own: the same product, so the same bits); where
// gscale_at is set, the factor is read from there on the device instead.
struct AdamWArgs {
  float decay, step, sbc2, b1, b2, eps, gscale;
  const float* gscale_at = nullptr;
};
__device__ __forceinline__ float adamw_one(float& w, float& m, float& v, float g, const AdamWArgs& a) {
  const float gj = a.gscale == 1.f ? g : g * a.gscale;
  float wj = w * a.decay;
  const float mj = a.b1 * m + (1.0f - a.b1) * gj;
  const float vj = a.b2 * v + (1.0f - a.b2) * gj * gj;
  wj -= a.step * mj / (sqrtf(vj) / a.sbc2 + a.eps);
  w = wj;
  m = mj;
  v = vj;
  return wj;
}

__host__ __device__ inline bool adamw_vectors(const float* w, const float* m, const float* v, const float* g,
                                              const __nv_bfloat16* wb) {
  return (uintptr_t(w) | uintptr_t(m) | uintptr_t(v) | uintptr_t(g)) % 16 == 0 && uintptr_t(wb) % 8 == 0;
}

// AdamW over n values: four a thread (float4 loads and stores) where every array is 16-byte
// aligned (wb 8-byte), then the rest one a thread. With wb, the weights' bf16 copy is written
// too (the bits cast_bf16 gives). Each value's arithmetic is the same either way.
__global__ void adamw_kernel(float* w, float* m, float* v, const float* g, int64_t n, AdamWArgs args,
                             __nv_bfloat16* wb) {
  allow_dependents();
  grid_dependency_wait();  // launched dependent with kDependTrain (launch.cuh)
  AdamWArgs a = args;
  if (a.gscale_at) a.gscale = *a.gscale_at;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n4 = adamw_vectors(w, m, v, g, wb) ? n / 4 : 0;
  if (i < n4) {
    float4 W = reinterpret_cast<float4*>(w)[i], M = reinterpret_cast<float4*>(m)[i];
    float4 V = reinterpret_cast<float4*>(v)[i];
    const float4 G = reinterpret_cast<const float4*>(g)[i];
    adamw_one(W.x, M.x, V.x, G.x, a);
    adamw_one(W.y, M.y, V.y, G.y, a);
    adamw_one(W.z, M.z, V.z, G.z, a);
    adamw_one(W.w, M.w, V.w, G.w, a);
    reinterpret_cast<float4*>(w)[i] = W;
    reinterpret_cast<float4*>(m)[i] = M;
    reinterpret_cast<float4*>(v)[i] = V;
    if (wb) {
      __nv_bfloat162* b = reinterpret_cast<__nv_bfloat162*>(wb + 4 * i);
      b[0] = __nv_bfloat162(__float2bfloat16_rn(W.x), __float2bfloat16_rn(W.y));
      b[1] = __nv_bfloat162(__float2bfloat16_rn(W.z), __float2bfloat16_rn(W.w));
    }
    return;
  }
  const int64_t j = n4 * 4 + (i - n4);  // the tail (or everything, unaligned)
  if (j >= n) return;
  const float wj = adamw_one(w[j], m[j], v[j], g[j], a);
  if (wb) wb[j] = __float2bfloat16_rn(wj);
}

// One AdamW update of n values at w, m, v (gradient g, bf16 copy wb or null) on stream s.
inline void adamw_update(float* w, float* m, float* v, const float* g, int64_t n, const AdamWArgs& a,
                         __nv_bfloat16* wb, cudaStream_t s) {
  const int64_t threads = adamw_vectors(w, m, v, g, wb) ? n / 4 + n % 4 : n;
  launch_dependent(kDependTrain, adamw_kernel, dim3(nblocks(threads, 256)), dim3(256), 0, s, w, m, v, g, n, a, wb);
}

// Host arrays to or from the tensors of one flat buffer (tensor i at base + offs[i]), on the
// engine's stream s, drained before returning: ordered with everything else the engine
// runs (a cudaMemcpy from pageable memory can return before its copy has landed, and it is
// not ordered with s).
inline void copy_tensors(float* base, const std::vector<int64_t>& offs, const std::vector<int64_t>& sizes,
                         const std::vector<float*>& host, bool to_host, cudaStream_t s) {
  if (host.size() != sizes.size())
    fail_msg("draft on GPU: " + std::to_string(host.size()) + " tensors given, expected " + std::to_string(sizes.size()));
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (to_host)
      CUDA_CHECK(cudaMemcpyAsync(host[i], base + offs[i], size_t(sizes[i]) * 4, cudaMemcpyDeviceToHost, s));
    else
      CUDA_CHECK(cudaMemcpyAsync(base + offs[i], host[i], size_t(sizes[i]) * 4, cudaMemcpyHostToDevice, s));
  }
  CUDA_CHECK(cudaStreamSynchronize(s));
}

inline std::vector<float*> unconst(const std::vector<const float*>& v) {
  std::vector<float*> o;
  for (auto* p : v) o.push_back(const_cast<float*>(p));
  return o;
}

}  // namespace
}  // namespace talon::cuda
