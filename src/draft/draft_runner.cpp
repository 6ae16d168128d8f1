#include "draft/draft_runner.h"

#include "draft/draft_backend.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

#include "backend/cpu/ops.h"
#include "model/model.h"
#include "draft/export.h"
#include "draft/trainer.h"
#include "util/error.h"

namespace talon::spec {

DraftModel load_draft(const fs::path& path, const Checkpoint& target) {
  const ModelConfig& tc = target.config();
  DraftModel m;
  const bool exported = fs::is_directory(path) && fs::exists(path / "config.json") &&
                        !fs::exists(path / train::kCheckpointName);
  if (!exported) {
    train::TrainedDraft d = train::load_trained_draft(path, tc, target.source());
    m.config = std::move(d.config);
    m.weights = std::move(d.weights);
    m.vocab = std::move(d.vocab);
    m.aux_layer_ids = std::move(d.aux_layer_ids);
    m.origin = "talon checkpoint " + d.path.string();
    m.drafter = d.drafter;
    m.mask_token = int32_t(d.mask_token_id);
    m.mask_hidden = std::move(d.mask_hidden);
    m.embed = std::move(d.embed);
    m.dflash = d.dflash;
    m.dweights = std::move(d.dweights);
    return m;
  }
  train::ExportedDraft d = train::load_exported_draft(path);
  const std::string where = (path / "config.json").string();
  TALON_CHECK(d.config.H == tc.hidden, "{}: the draft's hidden size is {}, but the target {} has {}", where,
              d.config.H, target.source(), tc.hidden);
  TALON_CHECK(d.config.V == tc.vocab, "{}: the draft's target vocabulary is {}, but the target {} has {}", where,
              d.config.V, target.source(), tc.vocab);
  TALON_CHECK(d.aux_layer_ids.size() == 3, "{}: {} aux layer ids, expected 3", where, d.aux_layer_ids.size());
  for (int64_t id : d.aux_layer_ids)
    TALON_CHECK(id >= 0 && id <= tc.n_layers, "{}: aux layer id {} (Talon's convention) outside [0, {}] of the target",
                where, id, tc.n_layers);
  m.config = std::move(d.config);
  m.weights = std::move(d.weights);
  m.vocab = std::move(d.vocab);
  m.aux_layer_ids = std::move(d.aux_layer_ids);
  m.origin = std::string(train::export_format_name(d.format)) + " export " + path.string();
  m.drafter = d.drafter;
  m.mask_token = int32_t(d.mask_token_id);
  m.mask_hidden = std::move(d.mask_hidden);
  m.embed = std::move(d.embed);
  m.dflash = d.dflash;
  m.dweights = std::move(d.dweights);
  return m;
}

namespace {

void linear(std::vector<float>& out, const std::vector<float>& in, const std::vector<float>& w, int64_t N, int64_t K,
            int64_t O) {
  out.resize(size_t(N * O));
  cpu::matmul_forward(out.data(), in.data(), w.data(), DType::F32, nullptr, N, K, O);
}

// The fp32 reference: keys and values [rows, kvd] in host vectors.
class CpuDraftBackend final : public DraftBackend {
 public:
  CpuDraftBackend(const DraftModel& m, const Checkpoint& target) : c_(m.config), w_(m.weights) {
    inv_ = rope_inv_freq(c_.rope, c_.head_dim);
    if (!m.embed.empty()) {  // P-EAGLE's own
      TALON_CHECK(int64_t(m.embed.size()) == c_.V * c_.H, "draft: its embedding has {} values, expected {} x {}",
                  m.embed.size(), c_.V, c_.H);
      embed_ = WeightRef{DType::F32, m.embed.data(), {c_.V, c_.H}};
      return;
    }
    const std::string name = "model.embed_tokens.weight";
    const CkptTensor* t = target.find(name);
    TALON_CHECK(t, "{}: no tensor '{}' (the draft shares the target's token embedding)", target.source(), name);
    embed_ = target.weight(*t);
    TALON_CHECK(embed_.shape.size() == 2 && embed_.shape[0] == c_.V && embed_.shape[1] == c_.H,
                "{}: '{}' is not [{}, {}]", target.source(), name, c_.V, c_.H);
  }

