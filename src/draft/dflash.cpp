#include "draft/dflash.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "draft/cpu_ops.h"
#include "model/model.h"
#include "util/error.h"

namespace talon::dflash {

namespace {
using Vec = std::vector<double>;
namespace ops = eagle3::ops;
constexpr double kReductionEps = 1e-5;  // added to the counted rows, as speculators does

// What one layer's backward reads of its forward.
struct Acts {
  Vec x, xn;                 // layer input [N, H] and input_layernorm(x)
  Vec q_raw, q;              // [N, qd]: projection, then per-head norm + RoPE
  Vec kb_raw, kb, vb;        // block keys / values [N, kvd]
  Vec kc_raw, kc, vc;        // context keys / values [T, kvd]
  std::vector<Vec> probs;    // [N * nh] softmax weights
  Vec att, x1, hm, ga, up, act;
};

// Per-head RMSNorm over hd values of each of `heads` heads, then RoPE at `pos`.
void head_norm_rope(double* out, const double* in, int64_t heads, int64_t hd, const std::vector<float>& w, double eps,
                    int64_t pos, const std::vector<float>& inv) {
  for (int64_t h = 0; h < heads; ++h) ops::rmsnorm(out + h * hd, in + h * hd, w.data(), hd, eps);
  ops::rope(out, heads, hd, pos, inv);
}
// Its backward: d(in) += ..., dw += ... from d(out) (d(out) is rotated back in place).
void head_norm_rope_backward(double* din, std::vector<double>* dw, double* dout, const double* in, int64_t heads,
                             int64_t hd, const std::vector<float>& w, double eps, int64_t pos,
                             const std::vector<float>& inv) {
  ops::rope(dout, heads, hd, -pos, inv);
  for (int64_t h = 0; h < heads; ++h)
    ops::rmsnorm_backward(din + h * hd, dw, dout + h * hd, in + h * hd, w.data(), hd, eps);
}
}  // namespace

std::vector<std::pair<const char*, std::vector<float>*>> Layer::named() {
  return {{"in_ln", &in_ln},     {"wq", &wq},         {"wk", &wk}, {"wv", &wv},     {"q_norm", &q_norm},
          {"k_norm", &k_norm},   {"wo", &wo},         {"post_ln", &post_ln},        {"gate", &gate},
          {"up", &up},           {"down", &down}};
}

LayerGrads::LayerGrads(Layer& l) {
  auto src = l.named();
  auto dst = named();
  for (size_t i = 0; i < dst.size(); ++i) dst[i].second->assign(src[i].second->size(), 0.0);
}
std::vector<std::pair<const char*, std::vector<double>*>> LayerGrads::named() {
  return {{"in_ln", &in_ln},     {"wq", &wq},         {"wk", &wk}, {"wv", &wv},     {"q_norm", &q_norm},
          {"k_norm", &k_norm},   {"wo", &wo},         {"post_ln", &post_ln},        {"gate", &gate},
          {"up", &up},           {"down", &down}};
}

Grads::Grads(Weights& w) : fc(w.fc.size(), 0.0), hidden_norm(w.hidden_norm.size(), 0.0), norm(w.norm.size(), 0.0) {
  for (auto& l : w.layers) layers.emplace_back(l);
}

eagle3::TttResult ttt_view(const Result& r, int64_t block) {
  auto at = [](const auto& v, int64_t i) { return size_t(i) < v.size() ? v[size_t(i)] : 0; };
  eagle3::TttResult t;
  for (int64_t i = 1; i < block; ++i) {
    eagle3::StepTally st;
    st.n = at(r.total, i);
    st.hits = at(r.hits, i);
    st.cond_n = at(r.cond_total, i);
    st.cond_hits = at(r.cond_hits, i);
    st.ce_sum = at(r.loss_sum, i);
    eagle3::add_step(t, st, 1.0);
  }
  t.loss = r.loss;
  return t;
}

std::vector<int64_t> select_anchors(const uint8_t* mask, int64_t T, int64_t B, int64_t max_anchors, uint64_t seed) {
  TALON_CHECK(B >= 2 && max_anchors >= 1, "DFlash: block size {} (expected >= 2) and {} anchors (expected >= 1)", B,
              max_anchors);
  std::vector<int64_t> pool;
  for (int64_t a = 0; a + B < T; ++a)
    if (mask[a]) pool.push_back(a);
  const int64_t k = std::min<int64_t>(max_anchors, int64_t(pool.size()));
  std::mt19937_64 rng(seed);
  for (int64_t i = 0; i < k; ++i) {  // a partial Fisher-Yates draw (own bounded draw: portable)
    const uint64_t span = uint64_t(pool.size()) - uint64_t(i);
    const uint64_t j = uint64_t(i) + uint64_t((unsigned __int128)rng() * span >> 64);
    std::swap(pool[size_t(i)], pool[size_t(j)]);
  }
  pool.resize(static_cast<size_t>(k));
  std::sort(pool.begin(), pool.end());
  return pool;
}

Result forward(const Config& c, const Weights& w, const eagle3::TargetHead& tgt, const eagle3::DraftVocab& vocab,
               const eagle3::Sample& s, const std::vector<int64_t>& anchors, int32_t mask_token, Grads* grads,
               std::vector<double>* logits_out) {
  const int64_t T = s.T, H = c.H, I = c.I, nh = c.n_heads, nkv = c.n_kv_heads, hd = c.head_dim, V = c.V, Vd = c.Vd;
  const int64_t B = c.block, AW = c.n_aux * H, nA = int64_t(anchors.size()), N = nA * B;
  const int64_t qd = nh * hd, kvd = nkv * hd, grp = nkv > 0 ? nh / nkv : 0;
  TALON_CHECK(nh > 0 && nkv > 0 && nh % nkv == 0 && hd % 2 == 0,
              "DFlash: {} heads, {} kv heads and head size {} do not make an attention layer", nh, nkv, hd);
  TALON_CHECK(B >= 2 && c.layers >= 1 && int64_t(w.layers.size()) == c.layers,
              "DFlash: block size {} and {} layers ({} given)", B, c.layers, w.layers.size());
  TALON_CHECK(int64_t(vocab.kept.size()) == Vd, "DFlash: draft vocabulary has {} of {} ids", vocab.kept.size(), Vd);
  TALON_CHECK(mask_token >= 0 && mask_token < V, "DFlash: mask token {} outside the vocabulary of {}", mask_token, V);
  TALON_CHECK(int64_t(w.fc.size()) == H * AW, "DFlash: fc has {} values, expected {} x {}", w.fc.size(), H, AW);
  for (int64_t j = 0; j < nA; ++j)
    TALON_CHECK(anchors[size_t(j)] >= 0 && anchors[size_t(j)] + B < T && (j == 0 || anchors[size_t(j)] > anchors[size_t(j - 1)]),
                "DFlash: anchor {} ({}) must ascend and leave a block of {} inside a sample of {}", j,
                anchors[size_t(j)], B, T);
  const std::vector<float> inv = rope_inv_freq(c.rope, hd);
  const double scale = 1.0 / std::sqrt(double(hd));

  // Block rows: position, token, target row.
  std::vector<int64_t> pos(static_cast<size_t>(N));
  std::vector<int32_t> tok(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) {
    const int64_t a = anchors[size_t(n / B)], i = n % B;
    pos[size_t(n)] = a + i;
    tok[size_t(n)] = i == 0 ? s.ids[a] : mask_token;
    TALON_CHECK(tok[size_t(n)] >= 0 && tok[size_t(n)] < V, "DFlash: token id {} outside the vocabulary", tok[size_t(n)]);
  }
  auto counts = [&](int64_t n) { return n % B != 0 && s.mask[pos[size_t(n)]] != 0; };

  // Target distributions over the draft vocabulary, from hidden[p - 1] for slot rows p.
  Vec P(static_cast<size_t>(N * Vd), 0.0);
  std::vector<int64_t> targ(static_cast<size_t>(N), 0);
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t n = 0; n < N; ++n) {
    if (counts(n))
      targ[size_t(n)] =
          ops::target_draft_row(s.hidden + (pos[size_t(n)] - 1) * H, tgt, vocab, H, P.data() + n * Vd);
  }

