// The CPU reference against HF transformers on tiny random checkpoints of every
// supported architecture (fixtures made by tools/make_golden.py, committed).
#include <gtest/gtest.h>

#include "model/model.h"
#include "backend/backend.h"
#include "tests/test_util.h"
#include "tests/tolerances.h"

using namespace talon;
using namespace talon::testing;

namespace {

class Golden : public ::testing::TestWithParam<std::string> {};

TEST_P(Golden, MatchesTransformersEveryLayerAndLogits) {
  const fs::path dir = fs::path(source_dir()) / "tests/fixtures/golden" / GetParam();
  auto ck = open_checkpoint(dir);
  auto model = make_cpu_model(*ck);
  const ModelConfig& c = model->config();
  st::File g(dir / "golden.safetensors");
  auto ids64 = read_i64(g, "input_ids");
  std::vector<int32_t> ids(ids64.begin(), ids64.end());
  const int64_t T = int64_t(ids.size()), H = c.hidden, L = c.n_layers;

  Batch b;
  b.add(ids.data(), T);
  Capture cap;
  std::vector<std::vector<float>> hs(size_t(L + 1), std::vector<float>(size_t(T * H)));
  for (int k = 0; k <= L; ++k) {
    cap.layers.push_back(k);
    cap.out.push_back(hs[size_t(k)].data());
  }
  std::vector<float> logits(size_t(T * c.vocab));
  model->forward(b, cap, logits.data());

  for (int k = 0; k <= L; ++k) {
    auto want = read_f32(g, "hidden." + std::to_string(k));
    ASSERT_EQ(want.size(), hs[size_t(k)].size());
    const double e = rel_err(hs[size_t(k)].data(), want.data(), want.size());
    EXPECT_LE(e, tol::kGoldenHiddenRel) << GetParam() << ": h[" << k << "]";
    if (k == L) RecordProperty("h_L_rel_err", std::to_string(e));
    if (k == L) std::printf("%s h[L] rel err %.3g\n", GetParam().c_str(), e);
  }
  auto want_logits = read_f32(g, "logits");
  ASSERT_EQ(want_logits.size(), logits.size());
  EXPECT_LE(rel_err(logits.data(), want_logits.data(), logits.size()), tol::kGoldenLogitsRel) << GetParam();
}

// The same sample must give the same bits alone and packed with others.
TEST_P(Golden, PackingDoesNotChangeResults) {
  const fs::path dir = fs::path(source_dir()) / "tests/fixtures/golden" / GetParam();
  auto ck = open_checkpoint(dir);
  auto model = make_cpu_model(*ck);
  const ModelConfig& c = model->config();
  st::File g(dir / "golden.safetensors");
  auto ids64 = read_i64(g, "input_ids");
  std::vector<int32_t> ids(ids64.begin(), ids64.end());
  const int64_t T = int64_t(ids.size()), H = c.hidden;
  std::vector<int32_t> other(7);
  for (size_t i = 0; i < other.size(); ++i) other[i] = int32_t((i * 13 + 5) % c.vocab);

  auto run = [&](const Batch& b, int64_t rows) {
    std::vector<float> h(size_t(rows * H));
    Capture cap{{int(c.n_layers)}, {h.data()}};
    model->forward(b, cap, nullptr);
    return h;
  };
  Batch alone;
  alone.add(ids.data(), T);
  Batch packed;
  packed.add(other.data(), int64_t(other.size()));
  packed.add(ids.data(), T);
  auto a = run(alone, T);
  auto p = run(packed, T + int64_t(other.size()));
  ASSERT_EQ(0, std::memcmp(a.data(), p.data() + other.size() * size_t(H), a.size() * 4));
}

INSTANTIATE_TEST_SUITE_P(Archs, Golden,
                         ::testing::Values("llama_gqa", "llama_tied", "llama_cfg4x", "mistral", "qwen2", "qwen3"));
// DeepSeek-V2/V3 family (MLA + MoE; tools/make_golden_deepseek.py). The fp8 / int4 cases
// store quantized weights; their golden is transformers on the dequantized weights.
INSTANTIATE_TEST_SUITE_P(DeepSeek, Golden,
                         ::testing::Values("deepseek_v3", "deepseek_v3_noqlora", "deepseek_v2", "deepseek_v2_greedy",
                                           "deepseek_v3_fp8", "kimi_k2_int4"));

}  // namespace
