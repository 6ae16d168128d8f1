// Drafting and speculative decoding on the CPU: the draft runner against the training-time
// test (TTT) forward it must mirror; tree selection; greedy equivalence of chain and tree
// speculation with target-only decoding; and a statistical test that speculative sampling
// (chain and tree) draws from the target's own distribution.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>

#include "model/decode.h"
#include "backend/backend.h"
#include "model/model.h"
#include "model/sampling.h"
#include "spec/speculate.h"
#include "tests/spec/random_draft.h"
#include "tests/test_util.h"
#include "tests/tolerances.h"
#include "draft/eagle3.h"
#include "draft/peagle.h"
#include "draft/export.h"
#include "draft/optim.h"
#include "draft/trainer.h"

using namespace talon;
using namespace talon::spec;
using namespace talon::testing;

namespace {


TEST(DraftRunner, TeacherForcedChainsEqualTheTrainingForward) {
  auto ck = open_checkpoint(golden_fixture("llama_gqa"));
  const ModelConfig& tc = ck->config();
  DraftModel m = random_draft(tc, tc.vocab / 2, 5);
  m.config.ttt_steps = 4;
  const int64_t T = 12, H = tc.hidden, V = tc.vocab, Vd = m.config.Vd, K = m.config.ttt_steps;
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<int32_t> ids(static_cast<size_t>(T));
  for (auto& x : ids) x = int32_t(rng() % uint32_t(V));
  std::vector<uint8_t> mask(static_cast<size_t>(T), 1);
  std::vector<float> aux(size_t(T * 3 * H)), hid(size_t(T * H)), fnorm(static_cast<size_t>(H), 1.f);
  for (auto& x : aux) x = nd(rng);
  for (auto& x : hid) x = nd(rng);
  // The TTT forward reads the target embedding as fp32.
  const auto ew = ck->weight(*ck->find("model.embed_tokens.weight"));
  std::vector<float> embed(size_t(V * H)), head(size_t(V * H));
  convert_to_f32(ew.dtype, ew.data, embed.data(), embed.size());
  for (auto& x : head) x = 0.1f * nd(rng);
  eagle3::TargetHead th{embed.data(), fnorm.data(), head.data(), tc.rms_eps};
  eagle3::Sample s{ids.data(), mask.data(), aux.data(), hid.data(), T};
  const auto ref = eagle3::ttt_forward(m.config, m.weights, th, m.vocab, s, /*keep_logits=*/true);
  ASSERT_EQ(int64_t(ref.logits.size()), K);

  DraftRunner run(m, *ck);
  std::vector<float> g(static_cast<size_t>(H)), lg(static_cast<size_t>(Vd)), g2(static_cast<size_t>(H)),
      lg2(static_cast<size_t>(Vd));
  double worst = 0;
  for (int64_t p = 0; p + 1 < T; ++p) {
    // Step 0 at position p: token x[p+1], aux of p (appended one row at a time).
    run.extend(&ids[size_t(p + 1)], aux.data() + p * 3 * H, 1, g.data(), lg.data());
    worst = std::max(worst, rel_err(lg.data(), ref.logits[0].data() + p * Vd, size_t(Vd)));
    // Steps 1..K-1 at base p: teacher-forced tokens x[p+1+k], each node below the last.
    std::vector<float> gk = g;
    for (int64_t k = 1; k < K && p + 1 + k < T; ++k) {
      run.tree_step({ids[size_t(p + 1 + k)]}, {int32_t(k - 2)}, gk.data(), g2.data(), lg2.data());
      const double e = rel_err(lg2.data(), ref.logits[size_t(k)].data() + p * Vd, size_t(Vd));
      EXPECT_LE(e, tol::kDraftRunnerRel) << "position " << p << " step " << k;
      worst = std::max(worst, e);
      gk = g2;
    }
    run.clear_tree();
  }
  EXPECT_LE(worst, tol::kDraftRunnerRel);
}

// P-EAGLE drafting at inference (step-0 rows, then one parallel step of mask rows) against
// the training forward (draft/peagle.h) on the same elements: anchor p's chain of depths
// 0..n must give the same logits, which pins positions, masks, mask_hidden through fc and the
// draft's own embedding to the training convention.
TEST(DraftRunner, ParallelStepEqualsThePEagleTrainingForward) {
  auto ck = open_checkpoint(golden_fixture("llama_gqa"));
  const ModelConfig& tc = ck->config();
  DraftModel m = random_peagle_draft(tc, tc.vocab / 2, 7);
  const int64_t T = 12, H = tc.hidden, V = tc.vocab, Vd = m.config.Vd, K = 4;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<int32_t> ids(static_cast<size_t>(T));
  for (auto& x : ids) x = int32_t(rng() % uint32_t(V - 1));
  std::vector<uint8_t> mask(static_cast<size_t>(T), 1);
  std::vector<float> aux(size_t(T * 3 * H)), hid(size_t(T * H)), fnorm(static_cast<size_t>(H), 1.f),
      head(size_t(V * H));
  for (auto& x : aux) x = nd(rng);
  for (auto& x : hid) x = nd(rng);
  for (auto& x : head) x = 0.1f * nd(rng);
  eagle3::TargetHead th{nullptr, fnorm.data(), head.data(), tc.rms_eps};
  eagle3::Sample s{ids.data(), mask.data(), aux.data(), hid.data(), T};
  peagle::Weights pw{m.weights, m.mask_hidden, m.embed};

  DraftRunner run(m, *ck);
  std::vector<float> g(static_cast<size_t>(H)), lg(static_cast<size_t>(Vd)), pl(size_t(K * Vd));
  double worst = 0;
  int compared = 0;
  for (int64_t p = 0; p + 2 < T; ++p) {
    const int64_t n = std::min<int64_t>(K - 1, T - 2 - p);  // depths 1..n after anchor p
    peagle::CodSample cod;
    for (int64_t a = 0; a + 1 < T; ++a) cod.anchor.push_back(a), cod.depth.push_back(0);
    for (int64_t d = 1; d <= n; ++d) cod.anchor.push_back(p), cod.depth.push_back(d);
    std::vector<double> ref64;
    peagle::forward(m.config, pw, th, m.vocab, s, cod, m.mask_token, nullptr, &ref64);
    ASSERT_EQ(int64_t(ref64.size()), cod.size() * Vd);
    const std::vector<float> ref(ref64.begin(), ref64.end());
    run.reset();
    std::vector<int32_t> next(ids.begin() + 1, ids.begin() + p + 2);
    run.extend(next.data(), aux.data(), p + 1, g.data(), lg.data());
    double e = rel_err(lg.data(), ref.data() + p * Vd, size_t(Vd));
    EXPECT_LE(e, tol::kDraftRunnerRel) << "anchor " << p << " depth 0";
    worst = std::max(worst, e);
    if (n == 0) continue;
    run.parallel_step(n, pl.data());
    for (int64_t d = 1; d <= n; ++d) {
      e = rel_err(pl.data() + (d - 1) * Vd, ref.data() + (T - 1 + d - 1) * Vd, size_t(Vd));
      EXPECT_LE(e, tol::kDraftRunnerRel) << "anchor " << p << " depth " << d;
      worst = std::max(worst, e);
      ++compared;
    }
    run.clear_tree();
  }
  EXPECT_GT(compared, 20);
  EXPECT_LE(worst, tol::kDraftRunnerRel);
  // An EAGLE-3 draft has no parallel step.
  DraftModel e3 = random_draft(tc, tc.vocab / 2, 7);
  DraftRunner r3(e3, *ck);
  r3.extend(&ids[1], aux.data(), 1, g.data(), lg.data());
  EXPECT_THROW(r3.parallel_step(2, pl.data()), Error);
}

// Greedy speculation with a P-EAGLE draft (one parallel step per round) leaves target-only
// greedy decoding unchanged; a tree is refused.
TEST(Speculate, PEagleChainsKeepGreedyOutputs) {
  for (const std::string fx : {"llama_gqa", "qwen3"}) {
    auto ck = open_checkpoint(golden_fixture(fx));
    const ModelConfig& tc = ck->config();
    auto dec = make_cpu_decoder(*ck, 1, 256);
    DraftModel m = random_peagle_draft(tc, tc.vocab / 2, 23);
    DraftRunner run(m, *ck);
    ASSERT_NO_FATAL_FAILURE(run_greedy_comparisons(
        *dec, run, tc.vocab, fx,
        [&](int prompt_i, const std::vector<int32_t>&, const std::vector<int32_t>& want, const SpecConfig& cfg,
            const std::vector<int32_t>& got, const DecodeStats& st) {
          EXPECT_EQ(got, want) << fx << " prompt " << prompt_i << " " << cfg.name();
          EXPECT_EQ(int64_t(st.tried.size()), cfg.k);
        },
        greedy_chains({1, 2, 5}, 30)));
    SpecConfig tree;
    tree.mode = SpecConfig::Mode::Tree;
    EXPECT_THROW(decode_speculative(*dec, 0, run, {1, 2, 3}, tree, SamplingParams{}, 0, GenLimits{}), Error) << fx;
  }
}

// DFlash drafting at inference (context rows by extend, then a block at the next position)
// against the training forward on the same block: the logits of positions 1..B-1 agree.
TEST(DraftRunner, BlockStepEqualsTheDFlashTrainingForward) {
  auto ck = open_checkpoint(golden_fixture("llama_gqa"));
  const ModelConfig& tc = ck->config();
  DraftModel m = random_dflash_draft(tc, tc.vocab / 2, 9);
  const int64_t T = 14, H = tc.hidden, V = tc.vocab, Vd = m.config.Vd, B = m.dflash.block;
  std::mt19937 rng(12);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<int32_t> ids(static_cast<size_t>(T));
  for (auto& x : ids) x = int32_t(rng() % uint32_t(V - 1));
  std::vector<uint8_t> mask(static_cast<size_t>(T), 0);
  std::vector<float> aux(size_t(T * 3 * H)), hid(size_t(T * H), 0.f);
  for (auto& x : aux) x = nd(rng);
  const auto ew = ck->weight(*ck->find("model.embed_tokens.weight"));
  std::vector<float> embed(size_t(V * H));
  convert_to_f32(ew.dtype, ew.data, embed.data(), embed.size());
  const eagle3::TargetHead th{embed.data(), nullptr, nullptr, tc.rms_eps};
  const eagle3::Sample s{ids.data(), mask.data(), aux.data(), hid.data(), T};
  DraftRunner run(m, *ck);
  std::vector<float> lg(size_t((B - 1) * Vd));
  double worst = 0;
  for (int64_t p = 1; p + B < T; ++p) {
    std::vector<double> ref64;
    dflash::forward(m.dflash, m.dweights, th, m.vocab, s, {p}, m.mask_token, nullptr, &ref64);
    const std::vector<float> ref(ref64.begin() + Vd, ref64.end());  // positions 1..B-1
    run.reset();
    std::vector<int32_t> next(ids.begin() + 1, ids.begin() + p + 1);  // last: ids[p], the block's token
    // The context arrives in pieces (one row, then up to two at a time), as accepted tokens
    // do while decoding; the runner caches each row's keys and values as it joins.
    for (int64_t at = 0; at < p;) {
      const int64_t n = at == 0 ? 1 : std::min<int64_t>(2, p - at);
      run.extend(next.data() + at, aux.data() + at * 3 * H, n, nullptr, nullptr);
      at += n;
    }
    run.block_step(B - 1, lg.data());
    const double e = rel_err(lg.data(), ref.data(), lg.size());
    // The cached path does the training forward's arithmetic row for row: the same floats.
    EXPECT_EQ(e, 0.0) << "anchor " << p;
    worst = std::max(worst, e);
  }
  EXPECT_EQ(worst, 0.0);
  EXPECT_THROW(run.block_step(B, lg.data()), Error) << "more than block - 1 positions";
  EXPECT_THROW(DraftRunner(m, *ck, 99, 64), Error) << "no GPU 99 (or no CUDA backend)";
}

// Greedy speculation with a DFlash draft (one block per round) leaves target-only greedy
// decoding unchanged; chains longer than the block are capped at block - 1; a tree is refused.
TEST(Speculate, DFlashChainsKeepGreedyOutputs) {
  for (const std::string fx : {"llama_gqa", "qwen3"}) {
    auto ck = open_checkpoint(golden_fixture(fx));
    const ModelConfig& tc = ck->config();
    auto dec = make_cpu_decoder(*ck, 1, 256);
    DraftModel m = random_dflash_draft(tc, tc.vocab / 2, 29);
    DraftRunner run(m, *ck);
    ASSERT_NO_FATAL_FAILURE(run_greedy_comparisons(
        *dec, run, tc.vocab, fx,
        [&](int prompt_i, const std::vector<int32_t>&, const std::vector<int32_t>& want, const SpecConfig& cfg,
            const std::vector<int32_t>& got, const DecodeStats& st) {
          EXPECT_EQ(got, want) << fx << " prompt " << prompt_i << " " << cfg.name();
          for (size_t d = size_t(m.dflash.block - 1); d < st.tried.size(); ++d)
            EXPECT_EQ(st.tried[d], 0) << "depth " << d + 1 << " beyond the block";
        },
        greedy_chains({1, 3, 6}, 24)));
    SpecConfig tree;
    tree.mode = SpecConfig::Mode::Tree;
    EXPECT_THROW(decode_speculative(*dec, 0, run, {1, 2, 3}, tree, SamplingParams{}, 0, GenLimits{}), Error) << fx;
  }
}

TEST(DraftTree, SelectionKeepsAncestorsAndOrdersParentsFirst) {
  DraftTree c;
  // depth 1: a(-0.1) b(-2); depth 2 under a: c(-0.5) d(-0.3); under b: e(-2.1); depth 3 under d: f(-0.3)
  c.tokens = {10, 11, 12, 13, 14, 15};
  c.parents = {-1, -1, 0, 0, 1, 3};
  c.scores = {-0.1, -2.0, -0.5, -0.3, -2.1, -0.3};
  const DraftTree t = select_tree(c, 4);
  // Kept: a, d, f (tie with d, deeper), c. Order: depth 1, depth 2 (d before c), depth 3.
  ASSERT_EQ(t.tokens.size(), 4u);
  EXPECT_EQ(t.tokens, (std::vector<int32_t>{10, 13, 12, 15}));
  EXPECT_EQ(t.parents, (std::vector<int32_t>{-1, 0, 0, 1}));
}

// Target-only greedy decoding vs speculation, token for token, across prompts and modes.
TEST(Speculate, GreedyOutputEqualsTargetOnlyGreedy) {
  for (const std::string fx : {"llama_gqa", "qwen3", "deepseek_v3"}) {
    auto ck = open_checkpoint(golden_fixture(fx));
    const ModelConfig& tc = ck->config();
    auto dec = make_cpu_decoder(*ck, 1, 256);
    DraftModel m = random_draft(tc, tc.vocab / 2, 21);
    DraftRunner run(m, *ck);
    ASSERT_NO_FATAL_FAILURE(run_greedy_comparisons(
        *dec, run, tc.vocab, fx,
        [&](int prompt_i, const std::vector<int32_t>&, const std::vector<int32_t>& want, const SpecConfig& cfg,
            const std::vector<int32_t>& got, const DecodeStats& st) {
          EXPECT_EQ(got, want) << fx << " prompt " << prompt_i << " " << cfg.name();
          EXPECT_EQ(st.new_tokens, int64_t(got.size()));
        }));
  }
}

// Chi-square goodness of fit: the (first, second) generated token pairs of speculative
// sampling against the exact distribution p(x1) p(x2 | x1) of the target. Cells expected
// below 5 draws are pooled. Returns the upper-tail p-value (Wilson-Hilferty).
double chi_square_p(const std::map<std::pair<int, int>, double>& expect_p, const std::map<std::pair<int, int>, int>& seen,
                    int n) {
  double chi = 0, pooled_e = 0, pooled_o = 0;
  int cells = 0;
  for (const auto& [k, p] : expect_p) {
    const double e = p * n;
    const double o = seen.count(k) ? seen.at(k) : 0;
    if (e < 5) {
      pooled_e += e;
      pooled_o += o;
      continue;
    }
    chi += (o - e) * (o - e) / e;
    ++cells;
  }
  if (pooled_e > 0) {
    chi += (pooled_o - pooled_e) * (pooled_o - pooled_e) / pooled_e;
    ++cells;
  }
  const double df = cells - 1;
  const double z = (std::cbrt(chi / df) - (1 - 2 / (9 * df))) / std::sqrt(2 / (9 * df));
  return 0.5 * std::erfc(z / std::sqrt(2.0));
}

// Target-only decoding at T > 0 draws token i of a sequence with uniform01(seed, stream, i),
// as `generate` does (so a sequence samples the same text in eval's baseline and in
// generate): checked against a second decoder's logits sampled here position by position.
TEST(Speculate, PlainSampledDecodingDrawsPositionByPosition) {
  auto ck = open_checkpoint(golden_fixture("llama_gqa"));
  const int64_t V = ck->config().vocab;
  auto dec = make_cpu_decoder(*ck, 1, 64), ref = make_cpu_decoder(*ck, 1, 64);
  SamplingParams sp;
  sp.temperature = 0.9;
  sp.top_p = 0.9;
  sp.seed = 77;
  GenLimits lim;
  lim.max_new_tokens = 12;
  const std::vector<int32_t> prompt = {3, 17, 42, 8, 5};
  int differing_streams = 0;
  std::vector<int32_t> first;
  for (const uint64_t stream : {uint64_t(0), uint64_t(5), uint64_t(123456)}) {
    const auto got = decode_plain(*dec, 0, prompt, sp, stream, lim);
    ASSERT_EQ(got.size(), 12u);
    std::vector<int32_t> want;
    std::vector<float> lg(static_cast<size_t>(V));
    std::vector<double> scratch;
    ref->reset(0);
    ref->forward({{0, prompt, {}, false}}, Capture{}, lg.data());
    ref->commit_all(0);
    for (int i = 0; i < 12; ++i) {
      want.push_back(sample_token(lg.data(), V, sp, stream, uint64_t(i), scratch));
      ref->forward({{0, {want.back()}, {}, true}}, Capture{}, lg.data());
      ref->commit_all(0);
    }
    EXPECT_EQ(got, want) << "stream " << stream;
    if (first.empty())
      first = got;
    else
      differing_streams += got != first;
  }
  EXPECT_GT(differing_streams, 0) << "streams should draw different tokens";
}

TEST(Speculate, SamplingMatchesTheTargetDistribution) {
  auto ck = open_checkpoint(golden_fixture("llama_gqa"));
  const ModelConfig& tc = ck->config();
  const int64_t V = tc.vocab;
  auto dec = make_cpu_decoder(*ck, 1, 64);
  auto model = make_cpu_model(*ck);
  // A draft that is often right: low temperature target, peaked draft.
  DraftModel m = random_draft(tc, V, 33, 8.0);
  DraftRunner run(m, *ck);
  SamplingParams sp;
  sp.temperature = 0.8;
  sp.top_p = 0.95;
  sp.seed = 1234;
  const std::vector<int32_t> prompt = {3, 17, 42, 8, 5};
  // Exact p(x1) and p(x2 | x1) from full forwards.
  std::map<std::pair<int, int>, double> exact;
  {
    std::vector<double> p1, p2;
    auto last_logits = [&](const std::vector<int32_t>& ids) {
      Batch b;
      b.add(ids.data(), int64_t(ids.size()));
      std::vector<float> lg(ids.size() * size_t(V));
      model->forward(b, Capture{}, lg.data());
      return std::vector<float>(lg.end() - V, lg.end());
    };
    auto l1 = last_logits(prompt);
    sampling_distribution(l1.data(), V, sp, p1);
    for (int a = 0; a < V; ++a) {
      if (p1[size_t(a)] <= 0) continue;
      auto ids = prompt;
      ids.push_back(a);
      auto l2 = last_logits(ids);
      sampling_distribution(l2.data(), V, sp, p2);
      for (int b = 0; b < V; ++b)
        if (p2[size_t(b)] > 0) exact[{a, b}] = p1[size_t(a)] * p2[size_t(b)];
    }
  }
  GenLimits lim;
  lim.max_new_tokens = 2;
  const int n = 4000;
  SpecConfig chain, tree;
  chain.k = 3;
  tree.mode = SpecConfig::Mode::Tree;
  tree.depth = 2, tree.topk = 4, tree.tree_tokens = 8;
  for (const auto& cfg : {chain, tree}) {
    std::map<std::pair<int, int>, int> seen;
    DecodeStats st;
    for (int i = 0; i < n; ++i) {
      const auto out = decode_speculative(*dec, 0, run, prompt, cfg, sp, uint64_t(i), lim, &st);
      ASSERT_EQ(out.size(), 2u);
      ++seen[{out[0], out[1]}];
    }
    const double pv = chi_square_p(exact, seen, n);
    EXPECT_GT(pv, 1e-3) << cfg.name() << ": the sampled pairs do not follow the target distribution";
    // Both branches (accept, and reject + residual) were taken.
    ASSERT_FALSE(st.tried.empty());
    EXPECT_GT(st.accepted[0], n / 50) << cfg.name();
    EXPECT_LT(st.accepted[0], st.tried[0]) << cfg.name();
  }
  // The test can fail: a biased sampler (the draft's token always kept) is rejected.
  {
    std::map<std::pair<int, int>, int> seen;
    std::vector<double> scratch;
    for (int i = 0; i < n; ++i) {
      // Biased: x2 from the target at temperature 0.4 instead of 0.8.
      SamplingParams biased = sp;
      biased.temperature = 0.4;
      const auto a = decode_plain(*dec, 0, prompt, sp, uint64_t(i), {1, {}, {}});
      auto ids = prompt;
      ids.push_back(a[0]);
      const auto b = decode_plain(*dec, 0, ids, biased, uint64_t(i) + 7777, {1, {}, {}});
      ++seen[{a[0], b[0]}];
    }
    EXPECT_LT(chi_square_p(exact, seen, n), 1e-3);
  }
}

}  // namespace

