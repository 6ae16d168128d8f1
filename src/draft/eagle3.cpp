#include "draft/eagle3.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "draft/cpu_ops.h"
#include "model/model.h"
#include "util/error.h"

namespace talon::eagle3 {

RopeConfig draft_rope_for(const ModelConfig& tc) {
  if (!is_deepseek(tc.arch)) return tc.rope;
  RopeConfig r;
  r.theta = tc.rope.theta;
  return r;
}

DraftConfig draft_config_for(const ModelConfig& tc, int64_t vd) {
  DraftConfig c;
  c.H = tc.hidden;
  c.I = tc.intermediate;
  c.n_heads = tc.n_heads;
  c.n_kv_heads = is_deepseek(tc.arch) ? tc.n_heads : tc.n_kv_heads;
  c.head_dim = is_deepseek(tc.arch) ? tc.ds.v_head_dim : tc.head_dim;
  c.V = tc.vocab;
  c.Vd = std::min(vd, tc.vocab);
  c.rms_eps = tc.rms_eps;
  c.rope = draft_rope_for(tc);
  return c;
}

void apply_draft_shape(DraftConfig& c, const DraftShape& s) {
  auto set = [](int64_t& field, int64_t v, const char* opt) {
    if (v == 0) return;
    TALON_CHECK(v > 0, "{} {}: expected a positive size", opt, v);
    field = v;
  };
  set(c.I, s.intermediate, "--draft-intermediate");
  set(c.n_heads, s.heads, "--draft-heads");
  set(c.n_kv_heads, s.kv_heads, "--draft-kv-heads");
  set(c.head_dim, s.head_dim, "--draft-head-dim");
  TALON_CHECK(c.n_heads % c.n_kv_heads == 0,
              "--draft-heads {} / --draft-kv-heads {}: the heads must be a multiple of the kv heads", c.n_heads,
              c.n_kv_heads);
  TALON_CHECK(c.head_dim % 2 == 0, "--draft-head-dim {}: RoPE needs an even head size", c.head_dim);
}

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
  return draft_vocab_of(std::move(dv.kept), V);
}

DraftVocab draft_vocab_of(std::vector<int64_t> kept, int64_t V) {
  DraftVocab dv;
  dv.t2d.assign(static_cast<size_t>(V), 0);
  for (size_t i = 0; i < kept.size(); ++i) {
    TALON_CHECK(kept[i] >= 0 && kept[i] < V && (i == 0 || kept[i] > kept[i - 1]),
                "draft vocabulary: kept id {} (entry {}) is out of order or outside [0, {})", kept[i], i, V);
    dv.t2d[size_t(kept[i])] = 1;
    dv.d2t.push_back(kept[i] - int64_t(i));
  }
  dv.kept = std::move(kept);
  return dv;
}

using namespace ops;  // NOLINT: the reference is written in these ops
using Vec = std::vector<double>;


void add_step(TttResult& r, const StepTally& s, double decay_k) {
  r.loss_k.push_back(s.n ? s.ce_sum / double(s.n) : 0.0);
  r.acc_k.push_back(s.n ? double(s.hits) / double(s.n) : 0.0);
  r.cond_acc_k.push_back(s.cond_n ? double(s.cond_hits) / double(s.cond_n) : 0.0);
  r.n_k.push_back(s.n);
  r.loss += decay_k * r.loss_k.back();
  double prod = 1;
  r.accept_len = 1;
  for (double a : r.acc_k) r.accept_len += (prod *= a);
}

DraftGrads::DraftGrads(const DraftWeights& w)
    : fc(w.fc.size()), in_ln(w.in_ln.size()), hidden_norm(w.hidden_norm.size()), wq(w.wq.size()), wk(w.wk.size()),
      wv(w.wv.size()), wo(w.wo.size()), post_ln(w.post_ln.size()), gate(w.gate.size()), up(w.up.size()),
      down(w.down.size()), norm(w.norm.size()), lm_head(w.lm_head.size()) {}

