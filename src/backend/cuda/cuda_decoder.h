// Internal to the CUDA backend: hooks of the cached decoder for benchmarks and tests.
#pragma once
#include <cstdint>
#include <memory>

#include "backend/backend.h"
#include "backend/cuda/cuda_model.h"
#include "model/decode.h"

namespace talon::cuda {

// What every CUDA decoder offers the hooks below.
class DecoderControls {
 public:
  virtual ~DecoderControls() = default;
  virtual void assume_length(int slot, int64_t len) = 0;
  virtual void use_graphs(bool on) = 0;
  virtual int64_t graph_launches() const = 0;
  virtual void graph_layers(int64_t n) = 0;
  virtual size_t graph_parts() const = 0;
};

// The DeepSeek-family decoder (cuda_deepseek_decoder.cpp); make_cuda_decoder picks it.
std::unique_ptr<Decoder> make_deepseek_decoder(const Checkpoint& ckpt, int device, int n_slots, int64_t max_len,
                                               int64_t cache_tokens);
// One rank of a tensor-parallel group of them (its share of the weights, cuda_model.h).
std::unique_ptr<Decoder> make_deepseek_rank_decoder(const Checkpoint& ckpt, int device, int n_slots, int64_t max_len,
                                                    int64_t cache_tokens, const DeepseekParallel& par);
// The group: go.tp ranks on go.devices (decoder_group.cpp).
std::unique_ptr<Decoder> make_deepseek_decoder_group(const Checkpoint& ckpt, const GpuOptions& go, int n_slots,
                                                     int64_t max_len, int64_t cache_tokens);

// Benchmarks only: marks the first `len` rows of a CUDA decoder's slot as committed without
// computing them (their keys and values are whatever the cache holds: a constant fill
// written once on the first call, so no NaN can come out of them).
void decoder_assume_length(Decoder& d, int slot, int64_t len);

// Whether forwards of a shape that ran before replay a captured CUDA graph (default on;
// TALON_CUDA_GRAPHS=0 in the environment turns it off for a whole run). Switching drops
// the graphs made so far.
void decoder_use_graphs(Decoder& d, bool on);
// Forwards served by a graph so far.
int64_t decoder_graph_launches(Decoder& d);
// Layers per graph part (graph_cache.h; <= 0: a forward is one graph), and how many parts the
// last replayed forward launched.
void decoder_graph_layers(Decoder& d, int64_t n);
size_t decoder_graph_parts(Decoder& d);
// The dense decoder only (others refuse): whether a one-token forward of a small model folds its norms, SwiGLU and residual adds into
// the skinny products (dense_block.h: DenseHooks::fold_one_token; default on,
// TALON_CUDA_FUSE=0 turns it off for a whole run).
void decoder_fold_one_token(Decoder& d, bool on);
// Whether folded forwards also fold RoPE and the cache write into the q|k|v product (ops.h:
// SkinnyRope; default on, TALON_CUDA_FOLD_ROPE=0 turns it off for a whole run).
void decoder_fold_rope(Decoder& d, bool on);

}  // namespace talon::cuda
