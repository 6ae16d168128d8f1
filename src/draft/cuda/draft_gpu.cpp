#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <thread>

#include "backend/cuda/check.h"
#include "draft/cuda/dflash_engine.h"
#include "draft/cuda/draft_engine.h"
#include "backend/cuda/nccl_lib.h"
#include "util/threads.h"
#include "util/log.h"
#include "model/model.h"
#include "draft/draft_gpu.h"
#include "util/error.h"

namespace talon::eagle3 {

namespace {

// A family's tensors by name, for an engine that holds `names` (sizes `sizes`) in that order:
// named_pointers gives the host arrays of `w` in that order, each checked; fetch_named fills
// those `out` asks for from get(pointers), which copies every engine tensor to the host.
std::vector<const float*> named_pointers(const GpuDraftTrainer::Named& w, const std::vector<std::string>& names,
                                         const std::vector<int64_t>& sizes) {
  std::vector<const float*> p;
  for (size_t i = 0; i < names.size(); ++i) {
    const std::vector<float>* v = nullptr;
    for (auto& [n, x] : w)
      if (n == names[i]) v = x;
    TALON_CHECK(v, "draft on GPU: tensor {} was not given", names[i]);
    TALON_CHECK(int64_t(v->size()) == sizes[i], "draft weight {}: {} values, expected {}", names[i], v->size(),
                sizes[i]);
    p.push_back(v->data());
  }
  return p;
}
template <class Get>
void fetch_named(const GpuDraftTrainer::NamedOut& out, const std::vector<std::string>& names,
                 const std::vector<int64_t>& sizes, Get&& get) {
  const auto index = [&](const std::string& n) {
    const auto it = std::find(names.begin(), names.end(), n);
    TALON_CHECK(it != names.end(), "draft on GPU: no tensor named {}", n);
    return size_t(it - names.begin());
  };
  for (auto& [n, v] : out) (void)index(n);
  std::vector<std::vector<float>> all(sizes.size());
  std::vector<float*> p;
  for (size_t i = 0; i < sizes.size(); ++i) {
    all[i].resize(size_t(sizes[i]));
    p.push_back(all[i].data());
  }
  get(p);
  for (auto& [n, v] : out) *v = std::move(all[index(n)]);
}

// An engine's optimizer moments, one pair per tensor, from and to trainable() order (`tr`: the
// engine index of each trainable tensor); frozen tensors get zeros, which AdamW never reads.
template <class Engine>
void put_moments(Engine& eng, const std::vector<std::string>& names, const std::vector<int64_t>& sizes,
                 const std::vector<size_t>& tr, const std::vector<std::vector<float>>& m,
                 const std::vector<std::vector<float>>& v) {
  TALON_CHECK(m.size() == tr.size() && v.size() == tr.size(), "optimizer state: {} tensors, expected {}", m.size(),
              tr.size());
  std::vector<std::vector<float>> zm(sizes.size()), zv(sizes.size());
  std::vector<const float*> pm(sizes.size()), pv(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    zm[i].assign(size_t(sizes[i]), 0.f);
    zv[i].assign(size_t(sizes[i]), 0.f);
    pm[i] = zm[i].data();
    pv[i] = zv[i].data();
  }
  for (size_t j = 0; j < tr.size(); ++j) {
    const size_t i = tr[j];
    TALON_CHECK(int64_t(m[j].size()) == sizes[i] && int64_t(v[j].size()) == sizes[i],
                "optimizer state: tensor {} has {} values, expected {}", names[i], m[j].size(), sizes[i]);
    pm[i] = m[j].data();
    pv[i] = v[j].data();
  }
  eng.set_moments(pm, pv);
}
template <class Engine>
void take_moments(Engine& eng, const std::vector<int64_t>& sizes, const std::vector<size_t>& tr,
                  std::vector<std::vector<float>>& m, std::vector<std::vector<float>>& v) {
  std::vector<std::vector<float>> am(sizes.size()), av(sizes.size());
  std::vector<float*> pm, pv;
  for (size_t i = 0; i < sizes.size(); ++i) {
    am[i].resize(size_t(sizes[i]));
    av[i].resize(size_t(sizes[i]));
    pm.push_back(am[i].data());
    pv.push_back(av[i].data());
  }
  eng.get_moments(pm, pv);
  m.assign(tr.size(), {});
  v.assign(tr.size(), {});
  for (size_t j = 0; j < tr.size(); ++j) {
    m[j] = std::move(am[tr[j]]);
    v[j] = std::move(av[tr[j]]);
  }
}

// One GPU's trainer, with what data parallel needs of it: the gradient buffer (every tensor,
// padded), its length and the stream its work runs on.
// `flag` set for the guard's scope (run_start(): run() then only starts its batch), cleared
// however the scope ends.
struct RaisedFlag {
  bool& flag;
  explicit RaisedFlag(bool& f) : flag(f) { flag = true; }
  ~RaisedFlag() { flag = false; }
  RaisedFlag(const RaisedFlag&) = delete;
  RaisedFlag& operator=(const RaisedFlag&) = delete;
};

class DeviceTrainer : public GpuDraftTrainer {
 public:
  virtual float* grad_data() = 0;
  virtual int64_t grad_elems() const = 0;
  virtual cudaStream_t stream() const = 0;
};

class CudaDraftTrainer final : public DeviceTrainer {
 public:
  CudaDraftTrainer(const DraftConfig& c, const TargetHead& tgt, const DraftVocab& vocab, int device, GpuMath math,
                   int64_t max_rows, const GpuDraftOptions& opt, const GpuFamily& fam)
      : c_(c), max_rows_(max_rows), fam_(fam), peagle_(fam.drafter == "peagle") {
    TALON_CHECK(fam.drafter == "eagle3" || fam.drafter == "peagle",
                "draft on GPU: drafter '{}' has no GPU trainer (eagle3, peagle and dflash do)", fam.drafter);
    TALON_CHECK(!peagle_ || (fam.mask_token >= 0 && fam.mask_token < c.V),
                "draft on GPU: P-EAGLE's mask token {} is outside the vocabulary of {}", fam.mask_token, c.V);
    TALON_CHECK(max_rows >= 2, "draft on GPU: the batch budget must be at least 2 tokens, got {}", max_rows);
    TALON_CHECK(int64_t(vocab.kept.size()) == c.Vd && int64_t(vocab.t2d.size()) == c.V,
                "draft vocabulary has {} of {} ids", vocab.kept.size(), c.Vd);
    cuda::DraftDims d = dims();
    d.target_eps = float(tgt.rms_eps);
    const auto m = math == GpuMath::F32 ? cuda::DraftMath::F32
                   : math == GpuMath::TF32 ? cuda::DraftMath::TF32
                                           : cuda::DraftMath::BF16;
    const std::vector<float> inv = rope_inv_freq(c.rope, c.head_dim);
    eng_ = std::make_unique<cuda::DraftEngine>(device, d, m, tgt.embed, tgt.final_norm, tgt.lm_head, vocab.kept.data(),
                                               vocab.t2d.data(), inv.data(), max_rows, opt);
    tlog::info("cuda:{}: draft trainer: {}", device, eng_->setup());
    DraftWeights probe;
    for (auto& [name, v] : probe.named()) {
      names_.push_back(name);
      decay_.push_back(is_norm_weight(name) ? 0 : 1);
    }
    if (peagle_) {  // as peagle's params(): no weight decay on mask_hidden, decay on the embedding
      names_.insert(names_.end(), {"mask_hidden", "embed"});
      decay_.insert(decay_.end(), {0, 1});
    }
  }

