#include "train/eagle3.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "model/model.h"
#include "util/error.h"

namespace talon::eagle3 {

DraftVocab build_draft_vocab(const std::vector<int64_t>& counts, int64_t vd) {
  const int64_t V = int64_t(counts.size());
  TALON_CHECK(vd >= 1 && vd <= V, "--draft-vocab {}: must be between 1 and the target vocabulary size {}", vd, V);
  std::vector<int64_t> order(static_cast<size_t>(V));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return counts[size_t(a)] > counts[size_t(b)]; });
  DraftVocab dv;
  dv.t2d.assign(static_cast<size_t>(V), 0);
  for (int64_t i = 0; i < vd && counts[size_t(order[size_t(i)])] > 0; ++i) {
    dv.kept.push_back(order[size_t(i)]);
    dv.t2d[size_t(order[size_t(i)])] = 1;
  }
  for (int64_t j = 0; int64_t(dv.kept.size()) < vd; ++j)  // pad with the lowest unused ids
    if (!dv.t2d[size_t(j)]) {
      dv.kept.push_back(j);
      dv.t2d[size_t(j)] = 1;
    }
  std::sort(dv.kept.begin(), dv.kept.end());
  for (int64_t i = 0; i < vd; ++i) dv.d2t.push_back(dv.kept[size_t(i)] - i);
  return dv;
}

