#include "data/extract.h"

#include <fcntl.h>
#include <omp.h>
#include <sys/file.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <nlohmann/json.hpp>

#include "data/features.h"
#include "data/samples.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "util/dtype.h"
#include "util/error.h"
#include "util/log.h"
#include "util/mem.h"
#include "util/progress.h"
#include "util/signals.h"

namespace talon {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

// Holds an exclusive lock on <out>/.talon.lock for the life of the run; records our PID.
class DirLock {
 public:
  explicit DirLock(const fs::path& dir) {
    const fs::path p = dir / ".talon.lock";
    fd_ = ::open(p.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) fail("{}: cannot create lock file", p.string());
    if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      char buf[32] = {};
      ssize_t n = ::pread(fd_, buf, sizeof buf - 1, 0);
      ::close(fd_);
      fail("{}: another talon run (pid {}) is writing this directory", dir.string(),
           n > 0 ? std::string(buf, size_t(n)) : "?");
    }
    std::string pid = std::to_string(::getpid());
    if (::ftruncate(fd_, 0) == 0) {
      ssize_t w = ::pwrite(fd_, pid.data(), pid.size(), 0);
      (void)w;
    }
  }
  ~DirLock() {
    if (fd_ >= 0) ::close(fd_);
  }

 private:
  int fd_ = -1;
};

// Identity of the weights: names, stored types and shapes of every tensor.
std::string weights_fingerprint(const Checkpoint& ck) {
  Sha256 h;
  for (auto& t : ck.tensors()) {
    std::string s = t.name + "|" + t.stored_type + "|" + st::shape_str(t.shape) + "\n";
    h.update(s.data(), s.size());
  }
  return h.hex();
}

struct ShardPlan {
  int64_t first, count, tokens;
};

std::vector<ShardPlan> plan_shards(const SampleSource& src, int64_t shard_tokens) {
  std::vector<ShardPlan> plan;
  ShardPlan cur{0, 0, 0};
  for (size_t i = 0; i < src.size(); ++i) {
    cur.count++;
    cur.tokens += int64_t(src.at(i).input_ids.size());
    if (cur.tokens >= shard_tokens) {
      plan.push_back(cur);
      cur = {int64_t(i) + 1, 0, 0};
    }
  }
  if (cur.count) plan.push_back(cur);
  return plan;
}

// The fields a resumed run must agree on.
const char* kPinned[] = {"format_version", "model_config_sha256", "model_weights_fingerprint", "input_sha256",
                         "aux_layer_ids", "final_layer_id", "dtype", "shard_tokens", "hidden_size"};

}  // namespace

