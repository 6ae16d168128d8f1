// Internal to the CUDA backend: the MoE experts' bf16 grouped GEMM on Hopper's warpgroup MMA
// and TMA, through CUTLASS's pointer-array grouped GEMM (TMA warp-specialized cooperative
// kernel, device-side problem sizes: no host round trip for the experts' row counts).
//
// out[offsets[e] + r, :] (fp32, row-major, N columns) = a[offsets[e] + r, :] (bf16, row-major,
// K columns) @ w[e]^T for every expert e and r < offsets[e+1] - offsets[e], w bf16 [E, N, K]
// (the stacked expert matrices of moe.h). offsets: device int32 [E + 1], ascending (moe.cu's
// sorted slot offsets). Needs K % 8 == 0, N % 4 == 0 and 16-byte aligned a, w, out.
//
// The default for bf16 experts past the decode-sized calls where the build has CUTLASS's headers
// (scripts/fetch_cutlass.sh; moe_cutlass_built() says whether it does): measured on an H100, one
// Kimi-K2 layer, 1.06-1.78x the mma.sync tiles from 64 to 8,192 tokens (bench/RESULTS.md,
// 2026-12-06). TALON_MOE_GEMM=tiles keeps the tiles (the tested fallback), =cutlass insists.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

namespace talon::cuda {

bool moe_cutlass_built();
// Whether bf16 experts take this route: TALON_MOE_GEMM in the environment (read once: cutlass,
// tiles, or unset for moe_cutlass_built()), unless moe_cutlass_use() overrode it.
bool moe_cutlass_requested();
// Tests: 1 routes bf16 experts to CUTLASS, 0 to the mma.sync tiles, -1 back to the environment.
void moe_cutlass_use(int mode);
// The tiles of the grouped product: 0 (TALON_MOE_CUTLASS_TILES=rows128, the default) 128 routed
// rows x 128 outputs, D as is; 1 (out128x64) and 2 (out128x128) the product transposed, 128
// outputs x 64 or 128 routed rows (an expert's rows padded to 64 or 128, not 128; the weights as
// the wgmma's A operand; D written column-major, which is the same row-major out). The
// environment is read once; tests set it with moe_cutlass_tiles(config) (-1: the environment).
int moe_cutlass_tiles();
void moe_cutlass_tiles(int config);
// For tests: cute's shared-memory descriptor (start address 0) of the K-major bf16 layout the
// wgmma expert kernel (moe.cu) gives its operands: one k16 step of 64 rows in 8x8 core matrices,
// the two k halves 128 bytes apart, groups of 8 rows sbo_bytes (1024 or 2048) apart.
uint64_t moe_cutlass_k_major_desc(int sbo_bytes);
// For tests: cute's (row, k) of A value v (0-7) of warpgroup thread tid (0-127) of an m64k16
// register fragment, and its (row, column) of accumulator value i (0-31) of an m64n64 product.
std::pair<int, int> moe_cutlass_gmma_a_coord(int tid, int v);
std::pair<int, int> moe_cutlass_gmma_d_coord(int tid, int i);
// Whether the shapes and pointers fit the kernel (see above).
bool moe_cutlass_fits(const void* a, const void* w, const void* out, int64_t N, int64_t K);
// A device buffer of n bf16 values for the routed rows in sorted order (per device and stream,
// grown as needed; a grow first synchronizes s).
__nv_bfloat16* moe_cutlass_rows(int64_t n, cudaStream_t s);
// The grouped product above, on stream s. Its pointer arrays and CUTLASS's workspace are kept
// per device and stream and grown as needed (a grow first synchronizes s).
void moe_cutlass_grouped_gemm(float* out, const __nv_bfloat16* a, const __nv_bfloat16* w, const int32_t* offsets,
                              int E, int64_t N, int64_t K, cudaStream_t s);

}  // namespace talon::cuda