  // Context: C = hidden_norm(fc(aux)), every position.
  const Vec aux(s.aux, s.aux + T * AW);
  Vec F, C(static_cast<size_t>(T * H));
  ops::linear(F, aux, w.fc, T, AW, H);
  for (int64_t t = 0; t < T; ++t) ops::rmsnorm(C.data() + t * H, F.data() + t * H, w.hidden_norm.data(), H, c.rms_eps);

  // Layers.
  Vec X(static_cast<size_t>(N * H));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t e = 0; e < H; ++e) X[size_t(n * H + e)] = double(tgt.embed[int64_t(tok[size_t(n)]) * H + e]);
  std::vector<Acts> acts(static_cast<size_t>(c.layers));
  // Keys of block row n, head group g: context rows before its anchor, then its block's rows.
  auto key_rows = [&](const Vec& kc, const Vec& kb, int64_t n, int64_t off) {
    const int64_t j = n / B, a = anchors[size_t(j)];
    std::vector<const double*> r;
    for (int64_t t = 0; t < a; ++t) r.push_back(kc.data() + t * kvd + off);
    for (int64_t m = j * B; m < (j + 1) * B; ++m) r.push_back(kb.data() + m * kvd + off);
    return r;
  };
  for (int64_t l = 0; l < c.layers; ++l) {
    const Layer& L = w.layers[size_t(l)];
    Acts& A = acts[size_t(l)];
    A.x = X;
    A.xn.assign(size_t(N * H), 0.0);
    for (int64_t n = 0; n < N; ++n) ops::rmsnorm(A.xn.data() + n * H, X.data() + n * H, L.in_ln.data(), H, c.rms_eps);
    ops::linear(A.q_raw, A.xn, L.wq, N, H, qd);
    ops::linear(A.kb_raw, A.xn, L.wk, N, H, kvd);
    ops::linear(A.vb, A.xn, L.wv, N, H, kvd);
    ops::linear(A.kc_raw, C, L.wk, T, H, kvd);
    ops::linear(A.vc, C, L.wv, T, H, kvd);
    A.q.assign(A.q_raw.size(), 0.0);
    A.kb.assign(A.kb_raw.size(), 0.0);
    A.kc.assign(A.kc_raw.size(), 0.0);
    for (int64_t n = 0; n < N; ++n) {
      head_norm_rope(A.q.data() + n * qd, A.q_raw.data() + n * qd, nh, hd, L.q_norm, c.rms_eps, pos[size_t(n)], inv);
      head_norm_rope(A.kb.data() + n * kvd, A.kb_raw.data() + n * kvd, nkv, hd, L.k_norm, c.rms_eps, pos[size_t(n)],
                     inv);
    }
    for (int64_t t = 0; t < T; ++t)
      head_norm_rope(A.kc.data() + t * kvd, A.kc_raw.data() + t * kvd, nkv, hd, L.k_norm, c.rms_eps, t, inv);
    A.att.assign(size_t(N * qd), 0.0);
    A.probs.assign(size_t(N * nh), Vec());
#pragma omp parallel for schedule(dynamic, 4)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t off = (h / grp) * hd;
        ops::attend_head(A.q.data() + n * qd + h * hd, key_rows(A.kc, A.kb, n, off), key_rows(A.vc, A.vb, n, off),
                         hd, scale, A.att.data() + n * qd + h * hd, A.probs[size_t(n * nh + h)]);
      }
    Vec o;
    ops::linear(o, A.att, L.wo, N, qd, H);
    A.x1.resize(size_t(N * H));
    for (int64_t i = 0; i < N * H; ++i) A.x1[size_t(i)] = X[size_t(i)] + o[size_t(i)];
    A.hm.assign(size_t(N * H), 0.0);
    for (int64_t n = 0; n < N; ++n)
      ops::rmsnorm(A.hm.data() + n * H, A.x1.data() + n * H, L.post_ln.data(), H, c.rms_eps);
    ops::linear(A.ga, A.hm, L.gate, N, H, I);
    ops::linear(A.up, A.hm, L.up, N, H, I);
    A.act.resize(A.ga.size());
    for (size_t i = 0; i < A.ga.size(); ++i) A.act[i] = A.ga[i] / (1.0 + std::exp(-A.ga[i])) * A.up[i];
    Vec down;
    ops::linear(down, A.act, L.down, N, I, H);
    for (int64_t i = 0; i < N * H; ++i) X[size_t(i)] = A.x1[size_t(i)] + down[size_t(i)];
  }
  Vec fn(static_cast<size_t>(N * H)), logits;
  for (int64_t n = 0; n < N; ++n) ops::rmsnorm(fn.data() + n * H, X.data() + n * H, w.norm.data(), H, c.rms_eps);
  ops::linear(logits, fn, w.lm_head, N, H, Vd);
  if (logits_out) *logits_out = logits;

  // Per-slot losses, their weights, the loss and per-slot accuracy.
  Result r;
  r.hits.assign(static_cast<size_t>(B), 0);
  r.total.assign(static_cast<size_t>(B), 0);
  r.cond_hits.assign(static_cast<size_t>(B), 0);
  r.cond_total.assign(static_cast<size_t>(B), 0);
  r.loss_sum.assign(static_cast<size_t>(B), 0.0);
  for (int64_t n = 0; n < N; ++n) r.counted += counts(n) ? 1 : 0;
  std::vector<uint8_t> right(static_cast<size_t>(nA), 1);
  const double denom = double(r.counted) + kReductionEps;
  Vec el(static_cast<size_t>(N), 0.0), lse(static_cast<size_t>(N), 0.0);
  for (int64_t n = 0; n < N; ++n) {
    if (!counts(n)) continue;
    const double* lg = logits.data() + n * Vd;
    const double lz = lse[size_t(n)] = ops::log_sum_exp(lg, Vd);
    el[size_t(n)] = c.loss == Config::Loss::CE ? lz - lg[targ[size_t(n)]] : ops::kl_row(P.data() + n * Vd, lg, lz, Vd);
    const int64_t i = n % B;
    const bool hit = (std::max_element(lg, lg + Vd) - lg) == targ[size_t(n)];
    r.total[size_t(i)] += 1;
    r.hits[size_t(i)] += hit;
    r.loss_sum[size_t(i)] += el[size_t(n)];
  }
  for (int64_t n = 0; n < N; ++n) {  // rows of a block are consecutive, slots ascending
    const int64_t i = n % B;
    if (i == 0) continue;
    uint8_t& ok = right[size_t(n / B)];
    const bool hit = counts(n) && (std::max_element(logits.data() + n * Vd, logits.data() + (n + 1) * Vd) -
                                   (logits.data() + n * Vd)) == targ[size_t(n)];
    if (counts(n) && ok) {
      r.cond_total[size_t(i)] += 1;
      r.cond_hits[size_t(i)] += hit;
    }
    ok = ok && hit;
  }
  Vec wt(static_cast<size_t>(N), 0.0);
  for (int64_t j = 0; j < nA; ++j) {
    if (c.weighting == Config::Weighting::ExpDecay) {
      for (int64_t i = 1; i < B; ++i) wt[size_t(j * B + i)] = std::exp(-double(i - 1) / c.gamma);
      continue;
    }
    Vec prefix(static_cast<size_t>(B));
    double run = 1;
    for (int64_t i = 0; i < B; ++i) {
      const int64_t n = j * B + i;
      run *= counts(n) ? (1.0 - c.dpace_alpha) * std::exp(-el[size_t(n)]) + c.dpace_alpha : 1.0;
      prefix[size_t(i)] = run;
    }
    double suffix = 0;
    for (int64_t i = B - 1; i >= 0; --i) {
      const int64_t n = j * B + i;
      if (counts(n)) suffix += prefix[size_t(i)];
      wt[size_t(n)] = counts(n) ? suffix : 0.0;
    }
  }
  Vec dlogits(grads ? size_t(N * Vd) : 0, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    if (!counts(n)) continue;
    r.loss += wt[size_t(n)] * el[size_t(n)];
    if (!grads) continue;
    const double* lg = logits.data() + n * Vd;
    const double f = wt[size_t(n)] / denom;
    for (int64_t d = 0; d < Vd; ++d) {
      const double q = std::exp(lg[d] - lse[size_t(n)]);
      const double p = c.loss == Config::Loss::CE ? (d == targ[size_t(n)] ? 1.0 : 0.0) : P[size_t(n * Vd + d)];
      dlogits[size_t(n * Vd + d)] = f * (q - p);
    }
  }
  r.loss /= denom;
  if (!grads) return r;

  // Backward (embedding and lm_head frozen).
  Grads& G = *grads;
  TALON_CHECK(int64_t(G.layers.size()) == c.layers, "DFlash: gradients for {} layers, the draft has {}",
              G.layers.size(), c.layers);
  Vec dfn(static_cast<size_t>(N * H), 0.0), dX(static_cast<size_t>(N * H), 0.0), dC(static_cast<size_t>(T * H), 0.0);
  ops::linear_backward(&dfn, nullptr, dlogits, fn, w.lm_head, N, H, Vd);
  for (int64_t n = 0; n < N; ++n)
    ops::rmsnorm_backward(dX.data() + n * H, &G.norm, dfn.data() + n * H, X.data() + n * H, w.norm.data(), H,
                          c.rms_eps);
  for (int64_t l = c.layers - 1; l >= 0; --l) {
    const Layer& L = w.layers[size_t(l)];
    LayerGrads& GL = G.layers[size_t(l)];
    Acts& A = acts[size_t(l)];
    // MLP: out = x1 + down(silu(gate(hm)) * up(hm)), hm = post_ln(x1).
    Vec dx1 = dX, dact(A.act.size(), 0.0);
    ops::linear_backward(&dact, &GL.down, dX, A.act, L.down, N, I, H);
    Vec dga(A.ga.size()), dup(A.up.size());
    for (size_t i = 0; i < A.ga.size(); ++i) {
      const double sg = 1.0 / (1.0 + std::exp(-A.ga[i]));
      dup[i] = dact[i] * A.ga[i] * sg;
      dga[i] = dact[i] * A.up[i] * sg * (1.0 + A.ga[i] * (1.0 - sg));
    }
    Vec dhm(static_cast<size_t>(N * H), 0.0);
    ops::linear_backward(&dhm, &GL.gate, dga, A.hm, L.gate, N, H, I);
    ops::linear_backward(&dhm, &GL.up, dup, A.hm, L.up, N, H, I);
    for (int64_t n = 0; n < N; ++n)
      ops::rmsnorm_backward(dx1.data() + n * H, &GL.post_ln, dhm.data() + n * H, A.x1.data() + n * H,
                            L.post_ln.data(), H, c.rms_eps);
    // Attention: x1 = x + wo(att).
    Vec dxin = dx1, datt(static_cast<size_t>(N * qd), 0.0);
    ops::linear_backward(&datt, &GL.wo, dx1, A.att, L.wo, N, qd, H);
    Vec dq(static_cast<size_t>(N * qd), 0.0), dkb(static_cast<size_t>(N * kvd), 0.0),
        dvb(static_cast<size_t>(N * kvd), 0.0), dkc(static_cast<size_t>(T * kvd), 0.0),
        dvc(static_cast<size_t>(T * kvd), 0.0);
    for (int64_t n = 0; n < N; ++n)  // serial: keys are shared between rows
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t off = (h / grp) * hd, j = n / B, a = anchors[size_t(j)];
        std::vector<double*> dkp, dvp;
        for (int64_t t = 0; t < a; ++t) {
          dkp.push_back(dkc.data() + t * kvd + off);
          dvp.push_back(dvc.data() + t * kvd + off);
        }
        for (int64_t m = j * B; m < (j + 1) * B; ++m) {
          dkp.push_back(dkb.data() + m * kvd + off);
          dvp.push_back(dvb.data() + m * kvd + off);
        }
        ops::attend_head_backward(A.q.data() + n * qd + h * hd, datt.data() + n * qd + h * hd,
                                  key_rows(A.kc, A.kb, n, off), key_rows(A.vc, A.vb, n, off),
                                  A.probs[size_t(n * nh + h)], hd, scale, dq.data() + n * qd + h * hd, dkp, dvp);
      }
    Vec dq_raw(dq.size(), 0.0), dkb_raw(dkb.size(), 0.0), dkc_raw(dkc.size(), 0.0);
    for (int64_t n = 0; n < N; ++n) {
      head_norm_rope_backward(dq_raw.data() + n * qd, &GL.q_norm, dq.data() + n * qd, A.q_raw.data() + n * qd, nh, hd,
                              L.q_norm, c.rms_eps, pos[size_t(n)], inv);
      head_norm_rope_backward(dkb_raw.data() + n * kvd, &GL.k_norm, dkb.data() + n * kvd, A.kb_raw.data() + n * kvd,
                              nkv, hd, L.k_norm, c.rms_eps, pos[size_t(n)], inv);
    }
    for (int64_t t = 0; t < T; ++t)
      head_norm_rope_backward(dkc_raw.data() + t * kvd, &GL.k_norm, dkc.data() + t * kvd, A.kc_raw.data() + t * kvd,
                              nkv, hd, L.k_norm, c.rms_eps, t, inv);
    Vec dxn(static_cast<size_t>(N * H), 0.0);
    ops::linear_backward(&dxn, &GL.wq, dq_raw, A.xn, L.wq, N, H, qd);
    ops::linear_backward(&dxn, &GL.wk, dkb_raw, A.xn, L.wk, N, H, kvd);
    ops::linear_backward(&dxn, &GL.wv, dvb, A.xn, L.wv, N, H, kvd);
    ops::linear_backward(&dC, &GL.wk, dkc_raw, C, L.wk, T, H, kvd);
    ops::linear_backward(&dC, &GL.wv, dvc, C, L.wv, T, H, kvd);
    for (int64_t n = 0; n < N; ++n)
      ops::rmsnorm_backward(dxin.data() + n * H, &GL.in_ln, dxn.data() + n * H, A.x.data() + n * H, L.in_ln.data(), H,
                            c.rms_eps);
    dX = std::move(dxin);
  }
  // Context: C = hidden_norm(F), F = fc(aux).
  Vec dF(static_cast<size_t>(T * H), 0.0);
  for (int64_t t = 0; t < T; ++t)
    ops::rmsnorm_backward(dF.data() + t * H, &G.hidden_norm, dC.data() + t * H, F.data() + t * H,
                          w.hidden_norm.data(), H, c.rms_eps);
  ops::linear_backward(nullptr, &G.fc, dF, aux, w.fc, T, AW, H);
  return r;
}

