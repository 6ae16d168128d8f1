// The draft trainer's variants of the shared kernels (backend/cuda/kernels/*.cuh) as plain
// functions: fp32 norms and their backward, RoPE with fp64 angles (forward, and sign -1 for the
// backward), SwiGLU forward and backward on fp32 or bf16 operands, and the MoE experts' SwiGLU
// (fp32 in, bf16 out). The trainer instantiates the same templates inline; these entry points
// let the op harness (tests/backend/test_cuda_kernels.cpp) check every variant against the
// CPU specification on odd shapes, unaligned pointers and guarded buffers. All enqueue on s.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace talon::cuda::kernel {

using bf16 = __nv_bfloat16;

// y[N, C] = x / rms(x) * w, fp32 (y may be bf16: the product's operand copy).
void rmsnorm_forward(float* y, const float* x, const float* w, int64_t N, int64_t C, float eps, cudaStream_t s);
void rmsnorm_forward(bf16* y, const float* x, const float* w, int64_t N, int64_t C, float eps, cudaStream_t s);
// dx[N, C] = res + the input gradient (res may be null or dx itself; dx may be null), dw[C] +=
// the weight gradient; wpart: scratch of rmsnorm_backward_groups(N) x C doubles.
int64_t rmsnorm_backward_groups(int64_t N);
// The backward's rows a block for the calls that follow: 4 (the default) or 8 (as
// TALON_CUDA_NORM_BACK_ROWS=8); 0: back to the environment's choice. For the op harness.
void set_norm_back_rows(int rows);
void rmsnorm_backward(float* dx, const float* res, float* dw, double* wpart, const float* dy, const float* x,
                      const float* w, int64_t N, int64_t C, float eps, cudaStream_t s);

// x[N, heads*hd] rotated by sign * (pos[n] + offset) * inv_freq[i] in fp64: in place when
// out_b is null, else into out_b (bf16) with x unchanged.
void rope(float* x, bf16* out_b, const int32_t* pos, int offset, const float* inv_freq, double sign, int64_t N,
          int64_t heads, int64_t hd, cudaStream_t s);

// act[N, I] = silu(g) * u; gate/up rows every ld elements.
void swiglu_forward(float* act, const float* g, const float* u, int64_t ld, int64_t N, int64_t I, cudaStream_t s);
void swiglu_forward(bf16* act, const bf16* g, const bf16* u, int64_t ld, int64_t N, int64_t I, cudaStream_t s);
void swiglu_forward(bf16* act, const float* g, const float* u, int64_t ld, int64_t N, int64_t I, cudaStream_t s);
// out[r * ldo + c] = bf16(in[r * ldi + c]), r < rows, c < cols.
void cast_rows_bf16(bf16* out, int64_t ldo, const float* in, int64_t ldi, int64_t rows, int64_t cols, cudaStream_t s);
// dg, du (N rows of I, every ldd elements) from dact [N, I].
void swiglu_backward(float* dg, float* du, const float* dact, const float* g, const float* u, int64_t ld, int64_t ldd,
                     int64_t N, int64_t I, cudaStream_t s);
void swiglu_backward(bf16* dg, bf16* du, const float* dact, const bf16* g, const bf16* u, int64_t ld, int64_t ldd,
                     int64_t N, int64_t I, cudaStream_t s);

}  // namespace talon::cuda::kernel
