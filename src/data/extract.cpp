#include "data/extract.h"

#include <fcntl.h>
#include <omp.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "data/features.h"
#include "data/samples.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "util/threads.h"
#include "util/dtype.h"
#include "util/error.h"
#include "util/log.h"
#include "util/mem.h"
#include "util/progress.h"
#include "util/runs.h"
#include "util/signals.h"

namespace talon {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {


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
  const DeviceSpec dev = parse_device(opt.device, opt.share_gpus);
  if (dev.cuda && !cuda_backend_built())
    fail("--device {}: this build has no CUDA backend (nvcc was not found when it was configured); use --device cpu",
         opt.device);
  TALON_CHECK(opt.tp >= 1 && opt.ep >= 1 && opt.dp >= 0, "--tp and --ep must be >= 1 and --dp >= 0 (got {}, {} and {})",
              opt.tp, opt.ep, opt.dp);
  TALON_CHECK(opt.tp == 1 || opt.ep == 1, "--tp {} and --ep {}: a replica is either tensor or expert parallel", opt.tp,
              opt.ep);
  TALON_CHECK(dev.cuda || (opt.tp == 1 && opt.ep == 1 && opt.dp <= 1), "--tp/--ep/--dp need --device cuda");
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
  // Model replicas: data parallel groups of tp devices each, loaded concurrently.
  std::vector<std::vector<int>> groups;
  if (dev.cuda) {
    std::vector<int> devs = dev.devices;
    if (devs.empty()) {
      const auto gpus = list_gpus();
      TALON_CHECK(!gpus.empty(), "--device {}: no CUDA device available", opt.device);
      for (auto& g : gpus) devs.push_back(g.index);
    }
    const int per = opt.tp * opt.ep;
    int dp = opt.dp > 0 ? opt.dp : int(devs.size()) / per;
    TALON_CHECK(dp >= 1 && int64_t(dp) * per <= int64_t(devs.size()),
                "--{} {} x --dp {} needs {} GPUs but --device {} gives {}", opt.ep > 1 ? "ep" : "tp", per,
                std::max(dp, 1), std::max(dp, 1) * per, opt.device, devs.size());
    for (int g = 0; g < dp; ++g) groups.emplace_back(devs.begin() + g * per, devs.begin() + (g + 1) * per);
  } else {
    groups.push_back({});
  }
  std::vector<std::unique_ptr<Model>> models(groups.size());
  run_threads(int(groups.size()), [&](int gi) {
    const size_t g = size_t(gi);
    if (!dev.cuda) {
      models[g] = make_cpu_model(*ckpt);
      return;
    }
    set_thread_log_tag(fmt::format("gpu {}", groups[g][0]));
    GpuOptions go;
    go.devices = groups[g];
    go.tp = opt.tp;
    go.ep = opt.ep;
    go.share_devices = opt.share_gpus;
    go.max_tokens = opt.max_batch_tokens;
    go.n_capture = int64_t(aux.size()) + 1;
    go.capture_dtype = opt.fp32 ? DType::F32 : DType::BF16;
    models[g] = make_cuda_model(*ckpt, go);
  });
  Model* model = models[0].get();
  rep.load_seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
  tlog::info("model {} ({}, L={}, H={}, V={}) loaded in {:.2f}s on {}{}", opt.model.string(), arch_name(cfg.arch), L, H,
             cfg.vocab, rep.load_seconds, model->backend(),
             dev.cuda ? fmt::format(" x {} data-parallel replica(s)", models.size())
                      : fmt::format(" with {} threads", omp_get_max_threads()));
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

