// The CUDA draft runner against the CPU one (spec/draft_runner.h), and speculative decoding
// with the target and the draft both on the GPU against target-only greedy decoding on the
// GPU. Skips without a GPU.
//
// Runner: the same step-0 rows (several extends, a prompt at once and single rows) and trees
// of up to 80 nodes (masks wider than one 64-bit word) go through both; every hidden state
// and logit row is compared, the tree inputs taken from the CPU so errors do not compound.
// The GPU's top-k (ids and log-softmax) must equal the host's over the logits it returned.
// After clear_tree, new step-0 rows and a new tree overwrite the old tree's cache rows.
//
// Greedy: bf16 GEMMs of different shapes (one token vs a verified tree) can flip a near-tie,
// so a speculative output may leave the target-only one only at a token where the fp32 CPU
// reference's logits of the two tokens are closer than kCudaGreedyMargin (checked on the
// common prefix); anywhere else the outputs must be equal.
#include <fmt/format.h>
#include <gtest/gtest.h>

#ifdef TALON_HAVE_CUDA
#include <cuda_runtime.h>

#include "tests/gpu_test.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <tuple>

#include "backend/backend.h"
#include "model/decode.h"
#include "model/model.h"
#include "model/random_checkpoint.h"
#include "draft/draft_backend.h"
#include "spec/speculate.h"
#include "tests/spec/random_draft.h"
#include "tests/test_util.h"
#include "tests/tolerances.h"

using namespace talon;
using namespace talon::spec;
using namespace talon::testing;

