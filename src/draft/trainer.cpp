#include "draft/trainer.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cmath>
#include <functional>
#include <fstream>
#include <future>
#include <optional>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "backend/backend.h"
#include "data/features.h"
#include "io/safetensors.h"
#include "model/checkpoint.h"
#include "model/deepseek.h"
#include "model/dense.h"
#include "model/model.h"
#include "data/samples.h"
#include "draft/draft_gpu.h"
#include "draft/family.h"
#include "draft/grad_tree.h"
#include "util/dist.h"
#include "util/dtype.h"
#include "util/error.h"
#include "util/log.h"
#include "util/progress.h"
#include "util/runs.h"
#include "util/signals.h"

namespace talon::train {

using json = nlohmann::json;
using namespace talon::eagle3;

namespace {


// splitmix64: a portable generator, so orders and initial weights are the same
// everywhere for a given seed.
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return double(next() >> 11) * 0x1.0p-53; }
  double normal() {  // Box-Muller
    const double u = std::max(uniform(), 1e-300), v = uniform();
    return std::sqrt(-2.0 * std::log(u)) * std::cos(2.0 * 3.141592653589793 * v);
  }
};

std::vector<int64_t> epoch_order(int64_t n, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> o(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) o[size_t(i)] = i;
  Rng r{seed * 1000003ull + uint64_t(epoch) * 7919ull + 1};
  for (int64_t i = n - 1; i > 0; --i) std::swap(o[size_t(i)], o[size_t(r.next() % uint64_t(i + 1))]);
  return o;
}

// One training sample: tokens and loss mask in memory. Its features are read from the
// extract dataset's mapped shard (offline) or made by the online target only for the batch
// that holds it, and dropped after.
struct TrainSample {
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;
  int32_t shard = -1;  // offline: the shard holding the features, and the sample's first row there
  int64_t row = 0;
};

// fp32 features of one sample of a batch: aux [T, 3H], hidden (h[L]) [T, H], in a buffer of
// FeatureSlots.
struct Features {
  float* aux = nullptr;
  float* hidden = nullptr;
};

// Host memory for a batch's features, reused from step to step: slot 0 and 1 alternate
// between this step and the next one (read ahead while this one trains), page-locked when
// training on a GPU so that batches upload from it directly. Slot 2 holds the eval split's
// (all of it at once, so possibly large): ordinary memory, released after each evaluation.
class FeatureSlots {
 public:
  explicit FeatureSlots(bool pinned) : pinned_(pinned) {}
  // The slot's buffer, at least n floats (grown when short; the contents are not kept).
  float* get(int slot, size_t n) {
    const size_t i = size_t(slot);
    if (cap_[i] < n) {
      buf_[i].reset();
      buf_[i] = eagle3::host_floats(n, pinned_ && slot < 2);
      cap_[i] = n;
    }
    return buf_[i].get();
  }
  void release(int slot) {
    buf_[size_t(slot)].reset();
    cap_[size_t(slot)] = 0;
  }

 private:
  bool pinned_;
  std::shared_ptr<float[]> buf_[3];
  size_t cap_[3] = {0, 0, 0};
};

// Each sample's share of one buffer of FeatureSlots: aux then hidden, sample after sample.
std::vector<Features> lay_out(FeatureSlots& slots, int slot, const std::vector<int64_t>& lengths, int64_t H) {
  size_t total = 0;
  for (int64_t T : lengths) total += size_t(T * 4 * H);
  float* p = slots.get(slot, total);
  std::vector<Features> out(lengths.size());
  for (size_t i = 0; i < lengths.size(); ++i) {
    out[i].aux = p;
    out[i].hidden = p + lengths[i] * 3 * H;
    p += lengths[i] * 4 * H;
  }
  return out;
}

std::vector<float> weight_f32(const WeightRef& w) {
  size_t n = 1;
  for (auto d : w.shape) n *= size_t(d);
  std::vector<float> out(n);
  convert_to_f32(w.dtype, w.data, out.data(), n);
  return out;
}

// --device: no GPUs for the CPU, else the GPUs to train on (data parallel when several).
// `cuda` with several processes on this node (torchrun --nproc-per-node, srun with several
// tasks a node): the visible GPUs are split evenly among them by local rank, unless the
// launcher already gave each process its own (fewer visible than processes here).
std::vector<int> parse_train_devices(const std::string& d, const RankInfo& ri) {
  const DeviceSpec spec = parse_device(d);
  if (!spec.cuda) return {};
  if (!spec.devices.empty()) return spec.devices;
  std::vector<int> all;
  for (auto& g : list_gpus()) all.push_back(g.index);
  TALON_CHECK(!all.empty(), "--device {}: no GPU is visible", d);
  if (ri.local_world > 1 && int(all.size()) >= ri.local_world) {
    TALON_CHECK(int(all.size()) % ri.local_world == 0,
                "--device {}: {} GPUs are visible to {} processes on this node; give each the same number (or "
                "name them with --device cuda:a,b per process)",
                d, all.size(), ri.local_world);
    const size_t m = all.size() / size_t(ri.local_world);
    return std::vector<int>(all.begin() + ptrdiff_t(m * size_t(ri.local_rank)),
                            all.begin() + ptrdiff_t(m * size_t(ri.local_rank + 1)));
  }
  return all;
}

// Mean of per-sample results (the batch's metrics).
struct Summary {
  double loss = 0, accept_len = 0;
  std::vector<double> acc, cond_acc;
};
Summary summarize(const std::vector<TttResult>& res, int K) {
  Summary m;
  m.acc.assign(size_t(K), 0.0);
  m.cond_acc.assign(size_t(K), 0.0);
  const double inv = res.empty() ? 0.0 : 1.0 / double(res.size());
  for (auto& r : res) {
    m.loss += r.loss * inv;
    m.accept_len += r.accept_len * inv;
    for (int k = 0; k < K; ++k) {
      m.acc[size_t(k)] += r.acc_k[size_t(k)] * inv;
      m.cond_acc[size_t(k)] += r.cond_acc_k[size_t(k)] * inv;
    }
  }
  return m;
}

// A step's per-sample results and gradient pieces travel between processes as bytes.
void put_result(std::string& s, const TttResult& r) {
  put_pods(s, r.loss_k);
  put_pods(s, r.acc_k);
  put_pods(s, r.cond_acc_k);
  put_pods(s, r.n_k);
  put_pod(s, r.loss);
  put_pod(s, r.accept_len);
}
TttResult get_result(PodReader& in) {
  TttResult r;
  r.loss_k = in.get_vec<double>();
  r.acc_k = in.get_vec<double>();
  r.cond_acc_k = in.get_vec<double>();
  r.n_k = in.get_vec<int64_t>();
  r.loss = in.get<double>();
  r.accept_len = in.get<double>();
  return r;
}
void add_grads(DraftGrads& dst, DraftGrads& src) {
  auto d = dst.named(), s = src.named();
  for (size_t i = 0; i < d.size(); ++i) {
    double* a = d[i].second->data();
    const double* b = s[i].second->data();
    const size_t n = d[i].second->size();
#pragma omp parallel for schedule(static) if (n > (1 << 16))
    for (size_t j = 0; j < n; ++j) a[j] += b[j];
  }
}
void zero_grads(DraftGrads& g) {
  for (auto& [name, v] : g.named()) std::fill(v->begin(), v->end(), 0.0);
}

std::string exact(double x) {
  char b[64];
  std::snprintf(b, sizeof b, "%.17g", x);
  return b;
}

}  // namespace

std::vector<Param> draft_params(DraftWeights& w, DraftGrads& g) {
  auto nw = w.named();
  auto ng = g.named();
  std::vector<Param> ps;
  for (size_t i = 0; i < nw.size(); ++i) ps.push_back({nw[i].first, nw[i].second, ng[i].second, !is_norm_weight(nw[i].first)});
  return ps;
}

namespace {

// One `talon train` run on one process of a job: setup (samples, target head, draft, resume,
// engines), then optimizer steps with evaluations and checkpoints.
class Trainer {
 public:
  Trainer(const TrainOptions& opt, ProcessGroup& pg, const std::vector<int>& gpus)
      : opt_(opt), pg_(pg), gpus_(gpus), gpu_(gpus.empty() ? -1 : gpus[0]), world_(pg.world()), rank_(pg.rank()),
        family_(opt.drafter != "eagle3") {}

