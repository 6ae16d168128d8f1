// Attention alone on one GPU, each route against the same inputs in one run: the tensor-core
// kernels Talon wrote (attention.cu for prefill, ttt_attention.cu for the draft trainer) and
// cuDNN's fused attention (backend/cuda/cudnn_sdpa.h). Packed samples of --seq-len rows each
// (--seqs of them); causal. Prints ms and TFLOP/s (causal work only: 2 * heads * (d_qk + d_v)
// * sum L(L+1)/2 multiply-adds x 2 for the forward; the backward counts 2.5x the forward, as
// FlashAttention's papers do).
//   prefill: GQA on a fused qkv buffer (--heads 32 --kv-heads 8 --head 128, Llama-3.1-8B) and
//            MLA (--mla-heads 64, heads of 192 over values of 128: Kimi-K2 / DeepSeek-V3).
//   ttt:     the draft trainer's causal part, forward and backward (the fused kernels' dq + dkv
//            vs cuDNN's backward), at the draft's heads (--heads/--kv-heads/--head).
//   talon_bench_attention [--seq-len 2048,4096] [--seqs 4] [--reps 20]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "gpu_bench_util.h"
#include "backend/cuda/cudnn_sdpa.h"
#include "backend/cuda/ops.h"
#include "draft/cuda/ttt_attention.h"

using namespace talon;