namespace {



// Fixtures, plus random targets with real head sizes (64 and 128).
std::vector<std::pair<std::string, std::shared_ptr<Checkpoint>>> targets() {
  std::vector<std::pair<std::string, std::shared_ptr<Checkpoint>>> out;
  for (const std::string fx : {"llama_gqa", "qwen3"}) out.emplace_back(fx, open_checkpoint(golden_fixture(fx)));
  for (const int64_t hd : {64, 128}) {
    ModelConfig c;
    c.arch = Arch::Llama;
    c.n_layers = 3, c.hidden = 256, c.intermediate = 512, c.vocab = 700, c.head_dim = hd;
    c.n_heads = hd == 64 ? 8 : 4, c.n_kv_heads = 2, c.rms_eps = 1e-5, c.max_position = 4096;
    out.emplace_back("random hd " + std::to_string(hd), make_random_checkpoint(c, 0.2f, uint64_t(hd)));
  }
  return out;
}

// Where a speculative output `got` first parts from the target-only `want` (both after
// `prompt`): equal when they never do; else the index and, when it lies inside both, the gap
// between the two tokens' logits of the fp32 reference `ref` on the common prefix.
struct Parting {
  bool equal = false, inside = false;
  size_t at = 0;
  double gap = 0;
};
Parting first_parting(Decoder& ref, const std::vector<int32_t>& prompt, const std::vector<int32_t>& want,
                      const std::vector<int32_t>& got, std::vector<float>& logits) {
  Parting p;
  while (p.at < got.size() && p.at < want.size() && got[p.at] == want[p.at]) ++p.at;
  p.equal = p.at == want.size() && got.size() == want.size();
  p.inside = p.at < std::min(got.size(), want.size());
  if (p.equal || !p.inside) return p;
  std::vector<int32_t> seq = prompt;
  seq.insert(seq.end(), want.begin(), want.begin() + std::ptrdiff_t(p.at));
  ref.reset(0);
  ref.forward({{0, seq, {}, false}}, {}, logits.data());
  p.gap = std::fabs(double(logits[size_t(want[p.at])]) - double(logits[size_t(got[p.at])]));
  return p;
}

// Greedy chains with the target and the draft both on the GPU against target-only GPU decoding,
// on the llama_gqa and qwen3 fixtures, three prompts (token ids below vocab - spare), chains of
// each k: equal, or parting only where the fp32 CPU reference's logits of the two tokens are
// closer than kCudaGreedyMargin (checked on the common prefix); at least half of the runs equal.
void expect_greedy_chains_on_gpu(const std::function<DraftModel(const ModelConfig&)>& make_draft,
                                 const std::vector<int>& ks, uint32_t seed, uint32_t spare, const char* label) {
  int equal = 0, runs = 0;
  for (const std::string fx : {"llama_gqa", "qwen3"}) {
    auto ck = open_checkpoint(golden_fixture(fx));
    const ModelConfig& tc = ck->config();
    auto dec = make_cuda_decoder(*ck, 0, 1, 256);
    auto ref = make_cpu_decoder(*ck, 1, 256);
    DraftModel m = make_draft(tc);
    DraftRunner run(m, *ck, 0, 256 + 64);
    std::vector<float> logits(static_cast<size_t>(tc.vocab));
    SamplingParams greedy;
    GenLimits lim;
    lim.max_new_tokens = 30;
    std::mt19937 rng(seed);
    for (int prompt_i = 0; prompt_i < 3; ++prompt_i) {
      std::vector<int32_t> prompt(size_t(3 + prompt_i * 5));
      for (auto& x : prompt) x = int32_t(rng() % (uint32_t(tc.vocab) - spare));
      const auto want = decode_plain(*dec, 0, prompt, greedy, 0, lim);
      for (int k : ks) {
        SpecConfig cfg;
        cfg.k = k;
        const auto got = decode_speculative(*dec, 0, run, prompt, cfg, greedy, 0, lim);
        ++runs;
        const Parting pt = first_parting(*ref, prompt, want, got, logits);
        if (pt.equal) {
          ++equal;
          continue;
        }
        ASSERT_TRUE(pt.inside) << fx << " chain " << k << ": lengths differ";
        EXPECT_LT(pt.gap, tol::kCudaGreedyMargin) << fx << " prompt " << prompt_i << " chain " << k << ": token " << pt.at;
      }
    }
  }
  std::printf("cuda %s greedy: %d/%d runs equal\n", label, equal, runs);
  EXPECT_GE(equal, runs / 2);
}

TEST(CudaDraft, RunnerMatchesTheCpuRunner) {
  REQUIRE_GPU();
  int variant = 0;
  for (const auto& target : targets()) {
    const std::string& name = target.first;
    const std::shared_ptr<Checkpoint>& ck = target.second;
    const ModelConfig& tc = ck->config();
    DraftModel m = random_draft(tc, tc.vocab / 2 + 3, 7 + variant);
    m.config.norm_before_residual = variant++ % 2 == 1;
    const int64_t H = tc.hidden, V = tc.vocab, Vd = m.config.Vd;
    DraftRunner cpu(m, *ck), gpu(m, *ck, 0, 400);
    EXPECT_EQ(gpu.backend(), "cuda:0");
    std::mt19937 rng(11);
    std::normal_distribution<float> nd(0.f, 1.f);
    double worst_h = 0, worst_l = 0;
    auto compare = [&](const std::vector<float>& hc, const std::vector<float>& hg, const std::vector<float>& lc,
                       const std::vector<float>& lg, int64_t rows, const std::string& what) {
      for (int64_t r = 0; r < rows; ++r) {
        const double eh = rel_err(hg.data() + r * H, hc.data() + r * H, size_t(H));
        const double el = rel_err(lg.data() + r * Vd, lc.data() + r * Vd, size_t(Vd));
        EXPECT_LE(eh, tol::kCudaDraftRel) << name << " " << what << " row " << r << " hidden";
        EXPECT_LE(el, tol::kCudaDraftRel) << name << " " << what << " row " << r << " logits";
        worst_h = std::max(worst_h, eh);
        worst_l = std::max(worst_l, el);
      }
    };
    auto extend = [&](int64_t n, const std::string& what) {
      std::vector<int32_t> toks(static_cast<size_t>(n));
      for (auto& t : toks) t = int32_t(rng() % uint32_t(V));
      std::vector<float> aux(size_t(n * 3 * H));
      for (auto& x : aux) x = nd(rng);
      std::vector<float> hc(static_cast<size_t>(H)), hg(hc.size()), lc(static_cast<size_t>(Vd)), lg(lc.size());
      cpu.extend(toks.data(), aux.data(), n, hc.data(), lc.data());
      gpu.extend(toks.data(), aux.data(), n, hg.data(), lg.data());
      compare(hc, hg, lc, lg, 1, what);
      return hc;
    };
    // A tree of `depths` levels of `width` nodes, each node's parent drawn from the level above.
    auto tree = [&](const std::vector<float>& root_hidden, int depths, int width, const std::string& what) {
      std::vector<std::vector<float>> hid;  // per node, from the CPU
      std::vector<int32_t> level;
      for (int d = 0; d < depths; ++d) {
        std::vector<int32_t> toks, pars, ids;
        std::vector<float> ph;
        for (int i = 0; i < width; ++i) {
          const int32_t par = level.empty() ? -1 : level[rng() % level.size()];
          toks.push_back(int32_t(rng() % uint32_t(V)));
          pars.push_back(par);
          const auto& h = par < 0 ? root_hidden : hid[size_t(par)];
          ph.insert(ph.end(), h.begin(), h.end());
        }
        const int64_t base = cpu.tree_size();
        ASSERT_EQ(gpu.tree_size(), base);
        std::vector<float> hc(size_t(width * H)), hg(hc.size()), lc(size_t(width * Vd)), lg(lc.size());
        cpu.tree_step(toks, pars, ph.data(), hc.data(), lc.data());
        DraftTop gt;
        gt.k = int(std::min<int64_t>(8, Vd));
        gpu.tree_step(toks, pars, ph.data(), hg.data(), lg.data(), &gt);
        compare(hc, hg, lc, lg, width, what + " depth " + std::to_string(d + 1));
        // The GPU's top-k of its own logits equals the host's on the same numbers.
        std::vector<int32_t> want_ids(static_cast<size_t>(gt.k));
        std::vector<float> want_lp(static_cast<size_t>(gt.k));
        for (int i = 0; i < width; ++i) {
          top_logsoftmax(lg.data() + i * Vd, Vd, gt.k, want_ids.data(), want_lp.data());
          for (int j = 0; j < gt.k; ++j) {
            EXPECT_EQ(gt.ids[size_t(i * gt.k + j)], want_ids[size_t(j)]) << name << " " << what << " row " << i << " rank " << j;
            EXPECT_NEAR(gt.logprob[size_t(i * gt.k + j)], want_lp[size_t(j)], 1e-4) << name << " " << what << " row " << i;
          }
        }
        level.clear();
        for (int i = 0; i < width; ++i) {
          hid.emplace_back(hc.begin() + i * H, hc.begin() + (i + 1) * H);
          level.push_back(int32_t(base + i));
        }
      }
    };
    extend(37, "prefill");
    extend(1, "one row");
    const auto g = extend(5, "five rows");
    tree(g, 10, 8, "tree of 80");
    cpu.clear_tree();
    gpu.clear_tree();
    const auto g2 = extend(3, "after the tree");
    tree(g2, 3, 5, "second tree");
    // A chain as the runner drafts one: single nodes below each other.
    cpu.clear_tree();
    gpu.clear_tree();
    tree(extend(1, "before the chain"), 6, 1, "chain");
    std::printf("cuda draft %s: worst rel err hidden %.4f, logits %.4f\n", name.c_str(), worst_h, worst_l);
  }
}

// Replayed CUDA graphs against eager launches: two GPU runners (one made with
// TALON_CUDA_GRAPHS=0) draft the same rounds (step-0 rows of 2 and 1, a chain of three
// one-node steps, a 2 x 4 tree), shapes repeating round after round; every hidden state,
// logit row and top-k entry must be bit-identical, and the first runner must have replayed.
TEST(CudaDraft, GraphReplayMatchesEagerLaunches) {
  REQUIRE_GPU();
  auto ck = open_checkpoint(golden_fixture("llama_gqa"));
  const ModelConfig& tc = ck->config();
  DraftModel m = random_draft(tc, tc.vocab / 2 + 3, 5);
  const int64_t H = tc.hidden, V = tc.vocab, Vd = m.config.Vd;
  DraftRunner ga(m, *ck, 0, 400);
  setenv("TALON_CUDA_GRAPHS", "0", 1);
  DraftRunner gb(m, *ck, 0, 400);
  unsetenv("TALON_CUDA_GRAPHS");
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.f, 1.f);
  auto same = [](const std::vector<float>& a, const std::vector<float>& b) { return a == b; };
  auto same_top = [](const DraftTop& a, const DraftTop& b) { return a.ids == b.ids && a.logprob == b.logprob; };
  auto extend = [&](int64_t n, const std::string& what) {
    std::vector<int32_t> toks(static_cast<size_t>(n));
    for (auto& t : toks) t = int32_t(rng() % uint32_t(V));
    std::vector<float> aux(size_t(n * 3 * H));
    for (auto& x : aux) x = nd(rng);
    std::vector<float> ha(static_cast<size_t>(H)), hb(ha.size()), la(static_cast<size_t>(Vd)), lb(la.size());
    DraftTop ta, tb;
    ta.k = tb.k = 4;
    ga.extend(toks.data(), aux.data(), n, ha.data(), la.data(), &ta);
    gb.extend(toks.data(), aux.data(), n, hb.data(), lb.data(), &tb);
    EXPECT_TRUE(same(ha, hb) && same(la, lb) && same_top(ta, tb)) << what;
    return ha;
  };
  auto step = [&](const std::vector<int32_t>& pars, const std::vector<float>& ph, const std::string& what) {
    const int64_t n = int64_t(pars.size());
    std::vector<int32_t> toks(static_cast<size_t>(n));
    for (auto& t : toks) t = int32_t(rng() % uint32_t(V));
    std::vector<float> ha(size_t(n * H)), hb(ha.size()), la(size_t(n * Vd)), lb(la.size());
    DraftTop ta, tb;
    ta.k = tb.k = 8;
    ga.tree_step(toks, pars, ph.data(), ha.data(), la.data(), &ta);
    gb.tree_step(toks, pars, ph.data(), hb.data(), lb.data(), &tb);
    EXPECT_TRUE(same(ha, hb) && same(la, lb) && same_top(ta, tb)) << what;
    return ha;
  };
  extend(30, "prompt");
  for (int round = 0; round < 8; ++round) {
    const std::string r = "round " + std::to_string(round) + ": ";
    const auto g = extend(round % 2 ? 2 : 1, r + "step-0");
    // A chain of three single nodes.
    const int64_t base = ga.tree_size();
    auto h = step({-1}, g, r + "chain 1");
    h = step({int32_t(base)}, h, r + "chain 2");
    step({int32_t(base + 1)}, h, r + "chain 3");
    ga.clear_tree();
    gb.clear_tree();
    // A tree: 4 children of the root, then 4 grandchildren.
    std::vector<float> ph;
    for (int i = 0; i < 4; ++i) ph.insert(ph.end(), g.begin(), g.end());
    const auto h1 = step({-1, -1, -1, -1}, ph, r + "tree 1");
    std::vector<float> ph2(h1.begin(), h1.begin() + 2 * H);
    ph2.insert(ph2.end(), h1.begin(), h1.begin() + 2 * H);
    const int32_t b = int32_t(ga.tree_size()) - 4;
    step({b, b + 1, b, b + 1}, ph2, r + "tree 2");
    ga.clear_tree();
    gb.clear_tree();
  }
  EXPECT_GT(ga.graph_replays(), 10);
  EXPECT_EQ(gb.graph_replays(), 0);
}