  TrainReport run() {
    check_options();
    ckpt_ = open_checkpoint(opt_.model);
    tc_ = &ckpt_->config();
    H_ = tc_->hidden, V_ = tc_->vocab, L_ = tc_->n_layers;
    if (opt_.online) load_prepared(); else load_extracted();
    split_eval();
    load_target_head();
    init_draft();
    resume();
    start_engines();
    return train();
  }

 private:
  // ------------------------------------------------------------------ setup

  void check_options() const {
    if (opt_.threads > 0) omp_set_num_threads(opt_.threads);
    TALON_CHECK(opt_.batch_samples >= 1 && opt_.max_length >= 2 && opt_.epochs >= 1 && opt_.ttt_steps >= 1,
                "train: --batch-samples, --epochs and --ttt-steps must be >= 1 and --max-length >= 2");
    TALON_CHECK(opt_.eval_fraction >= 0 && opt_.eval_fraction < 1, "--eval-fraction {}: expected a value in [0, 1)",
                opt_.eval_fraction);
    TALON_CHECK(opt_.noise >= 0, "--noise {}: expected >= 0", opt_.noise);
    TALON_CHECK(opt_.drafter == "eagle3" || opt_.drafter == "peagle" || opt_.drafter == "dflash",
                "--drafter '{}': expected eagle3, peagle or dflash", opt_.drafter);
    TALON_CHECK(opt_.optim.lr > 0 && std::isfinite(opt_.optim.lr), "--lr {}: expected a positive learning rate",
                opt_.optim.lr);
    TALON_CHECK(opt_.optim.schedule == "cosine" || opt_.optim.schedule == "linear" || opt_.optim.schedule == "constant",
                "--schedule '{}': expected cosine, linear or constant", opt_.optim.schedule);
    TALON_CHECK(opt_.optim.warmup_steps >= 0, "--warmup-steps {}: expected >= 0", opt_.optim.warmup_steps);
    {
      // The run directory must not sit inside the data it reads (a dataset's directory is
      // its own: extract's resume and inspect's checks would meet foreign files).
      const fs::path out = fs::weakly_canonical(opt_.out), data = fs::weakly_canonical(opt_.data);
      const auto [d, o] = std::mismatch(data.begin(), data.end(), out.begin(), out.end());
      TALON_CHECK(d != data.end(), "train: --out {} is inside --data {}; put the run directory elsewhere",
                  opt_.out.string(), opt_.data.string());
    }
    (void)parse_gpu_math(opt_.gpu_math);
    const auto& g = opt_.gpu_engine;
    TALON_CHECK(g.attention == "auto" || g.attention == "flash" || g.attention == "cudnn" || g.attention == "blocks" ||
                    g.attention == "loop",
                "--gpu-attention '{}': expected auto, cudnn, flash, blocks or loop", g.attention);
    TALON_CHECK(!(g.batch_embeddings && g.device_embeddings),
                "--gpu-batch-embeddings and --gpu-device-embeddings: choose one");
    TALON_CHECK(g.logit_rows >= 0, "--gpu-logit-rows {}: expected >= 1 (0: as many as fit)", g.logit_rows);
    TALON_CHECK(g.attn_block >= -1, "--gpu-attn-block {}: expected >= 0 (0: no skipping; -1: default)", g.attn_block);
  }

  // Online: tokens from a prepare dataset; the target runs in-process and makes each batch's
  // features when it is needed. Samples are truncated to --max-length.
  void load_prepared() {
    auto src = open_samples(opt_.data);
    data_sha_ = src->sha256();
    const std::vector<int> aux = opt_.layers.empty() ? default_aux_layers(L_) : parse_layer_ids(opt_.layers, L_);
    TALON_CHECK(aux.size() == 3, "--layers '{}': EAGLE-3 takes exactly 3 aux layers", opt_.layers);
    aux_ids_ = aux;
    final_id_ = L_;
    convention_ = kLayerConvention;
    for (size_t i = 0; i < src->size(); ++i) {
      const talon::Sample& sm = src->at(i);
      const int64_t T = std::min(int64_t(sm.input_ids.size()), opt_.max_length);
      if (T < 2) continue;
      TrainSample ts;
      ts.ids.assign(sm.input_ids.begin(), sm.input_ids.begin() + T);
      ts.mask.assign(sm.loss_mask.begin(), sm.loss_mask.begin() + T);
      for (int32_t id : ts.ids)
        TALON_CHECK(id >= 0 && id < V_, "{}: sample {} (line {}) has token id {}, outside the vocabulary of {} ({})",
                    src->path(), sm.id, sm.line, id, opt_.model.string(), V_);
      all_.push_back(std::move(ts));
    }
    TALON_CHECK(!all_.empty(), "{}: no samples of at least 2 tokens", opt_.data.string());
  }

  // Offline: tokens and features from an extract dataset made by this very target. The
  // shards stay mapped; a batch's features are read from them when it runs (host memory
  // holds tokens and the current batch, not the dataset).
  void load_extracted() {
    TALON_CHECK(opt_.layers.empty(), "--layers applies to --online training; an extract dataset has its layers");
    const json man = read_manifest(opt_.data);
    TALON_CHECK(man.value("status", "") == "complete",
                "{}: the extraction is not complete (status {}); finish it first", opt_.data.string(),
                man.value("status", json()).dump());
    TALON_CHECK(man.value("model_config_sha256", "") == tc_->hash(),
                "{}: features were extracted from a model with config sha256 {}, but --model {} has {}; train with "
                "the target that made them",
                opt_.data.string(), man.value("model_config_sha256", ""), opt_.model.string(), tc_->hash());
    TALON_CHECK(man.value("hidden_size", int64_t(0)) == H_, "{}: hidden_size {} but the model has {}",
                opt_.data.string(), man.value("hidden_size", int64_t(0)), H_);
    aux_ids_ = man.at("aux_layer_ids");
    final_id_ = man.at("final_layer_id");
    convention_ = man.at("convention");
    const std::string man_text = read_text_file(opt_.data / kManifestName);
    data_sha_ = sha256_hex(man_text.data(), man_text.size());
    // Every shard is checked against the manifest (size, SHA-256, tensor shapes, offsets)
    // before any of it is used.
    {
      const DatasetCheck chk = check_dataset(opt_.data, /*checksums=*/true);
      if (!chk.ok)
        fail("{}: the dataset does not verify: {}", opt_.data.string(), fmt::format("{}", fmt::join(chk.problems, "; ")));
    }
    const int64_t H = H_, V = V_;
    size_t shard_i = 0;
    for (auto& s : man.at("shards")) {
      shards_.push_back(std::make_unique<st::File>(shard_path(opt_.data, s, shard_i++)));
      const st::File& f = *shards_.back();
      const auto& aux = f.get(shard_tensors::aux_hidden);
      const auto& hid = f.get(shard_tensors::hidden);
      feat_views_.push_back({&aux, &hid});
      const auto& ids = f.get(shard_tensors::input_ids);
      const auto& mask = f.get(shard_tensors::loss_mask);
      const auto& off = f.get(shard_tensors::sample_offsets);
      // Tensors in a shard need not be aligned for their type (a U8 tensor precedes): copy.
      std::vector<int64_t> o(static_cast<size_t>(off.numel()));
      std::memcpy(o.data(), off.data, off.nbytes);
      for (int64_t i = 0; i + 1 < off.numel(); ++i) {
        const int64_t a = o[size_t(i)], T = std::min(o[size_t(i + 1)] - o[size_t(i)], opt_.max_length);
        if (T < 2) continue;
        TrainSample ts;
        ts.ids.resize(size_t(T));
        std::memcpy(ts.ids.data(), ids.data + size_t(a) * 4, size_t(T) * 4);
        ts.mask.assign(mask.data + a, mask.data + a + T);
        if (a < 0 || (a + T) * 3 * H > aux.numel() || (a + T) * H > hid.numel())
          fail("{}: sample {} (rows {}..{}) lies outside tensors '{}' / '{}' of {} / {} values", f.path().string(), i,
               a, a + T, shard_tensors::aux_hidden, shard_tensors::hidden, aux.numel(), hid.numel());
        ts.shard = int32_t(shards_.size() - 1);
        ts.row = a;
        for (int64_t t = 0; t < T; ++t)
          if (ts.ids[size_t(t)] < 0 || ts.ids[size_t(t)] >= V)
            fail("{}: tensor '{}': token id {} at position {} is outside the target vocabulary of {}",
                 f.path().string(), shard_tensors::input_ids, ts.ids[size_t(t)], a + t, V);
        all_.push_back(std::move(ts));
      }
    }
    TALON_CHECK(!all_.empty(), "{}: no samples of at least 2 tokens", opt_.data.string());
  }

