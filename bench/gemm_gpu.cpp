// The draft trainer's linear products in isolation (cuBLAS, bf16 operands, fp32 accumulation),
// each with three outputs: fp32 written (beta 0), fp32 accumulated (beta 1: the weight gradients
// summed over the TTT steps), and bf16 written. What a step's products lose to their outputs.
//   talon_bench_gemm [--rows 2765,4096] [--hidden 4096] [--inter 14336] [--vocab 32000] [--q 4096] [--kv 1024]
// With --algos N, instead: each product with fp32 outputs (written and accumulated) by the
// default algorithm (what the trainer calls) and by each of cuBLASLt's first N heuristic
// candidates, with the fastest candidate's configuration (tile, split-K, stages, cluster):
// whether the default's choice leaves time on the table at the step's row counts (products with
// few output tiles, e.g. 4096 outputs at ~1400 rows, fill 1.33 waves of 128x256 tiles). Each
// candidate's written output is compared bit for bit with the default's ("same": how many
// match): a choice among those that match would not change the trainer's results. Each line also
// names the first candidate's configuration and both one's wave count (cuBLASLt's estimate).
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <string>
#include <vector>

#include "backend/cuda/check.h"
#include "gpu_bench_util.h"

namespace {

struct Shape {
  std::string name;
  cublasOperation_t ta, tb;
  int64_t m, n, k;
};

}  // namespace

