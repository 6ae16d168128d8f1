// AdamW with fp32 master weights and fp32 moments, learning-rate schedules (linear
// warm-up, then cosine, linear or constant), and global-norm gradient clipping, with
// PyTorch's semantics (torch.optim.AdamW, torch.nn.utils.clip_grad_norm_).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace talon::train {

struct OptimConfig {
  double lr = 1e-4;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double weight_decay = 0.0;  // decoupled; applied to matrices only, never to norm weights
  int64_t warmup_steps = 0;
  int64_t total_steps = 0;     // for the decay; 0: constant after warm-up
  std::string schedule = "cosine";  // cosine | linear | constant
  double min_lr_ratio = 0.0;   // the decay ends at lr * min_lr_ratio
  double clip_norm = 0.5;      // 0: no clipping
};

// Learning rate of optimizer step `step` (0-based).
double lr_at(const OptimConfig& c, int64_t step);

// One parameter tensor: fp32 master weights and its fp64 gradient.
struct Param {
  const char* name;
  std::vector<float>* w;
  std::vector<double>* g;
  bool decay;  // weight decay applies
};

// Scales all gradients so their global L2 norm is at most max_norm (as PyTorch:
// coefficient max_norm / (norm + 1e-6), capped at 1). Returns the norm before clipping.
double clip_grad_norm(const std::vector<Param>& ps, double max_norm);

class AdamW {
 public:
  explicit AdamW(OptimConfig c) : c_(std::move(c)) {}
  // Applies one update with the current gradients and lr_at(step()); then step() + 1.
  void step(const std::vector<Param>& ps);
  int64_t step_count() const { return t_; }
  const OptimConfig& config() const { return c_; }
  // Moments, in the order of the parameters (for checkpoints).
  std::vector<std::vector<float>>& m() { return m_; }
  std::vector<std::vector<float>>& v() { return v_; }
  void set_step_count(int64_t t) { t_ = t; }

 private:
  OptimConfig c_;
  int64_t t_ = 0;
  std::vector<std::vector<float>> m_, v_;
};

}  // namespace talon::train