  std::string name() const override { return "cpu"; }

  void truncate(int64_t n) override {
    const int64_t kvd = c_.n_kv_heads * c_.head_dim;
    if (int64_t(k_.size()) > n * kvd) {
      k_.resize(size_t(n * kvd));
      v_.resize(size_t(n * kvd));
    }
  }

  void forward(const int32_t* tokens, const float* in, bool from_aux, const DraftRows& rows, bool last_only,
               float* hidden, float* logits, int top_k, int32_t* top_ids, float* top_lp) override {
    const auto& c = c_;
    const auto& w = w_;
    const int64_t N = rows.size(), H = c.H, I = c.I, nh = c.n_heads, nkv = c.n_kv_heads, hd = c.head_dim;
    const int64_t qd = nh * hd, kvd = nkv * hd, grp = nh / nkv;
    const float eps = float(c.rms_eps);
    std::vector<float> e(size_t(N * H)), g;
    cpu::embedding_forward(e.data(), tokens, embed_.data, embed_.dtype, N, H, c.V);
    if (from_aux)
      linear(g, std::vector<float>(in, in + N * 3 * H), w.fc, N, 3 * H, H);
    else
      g.assign(in, in + N * H);
    std::vector<float> xin(size_t(N * 2 * H)), tmp(size_t(N * H));
    for (int64_t r = 0; r < N; ++r) {
      cpu::rmsnorm_forward(xin.data() + r * 2 * H, e.data() + r * H, w.in_ln.data(), 1, H, eps);
      cpu::rmsnorm_forward(xin.data() + r * 2 * H + H, g.data() + r * H, w.hidden_norm.data(), 1, H, eps);
    }
    std::vector<float> q, k, v;
    linear(q, xin, w.wq, N, 2 * H, qd);
    linear(k, xin, w.wk, N, 2 * H, kvd);
    linear(v, xin, w.wv, N, 2 * H, kvd);
    cpu::rope_forward(q.data(), rows.pos.data(), inv_.data(), N, nh, hd);
    cpu::rope_forward(k.data(), rows.pos.data(), inv_.data(), N, nkv, hd);
    for (int64_t r = 0; r < N; ++r) {  // row r's key and value at cache row end - 1
      const size_t at = size_t(rows.end[size_t(r)] - 1);
      if (k_.size() < (at + 1) * size_t(kvd)) {
        k_.resize((at + 1) * size_t(kvd));
        v_.resize((at + 1) * size_t(kvd));
      }
      std::copy_n(k.data() + r * kvd, kvd, k_.data() + at * size_t(kvd));
      std::copy_n(v.data() + r * kvd, kvd, v_.data() + at * size_t(kvd));
    }
    std::vector<float> att(size_t(N * qd));
    const float scale = 1.0f / std::sqrt(float(hd));
    std::vector<int64_t> keys;
    std::vector<float> p;
    std::vector<double> acc;
    for (int64_t r = 0; r < N; ++r) {
      const int32_t len = rows.len[size_t(r)], end = rows.end[size_t(r)], mk = rows.mask[size_t(r)];
      keys.clear();
      for (int64_t j = 0; j < end; ++j)
        if (j < len || mk < 0 || ((rows.masks[size_t(mk + (j - len) / 64)] >> ((j - len) % 64)) & 1u))
          keys.push_back(j);
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t kh = h / grp;
        cpu::attend_row(att.data() + r * qd + h * hd, q.data() + r * qd + h * hd, k_.data() + kh * hd, kvd,
                        v_.data() + kh * hd, kvd, keys.data(), 0, int64_t(keys.size()), hd, hd, scale, p, acc);
      }
    }
    std::vector<float> o, g1(size_t(N * H)), hm(size_t(N * H));
    linear(o, att, w.wo, N, qd, H);
    for (int64_t r = 0; r < N; ++r) {
      const float* base = g.data() + r * H;
      if (c.norm_before_residual) {
        cpu::rmsnorm_forward(tmp.data() + r * H, base, w.hidden_norm.data(), 1, H, eps);
        base = tmp.data() + r * H;
      }
      for (int64_t i = 0; i < H; ++i) g1[size_t(r * H + i)] = base[i] + o[size_t(r * H + i)];
    }
    cpu::rmsnorm_forward(hm.data(), g1.data(), w.post_ln.data(), N, H, eps);
    std::vector<float> ga, up, down;
    linear(ga, hm, w.gate, N, H, I);
    linear(up, hm, w.up, N, H, I);
    cpu::swiglu_forward(ga.data(), ga.data(), up.data(), N * I);
    linear(down, ga, w.down, N, I, H);
    std::vector<float> hid(size_t(N * H));
    for (int64_t i = 0; i < N * H; ++i) hid[size_t(i)] = g1[size_t(i)] + down[size_t(i)];
    const int64_t first = last_only ? N - 1 : 0, n_out = N - first;
    std::copy_n(hid.data() + first * H, n_out * H, hidden);
    std::vector<float> fn(size_t(n_out * H));
    cpu::rmsnorm_forward(fn.data(), hidden, w.norm.data(), n_out, H, eps);
    std::vector<float> own;
    if (!logits) {
      own.resize(size_t(n_out * c.Vd));
      logits = own.data();
    }
    cpu::matmul_forward(logits, fn.data(), w.lm_head.data(), DType::F32, nullptr, n_out, H, c.Vd);
    for (int64_t r = 0; r < n_out && top_k > 0; ++r)
      top_logsoftmax(logits + r * c.Vd, c.Vd, top_k, top_ids + r * top_k, top_lp + r * top_k);
  }