// sampling_distribution against a plain full sort of the vocabulary (written here from the
// definition: softmax at T, ids by decreasing probability with ties to the lower id, keep the
// top_k, then the shortest prefix whose mass reaches top_p, renormalise), on logits with many
// ties and on vocabularies where the kept set is large (flat) and small (peaked).
TEST(Sampling, TopKTopPMatchFullSortDefinition) {
  std::mt19937 rng(7);
  for (int64_t V : {1, 5, 300, 49152})
    for (double spread : {0.05, 1.0, 12.0})
      for (auto [k, pp] : {std::pair<int, double>{0, 0.95}, {0, 0.5}, {0, 1.0}, {40, 0.9}, {3, 1.0}, {0, 0.9999}}) {
        std::vector<float> logits(static_cast<size_t>(V));
        std::normal_distribution<float> nd(0.f, float(spread));
        for (auto& x : logits) x = std::round(nd(rng) * 8.f) / 8.f;  // coarse: many exact ties
        SamplingParams sp;
        sp.temperature = 0.7;
        sp.top_k = k;
        sp.top_p = pp;
        std::vector<double> got;
        sampling_distribution(logits.data(), V, sp, got);
        double mx = -INFINITY, z = 0;
        for (float x : logits) mx = std::max(mx, double(x));
        std::vector<double> p(static_cast<size_t>(V));
        for (int64_t i = 0; i < V; ++i) z += p[size_t(i)] = std::exp((double(logits[size_t(i)]) - mx) / 0.7);
        for (auto& x : p) x /= z;
        std::vector<int32_t> ids(static_cast<size_t>(V));
        for (int64_t i = 0; i < V; ++i) ids[size_t(i)] = int32_t(i);
        std::sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) {
          return p[size_t(a)] != p[size_t(b)] ? p[size_t(a)] > p[size_t(b)] : a < b;
        });
        int64_t keep = k > 0 ? std::min<int64_t>(k, V) : V;
        double mass = 0;
        for (int64_t i = 0; i < keep && pp < 1; ++i)
          if ((mass += p[size_t(ids[size_t(i)])]) >= pp) {
            keep = i + 1;
            break;
          }
        double kept = 0;
        for (int64_t i = 0; i < keep; ++i) kept += p[size_t(ids[size_t(i)])];
        std::vector<double> want(static_cast<size_t>(V), 0.0);
        for (int64_t i = 0; i < keep; ++i) want[size_t(ids[size_t(i)])] = p[size_t(ids[size_t(i)])] / kept;
        ASSERT_EQ(got.size(), want.size());
        int64_t nonzero = 0;
        for (int64_t i = 0; i < V; ++i) {
          ASSERT_NEAR(got[size_t(i)], want[size_t(i)], 1e-12) << "V=" << V << " spread=" << spread << " k=" << k
                                                              << " p=" << pp << " id " << i;
          nonzero += got[size_t(i)] > 0;
        }
        EXPECT_EQ(nonzero, keep) << "V=" << V << " spread=" << spread << " k=" << k << " p=" << pp;
      }
}

