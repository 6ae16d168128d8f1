// Causal GQA attention over packed variable-length sequences on tensor cores.
//
// One block of 4 warps computes a 64-row query tile of one head of one sequence;
// each warp owns 16 query rows. Keys and values stream through shared memory in
// 64-row tiles (32-row tiles for head size 192, MLA's qk = 128 + 64, to keep the
// accumulators in registers and the tiles within static shared memory). S = Q K^T and O += P V run as bf16 mma.sync m16n8k16 with fp32
// accumulators; softmax is online (running max and sum per row, exp2 domain), so no
// T x T matrix exists anywhere. P goes from the S accumulators straight into the A
// operand of the P V product (the accumulator layout of two adjacent 8-column tiles
// is the A layout of one 16-wide k slice), so it never touches shared memory. P is
// carried as a sum of two bf16 terms, so the softmax weights keep fp32-like precision.
// Tiles never span sequences: the host lists (sequence, first row) for every tile.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/ops.h"
#include "backend/cuda/tensor_core.cuh"

namespace talon::cuda {

namespace {

constexpr int kTileM = 64;  // query rows per block (16 per warp)
constexpr int kThreads = 128;
constexpr int kPad = 8;  // bf16 elements of padding per smem row (breaks bank conflicts)

// Copies rows [r0, r0 + R) of a head slice (D columns, row stride ld) into smem; rows
// at or past `rows` are zero.
template <int D, int R>
__device__ __forceinline__ void load_tile(bf16 (*dst)[D + kPad], const bf16* base, int64_t ld, int64_t r0,
                                          int64_t rows) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  for (int i = threadIdx.x; i < R * kChunks; i += kThreads) {
    const int r = i / kChunks, c = (i % kChunks) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r0 + r < rows) v = *reinterpret_cast<const uint4*>(base + (r0 + r) * ld + c);
    *reinterpret_cast<uint4*>(&dst[r][c]) = v;
  }
}

// kTileN: keys per step. ks also stages the Q tile, so it has at least kTileM rows.
template <int D, int kTileN>
__global__ void __launch_bounds__(kThreads) flash_attention_kernel(bf16* out, const bf16* qkv, int64_t ld,
                                                                   const int64_t* seq_start, const int32_t* tiles,
                                                                   int nh, int nkv, int64_t window, float scale_log2) {
  static_assert(kTileN % 16 == 0 && kTileN <= kTileM, "key tile");
  __shared__ __align__(16) bf16 ks[kTileM][D + kPad];
  __shared__ __align__(16) bf16 vs[kTileN][D + kPad];
  const int seq = tiles[2 * blockIdx.x], q0 = tiles[2 * blockIdx.x + 1];
  const int h = blockIdx.y, kh = h / (nh / nkv);
  const int64_t s0 = seq_start[seq], len = seq_start[seq + 1] - s0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const bf16* qbase = qkv + s0 * ld + int64_t(h) * D;
  const bf16* kbase = qkv + s0 * ld + int64_t(nh + kh) * D;
  const bf16* vbase = qkv + s0 * ld + int64_t(nh + nkv + kh) * D;

  // Q tile through the K buffer into registers (A fragments, one per 16-wide k slice).
  uint32_t qf[D / 16][4];
  load_tile<D, kTileM>(ks, qbase, ld, q0, len);
  __syncthreads();
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc)
    ldmatrix_x4(qf[kc][0], qf[kc][1], qf[kc][2], qf[kc][3],
                &ks[warp * 16 + (lane % 8) + 8 * ((lane / 8) % 2)][kc * 16 + 8 * (lane / 16)]);
  __syncthreads();

  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m_run[2] = {-FLT_MAX, -FLT_MAX}, l_run[2] = {0.f, 0.f};
  const int64_t qi[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};

  const int64_t q_last = (q0 + kTileM < len ? q0 + kTileM : len) - 1;
  int64_t j_lo = window > 0 && q0 - window + 1 > 0 ? q0 - window + 1 : 0;
  j_lo -= j_lo % kTileN;
  for (int64_t j0 = j_lo; j0 <= q_last; j0 += kTileN) {
    load_tile<D, kTileN>(ks, kbase, ld, j0, len);
    load_tile<D, kTileN>(vs, vbase, ld, j0, len);
    __syncthreads();

    float s[kTileN / 8][4];
#pragma unroll
    for (int i = 0; i < kTileN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
#pragma unroll
      for (int nb = 0; nb < kTileN / 16; ++nb) {
        uint32_t b0, b1, b2, b3;
        ldmatrix_x4(b0, b1, b2, b3, &ks[nb * 16 + (lane % 8) + 8 * (lane / 16)][kc * 16 + 8 * ((lane / 8) % 2)]);
        mma_bf16(s[2 * nb], qf[kc], b0, b1);
        mma_bf16(s[2 * nb + 1], qf[kc], b2, b3);
      }
    }

    // Mask (causal, sequence end, sliding window), then the online-softmax update.
    const bool need_mask = j0 + kTileN - 1 > q0 || j0 + kTileN > len || window > 0;
    float mx[2] = {-FLT_MAX, -FLT_MAX};
#pragma unroll
    for (int nt = 0; nt < kTileN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2;
        float v = s[nt][e] * scale_log2;
        if (need_mask) {
          const int64_t kj = j0 + nt * 8 + 2 * t + (e % 2);
          if (kj > qi[r] || kj >= len || (window > 0 && qi[r] - kj >= window)) v = -INFINITY;
        }
        s[nt][e] = v;
        mx[r] = fmaxf(mx[r], v);
      }
    float corr[2];
    online_softmax_step(mx, m_run, l_run, corr);
    // P = P_hi + P_lo, both bf16: two P V products keep P to ~16 mantissa bits (one
    // bf16 rounding of P would add up to 2^-9 relative error per weight), for a few
    // percent more attention work.
    uint32_t pf[kTileN / 16][4], pl[kTileN / 16][4];
    probs_hi_lo(s, m_run, l_run, pf, pl);  // masked entries: exp2(-inf) = 0
    scale_rows(o, corr);
    // pf[kc] = {row g keys 2t.., row g+8 keys 2t.., row g keys 8+2t.., row g+8 keys 8+2t..} of the
    // 16-key slice kc: exactly the A fragment {a0, a1, a2, a3} of m16n8k16.
#pragma unroll
    for (int kc = 0; kc < kTileN / 16; ++kc) {
      const uint32_t a[4] = {pf[kc][0], pf[kc][1], pf[kc][2], pf[kc][3]};
      const uint32_t al[4] = {pl[kc][0], pl[kc][1], pl[kc][2], pl[kc][3]};
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b0, b1, b2, b3;
        ldmatrix_x4_trans(b0, b1, b2, b3, &vs[kc * 16 + (lane % 8) + 8 * ((lane / 8) % 2)][dp * 16 + 8 * (lane / 16)]);
        mma_bf16(o[2 * dp], a, b0, b1);
        mma_bf16(o[2 * dp + 1], a, b2, b3);
        mma_bf16(o[2 * dp], al, b0, b1);
        mma_bf16(o[2 * dp + 1], al, b2, b3);
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
  }
  const int64_t od = int64_t(nh) * D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (qi[r] >= len) continue;
    const float inv = 1.f / l_run[r];
    bf16* op = out + (s0 + qi[r]) * od + int64_t(h) * D;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      *reinterpret_cast<__nv_bfloat162*>(op + dt * 8 + 2 * t) =
          __floats2bfloat162_rn(o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv);
  }
}

}  // namespace