// A greedy chain drafted in one graph (DraftRunner::extend_chain: the step tokens mapped to
// target ids and the hidden states passed on the device) against the same chain drafted step
// by step (extend, then tree_step with top-1 fed the previous step's argmax and hidden state
// through the host) by a second GPU runner: the same draft ids, round after round, for
// extensions of 1-5 rows and chains of 1-6 tokens, a draft vocabulary smaller than the target's
// (ids mapped through d2t), both with and without norm_before_residual. The CPU runner's
// extend_chain (no chain on its backend: the runner's own loop) must give its step-by-step ids
// too.
TEST(CudaDraft, ChainInOneGraphDraftsWhatStepByStepDrafts) {
  REQUIRE_GPU();
  int variant = 0;
  for (const auto& target : targets()) {
    const std::string& name = target.first;
    const std::shared_ptr<Checkpoint>& ck = target.second;
    const ModelConfig& tc = ck->config();
    DraftModel m = random_draft(tc, tc.vocab / 2 + 3, 17 + variant);
    m.config.norm_before_residual = variant++ % 2 == 1;
    const int64_t H = tc.hidden, V = tc.vocab;
    DraftRunner one(m, *ck, 0, 400), steps(m, *ck, 0, 400), cpu_one(m, *ck), cpu_steps(m, *ck);
    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.f, 1.f);
    // extend + (k - 1) top-1 tree steps, as decoding drafted a chain before extend_chain.
    auto step_by_step = [&](DraftRunner& r, const std::vector<int32_t>& toks, const std::vector<float>& aux, int k) {
      std::vector<float> h(static_cast<size_t>(H)), h2(h.size());
      DraftTop top;
      top.k = 1;
      r.extend(toks.data(), aux.data(), int64_t(toks.size()), h.data(), nullptr, &top);
      std::vector<int32_t> ids = {top.ids[0]};
      for (int j = 1; j < k; ++j) {
        r.tree_step({r.to_target(ids.back())}, {j == 1 ? -1 : int32_t(r.tree_size()) - 1}, h.data(), h2.data(), nullptr,
                    &top);
        ids.push_back(top.ids[0]);
        h.swap(h2);
      }
      return ids;
    };
    int rounds = 0;
    for (const auto& [n, k] : std::vector<std::pair<int64_t, int>>{{20, 4}, {3, 5}, {1, 1}, {2, 2}, {1, 6}, {5, 3}, {1, 3}}) {
      std::vector<int32_t> toks(static_cast<size_t>(n));
      for (auto& t : toks) t = int32_t(rng() % uint32_t(V));
      std::vector<float> aux(size_t(n * 3 * H));
      for (auto& x : aux) x = nd(rng);
      const std::string what = fmt::format("{} (norm before residual {}): extend {} rows, chain of {}", name,
                                           m.config.norm_before_residual, n, k);
      const std::vector<int32_t> a = one.extend_chain(toks.data(), aux.data(), n, k);
      const std::vector<int32_t> b = step_by_step(steps, toks, aux, k);
      EXPECT_EQ(a, b) << what;
      EXPECT_EQ(one.tree_size(), k - 1) << what;
      EXPECT_EQ(cpu_one.extend_chain(toks.data(), aux.data(), n, k), step_by_step(cpu_steps, toks, aux, k)) << what;
      for (DraftRunner* r : {&one, &steps, &cpu_one, &cpu_steps}) r->clear_tree();
      ++rounds;
    }
    EXPECT_EQ(rounds, 7);
    EXPECT_EQ(one.length(), steps.length());
  }
}

