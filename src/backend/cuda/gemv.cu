// Skinny products for decoding (ops.h: skinny_gemm): out[N, O] = in[N, K] @ w[O, K]^T with
// N <= kSkinnyMaxRows, where every weight byte is read once and the time is the weight's
// bytes over the memory bandwidth. cuBLAS picks tiles made for wide N here and reads the
// smaller matrices at half the bandwidth; this kernel gives each warp one output column
// (a weight row), streamed in 16-byte loads with several in flight per lane, and keeps one
// fp32 accumulator per input row.
#include <cstdint>

#include "backend/cuda/check.h"
#include "backend/cuda/ops.h"

namespace talon::cuda {

namespace {

constexpr int kGemvWarps = 8;  // output columns per block
constexpr int kUnroll = 4;     // 16-byte weight loads in flight per lane

__device__ __forceinline__ float lo_bf16(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_bf16(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ float dot8(const uint4& a, const uint4& b) {
  return lo_bf16(a.x) * lo_bf16(b.x) + hi_bf16(a.x) * hi_bf16(b.x) + lo_bf16(a.y) * lo_bf16(b.y) +
         hi_bf16(a.y) * hi_bf16(b.y) + lo_bf16(a.z) * lo_bf16(b.z) + hi_bf16(a.z) * hi_bf16(b.z) +
         lo_bf16(a.w) * lo_bf16(b.w) + hi_bf16(a.w) * hi_bf16(b.w);
}

__device__ __forceinline__ void store_out(bf16* p, float v) { *p = __float2bfloat16(v); }
__device__ __forceinline__ void store_out(float* p, float v) { *p = v; }

// Warp w of block b: column o = b * kGemvWarps + w. K8 = K / 8 chunks of 16 bytes.
template <int kN, class Out>
__global__ void __launch_bounds__(kGemvWarps * 32) skinny_kernel(Out* out, const uint4* in, const uint4* w, int K8, int O) {
  const int lane = threadIdx.x % 32;
  const int o = blockIdx.x * kGemvWarps + threadIdx.x / 32;
  if (o >= O) return;
  const uint4* wr = w + int64_t(o) * K8;
  float acc[kN];
#pragma unroll
  for (int n = 0; n < kN; ++n) acc[n] = 0.f;
  int c = lane;
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

template <class Out>
void launch(Out* out, const bf16* in, const bf16* w, int64_t N, int64_t K, int64_t O, cudaStream_t s) {
  const dim3 grid(unsigned((O + kGemvWarps - 1) / kGemvWarps)), block(kGemvWarps * 32);
  const auto* x = reinterpret_cast<const uint4*>(in);
  const auto* wv = reinterpret_cast<const uint4*>(w);
  const int K8 = int(K / 8), Oi = int(O);
  switch (N) {
    case 1: skinny_kernel<1><<<grid, block, 0, s>>>(out, x, wv, K8, Oi); break;
    case 2: skinny_kernel<2><<<grid, block, 0, s>>>(out, x, wv, K8, Oi); break;
    case 3: skinny_kernel<3><<<grid, block, 0, s>>>(out, x, wv, K8, Oi); break;
    case 4: skinny_kernel<4><<<grid, block, 0, s>>>(out, x, wv, K8, Oi); break;
    case 5: skinny_kernel<5><<<grid, block, 0, s>>>(out, x, wv, K8, Oi); break;
    case 6: skinny_kernel<6><<<grid, block, 0, s>>>(out, x, wv, K8, Oi); break;
    case 7: skinny_kernel<7><<<grid, block, 0, s>>>(out, x, wv, K8, Oi); break;
    default: skinny_kernel<8><<<grid, block, 0, s>>>(out, x, wv, K8, Oi); break;
  }
  CUDA_LAUNCH_CHECK();
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

}  // namespace talon::cuda
