// DFlash's CPU reference (src/draft/dflash.cpp) against speculators 0.9.0's own
// DFlashDraftModel run in fp64 (tools/dflash_oracle.py -> tests/fixtures/dflash): the loss,
// per-slot accuracy counts and every trainable gradient: two layers with GQA, KL and
// fixed-exp-decay weights; one layer with as many kv heads as heads, two aux layers,
// cross-entropy and D-PACE weights; three layers, blocks of 8, KL and D-PACE. Talon's anchor
// sampler; the context mask's boundary.

#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "draft/dflash.h"
#include "io/safetensors.h"
#include "tests/test_util.h"
#include "tests/tolerances.h"

using namespace talon;

namespace {

using talon::testing::read_as;

// speculators' tensor name of each layer weight (Layer::named() order).
const char* const kLayerNames[] = {"input_layernorm.weight",  "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                   "self_attn.v_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                                   "self_attn.o_proj.weight", "post_attention_layernorm.weight",
                                   "mlp.gate_proj.weight",    "mlp.up_proj.weight",      "mlp.down_proj.weight"};

struct DCase {
  st::File f;
  dflash::Config c;
  int64_t T = 0;
  int32_t mask_token = 0;
  dflash::Weights w;
  std::vector<float> embed, fnorm, head, aux, hid;
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;
  std::vector<int64_t> anchors;
  eagle3::DraftVocab dv;

