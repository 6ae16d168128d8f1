// The fp64 CPU reference's building blocks, shared by every drafter family's reference
// (EAGLE-3 in eagle3.cpp, P-EAGLE in peagle.cpp, DFlash in dflash.cpp): products, RMSNorm,
// RoPE, one attention head, the layer's second half, the target's draft-vocabulary
// distribution and the loss rows, and their backward passes, each with one fixed summation
// order whatever the thread count.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "draft/eagle3.h"

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

// log(sum_d exp(lg[d])) over n logits, shifted by their maximum.
inline double log_sum_exp(const double* lg, int64_t n) {
  const double mx = *std::max_element(lg, lg + n);
  double z = 0;
  for (int64_t d = 0; d < n; ++d) z += std::exp(lg[d] - mx);
  return mx + std::log(z);
}

// KL(p || softmax(lg)) = sum over p[d] > 0 of p[d] (log p[d] - (lg[d] - lz)), lz the logits'
// log_sum_exp.
inline double kl_row(const double* p, const double* lg, double lz, int64_t n) {
  double kl = 0;
  for (int64_t d = 0; d < n; ++d)
    if (p[d] > 0) kl += p[d] * (std::log(p[d]) - (lg[d] - lz));
  return kl;
}

// The target's distribution over the draft vocabulary at one hidden state h [H]: softmax over
// d of final_norm(h) . lm_head[kept[d]], into p[Vd]; returns the argmax of those logits
// (the first of ties).
inline int64_t target_draft_row(const float* h, const TargetHead& tgt, const DraftVocab& vocab, int64_t H,
                                double* p);

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

// One query head's softmax attention over the keys it reads (rows of hd values):
// p = softmax(scale * q.k_i), out += sum_i p_i v_i (out may be null: p only, as a backward
// that recomputes it needs). p is kept for the backward.
inline void attend_head(const double* q, const std::vector<const double*>& k, const std::vector<const double*>& v,
                        int64_t hd, double scale, double* out, Vec& p) {
  p.assign(k.size(), 0.0);
  for (size_t i = 0; i < k.size(); ++i) {
    for (int64_t e = 0; e < hd; ++e) p[i] += q[e] * k[i][e];
    p[i] *= scale;
  }
  const double mx = *std::max_element(p.begin(), p.end());
  double z = 0;
  for (double& x : p) z += (x = std::exp(x - mx));
  for (size_t i = 0; i < k.size(); ++i) {
    p[i] /= z;
    if (out)
      for (int64_t e = 0; e < hd; ++e) out[e] += p[i] * v[i][e];
  }
}

// Its backward from d(out) and the saved p: dq += ..., dk_i += ..., dv_i += ...
inline void attend_head_backward(const double* q, const double* dout, const std::vector<const double*>& k,
                                 const std::vector<const double*>& v, const Vec& p, int64_t hd, double scale,
                                 double* dq, const std::vector<double*>& dk, const std::vector<double*>& dv) {
  Vec dp(k.size(), 0.0);
  double sum_pdp = 0;
  for (size_t i = 0; i < k.size(); ++i) {
    for (int64_t e = 0; e < hd; ++e) {
      dp[i] += dout[e] * v[i][e];
      dv[i][e] += p[i] * dout[e];
    }
    sum_pdp += p[i] * dp[i];
  }
  for (size_t i = 0; i < k.size(); ++i) {
    const double ds = p[i] * (dp[i] - sum_pdp) * scale;
    for (int64_t e = 0; e < hd; ++e) {
      dq[e] += ds * k[i][e];
      dk[i][e] += ds * q[e];
    }
  }
}