  void set_tensors(const Named& w) override {
    eng_->set_weights(named_pointers(w, names_, cuda::draft_tensor_sizes(dims())));
  }
  void get_tensors(const NamedOut& w) override {
    fetch_named(w, names_, cuda::draft_tensor_sizes(dims()), [&](const std::vector<float*>& p) { eng_->get_weights(p); });
  }
  void get_tensor_grads(const NamedOut& g) override {
    fetch_named(g, names_, cuda::draft_tensor_sizes(dims()), [&](const std::vector<float*>& p) { eng_->get_grads(p); });
  }
  std::vector<std::string> trainable() const override {
    std::vector<std::string> t;
    for (auto& n : names_)
      if (!(peagle_ && n == "lm_head")) t.push_back(n);
    return t;
  }

  void set_weights(DraftWeights& w) override {
    TALON_CHECK(!peagle_, "draft on GPU: a P-EAGLE draft's tensors go through set_tensors");
    std::vector<const float*> p;
    check_sizes(w);
    for (auto& [n, v] : w.named()) p.push_back(v->data());
    eng_->set_weights(p);
  }
  void get_weights(DraftWeights& w) override {
    TALON_CHECK(!peagle_, "draft on GPU: a P-EAGLE draft's tensors come through get_tensors");
    std::vector<float*> p;
    resize(w);
    for (auto& [n, v] : w.named()) p.push_back(v->data());
    eng_->get_weights(p);
  }
  void get_grads(DraftGrads& g) override {
    TALON_CHECK(!peagle_, "draft on GPU: a P-EAGLE draft's gradients come through get_tensor_grads");
    DraftWeights tmp;
    resize(tmp);
    std::vector<float*> p;
    for (auto& [n, v] : tmp.named()) p.push_back(v->data());
    eng_->get_grads(p);
    auto ng = g.named();
    auto nw = tmp.named();
    for (size_t i = 0; i < ng.size(); ++i) ng[i].second->assign(nw[i].second->begin(), nw[i].second->end());
  }
  // Moments in trainable() order; the engine holds one pair per tensor (P-EAGLE's frozen
  // lm_head: zeros, never read).
  void set_moments(const std::vector<std::vector<float>>& m, const std::vector<std::vector<float>>& v) override {
    put_moments(*eng_, names_, cuda::draft_tensor_sizes(dims()), trainable_index(), m, v);
  }
  void get_moments(std::vector<std::vector<float>>& m, std::vector<std::vector<float>>& v) override {
    take_moments(*eng_, cuda::draft_tensor_sizes(dims()), trainable_index(), m, v);
  }

  std::vector<TttResult> run(const std::vector<Sample>& batch, double weight, bool backward, bool zero_grads,
                             const std::vector<uint64_t>& seeds) override {
    const int64_t H = c_.H;
    int64_t N = 0;
    for (auto& s : batch) N += s.T;
    TALON_CHECK(N >= 1 && N <= max_rows_, "draft on GPU: {} tokens in one batch, the budget is {}", N, max_rows_);
    ids_.resize(size_t(N));
    mask_.resize(size_t(N));
    pos_.resize(size_t(N));
    len_.resize(size_t(N));
    const uint8_t* counts = peagle_ ? peagle_elements(batch, N, backward, seeds) : nullptr;
    // Features already in pinned memory (or on a GPU) upload from there; otherwise they go
    // into the engine's pinned staging first, in pieces of about 1M values copied in parallel
    // (a batch is hundreds of MB at the 8B shape).
    const auto direct = [](const float* p) { return cuda::is_pinned_host(p) || cuda::is_device_memory(p); };
    bool all_direct = true;
    for (auto& s : batch) all_direct = all_direct && direct(s.aux) && direct(s.hidden);
    if (all_direct) {
      int64_t r = 0;
      cuda::DraftBatch b{N, ids_.data(), mask_.data(), nullptr, nullptr, pos_.data(), len_.data(), {}, counts};
      for (auto& s : batch) {
        pack_tokens(s, r);
        b.parts.push_back({s.aux, s.hidden, s.T});
        r += s.T;
      }
      return finish(batch, N, weight, backward, zero_grads, eng_->prepare(b));
    }
    auto [aux, hid] = eng_->host_features();
    if (!aux) {
      if (!warned_unpinned_) {
        tlog::warn("draft on GPU: could not pin {:.1f} GiB of host memory for batch staging; batches upload from "
                   "pageable memory (slower)", double(max_rows_ * 4 * H) * 4 / double(1 << 30));
        warned_unpinned_ = true;
      }
      aux_.resize(size_t(N * 3 * H));
      hid_.resize(size_t(N * H));
      aux = aux_.data();
      hid = hid_.data();
    }
    struct Piece {
      float* dst;
      const float* src;
      int64_t n;
    };
    std::vector<Piece> pieces;
    const auto split = [&pieces](float* dst, const float* src, int64_t n) {
      constexpr int64_t kPiece = int64_t(1) << 20;
      for (int64_t o = 0; o < n; o += kPiece) pieces.push_back({dst + o, src + o, std::min(kPiece, n - o)});
    };
    int64_t r = 0;
    for (auto& s : batch) {
      pack_tokens(s, r);
      split(aux + r * 3 * H, s.aux, s.T * 3 * H);
      split(hid + r * H, s.hidden, s.T * H);
      r += s.T;
    }
#pragma omp parallel for schedule(dynamic, 4) if (pieces.size() > 8)
    for (size_t i = 0; i < pieces.size(); ++i) std::copy(pieces[i].src, pieces[i].src + pieces[i].n, pieces[i].dst);
    cuda::DraftBatch b{N, ids_.data(), mask_.data(), aux, hid, pos_.data(), len_.data(), {}, counts};
    return finish(batch, N, weight, backward, zero_grads, eng_->prepare(b));
  }

  // Sample s's tokens into rows [r, r + s.T) of the packed token arrays.
  void pack_tokens(const Sample& s, int64_t r) {
    for (int64_t t = 0; t < s.T; ++t) {
      TALON_CHECK(s.ids[t] >= 0 && s.ids[t] < c_.V, "draft: token id {} outside the vocabulary", s.ids[t]);
      ids_[size_t(r + t)] = s.ids[t];
      mask_[size_t(r + t)] = s.mask[t];
      pos_[size_t(r + t)] = int32_t(t);
      len_[size_t(r + t)] = int32_t(s.T);
    }
  }

