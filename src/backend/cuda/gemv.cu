// Skinny products for decoding (ops.h: skinny_gemm): out[N, O] = in[N, K] @ w[O, K]^T with
// N <= kSkinnyMaxRows, where every weight byte is read once and the time is the weight's
// bytes over the memory bandwidth. cuBLAS picks tiles made for wide N here and reads the
// smaller matrices at half the bandwidth; this kernel gives each warp one output column
// (a weight row), streamed in 16-byte loads with several in flight per lane, and keeps one
// fp32 accumulator per input row.
#include <cstdint>
#include <type_traits>

#include "backend/cuda/check.h"
#include "backend/cuda/decode_ops.h"
#include "backend/cuda/kernels/reduce.cuh"
#include "backend/cuda/kernels/swiglu.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/ops.h"
#include "backend/cuda/warp.cuh"

namespace talon::cuda {

namespace {

constexpr int kGemvWarps = 8;  // output columns per block
constexpr int kUnroll = 4;     // 16-byte weight loads in flight per lane
constexpr int kPrefetch = 8;   // 16-byte weight loads per lane issued before the inputs are ready

__device__ __forceinline__ float lo_bf16(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_bf16(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ float dot8(const uint4& a, const uint4& b) {
  return lo_bf16(a.x) * lo_bf16(b.x) + hi_bf16(a.x) * hi_bf16(b.x) + lo_bf16(a.y) * lo_bf16(b.y) +
         hi_bf16(a.y) * hi_bf16(b.y) + lo_bf16(a.z) * lo_bf16(b.z) + hi_bf16(a.z) * hi_bf16(b.z) +
         lo_bf16(a.w) * lo_bf16(b.w) + hi_bf16(a.w) * hi_bf16(b.w);
}

// silu(g) * u of 8 bf16 pairs, rounded to bf16 as swiglu_forward rounds them.
__device__ __forceinline__ uint32_t swiglu2(uint32_t g, uint32_t u) {
  const __nv_bfloat162 r = __floats2bfloat162_rn(silu_times(lo_bf16(g), lo_bf16(u)), silu_times(hi_bf16(g), hi_bf16(u)));
  return *reinterpret_cast<const uint32_t*>(&r);
}
__device__ __forceinline__ uint4 swiglu8(const uint4& g, const uint4& u) {
  return uint4{swiglu2(g.x, u.x), swiglu2(g.y, u.y), swiglu2(g.z, u.z), swiglu2(g.w, u.w)};
}

__device__ __forceinline__ void store_out(bf16* p, float v) { *p = __float2bfloat16(v); }
__device__ __forceinline__ void store_out(float* p, float v) { *p = v; }

// Warp w of block b: column o = b * kGemvWarps + w. K8 = K / 8 chunks of 16 bytes. The first
// kPrefetch chunks of each lane's weights are loaded before grid_dependency_wait(): launched
// with launch_dependent, the kernel streams weights while the kernel before it finishes.
template <int kN, class Out>
__global__ void __launch_bounds__(kGemvWarps * 32) skinny_kernel(Out* out, const uint4* in, const uint4* w, int K8, int O) {
  allow_dependents();
  const int lane = threadIdx.x % 32;
  const int o = blockIdx.x * kGemvWarps + threadIdx.x / 32;
  if (o >= O) {
    grid_dependency_wait();
    return;
  }
  const uint4* wr = w + int64_t(o) * K8;
  uint4 pre[kPrefetch];
#pragma unroll
  for (int u = 0; u < kPrefetch; ++u) pre[u] = lane + 32 * u < K8 ? __ldcs(wr + lane + 32 * u) : uint4{};
  grid_dependency_wait();
  float acc[kN];
#pragma unroll
  for (int n = 0; n < kN; ++n) acc[n] = 0.f;
#pragma unroll
  for (int u = 0; u < kPrefetch; ++u)
    if (lane + 32 * u < K8)
#pragma unroll
      for (int n = 0; n < kN; ++n) acc[n] += dot8(pre[u], __ldg(in + int64_t(n) * K8 + lane + 32 * u));
  int c = lane + 32 * kPrefetch;
  for (; c + 32 * (kUnroll - 1) < K8; c += 32 * kUnroll) {
    uint4 wv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) wv[u] = __ldcs(wr + c + 32 * u);  // streamed: read once
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int n = 0; n < kN; ++n) acc[n] += dot8(wv[u], __ldg(in + int64_t(n) * K8 + c + 32 * u));
  }
  for (; c < K8; c += 32) {
    const uint4 wv = __ldcs(wr + c);
#pragma unroll
    for (int n = 0; n < kN; ++n) acc[n] += dot8(wv, __ldg(in + int64_t(n) * K8 + c));
  }
#pragma unroll
  for (int n = 0; n < kN; ++n) {
    const float v = warp_sum(acc[n]);
    if (lane == 0) store_out(out + int64_t(n) * O + o, v);
  }
}

// Short rows and many columns (an LM head over a small hidden size: K8 <= kShortChunks * 32,
// O >= kShortMinO): each lane has at most kShortChunks weight loads per column, too few to
// cover the memory latency, so a warp takes kShortCols columns and issues all their loads at
// once. Each column's sums run in skinny_kernel's order (chunks lane, lane + 32, ..., then
// the warp's butterfly), so the bits are skinny_kernel's.
constexpr int kShortCols = 4, kShortChunks = 3;
constexpr int64_t kShortMinO = 8192;

template <int kN, class Out>
__global__ void __launch_bounds__(kGemvWarps * 32) skinny_short_kernel(Out* out, const uint4* in, const uint4* w, int K8,
                                                                       int O) {
  allow_dependents();
  const int lane = threadIdx.x % 32;
  const int o0 = (blockIdx.x * kGemvWarps + threadIdx.x / 32) * kShortCols;
  uint4 wv[kShortCols][kShortChunks];
#pragma unroll
  for (int j = 0; j < kShortCols; ++j)
#pragma unroll
    for (int u = 0; u < kShortChunks; ++u)
      wv[j][u] = o0 + j < O && lane + 32 * u < K8 ? __ldcs(w + int64_t(o0 + j) * K8 + lane + 32 * u) : uint4{};
  grid_dependency_wait();
  float acc[kShortCols][kN];
#pragma unroll
  for (int j = 0; j < kShortCols; ++j)
#pragma unroll
    for (int n = 0; n < kN; ++n) acc[j][n] = 0.f;
#pragma unroll
  for (int u = 0; u < kShortChunks; ++u) {
    if (lane + 32 * u >= K8) break;
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      const uint4 x = __ldg(in + int64_t(n) * K8 + lane + 32 * u);
#pragma unroll
      for (int j = 0; j < kShortCols; ++j) acc[j][n] += dot8(wv[j][u], x);
    }
  }
#pragma unroll
  for (int j = 0; j < kShortCols; ++j)
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      const float v = warp_sum(acc[j][n]);
      if (lane == 0 && o0 + j < O) store_out(out + int64_t(n) * O + o0 + j, v);
    }
}