// The layer after attention, over N rows: g1 = res + o, g2 = g1 + down(silu(gate(hm)) *
// up(hm)) with hm = post_ln(g1), logits = lm_head(norm(g2)). Keeps what the backward reads.
struct Tail {
  Vec g1, hm, ga, up, act, g2, fn;
};
inline void tail_forward(Tail& a, Vec& logits, const Vec& res, const Vec& o, const DraftWeights& w,
                         const DraftConfig& c, int64_t N) {
  const int64_t H = c.H, I = c.I;
  a.g1.resize(size_t(N * H));
  a.hm.resize(size_t(N * H));
  for (int64_t i = 0; i < N * H; ++i) a.g1[size_t(i)] = res[size_t(i)] + o[size_t(i)];
  for (int64_t n = 0; n < N; ++n) rmsnorm(a.hm.data() + n * H, a.g1.data() + n * H, w.post_ln.data(), H, c.rms_eps);
  linear(a.ga, a.hm, w.gate, N, H, I);
  linear(a.up, a.hm, w.up, N, H, I);
  a.act.resize(a.ga.size());
  for (size_t i = 0; i < a.ga.size(); ++i) a.act[i] = a.ga[i] / (1.0 + std::exp(-a.ga[i])) * a.up[i];
  Vec down;
  linear(down, a.act, w.down, N, I, H);
  a.g2.resize(size_t(N * H));
  a.fn.resize(size_t(N * H));
  for (int64_t i = 0; i < N * H; ++i) a.g2[size_t(i)] = a.g1[size_t(i)] + down[size_t(i)];
  for (int64_t n = 0; n < N; ++n) rmsnorm(a.fn.data() + n * H, a.g2.data() + n * H, w.norm.data(), H, c.rms_eps);
  linear(logits, a.fn, w.lm_head, N, H, c.Vd);
}

// Its backward from dlogits plus dg2_in (a gradient already reaching g2, or zeros): returns
// d(g1) (= d(res) = d(o)). The lm_head gradient is formed only when `lm_head_grad`.
inline Vec tail_backward(const Tail& a, const Vec& dlogits, Vec dg2_in, const DraftWeights& w, DraftGrads& G,
                         bool lm_head_grad, const DraftConfig& c, int64_t N) {
  const int64_t H = c.H, I = c.I;
  Vec dfn(size_t(N * H), 0.0);
  linear_backward(&dfn, lm_head_grad ? &G.lm_head : nullptr, dlogits, a.fn, w.lm_head, N, H, c.Vd);
  Vec& dg2 = dg2_in;
  for (int64_t n = 0; n < N; ++n)
    rmsnorm_backward(dg2.data() + n * H, &G.norm, dfn.data() + n * H, a.g2.data() + n * H, w.norm.data(), H,
                     c.rms_eps);
  Vec dact(size_t(N * I), 0.0);
  linear_backward(&dact, &G.down, dg2, a.act, w.down, N, I, H);
  Vec dga(size_t(N * I)), dup(size_t(N * I));
  for (size_t i = 0; i < dact.size(); ++i) {
    const double x = a.ga[i], sg = 1.0 / (1.0 + std::exp(-x)), silu = x * sg;
    dup[i] = dact[i] * silu;
    dga[i] = dact[i] * a.up[i] * sg * (1.0 + x * (1.0 - sg));
  }
  Vec dhm(size_t(N * H), 0.0);
  linear_backward(&dhm, &G.gate, dga, a.hm, w.gate, N, H, I);
  linear_backward(&dhm, &G.up, dup, a.hm, w.up, N, H, I);
  Vec dg1 = dg2;
  for (int64_t n = 0; n < N; ++n)
    rmsnorm_backward(dg1.data() + n * H, &G.post_ln, dhm.data() + n * H, a.g1.data() + n * H, w.post_ln.data(), H,
                     c.rms_eps);
  return dg1;
}

inline int64_t target_draft_row(const float* h, const TargetHead& tgt, const DraftVocab& vocab, int64_t H,
                                double* p) {
  const int64_t Vd = int64_t(vocab.kept.size());
  Vec x(h, h + H), hn(static_cast<size_t>(H)), lg(static_cast<size_t>(Vd));
  rmsnorm(hn.data(), x.data(), tgt.final_norm, H, tgt.rms_eps);
  for (int64_t d = 0; d < Vd; ++d) lg[size_t(d)] = dot(hn.data(), tgt.lm_head + vocab.kept[size_t(d)] * H, H);
  const double mx = *std::max_element(lg.begin(), lg.end());
  double z = 0;
  for (double v : lg) z += std::exp(v - mx);
  for (int64_t d = 0; d < Vd; ++d) p[d] = std::exp(lg[size_t(d)] - mx) / z;
  return std::max_element(lg.begin(), lg.end()) - lg.begin();
}

}  // namespace talon::eagle3::ops