  // P-EAGLE: each sample's elements (COD-sampled from its seed when training, every chain
  // when evaluating) into cods_, and which of them have a loss as the engine's step-major
  // counts [K * N] (element (a, d) of the sample at rows r.. is step d of row r + a).
  const uint8_t* peagle_elements(const std::vector<Sample>& batch, int64_t N, bool backward,
                                 const std::vector<uint64_t>& seeds) {
    const int64_t K = c_.ttt_steps;
    TALON_CHECK(!backward || seeds.size() == batch.size(), "draft on GPU: P-EAGLE needs one seed per sample ({} for {})",
                seeds.size(), batch.size());
    cods_.resize(batch.size());
    pe_counts_.assign(size_t(K * N), 0);
    int64_t r = 0;
    for (size_t i = 0; i < batch.size(); ++i) {
      const Sample& s = batch[i];
      std::vector<uint8_t> valid(size_t(std::max<int64_t>(s.T - 1, 0)));
      for (int64_t t = 0; t + 1 < s.T; ++t) valid[size_t(t)] = s.mask[t + 1];
      cods_[i] = backward ? peagle::cod_sample(valid, fam_.cod, seeds[i]) : peagle::all_chains(valid, int(K));
      const peagle::CodSample& cod = cods_[i];
      for (int64_t e = 0; e < cod.size(); ++e) {
        const int64_t a = cod.anchor[size_t(e)], d = cod.depth[size_t(e)];
        TALON_CHECK(d >= 0 && d < K && a >= 0 && a + d + 1 < s.T,
                    "draft on GPU: P-EAGLE element (anchor {}, depth {}) outside a sample of {} with {} depths", a, d,
                    s.T, K);
        if (s.mask[a + d + 1]) pe_counts_[size_t(d * N + r + a)] = 1;
      }
      r += s.T;
    }
    return pe_counts_.data();
  }

  // P-EAGLE's results: the loss, per-depth KL (cross-entropy minus the target's entropy) and
  // hits of each sample's counted elements, reduced as peagle::forward does.
  std::vector<TttResult> finish_peagle(const std::vector<Sample>& batch, int64_t N, double weight, bool backward,
                                       bool zero_grads) {
    const int64_t K = c_.ttt_steps;
    std::vector<float> scale(size_t(K * N), 0.f);
    std::vector<int64_t> counted(batch.size(), 0);
    int64_t r = 0;
    for (size_t i = 0; i < batch.size(); ++i) {
      for (int64_t k = 0; k < K; ++k)
        for (int64_t t = 0; t < batch[i].T; ++t) counted[i] += pe_counts_[size_t(k * N + r + t)];
      const float w = float(weight / (double(counted[i]) + peagle::kReductionEps));
      for (int64_t k = 0; k < K; ++k)
        for (int64_t t = 0; t < batch[i].T; ++t)
          if (pe_counts_[size_t(k * N + r + t)]) scale[size_t(k * N + r + t)] = w;
      r += batch[i].T;
    }
    cuda::DraftRowStats st;
    eng_->run(scale, backward, zero_grads, st);
    TALON_CHECK(st.counts == pe_counts_, "draft on GPU: the device's P-EAGLE elements disagree with the host's");
    const std::vector<float>& ent = eng_->target_entropy();
    std::vector<TttResult> out(batch.size());
    r = 0;
    for (size_t i = 0; i < batch.size(); ++i) {
      const peagle::CodSample& cod = cods_[i];
      peagle::Result res;
      res.counted = counted[i];
      res.hits.assign(size_t(K), 0);
      res.total.assign(size_t(K), 0);
      res.kl.assign(size_t(K), 0.0);
      res.outcome.assign(size_t(cod.size()), -1);
      double kl_sum = 0;
      for (int64_t e = 0; e < cod.size(); ++e) {
        const int64_t a = cod.anchor[size_t(e)], d = cod.depth[size_t(e)];
        const size_t j = size_t(d * N + r + a);
        if (!st.counts[j]) continue;
        const double kl = double(st.ce[j]) - double(ent[size_t(r + a + d + 1)]);
        kl_sum += kl;
        res.kl[size_t(d)] += kl;
        res.total[size_t(d)] += 1;
        res.hits[size_t(d)] += st.hit[j];
        res.outcome[size_t(e)] = st.hit[j] ? 1 : 0;
      }
      res.loss = kl_sum / (double(res.counted) + peagle::kReductionEps);
      out[i] = peagle::ttt_view(cod, res, int(K));
      r += batch[i].T;
    }
    return out;
  }

  // The rest of run() once the batch (N rows) is prepared (in_vocab: the engine's answer).
  std::vector<TttResult> finish(const std::vector<Sample>& batch, int64_t N, double weight, bool backward,
                                bool zero_grads, const std::vector<uint8_t>& in_vocab) {
    if (const std::string note = eng_->take_note(); !note.empty())
      tlog::warn("cuda:{}: draft trainer: {}", eng_->device(), note);
    if (peagle_) return finish_peagle(batch, N, weight, backward, zero_grads);
    const int64_t K = c_.ttt_steps;
    // Which rows count at each step, per-sample counts, and each row's weight in the
    // objective: weight * decay^k / n_k(sample), as the CPU reference normalises.
    std::vector<uint8_t> counts(size_t(K * N), 0);
    std::vector<float> scale(size_t(K * N), 0.f);
    std::vector<std::vector<int64_t>> nk(batch.size(), std::vector<int64_t>(size_t(K), 0));
    int64_t r = 0;
    for (size_t i = 0; i < batch.size(); ++i) {
      const Sample& s = batch[i];
      for (int64_t k = 0; k < K; ++k)
        for (int64_t t = 0; t < s.T; ++t) {
          const int64_t tp = t + 1 + k;
          const bool c = tp < s.T && s.mask[tp] && in_vocab[size_t(r + tp)];
          counts[size_t(k * N + r + t)] = c;
          nk[i][size_t(k)] += c;
        }
      for (int64_t k = 0; k < K; ++k) {
        if (nk[i][size_t(k)] == 0) continue;
        // One value for the sample's step (a pow a row cost ~0.15 ms a 2048-row batch, while
        // the device waits for run()).
        const float row_w = float(weight * std::pow(c_.step_decay, double(k)) / double(nk[i][size_t(k)]));
        for (int64_t t = 0; t < s.T; ++t)
          if (counts[size_t(k * N + r + t)]) scale[size_t(k * N + r + t)] = row_w;
      }
      r += s.T;
    }
    cuda::DraftRowStats st;
    eng_->run(scale, backward, zero_grads, st, !defer_);
    std::vector<int64_t> lengths;
    for (const Sample& s : batch) lengths.push_back(s.T);
    if (defer_) {  // run_start(): the results once run_finish() has the statistics
      pending_ = Pending{std::move(lengths), N, std::move(counts)};
      return {};
    }
    return results(lengths, N, counts, st);
  }