namespace {
#define CK(x) BENCH_CK(x)
using bench::dalloc;
// Random bf16 values of about unit size (the work does not depend on them; NaN-free inputs
// keep the softmax honest).
__nv_bfloat16* random_bf16(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<__nv_bfloat16> h(n);
  for (auto& x : h) x = __float2bfloat16(d(g));
  auto* p = dalloc<__nv_bfloat16>(n);
  CK(cudaMemcpy(p, h.data(), n * 2, cudaMemcpyHostToDevice));
  return p;
}
// Median ms of reps runs of f on stream s (after 3 warm-ups).
double time_ms(cudaStream_t s, int reps, const std::function<void()>& f) {
  for (int i = 0; i < 3; ++i) f();
  CK(cudaStreamSynchronize(s));
  std::vector<float> t;
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(a, s));
    f();
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}
void row(const char* what, int64_t L, double ms, double flops) {
  std::printf("%-44s L=%-5lld %9.3f ms %7.1f TFLOP/s\n", what, (long long)L, ms, flops / (ms * 1e-3) / 1e12);
}
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Attention routes on one GPU: Talon's tensor-core kernels vs cuDNN's fused attention"};
  std::vector<int64_t> lens{2048, 4096};
  int64_t seqs = 4, nh = 32, nkv = 8, hd = 128, mla_heads = 64;
  int reps = 20;
  app.add_option("--seq-len", lens, "rows per sample")->delimiter(',');
  app.add_option("--seqs", seqs, "samples per batch")->capture_default_str();
  app.add_option("--heads", nh)->capture_default_str();
  app.add_option("--kv-heads", nkv)->capture_default_str();
  app.add_option("--head", hd)->capture_default_str();
  app.add_option("--mla-heads", mla_heads, "MLA heads (0: skip)")->capture_default_str();
  app.add_option("--reps", reps)->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  std::string why;
  const bool have_cudnn = cuda::cudnn_sdpa_available(&why);
  if (!have_cudnn) std::printf("cuDNN: not available (%s); Talon's kernels only\n", why.c_str());
  else std::printf("cuDNN %lld\n", (long long)cuda::cudnn_version());
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  try {
    for (int64_t L : lens) {
      const int64_t N = L * seqs;
      std::vector<int64_t> ss;
      for (int64_t i = 0; i <= seqs; ++i) ss.push_back(i * L);
      int64_t* d_ss = dalloc<int64_t>(ss.size());
      CK(cudaMemcpy(d_ss, ss.data(), ss.size() * 8, cudaMemcpyHostToDevice));
      const double pairs = double(seqs) * double(L) * double(L + 1) / 2;  // causal (query, key) pairs
      const std::vector<int32_t> tiles = cuda::attention_tiles(ss.data(), seqs);
      int32_t* d_tiles = dalloc<int32_t>(tiles.size());
      CK(cudaMemcpy(d_tiles, tiles.data(), tiles.size() * 4, cudaMemcpyHostToDevice));
      // ---- prefill GQA on the fused qkv buffer
      {
        const int64_t ld = (nh + 2 * nkv) * hd;
        auto* qkv = random_bf16(size_t(N * ld), 1);
        auto* out = dalloc<__nv_bfloat16>(size_t(N * nh * hd));
        const double fl = 2.0 * pairs * double(nh) * double(2 * hd) * 1.0;
        row("prefill GQA, Talon (attention.cu)", L, time_ms(s, reps, [&] {
              cuda::flash_attention_forward(out, qkv, ld, d_ss, d_tiles, int64_t(tiles.size() / 2), nh, nkv, hd, 0, s);
            }), fl);
        if (have_cudnn) {
          cuda::SdpaShape sh{int(nh), int(nkv), int(hd), float(1 / std::sqrt(double(hd))), N};
          sh.ld_q = sh.ld_k = sh.ld_v = ld;
          sh.backward = false;
          cuda::CudnnSdpa att(sh, s);
          att.set_batch(ss, d_ss);
          row("prefill GQA, cuDNN", L,
              time_ms(s, reps, [&] { att.forward(out, nullptr, qkv, qkv + nh * hd, qkv + (nh + nkv) * hd); }), fl);
        }
        CK(cudaFree(qkv));
        CK(cudaFree(out));
      }
      // ---- prefill MLA (heads of 192 over values of 128, padded qkv buffer)
      if (mla_heads > 0) {
        const int64_t H = mla_heads, qk = 192, vd = 128, ld = 3 * H * qk;
        auto* qkv = random_bf16(size_t(N * ld), 2);
        auto* att = dalloc<__nv_bfloat16>(size_t(N * H * qk));
        auto* attv = dalloc<__nv_bfloat16>(size_t(N * H * vd));
        const double fl = 2.0 * pairs * double(H) * double(qk + vd);
        row("prefill MLA 192/128, Talon (values padded to 192)", L, time_ms(s, reps, [&] {
              cuda::flash_attention_forward(att, qkv, ld, d_ss, d_tiles, int64_t(tiles.size() / 2), H, H, qk, 0, s);
            }), fl);
        if (have_cudnn) {
          cuda::SdpaShape sh{int(H), int(H), int(qk), float(1 / std::sqrt(double(qk))), N};
          sh.hd_v = int(vd);
          sh.ld_q = sh.ld_k = sh.ld_v = ld;
          sh.hs_v = qk;
          sh.backward = false;
          cuda::CudnnSdpa a(sh, s);
          a.set_batch(ss, d_ss);
          row("prefill MLA 192/128, cuDNN", L,
              time_ms(s, reps, [&] { a.forward(attv, nullptr, qkv, qkv + H * qk, qkv + 2 * H * qk); }), fl);
        }
        CK(cudaFree(qkv));
        CK(cudaFree(att));
        CK(cudaFree(attv));
      }
      // ---- the draft trainer's causal part: forward, and backward (dq + dkv)
      if (cuda::ttt_flash_supported(hd)) {
        const int64_t qd = nh * hd, kvd = nkv * hd;
        auto *q = random_bf16(size_t(N * qd), 3), *k = random_bf16(size_t(N * kvd), 4),
             *v = random_bf16(size_t(N * kvd), 5), *dO = random_bf16(size_t(N * qd), 6);
        auto* o32 = dalloc<float>(size_t(N * qd));
        auto* lse = dalloc<float>(size_t(N * nh));
        auto* Dd = dalloc<float>(size_t(N * nh));
        CK(cudaMemset(Dd, 0, size_t(N * nh) * 4));
        auto* dq = dalloc<float>(size_t(N * qd));
        auto *dk = dalloc<float>(size_t(N * kvd)), *dv = dalloc<float>(size_t(N * kvd));
        auto* part = dalloc<float>(size_t(2 * (nh / nkv) * N * kvd));
        std::vector<std::pair<int64_t, int64_t>> seqv;
        for (int64_t i = 0; i < seqs; ++i) seqv.push_back({i * L, L});
        const std::vector<int32_t> tt = cuda::ttt_flash_tiles(seqv);
        int32_t* d_tt = dalloc<int32_t>(tt.size());
        CK(cudaMemcpy(d_tt, tt.data(), tt.size() * 4, cudaMemcpyHostToDevice));
        const cuda::TttFlashArgs fa{q,  k,  v,         dO,      d_ss, d_tt, int64_t(tt.size() / 2), N, int(nh),
                                    int(nkv), int(hd), float(1 / std::sqrt(double(hd)))};
        const double fl = 2.0 * pairs * double(nh) * double(2 * hd);
        row("TTT causal forward, Talon (ttt_attention.cu)", L,
            time_ms(s, reps, [&] { cuda::ttt_flash_forward(o32, lse, fa, s); }), fl);
        row("TTT causal backward, Talon (dq + dkv)", L, time_ms(s, reps, [&] {
              cuda::ttt_flash_dq(dq, lse, Dd, fa, s);
              cuda::ttt_flash_dkv(dk, dv, part, lse, Dd, fa, s);
            }), 2.5 * fl);
        if (have_cudnn) {
          cuda::CudnnSdpa a({int(nh), int(nkv), int(hd), float(1 / std::sqrt(double(hd))), N}, s);
          a.set_batch(ss, d_ss);
          auto* ob = dalloc<__nv_bfloat16>(size_t(N * qd));
          auto *gq = dalloc<__nv_bfloat16>(size_t(N * qd)), *gk = dalloc<__nv_bfloat16>(size_t(N * kvd)),
               *gv = dalloc<__nv_bfloat16>(size_t(N * kvd));
          row("TTT causal forward, cuDNN", L, time_ms(s, reps, [&] { a.forward(ob, lse, q, k, v); }), fl);
          row("TTT causal backward, cuDNN (deterministic)", L,
              time_ms(s, reps, [&] { a.backward(gq, gk, gv, q, k, v, ob, dO, lse); }), 2.5 * fl);
          CK(cudaFree(ob));
          CK(cudaFree(gq));
          CK(cudaFree(gk));
          CK(cudaFree(gv));
        }
        for (void* p : {(void*)q, (void*)k, (void*)v, (void*)dO, (void*)o32, (void*)lse, (void*)Dd, (void*)dq,
                        (void*)dk, (void*)dv, (void*)part, (void*)d_tt})
          CK(cudaFree(p));
      }
      CK(cudaFree(d_ss));
      CK(cudaFree(d_tiles));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "talon_bench_attention: %s\n", e.what());
    return 1;
  }
  return 0;
}
