// Model hyper-parameters, parsed from HF config.json (transformers 4.x and 5.x) or GGUF
// metadata, in one architecture-neutral struct that every backend reads.
#pragma once
#include "model/moe_routing.h"
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace talon {

enum class Arch { Llama, Mistral, Qwen2, Qwen3, DeepseekV2, DeepseekV3 };
const char* arch_name(Arch a);
// DeepSeek-V2/V3 family (MLA attention + MoE); Kimi-K2 parses as DeepseekV3.
inline bool is_deepseek(Arch a) { return a == Arch::DeepseekV2 || a == Arch::DeepseekV3; }

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
  // YaRN ("yarn", DeepSeek family only): inv_freq blends interpolated and extrapolated
  // frequencies over the correction range [beta_fast, beta_slow] rotations, and cos/sin
  // are multiplied by attention_factor (transformers: mscale / mscale_all_dim ratio).
  double beta_fast = 32.0, beta_slow = 1.0;
  double mscale = 0.0, mscale_all_dim = 0.0;  // 0: absent
  double attention_factor = 1.0;              // resolved at parse time
};

// DeepSeek-V2/V3 (and Kimi-K2) fields: multi-head latent attention and the MoE router.
// Names as in HF config.json.
struct DeepseekConfig {
  int64_t q_lora_rank = 0;       // 0 (null in JSON): plain q_proj
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  bool rope_interleave = true;   // rotate adjacent pairs (x0,x1),(x2,x3).. of the rope part
  int64_t n_routed_experts = 0;
  int64_t n_shared_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  int64_t first_k_dense_replace = 0;  // layers < this use a dense SwiGLU MLP
  int64_t moe_layer_freq = 1;
  double routed_scaling_factor = 1.0;
  MoeScoring scoring_func = MoeScoring::Softmax;
  MoeTopk topk_method = MoeTopk::Greedy;
  int64_t n_group = 1, topk_group = 1;
  bool norm_topk_prob = false;
  // Softmax scale of the attention: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2
  // under YaRN (DeepSeek's correction).
  double softmax_scale = 0.0;
  // Weight quantization declared in quantization_config ("" = none): "fp8" with a
  // [block_out, block_in] block, or "compressed-tensors" int4 pack-quantized with group size.
  std::string quant_method;
  int64_t fp8_block_out = 0, fp8_block_in = 0;
  int64_t int4_group = 0;
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
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
  DeepseekConfig ds;             // only meaningful when is_deepseek(arch); head_dim = qk_rope_head_dim


  // Canonical JSON of every field above (the DeepSeek block only for DeepSeek archs, so
  // dense-model hashes are unchanged); its SHA-256 is the model's config identity.
  nlohmann::json to_json() const;
  std::string hash() const;
  void validate(const std::string& source) const;
};

// DeepSeek's YaRN magnitude correction: 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1).
double yarn_mscale(double scale, double mscale);

// `source` names the file in error messages.
ModelConfig parse_hf_config(const nlohmann::json& j, const std::string& source);

}  // namespace talon
