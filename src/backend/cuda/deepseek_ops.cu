// DeepSeek-family kernels (deepseek_ops.h).
#include <algorithm>
#include <cstdint>

#include "backend/cuda/check.h"
#include "backend/cuda/deepseek_ops.h"
#include "backend/cuda/kernels/mla_rope.cuh"
#include "backend/cuda/kernels/rmsnorm.cuh"
#include "backend/cuda/warp.cuh"

namespace talon::cuda {

namespace {

unsigned grid_for(int64_t n, int threads) { return unsigned(std::min<int64_t>((n + threads - 1) / threads, 1 << 20)); }

__global__ void mla_assemble_kernel(bf16* qkv, const bf16* q, const bf16* kv, const bf16* ckv, int64_t ld_ckv, int kvr,
                                    const int32_t* pos, const float* inv_freq, int64_t N, int nh, int nope, int rope,
                                    int vd, bool interleaved, float af, float q_scale) {
  const int qk = nope + rope;
  const int64_t total = N * nh * qk;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < total; t += int64_t(gridDim.x) * blockDim.x) {
    const int i = int(t % qk);
    const int h = int((t / qk) % nh);
    const int64_t n = t / (int64_t(qk) * nh);
    const bf16* kvrow = kv + (n * nh + h) * (nope + vd);
    float qv, kval;
    if (i < nope) {
      qv = __bfloat162float(q[(n * nh + h) * qk + i]);
      kval = __bfloat162float(kvrow[i]);
    } else {
      const auto [p, ia, ib, first] = mla_rope_pair(i - nope, rope, interleaved);
      const float ang = float(pos[n]) * inv_freq[p];
      const float c = float(cos(double(ang))) * af, s = float(sin(double(ang))) * af;
      const bf16* qp = q + (n * nh + h) * qk + nope;
      const float qa = __bfloat162float(qp[ia]), qb = __bfloat162float(qp[ib]);
      qv = first ? qa * c - qb * s : qb * c + qa * s;
      const bf16* kp = ckv + n * ld_ckv + kvr;
      const float ka = __bfloat162float(kp[ia]), kb = __bfloat162float(kp[ib]);
      kval = first ? ka * c - kb * s : kb * c + ka * s;
    }
    const int64_t row = n * 3 * int64_t(nh) * qk;
    qkv[row + int64_t(h) * qk + i] = __float2bfloat16(qv * q_scale);
    qkv[row + int64_t(nh + h) * qk + i] = __float2bfloat16(kval);
    qkv[row + int64_t(2 * nh + h) * qk + i] = i < vd ? kvrow[nope + i] : __float2bfloat16(0.f);
  }
}

__global__ void unpad_kernel(bf16* out, const bf16* in, int64_t N, int nh, int qk, int vd) {
  const int64_t total = N * nh * vd;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < total; t += int64_t(gridDim.x) * blockDim.x) {
    const int i = int(t % vd);
    const int64_t nhh = t / vd;  // n * nh + h
    out[t] = in[nhh * qk + i];
  }
}

// One warp per (token, expert) dot product; 16-byte loads, four in flight a lane, when H and
// the rows allow (the same summation order for every N).
__global__ void router_kernel(float* logits, const float* x, const float* W, int64_t N, int64_t E, int64_t H,
                              bool vec) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / 32;
  for (int64_t warp = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; warp < N * E; warp += warps) {
    const int64_t n = warp / E, e = warp % E;
    const float* a = x + n * H;
    const float* b = W + e * H;
    float acc = 0.f;
    if (vec) {
      const float4* a4 = reinterpret_cast<const float4*>(a);
      const float4* b4 = reinterpret_cast<const float4*>(b);
#pragma unroll 4
      for (int64_t i = lane; i < H / 4; i += 32) {
        const float4 u = a4[i], v = b4[i];
        acc += u.x * v.x + u.y * v.y + u.z * v.z + u.w * v.w;
      }
    } else {
      for (int64_t i = lane; i < H; i += 32) acc += a[i] * b[i];
    }
    acc = warp_sum(acc);
    if (lane == 0) logits[warp] = acc;
  }
}

__global__ void add_f32_kernel(float* x, const float* y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] += y[i];
}

}  // namespace

void mla_assemble(bf16* qkv, const bf16* q, const bf16* kv, const bf16* ckv, int64_t ld_ckv, int64_t kvr,
                  const int32_t* pos, const float* inv_freq, int64_t N, int64_t nh, int64_t nope, int64_t rope,
                  int64_t vd, bool interleaved, float attn_factor, float q_scale, cudaStream_t s) {
  if (N == 0) return;
  if (vd > nope + rope) fail_msg("mla: v_head_dim larger than the qk head size is not supported");
  mla_assemble_kernel<<<grid_for(N * nh * (nope + rope), 256), 256, 0, s>>>(qkv, q, kv, ckv, ld_ckv, int(kvr), pos,
                                                                           inv_freq, N, int(nh), int(nope), int(rope),
                                                                           int(vd), interleaved, attn_factor, q_scale);
  CUDA_LAUNCH_CHECK();
}

void unpad_heads(bf16* out, const bf16* in, int64_t N, int64_t nh, int64_t qk, int64_t vd, cudaStream_t s) {
  if (N == 0) return;
  unpad_kernel<<<grid_for(N * nh * vd, 256), 256, 0, s>>>(out, in, N, int(nh), int(qk), int(vd));
  CUDA_LAUNCH_CHECK();
}

void rmsnorm_f32(float* out, const float* x, const bf16* w, int64_t N, int64_t C, float eps, cudaStream_t s) {
  if (N == 0) return;
  rmsnorm_forward<float, const float, void>(out, NormRows{C}, x, NormRows{C}, nullptr, w, N, C, eps, s);
  CUDA_LAUNCH_CHECK();
}

void router_logits_f32(float* logits, const float* x, const float* W, int64_t N, int64_t E, int64_t H, cudaStream_t s) {
  if (N == 0) return;
  // Blocks of two warps: at decode sizes (E dot products) more SMs take part.
  const bool vec = H % 4 == 0 && (reinterpret_cast<uintptr_t>(x) & 15) == 0 && (reinterpret_cast<uintptr_t>(W) & 15) == 0;
  router_kernel<<<grid_for(N * E * 32, 64), 64, 0, s>>>(logits, x, W, N, E, H, vec);
  CUDA_LAUNCH_CHECK();
}

void add_f32(float* x, const float* y, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  add_f32_kernel<<<grid_for(n, 256), 256, 0, s>>>(x, y, n);
  CUDA_LAUNCH_CHECK();
}

}  // namespace talon::cuda