namespace {

// Features of a whole sequence as `talon extract` makes them: the target's forward over it,
// capturing the draft's aux layers (rows [T, 3H]) and h[L] for the target side.
struct SeqFeatures {
  std::vector<float> aux, hidden;
};
SeqFeatures extract_like(Model& model, const std::vector<int64_t>& aux_ids, const std::vector<int32_t>& ids) {
  const int64_t T = int64_t(ids.size()), H = model.config().hidden;
  std::vector<std::vector<float>> cap(4, std::vector<float>(size_t(T * H)));
  Batch b;
  b.add(ids.data(), T);
  model.forward(b,
                Capture({int(aux_ids[0]), int(aux_ids[1]), int(aux_ids[2]), int(model.config().n_layers)},
                        {cap[0].data(), cap[1].data(), cap[2].data(), cap[3].data()}),
                nullptr);
  SeqFeatures f;
  f.aux.resize(size_t(T * 3 * H));
  for (int64_t t = 0; t < T; ++t)
    for (int i = 0; i < 3; ++i) std::copy_n(cap[size_t(i)].data() + t * H, H, f.aux.data() + (t * 3 + i) * H);
  f.hidden = std::move(cap[3]);
  return f;
}

}  // namespace

// Training and serving must see the same drafter: a draft trained (hand-written backward,
// AdamW) on the target's own greedy answers, then served by chain speculation, must accept
// at every depth exactly what the training forward (ttt_forward on extract-style features of
// the final text, teacher-forced) predicts round by round. A wrong capture row, a misaligned
// token/feature pair, a stale draft cache or a layer-id mix-up between the decoder and the
// extract path changes the served counts while greedy output stays equal.
TEST(Speculate, ServedAcceptanceEqualsTheTrainingForward) {
  auto ck = open_checkpoint(golden_fixture("llama_gqa"));
  const ModelConfig& tc = ck->config();
  const int64_t V = tc.vocab, H = tc.hidden;
  auto model = make_cpu_model(*ck);
  auto dec = make_cpu_decoder(*ck, 1, 256);
  const int K = 4, L0 = 6, N = 40;
  const SamplingParams greedy;
  GenLimits open_ended;
  open_ended.max_new_tokens = N + K + 2;

  // The target's greedy answers to random prompts: the training texts.
  std::mt19937 rng(5);
  std::vector<std::vector<int32_t>> prompts, texts;
  std::vector<int64_t> counts(size_t(V), 0);
  for (int i = 0; i < 12; ++i) {
    std::vector<int32_t> p(L0);
    for (auto& x : p) x = int32_t(3 + rng() % uint32_t(V - 3));
    auto ans = decode_plain(*dec, 0, p, greedy, 0, open_ended);
    ASSERT_EQ(int64_t(ans.size()), open_ended.max_new_tokens);
    for (auto x : ans) ++counts[size_t(x)];
    std::vector<int32_t> t = p;
    t.insert(t.end(), ans.begin(), ans.end());
    prompts.push_back(p);
    texts.push_back(t);
  }

  // Train the draft on them (loss on the answers), as `talon train` does on the CPU.
  spec::DraftModel m = random_draft(tc, V / 2, 13, 1.0);
  m.config.ttt_steps = K;
  m.vocab = eagle3::build_draft_vocab(counts, m.config.Vd);
  const auto ew = ck->weight(*ck->find("model.embed_tokens.weight"));
  const auto nw = ck->weight(*ck->find("model.norm.weight"));
  const auto hw = ck->weight(*ck->find("lm_head.weight"));
  std::vector<float> embed(size_t(V * H)), head(size_t(V * H));
  std::vector<float> fnorm(static_cast<size_t>(H));
  convert_to_f32(ew.dtype, ew.data, embed.data(), embed.size());
  convert_to_f32(nw.dtype, nw.data, fnorm.data(), fnorm.size());
  convert_to_f32(hw.dtype, hw.data, head.data(), head.size());
  const eagle3::TargetHead th{embed.data(), fnorm.data(), head.data(), tc.rms_eps};
  std::vector<SeqFeatures> feats;
  for (auto& t : texts) feats.push_back(extract_like(*model, m.aux_layer_ids, t));
  std::vector<std::vector<uint8_t>> masks;
  for (auto& t : texts) {
    std::vector<uint8_t> mk(t.size(), 0);
    std::fill(mk.begin() + L0, mk.end(), uint8_t(1));
    masks.push_back(mk);
  }
  train::OptimConfig oc;
  oc.lr = 3e-3;
  oc.schedule = "constant";
  eagle3::DraftGrads g(m.weights);
  const auto ps = train::draft_params(m.weights, g);
  train::AdamW opt(oc);
  double first = 0, last = 0;
  for (int step = 0; step < 240; ++step) {
    const size_t i = size_t(step) % texts.size();
    for (auto& p : ps) std::fill(p.g->begin(), p.g->end(), 0.0);
    const eagle3::Sample s{texts[i].data(), masks[i].data(), feats[i].aux.data(), feats[i].hidden.data(),
                           int64_t(texts[i].size())};
    const double loss = eagle3::ttt_forward(m.config, m.weights, th, m.vocab, s, false, &g).loss;
    if (step < int(texts.size())) first += loss;       // the first pass over the texts
    if (step >= 240 - int(texts.size())) last += loss;  // the last
    train::clip_grad_norm(ps, oc.clip_norm);
    opt.step(ps);
  }
  std::printf("training loss: first pass %.3f, last pass %.3f\n", first / double(texts.size()), last / double(texts.size()));

  DraftRunner run(m, *ck);
  SpecConfig cfg;
  cfg.k = K;
  GenLimits lim;
  lim.max_new_tokens = N;
  std::vector<int64_t> want_tried(size_t(K), 0), want_acc(size_t(K), 0);
  DecodeStats served;
  int compared = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    // Served: chain-K speculation from the prompt.
    DecodeStats st;
    const auto got = decode_speculative(*dec, 0, run, prompts[i], cfg, greedy, 0, lim, &st);
    ASSERT_EQ(got, std::vector<int32_t>(texts[i].begin() + L0, texts[i].begin() + L0 + N)) << "prompt " << i;
    // Predicted: the training forward over the whole text, its step-k logits at the round's
    // base b (the last row with target features) against the text, round by round.
    const eagle3::Sample s{texts[i].data(), masks[i].data(), feats[i].aux.data(), feats[i].hidden.data(),
                           int64_t(texts[i].size())};
    const auto ref = eagle3::ttt_forward(m.config, m.weights, th, m.vocab, s, /*keep_logits=*/true);
    const int64_t Vd = m.config.Vd;
    bool near_tie = false;
    auto draft_top = [&](int k, int64_t b) {
      const float* row = ref.logits[size_t(k)].data() + b * Vd;
      int64_t best = 0;
      for (int64_t j = 1; j < Vd; ++j)
        if (row[j] > row[best]) best = j;
      for (int64_t j = 0; j < Vd; ++j)
        if (j != best && row[best] - row[j] < 1e-3f) near_tie = true;
      return run.to_target(best);
    };
    std::vector<int64_t> tried(size_t(K), 0), acc(size_t(K), 0);
    int64_t gen = 1, b = L0 - 1;
    while (gen < N) {
      int a = 0;
      for (int k = 0; k < K; ++k) {
        ++tried[size_t(k)];
        if (draft_top(k, b) != texts[i][size_t(b + 2 + k)]) break;
        ++acc[size_t(k)], ++a;
      }
      gen += a + 1, b += a + 1;
    }
    if (near_tie) continue;  // an argmax within 1e-3 could go either way between the two paths
    ++compared;
    EXPECT_EQ(st.tried, tried) << "prompt " << i;
    EXPECT_EQ(st.accepted, acc) << "prompt " << i;
    for (int k = 0; k < K; ++k) want_tried[size_t(k)] += tried[size_t(k)], want_acc[size_t(k)] += acc[size_t(k)];
    served.add(st);
  }
  std::printf("compared %d prompts; served tried %s accepted %s\n", compared, fmt::format("{}", fmt::join(want_tried, ",")).c_str(),
              fmt::format("{}", fmt::join(want_acc, ",")).c_str());
  ASSERT_GE(compared, 8) << "too many near-ties to compare";
  // The comparison means something only if the draft is often right.
  EXPECT_GE(double(want_acc[0]) / double(want_tried[0]), 0.3)
      << "depth-1 acceptance " << want_acc[0] << "/" << want_tried[0];
}
