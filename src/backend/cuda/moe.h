// Mixture-of-experts on one GPU, for the DeepSeek-V3 / Kimi-K2 family (model/deepseek.h):
// routing on the device, tokens grouped by expert, and the experts' SwiGLU MLPs as grouped
// GEMMs (one launch per matrix for all experts of a layer, not one per expert), with int4
// group-quantized and FP8 block-quantized weights dequantized inside the GEMM (never the
// whole matrix).
// The CPU twin is cpu::moe_router_forward plus CpuDeepseekModel's per-expert MLP; the
// contract is the same: out[n] = sum over the token's experts e, in expert-id order, of
// w[n, e] * expert_e(xn[n]) (shared experts are a dense MLP added by the caller).
//
// Status: the GEMMs run on tensor cores (mma.sync bf16 -> fp32, tiles of 64 routed rows x
// 128 outputs; int4 as exact integers and FP8 as exact bf16, with the group / block scales
// applied in fp32, see moe.cu);
// expert parallelism across GPUs is next.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "backend/cuda/ops.h"
#include "model/moe_routing.h"

namespace talon::cuda {

struct MoeRouting {
  int n_experts = 0, top_k = 0;
  MoeScoring scoring = MoeScoring::Softmax;
  MoeTopk method = MoeTopk::Greedy;
  int n_group = 1, topk_group = 1;
  bool norm_topk = false;
  float routed_scale = 1.f;
};

// The stacked weights of one matrix kind (gate, up or down) for all E experts, logical shape
// [E, O, I], in one of three forms (exactly one of w, packed, fp8 is set):
//  * bf16 `w` [E, O, I];
//  * int4 `packed` int32 [E, O, ceil(I/8)] (element 8j+k of a row in bits 4k..4k+3, stored as
//    q + 8) with bf16 `scale` [E, O, ceil(I/group)]: w = q * scale[e, o, i / group];
//  * FP8 block (DeepSeek-V3): `fp8` e4m3 bytes [E, O, I] as stored in the checkpoint, with fp32
//    `block_scale` [E, ceil(O/bo), ceil(I/bi)] (the checkpoint's weight_scale_inv) for blocks of
//    bo rows x bi columns: w = e4m3(fp8[e, o, i]) * block_scale[e, o / bo, i / bi].
// int4 and FP8 are dequantized inside the GEMM (never the whole matrix).
struct ExpertMatrix {
  const bf16* w = nullptr;
  const int32_t* packed = nullptr;
  const bf16* scale = nullptr;
  int64_t O = 0, I = 0, group = 0;
  const uint8_t* fp8 = nullptr;
  const float* block_scale = nullptr;
  int64_t bo = 0, bi = 0;  // FP8 block rows, block columns
};

struct MoeExperts {
  ExpertMatrix gate, up, down;  // [E, Im, H], [E, Im, H], [E, H, Im]
};

// Device scratch of moe_forward for up to n_tokens tokens (allocated by the caller's arena).
struct MoeScratch {
  int32_t *idx, *order, *pos, *offsets, *tiles, *n_tiles;
  float *weights, *g, *u, *y;
  bf16* act;
  int64_t capacity = 0;  // tokens
};
// Sizes (in elements) of each scratch buffer for n tokens: see moe_scratch_elems.
struct MoeScratchSizes {
  int64_t idx, order, pos, offsets, tiles, weights, g, y, act;
};
MoeScratchSizes moe_scratch_elems(int64_t n_tokens, const MoeRouting& r, int64_t H, int64_t Im);

// idx[N, K] (ascending expert ids per token) and weights[N, K] from router logits [N, E]
// (fp32) and the noaux_tc correction bias [E] (or null), as cpu::moe_router_forward.
void moe_route(int32_t* idx, float* weights, const float* logits, const float* bias, int64_t N, const MoeRouting& r,
               cudaStream_t s);

// out[N, H] (fp32) = the routed experts' weighted sum for xn[N, H] (bf16) and router logits
// [N, E] (fp32). Overwrites out.
void moe_forward(float* out, const bf16* xn, const float* router_logits, const float* bias, int64_t N, int64_t H,
                 const MoeRouting& r, const MoeExperts& ex, const MoeScratch& sc, cudaStream_t s);

// Calls with at most this many routed slots (tokens x top-k) run their bf16 and int4 expert
// GEMMs on a decode-sized kernel (a few rows an expert: bytes decide, moe.cu) instead of the
// tensor-core tiles; FP8 always takes the tiles. Default 256, TALON_CUDA_MOE_SKINNY=n in the
// environment, or this call (tests; 0: never).
void moe_skinny_max_slots(int64_t slots);
// Calls with at most this many routed slots run int4 experts (group 32, I % 128 == 0) on the
// tensor-core decode kernel (weights as the mma's M operand, moe.cu), ahead of the kernel
// above, except one token (max_rows 1) beyond the reduction-split bound below, which the kernel
// above serves. Default: no bound (it beats the int4 tiles at every size measured, 1-16,384
// tokens of a Kimi-K2 layer), TALON_CUDA_MOE_INT4_MMA=n in the environment, or this call (tests;
// 0: never, the tiles; negative: the default again).
void moe_int4_mma_max_slots(int64_t slots);
// m16 tiles of weight rows a warp of that kernel: 1 or 2 (two share each activation load);
// default by size (2 past 8 token rows a pass), TALON_CUDA_MOE_INT4_TILES=1|2 in the
// environment, or this call (tests; other values: the default again).
void moe_int4_mma_tiles(int tiles);
// With int4 gate and up projections on that kernel: both products and the SwiGLU in one pass
// (each warp holds 16 rows of each; the activations are read once; no fp32 gate and up rows).
// Default on, TALON_CUDA_MOE_INT4_SWIGLU=0|1 in the environment, or this call (tests; 0 / 1;
// negative: the default again).
void moe_int4_mma_swiglu(int on);
// Calls of at most this many routed slots, with at most 8 rows an expert, split that kernel's
// reduction over each block's four warps (16 weight rows a block: four times the warps in flight
// when there are few tiles, e.g. one token). Default 16 (1-2 tokens at top-8; 0: never),
// TALON_CUDA_MOE_INT4_KSPLIT=n, or this call (tests; negative: the default again).
void moe_int4_mma_ksplit(int64_t slots);
// Whether that kernel stages each pass's activation rows once a block in shared memory, in the
// weights' cp.async stages (1, the default), or lets each warp load them from L1 / L2 inside its
// loop (0). TALON_CUDA_MOE_INT4_STAGED=0|1 in the environment, or this call (tests; negative:
// the default again). The reduction split never stages. TALON_CUDA_MOE_INT4_STAGES=3|4 fixes
// the staged kernel's cp.async stages (default 3 at 32 token rows a pass, 4 below).
void moe_int4_mma_staged(int on);
// Whether a tile whose rows take several passes of that kernel gets a block a pass (neighbours
// in launch order, so they share the weight reads through L2) or one block taking them in turn:
// 0 one block; 1 (the default) a block a pass at 32 token rows a pass; 2 at every pass size.
// TALON_CUDA_MOE_INT4_SPLIT=0|1|2, or this call (tests; other values: the default again).
void moe_int4_mma_split(int mode);

// Calls with at least this many routed slots run int4 experts (group 32) and FP8 experts (K
// blocks a multiple of 128, DeepSeek-V3's 128 x 128) whose I is a multiple of 128, and bf16
// experts whose I is a multiple of 64, on the
// warpgroup (wgmma) kernel of moe.cu: a block of one sort tile (64 rows of an expert) x 128
// weight rows, the weights converted into the wgmma's register operand, ahead of every kernel
// above (with the SwiGLU setting above on, gate and up in one pass). Default, by measurement on
// an H100: FP8 (K blocks of 128) always, int4 from 12,288 routed slots, bf16 never;
// TALON_CUDA_MOE_WGMMA=n in the environment, or this call, sets one threshold for every format
// (tests; 0: every call; a huge n: never; negative: the defaults again).
void moe_wgmma_min_slots(int64_t slots);
// That kernel's grid order: groups of this many consecutive sort tiles take each block of weight
// rows side by side (one expert's tiles are consecutive, so its weight slab is read from DRAM
// once and from L2 by the others) while the group's activation rows stay in L2 across the
// weight blocks. Default 16; 1 is tile-major, a large n weight-block-major.
// TALON_CUDA_MOE_WGMMA_GROUP=n, or this call (tests; < 1: the default again).
void moe_wgmma_group(int64_t tiles);

// The grids of the tile kernel (bf16, int4 and FP8 experts past the decode sizes) and of the int4
// tensor-core decode kernel: 0 (the default) the plain order, every tile taking a block of
// weight rows before any tile takes the next (past L2's size, each weight block then reads
// every tile's activation rows from DRAM again); n > 0 groups of n consecutive tiles take each
// weight block side by side, so that a group's activation rows stay in L2 across the weight
// blocks. TALON_CUDA_MOE_GRID_GROUP=n, or this call (tests; negative: the default again).
void moe_grid_group(int64_t tiles);
// How those kernels (and the wgmma kernel) lay a grid of gx tiles x
// gy weight blocks out in launch order, for tests: moe_grid_launch gives the blocks launched and
// the group in effect (0: the plain two-dimensional launch); moe_grid_block(b, ...) the (tile,
// weight block) that block b in launch order computes (tile >= gx: an idle block that exits).
// For tests: the shared-memory descriptor the wgmma kernel builds for a K-major operand at
// shared address addr (k halves 128 bytes apart, groups of 8 rows sbo_bytes apart), and the
// sbo its stages use for weights of form 0 (bf16), 1 (int4) or 2 (FP8).
uint64_t moe_wgmma_k_major_desc(uint32_t addr, int sbo_bytes);
int moe_wgmma_stage_sbo(int form);
// For tests: the fragment layouts the wgmma kernel assumes (tensor_core.cuh: wgmma_a_coord, the
// (row, k) of A value v of warpgroup thread tid; wgmma_d_coord, the (row, column) of accumulator
// value i, which its epilogue stores by).
std::pair<int, int> moe_wgmma_a_coord(int tid, int v);
// For tests (a GPU): one warpgroup's wgmma m64n64k16 built from the pieces the expert kernel
// uses (its descriptors, fragment layouts and core-matrix staging), alone: d [64][64] fp32 =
// a [64][16] x b^T, a and b row-major bf16 bits [64][16], A from registers or (a_in_smem) from
// shared memory. A wrong expert-kernel result with a right probe points at the kernel's plumbing.
std::vector<float> moe_wgmma_probe(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, bool a_in_smem);
std::pair<int, int> moe_wgmma_d_coord(int tid, int i);
struct MoeGridLaunch {
  int64_t blocks, group;
};
MoeGridLaunch moe_grid_launch(int64_t gx, int64_t gy, int64_t group);
std::pair<int64_t, int64_t> moe_grid_block(int64_t b, int64_t gx, int64_t gy, int64_t group);

// ---- Expert parallelism: one rank's pieces of moe_forward (cuda_deepseek.cpp moves the rows
// between ranks). Routing is global; experts are split in equal contiguous windows, rank d
// owning ids [d * per_rank, (d + 1) * per_rank), so after sorting slots by expert id the
// rows bound for each rank are one contiguous run of sorted positions.

// moe_forward's first half: sc.idx, sc.weights, and the slots sorted by expert (sc.order,
// sc.pos, sc.offsets [E + 1]).
void moe_route_sort(const float* router_logits, const float* bias, int64_t N, const MoeRouting& r,
                    const MoeScratch& sc, cudaStream_t s);
// For sorted positions p < NK: rows[p] = xn[order[p] / K] (bf16 [NK, H]) and ids[p] = the
// expert id of the slot minus the first id of its owner's window.
void moe_gather_sorted(bf16* rows, int32_t* ids, const bf16* xn, int64_t H, int K, int64_t NK, int per_rank,
                       const MoeScratch& sc, cudaStream_t s);
// y[R, H] (fp32, row order) = the SwiGLU MLP of expert ids[i] (local ids in [0, E_local))
// applied to rows[i]. `sc` is scratch for R rows of a top-1 routing over E_local experts
// (moe_scratch_elems(R, {E_local, 1}, ...)); ex holds the E_local experts.
void moe_experts_forward(float* y, const bf16* rows, const int32_t* ids, int64_t R, int64_t H, int E_local,
                         const MoeExperts& ex, const MoeScratch& sc, cudaStream_t s);
// moe_forward's last step: out[n] = sum over slots t of weights[n, t] * y[pos[n K + t]], y in
// sorted order [NK, H] fp32.
void moe_combine(float* out, const float* y, int64_t N, int64_t H, int K, const MoeScratch& sc, cudaStream_t s);

}  // namespace talon::cuda
