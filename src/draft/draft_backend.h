// Internal to the draft runner (draft_runner.h): where the EAGLE-3 draft layer's arithmetic
// runs. The runner keeps the bookkeeping (step-0 rows, tree parents and depths) on the host
// and describes each forward as rows in the cached decoder's convention
// (backend/cuda/decode_ops.h), so the CPU reference and the CUDA backend read one
// description of who attends to whom:
//
// * row r's key and value are stored at cache row end[r] - 1;
// * row r attends to cache rows [0, len[r]) always, and to rows j in [len[r], end[r]) if
//   mask[r] < 0 (a chain), else if bit (j - len[r]) of the words at masks[mask[r] ...] is set.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/checkpoint.h"

namespace talon::spec {

struct DraftModel;

struct DraftRows {
  std::vector<int32_t> pos, len, end, mask;
  std::vector<uint64_t> masks;
  int64_t size() const { return int64_t(pos.size()); }
};

class DraftBackend {
 public:
  virtual ~DraftBackend() = default;
  virtual std::string name() const = 0;
  // One forward of the draft layer over rows.size() rows. tokens: target ids of the rows.
  // in: fp32 [N, 3H] target aux states (through fc) when from_aux, else [N, H] input hidden
  // states. Outputs hidden [N, H], and logits [N, Vd] unless null; with last_only, only the
  // last row's ([H] and [Vd]). With top_k > 0 also, per output row, the top_k draft ids
  // (descending logit, ties to the lower id) and their log-softmax values [rows, top_k].
  virtual void forward(const int32_t* tokens, const float* in, bool from_aux, const DraftRows& rows, bool last_only,
                       float* hidden, float* logits, int top_k, int32_t* top_ids, float* top_lp) = 0;
  // Drops every cached row at or above n.
  virtual void truncate(int64_t n) = 0;
  // Forwards served by a replayed CUDA graph so far (0 where there are none).
  virtual int64_t graph_replays() const { return 0; }
  // A greedy chain in one go, where the backend can (false: not here; the runner then calls
  // forward once per step): `forward(tokens, in, from_aux, first, last_only)` with the top-1
  // of its last row, then one one-row forward per steps[j], whose token is the target id of
  // the argmax of the row before it (draft id d -> d + d2t[d]) and whose input is that row's
  // hidden state. ids[0 .. steps.size()]: the argmax draft ids, the same as those calls give.
  virtual bool chain(const int32_t* tokens, const float* in, bool from_aux, const DraftRows& first,
                     const std::vector<DraftRows>& steps, int32_t* ids) {
    return false;
  }
  // An EAGLE-2 dynamic tree in one go, where the backend can (false: not here; the runner then
  // expands it step by step). The root's k children are candidates 0..k-1 (root_tok target ids,
  // root_score their log-probabilities, hidden state root_hidden [H]); steps[j] are the rows of
  // expansion step j (k rows each; their masks hold only the first step's bits, the others are
  // made on the device). Each step forwards the k best candidates so far of the depth before
  // (DraftRunner::expand_tree) and adds their k children each. Outputs, per candidate: target
  // id, parent candidate (-1: the root), score, and the runner node it was forwarded as (-1).
  virtual bool tree(const std::vector<int32_t>& root_tok, const std::vector<double>& root_score,
                    const float* root_hidden, const std::vector<DraftRows>& steps, std::vector<int32_t>& tok,
                    std::vector<int32_t>& par, std::vector<double>& score, std::vector<int32_t>& runner) {
    return false;
  }
};

// A DFlash draft's arithmetic on a GPU (dflash.h: extend_context and block_logits with bf16
// weights and caches, fp32 accumulation and residual): the context rows' keys and values in
// every layer are cached when the rows join; a block reads them.
class DFlashBackend {
 public:
  virtual ~DFlashBackend() = default;
  virtual std::string name() const = 0;
  // Drops the context (the next extend starts at position 0).
  virtual void reset() = 0;
  // Appends n context rows: aux fp32 [n, n_aux * H], at positions rows() ...
  virtual void extend(const float* aux, int64_t n) = 0;
  virtual int64_t rows() const = 0;
  // The block anchored at position rows(): slot 0 holds `first`, the others `mask_token`.
  // Outputs slots 1..n (n < block): logits [n, Vd] unless null, and with top_k > 0 their top_k
  // draft ids and log-softmax values [n, top_k].
  virtual void block(int32_t first, int32_t mask_token, int64_t n, float* logits, int top_k, int32_t* top_ids,
                     float* top_lp) = 0;
};
std::unique_ptr<DFlashBackend> make_cuda_dflash_backend(const DraftModel& m, const Checkpoint& target, int device,
                                                        int64_t max_rows);

// The top_k ids and log-softmax values of one row of n logits (the CPU's arithmetic: fp64 sums).
void top_logsoftmax(const float* logits, int64_t n, int k, int32_t* ids, float* lp);

// The fp32 reference.
std::unique_ptr<DraftBackend> make_cpu_draft_backend(const DraftModel& m, const Checkpoint& target);

// On one GPU: bf16 weights and cache, fp32 accumulation and residual, a cache of max_rows
// rows allocated up front. Throws when the build has no CUDA backend.
std::unique_ptr<DraftBackend> make_cuda_draft_backend(const DraftModel& m, const Checkpoint& target, int device,
                                                      int64_t max_rows);

}  // namespace talon::spec
