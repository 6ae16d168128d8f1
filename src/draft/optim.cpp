#include "draft/optim.h"

#include <cmath>
#include <numbers>

#include "util/error.h"

namespace talon::train {

double lr_at(const OptimConfig& c, int64_t step) {
  if (c.warmup_steps > 0 && step < c.warmup_steps) return c.lr * double(step + 1) / double(c.warmup_steps);
  if (c.schedule == "constant" || c.total_steps <= c.warmup_steps) return c.lr;
  const double p = std::min(1.0, double(step - c.warmup_steps) / double(c.total_steps - c.warmup_steps));
  const double lo = c.lr * c.min_lr_ratio;
  if (c.schedule == "linear") return lo + (c.lr - lo) * (1.0 - p);
  if (c.schedule == "cosine") return lo + (c.lr - lo) * 0.5 * (1.0 + std::cos(std::numbers::pi * p));
  fail("--schedule '{}': expected cosine, linear or constant", c.schedule);
}

double clip_grad_norm(const std::vector<Param>& ps, double max_norm) {
  double ss = 0;
  for (auto& p : ps)
    for (double g : *p.g) ss += g * g;
  const double norm = std::sqrt(ss);
  if (max_norm > 0) {
    const double coef = max_norm / (norm + 1e-6);
    if (coef < 1.0)
      for (auto& p : ps)
        for (double& g : *p.g) g *= coef;
  }
  return norm;
}

void AdamW::step(const std::vector<Param>& ps) {
  if (m_.empty())
    for (auto& p : ps) {
      m_.emplace_back(p.w->size(), 0.0f);
      v_.emplace_back(p.w->size(), 0.0f);
    }
  TALON_CHECK(m_.size() == ps.size(), "optimizer: {} parameter tensors, expected {}", ps.size(), m_.size());
  const double lr = lr_at(c_, t_);
  ++t_;
  const double bc1 = 1.0 - std::pow(c_.beta1, double(t_)), bc2 = 1.0 - std::pow(c_.beta2, double(t_));
  const float b1 = float(c_.beta1), b2 = float(c_.beta2);
  for (size_t i = 0; i < ps.size(); ++i) {
    std::vector<float>& w = *ps[i].w;
    const std::vector<double>& g = *ps[i].g;
    TALON_CHECK(g.size() == w.size(), "optimizer: {} has {} gradients for {} weights", ps[i].name, g.size(), w.size());
    std::vector<float>&m = m_[i], &v = v_[i];
    const float decay = ps[i].decay ? float(1.0 - lr * c_.weight_decay) : 1.0f;
    const float step = float(lr / bc1), sbc2 = float(std::sqrt(bc2)), eps = float(c_.eps);
    for (size_t j = 0; j < w.size(); ++j) {
      const float gj = float(g[j]);
      w[j] *= decay;
      m[j] = b1 * m[j] + (1.0f - b1) * gj;
      v[j] = b2 * v[j] + (1.0f - b2) * gj * gj;
      w[j] -= step * m[j] / (std::sqrt(v[j]) / sbc2 + eps);
    }
  }
}

}  // namespace talon::train
