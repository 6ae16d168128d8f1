#include "model/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "util/error.h"

namespace talon {

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
    // Ids by decreasing probability (ties: lower id first: a strict order, so any sort gives
    // the same prefix), then cut. Only the prefix that is kept needs ordering: the k most
    // likely ids are ordered first (k = 64, then 4x while their mass is short of top_p), not
    // the whole vocabulary (a full sort per token made sampling at batch 256 cost ~1 s a step).
    std::vector<int32_t> order(static_cast<size_t>(V));
    std::iota(order.begin(), order.end(), 0);
    const auto before = [&](int32_t a, int32_t b) {
      return out[size_t(a)] > out[size_t(b)] || (out[size_t(a)] == out[size_t(b)] && a < b);
    };
    const int64_t cap = p.top_k > 0 ? std::min<int64_t>(p.top_k, V) : V;
    int64_t keep = cap;
    for (int64_t k = p.top_p < 1 ? std::min<int64_t>(cap, 64) : cap;; k = std::min<int64_t>(cap, k * 4)) {
      std::partial_sort(order.begin(), order.begin() + k, order.end(), before);
      if (p.top_p >= 1) break;  // top_k only: k == cap
      double mass = 0;
      int64_t reached = -1;
      for (int64_t i = 0; i < k; ++i) {
        mass += out[size_t(order[size_t(i)])];
        if (mass >= p.top_p) {
          reached = i + 1;
          break;
        }
      }
      if (reached > 0) {
        keep = reached;
        break;
      }
      if (k == cap) break;  // top_k reached first: keep all of it
    }
    // Zero all but the kept ids; renormalise by their mass (summed in rank order).
    std::vector<double> kept_p(static_cast<size_t>(keep));
    double kept = 0;
    for (int64_t i = 0; i < keep; ++i) kept += kept_p[size_t(i)] = out[size_t(order[size_t(i)])];
    std::fill(out.begin(), out.end(), 0.0);
    for (int64_t i = 0; i < keep; ++i) out[size_t(order[size_t(i)])] = kept_p[size_t(i)] / kept;
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

}  // namespace talon
