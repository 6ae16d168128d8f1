// Rotary position embedding, forward and backward, for every caller on the GPU: the target's
// q/k heads (bf16, in place inside the fused q|k|v rows, fp32 angles) and the draft trainer's
// (fp32 in place or into a bf16 copy, fp64 angles, the position offset of the TTT step, and
// sign -1 for the backward, which rotates the gradient back). The CPU twin is rope_forward in
// src/backend/cpu/ops.h (the specification): for each head and i < hd/2,
//   (x[i], x[i + hd/2]) <- (x[i] cos a - x[i + hd/2] sin a, x[i + hd/2] cos a + x[i] sin a),
//   a = sign * (pos[n] + offset) * inv_freq[i].
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/check.h"
#include "backend/cuda/kernels/convert.cuh"

namespace talon::cuda {
namespace {

__device__ __forceinline__ void sin_cos(float a, float* s, float* c) { sincosf(a, s, c); }
__device__ __forceinline__ void sin_cos(double a, double* s, double* c) { sincos(a, s, c); }

// Angle is the precision of the angle and the rotation (float or double); x and y may alias
// (in place). Rows of `heads` heads of hd values start every ldx / ldy elements.
template <class Angle, class Y, class X>
__global__ void rope_kernel(Y* y, int64_t ldy, const X* x, int64_t ldx, const int32_t* pos, int offset,
                            const float* inv_freq, Angle sign, int64_t N, int64_t heads, int64_t hd) {
  const int64_t half = hd / 2;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= N * heads * half) return;
  const int64_t i = idx % half, h = (idx / half) % heads, n = idx / (half * heads);
  Angle sn, cs;
  sin_cos(sign * Angle(pos[n] + offset) * Angle(inv_freq[i]), &sn, &cs);
  const X* p = x + n * ldx + h * hd;
  const Angle a = load_f(p + i), b = load_f(p + i + half);
  Y* o = y + n * ldy + h * hd;
  store_as(o + i, float(a * cs - b * sn));
  store_as(o + i + half, float(b * cs + a * sn));
}

// y = rope(x) on stream s; y == x rotates in place.
template <class Angle, class Y, class X>
void launch_rope(Y* y, int64_t ldy, const X* x, int64_t ldx, const int32_t* pos, int offset, const float* inv_freq,
          Angle sign, int64_t N, int64_t heads, int64_t hd, cudaStream_t s) {
  const int64_t n = N * heads * (hd / 2);
  if (n <= 0) return;
  rope_kernel<Angle><<<unsigned((n + 255) / 256), 256, 0, s>>>(y, ldy, x, ldx, pos, offset, inv_freq, sign, N, heads,
                                                              hd);
  CUDA_LAUNCH_CHECK();
}

}  // namespace
}  // namespace talon::cuda
