#include "spec/draft_runner.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include "backend/cpu/ops.h"
#include "model/model.h"
#include "train/export.h"
#include "train/trainer.h"
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
  return m;
}

struct DraftRunner::Impl {
  WeightRef embed;
  std::vector<float> inv;
  // Keys and values [rows, kvd]: the step-0 rows (positions 0 .. len-1), then the tree rows
  // (node i at row len + i), which clear_tree drops.
  std::vector<float> k, v;
  std::vector<int32_t> tparent, tdepth;
};

DraftRunner::DraftRunner(const DraftModel& m, const Checkpoint& target) : m_(m), impl_(std::make_unique<Impl>()) {
  const auto& c = m_.config;
  const std::string name = "model.embed_tokens.weight";
  const CkptTensor* t = target.find(name);
  TALON_CHECK(t, "{}: no tensor '{}' (the draft shares the target's token embedding)", target.source(), name);
  impl_->embed = target.weight(*t);
  TALON_CHECK(impl_->embed.shape.size() == 2 && impl_->embed.shape[0] == c.V && impl_->embed.shape[1] == c.H,
              "{}: '{}' is not [{}, {}]", target.source(), name, c.V, c.H);
  impl_->inv = rope_inv_freq(c.rope, c.head_dim);
}

DraftRunner::~DraftRunner() = default;

void DraftRunner::reset() {
  len_ = 0;
  impl_->k.clear();
  impl_->v.clear();
  clear_tree();
}

int64_t DraftRunner::tree_size() const { return int64_t(impl_->tparent.size()); }

void DraftRunner::clear_tree() {
  const int64_t kvd = m_.config.n_kv_heads * m_.config.head_dim;
  impl_->k.resize(size_t(len_ * kvd));
  impl_->v.resize(size_t(len_ * kvd));
  impl_->tparent.clear();
  impl_->tdepth.clear();
}

