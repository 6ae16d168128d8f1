// Mixture-of-experts kernels (moe.h).
//
// The expert GEMMs run on tensor cores (tc_grouped_gemm_kernel). One block computes one
// tile of the sort (an expert e and up to kTileRows = 64 consecutive sorted rows of it) times
// kTcCols = 128 outputs, with 8 warps; warp w owns all 64 rows x outputs [16w, 16w + 16) as
// 4 x 2 m16n8 fp32 accumulator fragments, and skips the m-fragments wholly past the tile's
// last row (a tile of one row costs one). The reduction runs in chunks of kTcK = 64 through
// a pipeline of cp.async shared-memory stages (3 for bf16 weights, 4 for int4): A, the
// tile's activation rows (gathered by token; rows past the tile or the expert and k past I
// are zero), and B, the expert's weight rows for the block's outputs. Products are mma.sync
// m16n8k16 bf16 x bf16 -> fp32; A and bf16 B fragments are read with ldmatrix. int4 B is
// copied packed, and each lane unpacks its fragment's nibbles to the integers q in [-8, 7],
// exact in bf16; the products of one quantization group accumulate in a separate fp32
// fragment that is added, times the fp32 scale of each output, to the accumulators when the
// group ends, so q * scale is never rounded to bf16. FP8 block-quantized B is copied as its
// e4m3 bytes, and each lane converts its fragment's bytes to bf16 (exact: e4m3 has 4
// significant bits and a range inside bf16's); the K blocks (bi columns) are the groups, the
// scale of output o being that of o's row block (o / bo). Both need the group / K block to be
// a multiple of 16; other sizes take the CUDA-core kernel (core_grouped_gemm_kernel, fp32 FMA
// on tiles dequantized in fp32).
//
// int4 experts of group 32 (I % 128 == 0) take, at every size, the tensor-core decode kernel
// (int4_decode_mma_kernel: weights as the mma's M operand, tokens as its n columns, a cp.async
// ring of weights per warp and of activation rows per block), which the H100 measured ahead of
// the tiles from 1 to 16,384 tokens of a Kimi-K2 layer. Other decode-sized calls (a few rows an
// expert, where the weight bytes decide): bf16 and other int4 experts take the CUDA-core
// decode-sized kernel (skinny_grouped_kernel). FP8 128-block experts at every size, and int4
// group-32 ones from 12,288 routed slots, take Hopper's warpgroup MMA (wgmma_grouped_kernel;
// TALON_CUDA_MOE_WGMMA=n moves that bound, kWgmmaDefaultMinSlots* below). grouped_gemm chooses.
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cfloat>
#include <climits>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/kernels/swiglu.cuh"
#include "backend/cuda/moe.h"
#include "backend/cuda/moe_cutlass.h"
#include "backend/cuda/tensor_core.cuh"
#include "backend/cuda/warp.cuh"

namespace talon::cuda {

namespace {

constexpr int kTileRows = 64;  // routed rows per GEMM tile (the sort's tile list; both GEMM kernels)
constexpr int kMaxExperts = 4096;
constexpr int64_t kSkinnyDefaultSlots = 256;  // moe.h: moe_skinny_max_slots
constexpr int64_t kInt4MmaDefaultSlots = int64_t(1) << 40;  // moe.h: moe_int4_mma_max_slots (no bound)
// moe.h: moe_wgmma_min_slots. Defaults per weight format, measured on one H100 (bench/RESULTS.md,
// 2026-12-06; one Kimi-K2 layer, top-8): FP8 128 x 128 blocks beat the tile kernels at every
// size from 1 token (0.22 vs 0.53 ms) to 16,384 (62.6 vs 96.0 ms); int4 group 32 from 1,536
// tokens (8.36 vs 8.64 ms; at 1,024 7.76 vs 6.53, so 12,288 routed slots); bf16 never (the
// tiles and CUTLASS beat it everywhere).
constexpr int64_t kWgmmaNever = int64_t(1) << 62;
constexpr int64_t kWgmmaDefaultMinSlotsFp8 = 1;
constexpr int64_t kWgmmaDefaultMinSlotsInt4 = 12288;
constexpr int64_t kWgmmaDefaultGroup = 16;  // moe.h: moe_wgmma_group (29.95 vs 30.71 ms for 4 at 8,192)
constexpr int64_t kInt4KSplitDefaultSlots = 16;  // moe.h: moe_int4_mma_ksplit

// Tensor-core GEMM.
constexpr int kTcCols = 128;             // outputs per block
constexpr int kTcK = 64;                 // reduction chunk (one pipeline stage)
constexpr int kTcThreads = 256;          // 8 warps, 16 outputs each
constexpr int kSteps = kTcK / 16;        // mma k-steps per chunk
constexpr int kTcLd = kTcK + 8;          // bf16 smem row: 144 bytes, so ldmatrix's 8 rows hit distinct banks
constexpr int kQLd = kTcK / 8 + 4;       // int4 smem row in words: 8 packed + 4 padding (48 bytes, conflict-free)
constexpr int kF8Ld = kTcK + 16;         // fp8 smem row in bytes: 64 + 16 padding (80: 8 rows on distinct banks)
constexpr int kFragRows = kTileRows / 16;  // m16 fragments per warp

// The weight storage a GEMM kernel is instantiated for (ExpertMatrix's three forms).
constexpr int kWBf16 = 0, kWInt4 = 1, kWFp8 = 2;

// The grids of the tile kernels: block (x, y) of gx x gy, launched in one dimension as groups of
// `group` consecutive x (tiles of the sort, or a tile's split blocks) that take y (blocks of
// weight rows) = 0, 1, ... side by side. group >= gx is the plain two-dimensional order (x
// fastest: each weight block sweeps every tile, so past L2's size every tile's activation rows
// come from DRAM again for each weight block); a small group keeps its activation rows in L2
// across the weight blocks and still lets one expert's consecutive tiles share a weight slab.
struct GroupedGrid {
  int gy = 1, group = 0;  // group 0: the plain two-dimensional launch
  // Block b of a one-dimensional launch in groups (group >= 1) as (x, y).
  __host__ __device__ static int2 of(int b, int gy, int group) {
    const int in_group = b % (group * gy);
    return make_int2(b / (group * gy) * group + in_group % group, in_group / group);
  }
  __device__ __forceinline__ int2 block() const {
    if (group == 0) return make_int2(int(blockIdx.x), int(blockIdx.y));
    return of(int(blockIdx.x), gy, group);
  }
};
// The launch of gx x gy blocks in groups of `group_x` x entries (0 or >= gx: the plain order).
struct GridLaunch {
  GroupedGrid g;
  dim3 blocks;
};
GridLaunch grouped_grid(int64_t gx, int64_t gy, int64_t group_x) {
  if (group_x <= 0 || group_x >= gx) return {{int(gy), 0}, dim3(unsigned(gx), unsigned(gy))};
  return {{int(gy), int(group_x)}, dim3(unsigned((gx + group_x - 1) / group_x * group_x * gy))};
}

// One pipeline stage in dynamic shared memory, in bytes: A [kTileRows][kTcLd] bf16, then B
// ([kTcCols][kTcLd] bf16; or [kTcCols][kQLd] packed int4 words, or [kTcCols][kF8Ld] e4m3
// bytes, each followed by the fp32 scales [kSteps][kTcCols] of each (k-step, output)).
template <int WF>
struct TcStage {
  static constexpr bool scaled = WF != kWBf16;
  static constexpr int a = kTileRows * kTcLd * 2;
  static constexpr int b = WF == kWInt4 ? kTcCols * kQLd * 4 : WF == kWFp8 ? kTcCols * kF8Ld : kTcCols * kTcLd * 2;
  static constexpr int scales = scaled ? kSteps * kTcCols * 4 : 0;
  static constexpr int bytes = a + b + scales;
  static constexpr int count = scaled ? 4 : 3;  // stages in the pipeline
  static constexpr size_t smem = size_t(bytes) * count;
  static_assert(a % 16 == 0 && b % 16 == 0 && bytes % 16 == 0, "16-byte aligned stage parts");
};

// CUDA-core GEMM (int4 groups / FP8 K blocks that are not a multiple of 16).
constexpr int kCoreCols = 64;  // outputs per block
constexpr int kCoreK = 32;     // reduction chunk

__device__ bool better(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }

// (value, index) argmax over a warp; ties to the lower index.
__device__ void warp_argmax(float& v, int& i) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (better(ov, oi, v, i)) v = ov, i = oi;
  }
}

// One warp per token. Shared: score[E], choice[E], taken[E].
__global__ void route_kernel(int32_t* idx, float* weights, const float* logits, const float* bias, int E, int K,
                             bool sigmoid, int method, int n_group, int topk_group, bool norm, float scale) {
  extern __shared__ float sh[];
  float* score = sh;
  float* choice = sh + E;
  int* taken = reinterpret_cast<int*>(sh + 2 * E);
  const int n = blockIdx.x, lane = threadIdx.x;
  const float* lg = logits + size_t(n) * E;
  if (sigmoid) {
    for (int e = lane; e < E; e += 32) score[e] = 1.0f / (1.0f + expf(-lg[e]));
  } else {
    float m = -INFINITY;
    for (int e = lane; e < E; e += 32) m = fmaxf(m, lg[e]);
    m = warp_max(m);
    double z = 0;
    for (int e = lane; e < E; e += 32) z += exp(double(lg[e]) - m);
    for (int o = 16; o > 0; o >>= 1) z += __shfl_xor_sync(0xffffffffu, z, o);
    for (int e = lane; e < E; e += 32) score[e] = float(exp(double(lg[e]) - m) / z);
  }
  for (int e = lane; e < E; e += 32) {
    choice[e] = score[e] + (bias ? bias[e] : 0.0f);
    taken[e] = 0;
  }
  __syncwarp();
  // Groups allowed (bit g of `allowed`); all of them for plain greedy.
  uint32_t allowed = 0xffffffffu;
  const int per_group = E / n_group;
  // Keeping topk_group of n_group groups keeps them all when topk_group >= n_group (Kimi-K2:
  // one group); the group scores, one lane scanning a whole group, are then not needed.
  if (method != 0 && topk_group < n_group) {
    float gs = -INFINITY;
    if (lane < n_group) {
      const float* c = choice + lane * per_group;
      if (method == 1) {
        gs = c[0];
        for (int i = 1; i < per_group; ++i) gs = fmaxf(gs, c[i]);
      } else {  // the sum of the two best, first-index ties as cpu top_k
        int b0 = 0;
        for (int i = 1; i < per_group; ++i)
          if (c[i] > c[b0]) b0 = i;
        int b1 = -1;
        for (int i = 0; i < per_group; ++i)
          if (i != b0 && (b1 < 0 || c[i] > c[b1])) b1 = i;
        gs = c[b0] + c[b1];
      }
    }
    allowed = 0;
    for (int t = 0; t < topk_group; ++t) {
      float v = (lane < n_group && !((allowed >> lane) & 1u)) ? gs : -INFINITY;
      int i = (lane < n_group && !((allowed >> lane) & 1u)) ? lane : INT_MAX;
      warp_argmax(v, i);
      if (i < n_group) allowed |= 1u << i;
    }
  }
  // Top-K experts among the allowed groups.
  int sel[16];
  for (int t = 0; t < K; ++t) {
    float v = -INFINITY;
    int i = INT_MAX;
    for (int e = lane; e < E; e += 32)
      if (!taken[e] && ((allowed >> (e / per_group)) & 1u) && better(choice[e], e, v, i)) v = choice[e], i = e;
    warp_argmax(v, i);
    sel[t] = i;
    if (lane == 0 && i < E) taken[i] = 1;
    __syncwarp();
  }
  if (lane == 0) {
    for (int a = 1; a < K; ++a)  // ascending expert ids
      for (int b = a; b > 0 && sel[b] < sel[b - 1]; --b) {
        const int t = sel[b];
        sel[b] = sel[b - 1];
        sel[b - 1] = t;
      }
    float sum = 0;
    for (int t = 0; t < K; ++t) sum += score[sel[t]];
    const float den = norm ? sum + 1e-20f : 1.0f;
    for (int t = 0; t < K; ++t) {
      idx[size_t(n) * K + t] = sel[t];
      weights[size_t(n) * K + t] = score[sel[t]] / den * scale;
    }
  }
}

// Groups the N*K (token, slot) rows by expert: order[p] = row at sorted position p, pos its
// inverse, offsets[E+1], and the GEMM tile list (expert, first sorted row) of kTileRows rows.
__global__ void sort_kernel(int32_t* order, int32_t* pos, int32_t* offsets, int32_t* tiles, int32_t* n_tiles,
                            const int32_t* idx, int NK, int E) {
  __shared__ int cnt[kMaxExperts];
  for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < NK; i += blockDim.x) atomicAdd(&cnt[idx[i]], 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    int off = 0, t = 0;
    for (int e = 0; e < E; ++e) {
      const int c = cnt[e];
      offsets[e] = off;
      for (int r = 0; r < c; r += kTileRows) tiles[2 * t] = e, tiles[2 * t + 1] = off + r, ++t;
      cnt[e] = off;  // becomes the expert's next free position
      off += c;
    }
    offsets[E] = off;
    *n_tiles = t;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < NK; i += blockDim.x) {
    const int p = atomicAdd(&cnt[idx[i]], 1);
    order[p] = i;
    pos[i] = p;
  }
}

// ---- Tensor-core grouped GEMM (see the top of the file) ----

// cp_async16 / cp_async_commit / cp_async_wait: tensor_core.cuh.

// The two int4 values in the low byte of x (stored q + 8; the low nibble is the lower k) as
// a bf16 pair (q0, q1), exact: the nibble n is put in the mantissa of 128.0 (bf16 0x4300,
// whose last mantissa step is 1), giving 128 + n, and 136 is subtracted.
__device__ __forceinline__ uint32_t int4x2_to_bf16x2(uint32_t x) {
  const uint32_t v = (x & 0xfu) | ((x & 0xf0u) << 12) | 0x43004300u;
  const __nv_bfloat162 r = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&v), __floats2bfloat162_rn(136.f, 136.f));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// The two e4m3 values in the low 16 bits of x (the low byte is the lower k) as a bf16 pair,
