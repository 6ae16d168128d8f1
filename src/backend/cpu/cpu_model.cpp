// The CPU reference forward for the dense decoder family. Read top to bottom, this
// is the definition of what every other backend must compute.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <functional>

#include "backend/cpu/kv_slots.h"
#include "backend/backend.h"
#include "backend/cpu/ops.h"
#include "model/decode.h"
#include "model/dense.h"
#include "model/model.h"
#include "util/error.h"

namespace talon {

namespace {


// Matrices stay where they are (mmap, zero-copy) unless an F32 view is misaligned.
struct Mat {
  const void* data = nullptr;
  DType dtype = DType::F32;
  std::vector<float> owned;
};

Mat to_mat(const WeightRef& w) {
  Mat m{w.data, w.dtype, {}};
  if (w.dtype == DType::F32 && reinterpret_cast<uintptr_t>(w.data) % alignof(float) != 0) {
    m.owned = weight_to_f32(w);
    m.data = m.owned.data();
  }
  return m;
}

struct Layer {
  std::vector<float> attn_norm, mlp_norm, bq, bk, bv, q_norm, k_norm;
  Mat wq, wk, wv, wo, w_gate, w_up, w_down;
};

// The weights of a dense decoder, and the layer stack both the full forward and the
// cached decoder run. Only attention differs between the two: `attend` gets layer l's
// RoPE'd q [N, nh*hd], k and v [N, nkv*hd] and writes att [N, nh*hd].
struct DenseStack {
  ModelConfig cfg;
  Mat embed, lm_head;
  std::vector<float> final_norm;
  std::vector<Layer> layers;
  std::vector<float> inv_freq;

  explicit DenseStack(const Checkpoint& ckpt) : cfg(ckpt.config()) {
    DenseWeights w = bind_dense_weights(ckpt);
    embed = to_mat(w.embed);
    lm_head = to_mat(w.lm_head);
    final_norm = weight_to_f32(w.final_norm);
    for (auto& l : w.layers) {
      Layer L;
      L.attn_norm = weight_to_f32(l.attn_norm);
      L.mlp_norm = weight_to_f32(l.mlp_norm);
      L.bq = weight_to_f32(l.bq);
      L.bk = weight_to_f32(l.bk);
      L.bv = weight_to_f32(l.bv);
      L.q_norm = weight_to_f32(l.q_norm);
      L.k_norm = weight_to_f32(l.k_norm);
      L.wq = to_mat(l.wq);
      L.wk = to_mat(l.wk);
      L.wv = to_mat(l.wv);
      L.wo = to_mat(l.wo);
      L.w_gate = to_mat(l.w_gate);
      L.w_up = to_mat(l.w_up);
      L.w_down = to_mat(l.w_down);
      layers.push_back(std::move(L));
    }
    inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim);
  }

