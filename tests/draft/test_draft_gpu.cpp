// The GPU draft trainer against the CPU reference (eagle3::ttt_forward, train::AdamW),
// which is itself checked against the PyTorch oracle: several samples of different
// lengths packed into one batch, GQA, both residual conventions; per-sample losses and
// accuracies, every gradient, five optimizer steps, and run-to-run determinism.
#ifdef TALON_HAVE_CUDA
#include <cuda_runtime.h>

#include "tests/gpu_test.h"
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <tuple>

#include "backend/cuda/cudnn_sdpa.h"
#include "backend/cuda/ops.h"
#include "draft/cuda/draft_engine.h"
#include "tests/test_util.h"
#include "tests/tolerances.h"
#include "draft/draft_gpu.h"
#include "draft/eagle3.h"
#include "draft/dflash.h"
#include "draft/optim.h"
#include "draft/peagle.h"
#include "draft/trainer.h"
#include "model/model.h"
#include "util/error.h"

using namespace talon;
using namespace talon::eagle3;

namespace {


struct Case {
  DraftConfig c;
  DraftWeights w;
  DraftVocab dv;
  std::vector<float> embed, fnorm, head;
  struct S {
    std::vector<int32_t> ids;
    std::vector<uint8_t> mask;
    std::vector<float> aux, hid;
  };
  std::vector<S> samples;

  Case(bool nbr, uint32_t seed, std::vector<int> lengths = {13, 7, 22, 2}, int head_dim = 16, int inter = 96,
       int heads = 4, int kv_heads = 2) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    c.H = 64;
    c.I = inter;
    c.n_heads = heads;
    c.n_kv_heads = kv_heads;
    c.head_dim = head_dim;
    c.V = 211;
    c.Vd = 60;
    c.rms_eps = 1e-5;
    c.rope.theta = 10000;
    c.norm_before_residual = nbr;
    c.ttt_steps = 4;
    c.step_decay = 0.8;
    auto fill = [&](std::vector<float>& v, size_t n, float sd) {
      v.resize(n);
      for (auto& x : v) x = sd * nd(rng);
    };
    const size_t H = size_t(c.H), qd = size_t(c.n_heads * c.head_dim), kvd = size_t(c.n_kv_heads * c.head_dim);
    fill(w.fc, H * 3 * H, 0.1f);
    fill(w.wq, qd * 2 * H, 0.15f);
    fill(w.wk, kvd * 2 * H, 0.15f);
    fill(w.wv, kvd * 2 * H, 0.15f);
    fill(w.wo, H * qd, 0.1f);
    fill(w.gate, size_t(c.I) * H, 0.1f);
    fill(w.up, size_t(c.I) * H, 0.1f);
    fill(w.down, H * size_t(c.I), 0.1f);
    fill(w.lm_head, size_t(c.Vd) * H, 0.2f);
    for (auto* v : {&w.in_ln, &w.hidden_norm, &w.post_ln, &w.norm}) {
      v->resize(H);
      for (auto& x : *v) x = 1.f + 0.1f * nd(rng);
    }
    fill(embed, size_t(c.V) * H, 1.f);
    fill(head, size_t(c.V) * H, 0.3f);
    fnorm.resize(H);
    for (auto& x : fnorm) x = 1.f + 0.1f * nd(rng);
    std::vector<int64_t> counts(size_t(c.V), 0);
    for (int T : lengths) {
      S s;
      for (int t = 0; t < T; ++t) {
        s.ids.push_back(int32_t(rng() % uint32_t(c.V)));
        s.mask.push_back(uint8_t(rng() % 5 != 0));
        if (s.mask.back()) counts[size_t(s.ids.back())]++;
      }
      fill(s.aux, size_t(T) * 3 * H, 1.f);
      fill(s.hid, size_t(T) * H, 1.f);
      samples.push_back(std::move(s));
    }
    // Also count the target's own favourite tokens, so most positions count.
    dv = build_draft_vocab(counts, c.Vd);
  }
  // Shrinks the target lm_head rows of ids outside the draft vocab, so that the target's
  // argmax mostly lands in it (as with a trained target) and most loss-masked positions count.
  // Loss masks laid out as chat data (needs five samples, the third of 18 tokens or more):
  // sample 1 a prompt only, sample 2 a prompt of 18 tokens before its answer, sample 4
  // alternating turns of four tokens.
  void mask_as_chat() {
    for (auto& m : samples[1].mask) m = 0;
    for (size_t t = 0; t < 18; ++t) samples[2].mask[t] = 0;
    for (size_t t = 0; t < samples[4].mask.size(); ++t) samples[4].mask[t] = (t / 4) % 2;
  }
  void favour_draft_vocab(float scale) {
    const size_t H = size_t(c.H);
    for (size_t v = 0; v < size_t(c.V); ++v)
      if (!dv.t2d[v])
        for (size_t j = 0; j < H; ++j) head[v * H + j] *= scale;
  }
  // Whether a loss row counts depends on the target's full-vocabulary argmax being a draft
  // token. With bf16 math the GPU's target logits carry bf16 rounding (about 1e-2 here), so
  // where the best draft token and the best other token are closer than that, the GPU and the
  // fp64 reference may decide differently and count a different set of rows; that is rounding,
  // not a fault. Such rows leave the loss mask (bf16 checks only); returns how many did.
  int unmask_near_ties(double rel) {
    const size_t H = size_t(c.H);
    int n = 0;
    for (auto& s : samples)
      for (size_t t = 0; t < s.ids.size(); ++t) {
        if (!s.mask[t]) continue;
        const float* h = s.hid.data() + t * H;
        double ss = 0;
        for (size_t j = 0; j < H; ++j) ss += double(h[j]) * h[j];
        const double r = 1.0 / std::sqrt(ss / double(H) + 1e-5);
        double in = -INFINITY, out = -INFINITY, big = 1;
        for (size_t v = 0; v < size_t(c.V); ++v) {
          double l = 0;
          for (size_t j = 0; j < H; ++j) l += double(h[j]) * r * fnorm[j] * head[v * H + j];
          double& best = dv.t2d[v] ? in : out;
          best = std::max(best, l);
          big = std::max(big, std::abs(l));
        }
        if (std::abs(in - out) < rel * big) {
          s.mask[t] = 0;
          ++n;
        }
      }
    return n;
  }
  TargetHead target() const { return {embed.data(), fnorm.data(), head.data(), 1e-5}; }
  std::vector<Sample> batch() const {
    std::vector<Sample> b;
    for (auto& s : samples) b.push_back({s.ids.data(), s.mask.data(), s.aux.data(), s.hid.data(), int64_t(s.ids.size())});
    return b;
  }
};

using talon::testing::rel_max_diff;

class GpuDraft : public ::testing::TestWithParam<bool> {};

// The engine options the trainers below are built with; ScopedOpt changes them for a scope.
// TALON_TEST_GPU_PRODUCTS=cublas|first|waves|timed runs every test below that leaves the
// products' rule alone under that rule instead of the default (auto: timed on bf16 operands);
// those on fp32 operands keep cublas, the only rule they allow.
const std::string g_env_products = [] {
  const char* e = std::getenv("TALON_TEST_GPU_PRODUCTS");
  return std::string(e && *e ? e : "");
}();
// TALON_TEST_GPU_FRESH_GRADS=0 runs every test below with GpuDraftOptions::fresh_grads off (the
// whole gradient zeroed before a run that starts it anew).
GpuDraftOptions g_eng = [] {
  GpuDraftOptions o;
  if (!g_env_products.empty()) o.products = g_env_products;
  const char* f = std::getenv("TALON_TEST_GPU_FRESH_GRADS");
  if (f && *f) o.fresh_grads = std::string(f) != "0";
  return o;
}();
struct ScopedOpt {
  GpuDraftOptions saved = g_eng;
  template <class F>
  explicit ScopedOpt(F&& set) {
    set(g_eng);
  }
  ~ScopedOpt() { g_eng = saved; }
};
GpuDraftOptions eng_for(GpuMath math) {
  GpuDraftOptions o = g_eng;
  if (!g_env_products.empty() && o.products == g_env_products && (math != GpuMath::BF16 || o.fp32_operands))
    o.products = "cublas";
  return o;
}
std::unique_ptr<GpuDraftTrainer> make_gpu(Case& cs, const std::vector<int>& devices, GpuMath math, int64_t max_rows) {
  return make_gpu_draft_trainer(cs.c, cs.target(), cs.dv, devices, math, max_rows, {}, eng_for(math));
}

void check_against_cpu(Case& cs, GpuMath math, double loss_tol, double grad_tol, int64_t max_rows = 64,
                       int64_t min_counted = 20) {
  if (math != GpuMath::F32) cs.unmask_near_ties(2e-2);
  const auto batch = cs.batch();
  const double weight = 1.0 / double(batch.size());
  // CPU reference: per-sample forward + backward, gradients scaled by the batch weight.
  DraftGrads cpu_g(cs.w);
  std::vector<TttResult> cpu;
  for (auto& s : batch) cpu.push_back(ttt_forward(cs.c, cs.w, cs.target(), cs.dv, s, false, &cpu_g));
  for (auto& [n, g] : cpu_g.named())
    for (auto& x : *g) x *= weight;

  auto gpu = make_gpu(cs, {0}, math, max_rows);
  gpu->set_weights(cs.w);
  const auto res = gpu->run(batch, weight, true, true);
  ASSERT_EQ(res.size(), cpu.size());
  int64_t counted = 0;
  for (size_t i = 0; i < res.size(); ++i) {
    ASSERT_EQ(res[i].n_k, cpu[i].n_k) << "sample " << i;
    for (auto n : cpu[i].n_k) counted += n;
    EXPECT_NEAR(res[i].loss, cpu[i].loss, loss_tol * std::max(1.0, std::abs(cpu[i].loss))) << "sample " << i;
    for (size_t k = 0; k < cpu[i].loss_k.size(); ++k)
      EXPECT_NEAR(res[i].loss_k[k], cpu[i].loss_k[k], loss_tol * std::max(1.0, cpu[i].loss_k[k])) << i << " step " << k;
    if (math == GpuMath::F32) {
      EXPECT_EQ(res[i].acc_k, cpu[i].acc_k) << "sample " << i;
      EXPECT_EQ(res[i].cond_acc_k, cpu[i].cond_acc_k) << "sample " << i;
    }
  }
  EXPECT_GT(counted, min_counted) << "too few positions count for the test to mean much";
  DraftGrads gpu_g(cs.w);
  gpu->get_grads(gpu_g);
  auto a = gpu_g.named();
  auto b = cpu_g.named();
  for (size_t i = 0; i < a.size(); ++i) {
    double mb = 0;
    for (double x : *b[i].second) mb = std::max(mb, std::abs(x));
    EXPECT_GT(mb, 0.0) << b[i].first << ": the reference gradient is zero";
    EXPECT_LE(rel_max_diff(*a[i].second, *b[i].second), grad_tol) << a[i].first;
  }
}

void check_against_cpu(bool nbr, GpuMath math, double loss_tol, double grad_tol) {
  Case cs(nbr, 1234);
  check_against_cpu(cs, math, loss_tol, grad_tol);
}

TEST_P(GpuDraft, ForwardBackwardMatchesCpuReference) {
  REQUIRE_GPU();
  check_against_cpu(GetParam(), GpuMath::F32, tol::kGpuTttLossRel, tol::kGpuTttGradRel);
}

// The fp32 loop kernels (--gpu-attention loop) are a second, independent attention
// implementation: they must match the reference as well.
TEST_P(GpuDraft, LoopAttentionMatchesCpuReference) {
  REQUIRE_GPU();
  ScopedOpt att([](GpuDraftOptions& o) { o.attention = "loop"; });
  check_against_cpu(GetParam(), GpuMath::F32, tol::kGpuTttLossRel, tol::kGpuTttGradRel);
}

TEST_P(GpuDraft, Bf16TensorCoresStayClose) {
  REQUIRE_GPU();
  check_against_cpu(GetParam(), GpuMath::BF16, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel);
}


// --gpu-lm-grad-in-backward: the lm_head's backward recomputes the logits in the
// backward pass, last step first like the reference (the default runs it in the forward
// pass, right after each step's loss). Exact fp32, so the reference's tolerances.
TEST_P(GpuDraft, LmBackwardInBackwardMatchesCpuReference) {
  REQUIRE_GPU();
  ScopedOpt e([](GpuDraftOptions& o) { o.lm_grad_in_backward = true; });
  check_against_cpu(GetParam(), GpuMath::F32, tol::kGpuTttLossRel, tol::kGpuTttGradRel);
  check_against_cpu(GetParam(), GpuMath::BF16, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel);
}

// --gpu-fp32-operands: bf16 math on fp32 operands in memory, rounded inside cuBLAS (the
// default keeps bf16 operands in memory: weight copies, bf16 twins of activations). The same
// rounding, so the same tolerances.
TEST_P(GpuDraft, Bf16RoundedInsideCublasStaysClose) {
  REQUIRE_GPU();
  ScopedOpt e([](GpuDraftOptions& o) { o.fp32_operands = true; });
  check_against_cpu(GetParam(), GpuMath::BF16, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel);
  ScopedOpt f([](GpuDraftOptions& o) { o.lm_grad_in_backward = true; });
  check_against_cpu(GetParam(), GpuMath::BF16, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel);
}

// Causal key blocks (--gpu-attn-block) of the score-buffer products
// (--gpu-attention blocks; with bf16 math auto takes the fused kernels or cuDNN): with
// blocks of 4 and 7 rows the packed samples (13, 7, 22 and 2 rows) have several blocks,
// partial last blocks and a sample shorter than one block; 0 turns the skipping off. The
// products only skip score tiles that the mask zeroes, so fp32 stays within the reference's
// tolerances.
TEST_P(GpuDraft, CausalKeyBlocksMatchCpuReference) {
  REQUIRE_GPU();
  ScopedOpt att([](GpuDraftOptions& o) { o.attention = "blocks"; });
  for (int64_t blk : {4, 7, 0}) {
    SCOPED_TRACE(fmt::format("block {}", blk));
    ScopedOpt e([&](GpuDraftOptions& o) { o.attn_block = blk; });
    check_against_cpu(GetParam(), GpuMath::F32, tol::kGpuTttLossRel, tol::kGpuTttGradRel);
    check_against_cpu(GetParam(), GpuMath::BF16, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel);
  }
}