  // Output directory: new, or a run of the same job to resume. With several ranks
  // (processes, usually one per node, sharing the directory), every rank records its finished shards in progress.rank-R.json, and rank
  // 0 folds them into the manifest once the whole plan is covered.
  const RankInfo rk = resolve_rank(opt.rank, opt.world);
  const bool multi = rk.world > 1;
  const std::string tag_prefix = multi ? fmt::format("rank {} ", rk.rank) : "";
  if (multi) {
    set_thread_log_tag(fmt::format("rank {}", rk.rank));
    tlog::info("rank {} of {} ({}); this rank computes work units u with u % {} == {}", rk.rank, rk.world, rk.source,
               rk.world, rk.rank);
  }
  const std::string lock_name = multi ? fmt::format(".talon.rank-{}.lock", rk.rank) : ".talon.lock";
  const fs::path my_progress = opt.out / fmt::format("progress.rank-{}.json", rk.rank);
  fs::create_directories(opt.out);
  std::vector<int> all_gpus;
  for (auto& g : groups) all_gpus.insert(all_gpus.end(), g.begin(), g.end());
  json rec = run_record("extract", all_gpus);
  rec["rank"] = rk.rank;
  rec["world"] = rk.world;
  DirLock lock(opt.out, rec, lock_name);
  json manifest;
  const fs::path mpath = opt.out / kManifestName;
  auto check_pinned = [&] {
    std::vector<std::string> diffs;
    for (const char* k : kPinned)
      if (manifest.value(k, json()) != want[k])
        diffs.push_back(fmt::format("{}: existing {} vs now {}", k, manifest.value(k, json()).dump(), want[k].dump()));
    if (!diffs.empty())
      fail("{}: holds a different extraction ({}); use another --out or delete it", opt.out.string(),
           fmt::format("{}", fmt::join(diffs, "; ")));
  };
  auto ours = [](const std::string& n) {  // files a run of this job may leave besides shards
    return n.rfind(".talon", 0) == 0 || n.find(".tmp-") != std::string::npos || n.rfind("progress.rank-", 0) == 0;
  };
  if (fs::exists(mpath)) {
    manifest = read_manifest(opt.out);
    check_pinned();
  } else {
    // Any rank may create it (ranks start in any order); concurrent creators write the
    // same pinned fields, atomically.
    for (auto& e : fs::directory_iterator(opt.out))
      if (!ours(e.path().filename().string()))
        fail("{}: directory is not empty and has no {}; refusing to write into it", opt.out.string(), kManifestName);
    manifest = want;
    manifest["status"] = "in_progress";
    manifest["shards"] = json::array();
    write_file_atomic(mpath, manifest.dump(2) + "\n");
  }
  // Temp files of a killed run. With several ranks only this rank's own progress file
  // (other ranks may be writing theirs); a stale shard temp is overwritten when redone.
  for (auto& e : fs::directory_iterator(opt.out)) {
    const std::string n = e.path().filename().string();
    if (n.find(".tmp-") != std::string::npos && (!multi || n.rfind(my_progress.filename().string(), 0) == 0))
      fs::remove(e.path());
  }
  std::map<int64_t, int64_t> index_of_first;  // first sample -> shard index
  for (size_t i = 0; i < plan.size(); ++i) index_of_first[plan[i].first] = int64_t(i);
  // Finished shards: the manifest's records (strict: they must match the plan and the
  // files) and the records of every rank's progress file (used when they check out).
  std::map<int64_t, json> done;
  {
    const json& ms = manifest["shards"];
    TALON_CHECK(ms.size() <= plan.size(), "{}: manifest lists {} shards but the plan has {}", mpath.string(), ms.size(),
                plan.size());
    for (size_t i = 0; i < ms.size(); ++i) {
      const json& s = ms[i];
      const fs::path p = opt.out / s.at("file").get<std::string>();
      TALON_CHECK(s.at("file") == shard_file_name(int64_t(i)) && s.at("first_sample") == plan[i].first &&
                      s.at("samples") == plan[i].count,
                  "{}: shard {} does not match the plan; the dataset is inconsistent, use a fresh --out", mpath.string(),
                  i);
      TALON_CHECK(fs::exists(p) && int64_t(fs::file_size(p)) == s.at("bytes").get<int64_t>(),
                  "{}: missing or wrong size although the manifest lists it; run `talon inspect {}`", p.string(),
                  opt.out.string());
      if (manifest.value("status", "") != "complete") verify_shard(opt.out, s, i);  // kept shards are checksummed
      done[int64_t(i)] = s;
    }
  }
  // Valid records of every rank's progress file go into `into`; those of this rank's
  // own file also into `mine` when given.
  auto read_progress = [&](std::map<int64_t, json>& into, json* mine) {
    for (auto& e : fs::directory_iterator(opt.out)) {
      const std::string n = e.path().filename().string();
      if (n.rfind("progress.rank-", 0) != 0 || e.path().extension() != ".json" || n.find(".tmp-") != std::string::npos)
        continue;
      json j = json::parse(read_text_file(e.path()), nullptr, false);
      if (!j.is_object() || !j.contains("shards") || !j["shards"].is_array()) {
        tlog::warn("{}: not a progress file; ignored", e.path().string());
        continue;
      }
      for (auto& r : j["shards"]) {
        if (!r.is_object() || !r.contains("first_sample") || !r["first_sample"].is_number_integer()) continue;
        auto it = index_of_first.find(r["first_sample"].get<int64_t>());
        if (it == index_of_first.end()) continue;
        const int64_t i = it->second;
        std::error_code ec;
        const fs::path p = opt.out / shard_file_name(i);
        if (r.value("file", "") == shard_file_name(i) && r.value("samples", int64_t(-1)) == plan[size_t(i)].count &&
            r.contains("bytes") && r["bytes"].is_number_integer() && fs::exists(p, ec) &&
            int64_t(fs::file_size(p, ec)) == r["bytes"].get<int64_t>()) {
          into.emplace(i, r);
          if (mine && e.path().filename() == my_progress.filename()) mine->push_back(r);
        }
      }
    }
  };
  json my_records = json::array();  // this rank's progress file content
  read_progress(done, multi ? &my_records : nullptr);
  rep.aux_layers = aux;
  rep.final_layer = int(L);
  rep.manifest = mpath;
  if (manifest.value("status", "") == "complete") {
    rep.status = ExtractStatus::AlreadyComplete;
    rep.samples = manifest.value("num_samples", 0);
    rep.tokens = manifest.value("num_tokens", 0);
    rep.loss_tokens = manifest.value("num_loss_tokens", 0);
    rep.shards = int64_t(done.size());
    tlog::info("{} is already complete ({} samples); nothing to do", opt.out.string(), rep.samples);
    return rep;
  }
  const int64_t done_shards = int64_t(done.size());

