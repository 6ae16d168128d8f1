// Model hyper-parameters, parsed from HF config.json (transformers 4.x and 5.x) or GGUF
// metadata, in one architecture-neutral struct that every backend reads.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace talon {

enum class Arch { Llama, Mistral, Qwen2, Qwen3 };
const char* arch_name(Arch a);

struct RopeConfig {
  double theta = 10000.0;           // base of the inverse frequencies
  std::string type = "default";     // "default" | "linear" | "llama3"
  double factor = 1.0;              // linear / llama3 scaling factor
  double low_freq_factor = 1.0;     // llama3
  double high_freq_factor = 4.0;    // llama3
  int64_t original_max_position = 8192;  // llama3
  // GGUF llama3-style models carry per-frequency divisors instead (rope_freqs.weight):
  // inv_freq[i] /= freq_factors[i]. Empty when absent.
  std::vector<float> freq_factors;
};

struct ModelConfig {
  Arch arch = Arch::Llama;
  int64_t n_layers = 0;          // L: decoder layers
  int64_t hidden = 0;            // H: residual-stream width
  int64_t intermediate = 0;      // I: SwiGLU inner width
  int64_t n_heads = 0;           // query heads
  int64_t n_kv_heads = 0;        // key/value heads (GQA when < n_heads)
  int64_t head_dim = 0;          // per-head width; n_heads * head_dim need not equal H (qwen3)
  int64_t vocab = 0;             // V
  int64_t max_position = 0;      // informational; RoPE is computed for any position
  double rms_eps = 1e-6;
  RopeConfig rope;
  bool tied_embeddings = false;  // lm_head shares embed_tokens
  bool qkv_bias = false;         // qwen2
  bool qk_norm = false;          // qwen3: RMSNorm over head_dim on q and k before RoPE
  int64_t sliding_window = 0;    // 0: full causal attention; else keys with q - k < window

  // Canonical JSON of every field above; its SHA-256 is the model's config identity.
  nlohmann::json to_json() const;
  std::string hash() const;
  void validate(const std::string& source) const;
};

// `source` names the file in error messages.
ModelConfig parse_hf_config(const nlohmann::json& j, const std::string& source);

}  // namespace talon