 private:
  const eagle3::DraftConfig& c_;
  const eagle3::DraftWeights& w_;
  WeightRef embed_;
  std::vector<float> inv_;
  std::vector<float> k_, v_;
};

}  // namespace

void top_logsoftmax(const float* x, int64_t n, int k, int32_t* ids, float* lp) {
  double mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, double(x[i]));
  double z = 0;
  for (int64_t i = 0; i < n; ++i) z += std::exp(double(x[i]) - mx);
  const double lz = mx + std::log(z);
  std::vector<int32_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                    [&](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
  for (int i = 0; i < k; ++i) {
    ids[i] = idx[size_t(i)];
    lp[i] = float(double(x[idx[size_t(i)]]) - lz);
  }
}

std::unique_ptr<DraftBackend> make_cpu_draft_backend(const DraftModel& m, const Checkpoint& target) {
  return std::make_unique<CpuDraftBackend>(m, target);
}

struct DraftRunner::Impl {
  std::unique_ptr<DraftBackend> be;
  std::unique_ptr<DFlashBackend> dfl;  // DFlash on a GPU
  // DFlash on the CPU: the target's embedding (fp32), the context so far (each row's keys and
  // values in every layer, dflash.h: ContextCache); and the last token.
  std::vector<float> embed;
  dflash::ContextCache ctx;
  int32_t last_token = -1;
  std::vector<int32_t> tparent, tdepth;  // the tree's nodes (ids from 0)
  // Appends nodes with these parents to the tree above `len` step-0 rows; the rows that
  // forward them.
  DraftRows add_tree_rows(int64_t len, const std::vector<int32_t>& parents) {
    const int64_t n = int64_t(parents.size()), T0 = int64_t(tparent.size());
    for (int64_t i = 0; i < n; ++i)
      TALON_CHECK(parents[size_t(i)] >= -1 && parents[size_t(i)] < T0 + i,
                  "draft: tree node {} has parent {}, expected -1 or an earlier node", T0 + i, parents[size_t(i)]);
    // Tree node t sits at cache row len + t, attends to the step-0 rows and to its ancestors
    // and itself (bits of the rows above len), at RoPE position (last step-0 position) + depth.
    DraftRows rows;
    for (int64_t i = 0; i < n; ++i) {
      const int32_t t = int32_t(T0 + i), par = parents[size_t(i)];
      tparent.push_back(par);
      tdepth.push_back(par < 0 ? 1 : tdepth[size_t(par)] + 1);
      rows.pos.push_back(int32_t(len - 1 + tdepth.back()));
      rows.len.push_back(int32_t(len));
      rows.end.push_back(int32_t(len + t + 1));
      rows.mask.push_back(int32_t(rows.masks.size()));
      rows.masks.resize(rows.masks.size() + size_t(t / 64 + 1), 0);
      for (int32_t a = t; a >= 0; a = tparent[size_t(a)])
        rows.masks[size_t(rows.mask.back() + a / 64)] |= uint64_t(1) << (a % 64);
    }
    return rows;
  }
};