namespace {

void linear(std::vector<float>& out, const std::vector<float>& in, const std::vector<float>& w, int64_t N, int64_t K,
            int64_t O) {
  out.resize(size_t(N * O));
  cpu::matmul_forward(out.data(), in.data(), w.data(), DType::F32, nullptr, N, K, O);
}

// The decoder layer over N rows: e (token embeddings) and g (input hidden states) [N, H],
// positions, and store(k, v) that files the rows' keys/values and keys_of(r) that lists
// (tree?, row) pairs row r attends to. Writes hidden [N, H] and logits [N, Vd].
void layer_forward(const eagle3::DraftConfig& c, const eagle3::DraftWeights& w, const std::vector<float>& inv,
                   const std::vector<float>& e, const std::vector<float>& g, const std::vector<int32_t>& pos,
                   const std::vector<float>& kstore, const std::vector<float>& vstore,
                   const std::function<void(const float*, const float*)>& store,
                   const std::function<void(int64_t, std::vector<int64_t>&)>& keys_of, float* hidden, float* logits) {
  const int64_t N = int64_t(pos.size()), H = c.H, I = c.I, nh = c.n_heads, nkv = c.n_kv_heads, hd = c.head_dim;
  const int64_t qd = nh * hd, kvd = nkv * hd, grp = nh / nkv;
  const float eps = float(c.rms_eps);
  std::vector<float> xin(size_t(N * 2 * H)), tmp(size_t(N * H));
  for (int64_t r = 0; r < N; ++r) {
    cpu::rmsnorm_forward(xin.data() + r * 2 * H, e.data() + r * H, w.in_ln.data(), 1, H, eps);
    cpu::rmsnorm_forward(xin.data() + r * 2 * H + H, g.data() + r * H, w.hidden_norm.data(), 1, H, eps);
  }
  std::vector<float> q, k, v;
  linear(q, xin, w.wq, N, 2 * H, qd);
  linear(k, xin, w.wk, N, 2 * H, kvd);
  linear(v, xin, w.wv, N, 2 * H, kvd);
  cpu::rope_forward(q.data(), pos.data(), inv.data(), N, nh, hd);
  cpu::rope_forward(k.data(), pos.data(), inv.data(), N, nkv, hd);
  store(k.data(), v.data());
  std::vector<float> att(size_t(N * qd));
  const float scale = 1.0f / std::sqrt(float(hd));
  std::vector<int64_t> rows;
  std::vector<float> p;
  std::vector<double> acc;
  for (int64_t r = 0; r < N; ++r) {
    keys_of(r, rows);
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t kh = h / grp;
      cpu::attend_row(att.data() + r * qd + h * hd, q.data() + r * qd + h * hd, kstore.data() + kh * hd, kvd,
                      vstore.data() + kh * hd, kvd, rows.data(), 0, int64_t(rows.size()), hd, hd, scale, p, acc);
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
  for (int64_t i = 0; i < N * H; ++i) hidden[i] = g1[size_t(i)] + down[size_t(i)];
  std::vector<float> fn(size_t(N * H));
  cpu::rmsnorm_forward(fn.data(), hidden, w.norm.data(), N, H, eps);
  cpu::matmul_forward(logits, fn.data(), w.lm_head.data(), DType::F32, nullptr, N, H, c.Vd);
}

}  // namespace

void DraftRunner::extend(const int32_t* next_tokens, const float* aux, int64_t n, float* hidden_last,
                         float* logits_last) {
  TALON_CHECK(n > 0, "draft: extend with no rows");
  TALON_CHECK(tree_size() == 0, "draft: extend with {} tree rows pending (clear_tree first)", tree_size());
  const auto& c = m_.config;
  const int64_t H = c.H, kvd = c.n_kv_heads * c.head_dim;
  std::vector<float> e(size_t(n * H)), g(size_t(n * H)), A(aux, aux + n * 3 * H);
  cpu::embedding_forward(e.data(), next_tokens, impl_->embed.data, impl_->embed.dtype, n, H, c.V);
  linear(g, A, m_.weights.fc, n, 3 * H, H);
  std::vector<int32_t> pos(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) pos[size_t(i)] = int32_t(len_ + i);
  const int64_t base = len_;
  auto store = [&](const float* k, const float* v) {
    impl_->k.insert(impl_->k.end(), k, k + n * kvd);
    impl_->v.insert(impl_->v.end(), v, v + n * kvd);
  };
  auto keys = [&](int64_t r, std::vector<int64_t>& rows) {  // step-0 rows 0 .. t (causal)
    rows.resize(size_t(base + r + 1));
    for (int64_t j = 0; j <= base + r; ++j) rows[size_t(j)] = j;
  };
  std::vector<float> hid(size_t(n * H)), lg(size_t(n * c.Vd));
  layer_forward(c, m_.weights, impl_->inv, e, g, pos, impl_->k, impl_->v, store, keys, hid.data(), lg.data());
  len_ += n;
  std::copy_n(hid.data() + (n - 1) * H, H, hidden_last);
  std::copy_n(lg.data() + (n - 1) * c.Vd, c.Vd, logits_last);
}

void DraftRunner::tree_step(const std::vector<int32_t>& tokens, const std::vector<int32_t>& parents,
                            const float* parent_hidden, float* hidden, float* logits) {
  const auto& c = m_.config;
  const int64_t n = int64_t(tokens.size()), H = c.H, kvd = c.n_kv_heads * c.head_dim, T0 = tree_size();
  TALON_CHECK(len_ > 0, "draft: tree_step before any step-0 row");
  TALON_CHECK(int64_t(parents.size()) == n && n > 0, "draft: tree_step with {} tokens and {} parents", n,
              parents.size());
  for (int64_t i = 0; i < n; ++i) {
    TALON_CHECK(parents[size_t(i)] >= -1 && parents[size_t(i)] < T0,
                "draft: tree node {} has parent {}, expected -1 or an existing node below {}", T0 + i,
                parents[size_t(i)], T0);
    impl_->tparent.push_back(parents[size_t(i)]);
    impl_->tdepth.push_back(parents[size_t(i)] < 0 ? 1 : impl_->tdepth[size_t(parents[size_t(i)])] + 1);
  }
  std::vector<float> e(size_t(n * H)), g(parent_hidden, parent_hidden + n * H);
  cpu::embedding_forward(e.data(), tokens.data(), impl_->embed.data, impl_->embed.dtype, n, H, c.V);
  std::vector<int32_t> pos(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) pos[size_t(i)] = int32_t(len_ - 1 + impl_->tdepth[size_t(T0 + i)]);
  auto store = [&](const float* k, const float* v) {
    impl_->k.insert(impl_->k.end(), k, k + n * kvd);
    impl_->v.insert(impl_->v.end(), v, v + n * kvd);
  };
  std::vector<int64_t> chain;
  auto keys = [&](int64_t r, std::vector<int64_t>& rows) {  // step-0 rows, then the node's ancestors and itself
    rows.resize(size_t(len_));
    for (int64_t j = 0; j < len_; ++j) rows[size_t(j)] = j;
    chain.clear();
    for (int64_t a = T0 + r; a >= 0; a = impl_->tparent[size_t(a)]) chain.push_back(len_ + a);
    rows.insert(rows.end(), chain.rbegin(), chain.rend());
  };
  layer_forward(c, m_.weights, impl_->inv, e, g, pos, impl_->k, impl_->v, store, keys, hidden, logits);
}

}  // namespace talon::spec