// One run's per-sample losses and gradients on the GPU.
struct GpuRun {
  std::vector<double> loss;
  DraftGrads g;
};
GpuRun run_once(Case& cs, GpuMath math, int64_t max_rows) {
  auto gpu = make_gpu(cs, {0}, math, max_rows);
  gpu->set_weights(cs.w);
  GpuRun r{{}, DraftGrads(cs.w)};
  for (auto& x : gpu->run(cs.batch(), 0.25, true, true)) r.loss.push_back(x.loss);
  gpu->get_grads(r.g);
  return r;
}

// Two runs that must compute the same bits: every sample's loss and every gradient equal.
void expect_same_bits(GpuRun& a, GpuRun& b) {
  ASSERT_EQ(a.loss.size(), b.loss.size());
  for (size_t i = 0; i < a.loss.size(); ++i) EXPECT_EQ(a.loss[i], b.loss[i]) << "sample " << i;
  auto ga = a.g.named(), gb = b.g.named();
  for (size_t i = 0; i < ga.size(); ++i) EXPECT_EQ(*ga[i].second, *gb[i].second) << ga[i].first;
}

// A GpuDraftOptions flag on and off computes the same bits (BF16, 311 rows), and no gradient
// is all zeros (which would compare equal whatever the flag did).
void expect_flag_keeps_bits(Case& cs, bool GpuDraftOptions::*flag) {
  GpuRun on_run{{}, DraftGrads(cs.w)}, off_run{{}, DraftGrads(cs.w)};
  {
    ScopedOpt on([&](GpuDraftOptions& o) { o.*flag = true; });
    on_run = run_once(cs, GpuMath::BF16, 311);
  }
  {
    ScopedOpt off([&](GpuDraftOptions& o) { o.*flag = false; });
    off_run = run_once(cs, GpuMath::BF16, 311);
  }
  expect_same_bits(on_run, off_run);
  for (auto& [name, g] : off_run.g.named()) {
    double mx = 0;
    for (double x : *g) mx = std::max(mx, std::abs(x));
    EXPECT_GT(mx, 0.0) << name << ": no gradient to compare";
  }
}

// Two runs of one route (a, b) give the same bits (resume depends on it), and their losses and
// gradients are within kGpuTttFusedVsBlocksRel of another route's on the same bf16 operands.
void expect_repeatable_and_near(GpuRun& a, GpuRun& b, GpuRun& other) {
  ASSERT_EQ(a.loss.size(), other.loss.size());
  for (size_t i = 0; i < a.loss.size(); ++i) {
    EXPECT_EQ(a.loss[i], b.loss[i]) << "sample " << i << " differs between identical runs";
    EXPECT_NEAR(a.loss[i], other.loss[i], tol::kGpuTttFusedVsBlocksRel * std::max(1.0, other.loss[i]))
        << "sample " << i;
  }
  auto ga = a.g.named(), gb = b.g.named(), go = other.g.named();
  for (size_t i = 0; i < ga.size(); ++i) {
    EXPECT_EQ(*ga[i].second, *gb[i].second) << ga[i].first << " differs between identical runs";
    EXPECT_LE(rel_max_diff(*ga[i].second, *go[i].second), tol::kGpuTttFusedVsBlocksRel) << ga[i].first;
  }
}

// The fused attention kernels (--gpu-attention flash) on samples that span several
// 64-row tiles: 150 rows (two full tiles and a partial one), exactly one tile, 7 rows, 90
// rows; head sizes 32, 64 and 128. Against the CPU reference within the bf16 tolerances,
// and against the score-buffer products (--gpu-attention blocks) on the same bf16
// operands, where only summation order and exp2 vs exp differ: a tighter bound, which a
// wrong mask at a tile edge or a dropped tile would break.
TEST_P(GpuDraft, FusedAttentionMatchesReferenceAcrossTiles) {
  REQUIRE_GPU();
  ScopedOpt fused([](GpuDraftOptions& o) { o.attention = "flash"; });
  for (int hd : {32, 64, 128}) {
    SCOPED_TRACE("head_dim " + std::to_string(hd));
    Case cs(GetParam(), 77, {150, 64, 7, 90}, hd);
    check_against_cpu(cs, GpuMath::BF16, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel, 311);
    GpuRun fused = run_once(cs, GpuMath::BF16, 311);
    GpuRun blocks{{}, DraftGrads(cs.w)};
    {
      ScopedOpt att([](GpuDraftOptions& o) { o.attention = "blocks"; });
      blocks = run_once(cs, GpuMath::BF16, 311);
    }
    for (size_t i = 0; i < fused.loss.size(); ++i)
      EXPECT_NEAR(fused.loss[i], blocks.loss[i], tol::kGpuTttFusedVsBlocksRel * std::max(1.0, blocks.loss[i]))
          << "sample " << i;
    auto a = fused.g.named(), b = blocks.g.named();
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_LE(rel_max_diff(*a[i].second, *b[i].second), tol::kGpuTttFusedVsBlocksRel) << a[i].first;
  }
}

// --gpu-attention cudnn: the causal part through cuDNN's fused attention, the diagonal keys merged
// through its log-sum-exp. The samples of the fused kernels' test and a batch of five (cuDNN's plans
// pad the sample count to eight), head sizes 64 and 128. Against the CPU reference within the
// bf16 tolerances, against the score-buffer products on the same operands, and bit-identical
// between two runs (resume depends on it). Skips where the build has no cuDNN frontend; a build
// that has one must find cuDNN on the GPU machine.
TEST_P(GpuDraft, CudnnAttentionMatchesReference) {
  REQUIRE_GPU();
  if (!talon::cuda::cudnn_sdpa_built()) GTEST_SKIP() << "built without the cuDNN frontend";
  std::string why;
  ASSERT_TRUE(talon::cuda::cudnn_sdpa_available(&why)) << why;
  const std::vector<std::vector<int>> batches = {{150, 64, 7, 90}, {31, 1, 130, 12, 66}};
  for (int hd : {64, 128})
    for (const auto& lens : batches) {
      SCOPED_TRACE(fmt::format("head_dim {}, {} samples", hd, lens.size()));
      Case cs(GetParam(), 78, lens, hd);
      ScopedOpt att([](GpuDraftOptions& o) { o.attention = "cudnn"; });
      check_against_cpu(cs, GpuMath::BF16, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel, 311);
      GpuRun a = run_once(cs, GpuMath::BF16, 311), b = run_once(cs, GpuMath::BF16, 311);
      GpuRun blocks{{}, DraftGrads(cs.w)};
      {
        ScopedOpt att2([](GpuDraftOptions& o) { o.attention = "blocks"; });
        blocks = run_once(cs, GpuMath::BF16, 311);
      }
      expect_repeatable_and_near(a, b, blocks);
    }
}

// The diagonal keys' backward in one kernel (GpuDraftOptions::fused_diag_backward) computes
// the same bits as the four kernels it replaces, after the fused kernels' and cuDNN's causal
// part, for head sizes of both of its instantiations (up to 64 and up to 128), over samples
// that span several tiles; and with the score-buffer products, against the CPU reference.
TEST_P(GpuDraft, FusedDiagonalBackwardMatchesTheSeparateKernels) {
  REQUIRE_GPU();
  std::vector<std::string> routes = {"flash"};
  if (talon::cuda::cudnn_sdpa_available(nullptr)) routes.push_back("cudnn");
  for (int hd : {32, 128})
    for (const std::string& route : routes) {
      SCOPED_TRACE(fmt::format("head_dim {}, {}", hd, route));
      Case cs(GetParam(), 79, {150, 64, 7, 90}, hd);
      ScopedOpt att([&](GpuDraftOptions& o) { o.attention = route; });
      GpuRun fused = run_once(cs, GpuMath::BF16, 311), apart{{}, DraftGrads(cs.w)};
      {
        ScopedOpt off([](GpuDraftOptions& o) { o.fused_diag_backward = false; });
        apart = run_once(cs, GpuMath::BF16, 311);
      }
      expect_same_bits(fused, apart);
    }
  Case cs(GetParam(), 80, {150, 64, 7, 90}, 64);
  ScopedOpt att([](GpuDraftOptions& o) { o.attention = "blocks"; });
  check_against_cpu(cs, GpuMath::BF16, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel, 311);
}

// The diagonal keys' merge with every step's rows in registers and their backward with the next
// step's rows loaded ahead (GpuDraftOptions::diag_rows_in_registers) compute the same bits as
// the kernels before: losses and every gradient, after the fused kernels' and cuDNN's causal
// part, head sizes 32, 48 (lanes past the head) and 128, and 4, 7 and 11 steps (the merge holds
// four steps' rows or eight; past eight, its later steps take the old kernel).
TEST_P(GpuDraft, DiagonalRowsInRegistersKeepTheBits) {
  REQUIRE_GPU();
  std::vector<std::string> routes = {"flash"};
  if (talon::cuda::cudnn_sdpa_available(nullptr)) routes.push_back("cudnn");
  for (int hd : {32, 48, 128})
    for (int K : {4, 7, 11})
      for (const std::string& route : routes) {
        SCOPED_TRACE(fmt::format("head_dim {}, {} steps, {}", hd, K, route));
        Case cs(GetParam(), 83, {150, 64, 7, 90}, hd);
        cs.c.ttt_steps = K;
        ScopedOpt att([&](GpuDraftOptions& o) { o.attention = route; });
        expect_flag_keeps_bits(cs, &GpuDraftOptions::diag_rows_in_registers);
      }
}

// RoPE, the row cut's moves and the bf16 casts of q, k, v and of their gradients in one kernel
// each, with step 0's keys and values kept as bf16 for every step's attention
// (GpuDraftOptions::fused_rope_rows), compute the same bits as the separate kernels: losses
// and every gradient, on a batch laid out as chat data (rows cut after step 0: a sample without
// loss rows, a long prompt, alternating turns) and without the cut, head sizes 16 and 128 (more
// rotation pairs a row than a block's threads), the fused attention kernels and cuDNN's, and
// with a product per matrix (only the forward's kernel then).
TEST_P(GpuDraft, FusedRopeRowsKeepTheBits) {
  REQUIRE_GPU();
  std::vector<std::string> routes = {"flash"};
  if (talon::cuda::cudnn_sdpa_available(nullptr)) routes.push_back("cudnn");
  for (int hd : {16, 128})
    for (bool cut : {true, false})
      for (bool fused_products : {true, false})
        for (const std::string& route : routes) {
          SCOPED_TRACE(fmt::format("head_dim {}, row cut {}, fused products {}, {}", hd, cut, fused_products, route));
          Case cs(GetParam(), 84, {13, 7, 30, 2, 17}, hd);
          cs.favour_draft_vocab(0.3f);
          cs.mask_as_chat();
          ScopedOpt opt([&](GpuDraftOptions& o) {
            o.attention = route;
            o.row_cut = cut;
            o.fused_products = fused_products;
            o.qkv_forward_product = false;  // three products either way (the bits of one differ)
          });
          expect_flag_keeps_bits(cs, &GpuDraftOptions::fused_rope_rows);
        }
}

// With the fused RoPE kernel the forward's q, k and v can be one product whose rows the kernel
// reads (GpuDraftOptions::qkv_forward_product): against the CPU reference, bit-identical between
// two runs (resume depends on it) and within the tolerance of two routes on the same bf16
// operands of three products (only the order of fp32 sums differs); rows cut and not, head sizes
// 16 (q|k|v rows wider than the MLP's, so the setup grows the buffer they go to) and 128, the
// fused attention kernels and cuDNN's.
TEST_P(GpuDraft, OneQkvForwardProductMatchesThree) {
  REQUIRE_GPU();
  std::vector<std::string> routes = {"flash"};
  if (talon::cuda::cudnn_sdpa_available(nullptr)) routes.push_back("cudnn");
  for (int hd : {16, 128})
    for (bool cut : {true, false})
      for (const std::string& route : routes) {
        SCOPED_TRACE(fmt::format("head_dim {}, row cut {}, {}", hd, cut, route));
        Case cs(GetParam(), 85, {13, 7, 30, 2, 17}, hd);
        cs.favour_draft_vocab(0.3f);
        for (size_t t = 0; t < 18; ++t) cs.samples[2].mask[t] = 0;
        ScopedOpt opt([&](GpuDraftOptions& o) {
          o.attention = route;
          o.row_cut = cut;
          o.fused_products = true;
          o.fused_rope_rows = true;
        });
        GpuRun one{{}, DraftGrads(cs.w)}, again{{}, DraftGrads(cs.w)}, three{{}, DraftGrads(cs.w)};
        {
          ScopedOpt on([](GpuDraftOptions& o) { o.qkv_forward_product = true; });
          check_against_cpu(cs, GpuMath::BF16, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel, 80, 20);
          one = run_once(cs, GpuMath::BF16, 311);
          again = run_once(cs, GpuMath::BF16, 311);
        }
        {
          ScopedOpt off([](GpuDraftOptions& o) { o.qkv_forward_product = false; });
          three = run_once(cs, GpuMath::BF16, 311);
        }
        expect_repeatable_and_near(one, again, three);
      }
}

// One product for gate|up (forward and backward) and one each for the q|k|v backward
// (GpuDraftOptions::fused_products) against a product per weight matrix: both against the CPU
// reference, against each other within the tolerance of two routes on the same bf16 operands
// (only the order of fp32 sums differs, but a rounding that moves flips bf16 roundings of later
// operands), and the fused route bit-identical between two runs (resume depends on it). Head
// sizes 16 and 128 (q|k|v rows narrower and wider than gate|up's 2I), an odd row budget, fused
// attention kernels and score-buffer products.
TEST_P(GpuDraft, FusedProductsMatchAProductPerMatrix) {
  REQUIRE_GPU();
  for (int hd : {16, 128})
    for (const std::string route : {"flash", "blocks"}) {
      SCOPED_TRACE(fmt::format("head_dim {}, {}", hd, route));
      Case cs(GetParam(), 81, {150, 64, 7, 90}, hd);
      ScopedOpt att([&](GpuDraftOptions& o) {
        o.attention = route;
        o.fused_products = false;
      });
      check_against_cpu(cs, GpuMath::BF16, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel, 311);
      // (the near ties the first check unmasked stay unmasked: every run below sees one batch)
      GpuRun apart = run_once(cs, GpuMath::BF16, 311);
      ScopedOpt on([](GpuDraftOptions& o) { o.fused_products = true; });
      check_against_cpu(cs, GpuMath::BF16, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel, 311);
      GpuRun fused = run_once(cs, GpuMath::BF16, 311), again = run_once(cs, GpuMath::BF16, 311);
      expect_repeatable_and_near(fused, again, apart);
    }
}

