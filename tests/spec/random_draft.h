// A random EAGLE-3 draft for a target (tests only).
#pragma once
#include <cmath>
#include <functional>
#include <random>

#include <gtest/gtest.h>
#include <string>
#include <vector>

#include "model/decode.h"
#include "model/model.h"
#include "draft/draft_runner.h"
#include "spec/speculate.h"
#include "draft/eagle3.h"
#include "draft/export.h"

namespace talon::testing {

// A random draft for `tc` (the target's sizes, a draft vocabulary of Vd ids): weights drawn
// at `scale` / sqrt(fan_in), norms near 1, lm_head scaled by `head_scale` so its
// distributions are peaked enough to be accepted sometimes.
inline spec::DraftModel random_draft(const ModelConfig& tc, int64_t Vd, uint32_t seed, double head_scale = 4.0) {
  spec::DraftModel m;
  m.config = eagle3::draft_config_for(tc, Vd);
  const auto& c = m.config;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  const auto shapes = train::draft_weight_shapes(c);
  auto named = m.weights.named();
  for (size_t i = 0; i < named.size(); ++i) {
    const auto& s = shapes[i];
    int64_t n = 1;
    for (auto d : s) n *= d;
    named[i].second->resize(size_t(n));
    const bool norm = s.size() == 1;
    const double sc = norm ? 0.1 : (std::string(named[i].first) == "lm_head" ? head_scale : 1.0) / std::sqrt(double(s[1]));
    for (auto& x : *named[i].second) x = norm ? 1.f + float(sc) * nd(rng) : float(sc) * nd(rng);
  }
  std::vector<int64_t> counts(size_t(c.V));
  for (auto& x : counts) x = rng() % 50;
  m.vocab = eagle3::build_draft_vocab(counts, Vd);
  m.aux_layer_ids = {1, int64_t(tc.n_layers / 2), tc.n_layers};
  m.origin = "random";
  return m;
}

// A random P-EAGLE draft: random_draft's layer plus its own embedding, mask_hidden and mask token.
inline spec::DraftModel random_peagle_draft(const ModelConfig& tc, int64_t Vd, uint32_t seed, double head_scale = 4.0) {
  spec::DraftModel m = random_draft(tc, Vd, seed, head_scale);
  std::mt19937 rng(seed + 101);
  std::normal_distribution<float> nd(0.f, 1.f);
  m.drafter = "peagle";
  m.mask_token = int32_t(tc.vocab - 1);
  m.mask_hidden.resize(size_t(3 * tc.hidden));
  for (auto& x : m.mask_hidden) x = nd(rng);
  m.embed.resize(size_t(tc.vocab * tc.hidden));
  for (auto& x : m.embed) x = 0.5f * nd(rng);
  m.origin = "random P-EAGLE";
  return m;
}

// A random DFlash draft: `layers` Qwen3-style layers with blocks of `block`, the target's sizes
// and 3 aux layers; weights at `scale` / sqrt(fan_in), norms near 1.
inline spec::DraftModel random_dflash_draft(const ModelConfig& tc, int64_t Vd, uint32_t seed, int64_t layers = 2,
                                            int64_t block = 4) {
  spec::DraftModel m = random_draft(tc, Vd, seed);
  m.drafter = "dflash";
  m.mask_token = int32_t(tc.vocab - 1);
  dflash::Config& c = m.dflash;
  c.H = m.config.H, c.I = m.config.I, c.n_heads = m.config.n_heads, c.n_kv_heads = m.config.n_kv_heads;
  c.head_dim = m.config.head_dim, c.V = m.config.V, c.Vd = m.config.Vd, c.rms_eps = m.config.rms_eps;
  c.rope = m.config.rope, c.layers = layers, c.block = block, c.n_aux = 3;
  std::mt19937 rng(seed + 202);
  std::normal_distribution<float> nd(0.f, 1.f);
  const auto shapes = train::dflash_weight_shapes(c);
  auto named = train::dflash_named(m.dweights, c);
  for (size_t i = 0; i < named.size(); ++i) {
    int64_t n = 1;
    for (auto d : shapes[i]) n *= d;
    named[i].second->resize(size_t(n));
    const bool norm = shapes[i].size() == 1;
    const double sc = norm ? 0.1 : (named[i].first == "lm_head" ? 4.0 : 1.0) / std::sqrt(double(shapes[i][1]));
    for (auto& x : *named[i].second) x = norm ? 1.f + float(sc) * nd(rng) : float(sc) * nd(rng);
  }
  m.origin = "random DFlash";
  return m;
}

// The drafting configurations the greedy-equivalence tests run: chains of 1 and 4, a narrow
// deep tree and a wide shallow one (more than 32 verified nodes).
inline std::vector<spec::SpecConfig> greedy_test_configs() {
  std::vector<spec::SpecConfig> cfgs(4);
  cfgs[0].k = 1;
  cfgs[1].k = 4;
  cfgs[2].mode = cfgs[3].mode = spec::SpecConfig::Mode::Tree;
  cfgs[2].depth = 4, cfgs[2].topk = 4, cfgs[2].tree_tokens = 12;
  cfgs[3].depth = 3, cfgs[3].topk = 16, cfgs[3].tree_tokens = 40;
  return cfgs;
}

// What run_greedy_comparisons runs: the configurations, how many random prompts, and how
// many new tokens each decoding makes.
struct GreedyRuns {
  std::vector<spec::SpecConfig> configs = greedy_test_configs();
  int prompts = 4;
  int64_t max_new_tokens = 40;
};

// The greedy-equivalence driver shared by the CPU and GPU tests and by every drafter family:
// random prompts (from a fixed seed), each decoded greedily by the target alone and
// speculatively with every configuration; `judge(prompt_i, prompt, want, cfg, got, stats)`
// decides whether each speculative output may stand beside the target-only one. Where tree
// configurations ran, they must have accepted draft tokens (tau > 1), so the acceptance path
// is exercised, not only rejections. Call it under ASSERT_NO_FATAL_FAILURE.
inline void run_greedy_comparisons(
    Decoder& dec, spec::DraftRunner& run, int64_t vocab, const std::string& what,
    const std::function<void(int, const std::vector<int32_t>&, const std::vector<int32_t>&, const spec::SpecConfig&,
                             const std::vector<int32_t>&, const spec::DecodeStats&)>& judge,
    const GreedyRuns& runs = {}) {
  SamplingParams greedy;
  spec::GenLimits lim;
  lim.max_new_tokens = runs.max_new_tokens;
  std::mt19937 rng(4);
  spec::DecodeStats tree_stats;
  bool trees = false;
  for (int prompt_i = 0; prompt_i < runs.prompts; ++prompt_i) {
    std::vector<int32_t> prompt(size_t(3 + prompt_i * 5));
    for (auto& x : prompt) x = int32_t(rng() % uint32_t(vocab));
    const auto want = spec::decode_plain(dec, 0, prompt, greedy, 0, lim);
    ASSERT_EQ(int64_t(want.size()), lim.max_new_tokens);
    for (const auto& cfg : runs.configs) {
      spec::DecodeStats st;
      const auto got = spec::decode_speculative(dec, 0, run, prompt, cfg, greedy, 0, lim, &st);
      if (cfg.mode == spec::SpecConfig::Mode::Tree) {
        tree_stats.add(st);
        trees = true;
      }
      judge(prompt_i, prompt, want, cfg, got, st);
    }
  }
  if (!trees) return;
  int64_t acc = 0;
  for (auto a : tree_stats.accepted) acc += a;
  EXPECT_GT(acc, 0) << what;
  EXPECT_GT(tree_stats.tau(), 1.0) << what;
}

// Chains of these lengths, for the families that draft one chain a round.
inline GreedyRuns greedy_chains(std::initializer_list<int> ks, int64_t max_new_tokens) {
  GreedyRuns r;
  r.configs.clear();
  for (int k : ks) {
    spec::SpecConfig c;
    c.k = k;
    r.configs.push_back(c);
  }
  r.prompts = 3;
  r.max_new_tokens = max_new_tokens;
  return r;
}

}  // namespace talon::testing
