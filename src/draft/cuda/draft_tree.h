// Internal to the CUDA draft backend (cuda_draft.cpp): one step of EAGLE-2 dynamic-tree
// expansion on the device, so that a whole tree is drafted in one graph (DraftRunner::
// expand_tree) instead of one host round trip per depth.
//
// Candidates are numbered as the host loop numbers them (spec/speculate.cpp before this ran on
// the device): the root's k children first, then for each expansion step the k children of
// each of its k rows in row order. A step's rows are the k best new candidates of the step
// before (by score = the sum of log-probabilities down the path, descending; ties to the lower
// candidate index), in that order.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace talon::cuda {

struct TreeExpandArgs {
  int k = 0;                              // children per row = rows per step (<= 64)
  const int32_t* top_ids = nullptr;       // [k, k]: this step's rows' top-k draft ids
  const float* top_lp = nullptr;          // [k, k]: their log-probabilities
  int32_t* frontier = nullptr;            // [k]: this step's rows as candidate indices; out: the next step's
  int32_t *cand_tok = nullptr, *cand_par = nullptr, *cand_runner = nullptr;  // per candidate
  double* cand_score = nullptr;
  int first_new = 0;                      // index of this step's first child candidate
  int base_id = 0;                        // runner node id of this step's row 0
  const int64_t* d2t = nullptr;           // draft id -> target id offset
  // The next step's inputs (next_ids null: this is the last step): its rows' target ids, their
  // input hidden states (the parents' rows of this step's output, [k, H] fp32) and attention
  // masks (node t's words at its mask offset: its parent's words, plus bit t).
  int32_t* next_ids = nullptr;
  float* next_hidden = nullptr;
  const float* cur_hidden = nullptr;
  int H = 0;
  uint64_t* next_masks = nullptr;
  const uint64_t* cur_masks = nullptr;
  const int32_t* cur_mask_off = nullptr;   // [k] this step's rows' mask offsets (words)
  const int32_t* next_mask_off = nullptr;  // [k]
  int next_base_id = 0;
};

void tree_expand(const TreeExpandArgs& a, cudaStream_t s);

}  // namespace talon::cuda