  // The held-back evaluation split: a seeded choice of samples, never trained on.
  void split_eval() {
    int64_t n_eval = int64_t(std::llround(opt_.eval_fraction * double(all_.size())));
    if (opt_.eval_fraction > 0 && all_.size() >= 2) n_eval = std::clamp<int64_t>(n_eval, 1, int64_t(all_.size()) - 1);
    else n_eval = 0;
    const auto pick = epoch_order(int64_t(all_.size()), opt_.seed ^ 0x5eed5eedull, -1);
    std::vector<uint8_t> is_eval(all_.size(), 0);
    for (int64_t i = 0; i < n_eval; ++i) is_eval[size_t(pick[size_t(i)])] = 1;
    for (size_t i = 0; i < all_.size(); ++i) (is_eval[i] ? eval_ : samples_).push_back(std::move(all_[i]));
    all_.clear();
  }

  // The target's embeddings, final norm and lm_head (bound as the model's own loader binds
  // them, so a checkpoint that the model would refuse is refused here too).
  void load_target_head() {
    if (is_deepseek(tc_->arch)) {
      const DeepseekWeights tw = bind_deepseek_weights(*ckpt_);
      embed_ = weight_f32(tw.embed), fnorm_ = weight_f32(tw.final_norm), head_ = weight_f32(tw.lm_head);
    } else {
      const DenseWeights tw = bind_dense_weights(*ckpt_);
      embed_ = weight_f32(tw.embed), fnorm_ = weight_f32(tw.final_norm), head_ = weight_f32(tw.lm_head);
    }
    tgt_ = TargetHead{embed_.data(), fnorm_.data(), head_.data(), tc_->rms_eps};
  }

  // The draft's sizes, its vocabulary (from the training split's loss-masked tokens), the
  // schedule, fresh weights (N(0, 0.02) matrices, unit norms, seeded) and the job's identity.
  void init_draft() {
    std::vector<int64_t> counts(static_cast<size_t>(V_), 0);
    for (auto& ts : samples_)
      for (size_t t = 0; t < ts.ids.size(); ++t)
        if (ts.mask[t]) counts[size_t(ts.ids[t])]++;
    c_ = draft_config_for(*tc_, opt_.draft_vocab);
    apply_draft_shape(c_, opt_.draft_shape);
    c_.norm_before_residual = opt_.norm_before_residual;
    c_.ttt_steps = opt_.ttt_steps;
    c_.step_decay = opt_.step_decay;
    dv_ = build_draft_vocab(counts, c_.Vd);

    steps_per_epoch_ = (int64_t(samples_.size()) + opt_.batch_samples - 1) / opt_.batch_samples;
    total_steps_ = steps_per_epoch_ * opt_.epochs;
    if (opt_.max_steps > 0) total_steps_ = std::min(total_steps_, opt_.max_steps);
    oc_ = opt_.optim;
    if (oc_.total_steps == 0) oc_.total_steps = total_steps_;

    const int64_t H = H_;
    Rng r{opt_.seed * 2654435761ull + 17};
    auto mat = [&](std::vector<float>& v, int64_t n) {
      v.resize(size_t(n));
      for (auto& x : v) x = float(0.02 * r.normal());
    };
    if (family_) {  // its own weights, drawn from the same seeded source
      resolve_mask_token();
      fam_ = make_family(opt_.drafter, FamilyInit{c_, tgt_, dv_, embed_, head_, [&r] { return r.normal(); },
                                                  mask_token_, opt_});
      params_ = fam_->params();
    } else {
      const int64_t qd = c_.n_heads * c_.head_dim, kvd = c_.n_kv_heads * c_.head_dim;
      mat(w_.fc, H * 3 * H);
      mat(w_.wq, qd * 2 * H);
      mat(w_.wk, kvd * 2 * H);
      mat(w_.wv, kvd * 2 * H);
      mat(w_.wo, H * qd);
      mat(w_.gate, c_.I * H);
      mat(w_.up, c_.I * H);
      mat(w_.down, H * c_.I);
      mat(w_.lm_head, c_.Vd * H);
      for (auto* v : {&w_.in_ln, &w_.hidden_norm, &w_.post_ln, &w_.norm}) v->assign(size_t(H), 1.0f);
      grads_ = std::make_unique<DraftGrads>(w_);
      params_ = draft_params(w_, *grads_);
    }
    adam_ = std::make_unique<AdamW>(oc_);

    // Identity of the job: a checkpoint from another job is refused.
    job_ = {{"data_manifest_sha256", data_sha_},
            {"target_config_sha256", tc_->hash()},
            {"draft_vocab", c_.Vd},
            {"ttt_steps", c_.ttt_steps},
            {"step_decay", c_.step_decay},
            {"norm_before_residual", c_.norm_before_residual},
            {"batch_samples", opt_.batch_samples},
            {"max_length", opt_.max_length},
            {"seed", opt_.seed},
            {"lr", oc_.lr},
            {"schedule", oc_.schedule},
            {"warmup_steps", oc_.warmup_steps},
            {"total_steps", oc_.total_steps},
            {"weight_decay", oc_.weight_decay},
            {"clip_norm", oc_.clip_norm},
            {"noise", opt_.noise},
            {"eval_fraction", opt_.eval_fraction}};
    if (opt_.online) {  // (offline jobs keep the keys they had)
      job_["online"] = true;
      job_["aux_layer_ids"] = aux_ids_;
    }
    if (fam_) {  // (likewise: only the other families' jobs)
      const json fj = fam_->job();
      for (auto& [k, v] : fj.items()) job_[k] = v;
      if (opt_.drafter == "dflash")  // EAGLE-3's settings that a DFlash draft does not read
        for (const char* k : {"ttt_steps", "step_decay", "norm_before_residual"}) job_.erase(k);
    }
    if (opt_.draft_shape.any())  // (likewise: only jobs that change the draft's sizes)
      job_["draft_shape"] = {{"intermediate_size", c_.I}, {"num_attention_heads", c_.n_heads},
                             {"num_key_value_heads", c_.n_kv_heads}, {"head_dim", c_.head_dim}};
  }

  // The mask token of the families that have one: --mask-token-id, else the highest id that no
  // training or held-back sample uses (its embedding row then serves the mask alone).
  void resolve_mask_token() {
    if (opt_.mask_token_id >= 0) {
      TALON_CHECK(opt_.mask_token_id < V_, "--mask-token-id {}: outside the target's vocabulary of {}",
                  opt_.mask_token_id, V_);
      mask_token_ = int32_t(opt_.mask_token_id);
      return;
    }
    std::vector<uint8_t> used(static_cast<size_t>(V_), 0);
    for (auto* set : {&samples_, &eval_})
      for (auto& ts : *set)
        for (int32_t id : ts.ids) used[size_t(id)] = 1;
    mask_token_ = -1;
    for (int64_t id = V_ - 1; id >= 0 && mask_token_ < 0; --id)
      if (!used[size_t(id)]) mask_token_ = int32_t(id);
    TALON_CHECK(mask_token_ >= 0, "--drafter {}: the data uses every one of the {} token ids; choose a mask token "
                                  "with --mask-token-id", opt_.drafter, V_);
  }

