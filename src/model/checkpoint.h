// A checkpoint is a model config plus named tensors in HF naming and PyTorch layout
// ([out, in] row-major), whatever the file format underneath. HF directories are
// memory-mapped and served zero-copy; GGUF tensors are dequantised to fp32 on load
// (and llama.cpp's Q/K row permutation is undone, so every backend sees HF layout).
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/config.h"
#include "util/dtype.h"
#include "util/file.h"

namespace talon {

struct CkptTensor {
  std::string name;            // HF name, e.g. "model.layers.0.self_attn.q_proj.weight"
  std::string stored_type;     // as stored: "BF16", "F32", "Q4_1", ...
  std::vector<int64_t> shape;  // PyTorch order
  std::string file;            // where it lives (for messages)
  int64_t numel() const;
};

// A weight as the backends consume it: either a view into the mapped file
// (F32/BF16/F16) or an owned fp32 buffer (dequantised).
struct WeightRef {
  DType dtype = DType::F32;
  const void* data = nullptr;
  std::vector<int64_t> shape;
};

// A weight as an owned fp32 vector (small tensors: norms, biases, router weights); empty
// when the weight is absent.
std::vector<float> weight_to_f32(const WeightRef& w);

class Checkpoint {
 public:
  virtual ~Checkpoint() = default;
  const ModelConfig& config() const { return config_; }
  const std::string& source() const { return source_; }
  const std::vector<CkptTensor>& tensors() const { return tensors_; }
  const CkptTensor* find(const std::string& name) const;
  // Weight for the backends: zero-copy where the stored type is F32/BF16/F16.
  virtual WeightRef weight(const CkptTensor& t) const = 0;
  // Summary for `talon inspect` (format, tokenizer/chat template presence, ...).
  const nlohmann::json& info() const { return info_; }

 protected:
  ModelConfig config_;
  std::string source_;
  std::vector<CkptTensor> tensors_;
  nlohmann::json info_ = nlohmann::json::object();
  void index();
  std::map<std::string, size_t> index_;
};

// A directory (HF) or a .gguf file.
std::unique_ptr<Checkpoint> open_checkpoint(const fs::path& path);

}  // namespace talon