// exact: every e4m3 value, subnormals (m 2^-9) included, is a normal fp16 (cvt.f16x2.e4m3x2),
// and fp16 -> fp32 -> bf16 is then exact too (4 significant bits, |v| <= 448); the NaN codes
// 0x7f / 0xff stay NaN, as the CPU's f8e4m3_to_f32.
__device__ __forceinline__ uint32_t fp8x2_to_bf16x2(uint32_t x) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(x & 0xffffu), __NV_E4M3);
  const float2 f = __half22float2(__half2(h));
  const __nv_bfloat162 r = __floats2bfloat162_rn(f.x, f.y);
  return *reinterpret_cast<const uint32_t*>(&r);
}

// One e4m3 value as fp32 (exact).
__device__ __forceinline__ float fp8_to_f32(uint8_t x) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(x), __NV_E4M3)));
}

// out[p, O] (fp32, sorted rows) = in[row(p)] @ W_e^T for the tile's expert e. GATHER: the
// input row of sorted position p is token order[p] / K of `in`; else row p itself.
// vec_a / vec_b: the rows of A / B are 16-byte aligned and I (for int4: the packed words per
// row; for fp8: the bytes) a multiple of 8 (4; 16), so the tiles load as 16-byte cp.async;
// else element by element. WF: the weights' form (kWBf16, kWInt4, kWFp8).
template <int WF, bool GATHER>
__global__ void __launch_bounds__(kTcThreads, 2)
    tc_grouped_gemm_kernel(float* out, const bf16* in, int64_t ld_in, const int32_t* order, int K,
                           const int32_t* tiles, const int32_t* n_tiles, const int32_t* offsets, ExpertMatrix m,
                           bool vec_a, bool vec_b, GroupedGrid grid) {
  using St = TcStage<WF>;
  constexpr bool INT4 = WF == kWInt4, FP8 = WF == kWFp8, SCALED = St::scaled;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int src[kTileRows];  // input row of each tile row, -1 past the tile's rows
  const int2 bxy = grid.block();
  if (bxy.x >= *n_tiles) return;
  const int e = tiles[2 * bxy.x], r0 = tiles[2 * bxy.x + 1];
  const int rows = min(kTileRows, offsets[e + 1] - r0);
  const int O = int(m.O), I = int(m.I), col0 = bxy.y * kTcCols;
  const int tid = threadIdx.x, lane = tid % 32, wn = (tid / 32) * 16, g = lane / 4, t = lane % 4;
  if (tid < kTileRows) src[tid] = tid < rows ? (GATHER ? order[r0 + tid] / K : r0 + tid) : -1;
  // gsize: the k extent of one scale (int4 group, fp8 K block); groups: scale columns.
  const int gsize = int(INT4 ? m.group : FP8 ? m.bi : 0), n_chunks = (I + kTcK - 1) / kTcK;
  const int64_t words = (I + 7) / 8, groups = SCALED ? (I + gsize - 1) / gsize : 0, wrow0 = int64_t(e) * O;
  const int bo = int(m.bo);                                                    // fp8 block rows
  const int64_t srow0 = FP8 ? int64_t(e) * ((O + bo - 1) / bo) : 0;           // fp8: the expert's first scale row
  const bf16 zero = __ushort_as_bfloat16(0);
  __syncthreads();

  // Issues the copies of chunk c (k in [c kTcK, (c + 1) kTcK)) into stage st.
  auto load_chunk = [&](int c, int st) {
    unsigned char* base = smem + st * St::bytes;
    const int k0 = c * kTcK;
    bf16* sa = reinterpret_cast<bf16*>(base);
    for (int i = tid; i < kTileRows * (kTcK / 8); i += kTcThreads) {
      const int r = i / (kTcK / 8), kc = (i % (kTcK / 8)) * 8, k = k0 + kc, row = src[r];
      bf16* dst = sa + r * kTcLd + kc;
      const bf16* s = in + (row >= 0 ? int64_t(row) * ld_in + k : 0);
      if (vec_a) {
        cp_async16(dst, s, row >= 0 && k < I);
      } else {
        for (int u = 0; u < 8; ++u) dst[u] = row >= 0 && k + u < I ? s[u] : zero;
      }
    }
    if constexpr (WF == kWBf16) {
      bf16* sb = reinterpret_cast<bf16*>(base + St::a);
      for (int i = tid; i < kTcCols * (kTcK / 8); i += kTcThreads) {
        const int n = i / (kTcK / 8), kc = (i % (kTcK / 8)) * 8, k = k0 + kc, o = col0 + n;
        bf16* dst = sb + n * kTcLd + kc;
        const bf16* s = m.w + (o < O ? (wrow0 + o) * I + k : 0);
        if (vec_b) {
          cp_async16(dst, s, o < O && k < I);
        } else {
          for (int u = 0; u < 8; ++u) dst[u] = o < O && k + u < I ? s[u] : zero;
        }
      }
    } else if constexpr (INT4) {
      // Packed words k0 / 8 .. k0 / 8 + 7 of each output row, as two 16-byte pieces. Words past
      // the row read as 0 (q = -8): harmless, as A is zero at those k.
      uint32_t* sq = reinterpret_cast<uint32_t*>(base + St::a);
      for (int i = tid; i < kTcCols * 2; i += kTcThreads) {
        const int n = i / 2, o = col0 + n;
        const int64_t j = k0 / 8 + (i % 2) * 4;
        uint32_t* dst = sq + n * kQLd + (i % 2) * 4;
        const int32_t* s = m.packed + (o < O ? (wrow0 + o) * words + j : 0);
        if (vec_b) {
          cp_async16(dst, s, o < O && j < words);
        } else {
          for (int u = 0; u < 4; ++u) dst[u] = o < O && j + u < words ? uint32_t(s[u]) : 0u;
        }
      }
    } else {
      // The chunk's 64 e4m3 bytes of each output row, as four 16-byte pieces; bytes past the
      // row (or the outputs) are 0 (+0.0: A is zero at those k, and 0 * NaN must not occur).
      unsigned char* sb = base + St::a;
      for (int i = tid; i < kTcCols * (kTcK / 16); i += kTcThreads) {
        const int n = i / (kTcK / 16), kc = (i % (kTcK / 16)) * 16, k = k0 + kc, o = col0 + n;
        unsigned char* dst = sb + n * kF8Ld + kc;
        const uint8_t* s = m.fp8 + (o < O ? (wrow0 + o) * I + k : 0);
        if (vec_b) {
          cp_async16(dst, s, o < O && k < I);
        } else {
          for (int u = 0; u < 16; ++u) dst[u] = o < O && k + u < I ? s[u] : uint8_t(0);
        }
      }
    }
  };
  // int4 / fp8: the scales of chunk c's (k-step, output) pairs, kSteps * kTcCols of them, two
  // per thread: read into registers one iteration before they are stored to the stage, so the
  // global loads' latency hides behind a chunk's products.
  constexpr int kScalesPerThread = kSteps * kTcCols / kTcThreads;
  float scale_reg[kScalesPerThread];
  auto load_scales = [&](int c) {
#pragma unroll
    for (int u = 0; u < kScalesPerThread; ++u) {
      const int i = tid + u * kTcThreads, o = col0 + i % kTcCols, k = c * kTcK + (i / kTcCols) * 16;
      if constexpr (INT4)
        scale_reg[u] = o < O && k < I ? __bfloat162float(m.scale[(wrow0 + o) * groups + k / gsize]) : 0.f;
      else if constexpr (FP8)
        scale_reg[u] = o < O && k < I ? m.block_scale[(srow0 + o / bo) * groups + k / gsize] : 0.f;
    }
  };
  auto store_scales = [&](int st) {
    float* ss = reinterpret_cast<float*>(smem + st * St::bytes + St::a + St::b);
#pragma unroll
    for (int u = 0; u < kScalesPerThread; ++u) ss[tid + u * kTcThreads] = scale_reg[u];
  };

  float acc[kFragRows][2][4] = {};
  float part[kFragRows][2][4] = {};  // int4 / fp8: the current group's products, unscaled
  const int n_frag = (rows + 15) / 16;  // m-fragments holding rows
  const int g16 = gsize / 16;           // int4 / fp8: k-steps per group
  int gstep = 0;                        // int4 / fp8: k-steps of the current group done

  for (int c = 0; c < St::count - 1; ++c) {
    if (c < n_chunks) {
      load_chunk(c, c);
      if constexpr (SCALED) load_scales(c), store_scales(c);
    }
    cp_async_commit();
  }
  for (int c = 0; c < n_chunks; ++c) {
    cp_async_wait<St::count - 2>();  // chunk c has landed (this thread's copies) ...
    __syncthreads();                 // ... everyone's, and everyone is done with chunk c - 1
    const int cn = c + St::count - 1;  // refill the stage of chunk c - 1
    if (cn < n_chunks) {
      load_chunk(cn, cn % St::count);
      if constexpr (SCALED) load_scales(cn);
    }
    cp_async_commit();

    const unsigned char* base = smem + (c % St::count) * St::bytes;
    const bf16* sa = reinterpret_cast<const bf16*>(base);
    uint32_t q[2][kTcK / 8];  // int4: this lane's packed words of output wn + 8j + g
    if constexpr (INT4) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint4* p = reinterpret_cast<const uint4*>(base + St::a) + (wn + 8 * j + g) * (kQLd / 4);
        const uint4 lo = p[0], hi = p[1];
        q[j][0] = lo.x, q[j][1] = lo.y, q[j][2] = lo.z, q[j][3] = lo.w;
        q[j][4] = hi.x, q[j][5] = hi.y, q[j][6] = hi.z, q[j][7] = hi.w;
      }
    }
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      const int k = c * kTcK + s * 16;
      if (k >= I) break;
      // B fragments of the warp's two 8-output slices: b[j][0] holds k 2t, 2t + 1 and b[j][1]
      // k 2t + 8, 2t + 9 of output wn + 8j + g.
      uint32_t b[2][2];
      if constexpr (INT4) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          b[j][0] = int4x2_to_bf16x2(q[j][2 * s] >> (8 * t));      // word 2s: k 16s .. 16s + 7
          b[j][1] = int4x2_to_bf16x2(q[j][2 * s + 1] >> (8 * t));  // word 2s + 1: k 16s + 8 ..
        }
      } else if constexpr (FP8) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint16_t* p =
              reinterpret_cast<const uint16_t*>(base + St::a + (wn + 8 * j + g) * kF8Ld + s * 16 + 2 * t);
          b[j][0] = fp8x2_to_bf16x2(p[0]);  // bytes 16s + 2t, + 1
          b[j][1] = fp8x2_to_bf16x2(p[4]);  // bytes 16s + 2t + 8, + 9
        }
      } else {
        const bf16* sb = reinterpret_cast<const bf16*>(base + St::a);
        ldmatrix_x4(b[0][0], b[0][1], b[1][0], b[1][1],
                    sb + (wn + lane % 8 + 8 * (lane / 16)) * kTcLd + s * 16 + 8 * ((lane / 8) % 2));
      }
#pragma unroll
      for (int f = 0; f < kFragRows; ++f) {
        if (f >= n_frag) break;
        uint32_t a[4];
        ldmatrix_x4(a[0], a[1], a[2], a[3], sa + (f * 16 + lane % 16) * kTcLd + s * 16 + 8 * (lane / 16));
#pragma unroll
        for (int j = 0; j < 2; ++j) mma_bf16(SCALED ? part[f][j] : acc[f][j], a, b[j][0], b[j][1]);
      }
      if constexpr (SCALED) {
        if (++gstep == g16 || k + 16 >= I) {  // the group ends: acc += scale[o] * part
          gstep = 0;
          const float* ss = reinterpret_cast<const float*>(base + St::a + St::b) + s * kTcCols;
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const float2 w = *reinterpret_cast<const float2*>(ss + wn + 8 * j + 2 * t);  // outputs 2t, 2t + 1
#pragma unroll
            for (int f = 0; f < kFragRows; ++f) {
              acc[f][j][0] = fmaf(w.x, part[f][j][0], acc[f][j][0]);
              acc[f][j][1] = fmaf(w.y, part[f][j][1], acc[f][j][1]);
              acc[f][j][2] = fmaf(w.x, part[f][j][2], acc[f][j][2]);
              acc[f][j][3] = fmaf(w.y, part[f][j][3], acc[f][j][3]);
              part[f][j][0] = part[f][j][1] = part[f][j][2] = part[f][j][3] = 0.f;
            }
          }
        }
      }
    }
    if constexpr (SCALED) {
      if (cn < n_chunks) store_scales(cn % St::count);  // its stage is idle until chunk cn
    }
  }

  // Accumulator fragment (f, j): rows f 16 + g (regs 0, 1) and + 8 (regs 2, 3), outputs
  // wn + 8j + 2t, + 1.
  const bool pairs = O % 2 == 0 && (reinterpret_cast<uintptr_t>(out) & 7) == 0;
#pragma unroll
  for (int f = 0; f < kFragRows; ++f) {
    if (f >= n_frag) break;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int o = col0 + wn + 8 * j + 2 * t;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = f * 16 + g + 8 * h;
        if (r >= rows || o >= O) continue;
        float* dst = out + int64_t(r0 + r) * O + o;
        if (pairs) {
          *reinterpret_cast<float2*>(dst) = make_float2(acc[f][j][2 * h], acc[f][j][2 * h + 1]);
        } else {
          dst[0] = acc[f][j][2 * h];
          if (o + 1 < O) dst[1] = acc[f][j][2 * h + 1];
        }
      }
    }
  }
}

// ---- CUDA-core grouped GEMM: int4 groups / fp8 K blocks the tensor-core kernel does not take ----