// kN rows with their neighbours folded in (ops.h: skinny_fused). The block first forms the
// input rows in shared memory when they are norms or SwiGLUs of other rows (every block the
// same values: the formulas and rounding of rmsnorm_forward and swiglu_forward), then each
// warp takes one column as skinny_kernel does, one accumulator per row. Row n of the inputs
// starts n * K values in (Swiglu: n * 2K), of the outputs n * O.
//
// kRope (ops.h: SkinnyRope): the columns of a block are four rotation pairs of one q or k
// head (warps 0-3 columns i0 .. i0 + 3 of the head, warps 4-7 the same plus hd/2) or, past the
// q and k heads, eight v columns; the epilogue rotates and writes the cache as
// rope_kv_write_kernel does (decode_attention.cu), from the same bf16-rounded products.
__device__ __forceinline__ int rope_column(int b, int wi, const SkinnyRope& r) {
  const int half = r.hd / 2, rope_blocks = (r.nh + r.nkv) * r.hd / kGemvWarps;
  if (b >= rope_blocks) return b * kGemvWarps + wi;
  const int per_head = half / 4, h = b / per_head, i0 = (b % per_head) * 4;
  return h * r.hd + i0 + (wi & 3) + (wi >> 2) * half;
}

template <int kIn, bool kAdd, int kN, bool kRope = false>
__global__ void __launch_bounds__(kGemvWarps * 32) skinny_fused_kernel(bf16* out, float* residual, const uint4* in,
                                                                         const float* x, const bf16* g, float eps,
                                                                         const uint4* w, int K, int O, SkinnyRope rope) {
  extern __shared__ uint4 staged[];
  __shared__ float sh[33 * kN];
  allow_dependents();
  const int K8 = K / 8, tid = threadIdx.x, lane = tid % 32;
  const int o = kRope ? rope_column(int(blockIdx.x), tid / 32, rope) : int(blockIdx.x) * kGemvWarps + tid / 32;
  const uint4* wr = w + int64_t(o < O ? o : 0) * K8;
  uint4 pre[kPrefetch];
#pragma unroll
  for (int u = 0; u < kPrefetch; ++u) pre[u] = o < O && lane + 32 * u < K8 ? __ldcs(wr + lane + 32 * u) : uint4{};
  grid_dependency_wait();
  const uint4* src = in;
  // The prologue's loads are issued kStage at a time for every row (all of them in flight, not
  // one round trip per row and value); each thread still takes its values in rmsnorm_forward's
  // order, and the out-of-range ones add 0, so the sums are the same bits.
  constexpr int kStage = 4;
  const int step = int(blockDim.x);
  if constexpr (kIn == int(SkinnyIn::Norm)) {
    // Every row's sum of squares in one pass and one block reduction; per row the additions
    // of block_sum (reduce.cuh), so the staged values are rmsnorm_forward's.
    bf16* xb = reinterpret_cast<bf16*>(staged);
    float ss[kN];
#pragma unroll
    for (int n = 0; n < kN; ++n) ss[n] = 0.f;
    for (int c0 = tid; c0 < K; c0 += kStage * step) {
      float v[kStage][kN];
#pragma unroll
      for (int u = 0; u < kStage; ++u)
#pragma unroll
        for (int n = 0; n < kN; ++n) v[u][n] = c0 + u * step < K ? x[int64_t(n) * K + c0 + u * step] : 0.f;
#pragma unroll
      for (int u = 0; u < kStage; ++u)
#pragma unroll
        for (int n = 0; n < kN; ++n) ss[n] += v[u][n] * v[u][n];
    }
    const int wi = tid >> 5, nw = int(blockDim.x >> 5);
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      ss[n] = warp_sum(ss[n]);
      if (lane == 0) sh[n * 33 + wi] = ss[n];
    }
    __syncthreads();
    if (wi == 0)
#pragma unroll
      for (int n = 0; n < kN; ++n) {
        float v = lane < nw ? sh[n * 33 + lane] : 0.f;
        v = warp_sum(v);
        if (lane == 0) sh[n * 33 + 32] = v;
      }
    __syncthreads();
    float k[kN];
#pragma unroll
    for (int n = 0; n < kN; ++n) k[n] = rsqrtf(sh[n * 33 + 32] / float(K) + eps);
    for (int c0 = tid; c0 < K; c0 += kStage * step) {
      float gv[kStage], v[kStage][kN];
#pragma unroll
      for (int u = 0; u < kStage; ++u) {
        const bool in_range = c0 + u * step < K;
        gv[u] = in_range ? __bfloat162float(g[c0 + u * step]) : 0.f;
#pragma unroll
        for (int n = 0; n < kN; ++n) v[u][n] = in_range ? x[int64_t(n) * K + c0 + u * step] : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kStage; ++u)
        if (c0 + u * step < K)
#pragma unroll
          for (int n = 0; n < kN; ++n) xb[n * K + c0 + u * step] = __float2bfloat16(v[u][n] * k[n] * gv[u]);
    }
    __syncthreads();
    src = staged;
  } else if constexpr (kIn == int(SkinnyIn::Swiglu)) {
    // 8 values a thread per row (16-byte loads of gate and up), the arithmetic of swiglu_forward.
    const uint4* gu = in;  // row n: [gate K | up K], 2 * K8 chunks
    for (int c = tid; c < K8; c += step) {
      uint4 gv[kN], uv[kN];
#pragma unroll
      for (int n = 0; n < kN; ++n) {
        gv[n] = gu[int64_t(n) * 2 * K8 + c];
        uv[n] = gu[int64_t(n) * 2 * K8 + K8 + c];
      }
#pragma unroll
      for (int n = 0; n < kN; ++n) staged[n * K8 + c] = swiglu8(gv[n], uv[n]);
    }
    __syncthreads();
    src = staged;
  }
  if (o >= O) return;
  float acc[kN];