// The products' algorithms chosen by cuBLASLt rules (GpuDraftOptions::products first, waves and
// timed) against cublasGemmEx's own choice (cublas): each against the CPU reference, against the
// cublas route within the tolerance of two routes on the same bf16 operands (the algorithms
// differ in the order of fp32 sums only), and bit-identical between two runs (resume depends on
// it; the timed rule's two runs time their candidates anew); with the fused products too, whose
// shapes differ. auto (the default) takes the timed rule on bf16 operands and cuBLAS's own choice on
// fp32 operands; an unknown rule, or a cuBLASLt rule without bf16 operands, is refused by name.
TEST_P(GpuDraft, LtProductRulesMatchCublasChoice) {
  REQUIRE_GPU();
  Case cs(GetParam(), 87, {150, 64, 7, 90}, 64);
  for (bool fused : {false, true})
    for (const std::string rule : {"first", "waves", "timed"}) {
      SCOPED_TRACE(fmt::format("{}, fused products {}", rule, fused));
      ScopedOpt base([&](GpuDraftOptions& o) {
        o.products = "cublas";
        o.fused_products = fused;
      });
      // (the first check unmasks the batch's near ties, once: every run below sees one batch)
      check_against_cpu(cs, GpuMath::BF16, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel, 313);
      GpuRun cublas = run_once(cs, GpuMath::BF16, 313);
      ScopedOpt on([&](GpuDraftOptions& o) { o.products = rule; });
      check_against_cpu(cs, GpuMath::BF16, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel, 313);
      GpuRun lt = run_once(cs, GpuMath::BF16, 313), again = run_once(cs, GpuMath::BF16, 313);
      expect_repeatable_and_near(lt, again, cublas);
    }
  // auto (the default): the timed rule's cuBLASLt families with bf16 operands; cuBLAS itself (no
  // plans, no error) with fp32 operands.
  for (const bool fp32_operands : {false, true}) {
    ScopedOpt o([&](GpuDraftOptions& e) {
      e.products = "auto";
      e.fp32_operands = fp32_operands;
    });
    auto gpu = make_gpu_draft_trainer(cs.c, cs.target(), cs.dv, {0}, GpuMath::BF16, 320, {}, g_eng);
    gpu->set_weights(cs.w);
    gpu->run(cs.batch(), 0.25, true, true);
    const ProductPlans pp = gpu->product_plans();
    if (fp32_operands) {
      EXPECT_EQ(pp.shapes, 0) << "auto on fp32 operands went through cuBLASLt";
    } else {
      EXPECT_GT(pp.families, 0) << "auto on bf16 operands did not take the timed rule";
    }
  }
  for (const auto& [rule, math, what] :
       {std::tuple{"fastest", GpuMath::BF16, "expected auto, cublas, first, waves or timed"},
        std::tuple{"waves", GpuMath::F32, "needs bf16 math on bf16 operands"}}) {
    ScopedOpt o([&](GpuDraftOptions& e) { e.products = rule; });
    try {
      make_gpu(cs, {0}, math, 320);
      ADD_FAILURE() << rule << " was accepted";
    } catch (const talon::Error& e) {
      EXPECT_NE(std::string(e.what()).find("--gpu-products"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  }
}

// auto takes cuDNN's attention for a batch whose bucket's workspace fits the bytes it may use
// (GpuDraftOptions::cudnn_auto_bytes; by default the idle memory lent to it) and the fused
// kernels for the others. Two batches of different buckets (4 samples of up to 150 rows; 2
// samples, one of 300): with the cap at 0, between the two buckets' workspaces and at the
// larger one, each batch's losses and gradients are the bits of the route it should take
// (`flash` or `cudnn` by name, same batches), and cudnn_batches() counts the cuDNN ones.
TEST_P(GpuDraft, AutoAttentionTakesCudnnWhereItsWorkspaceFits) {
  REQUIRE_GPU();
  if (!talon::cuda::cudnn_sdpa_available()) GTEST_SKIP() << "cuDNN is not available";
  constexpr int hd = 64;
  constexpr int64_t R = 320;
  Case cs(GetParam(), 83, {150, 64, 7, 90, 300, 20}, hd);
  const std::vector<Sample> all = cs.batch();
  const std::vector<Sample> b1(all.begin(), all.begin() + 4), b2(all.begin() + 4, all.end());
  struct Out {
    std::vector<std::vector<double>> loss;
    std::vector<DraftGrads> g;
    int64_t via_cudnn = -1;
  };
  const auto go = [&](const std::string& att, int64_t cap) {
    ScopedOpt o([&](GpuDraftOptions& e) {
      e.attention = att;
      e.cudnn_auto_bytes = cap;
    });
    auto gpu = make_gpu(cs, {0}, GpuMath::BF16, R);
    gpu->set_weights(cs.w);
    Out r;
    for (const auto* b : {&b1, &b2}) {
      r.loss.emplace_back();
      for (auto& x : gpu->run(*b, 0.25, true, true)) r.loss.back().push_back(x.loss);
      r.g.emplace_back(cs.w);
      gpu->get_grads(r.g.back());
    }
    r.via_cudnn = gpu->cudnn_batches();
    return r;
  };
  Out cudnn = go("cudnn", -1), flash = go("flash", -1);
  EXPECT_EQ(cudnn.via_cudnn, 2);
  EXPECT_EQ(flash.via_cudnn, 0);
  // The buckets' workspaces, from a CudnnSdpa of the engine's shape.
  talon::cuda::CudnnSdpa sdpa(talon::cuda::SdpaShape{int(cs.c.n_heads), int(cs.c.n_kv_heads), hd,
                                                     float(1.0 / std::sqrt(double(hd))), R},
                              nullptr);
  const int64_t w1 = sdpa.workspace_bytes(4, 150), w2 = sdpa.workspace_bytes(2, 300);
  ASSERT_LT(w1, w2) << "the second bucket must need more workspace for this test";
  for (auto [cap, take1, take2] :
       {std::tuple<int64_t, bool, bool>{0, false, false}, {w1, true, false}, {w2, true, true}}) {
    SCOPED_TRACE(fmt::format("cap {} bytes (buckets {} and {})", cap, w1, w2));
    Out a = go("auto", cap);
    EXPECT_EQ(a.via_cudnn, int64_t(take1) + int64_t(take2));
    for (int b = 0; b < 2; ++b) {
      Out& want = (b == 0 ? take1 : take2) ? cudnn : flash;
      EXPECT_EQ(a.loss[size_t(b)], want.loss[size_t(b)]) << "batch " << b;
      auto ga = a.g[size_t(b)].named(), gw = want.g[size_t(b)].named();
      for (size_t i = 0; i < ga.size(); ++i)
        EXPECT_EQ(*ga[i].second, *gw[i].second) << "batch " << b << ": " << ga[i].first;
    }
  }
}

// --gpu-cudnn-head-groups: where a bucket's backward over every head needs more workspace than
// cuDNN may use (here cudnn_auto_bytes, set just below it), auto still takes cuDNN, its backward
// in two head groups (8 query heads over 2 kv heads: one kv head and its 4 query heads a group),
// whose workspace is smaller (not half: part of it does not scale with the heads; at this
// shape, on an H100, 2.6 MiB against 4.6).
// Against the CPU reference within the bf16 tolerances, against cuDNN's backward over every head
// (--gpu-attention cudnn) within the fused kernels' tolerance, and bit-identical between runs.
TEST_P(GpuDraft, CudnnBackwardInHeadGroupsMatchesReference) {
  REQUIRE_GPU();
  if (!talon::cuda::cudnn_sdpa_available()) GTEST_SKIP() << "cuDNN is not available";
  constexpr int hd = 32;
  constexpr int64_t R = 311;
  Case cs(GetParam(), 88, {150, 64, 7, 90}, hd, 96, 8, 2);
  talon::cuda::CudnnSdpa sdpa(talon::cuda::SdpaShape{8, 2, hd, float(1.0 / std::sqrt(double(hd))), R}, nullptr);
  const int64_t whole = sdpa.workspace_bytes(4, 150);
  ASSERT_EQ(sdpa.backward_groups(4, 150), 1);
  sdpa.set_backward_limit(whole - 1);
  ASSERT_EQ(sdpa.backward_groups(4, 150), 2) << "less than the whole workspace: two head groups";
  const int64_t grouped = sdpa.workspace_bytes(4, 150);
  ASSERT_LT(grouped, whole);
  const auto go = [&](bool groups, int64_t* via_cudnn) {
    ScopedOpt o([&](GpuDraftOptions& e) {
      e.attention = groups ? "auto" : "cudnn";
      e.cudnn_head_groups = groups;
      e.cudnn_auto_bytes = groups ? grouped : -1;
    });
    auto gpu = make_gpu(cs, {0}, GpuMath::BF16, R);
    gpu->set_weights(cs.w);
    GpuRun r{{}, DraftGrads(cs.w)};
    for (auto& x : gpu->run(cs.batch(), 0.25, true, true)) r.loss.push_back(x.loss);
    gpu->get_grads(r.g);
    if (via_cudnn) *via_cudnn = gpu->cudnn_batches();
    return r;
  };
  {
    ScopedOpt o([&](GpuDraftOptions& e) {
      e.attention = "auto";
      e.cudnn_head_groups = true;
      e.cudnn_auto_bytes = grouped;
    });
    check_against_cpu(cs, GpuMath::BF16, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel, R);
  }
  int64_t via = -1;
  GpuRun a = go(true, &via), b = go(true, nullptr), all_heads = go(false, nullptr);
  EXPECT_EQ(via, 1) << "the batch did not go through cuDNN";
  expect_repeatable_and_near(a, b, all_heads);
}

// --gpu-batch-embeddings (the default with bf16 operands): the target's embedding stays on the
// host and each batch uploads the rows of its own tokens. The rows are the same bf16 values, so
// losses and gradients are the same bits as with the whole table on the device
// (--gpu-device-embeddings) and as by default; over two batches with different tokens (the
// second reuses the upload buffers), and refused where it cannot apply (exact fp32 math) or
// asked for with its opposite.
TEST_P(GpuDraft, BatchEmbeddingsGiveTheSameBits) {
  REQUIRE_GPU();
  Case cs(GetParam(), 91, {13, 7, 22, 2, 40, 1, 9});
  const std::vector<Sample> all = cs.batch();
  const std::vector<Sample> b1(all.begin(), all.begin() + 4), b2(all.begin() + 4, all.end());
  const auto go = [&](int where) {  // 0: on the device, 1: per batch, 2: the default
    ScopedOpt e([&](GpuDraftOptions& o) {
      o.batch_embeddings = where == 1;
      o.device_embeddings = where == 0;
    });
    auto gpu = make_gpu(cs, {0}, GpuMath::BF16, 64);
    gpu->set_weights(cs.w);
    GpuRun r{{}, DraftGrads(cs.w)};
    for (const auto* b : {&b1, &b2})
      for (auto& x : gpu->run(*b, 0.25, true, true)) r.loss.push_back(x.loss);
    gpu->get_grads(r.g);  // the second batch's
    return r;
  };
  GpuRun whole = go(0);
  for (int where : {1, 2}) {
    SCOPED_TRACE(where == 1 ? "batch embeddings" : "default");
    GpuRun rows = go(where);
    ASSERT_EQ(whole.loss.size(), rows.loss.size());
    for (size_t i = 0; i < whole.loss.size(); ++i) EXPECT_EQ(whole.loss[i], rows.loss[i]) << "sample " << i;
    auto a = whole.g.named(), b = rows.g.named();
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(*a[i].second, *b[i].second) << a[i].first;
  }
  ScopedOpt e([](GpuDraftOptions& o) { o.batch_embeddings = true; });
  EXPECT_THROW(make_gpu(cs, {0}, GpuMath::F32, 64), Error);
  ScopedOpt both([](GpuDraftOptions& o) { o.device_embeddings = true; });
  EXPECT_THROW(make_gpu(cs, {0}, GpuMath::BF16, 64), Error);
}

// An explicit request for the fused kernels that they cannot serve is refused.
TEST(GpuDraftFused, RefusesUnsupportedRequest) {
  REQUIRE_GPU();
  ScopedOpt att([](GpuDraftOptions& o) { o.attention = "flash"; });
  Case cs(false, 3);
  EXPECT_THROW(make_gpu(cs, {0}, GpuMath::F32, 64), Error);
  ScopedOpt bad([](GpuDraftOptions& o) { o.attention = "fastest"; });
  EXPECT_THROW(make_gpu(cs, {0}, GpuMath::BF16, 64), Error);
}

// The draft logits (and the target's full logits) a few rows at a time
// (--gpu-logit-rows): 5 rows split the 44-row batch into chunks that cut through
// samples and leave a short last one, 1 row is the extreme. Each chunk's loss gradient goes
// through the lm_head on its own, in the forward (the default) and in the backward; fp32
// stays within the reference's tolerances.
TEST_P(GpuDraft, LogitRowChunksMatchCpuReference) {
  REQUIRE_GPU();
  for (int64_t rows : {5, 1}) {
    SCOPED_TRACE(fmt::format("rows {}", rows));
    ScopedOpt e([&](GpuDraftOptions& o) { o.logit_rows = rows; });
    check_against_cpu(GetParam(), GpuMath::F32, tol::kGpuTttLossRel, tol::kGpuTttGradRel);
    check_against_cpu(GetParam(), GpuMath::BF16, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel);
    ScopedOpt f([](GpuDraftOptions& o) { o.lm_grad_in_backward = true; });
    check_against_cpu(GetParam(), GpuMath::F32, tol::kGpuTttLossRel, tol::kGpuTttGradRel);
  }
}

// An intermediate size of 4H: the MLP gradient's buffer (dact) is then large enough to also
// hold the draft logits, the fused attention's partials, the attention input's gradient and
// the RMSNorm backward's scratch, which share it (with I = 1.5H, as in the other tests, the
// last three have their own buffers). A write to shared memory while another of them is
// still live would show against the reference.
TEST_P(GpuDraft, SharedScratchMatchesCpuReference) {
  REQUIRE_GPU();
  Case cs(GetParam(), 4321, {13, 7, 22, 2}, 16, 256);
  check_against_cpu(cs, GpuMath::F32, tol::kGpuTttLossRel, tol::kGpuTttGradRel);
  check_against_cpu(cs, GpuMath::BF16, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel);
  ScopedOpt f([](GpuDraftOptions& o) { o.lm_grad_in_backward = true; });
  check_against_cpu(cs, GpuMath::F32, tol::kGpuTttLossRel, tol::kGpuTttGradRel);
  check_against_cpu(cs, GpuMath::BF16, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel);
}

// Only the rows whose loss counts get draft logits, a loss and an lm_head gradient, and only
// loss-masked rows get the target's distribution (loss_rows, target_rows): a batch laid out
// as real chat data is (a sample with no loss-masked token at all, a long prompt before the
// answer, masked runs between unmasked ones), logits a few rows at a time so that chunks of
// the compacted rows cut through samples, both lm_head backward placements.
TEST_P(GpuDraft, SparseLossRowsMatchCpuReference) {
  REQUIRE_GPU();
  Case cs(GetParam(), 99, {13, 7, 30, 2, 17});
  cs.favour_draft_vocab(0.3f);
  cs.mask_as_chat();
  for (int64_t rows : {3, 4096}) {
    SCOPED_TRACE(fmt::format("rows {}", rows));
    ScopedOpt e([&](GpuDraftOptions& o) { o.logit_rows = rows; });
    check_against_cpu(cs, GpuMath::F32, tol::kGpuTttLossRel, tol::kGpuTttGradRel, 80, 20);
    check_against_cpu(cs, GpuMath::BF16, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel, 80, 20);
    ScopedOpt f([](GpuDraftOptions& o) { o.lm_grad_in_backward = true; });
    check_against_cpu(cs, GpuMath::F32, tol::kGpuTttLossRel, tol::kGpuTttGradRel, 80, 20);
    check_against_cpu(cs, GpuMath::BF16, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel, 80, 20);
  }
}

// GpuDraftOptions::row_cut: steps after the first run only the rows some later step counts (as
// the CPU reference's ttt_forward leaves the others out), on a batch laid out as chat data is (a
// sample with no loss-masked token, a long prompt before its answer, alternating turns). Every
// attention route (the fused kernels, the score-buffer products, the fp32 loop kernels, cuDNN
// where built), both lm_head backward placements and chunks of 3 logit rows, against the CPU
// reference; the rows run (row_steps) fall between N (step 0 only) and N x K (no cut), and are
// N x K again with the option off.
TEST_P(GpuDraft, RowCutMatchesCpuReference) {
  REQUIRE_GPU();
  Case cs(GetParam(), 99, {13, 7, 30, 2, 17});
  cs.favour_draft_vocab(0.3f);
  cs.mask_as_chat();
  ScopedOpt cut([](GpuDraftOptions& o) { o.row_cut = true; });
  check_against_cpu(cs, GpuMath::F32, tol::kGpuTttLossRel, tol::kGpuTttGradRel, 80, 20);
  check_against_cpu(cs, GpuMath::BF16, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel, 80, 20);
  {
    ScopedOpt att([](GpuDraftOptions& o) { o.attention = "loop"; });
    check_against_cpu(cs, GpuMath::F32, tol::kGpuTttLossRel, tol::kGpuTttGradRel, 80, 20);
  }
  {
    ScopedOpt att([](GpuDraftOptions& o) { o.attention = "blocks"; });
    check_against_cpu(cs, GpuMath::BF16, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel, 80, 20);
  }
  if (talon::cuda::cudnn_sdpa_available(nullptr)) {
    ScopedOpt att([](GpuDraftOptions& o) { o.attention = "cudnn"; });
    check_against_cpu(cs, GpuMath::BF16, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel, 80, 20);
  }
  {
    ScopedOpt f([](GpuDraftOptions& o) { o.lm_grad_in_backward = true; });
    check_against_cpu(cs, GpuMath::F32, tol::kGpuTttLossRel, tol::kGpuTttGradRel, 80, 20);
    check_against_cpu(cs, GpuMath::BF16, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel, 80, 20);
  }
  {
    ScopedOpt e([](GpuDraftOptions& o) { o.logit_rows = 3; });
    check_against_cpu(cs, GpuMath::BF16, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel, 80, 20);
  }
  int64_t N = 0;
  for (auto& smp : cs.samples) N += int64_t(smp.ids.size());
  const int64_t K = cs.c.ttt_steps;
  for (bool on : {true, false}) {
    ScopedOpt e([&](GpuDraftOptions& o) { o.row_cut = on; });
    auto gpu = make_gpu(cs, {0}, GpuMath::BF16, 80);
    gpu->set_weights(cs.w);
    gpu->run(cs.batch(), 0.2, true, true);
    if (on) {
      EXPECT_GT(gpu->row_steps(), N);
      EXPECT_LT(gpu->row_steps(), N * K);
    } else {
      EXPECT_EQ(gpu->row_steps(), N * K);
    }
  }
}

// Samples too short for the later steps: steps 2 and 3 of 4 have no row that counts (their
// lm_head products are skipped, and the d fn they pass back is zero), steps 0 and 1 a few.
TEST_P(GpuDraft, StepsWithoutLossRowsMatchCpuReference) {
  REQUIRE_GPU();
  Case cs(GetParam(), 5, {3, 2, 3, 3, 2, 3});
  cs.favour_draft_vocab(0.3f);
  for (auto& s : cs.samples)
    for (auto& m : s.mask) m = 1;
  check_against_cpu(cs, GpuMath::F32, tol::kGpuTttLossRel, tol::kGpuTttGradRel, 64, 8);
  ScopedOpt f([](GpuDraftOptions& o) { o.lm_grad_in_backward = true; });
  check_against_cpu(cs, GpuMath::F32, tol::kGpuTttLossRel, tol::kGpuTttGradRel, 64, 8);
}

// Work on the legacy default stream from another thread while a test runs, as other users of
// the GPU make it: fills of a 1 GiB buffer back to back (about 0.3 ms each on an H200), so
// that anything else enqueued there waits behind one.
class DefaultStreamLoad {
 public:
  DefaultStreamLoad() {
    if (cudaMalloc(&buf_, kBytes) != cudaSuccess) {
      buf_ = nullptr;
      return;
    }
    th_ = std::thread([this] {
      cudaEvent_t ev[2];
      for (auto& e : ev) cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
      for (int i = 0; !stop_; ++i) {  // two fills in flight: the stream is never idle for long
        cudaMemsetAsync(buf_, i & 0xff, kBytes, cudaStreamLegacy);
        cudaEventRecord(ev[i % 2], cudaStreamLegacy);
        if (i > 0) cudaEventSynchronize(ev[(i + 1) % 2]);
      }
      cudaStreamSynchronize(cudaStreamLegacy);
      for (auto& e : ev) cudaEventDestroy(e);
    });
  }
  ~DefaultStreamLoad() {
    stop_ = true;
    if (th_.joinable()) th_.join();
    if (buf_) cudaFree(buf_);
  }
  bool on() const { return buf_ != nullptr; }

 private:
  static constexpr size_t kBytes = size_t(1) << 30;
  void* buf_ = nullptr;
  std::atomic<bool> stop_{false};
  std::thread th_;
};

// Micro-batches of more than 2,048 rows, packed from several samples, as `talon train` makes
// them for the held-back evaluation (the whole split, up to --max-batch-tokens rows at a
// time) and for --batch-samples > 1: six samples of 512-900 rows (4,362 rows) through the
// default path (bf16 math on bf16 operands, the fused attention kernels), forward only and
// with a backward, against the CPU reference. Each engine first runs one short sample with
// a backward, as training leaves it, so that the big batch grows its scratch buffers (the
// bf16 copies of the features and of the keys and values among them) in the middle of a
// run; meanwhile another thread keeps the legacy default stream busy, as other work on the
// GPU does. A buffer zeroed there rather than on the trainer's own stream could be cleared
// after the trainer had written it: the evaluation of a training run came out wrong that way
// (acc_0 0.19-0.37 against 0.42-0.44 for the same weights).
TEST(GpuDraftPacked, OverTwoThousandRowsMatchCpuReference) {
  REQUIRE_GPU();
  Case cs(false, 2026, {900, 512, 777, 640, 833, 700}, 64, 192);
  cs.favour_draft_vocab(0.3f);
  const auto batch = cs.batch();
  int64_t N = 0;
  for (auto& s : batch) N += s.T;
  ASSERT_GT(N, 2048);
  const double weight = 1.0 / double(batch.size());
  DraftGrads cpu_g(cs.w);
  std::vector<TttResult> cpu;
  for (auto& s : batch) cpu.push_back(ttt_forward(cs.c, cs.w, cs.target(), cs.dv, s, false, &cpu_g));
  for (auto& [n, g] : cpu_g.named())
    for (auto& x : *g) x *= weight;
  // Losses within the bf16 tolerance; accuracies within a few positions of a sample (bf16
  // can flip a near tie of the draft's argmax; a wrong attention moves them by tens of
  // percent).
  const auto expect_near_cpu = [&](const std::vector<TttResult>& res) {
    ASSERT_EQ(res.size(), cpu.size());
    for (size_t i = 0; i < res.size(); ++i) {
      ASSERT_EQ(res[i].n_k, cpu[i].n_k) << "sample " << i;
      EXPECT_NEAR(res[i].loss, cpu[i].loss, tol::kGpuTttBf16LossRel * std::max(1.0, cpu[i].loss)) << "sample " << i;
      for (size_t k = 0; k < cpu[i].loss_k.size(); ++k) {
        EXPECT_NEAR(res[i].loss_k[k], cpu[i].loss_k[k], tol::kGpuTttBf16LossRel * std::max(1.0, cpu[i].loss_k[k]))
            << "sample " << i << " step " << k;
        EXPECT_NEAR(res[i].acc_k[k], cpu[i].acc_k[k], tol::kGpuTttBf16AccAbs) << "sample " << i << " step " << k;
        EXPECT_NEAR(res[i].cond_acc_k[k], cpu[i].cond_acc_k[k], tol::kGpuTttBf16AccAbs)
            << "sample " << i << " step " << k;
      }
    }
  };
  for (int round = 0; round < 8; ++round) {
    for (bool backward : {false, true}) {
      SCOPED_TRACE(fmt::format("round {}, {}", round, backward ? "forward and backward" : "forward only"));
      auto gpu = make_gpu(cs, {0}, GpuMath::BF16, N);
      gpu->set_weights(cs.w);
      gpu->run({batch[1]}, 1.0, true, true);  // one short sample, as a training step
      std::vector<TttResult> res;
      {
        DefaultStreamLoad load;
        ASSERT_TRUE(load.on());
        res = gpu->run(batch, weight, backward, true);
      }
      expect_near_cpu(res);
      if (!backward) continue;
      DraftGrads gpu_g(cs.w);
      gpu->get_grads(gpu_g);
      auto a = gpu_g.named();
      auto b = cpu_g.named();
      for (size_t i = 0; i < a.size(); ++i)
        EXPECT_LE(rel_max_diff(*a[i].second, *b[i].second), tol::kGpuTttBf16GradRel) << a[i].first;
    }
    if (::testing::Test::HasFailure()) break;
  }
}

// Samples of 1-12 rows packed until there are at least 40: each row's position in its sample
// and the sample's length.
void random_samples(std::mt19937& rng, std::vector<int32_t>& pos, std::vector<int32_t>& len) {
  while (pos.size() < 40) {
    const int32_t T = 1 + int32_t(rng() % 12);
    for (int32_t t = 0; t < T; ++t) pos.push_back(t), len.push_back(T);
  }
}

// The row lists themselves, against their definition (host code: runs without a GPU).
TEST(DraftLossRows, ListsExactlyTheRowsThatCount) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 50; ++trial) {
    const int64_t K = 1 + int64_t(rng() % 7);
    std::vector<int32_t> pos, len;
    random_samples(rng, pos, len);
    const int64_t N = int64_t(pos.size());
    std::vector<uint8_t> mask(static_cast<size_t>(N)), iv(static_cast<size_t>(N));
    for (auto& m : mask) m = uint8_t(rng() % 3 != 0);
    for (auto& v : iv) v = uint8_t(rng() % 4 != 0);
    const cuda::LossRows lr = cuda::loss_rows(K, N, mask.data(), pos.data(), len.data(), iv.data());
    ASSERT_EQ(lr.count.size(), size_t(K));
    for (int64_t k = 0; k < K; ++k) {
      std::vector<int32_t> want;
      for (int64_t n = 0; n < N; ++n) {
        // Row n's step-k target is row n+1+k of its own sample.
        const int64_t start = n - pos[size_t(n)], tr = n + 1 + k;
        if (tr < start + len[size_t(n)] && mask[size_t(tr)] && iv[size_t(tr)]) want.push_back(int32_t(n));
      }
      ASSERT_EQ(lr.count[size_t(k)], int64_t(want.size())) << "step " << k;
      for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(lr.rows[size_t(k * N) + i], want[i]);
      for (int64_t n = 0; n < N; ++n) {
        const int32_t j = lr.slot[size_t(k * N + n)];
        const auto it = std::find(want.begin(), want.end(), int32_t(n));
        if (it == want.end())
          EXPECT_EQ(j, -1) << "step " << k << " row " << n;
        else
          EXPECT_EQ(j, int32_t(it - want.begin())) << "step " << k << " row " << n;
      }
    }
    const auto tr = cuda::target_rows(N, mask.data(), pos.data());
    std::vector<int32_t> want;
    for (int64_t n = 0; n < N; ++n)
      if (mask[size_t(n)] && pos[size_t(n)] > 0) want.push_back(int32_t(n));
    EXPECT_EQ(tr, want);
    // Every row a loss reads is a target row.
    for (int64_t k = 0; k < K; ++k)
      for (int64_t i = 0; i < lr.count[size_t(k)]; ++i)
        EXPECT_TRUE(std::binary_search(tr.begin(), tr.end(), lr.rows[size_t(k * N) + i] + 1 + int32_t(k)));
  }
}

// row_cut: the rows some step after the first counts, in order, the inverse map, and each step's
// loss rows and slots in the kept rows' numbering; no cut when every row is kept. Step 0's rows
// after its attention (its own loss rows and the kept ones) and the maps between the two.
TEST(DraftLossRows, RowCutKeepsTheRowsLaterStepsCount) {
  std::mt19937 rng(12);
  int cuts = 0, cuts0 = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const int64_t K = 1 + int64_t(rng() % 7);
    std::vector<int32_t> pos, len;
    random_samples(rng, pos, len);
    const int64_t N = int64_t(pos.size());
    std::vector<uint8_t> mask(static_cast<size_t>(N)), iv(static_cast<size_t>(N));
    const unsigned every = 1 + unsigned(trial % 4);  // from every row masked to a quarter
    for (auto& m : mask) m = uint8_t(rng() % every == 0);
    for (auto& v : iv) v = uint8_t(rng() % 4 != 0);
    const cuda::LossRows lr = cuda::loss_rows(K, N, mask.data(), pos.data(), len.data(), iv.data());
    const cuda::RowCut rc = cuda::row_cut(lr, K, N);
    std::vector<int32_t> want;
    for (int64_t n = 0; n < N; ++n) {
      bool later = false;
      for (int64_t k = 1; k < K; ++k) later = later || lr.slot[size_t(k * N + n)] >= 0;
      if (later) want.push_back(int32_t(n));
    }
    if (want.empty()) want.push_back(0);
    ASSERT_EQ(rc.crow, want) << "trial " << trial;
    ASSERT_EQ(rc.cinv.size(), size_t(N));
    for (int64_t n = 0; n < N; ++n) {
      const auto it = std::find(want.begin(), want.end(), int32_t(n));
      EXPECT_EQ(rc.cinv[size_t(n)], it == want.end() ? -1 : int32_t(it - want.begin())) << "row " << n;
    }
    EXPECT_EQ(rc.cut, want.size() < size_t(N));
    if (!rc.cut) continue;
    ++cuts;
    for (int64_t k = 1; k < K; ++k) {
      for (int64_t i = 0; i < lr.count[size_t(k)]; ++i)
        EXPECT_EQ(rc.crow[size_t(rc.clrow[size_t(k * N + i)])], lr.rows[size_t(k * N + i)]) << "step " << k;
      for (size_t c = 0; c < want.size(); ++c)
        EXPECT_EQ(rc.clslot[size_t(k * N) + c], lr.slot[size_t(k * N + want[c])]) << "step " << k;
    }
    // Step 0 after its attention: its own loss rows and the kept rows, in order.
    std::vector<int32_t> want0;
    for (int64_t n = 0; n < N; ++n)
      if (lr.slot[size_t(n)] >= 0 || std::binary_search(want.begin(), want.end(), int32_t(n)))
        want0.push_back(int32_t(n));
    ASSERT_EQ(rc.crow0, want0) << "trial " << trial;
    EXPECT_EQ(rc.cut0, want0.size() < size_t(N));
    if (!rc.cut0) continue;
    ++cuts0;
    for (int64_t n = 0; n < N; ++n) {
      const auto it = std::find(want0.begin(), want0.end(), int32_t(n));
      EXPECT_EQ(rc.cinv0[size_t(n)], it == want0.end() ? -1 : int32_t(it - want0.begin())) << "row " << n;
    }
    ASSERT_EQ(rc.clrow0.size(), size_t(lr.count[0]));
    for (int64_t i = 0; i < lr.count[0]; ++i) EXPECT_EQ(want0[size_t(rc.clrow0[size_t(i)])], lr.rows[size_t(i)]);
    ASSERT_EQ(rc.clslot0.size(), want0.size());
    ASSERT_EQ(rc.cinv10.size(), want0.size());
    for (size_t c = 0; c < want0.size(); ++c) {
      EXPECT_EQ(rc.clslot0[c], lr.slot[size_t(want0[c])]);
      EXPECT_EQ(rc.cinv10[c], rc.cinv[size_t(want0[c])]);
    }
    ASSERT_EQ(rc.c10.size(), want.size());
    for (size_t c = 0; c < want.size(); ++c) EXPECT_EQ(want0[size_t(rc.c10[c])], want[c]);
  }
  EXPECT_GT(cuts, 10);
  EXPECT_GT(cuts0, 5);
}