// As tc_grouped_gemm_kernel, on fp32 FMA: 256 threads, kCoreCols outputs x kTileRows rows
// (one output and 16 rows a thread), weights dequantized in fp32 (q * scale, e4m3 * block
// scale, as the CPU's dequantize) into the shared tile.
template <int WF, bool GATHER>
__global__ void core_grouped_gemm_kernel(float* out, const bf16* in, int64_t ld_in, const int32_t* order, int K,
                                         const int32_t* tiles, const int32_t* n_tiles, const int32_t* offsets,
                                         ExpertMatrix m) {
  if (int(blockIdx.x) >= *n_tiles) return;
  const int e = tiles[2 * blockIdx.x], r0 = tiles[2 * blockIdx.x + 1];
  const int rend = min(r0 + kTileRows, offsets[e + 1]);
  const int O = int(m.O), I = int(m.I), col0 = blockIdx.y * kCoreCols;
  __shared__ float A[kTileRows][kCoreK + 1];
  __shared__ float B[kCoreCols][kCoreK + 1];
  __shared__ int64_t src[kTileRows];
  const int tid = threadIdx.x, c = tid % kCoreCols, rr = tid / kCoreCols;  // 256 threads: 4 row groups
  if (tid < kTileRows) {
    const int p = r0 + tid;
    src[tid] = p < rend ? (GATHER ? int64_t(order[p] / K) : int64_t(p)) : -1;
  }
  const int64_t words = (I + 7) / 8, groups = m.group > 0 ? (I + m.group - 1) / m.group : 0;
  const int bo = int(m.bo), bi = int(m.bi);
  const int64_t fcols = WF == kWFp8 ? (I + bi - 1) / bi : 0, frow0 = WF == kWFp8 ? int64_t(e) * ((O + bo - 1) / bo) : 0;
  float acc[kTileRows / 4];
#pragma unroll
  for (int j = 0; j < kTileRows / 4; ++j) acc[j] = 0.f;
  __syncthreads();
  for (int k0 = 0; k0 < I; k0 += kCoreK) {
    for (int i = tid; i < kTileRows * kCoreK; i += blockDim.x) {
      const int r = i / kCoreK, k = i % kCoreK;
      A[r][k] = (src[r] >= 0 && k0 + k < I) ? __bfloat162float(in[src[r] * ld_in + k0 + k]) : 0.f;
    }
    for (int i = tid; i < kCoreCols * kCoreK; i += blockDim.x) {
      const int oc = i / kCoreK, k = i % kCoreK, o = col0 + oc, kk = k0 + k;
      float v = 0.f;
      if (o < O && kk < I) {
        const int64_t row = int64_t(e) * O + o;
        if constexpr (WF == kWInt4) {
          const uint32_t w = uint32_t(m.packed[row * words + kk / 8]);
          const int q = int((w >> (4 * (kk % 8))) & 15u) - 8;
          v = float(q) * __bfloat162float(m.scale[row * groups + kk / m.group]);
        } else if constexpr (WF == kWFp8) {
          v = fp8_to_f32(m.fp8[row * I + kk]) * m.block_scale[(frow0 + o / bo) * fcols + kk / bi];
        } else {
          v = __bfloat162float(m.w[row * I + kk]);
        }
      }
      B[oc][k] = v;
    }
    __syncthreads();
#pragma unroll 8
    for (int k = 0; k < kCoreK; ++k) {
      const float b = B[c][k];
#pragma unroll
      for (int j = 0; j < kTileRows / 4; ++j) acc[j] += A[rr + 4 * j][k] * b;
    }
    __syncthreads();
  }
  const int o = col0 + c;
  if (o >= O) return;
  for (int j = 0; j < kTileRows / 4; ++j) {
    const int p = r0 + rr + 4 * j;
    if (p < rend) out[int64_t(p) * O + o] = acc[j];
  }
}

// out[n, :] = sum_t w[n, t] * y[pos[n K + t], :], in slot (= expert id) order.
// Blocks (n, chunk of H): at decode sizes one block a token left most SMs idle.
__global__ void combine_kernel(float* out, const float* y, const float* w, const int32_t* pos, int K, int64_t H) {
  const int n = blockIdx.x;
  for (int64_t h = blockIdx.y * int64_t(blockDim.x) + threadIdx.x; h < H; h += int64_t(gridDim.y) * blockDim.x) {
    float acc = 0.f;
    for (int t = 0; t < K; ++t) acc += y[int64_t(pos[n * K + t]) * H + h] * w[n * K + t];
    out[int64_t(n) * H + h] = acc;
  }
}

// ---- Decode-sized grouped GEMV: few routed rows an expert ----

// At decode sizes an expert sees a few rows (batch 1 of Kimi-K2: one row each for 8 of 384
// experts), and a 64-row tensor-core tile would spend its pipeline on one row: the bytes of
// the weights, not the products, decide. Here a block takes one tile of the sort (an expert
// and up to kTileRows of its sorted rows) and kSkOut outputs per warp, 8 warps; each lane
// reads 16 bytes of weight row at a time (32 int4 values, or 8 bf16) for each of its outputs
// and multiplies them with up to kSkRows input rows at once (rows past that: another pass).
// int4: a word's 8 products are summed in fp32 and times the fp32 scale of the word's group,
// so q * scale is never rounded to bf16 (as the tensor-core kernel). Lanes' partial sums meet
// by shuffles. Needs I % 32 == 0 and a group a multiple of 8 (int4), I % 8 == 0 (bf16), and
// 16-byte aligned rows.
constexpr int kSkOut = 2, kSkWarps = 8, kSkCols = kSkWarps * kSkOut;

// R: input rows a pass (1, 2, 4 or 8: the fewest that hold every expert's rows when the
// caller knows a bound, as one token reaches an expert at most once). The next 16 bytes of
// each output's row are loaded while the current ones are multiplied.
template <int WF, bool GATHER, int R>
__global__ void __launch_bounds__(kSkWarps * 32)
    skinny_grouped_kernel(float* out, const bf16* in, int64_t ld_in, const int32_t* order, int K,
                          const int32_t* tiles, const int32_t* n_tiles, const int32_t* offsets, ExpertMatrix m) {
  constexpr bool INT4 = WF == kWInt4;
  constexpr int kPer = INT4 ? 32 : 8;  // weights a lane reads at a time (16 bytes)
  if (int(blockIdx.x) >= *n_tiles) return;
  const int e = tiles[2 * blockIdx.x], r0 = tiles[2 * blockIdx.x + 1];
  const int rows = min(kTileRows, offsets[e + 1] - r0);
  const int O = int(m.O), I = int(m.I), lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int o0 = int(blockIdx.y) * kSkCols + warp * kSkOut;
  if (o0 >= O) return;
  const int64_t words = I / 8, groups = INT4 ? (I + m.group - 1) / m.group : 0;
  const uint4* wrow[kSkOut];
#pragma unroll
  for (int j = 0; j < kSkOut; ++j) {
    const int64_t o = int64_t(e) * O + min(o0 + j, O - 1);
    wrow[j] = INT4 ? reinterpret_cast<const uint4*>(m.packed + o * words)
                   : reinterpret_cast<const uint4*>(m.w + o * I);
  }
  for (int rb = 0; rb < rows; rb += R) {
    const int nr = min(R, rows - rb);
    const bf16* xr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int rr = r < nr ? r0 + rb + r : r0 + rb;
      xr[r] = in + int64_t(GATHER ? order[rr] / K : rr) * ld_in;
    }
    float acc[R][kSkOut];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < kSkOut; ++j) acc[r][j] = 0.f;
    int k0 = lane * kPer;
    uint4 w[kSkOut];
    if (k0 < I) {
#pragma unroll
      for (int j = 0; j < kSkOut; ++j) w[j] = wrow[j][k0 / kPer];
    }
    for (; k0 < I; k0 += 32 * kPer) {
      uint4 wn[kSkOut];
      const int kn = k0 + 32 * kPer;
      if (kn < I) {
#pragma unroll
        for (int j = 0; j < kSkOut; ++j) wn[j] = wrow[j][kn / kPer];
      }
      float sc[kSkOut][kPer / 8];
      if constexpr (INT4) {
#pragma unroll
        for (int j = 0; j < kSkOut; ++j) {
          const bf16* srow = m.scale + (int64_t(e) * O + min(o0 + j, O - 1)) * groups;
#pragma unroll
          for (int q = 0; q < 4; ++q) sc[j][q] = __bfloat162float(srow[(k0 + 8 * q) / m.group]);
        }
      }
#pragma unroll
      for (int q = 0; q < kPer / 8; ++q) {  // 8 weights (one int4 word, or the whole bf16 load) at a time
        float wf[kSkOut][8];
#pragma unroll
        for (int j = 0; j < kSkOut; ++j) {
          if constexpr (INT4) {
            const uint32_t word = (&w[j].x)[q];
#pragma unroll
            for (int b = 0; b < 8; ++b) wf[j][b] = float(int((word >> (4 * b)) & 15u) - 8);
          } else {
            const bf16* wb = reinterpret_cast<const bf16*>(&w[j]);
#pragma unroll
            for (int b = 0; b < 8; ++b) wf[j][b] = __bfloat162float(wb[b]);
          }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          if (r >= nr) break;
          const uint4 xv = *reinterpret_cast<const uint4*>(xr[r] + k0 + 8 * q);
          const bf16* xb = reinterpret_cast<const bf16*>(&xv);
          float xf[8];
#pragma unroll
          for (int b = 0; b < 8; ++b) xf[b] = __bfloat162float(xb[b]);
#pragma unroll
          for (int j = 0; j < kSkOut; ++j) {
            float part = 0.f;
#pragma unroll
            for (int b = 0; b < 8; ++b) part += wf[j][b] * xf[b];
            if constexpr (INT4)
              acc[r][j] += part * sc[j][q];
            else
              acc[r][j] += part;
          }
        }
      }
      if (kn < I) {
#pragma unroll
        for (int j = 0; j < kSkOut; ++j) w[j] = wn[j];
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r >= nr) break;
#pragma unroll
      for (int j = 0; j < kSkOut; ++j) {
        const float v = warp_sum(acc[r][j]);
        if (lane == 0 && o0 + j < O) out[int64_t(r0 + rb + r) * O + o0 + j] = v;
      }
    }
  }
}

// ---- int4 experts at decode-sized batches on tensor cores (weights as the M operand) ----
//
// With a few rows an expert, the bytes of the int4 weights decide, and the kernels above spend
// more instructions unpacking nibbles than the bus needs: the tiles unpack 16 outputs per warp
// for an m16 fragment of mostly empty rows, the decode-sized kernel converts every nibble to
// fp32 and multiplies on CUDA cores. Here the products are mma.sync m16n8k16 with the roles
// swapped: A is 16 weight rows (outputs) of the expert, B is up to 8 routed rows (tokens) as the
// n columns, so one mma uses 256 weights and a token fragment costs one mma however few rows
// it holds. Each warp streams its own 16 output rows through a private ring of cp.async stages
// (no block-wide barrier), 128 k a stage: 64 packed bytes of each row plus the row's four bf16
// group scales. The reduction index is permuted (the sum does not care, as long as A and B use
// the same permutation): in the 32-k quantization group j of a stage, lane t of a quad holds
// word 4j + t (k 8t .. 8t + 7 of the group) of its rows g and g + 8 and pairs nibbles
// (b, b + 4), which a shift, a mask and a bf16x2 add turn into two exact bf16 values; the lane reads
// the matching 8 activations with one 16-byte load and pairs them the same way with byte
// permutes. An mma k-step (16 k) then lies inside one group, so the group's products
// accumulate unscaled in fp32 and are added times the fp32 scale when the group ends, as in
// the tiles (q * scale is never rounded to bf16). Needs group 32, I % 128 == 0, 16-byte
// aligned packed rows and inputs (ld % 8 == 0), 8-byte aligned scales.
constexpr int kQmWarps = 4;                  // warps a block, 16 MT outputs each
constexpr int kQmStages = 4;                 // cp.async stages a warp
constexpr int kQmK = 128;                    // k a stage
constexpr int kQmRowBytes = kQmK / 2 + 16;   // 64 packed bytes + 16 padding: quads' words on distinct banks
// A staged activation row (XS): 128 bf16 + 64 bytes of padding, so the 16-byte reads of a
// quarter warp (token rows g, g + 1; four 16-byte pieces each) fall on distinct banks.
constexpr int kQmXRowBytes = kQmK * 2 + 64;
// One stage of a warp owning MT m16 tiles of weight rows: [16 MT rows][kQmRowBytes] packed words,
// then the rows' scales [16 MT][4] bf16.
template <int MT>
struct QmStage {
  static constexpr int scales = 16 * MT * kQmRowBytes;
  static constexpr int bytes = scales + 16 * MT * 8;
  static_assert(bytes % 16 == 0, "16-byte aligned stages");
};

// d = a b (mma_bf16 without an accumulator to read).
__device__ __forceinline__ void mma_bf16_first(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %10, %10, %10};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.f));
}

__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}

// Nibbles 0 and 4 of a packed word (stored q + 8), at bits 0-3 and 16-19, as the bf16 pair
// (q_0, q_4), exact: the exponent of 128.0 (bf16 0x4300, whose last mantissa step is 1) makes
// each nibble n the value 128 + n, and 136 is subtracted. Pair (b, b + 4) is that of w >> 4b.
__device__ __forceinline__ uint32_t q4_pair(uint32_t w) {
  const uint32_t v = (w & 0x000f000fu) | 0x43004300u;
  const __nv_bfloat162 r = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&v), __floats2bfloat162_rn(136.f, 136.f));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// out[p, O] (fp32, sorted rows) = in[row(p)] @ W_e^T for the tile's int4 expert e (as
