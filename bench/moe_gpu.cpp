// One mixture-of-experts layer on one GPU (backend/cuda/moe.h) at a Kimi-K2 shape: 384
// routed experts, top-8, hidden 7168, expert width 2048, int4 experts (group 32), sigmoid
// noaux_tc routing with one group. Weights are a constant fill (cudaMemset: the kernels'
// work does not depend on the values); router logits are random so tokens spread over the
// experts as real routing does. Prints time per layer forward, tokens/s, the routed experts'
// TFLOP/s, and the rate at which the touched int4 weights are streamed. --fp8: FP8
// block-quantized experts instead (e4m3 bytes, fp32 scales of 128 x 128 blocks, as
// DeepSeek-V3's checkpoint).
//   talon_bench_moe [--tokens 256,1024,4096,16384] [--experts 384] [--topk 8] [--hidden 7168]
//                   [--inter 2048] [--group 32] [--fp8 | --bf16]
#include <cuda_runtime.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "gpu_bench_util.h"
#include "backend/cuda/moe.h"

using namespace talon;

namespace {
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
#define CK(x) BENCH_CK(x)
using bench::dalloc;
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"One MoE layer on one GPU (Kimi-K2 shape, int4 experts)"};
  std::vector<int64_t> tokens{256, 1024, 4096, 16384};
  int64_t E = 384, K = 8, H = 7168, Im = 2048, group = 32;
  bool fp8 = false;
  constexpr int64_t kBlock = 128;  // fp8 block rows and columns
  app.add_option("--tokens", tokens, "tokens per forward")->delimiter(',');
  app.add_option("--experts", E)->capture_default_str();
  app.add_option("--topk", K)->capture_default_str();
  app.add_option("--hidden", H)->capture_default_str();
  app.add_option("--inter", Im)->capture_default_str();
  app.add_option("--group", group)->capture_default_str();
  app.add_flag("--fp8", fp8, "FP8 block-quantized experts (blocks 128 x 128) instead of int4");
  bool bf16 = false;
  app.add_flag("--bf16", bf16, "bf16 experts instead of int4 (TALON_MOE_GEMM=cutlass: CUTLASS's grouped GEMM)");
  CLI11_PARSE(app, argc, argv);
  try {
    cuda::MoeRouting r;
    r.n_experts = int(E), r.top_k = int(K), r.scoring = MoeScoring::Sigmoid, r.method = MoeTopk::NoauxTc;
    r.n_group = 1, r.topk_group = 1, r.norm_topk = true, r.routed_scale = 2.827f;
    auto matrix = [&](int64_t O, int64_t I) {
      cuda::ExpertMatrix m;
      if (bf16) {
        m.O = O, m.I = I;
        auto* w = dalloc<cuda::bf16>(size_t(E * O * I));
        CK(cudaMemset(w, 0x3c, size_t(E * O * I) * 2));  // bf16 ~0.0115
        m.w = w;
        return m;
      }
      if (fp8) {
        m.O = O, m.I = I, m.bo = kBlock, m.bi = kBlock;
        const size_t bytes = size_t(E * O * I), blocks = size_t(E * ((O + kBlock - 1) / kBlock) * ((I + kBlock - 1) / kBlock));
        auto* w = dalloc<uint8_t>(bytes);
        auto* s = dalloc<float>(blocks);
        CK(cudaMemset(w, 0x3a, bytes));       // e4m3 1.25
        CK(cudaMemset(s, 0x3c, blocks * 4));  // fp32 ~0.0115
        m.fp8 = w, m.block_scale = s;
        return m;
      }
      m.O = O, m.I = I, m.group = group;
      const size_t words = size_t(E * O * ((I + 7) / 8)), groups = size_t(E * O * ((I + group - 1) / group));
      auto* p = dalloc<int32_t>(words);
      auto* s = dalloc<cuda::bf16>(groups);
      CK(cudaMemset(p, 0x9a, words * 4));
      CK(cudaMemset(s, 0x3c, groups * 2));
      m.packed = p, m.scale = s;
      return m;
    };
    const cuda::MoeExperts ex{matrix(Im, H), matrix(Im, H), matrix(H, Im)};
    const double weight_gb =
        double(E) * 3 * double(H * Im) *
        (bf16 ? 2.0 : fp8 ? 1.0 + 4.0 / double(kBlock * kBlock) : 0.5 + 2.0 / double(group)) / 1e9;
    const int64_t Nmax = *std::max_element(tokens.begin(), tokens.end());
    const auto sz = cuda::moe_scratch_elems(Nmax, r, H, Im);
    cuda::MoeScratch sc;
    sc.idx = dalloc<int32_t>(sz.idx), sc.order = dalloc<int32_t>(sz.order), sc.pos = dalloc<int32_t>(sz.pos);
    sc.offsets = dalloc<int32_t>(sz.offsets), sc.tiles = dalloc<int32_t>(sz.tiles), sc.n_tiles = dalloc<int32_t>(1);
    sc.weights = dalloc<float>(sz.weights), sc.g = dalloc<float>(sz.g), sc.u = dalloc<float>(sz.g);
    sc.y = dalloc<float>(sz.y), sc.act = dalloc<cuda::bf16>(sz.act);
    sc.capacity = Nmax;
    auto* x = dalloc<cuda::bf16>(size_t(Nmax * H));
    CK(cudaMemset(x, 0x3c, size_t(Nmax * H) * 2));
    auto* out = dalloc<float>(size_t(Nmax * H));
    std::vector<float> lg(size_t(Nmax * E));
    std::mt19937 rng(1);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (auto& v : lg) v = nd(rng);
    auto* logits = dalloc<float>(lg.size());
    CK(cudaMemcpy(logits, lg.data(), lg.size() * 4, cudaMemcpyHostToDevice));
    auto* bias = dalloc<float>(size_t(E));
    CK(cudaMemset(bias, 0, size_t(E) * 4));
    cudaDeviceProp prop{};
    CK(cudaGetDeviceProperties(&prop, 0));
    const std::string storage = bf16 ? "bf16" : fp8 ? "fp8 blocks 128x128" : "int4 group " + std::to_string(group);
    std::printf("MoE layer on %s: %lld experts, top-%lld, H %lld, expert width %lld, %s (%.2f GB of expert weights)\n",
                prop.name, (long long)E, (long long)K, (long long)H, (long long)Im, storage.c_str(), weight_gb);
    std::printf("%8s %10s %12s %10s %12s\n", "tokens", "ms", "tokens/s", "TFLOP/s", "weights GB/s");
    for (int64_t N : tokens) {
      auto run = [&] { cuda::moe_forward(out, x, logits, bias, N, H, r, ex, sc, nullptr); };
      run();
      CK(cudaDeviceSynchronize());
      std::vector<double> ts;
      for (int i = 0; i < 5; ++i) {
        const double a = now();
        run();
        CK(cudaDeviceSynchronize());
        ts.push_back(now() - a);
      }
      std::sort(ts.begin(), ts.end());
      const double t = ts[2];
      const double flops = double(N) * double(K) * 3 * 2 * double(H) * double(Im);
      // Expected fraction of the experts a batch touches: 1 - (1 - 1/E)^(N K).
      const double touched = 1.0 - std::pow(1.0 - 1.0 / double(E), double(N * K));
      std::printf("%8lld %10.2f %12.0f %10.1f %12.0f\n", (long long)N, t * 1e3, double(N) / t, flops / t / 1e12,
                  weight_gb * touched / t);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