TEST(GpuDraftLogitRows, RefusesBadValue) {
  REQUIRE_GPU();
  Case cs(false, 3);
  for (int64_t v : {-1, -3}) {
    ScopedOpt e([&](GpuDraftOptions& o) { o.logit_rows = v; });
    EXPECT_THROW(make_gpu(cs, {0}, GpuMath::BF16, 64), Error) << v;
  }
}

// One bf16 run of cs with each sample's features read from feats (aux, hidden, sample after
// sample) instead of cs's own vectors: the same losses and gradients as `staged`, bit for bit.
void expect_same_bits_from(Case& cs, GpuRun& staged, const std::vector<const float*>& feats) {
  auto gpu = make_gpu(cs, {0}, GpuMath::BF16, 64);
  gpu->set_weights(cs.w);
  std::vector<Sample> batch = cs.batch();
  ASSERT_EQ(feats.size(), 2 * batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    batch[i].aux = feats[2 * i];
    batch[i].hidden = feats[2 * i + 1];
  }
  const auto res = gpu->run(batch, 0.25, true, true);
  ASSERT_EQ(res.size(), staged.loss.size());
  for (size_t i = 0; i < res.size(); ++i) EXPECT_EQ(res[i].loss, staged.loss[i]) << "sample " << i;
  DraftGrads g(cs.w);
  gpu->get_grads(g);
  auto a = g.named(), b = staged.g.named();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(*a[i].second, *b[i].second) << a[i].first;
}

