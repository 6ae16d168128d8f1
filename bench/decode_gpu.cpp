// Cached decoding throughput on one GPU (make_cuda_decoder): steps of one new token for
// each of B slots at a given committed context, for several B; also one real prefill and
// tree verification. Random bf16 weights of a target shape built in memory (no files), or
// a real checkpoint with --model. Slot contexts are set without computing them
// (cuda::decoder_assume_length): the cache holds a constant fill, which costs the
// attention the same reads as real keys.
// With --draft-vocab > 0, also the EAGLE-3 draft layer of that shape on the GPU (random
// weights, the target's sizes): one step-0 row and tree steps of 1, 8 and 10 nodes at this
// context, and the batch-1 speedup those costs and the verify costs allow at a given mean
// acceptance length tau: tau x (one-token step) / (verify + draft steps of one round).
// --model random:kimi-k2:LAYERS[:bf16] runs the DeepSeek-family decoder (absorbed MLA over a
// latent cache, MoE) at the Kimi-K2 layer shapes; its floor counts the weights a step touches:
// every dense matrix, and per MoE layer the routed experts B slots x top-k picks reach when
// routing is uniform (E (1 - (1 - k/E)^B) of them), plus the latent cache.
//   talon_bench_decode [--shape llama3-8b|smollm2] [--model PATH] [--context 2048]
//                      [--batches 1,32,256] [--steps 16] [--tree 32] [--draft-vocab 32000] [--trace FILE]
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <random>
#include <string>

#include "backend/backend.h"
#include "backend/cuda/cuda_decoder.h"
#include "backend/cuda/cupti_trace.h"
#include "backend/cuda/graph_cache.h"
#include "backend/trace_gaps.h"
#include "draft/draft_runner.h"
#include "draft/export.h"
#include "model/checkpoint.h"
#include "model/decode.h"
#include "model/random_checkpoint.h"
#include "model/sampling.h"
#include "util/error.h"
#include "util/file.h"

using namespace talon;

namespace {

ModelConfig shape_config(const std::string& shape) {
  ModelConfig c;
  c.arch = Arch::Llama;
  if (shape == "llama3-8b") {
    c.n_layers = 32, c.hidden = 4096, c.intermediate = 14336, c.n_heads = 32, c.n_kv_heads = 8, c.head_dim = 128;
    c.vocab = 128256, c.rope.theta = 500000, c.rms_eps = 1e-5;
  } else if (shape == "smollm2") {
    c.n_layers = 30, c.hidden = 576, c.intermediate = 1536, c.n_heads = 9, c.n_kv_heads = 3, c.head_dim = 64;
    c.vocab = 49152, c.rope.theta = 100000, c.rms_eps = 1e-5, c.tied_embeddings = true;
  } else {
    fail("--shape {}: expected llama3-8b or smollm2", shape);
  }
  c.max_position = 131072;
  return c;
}

// Sizes each named tensor by its shape and fills it: uniform weights of variance 1/fan_in from a
// fast generator (the 8B shape has 425M of them), norms (1-D tensors) 1.
template <class Named>
void fill_random(const Named& named, const std::vector<std::vector<int64_t>>& shapes, uint64_t x) {
  for (size_t i = 0; i < named.size(); ++i) {
    int64_t n = 1;
    for (auto d : shapes[i]) n *= d;
    named[i].second->resize(size_t(n));
    const float a = shapes[i].size() == 1 ? 0.f : float(std::sqrt(3.0 / double(shapes[i][1])));
    for (auto& w : *named[i].second) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      w = shapes[i].size() == 1 ? 1.f : a * (float(x >> 40) / float(1 << 24) * 2.f - 1.f);
    }
  }
}

// A random EAGLE-3 draft with the target's sizes (fill_random).
spec::DraftModel random_draft(const ModelConfig& tc, int64_t Vd) {
  spec::DraftModel m;
  m.config = eagle3::draft_config_for(tc, Vd);
  const auto& c = m.config;
  fill_random(m.weights.named(), train::draft_weight_shapes(c), 88172645463325252ull);
  std::vector<int64_t> counts(size_t(c.V), 1);
  m.vocab = eagle3::build_draft_vocab(counts, c.Vd);
  m.aux_layer_ids = {2, tc.n_layers / 2, tc.n_layers - 3};
  return m;
}

