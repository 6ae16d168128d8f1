#include "train/trainer.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "data/features.h"
#include "io/safetensors.h"
#include "model/checkpoint.h"
#include "model/dense.h"
#include "model/model.h"
#include "util/dtype.h"
#include "util/error.h"
#include "util/log.h"
#include "util/progress.h"
#include "util/signals.h"

namespace talon::train {

using json = nlohmann::json;
using namespace talon::eagle3;

namespace {

constexpr const char* kCheckpointName = "checkpoint.safetensors";
constexpr const char* kMetricsName = "metrics.jsonl";

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

// One training sample in memory (fp32 features).
struct TrainSample {
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;
  std::vector<float> aux, hidden;
};

std::vector<float> to_f32(const st::TensorView& t, size_t offset_elems, size_t n) {
  std::vector<float> out(n);
  convert_to_f32(t.dtype, t.data + offset_elems * dtype_size(t.dtype), out.data(), n);
  return out;
}

std::vector<float> weight_f32(const WeightRef& w) {
  size_t n = 1;
  for (auto d : w.shape) n *= size_t(d);
  std::vector<float> out(n);
  convert_to_f32(w.dtype, w.data, out.data(), n);
  return out;
}

}  // namespace

std::vector<Param> draft_params(DraftWeights& w, DraftGrads& g) {
  auto nw = w.named();
  auto ng = g.named();
  std::vector<Param> ps;
  for (size_t i = 0; i < nw.size(); ++i) ps.push_back({nw[i].first, nw[i].second, ng[i].second, !is_norm_weight(nw[i].first)});
  return ps;
}

TrainReport run_train(const TrainOptions& opt) {
  if (opt.threads > 0) omp_set_num_threads(opt.threads);
  TALON_CHECK(opt.batch_samples >= 1 && opt.max_length >= 2 && opt.epochs >= 1 && opt.ttt_steps >= 1,
              "train: --batch-samples, --epochs and --ttt-steps must be >= 1 and --max-length >= 2");
  // Dataset and target must agree: the features were made by this very model.
  const json man = read_manifest(opt.data);
  TALON_CHECK(man.value("status", "") == "complete", "{}: the extraction is not complete (status {}); finish it first",
              opt.data.string(), man.value("status", json()).dump());
  auto ckpt = open_checkpoint(opt.model);
  const ModelConfig& tc = ckpt->config();
  TALON_CHECK(man.value("model_config_sha256", "") == tc.hash(),
              "{}: features were extracted from a model with config sha256 {}, but --model {} has {}; train with the "
              "target that made them",
              opt.data.string(), man.value("model_config_sha256", ""), opt.model.string(), tc.hash());
  const int64_t H = tc.hidden, V = tc.vocab;
  TALON_CHECK(man.value("hidden_size", int64_t(0)) == H, "{}: hidden_size {} but the model has {}", opt.data.string(),
              man.value("hidden_size", int64_t(0)), H);

  // Samples (truncated to --max-length) and the loss-masked token counts.
  // Every shard is checked against the manifest (size, SHA-256, tensor shapes, offsets)
  // before any of it is used.
  {
    const DatasetCheck chk = check_dataset(opt.data, /*checksums=*/true);
    if (!chk.ok) fail("{}: the dataset does not verify: {}", opt.data.string(), fmt::format("{}", fmt::join(chk.problems, "; ")));
  }
  std::vector<TrainSample> samples;
  std::vector<int64_t> counts(static_cast<size_t>(V), 0);
  size_t shard_i = 0;
  for (auto& s : man.at("shards")) {
    st::File f(shard_path(opt.data, s, shard_i++));
    const auto& ids = f.get(shard_tensors::input_ids);
    const auto& mask = f.get(shard_tensors::loss_mask);
    const auto& aux = f.get(shard_tensors::aux_hidden);
    const auto& hid = f.get(shard_tensors::hidden);
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
      ts.aux = to_f32(aux, size_t(a * 3 * H), size_t(T * 3 * H));
      ts.hidden = to_f32(hid, size_t(a * H), size_t(T * H));
      for (int64_t t = 0; t < T; ++t) {
        if (ts.ids[size_t(t)] < 0 || ts.ids[size_t(t)] >= V)
          fail("{}: tensor '{}': token id {} at position {} is outside the target vocabulary of {}", f.path().string(),
               shard_tensors::input_ids, ts.ids[size_t(t)], a + t, V);
        if (ts.mask[size_t(t)]) counts[size_t(ts.ids[size_t(t)])]++;
      }
      samples.push_back(std::move(ts));
    }
  }
  TALON_CHECK(!samples.empty(), "{}: no samples of at least 2 tokens", opt.data.string());

  DenseWeights tw = bind_dense_weights(*ckpt);
  const std::vector<float> embed = weight_f32(tw.embed), fnorm = weight_f32(tw.final_norm),
                           head = weight_f32(tw.lm_head);
  TargetHead tgt{embed.data(), fnorm.data(), head.data(), tc.rms_eps};