DraftRunner::DraftRunner(const DraftModel& m, const Checkpoint& target, int device, int64_t max_rows)
    : m_(m), impl_(std::make_unique<Impl>()) {
  const auto& c = m_.config;
  if (m_.block()) {
    TALON_CHECK(int64_t(m_.dweights.layers.size()) == m_.dflash.layers && m_.dflash.block >= 2,
                "{}: a DFlash draft without its layers", m_.origin);
    if (device >= 0) {
      TALON_CHECK(max_rows > 0, "draft: a GPU DFlash draft needs room for its context (max_rows {})", max_rows);
      impl_->dfl = make_cuda_dflash_backend(m_, target, device, max_rows);
      return;
    }
    const CkptTensor* t = target.find("model.embed_tokens.weight");
    TALON_CHECK(t, "{}: no tensor 'model.embed_tokens.weight' (a DFlash draft reads the target's embedding)",
                target.source());
    const WeightRef e = target.weight(*t);
    TALON_CHECK(e.shape.size() == 2 && e.shape[0] == m_.dflash.V && e.shape[1] == m_.dflash.H,
                "{}: the embedding is not [{}, {}]", target.source(), m_.dflash.V, m_.dflash.H);
    impl_->embed.resize(size_t(m_.dflash.V * m_.dflash.H));
    convert_to_f32(e.dtype, e.data, impl_->embed.data(), impl_->embed.size());
    return;
  }
  TALON_CHECK(c.H > 0 && c.n_heads > 0 && c.n_kv_heads > 0 && c.n_heads % c.n_kv_heads == 0,
              "draft: {} query heads and {} kv heads", c.n_heads, c.n_kv_heads);
  impl_->be = device < 0 ? make_cpu_draft_backend(m_, target) : make_cuda_draft_backend(m_, target, device, max_rows);
}

DraftRunner::~DraftRunner() = default;

std::string DraftRunner::backend() const {
  return impl_->be ? impl_->be->name() : impl_->dfl ? impl_->dfl->name() : std::string("cpu");
}
int64_t DraftRunner::graph_replays() const { return impl_->be ? impl_->be->graph_replays() : 0; }

void DraftRunner::reset() {
  len_ = 0;
  clear_tree();
}

int64_t DraftRunner::tree_size() const { return int64_t(impl_->tparent.size()); }

void DraftRunner::clear_tree() {
  if (impl_->be) impl_->be->truncate(len_);
  impl_->tparent.clear();
  impl_->tdepth.clear();
}

namespace {
// Sizes `top` for `rows` output rows; returns its k (0 without one).
int prepare_top(DraftTop* top, int64_t rows, int64_t Vd) {
  if (!top) return 0;
  TALON_CHECK(top->k > 0 && top->k <= Vd, "draft: top-k of {} over a draft vocabulary of {}", top->k, Vd);
  top->ids.resize(size_t(rows * top->k));
  top->logprob.resize(size_t(rows * top->k));
  return top->k;
}
}  // namespace

void DraftRunner::extend(const int32_t* next_tokens, const float* aux, int64_t n, float* hidden_last,
                         float* logits_last, DraftTop* top) {
  TALON_CHECK(n > 0, "draft: extend with no rows");
  TALON_CHECK(tree_size() == 0, "draft: extend with {} tree rows pending (clear_tree first)", tree_size());
  if (m_.block()) {
    if (impl_->dfl) {
      if (len_ == 0) impl_->dfl->reset();
      impl_->dfl->extend(aux, n);
    } else {
      if (len_ == 0) impl_->ctx = dflash::ContextCache{};
      dflash::extend_context(m_.dflash, m_.dweights, aux, n, impl_->ctx);
    }
    impl_->last_token = next_tokens[n - 1];
    len_ += n;
    return;
  }
  DraftRows rows;  // step-0 rows: causal over the step-0 rows before them
  for (int64_t i = 0; i < n; ++i) {
    rows.pos.push_back(int32_t(len_ + i));
    rows.len.push_back(int32_t(len_));
    rows.end.push_back(int32_t(len_ + i + 1));
    rows.mask.push_back(-1);
  }
  const int k = prepare_top(top, 1, m_.config.Vd);
  impl_->be->forward(next_tokens, aux, true, rows, true, hidden_last, logits_last, k, k ? top->ids.data() : nullptr,
                     k ? top->logprob.data() : nullptr);
  len_ += n;
}