void extend_context(const Config& c, const Weights& w, const float* aux, int64_t n, ContextCache& cc) {
  const int64_t H = c.H, AW = c.n_aux * H, nkv = c.n_kv_heads, hd = c.head_dim, kvd = nkv * hd;
  TALON_CHECK(n >= 0 && int64_t(w.layers.size()) == c.layers && int64_t(w.fc.size()) == H * AW,
              "DFlash: context of {} rows for {} layers ({} given), fc of {} values", n, c.layers, w.layers.size(),
              w.fc.size());
  if (n == 0) return;
  const std::vector<float> inv = rope_inv_freq(c.rope, hd);
  const Vec a(aux, aux + n * AW);
  Vec F, C(static_cast<size_t>(n * H));
  ops::linear(F, a, w.fc, n, AW, H);
  for (int64_t t = 0; t < n; ++t) ops::rmsnorm(C.data() + t * H, F.data() + t * H, w.hidden_norm.data(), H, c.rms_eps);
  cc.k.resize(size_t(c.layers));
  cc.v.resize(size_t(c.layers));
  for (int64_t l = 0; l < c.layers; ++l) {
    const Layer& L = w.layers[size_t(l)];
    Vec kr, vr;
    ops::linear(kr, C, L.wk, n, H, kvd);
    ops::linear(vr, C, L.wv, n, H, kvd);
    Vec& K = cc.k[size_t(l)];
    const size_t at = K.size();
    K.resize(at + size_t(n * kvd));
    for (int64_t t = 0; t < n; ++t)
      head_norm_rope(K.data() + at + size_t(t * kvd), kr.data() + t * kvd, nkv, hd, L.k_norm, c.rms_eps, cc.rows + t,
                     inv);
    cc.v[size_t(l)].insert(cc.v[size_t(l)].end(), vr.begin(), vr.end());
  }
  cc.rows += n;
}