// tc_grouped_gemm_kernel). NF: token fragments of 8 rows a pass (1, 2 or 4); a tile with
// more rows takes further passes over the weights. MT: m16 tiles of weight rows a warp (1 or
// 2): two share each activation load and byte permute, halving the activation reads (each block
// of the tile reads the tile's activation rows again, from L2 or L1) per weight byte.
// SWIGLU (MT 2): the warp's two tiles are the same 16 rows of the gate (m) and of the up
// projection (m2), and the warp writes act = silu(gate) * up, rounded to bf16 as
// launch_swiglu_forward rounds it, into act [rows, O] instead of out: the MoE's first two
// products and its SwiGLU in one pass over the activations.
// KS (4, with MT 1 and no SWIGLU; few tiles): the block's warps share 16 weight rows, each
// taking a quarter of the reduction, and warp 0 adds the others' sums (in warp order, through
// shared memory) before storing: four times the warps in flight when a call has few tiles.
// XS (KS 1): the pass's activation rows are staged once a block, in the same cp.async stages
// as the weights (a ring of ST chunks of 8 NF rows x 128 k; one block barrier a chunk),
// instead of each warp loading them from L1 / L2 inside the loop (whose latency the warps
// then wait on: ncu's largest stall, 45-63% of the cycles at 64-512 tokens without it).
// ST: cp.async stages (XS: 3 or 4). Dynamic shared memory: see int4_mma_launch.
template <bool GATHER, int NF, int MT, bool SWIGLU = false, int KS = 1, bool XS = false, int ST = kQmStages>
__global__ void __launch_bounds__(kQmWarps * 32, MT == 1 ? (NF == 1 ? 8 : NF == 2 ? 6 : 4) : (NF == 1 ? 5 : NF == 2 ? 4 : 3))
    int4_decode_mma_kernel(float* out, bf16* act, const bf16* in, int64_t ld_in, const int32_t* order, int K,
                           const int32_t* tiles, const int32_t* n_tiles, const int32_t* offsets, ExpertMatrix m,
                           ExpertMatrix m2, int splits, GroupedGrid grid) {
  static_assert(!SWIGLU || MT == 2, "the SwiGLU pairing holds a gate tile and an up tile");
  static_assert(KS == 1 || (KS == kQmWarps && MT == 1 && !SWIGLU), "reduction split: one quarter a warp");
  static_assert(!XS || KS == 1, "staged activations: every warp of the block walks the same chunks");
  using St = QmStage<MT>;
  constexpr int R = 16 * MT;          // weight rows a warp (its stage)
  constexpr int RO = SWIGLU ? 16 : R;  // output rows a warp
  constexpr int XB = 8 * NF * kQmXRowBytes;  // a staged activation chunk
  extern __shared__ __align__(16) unsigned char qm_smem[];
  // splits blocks a tile (x = tile * splits + split): split s takes the tile's passes
  // s, s + splits, ... Neighbours in launch order, they stream the same weight rows at about
  // the same time, so past the first the weights come from L2.
  // (The reduction split serves a few tiles: always the plain grid.)
  const int2 bxy = KS > 1 ? make_int2(int(blockIdx.x), int(blockIdx.y)) : grid.block();
  const int tile = bxy.x / splits, split = bxy.x % splits;
  if (tile >= *n_tiles) return;
  const int e = tiles[2 * tile], r0 = tiles[2 * tile + 1];
  const int rows = min(kTileRows, offsets[e + 1] - r0);
  const int O = int(m.O), I = int(m.I), lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  const int o0 = KS == 1 ? bxy.y * (kQmWarps * RO) + warp * RO : bxy.y * RO;
  // The warp's rows are past the matrix (KS: the block's): no other exit. With XS such a warp
  // stays for the block's copies and barriers (its weight rows repeat row O - 1; nothing stored).
  if (!XS && o0 >= O) return;
  const int64_t words = I / 8, groups = I / 32;
  const int n_chunks = I / kQmK;
  const int cb = KS == 1 ? 0 : warp * n_chunks / KS, ce = KS == 1 ? n_chunks : (warp + 1) * n_chunks / KS;
  auto ring = reinterpret_cast<unsigned char(*)[St::bytes]>(qm_smem + warp * ST * St::bytes);
  [[maybe_unused]] unsigned char* xring = qm_smem + kQmWarps * ST * St::bytes;  // XS: [ST][XB]
  // XS: this thread's NF 16-byte pieces of a staged chunk: piece u is token row rb + xi[u]
  // (xi = (tid + 128 u) / 16), bytes 16 (tid % 16) of the chunk's 256; xsrc[u] its row (null:
  // past the tile's rows; zero-filled).
  constexpr int kPieces = 8 * NF * (kQmK / 8) / (kQmWarps * 32);
  static_assert(!XS || kPieces == NF, "one piece a thread per token fragment");
  [[maybe_unused]] const bf16* xsrc[XS ? NF : 1];
  // The copies of stage c: lane l moves 16-byte pieces l + 32 i (stage row p / 4, quarter p % 4)
  // and, for l < R, the 8 scale bytes of stage row l. Rows past O repeat the last row (not
  // stored). SWIGLU: stage rows 16.. are the up projection's rows o0 ...
  const int64_t wrow0 = int64_t(e) * O;
  auto row_of = [&](int r) { return wrow0 + min(o0 + (SWIGLU ? r % 16 : r), O - 1); };
  auto issue = [&](int c) {
    unsigned char* st = ring[(c - cb) % ST];
#pragma unroll
    for (int i = 0; i < 2 * MT; ++i) {
      const int p = lane + 32 * i, r = p / 4, q = p % 4;
      const int32_t* base = SWIGLU && r >= 16 ? m2.packed : m.packed;
      cp_async16(st + r * kQmRowBytes + 16 * q, base + row_of(r) * words + int64_t(c) * (kQmK / 8) + 4 * q);
    }
    if (lane < R) {
      const bf16* base = SWIGLU && lane >= 16 ? m2.scale : m.scale;
      cp_async8(st + St::scales + 8 * lane, base + row_of(lane) * groups + 4 * c);
    }
    if constexpr (XS) {
      unsigned char* xs = xring + ((c - cb) % ST) * XB;
      const int q = threadIdx.x % 16;
#pragma unroll
      for (int u = 0; u < NF; ++u) {
        const int i = (threadIdx.x + kQmWarps * 32 * u) / 16;
        cp_async16(xs + i * kQmXRowBytes + 16 * q, (xsrc[u] ? xsrc[u] : in) + int64_t(c) * kQmK + 8 * q,
                   xsrc[u] != nullptr);
      }
    }
  };
  for (int rb = 8 * NF * split; rb < rows; rb += 8 * NF * splits) {
    const int nf = min(NF, (rows - rb + 7) / 8);  // token fragments holding rows this pass
    auto row_ptr = [&](int r) { return in + int64_t(GATHER ? order[r0 + r] / K : r0 + r) * ld_in; };
    // The activations of token column g of each fragment (null: past the tile's rows).
    const bf16* xr[NF];
#pragma unroll
    for (int f = 0; f < NF; ++f) {
      const int r = rb + 8 * f + g;
      xr[f] = !XS && r < rows ? row_ptr(r) + 8 * t : nullptr;
    }
    if constexpr (XS) {
#pragma unroll
      for (int u = 0; u < NF; ++u) {
        const int r = rb + (int(threadIdx.x) + kQmWarps * 32 * u) / 16;
        xsrc[u] = r < rows ? row_ptr(r) : nullptr;
      }
    }
    float acc[MT][NF][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int f = 0; f < NF; ++f) acc[mt][f][0] = acc[mt][f][1] = acc[mt][f][2] = acc[mt][f][3] = 0.f;
    // The previous pass is done with the rings (XS: the block's).
    if constexpr (XS)
      __syncthreads();
    else
      __syncwarp();
#pragma unroll
    for (int c = cb; c < cb + ST - 1; ++c) {
      if (c < ce) issue(c);
      cp_async_commit();
    }
    for (int c = cb; c < ce; ++c) {
      cp_async_wait<ST - 2>();
      // Every copy of stage c has landed; every lane (XS: thread of the block) is done with c - 1.
      if constexpr (XS)
        __syncthreads();
      else
        __syncwarp();
      if (c + ST - 1 < ce) issue(c + ST - 1);
      cp_async_commit();
      const unsigned char* st = ring[(c - cb) % ST];
      [[maybe_unused]] const unsigned char* xs = xring + ((c - cb) % ST) * XB;
      uint2 s_lo[MT], s_hi[MT];  // the scales of rows 16 mt + g and 16 mt + g + 8
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        s_lo[mt] = *reinterpret_cast<const uint2*>(st + St::scales + 8 * (16 * mt + g));
        s_hi[mt] = *reinterpret_cast<const uint2*>(st + St::scales + 8 * (16 * mt + g + 8));
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint4 xv[NF];
#pragma unroll
        for (int f = 0; f < NF; ++f) {
          if (f >= nf) break;
          if constexpr (XS)
            xv[f] = *reinterpret_cast<const uint4*>(xs + (8 * f + g) * kQmXRowBytes + 64 * j + 16 * t);
          else
            xv[f] = xr[f] ? *reinterpret_cast<const uint4*>(xr[f] + c * kQmK + 32 * j) : make_uint4(0u, 0u, 0u, 0u);
        }
        uint32_t w0[MT], w1[MT];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          w0[mt] = *reinterpret_cast<const uint32_t*>(st + (16 * mt + g) * kQmRowBytes + 4 * (4 * j + t));
          w1[mt] = *reinterpret_cast<const uint32_t*>(st + (16 * mt + g + 8) * kQmRowBytes + 4 * (4 * j + t));
        }
        float part[MT][NF][4];
        // k-step 0 (starts the group's sums): nibble pairs (0, 4) and (1, 5); k-step 1: (2, 6), (3, 7).
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint32_t a[MT][4];
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            a[mt][0] = q4_pair(w0[mt] >> (8 * h));
            a[mt][1] = q4_pair(w1[mt] >> (8 * h));
            a[mt][2] = q4_pair(w0[mt] >> (8 * h + 4));
            a[mt][3] = q4_pair(w1[mt] >> (8 * h + 4));
          }
#pragma unroll
          for (int f = 0; f < NF; ++f) {
            if (f >= nf) break;
            const uint32_t xa = h ? xv[f].y : xv[f].x, xb = h ? xv[f].w : xv[f].z;
            const uint32_t b0 = __byte_perm(xa, xb, 0x5410), b1 = __byte_perm(xa, xb, 0x7632);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
              if (h)
                mma_bf16(part[mt][f], a[mt], b0, b1);
              else
                mma_bf16_first(part[mt][f], a[mt], b0, b1);
            }
          }
        }
        // The group ends: acc += scale(row) * part; rows g (regs 0, 1) and g + 8 (regs 2, 3).
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const uint32_t sw_lo = j < 2 ? s_lo[mt].x : s_lo[mt].y, sw_hi = j < 2 ? s_hi[mt].x : s_hi[mt].y;
          const float sg = __uint_as_float((j % 2 ? sw_lo >> 16 : sw_lo & 0xffffu) << 16);
          const float sg8 = __uint_as_float((j % 2 ? sw_hi >> 16 : sw_hi & 0xffffu) << 16);
#pragma unroll
          for (int f = 0; f < NF; ++f) {
            if (f >= nf) break;
            acc[mt][f][0] = fmaf(sg, part[mt][f][0], acc[mt][f][0]);
            acc[mt][f][1] = fmaf(sg, part[mt][f][1], acc[mt][f][1]);
            acc[mt][f][2] = fmaf(sg8, part[mt][f][2], acc[mt][f][2]);
            acc[mt][f][3] = fmaf(sg8, part[mt][f][3], acc[mt][f][3]);
          }
        }
      }
    }
    cp_async_wait<0>();
    if constexpr (KS > 1) {
      __shared__ float red[KS - 1][32][NF * 4];
      if (warp > 0) {
#pragma unroll
        for (int f = 0; f < NF; ++f)
#pragma unroll
          for (int i = 0; i < 4; ++i) red[warp - 1][lane][4 * f + i] = acc[0][f][i];
      }
      __syncthreads();
      if (warp == 0) {
#pragma unroll
        for (int w = 0; w < KS - 1; ++w)
#pragma unroll
          for (int f = 0; f < NF; ++f)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[0][f][i] += red[w][lane][4 * f + i];
      }
      __syncthreads();  // red is free for the next pass
      if (warp > 0) continue;
    }
    // Accumulator (mt, f): outputs o0 + 16 mt + g (regs 0, 1) and + 8 (regs 2, 3), token rows
    // 8f + 2t, + 1 (SWIGLU: outputs o0 + g, + 8 of the gate, mt 0, and the up projection, mt 1).
    if constexpr (SWIGLU) {
#pragma unroll
      for (int f = 0; f < NF; ++f) {
        if (f >= nf) break;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = rb + 8 * f + 2 * t + (i & 1), o = o0 + g + 8 * (i >> 1);
          if (r < rows && o < O) act[int64_t(r0 + r) * O + o] = __float2bfloat16_rn(silu_times(acc[0][f][i], acc[1][f][i]));
        }
      }
    } else {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int f = 0; f < NF; ++f) {
          if (f >= nf) break;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int r = rb + 8 * f + 2 * t + (i & 1), o = o0 + 16 * mt + g + 8 * (i >> 1);
            if (r < rows && o < O) out[int64_t(r0 + r) * O + o] = acc[mt][f][i];
          }
        }
    }
  }
}