  // A checkpoint of this job in --out: its weights, moments and step (metrics logged after
  // it are dropped, to be recomputed). Every process must resume the same job at the same step.
  void resume() {
    fs::create_directories(opt_.out);
    // The run directory is this run's while it lasts: `talon stop DIR` signals the PID recorded
    // here, `talon gpus` lists it, and a second run on the same --out is refused. Other ranks
    // of a job hold a lock of their own.
    lock_ = std::make_unique<DirLock>(opt_.out, run_record("train", gpus_),
                                      rank_ == 0 ? std::string(".talon.lock") : fmt::format(".talon.rank-{}.lock", rank_));
    cpath_ = opt_.out / kCheckpointName, mpath_ = opt_.out / kMetricsName;
    if (int n = rank_ == 0 ? remove_stale_temps(opt_.out, {kCheckpointName, kMetricsName}) : 0)
      tlog::info("{}: removed {} temporary file(s) of an interrupted run", opt_.out.string(), n);
    if (fs::exists(cpath_)) {
      st::File f(cpath_);
      f.verify_checksum(/*required=*/true);
      auto meta = f.metadata().find("talon.train");
      const json st = meta == f.metadata().end() ? json() : json::parse(meta->second, nullptr, false);
      TALON_CHECK(st.is_object() && st.contains("job"), "{}: no talon.train metadata", cpath_.string());
      std::vector<std::string> diffs;
      for (auto& [k, v] : job_.items())
        if (st["job"].value(k, json()) != v)
          diffs.push_back(fmt::format("{}: {} vs now {}", k, st["job"].value(k, json()).dump(), v.dump()));
      if (st["job"].is_object())  // keys only the checkpoint's job has (say draft_shape)
        for (auto& [k, v] : st["job"].items())
          if (!job_.contains(k)) diffs.push_back(fmt::format("{}: {} vs now none", k, v.dump()));
      if (!diffs.empty())
        fail("{}: belongs to a different training job ({}); use another --out", cpath_.string(),
             fmt::format("{}", fmt::join(diffs, "; ")));
      step_ = st.at("step").get<int64_t>();
      for (auto& p : params_) {
        const auto& t = f.get(std::string("w.") + p.name, DType::F32, {int64_t(p.w->size())});
        std::memcpy(p.w->data(), t.data, t.nbytes);
      }
      adam_->set_step_count(step_);
      if (step_ > 0) {
        auto& M = adam_->m();
        auto& Vv = adam_->v();
        for (auto& p : params_) {
          const size_t n = p.w->size();
          const auto& tm = f.get(std::string("m.") + p.name, DType::F32, {int64_t(n)});
          const auto& tv = f.get(std::string("v.") + p.name, DType::F32, {int64_t(n)});
          M.emplace_back(reinterpret_cast<const float*>(tm.data), reinterpret_cast<const float*>(tm.data) + n);
          Vv.emplace_back(reinterpret_cast<const float*>(tv.data), reinterpret_cast<const float*>(tv.data) + n);
        }
      }
      // Metrics logged after the checkpoint are recomputed: drop them (an evaluation at
      // the checkpoint's own step ran before it was saved, so it stays).
      if (rank_ == 0) {
        std::string kept;
        if (fs::exists(mpath_)) {
          std::istringstream in(read_text_file(mpath_));
          for (std::string line; std::getline(in, line);) {
            json j = json::parse(line, nullptr, false);
            if (!j.is_object()) continue;
            const int64_t s = j.value("step", int64_t(1) << 60);
            if (s < step_ || (j.value("split", "") == "eval" && s <= step_)) kept += line + "\n";
          }
        }
        write_file_atomic(mpath_, kept);
      }
      tlog::info("resuming from {} at step {} of {}", cpath_.string(), step_, total_steps_);
    } else if (rank_ == 0 && fs::exists(mpath_)) {
      write_file_atomic(mpath_, "");
    }
    // Every process runs the same job from the same step (the checkpoint lies on a shared
    // file system; a process that reads another would train something else).
    pg_.check_same(fmt::format("{} step {}", job_.dump(), step_),
                   fmt::format("{}: the training job and the step it resumes at", cpath_.string()));
    if (rank_ == 0) metrics_.open(mpath_, std::ios::app);
    if (rank_ == 0 && !metrics_) fail("{}: cannot open for appending: {}", mpath_.string(), std::strerror(errno));
  }

  // The GPU trainer (it holds the weights and moments between checkpoints) and, online, the
  // target in-process: a batch's features are made just before it is used (bf16, as extract
  // stores them by default, then fp32) and dropped after.
  void start_engines() {
    if (gpu_ >= 0) {
      int64_t longest = 0;
      for (auto* set : {&samples_, &eval_})
        for (auto& ts : *set) longest = std::max(longest, int64_t(ts.ids.size()));
      GpuGroup group;
      if (world_ > 1) {  // every process's GPUs in one NCCL communicator, rank 0's id
        std::string n;
        put_pod(n, int64_t(gpus_.size()));
        pg_.check_same(n, "train: GPUs per process (every process needs as many)");
        group.first_rank = rank_ * int(gpus_.size());
        group.size = world_ * int(gpus_.size());
        if (rank_ == 0) group.nccl_id = nccl_unique_id();
        pg_.broadcast(group.nccl_id, 0);
      }
      GpuFamily fam;
      fam.drafter = opt_.drafter;
      fam.mask_token = mask_token_;
      fam.cod = {c_.ttt_steps, opt_.cod_ratio, opt_.cod_ratio_min};
      if (opt_.drafter == "dflash") {
        fam.dflash = dflash_config(c_, opt_);
        fam.max_anchors = opt_.max_anchors;
      }
      dev_ = make_gpu_draft_trainer(c_, tgt_, dv_, gpus_, parse_gpu_math(opt_.gpu_math),
                                    std::max(opt_.max_batch_tokens, longest), group, opt_.gpu_engine, fam);
      if (fam_) {  // the family's tensors by name; the device trains them in params_'s order
        std::vector<std::string> want;
        for (auto& p : params_) want.push_back(p.name);
        TALON_CHECK(dev_->trainable() == want, "train: the GPU trainer's tensors ({}) are not the {} family's ({})",
                    fmt::join(dev_->trainable(), ","), opt_.drafter, fmt::join(want, ","));
        GpuDraftTrainer::Named named;
        for (auto& p : params_) named.emplace_back(p.name, p.w);
        for (auto& [name, v] : fam_->frozen()) named.emplace_back(name, v);
        dev_->set_tensors(named);
      } else {
        dev_->set_weights(w_);
      }
      if (step_ > 0) dev_->set_moments(adam_->m(), adam_->v());
      tlog::info("train on cuda:{} ({} matrix products{}), {:.2f} GiB of device buffers per GPU for {} tokens per "
                 "micro-batch",
                 fmt::join(gpus_, ","), opt_.gpu_math, gpus_.size() > 1 || world_ > 1 ? ", data parallel" : "",
                 double(dev_->device_bytes()) / double(1 << 30), dev_->max_rows());
    }
    if (opt_.online) {
      if (gpu_ >= 0) {
        GpuOptions go;
        go.devices = {gpu_};
        go.max_tokens = std::max(opt_.max_batch_tokens, opt_.max_length);
        go.n_capture = 4;
        go.capture_dtype = DType::BF16;
        target_ = make_cuda_model(*ckpt_, go);
      } else {
        target_ = make_cpu_model(*ckpt_);
      }
      tlog::info("online: target {} on {} feeds the trainer, aux layers {} + final {} ({})", opt_.model.string(),
                 target_->backend(), aux_ids_.dump(), L_, kLayerConvention);
    }
    cap_layers_ = aux_ids_.get<std::vector<int>>();
    cap_layers_.push_back(final_id_.get<int>());
    slots_ = std::make_unique<FeatureSlots>(dev_ != nullptr);
  }

  // ------------------------------------------------------------------ features

  static std::vector<int64_t> lengths(const std::vector<TrainSample*>& need) {
    std::vector<int64_t> v;
    for (auto* ts : need) v.push_back(int64_t(ts->ids.size()));
    return v;
  }
  static std::vector<TrainSample*> subset(const std::vector<TrainSample*>& v, const std::vector<int64_t>& idx) {
    std::vector<TrainSample*> out;
    for (int64_t i : idx) out.push_back(v[size_t(i)]);
    return out;
  }

  // Offline: the features of `need` from the mapped shards (converted in parallel when
  // asked). Reads only the mappings, so it may run on a helper thread (the next step's
  // prefetch).
  std::vector<Features> read_features(const std::vector<TrainSample*>& need, bool parallel, int slot) {
    const int64_t H = H_;
    std::vector<Features> out = lay_out(*slots_, slot, lengths(need), H);
#pragma omp parallel for schedule(dynamic, 1) if (parallel && need.size() > 1)
    for (size_t i = 0; i < need.size(); ++i) {
      const TrainSample& ts = *need[i];
      const auto [aux, hid] = feat_views_[size_t(ts.shard)];
      const int64_t T = int64_t(ts.ids.size());
      convert_to_f32(aux->dtype, aux->data + size_t(ts.row * 3 * H) * dtype_size(aux->dtype), out[i].aux,
                     size_t(T * 3 * H));
      convert_to_f32(hid->dtype, hid->data + size_t(ts.row * H) * dtype_size(hid->dtype), out[i].hidden,
                     size_t(T * H));
    }
    return out;
  }

