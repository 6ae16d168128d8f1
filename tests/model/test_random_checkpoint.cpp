// make_random_checkpoint: the dense layout binds, values have the asked spread, norms are
// ones, tensors differ, and the CPU model runs on it.
#include <gtest/gtest.h>

#include <cmath>

#include "model/dense.h"
#include "model/model.h"
#include "model/random_checkpoint.h"

using namespace talon;

TEST(RandomCheckpoint, BindsWithTheAskedSpreadAndRuns) {
  ModelConfig c;
  c.arch = Arch::Qwen2;
  c.qkv_bias = true;
  c.n_layers = 2, c.hidden = 64, c.intermediate = 96, c.vocab = 50, c.head_dim = 16, c.n_heads = 4, c.n_kv_heads = 2;
  c.rms_eps = 1e-6;
  auto ck = make_random_checkpoint(c, 0.2f, 3);
  const DenseWeights w = bind_dense_weights(*ck);
  auto stats = [](const WeightRef& r) {
    int64_t n = 1;
    for (int64_t d : r.shape) n *= d;
    double s = 0, s2 = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double v = bf16_to_f32(static_cast<const uint16_t*>(r.data)[i]);
      s += v, s2 += v * v;
    }
    return std::make_pair(s / double(n), std::sqrt(s2 / double(n) - (s / double(n)) * (s / double(n))));
  };
  const auto [mean, sd] = stats(w.layers[0].w_gate);
  EXPECT_NEAR(mean, 0.0, 0.01);
  EXPECT_NEAR(sd, 0.2, 0.01);
  EXPECT_EQ(stats(w.layers[1].mlp_norm), std::make_pair(1.0, 0.0));
  EXPECT_NE(w.layers[0].w_gate.data, w.layers[0].w_up.data);
  auto m = make_cpu_model(*ck);
  std::vector<int32_t> ids = {1, 7, 49, 0};
  Batch b;
  b.add(ids.data(), 4);
  std::vector<float> lg(size_t(4 * c.vocab));
  m->forward(b, Capture{}, lg.data());
  for (float x : lg) ASSERT_TRUE(std::isfinite(x));
}