bool flash_attention_supported(int64_t hd) { return hd == 64 || hd == 128 || hd == 192; }

std::vector<int32_t> attention_tiles(const int64_t* seq_start, int64_t n_seqs) {
  std::vector<int32_t> t;
  for (int64_t s = 0; s < n_seqs; ++s)
    for (int64_t q = 0; q < seq_start[s + 1] - seq_start[s]; q += kTileM) {
      t.push_back(int32_t(s));
      t.push_back(int32_t(q));
    }
  return t;
}

int64_t attention_max_tiles(int64_t n_tokens, int64_t n_seqs) { return n_tokens / kTileM + n_seqs; }

void flash_attention_forward(bf16* out, const bf16* qkv, int64_t ld, const int64_t* seq_start, const int32_t* tiles,
                             int64_t n_tiles, int64_t nh, int64_t nkv, int64_t hd, int64_t window, cudaStream_t s) {
  if (n_tiles == 0) return;
  if (!flash_attention_supported(hd)) fail_msg("flash attention: head_dim " + std::to_string(hd) + " unsupported");
  if (nh % nkv != 0) fail_msg("attention: heads not a multiple of kv heads");
  if (ld % 8 != 0) fail_msg("flash attention: row stride must be a multiple of 8 elements");
  const dim3 grid(static_cast<unsigned>(n_tiles), static_cast<unsigned>(nh));
  const float scale_log2 = float(1.0 / std::sqrt(double(hd)) * 1.4426950408889634);
  if (hd == 64)
    flash_attention_kernel<64, 64><<<grid, kThreads, 0, s>>>(out, qkv, ld, seq_start, tiles, int(nh), int(nkv), window,
                                                             scale_log2);
  else if (hd == 128)
    flash_attention_kernel<128, 64><<<grid, kThreads, 0, s>>>(out, qkv, ld, seq_start, tiles, int(nh), int(nkv),
                                                              window, scale_log2);
  else
    flash_attention_kernel<192, 32><<<grid, kThreads, 0, s>>>(out, qkv, ld, seq_start, tiles, int(nh), int(nkv),
                                                              window, scale_log2);
  CUDA_LAUNCH_CHECK();
}

}  // namespace talon::cuda