  // The features of `need`: read (offline) or made by the target (online, on this thread,
  // which owns the target's GPU).
  std::vector<Features> featurize(const std::vector<TrainSample*>& need, int slot) {
    if (!opt_.online) return read_features(need, true, slot);
    const int64_t H = H_;
    std::vector<Features> out = lay_out(*slots_, slot, lengths(need), H);
    const int64_t budget = std::max(opt_.max_batch_tokens, opt_.max_length);
    for (size_t i = 0; i < need.size();) {
      Batch b;
      std::vector<size_t> part;
      for (; i < need.size() && (part.empty() || b.n_tokens() + int64_t(need[i]->ids.size()) <= budget); ++i) {
        b.add(need[i]->ids.data(), int64_t(need[i]->ids.size()));
        part.push_back(i);
      }
      const int64_t N = b.n_tokens();
      auto aux_buf = target_->host_buffer(size_t(N * 3 * H) * 2);
      auto fin_buf = target_->host_buffer(size_t(N * H) * 2);
      Capture cap;
      cap.layers = cap_layers_;
      cap.dtype = DType::BF16;
      for (int a = 0; a < 3; ++a) {
        cap.out.push_back(aux_buf.get() + size_t(a * H) * 2);
        cap.ld.push_back(3 * H);
      }
      cap.out.push_back(fin_buf.get());
      cap.ld.push_back(H);
      target_->forward(b, cap, nullptr);
      int64_t r = 0;
      for (size_t j : part) {
        const int64_t T = int64_t(need[j]->ids.size());
        Features& f = out[j];
        convert_to_f32(DType::BF16, aux_buf.get() + size_t(r * 3 * H) * 2, f.aux, size_t(T * 3 * H));
        convert_to_f32(DType::BF16, fin_buf.get() + size_t(r * H) * 2, f.hidden, size_t(T * H));
        r += T;
      }
    }
    return out;
  }

  // ------------------------------------------------------------------ who computes what

  // A step cut into micro-batches of at most max_rows tokens, as one process cuts it.
  std::vector<std::vector<int64_t>> micro_batches(const std::vector<int64_t>& lengths) const {
    std::vector<std::vector<int64_t>> mb;
    int64_t tok = 0;
    for (size_t i = 0; i < lengths.size(); ++i) {
      if (mb.empty() || tok + lengths[i] > dev_->max_rows()) {
        mb.emplace_back();
        tok = 0;
      }
      mb.back().push_back(int64_t(i));
      tok += lengths[i];
    }
    return mb;
  }

  // Which of a step's samples this process computes. One process: all of them. Several on
  // CPUs: a contiguous block each, summed in the canonical tree (grad_tree.h). Several with
  // GPUs: sample j of each micro-batch goes to global GPU j mod (processes x GPUs), as one
  // process with that many GPUs deals it, so the NCCL all-reduce sums the same partial
  // gradients.
  std::vector<int64_t> owned(const std::vector<int64_t>& lengths) const {
    std::vector<int64_t> idx;
    if (world_ == 1) {
      for (size_t i = 0; i < lengths.size(); ++i) idx.push_back(int64_t(i));
    } else if (!dev_) {
      const auto [a, b] = rank_block(int64_t(lengths.size()), rank_, world_);
      for (int64_t i = a; i < b; ++i) idx.push_back(i);
    } else {
      const int64_t M = int64_t(gpus_.size()), G = int64_t(world_) * M;
      for (auto& m : micro_batches(lengths))
        for (size_t j = 0; j < m.size(); ++j)
          if (int64_t(j) % G / M == rank_) idx.push_back(m[j]);
    }
    return idx;
  }

  // The results of every sample from those each process computed (in sample order), and
  // each process's `extra` bytes.
  void gather_results(std::vector<TttResult>& res, const std::vector<int64_t>& mine, const std::string& extra,
                      std::vector<std::string>* extras) {
    if (world_ == 1) return;
    std::string blob;
    put_pod(blob, uint64_t(mine.size()));
    for (int64_t i : mine) {
      put_pod(blob, i);
      put_result(blob, res[size_t(i)]);
    }
    put_pods(blob, std::vector<char>(extra.begin(), extra.end()));
    const auto all = pg_.allgather(blob);
    if (extras) extras->clear();
    for (int r = 0; r < world_; ++r) {
      PodReader in(all[size_t(r)], fmt::format("train: results of rank {}", r));
      const uint64_t n = in.get<uint64_t>();
      for (uint64_t k = 0; k < n; ++k) {
        const int64_t i = in.get<int64_t>();
        TALON_CHECK(i >= 0 && i < int64_t(res.size()), "train: rank {} sent sample {} of {}", r, i, res.size());
        res[size_t(i)] = get_result(in);
      }
      const auto e = in.get_vec<char>();
      if (extras) extras->emplace_back(e.begin(), e.end());
    }
  }

  // ------------------------------------------------------------------ forward / backward

  // Forward (and backward when `backward`) of a step's samples, of which this process holds
  // the features of `mine`: packed micro-batches on the GPU, one sample at a time on the
  // CPU. The gradients end up as weight * the sum over every process's samples.
  std::vector<TttResult> run_samples(const std::vector<eagle3::Sample>& batch, const std::vector<int64_t>& mine,
                                     double weight, bool backward) {
    if (dev_) return run_gpu(batch, mine, weight, backward);
    return fam_ ? run_family(batch, mine, weight, backward) : run_cpu(batch, mine, weight, backward);
  }

  // Several processes on CPUs: the step's results and gradient tree finished on every process
  // (grad_tree.h). This process's `pieces` (their sums in sums[0 ..]) go with its results to
  // every process, which rebuilds every process's pieces (make(): an empty buffer; parts(buf):
  // its named fp64 vectors, as many and as long as root's) and sums the whole tree into root.
  // Without `backward`, only the results travel.
  template <class Buf, class Parts, class Make, class Add, class Scratch>
  void finish_tree(int64_t B, std::vector<TttResult>& res, const std::vector<int64_t>& mine,
                   const std::vector<TreeNode>& pieces, std::vector<Buf>& sums, bool backward, Buf& root, Parts parts,
                   Make make, Add add, Scratch scratch) {
    std::string blob;
    if (backward) {
      put_pod(blob, uint64_t(pieces.size()));
      for (size_t j = 0; j < pieces.size(); ++j) {
        put_pod(blob, pieces[j].level);
        put_pod(blob, pieces[j].index);
        for (auto& [name, v] : parts(sums[j])) put_pods(blob, *v);
      }
    }
    std::vector<std::string> theirs;
    gather_results(res, mine, blob, &theirs);
    if (!backward) return;
    const auto ref = parts(root);
    std::vector<std::pair<TreeNode, Buf>> known;
    for (int r = 0; r < world_; ++r) {
      PodReader in(theirs[size_t(r)], fmt::format("train: gradient pieces of rank {}", r));
      const uint64_t n = in.get<uint64_t>();
      for (uint64_t k = 0; k < n; ++k) {
        TreeNode t;
        t.level = in.get<int>();
        t.index = in.get<int64_t>();
        known.emplace_back(t, make());
        auto dst = parts(known.back().second);
        for (size_t q = 0; q < dst.size(); ++q) {
          *dst[q].second = in.get_vec<double>();
          TALON_CHECK(dst[q].second->size() == ref[q].second->size(),
                      "train: gradient piece {} of rank {}: {} values, expected {}", dst[q].first, r,
                      dst[q].second->size(), ref[q].second->size());
        }
      }
    }
    auto lookup = [&](TreeNode t) -> const Buf* {
      for (auto& [n, g] : known)
        if (n == t) return &g;
      return nullptr;
    };
    auto no_leaf = [](int64_t i, Buf&) { fail("train: no process sent the gradient of sample {}", i); };
    tree_sum(B, TreeNode{tree_levels(B), 0}, root, add, no_leaf, lookup, scratch);
  }

