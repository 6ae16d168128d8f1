// Extraction throughput of a Kimi-K2-shaped model on one GPU or a group (make_cuda_model on the
// DeepSeek-V3 family): hidden 7168, MLA (q LoRA 1536, kv LoRA 512, 64 heads of 128 + 64),
// 384 routed experts top-8 with int4 group-32 weights plus one shared expert, a dense first
// layer; --layers of them (the real model has 61), random weights built in memory
// (make_random_checkpoint), no file. Each forward runs --seqs sequences of --seq-len tokens and
// captures three layers and h[L] to the host in bf16, as `talon extract` does. Prints the load
// time, tokens/s, GPU memory, and the achieved TFLOP/s of the active parameters (2 FLOP per
// active weight per token, attention scores excluded) next to the dense bf16 peak.
// --bf16-experts stores the routed experts in bf16 instead (the layout of the transformers
// peer, bench/deepseek_peer.py, which has no int4 kernels).
// --ep N / --tp N run it as an expert- / tensor-parallel group over --devices (--share-gpus:
// ranks may share a GPU); memory is then reported per device.
//   talon_bench_deepseek [--layers 4] [--seqs 4] [--seq-len 2048] [--steps 3] [--bf16-experts]
//                        [--ep N | --tp N] [--devices 0,1] [--share-gpus]
#include <cuda_runtime.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>

#include "model/model.h"
#include "backend/backend.h"
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
  bool bf16_experts = false, share = false;
  int ep = 1, tp = 1;
  std::vector<int> devices{0};
  app.add_option("--ep", ep, "expert-parallel degree")->capture_default_str();
  app.add_option("--tp", tp, "tensor-parallel degree")->capture_default_str();
  app.add_option("--devices", devices, "GPU ids, one per rank")->delimiter(',');
  app.add_flag("--share-gpus", share, "ranks may share a GPU");
  app.add_flag("--bf16-experts", bf16_experts, "routed experts in bf16 (default int4 group 32)");
  CLI11_PARSE(app, argc, argv);
  try {
    const ModelConfig c = kimi_k2_shape(layers, !bf16_experts);
    const auto& d = c.ds;
    const double t0 = now();
    auto ck = make_random_checkpoint(c, 0.02f, 1);
    GpuOptions go;
    go.devices = devices, go.ep = ep, go.tp = tp, go.share_devices = share;
    auto model = make_cuda_model(*ck, go);
    const double load = now() - t0;
    size_t free_b = 0, total_b = 0;
    std::string per_device;
    for (int d : devices) {
      cudaSetDevice(d);
      cudaMemGetInfo(&free_b, &total_b);
      per_device += " cuda:" + std::to_string(d) + " " + std::to_string((total_b - free_b) >> 30) + " GiB";
    }
    std::printf("backend %s; memory used:%s\n", model->backend().c_str(), per_device.c_str());
    // Active weights per token: attention, the dense MLP (layer 0) or 8 routed + 1 shared expert.
    const double H = double(c.hidden), nh = double(c.n_heads);
    const double attn = H * d.q_lora_rank + d.q_lora_rank * nh * 192 + H * (d.kv_lora_rank + 64) +
                        d.kv_lora_rank * nh * 256 + nh * 128 * H;
    const double moe = (8 + 1) * 3 * H * double(d.moe_intermediate_size), dense = 3 * H * double(c.intermediate);
    const double active = double(layers) * attn + dense + double(layers - 1) * moe;
    std::printf("Kimi-K2 shape, %lld layers (1 dense + %lld MoE, %s experts), random weights: load %.1f s, GPU memory "
                "used %.1f GiB; %.2fB active parameters per token\n",
                (long long)layers, (long long)(layers - 1), bf16_experts ? "bf16" : "int4", load, double(total_b - free_b) / double(1ll << 30),
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