// Features already in device memory (as a caller that makes them on the GPU would pass
// them) are copied device to device: the same bits as through the staging copy.
TEST(GpuDraftResident, DeviceFeaturesGiveTheSameBits) {
  REQUIRE_GPU();
  Case cs(false, 22);
  GpuRun staged = run_once(cs, GpuMath::BF16, 64);
  std::vector<float*> dev;
  for (auto& s : cs.samples)
    for (auto* v : {&s.aux, &s.hid}) {
      float* p = nullptr;
      ASSERT_EQ(cudaMalloc(&p, v->size() * 4), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(p, v->data(), v->size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_TRUE(cuda::is_device_memory(p));
      ASSERT_FALSE(cuda::is_pinned_host(p));
      dev.push_back(p);
    }
  EXPECT_FALSE(cuda::is_device_memory(cs.samples[0].aux.data()));
  expect_same_bits_from(cs, staged, std::vector<const float*>(dev.begin(), dev.end()));
  for (float* p : dev) cudaFree(p);
}

// Features in page-locked memory (as `talon train` keeps them on a GPU) upload straight from
// there, sample by sample, instead of through the trainer's staging copy: the same bits.
TEST(GpuDraftPinned, PinnedFeaturesGiveTheSameBits) {
  REQUIRE_GPU();
  Case cs(true, 21);
  GpuRun staged = run_once(cs, GpuMath::BF16, 64);
  std::vector<std::shared_ptr<float[]>> keep;
  for (auto& s : cs.samples)
    for (auto* v : {&s.aux, &s.hid}) {
      keep.push_back(host_floats(v->size(), true));
      ASSERT_TRUE(cuda::is_pinned_host(keep.back().get()));
      std::copy(v->begin(), v->end(), keep.back().get());
    }
  EXPECT_FALSE(cuda::is_pinned_host(cs.samples[0].aux.data()));
  std::vector<const float*> feats;
  for (auto& p : keep) feats.push_back(p.get());
  expect_same_bits_from(cs, staged, feats);
}

// The bf16 weight copy follows every update: at each step the GPU's loss matches the CPU
// reference evaluated at the GPU's current fp32 master weights, with a learning rate large
// enough to move the loss well past the bf16 tolerance (a stale copy would keep computing
// an earlier step's loss).
TEST_P(GpuDraft, Bf16OperandsFollowWeightUpdates) {
  REQUIRE_GPU();
  Case cs(GetParam(), 5);
  const auto batch = cs.batch();
  train::OptimConfig oc;
  oc.lr = 5e-2;
  oc.warmup_steps = 0;
  oc.clip_norm = 0;
  auto gpu = make_gpu(cs, {0}, GpuMath::BF16, 64);
  gpu->set_weights(cs.w);
  std::vector<double> cpu_losses;
  for (int step = 0; step < 5; ++step) {
    DraftWeights cur;
    gpu->get_weights(cur);
    double cpu_loss = 0;
    for (auto& s : batch) cpu_loss += ttt_forward(cs.c, cur, cs.target(), cs.dv, s, false, nullptr).loss / 4.0;
    double loss = 0;
    for (auto& r : gpu->run(batch, 0.25, true, true)) loss += r.loss / 4.0;
    EXPECT_NEAR(loss, cpu_loss, tol::kGpuTttBf16LossRel * std::max(1.0, cpu_loss)) << "step " << step;
    gpu->adamw_step(oc, step);
    cpu_losses.push_back(cpu_loss);
  }
  EXPECT_GT(std::abs(cpu_losses.back() - cpu_losses.front()),
            5 * tol::kGpuTttBf16LossRel * std::max(1.0, cpu_losses.front()))
      << "the loss hardly moved: the test cannot tell a stale weight copy";
}

TEST_P(GpuDraft, AdamWStepsMatchCpuAndAreDeterministic) {
  REQUIRE_GPU();
  Case cs(GetParam(), 99);
  const auto batch = cs.batch();
  train::OptimConfig oc;
  oc.lr = 1e-3;
  oc.weight_decay = 0.1;
  oc.warmup_steps = 2;
  oc.total_steps = 5;
  oc.clip_norm = 0.05;  // small enough to clip: the clipping path is exercised
  DraftWeights cw = cs.w;
  DraftGrads cg(cw);
  auto params = train::draft_params(cw, cg);
  train::AdamW adam(oc);
  std::vector<std::unique_ptr<GpuDraftTrainer>> gpus;
  for (int r = 0; r < 2; ++r) {
    gpus.push_back(make_gpu(cs, {0}, GpuMath::F32, 40));
    gpus.back()->set_weights(cs.w);
  }
  for (int step = 0; step < 5; ++step) {
    for (auto& p : params) std::fill(p.g->begin(), p.g->end(), 0.0);
    double cpu_loss = 0;
    for (auto& s : batch) cpu_loss += ttt_forward(cs.c, cw, cs.target(), cs.dv, s, false, &cg).loss / 4.0;
    for (auto& p : params)
      for (auto& g : *p.g) g *= 0.25;
    const double cn = train::clip_grad_norm(params, oc.clip_norm);
    adam.step(params);
    for (size_t gi = 0; gi < gpus.size(); ++gi) {
      auto& gpu = gpus[gi];
      // Two micro-batches (budget 40 tokens): gradients accumulate across them. The second
      // trainer runs the last one and the clipping in halves, the update enqueued in between
      // (as `talon train` steps): the same bits as the first, which runs each call whole.
      std::vector<Sample> m1(batch.begin(), batch.begin() + 2), m2(batch.begin() + 2, batch.end());
      double loss = 0, gn = 0;
      for (auto& r : gpu->run(m1, 0.25, true, true)) loss += r.loss / 4.0;
      if (gi == 0) {
        for (auto& r : gpu->run(m2, 0.25, true, false)) loss += r.loss / 4.0;
        gn = gpu->clip_grad_norm(oc.clip_norm);
        gpu->adamw_step(oc, step);
      } else {
        gpu->run_start(m2, 0.25, true, false);
        gpu->clip_grad_norm_start(oc.clip_norm);
        gpu->adamw_step(oc, step);
        const auto r2 = gpu->run_finish();
        ASSERT_EQ(r2.size(), m2.size());
        for (auto& r : r2) loss += r.loss / 4.0;
        gn = gpu->grad_norm();
      }
      EXPECT_NEAR(loss, cpu_loss, tol::kGpuTttLossRel * std::max(1.0, cpu_loss)) << "step " << step;
      EXPECT_NEAR(gn, cn, tol::kGpuTttGradRel * cn) << "step " << step;
    }
  }
  DraftWeights g0, g1;
  gpus[0]->get_weights(g0);
  gpus[1]->get_weights(g1);
  auto a = g0.named(), b = g1.named(), c = cw.named(), init = cs.w.named();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(*a[i].second, *b[i].second) << a[i].first << ": two runs on the same inputs differ";
    double moved = 0;
    size_t off = 0;
    for (size_t j = 0; j < c[i].second->size(); ++j) {
      moved = std::max(moved, double(std::abs((*c[i].second)[j] - (*init[i].second)[j])));
      off += std::abs((*a[i].second)[j] - (*c[i].second)[j]) > 0.01 * oc.lr;
    }
    EXPECT_GT(moved, 1e-4) << c[i].first << " did not train";
    EXPECT_LE(double(off), tol::kGpuTttWeightOffFraction * double(c[i].second->size())) << a[i].first;
  }
  std::vector<std::vector<float>> m, v;
  gpus[0]->get_moments(m, v);
  for (size_t i = 0; i < m.size(); ++i) {
    double d = 0, mx = 0;
    for (size_t j = 0; j < m[i].size(); ++j) {
      d = std::max(d, double(std::abs(m[i][j] - adam.m()[i][j])));
      mx = std::max(mx, double(std::abs(adam.m()[i][j])));
    }
    EXPECT_LE(d, tol::kGpuTttGradRel * mx) << "first moment of tensor " << i;
  }
}

// GpuDraftOptions::fresh_grads: no memset of the whole gradient; each weight matrix's first
// product of a run writes its gradient (beta 0), the rest of G is zeroed as before. Three
// trainers (off, on, on) with the lm_head's gradient in the forward and in the backward: the
// first run's gradients of every tensor agree with the zeroed ones to the order of fp32 sums,
// and then through 6 optimizer steps (one batch, then two micro-batches, the second adding to
// the first) the losses and gradient norms agree; the two trainers with the option give the
// same bits throughout, weights included.
TEST_P(GpuDraft, FreshGradientsMatchZeroedOnes) {
  REQUIRE_GPU();
  Case cs(GetParam(), 103);
  const auto batch = cs.batch();
  train::OptimConfig oc;
  oc.lr = 1e-3;
  oc.weight_decay = 0.1;
  oc.clip_norm = 0.05;
  for (const bool lm_in_backward : {false, true}) {
    SCOPED_TRACE(fmt::format("lm_head gradient in the {}", lm_in_backward ? "backward" : "forward"));
    std::vector<std::unique_ptr<GpuDraftTrainer>> gpus;
    for (const bool fresh : {false, true, true}) {
      ScopedOpt o([&](GpuDraftOptions& e) {
        e.fresh_grads = fresh;
        e.lm_grad_in_backward = lm_in_backward;
      });
      gpus.push_back(make_gpu(cs, {0}, GpuMath::BF16, 64));
      gpus.back()->set_weights(cs.w);
    }
    for (int step = 0; step < 6; ++step) {
      std::vector<double> loss[3], norm(3);
      for (int r = 0; r < 3; ++r) {
        auto& gpu = gpus[size_t(r)];
        if (step < 3) {
          for (auto& x : gpu->run(batch, 0.25, true, true)) loss[r].push_back(x.loss);
        } else {
          std::vector<Sample> m1(batch.begin(), batch.begin() + 2), m2(batch.begin() + 2, batch.end());
          for (auto& x : gpu->run(m1, 0.25, true, true)) loss[r].push_back(x.loss);
          for (auto& x : gpu->run(m2, 0.25, true, false)) loss[r].push_back(x.loss);
        }
        if (step == 0 && r == 2) {  // the first run's gradients, before any clipping
          DraftGrads g0(cs.w), g1(cs.w), g2(cs.w);
          gpus[0]->get_grads(g0);
          gpus[1]->get_grads(g1);
          gpus[2]->get_grads(g2);
          auto a = g0.named(), b = g1.named(), c = g2.named();
          for (size_t i = 0; i < a.size(); ++i) {
            double mx = 0;
            for (double x : *a[i].second) mx = std::max(mx, std::abs(x));
            EXPECT_GT(mx, 0.0) << a[i].first << ": no gradient to compare";
            EXPECT_LE(rel_max_diff(*b[i].second, *a[i].second), 1e-4) << a[i].first;
            EXPECT_EQ(*b[i].second, *c[i].second) << a[i].first << ": the two fresh trainers differ";
          }
        }
      }
      for (int r = 0; r < 3; ++r) norm[size_t(r)] = gpus[size_t(r)]->clip_grad_norm(oc.clip_norm);
      for (auto& gpu : gpus) gpu->adamw_step(oc, step);
      ASSERT_EQ(loss[0].size(), loss[1].size());
      for (size_t i = 0; i < loss[0].size(); ++i)
        EXPECT_NEAR(loss[1][i], loss[0][i], 1e-4 * std::max(1.0, std::abs(loss[0][i]))) << "step " << step;
      EXPECT_NEAR(norm[1], norm[0], 1e-3 * norm[0]) << "step " << step;
      EXPECT_EQ(loss[1], loss[2]) << "step " << step << ": the two fresh trainers' losses differ";
      EXPECT_EQ(norm[1], norm[2]) << "step " << step;
    }
    DraftWeights w1, w2;
    gpus[1]->get_weights(w1);
    gpus[2]->get_weights(w2);
    auto a = w1.named(), b = w2.named(), init = cs.w.named();
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(*a[i].second, *b[i].second) << a[i].first << ": the two fresh trainers differ";
      EXPECT_NE(*a[i].second, *init[i].second) << a[i].first << " did not train";
    }
  }
}