// ---- int4, FP8 and bf16 experts at large batches on Hopper's warpgroup MMA (wgmma) ----
//
// Past a few dozen rows an expert the int4 products are bound by instructions, not bytes: the
// mma.sync kernel above converts each weight for at most 32 token rows and issues one m16n8k16
// per 8 of them. Here a block takes one sort tile (up to 64 rows of one expert) and 128 weight
// rows, as two warpgroups of 64 rows each; a k16 step is one wgmma m64n64k16 a warpgroup, its A
// operand (the weights) converted straight into registers and its B operand (the tile's 64
// token rows) read by the tensor cores from shared memory. A stage of the cp.async ring holds
// 128 k: the block's 128 weight rows (int4: 64 packed bytes, FP8: 128 e4m3 bytes, each row
// padded by 16 so that the reads of rows g = 0..7 fall on distinct banks), their scales, and the
// 64 activation rows laid out as the wgmma's K-major core matrices ([row / 8][k / 8][row % 8][8
// k], no swizzle: a 16-byte piece a thread, consecutive threads on consecutive pieces).
// int4 (group 32): in the natural k order a lane needs byte t of each packed word (nibbles 2t,
// 2t + 1: k 2t, 2t + 1 of the mma's A fragment), which a byte permute of the word and of the
// word shifted by 4, a mask and a bf16x2 subtraction turn into two exact bf16 values. As in the
// kernels above the scales are never folded into bf16 weights: each 32-k group's two wgmma
// accumulate unscaled into part (the first one overwriting it), and acc += scale(row) * part in
// fp32 when they are done; the next group's fragments are converted while they run.
// FP8 (K blocks bi a multiple of 128: DeepSeek-V3's 128 x 128): a lane's A pair is two
// consecutive e4m3 bytes, converted exactly (fp8x2_to_bf16x2); a stage lies in one K block, so
// its eight wgmma accumulate into part and the block scale of each row is applied once a stage.
// SWIGLU: warpgroup 0 holds 64 rows of the gate, warpgroup 1 the same rows of the up projection;
// after the loop the up sums go through shared memory to warpgroup 0, which writes act =
// silu(gate) * up in bf16. Needs I % 128 == 0 and 16-byte aligned weight rows and inputs (ld %
// 8 == 0); built for sm_90a only.
// bf16: both operands from shared memory (the weights staged as K-major core matrices like the
// activations; stages of 64 k), no scales: the wgmma accumulate straight into acc, and a stage's
// products are waited for only before the next barrier, so they overlap the next stage's wait
// for its copies. Needs I % 64 == 0.
constexpr int kQwThreads = 256;  // two warpgroups
constexpr int kQwRows = 128;     // weight rows a block (64 a warpgroup)
constexpr int kQwN = kTileRows;  // token rows a block: one sort tile (64)
static_assert(kQwN == 64, "the block's wgmma is m64n64k16: one tile of 64 rows");
// One stage of k columns: [128][row] weight bytes (bf16: [128][k] as core matrices), then the
// rows' scales (int4: [128][4] bf16, one a 32-k group; FP8: [128] fp32; bf16: none), then
// [64][k] bf16 activations as core matrices.
template <int WF>
struct QwStage {
  static constexpr int k = WF == kWBf16 ? 64 : kQmK;  // k a stage
  static constexpr int row = WF == kWInt4 ? k / 2 + 16 : WF == kWFp8 ? k + 16 : 2 * k;
  static constexpr int scales = kQwRows * row;
  static constexpr int x = scales + kQwRows * (WF == kWInt4 ? 8 : WF == kWFp8 ? 4 : 0);
  static constexpr int bytes = x + kQwN * k * 2;
  static constexpr int sbo = (k / 8) * 128;  // core-matrix layouts: bytes between groups of 8 rows
  static constexpr int count = WF == kWFp8 ? 3 : 4;  // stages: two blocks fit an SM
  static_assert(x % 16 == 0 && bytes % 16 == 0, "16-byte aligned core matrices and stages");
};

__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}

// Byte t of packed word w (nibbles 2t and 2t + 1, stored q + 8) as the exact bf16 pair (q_2t,
// q_2t+1): the permute puts byte t of w in byte 0 and byte t of w >> 4 in byte 2, and 128.0's
// exponent makes each masked nibble n the value 128 + n (see q4_pair).
__device__ __forceinline__ uint32_t q4_byte_pair(uint32_t w, uint32_t sel) {
  const uint32_t v = (__byte_perm(w, w >> 4, sel) & 0x000f000fu) | 0x43004300u;
  const __nv_bfloat162 r = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&v), __floats2bfloat162_rn(136.f, 136.f));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// out[p, O] (fp32, sorted rows) = in[row(p)] @ W_e^T for the tile's expert e (WF: kWInt4,
// kWFp8 or kWBf16), or with SWIGLU act [p, O] = silu(in @ W_e^T) * (in @ W2_e^T) in bf16. The grid
// (GroupedGrid) runs groups of `group` consecutive tiles: a group's tiles take weight-row block
// 0 side by side, then block 1, and so on. Neighbours in launch order share
// a weight slab (the tiles of one expert are consecutive in the sort: its slab comes from DRAM
// once, then from L2), and the group's activation rows stay in L2 while its weight blocks go
// by. group 1: tile-major (a tile's weight blocks together); group >= the tiles: the plain
// two-dimensional launch (weight-block-major).
template <int WF, bool GATHER, bool SWIGLU>
__global__ void __launch_bounds__(kQwThreads, 2)
    wgmma_grouped_kernel(float* out, bf16* act, const bf16* in, int64_t ld_in, const int32_t* order, int K,
                         const int32_t* tiles, const int32_t* n_tiles, const int32_t* offsets, ExpertMatrix m,
                         ExpertMatrix m2, GroupedGrid grid) {
  static_assert(WF == kWInt4 || WF == kWFp8 || WF == kWBf16, "int4, FP8 or bf16 weights");
  using St = QwStage<WF>;
  constexpr int ST = St::count;
  extern __shared__ __align__(128) unsigned char qw_smem[];
  const int2 bxy = grid.block();
  const int tile = bxy.x, ob = bxy.y;
  if (tile >= *n_tiles) return;
  const int e = tiles[2 * tile], r0 = tiles[2 * tile + 1];
  const int rows = min(kTileRows, offsets[e + 1] - r0);
  const int O = int(m.O), I = int(m.I), tid = int(threadIdx.x);
  const int wg = tid / 128, warp = (tid % 128) / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int o0 = ob * (SWIGLU ? kQwRows / 2 : kQwRows);
  const int n_chunks = I / St::k;
  // Block weight row r: the expert's row o0 + r (SWIGLU: rows 64.. are the up projection's o0 ..);
  // rows past O repeat row O - 1 (computed, not stored).
  auto orow = [&](int r) { return min(o0 + (SWIGLU ? r % (kQwRows / 2) : r), O - 1); };
  auto second = [&](int r) { return SWIGLU && r >= kQwRows / 2; };  // block row r is the up projection's
  auto row_ptr = [&](int r) { return in + int64_t(GATHER ? order[r0 + r] / K : r0 + r) * ld_in; };
  // This thread's copies of a stage, 16-byte pieces p = tid + 256 u. Weights: int4, row p / 4,
  // quarter p % 4; FP8, row p / 8, eighth p % 8; bf16, as core matrices like the activations
  // (below). Scales, for tid < 128: row tid's (int4: the stage's four group scales, 8 bytes;
  // FP8: the stage's K block scale, 4 bytes). Activations, as core matrices: piece p is row
  // 8 (p / k) + p % 8, k 8 ((p / 8) % (k / 8)), at byte 16 p of the stage's block (null past
  // the tile's rows: zero-filled).
  constexpr int kWPieces = WF == kWInt4 ? 2 : 4, kPerRow = kWPieces * kQwThreads / kQwRows;
  auto cm_row = [](int p) { return 8 * (p / St::k) + p % 8; };           // core-matrix piece p's row
  auto cm_col = [](int p) { return 8 * ((p / 8) % (St::k / 8)); };       // and its first k
  const unsigned char* wsrc[kWPieces];
#pragma unroll
  for (int u = 0; u < kWPieces; ++u) {
    const int p = tid + kQwThreads * u, r = WF == kWBf16 ? cm_row(p) : p / kPerRow;
    const int64_t row = int64_t(e) * O + orow(r);
    if constexpr (WF == kWInt4)
      wsrc[u] = reinterpret_cast<const unsigned char*>((second(r) ? m2.packed : m.packed) + row * (I / 8)) + 16 * (p % kPerRow);
    else if constexpr (WF == kWFp8)
      wsrc[u] = (second(r) ? m2.fp8 : m.fp8) + row * I + 16 * (p % kPerRow);
    else
      wsrc[u] = reinterpret_cast<const unsigned char*>((second(r) ? m2.w : m.w) + row * I + cm_col(p));
  }
  // The scale rows: int4, bf16 [E O][I / 32]; FP8, fp32 block scales [E][ceil(O / bo)][ceil(I / bi)].
  // (gate and up share O, I and the block sizes.)
  [[maybe_unused]] const void* ssrc = nullptr;
  if constexpr (WF == kWInt4) {
    ssrc = (second(tid % kQwRows) ? m2.scale : m.scale) + (int64_t(e) * O + orow(tid % kQwRows)) * (I / 32);
  } else if constexpr (WF == kWFp8) {
    const int64_t bo = m.bo, bi = m.bi;
    ssrc = (second(tid % kQwRows) ? m2.block_scale : m.block_scale) +
           (int64_t(e) * ((O + bo - 1) / bo) + orow(tid % kQwRows) / bo) * ((I + bi - 1) / bi);
  }
  constexpr int kXPieces = kQwN * St::k / 8 / kQwThreads;
  const bf16* xsrc[kXPieces];
#pragma unroll
  for (int u = 0; u < kXPieces; ++u) {
    const int p = tid + kQwThreads * u, r = cm_row(p);
    xsrc[u] = r < rows ? row_ptr(r) + cm_col(p) : nullptr;
  }
  auto issue = [&](int c) {
    unsigned char* st = qw_smem + (c % ST) * St::bytes;
#pragma unroll
    for (int u = 0; u < kWPieces; ++u) {
      const int p = tid + kQwThreads * u;
      // (bytes of the stage's k columns a row: int4 k / 2, FP8 k, bf16 2 k)
      const int64_t step = int64_t(c) * (WF == kWInt4 ? St::k / 2 : WF == kWFp8 ? St::k : 2 * St::k);
      cp_async16(st + (WF == kWBf16 ? 16 * p : (p / kPerRow) * St::row + 16 * (p % kPerRow)), wsrc[u] + step);
    }
    if constexpr (WF != kWBf16) {
      if (tid < kQwRows) {
        if constexpr (WF == kWInt4)
          cp_async8(st + St::scales + 8 * tid, static_cast<const bf16*>(ssrc) + 4 * c);
        else
          cp_async4(st + St::scales + 4 * tid, static_cast<const float*>(ssrc) + int64_t(c) * St::k / m.bi);
      }
    }
#pragma unroll
    for (int u = 0; u < kXPieces; ++u)
      cp_async16(st + St::x + 16 * (tid + kQwThreads * u), xsrc[u] ? xsrc[u] + int64_t(c) * St::k : in,
                 xsrc[u] != nullptr);
  };
  // This thread's weight rows in the block: rl (row g of its warp's 16) and rl + 8.
  const int rl = 64 * wg + 16 * warp + g;
  float acc[32], part[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = part[i] = 0.f;
  // part's products are done: acc += scale(row rl) * part on rows rl (regs 4i, 4i + 1) and
  // rl + 8 (4i + 2, 4i + 3).
  auto add_scaled = [&](float sg, float sg8) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      acc[4 * i] = fmaf(sg, part[4 * i], acc[4 * i]);
      acc[4 * i + 1] = fmaf(sg, part[4 * i + 1], acc[4 * i + 1]);
      acc[4 * i + 2] = fmaf(sg8, part[4 * i + 2], acc[4 * i + 2]);
      acc[4 * i + 3] = fmaf(sg8, part[4 * i + 3], acc[4 * i + 3]);
    }
  };
  auto fence_part = [&] {
#pragma unroll
    for (int i = 0; i < 32; ++i) wgmma_reg_fence(part[i]);
  };
  [[maybe_unused]] auto fence_acc = [&] {
#pragma unroll
    for (int i = 0; i < 32; ++i) wgmma_reg_fence(acc[i]);
  };