// A random DFlash draft (dflash.h) on the target's sizes: `layers` layers, blocks of `block`.
spec::DraftModel random_dflash(const ModelConfig& tc, int64_t Vd, int64_t layers, int64_t block) {
  spec::DraftModel m = random_draft(tc, Vd);
  m.drafter = "dflash";
  m.mask_token = int32_t(tc.vocab - 1);
  dflash::Config& c = m.dflash;
  c.H = m.config.H, c.I = m.config.I, c.n_heads = m.config.n_heads, c.n_kv_heads = m.config.n_kv_heads;
  c.head_dim = m.config.head_dim, c.V = m.config.V, c.Vd = m.config.Vd, c.rms_eps = m.config.rms_eps;
  c.rope = m.config.rope, c.layers = layers, c.block = block, c.n_aux = 3;
  fill_random(train::dflash_named(m.dweights, c), train::dflash_weight_shapes(c), 1181783497276652981ull);
  return m;
}

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Cached decoding throughput on one GPU (make_cuda_decoder)"};
  std::string shape = "llama3-8b", model_path;
  int64_t context = 2048, steps = 16, tree = 32, draft_vocab = 0;
  std::vector<int> batches{1, 32, 256};
  double bandwidth_tbs = 0;
  app.add_option("--shape", shape, "random weights of this shape")->capture_default_str();
  app.add_option("--model", model_path, "a real checkpoint instead (HF directory or .gguf)");
  app.add_option("--bandwidth", bandwidth_tbs,
                 "memory bandwidth (TB/s) of the floor (default: the card's own, memory clock x bus width)");
  app.add_option("--context", context, "committed tokens per slot")->capture_default_str();
  app.add_option("--batches", batches, "slots decoding at once")->delimiter(',');
  app.add_option("--steps", steps, "timed steps per batch size (0: no batch table)")->capture_default_str();
  std::vector<int64_t> verify_tokens = {1, 2, 4, 6, 8, 16, 32, 64};
  app.add_option("--verify-tokens", verify_tokens, "pending-token counts of the batch-1 verify table")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--tree", tree, "tree size per slot for the verification case (0: skip)")->capture_default_str();
  int64_t dflash_layers = 0, dflash_block = 16;
  app.add_option("--dflash-layers", dflash_layers, "also time a DFlash draft of this many layers (0: skip)");
  app.add_option("--dflash-block", dflash_block, "its block size")->capture_default_str();
  app.add_option("--draft-vocab", draft_vocab, "time an EAGLE-3 draft layer with this draft vocabulary (0: skip)")
      ->capture_default_str();
  bool contiguous_pages = false;
  app.add_flag("--contiguous-pages", contiguous_pages,
               "leave each slot's cache pages in one run (default: interleaved across slots, as in generate)");
  int64_t accept_k = 3;
  app.add_option("--accept-chain", accept_k,
                 "time a sampled chain of this many draft tokens decided on the host and on the device (0: skip)")
      ->capture_default_str();
  int tp = 1, ep = 1;
  bool share = false;
  app.add_option("--tp", tp, "tensor-parallel ranks on GPUs 0..tp-1 (DeepSeek family)")->capture_default_str();
  app.add_option("--ep", ep, "expert-parallel ranks on GPUs 0..ep-1 (DeepSeek family)")->capture_default_str();
  app.add_flag("--share-gpus", share, "every --tp rank on GPU 0 (device-copy collectives)");
  std::string trace_file;
  std::vector<int64_t> graph_layers;
  app.add_option("--graph-layers", graph_layers,
                 "also time greedy graph steps at the first batch size with the graph in parts of n layers, "
                 "for each n (0: one graph; TALON_CUDA_GRAPH_LAYERS sets the tables' own)")
      ->delimiter(',');
  app.add_option("--trace", trace_file,
                 "CUPTI trace of 3 greedy steps at the first batch size (after its timing): the device's idle gaps "
                 "by host cause, and a Chrome trace in this file");
  CLI11_PARSE(app, argc, argv);
  try {
    const double t0 = now();
    std::unique_ptr<Checkpoint> ck =
        model_path.empty()                    ? make_random_checkpoint(shape_config(shape))
        : is_random_model_spec(model_path) ? open_random_model_spec(model_path)
                                           : open_checkpoint(model_path);
    const ModelConfig& c = ck->config();
    const int n_slots = *std::max_element(batches.begin(), batches.end());
    const int64_t max_len = context + std::max<int64_t>({steps + 2, tree, 64}) + 1;
    GpuOptions go;
    go.tp = tp;
    go.ep = ep;
    go.share_devices = share;
    go.devices.clear();
    for (int r = 0; r < tp * ep; ++r) go.devices.push_back(share ? 0 : r);
    // The main decoder decides sampled chains on the host (TALON_CUDA_ACCEPT=0): the reference
    // column of the chain-round figure below.
    setenv("TALON_CUDA_ACCEPT", "0", 1);
    auto dec = make_cuda_decoder(*ck, go, n_slots, max_len);
    unsetenv("TALON_CUDA_ACCEPT");
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, 0);
    std::printf("%s on %s (%s): %lld layers, H %lld, %lld/%lld heads x %lld, V %lld; %d slots x %lld tokens (setup %.1fs)\n",
                model_path.empty() ? ("random " + shape).c_str() : model_path.c_str(), prop.name, dec->backend().c_str(),
                (long long)c.n_layers, (long long)c.hidden, (long long)c.n_heads, (long long)c.n_kv_heads,
                (long long)c.head_dim, (long long)c.vocab, n_slots, (long long)max_len, now() - t0);
    // The floor's bandwidth: the card's (H100 SXM 3.35 TB/s, H200 4.8), and what a device copy
    // gets, measured here for scale.
    int clock_khz = 0, bus_bits = 0;
    cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, 0);
    cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, 0);
    const double card_bw = 2.0 * double(clock_khz) * 1e3 * double(bus_bits) / 8.0;
    const double bw = bandwidth_tbs > 0 ? bandwidth_tbs * 1e12 : card_bw > 0 ? card_bw : 4.8e12;
    {
      const size_t n = size_t(1) << 30;
      void *a = nullptr, *b = nullptr;
      cudaEvent_t e0 = nullptr, e1 = nullptr;
      float best = 0;
      if (cudaMalloc(&a, n) == cudaSuccess && cudaMalloc(&b, n) == cudaSuccess && cudaEventCreate(&e0) == cudaSuccess &&
          cudaEventCreate(&e1) == cudaSuccess)
        for (int i = 0; i < 6; ++i) {
          cudaEventRecord(e0);
          cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice);
          cudaEventRecord(e1);
          cudaEventSynchronize(e1);
          float ms = 0;
          cudaEventElapsedTime(&ms, e0, e1);
          if (i > 0 && (best == 0 || ms < best)) best = ms;  // the first is left out
        }
      const std::string copy = best > 0 ? fmt::format("{:.2f} TB/s", 2.0 * double(n) / (double(best) * 1e-3) / 1e12)
                                        : "(no room to measure)";
      std::printf(
          "memory bandwidth: the card's %.2f TB/s (clock x bus); a 1 GiB device copy moves %s; the floor below "
          "uses %.2f TB/s\n",
          card_bw / 1e12, copy.c_str(), bw / 1e12);
      if (e0) cudaEventDestroy(e0);
      if (e1) cudaEventDestroy(e1);
      cudaFree(a);
      cudaFree(b);
      cudaGetLastError();
    }
    // Bytes a decode step must read: every matrix once (the embedding is only gathered, so
    // the LM head counts once, tied or not) plus each slot's cached keys and values.
    const double weight_bytes = 2.0 * double(c.vocab * c.hidden +
                                             c.n_layers * (c.hidden * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim +
                                                           c.n_heads * c.head_dim * c.hidden + 3 * c.hidden * c.intermediate));
    double kv_per_token = 2.0 * 2 * double(c.n_layers * c.n_kv_heads * c.head_dim);
    // The DeepSeek family: weight bytes touched by a step of B slots (see the top).
    std::function<double(int)> step_weight_bytes = [&](int) { return weight_bytes; };
    if (is_deepseek(c.arch)) {
      const DeepseekConfig& d = c.ds;
      const double qk = double(d.qk_head_dim()), nh = double(c.n_heads), H = double(c.hidden);
      const double attn = (d.q_lora_rank > 0 ? H * double(d.q_lora_rank) + double(d.q_lora_rank) * nh * qk : H * nh * qk) +
                          H * double(d.kv_lora_rank + d.qk_rope_head_dim) +
                          double(d.kv_lora_rank) * nh * double(d.qk_nope_head_dim + d.v_head_dim) +
                          nh * double(d.v_head_dim) * H;
      const int64_t dense_layers = std::min<int64_t>(d.first_k_dense_replace, c.n_layers);
      const double expert = 3.0 * H * double(d.moe_intermediate_size) * (d.int4_group > 0 ? 0.5 + 2.0 / double(d.int4_group) : 2.0);
      const double fixed = 2.0 * (double(c.vocab) * H + double(c.n_layers) * attn +
                                  double(dense_layers) * 3.0 * H * double(c.intermediate) +
                                  double(c.n_layers - dense_layers) * double(d.n_shared_experts) * 3.0 * H *
                                      double(d.moe_intermediate_size));
      const double E = double(d.n_routed_experts), k = double(d.num_experts_per_tok);
      step_weight_bytes = [=](int B) {
        return fixed + double(c.n_layers - dense_layers) * E * (1.0 - std::pow(1.0 - k / E, double(B))) * expert;
      };
      kv_per_token = 2.0 * double(c.n_layers * (d.kv_lora_rank + d.qk_rope_head_dim));
    }
    std::mt19937 rng(1);
    auto tok = [&] { return int32_t(rng() % uint32_t(c.vocab)); };

    // One real prefill of `context` tokens on slot 0 (timed after a short warm-up).
    {
      const std::vector<int32_t> warm{tok(), tok(), tok()};
      dec->forward({DecodeRequest{0, warm, {}, false}}, Capture{}, nullptr);
      dec->reset(0);
      std::vector<int32_t> ids(static_cast<size_t>(context));
      for (auto& x : ids) x = tok();
      std::vector<float> lg(size_t(c.vocab));
      const double a = now();
      dec->forward({DecodeRequest{0, ids, {}, false}}, Capture{}, lg.data());
      const double s = now() - a;
      dec->reset(0);
      std::printf("prefill  1 x %lld tokens: %.1f ms, %.0f tokens/s\n", (long long)context, s * 1e3, double(context) / s);
    }
    // Every slot's cache grown a page at a time, slots in turn (as slots grow together in
    // generate), so that no slot's pages are contiguous in the pool; later lengths of at most
    // `context` keep these pages. --contiguous-pages skips this (each slot's pages in one run).
    if (!contiguous_pages)
      for (int64_t len = 64; len < context + 64; len += 64)
        for (int s = 0; s < n_slots; ++s) cuda::decoder_assume_length(*dec, s, std::min(len, context));
    // A step of B one-token slots three ways: eager launches with fp32 logits to the host
    // (the engine before CUDA graphs), a replayed graph with logits to the host, and a
    // replayed graph with greedy ids picked on the device (greedy generate and eval).
    // The floor: every weight byte and each slot's cached K/V read once at the bandwidth above.
    // Then sampled steps (generate at temperature > 0), graphs replayed: T 0.7 drawn on the
    // device, T 0.7 with top-p 0.95 on the device, and T 0.7 with logits to the host and the
    // host's sampler (TALON_CUDA_SAMPLE=0, what every sampled step cost before).
    std::printf("%6s %8s %10s %10s %10s %12s %10s %10s %8s %9s %9s %9s\n", "slots", "context", "eager ms", "graph ms",
                "greedy ms", "greedy tok/s", "GB/s", "floor ms", "of floor", "T ms", "T+p ms", "host ms");
    for (int B : steps > 0 ? batches : std::vector<int>{}) {
      std::vector<float> lg(size_t(B) * size_t(c.vocab));
      std::vector<int32_t> ids(static_cast<size_t>(B));
      std::vector<double> us(static_cast<size_t>(B));
      double per[6] = {0, 0, 0, 0, 0, 0};
      uint64_t counter = 0;
      for (int mode = 0; mode < 6; ++mode) {
        cuda::decoder_use_graphs(*dec, mode > 0);
        for (int s = 0; s < B; ++s) cuda::decoder_assume_length(*dec, s, context);
        SamplingParams sp;
        sp.temperature = 0.7;
        sp.top_p = mode == 4 ? 0.95 : 1.0;
        auto step = [&] {
          std::vector<DecodeRequest> reqs;
          for (int s = 0; s < B; ++s) reqs.push_back({s, {tok()}, {}, true});
          for (int s = 0; s < B; ++s) us[size_t(s)] = uniform01(1, uint64_t(s), counter);
          ++counter;
          if (mode == 2)
            dec->forward_greedy(reqs, Capture{}, ids.data());
          else if (mode == 3 || mode == 4)
            dec->forward_sample(reqs, Capture{}, sp, us.data(), ids.data());
          else if (mode == 5)
            dec->Decoder::forward_sample(reqs, Capture{}, sp, us.data(), ids.data());
          else
            dec->forward(reqs, Capture{}, lg.data());
          for (int s = 0; s < B; ++s) dec->commit_all(s);
        };
        step();
        step();
        const double a = now();
        for (int64_t i = 0; i < steps; ++i) step();
        per[mode] = (now() - a) / double(steps);
        if (!trace_file.empty() && mode == 2 && B == batches.front()) {  // after the timing
          cudaDeviceSynchronize();
          cuda::CuptiTrace trace;
          for (int i = 0; i < 3; ++i) step();
          cudaDeviceSynchronize();
          const std::vector<TraceEvent> ev = trace.stop();
          std::printf("trace of 3 greedy steps, %d slots (%zu events):\n%s", B, ev.size(),
                      format_gap_report(analyze_gaps(ev, 2000)).c_str());
          write_file_atomic(trace_file, chrome_trace_json(ev));
        }
      }
      const double bytes = step_weight_bytes(B) + double(B) * double(context + 2 + steps / 2) * kv_per_token;
      const double floor_s = bytes / bw;
      std::printf("%6d %8lld %10.3f %10.3f %10.3f %12.0f %10.0f %10.3f %7.0f%% %9.3f %9.3f %9.3f\n", B,
                  (long long)context, per[0] * 1e3, per[1] * 1e3, per[2] * 1e3, B / per[2], bytes / per[2] / 1e9,
                  floor_s * 1e3, 100 * floor_s / per[2], per[3] * 1e3, per[4] * 1e3, per[5] * 1e3);
    }
    cuda::decoder_use_graphs(*dec, true);
    if (!graph_layers.empty() && steps > 0) {
      // Greedy one-token steps with the graph in parts of n layers (graph_cache.h: whether a
      // shorter first graph starts the GPU sooner).
      const int B = batches.front();
      std::printf("greedy graph steps, %d slots, context %lld, by layers per graph part:\n", B, (long long)context);
      std::vector<int32_t> ids(static_cast<size_t>(B));
      for (int64_t n : graph_layers) {
        cuda::decoder_graph_layers(*dec, n);
        for (int s = 0; s < B; ++s) cuda::decoder_assume_length(*dec, s, context);
        auto step = [&] {
          std::vector<DecodeRequest> reqs;
          for (int s = 0; s < B; ++s) reqs.push_back({s, {tok()}, {}, true});
          dec->forward_greedy(reqs, Capture{}, ids.data());
          for (int s = 0; s < B; ++s) dec->commit_all(s);
        };
        for (int i = 0; i < 4; ++i) step();
        const double a = now();
        for (int64_t i = 0; i < steps; ++i) step();
        std::printf("  %2lld layers a part (%zu graphs): %.3f ms a step\n", (long long)n,
                    cuda::decoder_graph_parts(*dec), (now() - a) / double(steps) * 1e3);
      }
      cuda::decoder_graph_layers(*dec, cuda::GraphCache::default_layers_per_part());
    }
    {
      // The verify-step cost at batch 1: one target pass over n pending tokens (a chain of
      // k+1, or a random tree of N) against one token, at this context; greedy ids back (as
      // greedy eval runs), graphs replayed after the first two of each shape.
      std::printf("verify cost at batch 1, context %lld (median of 9, greedy ids):\n", (long long)context);
      double one = 0;
      std::map<std::pair<int64_t, int>, double> verify_ms;  // (tokens, chain) -> ms
      for (int64_t n : verify_tokens) {
        if (n < 1 || n > max_len - context) continue;
        for (int chain = 1; chain >= 0; --chain) {
          if (n == 1 && !chain) continue;
          DecodeRequest r{0, {}, {}, true};
          for (int64_t i = 0; i < n; ++i) {
            r.tokens.push_back(tok());
            if (!chain) r.parents.push_back(i == 0 ? -1 : int32_t(rng() % uint32_t(i)));
          }
          std::vector<int32_t> top(static_cast<size_t>(n));
          std::vector<double> ts;
          for (int i = 0; i < 11; ++i) {
            cuda::decoder_assume_length(*dec, 0, context);
            const double a = now();
            dec->forward_greedy({r}, Capture{}, top.data());
            ts.push_back(now() - a);
            dec->commit(0, {});
          }
          std::sort(ts.begin() + 2, ts.end());
          const double med = ts[2 + 4];
          if (n == 1 || one == 0) one = med;
          verify_ms[{n, chain}] = med * 1e3;
          std::printf("  %-5s %3lld tokens: %7.3f ms  (%.2fx one token)\n", chain ? "chain" : "tree", (long long)n,
                      med * 1e3, med / one);
        }
      }
      if (accept_k > 0 && accept_k + 1 <= max_len - context && tp * ep == 1) {
        // A sampled chain's round on the target (T 0.7, top-p 0.95): the verify pass plus the
        // acceptance decision, decided on the host from logits copied down (the main decoder)
        // and on the device (the default: a second decoder of one slot, on GPU 0).
        auto dacc = make_cuda_decoder(*ck, 0, 1, max_len);
        SamplingParams sp;
        sp.temperature = 0.7;
        sp.top_p = 0.95;
        DecodeRequest r{0, {}, {}, true};
        for (int64_t i = 0; i <= accept_k; ++i) r.tokens.push_back(tok());
        std::vector<std::vector<double>> q(size_t(accept_k), std::vector<double>(size_t(c.vocab), 1.0 / double(c.vocab)));
        std::vector<double> u(size_t(accept_k + 1), 0.5);
        double host_ms = 0, dev_ms = 0;
        for (Decoder* d : {dec.get(), dacc.get()}) {
          std::vector<double> ts;
          for (int i = 0; i < 11; ++i) {
            cuda::decoder_assume_length(*d, 0, context);
            const double a = now();
            d->forward_accept_chain(r, Capture{}, sp, q, u.data());
            ts.push_back(now() - a);
            d->commit(0, {});
          }
          std::sort(ts.begin() + 2, ts.end());
          (d == dec.get() ? host_ms : dev_ms) = ts[6] * 1e3;
        }
        std::printf("  sampled chain-%lld round on the target (verify + acceptance, T 0.7, top-p 0.95): host %.3f ms, "
                    "device %.3f ms (%.2fx / %.2fx one token)\n",
                    (long long)accept_k, host_ms, dev_ms, host_ms / (one * 1e3), dev_ms / (one * 1e3));
      }
      if (draft_vocab > 0) {
        // The draft layer at this context: step-0 rows for the context, then timed steps.
        const double d0 = now();
        const spec::DraftModel dm = random_draft(c, draft_vocab);
        spec::DraftRunner run(dm, *ck, 0, context + 256);
        std::printf("draft layer (H %lld, I %lld, Vd %lld) on the GPU, context %lld (setup %.1fs), median of 9:\n",
                    (long long)dm.config.H, (long long)dm.config.I, (long long)dm.config.Vd, (long long)context,
                    now() - d0);
        const int64_t H = c.hidden;
        std::vector<float> aux(size_t(context * 3 * H), 0.01f), hid(size_t(16 * H), 0.01f), ph(size_t(16 * H), 0.01f);
        std::vector<int32_t> ids(static_cast<size_t>(context));
        for (auto& t : ids) t = tok();
        spec::DraftTop top;
        top.k = 8;
        run.extend(ids.data(), aux.data(), context - 1, hid.data(), nullptr, &top);
        auto median = [&](const std::function<void()>& f) {
          std::vector<double> ts;
          for (int i = 0; i < 11; ++i) {
            const double a = now();
            f();
            ts.push_back(now() - a);
          }
          std::sort(ts.begin() + 2, ts.end());
          return ts[6] * 1e3;
        };
        std::vector<double> ext_ts;  // one more step-0 row on the full context, 9 times
        for (int i = 0; i < 9; ++i) {
          const double a = now();
          run.extend(ids.data(), aux.data(), 1, hid.data(), nullptr, &top);
          ext_ts.push_back(now() - a);
        }
        std::sort(ext_ts.begin(), ext_ts.end());
        const double ext_ms = ext_ts[4] * 1e3;
        std::map<int, double> step_ms;
        for (int n : {1, 8, 10}) {
          std::vector<int32_t> t(static_cast<size_t>(n)), par(static_cast<size_t>(n), -1);
          for (auto& v : t) v = tok();
          step_ms[n] = median([&] {
            run.tree_step(t, par, ph.data(), hid.data(), nullptr, &top);
            run.clear_tree();
          });
        }
        std::printf("  step-0 row %.3f ms; tree step of 1 node %.3f ms, 8 nodes %.3f ms, 10 nodes %.3f ms\n", ext_ms,
                    step_ms[1], step_ms[8], step_ms[10]);
        // A greedy chain as decoding drafts it: one step-0 row and k-1 steps in one call
        // (DraftRunner::extend_chain, one graph on the device).
        std::map<int, double> chain_ms;
        for (int k : {3, 5, 7}) chain_ms[k] = median([&] {
            run.extend_chain(ids.data(), aux.data(), 1, k);
            run.clear_tree();
          });
        std::printf("  greedy chain in one call (step-0 row + k-1 steps): k 3 %.3f ms, k 5 %.3f ms, k 7 %.3f ms "
                    "(step by step: %.3f, %.3f, %.3f)\n",
                    chain_ms[3], chain_ms[5], chain_ms[7], ext_ms + 2 * step_ms[1], ext_ms + 4 * step_ms[1],
                    ext_ms + 6 * step_ms[1]);
        // An EAGLE-2 tree of depth 6 and top-8 below a step-0 row: one graph (expand_tree) or a
        // host round trip per depth.
        std::map<int, double> tree_ms;
        for (int dev_side : {1, 0}) tree_ms[dev_side] = median([&] {
            std::vector<int32_t> tt, tp;
            std::vector<double> ts;
            run.expand_tree(top, hid.data(), 6, tt, tp, ts, dev_side == 1);
            run.clear_tree();
          });
        std::printf("  tree d6 k8 expansion (5 steps of 8 nodes): one graph %.3f ms, step by step %.3f ms\n", tree_ms[1],
                    tree_ms[0]);
        // Batch-1 speedup a mean acceptance length tau would give (draft and verify as timed):
        // chain k: verify k+1 tokens, draft one step-0 row and k-1 one-node steps in one call;
        // tree (depth 6, top-8, 32 nodes): verify a 32-token tree (the 33rd, the pending token,
        // left out), one step-0 row and the expansion (5 steps of 8 nodes) in one graph.
        std::printf("  projected batch-1 speedup = tau x %.3f ms / round:\n", one * 1e3);
        auto vms = [&](int64_t n, int chain) {
          auto it = verify_ms.find({n, chain});
          return it == verify_ms.end() ? std::nan("") : it->second;
        };
        struct Cfg { const char* name; double round; };
        const std::vector<Cfg> cfgs = {
            {"chain-3", vms(4, 1) + chain_ms[3]},
            {"chain-5", vms(6, 1) + chain_ms[5]},
            {"chain-7", vms(8, 1) + chain_ms[7]},
            {"tree d6 k8 n32", vms(32, 0) + ext_ms + tree_ms[1]}};
        for (const auto& cf : cfgs) {
          if (!(cf.round > 0)) continue;  // its verify length was not in --verify-tokens
          std::printf("    %-15s round %.3f ms:", cf.name, cf.round);
          for (double tau : {1.5, 2.0, 3.0, 4.0, 5.0, 6.0}) std::printf("  tau %.1f -> %.2fx", tau, tau * one * 1e3 / cf.round);
          std::printf("\n");
        }
      }
    }
    if (dflash_layers > 0 && draft_vocab > 0) {
      // A DFlash round's draft work at this context: one verified row joins the context, then
      // the block at the next position gives block - 1 draft tokens (greedy top-1 ids).
      const spec::DraftModel dm = random_dflash(c, draft_vocab, dflash_layers, dflash_block);
      spec::DraftRunner run(dm, *ck, 0, context + 256);
      const int64_t H = c.hidden;
      std::vector<float> aux(size_t(context * 3 * H), 0.01f);
      std::vector<int32_t> ids(static_cast<size_t>(context));
      for (auto& t : ids) t = tok();
      run.extend(ids.data(), aux.data(), context - 1, nullptr, nullptr);
      spec::DraftTop top;
      top.k = 1;
      std::vector<double> ext, blk;
      for (int i = 0; i < 11; ++i) {
        double a = now();
        run.extend(ids.data(), aux.data(), 1, nullptr, nullptr);
        ext.push_back(now() - a);
        a = now();
        run.block_step(dflash_block - 1, nullptr, &top);
        blk.push_back(now() - a);
      }
      std::sort(ext.begin() + 2, ext.end());
      std::sort(blk.begin() + 2, blk.end());
      std::printf("DFlash draft (%lld layers, block %lld, Vd %lld) on the GPU, context %lld, median of 9: context row "
                  "%.3f ms, block of %lld tokens %.3f ms\n",
                  (long long)dflash_layers, (long long)dflash_block, (long long)draft_vocab, (long long)context,
                  ext[6] * 1e3, (long long)(dflash_block - 1), blk[6] * 1e3);
    }
    if (tree > 0) {
      // Verification: 32 slots (or fewer) each with a random tree of `tree` tokens.
      const int B = std::min(32, n_slots);
      std::vector<DecodeRequest> reqs;
      for (int s = 0; s < B; ++s) {
        cuda::decoder_assume_length(*dec, s, context);
        DecodeRequest r{s, {}, {}, true};
        for (int64_t i = 0; i < tree; ++i) {
          r.tokens.push_back(tok());
          r.parents.push_back(i == 0 ? -1 : int32_t(rng() % uint32_t(i)));
        }
        reqs.push_back(r);
      }
      std::vector<float> lg(size_t(B * tree) * size_t(c.vocab));
      dec->forward(reqs, Capture{}, lg.data());
      for (int s = 0; s < B; ++s) dec->commit(s, {});
      const double a = now();
      for (int i = 0; i < 4; ++i) {
        dec->forward(reqs, Capture{}, lg.data());
        for (int s = 0; s < B; ++s) dec->commit(s, {});
      }
      const double s = (now() - a) / 4;
      std::printf("verify %d slots x tree of %lld at context %lld: %.2f ms/forward, %.0f tree tokens/s\n", B,
                  (long long)tree, (long long)context, s * 1e3, double(B * tree) / s);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
