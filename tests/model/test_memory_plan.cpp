// The GPU memory plan (computed before loading) against the checkpoints themselves:
// its weight bytes must equal the bf16 size of every tensor the model stores, and a
// tensor-parallel rank must hold the replicated tensors plus 1/tp of the sharded ones.
#include <gtest/gtest.h>

#include "model/checkpoint.h"
#include "backend/backend.h"
#include "model/model.h"
#include "tests/test_util.h"

using namespace talon;

namespace {

int64_t numel(const CkptTensor& t) {
  int64_t n = 1;
  for (auto d : t.shape) n *= d;
  return n;
}

bool replicated(const std::string& name) {  // embeddings, lm_head and every norm
  return name.find("embed_tokens") != std::string::npos || name.find("lm_head") != std::string::npos ||
         name.find("norm") != std::string::npos;
}

class MemoryPlan : public ::testing::TestWithParam<std::string> {};

TEST_P(MemoryPlan, WeightsMatchCheckpointBytes) {
  const fs::path dir = fs::path(talon::testing::source_dir()) / "tests/fixtures/golden" / GetParam();
  auto ck = open_checkpoint(dir);
  int64_t all = 0, rep = 0;
  for (auto& t : ck->tensors()) {
    all += 2 * numel(t);
    if (replicated(t.name)) rep += 2 * numel(t);
  }
  GpuOptions o;
  EXPECT_EQ(plan_gpu_memory(ck->config(), o).weights, all);
  const ModelConfig& c = ck->config();
  if (c.n_heads % 2 == 0 && c.n_kv_heads % 2 == 0 && c.intermediate % 2 == 0) {
    o.tp = 2;
    EXPECT_EQ(plan_gpu_memory(c, o).weights, rep + (all - rep) / 2);
  }
}
INSTANTIATE_TEST_SUITE_P(Golden, MemoryPlan,
                         ::testing::Values("llama_gqa", "llama_tied", "llama_cfg4x", "mistral", "qwen2", "qwen3"));

TEST(MemoryPlan, ActivationsScaleWithTheTokenBudget) {
  auto ck = open_checkpoint(fs::path(talon::testing::source_dir()) / "tests/fixtures/golden/qwen3");
  GpuOptions o;
  o.n_capture = 4;
  o.max_tokens = 1000;
  const auto a = plan_gpu_memory(ck->config(), o);
  o.max_tokens = 3000;
  const auto b = plan_gpu_memory(ck->config(), o);
  EXPECT_EQ(b.activations, 3 * a.activations);
  // Capture buffers: 4 layers x hidden x 2 bytes (bf16) per token.
  EXPECT_EQ(b.captures, 3000 * 4 * ck->config().hidden * 2);
  EXPECT_EQ(b.weights, a.weights);
}

}  // namespace