// The trainers' own kernels launched as programmatic dependents (kDependTrain in
// TALON_CUDA_PDL: each may start while the kernel before it ends, and waits for it before it
// touches memory) compute the same bits as ordinary launches: two trainers, one launching each
// way, through four optimizer steps (forward, backward, gradient norm, AdamW), with the fused
// kernels and with cuDNN's attention; losses, gradient norms and the weights are equal. A kernel
// that read its predecessor's output before waiting would show up here as differing bits.
TEST_P(GpuDraft, DependentLaunchesKeepTheBits) {
  REQUIRE_GPU();
  struct Restore {
    ~Restore() { talon::cuda::set_dependent_launches(talon::cuda::kDependDefault); }
  } restore;
  std::vector<std::string> routes = {"flash"};
  if (talon::cuda::cudnn_sdpa_available(nullptr)) routes.push_back("cudnn");
  train::OptimConfig oc;
  oc.lr = 1e-3;
  oc.weight_decay = 0.1;
  oc.clip_norm = 0.05;
  for (const std::string& route : routes) {
    SCOPED_TRACE(route);
    Case cs(GetParam(), 107, {150, 64, 7, 90}, 128);
    const auto batch = cs.batch();
    ScopedOpt att([&](GpuDraftOptions& o) { o.attention = route; });
    std::unique_ptr<GpuDraftTrainer> gpus[2] = {make_gpu(cs, {0}, GpuMath::BF16, 311),
                                                make_gpu(cs, {0}, GpuMath::BF16, 311)};
    const unsigned masks[2] = {talon::cuda::kDependDefault & ~talon::cuda::kDependTrain,
                               talon::cuda::kDependDefault | talon::cuda::kDependTrain};
    for (auto& g : gpus) g->set_weights(cs.w);
    for (int step = 0; step < 4; ++step) {
      std::vector<double> loss[2];
      double norm[2] = {0, 0};
      for (int r = 0; r < 2; ++r) {
        talon::cuda::set_dependent_launches(masks[r]);
        for (auto& x : gpus[r]->run(batch, 0.25, true, true)) loss[r].push_back(x.loss);
        norm[r] = gpus[r]->clip_grad_norm(oc.clip_norm);
        gpus[r]->adamw_step(oc, step);
      }
      EXPECT_EQ(loss[0], loss[1]) << "step " << step;
      EXPECT_EQ(norm[0], norm[1]) << "step " << step;
      EXPECT_GT(norm[0], 0.0);
    }
    talon::cuda::set_dependent_launches(talon::cuda::kDependDefault);
    DraftWeights w0, w1;
    gpus[0]->get_weights(w0);
    gpus[1]->get_weights(w1);
    auto a = w0.named(), b = w1.named(), init = cs.w.named();
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(*a[i].second, *b[i].second) << a[i].first;
      EXPECT_NE(*a[i].second, *init[i].second) << a[i].first << " did not train";
    }
  }
}

// The engine's contract beside the trainer's (which calls prepare() and run() back to back):
// prepare() queues step 0's fc product early, and weights set between prepare() and run() are
// the ones run() uses, that product made again. The forward's statistics say which fc ran.
TEST(GpuDraftEngine, WeightsSetBetweenPrepareAndRunAreTheOnesUsed) {
  REQUIRE_GPU();
  Case cs(false, 41);
  cs.favour_draft_vocab(0.2f);
  const DraftConfig& c = cs.c;
  cuda::DraftDims d;
  d.H = c.H, d.I = c.I, d.nh = c.n_heads, d.nkv = c.n_kv_heads, d.hd = c.head_dim, d.V = c.V, d.Vd = c.Vd;
  d.eps = float(c.rms_eps), d.K = c.ttt_steps, d.norm_before_residual = c.norm_before_residual;
  const std::vector<float> inv = rope_inv_freq(c.rope, c.head_dim);
  std::vector<int32_t> ids, pos, len;
  std::vector<uint8_t> mask;
  std::vector<float> aux, hid;
  for (const auto& smp : cs.samples) {
    const int32_t T = int32_t(smp.ids.size());
    for (int32_t t = 0; t < T; ++t) pos.push_back(t), len.push_back(T);
    ids.insert(ids.end(), smp.ids.begin(), smp.ids.end());
    mask.insert(mask.end(), smp.mask.begin(), smp.mask.end());
    aux.insert(aux.end(), smp.aux.begin(), smp.aux.end());
    hid.insert(hid.end(), smp.hid.begin(), smp.hid.end());
  }
  cuda::DraftBatch b;
  b.N = int64_t(ids.size()), b.ids = ids.data(), b.mask = mask.data(), b.aux = aux.data(), b.hidden = hid.data();
  b.pos = pos.data(), b.len = len.data();
  DraftWeights w2 = cs.w;
  for (auto& x : w2.fc) x *= -0.7f;  // another step-0 input for every row
  const auto ptrs = [](DraftWeights& w) {
    std::vector<const float*> p;
    for (auto& nv : w.named()) p.push_back(nv.second->data());
    return p;
  };
  // first: weights before prepare(); then: weights set after it (none when null).
  const auto forward = [&](DraftWeights& first, DraftWeights* then) {
    cuda::DraftEngine e(0, d, cuda::DraftMath::F32, cs.embed.data(), cs.fnorm.data(), cs.head.data(),
                        cs.dv.kept.data(), cs.dv.t2d.data(), inv.data(), b.N);
    e.set_weights(ptrs(first));
    e.prepare(b);
    if (then) e.set_weights(ptrs(*then));
    cuda::DraftRowStats st;
    e.run({}, false, false, st);
    return st;
  };
  const cuda::DraftRowStats switched = forward(cs.w, &w2), only2 = forward(w2, nullptr), only1 = forward(cs.w, nullptr);
  ASSERT_EQ(switched.counts, only2.counts);
  ASSERT_GT(std::count(only2.counts.begin(), only2.counts.end(), uint8_t(1)), 10);
  EXPECT_EQ(switched.ce, only2.ce) << "run() used the fc product prepare() made with the old weights";
  EXPECT_NE(only1.ce, only2.ce) << "the two fc weights give the same losses: the test cannot tell them apart";
}

TEST(GpuDraftBudget, RefusesBatchOverBudget) {
  REQUIRE_GPU();
  Case cs(false, 7);
  auto gpu = make_gpu(cs, {0}, GpuMath::F32, 16);
  gpu->set_weights(cs.w);
  EXPECT_THROW(gpu->run(cs.batch(), 1.0, true, true), Error);
}

// Data parallel over 2 GPUs against one GPU: per-sample results in batch order, the
// same losses and gradient norms at every step, weights that track; two runs identical.
TEST(GpuDraftDataParallel, TwoGpusMatchOneAndAreDeterministic) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) GTEST_SKIP() << "needs 2 GPUs, found " << n;
  Case cs(false, 321);
  const auto batch = cs.batch();  // 4 samples: 2 per GPU
  train::OptimConfig oc;
  oc.lr = 1e-3;
  oc.total_steps = 3;
  auto one = make_gpu(cs, {0}, GpuMath::F32, 64);
  auto dp1 = make_gpu(cs, {0, 1}, GpuMath::F32, 64);
  auto dp2 = make_gpu(cs, {1, 0}, GpuMath::F32, 64);
  for (auto* t : {one.get(), dp1.get(), dp2.get()}) t->set_weights(cs.w);
  for (int step = 0; step < 3; ++step) {
    const auto r1 = one->run(batch, 0.25, true, true);
    const auto ra = dp1->run(batch, 0.25, true, true);
    const auto rb = dp2->run(batch, 0.25, true, true);
    ASSERT_EQ(ra.size(), r1.size());
    for (size_t i = 0; i < r1.size(); ++i) {
      EXPECT_EQ(ra[i].n_k, r1[i].n_k) << "sample " << i << " came back out of order";
      EXPECT_NEAR(ra[i].loss, r1[i].loss, tol::kGpuTttLossRel * std::max(1.0, r1[i].loss)) << "step " << step;
      EXPECT_EQ(ra[i].loss, rb[i].loss) << "step " << step << ": two data-parallel runs differ";
    }
    const double g1 = one->clip_grad_norm(0.5), ga = dp1->clip_grad_norm(0.5);
    for (auto* t : {one.get(), dp1.get()}) t->adamw_step(oc, step);
    // The third in halves, its update enqueued before its results are read: the same bits.
    dp2->run_start(batch, 0.25, true, true);
    dp2->clip_grad_norm_start(0.5);
    dp2->adamw_step(oc, step);
    const auto rh = dp2->run_finish();
    const double gb = dp2->grad_norm();
    ASSERT_EQ(rh.size(), rb.size());
    for (size_t i = 0; i < rb.size(); ++i) EXPECT_EQ(rh[i].loss, rb[i].loss) << "sample " << i << ", step " << step;
    EXPECT_NEAR(ga, g1, tol::kGpuTttGradRel * g1) << "step " << step;
    EXPECT_EQ(ga, gb);
  }
  DraftWeights w1, wa, wb;
  one->get_weights(w1);
  dp1->get_weights(wa);
  dp2->get_weights(wb);
  auto a = wa.named(), b = wb.named(), c = w1.named();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(*a[i].second, *b[i].second) << a[i].first;
    size_t off = 0;
    for (size_t j = 0; j < a[i].second->size(); ++j) off += std::abs((*a[i].second)[j] - (*c[i].second)[j]) > 0.01 * oc.lr;
    EXPECT_LE(double(off), tol::kGpuTttWeightOffFraction * double(a[i].second->size())) << a[i].first;
  }
}

// After the same optimizer steps on two GPU trainers (g0, g1) and on the CPU family (cpu_w,
// AdamW `adam` over `params`), for tensors `names` that started as init_w: the two GPUs agree
// to the bit; each trained tensor moved on the CPU and tracks it on the GPU; the frozen
// lm_head is unchanged; g0's moments track AdamW's and come back unchanged through `fresh`'s
// set_moments (a resume).
void expect_steps_track_cpu(const std::vector<std::string>& names, GpuDraftTrainer& g0, GpuDraftTrainer& g1,
                            const std::vector<const std::vector<float>*>& cpu_w,
                            const std::vector<const std::vector<float>*>& init_w,
                            const std::vector<train::Param>& params, train::AdamW& adam, double lr,
                            GpuDraftTrainer& fresh) {
  std::vector<std::vector<float>> a(names.size()), b(names.size());
  GpuDraftTrainer::NamedOut oa, ob;
  for (size_t i = 0; i < names.size(); ++i) {
    oa.emplace_back(names[i], &a[i]);
    ob.emplace_back(names[i], &b[i]);
  }
  g0.get_tensors(oa);
  g1.get_tensors(ob);
  for (size_t i = 0; i < names.size(); ++i) {
    EXPECT_EQ(a[i], b[i]) << names[i] << ": two runs on the same inputs differ";
    if (names[i] == "lm_head") {
      EXPECT_EQ(a[i], *init_w[i]) << "the frozen lm_head moved";
      continue;
    }
    double moved = 0;
    size_t off = 0;
    for (size_t j = 0; j < a[i].size(); ++j) {
      moved = std::max(moved, double(std::abs((*cpu_w[i])[j] - (*init_w[i])[j])));
      off += std::abs(a[i][j] - (*cpu_w[i])[j]) > 0.01 * lr;
    }
    EXPECT_GT(moved, 1e-4) << names[i] << " did not train";
    EXPECT_LE(double(off), tol::kGpuTttWeightOffFraction * double(a[i].size())) << names[i];
  }
  std::vector<std::vector<float>> m, v;
  g0.get_moments(m, v);
  ASSERT_EQ(m.size(), params.size());
  for (size_t i = 0; i < m.size(); ++i) {
    double d = 0, mx = 0;
    for (size_t j = 0; j < m[i].size(); ++j) {
      d = std::max(d, double(std::abs(m[i][j] - adam.m()[i][j])));
      mx = std::max(mx, double(std::abs(adam.m()[i][j])));
    }
    EXPECT_LE(d, tol::kGpuTttGradRel * mx) << "first moment of " << params[i].name;
  }
  fresh.set_moments(m, v);
  std::vector<std::vector<float>> m2, v2;
  fresh.get_moments(m2, v2);
  EXPECT_EQ(m2, m);
  EXPECT_EQ(v2, v);
}