std::vector<int32_t> DraftRunner::extend_chain(const int32_t* next_tokens, const float* aux, int64_t n, int k) {
  TALON_CHECK(!m_.chain_only(), "draft: {} drafts its chain in one pass, not step by step", m_.origin);
  TALON_CHECK(n > 0 && k >= 1, "draft: extend_chain of {} rows and a chain of {}", n, k);
  TALON_CHECK(tree_size() == 0, "draft: extend with {} tree rows pending (clear_tree first)", tree_size());
  DraftRows first;  // step-0 rows, as extend()
  for (int64_t i = 0; i < n; ++i) {
    first.pos.push_back(int32_t(len_ + i));
    first.len.push_back(int32_t(len_));
    first.end.push_back(int32_t(len_ + i + 1));
    first.mask.push_back(-1);
  }
  std::vector<DraftRows> steps;
  for (int j = 0; j + 1 < k; ++j) steps.push_back(impl_->add_tree_rows(len_ + n, {j == 0 ? -1 : int32_t(j - 1)}));
  std::vector<int32_t> ids(static_cast<size_t>(k));
  if (!impl_->be->chain(next_tokens, aux, true, first, steps, ids.data())) {
    const int64_t H = m_.config.H;
    std::vector<float> h(static_cast<size_t>(H)), h2(h.size());
    float lp = 0;
    impl_->be->forward(next_tokens, aux, true, first, true, h.data(), nullptr, 1, &ids[0], &lp);
    for (int j = 0; j + 1 < k; ++j) {
      const int32_t tok = to_target(ids[size_t(j)]);
      impl_->be->forward(&tok, h.data(), false, steps[size_t(j)], false, h2.data(), nullptr, 1, &ids[size_t(j + 1)], &lp);
      h.swap(h2);
    }
  }
  len_ += n;
  return ids;
}

