// Extraction throughput of a Kimi-K2-shaped model on one GPU (make_cuda_model on the
// DeepSeek-V3 family): hidden 7168, MLA (q LoRA 1536, kv LoRA 512, 64 heads of 128 + 64),
// 384 routed experts top-8 with int4 group-32 weights plus one shared expert, a dense first
// layer; --layers of them (the real model has 61), random weights built in memory
// (make_random_checkpoint), no file. Each forward runs --seqs sequences of --seq-len tokens and
// captures three layers and h[L] to the host in bf16, as `talon extract` does. Prints the load
// time, tokens/s, GPU memory, and the achieved TFLOP/s of the active parameters (2 FLOP per
// active weight per token, attention scores excluded) next to the dense bf16 peak.
//   talon_bench_deepseek [--layers 4] [--seqs 4] [--seq-len 2048] [--steps 3]
#include <cuda_runtime.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>

#include "model/model.h"
#include "model/random_checkpoint.h"

using namespace talon;

namespace {
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Kimi-K2-shaped extraction throughput on one GPU"};
  int64_t layers = 4, seqs = 4, seq_len = 2048, steps = 3;
  app.add_option("--layers", layers, "decoder layers (the first dense, the rest MoE)")->capture_default_str();
  app.add_option("--seqs", seqs, "sequences per forward")->capture_default_str();
  app.add_option("--seq-len", seq_len, "tokens per sequence")->capture_default_str();
  app.add_option("--steps", steps, "timed forwards")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    ModelConfig c;
    c.arch = Arch::DeepseekV3;
    c.n_layers = layers, c.hidden = 7168, c.intermediate = 18432, c.vocab = 163840, c.n_heads = 64, c.n_kv_heads = 64;
    c.rms_eps = 1e-6, c.rope.theta = 50000, c.max_position = 262144;
    auto& d = c.ds;
    d.q_lora_rank = 1536, d.kv_lora_rank = 512, d.qk_nope_head_dim = 128, d.qk_rope_head_dim = 64, d.v_head_dim = 128;
    d.n_routed_experts = 384, d.n_shared_experts = 1, d.num_experts_per_tok = 8, d.moe_intermediate_size = 2048;
    d.first_k_dense_replace = 1, d.routed_scaling_factor = 2.827, d.scoring_func = "sigmoid";
    d.topk_method = "noaux_tc", d.norm_topk_prob = true, d.softmax_scale = 1.0 / std::sqrt(192.0);
    d.quant_method = "compressed-tensors", d.int4_group = 32;
    c.head_dim = d.qk_head_dim();
    const double t0 = now();
    auto ck = make_random_checkpoint(c, 0.02f, 1);
    auto model = make_cuda_model(*ck, 0);
    const double load = now() - t0;
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    // Active weights per token: attention, the dense MLP (layer 0) or 8 routed + 1 shared expert.
    const double H = double(c.hidden), nh = double(c.n_heads);
    const double attn = H * d.q_lora_rank + d.q_lora_rank * nh * 192 + H * (d.kv_lora_rank + 64) +
                        d.kv_lora_rank * nh * 256 + nh * 128 * H;
    const double moe = (8 + 1) * 3 * H * double(d.moe_intermediate_size), dense = 3 * H * double(c.intermediate);
    const double active = double(layers) * attn + dense + double(layers - 1) * moe;
    std::printf("Kimi-K2 shape, %lld layers (1 dense + %lld MoE, int4 experts), random weights: load %.1f s, GPU memory "
                "used %.1f GiB; %.2fB active parameters per token\n",
                (long long)layers, (long long)(layers - 1), load, double(total_b - free_b) / double(1ll << 30),
                active / 1e9);
    std::mt19937 rng(1);
    Batch b;
    for (int64_t s = 0; s < seqs; ++s) {
      std::vector<int32_t> ids(static_cast<size_t>(seq_len));
      for (auto& x : ids) x = int32_t(rng() % uint32_t(c.vocab));
      b.add(ids.data(), seq_len);
    }
    const int64_t N = b.n_tokens();
    std::vector<int> cap_layers = {1, int(layers / 2), int(layers - 1), int(layers)};
    std::shared_ptr<uint8_t> host = model->host_buffer(size_t(N * c.hidden * 2) * cap_layers.size());
    Capture cap;
    cap.dtype = DType::BF16;
    for (size_t i = 0; i < cap_layers.size(); ++i) {
      cap.layers.push_back(cap_layers[i]);
      cap.out.push_back(host.get() + i * size_t(N * c.hidden * 2));
    }
    model->forward(b, cap, nullptr);  // warm-up
    const double a = now();
    for (int64_t i = 0; i < steps; ++i) model->forward(b, cap, nullptr);
    const double t = (now() - a) / double(steps);
    std::printf("%lld tokens per forward: %.1f ms, %.0f tokens/s, %.1f TFLOP/s on active weights (dense bf16 peak ~990)\n",
                (long long)N, t * 1e3, double(N) / t, 2.0 * active * double(N) / t / 1e12);
    std::printf("per layer: %.0f tokens/s; projected to 61 layers on one GPU %.0f tokens/s (if it held them)\n",
                double(N) / t * double(layers), double(N) / t * double(layers) / 61.0);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
