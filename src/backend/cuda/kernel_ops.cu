#include "backend/cuda/kernel_ops.h"

#include "backend/cuda/check.h"
#include "backend/cuda/kernels/cast.cuh"
#include "backend/cuda/kernels/rmsnorm.cuh"
#include "backend/cuda/kernels/rope.cuh"
#include "backend/cuda/kernels/swiglu.cuh"

namespace talon::cuda::kernel {

void rmsnorm_forward(float* y, const float* x, const float* w, int64_t N, int64_t C, float eps, cudaStream_t s) {
  cuda::rmsnorm_forward<float, const float, void>(y, NormRows{C}, x, NormRows{C}, nullptr, w, N, C, eps, s);
  CUDA_LAUNCH_CHECK();
}
void rmsnorm_forward(bf16* y, const float* x, const float* w, int64_t N, int64_t C, float eps, cudaStream_t s) {
  cuda::rmsnorm_forward<bf16, const float, void>(y, NormRows{C}, x, NormRows{C}, nullptr, w, N, C, eps, s);
  CUDA_LAUNCH_CHECK();
}
int64_t rmsnorm_backward_groups(int64_t N) { return cuda::rmsnorm_backward_groups(N); }
void set_norm_back_rows(int rows) { g_norm_back_rows.store(rows, std::memory_order_relaxed); }
void rmsnorm_backward(float* dx, const float* res, float* dw, double* wpart, const float* dy, const float* x,
                      const float* w, int64_t N, int64_t C, float eps, cudaStream_t s) {
  cuda::rmsnorm_backward(dx, C, res, dw, wpart, dy, C, x, C, w, N, C, eps, s);
  CUDA_LAUNCH_CHECK();
}

void rope(float* x, bf16* out_b, const int32_t* pos, int offset, const float* inv_freq, double sign, int64_t N,
          int64_t heads, int64_t hd, cudaStream_t s) {
  const int64_t ld = heads * hd;
  if (out_b)
    launch_rope(out_b, ld, x, ld, pos, offset, inv_freq, sign, N, heads, hd, s);
  else
    launch_rope(x, ld, x, ld, pos, offset, inv_freq, sign, N, heads, hd, s);
}

void swiglu_forward(float* act, const float* g, const float* u, int64_t ld, int64_t N, int64_t I, cudaStream_t s) {
  launch_swiglu_forward(act, g, u, ld, N, I, s);
}
void swiglu_forward(bf16* act, const bf16* g, const bf16* u, int64_t ld, int64_t N, int64_t I, cudaStream_t s) {
  launch_swiglu_forward(act, g, u, ld, N, I, s);
}
void swiglu_forward(bf16* act, const float* g, const float* u, int64_t ld, int64_t N, int64_t I, cudaStream_t s) {
  launch_swiglu_forward(act, g, u, ld, N, I, s);
}
void cast_rows_bf16(bf16* out, int64_t ldo, const float* in, int64_t ldi, int64_t rows, int64_t cols, cudaStream_t s) {
  cuda::cast_rows_bf16(out, ldo, in, ldi, rows, cols, s);
}
void swiglu_backward(float* dg, float* du, const float* dact, const float* g, const float* u, int64_t ld, int64_t ldd,
                     int64_t N, int64_t I, cudaStream_t s) {
  launch_swiglu_backward(dg, du, dact, g, u, ld, ldd, N, I, s);
}
void swiglu_backward(bf16* dg, bf16* du, const float* dact, const bf16* g, const bf16* u, int64_t ld, int64_t ldd,
                     int64_t N, int64_t I, cudaStream_t s) {
  launch_swiglu_backward(dg, du, dact, g, u, ld, ldd, N, I, s);
}

}  // namespace talon::cuda::kernel