#pragma unroll
  for (int n = 0; n < kN; ++n) acc[n] = 0.f;
#pragma unroll
  for (int u = 0; u < kPrefetch; ++u)
    if (lane + 32 * u < K8)
#pragma unroll
      for (int n = 0; n < kN; ++n) acc[n] += dot8(pre[u], src[n * K8 + lane + 32 * u]);
  int c = lane + 32 * kPrefetch;
  for (; c + 32 * (kUnroll - 1) < K8; c += 32 * kUnroll) {
    uint4 wv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) wv[u] = __ldcs(wr + c + 32 * u);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int n = 0; n < kN; ++n) acc[n] += dot8(wv[u], src[n * K8 + c + 32 * u]);
  }
  for (; c < K8; c += 32) {
    const uint4 wv = __ldcs(wr + c);
#pragma unroll
    for (int n = 0; n < kN; ++n) acc[n] += dot8(wv, src[n * K8 + c]);
  }
  if constexpr (kRope) {
    // Every block has 8 live columns (O is a multiple of 8): the products meet in shared memory.
    __shared__ float rv[kN][kGemvWarps];
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      const float v = warp_sum(acc[n]);
      if (lane == 0) rv[n][tid / 32] = __bfloat162float(__float2bfloat16(v));
    }
    __syncthreads();
    const int b = int(blockIdx.x), half = rope.hd / 2, kvd = rope.nkv * rope.hd;
    if (b < (rope.nh + rope.nkv) * rope.hd / kGemvWarps) {
      if (tid >= 4 * kN) return;
      const int n = tid / 4, j = tid % 4, per_head = half / 4, h = b / per_head, i = (b % per_head) * 4 + j;
      float sn, cs;
      sincosf(float(1.f) * float(rope.pos[n]) * rope.inv_freq[i], &sn, &cs);
      const float a = rv[n][j], bb = rv[n][j + 4];
      const bf16 x0 = __float2bfloat16(a * cs - bb * sn), x1 = __float2bfloat16(bb * cs + a * sn);
      bf16* hp = out + int64_t(n) * O + int64_t(h) * rope.hd;
      hp[i] = x0;
      hp[i + half] = x1;
      if (h >= rope.nh) {
        const DecodeRow row = rope.rows[n];
        const int64_t dst = (rope.cache.row(row.slot, row.end - 1) * rope.nkv + (h - rope.nh)) * rope.hd;
        rope.kc[dst + i] = x0;
        rope.kc[dst + i + half] = x1;
      }
    } else {
      if (tid >= kGemvWarps * kN) return;
      const int n = tid / kGemvWarps, oc = b * kGemvWarps + tid % kGemvWarps;
      const bf16 v = __float2bfloat16(rv[n][tid % kGemvWarps]);
      out[int64_t(n) * O + oc] = v;
      const DecodeRow row = rope.rows[n];
      rope.vc[rope.cache.row(row.slot, row.end - 1) * kvd + oc - (rope.nh + rope.nkv) * rope.hd] = v;
    }
  } else {
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      const float v = warp_sum(acc[n]);
      if (lane != 0) continue;
      if constexpr (kAdd)
        residual[int64_t(n) * O + o] += __bfloat162float(__float2bfloat16(v));  // the branch output in bf16, as the unfused path
      else
        out[int64_t(n) * O + o] = __float2bfloat16(v);
    }
  }
}

