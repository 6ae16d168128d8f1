// Draft-training throughput on one GPU for a target shape (random weights and features):
// optimizer steps of packed samples through the same GpuDraftTrainer `talon train
// --device cuda` uses; reports tokens/s, the share of the FLOP roofline and device memory.
// The features lie in page-locked host memory, as `talon train` keeps them on a GPU (they
// upload straight from there); --staged puts them in ordinary memory, which the trainer
// first copies into its pinned staging.
//   talon_bench_train [--shape llama3-8b|kimi-k2|smollm2] [--seq 2048] [--samples 2] [--steps 6]
//                     [--math bf16|tf32|f32] [--ttt 7] [--draft-vocab 32000] [--peak-tflops 779]
//                     [--staged] [--drafter eagle3|peagle|dflash] [--draft-layers 5] [--block-size 16]
//                     [--max-anchors 512] [--dflash-loss ce|kl] [--dflash-weighting dpace|fixed-exp-decay]
//                     [--gpu-attention auto|flash|cudnn|blocks|loop] [--gpu-batch-embeddings]
//                     [--gpu-device-embeddings] [--trace FILE]
// --trace FILE: a CUPTI trace of the last step (not timed): the device's idle gaps, charged to the
// host CUDA call that overlaps each most (backend/trace_gaps.h), and a Chrome trace in FILE. The
// traced step starts with the device drained; --trace-warm starts the trace a step early and
// keeps what runs from the traced step's start on, as a timed step sees it (two steps untimed).
// --drafter peagle trains P-EAGLE with --ttt depths (COD ratio 0.7, floor 0.2), dflash the block
// drafter; bench/train_peer_families.py is their peer (speculators' own model classes).
#include <cuda_runtime.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cupti_trace.h"
#include "backend/trace_gaps.h"
#include "draft/draft_gpu.h"
#include "draft/trainer.h"
#include "util/error.h"
#include "util/file.h"

using namespace talon;
using namespace talon::eagle3;