  explicit DCase(const std::string& name)
      : f(fs::path(talon::testing::source_dir()) / "tests/fixtures/dflash" / ("dflash_" + name + ".safetensors")) {
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
    c.layers = std::stoll(meta("L"));
    c.n_aux = std::stoll(meta("n_aux"));
    c.block = std::stoll(meta("B"));
    c.gamma = std::stod(meta("gamma"));
    c.dpace_alpha = std::stod(meta("alpha"));
    c.loss = meta("loss") == "ce" ? dflash::Config::Loss::CE : dflash::Config::Loss::KL;
    c.weighting = meta("weighting") == "dpace" ? dflash::Config::Weighting::DPace : dflash::Config::Weighting::ExpDecay;
    T = std::stoll(meta("T"));
    mask_token = std::stoi(meta("mask_token"));
    w.fc = read_as<float>(f, "w.fc.weight");
    w.hidden_norm = read_as<float>(f, "w.hidden_norm.weight");
    w.norm = read_as<float>(f, "w.norm.weight");
    w.lm_head = read_as<float>(f, "w.lm_head.weight");
    w.layers.resize(size_t(c.layers));
    for (int64_t l = 0; l < c.layers; ++l) {
      auto named = w.layers[size_t(l)].named();
      for (size_t i = 0; i < named.size(); ++i)
        *named[i].second = read_as<float>(f, "w.layers." + std::to_string(l) + "." + kLayerNames[i]);
    }
    embed = read_as<float>(f, "w.embed_tokens.weight");
    fnorm = read_as<float>(f, "w.verifier_norm.weight");
    head = read_as<float>(f, "target_lm_head");
    ids = read_as<int32_t>(f, "ids");
    mask = read_as<uint8_t>(f, "mask");
    aux = read_as<float>(f, "aux");
    hid = read_as<float>(f, "hidden");
    anchors = read_as<int64_t>(f, "anchors");
    dv = eagle3::draft_vocab_of(read_as<int64_t>(f, "kept"), c.V);
  }
  eagle3::TargetHead target() const { return {embed.data(), fnorm.data(), head.data(), c.rms_eps}; }
  eagle3::Sample sample() const { return {ids.data(), mask.data(), aux.data(), hid.data(), T}; }
};

class DFlash : public ::testing::TestWithParam<std::string> {};

TEST_P(DFlash, MatchesSpeculatorsModel) {
  DCase dc(GetParam());
  dflash::Grads g(dc.w);
  const dflash::Result r =
      dflash::forward(dc.c, dc.w, dc.target(), dc.dv, dc.sample(), dc.anchors, dc.mask_token, &g);
  const double want_loss = read_as<double>(dc.f, "loss")[0];
  EXPECT_NEAR(r.loss, want_loss, tol::kTttLossRel * std::abs(want_loss));
  // Slot 0 (the anchor token) is never counted; speculators reports slots 1 .. B-1.
  const auto hits = read_as<double>(dc.f, "acc_sum"), total = read_as<double>(dc.f, "acc_total");
  ASSERT_EQ(int64_t(r.total.size()), dc.c.block);
  EXPECT_EQ(r.total[0], 0);
  for (size_t i = 1; i < r.total.size(); ++i) {
    EXPECT_EQ(double(r.total[i]), total[i - 1]) << "slot " << i;
    EXPECT_EQ(double(r.hits[i]), hits[i - 1]) << "slot " << i;
  }
  std::vector<std::pair<std::string, const std::vector<double>*>> grads = {
      {"fc.weight", &g.fc}, {"hidden_norm.weight", &g.hidden_norm}, {"norm.weight", &g.norm}};
  for (int64_t l = 0; l < dc.c.layers; ++l) {
    auto named = g.layers[size_t(l)].named();
    for (size_t i = 0; i < named.size(); ++i)
      grads.push_back({"layers." + std::to_string(l) + "." + kLayerNames[i], named[i].second});
  }
  std::set<std::string> compared;
  for (auto& [name, got] : grads) {
    const auto want = read_as<double>(dc.f, "g." + name);
    ASSERT_EQ(want.size(), got->size()) << name;
    EXPECT_LE(talon::testing::rel_max_diff(*got, want), tol::kTttGradRel) << "grad of " << name;
    compared.insert("g." + name);
  }
  // Every gradient the oracle recorded was compared; the embedding and lm_head have none.
  for (auto& t : dc.f.tensors())
    if (t.name.rfind("g.", 0) == 0) {
      EXPECT_TRUE(compared.count(t.name)) << t.name << " not compared";
    }
  EXPECT_EQ(dc.f.find("g.lm_head.weight"), nullptr);
  EXPECT_EQ(dc.f.find("g.embed_tokens.weight"), nullptr);

  // The logits the forward reports are its own: the loss does not change when asked for them.
  std::vector<double> logits;
  const dflash::Result r2 = dflash::forward(dc.c, dc.w, dc.target(), dc.dv, dc.sample(), dc.anchors, dc.mask_token,
                                            nullptr, &logits);
  EXPECT_EQ(r2.loss, r.loss);
  EXPECT_EQ(int64_t(logits.size()), int64_t(dc.anchors.size()) * dc.c.block * dc.c.Vd);
}
INSTANTIATE_TEST_SUITE_P(Fixtures, DFlash, ::testing::Values("gqa2", "mha1", "gqa3"));

// The context a block reads stops before its anchor: changing the target's states at the last
// anchor and after leaves the loss exactly as it was (no block reads them), changing them just
// before the first anchor does not.
TEST(DFlashMask, ContextStopsBeforeTheAnchor) {
  DCase dc("gqa2");
  const double base = dflash::forward(dc.c, dc.w, dc.target(), dc.dv, dc.sample(), dc.anchors, dc.mask_token).loss;
  const int64_t AW = dc.c.n_aux * dc.c.H, last = dc.anchors.back(), first = dc.anchors.front();
  ASSERT_GT(first, 0);
  auto with_aux_changed = [&](int64_t from, int64_t to) {
    DCase d2("gqa2");
    for (int64_t t = from; t < to; ++t)
      for (int64_t e = 0; e < AW; ++e) d2.aux[size_t(t * AW + e)] += 1.0f;
    return dflash::forward(d2.c, d2.w, d2.target(), d2.dv, d2.sample(), d2.anchors, d2.mask_token).loss;
  };
  EXPECT_EQ(with_aux_changed(last, dc.T), base);
  EXPECT_GT(std::abs(with_aux_changed(first - 1, first) - base), 1e-6 * std::abs(base));
}

TEST(DFlashAnchors, DrawnFromLossMaskedPositionsBeforeTheLastBlock) {
  std::vector<uint8_t> mask(40, 0);
  for (int t = 5; t < 40; ++t) mask[size_t(t)] = t % 3 != 0;
  const auto a = dflash::select_anchors(mask.data(), 40, 8, 10, 1), b = dflash::select_anchors(mask.data(), 40, 8, 10, 1),
             c = dflash::select_anchors(mask.data(), 40, 8, 10, 2);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c) << "the seed draws the anchors";
  ASSERT_EQ(a.size(), 10u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(mask[size_t(a[i])]) << a[i];
    EXPECT_LT(a[i] + 8, 40) << "a block of 8 must fit";
    if (i) {
      EXPECT_GT(a[i], a[i - 1]) << "ascending, distinct";
    }
  }
  // Fewer candidates than asked: all of them.
  int64_t pool = 0;
  for (int t = 0; t + 8 < 40; ++t) pool += mask[size_t(t)];
  EXPECT_EQ(int64_t(dflash::select_anchors(mask.data(), 40, 8, 1000, 3).size()), pool);
  EXPECT_THROW(dflash::select_anchors(mask.data(), 40, 1, 4, 0), Error);
}

}  // namespace
