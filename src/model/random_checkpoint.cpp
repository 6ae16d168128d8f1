#include "model/random_checkpoint.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <vector>

#include "model/dense.h"

namespace talon {

namespace {

class RandomCheckpoint final : public Checkpoint {
 public:
  RandomCheckpoint(const ModelConfig& cfg, float std, uint64_t seed) {
    config_ = cfg;
    source_ = "random " + std::string(arch_name(cfg.arch)) + " weights";
    DenseWeights w;
    int64_t most = 0;
    for (const WeightSpec& s : dense_weight_table(cfg, w)) {
      CkptTensor t;
      t.name = s.name;
      t.stored_type = "BF16";
      t.shape = s.shape;
      t.file = source_;
      most = std::max(most, t.numel());
      tensors_.push_back(t);
    }
    index();
    constexpr int64_t kSlack = 1 << 20;
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
    ones_.assign(size_t(std::max(cfg.hidden, cfg.head_dim)), 0x3f80);  // bf16 1.0
  }

  WeightRef weight(const CkptTensor& t) const override {
    if (t.name.find("norm") != std::string::npos) return {DType::BF16, ones_.data(), t.shape};
    const size_t i = size_t(&t - tensors_.data());
    return {DType::BF16, pool_.data() + offset_[i], t.shape};
  }

 private:
  std::vector<uint16_t> pool_, ones_;
  std::vector<int64_t> offset_;
};

}  // namespace

std::unique_ptr<Checkpoint> make_random_checkpoint(const ModelConfig& cfg, float std, uint64_t seed) {
  return std::make_unique<RandomCheckpoint>(cfg, std, seed);
}

}  // namespace talon
