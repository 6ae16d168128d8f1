// Skinny products for decoding (ops.h: skinny_gemm): out[N, O] = in[N, K] @ w[O, K]^T with
// N <= kSkinnyMaxRows, where every weight byte is read once and the time is the weight's
// bytes over the memory bandwidth. cuBLAS picks tiles made for wide N here and reads the
// smaller matrices at half the bandwidth; this kernel gives each warp one output column
// (a weight row), streamed in 16-byte loads with several in flight per lane, and keeps one
// fp32 accumulator per input row.
#include <cstdint>

#include "backend/cuda/check.h"
#include "backend/cuda/kernels/reduce.cuh"
#include "backend/cuda/kernels/swiglu.cuh"
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
    float v = acc[n];
    for (int s = 16; s > 0; s >>= 1) v += __shfl_xor_sync(0xffffffffu, v, s);
    if (lane == 0) store_out(out + int64_t(n) * O + o, v);
  }
}

// kN rows with their neighbours folded in (ops.h: skinny_fused). The block first forms the
// input rows in shared memory when they are norms or SwiGLUs of other rows (every block the
// same values: the formulas and rounding of rmsnorm_forward and swiglu_forward), then each
// warp takes one column as skinny_kernel does, one accumulator per row. Row n of the inputs
// starts n * K values in (Swiglu: n * 2K), of the outputs n * O.
template <int kIn, bool kAdd, int kN>
__global__ void __launch_bounds__(kGemvWarps * 32) skinny_fused_kernel(bf16* out, float* residual, const uint4* in,
                                                                         const float* x, const bf16* g, float eps,
                                                                         const uint4* w, int K, int O) {
  extern __shared__ uint4 staged[];
  __shared__ float sh[33 * kN];
  allow_dependents();
  const int K8 = K / 8, tid = threadIdx.x, lane = tid % 32;
  const int o = blockIdx.x * kGemvWarps + tid / 32;
  const uint4* wr = w + int64_t(o < O ? o : 0) * K8;
  uint4 pre[kPrefetch];
#pragma unroll
  for (int u = 0; u < kPrefetch; ++u) pre[u] = o < O && lane + 32 * u < K8 ? __ldcs(wr + lane + 32 * u) : uint4{};
  grid_dependency_wait();
  const uint4* src = in;
  if constexpr (kIn == int(SkinnyIn::Norm)) {
    // Every row's sum of squares in one pass and one block reduction; per row the additions
    // of block_sum (reduce.cuh), so the staged values are rmsnorm_forward's.
    bf16* xb = reinterpret_cast<bf16*>(staged);
    float ss[kN];
#pragma unroll
    for (int n = 0; n < kN; ++n) ss[n] = 0.f;
    for (int c = tid; c < K; c += blockDim.x)
#pragma unroll
      for (int n = 0; n < kN; ++n) ss[n] += x[int64_t(n) * K + c] * x[int64_t(n) * K + c];
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
    for (int n = 0; n < kN; ++n) {
      const float k = rsqrtf(sh[n * 33 + 32] / float(K) + eps);
      const float* xr = x + int64_t(n) * K;
      for (int c = tid; c < K; c += blockDim.x) xb[n * K + c] = __float2bfloat16(xr[c] * k * __bfloat162float(g[c]));
    }
    __syncthreads();
    src = staged;
  } else if constexpr (kIn == int(SkinnyIn::Swiglu)) {
    const bf16* gu = reinterpret_cast<const bf16*>(in);  // row n: [gate K | up K]
    bf16* xb = reinterpret_cast<bf16*>(staged);
    for (int n = 0; n < kN; ++n)
      for (int c = tid; c < K; c += blockDim.x)
        xb[n * K + c] = __float2bfloat16(
            silu_times(__bfloat162float(gu[int64_t(n) * 2 * K + c]), __bfloat162float(gu[int64_t(n) * 2 * K + K + c])));
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
#pragma unroll
  for (int n = 0; n < kN; ++n) {
    float v = acc[n];
    for (int sft = 16; sft > 0; sft >>= 1) v += __shfl_xor_sync(0xffffffffu, v, sft);
    if (lane != 0) continue;
    if constexpr (kAdd)
      residual[int64_t(n) * O + o] += __bfloat162float(__float2bfloat16(v));  // the branch output in bf16, as the unfused path
    else
      out[int64_t(n) * O + o] = __float2bfloat16(v);
  }
}

// A launch that may overlap the end of the kernel before it on the stream (warp.cuh:
// grid_dependency_wait), where dependent_launch_enabled().
template <class... P, class... A>
void launch_dependent(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, A... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = dependent_launch_enabled() ? 1 : 0;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, P(args)...));
  CUDA_LAUNCH_CHECK();
}

template <class Out>
void launch(Out* out, const bf16* in, const bf16* w, int64_t N, int64_t K, int64_t O, cudaStream_t s) {
  const dim3 grid(unsigned((O + kGemvWarps - 1) / kGemvWarps)), block(kGemvWarps * 32);
  const auto* x = reinterpret_cast<const uint4*>(in);
  const auto* wv = reinterpret_cast<const uint4*>(w);
  const int K8 = int(K / 8), Oi = int(O);
  auto go = [&](auto kernel) { launch_dependent(kernel, grid, block, 0, s, out, x, wv, K8, Oi); };
  switch (N) {
    case 1: go(skinny_kernel<1, Out>); break;
    case 2: go(skinny_kernel<2, Out>); break;
    case 3: go(skinny_kernel<3, Out>); break;
    case 4: go(skinny_kernel<4, Out>); break;
    case 5: go(skinny_kernel<5, Out>); break;
    case 6: go(skinny_kernel<6, Out>); break;
    case 7: go(skinny_kernel<7, Out>); break;
    default: go(skinny_kernel<8, Out>); break;
  }
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
template <int kIn, bool kAdd>
void launch_fused(const SkinnyFused& f, dim3 grid, dim3 block, size_t smem, cudaStream_t s, const uint4* in,
                  const uint4* wv, int Ki, int Oi) {
  auto go = [&](auto kernel) {
    launch_dependent(kernel, grid, block, smem, s, f.out, f.residual, in, f.x, f.norm_w, f.eps, wv, Ki, Oi);
  };
  switch (f.rows) {
    case 1: go(skinny_fused_kernel<kIn, kAdd, 1>); break;
    case 2: go(skinny_fused_kernel<kIn, kAdd, 2>); break;
    case 3: go(skinny_fused_kernel<kIn, kAdd, 3>); break;
    case 4: go(skinny_fused_kernel<kIn, kAdd, 4>); break;
    case 5: go(skinny_fused_kernel<kIn, kAdd, 5>); break;
    case 6: go(skinny_fused_kernel<kIn, kAdd, 6>); break;
    case 7: go(skinny_fused_kernel<kIn, kAdd, 7>); break;
    default: go(skinny_fused_kernel<kIn, kAdd, 8>); break;
  }
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