  // Work units: runs of consecutive shards holding at least 4 batches' worth of tokens,
  // so batches fill the token budget even when shards are small. Unit boundaries are
  // fixed by the plan alone (never by where a resume starts or by the number of ranks),
  // so every unit is always computed in the same batches and a resumed dataset is
  // byte-identical; a unit with some shards already written is recomputed, but only its
  // missing shards are written.
  std::vector<std::pair<int64_t, int64_t>> units;  // [first shard, end shard) this rank computes
  int64_t total_tokens = 0, done_tokens = 0, my_tokens = 0;
  {
    const int64_t target = 4 * opt.max_batch_tokens;
    int64_t b = 0, tok = 0, u = 0;
    for (int64_t si = 0; si < int64_t(plan.size()); ++si) {
      tok += plan[size_t(si)].tokens;
      if (tok >= target || si + 1 == int64_t(plan.size())) {
        bool missing = false;
        for (int64_t k = b; k <= si; ++k) missing |= !done.count(k);
        if (missing && u % rk.world == rk.rank) {
          units.push_back({b, si + 1});
          my_tokens += tok;
        }
        b = si + 1;
        tok = 0;
        ++u;
      }
    }
  }
  for (size_t i = 0; i < plan.size(); ++i) {
    total_tokens += plan[i].tokens;
    if (done.count(int64_t(i))) done_tokens += plan[i].tokens;
  }
  if (done_shards > 0)
    tlog::info("resuming: {} of {} shards already written ({} tokens)", done_shards, plan.size(), done_tokens);