  using Attend = std::function<void(int64_t layer, const float* q, const float* k, const float* v, float* att)>;
  // capture(layer_id, x): x [N, H] is h[layer_id]. logits_rows: which rows get logits
  // (empty: none; logits is [logits_rows.size(), V]).
  void run(const int32_t* tokens, const int32_t* pos, int64_t N, const Attend& attend,
           const std::function<void(int64_t, const float*)>& capture, const std::vector<int64_t>& logits_rows,
           float* logits) const {
    const ModelConfig& c = cfg;
    const int64_t H = c.hidden, I = c.intermediate, hd = c.head_dim;
    const int64_t nh = c.n_heads, nkv = c.n_kv_heads, qd = nh * hd, kvd = nkv * hd;
    const float eps = float(c.rms_eps);
    std::vector<float> x(size_t(N * H)), xn(size_t(N * H)), q(size_t(N * qd)), k(size_t(N * kvd)),
        v(size_t(N * kvd)), att(size_t(N * qd)), tmp(size_t(N * H)), g(size_t(N * I)), u(size_t(N * I));
    auto mm = [&](float* out, const float* in, const Mat& w, const std::vector<float>& bias, int64_t K, int64_t O) {
      cpu::matmul_forward(out, in, w.data, w.dtype, bias.empty() ? nullptr : bias.data(), N, K, O);
    };
    static const std::vector<float> none;

    cpu::embedding_forward(x.data(), tokens, embed.data, embed.dtype, N, H, c.vocab);  // h[0]
    for (int64_t l = 0; l < c.n_layers; ++l) {
      capture(l, x.data());  // h[l]: the input of layer l
      const Layer& L = layers[size_t(l)];
      // attention block
      cpu::rmsnorm_forward(xn.data(), x.data(), L.attn_norm.data(), N, H, eps);
      mm(q.data(), xn.data(), L.wq, L.bq, H, qd);
      mm(k.data(), xn.data(), L.wk, L.bk, H, kvd);
      mm(v.data(), xn.data(), L.wv, L.bv, H, kvd);
      if (c.qk_norm) {  // per-head RMSNorm over head_dim, before RoPE
        cpu::rmsnorm_forward(q.data(), q.data(), L.q_norm.data(), N * nh, hd, eps);
        cpu::rmsnorm_forward(k.data(), k.data(), L.k_norm.data(), N * nkv, hd, eps);
      }
      cpu::rope_forward(q.data(), pos, inv_freq.data(), N, nh, hd);
      cpu::rope_forward(k.data(), pos, inv_freq.data(), N, nkv, hd);
      attend(l, q.data(), k.data(), v.data(), att.data());
      mm(tmp.data(), att.data(), L.wo, none, qd, H);
      cpu::residual_forward(x.data(), tmp.data(), N * H);
      // MLP block
      cpu::rmsnorm_forward(xn.data(), x.data(), L.mlp_norm.data(), N, H, eps);
      mm(g.data(), xn.data(), L.w_gate, none, H, I);
      mm(u.data(), xn.data(), L.w_up, none, H, I);
      cpu::swiglu_forward(g.data(), g.data(), u.data(), N * I);
      mm(tmp.data(), g.data(), L.w_down, none, I, H);
      cpu::residual_forward(x.data(), tmp.data(), N * H);
    }
    capture(c.n_layers, x.data());  // h[L]: before the final norm
    if (!logits_rows.empty()) {
      const int64_t R = int64_t(logits_rows.size());
      std::vector<float> sel(size_t(R * H));
      for (int64_t i = 0; i < R; ++i)
        std::copy_n(x.data() + logits_rows[size_t(i)] * H, H, sel.data() + i * H);
      cpu::rmsnorm_forward(sel.data(), sel.data(), final_norm.data(), R, H, eps);
      cpu::matmul_forward(logits, sel.data(), lm_head.data, lm_head.dtype, nullptr, R, H, c.vocab);
    }
  }
};

class CpuDenseModel final : public Model {
 public:
  explicit CpuDenseModel(const Checkpoint& ckpt) : w_(ckpt) {}

  const ModelConfig& config() const override { return w_.cfg; }
  std::string backend() const override { return "cpu"; }

  void forward(const Batch& b, const Capture& cap, float* logits) override {
    const ModelConfig& c = w_.cfg;
    const int64_t N = b.n_tokens();
    cap.validate(c.n_layers, b);
    const std::vector<int32_t> pos = b.positions();
    const std::vector<int64_t> dst = cap.dst_rows(b);
    std::vector<int64_t> rows;
    if (logits)
      for (int64_t r = 0; r < N; ++r) rows.push_back(r);
    w_.run(
        b.tokens.data(), pos.data(), N,
        [&](int64_t, const float* q, const float* k, const float* v, float* att) {
          cpu::attention_forward(att, q, k, v, b.seq_start.data(), b.n_seqs(), c.n_heads, c.n_kv_heads, c.head_dim,
                                 c.sliding_window);
        },
        [&](int64_t l, const float* x) { cpu::capture_rows(cap, int(l), x, N, c.hidden, dst.data()); }, rows, logits);
  }

