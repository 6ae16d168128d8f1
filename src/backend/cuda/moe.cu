// Mixture-of-experts kernels (moe.h).
#include <cfloat>
#include <climits>
#include <string>

#include "backend/cuda/check.h"
#include "backend/cuda/moe.h"

namespace talon::cuda {

namespace {

constexpr int kTileRows = 16;   // routed rows per GEMM tile
constexpr int kTileCols = 64;   // outputs per GEMM tile
constexpr int kTileK = 32;      // reduction chunk (one int4 group of 32 when group = 32)
constexpr int kMaxExperts = 4096;

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
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
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
  if (method != 0) {
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

// out[p, O] (fp32, sorted rows) = in[row(p)] @ W_e^T for the tile's expert e. GATHER: the
// input row of sorted position p is token order[p] / K of `in`; else row p itself.
template <bool INT4, bool GATHER>
__global__ void grouped_gemm_kernel(float* out, const bf16* in, int64_t ld_in, const int32_t* order, int K,
                                    const int32_t* tiles, const int32_t* n_tiles, const int32_t* offsets,
                                    ExpertMatrix m) {
  if (int(blockIdx.x) >= *n_tiles) return;
  const int e = tiles[2 * blockIdx.x], r0 = tiles[2 * blockIdx.x + 1];
  const int rend = min(r0 + kTileRows, offsets[e + 1]);
  const int O = int(m.O), I = int(m.I), col0 = blockIdx.y * kTileCols;
  __shared__ float A[kTileRows][kTileK + 1];
  __shared__ float B[kTileCols][kTileK + 1];
  __shared__ int64_t src[kTileRows];
  const int tid = threadIdx.x, c = tid % kTileCols, rr = tid / kTileCols;  // 256 threads: 4 row groups
  if (tid < kTileRows) {
    const int p = r0 + tid;
    src[tid] = p < rend ? (GATHER ? int64_t(order[p] / K) : int64_t(p)) : -1;
  }
  const int64_t words = (I + 7) / 8, groups = m.group > 0 ? (I + m.group - 1) / m.group : 0;
  float acc[kTileRows / 4] = {0.f, 0.f, 0.f, 0.f};
  __syncthreads();
  for (int k0 = 0; k0 < I; k0 += kTileK) {
    for (int i = tid; i < kTileRows * kTileK; i += blockDim.x) {
      const int r = i / kTileK, k = i % kTileK;
      A[r][k] = (src[r] >= 0 && k0 + k < I) ? __bfloat162float(in[src[r] * ld_in + k0 + k]) : 0.f;
    }
    for (int i = tid; i < kTileCols * kTileK; i += blockDim.x) {
      const int oc = i / kTileK, k = i % kTileK, o = col0 + oc, kk = k0 + k;
      float v = 0.f;
      if (o < O && kk < I) {
        const int64_t row = int64_t(e) * O + o;
        if (INT4) {
          const uint32_t w = uint32_t(m.packed[row * words + kk / 8]);
          const int q = int((w >> (4 * (kk % 8))) & 15u) - 8;
          v = float(q) * __bfloat162float(m.scale[row * groups + kk / m.group]);
        } else {
          v = __bfloat162float(m.w[row * I + kk]);
        }
      }
      B[oc][k] = v;
    }
    __syncthreads();
#pragma unroll 8
    for (int k = 0; k < kTileK; ++k) {
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

__global__ void swiglu_f32_kernel(bf16* act, const float* g, const float* u, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float x = g[i];
    act[i] = __float2bfloat16(x / (1.0f + expf(-x)) * u[i]);
  }
}

// out[n, :] = sum_t w[n, t] * y[pos[n K + t], :], in slot (= expert id) order.
__global__ void combine_kernel(float* out, const float* y, const float* w, const int32_t* pos, int K, int64_t H) {
  const int n = blockIdx.x;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    float acc = 0.f;
    for (int t = 0; t < K; ++t) acc += y[int64_t(pos[n * K + t]) * H + h] * w[n * K + t];
    out[int64_t(n) * H + h] = acc;
  }
}

void grouped_gemm(float* out, const bf16* in, int64_t ld_in, bool gather, const MoeScratch& sc, int K, int64_t max_tiles,
                  const ExpertMatrix& m, cudaStream_t s) {
  const dim3 grid(unsigned(max_tiles), unsigned((m.O + kTileCols - 1) / kTileCols));
  const bool int4 = m.packed != nullptr;
  if (int4 && (m.group <= 0 || !m.scale)) fail_msg("moe: int4 expert weights need a group size and scales");
  if (!int4 && !m.w) fail_msg("moe: expert weights missing");
  auto go = [&](auto kernel) {
    kernel<<<grid, 256, 0, s>>>(out, in, ld_in, sc.order, K, sc.tiles, sc.n_tiles, sc.offsets, m);
  };
  if (int4)
    gather ? go(grouped_gemm_kernel<true, true>) : go(grouped_gemm_kernel<true, false>);
  else
    gather ? go(grouped_gemm_kernel<false, true>) : go(grouped_gemm_kernel<false, false>);
  CUDA_LAUNCH_CHECK();
}

int64_t max_tiles(int64_t NK, int64_t E) { return (NK + kTileRows - 1) / kTileRows + E; }

}  // namespace

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
  const bool grouped = r.method != MoeRouting::Method::Greedy;
  if (grouped && (r.n_group < 1 || r.n_group > 32 || E % r.n_group || r.topk_group < 1 || r.topk_group > r.n_group ||
                  (r.method == MoeRouting::Method::NoauxTc && E / r.n_group < 2)))
    fail_msg("moe: n_group " + std::to_string(r.n_group) + " / topk_group " + std::to_string(r.topk_group) +
             " unsupported for " + std::to_string(E) + " experts (n_group <= 32 dividing them)");
  const size_t smem = size_t(3 * E) * 4;
  route_kernel<<<unsigned(N), 32, smem, s>>>(idx, weights, logits, bias, E, r.top_k, r.sigmoid, int(r.method),
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
  grouped_gemm(sc.g, xn, H, true, sc, K, T, ex.gate, s);
  grouped_gemm(sc.u, xn, H, true, sc, K, T, ex.up, s);
  swiglu_f32_kernel<<<unsigned(std::min<int64_t>((NK * Im + 255) / 256, 65535)), 256, 0, s>>>(sc.act, sc.g, sc.u,
                                                                                                NK * Im);
  CUDA_LAUNCH_CHECK();
  grouped_gemm(sc.y, sc.act, Im, false, sc, K, T, ex.down, s);
  combine_kernel<<<unsigned(N), 256, 0, s>>>(out, sc.y, sc.weights, sc.pos, K, H);
  CUDA_LAUNCH_CHECK();
}

}  // namespace talon::cuda