  Progress progress("extract", multi ? my_tokens : total_tokens, "tok", multi ? 0 : total_tokens - my_tokens);
  std::vector<int> cap_layers = aux;
  cap_layers.push_back(int(L));
  const int64_t esz = int64_t(dtype_size(feat_dt));
  std::atomic<int64_t> written_this_run{0}, n_batches{0}, batch_tokens{0};
  const auto t_run = Clock::now();

  // Pipeline: one compute thread per model replica takes the next work unit (a run of
  // shards), runs its samples in length-sorted batches and leaves the features in the
  // unit's buffer (page-locked on GPUs: the device copies into it asynchronously while
  // it computes). A small pool of writer threads hashes, writes and fsyncs the unit's
  // shards. Buffers come from a fixed pool, so a slow disk stalls compute instead of
  // growing memory (back-pressure). The manifest only ever lists a contiguous prefix
  // of finished shards, so a resume recomputes exactly the ones not listed.
  struct UnitBuf {
    std::shared_ptr<uint8_t> mem;
    std::function<void(std::shared_ptr<uint8_t>)> back;
    UnitBuf(std::shared_ptr<uint8_t> m, std::function<void(std::shared_ptr<uint8_t>)> b)
        : mem(std::move(m)), back(std::move(b)) {}
    ~UnitBuf() {
      if (mem) back(std::move(mem));
    }
  };
  struct ShardJob {
    int64_t index;
    ShardPlan plan;
    std::vector<int32_t> ids;
    std::vector<uint8_t> mask;
    std::vector<int64_t> offsets, sample_index;
    std::shared_ptr<UnitBuf> unit;  // holds the memory aux/fin point into
    uint8_t *aux = nullptr, *fin = nullptr;  // [T, 3H] and [T, H] rows in feat_dt
  };
  int64_t max_unit_tokens = 0;
  for (auto& u : units) {
    int64_t t = 0;
    for (int64_t si = u.first; si < u.second; ++si) t += plan[size_t(si)].tokens;
    max_unit_tokens = std::max(max_unit_tokens, t);
  }
  const size_t buf_bytes = size_t(max_unit_tokens) * size_t(4 * H * esz);
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::unique_ptr<ShardJob>> queue;
  std::vector<std::shared_ptr<uint8_t>> free_bufs;
  std::map<int64_t, json> finished;  // shard index -> manifest record, not yet in the manifest
  std::exception_ptr failure;
  std::atomic<bool> failed{false};  // mirrors `failure` for the compute loop (read without the lock)
  int64_t next_to_record = int64_t(manifest["shards"].size());
  const int64_t n_writers = std::max<int64_t>(1, std::min<int64_t>(4, int64_t(plan.size()) - done_shards));
  const int64_t max_bufs = 2 * int64_t(models.size()) + 1;
  bool closing = false;
  std::atomic<int64_t> next_unit{0}, shards_queued{0};
  // A unit's buffer goes back to the pool when its last shard is written (or dropped).
  std::function<void(std::shared_ptr<uint8_t>)> give_back = [&](std::shared_ptr<uint8_t> mem) {
    {
      std::unique_lock lk(mu);
      free_bufs.push_back(std::move(mem));
    }
    cv.notify_all();
  };
  std::atomic<bool> interrupted{false};

