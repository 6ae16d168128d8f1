// EAGLE-3 drafting at inference time: the draft model of train/eagle3.h run incrementally
// with its own KV cache, in the same conventions as training-time test (SPEC-EAGLE3 s. 3):
//
// * Step 0 at position t reads the target token x[t+1] and the target's aux states at t
//   (through fc); it predicts x[t+2]. `extend` appends step-0 rows for positions whose
//   target states are known; they stay cached (the draft's "prefix").
// * A draft node at depth d >= 1 below the last step-0 position p reads its own token and
//   the hidden state of its parent (the step-0 row p for depth 1), has RoPE position p + d,
//   and attends to the step-0 rows 0..p plus its ancestors and itself (the TTT diagonal
//   pattern, generalised from a chain to a tree). Tree rows are dropped by `clear_tree`.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/checkpoint.h"
#include "draft/dflash.h"
#include "draft/eagle3.h"
#include "util/file.h"

namespace talon::spec {

struct DraftModel {
  eagle3::DraftConfig config;
  eagle3::DraftWeights weights;
  eagle3::DraftVocab vocab;
  std::vector<int64_t> aux_layer_ids;  // Talon's input-of-layer convention
  std::string origin;                  // "talon checkpoint PATH" / "speculators export DIR" / ...
  // P-EAGLE (drafter "peagle"): the draft's own token embedding [V, H] (else the target's is
  // used), and what stands in for the unknown tokens of a parallel step.
  std::string drafter = "eagle3";
  int32_t mask_token = -1;
  std::vector<float> mask_hidden, embed;  // [3H], [V, H]
  bool parallel() const { return drafter == "peagle"; }
  // DFlash (drafter "dflash"): its own layers and sizes (config/weights above keep only the
  // shared sizes and the vocabulary).
  dflash::Config dflash;
  dflash::Weights dweights;
  bool block() const { return drafter == "dflash"; }
  bool chain_only() const { return parallel() || block(); }  // drafts one chain a round
};

// A `talon train` run directory or checkpoint file, or a `talon export` directory (either
// format). Checked against the target: hidden size, vocabulary, layer ids.
DraftModel load_draft(const fs::path& path, const Checkpoint& target);

// What a drafter needs of each output row instead of (or beside) its logits: the k draft
// ids of largest logit (descending, ties to the lower id) and their log-probabilities under
// the draft distribution (log-softmax over the draft vocabulary). On a GPU this saves
// copying and scanning the logits on the host.
struct DraftTop {
  int k = 0;
  std::vector<int32_t> ids;     // [rows, k]
  std::vector<float> logprob;   // [rows, k]
};

class DraftRunner {
 public:
  // `target` supplies the frozen token embedding (kept by reference: it must outlive this).
  // device < 0: the fp32 CPU reference; else that GPU, with room for max_rows cached rows
  // (step-0 rows plus one round's tree).
  DraftRunner(const DraftModel& m, const Checkpoint& target, int device = -1, int64_t max_rows = 0);
  ~DraftRunner();
  DraftRunner(const DraftRunner&) = delete;
  DraftRunner& operator=(const DraftRunner&) = delete;

  const DraftModel& model() const { return m_; }
  std::string backend() const;
  // Forwards the backend served from replayed CUDA graphs (tests, benchmarks).
  int64_t graph_replays() const;
  int64_t length() const { return len_; }  // step-0 rows cached
  void reset();

  // Appends n step-0 rows: next_tokens[i] = x[t+1] and aux[i] = concat of the target's aux
  // states at t = length() + i, fp32 [n, 3H]. Outputs the last row's hidden state [H] and
  // its draft-vocabulary logits [Vd] (unless logits_last is null); top, if given, for that row.
  void extend(const int32_t* next_tokens, const float* aux, int64_t n, float* hidden_last, float* logits_last,
              DraftTop* top = nullptr);

  // Greedy chain drafting in one call: extend(next_tokens, aux, n) and then k - 1 tree steps
  // down one chain, each node's token the argmax of the row above it. Returns the k draft ids
  // (draft vocabulary; to_target maps them): the argmax of the last step-0 row, then of each
  // node. The same ids as extend + tree_step with top-1, in one forward pass list (on a GPU,
  // one graph, one copy up and one down); the nodes stay in the tree until clear_tree.
  std::vector<int32_t> extend_chain(const int32_t* next_tokens, const float* aux, int64_t n, int k);

  // EAGLE-2 dynamic-tree drafting below the last step-0 row: its top-k (`top`, the k of the
  // tree) and hidden state are the root; candidates are the root's k children, then for each
  // depth 2..depth the k children of each of the k best-scoring candidates of the depth before
  // (score: the sum of log-probabilities down the path; ties to the earlier candidate), those
  // k forwarded as one tree step. Outputs every candidate: target id, parent candidate (-1: the
  // root) and score, in that order. On a GPU the whole expansion is one graph (one copy up,
  // one down); elsewhere, or with on_device false, one tree_step per depth. The forwarded nodes
  // stay in the tree until clear_tree.
  void expand_tree(const DraftTop& top, const float* hidden, int depth, std::vector<int32_t>& tokens,
                   std::vector<int32_t>& parents, std::vector<double>& scores, bool on_device = true);

  // One draft step over tree nodes: node i has token tokens[i] (a target id) and parent
  // parents[i] (an earlier tree node, or -1: the last step-0 row). parent_hidden[i] is that
  // parent's hidden state. Appends the nodes to the tree; outputs hidden [n, H] and logits
  // [n, Vd] (unless null; top, if given, per node). Node ids are assigned in order from tree_size() before the call.
  void tree_step(const std::vector<int32_t>& tokens, const std::vector<int32_t>& parents, const float* parent_hidden,
                 float* hidden, float* logits, DraftTop* top = nullptr);
  int64_t tree_size() const;
  void clear_tree();

  // P-EAGLE: n draft positions after the last step-0 row in one forward, as a chain of tree
  // nodes (node i's parent is node i-1) that read the mask token and mask_hidden (through fc)
  // instead of drafted tokens and hidden states. Row i predicts the token at depth i + 2 (the
  // last step-0 row's own logits are depth 1). Outputs logits [n, Vd] (unless null) and top.
  void parallel_step(int64_t n, float* logits, DraftTop* top = nullptr);

  // DFlash: the block anchored at the next position (length()), whose first row is the last
  // token extend() was given and whose context is every row extended so far; outputs the
  // logits [n, Vd] of block positions 1..n (n <= block - 1) and top. For a DFlash draft,
  // extend() only appends context rows (its hidden / logits outputs are not written). On the
  // CPU, in fp64 against the context's cached keys and values (draft/dflash.h: block_logits).
  void block_step(int64_t n, float* logits, DraftTop* top = nullptr);

  // Target id of a draft-vocabulary id.
  int32_t to_target(int64_t draft_id) const { return int32_t(draft_id + m_.vocab.d2t[size_t(draft_id)]); }

 private:
  struct Impl;
  DraftModel m_;
  std::unique_ptr<Impl> impl_;
  int64_t len_ = 0;
};

}  // namespace talon::spec
