// P-EAGLE's CPU reference (src/draft/peagle.cpp) against speculators 0.9.0's own
// PEagleDraftModel run in fp64 (tools/peagle_oracle.py -> tests/fixtures/peagle): the loss,
// per-depth accuracy counts and every trainable gradient on the COD sample speculators drew;
// Talon's own COD sampler against the structure of speculators'.

#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "draft/export.h"
#include "draft/peagle.h"
#include "io/safetensors.h"
#include "tests/test_util.h"
#include "tests/tolerances.h"

using namespace talon;
using namespace talon::eagle3;

namespace {

using talon::testing::read_as;
using talon::train::exported_weight_names;
using talon::train::ExportFormat;

struct PCase {
  st::File f;
  DraftConfig c;
  int64_t T = 0;
  int depths = 0;
  int32_t mask_token = 0;
  peagle::Weights w;
  std::vector<float> fnorm, head, aux, hid;
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;
  peagle::CodSample cod;
  DraftVocab dv;

  explicit PCase(const std::string& name)
      : f(fs::path(talon::testing::source_dir()) / "tests/fixtures/peagle" / ("peagle_" + name + ".safetensors")) {
    auto meta = [&](const char* k) { return f.metadata().at(k); };
    c.H = std::stoll(meta("H"));
    c.I = std::stoll(meta("I"));
    c.n_heads = std::stoll(meta("nh"));
    c.n_kv_heads = std::stoll(meta("nkv"));
    c.head_dim = std::stoll(meta("hd"));
    c.V = std::stoll(meta("V"));
    c.Vd = std::stoll(meta("Vd"));
    c.rms_eps = std::stod(meta("eps"));
    c.rope.theta = std::stod(meta("theta"));
    c.norm_before_residual = meta("nbr") == "True";
    T = std::stoll(meta("T"));
    depths = std::stoi(meta("depths"));
    mask_token = std::stoi(meta("mask_token"));
    // speculators' names, in DraftWeights::named() order (the export's own table).
    const auto names = exported_weight_names(ExportFormat::Speculators);
    auto layer = w.layer.named();
    for (size_t i = 0; i < names.size(); ++i) *layer[i].second = read_as<float>(f, "w." + names[i]);
    w.mask_hidden = read_as<float>(f, "w.mask_hidden");
    w.embed = read_as<float>(f, "w.embed_tokens.weight");
    fnorm = read_as<float>(f, "w.verifier_norm.weight");
    head = read_as<float>(f, "target_lm_head");
    ids = read_as<int32_t>(f, "ids");
    mask = read_as<uint8_t>(f, "mask");
    aux = read_as<float>(f, "aux");
    hid = read_as<float>(f, "hidden");
    cod.anchor = read_as<int64_t>(f, "anchor");
    cod.depth = read_as<int64_t>(f, "depth");
    dv = eagle3::draft_vocab_of(read_as<int64_t>(f, "kept"), c.V);
  }
  TargetHead target() const { return {nullptr, fnorm.data(), head.data(), c.rms_eps}; }
  Sample sample() const { return {ids.data(), mask.data(), aux.data(), hid.data(), T}; }
  std::vector<uint8_t> valid() const { return std::vector<uint8_t>(mask.begin() + 1, mask.end()); }
};

// The structure every COD sample has: depth 0 is every position; a chain at depth d >= 1
// continues one at depth d-1 of the same anchor; its target row is loss-masked; a depth
// holds at most floor(n_d * max(r^d, r_min)) elements.
void expect_cod_structure(const peagle::CodSample& s, const std::vector<uint8_t>& valid, const peagle::CodOptions& o) {
  const int64_t S = int64_t(valid.size());
  int64_t seeds = 0;
  for (uint8_t v : valid) seeds += v;
  std::set<std::pair<int64_t, int64_t>> have;
  std::vector<int64_t> per_depth(size_t(o.depths), 0);
  for (int64_t i = 0; i < s.size(); ++i) {
    const int64_t a = s.anchor[size_t(i)], d = s.depth[size_t(i)];
    ASSERT_GE(a, 0);
    ASSERT_LT(a + d, S);
    ASSERT_LT(d, o.depths);
    have.insert({a, d});
    ++per_depth[size_t(d)];
    if (i > 0) {
      EXPECT_GE(d, s.depth[size_t(i - 1)]) << "depth-major order";
    }
    if (d == 0) {
      EXPECT_EQ(a, i);
      continue;
    }
    EXPECT_TRUE(have.count({a, d - 1})) << "element (" << a << ", " << d << ") continues no chain";
    EXPECT_TRUE(valid[size_t(a + d)]) << "element (" << a << ", " << d << ") has an unmasked target";
  }
  EXPECT_EQ(per_depth[0], S);
  for (int d = 1; d < o.depths; ++d) {
    const int64_t n = std::max<int64_t>(0, seeds - d);
    EXPECT_LE(per_depth[size_t(d)], int64_t(double(n) * std::max(std::pow(o.ratio, d), o.ratio_min))) << "depth " << d;
  }
}

class PEagle : public ::testing::TestWithParam<std::string> {};

TEST_P(PEagle, MatchesSpeculatorsModel) {
  PCase pc(GetParam());
  peagle::Grads g(pc.w);
  const peagle::Result r =
      peagle::forward(pc.c, pc.w, pc.target(), pc.dv, pc.sample(), pc.cod, pc.mask_token, &g);
  const double want_loss = read_as<double>(pc.f, "loss")[0];
  // speculators' model takes RoPE's cos/sin from transformers' rotary embedding, in fp32
  // whatever the model's dtype: the loss agrees to ~1e-8, the gradients to ~1e-7.
  EXPECT_NEAR(r.loss, want_loss, tol::kTttLossRel * std::abs(want_loss));
  const auto hits = read_as<double>(pc.f, "acc_sum"), total = read_as<double>(pc.f, "acc_total");
  ASSERT_EQ(int64_t(r.total.size()), int64_t(total.size()));
  for (size_t d = 0; d < total.size(); ++d) {
    EXPECT_EQ(double(r.total[d]), total[d]) << "depth " << d;
    EXPECT_EQ(double(r.hits[d]), hits[d]) << "depth " << d;
  }
  const auto names = exported_weight_names(ExportFormat::Speculators);
  auto layer = g.layer.named();
  std::vector<std::pair<std::string, const std::vector<double>*>> grads;
  for (size_t i = 0; i < names.size(); ++i)
    if (names[i] != "lm_head.weight") grads.push_back({names[i], layer[i].second});
  grads.push_back({"mask_hidden", &g.mask_hidden});
  grads.push_back({"embed_tokens.weight", &g.embed});
  for (auto& [name, got] : grads) {
    const auto want = read_as<double>(pc.f, "g." + name);
    ASSERT_EQ(want.size(), got->size()) << name;
    EXPECT_LE(talon::testing::rel_max_diff(*got, want), tol::kTttGradRel) << "grad of " << name;
  }
  // The lm_head is frozen (speculators trains no gradient for it): the fixture has none.
  EXPECT_EQ(pc.f.find("g.lm_head.weight"), nullptr);
  // speculators' own sample has the structure Talon's sampler promises.
  peagle::CodOptions o;
  o.depths = pc.depths;
  expect_cod_structure(pc.cod, pc.valid(), o);
}
INSTANTIATE_TEST_SUITE_P(Fixtures, PEagle, ::testing::Values("gqa", "nbr"));

TEST(PEagleCod, StructureSizesAndSeeds) {
  for (int64_t S : {1, 7, 40, 300}) {
    std::vector<uint8_t> valid(static_cast<size_t>(S));
    for (int64_t t = 0; t < S; ++t) valid[size_t(t)] = (t >= S / 5) && (t % 7 != 3);
    for (int depths : {1, 4, 8}) {
      peagle::CodOptions o;
      o.depths = depths;
      const auto a = peagle::cod_sample(valid, o, 1), b = peagle::cod_sample(valid, o, 1),
                 c = peagle::cod_sample(valid, o, 2);
      expect_cod_structure(a, valid, o);
      EXPECT_EQ(a.anchor, b.anchor);
      EXPECT_EQ(a.depth, b.depth);
      if (S == 300 && depths == 8) {
        EXPECT_NE(a.anchor, c.anchor) << "the seed draws the sample";
        // Depth 1 is a draw from every loss-masked position, so it has exactly the size.
        int64_t seeds = 0, d1 = 0;
        for (uint8_t v : valid) seeds += v;
        for (int64_t d : a.depth) d1 += d == 1;
        EXPECT_EQ(d1, int64_t(double(seeds - 1) * 0.7));
      }
    }
  }
  peagle::CodOptions bad;
  bad.ratio = 1.5;
  EXPECT_THROW(peagle::cod_sample({1, 1}, bad, 0), Error);
}

// Every element attends to itself, never to a later depth-0 anchor or another chain's
// masked elements.
TEST(PEagleCod, AttentionMask) {
  peagle::CodSample s;
  s.anchor = {0, 1, 2, 3, 0, 2, 0};
  s.depth = {0, 0, 0, 0, 1, 1, 2};
  for (int64_t q = 0; q < s.size(); ++q) EXPECT_TRUE(peagle::attends(s, q, q));
  EXPECT_TRUE(peagle::attends(s, 5, 0));   // (2,1) reads depth-0 anchors 0..2
  EXPECT_TRUE(peagle::attends(s, 5, 2));
  EXPECT_FALSE(peagle::attends(s, 5, 3));  // not the later anchor 3
  EXPECT_FALSE(peagle::attends(s, 5, 4));  // not chain 0's masked element
  EXPECT_TRUE(peagle::attends(s, 6, 4));   // (0,2) reads (0,1)
  EXPECT_FALSE(peagle::attends(s, 4, 6));  // (0,1) does not read (0,2)
  EXPECT_FALSE(peagle::attends(s, 1, 4));  // depth 0 reads only depth 0
}

// The trainer's per-depth view of a result, on a hand-made sample: depth 0 anchors 0, 1, 2,
// 3 (anchor 3 not counted); depth 1 anchors 0 and 2; depth 2 anchor 0.
TEST(PEagleCod, PerDepthViewForTheTrainer) {
  peagle::CodSample cod;
  cod.anchor = {0, 1, 2, 3, 0, 2, 0};
  cod.depth = {0, 0, 0, 0, 1, 1, 2};
  peagle::Result r;
  r.loss = 0.75;
  r.outcome = {1, 0, 1, -1, 1, 0, 0};
  r.kl = {0.3, 0.8, 0.9};
  const auto t = peagle::ttt_view(cod, r, 3);
  ASSERT_EQ(t.acc_k.size(), 3u);
  EXPECT_EQ(t.n_k, (std::vector<int64_t>{3, 2, 1}));
  EXPECT_DOUBLE_EQ(t.acc_k[0], 2.0 / 3);
  EXPECT_DOUBLE_EQ(t.acc_k[1], 1.0 / 2);
  EXPECT_DOUBLE_EQ(t.acc_k[2], 0.0);
  // Depth 1: both chains (anchors 0 and 2) were right at depth 0; one is right now. Depth 2:
  // anchor 0's chain was right at depths 0 and 1, and misses.
  EXPECT_DOUBLE_EQ(t.cond_acc_k[0], 2.0 / 3);
  EXPECT_DOUBLE_EQ(t.cond_acc_k[1], 1.0 / 2);
  EXPECT_DOUBLE_EQ(t.cond_acc_k[2], 0.0);
  EXPECT_DOUBLE_EQ(t.loss_k[0], 0.1);
  EXPECT_DOUBLE_EQ(t.loss_k[1], 0.4);
  EXPECT_DOUBLE_EQ(t.loss, 0.75);  // the result's own reduction, not a sum of depths
  EXPECT_DOUBLE_EQ(t.accept_len, 1 + 2.0 / 3 + 2.0 / 3 * 0.5);
  // A result of another sample is refused.
  r.outcome.pop_back();
  EXPECT_THROW(peagle::ttt_view(cod, r, 3), Error);
}

// The evaluation sample: every chain the sampler could reach. valid = 1 1 0 1 1 1: depth 1
// needs position a+1 valid (anchors 0, 2, 3, 4), depth 2 positions a+1 and a+2 (anchors 2, 3).
TEST(PEagleCod, AllChainsKeepsEveryReachableChain) {
  const auto s = peagle::all_chains({1, 1, 0, 1, 1, 1}, 3);
  EXPECT_EQ(s.depth, (std::vector<int64_t>{0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2}));
  EXPECT_EQ(s.anchor, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 0, 2, 3, 4, 2, 3}));
  // Any COD draw on the same positions is a subset of it.
  peagle::CodOptions o;
  o.depths = 3;
  for (uint64_t seed = 0; seed < 20; ++seed) {
    const auto c = peagle::cod_sample({1, 1, 0, 1, 1, 1}, o, seed);
    for (int64_t i = 0; i < c.size(); ++i) {
      bool found = false;
      for (int64_t j = 0; j < s.size(); ++j) found |= s.anchor[size_t(j)] == c.anchor[size_t(i)] && s.depth[size_t(j)] == c.depth[size_t(i)];
      EXPECT_TRUE(found) << "seed " << seed << " element (" << c.anchor[size_t(i)] << ", " << c.depth[size_t(i)] << ")";
    }
  }
}

}  // namespace
