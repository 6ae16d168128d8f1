// MLA in its absorbed form for the cached decoder (deepseek_ops.h): the query's rope part and
// the latent cache write, and attention over the latent cache.
#include <cfloat>
#include <cmath>
#include <string>
#include <type_traits>

#include "backend/cuda/check.h"
#include "backend/cuda/deepseek_ops.h"
#include "backend/cuda/kernels/mla_rope.cuh"
#include "backend/cuda/warp.cuh"

namespace talon::cuda {

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kKeys = 32;       // keys per tile: one per lane in the softmax update
constexpr int kMaxLatent = 512;  // kvr: one value pair per thread

// The rotation of pair element j of a rope vector (as mla_assemble_kernel), with the row's
// cos / sin (times attn_factor) of each pair in cs / sn.
__device__ __forceinline__ float rotate(const bf16* v, int j, int rope, bool interleaved, const float* cs,
                                        const float* sn) {
  const auto [p, ia, ib, first] = mla_rope_pair(j, rope, interleaved);
  const float c = cs[p], s = sn[p];
  const float a = __bfloat162float(v[ia]), b = __bfloat162float(v[ib]);
  return first ? a * c - b * s : b * c + a * s;
}

// Block per row: the row's rope / 2 angles once (fp64 cos / sin, as mla_assemble_kernel), then
// every head's q_pe and the cache row.
__global__ void mla_prepare_kernel(float* qd, int64_t ldqd, const bf16* q, int64_t ldq, const bf16* ckv, int64_t ld_ckv,
                                   const bf16* lat, const int32_t* pos, const float* inv_freq, const DecodeRow* rows,
                                   bf16* cache, int nh, int nope, int rope, int kvr, CacheMap map, bool interleaved,
                                   float af) {
  extern __shared__ float trig[];  // [rope / 2] cos, then [rope / 2] sin
  const int64_t n = blockIdx.x;
  const float p = float(pos[n]);
  const int qk = nope + rope, D = kvr + rope, half = rope / 2;
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const float ang = p * inv_freq[i];
    trig[i] = float(cos(double(ang))) * af;
    trig[half + i] = float(sin(double(ang))) * af;
  }
  __syncthreads();
  for (int t = threadIdx.x; t < nh * rope; t += blockDim.x) {
    const int h = t / rope, j = t % rope;
    qd[n * ldqd + int64_t(h) * D + kvr + j] = rotate(q + n * ldq + int64_t(h) * qk + nope, j, rope, interleaved, trig,
                                                     trig + half);
  }
  const DecodeRow r = rows[n];
  bf16* dst = cache + map.row(r.slot, r.end - 1) * D;
  for (int i = threadIdx.x; i < kvr; i += blockDim.x) dst[i] = lat[n * kvr + i];
  for (int j = threadIdx.x; j < rope; j += blockDim.x)
    dst[kvr + j] = __float2bfloat16(rotate(ckv + n * ld_ckv + kvr, j, rope, interleaved, trig, trig + half));
}