  DraftConfig c;
  c.H = H;
  c.I = tc.intermediate;
  c.n_heads = tc.n_heads;
  c.n_kv_heads = tc.n_kv_heads;
  c.head_dim = tc.head_dim;
  c.V = V;
  c.Vd = std::min(opt.draft_vocab, V);
  c.rms_eps = tc.rms_eps;
  c.rope = tc.rope;
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
  const std::string man_text = read_text_file(opt.data / kManifestName);
  const json job = {{"data_manifest_sha256", sha256_hex(man_text.data(), man_text.size())},
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
                    {"clip_norm", oc.clip_norm}};
  fs::create_directories(opt.out);
  const fs::path cpath = opt.out / kCheckpointName, mpath = opt.out / kMetricsName;
  int64_t step = 0;
  if (int n = remove_stale_temps(opt.out, {kCheckpointName, kMetricsName}))
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
    // Metrics logged after the checkpoint are recomputed: drop them.
    std::string kept;
    if (fs::exists(mpath)) {
      std::istringstream in(read_text_file(mpath));
      for (std::string line; std::getline(in, line);) {
        json j = json::parse(line, nullptr, false);
        if (j.is_object() && j.value("step", int64_t(1) << 60) < step) kept += line + "\n";
      }
    }
    write_file_atomic(mpath, kept);
    tlog::info("resuming from {} at step {} of {}", cpath.string(), step, total_steps);
  } else if (fs::exists(mpath)) {
    write_file_atomic(mpath, "");
  }

  auto save = [&] {
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
               {"aux_layer_ids", man.at("aux_layer_ids")},
               {"final_layer_id", man.at("final_layer_id")},
               {"convention", man.at("convention")}};
    wr.set_metadata("talon.train", st.dump());
    wr.set_checksum(true);
    wr.write(cpath);
  };

  tlog::info("train: {} samples, draft vocab {} of {}, K={} steps, {} optimizer steps of {} sample(s), lr {}", samples.size(),
             c.Vd, V, c.ttt_steps, total_steps, opt.batch_samples, oc.lr);
  std::ofstream metrics(mpath, std::ios::app);
  if (!metrics) fail("{}: cannot open for appending: {}", mpath.string(), std::strerror(errno));
  Progress progress("train", total_steps, "step", step);
  TrainReport rep;
  rep.total_steps = total_steps;
  const auto t0 = std::chrono::steady_clock::now();
  int64_t tokens = 0;
  while (step < total_steps) {
    if (stop_requested()) {
      save();
      rep.status = TrainStatus::Interrupted;
      rep.steps = step;
      return rep;
    }
    const int64_t epoch = step / steps_per_epoch, in_epoch = step % steps_per_epoch;
    const auto order = epoch_order(int64_t(samples.size()), opt.seed, epoch);
    for (auto& p : params) std::fill(p.g->begin(), p.g->end(), 0.0);
    // The batch's samples; gradients are averaged.
    std::vector<TttResult> res;
    for (int64_t b = 0; b < opt.batch_samples; ++b) {
      const int64_t k = in_epoch * opt.batch_samples + b;
      if (k >= int64_t(samples.size())) break;
      const TrainSample& ts = samples[size_t(order[size_t(k)])];
      Sample s{ts.ids.data(), ts.mask.data(), ts.aux.data(), ts.hidden.data(), int64_t(ts.ids.size())};
      res.push_back(ttt_forward(c, w, tgt, dv, s, false, &grads));
      tokens += s.T;
    }
    const double inv_b = 1.0 / double(res.size());
    for (auto& p : params)
      for (auto& g : *p.g) g *= inv_b;
    const double gnorm = clip_grad_norm(params, oc.clip_norm);
    const double lr = lr_at(oc, step);
    adam.step(params);
    double loss = 0;
    std::vector<double> acc(size_t(c.ttt_steps), 0.0);
    double alen = 0;
    for (auto& r : res) {
      loss += r.loss * inv_b;
      alen += r.accept_len * inv_b;
      for (int k = 0; k < c.ttt_steps; ++k) acc[size_t(k)] += r.acc_k[size_t(k)] * inv_b;
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    char lbuf[64];
    std::snprintf(lbuf, sizeof lbuf, "%.17g", loss);  // exact, for resume comparisons
    metrics << json{{"step", step}, {"epoch", epoch}, {"loss", loss}, {"loss_exact", lbuf}, {"acc", acc},
                    {"sim_accept_len", alen}, {"lr", lr}, {"grad_norm", gnorm},
                    {"tokens_per_s", secs > 0 ? double(tokens) / secs : 0.0}}.dump()
            << "\n";
    metrics.flush();
    if (!metrics) fail("{}: write failed: {} (a checkpoint keeps the finished steps; rerun to resume)", mpath.string(), std::strerror(errno));
    tlog::debug("step {} loss {:.4f} acc0 {:.3f} accept {:.3f} lr {:.3g} |g| {:.3g}", step, loss, acc[0], alen, lr, gnorm);
    rep.last_loss = loss;
    ++step;
    progress.advance(1);
    if (step % opt.save_every == 0 || step == total_steps) save();
    if (opt.stop_after_steps >= 0 && step >= opt.stop_after_steps && step < total_steps) request_stop_for_test();
  }
  progress.finish();
  rep.steps = step;
  return rep;
}

}  // namespace talon::train
