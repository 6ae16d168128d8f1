#include "spec/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "util/error.h"

namespace talon::spec {

void SamplingParams::validate() const {
  TALON_CHECK(temperature >= 0 && std::isfinite(temperature), "--temperature must be >= 0 (got {})", temperature);
  TALON_CHECK(top_p > 0 && top_p <= 1, "--top-p must be in (0, 1] (got {})", top_p);
  TALON_CHECK(top_k >= 0, "--top-k must be >= 0 (got {})", top_k);
}

namespace {
uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
}  // namespace

double uniform01(uint64_t seed, uint64_t stream, uint64_t counter) {
  const uint64_t z = mix(mix(mix(seed) ^ stream) ^ counter);
  return double(z >> 11) * 0x1.0p-53;
}

int32_t argmax(const float* logits, int64_t V) {
  int64_t best = 0;
  for (int64_t i = 1; i < V; ++i)
    if (logits[i] > logits[best]) best = i;
  return int32_t(best);
}

void sampling_distribution(const float* logits, int64_t V, const SamplingParams& p, std::vector<double>& out) {
  out.assign(size_t(V), 0.0);
  if (p.greedy()) {
    out[size_t(argmax(logits, V))] = 1.0;
    return;
  }
  double mx = -INFINITY;
  for (int64_t i = 0; i < V; ++i) mx = std::max(mx, double(logits[i]));
  double z = 0;
  for (int64_t i = 0; i < V; ++i) z += out[size_t(i)] = std::exp((double(logits[i]) - mx) / p.temperature);
  for (auto& x : out) x /= z;
  if ((p.top_k > 0 && p.top_k < V) || p.top_p < 1) {
    // Ids by decreasing probability (ties: lower id first), then cut.
    std::vector<int32_t> order(static_cast<size_t>(V));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return out[size_t(a)] > out[size_t(b)]; });
    int64_t keep = p.top_k > 0 ? std::min<int64_t>(p.top_k, V) : V;
    if (p.top_p < 1) {
      double mass = 0;
      for (int64_t i = 0; i < keep; ++i) {
        mass += out[size_t(order[size_t(i)])];
        if (mass >= p.top_p) {
          keep = i + 1;
          break;
        }
      }
    }
    double kept = 0;
    for (int64_t i = 0; i < V; ++i) {
      double& x = out[size_t(order[size_t(i)])];
      if (i >= keep) x = 0;
      kept += x;
    }
    for (auto& x : out) x /= kept;
  }
}

int32_t draw(const std::vector<double>& probs, double u) {
  double total = 0;
  for (double x : probs) total += x;
  TALON_CHECK(total > 0, "sampling: a distribution with no mass");
  const double target = u * total;
  double acc = 0;
  int32_t last = -1;
  for (size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] <= 0) continue;
    acc += probs[i];
    last = int32_t(i);
    if (target < acc) return int32_t(i);
  }
  return last;  // rounding: u*total reached the sum
}

int32_t sample_token(const float* logits, int64_t V, const SamplingParams& p, uint64_t stream, uint64_t counter,
                     std::vector<double>& scratch) {
  if (p.greedy()) return argmax(logits, V);
  sampling_distribution(logits, V, p, scratch);
  return draw(scratch, uniform01(p.seed, stream, counter));
}

}  // namespace talon::spec
