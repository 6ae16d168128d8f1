// The real embedded model: SmolLM2-135M-Instruct Q4_1 GGUF, against transformers
// running the same dequantised weights (tools/make_golden.py --smollm2).
#include <gtest/gtest.h>

#include <cstdlib>

#include "model/model.h"
#include "backend/backend.h"
#include "tests/test_util.h"
#include "tests/tolerances.h"

using namespace talon;
using namespace talon::testing;

namespace {

fs::path smollm2_path() {
  if (const char* p = std::getenv("TALON_SMOLLM2_GGUF")) return p;
  return fs::path(source_dir()) / ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

TEST(SmolLM2, LogitsHiddenStatesAndGreedyTokensMatchTransformers) {
  const fs::path gguf = smollm2_path();
  if (!fs::exists(gguf)) {
    if (std::getenv("TALON_REQUIRE_MODEL")) FAIL() << gguf << " missing; run scripts/fetch_model.sh";
    GTEST_SKIP() << gguf << " missing; run scripts/fetch_model.sh";
  }
  auto ck = open_checkpoint(gguf);
  auto model = make_cpu_model(*ck);
  const ModelConfig& c = model->config();
  ASSERT_EQ(c.n_layers, 30);
  ASSERT_EQ(c.hidden, 576);
  ASSERT_EQ(c.vocab, 49152);
  st::File g(fs::path(source_dir()) / "tests/fixtures/golden/smollm2/golden.safetensors");
  const int hidden_ids[] = {2, 15, 27, 30};
  int prompts = 0;
  for (int p = 0; g.find(fmt::format("p{}.input_ids", p)); ++p, ++prompts) {
    const std::string pre = fmt::format("p{}.", p);
    auto ids64 = read_i64(g, pre + "input_ids");
    std::vector<int32_t> ids(ids64.begin(), ids64.end());
    const int64_t T = int64_t(ids.size()), H = c.hidden, V = c.vocab;
    Batch b;
    b.add(ids.data(), T);
    Capture cap;
    std::vector<std::vector<float>> hs(4, std::vector<float>(size_t(T * H)));
    for (int i = 0; i < 4; ++i) {
      cap.layers.push_back(hidden_ids[i]);
      cap.out.push_back(hs[size_t(i)].data());
    }
    std::vector<float> logits(size_t(T * V));
    model->forward(b, cap, logits.data());

    for (int i = 0; i < 4; ++i) {
      auto want = read_f32(g, pre + "hidden." + std::to_string(hidden_ids[i]));
      EXPECT_LE(rel_err(hs[size_t(i)].data(), want.data(), want.size()), tol::kRealHiddenRel)
          << "prompt " << p << " h[" << hidden_ids[i] << "]";
    }
    auto last = read_f32(g, pre + "logits_last");
    double max_abs = 0;
    for (int64_t v = 0; v < V; ++v)
      max_abs = std::max(max_abs, double(std::fabs(logits[size_t((T - 1) * V + v)] - last[size_t(v)])));
    EXPECT_LE(max_abs, tol::kRealLogitsAbs) << "prompt " << p << " last-position logits";
    std::printf("prompt %d: T=%lld, last-position max |dlogit| = %.3g\n", p, (long long)T, max_abs);

    // Greedy next token at every position, except near-ties (gap below 4x the tolerance).
    auto argmax = read_i64(g, pre + "argmax");
    auto margin = read_f32(g, pre + "top2_margin");
    int checked = 0;
    for (int64_t t = 0; t < T; ++t) {
      if (margin[size_t(t)] < 4 * tol::kRealLogitsAbs) continue;
      const float* row = logits.data() + t * V;
      const int64_t best = std::max_element(row, row + V) - row;
      EXPECT_EQ(best, argmax[size_t(t)]) << "prompt " << p << " position " << t;
      ++checked;
    }
    EXPECT_GE(checked, T - 2) << "too many near-ties to check greedy tokens";
  }
  EXPECT_GE(prompts, 3);
}

}  // namespace