std::vector<std::pair<const char*, std::vector<float>*>> DraftWeights::named() {
  return {{"fc", &fc}, {"in_ln", &in_ln}, {"hidden_norm", &hidden_norm}, {"wq", &wq},   {"wk", &wk},
          {"wv", &wv}, {"wo", &wo},       {"post_ln", &post_ln},         {"gate", &gate}, {"up", &up},
          {"down", &down}, {"norm", &norm}, {"lm_head", &lm_head}};
}

bool is_norm_weight(const std::string& name) {
  return name.find("norm") != std::string::npos || name.find("_ln") != std::string::npos;
}

std::vector<std::pair<const char*, std::vector<double>*>> DraftGrads::named() {
  return {{"fc", &fc}, {"in_ln", &in_ln}, {"hidden_norm", &hidden_norm}, {"wq", &wq},   {"wk", &wk},
          {"wv", &wv}, {"wo", &wo},       {"post_ln", &post_ln},         {"gate", &gate}, {"up", &up},
          {"down", &down}, {"norm", &norm}, {"lm_head", &lm_head}};
}

TttResult ttt_forward(const DraftConfig& c, const DraftWeights& w, const TargetHead& tgt, const DraftVocab& vocab,
                      const Sample& s, bool keep_logits, DraftGrads* grads) {
  const int64_t T = s.T, H = c.H, nh = c.n_heads, nkv = c.n_kv_heads, hd = c.head_dim, V = c.V, Vd = c.Vd;
  TALON_CHECK(nh > 0 && nkv > 0 && nh % nkv == 0, "draft: {} heads not a multiple of {} kv heads", nh, nkv);
  TALON_CHECK(int64_t(vocab.kept.size()) == Vd && int64_t(vocab.t2d.size()) == V, "draft vocabulary has {} of {} ids",
              vocab.kept.size(), Vd);
  const int64_t qd = nh * hd, kvd = nkv * hd, grp = nh / nkv, K = c.ttt_steps;
  const std::vector<float> inv = rope_inv_freq(c.rope, hd);

  // Target distribution over the draft vocabulary, its argmax, and whether the target's
  // full-vocabulary argmax is a draft token; only for the loss-masked rows, the only ones any
  // step reads (the full-vocabulary product is most of a sample's work on the CPU).
  Vec P(static_cast<size_t>(T * Vd));
  std::vector<int64_t> tgt_arg(static_cast<size_t>(T));
  std::vector<uint8_t> in_vocab(static_cast<size_t>(T));
  {
#pragma omp parallel for schedule(dynamic, 4)
    for (int64_t t = 0; t < T; ++t) {
      if (!s.mask[t]) continue;
      Vec hn(static_cast<size_t>(H)), full(static_cast<size_t>(V));
      Vec h(s.hidden + t * H, s.hidden + (t + 1) * H);
      rmsnorm(hn.data(), h.data(), tgt.final_norm, H, tgt.rms_eps);
      for (int64_t v = 0; v < V; ++v) full[size_t(v)] = dot(hn.data(), tgt.lm_head + v * H, H);
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

  // The rows each step computes. Step 0: every row (its keys are every later query's
  // context). Step k >= 1: the rows that some step j >= k still counts for: a row's later steps
  // read only its own earlier ones (its diagonal keys and hidden state), so a row no later
  // loss counts for has no effect on the loss, the metrics or any gradient. In chat data
  // these are most prompt rows. With keep_logits every row is kept (the caller reads them all).
  // rows[k]: step k's rows, ascending; at[k][t]: row t's index in rows[k], -1 when absent.
  std::vector<int64_t> last_count(static_cast<size_t>(T), -1);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < K; ++j) {
      const int64_t tp = t + 1 + j;
      if (tp < T && s.mask[tp] && in_vocab[size_t(tp)]) last_count[size_t(t)] = j;
    }
  std::vector<std::vector<int64_t>> rows(static_cast<size_t>(K)), at(static_cast<size_t>(K));
  for (int64_t k = 0; k < K; ++k) {
    at[size_t(k)].assign(size_t(T), -1);
    for (int64_t t = 0; t < T; ++t)
      if (k == 0 || keep_logits || last_count[size_t(t)] >= k) {
        at[size_t(k)][size_t(t)] = int64_t(rows[size_t(k)].size());
        rows[size_t(k)].push_back(t);
      }
  }
  // Rows of step `from`'s layout moved to step `to`'s (to > from: a subset; to < from: a
  // superset, zero elsewhere), W values a row.
  auto relayout = [&](const Vec& x, int64_t from, int64_t to, int64_t W) {
    const std::vector<int64_t>& dst = rows[size_t(to)];
    const std::vector<int64_t>& src = rows[size_t(from)];
    if (dst.size() == src.size()) return x;
    Vec y(dst.size() * size_t(W), 0.0);
    if (to > from) {
      for (size_t i = 0; i < dst.size(); ++i) {
        const int64_t f = at[size_t(from)][size_t(dst[i])];
        std::copy(x.begin() + f * W, x.begin() + (f + 1) * W, y.begin() + int64_t(i) * W);
      }
    } else {
      for (size_t i = 0; i < src.size(); ++i) {
        const int64_t f = at[size_t(to)][size_t(src[i])];
        std::copy(x.begin() + int64_t(i) * W, x.begin() + int64_t(i + 1) * W, y.begin() + f * W);
      }
    }
    return y;
  };

  TttResult r;
  Vec A(s.aux, s.aux + T * 3 * H), g;
  linear(g, A, w.fc, T, 3 * H, H);
  std::vector<Vec> keys, vals;  // per step: [rows of the step, kvd]
  // What the backward pass needs from each step.
  struct Saved {
    Vec e, g, xin, q, att;
    Tail tail;
    Vec dlogits;
  };
  std::vector<Saved> saved;
  std::vector<uint8_t> right(static_cast<size_t>(T), 1);
  r.accept_len = 1;
  for (int64_t k = 0; k < K; ++k) {
    const std::vector<int64_t>& rk = rows[size_t(k)];
    const int64_t n = int64_t(rk.size());
    if (k > 0) g = relayout(g, k - 1, k, H);
    // Inputs: token x[t+1+k] (teacher forcing) and the hidden state g.
    Vec xin(static_cast<size_t>(n * 2 * H)), E(static_cast<size_t>(n * H));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t tp = rk[size_t(i)] + 1 + k;
      const int32_t tok = tp < T ? s.ids[tp] : 0;
      TALON_CHECK(tok >= 0 && tok < V, "draft: token id {} outside the vocabulary", tok);
      std::copy(tgt.embed + int64_t(tok) * H, tgt.embed + (int64_t(tok) + 1) * H, E.begin() + i * H);
      rmsnorm(xin.data() + i * 2 * H, E.data() + i * H, w.in_ln.data(), H, c.rms_eps);
      rmsnorm(xin.data() + i * 2 * H + H, g.data() + i * H, w.hidden_norm.data(), H, c.rms_eps);
    }
    Vec q, kk, vv;
    linear(q, xin, w.wq, n, 2 * H, qd);
    linear(kk, xin, w.wk, n, 2 * H, kvd);
    linear(vv, xin, w.wv, n, 2 * H, kvd);
    for (int64_t i = 0; i < n; ++i) {
      rope(q.data() + i * qd, nh, hd, rk[size_t(i)] + k, inv);
      rope(kk.data() + i * kvd, nkv, hd, rk[size_t(i)] + k, inv);
    }
    keys.push_back(kk);
    vals.push_back(vv);
    // Attention: step-0 keys at positions <= t, plus the key at t of every step 1..k.
    Vec att(static_cast<size_t>(n * qd), 0.0);
    const double scale = 1.0 / std::sqrt(double(hd));
    std::vector<const double*> kp, vp;
    Vec p;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t t = rk[size_t(i)], off = (h / grp) * hd;
        kp.clear();
        vp.clear();
        for (int64_t pos = 0; pos <= t; ++pos) {
          kp.push_back(keys[0].data() + pos * kvd + off);
          vp.push_back(vals[0].data() + pos * kvd + off);
        }
        for (int64_t j = 1; j <= k; ++j) {
          const int64_t tj = at[size_t(j)][size_t(t)];  // present: rows[k] is within rows[j]
          kp.push_back(keys[size_t(j)].data() + tj * kvd + off);
          vp.push_back(vals[size_t(j)].data() + tj * kvd + off);
        }
        attend_head(q.data() + i * qd + h * hd, kp, vp, hd, scale, att.data() + i * qd + h * hd, p);
      }
    Vec o, res(static_cast<size_t>(n * H));
    linear(o, att, w.wo, n, qd, H);
    for (int64_t i = 0; i < n; ++i) {
      if (c.norm_before_residual)
        rmsnorm(res.data() + i * H, g.data() + i * H, w.hidden_norm.data(), H, c.rms_eps);
      else
        std::copy(g.begin() + i * H, g.begin() + (i + 1) * H, res.begin() + i * H);
    }
    Tail tail;
    Vec logits;
    tail_forward(tail, logits, res, o, w, c, n);

    // Loss and metrics over the positions that count at this step (rows left out never do).
    StepTally tally;
    Vec dlogits(grads ? size_t(n * Vd) : 0, 0.0);  // d(sum of CE) / d logits, scaled below
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = rk[size_t(i)], tp = t + 1 + k;
      const double* lg = logits.data() + i * Vd;
      const int64_t arg = std::max_element(lg, lg + Vd) - lg;
      const bool counts = tp < T && s.mask[tp] && in_vocab[size_t(tp)];
      const bool hit = counts && arg == tgt_arg[size_t(tp)];
      double ce = 0;
      if (counts) {
        const double mx = *std::max_element(lg, lg + Vd);
        double z = 0;
        for (int64_t d = 0; d < Vd; ++d) z += std::exp(lg[d] - mx);
        const double lz = mx + std::log(z);
        for (int64_t d = 0; d < Vd; ++d) ce -= P[size_t(tp * Vd + d)] * (lg[d] - lz);
        if (grads)
          for (int64_t d = 0; d < Vd; ++d) dlogits[size_t(i * Vd + d)] = std::exp(lg[d] - lz) - P[size_t(tp * Vd + d)];
      }
      tally.add(counts, hit, ce, right[size_t(t)]);
    }
    const int64_t n_counted = tally.n;
    add_step(r, tally, std::pow(c.step_decay, double(k)));
    if (keep_logits) r.logits.emplace_back(logits.begin(), logits.end());
    if (grads) {
      const double scale_k = n_counted ? std::pow(c.step_decay, double(k)) / double(n_counted) : 0.0;
      for (auto& d : dlogits) d *= scale_k;
      saved.push_back({std::move(E), g, std::move(xin), q, std::move(att), tail, std::move(dlogits)});
    }
    g = std::move(tail.g2);
  }
  if (!grads) return r;

  // Backward, last step first. Step k's keys and values receive gradient from the
  // queries of steps k..K-1, all processed before step k itself. Each step's arrays are in
  // its own row layout (rows[k]).
  DraftGrads& G = *grads;
  std::vector<Vec> dK, dV;
  for (int64_t k = 0; k < K; ++k) {
    dK.emplace_back(rows[size_t(k)].size() * size_t(kvd), 0.0);
    dV.emplace_back(rows[size_t(k)].size() * size_t(kvd), 0.0);
  }
  // The gradient into step k's output g2 from step k + 1.
  Vec dg_next(rows[size_t(K - 1)].size() * size_t(H), 0.0);
  const double scale = 1.0 / std::sqrt(double(hd));
  for (int64_t k = K - 1; k >= 0; --k) {
    Saved& S = saved[size_t(k)];
    const std::vector<int64_t>& rk = rows[size_t(k)];
    const int64_t n = int64_t(rk.size());
    const Vec dg1 = tail_backward(S.tail, S.dlogits, dg_next, w, G, true, c, n);
    // g1 = r + o_proj(att)
    Vec datt(static_cast<size_t>(n * qd), 0.0);
    linear_backward(&datt, &G.wo, dg1, S.att, w.wo, n, qd, H);
    // Attention (probabilities recomputed): keys/values of step 0 at positions <= t, step j at t.
    Vec dq(static_cast<size_t>(n * qd), 0.0), p;
    std::vector<const double*> kp, vp;
    std::vector<double*> dkp, dvp;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t t = rk[size_t(i)], off = (h / grp) * hd;
        kp.clear();
        vp.clear();
        dkp.clear();
        dvp.clear();
        auto key = [&](int64_t j, int64_t row) {
          kp.push_back(keys[size_t(j)].data() + row * kvd + off);
          vp.push_back(vals[size_t(j)].data() + row * kvd + off);
          dkp.push_back(dK[size_t(j)].data() + row * kvd + off);
          dvp.push_back(dV[size_t(j)].data() + row * kvd + off);
        };
        for (int64_t pos = 0; pos <= t; ++pos) key(0, pos);
        for (int64_t j = 1; j <= k; ++j) key(j, at[size_t(j)][size_t(t)]);
        const double* qp = S.q.data() + i * qd + h * hd;
        attend_head(qp, kp, vp, hd, scale, nullptr, p);
        attend_head_backward(qp, datt.data() + i * qd + h * hd, kp, vp, p, hd, scale, dq.data() + i * qd + h * hd,
                             dkp, dvp);
      }
    // RoPE is a rotation: its backward rotates by the negative angle.
    Vec& dKk = dK[size_t(k)];
    for (int64_t i = 0; i < n; ++i) {
      rope(dq.data() + i * qd, nh, hd, -(rk[size_t(i)] + k), inv);
      rope(dKk.data() + i * kvd, nkv, hd, -(rk[size_t(i)] + k), inv);
    }
    Vec dxin(static_cast<size_t>(n * 2 * H), 0.0);
    linear_backward(&dxin, &G.wq, dq, S.xin, w.wq, n, 2 * H, qd);
    linear_backward(&dxin, &G.wk, dKk, S.xin, w.wk, n, 2 * H, kvd);
    linear_backward(&dxin, &G.wv, dV[size_t(k)], S.xin, w.wv, n, 2 * H, kvd);
    // xin = [in_ln(e), hidden_norm(g)] (the embedding is frozen); r = g or hidden_norm(g).
    Vec dg(static_cast<size_t>(n * H), 0.0);
    for (int64_t i = 0; i < n; ++i) {
      rmsnorm_backward(nullptr, &G.in_ln, dxin.data() + i * 2 * H, S.e.data() + i * H, w.in_ln.data(), H, c.rms_eps);
      rmsnorm_backward(dg.data() + i * H, &G.hidden_norm, dxin.data() + i * 2 * H + H, S.g.data() + i * H,
                       w.hidden_norm.data(), H, c.rms_eps);
      if (c.norm_before_residual)
        rmsnorm_backward(dg.data() + i * H, &G.hidden_norm, dg1.data() + i * H, S.g.data() + i * H,
                         w.hidden_norm.data(), H, c.rms_eps);
      else
        for (int64_t x = 0; x < H; ++x) dg[size_t(i * H + x)] += dg1[size_t(i * H + x)];
    }
    if (k > 0) {
      dg_next = relayout(dg, k, k - 1, H);
    } else {
      linear_backward(nullptr, &G.fc, dg, A, w.fc, T, 3 * H, H);  // g0 = fc(aux)
    }
  }
  return r;
}

}  // namespace talon::eagle3