  // Per-sample results from the engine's row statistics (the samples' lengths, N rows, the
  // host's counts to check the device's against).
  std::vector<TttResult> results(const std::vector<int64_t>& lengths, int64_t N, const std::vector<uint8_t>& counts,
                                 const cuda::DraftRowStats& st) const {
    TALON_CHECK(st.counts == counts, "draft on GPU: the device's positions that count disagree with the host's");
    const int64_t K = c_.ttt_steps;
    std::vector<TttResult> out(lengths.size());
    int64_t r = 0;
    for (size_t i = 0; i < lengths.size(); ++i) {
      const int64_t T = lengths[i];
      TttResult& res = out[i];
      std::vector<uint8_t> right(size_t(T), 1);
      res.accept_len = 1;
      for (int64_t k = 0; k < K; ++k) {
        StepTally tally;
        for (int64_t t = 0; t < T; ++t) {
          const size_t j = size_t(k * N + r + t);
          tally.add(st.counts[j], st.hit[j], double(st.ce[j]), right[size_t(t)]);
        }
        add_step(res, tally, std::pow(c_.step_decay, double(k)));
      }
      r += T;
    }
    return out;
  }

 public:
  // EAGLE-3's run in halves (P-EAGLE: the default, whole in run_start()).
  void run_start(const std::vector<Sample>& batch, double weight, bool backward, bool zero_grads,
                 const std::vector<uint64_t>& seeds) override {
    TALON_CHECK(!pending_, "draft on GPU: run_start() again before run_finish()");
    if (peagle_) return GpuDraftTrainer::run_start(batch, weight, backward, zero_grads, seeds);
    const RaisedFlag deferring(defer_);
    (void)run(batch, weight, backward, zero_grads, seeds);
  }
  std::vector<TttResult> run_finish() override {
    if (!pending_) return GpuDraftTrainer::run_finish();
    const Pending p = std::move(*pending_);
    pending_.reset();
    cuda::DraftRowStats st;
    eng_->finish_run(st);
    return results(p.lengths, p.N, p.counts, st);
  }
  void clip_grad_norm_start(double max_norm) override { eng_->clip_grad_norm_start(max_norm); }
  double grad_norm() override { return eng_->grad_norm(); }

 private:
  // run_start()'s batch, until run_finish().
  struct Pending {
    std::vector<int64_t> lengths;
    int64_t N = 0;
    std::vector<uint8_t> counts;
  };
  std::optional<Pending> pending_;
  bool defer_ = false;

 public:
  double clip_grad_norm(double max_norm) override { return eng_->clip_grad_norm(max_norm); }
  void adamw_step(const train::OptimConfig& c, int64_t t_before) override {
    eng_->adamw(train::lr_at(c, t_before), c.beta1, c.beta2, c.eps, c.weight_decay, decay_, t_before + 1);
  }
  void zero_grads() override { eng_->zero_grads(); }
  std::vector<std::pair<std::string, double>> profile() const override { return eng_->profile(); }
  float* grad_data() override { return eng_->grad_data(); }
  int64_t grad_elems() const override { return eng_->grad_elems(); }
  cudaStream_t stream() const override { return eng_->stream(); }
  int64_t max_rows() const override { return max_rows_; }
  size_t device_bytes() const override { return eng_->device_bytes(); }
  int64_t row_steps() const override { return eng_->row_steps(); }
  double product_flops() const override { return eng_->product_flops(); }
  int64_t cudnn_batches() const override { return eng_->cudnn_batches(); }
  ProductPlans product_plans() const override { return eng_->product_plans(); }

 private:
  cuda::DraftDims dims() const {
    cuda::DraftDims d;
    d.H = c_.H;
    d.I = c_.I;
    d.nh = c_.n_heads;
    d.nkv = c_.n_kv_heads;
    d.hd = c_.head_dim;
    d.V = c_.V;
    d.Vd = c_.Vd;
    d.eps = float(c_.rms_eps);
    d.K = c_.ttt_steps;
    d.norm_before_residual = c_.norm_before_residual;
    d.peagle = peagle_;
    d.mask_token = fam_.mask_token;
    return d;
  }
  // Engine tensor index of each trainable() entry.
  std::vector<size_t> trainable_index() const {
    std::vector<size_t> ix;
    for (size_t i = 0; i < names_.size(); ++i)
      if (!(peagle_ && names_[i] == "lm_head")) ix.push_back(i);
    return ix;
  }
  void resize(DraftWeights& w) const {
    const auto sizes = cuda::draft_tensor_sizes(dims());
    auto nw = w.named();
    for (size_t i = 0; i < nw.size(); ++i) nw[i].second->resize(size_t(sizes[i]));
  }
  void check_sizes(DraftWeights& w) const {
    const auto sizes = cuda::draft_tensor_sizes(dims());
    auto nw = w.named();
    for (size_t i = 0; i < nw.size(); ++i)
      TALON_CHECK(int64_t(nw[i].second->size()) == sizes[i], "draft weight {}: {} values, expected {}", nw[i].first,
                  nw[i].second->size(), sizes[i]);
  }

  DraftConfig c_;
  int64_t max_rows_;
  GpuFamily fam_;
  bool peagle_;
  std::unique_ptr<cuda::DraftEngine> eng_;
  std::vector<std::string> names_;  // the engine's tensors, in its order
  std::vector<uint8_t> decay_;
  std::vector<peagle::CodSample> cods_;  // P-EAGLE: the elements of the batch's samples
  std::vector<uint8_t> pe_counts_;       // and which have a loss, [K * N]
  std::vector<int32_t> ids_, pos_, len_;
  std::vector<uint8_t> mask_;
  std::vector<float> aux_, hid_;  // staging when the engine's pinned buffers are unavailable
  bool warned_unpinned_ = false;
};


// DFlash on one GPU (dflash_engine.h). The host draws each sample's anchors, lays out the
// blocks, and computes the per-row loss weights from the forward's per-row losses (D-PACE
// reads them), then runs the backward; results and reductions as dflash::forward.
class CudaDFlashTrainer final : public DeviceTrainer {
 public:
  struct Piece {  // a sample's anchors [b0, b1) in one engine call
    size_t i;
    int64_t b0, b1;
  };
  CudaDFlashTrainer(const TargetHead& tgt, const DraftVocab& vocab, int device, GpuMath math, int64_t max_rows,
                    const GpuFamily& fam)
      : c_(fam.dflash), max_rows_(max_rows), mask_token_(fam.mask_token), max_anchors_(fam.max_anchors) {
    TALON_CHECK(int64_t(vocab.kept.size()) == c_.Vd && int64_t(vocab.t2d.size()) == c_.V,
                "draft vocabulary has {} of {} ids, the DFlash draft {} of {}", vocab.kept.size(), vocab.t2d.size(),
                c_.Vd, c_.V);
    TALON_CHECK(mask_token_ >= 0 && mask_token_ < c_.V, "draft on GPU: DFlash's mask token {} is outside the "
                "vocabulary of {}", mask_token_, c_.V);
    TALON_CHECK(max_anchors_ >= 1, "draft on GPU: DFlash needs at least one anchor a sample, got {}", max_anchors_);
    TALON_CHECK(max_rows >= c_.block, "draft on GPU: a batch budget of {} tokens cannot hold a block of {}",
                max_rows, c_.block);
    d_.H = c_.H, d_.I = c_.I, d_.nh = c_.n_heads, d_.nkv = c_.n_kv_heads, d_.hd = c_.head_dim, d_.V = c_.V,
    d_.Vd = c_.Vd;
    d_.layers = c_.layers, d_.n_aux = c_.n_aux, d_.block = c_.block;
    d_.eps = float(c_.rms_eps);
    d_.target_eps = float(tgt.rms_eps);
    d_.ce = c_.loss == dflash::Config::Loss::CE;
    TALON_CHECK(tgt.embed && tgt.final_norm && tgt.lm_head, "draft on GPU: DFlash reads the target's embedding, "
                "final norm and lm_head");
    const auto m = math == GpuMath::F32 ? cuda::DraftMath::F32
                   : math == GpuMath::TF32 ? cuda::DraftMath::TF32
                                           : cuda::DraftMath::BF16;
    const std::vector<float> inv = rope_inv_freq(c_.rope, c_.head_dim);
    eng_ = std::make_unique<cuda::DFlashEngine>(device, d_, m, tgt.embed, tgt.final_norm, tgt.lm_head,
                                                vocab.kept.data(), inv.data(), max_rows, max_rows);
    names_ = cuda::dflash_tensor_names(d_);
    sizes_ = cuda::dflash_tensor_sizes(d_);
    for (auto& n : names_)  // as the CPU family: no decay on norms
      decay_.push_back(n != "lm_head" && n.find("norm") == std::string::npos && n.find("_ln") == std::string::npos);
  }