  // The other families on the CPU: what a sample draws (COD elements, anchors) is seeded by
  // (seed, step, slot in the batch), so a resumed run draws the same. Gradients are summed in
  // the canonical tree over the step's samples (grad_tree.h), as EAGLE-3's CPU path does, so
  // one process and any number of them (each computing its block of samples) give the same
  // bits. Without `backward` (evaluation) each family uses its deterministic evaluation
  // sample (every chain, every anchor).
  using FamGrads = std::vector<std::vector<double>>;  // one per params_ entry
  // A family gradient's vectors named as params_ (the buffer holds one per entry).
  std::vector<std::pair<const char*, std::vector<double>*>> fam_parts(FamGrads& g) {
    std::vector<std::pair<const char*, std::vector<double>*>> out;
    for (size_t q = 0; q < params_.size(); ++q) out.emplace_back(params_[q].name, &g[q]);
    return out;
  }
  std::vector<TttResult> run_family(const std::vector<eagle3::Sample>& batch, const std::vector<int64_t>& mine,
                                    double weight, bool backward) {
    std::vector<TttResult> res(batch.size());
    const int64_t B = int64_t(batch.size());
    if (!backward) {
      for (int64_t i : mine) res[size_t(i)] = fam_->run(batch[size_t(i)], sample_seed(i), false);
      gather_results(res, mine, {}, nullptr);
      return res;
    }
    auto add = [](FamGrads& d, const FamGrads& s) {
      for (size_t q = 0; q < d.size(); ++q)
        for (size_t k = 0; k < d[q].size(); ++k) d[q][k] += s[q][k];
    };
    // A row-sparse table (Family::row_sparse_param) goes through the tree as the step's rows
    // only (grad_tree.h: RowSubset): every row any sample of the step touches, the same on
    // every process, which all see the whole batch.
    int64_t sq = -1;
    std::optional<RowSubset> sub;
    if (const char* name = fam_->row_sparse_param()) {
      for (size_t q = 0; q < params_.size(); ++q)
        if (std::string(params_[q].name) == name) sq = int64_t(q);
      TALON_CHECK(sq >= 0, "train: the family's row-sparse table {} is not one of its parameters", name);
      const int64_t width = c_.H, n = int64_t(params_[size_t(sq)].g->size());
      TALON_CHECK(width > 0 && n % width == 0, "train: {} has {} values, not rows of {}", name, n, width);
      std::vector<int64_t> rows;
      for (const auto& smp : batch) fam_->touched_rows(smp, rows);
      sub.emplace(std::move(rows), n / width, width);  // ids out of range: the family refuses them itself
    }
    for (size_t q = 0; q < params_.size(); ++q) std::fill(params_[q].g->begin(), params_[q].g->end(), 0.0);
    // A sample's gradient: the family adds into params_'s buffers, zeroed first (a row-sparse
    // table only on its rows: the rest was zeroed above and nothing writes there).
    auto leaf = [&](int64_t i, FamGrads& out) {
      for (size_t q = 0; q < params_.size(); ++q) {
        if (int64_t(q) == sq)
          sub->zero(*params_[q].g);
        else
          std::fill(params_[q].g->begin(), params_[q].g->end(), 0.0);
      }
      res[size_t(i)] = fam_->run(batch[size_t(i)], sample_seed(i), true);
      out.resize(params_.size());
      for (size_t q = 0; q < params_.size(); ++q) {
        if (int64_t(q) == sq)
          sub->gather(*params_[q].g, out[q]);
        else
          out[q] = *params_[q].g;
      }
    };
    auto scratch = [this](int level) -> FamGrads& {
      if (fam_scratch_.size() <= size_t(level)) fam_scratch_.resize(size_t(level) + 1);
      return fam_scratch_[size_t(level)];
    };
    auto none = [](TreeNode) -> const FamGrads* { return nullptr; };
    FamGrads root;
    std::vector<TreeNode> pieces;
    std::vector<FamGrads> piece_sums;
    if (world_ == 1) {
      tree_sum(B, TreeNode{tree_levels(B), 0}, root, add, leaf, none, scratch);
    } else {
      if (!mine.empty()) {
        pieces = tree_pieces(B, mine.front(), mine.back() + 1);
        piece_sums.resize(pieces.size());
        for (size_t j = 0; j < pieces.size(); ++j) tree_sum(B, pieces[j], piece_sums[j], add, leaf, none, scratch);
      }
      root.resize(params_.size());
      for (size_t q = 0; q < params_.size(); ++q)  // the sizes pieces must have
        root[q].resize(int64_t(q) == sq ? sub->size() : params_[q].g->size());
      finish_tree(B, res, mine, pieces, piece_sums, true, root, [this](FamGrads& g) { return fam_parts(g); },
                  [this] { return FamGrads(params_.size()); }, add, scratch);
    }
    for (size_t q = 0; q < params_.size(); ++q) {
      std::vector<double>& g = *params_[q].g;
      if (int64_t(q) == sq) {
        // The last sample's gradient is still in g: a row outside the subset there means the
        // family touched a row it did not declare, whose gradient the tree would have dropped.
        const int64_t stray = sub->stray_row(g);
        TALON_CHECK(stray < 0, "train: {} row {} has a gradient but the family did not list it in touched_rows",
                    params_[q].name, stray);
        sub->scatter(root[q], weight, g);
        continue;
      }
      g = std::move(root[q]);
      for (auto& x : g) x *= weight;
    }
    return res;
  }

  // What sample i of this step's batch draws (P-EAGLE's COD elements, DFlash's anchors): seeded
  // by (seed, step, slot), so a resumed run, any number of processes and either device draw
  // the same.
  uint64_t sample_seed(int64_t i) const {
    return opt_.seed * 0x9e3779b97f4a7c15ull + uint64_t(step_) * 1315423911ull + uint64_t(i);
  }

  // With `meanwhile` (a step's clipping and update), the last micro-batch runs in halves
  // (run_start, run_finish) with meanwhile() enqueued between them: the host then waits for
  // the statistics while the device goes on, with no sync between the backward and the update.
  std::vector<TttResult> run_gpu(const std::vector<eagle3::Sample>& batch, const std::vector<int64_t>& mine,
                                 double weight, bool backward, const std::function<void()>& meanwhile = {}) {
    std::vector<TttResult> res(batch.size());
    std::vector<int64_t> lengths;
    for (auto& s : batch) lengths.push_back(s.T);
    std::vector<uint8_t> is_mine(batch.size(), 0);
    for (int64_t i : mine) is_mine[size_t(i)] = 1;
    bool first = true;
    const std::vector<std::vector<int64_t>> micros = micro_batches(lengths);
    std::vector<int64_t> started;  // the last micro-batch's samples, run_start()ed
    for (size_t mi = 0; mi < micros.size(); ++mi) {
      std::vector<eagle3::Sample> micro;
      std::vector<int64_t> at;
      std::vector<uint64_t> seeds;
      for (int64_t i : micros[mi])
        if (is_mine[size_t(i)]) micro.push_back(batch[size_t(i)]), at.push_back(i), seeds.push_back(sample_seed(i));
      if (!micro.empty() && meanwhile && mi + 1 == micros.size()) {
        dev_->run_start(micro, weight, backward, first, seeds);
        started = std::move(at);
      } else if (!micro.empty()) {
        auto r = dev_->run(micro, weight, backward, first, seeds);
        for (size_t k = 0; k < at.size(); ++k) res[size_t(at[k])] = std::move(r[k]);
      } else if (backward && first) {
        dev_->zero_grads();
      }
      first = false;
    }
    if (meanwhile) meanwhile();
    if (!started.empty()) {
      auto r = dev_->run_finish();
      for (size_t k = 0; k < started.size(); ++k) res[size_t(started[k])] = std::move(r[k]);
    }
    gather_results(res, mine, {}, nullptr);
    return res;
  }

  DraftGrads& scratch_at(int level) {
    if (scratch_.size() <= size_t(level)) scratch_.resize(size_t(level) + 1);
    if (!scratch_[size_t(level)]) scratch_[size_t(level)] = std::make_unique<DraftGrads>(w_);
    return *scratch_[size_t(level)];
  }

  std::vector<TttResult> run_cpu(const std::vector<eagle3::Sample>& batch, const std::vector<int64_t>& mine,
                                 double weight, bool backward) {
    std::vector<TttResult> res(batch.size());
    const int64_t B = int64_t(batch.size());
    auto add = [](DraftGrads& d, DraftGrads& s) { add_grads(d, s); };
    auto none = [](TreeNode) -> const DraftGrads* { return nullptr; };
    auto scratch = [this](int level) -> DraftGrads& { return scratch_at(level); };
    auto leaf = [&](int64_t i, DraftGrads& out) {
      zero_grads(out);
      res[size_t(i)] = ttt_forward(c_, w_, tgt_, dv_, batch[size_t(i)], false, &out);
    };
    std::vector<TreeNode> pieces;
    if (!backward) {
      for (int64_t i : mine) res[size_t(i)] = ttt_forward(c_, w_, tgt_, dv_, batch[size_t(i)], false, nullptr);
    } else if (world_ == 1) {
      tree_sum(B, TreeNode{tree_levels(B), 0}, *grads_, add, leaf, none, scratch);
    } else if (!mine.empty()) {
      pieces = tree_pieces(B, mine.front(), mine.back() + 1);
      while (pieces_buf_.size() < pieces.size()) pieces_buf_.emplace_back(w_);
      for (size_t j = 0; j < pieces.size(); ++j) tree_sum(B, pieces[j], pieces_buf_[j], add, leaf, none, scratch);
    }
    if (world_ > 1)
      finish_tree(B, res, mine, pieces, pieces_buf_, backward, *grads_, [](DraftGrads& g) { return g.named(); },
                  [this] { return DraftGrads(w_); }, add, scratch);
    if (backward)
      for (auto& p : params_)
        for (auto& g : *p.g) g *= weight;
    return res;
  }