// Block (row r, head block hb, split z): heads hb * G .. hb * G + G - 1 against keys
// [lo + z * split_len, min(end, lo + (z + 1) * split_len)) of the row, in tiles of kKeys.
// Shared memory: the G queries [G, D] fp32, the key tile [kKeys, D] bf16 (the latent part is
// also the values), probabilities [G, kKeys], running max / sum / correction [3, G].
// Scores: warp w takes keys w, w + 8, ...; its lanes split the D dims of each and sum them
// with shuffles. Values: thread t owns dims 2t, 2t + 1 of all G heads. Scores are kept in the
// log2 domain (scale * log2(e) folded in), as decode_combine expects.
template <int G>
__global__ void __launch_bounds__(kThreads) mla_attention_kernel(float* part, const float* qd, const bf16* cache,
                                                                 const DecodeRow* rows, const uint64_t* masks, int nh,
                                                                 int kvr, int rope, CacheMap map, int n_splits,
                                                                 int split_len, float scale_log2) {
  const int D = kvr + rope;
  const int r = blockIdx.x, h0 = blockIdx.y * G, z = blockIdx.z;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  extern __shared__ __align__(16) float sm[];
  float* qs = sm;             // [G][D]
  float* ps = qs + G * D;     // [G][kKeys]
  float* ms = ps + G * kKeys;  // [G] running max
  float* ls = ms + G;          // [G] running sum
  float* cs = ls + G;          // [G] correction of this tile
  bf16* ks = reinterpret_cast<bf16*>(sm + ((G * D + G * kKeys + 3 * G + 3) / 4) * 4);  // [kKeys][D]

  const DecodeRow row = rows[r];
  const int k_lo = row.lo + z * split_len, k_hi = min(row.end, row.lo + (z + 1) * split_len);
  for (int i = tid; i < G * D; i += kThreads) qs[i] = qd[(int64_t(r) * nh + h0) * D + i];
  if (tid < G) ms[tid] = -INFINITY, ls[tid] = 0.f;
  float o[G][2];
#pragma unroll
  for (int g = 0; g < G; ++g) o[g][0] = o[g][1] = 0.f;
  const bf16* base = cache;  // key t at + map.row(row.slot, t) * D (paged or flat, ops.h: CacheMap)
  for (int k0 = k_lo; k0 < k_hi; k0 += kKeys) {
    const int nt = min(kKeys, k_hi - k0);
    __syncthreads();  // the previous tile's readers are done (and the queries are in)
    if (D % 8 == 0) {  // 16-byte loads (DeepSeek-V3 / Kimi-K2: D = 576)
      const int chunks = D / 8;
      for (int i = tid; i < kKeys * chunks; i += kThreads) {
        const int t = i / chunks, c = (i % chunks) * 8;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (t < nt) v = *reinterpret_cast<const uint4*>(base + map.row(row.slot, k0 + t) * D + c);
        *reinterpret_cast<uint4*>(ks + t * D + c) = v;
      }
    } else {
      for (int i = tid; i < kKeys * D; i += kThreads) {
        const int t = i / D;
        ks[i] = t < nt ? base[map.row(row.slot, k0 + t) * D + i % D] : __float2bfloat16(0.f);
      }
    }
    __syncthreads();
    for (int t = warp; t < kKeys; t += kWarps) {
      float acc[G];
#pragma unroll
      for (int g = 0; g < G; ++g) acc[g] = 0.f;
      const bf16* kr = ks + t * D;
      for (int i = lane; i < D; i += 32) {
        const float kv = __bfloat162float(kr[i]);
#pragma unroll
        for (int g = 0; g < G; ++g) acc[g] += qs[g * D + i] * kv;
      }
#pragma unroll
      for (int g = 0; g < G; ++g) acc[g] = warp_sum(acc[g]);
      if (lane == 0) {
        const int key = k0 + t;
        bool visible = t < nt;
        if (visible && key >= row.len && row.mask >= 0) {
          const int a = key - row.len;
          visible = (masks[row.mask + a / 64] >> (a % 64)) & 1ull;
        }
#pragma unroll
        for (int g = 0; g < G; ++g) ps[g * kKeys + t] = visible ? acc[g] * scale_log2 : -INFINITY;
      }
    }
    __syncthreads();
    for (int g = warp; g < G; g += kWarps) {
      const float v = ps[g * kKeys + lane];
      const float m_old = ms[g], m_new = fmaxf(m_old, warp_max(v));
      float pr = 0.f, c = 1.f;
      if (m_new != -INFINITY) {
        pr = v == -INFINITY ? 0.f : exp2f(v - m_new);
        c = m_old == -INFINITY ? 0.f : exp2f(m_old - m_new);
      }
      ps[g * kKeys + lane] = pr;
      const float sum = warp_sum(pr);
      __syncwarp();
      if (lane == 0) {
        ls[g] = ls[g] * c + sum;
        ms[g] = m_new;
        cs[g] = c;
      }
    }
    __syncthreads();
    if (2 * tid < kvr) {
#pragma unroll
      for (int g = 0; g < G; ++g) o[g][0] *= cs[g], o[g][1] *= cs[g];
      for (int t = 0; t < nt; ++t) {
        const float v0 = __bfloat162float(ks[t * D + 2 * tid]), v1 = __bfloat162float(ks[t * D + 2 * tid + 1]);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float pr = ps[g * kKeys + t];
          o[g][0] += pr * v0;
          o[g][1] += pr * v1;
        }
      }
    }
  }
  __syncthreads();
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float* p = part + ((int64_t(r) * nh + h0 + g) * n_splits + z) * (kvr + 2);
    if (2 * tid < kvr) p[2 * tid] = o[g][0], p[2 * tid + 1] = o[g][1];
    if (tid == 0) p[kvr] = ms[g], p[kvr + 1] = ls[g];
  }
}