  void set_tensors(const Named& w) override { eng_->set_weights(named_pointers(w, names_, sizes_)); }
  void get_tensors(const NamedOut& w) override {
    fetch_named(w, names_, sizes_, [&](const std::vector<float*>& p) { eng_->get_weights(p); });
  }
  void get_tensor_grads(const NamedOut& g) override {
    fetch_named(g, names_, sizes_, [&](const std::vector<float*>& p) { eng_->get_grads(p); });
  }
  std::vector<std::string> trainable() const override {
    return std::vector<std::string>(names_.begin(), names_.end() - 1);  // the lm_head (last) is frozen
  }
  std::vector<size_t> trainable_index() const {
    std::vector<size_t> ix(names_.size() - 1);
    for (size_t i = 0; i < ix.size(); ++i) ix[i] = i;
    return ix;
  }
  void set_weights(DraftWeights&) override { fail("draft on GPU: a DFlash draft's tensors go through set_tensors"); }
  void get_weights(DraftWeights&) override { fail("draft on GPU: a DFlash draft's tensors come through get_tensors"); }
  void get_grads(DraftGrads&) override { fail("draft on GPU: a DFlash draft's gradients come through get_tensor_grads"); }
  void set_moments(const std::vector<std::vector<float>>& m, const std::vector<std::vector<float>>& v) override {
    put_moments(*eng_, names_, sizes_, trainable_index(), m, v);
  }
  void get_moments(std::vector<std::vector<float>>& m, std::vector<std::vector<float>>& v) override {
    take_moments(*eng_, sizes_, trainable_index(), m, v);
  }

  std::vector<TttResult> run(const std::vector<Sample>& batch, double weight, bool backward, bool zero_grads,
                             const std::vector<uint64_t>& seeds) override {
    const int64_t B = c_.block;
    TALON_CHECK(!backward || seeds.size() == batch.size(), "draft on GPU: DFlash needs one seed per sample ({} for {})",
                seeds.size(), batch.size());
    // Anchors and counted slots per sample; the loss of sample i is divided by its counted
    // slots + 1e-5 (speculators' reduction), whichever pass its blocks run in.
    std::vector<std::vector<int64_t>> anchors(batch.size());
    std::vector<int64_t> counted(batch.size(), 0);
    for (size_t i = 0; i < batch.size(); ++i) {
      const Sample& s = batch[i];
      TALON_CHECK(s.T <= max_rows_, "draft on GPU: a sample of {} tokens, the budget is {}", s.T, max_rows_);
      anchors[i] = dflash::select_anchors(s.mask, s.T, B, backward ? max_anchors_ : s.T, backward ? seeds[i] : 0);
      for (int64_t a : anchors[i])
        for (int64_t k = 1; k < B; ++k) counted[i] += s.mask[a + k] ? 1 : 0;
    }
    std::vector<dflash::Result> res(batch.size());
    for (auto& r : res) {
      r.counted = 0;
      r.hits.assign(size_t(B), 0);
      r.total.assign(size_t(B), 0);
      r.cond_hits.assign(size_t(B), 0);
      r.cond_total.assign(size_t(B), 0);
      r.loss_sum.assign(size_t(B), 0.0);
    }
    // Passes: samples in order, each sample's blocks in order, as many as the buffers hold
    // (max_rows context rows, max_rows block rows); a sample with more blocks than one pass
    // holds continues in the next.
    const int64_t per_pass = std::max<int64_t>(1, max_rows_ / B);
    std::vector<Piece> pass;
    int64_t ctx = 0, blocks = 0;
    bool first = true;
    const auto flush = [&] {
      if (pass.empty()) return;
      run_pass(batch, pass, anchors, counted, weight, backward, zero_grads && first, res);
      first = false;
      pass.clear();
      ctx = blocks = 0;
    };
    for (size_t i = 0; i < batch.size(); ++i) {
      int64_t b = 0;
      const int64_t nA = int64_t(anchors[i].size());
      while (b < nA) {
        if (ctx + batch[i].T > max_rows_ || blocks >= per_pass) flush();
        const int64_t take = std::min(nA - b, per_pass - blocks);
        pass.push_back({i, b, b + take});
        ctx += batch[i].T;
        blocks += take;
        b += take;
      }
    }
    flush();
    if (first && backward && zero_grads) eng_->zero_grads();  // no block anywhere: a zero gradient
    std::vector<TttResult> out(batch.size());
    for (size_t i = 0; i < batch.size(); ++i) {
      dflash::Result& r = res[i];
      r.counted = counted[i];
      r.loss /= double(counted[i]) + peagle::kReductionEps;
      out[i] = dflash::ttt_view(r, B);
    }
    return out;
  }

  double clip_grad_norm(double max_norm) override { return eng_->clip_grad_norm(max_norm); }
  void adamw_step(const train::OptimConfig& c, int64_t t_before) override {
    eng_->adamw(train::lr_at(c, t_before), c.beta1, c.beta2, c.eps, c.weight_decay, decay_, t_before + 1);
  }
  void zero_grads() override { eng_->zero_grads(); }
  std::vector<std::pair<std::string, double>> profile() const override { return {}; }
  int64_t max_rows() const override { return max_rows_; }
  size_t device_bytes() const override { return eng_->device_bytes(); }
  float* grad_data() override { return eng_->grad_data(); }
  int64_t grad_elems() const override { return eng_->grad_elems(); }
  cudaStream_t stream() const override { return eng_->stream(); }

