// Internal to the CUDA backend: the warp-level tensor-core primitives the flash attention
// (attention.cu), the decode and TTT attention and the grouped expert GEMM (moe.cu) are built
// from, as inline PTX.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

namespace talon::cuda {
namespace {

// A generic pointer into shared memory as the 32-bit shared-window address PTX expects.
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// 16 bytes global -> shared, asynchronously (cp.async, bypassing L1); when !valid the
// destination is zero-filled and src is not read (it must still be a valid address).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid = true) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
// Closes this thread's copies issued since the last commit into one group.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed copy groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 b16 matrices from shared memory (lane l gives the row address of matrix l / 8).
__device__ __forceinline__ void ldmatrix_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(smem_addr(p)));
}

// The same, each matrix transposed.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3,
                                                  const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(smem_addr(p)));
}

// d[4] += a[4] (16x16 row-major) * b0, b1 (16x8 column-major), bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma_bf16(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as a bf16 pair (lo in the low half, as the fragments of mma_bf16 take them).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Online softmax over key tiles, per lane of an m16n8 score fragment: the lane holds rows g and
// g + 8, mx their maxima over this tile's scores (log2 domain, hidden keys -inf). Reduces mx
// over the quad that shares the rows, moves the running maxima m_run, rescales the running sums
// l_run, and gives in corr the factor of each row's running output (scale_rows).
__device__ __forceinline__ void online_softmax_step(float (&mx)[2], float (&m_run)[2], float (&l_run)[2],
                                                    float (&corr)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    const float m_new = fmaxf(m_run[r], mx[r]);
    corr[r] = exp2f(m_run[r] - m_new);
    m_run[r] = m_new;
    l_run[r] *= corr[r];
  }
}

// o (DT output fragments of rows g, g + 8) times each row's corr.
template <int DT>
__device__ __forceinline__ void scale_rows(float (&o)[DT][4], const float (&corr)[2]) {
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) {
    o[dt][0] *= corr[0];
    o[dt][1] *= corr[0];
    o[dt][2] *= corr[1];
    o[dt][3] *= corr[1];
  }
}

// P = exp2(s - m_run) of NT groups of 8 keys (hidden keys: exp2(-inf) = 0), its row sums added
// to l_run, as A fragments of NT / 2 16-key slices: pf the bf16 rounding of P and pl what that
// rounding lost, so that two P V products keep P to ~16 mantissa bits.
template <int NT>
__device__ __forceinline__ void probs_hi_lo(const float (&s)[NT][4], const float (&m_run)[2], float (&l_run)[2],
                                            uint32_t (&pf)[NT / 2][4], uint32_t (&pl)[NT / 2][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    float p[4], lo[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      p[e] = exp2f(s[nt][e] - m_run[e / 2]);
      l_run[e / 2] += p[e];
      lo[e] = p[e] - __bfloat162float(__float2bfloat16(p[e]));
    }
    pf[nt / 2][(nt % 2) * 2 + 0] = pack_bf16(p[0], p[1]);
    pf[nt / 2][(nt % 2) * 2 + 1] = pack_bf16(p[2], p[3]);
    pl[nt / 2][(nt % 2) * 2 + 0] = pack_bf16(lo[0], lo[1]);
    pl[nt / 2][(nt % 2) * 2 + 1] = pack_bf16(lo[2], lo[3]);
  }
}

}  // namespace
}  // namespace talon::cuda