// An EAGLE-2 tree expanded in one graph (DraftRunner::expand_tree: the best k candidates picked,
// their tokens, hidden states and attention masks made on the device) against the same runner
// code expanding step by step through the host (on_device false) on a second GPU runner: the
// same candidates (target ids, parents, scores bit for bit), rounds after extensions of 1-3
// rows, depths 1-6, k 1, 4, 8 and 16 (two mask words past 64 nodes at depth 6, k 16), four targets.
TEST(CudaDraft, TreeInOneGraphExpandsWhatStepByStepExpands) {
  REQUIRE_GPU();
  int variant = 0;
  for (const auto& target : targets()) {
    const std::string& name = target.first;
    const std::shared_ptr<Checkpoint>& ck = target.second;
    const ModelConfig& tc = ck->config();
    DraftModel m = random_draft(tc, tc.vocab / 2 + 3, 41 + variant);
    m.config.norm_before_residual = variant++ % 2 == 1;
    const int64_t H = tc.hidden, V = tc.vocab;
    DraftRunner one(m, *ck, 0, 600), steps(m, *ck, 0, 600);
    std::mt19937 rng(9);
    std::normal_distribution<float> nd(0.f, 1.f);
    int rounds = 0;
    for (const auto& [n, depth, k] : std::vector<std::tuple<int64_t, int, int>>{
             {25, 2, 4}, {1, 6, 8}, {3, 4, 4}, {2, 3, 1}, {1, 6, 16}, {1, 1, 4}}) {
      std::vector<int32_t> toks(static_cast<size_t>(n));
      for (auto& t : toks) t = int32_t(rng() % uint32_t(V));
      std::vector<float> aux(size_t(n * 3 * H));
      for (auto& x : aux) x = nd(rng);
      std::vector<float> ha(static_cast<size_t>(H)), hb(ha.size());
      DraftTop ta, tb;
      ta.k = tb.k = k;
      one.extend(toks.data(), aux.data(), n, ha.data(), nullptr, &ta);
      steps.extend(toks.data(), aux.data(), n, hb.data(), nullptr, &tb);
      ASSERT_EQ(ha, hb);
      std::vector<int32_t> t1, p1, t2, p2;
      std::vector<double> s1, s2;
      one.expand_tree(ta, ha.data(), depth, t1, p1, s1, true);
      steps.expand_tree(tb, hb.data(), depth, t2, p2, s2, false);
      const std::string what = fmt::format("{}: extend {}, depth {}, k {}", name, n, depth, k);
      EXPECT_EQ(t1.size(), size_t(k + (depth - 1) * k * k)) << what;
      EXPECT_EQ(t1, t2) << what;
      EXPECT_EQ(p1, p2) << what;
      EXPECT_EQ(s1, s2) << what;
      EXPECT_EQ(one.tree_size(), steps.tree_size()) << what;
      EXPECT_EQ(one.tree_size(), int64_t(depth - 1) * k) << what;
      one.clear_tree();
      steps.clear_tree();
      ++rounds;
    }
    EXPECT_EQ(rounds, 6);
  }
}

