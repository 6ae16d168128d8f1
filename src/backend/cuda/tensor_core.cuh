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

// ---- Hopper warpgroup MMA (wgmma; sm_90a): a warpgroup is 4 consecutive warps (128 threads)
// issuing together. With A from registers, each warp w of the group holds rows 16 w .. 16 w + 15
// of the 64-row A tile in mma_bf16's A fragment layout, and the fp32 accumulator of an m64nN
// product holds, for each 8-column slice j, d[4 j .. 4 j + 3] = (row g, columns 8 j + 2 t, + 1)
// and (row g + 8, the same columns) of the warp's 16 rows, as mma_bf16's C fragment repeated.

// Thread tid (0-127) of a warpgroup: the (row, k) of bf16 value v (0-7; register v / 2, the low
// half first) of its m64k16 A fragment, and the (row, column) of value i of its m64nN
// accumulator (the layouts CUTLASS's cute calls ALayout_64x16 and CLayout_64xN).
__host__ __device__ __forceinline__ int2 wgmma_a_coord(int tid, int v) {
  const int w = tid / 32, g = (tid % 32) / 4, t = tid % 4;
  return make_int2(16 * w + g + 8 * ((v / 2) & 1), 2 * t + (v & 1) + 8 * (v / 4));
}
__host__ __device__ __forceinline__ int2 wgmma_d_coord(int tid, int i) {
  const int w = tid / 32, g = (tid % 32) / 4, t = tid % 4;
  return make_int2(16 * w + g + 8 * ((i / 2) & 1), 8 * (i / 4) + 2 * t + (i & 1));
}

// The shared-memory matrix descriptor of a K-major bf16 operand without swizzling: 8x8 core
// matrices of 8 rows x 16 contiguous bytes, the two core matrices of a k16 step `lbo` bytes
// apart, consecutive groups of 8 rows (the N dimension) `sbo` bytes apart. `addr` is the
// shared-window address of the first core matrix (16-byte aligned).
__host__ __device__ __forceinline__ uint64_t wgmma_desc_k_major(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((addr >> 4) & 0x3fffu) | uint64_t((lbo >> 4) & 0x3fffu) << 16 | uint64_t((sbo >> 4) & 0x3fffu) << 32;
}
// Orders this warpgroup's earlier register and shared-memory accesses before its next wgmma.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N of this warpgroup's committed wgmma groups are in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses of r across a wgmma that reads or writes it.
__device__ __forceinline__ void wgmma_reg_fence(float& r) { asm volatile("" : "+f"(r)::"memory"); }
// Makes this thread's generic-proxy writes of shared memory (st.shared, cp.async) visible to the
// async proxy that wgmma reads its shared operand through.
__device__ __forceinline__ void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// d[32] (= or +=, by accumulate) a (64x16 bf16, registers) * B (16x64 bf16, K-major in shared
// memory, descriptor b): one warpgroup's wgmma m64n64k16 with fp32 accumulation.
__device__ __forceinline__ void wgmma_m64n64k16_rs(float* d, const uint32_t* a, uint64_t b, bool accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p_acc;\nsetp.ne.b32 p_acc, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p_acc, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(int(accumulate)));
#else
  __trap();  // wgmma needs sm_90a
#endif
}

// d[32] += A (64x16 bf16, K-major in shared memory, descriptor a) * B (16x64, descriptor b): one
// warpgroup's wgmma m64n64k16 with both operands in shared memory.
__device__ __forceinline__ void wgmma_m64n64k16_ss(float* d, uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p_acc;\nsetp.ne.b32 p_acc, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p_acc, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b), "r"(1));
#else
  __trap();  // wgmma needs sm_90a
#endif
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