 private:
  // One engine call over the pieces of `pass`: forward, the per-row weights, the results; with
  // backward, the gradient of weight * sum_i loss_i over these blocks (zeroed first with zero).
  void run_pass(const std::vector<Sample>& batch, const std::vector<Piece>& pass,
                const std::vector<std::vector<int64_t>>& anchors, const std::vector<int64_t>& counted, double weight,
                bool backward, bool zero, std::vector<dflash::Result>& res) {
    const int64_t B = c_.block;
    cuda::DFlashBatch b;
    ctx_pos_.clear();
    bctx0_.clear();
    banchor_.clear();
    bend_.clear();
    tok_.clear();
    trow_.clear();
    // Each sample's rows once, where its first piece of this pass puts them.
    std::vector<int64_t> at(batch.size(), -1);
    for (const Piece& p : pass) {
      const Sample& s = batch[p.i];
      if (at[p.i] < 0) {
        at[p.i] = b.ctx_rows;
        b.parts.push_back({s.aux, s.hidden, s.T});
        for (int64_t t = 0; t < s.T; ++t) ctx_pos_.push_back(int32_t(t));
        b.ctx_rows += s.T;
      }
      const int64_t c0 = at[p.i];
      for (int64_t j = p.b0; j < p.b1; ++j) {
        const int64_t a = anchors[p.i][size_t(j)];
        bctx0_.push_back(int32_t(c0));
        banchor_.push_back(int32_t(a));
        bend_.push_back(int32_t(c0 + s.T));
        for (int64_t k = 0; k < B; ++k) {
          TALON_CHECK(k > 0 || (s.ids[a] >= 0 && s.ids[a] < c_.V), "draft: token id {} outside the vocabulary",
                      s.ids[a]);
          tok_.push_back(k == 0 ? s.ids[a] : mask_token_);
          trow_.push_back(k > 0 && s.mask[a + k] ? int32_t(c0 + a + k - 1) : -1);
        }
      }
    }
    b.ctx_pos = ctx_pos_.data();
    b.blocks = int64_t(bctx0_.size());
    b.blk_ctx0 = bctx0_.data();
    b.blk_anchor = banchor_.data();
    b.blk_ctx_end = bend_.data();
    b.tok = tok_.data();
    b.trow = trow_.data();
    cuda::DFlashRowStats st;
    eng_->forward(b, st);
    // Per-row weights (dflash::forward's): fixed-exp-decay exp(-(k-1)/gamma), or D-PACE from the
    // rows' losses; the results per slot.
    std::vector<float> scale(size_t(b.blocks * B), 0.f);
    int64_t j = 0;
    for (const Piece& p : pass) {
      const double denom = double(counted[p.i]) + peagle::kReductionEps;
      dflash::Result& r = res[p.i];
      for (int64_t q = p.b0; q < p.b1; ++q, ++j) {
        const size_t n0 = size_t(j * B);
        std::vector<double> wt(size_t(B), 0.0);
        if (c_.weighting == dflash::Config::Weighting::ExpDecay) {
          for (int64_t k = 1; k < B; ++k) wt[size_t(k)] = std::exp(-double(k - 1) / c_.gamma);
        } else {
          std::vector<double> prefix(static_cast<size_t>(B));
          double run = 1;
          for (int64_t k = 0; k < B; ++k) {
            const bool cnt = trow_[n0 + size_t(k)] >= 0;
            run *= cnt ? (1.0 - c_.dpace_alpha) * std::exp(-double(st.loss[n0 + size_t(k)])) + c_.dpace_alpha : 1.0;
            prefix[size_t(k)] = run;
          }
          double suffix = 0;
          for (int64_t k = B - 1; k >= 0; --k) {
            const bool cnt = trow_[n0 + size_t(k)] >= 0;
            if (cnt) suffix += prefix[size_t(k)];
            wt[size_t(k)] = cnt ? suffix : 0.0;
          }
        }
        bool right = true;
        for (int64_t k = 1; k < B; ++k) {
          const size_t n = n0 + size_t(k);
          const bool cnt = trow_[n] >= 0, hit = cnt && st.hit[n];
          if (cnt) {
            const double el = double(st.loss[n]);
            r.total[size_t(k)] += 1;
            r.hits[size_t(k)] += hit;
            r.loss_sum[size_t(k)] += el;
            r.loss += wt[size_t(k)] * el;
            scale[n] = float(weight * wt[size_t(k)] / denom);
            if (right) {
              r.cond_total[size_t(k)] += 1;
              r.cond_hits[size_t(k)] += hit;
            }
          }
          right = right && hit;
        }
      }
    }
    if (backward) eng_->backward(scale, zero);
  }

  dflash::Config c_;
  cuda::DFlashDims d_;
  int64_t max_rows_;
  int32_t mask_token_;
  int64_t max_anchors_;
  std::unique_ptr<cuda::DFlashEngine> eng_;
  std::vector<std::string> names_;
  std::vector<int64_t> sizes_;
  std::vector<uint8_t> decay_;
  std::vector<int32_t> ctx_pos_, bctx0_, banchor_, bend_, tok_, trow_;  // one pass's layout
};

// One GPU's trainer for the family.
std::unique_ptr<DeviceTrainer> make_one(const DraftConfig& c, const TargetHead& tgt, const DraftVocab& vocab,
                                        int device, GpuMath math, int64_t max_rows, const GpuDraftOptions& opt,
                                        const GpuFamily& fam) {
  if (fam.drafter == "dflash") {
    // DFlash's engine has its own attention and embedding table.
    TALON_CHECK(!opt.batch_embeddings, "--gpu-batch-embeddings: not for DFlash (EAGLE-3 only)");
    TALON_CHECK(opt.attention != "cudnn", "--gpu-attention cudnn: not for DFlash (EAGLE-3 and P-EAGLE)");
    return std::make_unique<CudaDFlashTrainer>(tgt, vocab, device, math, max_rows, fam);
  }
  return std::make_unique<CudaDraftTrainer>(c, tgt, vocab, device, math, max_rows, opt, fam);
}

#if TALON_HAVE_NCCL_H
// Data parallel over several GPUs in this process: one CudaDraftTrainer per GPU, each
// call fanned out to one thread per GPU.
class DataParallelDraftTrainer final : public GpuDraftTrainer {
 public:
  DataParallelDraftTrainer(const DraftConfig& c, const TargetHead& tgt, const DraftVocab& vocab,
                           const std::vector<int>& devices, GpuMath math, int64_t max_rows, const GpuGroup& group,
                           const GpuDraftOptions& opt, const GpuFamily& fam)
      : devices_(devices) {
    const Nccl& nc = Nccl::get();
    const int n = int(devices.size());
    ranks_.resize(size_t(n));
    comms_.resize(size_t(n));
    each([&](int r) { ranks_[size_t(r)] = make_one(c, tgt, vocab, devices_[size_t(r)], math, max_rows, opt, fam); });
    if (group.size == 0) {
      nc.check(nc.comm_init_all(comms_.data(), n, devices_.data()), "ncclCommInitAll");
      return;
    }
    // Across processes: this process's GPUs are global ranks first_rank.. of group.size.
    TALON_CHECK(group.nccl_id.size() == sizeof(ncclUniqueId), "data parallel: an NCCL id of {} bytes, expected {}",
                group.nccl_id.size(), sizeof(ncclUniqueId));
    ncclUniqueId id;
    std::memcpy(&id, group.nccl_id.data(), sizeof id);
    nc.check(nc.group_start(), "ncclGroupStart");
    for (int r = 0; r < n; ++r) {
      CUDA_CHECK(cudaSetDevice(devices_[size_t(r)]));
      nc.check(nc.comm_init_rank(&comms_[size_t(r)], group.size, id, group.first_rank + r), "ncclCommInitRank");
    }
    nc.check(nc.group_end(), "ncclGroupEnd (joining the job's GPUs)");
  }
  ~DataParallelDraftTrainer() override {
    for (auto c : comms_)
      if (c) Nccl::get().comm_destroy(c);
  }

