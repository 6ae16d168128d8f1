// make_random_checkpoint: the dense layout binds, values have the asked spread, norms are
// ones, tensors differ, and the CPU model runs on it.
#include <gtest/gtest.h>

#include <cmath>

#include "model/deepseek.h"
#include "backend/backend.h"
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

// The DeepSeek layout (a small Kimi-K2-like config: q LoRA, noaux_tc, a dense first layer,
// shared experts), with bf16 and with int4 routed experts: it binds, the int4 experts are
// int4 with their true shapes, and the CPU reference runs on it.
TEST(RandomCheckpoint, DeepseekLayoutsBindAndRun) {
  for (const bool int4 : {false, true}) {
    ModelConfig c;
    c.arch = Arch::DeepseekV3;
    c.n_layers = 2, c.hidden = 64, c.intermediate = 96, c.vocab = 50, c.n_heads = 4, c.n_kv_heads = 4;
    c.rms_eps = 1e-6;
    auto& d = c.ds;
    d.q_lora_rank = 24, d.kv_lora_rank = 16, d.qk_nope_head_dim = 8, d.qk_rope_head_dim = 8, d.v_head_dim = 8;
    d.n_routed_experts = 8, d.n_shared_experts = 1, d.num_experts_per_tok = 2, d.moe_intermediate_size = 32;
    d.first_k_dense_replace = 1, d.routed_scaling_factor = 2.5, d.scoring_func = MoeScoring::Sigmoid, d.topk_method = MoeTopk::NoauxTc;
    d.norm_topk_prob = true, d.softmax_scale = 1.0 / 4.0;
    c.head_dim = d.qk_head_dim();
    if (int4) d.quant_method = "compressed-tensors", d.int4_group = 32;
    auto ck = make_random_checkpoint(c, 0.1f, 5);
    const DeepseekWeights w = bind_deepseek_weights(*ck);
    ASSERT_EQ(w.layers.size(), 2u);
    EXPECT_FALSE(w.layers[0].moe);
    ASSERT_TRUE(w.layers[1].moe);
    const QuantWeight& up = w.layers[1].experts[3].up;
    EXPECT_EQ(up.kind, int4 ? QuantWeight::Kind::Int4Group : QuantWeight::Kind::Plain);
    EXPECT_EQ(up.rows, 32);
    EXPECT_EQ(up.cols, 64);
    EXPECT_FALSE(w.layers[1].shared.gate.empty());
    auto m = make_cpu_model(*ck);
    std::vector<int32_t> ids = {1, 7, 49, 0, 3};
    Batch b;
    b.add(ids.data(), 5);
    std::vector<float> lg(size_t(5 * c.vocab));
    m->forward(b, Capture{}, lg.data());
    for (float x : lg) ASSERT_TRUE(std::isfinite(x)) << (int4 ? "int4" : "bf16");
  }
}
