// The EAGLE-3 draft model and its training-time-test (TTT) objective on the CPU:
// the reference the trainer's fast paths are checked against (SPEC-EAGLE3 sections 2-4).
//
// Pinned conventions: the draft vocabulary keeps the Vd most frequent loss-masked target
// tokens (ties towards the lower id), pads with the lowest unused ids and is sorted
// ascending; d2t[i] = kept[i] - i, t2d[j] = (j is kept). A position counts at step k when
// its target position t+1+k is inside the sample, loss-masked, and the target's
// full-vocabulary argmax lies in the draft vocabulary; loss_k is normalised by the number
// of positions that count at step k; the total is sum_k decay^k loss_k.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace talon::eagle3 {

struct DraftVocab {
  std::vector<int64_t> kept;  // [Vd] target ids, ascending
  std::vector<int64_t> d2t;   // [Vd] target_id = draft_id + d2t[draft_id]
  std::vector<uint8_t> t2d;   // [V]  1 where the target id is in the draft vocabulary
};
// counts[V]: loss-masked occurrences of each target token. Fails unless 1 <= Vd <= V.
DraftVocab build_draft_vocab(const std::vector<int64_t>& counts, int64_t vd);
// The vocabulary of these kept target ids (strictly ascending, each in [0, V)): d2t and t2d
// filled in. Fails naming the first id out of order or out of range.
DraftVocab draft_vocab_of(std::vector<int64_t> kept, int64_t V);

struct DraftConfig {
  int64_t H = 0, I = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0, V = 0, Vd = 0;
  double rms_eps = 1e-5;
  RopeConfig rope;
  bool norm_before_residual = false;
  int ttt_steps = 7;
  double step_decay = 0.8;
};

// A draft with the target's sizes (hidden, MLP width, heads, head size, vocabulary, RMSNorm
// eps, RoPE) and a draft vocabulary of min(vd, V) ids; the other fields at their defaults.
// For MLA + MoE targets (DeepSeek-V2/V3, Kimi-K2) the draft is still a Llama layer: the
// target's hidden size, dense MLP width (intermediate_size) and head count, as many kv
// heads as heads, head size v_head_dim, and RoPE as draft_rope_for gives it.
DraftConfig draft_config_for(const ModelConfig& target, int64_t vd);

// The draft's RoPE: the target's, except for the DeepSeek family, whose YaRN long-context
// scaling (and interleaved rope half of MLA heads) belongs to its own attention: there the
// draft rotates its whole head the Llama way at the target's base, unscaled.
RopeConfig draft_rope_for(const ModelConfig& target);

// Optional draft sizes that replace the target-derived ones (0: keep). The hidden size is
// always the target's (the draft reads the target's embeddings and hidden states).
struct DraftShape {
  int64_t intermediate = 0, heads = 0, kv_heads = 0, head_dim = 0;
  bool any() const { return intermediate || heads || kv_heads || head_dim; }
};
// Applies `s` to `c`; fails naming the option when the result is not a valid layer (sizes
// positive, heads a multiple of kv heads, an even head size).
void apply_draft_shape(DraftConfig& c, const DraftShape& s);

// fp32, row-major [out, in] like PyTorch.
struct DraftWeights {
  std::vector<float> fc;                     // [H, 3H]
  std::vector<float> in_ln, hidden_norm;     // [H]
  std::vector<float> wq, wk, wv;             // [nh*hd, 2H], [nkv*hd, 2H] x2
  std::vector<float> wo;                     // [H, nh*hd]
  std::vector<float> post_ln;                // [H]
  std::vector<float> gate, up, down;         // [I, H], [I, H], [H, I]
  std::vector<float> norm;                   // [H]
  std::vector<float> lm_head;                // [Vd, H]
  // Every tensor with its name, in the one order DraftGrads::named() also uses.
  std::vector<std::pair<const char*, std::vector<float>*>> named();
};

// RMSNorm weights (no weight decay); the rest are matrices.
bool is_norm_weight(const std::string& name);

// The frozen parts of the target the draft uses: embeddings, and the final norm and
// lm_head that turn h[L] into the target distribution.
struct TargetHead {
  const float* embed = nullptr;       // [V, H]
  const float* final_norm = nullptr;  // [H]
  const float* lm_head = nullptr;     // [V, H]
  double rms_eps = 1e-5;
};

struct Sample {
  const int32_t* ids = nullptr;   // [T]
  const uint8_t* mask = nullptr;  // [T]
  const float* aux = nullptr;     // [T, 3H] concat(h[a0], h[a1], h[a2])
  const float* hidden = nullptr;  // [T, H]  h[L]
  int64_t T = 0;
};

struct TttResult {
  std::vector<double> loss_k, acc_k, cond_acc_k;
  std::vector<int64_t> n_k;  // positions that count at each step
  double loss = 0;           // sum_k decay^k loss_k
  double accept_len = 0;     // simulated acceptance length 1 + sum_k prod_{j<=k} acc_j
  std::vector<std::vector<float>> logits;  // [K][T, Vd] when requested
};

// One TTT step's tallies over a sample's positions; `right[t]` carries "every earlier step
// was right at t" from step to step (for the conditional accuracy).
struct StepTally {
  double ce_sum = 0;
  int64_t n = 0, hits = 0, cond_n = 0, cond_hits = 0;
  void add(bool counts, bool hit, double ce, uint8_t& right) {
    if (counts) {
      ce_sum += ce;
      ++n;
      hits += hit;
      if (right) {
        ++cond_n;
        cond_hits += hit;
      }
    }
    right = right && hit;
  }
};
// Appends a step's loss, accuracies and count to r; updates the weighted total (decay_k =
// decay^k) and the simulated acceptance length.
void add_step(TttResult& r, const StepTally& s, double decay_k);

// Gradients of the total loss, same layout as DraftWeights, fp64; accumulated (+=).
struct DraftGrads {
  std::vector<double> fc, in_ln, hidden_norm, wq, wk, wv, wo, post_ln, gate, up, down, norm, lm_head;
  explicit DraftGrads(const DraftWeights& w);
  std::vector<std::pair<const char*, std::vector<double>*>> named();
};

// Forward of all K steps over one sample, loss and metrics; with `grads`, also the
// backward pass (written by hand, op by op) of the total loss into grads.
TttResult ttt_forward(const DraftConfig& c, const DraftWeights& w, const TargetHead& tgt, const DraftVocab& vocab,
                      const Sample& s, bool keep_logits = false, DraftGrads* grads = nullptr);

}  // namespace talon::eagle3
