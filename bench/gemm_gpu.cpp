// The draft trainer's linear products in isolation (cuBLAS, bf16 operands, fp32 accumulation),
// each with three outputs: fp32 written (beta 0), fp32 accumulated (beta 1: the weight gradients
// summed over the TTT steps), and bf16 written. What a step's products lose to their outputs.
//   talon_bench_gemm [--rows 2765,4096] [--hidden 4096] [--inter 14336] [--vocab 32000] [--q 4096] [--kv 1024]
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <CLI/CLI.hpp>
#include <algorithm>
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
  int reps = 10;
  CLI::App app{"the draft trainer's linear products with fp32, fp32 accumulated and bf16 outputs"};
  app.add_option("--rows", rows)->delimiter(',');
  app.add_option("--hidden", H);
  app.add_option("--inter", I);
  app.add_option("--vocab", Vd);
  app.add_option("--q", qd);
  app.add_option("--kv", kvd);
  app.add_option("--reps", reps);
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
  BENCH_CK(cudaMemset(C, 0, most_c * 4));
  cublasHandle_t h;
  CUBLAS_CHECK(cublasCreate(&h));
  size_t ws_bytes = size_t(64) << 20;
  void* ws = dalloc<char>(ws_bytes);
  CUBLAS_CHECK(cublasSetWorkspace(h, ws, ws_bytes));
  cudaEvent_t e0, e1;
  BENCH_CK(cudaEventCreate(&e0));
  BENCH_CK(cudaEventCreate(&e1));
  // Median milliseconds of `reps` runs of one product, after two warm-up runs.
  auto time = [&](const Shape& s, int out) {
    const float alpha = 1.f, beta = out == 1 ? 1.f : 0.f;
    const int lda = int(s.ta == CUBLAS_OP_N ? s.m : s.k), ldb = int(s.tb == CUBLAS_OP_N ? s.k : s.n);
    auto run = [&] {
      CUBLAS_CHECK(cublasGemmEx(h, s.ta, s.tb, int(s.m), int(s.n), int(s.k), &alpha, A, CUDA_R_16BF, lda, B,
                                CUDA_R_16BF, ldb, &beta, out == 2 ? static_cast<void*>(Cb) : static_cast<void*>(C),
                                out == 2 ? CUDA_R_16BF : CUDA_R_32F, int(s.m), CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT));
    };
    run();
    run();
    std::vector<float> ms;
    for (int i = 0; i < reps; ++i) {
      BENCH_CK(cudaEventRecord(e0));
      run();
      BENCH_CK(cudaEventRecord(e1));
      BENCH_CK(cudaEventSynchronize(e1));
      float t = 0;
      BENCH_CK(cudaEventElapsedTime(&t, e0, e1));
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return double(ms[ms.size() / 2]);
  };
  const double ceil_ms = time({"ceiling", CUBLAS_OP_N, CUBLAS_OP_N, 8192, 8192, 8192}, 2);
  std::printf("ceiling (8192^3, bf16 out): %.0f TFLOP/s\n", 2.0 * 8192 * 8192 * 8192 / (ceil_ms * 1e-3) / 1e12);
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