#pragma unroll
  for (int c = 0; c < ST - 1; ++c) {
    if (c < n_chunks) issue(c);
    cp_async_commit();
  }
  for (int c = 0; c < n_chunks; ++c) {
    cp_async_wait<ST - 2>();
    fence_proxy_async_shared();
    if constexpr (WF == kWBf16) wgmma_wait<0>();  // stage c - 1's products (issued unwaited)
    // Every copy of stage c has landed; every warpgroup's wgmma of stage c - 1 is complete (each
    // waits for its own before the barrier), so stage c - 1's slot can be refilled.
    __syncthreads();
    if (c + ST - 1 < n_chunks) issue(c + ST - 1);
    cp_async_commit();
    const unsigned char* st = qw_smem + (c % ST) * St::bytes;
    const uint32_t xs = smem_addr(st + St::x);
    // The B descriptor of the stage's k16 step s: k 16s .. 16s + 15 of the 64 token rows.
    auto desc = [&](int s) { return wgmma_desc_k_major(xs + 256 * s, 128, St::sbo); };
    if constexpr (WF == kWBf16) {
      // The warpgroup's 64 weight rows (8 groups of 8 from row 64 wg) at k step s.
      const uint32_t ws = smem_addr(st) + 8 * wg * St::sbo;
      if (c == 0) fence_acc();
      wgmma_fence();
#pragma unroll
      for (int s = 0; s < St::k / 16; ++s)
        wgmma_m64n64k16_ss(acc, wgmma_desc_k_major(ws + 256 * s, 128, St::sbo), desc(s));
      wgmma_commit();
    } else if constexpr (WF == kWInt4) {
      const uint2 s_lo = *reinterpret_cast<const uint2*>(st + St::scales + 8 * rl);
      const uint2 s_hi = *reinterpret_cast<const uint2*>(st + St::scales + 8 * (rl + 8));
      const uint32_t sel = uint32_t(t) | uint32_t(4 + t) << 8;
      // The A fragments of group j's two k16 steps (register q: wgmma_a_coord's values 2q, 2q + 1,
      // row rl + 8 (q % 2), k 2t, 2t + 1 of the step's first (q < 2) or second 8): step 2j + h
      // covers words 4j + 2h (its k 0-7) and 4j + 2h + 1 (k 8-15) of rows rl and rl + 8.
      auto convert = [&](int j, uint32_t (&a)[2][4]) {
        const uint4 wl = *reinterpret_cast<const uint4*>(st + rl * St::row + 16 * j);
        const uint4 wh = *reinterpret_cast<const uint4*>(st + (rl + 8) * St::row + 16 * j);
        a[0][0] = q4_byte_pair(wl.x, sel), a[0][1] = q4_byte_pair(wh.x, sel);
        a[0][2] = q4_byte_pair(wl.y, sel), a[0][3] = q4_byte_pair(wh.y, sel);
        a[1][0] = q4_byte_pair(wl.z, sel), a[1][1] = q4_byte_pair(wh.z, sel);
        a[1][2] = q4_byte_pair(wl.w, sel), a[1][3] = q4_byte_pair(wh.w, sel);
      };
      uint32_t a[2][4], an[2][4];
      convert(0, a);
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // the stage's 32-k groups
        fence_part();
        wgmma_fence();
        wgmma_m64n64k16_rs(part, a[0], desc(2 * j), false);
        wgmma_m64n64k16_rs(part, a[1], desc(2 * j + 1), true);
        wgmma_commit();
        if (j < 3) convert(j + 1, an);  // the next group's fragments while the tensor cores run
        wgmma_wait<0>();
        fence_part();
        const uint32_t sw_lo = j < 2 ? s_lo.x : s_lo.y, sw_hi = j < 2 ? s_hi.x : s_hi.y;
        add_scaled(__uint_as_float((j % 2 ? sw_lo >> 16 : sw_lo & 0xffffu) << 16),
                   __uint_as_float((j % 2 ? sw_hi >> 16 : sw_hi & 0xffffu) << 16));
        if (j < 3) {
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int q = 0; q < 4; ++q) a[h][q] = an[h][q];
        }
      }
    } else {
      // k16 step s: bytes 16s + 2t, + 1 (k 2t, 2t + 1) and 16s + 2t + 8, + 9 of rows rl, rl + 8.
      auto convert = [&](int s, uint32_t (&a)[4]) {
        const uint16_t* lo = reinterpret_cast<const uint16_t*>(st + rl * St::row + 16 * s + 2 * t);
        const uint16_t* hi = reinterpret_cast<const uint16_t*>(st + (rl + 8) * St::row + 16 * s + 2 * t);
        a[0] = fp8x2_to_bf16x2(lo[0]), a[1] = fp8x2_to_bf16x2(hi[0]);
        a[2] = fp8x2_to_bf16x2(lo[4]), a[3] = fp8x2_to_bf16x2(hi[4]);
      };
      // Eight steps into part, two fragment sets in turn: step s's set is converted once step
      // s - 2 (its last reader) is complete.
      uint32_t a[2][4];
#pragma unroll
      for (int s = 0; s < St::k / 16; ++s) {
        convert(s, a[s % 2]);
        if (s == 0) fence_part();
        wgmma_fence();
        wgmma_m64n64k16_rs(part, a[s % 2], desc(s), s > 0);
        wgmma_commit();
        wgmma_wait<1>();
      }
      wgmma_wait<0>();
      fence_part();
      add_scaled(*reinterpret_cast<const float*>(st + St::scales + 4 * rl),
                 *reinterpret_cast<const float*>(st + St::scales + 4 * (rl + 8)));
    }
  }
  cp_async_wait<0>();
  if constexpr (WF == kWBf16) {
    wgmma_wait<0>();
    fence_acc();
  }
  // acc[i]: the warpgroup's weight row and token row wgmma_d_coord(tid % 128, i).
  if constexpr (SWIGLU) {
    __syncthreads();  // every warpgroup is done with the ring: it holds the up sums now
    float* up = reinterpret_cast<float*>(qw_smem);  // [32][128]: consecutive threads, consecutive words
    if (wg == 1) {
#pragma unroll
      for (int i = 0; i < 32; ++i) up[i * 128 + tid - 128] = acc[i];
    }
    __syncthreads();
    if (wg == 1) return;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int2 d = wgmma_d_coord(tid, i);  // warpgroup 0
      const int r = d.y, o = o0 + d.x;
      if (r < rows && o < O) act[int64_t(r0 + r) * O + o] = __float2bfloat16_rn(silu_times(acc[i], up[i * 128 + tid]));
    }
  } else {
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int2 d = wgmma_d_coord(tid % 128, i);
      const int r = d.y, o = o0 + 64 * wg + d.x;
      if (r < rows && o < O) out[int64_t(r0 + r) * O + o] = acc[i];
    }
  }
}

// One warpgroup's wgmma m64n64k16, for moe_wgmma_probe: d [64][64] fp32 = a [64][16] (row-major
// bf16) times b^T (b [64][16] row-major: the B operand's 64 columns, K contiguous), with A from
// registers (a_in_smem false) or from shared memory. Both staged as the expert kernel stages its
// operands: 8x8 core matrices, k halves 128 bytes apart, groups of 8 rows 256 bytes apart.
__global__ void __launch_bounds__(128) wgmma_probe_kernel(float* d, const bf16* a, const bf16* b, bool a_in_smem) {
  __shared__ __align__(128) bf16 sa[64 * 16], sb[64 * 16];
  const int tid = int(threadIdx.x);
  for (int i = tid; i < 64 * 16; i += 128) {
    const int r = i / 16, k = i % 16, at = (r / 8) * 128 + (k / 8) * 64 + (r % 8) * 8 + k % 8;
    sa[at] = a[i];
    sb[at] = b[i];
  }
  fence_proxy_async_shared();
  __syncthreads();
  float acc[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0.f;
  const uint64_t db = wgmma_desc_k_major(smem_addr(sb), 128, 256);
#pragma unroll
  for (int i = 0; i < 32; ++i) wgmma_reg_fence(acc[i]);
  wgmma_fence();
  if (a_in_smem) {
    wgmma_m64n64k16_ss(acc, wgmma_desc_k_major(smem_addr(sa), 128, 256), db);
  } else {
    uint32_t regs[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int2 lo = wgmma_a_coord(tid, 2 * q), hi = wgmma_a_coord(tid, 2 * q + 1);
      const bf16 l = a[lo.x * 16 + lo.y], h = a[hi.x * 16 + hi.y];
      regs[q] = uint32_t(*reinterpret_cast<const uint16_t*>(&l)) | uint32_t(*reinterpret_cast<const uint16_t*>(&h)) << 16;
    }
    wgmma_fence();
    wgmma_m64n64k16_rs(acc, regs, db, true);
  }
  wgmma_commit();
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    wgmma_reg_fence(acc[i]);
    const int2 c = wgmma_d_coord(tid, i);
    d[c.x * 64 + c.y] = acc[i];
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }
bool aligned8(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 7) == 0; }

// A count setting of the expert kernels: `value` once set (>= 0, by a test's call or an earlier
// read), else the environment variable `name` (a count, negative read as 0) when set, else `def`.
int64_t count_setting(int64_t& value, const char* name, int64_t def) {
  if (value < 0) {
    const char* e = std::getenv(name);
    value = e && *e ? std::max<int64_t>(0, std::atoll(e)) : def;
  }
  return value;
}

// Routed slots up to which int4 experts take int4_decode_mma_kernel: see moe_int4_mma_max_slots.
int64_t g_int4_mma_max_slots = -1;
int64_t int4_mma_max_slots() { return count_setting(g_int4_mma_max_slots, "TALON_CUDA_MOE_INT4_MMA", kInt4MmaDefaultSlots); }
// TALON_CUDA_MOE_INT4_TILES=1/2: m16 tiles of weight rows a warp of that kernel; else 0 (the
// default): by the rows a pass (int4_mma_launch).
int64_t g_int4_mma_tiles = -1;
int int4_mma_tiles() {
  const int64_t v = count_setting(g_int4_mma_tiles, "TALON_CUDA_MOE_INT4_TILES", 0);
  return v == 1 || v == 2 ? int(v) : 0;
}
// TALON_CUDA_MOE_INT4_SWIGLU=0: the gate and up products apart (default 1: with the SwiGLU in one
// pass; gate_up_swiglu).
int64_t g_int4_mma_swiglu = -1;
bool int4_mma_swiglu() { return count_setting(g_int4_mma_swiglu, "TALON_CUDA_MOE_INT4_SWIGLU", 1) == 1; }
// TALON_CUDA_MOE_INT4_STAGED=0: that kernel's warps load the activations themselves (not staged
// once a block; moe_int4_mma_staged).
int64_t g_int4_mma_staged = -1;
bool int4_mma_staged() { return count_setting(g_int4_mma_staged, "TALON_CUDA_MOE_INT4_STAGED", 1) == 1; }
// TALON_CUDA_MOE_INT4_SPLIT=0|1|2: a tile's passes of that kernel on one block (0), on a block
// each at 32 rows a pass (1, the default), at every pass size (2); moe_int4_mma_split.
int64_t g_int4_mma_split = -1;
int int4_mma_split() {
  const int64_t v = count_setting(g_int4_mma_split, "TALON_CUDA_MOE_INT4_SPLIT", 1);
  return v <= 2 ? int(v) : 1;
}
// TALON_CUDA_MOE_INT4_STAGES=3|4: cp.async stages of the staged kernel; else 0 (the default): by
// the rows a pass (int4_mma_launch).
int64_t g_int4_mma_stages = -1;
int int4_mma_stages() {
  const int64_t v = count_setting(g_int4_mma_stages, "TALON_CUDA_MOE_INT4_STAGES", 0);
  return v == 3 || v == 4 ? int(v) : 0;
}
// TALON_CUDA_MOE_INT4_KSPLIT=n: calls of at most n routed slots (and at most 8 rows an expert)
// split that kernel's reduction over a block's warps (moe_int4_mma_ksplit).
int64_t g_int4_mma_ksplit = -1;
int64_t int4_mma_ksplit_slots() {
  return count_setting(g_int4_mma_ksplit, "TALON_CUDA_MOE_INT4_KSPLIT", kInt4KSplitDefaultSlots);
}
// TALON_CUDA_MOE_INT4_ROWS=8/16/32: rows a pass of that kernel instead of the estimate from the
// mean rows an expert (benchmarks; 0: the estimate).
int64_t g_int4_mma_rows = -1;
int64_t int4_mma_rows() { return count_setting(g_int4_mma_rows, "TALON_CUDA_MOE_INT4_ROWS", 0); }

// TALON_CUDA_MOE_WGMMA=n: calls of at least n routed slots take int4 (group 32), FP8 (K blocks
// of 128) and bf16 experts on the warpgroup kernel (moe_wgmma_min_slots); unset, the measured
// default of each format (kWgmmaDefaultMinSlots*). g_wgmma_state: -1 not yet read, 0 read and
// neither the environment nor a call set it (the per-format default), 1 set to g_wgmma_min_slots
// (any count, the largest included, so a huge n always means never).
int64_t g_wgmma_min_slots = 0;
int g_wgmma_state = -1;
int64_t wgmma_min_slots(int64_t fallback) {
  if (g_wgmma_state < 0) {
    const char* e = std::getenv("TALON_CUDA_MOE_WGMMA");
    g_wgmma_state = e && *e ? 1 : 0;
    if (g_wgmma_state) g_wgmma_min_slots = std::max<int64_t>(0, std::atoll(e));
  }
  return g_wgmma_state ? g_wgmma_min_slots : fallback;
}
// TALON_CUDA_MOE_GRID_GROUP=n: the tile and int4 decode kernels' grids in groups of n tiles
// (moe_grid_group); default 0, the plain order.
int64_t g_grid_group = -1;
int64_t grid_group_tiles() { return count_setting(g_grid_group, "TALON_CUDA_MOE_GRID_GROUP", 0); }
// TALON_CUDA_MOE_WGMMA_GROUP=n: tiles that take each weight block side by side (moe_wgmma_group).
int64_t g_wgmma_order = -1;
int64_t wgmma_group() { return std::max<int64_t>(1, count_setting(g_wgmma_order, "TALON_CUDA_MOE_WGMMA_GROUP", kWgmmaDefaultGroup)); }

// Routed slots (N x top-k) up to which moe_forward takes the decode-sized kernel: see
// moe_skinny_max_slots in moe.h.
int64_t g_skinny_max_slots = -1;
int64_t skinny_max_slots() { return count_setting(g_skinny_max_slots, "TALON_CUDA_MOE_SKINNY", kSkinnyDefaultSlots); }

// rows[p] = in[order[p] / K], ids[p] = idx[order[p]] % per_rank.
__global__ void gather_sorted_kernel(bf16* rows, int32_t* ids, const bf16* in, const int32_t* order, const int32_t* idx,
                                     int K, int per_rank, int64_t H) {
  const int p = blockIdx.x, slot = order[p];
  const bf16* src = in + int64_t(slot / K) * H;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) rows[int64_t(p) * H + h] = src[h];
  if (threadIdx.x == 0) ids[p] = idx[slot] % per_rank;
}

// rows[p] = in[order[p] / K] (bf16 rows of H, `in` rows ld apart): the routed rows in sorted order.
__global__ void gather_rows_kernel(bf16* rows, const bf16* in, int64_t ld, const int32_t* order, int K, int64_t H) {
  const int p = blockIdx.x;
  const bf16* src = in + int64_t(order[p] / K) * ld;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) rows[int64_t(p) * H + h] = src[h];
}

// out[i] = in[pos[i]] (rows of H fp32).
__global__ void unsort_kernel(float* out, const float* in, const int32_t* pos, int64_t H) {
  const int i = blockIdx.x;
  const float* src = in + int64_t(pos[i]) * H;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) out[int64_t(i) * H + h] = src[h];
}

// Whether int4_decode_mma_kernel takes an int4 expert product of `slots` routed rows.
bool int4_mma_fits(const ExpertMatrix& m, const bf16* in, int64_t ld_in, int64_t slots, int64_t max_rows) {
  return m.packed && m.scale && slots <= int4_mma_max_slots() &&
         (max_rows > 1 || slots > skinny_max_slots() || slots <= int4_mma_ksplit_slots()) &&
         m.group == 32 && m.I % kQmK == 0 && ld_in % 8 == 0 && aligned16(in) && aligned16(m.packed) && aligned8(m.scale);
}

