// Internal to the CUDA backend: the causal part of the draft trainer's training-time-test
// attention as fused tensor-core kernels (no score matrix in memory).
//
// Step k's queries attend causally to the step-0 keys of their own sample, plus k diagonal
// keys that the caller handles (see draft_train.cu). These kernels cover the causal part:
//  * forward: O_c = softmax(scale Q K0^T) V0 and its per-row log-sum-exp lse_c;
//  * dq:  dQ = dS K0, with P = exp(scale Q K0^T - lse) and dS = P (dO V0^T - D) scale, where
//         lse and D are those of the whole row (causal and diagonal keys together);
//  * dkv: dK0 += dS^T Q and dV0 += P^T dO, summed over the heads sharing each kv head.
// Operands are bf16 in memory, row-major: Q and dO [N, nh*hd], K0 and V0 [N, nkv*hd];
// outputs, lse and D are fp32. Samples are packed rows: seq_start[s]..seq_start[s+1], and
// `tiles` lists (sample, first row) for every 64-row tile of every sample (tiles_of()).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace talon::cuda {

bool ttt_flash_supported(int64_t hd);  // hd a multiple of 16, at most 128

// (sample, first row) pairs of the 64-row tiles of samples given as (first row, length).
std::vector<int32_t> ttt_flash_tiles(const std::vector<std::pair<int64_t, int64_t>>& seqs);

struct TttFlashArgs {
  const __nv_bfloat16 *q, *k0, *v0, *dO;  // dO: backward only
  const int64_t* seq_start;
  const int32_t* tiles;
  int64_t n_tiles, n_rows;  // n_rows: N, the rows of the batch
  int nh, nkv, hd;
  float scale;
};

// out[N, nh*hd] = O_c (fp32), lse[N, nh] = lse_c (natural log).
void ttt_flash_forward(float* out, float* lse, const TttFlashArgs& a, cudaStream_t s);
// dq[N, nh*hd] = dS K0 (overwritten); lse and D [N, nh] of the whole row.
void ttt_flash_dq(float* dq, const float* lse, const float* D, const TttFlashArgs& a, cudaStream_t s);
// dK0, dV0 [N, nkv*hd] += dS^T Q, P^T dO; part: scratch of 2 * (nh / nkv) * N * nkv*hd floats
// (per-head partials, summed in a fixed order).
void ttt_flash_dkv(float* dK, float* dV, float* part, const float* lse, const float* D, const TttFlashArgs& a,
                   cudaStream_t s);

}  // namespace talon::cuda
