// The CPU draft model and TTT objective against the PyTorch fp64 oracle written from
// SPEC-EAGLE3 (tools/eagle3_oracle.py -> tests/fixtures/eagle3): draft vocabulary, every
// step's logits, per-step losses, accuracies, conditional accuracies and the total loss.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "io/safetensors.h"
#include "tests/test_util.h"
#include "tests/tolerances.h"
#include "draft/eagle3.h"
#include "draft/optim.h"
#include "draft/trainer.h"
#include "util/error.h"

using namespace talon;
using namespace talon::eagle3;

namespace {

using talon::testing::read_as;

// One oracle fixture: the draft config, weights, target head and sample it was made with.
struct OracleCase {
  st::File f;
  DraftConfig c;
  int64_t T;
  DraftWeights w;
  std::vector<float> embed, fnorm, head, aux, hid;
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;

  explicit OracleCase(const std::string& name)
      : f(fs::path(talon::testing::source_dir()) / "tests/fixtures/eagle3" / ("ttt_" + name + ".safetensors")) {
    c.H = std::stoll(meta("H"));
    c.I = std::stoll(meta("I"));
    c.n_heads = std::stoll(meta("nh"));
    c.n_kv_heads = std::stoll(meta("nkv"));
    c.head_dim = std::stoll(meta("hd"));
    c.V = std::stoll(meta("V"));
    c.Vd = std::stoll(meta("Vd"));
    c.rms_eps = std::stod(meta("eps"));
    c.rope.theta = std::stod(meta("theta"));
    c.norm_before_residual = meta("norm_before_residual") == "True";
    c.ttt_steps = std::stoi(meta("K"));
    c.step_decay = std::stod(meta("decay"));
    T = std::stoll(meta("T"));
    for (auto& [n, v] : w.named()) *v = read_as<float>(f, std::string("w.") + n);
    embed = read_as<float>(f, "target.embed");
    fnorm = read_as<float>(f, "target.final_norm");
    head = read_as<float>(f, "target.lm_head");
    ids = read_as<int32_t>(f, "input_ids");
    mask = read_as<uint8_t>(f, "loss_mask");
    aux = read_as<float>(f, "aux");
    hid = read_as<float>(f, "hidden");
  }
  const std::string& meta(const std::string& k) const { return f.metadata().at(k); }
  TargetHead target() const { return {embed.data(), fnorm.data(), head.data(), c.rms_eps}; }
  Sample sample() const { return {ids.data(), mask.data(), aux.data(), hid.data(), T}; }
};

class Ttt : public ::testing::TestWithParam<std::string> {};

TEST_P(Ttt, MatchesTorchOracle) {
  OracleCase oc(GetParam());
  const st::File& f = oc.f;
  const DraftConfig& c = oc.c;
  const int64_t T = oc.T;
  DraftWeights& w = oc.w;

  // Draft vocabulary from the loss-masked counts.
  const auto counts = read_as<int64_t>(f, "counts");
  const DraftVocab dv = build_draft_vocab(counts, c.Vd);
  EXPECT_EQ(dv.kept, read_as<int64_t>(f, "kept"));
  EXPECT_EQ(dv.d2t, read_as<int64_t>(f, "d2t"));
  EXPECT_EQ(dv.t2d, read_as<uint8_t>(f, "t2d"));

  const TargetHead tg = oc.target();
  const Sample s = oc.sample();
  DraftGrads grads(w);
  const TttResult r = ttt_forward(c, w, tg, dv, s, true, &grads);
  // Hand-written backward vs autograd, every weight.
  for (auto& [name, g] : grads.named()) {
    const auto want = read_as<double>(f, std::string("grad.") + name);
    ASSERT_EQ(want.size(), g->size()) << name;
    EXPECT_LE(talon::testing::rel_max_diff(*g, want), tol::kTttGradRel) << "grad of " << name;
  }
  // And against central finite differences of the loss itself, a few entries per weight.
  for (const train::Param& p : train::draft_params(w, grads)) {
    std::vector<float>* wt = p.w;
    const char* name = p.name;
    const std::vector<double>* g = p.g;
    for (size_t i = 0; i < wt->size(); i += std::max<size_t>(1, wt->size() / 5)) {
      const float orig = (*wt)[i];
      const float hi = orig + 1e-3f, lo = orig - 1e-3f;
      (*wt)[i] = hi;
      const double lp = ttt_forward(c, w, tg, dv, s).loss;
      (*wt)[i] = lo;
      const double lm = ttt_forward(c, w, tg, dv, s).loss;
      (*wt)[i] = orig;
      const double fd = (lp - lm) / (double(hi) - double(lo));
      EXPECT_NEAR((*g)[i], fd, tol::kTttFiniteDiffAbs + tol::kTttFiniteDiffRel * std::abs(fd)) << name << "[" << i << "]";
    }
  }
  const auto loss_k = read_as<double>(f, "loss_k"), acc_k = read_as<double>(f, "acc_k"), cond = read_as<double>(f, "cond_acc_k"),
             n_k = read_as<double>(f, "n_k"), loss = read_as<double>(f, "loss");
  const auto logits = read_as<float>(f, "logits");
  ASSERT_EQ(int64_t(r.loss_k.size()), c.ttt_steps);
  for (int k = 0; k < c.ttt_steps; ++k) {
    const float* want = logits.data() + size_t(k) * size_t(T * c.Vd);
    EXPECT_LE(talon::testing::rel_err(r.logits[size_t(k)].data(), want, size_t(T * c.Vd)), tol::kTttLogitsRel)
        << "step " << k;
    EXPECT_NEAR(r.loss_k[size_t(k)], loss_k[size_t(k)], tol::kTttLossRel * std::max(1.0, std::abs(loss_k[size_t(k)])))
        << "step " << k;
    EXPECT_EQ(double(r.n_k[size_t(k)]), n_k[size_t(k)]) << "step " << k;
    EXPECT_DOUBLE_EQ(r.acc_k[size_t(k)], acc_k[size_t(k)]) << "step " << k;
    EXPECT_DOUBLE_EQ(r.cond_acc_k[size_t(k)], cond[size_t(k)]) << "step " << k;
  }
  EXPECT_NEAR(r.loss, loss[0], tol::kTttLossRel * std::max(1.0, std::abs(loss[0])));
  double want_len = 1, prod = 1;
  for (double a : acc_k) want_len += (prod *= a);
  EXPECT_DOUBLE_EQ(r.accept_len, want_len);
}
INSTANTIATE_TEST_SUITE_P(Fixtures, Ttt, ::testing::Values("gqa", "nbr"));

// Rows no later loss counts for are left out of steps >= 1 (a row's later steps read only its
// own earlier ones), and with keep_logits every row is computed. Both must give the same
// losses, metrics and gradients, equal as values: on each fixture with its own mask, with a
// prompt-like span of unmasked tokens at the start and in the middle, and with one loss token.
TEST_P(Ttt, RowsNoLaterLossReadsChangeNothing) {
  OracleCase oc(GetParam());
  const DraftConfig& c = oc.c;
  const int64_t T = oc.T;
  const DraftVocab dv = build_draft_vocab(read_as<int64_t>(oc.f, "counts"), c.Vd);
  const TargetHead tg = oc.target();
  const std::vector<uint8_t> own = oc.mask;
  std::vector<std::vector<uint8_t>> masks{own, own};
  for (int64_t t = 0; t < T; ++t)
    if (t < T / 3 || (t >= T / 2 && t < T / 2 + 3)) masks[1][size_t(t)] = 0;
  for (int64_t p : {T - 2, T / 2, T / 3 + 1, int64_t(3)}) {  // one loss token
    masks.emplace_back(size_t(T), 0);
    masks.back()[size_t(p)] = 1;
  }
  int64_t single_counted = 0;
  for (size_t m = 0; m < masks.size(); ++m) {
    oc.mask = masks[m];
    const Sample s = oc.sample();
    DraftGrads all(oc.w), some(oc.w);
    const TttResult a = ttt_forward(c, oc.w, tg, dv, s, true, &all);
    const TttResult b = ttt_forward(c, oc.w, tg, dv, s, false, &some);
    EXPECT_EQ(a.loss, b.loss) << "mask " << m;
    EXPECT_EQ(a.loss_k, b.loss_k) << "mask " << m;
    EXPECT_EQ(a.acc_k, b.acc_k) << "mask " << m;
    EXPECT_EQ(a.cond_acc_k, b.cond_acc_k) << "mask " << m;
    EXPECT_EQ(a.n_k, b.n_k) << "mask " << m;
    EXPECT_EQ(a.accept_len, b.accept_len) << "mask " << m;
    const auto na = all.named(), nb = some.named();
    for (size_t q = 0; q < na.size(); ++q) {
      EXPECT_EQ(*na[q].second, *nb[q].second) << "mask " << m << ", grad of " << na[q].first;
    }
    double gsum = 0;
    for (double x : *na[0].second) gsum += std::abs(x);
    if (m < 2) {
      EXPECT_GT(gsum, 0) << "mask " << m;  // a loss counted, so the comparison is not of zeros
    } else {
      single_counted += gsum > 0;
    }
  }
  EXPECT_GT(single_counted, 0);  // some one-token mask had a target in the draft vocabulary
}

// 20 AdamW steps (warm-up + cosine, weight decay on matrices, global-norm clipping) on
// the gqa fixture: the loss curve, gradient norms and final weights match PyTorch's
// torch.optim.AdamW + LambdaLR + clip_grad_norm_ run by the oracle.
TEST(TttTraining, LossCurveMatchesTorchAdamW) {
  OracleCase fx("gqa");
  const st::File& f = fx.f;
  const DraftConfig& c = fx.c;
  auto meta = [&](const std::string& k) { return fx.meta(k); };
  train::OptimConfig oc;
  oc.lr = std::stod(meta("train.lr"));
  oc.weight_decay = std::stod(meta("train.weight_decay"));
  oc.eps = std::stod(meta("train.eps"));
  oc.warmup_steps = std::stoll(meta("train.warmup"));
  oc.total_steps = std::stoll(meta("train.total"));
  oc.min_lr_ratio = std::stod(meta("train.min_lr_ratio"));
  oc.clip_norm = std::stod(meta("train.clip"));
  oc.schedule = "cosine";
  ASSERT_EQ(meta("train.betas"), "(0.9, 0.95)");
  const DraftVocab dv = build_draft_vocab(read_as<int64_t>(f, "counts"), c.Vd);
  DraftWeights& w = fx.w;
  DraftGrads g(w);
  const std::vector<train::Param> ps = train::draft_params(w, g);
  const TargetHead tg = fx.target();
  const Sample s = fx.sample();
  const auto want_loss = read_as<double>(f, "train.loss"), want_norm = read_as<double>(f, "train.grad_norm");
  train::AdamW opt(oc);
  for (int64_t step = 0; step < oc.total_steps; ++step) {
    for (auto& p : ps) std::fill(p.g->begin(), p.g->end(), 0.0);
    const double loss = ttt_forward(c, w, tg, dv, s, false, &g).loss;
    const double norm = train::clip_grad_norm(ps, oc.clip_norm);
    opt.step(ps);
    EXPECT_NEAR(loss, want_loss[size_t(step)], tol::kTrainCurveRel * std::abs(want_loss[size_t(step)])) << "step " << step;
    EXPECT_NEAR(norm, want_norm[size_t(step)], tol::kTrainCurveRel * std::abs(want_norm[size_t(step)])) << "step " << step;
  }
  EXPECT_LT(want_loss.back(), 0.5 * want_loss.front());  // the fixture really trains
  const auto fc = read_as<float>(f, "train.final.fc"), nm = read_as<float>(f, "train.final.norm");
  EXPECT_LE(talon::testing::rel_err(w.fc.data(), fc.data(), fc.size()), tol::kTrainCurveRel);
  EXPECT_LE(talon::testing::rel_err(w.norm.data(), nm.data(), nm.size()), tol::kTrainCurveRel);
}

TEST(TttTraining, ScheduleWarmupCosineLinearConstant) {
  train::OptimConfig c;
  c.lr = 1.0;
  c.warmup_steps = 4;
  c.total_steps = 14;
  c.min_lr_ratio = 0.0;
  EXPECT_DOUBLE_EQ(train::lr_at(c, 0), 0.25);  // warm-up: (step + 1) / warmup
  EXPECT_DOUBLE_EQ(train::lr_at(c, 3), 1.0);
  EXPECT_NEAR(train::lr_at(c, 9), 0.5, 1e-12);   // half way through the decay: cos(pi/2)
  EXPECT_NEAR(train::lr_at(c, 14), 0.0, 1e-12);
  c.schedule = "linear";
  EXPECT_NEAR(train::lr_at(c, 9), 0.5, 1e-12);
  EXPECT_NEAR(train::lr_at(c, 6), 0.8, 1e-12);
  c.schedule = "constant";
  EXPECT_DOUBLE_EQ(train::lr_at(c, 9), 1.0);
  c.schedule = "bogus";
  EXPECT_THROW(train::lr_at(c, 9), Error);
}

TEST(DraftVocab, KeepsMostFrequentTiesLowPadsLowSorted) {
  // Hand-checked against SPEC-EAGLE3 section 3: counts over ids 0..7.
  const std::vector<int64_t> counts{0, 5, 2, 5, 0, 9, 2, 0};
  // Vd = 4: 5 (9), 1 and 3 (5 each), then 2 (2, lower id than 6); sorted -> 1 2 3 5.
  DraftVocab a = build_draft_vocab(counts, 4);
  EXPECT_EQ(a.kept, (std::vector<int64_t>{1, 2, 3, 5}));
  EXPECT_EQ(a.d2t, (std::vector<int64_t>{1, 1, 1, 2}));
  EXPECT_EQ(a.t2d, (std::vector<uint8_t>{0, 1, 1, 1, 0, 1, 0, 0}));
  // Vd = 7: the five seen ids, padded with the lowest unused ids 0 and 4.
  DraftVocab b = build_draft_vocab(counts, 7);
  EXPECT_EQ(b.kept, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6}));
  EXPECT_THROW(build_draft_vocab(counts, 9), Error);
  EXPECT_THROW(build_draft_vocab(counts, 0), Error);
}

TEST(DraftVocab, FromKeptIds) {
  const DraftVocab a = draft_vocab_of({0, 2, 3, 7}, 8);
  EXPECT_EQ(a.d2t, (std::vector<int64_t>{0, 1, 1, 4}));
  EXPECT_EQ(a.t2d, (std::vector<uint8_t>{1, 0, 1, 1, 0, 0, 0, 1}));
  for (const std::vector<int64_t>& bad : {std::vector<int64_t>{2, 2}, {3, 1}, {-1, 2}, {1, 8}}) {
    const std::string msg = talon::testing::error_of([&] { draft_vocab_of(bad, 8); });
    EXPECT_NE(msg.find("out of order or outside [0, 8)"), std::string::npos) << msg;
  }
}

}  // namespace