namespace {

using Vec = std::vector<double>;

// y[n, o] = sum_k x[n, k] * w[o, k]
void linear(Vec& y, const Vec& x, const std::vector<float>& w, int64_t N, int64_t K, int64_t O) {
  y.assign(size_t(N * O), 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < O; ++o) {
      double acc = 0;
      const float* wr = w.data() + o * K;
      const double* xr = x.data() + n * K;
      for (int64_t k = 0; k < K; ++k) acc += xr[k] * double(wr[k]);
      y[size_t(n * O + o)] = acc;
    }
}

void rmsnorm(double* out, const double* x, const float* w, int64_t C, double eps) {
  double ss = 0;
  for (int64_t c = 0; c < C; ++c) ss += x[c] * x[c];
  const double r = 1.0 / std::sqrt(ss / double(C) + eps);
  for (int64_t c = 0; c < C; ++c) out[c] = x[c] * r * double(w[c]);
}

void rope(double* x, int64_t heads, int64_t hd, int64_t pos, const std::vector<float>& inv) {
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

}  // namespace

TttResult ttt_forward(const DraftConfig& c, const DraftWeights& w, const TargetHead& tgt, const DraftVocab& vocab,
                      const Sample& s, bool keep_logits) {
  const int64_t T = s.T, H = c.H, I = c.I, nh = c.n_heads, nkv = c.n_kv_heads, hd = c.head_dim, V = c.V, Vd = c.Vd;
  TALON_CHECK(nh > 0 && nkv > 0 && nh % nkv == 0, "draft: {} heads not a multiple of {} kv heads", nh, nkv);
  TALON_CHECK(int64_t(vocab.kept.size()) == Vd && int64_t(vocab.t2d.size()) == V, "draft vocabulary has {} of {} ids",
              vocab.kept.size(), Vd);
  const int64_t qd = nh * hd, kvd = nkv * hd, grp = nh / nkv, K = c.ttt_steps;
  const std::vector<float> inv = rope_inv_freq(c.rope, hd);

  // Target distribution over the draft vocabulary, its argmax, and whether the target's
  // full-vocabulary argmax is a draft token.
  Vec P(static_cast<size_t>(T * Vd));
  std::vector<int64_t> tgt_arg(static_cast<size_t>(T));
  std::vector<uint8_t> in_vocab(static_cast<size_t>(T));
  {
    Vec hn(static_cast<size_t>(H)), full(static_cast<size_t>(V));
    for (int64_t t = 0; t < T; ++t) {
      Vec h(s.hidden + t * H, s.hidden + (t + 1) * H);
      rmsnorm(hn.data(), h.data(), tgt.final_norm, H, tgt.rms_eps);
      for (int64_t v = 0; v < V; ++v) {
        double acc = 0;
        for (int64_t k = 0; k < H; ++k) acc += hn[size_t(k)] * double(tgt.lm_head[v * H + k]);
        full[size_t(v)] = acc;
      }
      in_vocab[size_t(t)] = vocab.t2d[size_t(std::max_element(full.begin(), full.end()) - full.begin())];
      double mx = -INFINITY;
      for (int64_t d = 0; d < Vd; ++d) mx = std::max(mx, full[size_t(vocab.kept[size_t(d)])]);
      double z = 0;
      for (int64_t d = 0; d < Vd; ++d) z += std::exp(full[size_t(vocab.kept[size_t(d)])] - mx);
      int64_t best = 0;
      for (int64_t d = 0; d < Vd; ++d) {
        P[size_t(t * Vd + d)] = std::exp(full[size_t(vocab.kept[size_t(d)])] - mx) / z;
        if (P[size_t(t * Vd + d)] > P[size_t(t * Vd + best)]) best = d;
      }
      tgt_arg[size_t(t)] = best;
    }
  }

  TttResult r;
  Vec A(s.aux, s.aux + T * 3 * H), g;
  linear(g, A, w.fc, T, 3 * H, H);
  std::vector<Vec> keys, vals;  // per step: [T, kvd]
  std::vector<uint8_t> right(static_cast<size_t>(T), 1);
  double prod = 1;
  r.accept_len = 1;
  for (int64_t k = 0; k < K; ++k) {
    // Inputs: token x[t+1+k] (teacher forcing) and the hidden state g.
    Vec xin(static_cast<size_t>(T * 2 * H)), tmp(static_cast<size_t>(H));
    for (int64_t t = 0; t < T; ++t) {
      const int64_t tp = t + 1 + k;
      const int32_t tok = tp < T ? s.ids[tp] : 0;
      TALON_CHECK(tok >= 0 && tok < V, "draft: token id {} outside the vocabulary", tok);
      Vec e(tgt.embed + int64_t(tok) * H, tgt.embed + (int64_t(tok) + 1) * H);
      rmsnorm(xin.data() + t * 2 * H, e.data(), w.in_ln.data(), H, c.rms_eps);
      rmsnorm(xin.data() + t * 2 * H + H, g.data() + t * H, w.hidden_norm.data(), H, c.rms_eps);
    }
    Vec q, kk, vv;
    linear(q, xin, w.wq, T, 2 * H, qd);
    linear(kk, xin, w.wk, T, 2 * H, kvd);
    linear(vv, xin, w.wv, T, 2 * H, kvd);
    for (int64_t t = 0; t < T; ++t) {
      rope(q.data() + t * qd, nh, hd, t + k, inv);
      rope(kk.data() + t * kvd, nkv, hd, t + k, inv);
    }
    keys.push_back(kk);
    vals.push_back(vv);
    // Attention: step-0 keys at positions <= t, plus the key at t of every step 1..k.
    Vec att(static_cast<size_t>(T * qd), 0.0);
    const double scale = 1.0 / std::sqrt(double(hd));
    std::vector<double> sc;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t kh = h / grp;
        const double* qp = q.data() + t * qd + h * hd;
        sc.clear();
        auto dot = [&](const Vec& kv, int64_t pos) {
          double a = 0;
          for (int64_t i = 0; i < hd; ++i) a += qp[i] * kv[size_t(pos * kvd + kh * hd + i)];
          return a * scale;
        };
        for (int64_t p = 0; p <= t; ++p) sc.push_back(dot(keys[0], p));
        for (int64_t j = 1; j <= k; ++j) sc.push_back(dot(keys[size_t(j)], t));
        const double mx = *std::max_element(sc.begin(), sc.end());
        double z = 0;
        for (auto& x : sc) z += (x = std::exp(x - mx));
        double* op = att.data() + t * qd + h * hd;
        size_t n = 0;
        auto acc = [&](const Vec& kv, int64_t pos) {
          const double pw = sc[n++] / z;
          for (int64_t i = 0; i < hd; ++i) op[i] += pw * kv[size_t(pos * kvd + kh * hd + i)];
        };
        for (int64_t p = 0; p <= t; ++p) acc(vals[0], p);
        for (int64_t j = 1; j <= k; ++j) acc(vals[size_t(j)], t);
      }
    Vec o;
    linear(o, att, w.wo, T, qd, H);
    Vec g1(static_cast<size_t>(T * H)), hm(static_cast<size_t>(T * H));
    for (int64_t t = 0; t < T; ++t) {
      if (c.norm_before_residual) rmsnorm(tmp.data(), g.data() + t * H, w.hidden_norm.data(), H, c.rms_eps);
      for (int64_t i = 0; i < H; ++i)
        g1[size_t(t * H + i)] = (c.norm_before_residual ? tmp[size_t(i)] : g[size_t(t * H + i)]) + o[size_t(t * H + i)];
      rmsnorm(hm.data() + t * H, g1.data() + t * H, w.post_ln.data(), H, c.rms_eps);
    }
    Vec ga, up, down;
    linear(ga, hm, w.gate, T, H, I);
    linear(up, hm, w.up, T, H, I);
    for (size_t i = 0; i < ga.size(); ++i) ga[i] = ga[i] / (1.0 + std::exp(-ga[i])) * up[i];
    linear(down, ga, w.down, T, I, H);
    Vec g2(static_cast<size_t>(T * H)), fn(static_cast<size_t>(T * H));
    for (int64_t i = 0; i < T * H; ++i) g2[size_t(i)] = g1[size_t(i)] + down[size_t(i)];
    for (int64_t t = 0; t < T; ++t) rmsnorm(fn.data() + t * H, g2.data() + t * H, w.norm.data(), H, c.rms_eps);
    Vec logits;
    linear(logits, fn, w.lm_head, T, H, Vd);

    // Loss and metrics over the positions that count at this step.
    double loss = 0;
    int64_t n = 0, hits = 0, cond_n = 0, cond_hits = 0;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t tp = t + 1 + k;
      const double* lg = logits.data() + t * Vd;
      const int64_t arg = std::max_element(lg, lg + Vd) - lg;
      const bool counts = tp < T && s.mask[tp] && in_vocab[size_t(tp)];
      const bool hit = counts && arg == tgt_arg[size_t(tp)];
      if (counts) {
        const double mx = *std::max_element(lg, lg + Vd);
        double z = 0;
        for (int64_t d = 0; d < Vd; ++d) z += std::exp(lg[d] - mx);
        const double lz = mx + std::log(z);
        double ce = 0;
        for (int64_t d = 0; d < Vd; ++d) ce -= P[size_t(tp * Vd + d)] * (lg[d] - lz);
        loss += ce;
        ++n;
        hits += hit;
        if (right[size_t(t)]) {
          ++cond_n;
          cond_hits += hit;
        }
      }
      right[size_t(t)] = right[size_t(t)] && hit;
    }
    r.loss_k.push_back(n ? loss / double(n) : 0.0);
    r.acc_k.push_back(n ? double(hits) / double(n) : 0.0);
    r.cond_acc_k.push_back(cond_n ? double(cond_hits) / double(cond_n) : 0.0);
    r.n_k.push_back(n);
    r.loss += std::pow(c.step_decay, double(k)) * r.loss_k.back();
    prod *= r.acc_k.back();
    r.accept_len += prod;
    if (keep_logits) r.logits.emplace_back(logits.begin(), logits.end());
    g = std::move(g2);
  }
  return r;
}

}  // namespace talon::eagle3