int main(int argc, char** argv) {
  CLI::App app{"Draft training throughput on one GPU (random weights and features)"};
  std::string drafter = "eagle3", df_loss = "ce", df_weighting = "dpace";
  int64_t df_layers = 5, df_block = 16, df_anchors = 512;
  app.add_option("--drafter", drafter, "eagle3 | peagle | dflash")->capture_default_str();
  app.add_option("--draft-layers", df_layers, "dflash: decoder layers")->capture_default_str();
  app.add_option("--block-size", df_block, "dflash: block size")->capture_default_str();
  app.add_option("--max-anchors", df_anchors, "dflash: blocks per sample")->capture_default_str();
  app.add_option("--dflash-loss", df_loss, "dflash: ce | kl")->capture_default_str();
  app.add_option("--dflash-weighting", df_weighting, "dflash: dpace | fixed-exp-decay")->capture_default_str();
  std::string shape = "llama3-8b", math = "bf16";
  int64_t seq = 2048, samples = 2, steps = 6, vd = 32000;
  int ttt = 7, n_gpus = 1;
  double peak = 779;
  app.add_option("--shape", shape)->capture_default_str();
  app.add_option("--seq", seq)->capture_default_str();
  app.add_option("--samples", samples, "samples per optimizer step")->capture_default_str();
  app.add_option("--steps", steps)->capture_default_str();
  int64_t warmup = -1;
  app.add_option("--warmup", warmup,
                 "Steps left out of the timing (default: 2 when at least 4 are timed, else 1), after the timed "
                 "product rule's untimed steps");
  app.add_option("--math", math)->capture_default_str();
  app.add_option("--ttt", ttt)->capture_default_str();
  app.add_option("--draft-vocab", vd)->capture_default_str();
  app.add_option("--peak-tflops", peak, "dense bf16 peak of the GPU")->capture_default_str();
  app.add_option("--gpus", n_gpus, "data parallel over GPUs 0..n-1 (samples dealt in turn)")->capture_default_str();
  double share = 1.0, skew = 0.5;
  app.add_option("--loss-share", share,
                 "share of each sample's tokens that are loss-masked (answers), laid out as 512-token turns: "
                 "a prompt, then its answer; 1 = every token, the most work")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--head-skew", skew,
                 "scale of the target lm_head rows outside the draft vocab: below 1, the target's argmax "
                 "falls in the draft vocab (as with a trained target) instead of on random ids")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  bool staged = false, resident = false;
  app.add_flag("--staged", staged, "features in ordinary (pageable) host memory");
  bool whole_calls = false;
  app.add_flag("--whole-calls", whole_calls,
               "each step as run(), clip_grad_norm(), adamw_step(): two host syncs between the backward and the "
               "update (the default runs and clips in halves, as `talon train` steps)");
  GpuDraftOptions eng;  // the engine's options, as `talon train --gpu-*` sets them
  app.add_flag("--gpu-batch-embeddings", eng.batch_embeddings,
               "target embedding on the host, batch rows uploaded (the default where it applies)");
  app.add_flag("--gpu-device-embeddings", eng.device_embeddings, "the whole target embedding on the device");
  app.add_option("--gpu-attention", eng.attention, "auto | flash | cudnn | blocks | loop")->capture_default_str();
  app.add_flag("--gpu-fp32-operands", eng.fp32_operands, "bf16 math rounds fp32 operands inside cuBLAS");
  app.add_option("--gpu-logit-rows", eng.logit_rows, "rows of logits per chunk (0: as many as fit)");
  app.add_option("--gpu-attn-block", eng.attn_block, "blocks attention: causal key block (-1 default, 0 none)");
  app.add_flag("--gpu-lm-grad-in-backward", eng.lm_grad_in_backward, "lm_head backward in the backward pass");
  app.add_flag("--gpu-row-cut,!--gpu-all-rows", eng.row_cut,
               "steps after the first run only rows a later loss reads (default; --gpu-all-rows: every row)");
  app.add_flag("--gpu-fused-products,!--gpu-separate-products", eng.fused_products,
               "gate|up and the q|k|v backward as one product each (the default; --gpu-separate-products: one "
               "a matrix)");
  app.add_option("--gpu-products", eng.products,
                 "auto | cublas | first | waves | timed (who picks each product's algorithm)")
      ->capture_default_str();
  app.add_flag("--gpu-fresh-grads,!--gpu-zeroed-grads", eng.fresh_grads,
               "each weight matrix's first gradient product of a step writes it (no memset of the whole "
               "gradient; the default); --gpu-zeroed-grads zeroes the whole gradient first");
  app.add_flag("--gpu-cudnn-head-groups", eng.cudnn_head_groups,
               "cuDNN's attention backward in head groups where its workspace would not fit the lent memory");
  app.add_flag("--gpu-fused-rope,!--gpu-separate-rope", eng.fused_rope_rows,
               "RoPE, row moves and casts of q, k, v and their gradients in one kernel each (the default)");
  app.add_flag("--gpu-qkv-forward,!--gpu-no-qkv-forward", eng.qkv_forward_product,
               "with --gpu-fused-rope and fused products: the forward's q, k, v as one product");
  app.add_flag("--gpu-diag-registers,!--gpu-no-diag-registers", eng.diag_rows_in_registers,
               "the diagonal keys' merge and backward with their rows in registers, loaded ahead (the "
               "default); --gpu-no-diag-registers: a load at a time");
  app.add_flag("--gpu-profile", eng.profile, "GPU time per phase");
  app.add_flag("--resident", resident,
               "features in device memory (as the PyTorch peer keeps them), copied device to device; the "
               "memory figure includes them");
  std::string trace_file;
  app.add_option("--trace", trace_file,
                 "CUPTI trace of the last step: the device's idle gaps and what the host did in them, and a Chrome "
                 "trace (JSON) in this file");
  bool trace_warm = false;
  app.add_flag("--trace-warm", trace_warm,
               "--trace: start the trace a step early, without draining the device, and keep what runs from the "
               "traced step's start on (the interval a timed step measures); neither step is timed");
  CLI11_PARSE(app, argc, argv);
  try {
    DraftConfig c;
    if (shape == "llama3-8b") {
      c.H = 4096, c.I = 14336, c.n_heads = 32, c.n_kv_heads = 8, c.head_dim = 128, c.V = 128256;
      c.rope.theta = 500000;
    } else if (shape == "kimi-k2") {  // the draft talon train makes for Kimi-K2 (docs/deepseek.md)
      c.H = 7168, c.I = 18432, c.n_heads = 64, c.n_kv_heads = 64, c.head_dim = 128, c.V = 163840;
      c.rope.theta = 50000;
    } else if (shape == "smollm2") {
      c.H = 576, c.I = 1536, c.n_heads = 9, c.n_kv_heads = 3, c.head_dim = 64, c.V = 49152;
      c.rope.theta = 100000;
    } else {
      fail("--shape {}: expected llama3-8b, kimi-k2 or smollm2", shape);
    }
    c.Vd = std::min(vd, c.V);
    c.ttt_steps = ttt;
    std::mt19937 rng(1);
    std::normal_distribution<float> nd(0.f, 1.f);
    auto fill = [&](std::vector<float>& v, size_t n, float sd) {
      v.resize(n);
      for (auto& x : v) x = sd * nd(rng);
    };
    const size_t H = size_t(c.H);
    std::vector<float> embed, head, fnorm(H, 1.f);
    fill(embed, size_t(c.V) * H, 0.02f);
    fill(head, size_t(c.V) * H, 0.02f);
    std::vector<int64_t> counts(size_t(c.V), 0);
    const int64_t N = seq * samples;
    std::vector<int32_t> ids(static_cast<size_t>(N));
    std::vector<uint8_t> mask(static_cast<size_t>(N), 1);
    constexpr int64_t kTurn = 512;  // prompt rows, then answer rows, in each turn
    const int64_t prompt = int64_t(std::llround(double(kTurn) * (1.0 - share)));
    for (int64_t n = 0; n < N; ++n) mask[size_t(n)] = uint8_t((n % seq) % kTurn >= prompt);
    for (auto& x : ids) {
      x = int32_t(rng() % uint32_t(c.V));
      counts[size_t(x)]++;
    }
    const auto features = [&](size_t n) {
      std::shared_ptr<float[]> p = host_floats(n, !staged);
      for (size_t i = 0; i < n; ++i) p[i] = nd(rng);
      return p;
    };
    const std::shared_ptr<float[]> aux = features(size_t(N) * 3 * H), hid = features(size_t(N) * H);
    const DraftVocab dv = build_draft_vocab(counts, c.Vd);
    for (int64_t v = 0; v < c.V; ++v)
      if (!dv.t2d[size_t(v)])
        for (size_t j = 0; j < H; ++j) head[size_t(v) * H + j] *= float(skew);
    DraftWeights w;
    const size_t qd = size_t(c.n_heads * c.head_dim), kvd = size_t(c.n_kv_heads * c.head_dim);
    fill(w.fc, H * 3 * H, 0.02f);
    fill(w.wq, qd * 2 * H, 0.02f);
    fill(w.wk, kvd * 2 * H, 0.02f);
    fill(w.wv, kvd * 2 * H, 0.02f);
    fill(w.wo, H * qd, 0.02f);
    fill(w.gate, size_t(c.I) * H, 0.02f);
    fill(w.up, size_t(c.I) * H, 0.02f);
    fill(w.down, H * size_t(c.I), 0.02f);
    fill(w.lm_head, size_t(c.Vd) * H, 0.02f);
    for (auto* v : {&w.in_ln, &w.hidden_norm, &w.post_ln, &w.norm}) v->assign(H, 1.f);
    std::vector<int> devices;
    for (int g = 0; g < n_gpus; ++g) devices.push_back(g);
    size_t free0 = 0, total = 0;
    cudaMemGetInfo(&free0, &total);
    // --resident: the features in device memory (counted in the memory figure, as the peer's are).
    float *aux_d = nullptr, *hid_d = nullptr;
    if (resident) {
      const size_t na = size_t(N) * 3 * H, nh = size_t(N) * H;
      if (cudaMalloc(&aux_d, na * 4) != cudaSuccess || cudaMalloc(&hid_d, nh * 4) != cudaSuccess)
        fail("--resident: could not allocate {:.1f} GiB of features on the device", double(na + nh) * 4 / (1 << 30));
      if (cudaMemcpy(aux_d, aux.get(), na * 4, cudaMemcpyHostToDevice) != cudaSuccess ||
          cudaMemcpy(hid_d, hid.get(), nh * 4, cudaMemcpyHostToDevice) != cudaSuccess)
        fail("--resident: could not copy the features to the device");
    }
    const float* aux_p = resident ? aux_d : aux.get();
    const float* hid_p = resident ? hid_d : hid.get();
    GpuFamily fam;
    fam.drafter = drafter;
    fam.mask_token = int32_t(c.V - 1);
    fam.cod = {c.ttt_steps, 0.7, 0.2};
    std::vector<float> mask_hidden, pe_embed;
    dflash::Weights dw;
    if (drafter == "dflash") {
      dflash::Config& d = fam.dflash;
      d.H = c.H, d.I = c.I, d.n_heads = c.n_heads, d.n_kv_heads = c.n_kv_heads, d.head_dim = c.head_dim, d.V = c.V;
      d.Vd = c.Vd, d.rms_eps = 1e-6, d.rope = c.rope, d.layers = df_layers, d.n_aux = 3, d.block = df_block;
      if (df_loss != "ce" && df_loss != "kl") fail("--dflash-loss {}: expected ce or kl", df_loss);
      if (df_weighting != "dpace" && df_weighting != "fixed-exp-decay")
        fail("--dflash-weighting {}: expected dpace or fixed-exp-decay", df_weighting);
      d.loss = df_loss == "ce" ? dflash::Config::Loss::CE : dflash::Config::Loss::KL;
      d.weighting = df_weighting == "dpace" ? dflash::Config::Weighting::DPace : dflash::Config::Weighting::ExpDecay;
      fam.max_anchors = df_anchors;
      fill(dw.fc, H * 3 * H, 0.02f);
      dw.hidden_norm.assign(H, 1.f);
      dw.layers.resize(size_t(df_layers));
      for (auto& L : dw.layers) {
        fill(L.wq, qd * H, 0.02f);
        fill(L.wk, kvd * H, 0.02f);
        fill(L.wv, kvd * H, 0.02f);
        fill(L.wo, H * qd, 0.02f);
        fill(L.gate, size_t(c.I) * H, 0.02f);
        fill(L.up, size_t(c.I) * H, 0.02f);
        fill(L.down, H * size_t(c.I), 0.02f);
        for (auto* v : {&L.in_ln, &L.post_ln}) v->assign(H, 1.f);
        for (auto* v : {&L.q_norm, &L.k_norm}) v->assign(size_t(c.head_dim), 1.f);
      }
      dw.norm.assign(H, 1.f);
      dw.lm_head.resize(size_t(c.Vd) * H);
      for (int64_t v = 0; v < c.Vd; ++v)
        std::copy(head.begin() + dv.kept[size_t(v)] * int64_t(H), head.begin() + (dv.kept[size_t(v)] + 1) * int64_t(H),
                  dw.lm_head.begin() + v * int64_t(H));
    } else if (drafter == "peagle") {
      fill(mask_hidden, 3 * H, 1.f);
      pe_embed = embed;
    } else if (drafter != "eagle3") {
      fail("--drafter {}: expected eagle3, peagle or dflash", drafter);
    }
    auto gpu = make_gpu_draft_trainer(c, {embed.data(), fnorm.data(), head.data(), 1e-5}, dv, devices, parse_gpu_math(math), N, {},
                                      eng, fam);
    if (drafter == "eagle3") {
      gpu->set_weights(w);
    } else if (drafter == "peagle") {
      GpuDraftTrainer::Named named;
      for (auto& [n, v] : w.named()) named.emplace_back(n, v);
      named.emplace_back("mask_hidden", &mask_hidden);
      named.emplace_back("embed", &pe_embed);
      gpu->set_tensors(named);
    } else {
      GpuDraftTrainer::Named named = {{"fc", &dw.fc}, {"hidden_norm", &dw.hidden_norm}};
      for (size_t l = 0; l < dw.layers.size(); ++l)
        for (auto& [n, v] : dw.layers[l].named()) named.emplace_back(fmt::format("layers.{}.{}", l, n), v);
      named.emplace_back("norm", &dw.norm);
      named.emplace_back("lm_head", &dw.lm_head);
      gpu->set_tensors(named);
    }
    std::vector<Sample> batch;
    for (int64_t s = 0; s < samples; ++s)
      batch.push_back({ids.data() + s * seq, mask.data() + s * seq, aux_p + s * seq * 3 * c.H,
                       hid_p + s * seq * c.H, seq});
    train::OptimConfig oc;
    // A step is timed from the previous step's return to its own: the optimizer's update is not
    // waited for (the host prepares the next batch meanwhile, as `talon train` does), so in the
    // steady state each interval holds one whole step of device work. The first step warms
    // cuBLAS up and ends with the device drained; the second, which then starts with nothing in
    // flight, is left out too when at least two others are timed. A traced step is never timed.
    // Before all of them: the timed product rule (--gpu-products auto, the default with bf16
    // operands, or timed) times its candidates in a run's first steps; those steps run untimed
    // until every family of products has its choice (at most 40).
    // One optimizer step on the batch: in halves as `talon train` steps (the update enqueued
    // before the results are read), or as three whole calls (--whole-calls).
    const auto train_step = [&](const std::vector<uint64_t>& seeds, int64_t t) {
      std::vector<TttResult> res;
      if (whole_calls) {
        res = gpu->run(batch, 1.0 / double(samples), true, true, seeds);
        gpu->clip_grad_norm(0.5);
        gpu->adamw_step(oc, t);
      } else {
        gpu->run_start(batch, 1.0 / double(samples), true, true, seeds);
        gpu->clip_grad_norm_start(0.5);
        gpu->adamw_step(oc, t);
        res = gpu->run_finish();
        gpu->grad_norm();
      }
      return res;
    };
    int64_t settle = 0;
    for (; (eng.products == "auto" || eng.products == "timed") && settle < 40; ++settle) {
      const ProductPlans pp = gpu->product_plans();
      if (settle > 0 && (pp.families == 0 || pp.checking + pp.timing == 0)) break;
      std::vector<uint64_t> seeds;
      for (int64_t s = 0; s < samples; ++s) seeds.push_back(9000000ull + uint64_t(settle) * 1000003ull + uint64_t(s));
      train_step(seeds, settle);
    }
    if (const ProductPlans pp = gpu->product_plans(); pp.families > 0)
      std::printf("%lld untimed steps first, while the timed product rule chose (%lld of %lld families left)\n",
                  (long long)settle, (long long)(pp.checking + pp.timing), (long long)pp.families);
    cudaDeviceSynchronize();
    const int64_t untraced = trace_file.empty() ? steps : trace_warm ? steps - 2 : steps - 1;
    const int64_t first_timed = warmup >= 1 ? warmup : untraced >= 4 ? 2 : 1;
    std::vector<double> times;
    double step_flops = 0;  // of the linear products enqueued in the last step
    // the engine's counters run from its start; the settle steps above are left out of these
    const int64_t row_steps0 = gpu->row_steps(), cudnn_batches0 = gpu->cudnn_batches();
    int64_t row_steps_first = 0;  // of step 0 alone
    auto t_prev = std::chrono::steady_clock::now();
    std::unique_ptr<cuda::CuptiTrace> trace;
    uint64_t trace_from = 0;  // --trace-warm: the traced step's start on CUPTI's clock
    for (int64_t st = 0; st < steps; ++st) {
      const double flops0 = gpu->product_flops();
      if (st == untraced) {  // drained first, unless the trace starts a step early (--trace-warm)
        if (!trace_warm) cudaDeviceSynchronize();
        trace = std::make_unique<cuda::CuptiTrace>();
      }
      const bool traced = trace && st == steps - 1;
      if (traced && trace_warm) trace_from = cuda::CuptiTrace::now();
      std::vector<uint64_t> seeds;
      for (int64_t s = 0; s < samples; ++s) seeds.push_back(uint64_t(st) * 1000003ull + uint64_t(s));
      const std::vector<TttResult> res = train_step(seeds, st);
      const auto t1 = std::chrono::steady_clock::now();
      const double dt = std::chrono::duration<double>(t1 - t_prev).count();
      t_prev = t1;
      step_flops = gpu->product_flops() - flops0;
      if (traced) {  // not among the timed steps: tracing slows the host down
        cudaDeviceSynchronize();
        std::vector<TraceEvent> ev = trace->stop();
        trace.reset();
        if (trace_warm) {
          ev = events_from(ev, trace_from);
          uint64_t first = UINT64_MAX;
          for (const TraceEvent& e : ev)
            if (on_device(e.kind)) first = std::min(first, e.start);
          const std::string at_start = first == UINT64_MAX   ? "ran nothing"
                                       : first == trace_from ? "was busy when it began"
                                                             : fmt::format("idled {:.1f} us before its first event",
                                                                           double(first - trace_from) / 1e3);
          std::printf("trace from the step's start (--trace-warm): the device %s\n", at_start.c_str());
        }
        std::printf("trace of step %lld (%zu events):\n%s", (long long)st, ev.size(),
                    format_gap_report(analyze_gaps(ev)).c_str());
        // cuBLAS's kernels (nvjet, *gemm*), the attention's own left out: the products' rate.
        double gemm_ns = 0;
        for (const TraceEvent& e : ev) {
          const std::string& k = e.name;
          const bool blas = k.find("nvjet") != std::string::npos || k.find("gemm") != std::string::npos;
          const bool attn = k.find("sdpa") != std::string::npos || k.find("fmha") != std::string::npos ||
                            k.find("flash") != std::string::npos;
          if (e.kind == TraceEvent::Kind::Kernel && blas && !attn) gemm_ns += double(e.end - e.start);
        }
        if (gemm_ns > 0 && step_flops > 0)
          std::printf("traced products: %.1f ms of cuBLAS kernels for %.2f TFLOP: %.0f TFLOP/s\n", gemm_ns / 1e6,
                      step_flops / 1e12, step_flops / (gemm_ns * 1e-9) / 1e12);
        write_file_atomic(trace_file, chrome_trace_json(ev));
      } else if (st >= first_timed && st < untraced) {
        times.push_back(dt);
      }
      if (st == 0) {
        cudaDeviceSynchronize();
        row_steps_first = gpu->row_steps() - row_steps0;
        t_prev = std::chrono::steady_clock::now();
      }
      std::printf("step %lld: %.3f s, loss %.4f\n", (long long)st, dt, res[0].loss);
      if (st == 0) {
        int64_t n0 = 0, masked = 0;
        for (auto& r : res) n0 += r.n_k.empty() ? 0 : r.n_k[0];
        for (auto m : mask) masked += m;
        std::printf("loss-masked rows %.1f%%; rows in step 0's loss (masked, target argmax in the draft vocab) %.1f%%\n",
                    100.0 * double(masked) / double(N), 100.0 * double(n0) / double(N));
        if (row_steps_first > 0)  // EAGLE-3 and P-EAGLE count them
          std::printf(
              "rows run through the draft's layer: %.1f%% of N x K (--gpu-row-cut leaves out the rows no "
              "later loss reads)\n",
              100.0 * double(row_steps_first) / double(N * c.ttt_steps));
      }
    }
    if (step_flops > 0)  // what the engine ran, cut rows left out (the per-token count below is the full work)
      std::printf("linear products run in the last step: %.2f TFLOP (%.1f GFLOP a token)\n", step_flops / 1e12,
                  step_flops / 1e9 / double(N));
    std::printf("batches through cuDNN's attention: %lld of %lld\n", (long long)(gpu->cudnn_batches() - cudnn_batches0),
                (long long)steps);
    if (const ProductPlans pp = gpu->product_plans(); pp.families > 0)
      std::printf("products through cuBLASLt (%s): %lld shapes, %lld families, %lld decided (%lld of them on another "
                  "candidate than the first), %lld checking, %lld timing\n",
                  eng.products.c_str(), (long long)pp.shapes, (long long)pp.families, (long long)pp.decided,
                  (long long)pp.moved, (long long)pp.checking, (long long)pp.timing);
    else if (pp.shapes > 0)
      std::printf("products through cuBLASLt (%s): %lld shapes, %lld of them off its first candidate\n",
                  eng.products.c_str(), (long long)pp.shapes, (long long)pp.moved);
    double prof_total = 0;
    for (auto& [name, ms] : gpu->profile()) prof_total += ms;
    for (auto& [name, ms] : gpu->profile())
      std::printf("  %-42s %9.1f ms  %5.1f%%\n", name.c_str(), ms, 100 * ms / prof_total);
    size_t free1 = 0;
    cudaMemGetInfo(&free1, &total);
    // Useful FLOPs per token (as bench/train_peer.py counts them): each TTT step runs the layer
    // (q,k,v,o, gate/up/down) and the lm_head forward (2 flop per weight) and backward (4);
    // fc forward and weight gradient (4); the target head (V x H) forward once. Attention and
    // any recomputation are not counted.
    const double layer = double(qd * 2 * H + 2 * kvd * 2 * H + H * qd + 3 * size_t(c.I) * H);
    const double lm = double(size_t(c.Vd) * H);
    const double per_tok = double(c.ttt_steps) * (6 * layer + 6 * lm) + 4 * double(H * 3 * H) + 2 * double(size_t(c.V) * H);
    if (times.empty())
      fail(
          "--steps must exceed the steps left out (--warmup, at least 1), one more with --trace, two with "
          "--trace-warm");
    std::sort(times.begin(), times.end());
    const size_t nt = times.size();
    const double med = nt % 2 ? times[nt / 2] : 0.5 * (times[nt / 2 - 1] + times[nt / 2]);
    const double tps = double(N) / med;
    if (drafter != "eagle3") {  // the FLOP count below is EAGLE-3's
      std::printf("drafter %s, shape %s seq %lld x %lld samples, math %s, %d GPU(s): %.0f tokens/s (median of %zu "
                  "steps, %.1f ms a step); device memory %.1f GiB (buffers %.1f GiB)\n",
                  drafter.c_str(), shape.c_str(), (long long)seq, (long long)samples, math.c_str(), n_gpus, tps, nt,
                  1000 * med, double(free0 - free1) / double(1 << 30), double(gpu->device_bytes()) / double(1 << 30));
      return 0;
    }
    std::printf("shape %s seq %lld x %lld samples, K=%d, math %s, %d GPU(s): %.0f tokens/s (median of %zu steps), "
                "%.1f GFLOP/token (no "
                "attention), %.1f%% of %.0f TFLOP/s per GPU; device memory %.1f GiB (buffers %.1f GiB)\n",
                shape.c_str(), (long long)seq, (long long)samples, c.ttt_steps, math.c_str(), n_gpus, tps, nt,
                per_tok / 1e9,
                100 * tps * per_tok / (peak * 1e12 * n_gpus), peak, double(free0 - free1) / double(1 << 30),
                double(gpu->device_bytes()) / double(1 << 30));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
