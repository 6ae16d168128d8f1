#include "draft/peagle.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "draft/cpu_ops.h"
#include "model/model.h"
#include "util/error.h"

namespace talon::peagle {

namespace {
using Vec = std::vector<double>;
namespace ops = eagle3::ops;
}  // namespace

CodSample cod_sample(const std::vector<uint8_t>& valid, const CodOptions& o, uint64_t seed) {
  TALON_CHECK(o.depths >= 1, "P-EAGLE: depths must be >= 1 (got {})", o.depths);
  TALON_CHECK(o.ratio > 0 && o.ratio < 1 && o.ratio_min >= 0 && o.ratio_min <= 1,
              "P-EAGLE: down-sample ratio must be in (0, 1) and its floor in [0, 1] (got {}, {})", o.ratio,
              o.ratio_min);
  const int64_t S = int64_t(valid.size());
  CodSample s;
  for (int64_t t = 0; t < S; ++t) {
    s.anchor.push_back(t);
    s.depth.push_back(0);
  }
  std::vector<int64_t> seeds;
  for (int64_t t = 0; t < S; ++t)
    if (valid[size_t(t)]) seeds.push_back(t);
  std::mt19937_64 rng(seed);
  std::vector<int64_t> prev = seeds;  // target positions a chain can reach at this depth
  for (int d = 1; d < o.depths; ++d) {
    const int64_t n = std::max<int64_t>(0, int64_t(seeds.size()) - d);
    const int64_t want = int64_t(double(n) * std::max(std::pow(o.ratio, d), o.ratio_min));
    if (want <= 0) break;
    // A chain at depth d ends at position p = a + d; p < d would start before the sample.
    std::erase_if(prev, [&](int64_t p) { return p < d; });
    std::vector<int64_t> pick = prev;
    if (int64_t(pick.size()) >= want) {
      for (int64_t i = 0; i < want; ++i) {  // a partial Fisher-Yates draw of `want` of them
        // (a bounded draw of our own: std's distributions differ between standard libraries)
        const uint64_t span = uint64_t(pick.size()) - uint64_t(i);
        const uint64_t j = uint64_t(i) + uint64_t((unsigned __int128)rng() * span >> 64);
        std::swap(pick[size_t(i)], pick[size_t(j)]);
      }
      pick.resize(static_cast<size_t>(want));
      std::sort(pick.begin(), pick.end());
    }
    for (int64_t p : pick) {
      s.anchor.push_back(p - d);
      s.depth.push_back(d);
    }
    prev.clear();
    for (int64_t p : pick)
      if (p + 1 < S && valid[size_t(p + 1)]) prev.push_back(p + 1);
  }
  return s;
}

CodSample all_chains(const std::vector<uint8_t>& valid, int depths) {
  const int64_t S = int64_t(valid.size());
  std::vector<int64_t> run(static_cast<size_t>(S + 1), 0);  // run[p]: valid positions p, p+1, ... in a row
  for (int64_t p = S - 1; p >= 0; --p) run[size_t(p)] = valid[size_t(p)] ? run[size_t(p + 1)] + 1 : 0;
  CodSample s;
  for (int d = 0; d < depths; ++d)
    for (int64_t a = 0; a + d < S; ++a)
      if (d == 0 || run[size_t(a + 1)] >= d) {
        s.anchor.push_back(a);
        s.depth.push_back(d);
      }
  return s;
}

bool attends(const CodSample& s, int64_t q, int64_t kv) {
  const int64_t aq = s.anchor[size_t(q)], ak = s.anchor[size_t(kv)];
  return (s.depth[size_t(kv)] == 0 && aq >= ak) || (aq == ak && s.depth[size_t(q)] >= s.depth[size_t(kv)]);
}

Grads::Grads(const Weights& w)
    : layer(w.layer), mask_hidden(w.mask_hidden.size(), 0.0), embed(w.embed.size(), 0.0) {}

Result forward(const eagle3::DraftConfig& c, const Weights& w, const eagle3::TargetHead& tgt,
               const eagle3::DraftVocab& vocab, const eagle3::Sample& s, const CodSample& cod, int32_t mask_token,
               Grads* grads, std::vector<double>* logits_out) {
  const int64_t T = s.T, H = c.H, nh = c.n_heads, nkv = c.n_kv_heads, hd = c.head_dim, V = c.V, Vd = c.Vd;
  const int64_t N = cod.size(), qd = nh * hd, kvd = nkv * hd, grp = nh / nkv;
  TALON_CHECK(nh > 0 && nkv > 0 && nh % nkv == 0, "P-EAGLE: {} heads not a multiple of {} kv heads", nh, nkv);
  TALON_CHECK(int64_t(vocab.kept.size()) == Vd, "P-EAGLE: draft vocabulary has {} of {} ids", vocab.kept.size(), Vd);
  TALON_CHECK(int64_t(w.mask_hidden.size()) == 3 * H && int64_t(w.embed.size()) == V * H,
              "P-EAGLE: mask_hidden has {} values (expected {}), embed {} (expected {})", w.mask_hidden.size(), 3 * H,
              w.embed.size(), V * H);
  TALON_CHECK(mask_token >= 0 && mask_token < V, "P-EAGLE: mask token {} outside the vocabulary of {}", mask_token, V);
  const std::vector<float> inv = rope_inv_freq(c.rope, hd);
  const auto& L = w.layer;

  // Per element: input token, position, target row.
  std::vector<int32_t> tok(static_cast<size_t>(N));
  std::vector<int64_t> pos(static_cast<size_t>(N)), trow(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) {
    const int64_t a = cod.anchor[size_t(n)], d = cod.depth[size_t(n)];
    TALON_CHECK(a >= 0 && d >= 0 && a + d + 1 < T, "P-EAGLE: element {} (anchor {}, depth {}) outside a sample of {}",
                n, a, d, T);
    tok[size_t(n)] = d == 0 ? s.ids[a + 1] : mask_token;
    TALON_CHECK(tok[size_t(n)] >= 0 && tok[size_t(n)] < V, "P-EAGLE: token id {} outside the vocabulary",
                tok[size_t(n)]);
    pos[size_t(n)] = a + d;
    trow[size_t(n)] = a + d + 1;
  }

  // Target distribution over the draft vocabulary for every row an element reads.
  Vec P(static_cast<size_t>(T * Vd), 0.0);
  std::vector<int64_t> targ(static_cast<size_t>(T), 0);
  std::vector<uint8_t> need(static_cast<size_t>(T), 0);
  for (int64_t n = 0; n < N; ++n) need[size_t(trow[size_t(n)])] = 1;
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t t = 0; t < T; ++t) {
    if (need[size_t(t)]) targ[size_t(t)] = ops::target_draft_row(s.hidden + t * H, tgt, vocab, H, P.data() + t * Vd);
  }