  // ------------------------------------------------------------------ steps

  // The samples of optimizer step st (its epoch's seeded order, made once per epoch).
  std::vector<TrainSample*> pick(int64_t st) {
    const int64_t epoch = st / steps_per_epoch_, in_epoch = st % steps_per_epoch_;
    if (epoch != order_epoch_) {
      order_ = epoch_order(int64_t(samples_.size()), opt_.seed, epoch);
      order_epoch_ = epoch;
    }
    std::vector<TrainSample*> picked;
    for (int64_t b = 0; b < opt_.batch_samples; ++b) {
      const int64_t k = in_epoch * opt_.batch_samples + b;
      if (k >= int64_t(samples_.size())) break;
      picked.push_back(&samples_[size_t(order_[size_t(k)])]);
    }
    return picked;
  }

  // Tokens of the samples of optimizer steps [0, steps), from the seeded sample order, so the
  // count survives a resume; computed once per process, then advanced by step_once.
  int64_t trained_tokens(int64_t steps) {
    if (trained_tokens_ >= 0 && trained_steps_ == steps) return trained_tokens_;
    trained_tokens_ = 0;
    for (int64_t s = 0; s < steps; ++s)
      for (auto* ts : pick(s)) trained_tokens_ += int64_t(ts->ids.size());
    trained_steps_ = steps;
    return trained_tokens_;
  }

  // Writes the checkpoint (rank 0): weights, moments, the vocabulary mapping, the job.
  void save() {
    if (rank_ != 0) return;
    if (dev_) {
      if (fam_) {
        GpuDraftTrainer::NamedOut out;
        for (auto& p : params_) out.emplace_back(p.name, p.w);
        dev_->get_tensors(out);
      } else {
        dev_->get_weights(w_);
      }
      if (step_ > 0) dev_->get_moments(adam_->m(), adam_->v());
    }
    st::Writer wr;
    for (auto& p : params_)
      wr.add(std::string("w.") + p.name, DType::F32, {int64_t(p.w->size())}, p.w->data(), p.w->size() * 4);
    for (size_t i = 0; i < adam_->m().size(); ++i) {
      const char* nm = params_[i].name;
      wr.add(std::string("m.") + nm, DType::F32, {int64_t(adam_->m()[i].size())}, adam_->m()[i].data(),
             adam_->m()[i].size() * 4);
      wr.add(std::string("v.") + nm, DType::F32, {int64_t(adam_->v()[i].size())}, adam_->v()[i].data(),
             adam_->v()[i].size() * 4);
    }
    if (fam_)  // frozen: no moments, but the exporter and the evaluator read them here
      for (auto& [name, v] : fam_->frozen())
        wr.add("w." + name, DType::F32, {int64_t(v->size())}, v->data(), v->size() * 4);
    wr.add("d2t", DType::I64, {int64_t(dv_.d2t.size())}, dv_.d2t.data(), dv_.d2t.size() * 8);
    wr.add("t2d", DType::U8, {int64_t(dv_.t2d.size())}, dv_.t2d.data(), dv_.t2d.size());
    json st = {{"job", job_},
               {"step", step_},
               {"draft", {{"hidden_size", c_.H}, {"intermediate_size", c_.I}, {"num_attention_heads", c_.n_heads},
                          {"num_key_value_heads", c_.n_kv_heads}, {"head_dim", c_.head_dim}, {"vocab_size", c_.V},
                          {"draft_vocab_size", c_.Vd}, {"rms_norm_eps", c_.rms_eps},
                          {"norm_before_residual", c_.norm_before_residual}}},
               {"drafter", opt_.drafter},
               {"aux_layer_ids", aux_ids_},
               {"final_layer_id", final_id_},
               {"convention", convention_},
               {"online", opt_.online}};
    if (fam_) {
      const json fd = fam_->draft();
      for (auto& [k, v] : fd.items()) st["draft"][k] = v;
    }
    wr.set_metadata("talon.train", st.dump());
    wr.set_checksum(true);
    wr.write(cpath_);
  }

  void log_metrics(const json& j) {
    if (rank_ != 0) return;
    metrics_ << j.dump() << "\n";
    metrics_.flush();
    if (!metrics_)
      fail("{}: write failed: {} (a checkpoint keeps the finished steps; rerun to resume)", mpath_.string(),
           std::strerror(errno));
  }

  // Forward over the held-back split; logged with "split": "eval" after `done` updates.
  void evaluate(int64_t done) {
    if (eval_.empty()) return;
    std::vector<TrainSample*> ptrs;
    for (auto& ts : eval_) ptrs.push_back(&ts);
    const std::vector<int64_t> mine = owned(lengths(ptrs));
    const std::vector<Features> feats = featurize(subset(ptrs, mine), 2);
    std::vector<eagle3::Sample> es;
    for (auto* ts : ptrs) es.push_back({ts->ids.data(), ts->mask.data(), nullptr, nullptr, int64_t(ts->ids.size())});
    for (size_t k = 0; k < mine.size(); ++k) {
      es[size_t(mine[k])].aux = feats[k].aux;
      es[size_t(mine[k])].hidden = feats[k].hidden;
    }
    const Summary m = summarize(run_samples(es, mine, 0.0, false), width());
    slots_->release(2);
    log_metrics(json{{"split", "eval"}, {"step", done}, {"samples", es.size()}, {"loss", m.loss},
                     {"loss_exact", exact(m.loss)}, {"acc", m.acc}, {"cond_acc", m.cond_acc},
                     {"sim_accept_len", m.accept_len}, {"tokens_trained", trained_tokens(done)}});
    tlog::info("eval after {} steps: loss {:.4f} acc0 {:.3f} simulated acceptance length {:.3f} ({} samples)", done,
               m.loss, m.acc[0], m.accept_len, es.size());
  }

