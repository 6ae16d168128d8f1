#include "train/trainer.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cmath>
#include <fstream>
#include <future>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "data/features.h"
#include "io/safetensors.h"
#include "model/checkpoint.h"
#include "model/deepseek.h"
#include "model/dense.h"
#include "model/model.h"
#include "data/samples.h"
#include "train/draft_gpu.h"
#include "train/grad_tree.h"
#include "util/dist.h"
#include "util/dtype.h"
#include "util/error.h"
#include "util/log.h"
#include "util/progress.h"
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

TrainReport train_impl(const TrainOptions& opt, ProcessGroup& pg, const std::vector<int>& gpus) {
  if (opt.threads > 0) omp_set_num_threads(opt.threads);
  TALON_CHECK(opt.batch_samples >= 1 && opt.max_length >= 2 && opt.epochs >= 1 && opt.ttt_steps >= 1,
              "train: --batch-samples, --epochs and --ttt-steps must be >= 1 and --max-length >= 2");
  TALON_CHECK(opt.eval_fraction >= 0 && opt.eval_fraction < 1, "--eval-fraction {}: expected a value in [0, 1)",
              opt.eval_fraction);
  TALON_CHECK(opt.noise >= 0, "--noise {}: expected >= 0", opt.noise);
  const int gpu = gpus.empty() ? -1 : gpus[0];
  const GpuMath gpu_math = parse_gpu_math(opt.gpu_math);
  auto ckpt = open_checkpoint(opt.model);
  const ModelConfig& tc = ckpt->config();
  const int64_t H = tc.hidden, V = tc.vocab, L = tc.n_layers;

  // Samples (truncated to --max-length). Offline: tokens and features from an extract
  // dataset made by this very target. Online: tokens from a prepare dataset; the target
  // runs in-process and makes each batch's features when it is needed.
  std::vector<TrainSample> all;
  // Offline: the dataset's shards stay mapped; a batch's features are read from them when
  // it runs (streamed: host memory holds tokens and the current batch, not the dataset).
  std::vector<std::unique_ptr<st::File>> shards;
  std::vector<std::pair<const st::TensorView*, const st::TensorView*>> feat_views;  // per shard: aux, hidden
  json aux_ids, final_id, convention;
  std::string data_sha;
  if (opt.online) {
    auto src = open_samples(opt.data);
    data_sha = src->sha256();
    const std::vector<int> aux = opt.layers.empty() ? default_aux_layers(L) : parse_layer_ids(opt.layers, L);
    TALON_CHECK(aux.size() == 3, "--layers '{}': EAGLE-3 takes exactly 3 aux layers", opt.layers);
    aux_ids = aux;
    final_id = L;
    convention = kLayerConvention;
    for (size_t i = 0; i < src->size(); ++i) {
      const talon::Sample& sm = src->at(i);
      const int64_t T = std::min(int64_t(sm.input_ids.size()), opt.max_length);
      if (T < 2) continue;
      TrainSample ts;
      ts.ids.assign(sm.input_ids.begin(), sm.input_ids.begin() + T);
      ts.mask.assign(sm.loss_mask.begin(), sm.loss_mask.begin() + T);
      for (int32_t id : ts.ids)
        TALON_CHECK(id >= 0 && id < V, "{}: sample {} (line {}) has token id {}, outside the vocabulary of {} ({})",
                    src->path(), sm.id, sm.line, id, opt.model.string(), V);
      all.push_back(std::move(ts));
    }
  } else {
    TALON_CHECK(opt.layers.empty(), "--layers applies to --online training; an extract dataset has its layers");
    const json man = read_manifest(opt.data);
    TALON_CHECK(man.value("status", "") == "complete",
                "{}: the extraction is not complete (status {}); finish it first", opt.data.string(),
                man.value("status", json()).dump());
    TALON_CHECK(man.value("model_config_sha256", "") == tc.hash(),
                "{}: features were extracted from a model with config sha256 {}, but --model {} has {}; train with "
                "the target that made them",
                opt.data.string(), man.value("model_config_sha256", ""), opt.model.string(), tc.hash());
    TALON_CHECK(man.value("hidden_size", int64_t(0)) == H, "{}: hidden_size {} but the model has {}",
                opt.data.string(), man.value("hidden_size", int64_t(0)), H);
    aux_ids = man.at("aux_layer_ids");
    final_id = man.at("final_layer_id");
    convention = man.at("convention");
    const std::string man_text = read_text_file(opt.data / kManifestName);
    data_sha = sha256_hex(man_text.data(), man_text.size());
    // Every shard is checked against the manifest (size, SHA-256, tensor shapes, offsets)
    // before any of it is used.
    {
      const DatasetCheck chk = check_dataset(opt.data, /*checksums=*/true);
      if (!chk.ok)
        fail("{}: the dataset does not verify: {}", opt.data.string(), fmt::format("{}", fmt::join(chk.problems, "; ")));
    }
    size_t shard_i = 0;
    for (auto& s : man.at("shards")) {
      shards.push_back(std::make_unique<st::File>(shard_path(opt.data, s, shard_i++)));
      const st::File& f = *shards.back();
      const auto& aux = f.get(shard_tensors::aux_hidden);
      const auto& hid = f.get(shard_tensors::hidden);
      feat_views.push_back({&aux, &hid});
      const auto& ids = f.get(shard_tensors::input_ids);
      const auto& mask = f.get(shard_tensors::loss_mask);
      const auto& off = f.get(shard_tensors::sample_offsets);
      // Tensors in a shard need not be aligned for their type (a U8 tensor precedes): copy.
      std::vector<int64_t> o(static_cast<size_t>(off.numel()));
      std::memcpy(o.data(), off.data, off.nbytes);
      for (int64_t i = 0; i + 1 < off.numel(); ++i) {
        const int64_t a = o[size_t(i)], T = std::min(o[size_t(i + 1)] - o[size_t(i)], opt.max_length);
        if (T < 2) continue;
        TrainSample ts;
        ts.ids.resize(size_t(T));
        std::memcpy(ts.ids.data(), ids.data + size_t(a) * 4, size_t(T) * 4);
        ts.mask.assign(mask.data + a, mask.data + a + T);
        if (a < 0 || (a + T) * 3 * H > aux.numel() || (a + T) * H > hid.numel())
          fail("{}: sample {} (rows {}..{}) lies outside tensors '{}' / '{}' of {} / {} values", f.path().string(), i,
               a, a + T, shard_tensors::aux_hidden, shard_tensors::hidden, aux.numel(), hid.numel());
        ts.shard = int32_t(shards.size() - 1);
        ts.row = a;
        for (int64_t t = 0; t < T; ++t)
          if (ts.ids[size_t(t)] < 0 || ts.ids[size_t(t)] >= V)
            fail("{}: tensor '{}': token id {} at position {} is outside the target vocabulary of {}",
                 f.path().string(), shard_tensors::input_ids, ts.ids[size_t(t)], a + t, V);
        all.push_back(std::move(ts));
      }
    }
  }
  TALON_CHECK(!all.empty(), "{}: no samples of at least 2 tokens", opt.data.string());
  // The held-back evaluation split: a seeded choice of samples, never trained on.
  std::vector<TrainSample> samples, eval;
  {
    int64_t n_eval = int64_t(std::llround(opt.eval_fraction * double(all.size())));
    if (opt.eval_fraction > 0 && all.size() >= 2) n_eval = std::clamp<int64_t>(n_eval, 1, int64_t(all.size()) - 1);
    else n_eval = 0;
    const auto pick = epoch_order(int64_t(all.size()), opt.seed ^ 0x5eed5eedull, -1);
    std::vector<uint8_t> is_eval(all.size(), 0);
    for (int64_t i = 0; i < n_eval; ++i) is_eval[size_t(pick[size_t(i)])] = 1;
    for (size_t i = 0; i < all.size(); ++i) (is_eval[i] ? eval : samples).push_back(std::move(all[i]));
  }
  // The draft vocabulary comes from the training split's loss-masked tokens.
  std::vector<int64_t> counts(static_cast<size_t>(V), 0);
  for (auto& ts : samples)
    for (size_t t = 0; t < ts.ids.size(); ++t)
      if (ts.mask[t]) counts[size_t(ts.ids[t])]++;

  // The target's embeddings, final norm and lm_head (bound as the model's own loader binds
  // them, so a checkpoint that the model would refuse is refused here too).
  std::vector<float> embed, fnorm, head;
  if (is_deepseek(tc.arch)) {
    const DeepseekWeights tw = bind_deepseek_weights(*ckpt);
    embed = weight_f32(tw.embed), fnorm = weight_f32(tw.final_norm), head = weight_f32(tw.lm_head);
  } else {
    const DenseWeights tw = bind_dense_weights(*ckpt);
    embed = weight_f32(tw.embed), fnorm = weight_f32(tw.final_norm), head = weight_f32(tw.lm_head);
  }
  TargetHead tgt{embed.data(), fnorm.data(), head.data(), tc.rms_eps};

  DraftConfig c = draft_config_for(tc, opt.draft_vocab);
  apply_draft_shape(c, opt.draft_shape);
  c.norm_before_residual = opt.norm_before_residual;
  c.ttt_steps = opt.ttt_steps;
  c.step_decay = opt.step_decay;
  const DraftVocab dv = build_draft_vocab(counts, c.Vd);

  const int64_t steps_per_epoch = (int64_t(samples.size()) + opt.batch_samples - 1) / opt.batch_samples;
  int64_t total_steps = steps_per_epoch * opt.epochs;
  if (opt.max_steps > 0) total_steps = std::min(total_steps, opt.max_steps);
  OptimConfig oc = opt.optim;
  if (oc.total_steps == 0) oc.total_steps = total_steps;

  // Fresh weights: N(0, 0.02) matrices, unit norms (seeded).
  DraftWeights w;
  {
    Rng r{opt.seed * 2654435761ull + 17};
    auto mat = [&](std::vector<float>& v, int64_t n) {
      v.resize(size_t(n));
      for (auto& x : v) x = float(0.02 * r.normal());
    };
    const int64_t qd = c.n_heads * c.head_dim, kvd = c.n_kv_heads * c.head_dim;
    mat(w.fc, H * 3 * H);
    mat(w.wq, qd * 2 * H);
    mat(w.wk, kvd * 2 * H);
    mat(w.wv, kvd * 2 * H);
    mat(w.wo, H * qd);
    mat(w.gate, c.I * H);
    mat(w.up, c.I * H);
    mat(w.down, H * c.I);
    mat(w.lm_head, c.Vd * H);
    for (auto* v : {&w.in_ln, &w.hidden_norm, &w.post_ln, &w.norm}) v->assign(size_t(H), 1.0f);
  }
  DraftGrads grads(w);
  const std::vector<Param> params = draft_params(w, grads);
  AdamW adam(oc);

  // Identity of the job: a checkpoint from another job is refused.
  json job = {{"data_manifest_sha256", data_sha},
                    {"target_config_sha256", tc.hash()},
                    {"draft_vocab", c.Vd},
                    {"ttt_steps", c.ttt_steps},
                    {"step_decay", c.step_decay},
                    {"norm_before_residual", c.norm_before_residual},
                    {"batch_samples", opt.batch_samples},
                    {"max_length", opt.max_length},
                    {"seed", opt.seed},
                    {"lr", oc.lr},
                    {"schedule", oc.schedule},
                    {"warmup_steps", oc.warmup_steps},
                    {"total_steps", oc.total_steps},
                    {"weight_decay", oc.weight_decay},
                    {"clip_norm", oc.clip_norm},
                    {"noise", opt.noise},
                    {"eval_fraction", opt.eval_fraction}};
  if (opt.online) {  // (offline jobs keep the keys they had)
    job["online"] = true;
    job["aux_layer_ids"] = aux_ids;
  }
  if (opt.draft_shape.any())  // (likewise: only jobs that change the draft's sizes)
    job["draft_shape"] = {{"intermediate_size", c.I}, {"num_attention_heads", c.n_heads},
                          {"num_key_value_heads", c.n_kv_heads}, {"head_dim", c.head_dim}};
  fs::create_directories(opt.out);
  const fs::path cpath = opt.out / kCheckpointName, mpath = opt.out / kMetricsName;
  int64_t step = 0;
  if (int n = pg.rank() == 0 ? remove_stale_temps(opt.out, {kCheckpointName, kMetricsName}) : 0)
    tlog::info("{}: removed {} temporary file(s) of an interrupted run", opt.out.string(), n);
  if (fs::exists(cpath)) {
    st::File f(cpath);
    f.verify_checksum(/*required=*/true);
    auto meta = f.metadata().find("talon.train");
    const json st = meta == f.metadata().end() ? json() : json::parse(meta->second, nullptr, false);
    TALON_CHECK(st.is_object() && st.contains("job"), "{}: no talon.train metadata", cpath.string());
    std::vector<std::string> diffs;
    for (auto& [k, v] : job.items())
      if (st["job"].value(k, json()) != v) diffs.push_back(fmt::format("{}: {} vs now {}", k, st["job"].value(k, json()).dump(), v.dump()));
    if (st["job"].is_object())  // keys only the checkpoint's job has (say draft_shape)
      for (auto& [k, v] : st["job"].items())
        if (!job.contains(k)) diffs.push_back(fmt::format("{}: {} vs now none", k, v.dump()));
    if (!diffs.empty())
      fail("{}: belongs to a different training job ({}); use another --out", cpath.string(),
           fmt::format("{}", fmt::join(diffs, "; ")));
    step = st.at("step").get<int64_t>();
    for (auto& p : params) {
      const auto& t = f.get(std::string("w.") + p.name, DType::F32, {int64_t(p.w->size())});
      std::memcpy(p.w->data(), t.data, t.nbytes);
    }
    adam.set_step_count(step);
    if (step > 0) {
      auto& M = adam.m();
      auto& Vv = adam.v();
      for (auto& p : params) {
        const size_t n = p.w->size();
        const auto& tm = f.get(std::string("m.") + p.name, DType::F32, {int64_t(n)});
        const auto& tv = f.get(std::string("v.") + p.name, DType::F32, {int64_t(n)});
        M.emplace_back(reinterpret_cast<const float*>(tm.data), reinterpret_cast<const float*>(tm.data) + n);
        Vv.emplace_back(reinterpret_cast<const float*>(tv.data), reinterpret_cast<const float*>(tv.data) + n);
      }
    }
    // Metrics logged after the checkpoint are recomputed: drop them (an evaluation at
    // the checkpoint's own step ran before it was saved, so it stays).
    std::string kept;
    if (pg.rank() == 0 && fs::exists(mpath)) {
      std::istringstream in(read_text_file(mpath));
      for (std::string line; std::getline(in, line);) {
        json j = json::parse(line, nullptr, false);
        if (!j.is_object()) continue;
        const int64_t s = j.value("step", int64_t(1) << 60);
        if (s < step || (j.value("split", "") == "eval" && s <= step)) kept += line + "\n";
      }
    }
    if (pg.rank() == 0) write_file_atomic(mpath, kept);
    tlog::info("resuming from {} at step {} of {}", cpath.string(), step, total_steps);
  } else if (pg.rank() == 0 && fs::exists(mpath)) {
    write_file_atomic(mpath, "");
  }
  // Every process runs the same job from the same step (the checkpoint lies on a shared
  // file system; a process that reads another would train something else).
  pg.check_same(fmt::format("{} step {}", job.dump(), step),
                fmt::format("{}: the training job and the step it resumes at", cpath.string()));

  // The GPU trainer holds the weights and moments between checkpoints.
  std::unique_ptr<GpuDraftTrainer> dev;
  if (gpu >= 0) {
    int64_t longest = 0;
    for (auto* set : {&samples, &eval})
      for (auto& ts : *set) longest = std::max(longest, int64_t(ts.ids.size()));
    GpuGroup group;
    if (pg.world() > 1) {  // every process's GPUs in one NCCL communicator, rank 0's id
      std::string n;
      put_pod(n, int64_t(gpus.size()));
      pg.check_same(n, "train: GPUs per process (every process needs as many)");
      group.first_rank = pg.rank() * int(gpus.size());
      group.size = pg.world() * int(gpus.size());
      if (pg.rank() == 0) group.nccl_id = nccl_unique_id();
      pg.broadcast(group.nccl_id, 0);
    }
    dev = make_gpu_draft_trainer(c, tgt, dv, gpus, gpu_math, std::max(opt.max_batch_tokens, longest), group);
    dev->set_weights(w);
    if (step > 0) dev->set_moments(adam.m(), adam.v());
    tlog::info("train on cuda:{} ({} matrix products{}), {:.2f} GiB of device buffers per GPU for {} tokens per "
               "micro-batch",
               fmt::join(gpus, ","), opt.gpu_math, gpus.size() > 1 ? ", data parallel" : "",
               double(dev->device_bytes()) / double(1 << 30), dev->max_rows());
  }
  // Online: the target in-process. Features of a batch are made just before it is used
  // (bf16, as extract stores them by default, then fp32) and dropped after.
  std::unique_ptr<Model> target;
  if (opt.online) {
    if (gpu >= 0) {
      GpuOptions go;
      go.devices = {gpu};
      go.max_tokens = std::max(opt.max_batch_tokens, opt.max_length);
      go.n_capture = 4;
      go.capture_dtype = DType::BF16;
      target = make_cuda_model(*ckpt, go);
    } else {
      target = make_cpu_model(*ckpt);
    }
    tlog::info("online: target {} on {} feeds the trainer, aux layers {} + final {} ({})", opt.model.string(),
               target->backend(), aux_ids.dump(), L, kLayerConvention);
  }
  const std::vector<int> cap_layers = [&] {
    std::vector<int> v = aux_ids.get<std::vector<int>>();
    v.push_back(final_id.get<int>());
    return v;
  }();
  // Offline: the features of `need` from the mapped shards (converted in parallel when
  // asked). Reads only the mappings, so it may run on a helper thread (the next step's
  // prefetch).
  FeatureSlots slots(dev != nullptr);
  const auto lengths = [](const std::vector<TrainSample*>& need) {
    std::vector<int64_t> v;
    for (auto* ts : need) v.push_back(int64_t(ts->ids.size()));
    return v;
  };
  auto subset = [](const std::vector<TrainSample*>& v, const std::vector<int64_t>& idx) {
    std::vector<TrainSample*> out;
    for (int64_t i : idx) out.push_back(v[size_t(i)]);
    return out;
  };
  auto read_features = [&](const std::vector<TrainSample*>& need, bool parallel, int slot) {
    std::vector<Features> out = lay_out(slots, slot, lengths(need), H);
#pragma omp parallel for schedule(dynamic, 1) if (parallel && need.size() > 1)
    for (size_t i = 0; i < need.size(); ++i) {
      const TrainSample& ts = *need[i];
      const auto [aux, hid] = feat_views[size_t(ts.shard)];
      const int64_t T = int64_t(ts.ids.size());
      convert_to_f32(aux->dtype, aux->data + size_t(ts.row * 3 * H) * dtype_size(aux->dtype), out[i].aux,
                     size_t(T * 3 * H));
      convert_to_f32(hid->dtype, hid->data + size_t(ts.row * H) * dtype_size(hid->dtype), out[i].hidden,
                     size_t(T * H));
    }
    return out;
  };
  // The features of `need`: read (offline) or made by the target (online, on this thread,
  // which owns the target's GPU).
  auto featurize = [&](const std::vector<TrainSample*>& need, int slot) {
    if (!opt.online) return read_features(need, true, slot);
    std::vector<Features> out = lay_out(slots, slot, lengths(need), H);
    const int64_t budget = std::max(opt.max_batch_tokens, opt.max_length);
    for (size_t i = 0; i < need.size();) {
      Batch b;
      std::vector<size_t> part;
      for (; i < need.size() && (part.empty() || b.n_tokens() + int64_t(need[i]->ids.size()) <= budget); ++i) {
        b.add(need[i]->ids.data(), int64_t(need[i]->ids.size()));
        part.push_back(i);
      }
      const int64_t N = b.n_tokens();
      auto aux_buf = target->host_buffer(size_t(N * 3 * H) * 2);
      auto fin_buf = target->host_buffer(size_t(N * H) * 2);
      Capture cap;
      cap.layers = cap_layers;
      cap.dtype = DType::BF16;
      for (int a = 0; a < 3; ++a) {
        cap.out.push_back(aux_buf.get() + size_t(a * H) * 2);
        cap.ld.push_back(3 * H);
      }
      cap.out.push_back(fin_buf.get());
      cap.ld.push_back(H);
      target->forward(b, cap, nullptr);
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
  };

  // Which of a step's samples this process computes. One process: all of them. Several on
  // CPUs: a contiguous block each, summed in the canonical tree (grad_tree.h). Several with
  // GPUs: the step is cut into micro-batches of max_rows tokens exactly as one process would
  // cut it, and sample j of a micro-batch goes to global GPU j mod (processes x GPUs), as
  // one process with that many GPUs deals it, so the NCCL all-reduce sums the same
  // partial gradients.
  const int world = pg.world(), rank = pg.rank();
  const int local_gpus = int(std::max<size_t>(gpus.size(), 1));
  auto micro_batches = [&](const std::vector<int64_t>& lengths) {
    std::vector<std::vector<int64_t>> mb;
    int64_t tok = 0;
    for (size_t i = 0; i < lengths.size(); ++i) {
      if (mb.empty() || tok + lengths[i] > dev->max_rows()) {
        mb.emplace_back();
        tok = 0;
      }
      mb.back().push_back(int64_t(i));
      tok += lengths[i];
    }
    return mb;
  };
  auto owned = [&](const std::vector<int64_t>& lengths) {
    std::vector<int64_t> idx;
    if (world == 1) {
      for (size_t i = 0; i < lengths.size(); ++i) idx.push_back(int64_t(i));
    } else if (!dev) {
      const auto [a, b] = rank_block(int64_t(lengths.size()), rank, world);
      for (int64_t i = a; i < b; ++i) idx.push_back(i);
    } else {
      const int64_t G = int64_t(world) * local_gpus;
      for (auto& m : micro_batches(lengths))
        for (size_t j = 0; j < m.size(); ++j)
          if (int64_t(j) % G / local_gpus == rank) idx.push_back(m[j]);
    }
    return idx;
  };
  // The results of every sample from those each process computed (in sample order).
  auto gather_results = [&](std::vector<TttResult>& res, const std::vector<int64_t>& mine, std::string extra,
                            std::vector<std::string>* extras) {
    if (world == 1) return;
    std::string blob;
    put_pod(blob, uint64_t(mine.size()));
    for (int64_t i : mine) {
      put_pod(blob, i);
      put_result(blob, res[size_t(i)]);
    }
    put_pods(blob, std::vector<char>(extra.begin(), extra.end()));
    const auto all = pg.allgather(blob);
    if (extras) extras->clear();
    for (int r = 0; r < world; ++r) {
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
  };
  // CPU scratch of the gradient tree: one buffer per level, and this process's pieces.
  std::vector<std::unique_ptr<DraftGrads>> scratch;
  std::vector<DraftGrads> pieces_buf;
  auto scratch_at = [&](int level) -> DraftGrads& {
    if (scratch.size() <= size_t(level)) scratch.resize(size_t(level) + 1);
    if (!scratch[size_t(level)]) scratch[size_t(level)] = std::make_unique<DraftGrads>(w);
    return *scratch[size_t(level)];
  };
  auto add = [](DraftGrads& d, DraftGrads& s) { add_grads(d, s); };
  auto none = [](TreeNode) -> const DraftGrads* { return nullptr; };

  // Forward (and backward when `backward`) of a step's samples, of which this process holds
  // the features of `mine`: packed micro-batches on the GPU, one sample at a time on the CPU.
  // The gradients end up as weight * the sum over every process's samples.
  auto run_samples = [&](const std::vector<eagle3::Sample>& batch, const std::vector<int64_t>& mine, double weight,
                         bool backward) {
    std::vector<TttResult> res(batch.size());
    if (dev) {
      std::vector<int64_t> lengths;
      for (auto& s : batch) lengths.push_back(s.T);
      std::vector<uint8_t> is_mine(batch.size(), 0);
      for (int64_t i : mine) is_mine[size_t(i)] = 1;
      bool first = true;
      for (auto& m : micro_batches(lengths)) {
        std::vector<eagle3::Sample> micro;
        std::vector<int64_t> at;
        for (int64_t i : m)
          if (is_mine[size_t(i)]) micro.push_back(batch[size_t(i)]), at.push_back(i);
        if (!micro.empty()) {
          auto r = dev->run(micro, weight, backward, first);
          for (size_t k = 0; k < at.size(); ++k) res[size_t(at[k])] = std::move(r[k]);
        } else if (backward && first) {
          dev->zero_grads();
        }
        first = false;
      }
      gather_results(res, mine, {}, nullptr);
      return res;
    }
    const int64_t B = int64_t(batch.size());
    auto leaf = [&](int64_t i, DraftGrads& out) {
      zero_grads(out);
      res[size_t(i)] = ttt_forward(c, w, tgt, dv, batch[size_t(i)], false, &out);
    };
    std::vector<TreeNode> pieces;
    if (!backward) {
      for (int64_t i : mine) res[size_t(i)] = ttt_forward(c, w, tgt, dv, batch[size_t(i)], false, nullptr);
    } else if (world == 1) {
      tree_sum(B, TreeNode{tree_levels(B), 0}, grads, add, leaf, none, scratch_at);
    } else if (!mine.empty()) {
      pieces = tree_pieces(B, mine.front(), mine.back() + 1);
      while (pieces_buf.size() < pieces.size()) pieces_buf.emplace_back(w);
      for (size_t j = 0; j < pieces.size(); ++j) tree_sum(B, pieces[j], pieces_buf[j], add, leaf, none, scratch_at);
    }
    if (world > 1) {
      // Every process's pieces to every process, which finishes the tree from them.
      std::string mine_pieces;
      if (backward) {
        put_pod(mine_pieces, uint64_t(pieces.size()));
        for (size_t j = 0; j < pieces.size(); ++j) {
          put_pod(mine_pieces, pieces[j].level);
          put_pod(mine_pieces, pieces[j].index);
          for (auto& [name, v] : pieces_buf[j].named()) put_pods(mine_pieces, *v);
        }
      }
      std::vector<std::string> theirs;
      gather_results(res, mine, std::move(mine_pieces), &theirs);
      if (backward) {
        std::vector<std::pair<TreeNode, DraftGrads>> known;
        for (int r = 0; r < world; ++r) {
          PodReader in(theirs[size_t(r)], fmt::format("train: gradient pieces of rank {}", r));
          const uint64_t n = in.get<uint64_t>();
          for (uint64_t k = 0; k < n; ++k) {
            TreeNode t;
            t.level = in.get<int>();
            t.index = in.get<int64_t>();
            known.emplace_back(t, DraftGrads(w));
            auto dst = known.back().second.named();
            auto ref = grads.named();
            for (size_t q = 0; q < dst.size(); ++q) {
              *dst[q].second = in.get_vec<double>();
              TALON_CHECK(dst[q].second->size() == ref[q].second->size(),
                          "train: gradient piece {} of rank {}: {} values, expected {}", dst[q].first, r,
                          dst[q].second->size(), ref[q].second->size());
            }
          }
        }
        auto lookup = [&](TreeNode t) -> const DraftGrads* {
          for (auto& [n, g] : known)
            if (n == t) return &g;
          return nullptr;
        };
        auto no_leaf = [&](int64_t i, DraftGrads&) { fail("train: no process sent the gradient of sample {}", i); };
        tree_sum(B, TreeNode{tree_levels(B), 0}, grads, add, no_leaf, lookup, scratch_at);
      }
    }
    if (backward)
      for (auto& p : params)
        for (auto& g : *p.g) g *= weight;
    return res;
  };

  auto save = [&] {
    if (pg.rank() != 0) return;  // rank 0 writes the one checkpoint
    if (dev) {
      dev->get_weights(w);
      if (step > 0) dev->get_moments(adam.m(), adam.v());
    }
    st::Writer wr;
    for (auto& p : params) wr.add(std::string("w.") + p.name, DType::F32, {int64_t(p.w->size())}, p.w->data(), p.w->size() * 4);
    for (size_t i = 0; i < adam.m().size(); ++i) {
      const char* nm = params[i].name;
      wr.add(std::string("m.") + nm, DType::F32, {int64_t(adam.m()[i].size())}, adam.m()[i].data(), adam.m()[i].size() * 4);
      wr.add(std::string("v.") + nm, DType::F32, {int64_t(adam.v()[i].size())}, adam.v()[i].data(), adam.v()[i].size() * 4);
    }
    wr.add("d2t", DType::I64, {int64_t(dv.d2t.size())}, dv.d2t.data(), dv.d2t.size() * 8);
    wr.add("t2d", DType::U8, {int64_t(dv.t2d.size())}, dv.t2d.data(), dv.t2d.size());
    json st = {{"job", job},
               {"step", step},
               {"draft", {{"hidden_size", c.H}, {"intermediate_size", c.I}, {"num_attention_heads", c.n_heads},
                          {"num_key_value_heads", c.n_kv_heads}, {"head_dim", c.head_dim}, {"vocab_size", c.V},
                          {"draft_vocab_size", c.Vd}, {"rms_norm_eps", c.rms_eps}, {"norm_before_residual", c.norm_before_residual}}},
               {"aux_layer_ids", aux_ids},
               {"final_layer_id", final_id},
               {"convention", convention},
               {"online", opt.online}};
    wr.set_metadata("talon.train", st.dump());
    wr.set_checksum(true);
    wr.write(cpath);
  };

  std::ofstream metrics;
  if (pg.rank() == 0) metrics.open(mpath, std::ios::app);
  if (pg.rank() == 0 && !metrics) fail("{}: cannot open for appending: {}", mpath.string(), std::strerror(errno));
  // Forward over the held-back split; logged with "split": "eval" after `done` updates.
  auto evaluate = [&](int64_t done) {
    if (eval.empty()) return;
    std::vector<TrainSample*> ptrs;
    for (auto& ts : eval) ptrs.push_back(&ts);
    const std::vector<int64_t> mine = owned(lengths(ptrs));
    const std::vector<Features> feats = featurize(subset(ptrs, mine), 2);
    std::vector<eagle3::Sample> es;
    for (auto* ts : ptrs) es.push_back({ts->ids.data(), ts->mask.data(), nullptr, nullptr, int64_t(ts->ids.size())});
    for (size_t k = 0; k < mine.size(); ++k) {
      es[size_t(mine[k])].aux = feats[k].aux;
      es[size_t(mine[k])].hidden = feats[k].hidden;
    }
    const Summary m = summarize(run_samples(es, mine, 0.0, false), c.ttt_steps);
    slots.release(2);
    if (rank != 0) return;
    metrics << json{{"split", "eval"}, {"step", done}, {"samples", es.size()}, {"loss", m.loss}, {"loss_exact", exact(m.loss)},
                    {"acc", m.acc}, {"cond_acc", m.cond_acc}, {"sim_accept_len", m.accept_len}}.dump()
            << "\n";
    metrics.flush();
    if (!metrics) fail("{}: write failed: {}", mpath.string(), std::strerror(errno));
    tlog::info("eval after {} steps: loss {:.4f} acc0 {:.3f} simulated acceptance length {:.3f} ({} samples)", done,
               m.loss, m.acc[0], m.accept_len, es.size());
  };

  tlog::info("train: {} samples (+{} held back for eval), draft vocab {} of {}, K={} steps, {} optimizer steps of {} "
             "sample(s), lr {}, on {}",
             samples.size(), eval.size(), c.Vd, V, c.ttt_steps, total_steps, opt.batch_samples, oc.lr, opt.device);
  Progress progress("train", total_steps, "step", step);
  TrainReport rep;
  rep.total_steps = total_steps;
  const auto t0 = std::chrono::steady_clock::now();
  int64_t tokens = 0;
  // The samples of optimizer step st (its epoch's seeded order, made once per epoch).
  int64_t order_epoch = -1;
  std::vector<int64_t> order;
  auto pick = [&](int64_t st) {
    const int64_t epoch = st / steps_per_epoch, in_epoch = st % steps_per_epoch;
    if (epoch != order_epoch) {
      order = epoch_order(int64_t(samples.size()), opt.seed, epoch);
      order_epoch = epoch;
    }
    std::vector<TrainSample*> picked;
    for (int64_t b = 0; b < opt.batch_samples; ++b) {
      const int64_t k = in_epoch * opt.batch_samples + b;
      if (k >= int64_t(samples.size())) break;
      picked.push_back(&samples[size_t(order[size_t(k)])]);
    }
    return picked;
  };
  // Offline, the next step's features are read on a helper thread while this step trains
  // (the shards are only read; the online target stays on this thread). On the CPU the
  // trainer's own parallel loops use every core, so the helper converts serially there.
  std::future<std::vector<Features>> prefetch;
  int64_t prefetch_step = -1;
  while (step < total_steps) {
    // A stop seen by any process stops every process at the same step.
    if (pg.any(stop_requested())) {
      if (world > 1 && !stop_requested()) request_stop_for_test();  // (the resume hint is printed everywhere)
      save();
      rep.status = TrainStatus::Interrupted;
      rep.steps = step;
      return rep;
    }
    const int64_t epoch = step / steps_per_epoch;
    if (!dev)
      for (auto& p : params) std::fill(p.g->begin(), p.g->end(), 0.0);
    const std::vector<TrainSample*> picked = pick(step);
    const std::vector<int64_t> mine = owned(lengths(picked));
    std::vector<Features> feats = prefetch.valid() && prefetch_step == step ? prefetch.get()
                                                                            : featurize(subset(picked, mine), int(step % 2));
    if (!opt.online && step + 1 < total_steps) {
      prefetch_step = step + 1;
      const std::vector<TrainSample*> next = pick(step + 1);
      prefetch = std::async(std::launch::async, [&read_features, next = subset(next, owned(lengths(next))),
                                                 par = dev != nullptr, slot = int((step + 1) % 2)] {
        return read_features(next, par, slot);
      });
    }
    std::vector<eagle3::Sample> batch;
    for (auto* ts : picked) {
      batch.push_back({ts->ids.data(), ts->mask.data(), nullptr, nullptr, int64_t(ts->ids.size())});
      tokens += int64_t(ts->ids.size());
    }
    for (size_t k = 0; k < mine.size(); ++k) {
      const int64_t b = mine[k];
      Features& f = feats[k];  // this step's own copy: noise goes in place
      if (opt.noise > 0) {  // seeded by (seed, step, slot): the same after a resume, on any process
        Rng r{opt.seed * 0x9e3779b97f4a7c15ull + uint64_t(step) * 1315423911ull + uint64_t(b) + 3};
        for (int64_t i = 0; i < batch[size_t(b)].T * 3 * H; ++i) f.aux[i] += float(opt.noise * (2.0 * r.uniform() - 1.0));
      }
      batch[size_t(b)].aux = f.aux;
      batch[size_t(b)].hidden = f.hidden;
    }
    const double inv_b = 1.0 / double(batch.size());
    const std::vector<TttResult> res = run_samples(batch, mine, inv_b, true);
    const double gnorm = dev ? dev->clip_grad_norm(oc.clip_norm) : clip_grad_norm(params, oc.clip_norm);
    const double lr = lr_at(oc, step);
    if (dev) {
      dev->adamw_step(oc, step);
      adam.set_step_count(step + 1);
    } else {
      adam.step(params);
    }
    const Summary m = summarize(res, c.ttt_steps);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double tps = secs > 0 ? double(tokens) / secs : 0.0;
    if (world > 1) {  // every process applied the same update from the same gradients
      std::string g;
      put_pod(g, gnorm);
      pg.check_same(g, fmt::format("train step {}: the gradient norm", step));
    }
    if (rank == 0) metrics << json{{"step", step}, {"epoch", epoch}, {"loss", m.loss}, {"loss_exact", exact(m.loss)}, {"acc", m.acc},
                    {"cond_acc", m.cond_acc}, {"sim_accept_len", m.accept_len}, {"lr", lr}, {"grad_norm", gnorm},
                    {"tokens_per_s", tps}}.dump()
            << "\n";
    metrics.flush();
    if (rank == 0 && !metrics)
      fail("{}: write failed: {} (a checkpoint keeps the finished steps; rerun to resume)", mpath.string(),
           std::strerror(errno));
    progress.set_note(fmt::format("loss {:.4f} acc0 {:.3f} accept {:.2f} | {} tok/s", m.loss, m.acc[0], m.accept_len,
                                  format_count(tps)));
    tlog::debug("step {} loss {:.4f} acc0 {:.3f} accept {:.3f} lr {:.3g} |g| {:.3g}", step, m.loss, m.acc[0],
                m.accept_len, lr, gnorm);
    rep.last_loss = m.loss;
    ++step;
    progress.advance(1);
    if ((opt.eval_every > 0 && step % opt.eval_every == 0) || step == total_steps) evaluate(step);
    if (step % opt.save_every == 0 || step == total_steps) save();
    if (opt.stop_after_steps >= 0 && step >= opt.stop_after_steps && step < total_steps) request_stop_for_test();
  }
  progress.finish();
  rep.steps = step;
  return rep;
}

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
    return train_impl(opt, *pg, gpus);
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