// P-EAGLE on the GPU: the draft's own embedding and the parallel step (mask rows through fc)
// against the CPU runner, rows of a prompt and chains of 1..7 mask rows, then greedy chains
// that must equal target-only GPU decoding up to an fp32 near-tie (as above).
TEST(CudaDraft, PEagleParallelStepMatchesTheCpuRunner) {
  REQUIRE_GPU();
  int variant = 0;
  for (const auto& target : targets()) {
    const std::string& name = target.first;
    const std::shared_ptr<Checkpoint>& ck = target.second;
    const ModelConfig& tc = ck->config();
    DraftModel m = random_peagle_draft(tc, tc.vocab / 2 + 3, 17 + variant);
    m.config.norm_before_residual = variant++ % 2 == 1;
    const int64_t H = tc.hidden, V = tc.vocab, Vd = m.config.Vd;
    DraftRunner cpu(m, *ck), gpu(m, *ck, 0, 200);
    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.f, 1.f);
    double worst = 0;
    for (int n = 1; n <= 7; ++n) {
      const int64_t rows = n == 1 ? 29 : 2;
      std::vector<int32_t> toks(static_cast<size_t>(rows));
      for (auto& t : toks) t = int32_t(rng() % uint32_t(V));
      std::vector<float> aux(size_t(rows * 3 * H)), hc(static_cast<size_t>(H)), hg(hc.size()),
          lc(size_t((n + 1) * Vd)), lg(lc.size());
      for (auto& x : aux) x = nd(rng);
      cpu.extend(toks.data(), aux.data(), rows, hc.data(), lc.data());
      gpu.extend(toks.data(), aux.data(), rows, hg.data(), lg.data());
      cpu.parallel_step(n, lc.data() + Vd);
      DraftTop top;
      top.k = 4;
      gpu.parallel_step(n, lg.data() + Vd, &top);
      for (int r = 0; r <= n; ++r) {
        const double e = rel_err(lg.data() + r * Vd, lc.data() + r * Vd, size_t(Vd));
        EXPECT_LE(e, tol::kCudaDraftRel) << name << " chain of " << n << " row " << r;
        worst = std::max(worst, e);
      }
      std::vector<int32_t> ids(4);
      std::vector<float> lp(4);
      for (int r = 0; r < n; ++r) {
        top_logsoftmax(lg.data() + (r + 1) * Vd, Vd, 4, ids.data(), lp.data());
        for (int j = 0; j < 4; ++j) EXPECT_EQ(top.ids[size_t(r * 4 + j)], ids[size_t(j)]) << name << " row " << r;
      }
      cpu.clear_tree();
      gpu.clear_tree();
    }
    std::printf("cuda P-EAGLE draft %s: worst rel err logits %.4f\n", name.c_str(), worst);
  }
  expect_greedy_chains_on_gpu(
      [](const ModelConfig& tc) { return random_peagle_draft(tc, tc.vocab / 2, 23); }, {2, 5}, 4, 0, "P-EAGLE");
}