  // Where the time goes, per replica: forward passes vs waiting for a free shard buffer
  // (i.e. for the writers); and the writers' busy time.
  std::vector<double> t_forward(models.size(), 0.0), t_wait(models.size(), 0.0);
  std::atomic<int64_t> writer_us{0};
  auto secs_since = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
  auto write_shard = [&](ShardJob& j) {
    const int64_t T = j.plan.tokens, n = j.plan.count;
    st::Writer w;
    w.add(shard_tensors::input_ids, DType::I32, {T}, j.ids.data(), j.ids.size() * 4);
    w.add(shard_tensors::loss_mask, DType::U8, {T}, j.mask.data(), j.mask.size());
    w.add(shard_tensors::aux_hidden, feat_dt, {T, 3 * H}, j.aux, size_t(T * 3 * H * esz));
    w.add(shard_tensors::hidden, feat_dt, {T, H}, j.fin, size_t(T * H * esz));
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
    set_thread_log_tag(tag_prefix + "writer " + std::to_string(id));
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
        const auto tw = Clock::now();
        json rec = write_shard(*job);
        writer_us += int64_t(secs_since(tw) * 1e6);
        tlog::debug("wrote {} ({} samples, {} tokens)", rec["file"].get<std::string>(), job->plan.count, job->plan.tokens);
        std::unique_lock lk(mu);
        if (multi) {
          // This rank's own record of finished shards; rank 0 merges them at the end.
          my_records.push_back(rec);
          done[job->index] = std::move(rec);
          write_file_atomic(my_progress,
                            json{{"rank", rk.rank}, {"world", rk.world}, {"shards", my_records}}.dump(1) + "\n");
        } else {
          finished[job->index] = std::move(rec);
          // Record the contiguous prefix of finished shards (some may be done already,
          // from the progress files of an earlier multi-rank run).
          bool advanced = false;
          for (;;) {
            auto it = finished.find(next_to_record);
            auto dt = done.find(next_to_record);
            if (it == finished.end() && dt == done.end()) break;
            manifest["shards"].push_back(it != finished.end() ? it->second : dt->second);
            if (it != finished.end()) {
              done[next_to_record] = it->second;
              finished.erase(it);
            }
            ++next_to_record;
            advanced = true;
          }
          if (advanced) write_file_atomic(mpath, manifest.dump(2) + "\n");
        }
      } catch (...) {
        std::unique_lock lk(mu);
        if (!failure) failure = std::current_exception();
        failed = true;
      }
      job.reset();  // may hand the unit's buffer back (takes the lock itself)
      cv.notify_all();
    }
  };

  // Batches within a shard: samples sorted by length (longest first), each batch
  // filled first-fit up to the token budget; a sample longer than the budget runs
  // alone. Batches are packed without padding; captures are scattered back to the
  // samples' places in the shard.
  // Work units: runs of consecutive shards holding at least 4 batches' worth of tokens,
  // so batches fill the token budget even when shards are small. Unit boundaries are
  // fixed by the plan alone (never by where a resume starts), so every unit is always
  // computed in the same batches and a resumed dataset is byte-identical; a resume
  // recomputes the unit holding the first unrecorded shard but writes only the
  // unrecorded shards.
  auto compute_main = [&](size_t g) {
    Model& m = *models[g];
    set_thread_log_tag(tag_prefix + (groups[g].empty() ? std::string("compute") : fmt::format("gpu {}", groups[g][0])));
    Batch batch;
    for (;;) {
      if (stop_requested()) {
        interrupted = true;
        return;
      }
      const int64_t ui = next_unit++;
      if (ui >= int64_t(units.size())) return;
      const int64_t s_begin = units[size_t(ui)].first, s_end = units[size_t(ui)].second;
      std::shared_ptr<UnitBuf> ub;
      {
        const auto tw = Clock::now();
        std::unique_lock lk(mu);
        cv.wait(lk, [&] { return !free_bufs.empty() || failure; });
        t_wait[g] += secs_since(tw);
        if (failure) return;
        std::shared_ptr<uint8_t> mem = std::move(free_bufs.back());
        free_bufs.pop_back();
        lk.unlock();
        ub = std::make_shared<UnitBuf>(std::move(mem), give_back);
      }
      const int64_t first = plan[size_t(s_begin)].first;
      const int64_t last = plan[size_t(s_end - 1)].first + plan[size_t(s_end - 1)].count;
      int64_t T = 0;
      for (int64_t si = s_begin; si < s_end; ++si) T += plan[size_t(si)].tokens;
      uint8_t* aux_base = ub->mem.get();
      uint8_t* fin_base = aux_base + size_t(T * 3 * H * esz);
      // Unit-wide token offsets of every sample.
      const int64_t n = last - first;
      std::vector<int64_t> off(static_cast<size_t>(n + 1), 0);
      for (int64_t k = 0; k < n; ++k) off[size_t(k + 1)] = off[size_t(k)] + int64_t(src->at(size_t(first + k)).input_ids.size());
      std::vector<int64_t> order(static_cast<size_t>(n));
      for (int64_t k = 0; k < n; ++k) order[size_t(k)] = k;
      auto len = [&](int64_t k) { return off[size_t(k + 1)] - off[size_t(k)]; };
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return len(a) > len(b); });
      std::vector<bool> taken(static_cast<size_t>(n), false);
      size_t head = 0;
      bool stopped = false;
      while (head < order.size()) {
        if (stop_requested() || failed) {  // a signal, or a writer failed (e.g. the disk is full)
          stopped = true;
          break;
        }
        batch.clear();
        Capture cap;
        cap.layers = cap_layers;
        cap.dtype = feat_dt;
        for (int a = 0; a < 3; ++a) {
          cap.out.push_back(aux_base + size_t(a * H * esz));
          cap.ld.push_back(3 * H);
        }
        cap.out.push_back(fin_base);
        cap.ld.push_back(H);
        for (size_t i = head; i < order.size(); ++i) {
          const int64_t k = order[i];
          if (taken[size_t(k)]) continue;
          if (batch.n_tokens() > 0 && batch.n_tokens() + len(k) > opt.max_batch_tokens) continue;
          batch.add(src->at(size_t(first + k)).input_ids.data(), len(k));
          cap.seq_dst.push_back(off[size_t(k)]);
          taken[size_t(k)] = true;
          if (batch.n_tokens() >= opt.max_batch_tokens) break;
        }
        while (head < order.size() && taken[size_t(order[head])]) ++head;
        const auto tf = Clock::now();
        m.forward(batch, cap, nullptr);
        t_forward[g] += secs_since(tf);
        n_batches++;
        batch_tokens += batch.n_tokens();
        progress.advance(batch.n_tokens());
      }
      if (stopped) {  // the unfinished unit is dropped (its buffer goes back); a resume recomputes it
        interrupted = true;
        return;
      }
      // One writer job per shard of the unit not recorded yet.
      std::vector<std::unique_ptr<ShardJob>> jobs;
      std::vector<int64_t> missing;
      {
        std::unique_lock lk(mu);
        for (int64_t si = s_begin; si < s_end; ++si)
          if (!done.count(si)) missing.push_back(si);
      }
      for (int64_t si : missing) {
        const ShardPlan& sp = plan[size_t(si)];
        auto job = std::make_unique<ShardJob>();
        job->index = si;
        job->plan = sp;
        job->unit = ub;
        const int64_t r0 = off[size_t(sp.first - first)];
        job->aux = aux_base + size_t(r0 * 3 * H * esz);
        job->fin = fin_base + size_t(r0 * H * esz);
        job->offsets.assign(1, 0);
        for (int64_t k = sp.first; k < sp.first + sp.count; ++k) {
          const Sample& smp = src->at(size_t(k));
          job->ids.insert(job->ids.end(), smp.input_ids.begin(), smp.input_ids.end());
          job->mask.insert(job->mask.end(), smp.loss_mask.begin(), smp.loss_mask.end());
          job->offsets.push_back(int64_t(job->ids.size()));
          job->sample_index.push_back(k);
        }
        written_this_run += sp.tokens;
        jobs.push_back(std::move(job));
      }
      ub.reset();  // the jobs hold the buffer now
      {
        std::unique_lock lk(mu);
        for (auto& j : jobs) queue.push_back(std::move(j));
      }
      cv.notify_all();
      shards_queued += int64_t(missing.size());
      if (opt.stop_after_shards >= 0 && shards_queued >= opt.stop_after_shards && ui + 1 < int64_t(units.size()))
        request_stop_for_test();
    }
  };

  // Page-locked buffers take ~0.3 s per GB to allocate: one thread makes them while
  // the first units compute, instead of the compute threads stalling on each.
  std::thread allocator([&] {
    try {
      for (int64_t i = 0; i < max_bufs && !units.empty(); ++i) {
        auto mem = models[size_t(i) % models.size()]->host_buffer(buf_bytes);
        {
          std::unique_lock lk(mu);
          if (failure) break;
          free_bufs.push_back(std::move(mem));
        }
        cv.notify_all();
      }
    } catch (...) {
      std::unique_lock lk(mu);
      if (!failure) failure = std::current_exception();
        failed = true;
      cv.notify_all();
    }
  });
  std::vector<std::thread> writers, computers;
  for (int64_t i = 0; i < n_writers; ++i) writers.emplace_back(writer_main, int(i));
  for (size_t g = 0; g < models.size(); ++g)
    computers.emplace_back([&, g] {
      try {
        compute_main(g);
      } catch (...) {
        std::unique_lock lk(mu);
        if (!failure) failure = std::current_exception();
        failed = true;
        cv.notify_all();
      }
    });
  for (auto& t : computers) t.join();
  allocator.join();
  {
    std::unique_lock lk(mu);
    closing = true;
  }
  cv.notify_all();
  for (auto& t : writers) t.join();  // drains: every finished shard is written and recorded
  if (failure) std::rethrow_exception(failure);
  progress.finish();
  if (n_batches > 0)
    tlog::info("batches: {} of mean {:.0f} tokens ({:.1f}% of --max-batch-tokens {}; packed, no padding)",
               n_batches.load(), double(batch_tokens) / double(n_batches.load()),
               100.0 * double(batch_tokens) / double(n_batches.load()) / double(opt.max_batch_tokens),
               opt.max_batch_tokens);
  const double wall = secs_since(t_run);
  for (size_t g = 0; g < models.size(); ++g)
    tlog::info("{}: forward {:.2f}s, waited {:.2f}s for writers, of {:.2f}s", models[g]->backend(), t_forward[g],
               t_wait[g], wall);
  tlog::info("writers: {} threads busy {:.2f}s in total (hash + write + fsync)", n_writers, double(writer_us) / 1e6);
  auto interrupted_report = [&] {
    rep.status = ExtractStatus::Interrupted;
    rep.shards = int64_t(done.size());
    rep.tokens_this_run = written_this_run;
    rep.seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
    return rep;
  };
  if (interrupted) return interrupted_report();
  if (multi && rk.rank != 0) {
    rep.status = ExtractStatus::RankDone;
    rep.shards = int64_t(my_records.size());
    rep.tokens_this_run = written_this_run;
    rep.seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
    tlog::info("rank {}: all its work units are written ({} tokens this run); rank 0 completes the manifest", rk.rank,
               int64_t(written_this_run));
    return rep;
  }
  if (multi) {
    // Rank 0: wait until the ranks' progress files cover the whole plan, then fold them
    // into the manifest in shard order.
    const auto tw = Clock::now();
    double last_note = -1;
    for (;;) {
      std::map<int64_t, json> all = done;
      read_progress(all, nullptr);
      if (all.size() == plan.size()) {
        done = std::move(all);
        break;
      }
      if (stop_requested()) return interrupted_report();
      const double waited = secs_since(tw);
      if (waited - last_note >= 30 || last_note < 0) {
        tlog::info("waiting for the other ranks: {} of {} shards written", all.size(), plan.size());
        last_note = waited;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    manifest["shards"] = json::array();
    for (auto& [i, r] : done) manifest["shards"].push_back(r);
  }
  TALON_CHECK(manifest["shards"].size() == plan.size(), "{}: {} of {} shards recorded at the end (internal error)",
              mpath.string(), manifest["shards"].size(), plan.size());

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
  for (auto& e : fs::directory_iterator(opt.out)) {  // folded into the manifest now
    const std::string n = e.path().filename().string();
    if (n.rfind("progress.rank-", 0) == 0) fs::remove(e.path());
  }
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