 private:
  DenseStack w_;
};

// The cached decoder: per slot and layer, each token's key and value [k | v] (2*nkv*hd
// floats) in fp32 (cpu::KvSlots keeps the committed and pending rows).
class CpuDecoder final : public cpu::KvSlots {
 public:
  CpuDecoder(const Checkpoint& ckpt, int n_slots, int64_t max_len, int64_t cache_tokens)
      : KvSlots(n_slots, ckpt.config().n_layers, 2 * ckpt.config().n_kv_heads * ckpt.config().head_dim, max_len,
                cache_tokens),
        w_(ckpt) {}
  const ModelConfig& config() const override { return w_.cfg; }
  std::string backend() const override { return "cpu"; }

  void forward(const std::vector<DecodeRequest>& reqs, const Capture& cap, float* logits) override {
    const ModelConfig& c = w_.cfg;
    const int64_t kvd = c.n_kv_heads * c.head_dim;
    cap.validate(c.n_layers);
    cpu::KvSlots::Plan plan = plan_forward(reqs);
    const int64_t N = int64_t(plan.rows.size());
    std::vector<int64_t> dst(static_cast<size_t>(N));
    for (int64_t r = 0; r < N; ++r) dst[size_t(r)] = r;

    const int64_t nh = c.n_heads, hd = c.head_dim, group = nh / c.n_kv_heads, qw = nh * hd;
    const float scale = 1.0f / std::sqrt(float(hd));
    auto attend = [&](int64_t l, const float* q, const float* k, const float* v, float* att) {
      // Store the new keys and values as pending rows of their slots.
      for (int64_t r = 0; r < N; ++r) {
        float* row = cache_ptr(plan.rows[size_t(r)].slot, l, cache_row(plan, r));
        std::copy_n(k + r * kvd, kvd, row);
        std::copy_n(v + r * kvd, kvd, row + kvd);
      }
      int64_t pairs = 0;  // query-key pairs, at most
      for (int64_t r = 0; r < N; ++r) pairs += cache_row(plan, r) + 1;
#pragma omp parallel if (pairs * nh * hd >= cpu::kParallelMinWork)
      {
        std::vector<int64_t> keys;  // cache rows this query attends to, ascending
        std::vector<float> p;
        std::vector<double> acc(static_cast<size_t>(hd));
#pragma omp for schedule(dynamic, 4)
        for (int64_t r = 0; r < N; ++r) {
          attended_rows(plan, r, c.sliding_window, keys);
          const float* K = layer_rows(plan.rows[size_t(r)].slot, l);
          for (int64_t h = 0; h < nh; ++h) {
            const int64_t kh = h / group;
            cpu::attend_row(att + r * qw + h * hd, q + r * qw + h * hd, K + kh * hd, 2 * kvd, K + kvd + kh * hd,
                            2 * kvd, keys.data(), 0, int64_t(keys.size()), hd, hd, scale, p, acc);
          }
        }
      }
    };
    w_.run(plan.tokens.data(), plan.pos.data(), N, attend,
           [&](int64_t l, const float* x) { cpu::capture_rows(cap, int(l), x, N, c.hidden, dst.data()); },
           logits ? plan.logit_rows : std::vector<int64_t>{}, logits);
    finish(reqs, plan);
  }

 private:
  DenseStack w_;
};

}  // namespace

std::unique_ptr<Model> make_cpu_model(const Checkpoint& ckpt) {
  if (is_deepseek(ckpt.config().arch)) return make_cpu_deepseek_model(ckpt);  // MLA + MoE: cpu_deepseek.cpp
  return std::make_unique<CpuDenseModel>(ckpt);
}