// DFlash on the GPU (src/draft/cuda/cuda_dflash.cpp) against the fp64 CPU runner: the context
// arrives in pieces (a prompt, then 1-3 rows at a time, as verified tokens do), and after each
// piece the block at the next position gives logits within the bf16 tolerance and a top-k equal
// to the host's over those logits; two layer counts and block sizes, four targets (GQA groups,
// head sizes 64 and 128, Qwen3 norms). Then greedy chains with the target and the draft both on
// the GPU against target-only GPU decoding (equal, or parting at an fp32 near-tie).
TEST(CudaDraft, DFlashBlocksMatchTheCpuRunner) {
  REQUIRE_GPU();
  int variant = 0;
  for (const auto& target : targets()) {
    const std::string& name = target.first;
    const std::shared_ptr<Checkpoint>& ck = target.second;
    const ModelConfig& tc = ck->config();
    const int64_t layers = variant % 2 ? 3 : 2, block = variant % 2 ? 6 : 4;
    DraftModel m = random_dflash_draft(tc, tc.vocab / 2 + 3, 31 + variant++, layers, block);
    const int64_t H = tc.hidden, V = tc.vocab, Vd = m.config.Vd;
    DraftRunner cpu(m, *ck), gpu(m, *ck, 0, 200);
    EXPECT_EQ(gpu.backend(), "cuda:0");
    std::mt19937 rng(8);
    std::normal_distribution<float> nd(0.f, 1.f);
    double worst = 0;
    int blocks = 0;
    for (const int64_t n : {29, 1, 2, 3, 1, 1, 2}) {
      std::vector<int32_t> toks(static_cast<size_t>(n));
      for (auto& t : toks) t = int32_t(rng() % uint32_t(V - 1));
      std::vector<float> aux(size_t(n * 3 * H));
      for (auto& x : aux) x = nd(rng);
      cpu.extend(toks.data(), aux.data(), n, nullptr, nullptr);
      gpu.extend(toks.data(), aux.data(), n, nullptr, nullptr);
      for (int64_t k = 1; k < block; k += block - 2) {
        std::vector<float> lc(size_t(k * Vd)), lg(lc.size());
        DraftTop top;
        top.k = 4;
        cpu.block_step(k, lc.data());
        gpu.block_step(k, lg.data(), &top);
        std::vector<int32_t> ids(4);
        std::vector<float> lp(4);
        for (int64_t r = 0; r < k; ++r) {
          const double e = rel_err(lg.data() + r * Vd, lc.data() + r * Vd, size_t(Vd));
          EXPECT_LE(e, tol::kCudaDraftRel) << name << " context " << cpu.length() << " slot " << r + 1;
          worst = std::max(worst, e);
          top_logsoftmax(lg.data() + r * Vd, Vd, 4, ids.data(), lp.data());
          for (int j = 0; j < 4; ++j)
            EXPECT_EQ(top.ids[size_t(r * 4 + j)], ids[size_t(j)]) << name << " slot " << r + 1 << " rank " << j;
        }
        ++blocks;
      }
    }
    EXPECT_EQ(blocks, 14) << name;
    std::printf("cuda DFlash draft %s (%lld layers, block %lld): worst rel err logits %.4f\n", name.c_str(),
                (long long)layers, (long long)block, worst);
  }
  expect_greedy_chains_on_gpu(
      [](const ModelConfig& tc) { return random_dflash_draft(tc, tc.vocab / 2, 37, 2, 5); }, {2, 4}, 6, 1, "DFlash");
}

