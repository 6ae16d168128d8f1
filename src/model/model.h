// The model interface every backend implements, and the conventions it follows.
//
// Hidden-state ids use the "input of layer k" convention (SPEC-EAGLE3 section 1):
//   h[k] = the residual-stream state entering decoder layer k,
//   h[0] = token embeddings, h[L] = output of the last layer BEFORE the final norm.
// Note HF's output_hidden_states[L] is after the final norm; h[L] here is not.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/checkpoint.h"
#include "model/config.h"
#include "util/dtype.h"

namespace talon {

inline constexpr const char* kLayerConvention = "input-of-layer";
inline constexpr const char* kLayerConventionText =
    "h[k] is the residual stream entering decoder layer k; h[0] = token embeddings; "
    "h[L] = output of the last decoder layer before the final norm";

// Default EAGLE-3 aux ids: [2, L/2, L-3].
std::vector<int> default_aux_layers(int64_t n_layers);
// Parses "a,b,c" and validates each id against L (0 <= id <= L, strictly increasing).
std::vector<int> parse_layer_ids(const std::string& spec, int64_t n_layers);

// Independent sequences packed back to back; positions restart at 0 in each.
struct Batch {
  std::vector<int32_t> tokens;     // [N]
  std::vector<int64_t> seq_start;  // [S+1]; sequence s is tokens[seq_start[s] .. seq_start[s+1])
  int64_t n_tokens() const { return int64_t(tokens.size()); }
  int64_t n_seqs() const { return int64_t(seq_start.size()) - 1; }
  void add(const int32_t* ids, int64_t n);
  void clear();
  // Each token's position in its own sequence (RoPE positions restart at 0 per sequence).
  std::vector<int32_t> positions() const;
};

// Hidden states to copy out during a forward: h[layers[i]] -> out[i], N rows of H
// values at a row stride of ld[i] elements (ld empty: H), as fp32 (dtype F32, out[i]
// is a float*) or bf16 (dtype BF16, out[i] points at uint16_t). Host memory; when it
// comes from Model::host_buffer() a GPU backend copies into it asynchronously.
// seq_dst (optional, one entry per batch sequence) scatters: the rows of sequence s
// land at out rows seq_dst[s] ... (batches sorted by length fill shards in sample order).
struct Capture {
  std::vector<int> layers;
  std::vector<void*> out;
  DType dtype = DType::F32;
  std::vector<int64_t> ld;
  std::vector<int64_t> seq_dst;
  int64_t stride(size_t i, int64_t H) const { return ld.empty() ? H : ld[i]; }
  // Output row of batch row r in sequence s.
  int64_t dst_row(const Batch& b, int64_t s, int64_t r) const;
  // dst_row of every batch row, in row order.
  std::vector<int64_t> dst_rows(const Batch& b) const;
  // Throws unless layer ids are in [0, n_layers], sizes agree and the dtype is F32/BF16.
  void validate(int64_t n_layers) const;
  void validate(int64_t n_layers, const Batch& b) const;
  Capture() = default;
  Capture(std::vector<int> l, std::vector<float*> o) : layers(std::move(l)), out(o.begin(), o.end()) {}
};

class Model {
 public:
  virtual ~Model() = default;
  virtual const ModelConfig& config() const = 0;
  virtual std::string backend() const = 0;
  // logits may be null; otherwise [N, V] fp32.
  virtual void forward(const Batch& batch, const Capture& capture, float* logits) = 0;
  // Host memory for capture outputs (page-locked on GPU backends, so device-to-host
  // copies run asynchronously at full bus speed). Freed when the pointer dies.
  virtual std::shared_ptr<uint8_t> host_buffer(size_t bytes);
};

// RoPE inverse frequencies [head_dim/2] for the config's scaling rule.
std::vector<float> rope_inv_freq(const RopeConfig& rope, int64_t head_dim);

}  // namespace talon