// ---- P-EAGLE on the GPU against peagle::forward (the fp64 reference, itself checked against
// speculators' PEagleDraftModel): the EAGLE-3 layer of Case plus a trained embedding and
// mask_hidden, COD-sampled elements from per-sample seeds (all chains when evaluating).
struct PeCase {
  Case cs;
  peagle::Weights w;
  int32_t mask_token;
  peagle::CodOptions cod;
  PeCase(bool nbr, uint32_t seed, std::vector<int> lengths) : cs(nbr, seed, std::move(lengths)) {
    std::mt19937 rng(seed + 1);
    std::normal_distribution<float> nd(0.f, 1.f);
    w.layer = cs.w;
    w.embed = cs.embed;
    w.mask_hidden.resize(size_t(3 * cs.c.H));
    for (auto& x : w.mask_hidden) x = nd(rng);
    mask_token = int32_t(cs.c.V - 1);
    cod = {cs.c.ttt_steps, 0.7, 0.2};
  }
  GpuFamily family() const {
    GpuFamily f;
    f.drafter = "peagle";
    f.mask_token = mask_token;
    f.cod = cod;
    return f;
  }
  GpuDraftTrainer::Named named() {
    GpuDraftTrainer::Named n;
    for (auto& [name, v] : w.layer.named()) n.emplace_back(name, v);
    n.emplace_back("mask_hidden", &w.mask_hidden);
    n.emplace_back("embed", &w.embed);
    return n;
  }
  // The trainable tensors and their gradients, as the CPU family's params() lists them.
  static std::vector<train::Param> params(peagle::Weights& w, peagle::Grads& g) {
    std::vector<train::Param> ps = train::draft_params(w.layer, g.layer);
    std::erase_if(ps, [](const train::Param& p) { return std::string(p.name) == "lm_head"; });
    ps.push_back({"mask_hidden", &w.mask_hidden, &g.mask_hidden, false});
    ps.push_back({"embed", &w.embed, &g.embed, true});
    return ps;
  }
  std::vector<uint64_t> seeds(uint64_t base) const {
    std::vector<uint64_t> v;
    for (size_t i = 0; i < cs.samples.size(); ++i) v.push_back(base * 1000003ull + i);
    return v;
  }
  peagle::CodSample elements(const Sample& s, bool train, uint64_t seed) const {
    std::vector<uint8_t> valid(size_t(std::max<int64_t>(s.T - 1, 0)));
    for (int64_t t = 0; t + 1 < s.T; ++t) valid[size_t(t)] = s.mask[t + 1];
    return train ? peagle::cod_sample(valid, cod, seed) : peagle::all_chains(valid, cs.c.ttt_steps);
  }
  // CPU reference of one call: per-sample results; with train, gradients (x weight) into g.
  std::vector<TttResult> cpu(const peagle::Weights& ww, const std::vector<Sample>& batch, bool train,
                             const std::vector<uint64_t>& sd, double weight, peagle::Grads* g) const {
    std::vector<TttResult> out;
    peagle::Grads mine(ww);
    for (size_t i = 0; i < batch.size(); ++i) {
      const peagle::CodSample e = elements(batch[i], train, train ? sd[i] : 0);
      const peagle::Result r =
          peagle::forward(cs.c, ww, cs.target(), cs.dv, batch[i], e, mask_token, train ? &mine : nullptr);
      out.push_back(peagle::ttt_view(e, r, cs.c.ttt_steps));
    }
    if (g) {
      auto add = [weight](std::vector<double>& d, const std::vector<double>& s) {
        for (size_t k = 0; k < d.size(); ++k) d[k] += weight * s[k];
      };
      auto a = g->layer.named(), b = mine.layer.named();
      for (size_t i = 0; i < a.size(); ++i) add(*a[i].second, *b[i].second);
      add(g->mask_hidden, mine.mask_hidden);
      add(g->embed, mine.embed);
    }
    return out;
  }
};

std::unique_ptr<GpuDraftTrainer> make_pe(PeCase& pc, const std::vector<int>& devices, GpuMath math,
                                         int64_t max_rows) {
  auto t = make_gpu_draft_trainer(pc.cs.c, pc.cs.target(), pc.cs.dv, devices, math, max_rows, {}, eng_for(math),
                                  pc.family());
  t->set_tensors(pc.named());
  return t;
}

std::vector<double> as_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

void check_peagle_against_cpu(PeCase& pc, GpuMath math, bool train, double loss_tol, double grad_tol,
                              int64_t max_rows = 96) {
  const auto batch = pc.cs.batch();
  const double weight = 1.0 / double(batch.size());
  const auto seeds = pc.seeds(7);
  peagle::Grads cg(pc.w);
  const auto cpu = pc.cpu(pc.w, batch, train, seeds, weight, train ? &cg : nullptr);
  auto gpu = make_pe(pc, {0}, math, max_rows);
  const auto res = gpu->run(batch, weight, train, true, train ? seeds : std::vector<uint64_t>{});
  ASSERT_EQ(res.size(), cpu.size());
  int64_t deep = 0;
  for (size_t i = 0; i < res.size(); ++i) {
    ASSERT_EQ(res[i].n_k, cpu[i].n_k) << "sample " << i;
    for (size_t k = 1; k < cpu[i].n_k.size(); ++k) deep += cpu[i].n_k[k];
    EXPECT_NEAR(res[i].loss, cpu[i].loss, loss_tol * std::max(1.0, std::abs(cpu[i].loss))) << "sample " << i;
    for (size_t k = 0; k < cpu[i].loss_k.size(); ++k)
      EXPECT_NEAR(res[i].loss_k[k], cpu[i].loss_k[k], loss_tol * std::max(1.0, cpu[i].loss_k[k])) << i << " depth " << k;
    if (math == GpuMath::F32) {
      EXPECT_EQ(res[i].acc_k, cpu[i].acc_k) << "sample " << i;
      EXPECT_EQ(res[i].cond_acc_k, cpu[i].cond_acc_k) << "sample " << i;
    }
  }
  EXPECT_GT(deep, 10) << "too few elements past depth 0 for the test to mean much";
  if (!train) return;
  std::vector<std::vector<float>> got(16);
  GpuDraftTrainer::NamedOut out;
  std::vector<std::string> names;
  for (auto& [name, v] : pc.w.layer.named()) names.push_back(name);
  names.insert(names.end(), {"mask_hidden", "embed"});
  for (size_t i = 0; i < names.size(); ++i) out.emplace_back(names[i], &got[i]);
  gpu->get_tensor_grads(out);
  std::vector<const std::vector<double>*> want;
  for (auto& [name, v] : cg.layer.named()) want.push_back(v);
  want.push_back(&cg.mask_hidden);
  want.push_back(&cg.embed);
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i] == "lm_head") {  // frozen: never formed
      EXPECT_TRUE(std::all_of(got[i].begin(), got[i].end(), [](float x) { return x == 0.f; })) << "lm_head gradient";
      continue;
    }
    double mb = 0;
    for (double x : *want[i]) mb = std::max(mb, std::abs(x));
    EXPECT_GT(mb, 0.0) << names[i] << ": the reference gradient is zero";
    ASSERT_EQ(got[i].size(), want[i]->size()) << names[i];
    EXPECT_LE(rel_max_diff(as_double(got[i]), *want[i]), grad_tol) << names[i];
  }
}

TEST_P(GpuDraft, PEagleMatchesCpuReference) {
  REQUIRE_GPU();
  PeCase pc(GetParam(), 4242, {30, 7, 22, 2, 17});
  pc.cs.favour_draft_vocab(0.3f);
  for (auto& m : pc.cs.samples[1].mask) m = 0;  // a prompt only: no element counts
  check_peagle_against_cpu(pc, GpuMath::F32, true, tol::kGpuTttLossRel, tol::kGpuTttGradRel);
  check_peagle_against_cpu(pc, GpuMath::F32, false, tol::kGpuTttLossRel, tol::kGpuTttGradRel);
  {
    ScopedOpt f([](GpuDraftOptions& o) { o.lm_grad_in_backward = true; });
    check_peagle_against_cpu(pc, GpuMath::F32, true, tol::kGpuTttLossRel, tol::kGpuTttGradRel);
  }
  {
    ScopedOpt e([](GpuDraftOptions& o) { o.logit_rows = 5; });
    check_peagle_against_cpu(pc, GpuMath::F32, true, tol::kGpuTttLossRel, tol::kGpuTttGradRel);
  }
  check_peagle_against_cpu(pc, GpuMath::BF16, true, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel);
  check_peagle_against_cpu(pc, GpuMath::BF16, false, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel);
  {  // steps after the first on the rows a later element reads only (the prompt-only sample's are out)
    ScopedOpt cut([](GpuDraftOptions& o) { o.row_cut = true; });
    check_peagle_against_cpu(pc, GpuMath::F32, true, tol::kGpuTttLossRel, tol::kGpuTttGradRel);
    check_peagle_against_cpu(pc, GpuMath::BF16, true, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel);
  }
}

// A P-EAGLE batch without its seeds, a mask token outside the vocabulary and a drafter
// without a GPU trainer are refused.
TEST(GpuDraftPEagle, RefusesBadSetups) {
  REQUIRE_GPU();
  PeCase pc(false, 5, {9, 6});
  auto gpu = make_pe(pc, {0}, GpuMath::F32, 32);
  EXPECT_THROW(gpu->run(pc.cs.batch(), 0.5, true, true), Error);
  GpuFamily bad = pc.family();
  bad.mask_token = int32_t(pc.cs.c.V);
  EXPECT_THROW(
      make_gpu_draft_trainer(pc.cs.c, pc.cs.target(), pc.cs.dv, {0}, GpuMath::F32, 32, {}, eng_for(GpuMath::F32), bad),
      Error);
  GpuFamily df = pc.family();
  df.drafter = "dflash";
  EXPECT_THROW(
      make_gpu_draft_trainer(pc.cs.c, pc.cs.target(), pc.cs.dv, {0}, GpuMath::F32, 32, {}, eng_for(GpuMath::F32), df),
      Error);
}

// Optimizer steps (two micro-batches a step, clipping on, weight decay on the embedding and
// not on mask_hidden) against the CPU family's AdamW; the frozen lm_head stays bit for bit;
// two GPU runs are identical.
TEST_P(GpuDraft, PEagleAdamWStepsMatchCpuAndAreDeterministic) {
  REQUIRE_GPU();
  PeCase pc(GetParam(), 616, {13, 7, 22, 9});
  const auto batch = pc.cs.batch();
  train::OptimConfig oc;
  oc.lr = 1e-3;
  oc.weight_decay = 0.1;
  oc.warmup_steps = 2;
  oc.total_steps = 4;
  oc.clip_norm = 0.05;
  peagle::Weights cw = pc.w;
  peagle::Grads cg(cw);
  auto params = PeCase::params(cw, cg);
  train::AdamW adam(oc);
  std::vector<std::unique_ptr<GpuDraftTrainer>> gpus;
  for (int r = 0; r < 2; ++r) gpus.push_back(make_pe(pc, {0}, GpuMath::F32, 40));
  std::vector<std::string> want;
  for (auto& p : params) want.push_back(p.name);
  EXPECT_EQ(gpus[0]->trainable(), want);
  for (int step = 0; step < 4; ++step) {
    const auto seeds = pc.seeds(uint64_t(step) + 1);
    for (auto& p : params) std::fill(p.g->begin(), p.g->end(), 0.0);
    double cpu_loss = 0;
    for (auto& r : pc.cpu(cw, batch, true, seeds, 0.25, &cg)) cpu_loss += r.loss / 4.0;
    const double cn = train::clip_grad_norm(params, oc.clip_norm);
    adam.step(params);
    for (auto& gpu : gpus) {
      std::vector<Sample> m1(batch.begin(), batch.begin() + 2), m2(batch.begin() + 2, batch.end());
      std::vector<uint64_t> s1(seeds.begin(), seeds.begin() + 2), s2(seeds.begin() + 2, seeds.end());
      double loss = 0;
      for (auto& r : gpu->run(m1, 0.25, true, true, s1)) loss += r.loss / 4.0;
      for (auto& r : gpu->run(m2, 0.25, true, false, s2)) loss += r.loss / 4.0;
      EXPECT_NEAR(loss, cpu_loss, tol::kGpuTttLossRel * std::max(1.0, cpu_loss)) << "step " << step;
      const double gn = gpu->clip_grad_norm(oc.clip_norm);
      EXPECT_NEAR(gn, cn, tol::kGpuTttGradRel * cn) << "step " << step;
      gpu->adamw_step(oc, step);
    }
  }
  std::vector<std::string> names;
  for (auto& [name, v] : pc.w.layer.named()) names.push_back(name);
  names.insert(names.end(), {"mask_hidden", "embed"});
  std::vector<const std::vector<float>*> cpu_w, init_w;
  for (auto& [name, v] : cw.layer.named()) cpu_w.push_back(v);
  cpu_w.insert(cpu_w.end(), {&cw.mask_hidden, &cw.embed});
  for (auto& [name, v] : pc.w.layer.named()) init_w.push_back(v);
  init_w.insert(init_w.end(), {&pc.w.mask_hidden, &pc.w.embed});
  auto fresh = make_pe(pc, {0}, GpuMath::F32, 40);
  expect_steps_track_cpu(names, *gpus[0], *gpus[1], cpu_w, init_w, params, adam, oc.lr, *fresh);
}

