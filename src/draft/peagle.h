// P-EAGLE (parallel EAGLE) on the CPU: the fp64 reference of the drafter that predicts all K
// draft positions in one forward pass, as speculators 0.9.0 trains it (models/peagle). It
// reuses the EAGLE-3 layer (eagle3.h) and adds a learned "mask hidden" vector, a mask token
// and trainable token embeddings.
//
// Layout. Positions t index Talon's unshifted sample (ids, mask, aux, hidden of eagle3::Sample).
// The training sequence is a set of elements (anchor a, depth d), 0 <= a + d <= T - 2:
//   depth 0, one element for every a: input token ids[a+1] and the aux states at a;
//   depth d >= 1: the mask token and mask_hidden in place of token and aux states.
// Every element at (a, d) predicts the target's distribution from hidden[a+d+1] (the token
// after ids[a+d+1]), counted when mask[a+d+1]; its RoPE position is a + d. An element attends
// to depth-0 elements whose anchor is <= its own, and to the elements of its own chain
// (same anchor) of depth <= its own.
// Loss: KL(target || draft) over the draft vocabulary, summed over counted elements and
// divided by their number (+1e-5, speculators' reduction). The draft lm_head is frozen (the
// target's rows of the draft vocabulary, as speculators initialises and keeps it).
#pragma once
#include <cstdint>
#include <vector>

#include "draft/eagle3.h"

namespace talon::peagle {

// Which elements a sample trains on (COD sampling): depth 0 is every position 0..T-2; depth d
// keeps a random floor(n_d * max(ratio^d, ratio_min)) of the chains that reached depth d-1 and
// can continue (next target position loss-masked), where n_d = (loss-masked positions) - d.
struct CodOptions {
  int depths = 8;
  double ratio = 0.7, ratio_min = 0.2;
};
struct CodSample {
  std::vector<int64_t> anchor, depth;  // elements, depth-major, anchors ascending within a depth
  int64_t size() const { return int64_t(anchor.size()); }
};
// valid[t] (t in [0, T-1)): 1 when position t's target row is loss-masked (mask[t+1]).
// Deterministic in (valid, options, seed), with the same draw on every platform.
CodSample cod_sample(const std::vector<uint8_t>& valid, const CodOptions& o, uint64_t seed);
// Every chain at every depth below `depths`: depth 0 at every position, depth d >= 1 at
// anchor a when positions a+1 .. a+d are valid (what COD sampling could reach, all of it).
// The evaluation sample: its per-depth accuracies are those of real drafts from every anchor.
CodSample all_chains(const std::vector<uint8_t>& valid, int depths);
// Whether element q attends to element kv (one document).
bool attends(const CodSample& s, int64_t q, int64_t kv);

struct Weights {
  eagle3::DraftWeights layer;     // fc, norms, attention, MLP, final norm, lm_head (frozen)
  std::vector<float> mask_hidden;  // [3H]
  std::vector<float> embed;        // [V, H], trainable
};
struct Grads {
  eagle3::DraftGrads layer;  // lm_head left untouched (frozen)
  std::vector<double> mask_hidden, embed;
  explicit Grads(const Weights& w);
};

// Added to the number of counted elements in the loss's denominator, as speculators does.
inline constexpr double kReductionEps = 1e-5;

struct Result {
  double loss = 0;
  int64_t counted = 0;
  std::vector<int64_t> hits, total;  // per depth: argmax matches and counted elements
  std::vector<double> kl;            // per depth: summed KL of its counted elements
  std::vector<int8_t> outcome;       // per element: -1 not counted, 0 missed, 1 argmax right
};

// The trainer's view of one sample's result: per depth d, loss_k[d] (mean KL), acc_k[d],
// cond_acc_k[d] (accuracy of the elements whose chain was right at every earlier depth) and
// n_k[d], over `depths` depths; `loss` is the result's own (speculators') reduction and
// accept_len 1 + sum_d prod_{j<=d} acc_k[j], as for EAGLE-3.
eagle3::TttResult ttt_view(const CodSample& cod, const Result& r, int depths);

// Forward over one sample's elements, the loss and per-depth accuracy; with `grads`, the
// hand-written backward of the loss, accumulated (+=). `tgt` supplies the target's final
// norm and lm_head (its embed is not read: the drafter has its own, w.embed). With `logits`,
// also every element's draft logits [N, Vd].
Result forward(const eagle3::DraftConfig& c, const Weights& w, const eagle3::TargetHead& tgt,
               const eagle3::DraftVocab& vocab, const eagle3::Sample& s, const CodSample& cod, int32_t mask_token,
               Grads* grads = nullptr, std::vector<double>* logits = nullptr);

}  // namespace talon::peagle