template <int G>
void launch_attention(const dim3& grid, float* part, const float* qd, const bf16* cache, const DecodeRow* rows,
                      const uint64_t* masks, int nh, int kvr, int rope, CacheMap map, int n_splits, int split_len,
                      float scale_log2, cudaStream_t s) {
  const int D = kvr + rope;
  const size_t smem = size_t((G * D + G * kKeys + 3 * G + 3) / 4 * 4) * 4 + size_t(kKeys * D) * 2;
  if (smem > 48 * 1024)
    CUDA_CHECK(cudaFuncSetAttribute(mla_attention_kernel<G>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  mla_attention_kernel<G><<<grid, kThreads, smem, s>>>(part, qd, cache, rows, masks, nh, kvr, rope, map, n_splits,
                                                       split_len, scale_log2);
}

}  // namespace

int64_t mla_head_blocks(int64_t nh) {
  int64_t G = 16;
  while (nh % G != 0) G /= 2;
  return nh / G;
}

void mla_decode_prepare(float* qd, int64_t ldqd, const bf16* q, int64_t ldq, const bf16* ckv, int64_t ld_ckv,
                        const bf16* lat, const int32_t* pos, const float* inv_freq, const DecodeRow* rows, bf16* cache,
                        int64_t N, int64_t nh, int64_t nope, int64_t rope, int64_t kvr, CacheMap map,
                        bool interleaved, float attn_factor, cudaStream_t s) {
  if (N == 0) return;
  mla_prepare_kernel<<<unsigned(N), 256, size_t(rope) * 4, s>>>(qd, ldqd, q, ldq, ckv, ld_ckv, lat, pos, inv_freq, rows, cache, int(nh),
                                                 int(nope), int(rope), int(kvr), map, interleaved, attn_factor);
  CUDA_LAUNCH_CHECK();
}

void mla_decode_attention(bf16* out, float* part, const float* qd, const bf16* cache, const DecodeRow* rows,
                          const uint64_t* masks, int64_t N, int64_t nh, int64_t kvr, int64_t rope, CacheMap map,
                          int64_t n_splits, int64_t split_len, float scale, cudaStream_t s) {
  if (N == 0) return;
  if (kvr > kMaxLatent || kvr % 2 != 0)
    fail_msg("mla decode attention: kv_lora_rank " + std::to_string(kvr) + " unsupported (even, at most 512)");
  const int64_t blocks = mla_head_blocks(nh), G = nh / blocks;
  const dim3 grid(static_cast<unsigned>(N), static_cast<unsigned>(blocks), static_cast<unsigned>(n_splits));
  const float sl = scale * kLog2e;
  auto go = [&](auto g) {
    launch_attention<decltype(g)::value>(grid, part, qd, cache, rows, masks, int(nh), int(kvr), int(rope), map,
                                         int(n_splits), int(split_len), sl, s);
  };
  switch (G) {
    case 16: go(std::integral_constant<int, 16>{}); break;
    case 8: go(std::integral_constant<int, 8>{}); break;
    case 4: go(std::integral_constant<int, 4>{}); break;
    case 2: go(std::integral_constant<int, 2>{}); break;
    default: go(std::integral_constant<int, 1>{}); break;
  }
  CUDA_LAUNCH_CHECK();
  decode_combine(out, part, N * nh, kvr, n_splits, s);
}

}  // namespace talon::cuda