ExtractReport run_extract(const ExtractOptions& opt) {
  ExtractReport rep;
  const auto t_start = Clock::now();
  int cuda_device = -1;
  if (opt.device == "cuda") cuda_device = 0;
  else if (opt.device.rfind("cuda:", 0) == 0) {
    try {
      size_t used = 0;
      cuda_device = std::stoi(opt.device.substr(5), &used);
      if (used != opt.device.size() - 5) cuda_device = -2;
    } catch (const std::exception&) {
      cuda_device = -2;
    }
  }
  if (opt.device != "cpu" && cuda_device < 0) fail("--device '{}': expected cpu, cuda or cuda:N", opt.device);
  if (cuda_device >= 0 && !cuda_backend_built())
    fail("--device {}: this build has no CUDA backend (nvcc was not found when it was configured); use --device cpu",
         opt.device);
  TALON_CHECK(opt.max_batch_tokens > 0, "--max-batch-tokens must be positive, got {}", opt.max_batch_tokens);
  TALON_CHECK(opt.shard_tokens >= 0, "--shard-tokens must be >= 0, got {}", opt.shard_tokens);
  if (opt.threads > 0) omp_set_num_threads(opt.threads);

  // Inputs first: every check that can fail runs before anything is written.
  auto ckpt = open_checkpoint(opt.model);
  const ModelConfig& cfg = ckpt->config();
  const int64_t L = cfg.n_layers, H = cfg.hidden;
  std::vector<int> aux = opt.layers.empty() ? default_aux_layers(L) : parse_layer_ids(opt.layers, L);
  auto src = open_samples(opt.data);
  for (size_t i = 0; i < src->size(); ++i) {
    const Sample& s = src->at(i);
    for (size_t k = 0; k < s.input_ids.size(); ++k)
      TALON_CHECK(s.input_ids[k] < cfg.vocab, "{}:{}: input_ids[{}] = {} outside the model's vocabulary [0, {})",
                  src->path(), s.line, k, s.input_ids[k], cfg.vocab);
  }
  auto model = cuda_device >= 0 ? make_cuda_model(*ckpt, cuda_device) : make_cpu_model(*ckpt);
  rep.load_seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
  tlog::info("model {} ({}, L={}, H={}, V={}) loaded in {:.2f}s on {} with {} threads", opt.model.string(),
             arch_name(cfg.arch), L, H, cfg.vocab, rep.load_seconds, model->backend(), omp_get_max_threads());
  tlog::info("memory after load: {}", format_mem(mem_usage()));
  tlog::info("layers: aux h{} + final h[{}] ({}: {})", fmt::format("{}", fmt::join(aux, ",")), L,
             kLayerConvention, kLayerConventionText);

  const bool f32 = opt.fp32;
  const DType feat_dt = f32 ? DType::F32 : DType::BF16;
  const int64_t bytes_per_token = (3 + 1) * H * int64_t(dtype_size(feat_dt)) + 5;
  const int64_t shard_tokens = opt.shard_tokens > 0 ? opt.shard_tokens : std::max<int64_t>(1, (512ll << 20) / bytes_per_token);
  const auto plan = plan_shards(*src, shard_tokens);

  json want = {{"format", kFeaturesFormat},
               {"format_version", kFeaturesVersion},
               {"convention", kLayerConvention},
               {"convention_text", kLayerConventionText},
               {"aux_layer_ids", aux},
               {"final_layer_id", L},
               {"num_layers", L},
               {"hidden_size", H},
               {"vocab_size", cfg.vocab},
               {"dtype", f32 ? "f32" : "bf16"},
               {"model", opt.model.string()},
               {"model_arch", arch_name(cfg.arch)},
               {"model_config", cfg.to_json()},
               {"model_config_sha256", cfg.hash()},
               {"model_weights_fingerprint", weights_fingerprint(*ckpt)},
               {"input", src->path()},
               {"input_format", src->format()},
               {"input_sha256", src->sha256()},
               {"input_samples", src->size()},
               {"shard_tokens", shard_tokens},
               {"planned_shards", plan.size()},
               {"backend", model->backend()},
               {"talon_version", TALON_VERSION}};

  // Output directory: new, or a run of the same job to resume.
  fs::create_directories(opt.out);
  DirLock lock(opt.out);
  json manifest;
  const fs::path mpath = opt.out / kManifestName;
  if (fs::exists(mpath)) {
    manifest = read_manifest(opt.out);
    std::vector<std::string> diffs;
    for (const char* k : kPinned)
      if (manifest.value(k, json()) != want[k])
        diffs.push_back(fmt::format("{}: existing {} vs now {}", k, manifest.value(k, json()).dump(), want[k].dump()));
    if (!diffs.empty())
      fail("{}: holds a different extraction ({}); use another --out or delete it", opt.out.string(),
           fmt::format("{}", fmt::join(diffs, "; ")));
  } else {
    for (auto& e : fs::directory_iterator(opt.out)) {
      const std::string n = e.path().filename().string();
      if (n != ".talon.lock" && n.find(".tmp-") == std::string::npos)
        fail("{}: directory is not empty and has no {}; refusing to write into it", opt.out.string(), kManifestName);
    }
    manifest = want;
    manifest["status"] = "in_progress";
    manifest["shards"] = json::array();
    write_file_atomic(mpath, manifest.dump(2) + "\n");
  }
  // Leftovers of a killed run: temp files and shards written after the last manifest update.
  for (auto& e : fs::directory_iterator(opt.out)) {
    const std::string n = e.path().filename().string();
    if (n.find(".tmp-") != std::string::npos) fs::remove(e.path());
  }
  int64_t done_shards = int64_t(manifest["shards"].size());
  TALON_CHECK(done_shards <= int64_t(plan.size()), "{}: manifest lists {} shards but the plan has {}", mpath.string(),
              done_shards, plan.size());
  for (int64_t i = 0; i < done_shards; ++i) {
    const json& s = manifest["shards"][size_t(i)];
    const fs::path p = opt.out / s.at("file").get<std::string>();
    TALON_CHECK(s.at("file") == shard_file_name(i) && s.at("first_sample") == plan[size_t(i)].first &&
                    s.at("samples") == plan[size_t(i)].count,
                "{}: shard {} does not match the plan; the dataset is inconsistent, use a fresh --out", mpath.string(), i);
    TALON_CHECK(fs::exists(p) && int64_t(fs::file_size(p)) == s.at("bytes").get<int64_t>(),
                "{}: missing or wrong size although the manifest lists it; run `talon inspect {}`", p.string(),
                opt.out.string());
  }
  rep.aux_layers = aux;
  rep.final_layer = int(L);
  rep.manifest = mpath;
  if (manifest.value("status", "") == "complete") {
    rep.status = ExtractStatus::AlreadyComplete;
    rep.samples = manifest.value("num_samples", 0);
    rep.tokens = manifest.value("num_tokens", 0);
    rep.loss_tokens = manifest.value("num_loss_tokens", 0);
    rep.shards = done_shards;
    tlog::info("{} is already complete ({} samples); nothing to do", opt.out.string(), rep.samples);
    return rep;
  }

  int64_t total_tokens = 0, done_tokens = 0;
  for (size_t i = 0; i < plan.size(); ++i) {
    total_tokens += plan[i].tokens;
    if (int64_t(i) < done_shards) done_tokens += plan[i].tokens;
  }
  if (done_shards > 0)
    tlog::info("resuming: {} of {} shards already written ({} tokens)", done_shards, plan.size(), done_tokens);

  Progress progress("extract", total_tokens, "tok", done_tokens);
  std::vector<int> cap_layers = aux;
  cap_layers.push_back(int(L));
  const int64_t esz = int64_t(dtype_size(feat_dt));
  Batch batch;
  int64_t written_this_run = 0;
  const auto t_run = Clock::now();

  // Shards are written by a small pool of threads (hash + write + fsync) while the
  // model computes the next ones; at most `max_inflight` finished shards wait in
  // memory (back-pressure). The manifest only ever lists a contiguous prefix of
  // finished shards, so a resume recomputes exactly the ones not listed.
  struct ShardJob {
    int64_t index;
    ShardPlan plan;
    std::vector<int32_t> ids;
    std::vector<uint8_t> mask;
    std::vector<int64_t> offsets, sample_index;
    std::vector<uint8_t> aux, fin;  // [T, 3H], [T, H] in feat_dt
  };
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::unique_ptr<ShardJob>> queue;
  std::map<int64_t, json> finished;  // shard index -> manifest record, not yet in the manifest
  std::exception_ptr writer_error;
  int64_t next_to_record = done_shards, inflight = 0;
  const int64_t n_writers = std::max<int64_t>(1, std::min<int64_t>(4, int64_t(plan.size()) - done_shards));
  const int64_t max_inflight = n_writers + 1;
  bool closing = false;

  auto write_shard = [&](ShardJob& j) {
    const int64_t T = j.plan.tokens, n = j.plan.count;
    st::Writer w;
    w.add(shard_tensors::input_ids, DType::I32, {T}, j.ids.data(), j.ids.size() * 4);
    w.add(shard_tensors::loss_mask, DType::U8, {T}, j.mask.data(), j.mask.size());
    w.add(shard_tensors::aux_hidden, feat_dt, {T, 3 * H}, j.aux.data(), j.aux.size());
    w.add(shard_tensors::hidden, feat_dt, {T, H}, j.fin.data(), j.fin.size());
    w.add(shard_tensors::sample_offsets, DType::I64, {n + 1}, j.offsets.data(), j.offsets.size() * 8);
    w.add(shard_tensors::sample_index, DType::I64, {n}, j.sample_index.data(), j.sample_index.size() * 8);
    w.set_metadata("format", kFeaturesFormat);
    w.set_metadata("format_version", std::to_string(kFeaturesVersion));
    w.set_metadata("convention", kLayerConvention);
    w.set_metadata("aux_layer_ids", json(aux).dump());
    w.set_metadata("final_layer_id", std::to_string(L));
    size_t bytes = 0;
    const std::string fname = shard_file_name(j.index);
    const std::string sha = w.write(opt.out / fname, &bytes);
    int64_t lt = 0;
    for (auto m : j.mask) lt += m;
    return json{{"file", fname}, {"first_sample", j.plan.first}, {"samples", n}, {"tokens", T},
                {"loss_tokens", lt}, {"bytes", bytes}, {"sha256", sha}};
  };
  auto writer_main = [&](int id) {
    set_thread_log_tag("writer " + std::to_string(id));
    for (;;) {
      std::unique_ptr<ShardJob> job;
      {
        std::unique_lock lk(mu);
        cv.wait(lk, [&] { return !queue.empty() || closing; });
        if (queue.empty()) return;
        job = std::move(queue.front());
        queue.pop_front();
      }
      try {
        json rec = write_shard(*job);
        tlog::debug("wrote {} ({} samples, {} tokens)", rec["file"].get<std::string>(), job->plan.count, job->plan.tokens);
        std::unique_lock lk(mu);
        finished[job->index] = std::move(rec);
        // Record the contiguous prefix of finished shards.
        bool advanced = false;
        while (finished.count(next_to_record)) {
          manifest["shards"].push_back(std::move(finished[next_to_record]));
          finished.erase(next_to_record++);
          advanced = true;
        }
        if (advanced) write_file_atomic(mpath, manifest.dump(2) + "\n");
      } catch (...) {
        std::unique_lock lk(mu);
        if (!writer_error) writer_error = std::current_exception();
      }
      {
        std::unique_lock lk(mu);
        --inflight;
      }
      cv.notify_all();
    }
  };
  std::vector<std::thread> writers;
  for (int64_t i = 0; i < n_writers; ++i) writers.emplace_back(writer_main, int(i));
  auto close_writers = [&] {
    {
      std::unique_lock lk(mu);
      closing = true;
    }
    cv.notify_all();
    for (auto& t : writers) t.join();
    writers.clear();
    if (writer_error) std::rethrow_exception(writer_error);
  };

  bool interrupted = false;
  try {
    for (int64_t si = done_shards; si < int64_t(plan.size()) && !interrupted; ++si) {
      auto job = std::make_unique<ShardJob>();
      job->index = si;
      job->plan = plan[size_t(si)];
      const size_t T = size_t(job->plan.tokens);
      job->ids.reserve(T);
      job->mask.reserve(T);
      job->offsets.push_back(0);
      job->aux.resize(T * size_t(3 * H * esz));
      job->fin.resize(T * size_t(H * esz));
      int64_t s = job->plan.first;
      const int64_t s_end = job->plan.first + job->plan.count;
      while (s < s_end) {
        if (stop_requested()) {
          interrupted = true;
          break;
        }
        // Pack whole samples up to the token budget (a longer sample runs alone).
        batch.clear();
        const int64_t first_in_batch = s;
        while (s < s_end) {
          const Sample& smp = src->at(size_t(s));
          if (batch.n_tokens() > 0 && batch.n_tokens() + int64_t(smp.input_ids.size()) > opt.max_batch_tokens) break;
          batch.add(smp.input_ids.data(), int64_t(smp.input_ids.size()));
          ++s;
        }
        // Captures land directly in the shard: aux = concat(h[a0], h[a1], h[a2]) per row.
        const size_t base = job->ids.size();
        Capture cap;
        cap.layers = cap_layers;
        cap.dtype = feat_dt;
        for (int a = 0; a < 3; ++a) {
          cap.out.push_back(job->aux.data() + (base * size_t(3 * H) + size_t(a * H)) * size_t(esz));
          cap.ld.push_back(3 * H);
        }
        cap.out.push_back(job->fin.data() + base * size_t(H * esz));
        cap.ld.push_back(H);
        model->forward(batch, cap, nullptr);
        for (int64_t k = first_in_batch; k < s; ++k) {
          const Sample& smp = src->at(size_t(k));
          job->ids.insert(job->ids.end(), smp.input_ids.begin(), smp.input_ids.end());
          job->mask.insert(job->mask.end(), smp.loss_mask.begin(), smp.loss_mask.end());
          job->offsets.push_back(int64_t(job->ids.size()));
          job->sample_index.push_back(k);
        }
        progress.advance(batch.n_tokens());
      }
      if (interrupted) break;  // the unfinished shard is dropped; a resume recomputes it
      {
        std::unique_lock lk(mu);
        cv.wait(lk, [&] { return inflight < max_inflight || writer_error; });
        if (writer_error) break;
        ++inflight;
        queue.push_back(std::move(job));
      }
      cv.notify_all();
      written_this_run += plan[size_t(si)].tokens;
      if (opt.stop_after_shards >= 0 && si + 1 - done_shards >= opt.stop_after_shards && si + 1 < int64_t(plan.size()))
        request_stop_for_test();
    }
  } catch (...) {
    try {
      close_writers();
    } catch (...) {
    }
    throw;
  }
  close_writers();  // drains: every finished shard is written and recorded
  progress.finish();
  if (interrupted) {
    rep.status = ExtractStatus::Interrupted;
    rep.shards = int64_t(manifest["shards"].size());
    rep.tokens_this_run = written_this_run;
    rep.seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
    return rep;
  }

  int64_t ns = 0, nt = 0, nl = 0;
  for (auto& s : manifest["shards"]) {
    ns += s["samples"].get<int64_t>();
    nt += s["tokens"].get<int64_t>();
    nl += s["loss_tokens"].get<int64_t>();
  }
  manifest["status"] = "complete";
  manifest["num_samples"] = ns;
  manifest["num_tokens"] = nt;
  manifest["num_loss_tokens"] = nl;
  manifest["num_shards"] = manifest["shards"].size();
  write_file_atomic(mpath, manifest.dump(2) + "\n");
  rep.status = ExtractStatus::Complete;
  rep.samples = ns;
  rep.tokens = nt;
  rep.loss_tokens = nl;
  rep.shards = int64_t(manifest["shards"].size());
  rep.tokens_this_run = written_this_run;
  rep.seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
  const double run_s = std::chrono::duration<double>(Clock::now() - t_run).count();
  tlog::info("extract: {} tokens in {:.2f}s ({:.0f} tok/s); {}", written_this_run, run_s,
             run_s > 0 ? double(written_this_run) / run_s : 0.0, format_mem(mem_usage()));
  return rep;
}

}  // namespace talon