  void set_weights(DraftWeights& w) override {
    each([&](int r) { ranks_[size_t(r)]->set_weights(w); });
  }
  void set_tensors(const Named& w) override {
    each([&](int r) { ranks_[size_t(r)]->set_tensors(w); });
  }
  void get_tensors(const NamedOut& w) override { ranks_[0]->get_tensors(w); }
  void get_tensor_grads(const NamedOut& g) override { ranks_[0]->get_tensor_grads(g); }
  std::vector<std::string> trainable() const override { return ranks_[0]->trainable(); }
  void get_weights(DraftWeights& w) override { ranks_[0]->get_weights(w); }
  void get_grads(DraftGrads& g) override { ranks_[0]->get_grads(g); }
  void set_moments(const std::vector<std::vector<float>>& m, const std::vector<std::vector<float>>& v) override {
    each([&](int r) { ranks_[size_t(r)]->set_moments(m, v); });
  }
  void get_moments(std::vector<std::vector<float>>& m, std::vector<std::vector<float>>& v) override {
    ranks_[0]->get_moments(m, v);
  }
  std::vector<TttResult> run(const std::vector<Sample>& batch, double weight, bool backward, bool zero_grads,
                             const std::vector<uint64_t>& seeds) override {
    const size_t n = ranks_.size();
    std::vector<std::vector<Sample>> part(n);
    std::vector<std::vector<uint64_t>> part_seeds(n);
    for (size_t i = 0; i < batch.size(); ++i) {
      part[i % n].push_back(batch[i]);
      if (i < seeds.size()) part_seeds[i % n].push_back(seeds[i]);
    }
    std::vector<std::vector<TttResult>> res(n);
    each([&](int r) {
      DeviceTrainer& e = *ranks_[size_t(r)];
      if (!part[size_t(r)].empty()) {
        if (starting_)
          e.run_start(part[size_t(r)], weight, backward, zero_grads, part_seeds[size_t(r)]);
        else
          res[size_t(r)] = e.run(part[size_t(r)], weight, backward, zero_grads, part_seeds[size_t(r)]);
      } else if (backward && zero_grads) {
        e.zero_grads();
      }
    });
    if (starting_) {
      started_parts_.clear();
      for (auto& p : part) started_parts_.push_back(p.size());
      started_n_ = batch.size();
      return {};
    }
    return interleave(res, batch.size());
  }
  // Sample i went to GPU i mod n: back in the batch's order.
  std::vector<TttResult> interleave(std::vector<std::vector<TttResult>>& res, size_t count) const {
    const size_t n = ranks_.size();
    std::vector<TttResult> out(count);
    for (size_t i = 0; i < count; ++i) out[i] = std::move(res[i % n][i / n]);
    return out;
  }
  void run_start(const std::vector<Sample>& batch, double weight, bool backward, bool zero_grads,
                 const std::vector<uint64_t>& seeds) override {
    TALON_CHECK(started_n_ == 0, "data parallel: run_start() again before run_finish()");
    const RaisedFlag starting(starting_);
    (void)run(batch, weight, backward, zero_grads, seeds);
  }
  std::vector<TttResult> run_finish() override {
    TALON_CHECK(started_n_ > 0 && started_parts_.size() == ranks_.size(),
                "data parallel: run_finish() with no run_start() before it");
    std::vector<std::vector<TttResult>> res(ranks_.size());
    each([&](int r) {
      if (started_parts_[size_t(r)] > 0) res[size_t(r)] = ranks_[size_t(r)]->run_finish();
    });
    const size_t count = started_n_;
    started_n_ = 0;
    return interleave(res, count);
  }
  // The gradients summed over every GPU (NCCL), then each GPU's norm and factor (the same
  // sums, so the same bits).
  void clip_grad_norm_start(double max_norm) override {
    each([&](int r) {
      DeviceTrainer& e = *ranks_[size_t(r)];
      const Nccl& x = Nccl::get();
      x.check(x.all_reduce(e.grad_data(), e.grad_data(), size_t(e.grad_elems()), ncclFloat32, ncclSum,
                           comms_[size_t(r)], e.stream()),
              "all-reduce of the gradients");
      e.clip_grad_norm_start(max_norm);
    });
  }
  double grad_norm() override {
    std::vector<double> norms(ranks_.size());
    each([&](int r) { norms[size_t(r)] = ranks_[size_t(r)]->grad_norm(); });
    for (double v : norms)
      TALON_CHECK(v == norms[0], "data parallel: the GPUs disagree on the gradient norm ({} vs {})", v, norms[0]);
    return norms[0];
  }
  double clip_grad_norm(double max_norm) override {
    clip_grad_norm_start(max_norm);
    return grad_norm();
  }
  void adamw_step(const train::OptimConfig& c, int64_t t_before) override {
    each([&](int r) { ranks_[size_t(r)]->adamw_step(c, t_before); });
  }
  void zero_grads() override {
    each([&](int r) { ranks_[size_t(r)]->zero_grads(); });
  }
  int64_t max_rows() const override { return ranks_[0]->max_rows(); }
  std::vector<std::pair<std::string, double>> profile() const override { return ranks_[0]->profile(); }
  size_t device_bytes() const override { return ranks_[0]->device_bytes(); }
  ProductPlans product_plans() const override { return ranks_[0]->product_plans(); }
  int64_t row_steps() const override {
    int64_t n = 0;
    for (const auto& r : ranks_) n += r->row_steps();
    return n;
  }
  int64_t cudnn_batches() const override {
    int64_t n = 0;
    for (const auto& r : ranks_) n += r->cudnn_batches();
    return n;
  }
  double product_flops() const override {
    double f = 0;
    for (const auto& r : ranks_) f += r->product_flops();
    return f;
  }

 private:
  // f(rank) on one thread per GPU, all at once; the first error is rethrown.
  template <class F>
  void each(F&& f) {
    run_threads(int(devices_.size()), [&](int r) {
      set_thread_log_tag(fmt::format("gpu {}", devices_[size_t(r)]));
      CUDA_CHECK(cudaSetDevice(devices_[size_t(r)]));
      f(r);
    });
  }

