// The fp64 CPU reference's building blocks, shared by every drafter family's reference
// (EAGLE-3 in eagle3.cpp, P-EAGLE in peagle.cpp): products, RMSNorm, RoPE and their
// backward passes, each with one fixed summation order whatever the thread count.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace talon::eagle3::ops {

using Vec = std::vector<double>;

// sum_k x[k] * w[k] with 8 interleaved partial sums combined in a fixed order: the
// compiler can vectorise it, and the result does not depend on anything but the inputs.
inline double dot(const double* x, const float* w, int64_t K) {
  double p[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= K; k += 8)
    for (int j = 0; j < 8; ++j) p[j] += x[k + j] * double(w[k + j]);
  double acc = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
  for (; k < K; ++k) acc += x[k] * double(w[k]);
  return acc;
}

// y[n, o] = sum_k x[n, k] * w[o, k]. Threads split rows; each output element has one
// fixed summation order, so results do not depend on the thread count.
inline void linear(Vec& y, const Vec& x, const std::vector<float>& w, int64_t N, int64_t K, int64_t O) {
  y.assign(size_t(N * O), 0.0);
#pragma omp parallel for schedule(static) if (N * O * K > (1 << 16))
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < O; ++o) y[size_t(n * O + o)] = dot(x.data() + n * K, w.data() + o * K, K);
}

inline void rmsnorm(double* out, const double* x, const float* w, int64_t C, double eps) {
  double ss = 0;
  for (int64_t c = 0; c < C; ++c) ss += x[c] * x[c];
  const double r = 1.0 / std::sqrt(ss / double(C) + eps);
  for (int64_t c = 0; c < C; ++c) out[c] = x[c] * r * double(w[c]);
}

inline void rope(double* x, int64_t heads, int64_t hd, int64_t pos, const std::vector<float>& inv) {
  for (int64_t h = 0; h < heads; ++h) {
    double* p = x + h * hd;
    for (int64_t i = 0; i < hd / 2; ++i) {
      const double ang = double(pos) * double(inv[size_t(i)]);
      const double c = std::cos(ang), s = std::sin(ang), a = p[i], b = p[i + hd / 2];
      p[i] = a * c - b * s;
      p[i + hd / 2] = b * c + a * s;
    }
  }
}

// dx[n, k] += sum_o dy[n, o] * w[o, k];  dw[o, k] += sum_n dy[n, o] * x[n, k]
// (threads split rows of dx, then rows of dw: fixed summation order per element).
inline void linear_backward(Vec* dx, std::vector<double>* dw, const Vec& dy, const Vec& x, const std::vector<float>& w,
                     int64_t N, int64_t K, int64_t O) {
  const bool par = N * O * K > (1 << 16);
  if (dx) {
#pragma omp parallel for schedule(static) if (par)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < O; ++o) {
        const double d = dy[size_t(n * O + o)];
        if (d == 0) continue;
        const float* wr = w.data() + o * K;
        double* xr = dx->data() + n * K;
        for (int64_t k = 0; k < K; ++k) xr[k] += d * double(wr[k]);
      }
  }
  if (dw) {
#pragma omp parallel for schedule(static) if (par)
    for (int64_t o = 0; o < O; ++o)
      for (int64_t n = 0; n < N; ++n) {
        const double d = dy[size_t(n * O + o)];
        if (d == 0) continue;
        const double* xr = x.data() + n * K;
        double* wr = dw->data() + o * K;
        for (int64_t k = 0; k < K; ++k) wr[k] += d * xr[k];
      }
  }
}

// out = x * r * w, r = (mean(x^2) + eps)^-1/2: dx += r*w*dout - x * r^3 / C * sum(w*dout*x); dw += dout*x*r
inline void rmsnorm_backward(double* dx, std::vector<double>* dw, const double* dout, const double* x, const float* w,
                      int64_t C, double eps) {
  double ss = 0, dot = 0;
  for (int64_t c = 0; c < C; ++c) {
    ss += x[c] * x[c];
    dot += double(w[c]) * dout[c] * x[c];
  }
  const double r = 1.0 / std::sqrt(ss / double(C) + eps);
  for (int64_t c = 0; c < C; ++c) {
    if (dx) dx[c] += r * double(w[c]) * dout[c] - x[c] * r * r * r / double(C) * dot;
    if (dw) (*dw)[size_t(c)] += dout[c] * x[c] * r;
  }
}


}  // namespace talon::eagle3::ops