std::unique_ptr<Decoder> make_cpu_decoder(const Checkpoint& ckpt, int n_slots, int64_t max_len, int64_t cache_tokens) {
  if (is_deepseek(ckpt.config().arch)) return make_cpu_deepseek_decoder(ckpt, n_slots, max_len, cache_tokens);
  return std::make_unique<CpuDecoder>(ckpt, n_slots, max_len, cache_tokens);
}

void Decoder::commit_all(int slot) {
  TALON_CHECK(slot >= 0 && size_t(slot) < pending_.size(), "decoder: slot {} outside [0, {})", slot, pending_.size());
  std::vector<int32_t> keep(static_cast<size_t>(pending_[size_t(slot)]));
  for (size_t i = 0; i < keep.size(); ++i) keep[i] = int32_t(i);
  commit(slot, keep);
}

int64_t logits_rows(const std::vector<DecodeRequest>& reqs) {
  int64_t n = 0;
  for (const DecodeRequest& r : reqs) n += r.all_logits ? int64_t(r.tokens.size()) : 1;
  return n;
}

void Decoder::forward_greedy(const std::vector<DecodeRequest>& reqs, const Capture& cap, int32_t* ids) {
  const int64_t rows = logits_rows(reqs), V = config().vocab;
  std::vector<float>& logits = host_logits_;
  logits.resize(size_t(rows) * size_t(V));
  forward(reqs, cap, logits.data());
  for (int64_t r = 0; r < rows; ++r) {
    const float* l = logits.data() + r * V;
    int64_t best = 0;
    for (int64_t i = 1; i < V; ++i)
      if (l[i] > l[best]) best = i;
    ids[r] = int32_t(best);
  }
}

void Decoder::forward_sample(const std::vector<DecodeRequest>& reqs, const Capture& cap, const SamplingParams& p,
                             const double* u, int32_t* ids) {
  if (p.greedy()) {
    forward_greedy(reqs, cap, ids);
    return;
  }
  const int64_t rows = logits_rows(reqs), V = config().vocab;
  std::vector<float>& logits = host_logits_;
  logits.resize(size_t(rows) * size_t(V));
  forward(reqs, cap, logits.data());
  // Rows in parallel: each depends on its own logits and u only.
#pragma omp parallel if (rows >= 4)
  {
    std::vector<double> dist;
#pragma omp for schedule(dynamic, 4)
    for (int64_t r = 0; r < rows; ++r) {
      sampling_distribution(logits.data() + r * V, V, p, dist);
      ids[r] = draw(dist, u[r]);
    }
  }
}

void check_chain_acceptance(const DecodeRequest& req, size_t n_q, const SamplingParams& p) {
  TALON_CHECK(!p.greedy(), "decoder: forward_accept_chain needs sampling parameters (temperature > 0)");
  const size_t n = req.tokens.size();
  bool chain = req.all_logits && (req.parents.empty() || req.parents.size() == n);
  for (size_t i = 0; chain && i < req.parents.size(); ++i) chain = req.parents[i] == int32_t(i) - 1;
  TALON_CHECK(chain, "decoder: forward_accept_chain takes a chain (parents empty or i - 1) with all logits");
  TALON_CHECK(n >= 1 && n_q == n - 1, "decoder: a chain of {} draft tokens with {} draft distributions",
              n == 0 ? 0 : n - 1, n_q);
}

