// Decoding one sequence with the target alone (the baseline, and `generate`'s inner step)
// or speculatively with an EAGLE-3 draft: chain drafting of k tokens, or EAGLE-2-style
// dynamic trees (top-k expansion of the most likely nodes at each depth, then the best N
// nodes by cumulative draft log-probability), verified in one target pass per round.
//
// Acceptance is lossless:
// * greedy: a draft token is kept iff it equals the target's argmax at its parent, so the
//   output equals target-only greedy decoding token for token;
// * chain sampling (drafts sampled from the draft distribution q): keep d with probability
//   min(1, p(d)/q(d)), else draw from norm(max(0, p - q)) and stop (speculative sampling);
// * tree sampling (deterministic top-k children): visit a node's children in score order,
//   keep child c with probability p'(c) where p' is the target distribution with the
//   rejected children removed and renormalised; if none is kept draw from p'. Each child is
//   a point-mass proposal, so the output token is distributed exactly as p.
// Target-only and speculative sampling of the same sequence use different random draws,
// so they agree in distribution, not token for token.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/decode.h"
#include "draft/draft_runner.h"
#include "model/sampling.h"

namespace talon::spec {

struct SpecConfig {
  enum class Mode { Chain, Tree };
  Mode mode = Mode::Chain;
  int k = 5;                // chain: draft tokens per round
  int depth = 6;            // tree: draft steps per round
  int topk = 8;             // tree: children per expanded node, and nodes expanded per depth
  int tree_tokens = 32;     // tree: draft nodes sent to verification
  std::string name() const;  // "chain-5", "tree-d6-k8-n32"
  void validate() const;
  // Most draft tokens one round can send to the target.
  int max_draft_tokens() const { return mode == Mode::Chain ? k : tree_tokens; }
};

struct GenLimits {
  int64_t max_new_tokens = 256;
  std::vector<int32_t> eos;  // generation stops after any of these (the token is kept)
  // Called after each new token with everything generated so far: true stops (e.g. a stop
  // string); the tokens stay.
  std::function<bool(const std::vector<int32_t>&)> stop;
};

struct DecodeStats {
  int64_t rounds = 0;      // target passes after the prefill
  int64_t new_tokens = 0;  // tokens generated
  int64_t drafted = 0;     // draft tokens sent to verification
  std::vector<int64_t> tried, accepted;  // per draft depth d (index d-1): reached, and kept
  double seconds = 0, target_seconds = 0, draft_seconds = 0, prefill_seconds = 0;
  // After the prefill: the time of the rounds (target passes and, speculating, drafting) and
  // of their target passes alone.
  double round_seconds = 0, round_target_seconds = 0;
  // Mean tokens per target pass after the prefill (tau, the acceptance length).
  double tau() const;
  // Mean milliseconds of a round, of its target pass, and of its drafting (0 without rounds).
  double round_ms() const { return rounds ? 1e3 * round_seconds / double(rounds) : 0; }
  double verify_ms() const { return rounds ? 1e3 * round_target_seconds / double(rounds) : 0; }
  double draft_ms() const { return rounds ? 1e3 * (round_seconds - round_target_seconds) / double(rounds) : 0; }
  void add(const DecodeStats& o);
};

// Target-only decoding: prefill `prompt` in slot `slot` (reset first), then one token per
// pass. Random draws use (params.seed, stream, token index).
std::vector<int32_t> decode_plain(Decoder& target, int slot, const std::vector<int32_t>& prompt,
                                  const SamplingParams& params, uint64_t stream, const GenLimits& limits,
                                  DecodeStats* stats = nullptr);

// Speculative decoding with `draft` (its aux layers are captured from the target).
std::vector<int32_t> decode_speculative(Decoder& target, int slot, DraftRunner& draft,
                                        const std::vector<int32_t>& prompt, const SpecConfig& cfg,
                                        const SamplingParams& params, uint64_t stream, const GenLimits& limits,
                                        DecodeStats* stats = nullptr);

// Pieces, exposed for tests.
struct DraftTree {
  std::vector<int32_t> tokens;   // target ids
  std::vector<int32_t> parents;  // -1: follows the root (the last accepted token)
  std::vector<double> scores;    // cumulative draft log-probability
  // Chain sampling only: the draft distribution each token was drawn from, over target ids.
  std::vector<std::vector<double>> q;
};
// The nodes kept from candidates (score desc, then depth, then creation order): a prefix of
// that order, so every kept node's ancestors are kept; re-indexed so parents come first.
DraftTree select_tree(const DraftTree& candidates, int n);

}  // namespace talon::spec
