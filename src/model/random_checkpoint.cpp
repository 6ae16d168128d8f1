#include "model/random_checkpoint.h"

#include <algorithm>
#include <array>
#include <string>
#include <bit>
#include <cmath>
#include <vector>

#include "model/deepseek.h"
#include "model/dense.h"
#include "util/error.h"

namespace talon {

namespace {

struct Spec {
  std::string name;
  std::vector<int64_t> shape;
  const char* type = "BF16";  // "BF16", "I32" (int4 packed words), "I64" (an int4 weight_shape)
  std::array<int64_t, 2> logical{};  // I64: the values it holds, the weight's [O, I]
};

// The DeepSeek-family layout (deepseek_weight_table, as bind_deepseek_weights reads it):
// linear layers bf16, routed experts int4 pack-quantized when the config says
// compressed-tensors with a group size.
std::vector<Spec> deepseek_specs(const ModelConfig& c) {
  const int64_t g = c.ds.int4_group;
  const bool int4 = c.ds.quant_method == "compressed-tensors" && g > 0;
  DeepseekWeights w;
  std::vector<Spec> v;
  for (const DeepseekTensorSpec& s : deepseek_weight_table(c, w)) {
    if (!s.linear) {
      v.push_back({s.name, s.shape, "BF16"});
      continue;
    }
    const int64_t O = s.shape[0], I = s.shape[1];
    if (!(int4 && s.routed_expert)) {
      v.push_back({s.name + ".weight", {O, I}, "BF16"});
      continue;
    }
    v.push_back({s.name + ".weight_packed", {O, (I + 7) / 8}, "I32"});
    v.push_back({s.name + ".weight_scale", {O, (I + g - 1) / g}, "BF16"});
    v.push_back({s.name + ".weight_shape", {2}, "I64", {O, I}});
  }
  return v;
}

class RandomCheckpoint final : public Checkpoint {
 public:
  RandomCheckpoint(const ModelConfig& cfg, float std, uint64_t seed) {
    config_ = cfg;
    source_ = "random " + std::string(arch_name(cfg.arch)) + " weights";
    std::vector<Spec> specs;
    if (is_deepseek(cfg.arch)) {
      specs = deepseek_specs(cfg);
    } else {
      DenseWeights w;
      for (const WeightSpec& s : dense_weight_table(cfg, w)) specs.push_back({s.name, s.shape, "BF16"});
    }
    int64_t most = 0, most_words = 1;
    for (const Spec& s : specs) {
      CkptTensor t{s.name, std::string(s.type), s.shape, source_};
      if (std::string(s.type) == "I32")
        most_words = std::max(most_words, t.numel());
      else
        most = std::max(most, t.numel());
      shape_idx_.push_back(-1);
      if (std::string(s.type) == "I64") {
        shape_idx_.back() = int64_t(shapes_.size());
        shapes_.push_back(s.logical);
      }
      tensors_.push_back(t);
    }
    index();
    constexpr int64_t kSlack = 1 << 20;
    words_.resize(size_t(most_words + kSlack));
    uint64_t y = seed * 0xd1b54a32d192ed03ull + 7;
    for (auto& w : words_) {
      y ^= y >> 12, y ^= y << 25, y ^= y >> 27;
      w = int32_t(uint32_t((y * 0x2545f4914f6cdd1dull) >> 32));
    }
    pool_.resize(size_t(most + kSlack));
    // xorshift64*; the top 24 bits give u in [0, 1), scaled to [-a, a] with a = std * sqrt(3).
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    const float a = std * std::sqrt(3.f);
    for (auto& v : pool_) {
      x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
      const float u = float((x * 0x2545f4914f6cdd1dull) >> 40) / float(1 << 24);
      v = uint16_t(std::bit_cast<uint32_t>((u * 2.f - 1.f) * a) >> 16);
    }
    for (size_t i = 0; i < tensors_.size(); ++i) offset_.push_back(int64_t((i * 104729u) % uint64_t(kSlack)));
    int64_t widest = std::max(cfg.hidden, cfg.head_dim);
    if (is_deepseek(cfg.arch)) widest = std::max({widest, cfg.ds.q_lora_rank, cfg.ds.kv_lora_rank});
    ones_.assign(size_t(widest), 0x3f80);  // bf16 1.0
  }

  WeightRef weight(const CkptTensor& t) const override {
    const size_t i = size_t(&t - tensors_.data());
    if (t.stored_type == "I32") return {DType::I32, words_.data() + offset_[i], t.shape};
    if (t.stored_type == "I64") return {DType::I64, shapes_[size_t(shape_idx_[i])].data(), t.shape};
    if (t.name.find("norm") != std::string::npos) return {DType::BF16, ones_.data(), t.shape};
    return {DType::BF16, pool_.data() + offset_[i], t.shape};
  }

 private:
  std::vector<uint16_t> pool_, ones_;
  std::vector<int32_t> words_;
  std::vector<std::array<int64_t, 2>> shapes_;
  std::vector<int64_t> offset_, shape_idx_;
};

}  // namespace

std::unique_ptr<Checkpoint> make_random_checkpoint(const ModelConfig& cfg, float std, uint64_t seed) {
  return std::make_unique<RandomCheckpoint>(cfg, std, seed);
}

ModelConfig kimi_k2_shape(int64_t layers, bool int4_experts) {
  ModelConfig c;
  c.arch = Arch::DeepseekV3;
  c.n_layers = layers, c.hidden = 7168, c.intermediate = 18432, c.vocab = 163840, c.n_heads = 64, c.n_kv_heads = 64;
  c.rms_eps = 1e-6, c.rope.theta = 50000, c.max_position = 262144;
  auto& d = c.ds;
  d.q_lora_rank = 1536, d.kv_lora_rank = 512, d.qk_nope_head_dim = 128, d.qk_rope_head_dim = 64, d.v_head_dim = 128;
  d.n_routed_experts = 384, d.n_shared_experts = 1, d.num_experts_per_tok = 8, d.moe_intermediate_size = 2048;
  d.first_k_dense_replace = 1, d.routed_scaling_factor = 2.827, d.scoring_func = MoeScoring::Sigmoid;
  d.topk_method = MoeTopk::NoauxTc, d.norm_topk_prob = true, d.softmax_scale = 1.0 / std::sqrt(192.0);
  if (int4_experts) d.quant_method = "compressed-tensors", d.int4_group = 32;
  c.head_dim = d.qk_head_dim();
  return c;
}

bool is_random_model_spec(const std::string& s) { return s.rfind("random:", 0) == 0; }

std::unique_ptr<Checkpoint> open_random_model_spec(const std::string& spec) {
  const auto bad = [&] {
    fail("--model {}: expected random:kimi-k2:LAYERS or random:kimi-k2:LAYERS:bf16 (LAYERS 1..61)", spec);
  };
  const std::string pre = "random:kimi-k2:";
  if (spec.rfind(pre, 0) != 0) bad();
  std::string rest = spec.substr(pre.size());
  bool int4 = true;
  if (rest.size() > 5 && rest.compare(rest.size() - 5, 5, ":bf16") == 0) int4 = false, rest.resize(rest.size() - 5);
  if (rest.empty() || rest.size() > 2 || rest.find_first_not_of("0123456789") != std::string::npos) bad();
  const int64_t layers = std::stoll(rest);
  if (layers < 1 || layers > 61) bad();
  return make_random_checkpoint(kimi_k2_shape(layers, int4), 0.02f, 1);
}

}  // namespace talon