TEST(CudaDraft, BadRequestsAreRefused) {
  REQUIRE_GPU();
  auto ck = open_checkpoint(golden_fixture("llama_gqa"));
  const ModelConfig& tc = ck->config();
  DraftModel m = random_draft(tc, 16, 3);
  DraftRunner gpu(m, *ck, 0, 8);
  std::vector<float> aux(size_t(10 * 3 * tc.hidden)), h(size_t(tc.hidden)), l(16);
  std::vector<int32_t> toks(10, 1);
  EXPECT_NE(error_of([&] { gpu.extend(toks.data(), aux.data(), 10, h.data(), l.data()); }).find("GPU cache of 8 rows"),
            std::string::npos);
  toks[0] = int32_t(tc.vocab);
  EXPECT_NE(error_of([&] { gpu.extend(toks.data(), aux.data(), 1, h.data(), l.data()); }).find("outside the vocabulary"),
            std::string::npos);
  EXPECT_NE(error_of([] { DraftRunner bad(random_draft(open_checkpoint(golden_fixture("llama_gqa"))->config(), 16, 3),
                                          *open_checkpoint(golden_fixture("llama_gqa")), 99, 8); })
                .find("cuda:99"),
            std::string::npos);
}

TEST(CudaDraft, GreedySpeculationEqualsTargetOnlyGreedyOnTheGpu) {
  REQUIRE_GPU();
  int equal = 0, ties = 0, runs = 0;
  for (const std::string fx : {"llama_gqa", "qwen3"}) {
    auto ck = open_checkpoint(golden_fixture(fx));
    const ModelConfig& tc = ck->config();
    auto dec = make_cuda_decoder(*ck, 0, 1, 256);
    auto ref = make_cpu_decoder(*ck, 1, 256);
    DraftModel m = random_draft(tc, tc.vocab / 2, 21);
    DraftRunner run(m, *ck, 0, 256 + 64);
    std::vector<float> logits(static_cast<size_t>(tc.vocab));
    ASSERT_NO_FATAL_FAILURE(run_greedy_comparisons(
        *dec, run, tc.vocab, fx,
        [&](int prompt_i, const std::vector<int32_t>& prompt, const std::vector<int32_t>& want, const SpecConfig& cfg,
            const std::vector<int32_t>& got, const DecodeStats&) {
          ++runs;
          const Parting pt = first_parting(*ref, prompt, want, got, logits);
          if (pt.equal) {
            ++equal;
            return;
          }
          ASSERT_TRUE(pt.inside) << fx << " " << cfg.name() << ": lengths differ";
          // The first difference must be a near-tie of the fp32 reference on the common prefix.
          EXPECT_LT(pt.gap, tol::kCudaGreedyMargin)
              << fx << " prompt " << prompt_i << " " << cfg.name() << ": token " << pt.at << " is " << got[pt.at]
              << " instead of " << want[pt.at] << ", fp32 logits apart by " << pt.gap;
          ++ties;
        }));
  }
  std::printf("cuda speculative greedy: %d/%d runs equal, %d left at an fp32 near-tie\n", equal, runs, ties);
  EXPECT_GE(equal, runs / 2);
}