// Calls f with std::integral_constant<int, n> for n = N, 1 <= N <= kSkinnyMaxRows (8).
template <class F>
void with_rows(int64_t N, F&& f) {
  switch (N) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

template <class Out>
void launch(Out* out, const bf16* in, const bf16* w, int64_t N, int64_t K, int64_t O, cudaStream_t s) {
  const auto* x = reinterpret_cast<const uint4*>(in);
  const auto* wv = reinterpret_cast<const uint4*>(w);
  const int K8 = int(K / 8), Oi = int(O);
  // The kernel depends on the shape only, never on N: a row's outputs are the same bits
  // whatever the row count.
  const bool short_rows = K8 <= 32 * kShortChunks && O >= kShortMinO;
  const int per_block = kGemvWarps * (short_rows ? kShortCols : 1);
  const dim3 grid(unsigned((O + per_block - 1) / per_block)), block(kGemvWarps * 32);
  auto go = [&](auto kernel) { launch_dependent(kDependProduct, kernel, grid, block, 0, s, out, x, wv, K8, Oi); };
  with_rows(N, [&](auto rows) {
    constexpr int n = decltype(rows)::value;
    if (short_rows)
      go(skinny_short_kernel<n, Out>);
    else
      go(skinny_kernel<n, Out>);
  });
}

bool fits(const bf16* in, const bf16* w, int64_t N, int64_t K, int64_t O) {
  return N >= 1 && N <= kSkinnyMaxRows && K % 8 == 0 && K / 8 < (int64_t(1) << 31) && O < (int64_t(1) << 31) &&
         reinterpret_cast<uintptr_t>(in) % 16 == 0 && reinterpret_cast<uintptr_t>(w) % 16 == 0;
}

}  // namespace