  // Inputs: x = [in_ln(embed[tok]), hidden_norm(g)], g = fc(aux or mask_hidden).
  Vec A(static_cast<size_t>(N * 3 * H)), E(static_cast<size_t>(N * H)), g, xin(static_cast<size_t>(N * 2 * H)), res(static_cast<size_t>(N * H));
  for (int64_t n = 0; n < N; ++n) {
    const int64_t a = cod.anchor[size_t(n)];
    if (cod.depth[size_t(n)] == 0)
      std::copy(s.aux + a * 3 * H, s.aux + (a + 1) * 3 * H, A.begin() + n * 3 * H);
    else
      std::copy(w.mask_hidden.begin(), w.mask_hidden.end(), A.begin() + n * 3 * H);
    std::copy(w.embed.begin() + int64_t(tok[size_t(n)]) * H, w.embed.begin() + (int64_t(tok[size_t(n)]) + 1) * H,
              E.begin() + n * H);
  }
  ops::linear(g, A, L.fc, N, 3 * H, H);
  for (int64_t n = 0; n < N; ++n) {
    ops::rmsnorm(xin.data() + n * 2 * H, E.data() + n * H, L.in_ln.data(), H, c.rms_eps);
    ops::rmsnorm(xin.data() + n * 2 * H + H, g.data() + n * H, L.hidden_norm.data(), H, c.rms_eps);
    for (int64_t i = 0; i < H; ++i)
      res[size_t(n * H + i)] = c.norm_before_residual ? xin[size_t(n * 2 * H + H + i)] : g[size_t(n * H + i)];
  }
  Vec q, kk, vv;
  ops::linear(q, xin, L.wq, N, 2 * H, qd);
  ops::linear(kk, xin, L.wk, N, 2 * H, kvd);
  ops::linear(vv, xin, L.wv, N, 2 * H, kvd);
  for (int64_t n = 0; n < N; ++n) {
    ops::rope(q.data() + n * qd, nh, hd, pos[size_t(n)], inv);
    ops::rope(kk.data() + n * kvd, nkv, hd, pos[size_t(n)], inv);
  }
  // Which elements each element reads, as key/value rows per kv head.
  std::vector<std::vector<int64_t>> keys(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t m = 0; m < N; ++m)
      if (attends(cod, n, m)) keys[size_t(n)].push_back(m);
  auto rows = [&](const Vec& x, int64_t n, int64_t off) {
    std::vector<const double*> r;
    for (int64_t m : keys[size_t(n)]) r.push_back(x.data() + m * kvd + off);
    return r;
  };
  const double scale = 1.0 / std::sqrt(double(hd));
  Vec att(static_cast<size_t>(N * qd), 0.0);
  std::vector<Vec> probs(static_cast<size_t>(N * nh));  // softmax weights, kept for the backward
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t off = (h / grp) * hd;
      ops::attend_head(q.data() + n * qd + h * hd, rows(kk, n, off), rows(vv, n, off), hd, scale,
                       att.data() + n * qd + h * hd, probs[size_t(n * nh + h)]);
    }
  Vec o;
  ops::linear(o, att, L.wo, N, qd, H);
  ops::Tail tail;
  Vec logits;
  ops::tail_forward(tail, logits, res, o, L, c, N);

  // Loss: KL(P || softmax(logits)) over counted elements; accuracy per depth.
  Result r;
  int depths = 0;
  for (int64_t d : cod.depth) depths = std::max<int>(depths, int(d) + 1);
  r.hits.assign(static_cast<size_t>(depths), 0);
  r.total.assign(static_cast<size_t>(depths), 0);
  r.kl.assign(static_cast<size_t>(depths), 0.0);
  r.outcome.assign(static_cast<size_t>(N), -1);
  for (int64_t n = 0; n < N; ++n) r.counted += s.mask[trow[size_t(n)]] ? 1 : 0;
  const double denom = double(r.counted) + kReductionEps;
  Vec dlogits(grads ? size_t(N * Vd) : 0, 0.0);
  double kl_sum = 0;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t t = trow[size_t(n)];
    if (!s.mask[t]) continue;
    const double* lg = logits.data() + n * Vd;
    const double* p = P.data() + t * Vd;
    const double lz = ops::log_sum_exp(lg, Vd);
    const double kl = ops::kl_row(p, lg, lz, Vd);
    if (grads)
      for (int64_t d = 0; d < Vd; ++d) dlogits[size_t(n * Vd + d)] = (std::exp(lg[d] - lz) - p[d]) / denom;
    kl_sum += kl;
    const int64_t dep = cod.depth[size_t(n)];
    const bool hit = (std::max_element(lg, lg + Vd) - lg) == targ[size_t(t)];
    r.total[size_t(dep)] += 1;
    r.hits[size_t(dep)] += hit;
    r.kl[size_t(dep)] += kl;
    r.outcome[size_t(n)] = hit ? 1 : 0;
  }
  r.loss = kl_sum / denom;
  if (logits_out) *logits_out = logits;
  if (!grads) return r;

  // Backward (the lm_head is frozen: its gradient is not formed).
  Grads& G = *grads;
  auto& GL = G.layer;
  const Vec dg1 = ops::tail_backward(tail, dlogits, Vec(static_cast<size_t>(N * H), 0.0), L, GL, false, c, N);
  Vec datt(static_cast<size_t>(N * qd), 0.0);
  ops::linear_backward(&datt, &GL.wo, dg1, att, L.wo, N, qd, H);
  // Attention: dq per query row; dk, dv scattered to the keys (serial: keys are shared).
  Vec dq(static_cast<size_t>(N * qd), 0.0), dk(static_cast<size_t>(N * kvd), 0.0), dv(static_cast<size_t>(N * kvd), 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t off = (h / grp) * hd;
      std::vector<double*> dkp, dvp;
      for (int64_t m : keys[size_t(n)]) {
        dkp.push_back(dk.data() + m * kvd + off);
        dvp.push_back(dv.data() + m * kvd + off);
      }
      ops::attend_head_backward(q.data() + n * qd + h * hd, datt.data() + n * qd + h * hd, rows(kk, n, off),
                                rows(vv, n, off), probs[size_t(n * nh + h)], hd, scale, dq.data() + n * qd + h * hd,
                                dkp, dvp);
    }
  for (int64_t n = 0; n < N; ++n) {
    ops::rope(dq.data() + n * qd, nh, hd, -pos[size_t(n)], inv);
    ops::rope(dk.data() + n * kvd, nkv, hd, -pos[size_t(n)], inv);
  }
  Vec dxin(static_cast<size_t>(N * 2 * H), 0.0);
  ops::linear_backward(&dxin, &GL.wq, dq, xin, L.wq, N, 2 * H, qd);
  ops::linear_backward(&dxin, &GL.wk, dk, xin, L.wk, N, 2 * H, kvd);
  ops::linear_backward(&dxin, &GL.wv, dv, xin, L.wv, N, 2 * H, kvd);
  Vec dg(static_cast<size_t>(N * H), 0.0), dE(static_cast<size_t>(N * H), 0.0);
  for (int64_t n = 0; n < N; ++n) {
    ops::rmsnorm_backward(dE.data() + n * H, &GL.in_ln, dxin.data() + n * 2 * H, E.data() + n * H, L.in_ln.data(), H,
                          c.rms_eps);
    // The hidden half of x and, with norm_before_residual, the residual read hidden_norm(g).
    Vec dhn(dxin.begin() + n * 2 * H + H, dxin.begin() + (n + 1) * 2 * H);
    if (c.norm_before_residual)
      for (int64_t i = 0; i < H; ++i) dhn[size_t(i)] += dg1[size_t(n * H + i)];
    else
      for (int64_t i = 0; i < H; ++i) dg[size_t(n * H + i)] += dg1[size_t(n * H + i)];
    ops::rmsnorm_backward(dg.data() + n * H, &GL.hidden_norm, dhn.data(), g.data() + n * H, L.hidden_norm.data(), H,
                          c.rms_eps);
  }
  Vec dA(static_cast<size_t>(N * 3 * H), 0.0);
  ops::linear_backward(&dA, &GL.fc, dg, A, L.fc, N, 3 * H, H);
  for (int64_t n = 0; n < N; ++n) {
    if (cod.depth[size_t(n)] != 0)
      for (int64_t i = 0; i < 3 * H; ++i) G.mask_hidden[size_t(i)] += dA[size_t(n * 3 * H + i)];
    double* de = G.embed.data() + int64_t(tok[size_t(n)]) * H;
    for (int64_t i = 0; i < H; ++i) de[i] += dE[size_t(n * H + i)];
  }
  return r;
}

