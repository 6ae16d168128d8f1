// Cached decoding throughput on one GPU (make_cuda_decoder): steps of one new token for
// each of B slots at a given committed context, for several B; also one real prefill and
// tree verification. Random bf16 weights of a target shape built in memory (no files), or
// a real checkpoint with --model. Slot contexts are set without computing them
// (cuda::decoder_assume_length): the cache holds a constant fill, which costs the
// attention the same reads as real keys.
//   talon_bench_decode [--shape llama3-8b|smollm2] [--model PATH] [--context 2048]
//                      [--batches 1,32,256] [--steps 16] [--tree 32]
#include <cuda_runtime.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <random>

#include "backend/cuda/cuda_decoder.h"
#include "model/checkpoint.h"
#include "model/decode.h"
#include "model/random_checkpoint.h"
#include "util/error.h"

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

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Cached decoding throughput on one GPU (make_cuda_decoder)"};
  std::string shape = "llama3-8b", model_path;
  int64_t context = 2048, steps = 16, tree = 32;
  std::vector<int> batches{1, 32, 256};
  app.add_option("--shape", shape, "random weights of this shape")->capture_default_str();
  app.add_option("--model", model_path, "a real checkpoint instead (HF directory or .gguf)");
  app.add_option("--context", context, "committed tokens per slot")->capture_default_str();
  app.add_option("--batches", batches, "slots decoding at once")->delimiter(',');
  app.add_option("--steps", steps, "timed steps per batch size")->capture_default_str();
  app.add_option("--tree", tree, "tree size per slot for the verification case (0: skip)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    const double t0 = now();
    std::unique_ptr<Checkpoint> ck =
        model_path.empty() ? make_random_checkpoint(shape_config(shape)) : open_checkpoint(model_path);
    const ModelConfig& c = ck->config();
    const int n_slots = *std::max_element(batches.begin(), batches.end());
    const int64_t max_len = context + std::max<int64_t>({steps + 2, tree, 64}) + 1;
    auto dec = make_cuda_decoder(*ck, 0, n_slots, max_len);
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, 0);
    std::printf("%s on %s: %lld layers, H %lld, %lld/%lld heads x %lld, V %lld; %d slots x %lld tokens (setup %.1fs)\n",
                model_path.empty() ? ("random " + shape).c_str() : model_path.c_str(), prop.name,
                (long long)c.n_layers, (long long)c.hidden, (long long)c.n_heads, (long long)c.n_kv_heads,
                (long long)c.head_dim, (long long)c.vocab, n_slots, (long long)max_len, now() - t0);
    // Bytes a decode step must read: every matrix once (the embedding is only gathered, so
    // the LM head counts once, tied or not) plus each slot's cached keys and values.
    const double weight_bytes = 2.0 * double(c.vocab * c.hidden +
                                             c.n_layers * (c.hidden * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim +
                                                           c.n_heads * c.head_dim * c.hidden + 3 * c.hidden * c.intermediate));
    const double kv_per_token = 2.0 * 2 * double(c.n_layers * c.n_kv_heads * c.head_dim);
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
    std::printf("%6s %8s %12s %12s %12s %10s\n", "slots", "context", "ms/step", "tokens/s", "no-logits", "GB/s");
    for (int B : batches) {
      for (int s = 0; s < n_slots; ++s) cuda::decoder_assume_length(*dec, s, context);
      std::vector<float> lg(size_t(B) * size_t(c.vocab));
      double per[2] = {0, 0};
      for (int mode = 0; mode < 2; ++mode) {  // 0: logits to the host, 1: none
        for (int s = 0; s < B; ++s) cuda::decoder_assume_length(*dec, s, context);
        auto step = [&] {
          std::vector<DecodeRequest> reqs;
          for (int s = 0; s < B; ++s) reqs.push_back({s, {tok()}, {}, true});
          dec->forward(reqs, Capture{}, mode == 0 ? lg.data() : nullptr);
          for (int s = 0; s < B; ++s) dec->commit_all(s);
        };
        step();
        step();
        const double a = now();
        for (int64_t i = 0; i < steps; ++i) step();
        per[mode] = (now() - a) / double(steps);
      }
      const double bytes = weight_bytes + double(B) * double(context + 2 + steps / 2) * kv_per_token;
      std::printf("%6d %8lld %12.2f %12.0f %12.0f %10.0f\n", B, (long long)context, per[0] * 1e3, B / per[0], B / per[1],
                  bytes / per[1] / 1e9);
    }
    {
      // The verify-step cost at batch 1: one target pass over n pending tokens (a chain of
      // k+1, or a random tree of N) against one token, at this context; logits to the host.
      std::printf("verify cost at batch 1, context %lld (median of 9):\n", (long long)context);
      double one = 0;
      for (int64_t n : {1, 2, 4, 6, 8, 16, 32, 64}) {
        if (n > max_len - context) break;
        for (int chain = 1; chain >= 0; --chain) {
          if (n == 1 && !chain) continue;
          DecodeRequest r{0, {}, {}, true};
          for (int64_t i = 0; i < n; ++i) {
            r.tokens.push_back(tok());
            if (!chain) r.parents.push_back(i == 0 ? -1 : int32_t(rng() % uint32_t(i)));
          }
          std::vector<float> lg(size_t(n) * size_t(c.vocab));
          std::vector<double> ts;
          for (int i = 0; i < 11; ++i) {
            cuda::decoder_assume_length(*dec, 0, context);
            const double a = now();
            dec->forward({r}, Capture{}, lg.data());
            ts.push_back(now() - a);
            dec->commit(0, {});
          }
          std::sort(ts.begin() + 2, ts.end());
          const double med = ts[2 + 4];
          if (n == 1) one = med;
          std::printf("  %-5s %3lld tokens: %7.3f ms  (%.2fx one token)\n", chain ? "chain" : "tree", (long long)n,
                      med * 1e3, med / one);
        }
      }
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
