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

__global__ void sumsq_kernel(double* partial, const float* g, int64_t n) {
  __shared__ double sh[256];
  double s = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    s += double(g[i]) * double(g[i]);
  sh[threadIdx.x] = s;
  __syncthreads();
  for (int o = blockDim.x / 2; o > 0; o >>= 1) {
    if (threadIdx.x < o) sh[threadIdx.x] += sh[threadIdx.x + o];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = sh[0];
}

__global__ void scale_kernel(float* x, float s, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= s;
}

// One AdamW update of n values. The gradient is read times gscale (the clipping factor, applied
// here instead of in a pass of its own: the same product, so the same bits); with wb, the
// weights' bf16 copy is written too (the bits cast_bf16 gives).
__global__ void adamw_kernel(float* w, float* m, float* v, const float* g, int64_t n, float decay, float step,
                             float sbc2, float b1, float b2, float eps, float gscale, __nv_bfloat16* wb) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float gj = gscale == 1.f ? g[i] : g[i] * gscale;
  float wj = w[i] * decay;
  const float mj = b1 * m[i] + (1.0f - b1) * gj;
  const float vj = b2 * v[i] + (1.0f - b2) * gj * gj;
  wj -= step * mj / (sqrtf(vj) / sbc2 + eps);
  w[i] = wj;
  m[i] = mj;
  v[i] = vj;
  if (wb) wb[i] = __float2bfloat16_rn(wj);
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