eagle3::TttResult ttt_view(const CodSample& cod, const Result& r, int depths) {
  TALON_CHECK(int64_t(r.outcome.size()) == cod.size(), "P-EAGLE: a result of {} elements for a sample of {}",
              r.outcome.size(), cod.size());
  // right[a]: the chain anchored at a was right at every depth so far (elements are depth-major).
  int64_t anchors = 0;
  for (int64_t a : cod.anchor) anchors = std::max(anchors, a + 1);
  std::vector<uint8_t> right(static_cast<size_t>(anchors), 1);
  std::vector<eagle3::StepTally> tally(static_cast<size_t>(depths));
  for (int64_t n = 0; n < cod.size(); ++n) {
    const int64_t d = cod.depth[size_t(n)];
    if (d >= depths) continue;
    const int8_t o = r.outcome[size_t(n)];
    tally[size_t(d)].add(o >= 0, o == 1, 0.0, right[size_t(cod.anchor[size_t(n)])]);
  }
  eagle3::TttResult t;
  for (int d = 0; d < depths; ++d) {
    if (size_t(d) < r.kl.size()) tally[size_t(d)].ce_sum = r.kl[size_t(d)];
    eagle3::add_step(t, tally[size_t(d)], 1.0);
  }
  t.loss = r.loss;
  return t;
}

}  // namespace talon::peagle
