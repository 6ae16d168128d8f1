// DFlash on the CPU: the fp64 reference of the block drafter as speculators 0.9.0 trains it
// (models/dflash): several Qwen3-style decoder layers that predict a whole block of tokens in
// one pass, conditioned on the target's hidden states through the layers' own keys and
// values.
//
// Layout. Positions t index the sample unshifted (ids, mask, aux, hidden as extract writes
// them; aux has n_aux target layers, [T, n_aux*H]). The context is C = hidden_norm(fc(aux)),
// one row per position. A block is anchored at a position a (loss-masked, a + B < T) and
// holds B rows at positions a .. a+B-1: the token ids[a] (slot 0), then the mask token. In
// every layer a block row attends to the context rows t < a and to all B rows of its own
// block (both ways). The context's keys and values are that layer's k/v projections of C
// (k normed per head, both rotated at their positions); C itself is not updated by the layers.
// Slot i >= 1 predicts ids[a+i]: its target is the target's distribution from hidden[a+i-1],
// counted when mask[a+i]. Slot 0 is the given anchor token and not trained.
// Loss: sum over counted slots of w_i * l_i, divided by (counted slots + 1e-5), where l_i is
// KL(target || draft) over the draft vocabulary (kl) or the cross-entropy of the target's
// argmax (ce), and w_i is exp(-(i-1)/gamma) (fixed-exp-decay) or D-PACE's weight: with
// s_i = (1 - alpha) exp(-l_i) + alpha on counted slots (1 elsewhere) and P_i = prod_{j<=i} s_j,
// w_i = sum_{k>=i, counted} P_k on counted slots, held constant in the backward.
// speculators' model defaults to kl + fixed-exp-decay; its trainer's DFlash recipe is
// ce + dpace (with 5 layers and blocks of 16).
// Frozen: the token embedding (the target's) and the lm_head (the target's rows of the draft
// vocabulary).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "draft/eagle3.h"

namespace talon::dflash {

struct Config {
  int64_t H = 0, I = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0, V = 0, Vd = 0;
  int64_t layers = 1, n_aux = 3, block = 8;
  double rms_eps = 1e-6;
  RopeConfig rope;
  enum class Loss { KL, CE } loss = Loss::KL;
  enum class Weighting { ExpDecay, DPace } weighting = Weighting::ExpDecay;
  double gamma = 4.0;        // fixed-exp-decay
  double dpace_alpha = 0.5;  // D-PACE smoothing
};

// One decoder layer, fp32, row-major [out, in] like PyTorch.
struct Layer {
  std::vector<float> in_ln;          // [H]
  std::vector<float> wq, wk, wv;     // [nh*hd, H], [nkv*hd, H] x2
  std::vector<float> q_norm, k_norm;  // [hd]
  std::vector<float> wo;             // [H, nh*hd]
  std::vector<float> post_ln;        // [H]
  std::vector<float> gate, up, down;  // [I, H], [I, H], [H, I]
  std::vector<std::pair<const char*, std::vector<float>*>> named();
};
struct Weights {
  std::vector<float> fc;           // [H, n_aux*H]
  std::vector<float> hidden_norm;  // [H]
  std::vector<Layer> layers;
  std::vector<float> norm;     // [H]
  std::vector<float> lm_head;  // [Vd, H], frozen
};
struct LayerGrads {
  std::vector<double> in_ln, wq, wk, wv, q_norm, k_norm, wo, post_ln, gate, up, down;
  explicit LayerGrads(Layer& l);
  std::vector<std::pair<const char*, std::vector<double>*>> named();
};
struct Grads {
  std::vector<double> fc, hidden_norm, norm;
  std::vector<LayerGrads> layers;
  explicit Grads(Weights& w);
};

struct Result {
  double loss = 0;
  int64_t counted = 0;
  std::vector<int64_t> hits, total;  // per slot 0..B-1: argmax matches and counted rows
  // Per slot, the counted rows whose block was right (counted and argmax right) at every
  // slot 1 .. i-1, and their matches: what a verifier accepts position by position.
  std::vector<int64_t> cond_hits, cond_total;
  std::vector<double> loss_sum;  // per slot: summed unweighted per-row loss
};

// The trainer's view of one sample's result: per block position i = 1 .. block-1, its
// accuracy, its accuracy on blocks right at every earlier position (cond_acc), and its mean
// per-row loss; `loss` is the result's own. A default Result (no anchors) gives empty tallies.
eagle3::TttResult ttt_view(const Result& r, int64_t block);

// Up to max_anchors distinct anchors drawn uniformly from the positions a with mask[a] and
// a + B < T, ascending. Deterministic in (mask, B, max_anchors, seed) on every platform.
std::vector<int64_t> select_anchors(const uint8_t* mask, int64_t T, int64_t B, int64_t max_anchors, uint64_t seed);

// Forward over the blocks at `anchors`, the loss and per-slot accuracy; with `grads`, the
// hand-written backward of the loss, accumulated (+=). `tgt` supplies the target's (frozen)
// embedding, final norm and lm_head. With `logits`, every block row's logits [n*B, Vd].
Result forward(const Config& c, const Weights& w, const eagle3::TargetHead& tgt, const eagle3::DraftVocab& vocab,
               const eagle3::Sample& s, const std::vector<int64_t>& anchors, int32_t mask_token,
               Grads* grads = nullptr, std::vector<double>* logits = nullptr);

// Drafting at inference, with the context cached: a context row's keys and values in each
// layer depend only on that row's aux states, so they are computed once, when the row joins
// (extend_context), and each block reads them (block_logits) instead of recomputing the whole
// context per round. The arithmetic is forward()'s row for row, so the logits are the same.
struct ContextCache {
  int64_t rows = 0;
  std::vector<std::vector<double>> k, v;  // per layer [rows, n_kv_heads * head_dim]; k normed + RoPE
};
// Appends n context rows (aux fp32 [n, n_aux * H]) at positions cache.rows ...
void extend_context(const Config& c, const Weights& w, const float* aux, int64_t n, ContextCache& cache);
// Logits [block, Vd] of the block at anchor cache.rows (the next position): slot 0 holds
// `first`, the others the mask token; it attends every cached row and its own block. `embed`
// is the target's token embedding [V, H].
std::vector<double> block_logits(const Config& c, const Weights& w, const float* embed, const ContextCache& cache,
                                 int32_t first, int32_t mask_token);

}  // namespace talon::dflash