// The same on DeepSeek-family targets (the GPU decoder of absorbed MLA over a latent cache, MoE).
// A verify pass and a one-token step round differently, and where a token's expert choice is a
// near-tie that can pick other experts for the same token (tests/backend/test_cuda_decode.cpp,
// Twin): such a parting is counted, not required to be an fp32 near-tie of the tokens'
// logits. At least half the runs must be equal throughout, and most of the rest part at an
// fp32 near-tie.
TEST(CudaDraft, GreedySpeculationOnDeepSeekTargetsOnTheGpu) {
  REQUIRE_GPU();
  int equal = 0, ties = 0, other = 0, runs = 0;
  for (const std::string fx : {"deepseek_v3", "kimi_k2_int4"}) {
    auto ck = open_checkpoint(golden_fixture(fx));
    const ModelConfig& tc = ck->config();
    auto dec = make_cuda_decoder(*ck, 0, 1, 256);
    auto ref = make_cpu_decoder(*ck, 1, 256);
    DraftModel m = random_draft(tc, tc.vocab / 2, 23);
    DraftRunner run(m, *ck, 0, 256 + 64);
    std::vector<float> logits(static_cast<size_t>(tc.vocab));
    ASSERT_NO_FATAL_FAILURE(run_greedy_comparisons(
        *dec, run, tc.vocab, fx,
        [&](int, const std::vector<int32_t>& prompt, const std::vector<int32_t>& want, const SpecConfig& cfg,
            const std::vector<int32_t>& got, const DecodeStats&) {
          ++runs;
          const Parting pt = first_parting(*ref, prompt, want, got, logits);
          if (pt.equal) {
            ++equal;
            return;
          }
          ASSERT_TRUE(pt.inside) << fx << " " << cfg.name() << ": lengths differ";
          (pt.gap < tol::kCudaGreedyMargin ? ties : other) += 1;
        }));
  }
  std::printf("cuda speculative greedy on DeepSeek targets: %d/%d runs equal, %d part at an fp32 near-tie, %d "
              "elsewhere\n",
              equal, runs, ties, other);
  EXPECT_GE(equal, runs / 2);
  EXPECT_LE(other, (runs - equal) / 2);
}

}  // namespace
#endif  // TALON_HAVE_CUDA
