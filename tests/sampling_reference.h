// A sampling oracle written from the definition, independent of model/sampling.cpp: softmax of
// logits / T in fp64, a full sort (probability descending, id ascending), the top-k and then
// the shortest prefix whose mass reaches top_p, and the inverse-CDF draw in id order. It also
// says when the answer hangs on rounding: u * total within `eps` (relative) of a boundary of
// the CDF, or the top-p prefix's mass within `eps` of top_p. Implementations that sum in
// another order may then pick a neighbour, and nothing else.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace talon::testing {

struct ReferenceDraw {
  int32_t id = -1;
  bool ambiguous = false;
};

inline ReferenceDraw reference_draw(const float* logits, int64_t V, double T, int64_t top_k, double top_p, double u,
                                    double eps = 1e-9) {
  ReferenceDraw r;
  if (T <= 0) {
    r.id = int32_t(std::max_element(logits, logits + V) - logits);
    return r;
  }
  double mx = -INFINITY;
  for (int64_t i = 0; i < V; ++i) mx = std::max(mx, double(logits[i]));
  std::vector<double> p(static_cast<size_t>(V));
  double z = 0;
  for (int64_t i = 0; i < V; ++i) z += p[size_t(i)] = std::exp((double(logits[i]) - mx) / T);
  for (double& x : p) x /= z;
  std::vector<int32_t> order(static_cast<size_t>(V));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return p[size_t(a)] > p[size_t(b)] || (p[size_t(a)] == p[size_t(b)] && a < b);
  });
  int64_t keep = top_k > 0 ? std::min(top_k, V) : V;
  if (top_p < 1) {
    double mass = 0;
    for (int64_t i = 0; i < keep; ++i) {
      mass += p[size_t(order[size_t(i)])];
      if (mass >= top_p) {
        // Ambiguous when one id less would almost reach top_p, or this one barely does.
        if (mass - top_p < eps || top_p - (mass - p[size_t(order[size_t(i)])]) < eps) r.ambiguous = true;
        keep = i + 1;
        break;
      }
    }
  }
  std::vector<double> q(static_cast<size_t>(V), 0.0);
  double kept = 0;
  for (int64_t i = 0; i < keep; ++i) kept += p[size_t(order[size_t(i)])];
  for (int64_t i = 0; i < keep; ++i) q[size_t(order[size_t(i)])] = p[size_t(order[size_t(i)])] / kept;
  double total = 0;
  for (double x : q) total += x;
  const double target = u * total;
  double acc = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (q[size_t(i)] <= 0) continue;
    const double before = acc;
    acc += q[size_t(i)];
    r.id = int32_t(i);
    if (target < acc) {
      if ((before > 0 && target - before < eps * total) || acc - target < eps * total) r.ambiguous = true;
      return r;
    }
  }
  r.ambiguous = true;  // u * total reached the sum: the last kept id, by rounding
  return r;
}

}  // namespace talon::testing