  std::vector<int> devices_;
  std::vector<std::unique_ptr<DeviceTrainer>> ranks_;
  std::vector<ncclComm_t> comms_;
  // run_start(): run() starts each GPU's part; run_finish() collects them (started_parts_:
  // samples a GPU; started_n_: the batch's, 0 when nothing is started).
  bool starting_ = false;
  std::vector<size_t> started_parts_;
  size_t started_n_ = 0;
};
#endif

}  // namespace

#if TALON_HAVE_NCCL_H
// Host collectives over NCCL: one rank per process, bytes staged through device memory.
class NcclProcessGroup final : public ProcessGroup {
 public:
  NcclProcessGroup(const RankInfo& ri, int device, const fs::path& dir)
      : ProcessGroup(ri.rank, ri.world), device_(device) {
    const Nccl& nc = Nccl::get();
    const std::string id_bytes =
        exchange_id_file(dir, "nccl", ri, ri.rank == 0 ? nccl_unique_id() : std::string(sizeof(ncclUniqueId), '\0'));
    ncclUniqueId id;
    std::memcpy(&id, id_bytes.data(), sizeof id);
    CUDA_CHECK(cudaSetDevice(device_));
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    nc.check(nc.comm_init_rank(&comm_, world_, id, rank_), "ncclCommInitRank (the processes' host group)");
    barrier();
    if (rank_ == 0) remove_id_file(dir, "nccl");
  }
  ~NcclProcessGroup() override {
    if (comm_) Nccl::get().comm_destroy(comm_);
    if (buf_) cudaFree(buf_);
    if (stream_) cudaStreamDestroy(stream_);
  }
  std::vector<std::string> allgather(const std::string& mine) override {
    const Nccl& nc = Nccl::get();
    CUDA_CHECK(cudaSetDevice(device_));
    std::vector<uint64_t> sizes(static_cast<size_t>(world_));
    uint64_t n = mine.size();
    reserve(size_t(world_ + 1) * 8);
    CUDA_CHECK(cudaMemcpyAsync(buf_, &n, 8, cudaMemcpyHostToDevice, stream_));
    nc.check(nc.all_gather(buf_, buf_ + 8, 8, ncclUint8, comm_, stream_), "ncclAllGather (sizes)");
    CUDA_CHECK(cudaMemcpyAsync(sizes.data(), buf_ + 8, size_t(world_) * 8, cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    uint64_t most = 0;
    for (auto z : sizes) most = std::max(most, z);
    reserve(size_t(most) * size_t(world_ + 1));
    if (most > 0) {
      CUDA_CHECK(cudaMemcpyAsync(buf_, mine.data(), mine.size(), cudaMemcpyHostToDevice, stream_));
      nc.check(nc.all_gather(buf_, buf_ + most, size_t(most), ncclUint8, comm_, stream_), "ncclAllGather");
    }
    std::vector<std::string> all(static_cast<size_t>(world_));
    for (int r = 0; r < world_; ++r) {
      all[size_t(r)].resize(size_t(sizes[size_t(r)]));
      if (sizes[size_t(r)] > 0)
        CUDA_CHECK(cudaMemcpyAsync(all[size_t(r)].data(), buf_ + most * uint64_t(r + 1), size_t(sizes[size_t(r)]),
                                   cudaMemcpyDeviceToHost, stream_));
    }
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    return all;
  }
  void broadcast(std::string& data, int root) override {
    const Nccl& nc = Nccl::get();
    CUDA_CHECK(cudaSetDevice(device_));
    uint64_t n = data.size();
    reserve(8);
    CUDA_CHECK(cudaMemcpyAsync(buf_, &n, 8, cudaMemcpyHostToDevice, stream_));
    nc.check(nc.broadcast(buf_, buf_, 8, ncclUint8, root, comm_, stream_), "ncclBroadcast (size)");
    CUDA_CHECK(cudaMemcpyAsync(&n, buf_, 8, cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (rank_ != root) data.resize(size_t(n));
    if (n == 0) return;
    reserve(size_t(n));
    CUDA_CHECK(cudaMemcpyAsync(buf_, data.data(), size_t(n), cudaMemcpyHostToDevice, stream_));
    nc.check(nc.broadcast(buf_, buf_, size_t(n), ncclUint8, root, comm_, stream_), "ncclBroadcast");
    CUDA_CHECK(cudaMemcpyAsync(data.data(), buf_, size_t(n), cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void barrier() override { (void)allgather(std::string()); }
  [[noreturn]] void abort(int code) override {
    spdlog::default_logger()->flush();
    if (comm_) Nccl::get().comm_abort(comm_);
    std::_Exit(code);
  }
  std::string kind() const override { return "NCCL"; }

 private:
  void reserve(size_t n) {
    if (n <= cap_) return;
    if (buf_) CUDA_CHECK(cudaFree(buf_));
    buf_ = nullptr;
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&buf_), n));
    cap_ = n;
  }
  int device_;
  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;
  uint8_t* buf_ = nullptr;
  size_t cap_ = 0;
};
#endif

std::string nccl_unique_id() {
#if TALON_HAVE_NCCL_H
  const Nccl& nc = Nccl::get();
  ncclUniqueId id;
  nc.check(nc.get_unique_id(&id), "ncclGetUniqueId");
  return std::string(reinterpret_cast<const char*>(&id), sizeof id);
#else
  fail("training on GPUs across processes needs NCCL, and this build found no nccl.h (set TALON_NCCL_DIR)");
#endif
}

std::unique_ptr<ProcessGroup> nccl_process_group(const RankInfo& ri, int device, const fs::path& dir) {
#if TALON_HAVE_NCCL_H
  return std::make_unique<NcclProcessGroup>(ri, device, dir);
#else
  (void)ri, (void)device, (void)dir;
  fail("training on GPUs across processes needs NCCL, and this build found no nccl.h (set TALON_NCCL_DIR)");
#endif
}

std::shared_ptr<float[]> host_floats(size_t n, bool pinned) {
  void* p = nullptr;
  if (pinned && n > 0 && cudaHostAlloc(&p, n * sizeof(float), cudaHostAllocPortable) == cudaSuccess)
    return std::shared_ptr<float[]>(static_cast<float*>(p), [](float* q) { cudaFreeHost(q); });
  (void)cudaGetLastError();  // not sticky: ordinary memory instead
  return std::shared_ptr<float[]>(new float[n]);
}

std::unique_ptr<GpuDraftTrainer> make_gpu_draft_trainer(const DraftConfig& c, const TargetHead& tgt,
                                                        const DraftVocab& vocab, const std::vector<int>& devices,
                                                        GpuMath math, int64_t max_rows, const GpuGroup& group,
                                                        const GpuDraftOptions& opt, const GpuFamily& family) {
  TALON_CHECK(!devices.empty(), "draft on GPU: no device given");
  if (devices.size() == 1 && group.size == 0) return make_one(c, tgt, vocab, devices[0], math, max_rows, opt, family);
#if TALON_HAVE_NCCL_H
  return std::make_unique<DataParallelDraftTrainer>(c, tgt, vocab, devices, math, max_rows, group, opt, family);
#else
  fail("training on {} GPUs needs NCCL, and this build found no nccl.h (set TALON_NCCL_DIR)", devices.size());
#endif
}

}  // namespace talon::eagle3