// Launches int4_decode_mma_kernel: out = in @ m^T, or with m2 (the up projection of gate m)
// act = silu(in @ m^T) * (in @ m2^T) in bf16.
void int4_mma_launch(float* out, bf16* act, const bf16* in, int64_t ld_in, bool gather, const MoeScratch& sc, int K,
                     int64_t max_tiles, int64_t slots, int64_t max_rows, int E, const ExpertMatrix& m,
                     const ExpertMatrix& m2, cudaStream_t s) {
  // Rows a pass (at most the call's tokens): 16 while 1.5x the mean rows an expert is below 16,
  // else 32 (each token fragment a pass holds costs registers and shared memory, and so blocks
  // an SM; experts past it take another pass, mostly from L2). Measured on an H100, Kimi-K2
  // layer, activations staged: 256 tokens 5.31 ms with 16 rows against 6.23 with 8; 512 tokens
  // 5.79 with 32 (3 stages) against 6.05 with 16; 1,024 tokens 6.64 with 32 against 11.2 with 16.
  const int64_t mean15 = 3 * slots / (2 * std::max<int64_t>(E, 1));
  const int64_t rows = std::min(max_rows, int4_mma_rows() > 0 ? int4_mma_rows() : mean15 < 16 ? 16 : 32);
  const int nf = rows <= 8 ? 1 : rows <= 16 ? 2 : 4;  // token fragments (8 rows each) a pass
  const bool swiglu = m2.packed != nullptr;
  // Weight rows a warp: 32 (two m16 tiles sharing the activation loads) past 8 rows a pass, where
  // the activations weigh as much as the weights (H100, unstaged: 512 tokens 8.6 ms against 9.6
  // with 16 rows a warp, 1024 tokens 11.8 against 14.3; staged, 256 tokens at 16 rows a pass:
  // 5.42 against 5.80); 16 below. The fused gate|up pass always holds 16 rows of each.
  const int mt = swiglu ? 2 : int4_mma_tiles() > 0 ? int4_mma_tiles() : rows > 8 ? 2 : 1;
  // Few tiles: the reduction split over the block's warps (KS), 16 weight rows a block (H100: one
  // token 0.21 ms a layer, two 0.34, against 0.33 and 0.40 without).
  const bool ksplit = !swiglu && mt == 1 && slots <= int4_mma_ksplit_slots() && max_rows <= 8;
  const int64_t block_rows = ksplit ? 16 : kQmWarps * 16 * (swiglu ? 1 : mt);
  // Blocks a tile: one a pass of its rows (up to 4) where the passes split, else one.
  const int64_t pass_rows = 8 * nf;
  const bool split = int4_mma_split() == 2 || (int4_mma_split() == 1 && nf == 4);
  const int splits = split ? int((std::min<int64_t>(max_rows, kTileRows) + pass_rows - 1) / pass_rows) : 1;
  const GridLaunch grid = grouped_grid(std::min(max_tiles, slots) * splits, (m.O + block_rows - 1) / block_rows,
                                       ksplit ? 0 : grid_group_tiles() * splits);
  const bool staged = !ksplit && int4_mma_staged();
  // Dynamic shared memory: each warp's weight ring, then (staged) the block's activation ring.
  // Stages: 3 at 32 rows a pass, where shared memory (85 KB a block with 4) would hold an SM to
  // two blocks, 4 below (H100, Kimi-K2 layer: 1,024 tokens 6.64 ms against 7.66 with 4, 8,192
  // tokens 35.9 against 43.8; 256 tokens at 16 rows a pass 5.31 against 5.43 with 3).
  const int stages = !staged ? kQmStages : int4_mma_stages() > 0 ? int4_mma_stages() : nf == 4 ? 3 : kQmStages;
  auto go = [&](auto kernel) {
    const size_t weights = size_t(kQmWarps) * stages * (ksplit || mt == 1 ? QmStage<1>::bytes : QmStage<2>::bytes);
    const size_t bytes = weights + (staged ? size_t(stages) * 8 * nf * kQmXRowBytes : 0);
    if (bytes > 48 * 1024) CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    kernel<<<grid.blocks, kQmWarps * 32, bytes, s>>>(out, act, in, ld_in, sc.order, K, sc.tiles, sc.n_tiles,
                                                     sc.offsets, m, m2, splits, grid.g);
  };
  auto pick = [&](auto nf) {
    constexpr int NF = decltype(nf)::value;
    // The kernel of NF token fragments for gather G, MT weight tiles a warp and SWIGLU SW: warps
    // loading their activations, or staged with 4 or 3 stages.
    auto launch = [&](auto g_c, auto mt_c, auto sw_c) {
      constexpr bool G = decltype(g_c)::value, SW = decltype(sw_c)::value;
      constexpr int MT = decltype(mt_c)::value;
      if (!staged)
        go(int4_decode_mma_kernel<G, NF, MT, SW>);
      else if (stages == 3)
        go(int4_decode_mma_kernel<G, NF, MT, SW, 1, true, 3>);
      else
        go(int4_decode_mma_kernel<G, NF, MT, SW, 1, true>);
    };
    auto by_gather = [&](auto mt_c, auto sw_c) {
      gather ? launch(std::true_type{}, mt_c, sw_c) : launch(std::false_type{}, mt_c, sw_c);
    };
    if (ksplit)
      gather ? go(int4_decode_mma_kernel<true, 1, 1, false, kQmWarps>) : go(int4_decode_mma_kernel<false, 1, 1, false, kQmWarps>);
    else if (swiglu)
      by_gather(std::integral_constant<int, 2>{}, std::true_type{});
    else if (mt == 2)
      by_gather(std::integral_constant<int, 2>{}, std::false_type{});
    else
      by_gather(std::integral_constant<int, 1>{}, std::false_type{});
  };
  if (nf == 1)
    pick(std::integral_constant<int, 1>{});
  else if (nf == 2)
    pick(std::integral_constant<int, 2>{});
  else
    pick(std::integral_constant<int, 4>{});
  CUDA_LAUNCH_CHECK();
}

// Whether wgmma_grouped_kernel takes an expert product of `slots` routed rows: int4 of group 32
// or FP8 with K blocks a multiple of 128 (I % 128 == 0), or bf16 (I % 64 == 0), aligned rows.
bool wgmma_fits(const ExpertMatrix& m, const bf16* in, int64_t ld_in, int64_t slots) {
  const bool int4 = m.packed && m.scale && m.group == 32 && aligned16(m.packed) && aligned8(m.scale) && m.I % kQmK == 0;
  const bool fp8 = m.fp8 && m.block_scale && m.bo > 0 && m.bi > 0 && m.bi % kQmK == 0 && aligned16(m.fp8) &&
                   (reinterpret_cast<uintptr_t>(m.block_scale) & 3) == 0 && m.I % kQmK == 0;
  const bool bf = m.w && aligned16(m.w) && m.I % QwStage<kWBf16>::k == 0;
  const int64_t fallback = fp8 ? kWgmmaDefaultMinSlotsFp8 : int4 ? kWgmmaDefaultMinSlotsInt4 : kWgmmaNever;
  return (int4 || fp8 || bf) && slots > 0 && slots >= wgmma_min_slots(fallback) && ld_in % 8 == 0 && aligned16(in);
}

// Launches wgmma_grouped_kernel: out = in @ m^T, or with m2 (the up projection of gate m, in the
// same form) act = silu(in @ m^T) * (in @ m2^T) in bf16.
void wgmma_launch(float* out, bf16* act, const bf16* in, int64_t ld_in, bool gather, const MoeScratch& sc, int K,
                  int64_t max_tiles, int64_t slots, const ExpertMatrix& m, const ExpertMatrix& m2, cudaStream_t s) {
  const bool swiglu = m2.packed != nullptr || m2.fp8 != nullptr || m2.w != nullptr;
  const int64_t grid_tiles = std::min(max_tiles, slots);
  const int64_t o_blocks = (m.O + (swiglu ? kQwRows / 2 : kQwRows) - 1) / (swiglu ? kQwRows / 2 : kQwRows);
  if (grid_tiles <= 0 || o_blocks <= 0) return;
  const GridLaunch grid = grouped_grid(grid_tiles, o_blocks, wgmma_group());
  auto go = [&](auto kernel, size_t bytes) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    kernel<<<grid.blocks, kQwThreads, bytes, s>>>(out, act, in, ld_in, sc.order, K, sc.tiles, sc.n_tiles,
                                                  sc.offsets, m, m2, grid.g);
  };
  auto pick = [&](auto wf) {
    constexpr int WF = decltype(wf)::value;
    constexpr size_t bytes = size_t(QwStage<WF>::count) * QwStage<WF>::bytes;
    if (swiglu)
      gather ? go(wgmma_grouped_kernel<WF, true, true>, bytes) : go(wgmma_grouped_kernel<WF, false, true>, bytes);
    else
      gather ? go(wgmma_grouped_kernel<WF, true, false>, bytes) : go(wgmma_grouped_kernel<WF, false, false>, bytes);
  };
  if (m.packed)
    pick(std::integral_constant<int, kWInt4>{});
  else if (m.fp8)
    pick(std::integral_constant<int, kWFp8>{});
  else
    pick(std::integral_constant<int, kWBf16>{});
  CUDA_LAUNCH_CHECK();
}

// slots: the routed rows of this call (NK); a non-empty tile holds at least one, so the grid
// needs at most min(max_tiles, slots) tiles.
// max_rows: a bound on any expert's rows (the token count: a token reaches an expert once).
void grouped_gemm(float* out, const bf16* in, int64_t ld_in, bool gather, const MoeScratch& sc, int K, int64_t max_tiles,
                  int64_t slots, int64_t max_rows, int E, const ExpertMatrix& m, cudaStream_t s) {
  const bool int4 = m.packed != nullptr, fp8 = m.fp8 != nullptr;
  if (int(int4) + int(fp8) + int(m.w != nullptr) != 1)
    fail_msg("moe: expert weights need exactly one of bf16, int4 and fp8 storage");
  if (int4 && (m.group <= 0 || !m.scale)) fail_msg("moe: int4 expert weights need a group size and scales");
  if (fp8 && (m.bo <= 0 || m.bi <= 0 || !m.block_scale)) fail_msg("moe: fp8 expert weights need block sizes and scales");
  max_tiles = std::min(max_tiles, slots);
  if (wgmma_fits(m, in, ld_in, slots)) {
    wgmma_launch(out, nullptr, in, ld_in, gather, sc, K, max_tiles, slots, m, ExpertMatrix{}, s);
    return;
  }
  if (int4_mma_fits(m, in, ld_in, slots, max_rows)) {
    int4_mma_launch(out, nullptr, in, ld_in, gather, sc, K, max_tiles, slots, max_rows, E, m, ExpertMatrix{}, s);
    return;
  }
  const bool skinny_fits = !fp8 && slots <= skinny_max_slots() && ld_in % 8 == 0 && aligned16(in) &&
                           (int4 ? m.I % 32 == 0 && m.group % 8 == 0 && aligned16(m.packed) : m.I % 8 == 0 && aligned16(m.w));
  if (skinny_fits) {
    const dim3 grid(static_cast<unsigned>(max_tiles), static_cast<unsigned>((m.O + kSkCols - 1) / kSkCols));
    auto go = [&](auto kernel) {
      kernel<<<grid, kSkWarps * 32, 0, s>>>(out, in, ld_in, sc.order, K, sc.tiles, sc.n_tiles, sc.offsets, m);
    };
    auto pick = [&](auto rows) {
      constexpr int R = decltype(rows)::value;
      if (int4)
        gather ? go(skinny_grouped_kernel<kWInt4, true, R>) : go(skinny_grouped_kernel<kWInt4, false, R>);
      else
        gather ? go(skinny_grouped_kernel<kWBf16, true, R>) : go(skinny_grouped_kernel<kWBf16, false, R>);
    };
    if (max_rows <= 1)
      pick(std::integral_constant<int, 1>{});
    else if (max_rows <= 2)
      pick(std::integral_constant<int, 2>{});
    else if (max_rows <= 4)
      pick(std::integral_constant<int, 4>{});
    else
      pick(std::integral_constant<int, 8>{});
    CUDA_LAUNCH_CHECK();
    return;
  }
  // TALON_MOE_GEMM=cutlass: bf16 experts on CUTLASS's wgmma/TMA grouped GEMM, which reads each
  // expert's rows as one contiguous block (gathered first when they come from the tokens).
  if (m.w && moe_cutlass_requested()) {
    const bf16* a = in;
    if (gather || ld_in != m.I) {
      bf16* rows = moe_cutlass_rows(slots * m.I, s);
      if (gather) {
        gather_rows_kernel<<<unsigned(slots), 256, 0, s>>>(rows, in, ld_in, sc.order, K, m.I);
        CUDA_LAUNCH_CHECK();
      } else {
        CUDA_CHECK(cudaMemcpy2DAsync(rows, size_t(m.I) * 2, in, size_t(ld_in) * 2, size_t(m.I) * 2, size_t(slots),
                                     cudaMemcpyDeviceToDevice, s));
      }
      a = rows;
    }
    if (moe_cutlass_fits(a, m.w, out, m.O, m.I)) {
      moe_cutlass_grouped_gemm(out, a, m.w, sc.offsets, E, m.O, m.I, s);
      return;
    }
  }
  if (int4 ? m.group % 16 == 0 : fp8 ? m.bi % 16 == 0 : true) {
    const GridLaunch grid = grouped_grid(max_tiles, (m.O + kTcCols - 1) / kTcCols, grid_group_tiles());
    const bool vec_a = ld_in % 8 == 0 && m.I % 8 == 0 && aligned16(in);
    const bool vec_b = int4  ? ((m.I + 7) / 8) % 4 == 0 && aligned16(m.packed)
                       : fp8 ? m.I % 16 == 0 && aligned16(m.fp8)
                             : m.I % 8 == 0 && aligned16(m.w);
    auto go = [&](auto kernel, size_t smem) {
      if (smem > 48 * 1024)
        CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      kernel<<<grid.blocks, kTcThreads, smem, s>>>(out, in, ld_in, sc.order, K, sc.tiles, sc.n_tiles, sc.offsets, m,
                                                   vec_a, vec_b, grid.g);
    };
    if (int4)
      gather ? go(tc_grouped_gemm_kernel<kWInt4, true>, TcStage<kWInt4>::smem)
             : go(tc_grouped_gemm_kernel<kWInt4, false>, TcStage<kWInt4>::smem);
    else if (fp8)
      gather ? go(tc_grouped_gemm_kernel<kWFp8, true>, TcStage<kWFp8>::smem)
             : go(tc_grouped_gemm_kernel<kWFp8, false>, TcStage<kWFp8>::smem);
    else
      gather ? go(tc_grouped_gemm_kernel<kWBf16, true>, TcStage<kWBf16>::smem)
             : go(tc_grouped_gemm_kernel<kWBf16, false>, TcStage<kWBf16>::smem);
  } else {
    const dim3 grid(unsigned(max_tiles), unsigned((m.O + kCoreCols - 1) / kCoreCols));
    auto go = [&](auto kernel) {
      kernel<<<grid, 256, 0, s>>>(out, in, ld_in, sc.order, K, sc.tiles, sc.n_tiles, sc.offsets, m);
    };
    if (int4)
      gather ? go(core_grouped_gemm_kernel<kWInt4, true>) : go(core_grouped_gemm_kernel<kWInt4, false>);
    else
      gather ? go(core_grouped_gemm_kernel<kWFp8, true>) : go(core_grouped_gemm_kernel<kWFp8, false>);
  }
  CUDA_LAUNCH_CHECK();
}