void DraftRunner::expand_tree(const DraftTop& top, const float* hidden, int depth, std::vector<int32_t>& tokens,
                              std::vector<int32_t>& parents, std::vector<double>& scores, bool on_device) {
  TALON_CHECK(!m_.chain_only(), "draft: {} drafts one chain a round, not a tree", m_.origin);
  TALON_CHECK(len_ > 0 && depth >= 1, "draft: a tree of depth {} after {} step-0 rows", depth, len_);
  const int k = top.k;
  TALON_CHECK(k >= 1 && int64_t(top.ids.size()) >= k && int64_t(top.logprob.size()) >= k, "draft: a root top-k of {}",
              k);
  const int64_t H = m_.config.H;
  tokens.clear(), parents.clear(), scores.clear();
  for (int j = 0; j < k; ++j) {
    tokens.push_back(to_target(top.ids[size_t(j)]));
    parents.push_back(-1);
    scores.push_back(double(top.logprob[size_t(j)]));
  }
  if (depth == 1) return;
  // The k best of the candidates [first, end) (score descending, ties to the lower index).
  auto best = [&](size_t first) {
    std::vector<int32_t> idx(scores.size() - first);
    std::iota(idx.begin(), idx.end(), int32_t(first));
    const size_t n = std::min(idx.size(), size_t(k));
    std::partial_sort(idx.begin(), idx.begin() + std::ptrdiff_t(n), idx.end(), [&](int32_t a, int32_t b) {
      return scores[size_t(a)] > scores[size_t(b)] || (scores[size_t(a)] == scores[size_t(b)] && a < b);
    });
    idx.resize(n);
    return idx;
  };
  const int64_t T0 = tree_size();
  if (on_device) {
    // The rows of every step: node ids follow one another, each step's parents are made on the
    // device; only the first step's (the root's children: own bits) are known here.
    std::vector<DraftRows> steps;
    for (int d = 2; d <= depth; ++d) {
      DraftRows r;
      for (int i = 0; i < k; ++i) {
        const int32_t t = int32_t(T0 + int64_t(d - 2) * k + i);
        r.pos.push_back(int32_t(len_ - 1 + d - 1));
        r.len.push_back(int32_t(len_));
        r.end.push_back(int32_t(len_ + t + 1));
        r.mask.push_back(int32_t(r.masks.size()));
        r.masks.resize(r.masks.size() + size_t(t / 64 + 1), 0);
        if (d == 2) r.masks[size_t(r.mask.back() + t / 64)] |= uint64_t(1) << (t % 64);
      }
      steps.push_back(std::move(r));
    }
    std::vector<int32_t> tok, par, run;
    std::vector<double> sc;
    if (impl_->be->tree(tokens, scores, hidden, steps, tok, par, sc, run)) {
      tokens = tok, parents = par, scores = sc;
      // The runner's own record of the forwarded nodes (node = run[c] for candidate c).
      std::vector<int32_t> node_parent(static_cast<size_t>(int64_t(depth - 1) * k), -1),
          node_depth(node_parent.size(), 0);
      std::vector<int32_t> cand_depth(tokens.size(), 1);
      for (size_t c = 0; c < tokens.size(); ++c) {
        if (parents[c] >= 0) cand_depth[c] = cand_depth[size_t(parents[c])] + 1;
        if (run[c] < 0) continue;
        const int64_t at = run[c] - T0;
        TALON_CHECK(at >= 0 && at < int64_t(node_parent.size()), "draft: the device tree forwarded node {}", run[c]);
        node_parent[size_t(at)] = parents[c] < 0 ? -1 : run[size_t(parents[c])];
        node_depth[size_t(at)] = cand_depth[c];
      }
      impl_->tparent.insert(impl_->tparent.end(), node_parent.begin(), node_parent.end());
      impl_->tdepth.insert(impl_->tdepth.end(), node_depth.begin(), node_depth.end());
      return;
    }
  }
  // Step by step: forward the frontier, add its children, keep the k best.
  std::vector<int32_t> runner_id(tokens.size(), -1), frontier(static_cast<size_t>(k));
  std::iota(frontier.begin(), frontier.end(), 0);
  std::vector<std::vector<float>> hid;  // per forwarded node
  DraftTop st;
  st.k = k;
  for (int d = 2; d <= depth; ++d) {
    std::vector<int32_t> toks, pars;
    std::vector<float> ph;
    for (int32_t f : frontier) {
      toks.push_back(tokens[size_t(f)]);
      const int32_t p = parents[size_t(f)];
      pars.push_back(p < 0 ? -1 : runner_id[size_t(p)]);
      const float* h = p < 0 ? hidden : hid[size_t(runner_id[size_t(p)] - T0)].data();
      ph.insert(ph.end(), h, h + H);
    }
    const int64_t base = tree_size(), n = int64_t(frontier.size());
    std::vector<float> hs(size_t(n * H));
    tree_step(toks, pars, ph.data(), hs.data(), nullptr, &st);
    const size_t first_new = tokens.size();
    for (int64_t i = 0; i < n; ++i) {
      const int32_t f = frontier[size_t(i)];
      runner_id[size_t(f)] = int32_t(base + i);
      hid.emplace_back(hs.begin() + i * H, hs.begin() + (i + 1) * H);
      for (int j = 0; j < k; ++j) {
        tokens.push_back(to_target(st.ids[size_t(i * k + j)]));
        parents.push_back(f);
        scores.push_back(scores[size_t(f)] + double(st.logprob[size_t(i * k + j)]));
        runner_id.push_back(-1);
      }
    }
    frontier = best(first_new);
  }
}