// ---- DFlash on the GPU against dflash::forward (the fp64 reference, itself checked against
// speculators' DFlashDraftModel): packed samples of different lengths, GQA, two layers, blocks
// of 4; KL with fixed-exp-decay and cross-entropy with D-PACE; anchors drawn from per-sample
// seeds when training, every candidate when evaluating.
struct DfCase {
  dflash::Config c;
  dflash::Weights w;
  DraftVocab dv;
  std::vector<float> embed, fnorm, head;
  std::vector<Case::S> samples;
  int32_t mask_token;
  int64_t max_anchors = 5;
  DfCase(uint32_t seed, std::vector<int> lengths, bool ce_dpace, int64_t layers = 2, int64_t block = 4) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    c.H = 64, c.I = 96, c.n_heads = 4, c.n_kv_heads = 2, c.head_dim = 16, c.V = 211, c.Vd = 60;
    c.rms_eps = 1e-6;
    c.rope.theta = 10000;
    c.layers = layers, c.n_aux = 3, c.block = block;
    c.loss = ce_dpace ? dflash::Config::Loss::CE : dflash::Config::Loss::KL;
    c.weighting = ce_dpace ? dflash::Config::Weighting::DPace : dflash::Config::Weighting::ExpDecay;
    c.gamma = 2.5;
    c.dpace_alpha = 0.3;
    auto fill = [&](std::vector<float>& v, size_t n, float sd) {
      v.resize(n);
      for (auto& x : v) x = sd * nd(rng);
    };
    auto norm_w = [&](std::vector<float>& v, size_t n) {
      v.resize(n);
      for (auto& x : v) x = 1.f + 0.1f * nd(rng);
    };
    const size_t H = size_t(c.H), qd = size_t(c.n_heads * c.head_dim), kvd = size_t(c.n_kv_heads * c.head_dim);
    fill(w.fc, H * 3 * H, 0.08f);
    norm_w(w.hidden_norm, H);
    w.layers.resize(size_t(layers));
    for (auto& L : w.layers) {
      norm_w(L.in_ln, H);
      fill(L.wq, qd * H, 0.15f);
      fill(L.wk, kvd * H, 0.15f);
      fill(L.wv, kvd * H, 0.15f);
      norm_w(L.q_norm, size_t(c.head_dim));
      norm_w(L.k_norm, size_t(c.head_dim));
      fill(L.wo, H * qd, 0.1f);
      norm_w(L.post_ln, H);
      fill(L.gate, size_t(c.I) * H, 0.1f);
      fill(L.up, size_t(c.I) * H, 0.1f);
      fill(L.down, H * size_t(c.I), 0.1f);
    }
    norm_w(w.norm, H);
    fill(embed, size_t(c.V) * H, 1.f);
    fill(head, size_t(c.V) * H, 0.3f);
    norm_w(fnorm, H);
    std::vector<int64_t> counts(size_t(c.V), 0);
    for (int T : lengths) {
      Case::S sm;
      for (int t = 0; t < T; ++t) {
        sm.ids.push_back(int32_t(rng() % uint32_t(c.V - 1)));
        sm.mask.push_back(uint8_t(rng() % 5 != 0));
        if (sm.mask.back()) counts[size_t(sm.ids.back())]++;
      }
      fill(sm.aux, size_t(T) * 3 * H, 1.f);
      fill(sm.hid, size_t(T) * H, 1.f);
      samples.push_back(std::move(sm));
    }
    dv = build_draft_vocab(counts, c.Vd);
    w.lm_head.resize(size_t(c.Vd) * H);
    for (int64_t d = 0; d < c.Vd; ++d)
      std::copy(head.begin() + dv.kept[size_t(d)] * int64_t(H), head.begin() + (dv.kept[size_t(d)] + 1) * int64_t(H),
                w.lm_head.begin() + d * int64_t(H));
    mask_token = int32_t(c.V - 1);
  }
  TargetHead target() const { return {embed.data(), fnorm.data(), head.data(), 1e-5}; }
  std::vector<Sample> batch() const {
    std::vector<Sample> b;
    for (auto& sm : samples)
      b.push_back({sm.ids.data(), sm.mask.data(), sm.aux.data(), sm.hid.data(), int64_t(sm.ids.size())});
    return b;
  }
  GpuFamily family() const {
    GpuFamily f;
    f.drafter = "dflash";
    f.mask_token = mask_token;
    f.dflash = c;
    f.max_anchors = max_anchors;
    return f;
  }
  // The family's tensor names, the weights and a gradient's vectors in that order.
  std::vector<std::string> names() const {
    std::vector<std::string> n = {"fc", "hidden_norm"};
    for (int64_t l = 0; l < c.layers; ++l) {
      dflash::Layer probe;
      for (auto& [t, v] : probe.named()) n.push_back(fmt::format("layers.{}.{}", l, t));
    }
    n.insert(n.end(), {"norm", "lm_head"});
    return n;
  }
  std::vector<std::vector<float>*> tensors(dflash::Weights& x) const {
    std::vector<std::vector<float>*> t = {&x.fc, &x.hidden_norm};
    for (auto& L : x.layers)
      for (auto& [n, v] : L.named()) t.push_back(v);
    t.insert(t.end(), {&x.norm, &x.lm_head});
    return t;
  }
  static std::vector<std::vector<double>*> grads(dflash::Grads& g) {
    std::vector<std::vector<double>*> t = {&g.fc, &g.hidden_norm};
    for (auto& L : g.layers)
      for (auto& [n, v] : L.named()) t.push_back(v);
    t.push_back(&g.norm);
    return t;
  }
  GpuDraftTrainer::Named named() {
    GpuDraftTrainer::Named out;
    const auto n = names();
    const auto t = tensors(w);
    for (size_t i = 0; i < n.size(); ++i) out.emplace_back(n[i], t[i]);
    return out;
  }
  std::vector<uint64_t> seeds(uint64_t base) const {
    std::vector<uint64_t> v;
    for (size_t i = 0; i < samples.size(); ++i) v.push_back(base * 7919ull + i);
    return v;
  }
  // The CPU reference of one call, as the trainer's DFlash family reports it; with train,
  // weight * the gradients into g.
  std::vector<TttResult> cpu(const dflash::Weights& ww, const std::vector<Sample>& batch, bool train,
                             const std::vector<uint64_t>& sd, double weight, dflash::Grads* g) const {
    std::vector<TttResult> out;
    dflash::Weights wc = ww;
    dflash::Grads mine(wc);
    for (size_t i = 0; i < batch.size(); ++i) {
      const auto anchors = dflash::select_anchors(batch[i].mask, batch[i].T, c.block, train ? max_anchors : batch[i].T,
                                                  train ? sd[i] : 0);
      const dflash::Result r =
          anchors.empty() ? dflash::Result{}
                          : dflash::forward(c, ww, target(), dv, batch[i], anchors, mask_token, train ? &mine : nullptr);
      out.push_back(dflash::ttt_view(r, c.block));
    }
    if (g) {
      auto a = grads(*g), b = grads(mine);
      for (size_t q = 0; q < a.size(); ++q)
        for (size_t k = 0; k < a[q]->size(); ++k) (*a[q])[k] += weight * (*b[q])[k];
    }
    return out;
  }
};

std::unique_ptr<GpuDraftTrainer> make_df(DfCase& dc, const std::vector<int>& devices, GpuMath math, int64_t max_rows) {
  auto t = make_gpu_draft_trainer(eagle3::DraftConfig{}, dc.target(), dc.dv, devices, math, max_rows, {}, eng_for(math),
                                  dc.family());
  t->set_tensors(dc.named());
  return t;
}

void check_dflash_against_cpu(DfCase& dc, GpuMath math, bool train, double loss_tol, double grad_tol,
                              int64_t max_rows) {
  const auto batch = dc.batch();
  const double weight = 1.0 / double(batch.size());
  const auto seeds = dc.seeds(3);
  dflash::Grads cg(dc.w);
  const auto cpu = dc.cpu(dc.w, batch, train, seeds, weight, train ? &cg : nullptr);
  auto gpu = make_df(dc, {0}, math, max_rows);
  const auto res = gpu->run(batch, weight, train, true, train ? seeds : std::vector<uint64_t>{});
  ASSERT_EQ(res.size(), cpu.size());
  int64_t counted = 0;
  for (size_t i = 0; i < res.size(); ++i) {
    ASSERT_EQ(res[i].n_k, cpu[i].n_k) << "sample " << i;
    for (auto n : cpu[i].n_k) counted += n;
    EXPECT_NEAR(res[i].loss, cpu[i].loss, loss_tol * std::max(1.0, std::abs(cpu[i].loss))) << "sample " << i;
    for (size_t k = 0; k < cpu[i].loss_k.size(); ++k)
      EXPECT_NEAR(res[i].loss_k[k], cpu[i].loss_k[k], loss_tol * std::max(1.0, cpu[i].loss_k[k])) << i << " slot " << k;
    if (math == GpuMath::F32) {
      EXPECT_EQ(res[i].acc_k, cpu[i].acc_k) << "sample " << i;
      EXPECT_EQ(res[i].cond_acc_k, cpu[i].cond_acc_k) << "sample " << i;
    }
  }
  EXPECT_GT(counted, 20) << "too few slots count for the test to mean much";
  if (!train) return;
  const auto names = dc.names();
  std::vector<std::vector<float>> got(names.size());
  GpuDraftTrainer::NamedOut out;
  for (size_t i = 0; i < names.size(); ++i) out.emplace_back(names[i], &got[i]);
  gpu->get_tensor_grads(out);
  const auto want = DfCase::grads(cg);
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i] == "lm_head") {
      EXPECT_TRUE(std::all_of(got[i].begin(), got[i].end(), [](float x) { return x == 0.f; })) << "lm_head gradient";
      continue;
    }
    double mb = 0;
    for (double x : *want[i]) mb = std::max(mb, std::abs(x));
    EXPECT_GT(mb, 0.0) << names[i] << ": the reference gradient is zero";
    ASSERT_EQ(got[i].size(), want[i]->size()) << names[i];
    EXPECT_LE(rel_max_diff(as_double(got[i]), *want[i]), grad_tol) << names[i];
  }
}

class GpuDFlash : public ::testing::TestWithParam<bool> {};

TEST_P(GpuDFlash, MatchesCpuReference) {
  REQUIRE_GPU();
  DfCase dc(31 + uint32_t(GetParam()), {30, 9, 22, 3, 17}, GetParam());
  for (auto& m : dc.samples[1].mask) m = 0;  // a prompt only: no anchor
  dc.max_anchors = 12;
  // A budget that holds the whole batch in one engine call, then one of 32 rows: passes of 8
  // blocks that split a sample's blocks across calls.
  for (int64_t rows : {200, 32}) {
    SCOPED_TRACE(fmt::format("budget {}", rows));
    check_dflash_against_cpu(dc, GpuMath::F32, true, tol::kGpuTttLossRel, tol::kGpuTttGradRel, rows);
    check_dflash_against_cpu(dc, GpuMath::F32, false, tol::kGpuTttLossRel, tol::kGpuTttGradRel, rows);
  }
  check_dflash_against_cpu(dc, GpuMath::BF16, true, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel, 96);
  check_dflash_against_cpu(dc, GpuMath::TF32, false, tol::kGpuTttBf16LossRel, tol::kGpuTttBf16GradRel, 96);
}

// Three layers and blocks of 8 on longer samples.
TEST(GpuDFlashShapes, ThreeLayersBlocksOfEight) {
  REQUIRE_GPU();
  DfCase dc(77, {60, 41, 12}, false, 3, 8);
  dc.max_anchors = 6;
  check_dflash_against_cpu(dc, GpuMath::F32, true, tol::kGpuTttLossRel, tol::kGpuTttGradRel, 128);
}

// A batch without seeds, a bad mask token and a batch over the budget are refused.
TEST(GpuDFlashSetup, RefusesBadSetups) {
  REQUIRE_GPU();
  DfCase dc(5, {12, 9}, false);
  auto gpu = make_df(dc, {0}, GpuMath::F32, 32);
  EXPECT_THROW(gpu->run(dc.batch(), 0.5, true, true), Error);
  GpuFamily bad = dc.family();
  bad.mask_token = int32_t(dc.c.V);
  EXPECT_THROW(make_gpu_draft_trainer(eagle3::DraftConfig{}, dc.target(), dc.dv, {0}, GpuMath::F32, 32, {},
                                      eng_for(GpuMath::F32), bad),
               Error);
  DfCase big(6, {40}, false);
  auto small = make_df(big, {0}, GpuMath::F32, 16);
  EXPECT_THROW(small->run(big.batch(), 1.0, true, true, big.seeds(1)), Error);
}

// AdamW steps (two micro-batches a step, clipping on) against the CPU family's, the frozen
// lm_head untouched, two GPU runs identical, moments through a resume.
TEST_P(GpuDFlash, AdamWStepsMatchCpuAndAreDeterministic) {
  REQUIRE_GPU();
  DfCase dc(909, {20, 14, 25, 11}, GetParam());
  const auto batch = dc.batch();
  train::OptimConfig oc;
  oc.lr = 1e-3;
  oc.weight_decay = 0.1;
  oc.warmup_steps = 1;
  oc.total_steps = 4;
  oc.clip_norm = 0.05;
  dflash::Weights cw = dc.w;
  dflash::Grads cg(cw);
  std::vector<train::Param> params;
  {
    const auto n = dc.names();
    const auto t = dc.tensors(cw);
    const auto g = DfCase::grads(cg);
    for (size_t i = 0; i + 1 < n.size(); ++i)
      params.push_back({n[i].c_str(), t[i], g[i],
                        n[i].find("norm") == std::string::npos && n[i].find("_ln") == std::string::npos});
  }
  const auto names = dc.names();
  train::AdamW adam(oc);
  std::vector<std::unique_ptr<GpuDraftTrainer>> gpus;
  for (int r = 0; r < 2; ++r) gpus.push_back(make_df(dc, {0}, GpuMath::F32, 64));
  std::vector<std::string> want(names.begin(), names.end() - 1);
  EXPECT_EQ(gpus[0]->trainable(), want);
  for (int step = 0; step < 4; ++step) {
    const auto seeds = dc.seeds(uint64_t(step) + 1);
    for (auto& p : params) std::fill(p.g->begin(), p.g->end(), 0.0);
    double cpu_loss = 0;
    for (auto& r : dc.cpu(cw, batch, true, seeds, 0.25, &cg)) cpu_loss += r.loss / 4.0;
    const double cn = train::clip_grad_norm(params, oc.clip_norm);
    adam.step(params);
    for (auto& gpu : gpus) {
      std::vector<Sample> m1(batch.begin(), batch.begin() + 2), m2(batch.begin() + 2, batch.end());
      std::vector<uint64_t> s1(seeds.begin(), seeds.begin() + 2), s2(seeds.begin() + 2, seeds.end());
      double loss = 0;
      for (auto& r : gpu->run(m1, 0.25, true, true, s1)) loss += r.loss / 4.0;
      for (auto& r : gpu->run(m2, 0.25, true, false, s2)) loss += r.loss / 4.0;
      EXPECT_NEAR(loss, cpu_loss, tol::kGpuTttLossRel * std::max(1.0, cpu_loss)) << "step " << step;
      const double gn = gpu->clip_grad_norm(oc.clip_norm);
      EXPECT_NEAR(gn, cn, tol::kGpuTttGradRel * cn) << "step " << step;
      gpu->adamw_step(oc, step);
    }
  }
  const auto cw_t = dc.tensors(cw), init_t = dc.tensors(dc.w);
  const std::vector<const std::vector<float>*> cpu_w(cw_t.begin(), cw_t.end()), init_w(init_t.begin(), init_t.end());
  auto fresh = make_df(dc, {0}, GpuMath::F32, 64);
  expect_steps_track_cpu(names, *gpus[0], *gpus[1], cpu_w, init_w, params, adam, oc.lr, *fresh);
}

INSTANTIATE_TEST_SUITE_P(Objective, GpuDFlash, ::testing::Values(false, true),
                         [](const auto& i) { return i.param ? std::string("CeDPace") : std::string("KlExpDecay"); });

INSTANTIATE_TEST_SUITE_P(Residual, GpuDraft, ::testing::Values(false, true),
                         [](const auto& i) { return i.param ? std::string("NormBeforeResidual") : std::string("Plain"); });

}  // namespace
#endif  // TALON_HAVE_CUDA