// The MoE's gate and up products and SwiGLU into sc.act: one pass of int4_decode_mma_kernel when
// both are int4 and it takes them and TALON_CUDA_MOE_INT4_SWIGLU (moe_int4_mma_swiglu) is on;
// else the two grouped products and launch_swiglu_forward.
void gate_up_swiglu(const bf16* in, int64_t ld_in, bool gather, const MoeScratch& sc, int K, int64_t max_tiles,
                    int64_t slots, int64_t max_rows, int E, const MoeExperts& ex, cudaStream_t s) {
  const int64_t Im = ex.gate.O;
  if (int4_mma_swiglu() && wgmma_fits(ex.gate, in, ld_in, slots) && wgmma_fits(ex.up, in, ld_in, slots) &&
      (ex.gate.packed != nullptr) == (ex.up.packed != nullptr) && (ex.gate.fp8 != nullptr) == (ex.up.fp8 != nullptr)) {
    wgmma_launch(nullptr, sc.act, in, ld_in, gather, sc, K, max_tiles, slots, ex.gate, ex.up, s);
    return;
  }
  if (int4_mma_swiglu() && int4_mma_fits(ex.gate, in, ld_in, slots, max_rows) &&
      int4_mma_fits(ex.up, in, ld_in, slots, max_rows)) {
    int4_mma_launch(nullptr, sc.act, in, ld_in, gather, sc, K, max_tiles, slots, max_rows, E, ex.gate, ex.up, s);
    return;
  }
  grouped_gemm(sc.g, in, ld_in, gather, sc, K, max_tiles, slots, max_rows, E, ex.gate, s);
  grouped_gemm(sc.u, in, ld_in, gather, sc, K, max_tiles, slots, max_rows, E, ex.up, s);
  launch_swiglu_forward(sc.act, sc.g, sc.u, Im, slots, Im, s);
}

// TALON_MOE_GEMM=cutlass with bf16 experts past the decode-sized calls: the routed rows gathered
// once into sorted order (CUTLASS reads each expert's rows as one block), for both the gate and
// the up product; null otherwise (grouped_gemm then gathers as it reads).
const bf16* cutlass_sorted_rows(const bf16* in, int64_t ld, int K, int64_t slots, const ExpertMatrix& m,
                                const MoeScratch& sc, cudaStream_t s) {
  if (!m.w || !moe_cutlass_requested() || slots <= skinny_max_slots() || slots == 0) return nullptr;
  bf16* rows = moe_cutlass_rows(slots * m.I, s);
  gather_rows_kernel<<<unsigned(slots), 256, 0, s>>>(rows, in, ld, sc.order, K, m.I);
  CUDA_LAUNCH_CHECK();
  return rows;
}

dim3 combine_grid(int64_t N, int64_t H) {
  return dim3(static_cast<unsigned>(N),
              static_cast<unsigned>(std::clamp<int64_t>(256 / std::max<int64_t>(N, 1), 1, (H + 255) / 256)));
}

int64_t max_tiles(int64_t NK, int64_t E) { return (NK + kTileRows - 1) / kTileRows + E; }

}  // namespace

void moe_skinny_max_slots(int64_t slots) { g_skinny_max_slots = std::max<int64_t>(0, slots); }
void moe_int4_mma_max_slots(int64_t slots) { g_int4_mma_max_slots = slots < 0 ? -1 : slots; }
void moe_int4_mma_tiles(int tiles) { g_int4_mma_tiles = tiles == 1 || tiles == 2 ? tiles : -1; }
void moe_int4_mma_swiglu(int on) { g_int4_mma_swiglu = on == 0 || on == 1 ? on : -1; }
void moe_int4_mma_ksplit(int64_t slots) { g_int4_mma_ksplit = slots < 0 ? -1 : slots; }
void moe_int4_mma_staged(int on) { g_int4_mma_staged = on == 0 || on == 1 ? on : -1; }
void moe_int4_mma_split(int mode) { g_int4_mma_split = mode >= 0 && mode <= 2 ? mode : -1; }
void moe_wgmma_min_slots(int64_t slots) {
  g_wgmma_min_slots = std::max<int64_t>(slots, 0);
  g_wgmma_state = slots < 0 ? -1 : 1;
}
void moe_wgmma_group(int64_t tiles) { g_wgmma_order = tiles < 1 ? -1 : tiles; }
void moe_grid_group(int64_t tiles) { g_grid_group = tiles < 0 ? -1 : tiles; }

uint64_t moe_wgmma_k_major_desc(uint32_t addr, int sbo_bytes) { return wgmma_desc_k_major(addr, 128, uint32_t(sbo_bytes)); }
std::vector<float> moe_wgmma_probe(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, bool a_in_smem) {
  if (a.size() != 64 * 16 || b.size() != 64 * 16) fail_msg("moe_wgmma_probe: a and b must be 64 x 16");
  bf16 *da = nullptr, *db = nullptr;
  float* dd = nullptr;
  CUDA_CHECK(cudaMalloc(&da, a.size() * 2));
  CUDA_CHECK(cudaMalloc(&db, b.size() * 2));
  CUDA_CHECK(cudaMalloc(&dd, 64 * 64 * 4));
  CUDA_CHECK(cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemset(dd, 0xff, 64 * 64 * 4));  // NaN where nothing is stored
  wgmma_probe_kernel<<<1, 128>>>(dd, da, db, a_in_smem);
  CUDA_LAUNCH_CHECK();
  std::vector<float> d(64 * 64);
  CUDA_CHECK(cudaMemcpy(d.data(), dd, d.size() * 4, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaFree(da));
  CUDA_CHECK(cudaFree(db));
  CUDA_CHECK(cudaFree(dd));
  return d;
}

std::pair<int, int> moe_wgmma_a_coord(int tid, int v) {
  const int2 c = wgmma_a_coord(tid, v);
  return {c.x, c.y};
}
std::pair<int, int> moe_wgmma_d_coord(int tid, int i) {
  const int2 c = wgmma_d_coord(tid, i);
  return {c.x, c.y};
}
int moe_wgmma_stage_sbo(int form) {
  return form == 0 ? QwStage<kWBf16>::sbo : form == 1 ? QwStage<kWInt4>::sbo : QwStage<kWFp8>::sbo;
}

MoeGridLaunch moe_grid_launch(int64_t gx, int64_t gy, int64_t group) {
  const GridLaunch l = grouped_grid(gx, gy, group);
  return {int64_t(l.blocks.x) * l.blocks.y, l.g.group};
}

std::pair<int64_t, int64_t> moe_grid_block(int64_t b, int64_t gx, int64_t gy, int64_t group) {
  if (group == 0) return {b % gx, b / gx};  // the two-dimensional launch, x fastest
  const int2 xy = GroupedGrid::of(int(b), int(gy), int(group));
  return {xy.x, xy.y};
}

MoeScratchSizes moe_scratch_elems(int64_t n, const MoeRouting& r, int64_t H, int64_t Im) {
  const int64_t NK = n * r.top_k;
  return {NK, NK, NK, r.n_experts + 1, 2 * max_tiles(NK, r.n_experts) + 1, NK, NK * Im, NK * H, NK * Im};
}

void moe_route(int32_t* idx, float* weights, const float* logits, const float* bias, int64_t N, const MoeRouting& r,
               cudaStream_t s) {
  if (N == 0) return;
  const int E = r.n_experts;
  if (E <= 0 || E > kMaxExperts) fail_msg("moe: " + std::to_string(E) + " experts (1.." + std::to_string(kMaxExperts) + ")");
  if (r.top_k < 1 || r.top_k > 16 || r.top_k > E) fail_msg("moe: top-k " + std::to_string(r.top_k) + " (1..16, <= experts)");
  const bool grouped = r.method != MoeTopk::Greedy;
  if (grouped && (r.n_group < 1 || r.n_group > 32 || E % r.n_group || r.topk_group < 1 || r.topk_group > r.n_group ||
                  (r.method == MoeTopk::NoauxTc && E / r.n_group < 2)))
    fail_msg("moe: n_group " + std::to_string(r.n_group) + " / topk_group " + std::to_string(r.topk_group) +
             " unsupported for " + std::to_string(E) + " experts (n_group <= 32 dividing them)");
  const size_t smem = size_t(3 * E) * 4;
  route_kernel<<<unsigned(N), 32, smem, s>>>(idx, weights, logits, bias, E, r.top_k, r.scoring == MoeScoring::Sigmoid, int(r.method),
                                             grouped ? r.n_group : 1, grouped ? r.topk_group : 1, r.norm_topk,
                                             r.routed_scale);
  CUDA_LAUNCH_CHECK();
}

void moe_forward(float* out, const bf16* xn, const float* router_logits, const float* bias, int64_t N, int64_t H,
                 const MoeRouting& r, const MoeExperts& ex, const MoeScratch& sc, cudaStream_t s) {
  if (N == 0) return;
  if (N > sc.capacity) fail_msg("moe: " + std::to_string(N) + " tokens, scratch for " + std::to_string(sc.capacity));
  const int K = r.top_k;
  const int64_t NK = N * K, Im = ex.gate.O;
  if (ex.gate.I != H || ex.up.O != Im || ex.up.I != H || ex.down.O != H || ex.down.I != Im)
    fail_msg("moe: expert matrix shapes disagree with H " + std::to_string(H));
  moe_route(sc.idx, sc.weights, router_logits, bias, N, r, s);
  sort_kernel<<<1, 1024, 0, s>>>(sc.order, sc.pos, sc.offsets, sc.tiles, sc.n_tiles, sc.idx, int(NK), r.n_experts);
  CUDA_LAUNCH_CHECK();
  const int64_t T = max_tiles(NK, r.n_experts);
  const bf16* sorted = cutlass_sorted_rows(xn, H, K, NK, ex.gate, sc, s);
  gate_up_swiglu(sorted ? sorted : xn, H, !sorted, sc, K, T, NK, N, r.n_experts, ex, s);
  grouped_gemm(sc.y, sc.act, Im, false, sc, K, T, NK, N, r.n_experts, ex.down, s);
  combine_kernel<<<combine_grid(N, H), 256, 0, s>>>(out, sc.y, sc.weights, sc.pos, K, H);
  CUDA_LAUNCH_CHECK();
}

void moe_route_sort(const float* router_logits, const float* bias, int64_t N, const MoeRouting& r,
                    const MoeScratch& sc, cudaStream_t s) {
  if (N == 0) return;
  if (N > sc.capacity) fail_msg("moe: " + std::to_string(N) + " tokens, scratch for " + std::to_string(sc.capacity));
  moe_route(sc.idx, sc.weights, router_logits, bias, N, r, s);
  sort_kernel<<<1, 1024, 0, s>>>(sc.order, sc.pos, sc.offsets, sc.tiles, sc.n_tiles, sc.idx, int(N * r.top_k),
                                 r.n_experts);
  CUDA_LAUNCH_CHECK();
}

void moe_gather_sorted(bf16* rows, int32_t* ids, const bf16* xn, int64_t H, int K, int64_t NK, int per_rank,
                       const MoeScratch& sc, cudaStream_t s) {
  if (NK == 0) return;
  gather_sorted_kernel<<<unsigned(NK), 256, 0, s>>>(rows, ids, xn, sc.order, sc.idx, K, per_rank, H);
  CUDA_LAUNCH_CHECK();
}

void moe_experts_forward(float* y, const bf16* rows, const int32_t* ids, int64_t R, int64_t H, int E_local,
                         const MoeExperts& ex, const MoeScratch& sc, cudaStream_t s) {
  if (R == 0) return;
  if (R > sc.capacity) fail_msg("moe: " + std::to_string(R) + " rows, scratch for " + std::to_string(sc.capacity));
  if (E_local < 1 || E_local > kMaxExperts) fail_msg("moe: " + std::to_string(E_local) + " local experts");
  const int64_t Im = ex.gate.O;
  if (ex.gate.I != H || ex.up.O != Im || ex.up.I != H || ex.down.O != H || ex.down.I != Im)
    fail_msg("moe: expert matrix shapes disagree with H " + std::to_string(H));
  // Top-1 "routing" given by ids: group the rows by local expert, then moe_forward's GEMMs.
  sort_kernel<<<1, 1024, 0, s>>>(sc.order, sc.pos, sc.offsets, sc.tiles, sc.n_tiles, ids, int(R), E_local);
  CUDA_LAUNCH_CHECK();
  const int64_t T = max_tiles(R, E_local);
  const bf16* sorted = cutlass_sorted_rows(rows, H, 1, R, ex.gate, sc, s);
  gate_up_swiglu(sorted ? sorted : rows, H, !sorted, sc, 1, T, R, R, E_local, ex, s);
  grouped_gemm(sc.y, sc.act, Im, false, sc, 1, T, R, R, E_local, ex.down, s);
  unsort_kernel<<<unsigned(R), 256, 0, s>>>(y, sc.y, sc.pos, H);
  CUDA_LAUNCH_CHECK();
}

void moe_combine(float* out, const float* y, int64_t N, int64_t H, int K, const MoeScratch& sc, cudaStream_t s) {
  if (N == 0) return;
  combine_kernel<<<combine_grid(N, H), 256, 0, s>>>(out, y, sc.weights, sc.pos, K, H);
  CUDA_LAUNCH_CHECK();
}

}  // namespace talon::cuda