void DraftRunner::tree_step(const std::vector<int32_t>& tokens, const std::vector<int32_t>& parents,
                            const float* parent_hidden, float* hidden, float* logits, DraftTop* top) {
  const int64_t n = int64_t(tokens.size());
  TALON_CHECK(len_ > 0, "draft: tree_step before any step-0 row");
  TALON_CHECK(int64_t(parents.size()) == n && n > 0, "draft: tree_step with {} tokens and {} parents", n,
              parents.size());
  const DraftRows rows = impl_->add_tree_rows(len_, parents);
  const int k = prepare_top(top, n, m_.config.Vd);
  impl_->be->forward(tokens.data(), parent_hidden, false, rows, false, hidden, logits, k,
                     k ? top->ids.data() : nullptr, k ? top->logprob.data() : nullptr);
}

void DraftRunner::block_step(int64_t n, float* logits, DraftTop* top) {
  TALON_CHECK(m_.block(), "draft: a block step needs a DFlash draft ({} is {})", m_.origin, m_.drafter);
  const dflash::Config& c = m_.dflash;
  TALON_CHECK(len_ > 0 && n >= 1 && n < c.block, "draft: block step of {} rows (blocks of {}) after {} context rows",
              n, c.block, len_);
  TALON_CHECK(impl_->last_token >= 0 && impl_->last_token < c.V, "draft: block token {} outside the vocabulary",
              impl_->last_token);
  if (impl_->dfl) {
    TALON_CHECK(impl_->dfl->rows() == len_, "draft: {} context rows cached for {} extended", impl_->dfl->rows(), len_);
    const int k = prepare_top(top, n, c.Vd);
    impl_->dfl->block(impl_->last_token, m_.mask_token, n, logits, k, k ? top->ids.data() : nullptr,
                      k ? top->logprob.data() : nullptr);
    return;
  }
  TALON_CHECK(impl_->ctx.rows == len_, "draft: {} context rows cached for {} extended", impl_->ctx.rows, len_);
  const std::vector<double> lg =
      dflash::block_logits(c, m_.dweights, impl_->embed.data(), impl_->ctx, impl_->last_token, m_.mask_token);
  std::vector<float> rows(size_t(n * c.Vd));
  for (int64_t i = 0; i < n * c.Vd; ++i) rows[size_t(i)] = float(lg[size_t(c.Vd + i)]);  // positions 1..n
  if (logits) std::copy(rows.begin(), rows.end(), logits);
  const int k = prepare_top(top, n, c.Vd);
  for (int64_t r = 0; r < n && k > 0; ++r)
    top_logsoftmax(rows.data() + r * c.Vd, c.Vd, k, top->ids.data() + r * k, top->logprob.data() + r * k);
}

void DraftRunner::parallel_step(int64_t n, float* logits, DraftTop* top) {
  TALON_CHECK(m_.parallel(), "draft: a parallel step needs a P-EAGLE draft ({} is {})", m_.origin, m_.drafter);
  TALON_CHECK(len_ > 0 && n > 0, "draft: parallel step of {} rows after {} step-0 rows", n, len_);
  const int64_t H = m_.config.H;
  TALON_CHECK(int64_t(m_.mask_hidden.size()) == 3 * H, "draft: mask_hidden has {} values, expected {}",
              m_.mask_hidden.size(), 3 * H);
  std::vector<int32_t> parents(static_cast<size_t>(n));
  const int32_t T0 = int32_t(tree_size());
  for (int64_t i = 0; i < n; ++i) parents[size_t(i)] = i == 0 ? -1 : T0 + int32_t(i) - 1;
  const DraftRows rows = impl_->add_tree_rows(len_, parents);
  const std::vector<int32_t> tokens(static_cast<size_t>(n), m_.mask_token);
  std::vector<float> in(static_cast<size_t>(n * 3 * H)), hidden(static_cast<size_t>(n * H));
  for (int64_t i = 0; i < n; ++i) std::copy(m_.mask_hidden.begin(), m_.mask_hidden.end(), in.begin() + i * 3 * H);
  const int k = prepare_top(top, n, m_.config.Vd);
  impl_->be->forward(tokens.data(), in.data(), true, rows, false, hidden.data(), logits, k,
                     k ? top->ids.data() : nullptr, k ? top->logprob.data() : nullptr);
}


}  // namespace talon::spec
