#include "draft/cuda/draft_tree.h"

#include "backend/cuda/check.h"

namespace talon::cuda {

namespace {

constexpr int kThreads = 256;

// One block: record this step's children, pick the k best, write the next step's inputs.
__global__ void __launch_bounds__(kThreads) tree_expand_kernel(TreeExpandArgs a) {
  __shared__ int32_t rows_cand[64];  // this step's rows as candidate indices
  __shared__ int32_t sel[64];        // the chosen children (local index i * k + j)
  __shared__ uint8_t taken[64 * 64];
  __shared__ double best_s[kThreads / 32];
  __shared__ int best_i[kThreads / 32];
  const int k = a.k, n = k * k, tid = threadIdx.x;
  for (int i = tid; i < k; i += kThreads) {
    rows_cand[i] = a.frontier[i];
    a.cand_runner[a.frontier[i]] = a.base_id + i;
  }
  __syncthreads();
  for (int c = tid; c < n; c += kThreads) {
    const int i = c / k, idx = a.first_new + c, id = a.top_ids[c];
    a.cand_tok[idx] = int32_t(int64_t(id) + a.d2t[id]);
    a.cand_par[idx] = rows_cand[i];
    a.cand_score[idx] = a.cand_score[rows_cand[i]] + double(a.top_lp[c]);
    a.cand_runner[idx] = -1;
    taken[c] = 0;
  }
  __syncthreads();
  // k rounds of a block-wide argmax (score descending, index ascending), as a partial sort.
  for (int r = 0; r < k; ++r) {
    double bs = 0;
    int bi = -1;
    for (int c = tid; c < n; c += kThreads) {
      if (taken[c]) continue;
      const double v = a.cand_score[a.first_new + c];
      if (bi < 0 || v > bs || (v == bs && c < bi)) bs = v, bi = c;
    }
    for (int off = 16; off > 0; off /= 2) {
      const double os = __shfl_xor_sync(0xffffffffu, bs, off);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
      if (oi >= 0 && (bi < 0 || os > bs || (os == bs && oi < bi))) bs = os, bi = oi;
    }
    if (tid % 32 == 0) best_s[tid / 32] = bs, best_i[tid / 32] = bi;
    __syncthreads();
    if (tid == 0) {
      double s = 0;
      int b = -1;
      for (int w = 0; w < kThreads / 32; ++w)
        if (best_i[w] >= 0 && (b < 0 || best_s[w] > s || (best_s[w] == s && best_i[w] < b))) s = best_s[w], b = best_i[w];
      sel[r] = b;
      taken[b] = 1;
    }
    __syncthreads();
  }
  for (int r = tid; r < k; r += kThreads) a.frontier[r] = a.first_new + sel[r];
  if (!a.next_ids) return;
  for (int r = tid; r < k; r += kThreads) a.next_ids[r] = a.cand_tok[a.first_new + sel[r]];
  // Hidden states: row r of the next step reads its parent's row (sel[r] / k) of this step.
  for (int e = tid; e < k * a.H; e += kThreads) {
    const int r = e / a.H, col = e % a.H;
    a.next_hidden[e] = a.cur_hidden[int64_t(sel[r] / k) * a.H + col];
  }
  // Masks: the parent's words, zero-extended, plus the node's own bit.
  for (int r = tid; r < k; r += kThreads) {
    const int parent_row = sel[r] / k, t = a.next_base_id + r, tp = a.base_id + parent_row;
    const uint64_t* pw = a.cur_masks + a.cur_mask_off[parent_row];
    uint64_t* w = a.next_masks + a.next_mask_off[r];
    for (int i = 0; i <= t / 64; ++i) w[i] = i <= tp / 64 ? pw[i] : 0;
    w[t / 64] |= uint64_t(1) << (t % 64);
  }
}

}  // namespace

void tree_expand(const TreeExpandArgs& a, cudaStream_t s) {
  if (a.k < 1 || a.k > 64) fail_msg("tree_expand: k must be in [1, 64]");
  tree_expand_kernel<<<1, kThreads, 0, s>>>(a);
  CUDA_LAUNCH_CHECK();
}

}  // namespace talon::cuda