int main(int argc, char** argv) try {
  using namespace talon::bench;
  std::vector<int64_t> rows = {2765, 4096};
  int64_t H = 4096, I = 14336, Vd = 32000, qd = 4096, kvd = 1024;
  int reps = 10, algos = 0;
  CLI::App app{"the draft trainer's linear products with fp32, fp32 accumulated and bf16 outputs"};
  app.add_option("--rows", rows)->delimiter(',');
  app.add_option("--hidden", H);
  app.add_option("--inter", I);
  app.add_option("--vocab", Vd);
  app.add_option("--q", qd);
  app.add_option("--kv", kvd);
  app.add_option("--reps", reps);
  app.add_option("--algos", algos, "time cuBLASLt's first N heuristic candidates against the default");
  CLI11_PARSE(app, argc, argv);

  // Column-major, as the trainer calls cuBLAS: forward y = W x (T, N: m = out, n = rows, k = in),
  // input gradient dx = W^T dy (N, N: m = in, n = rows, k = out), weight gradient
  // dW += x dy^T (N, T: m = in, n = out, k = rows).
  struct Lin {
    const char* name;
    int64_t in, out;
  };
  // By default the trainer runs a product per matrix; with --gpu-fused-products (bf16 operands)
  // gate+up is one product (forward and backward) and so is the q|k|v backward (dx and dW),
  // while the q, k, v forward stays three. Both kinds are timed here.
  const std::vector<Lin> lins = {{"q", 2 * H, qd},    {"k (or v)", 2 * H, kvd}, {"qkv", 2 * H, qd + 2 * kvd},
                                 {"o", qd, H},        {"gate (or up)", H, I},   {"gate+up", H, 2 * I},
                                 {"down", I, H},      {"lm_head", H, Vd},       {"fc", 3 * H, H}};
  std::vector<Shape> shapes;
  for (int64_t r : rows)
    for (const Lin& l : lins) {
      const std::string tag = std::string(l.name) + " rows " + std::to_string(r);
      shapes.push_back({tag + " forward", CUBLAS_OP_T, CUBLAS_OP_N, l.out, r, l.in});
      shapes.push_back({tag + " dx", CUBLAS_OP_N, CUBLAS_OP_N, l.in, r, l.out});
      shapes.push_back({tag + " dW", CUBLAS_OP_N, CUBLAS_OP_T, l.in, l.out, r});
    }
  size_t most_a = 0, most_b = 0, most_c = 0;
  for (const Shape& s : shapes) {
    most_a = std::max(most_a, size_t(s.m * s.k));
    most_b = std::max(most_b, size_t(s.k * s.n));
    most_c = std::max(most_c, size_t(s.m * s.n));
  }
  most_a = std::max(most_a, size_t(8192) * 8192);
  most_b = std::max(most_b, size_t(8192) * 8192);
  most_c = std::max(most_c, size_t(8192) * 8192);
  auto* A = dalloc<__nv_bfloat16>(most_a);
  auto* B = dalloc<__nv_bfloat16>(most_b);
  auto* C = dalloc<float>(most_c);
  auto* Cb = dalloc<__nv_bfloat16>(most_c);
  // Small finite values (bf16 0x3c3c): the timing does not depend on them.
  BENCH_CK(cudaMemset(A, 0x3c, most_a * 2));
  BENCH_CK(cudaMemset(B, 0x3c, most_b * 2));
  if (algos > 0) {  // varied values, so that comparing outputs bit for bit means something
    std::vector<__nv_bfloat16> h(std::max(most_a, most_b));
    uint32_t x = 12345;
    for (auto& v : h) {
      x = x * 1664525u + 1013904223u;
      v = __float2bfloat16(float(int(x >> 9) - (1 << 22)) / float(1 << 22));
    }
    BENCH_CK(cudaMemcpy(A, h.data(), most_a * 2, cudaMemcpyHostToDevice));
    BENCH_CK(cudaMemcpy(B, h.data() + (h.size() - most_b), most_b * 2, cudaMemcpyHostToDevice));
  }
  BENCH_CK(cudaMemset(C, 0, most_c * 4));
  cublasHandle_t h;
  CUBLAS_CHECK(cublasCreate(&h));
  size_t ws_bytes = size_t(64) << 20;
  void* ws = dalloc<char>(ws_bytes);
  CUBLAS_CHECK(cublasSetWorkspace(h, ws, ws_bytes));
  cudaEvent_t e0, e1;
  BENCH_CK(cudaEventCreate(&e0));
  BENCH_CK(cudaEventCreate(&e1));
  // Median milliseconds of `reps` runs of f(), after two warm-up runs.
  auto median_ms = [&](auto&& f) {
    f();
    f();
    std::vector<float> ms;
    for (int i = 0; i < reps; ++i) {
      BENCH_CK(cudaEventRecord(e0));
      f();
      BENCH_CK(cudaEventRecord(e1));
      BENCH_CK(cudaEventSynchronize(e1));
      float t = 0;
      BENCH_CK(cudaEventElapsedTime(&t, e0, e1));
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return double(ms[ms.size() / 2]);
  };
  // The same for one product by cublasGemmEx's default algorithm (out: 0 fp32 written, 1 fp32
  // accumulated, 2 bf16 written).
  auto time = [&](const Shape& s, int out) {
    const float alpha = 1.f, beta = out == 1 ? 1.f : 0.f;
    const int lda = int(s.ta == CUBLAS_OP_N ? s.m : s.k), ldb = int(s.tb == CUBLAS_OP_N ? s.k : s.n);
    auto run = [&] {
      CUBLAS_CHECK(cublasGemmEx(h, s.ta, s.tb, int(s.m), int(s.n), int(s.k), &alpha, A, CUDA_R_16BF, lda, B,
                                CUDA_R_16BF, ldb, &beta, out == 2 ? static_cast<void*>(Cb) : static_cast<void*>(C),
                                out == 2 ? CUDA_R_16BF : CUDA_R_32F, int(s.m), CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT));
    };
    return median_ms(run);
  };
  const double ceil_ms = time({"ceiling", CUBLAS_OP_N, CUBLAS_OP_N, 8192, 8192, 8192}, 2);
  std::printf("ceiling (8192^3, bf16 out): %.0f TFLOP/s\n", 2.0 * 8192 * 8192 * 8192 / (ceil_ms * 1e-3) / 1e12);
  if (algos > 0) {
    cublasLtHandle_t lt;
    CUBLAS_CHECK(cublasLtCreate(&lt));
    auto config = [](const cublasLtMatmulAlgo_t& a) {
      int tile = 0, split = 0, stages = 0, cluster = 0;
      size_t w = 0;
      cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &w);
      cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split, sizeof split, &w);
      cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof stages, &w);
      cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof cluster, &w);
      return "tile " + std::to_string(tile) + " split " + std::to_string(split) + " stages " + std::to_string(stages) +
             " cluster " + std::to_string(cluster);
    };
    std::printf("%-34s %-4s %8s %8s %8s %4s %4s  %s\n", "product", "out", "dflt ms", "lt#0 ms", "best ms", "of",
                "same", "best's configuration (=: its bits match the default's)");
    std::vector<float> ref, got;
    double tot_default = 0, tot_best = 0;
    for (const Shape& s : shapes)
      for (int out = 0; out < 2; ++out) {
        const float alpha = 1.f, beta = out == 1 ? 1.f : 0.f;
        const double dflt = time(s, out);
        const size_t nc = size_t(s.m * s.n);
        if (out == 0) {  // time() left the default's written output in C
          ref.resize(nc);
          BENCH_CK(cudaMemcpy(ref.data(), C, nc * 4, cudaMemcpyDeviceToHost));
        }        cublasLtMatmulDesc_t op;
        CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &s.ta, sizeof s.ta));
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &s.tb, sizeof s.tb));
        const uint64_t ar = uint64_t(s.ta == CUBLAS_OP_N ? s.m : s.k), ac = uint64_t(s.ta == CUBLAS_OP_N ? s.k : s.m);
        const uint64_t br = uint64_t(s.tb == CUBLAS_OP_N ? s.k : s.n), bc = uint64_t(s.tb == CUBLAS_OP_N ? s.n : s.k);
        cublasLtMatrixLayout_t la, lb, lc;
        CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, ar, ac, int64_t(ar)));
        CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, br, bc, int64_t(br)));
        CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, uint64_t(s.m), uint64_t(s.n), s.m));
        cublasLtMatmulPreference_t pref;
        CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
        CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                          sizeof ws_bytes));
        std::vector<cublasLtMatmulHeuristicResult_t> res(static_cast<size_t>(algos));
        int found = 0;
        CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, algos, res.data(), &found));
        double first = 0, best = 1e30;
        int best_i = -1, same = 0;
        bool best_same = false;
        for (int i = 0; i < found; ++i) {
          if (res[size_t(i)].workspaceSize > ws_bytes) continue;
          const double t = median_ms([&] {
            CUBLAS_CHECK(cublasLtMatmul(lt, op, &alpha, A, la, B, lb, &beta, C, lc, C, lc, &res[size_t(i)].algo, ws,
                                        ws_bytes, nullptr));
          });
          bool eq = false;
          if (out == 0) {
            got.resize(nc);
            BENCH_CK(cudaMemcpy(got.data(), C, nc * 4, cudaMemcpyDeviceToHost));
            eq = std::equal(got.begin(), got.end(), ref.begin(),
                            [](float a, float b) { return std::memcmp(&a, &b, 4) == 0; });
            same += eq;
          }
          if (i == 0) first = t;
          if (t < best) best = t, best_i = i, best_same = eq;
        }
        tot_default += dflt;
        tot_best += std::min(dflt, best);
        std::printf("%-34s %-4s %8.3f %8.3f %8.3f %4d %4s  #%d%s %s waves %.2f (#0: %s waves %.2f)\n",
                    s.name.c_str(), out ? "+=" : "=", dflt, first, best, found,
                    out ? "-" : std::to_string(same).c_str(), best_i, best_same ? "=" : "",
                    best_i >= 0 ? config(res[size_t(best_i)].algo).c_str() : "-",
                    best_i >= 0 ? double(res[size_t(best_i)].wavesCount) : 0.0,
                    found > 0 ? config(res[0].algo).c_str() : "-", found > 0 ? double(res[0].wavesCount) : 0.0);
        cublasLtMatmulPreferenceDestroy(pref);
        cublasLtMatrixLayoutDestroy(la);
        cublasLtMatrixLayoutDestroy(lb);
        cublasLtMatrixLayoutDestroy(lc);
        cublasLtMatmulDescDestroy(op);
      }
    std::printf("sum: default %.2f ms, best of each %.2f ms\n", tot_default, tot_best);
    cublasLtDestroy(lt);
    cublasDestroy(h);
    return 0;
  }
  std::printf("%-34s %8s %8s %8s   TFLOP/s: %6s %6s %6s\n", "product", "f32 ms", "f32+= ms", "bf16 ms", "f32",
              "f32+=", "bf16");
  double tot[3] = {0, 0, 0};
  for (const Shape& s : shapes) {
    const double fl = 2.0 * double(s.m) * double(s.n) * double(s.k);
    double t[3];
    for (int o = 0; o < 3; ++o) {
      t[o] = time(s, o);
      tot[o] += t[o];
    }
    std::printf("%-34s %8.3f %8.3f %8.3f   %14.0f %6.0f %6.0f\n", s.name.c_str(), t[0], t[1], t[2],
                fl / (t[0] * 1e-3) / 1e12, fl / (t[1] * 1e-3) / 1e12, fl / (t[2] * 1e-3) / 1e12);
  }
  std::printf("sum: %.2f / %.2f / %.2f ms\n", tot[0], tot[1], tot[2]);
  cublasDestroy(h);
  return 0;
} catch (const std::exception& e) {  // a failed cuBLAS call (check.h), named
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