Decoder::ChainAcceptance Decoder::forward_accept_chain(const DecodeRequest& req, const Capture& cap,
                                                       const SamplingParams& p,
                                                       const std::vector<std::vector<double>>& q, const double* u) {
  check_chain_acceptance(req, q.size(), p);
  const int64_t n = int64_t(req.tokens.size()), k = n - 1, V = config().vocab;
  std::vector<float>& logits = host_logits_;
  logits.resize(size_t(n) * size_t(V));
  forward({req}, cap, logits.data());
  ChainAcceptance r;
  std::vector<double> dist;
  int tests = 0;
  for (int64_t i = 0;; ++i) {
    sampling_distribution(logits.data() + i * V, V, p, dist);
    if (i == k) break;  // every draft token kept: the next one from p_k
    const int32_t d = req.tokens[size_t(i + 1)];
    const std::vector<double>& qi = q[size_t(i)];
    // (a uniform is used only when the test is made: q(d) > 0)
    if (qi[size_t(d)] > 0 && u[tests++] < std::min(1.0, dist[size_t(d)] / qi[size_t(d)])) {
      ++r.kept;
      continue;
    }
    double mass = 0;
    for (int64_t v = 0; v < V; ++v) mass += dist[size_t(v)] = std::max(0.0, dist[size_t(v)] - qi[size_t(v)]);
    if (mass <= 0) sampling_distribution(logits.data() + i * V, V, p, dist);
    break;
  }
  r.next = draw(dist, u[tests]);
  return r;
}

void check_tree_acceptance(const DecodeRequest& req, const SamplingParams& p) {
  TALON_CHECK(!p.greedy(), "decoder: forward_accept_tree needs sampling parameters (temperature > 0)");
  const size_t n = req.tokens.size();
  TALON_CHECK(n >= 1 && req.all_logits && req.parents.size() == n && req.parents[0] == -1,
              "decoder: forward_accept_tree takes a tree: every token's parent, the first -1, with all logits");
  for (size_t i = 1; i < n; ++i)
    TALON_CHECK(req.parents[i] >= 0 && req.parents[i] < int32_t(i),
                "decoder: forward_accept_tree: token {} has parent {}, expected an earlier token", i, req.parents[i]);
}

Decoder::TreeAcceptance Decoder::forward_accept_tree(const DecodeRequest& req, const Capture& cap,
                                                     const SamplingParams& p, const double* u) {
  check_tree_acceptance(req, p);
  const int64_t n = int64_t(req.tokens.size()), V = config().vocab;
  std::vector<float>& logits = host_logits_;
  logits.resize(size_t(n) * size_t(V));
  forward({req}, cap, logits.data());
  std::vector<std::vector<int32_t>> children(static_cast<size_t>(n));
  for (int64_t i = 1; i < n; ++i) children[size_t(req.parents[size_t(i)])].push_back(int32_t(i));
  TreeAcceptance r;
  r.path = {0};
  std::vector<double> dist;
  int used = 0;
  for (;;) {
    const int32_t at = r.path.back();
    sampling_distribution(logits.data() + int64_t(at) * V, V, p, dist);
    double mass = 0;
    for (double x : dist) mass += x;
    int32_t kept = -1;
    for (int32_t c : children[size_t(at)]) {
      const int32_t t = req.tokens[size_t(c)];
      if (dist[size_t(t)] > 0 && u[used++] * mass < dist[size_t(t)]) {
        kept = c;
        break;
      }
      mass -= dist[size_t(t)];
      dist[size_t(t)] = 0;
    }
    if (kept < 0) {
      r.next = draw(dist, u[used]);
      return r;
    }
    r.path.push_back(kept);
  }
}

std::vector<int32_t> request_depths(const DecodeRequest& r) {
  const size_t n = r.tokens.size();
  std::vector<int32_t> d(n);
  if (r.parents.empty()) {
    for (size_t i = 0; i < n; ++i) d[i] = int32_t(i);
    return d;
  }
  TALON_CHECK(r.parents.size() == n, "decoder: request for slot {} has {} tokens but {} parents", r.slot, n,
              r.parents.size());
  for (size_t i = 0; i < n; ++i) {
    const int32_t p = r.parents[i];
    TALON_CHECK(p >= -1 && p < int32_t(i), "decoder: request for slot {}: parent {} of token {} must be -1 or an earlier token",
                r.slot, p, i);
    d[i] = p < 0 ? 0 : d[size_t(p)] + 1;
  }
  return d;
}

}  // namespace talon