  // One optimizer step: this process's share of the step's samples (features read ahead
  // for the next step offline), forward and backward, clip, AdamW, metrics.
  void step_once(Progress& progress) {
    const int64_t epoch = step_ / steps_per_epoch_;
    const std::vector<TrainSample*> picked = pick(step_);
    const std::vector<int64_t> mine = owned(lengths(picked));
    std::vector<Features> feats = prefetch_.valid() && prefetch_step_ == step_
                                      ? prefetch_.get()
                                      : featurize(subset(picked, mine), int(step_ % 2));
    if (!opt_.online && step_ + 1 < total_steps_) {
      // The shards are only read; the online target stays on this thread. On the CPU the
      // trainer's own parallel loops use every core, so the helper converts serially there.
      prefetch_step_ = step_ + 1;
      const std::vector<TrainSample*> next = pick(step_ + 1);
      prefetch_ = std::async(std::launch::async, [this, next = subset(next, owned(lengths(next))),
                                                  par = dev_ != nullptr, slot = int((step_ + 1) % 2)] {
        return read_features(next, par, slot);
      });
    }
    std::vector<eagle3::Sample> batch;
    for (auto* ts : picked) {
      batch.push_back({ts->ids.data(), ts->mask.data(), nullptr, nullptr, int64_t(ts->ids.size())});
      tokens_ += int64_t(ts->ids.size());
    }
    trained_tokens(step_);  // through the steps before this one
    for (auto* ts : picked) trained_tokens_ += int64_t(ts->ids.size());
    trained_steps_ = step_ + 1;
    for (size_t k = 0; k < mine.size(); ++k) {
      const int64_t b = mine[k];
      Features& f = feats[k];  // this step's own copy: noise goes in place
      if (opt_.noise > 0) {  // seeded by (seed, step, slot): the same after a resume, on any process
        Rng r{opt_.seed * 0x9e3779b97f4a7c15ull + uint64_t(step_) * 1315423911ull + uint64_t(b) + 3};
        for (int64_t i = 0; i < batch[size_t(b)].T * 3 * H_; ++i)
          f.aux[i] += float(opt_.noise * (2.0 * r.uniform() - 1.0));
      }
      batch[size_t(b)].aux = f.aux;
      batch[size_t(b)].hidden = f.hidden;
    }
    const double inv_b = 1.0 / double(batch.size());
    std::vector<TttResult> res;
    double gnorm = 0;
    if (dev_) {  // the update is enqueued before the host waits for the step's statistics
      res = run_gpu(batch, mine, inv_b, true, [&] {
        dev_->clip_grad_norm_start(oc_.clip_norm);
        dev_->adamw_step(oc_, step_);
      });
      gnorm = dev_->grad_norm();
      adam_->set_step_count(step_ + 1);
    } else {
      res = run_samples(batch, mine, inv_b, true);
      gnorm = clip_grad_norm(params_, oc_.clip_norm);
      adam_->step(params_);
    }
    const double lr = lr_at(oc_, step_);
    const Summary m = summarize(res, width());
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    const double tps = secs > 0 ? double(tokens_) / secs : 0.0;
    if (world_ > 1) {  // every process applied the same update from the same gradients
      std::string g;
      put_pod(g, gnorm);
      pg_.check_same(g, fmt::format("train step {}: the gradient norm", step_));
    }
    log_metrics(json{{"step", step_}, {"epoch", epoch}, {"loss", m.loss}, {"loss_exact", exact(m.loss)},
                     {"acc", m.acc}, {"cond_acc", m.cond_acc}, {"sim_accept_len", m.accept_len}, {"lr", lr},
                     {"grad_norm", gnorm}, {"tokens_per_s", tps}, {"tokens_trained", trained_tokens_}});
    progress.set_note(fmt::format("loss {:.4f} acc0 {:.3f} accept {:.2f} | {} tok/s", m.loss, m.acc[0], m.accept_len,
                                  format_count(tps)));
    tlog::debug("step {} loss {:.4f} acc0 {:.3f} accept {:.3f} lr {:.3g} |g| {:.3g}", step_, m.loss, m.acc[0],
                m.accept_len, lr, gnorm);
    last_loss_ = m.loss;
  }

  TrainReport train() {
    tlog::info("train: {} samples (+{} held back for eval), {} draft, draft vocab {} of {}, K={} {}, {} optimizer "
               "steps of {} sample(s), lr {}, on {}{}",
               samples_.size(), eval_.size(), opt_.drafter, c_.Vd, V_, width(), family_ ? "positions" : "steps",
               total_steps_, opt_.batch_samples, oc_.lr, opt_.device,
               world_ > 1 ? fmt::format(" x {} processes", world_) : std::string());
    if (fam_) tlog::info("{}", fam_->describe());
    Progress progress("train", total_steps_, "step", step_);
    TrainReport rep;
    rep.total_steps = total_steps_;
    t0_ = std::chrono::steady_clock::now();
    while (step_ < total_steps_) {
      // A stop seen by any process stops every process at the same step.
      if (pg_.any(stop_requested())) {
        if (world_ > 1 && !stop_requested()) request_stop_for_test();  // (the resume hint is printed everywhere)
        save();
        rep.status = TrainStatus::Interrupted;
        rep.steps = step_;
        return rep;
      }
      step_once(progress);
      ++step_;
      progress.advance(1);
      if ((opt_.eval_every > 0 && step_ % opt_.eval_every == 0) || step_ == total_steps_) evaluate(step_);
      if (step_ % opt_.save_every == 0 || step_ == total_steps_) save();
      if (opt_.stop_after_steps >= 0 && step_ >= opt_.stop_after_steps && step_ < total_steps_)
        request_stop_for_test();
    }
    progress.finish();
    if (dev_ && opt_.gpu_engine.profile)
      for (auto& [phase, ms] : dev_->profile()) tlog::info("gpu profile: {:<44} {:10.1f} ms", phase, ms);
    rep.steps = step_;
    rep.last_loss = last_loss_;
    return rep;
  }

  // ------------------------------------------------------------------ state

  const TrainOptions& opt_;
  ProcessGroup& pg_;
  const std::vector<int> gpus_;
  const int gpu_, world_, rank_;
  const bool family_;  // --drafter other than eagle3 (draft/family.h)
  int width() const { return fam_ ? fam_->width() : c_.ttt_steps; }  // metric entries per sample
  std::unique_ptr<Checkpoint> ckpt_;
  std::unique_ptr<DirLock> lock_;
  const ModelConfig* tc_ = nullptr;
  int64_t H_ = 0, V_ = 0, L_ = 0;
  // Samples: all_ until split into the training and the held-back ones.
  std::vector<TrainSample> all_, samples_, eval_;
  std::vector<std::unique_ptr<st::File>> shards_;  // offline: mapped for the run
  std::vector<std::pair<const st::TensorView*, const st::TensorView*>> feat_views_;  // per shard: aux, hidden
  json aux_ids_, final_id_, convention_;
  std::string data_sha_;
  std::vector<float> embed_, fnorm_, head_;
  TargetHead tgt_{};
  DraftConfig c_;
  DraftVocab dv_;
  int64_t steps_per_epoch_ = 0, total_steps_ = 0;
  OptimConfig oc_;
  DraftWeights w_;                     // eagle3
  std::unique_ptr<DraftGrads> grads_;  // eagle3
  std::unique_ptr<Family> fam_;        // the other families: their weights and gradients
  std::vector<FamGrads> fam_scratch_;  // run_family's tree buffers, one per level
  int32_t mask_token_ = -1;            // peagle, dflash
  std::vector<Param> params_;
  std::unique_ptr<AdamW> adam_;
  json job_;
  fs::path cpath_, mpath_;
  int64_t step_ = 0;
  std::ofstream metrics_;
  std::unique_ptr<GpuDraftTrainer> dev_;
  std::unique_ptr<Model> target_;
  std::vector<int> cap_layers_;
  std::unique_ptr<FeatureSlots> slots_;
  // CPU gradient tree: one scratch buffer per level, and this process's pieces.
  std::vector<std::unique_ptr<DraftGrads>> scratch_;
  std::vector<DraftGrads> pieces_buf_;
  // Step loop.
  int64_t order_epoch_ = -1;
  std::vector<int64_t> order_;
  std::future<std::vector<Features>> prefetch_;
  int64_t prefetch_step_ = -1;
  std::chrono::steady_clock::time_point t0_;
  int64_t tokens_ = 0;
  int64_t trained_tokens_ = -1, trained_steps_ = -1;  // tokens of steps [0, trained_steps_)
  double last_loss_ = 0;
};

}  // namespace

TrainReport run_train(const TrainOptions& opt) {
  const RankInfo ri = resolve_rank(-1, -1);
  const std::vector<int> gpus = parse_train_devices(opt.device, ri);
  if (ri.world > 1) fs::create_directories(opt.out);  // (the NCCL id file of a GPU job lies there)
  std::unique_ptr<ProcessGroup> pg;
  if (ri.world == 1) {
    pg = single_process_group();
  } else {
    set_thread_log_tag(fmt::format("rank {}", ri.rank));
    if (ri.mpi) pg = mpi_process_group(ri);
    else if (!gpus.empty()) pg = nccl_process_group(ri, gpus[0], opt.out);
    else
      fail("{} says rank {} of {}: training on CPUs across processes needs MPI; start it with mpirun (or srun "
           "--mpi=pmix)",
           ri.source, ri.rank, ri.world);
    tlog::info("rank {} of {} ({}; collectives over {}), {}", ri.rank, ri.world, ri.source, pg->kind(),
               gpus.empty() ? std::string("CPU") : fmt::format("GPUs {}", fmt::join(gpus, ",")));
  }
  try {
    return Trainer(opt, *pg, gpus).run();
  } catch (const std::exception& e) {
    if (pg->world() > 1) {  // the other ranks would wait in the next collective forever
      tlog::error("{}", e.what());
      tlog::error("rank {} failed: ending every rank of the job", ri.rank);
      pg->abort(1);
    }
    throw;
  }
}

}  // namespace talon::train

namespace talon::eagle3 {

GpuMath parse_gpu_math(const std::string& s) {
  if (s == "f32") return GpuMath::F32;
  if (s == "tf32") return GpuMath::TF32;
  if (s == "bf16") return GpuMath::BF16;
  fail("--gpu-math '{}': expected f32, tf32 or bf16", s);
}

}  // namespace talon::eagle3