std::vector<double> block_logits(const Config& c, const Weights& w, const float* embed, const ContextCache& cc,
                                 int32_t first, int32_t mask_token) {
  const int64_t H = c.H, I = c.I, nh = c.n_heads, nkv = c.n_kv_heads, hd = c.head_dim, B = c.block, Vd = c.Vd;
  const int64_t qd = nh * hd, kvd = nkv * hd, grp = nh / nkv, a = cc.rows;
  TALON_CHECK(first >= 0 && first < c.V && mask_token >= 0 && mask_token < c.V,
              "DFlash: block tokens {} / {} outside the vocabulary of {}", first, mask_token, c.V);
  TALON_CHECK(a == 0 || int64_t(cc.k.size()) == c.layers, "DFlash: a context cache of {} layers for {}", cc.k.size(),
              c.layers);
  const std::vector<float> inv = rope_inv_freq(c.rope, hd);
  const double scale = 1.0 / std::sqrt(double(hd));
  Vec X(static_cast<size_t>(B * H));
  for (int64_t n = 0; n < B; ++n) {
    const int64_t tok = n == 0 ? first : mask_token;
    for (int64_t e = 0; e < H; ++e) X[size_t(n * H + e)] = double(embed[tok * H + e]);
  }
  for (int64_t l = 0; l < c.layers; ++l) {
    const Layer& L = w.layers[size_t(l)];
    Vec xn(static_cast<size_t>(B * H)), q_raw, kb_raw, vb;
    for (int64_t n = 0; n < B; ++n) ops::rmsnorm(xn.data() + n * H, X.data() + n * H, L.in_ln.data(), H, c.rms_eps);
    ops::linear(q_raw, xn, L.wq, B, H, qd);
    ops::linear(kb_raw, xn, L.wk, B, H, kvd);
    ops::linear(vb, xn, L.wv, B, H, kvd);
    Vec q(q_raw.size()), kb(kb_raw.size());
    for (int64_t n = 0; n < B; ++n) {
      head_norm_rope(q.data() + n * qd, q_raw.data() + n * qd, nh, hd, L.q_norm, c.rms_eps, a + n, inv);
      head_norm_rope(kb.data() + n * kvd, kb_raw.data() + n * kvd, nkv, hd, L.k_norm, c.rms_eps, a + n, inv);
    }
    const double* kc = a ? cc.k[size_t(l)].data() : nullptr;
    const double* vc = a ? cc.v[size_t(l)].data() : nullptr;
    Vec att(static_cast<size_t>(B * qd), 0.0);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t n = 0; n < B; ++n) {
      Vec probs;
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t off = (h / grp) * hd;
        std::vector<const double*> kr, vr;  // the context rows, then the block's (bidirectional)
        for (int64_t t = 0; t < a; ++t) kr.push_back(kc + t * kvd + off), vr.push_back(vc + t * kvd + off);
        for (int64_t m = 0; m < B; ++m) kr.push_back(kb.data() + m * kvd + off), vr.push_back(vb.data() + m * kvd + off);
        ops::attend_head(q.data() + n * qd + h * hd, kr, vr, hd, scale, att.data() + n * qd + h * hd, probs);
      }
    }
    Vec o;
    ops::linear(o, att, L.wo, B, qd, H);
    Vec x1(static_cast<size_t>(B * H)), hm(static_cast<size_t>(B * H), 0.0);
    for (int64_t i = 0; i < B * H; ++i) x1[size_t(i)] = X[size_t(i)] + o[size_t(i)];
    for (int64_t n = 0; n < B; ++n) ops::rmsnorm(hm.data() + n * H, x1.data() + n * H, L.post_ln.data(), H, c.rms_eps);
    Vec ga, up, down;
    ops::linear(ga, hm, L.gate, B, H, I);
    ops::linear(up, hm, L.up, B, H, I);
    Vec act(ga.size());
    for (size_t i = 0; i < ga.size(); ++i) act[i] = ga[i] / (1.0 + std::exp(-ga[i])) * up[i];
    ops::linear(down, act, L.down, B, I, H);
    for (int64_t i = 0; i < B * H; ++i) X[size_t(i)] = x1[size_t(i)] + down[size_t(i)];
  }
  Vec fn(static_cast<size_t>(B * H)), logits;
  for (int64_t n = 0; n < B; ++n) ops::rmsnorm(fn.data() + n * H, X.data() + n * H, w.norm.data(), H, c.rms_eps);
  ops::linear(logits, fn, w.lm_head, B, H, Vd);
  return logits;
}

}  // namespace talon::dflash