bool skinny_gemm(bf16* out, const bf16* in, const bf16* w, int64_t N, int64_t K, int64_t O, cudaStream_t s) {
  if (!fits(in, w, N, K, O)) return false;
  launch(out, in, w, N, K, O, s);
  return true;
}

bool skinny_gemm(float* out, const bf16* in, const bf16* w, int64_t N, int64_t K, int64_t O, cudaStream_t s) {
  if (!fits(in, w, N, K, O)) return false;
  launch(out, in, w, N, K, O, s);
  return true;
}

bool skinny_fused_fits(int64_t K, int64_t rows) {
  return K > 0 && K % 8 == 0 && rows >= 1 && rows <= kSkinnyMaxRows && K * rows <= kSkinnyFusedMaxK;
}

namespace {
template <int kIn, bool kAdd, bool kRope = false>
void launch_fused(const SkinnyFused& f, dim3 grid, dim3 block, size_t smem, cudaStream_t s, const uint4* in,
                  const uint4* wv, int Ki, int Oi) {
  const SkinnyRope rope = f.rope ? *f.rope : SkinnyRope{};
  auto go = [&](auto kernel) {
    launch_dependent(kDependProduct, kernel, grid, block, smem, s, f.out, f.residual, in, f.x, f.norm_w, f.eps, wv, Ki,
                     Oi, rope);
  };
  with_rows(f.rows, [&](auto rows) { go(skinny_fused_kernel<kIn, kAdd, decltype(rows)::value, kRope>); });
}
}  // namespace

bool skinny_fused(const SkinnyFused& f, const bf16* w, int64_t K, int64_t O, cudaStream_t s) {
  if (!skinny_fused_fits(K, f.rows) || O >= (int64_t(1) << 31) || (f.residual == nullptr) == (f.out == nullptr))
    return false;
  if (reinterpret_cast<uintptr_t>(w) % 16 != 0 || reinterpret_cast<uintptr_t>(f.in) % 16 != 0) return false;
  const dim3 grid(unsigned((O + kGemvWarps - 1) / kGemvWarps)), block(kGemvWarps * 32);
  const size_t smem = f.kind == SkinnyIn::Plain ? 0 : size_t(K * f.rows) * 2;
  const auto* in = reinterpret_cast<const uint4*>(f.in);
  const auto* wv = reinterpret_cast<const uint4*>(w);
  const int Ki = int(K), Oi = int(O);
  const bool add = f.residual != nullptr;
  if (f.rope) {
    const SkinnyRope& r = *f.rope;
    if (f.kind == SkinnyIn::Swiglu || add || r.hd <= 0 || r.hd % 8 != 0 || r.nh <= 0 || r.nkv <= 0 ||
        O != int64_t(r.nh + 2 * r.nkv) * r.hd || !r.pos || !r.inv_freq || !r.rows || !r.kc || !r.vc)
      return false;
    if (f.kind == SkinnyIn::Norm)
      launch_fused<int(SkinnyIn::Norm), false, true>(f, grid, block, smem, s, in, wv, Ki, Oi);
    else
      launch_fused<int(SkinnyIn::Plain), false, true>(f, grid, block, smem, s, in, wv, Ki, Oi);
    return true;
  }
  switch (f.kind) {
    case SkinnyIn::Plain:
      add ? launch_fused<int(SkinnyIn::Plain), true>(f, grid, block, smem, s, in, wv, Ki, Oi)
          : launch_fused<int(SkinnyIn::Plain), false>(f, grid, block, smem, s, in, wv, Ki, Oi);
      break;
    case SkinnyIn::Norm:
      add ? launch_fused<int(SkinnyIn::Norm), true>(f, grid, block, smem, s, in, wv, Ki, Oi)
          : launch_fused<int(SkinnyIn::Norm), false>(f, grid, block, smem, s, in, wv, Ki, Oi);
      break;
    case SkinnyIn::Swiglu:
      add ? launch_fused<int(SkinnyIn::Swiglu), true>(f, grid, block, smem, s, in, wv, Ki, Oi)
          : launch_fused<int(SkinnyIn::Swiglu), false>(f, grid, block, smem, s, in, wv, Ki, Oi);
      break;
  }
  return true;
}

}  // namespace talon::cuda
