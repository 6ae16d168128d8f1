// `talon extract`, resume: the output directory of a job. A new directory gets the job's
// manifest; an existing one must hold the same job (the pinned fields of the manifest
// agree) and its written shards are kept: those the manifest lists (strict: they must
// match the plan and the files) and those of every rank's progress file (used when they
// check out). The manifest only ever lists a contiguous prefix of finished shards.
#include <chrono>
#include <thread>

#include "data/extract_internal.h"
#include "data/features.h"
#include "util/error.h"
#include "util/file.h"
#include "util/log.h"
#include "util/signals.h"

namespace talon::extract {

namespace {

// The fields a resumed run must agree on.
const char* kPinned[] = {"format_version", "model_config_sha256", "model_weights_fingerprint", "input_sha256",
                         "aux_layer_ids", "final_layer_id", "dtype", "shard_tokens", "hidden_size"};

// Files a run of this job may leave besides shards.
bool ours(const std::string& n) {
  return n.rfind(".talon", 0) == 0 || n.find(".tmp-") != std::string::npos || n.rfind("progress.rank-", 0) == 0;
}

DirLock lock_dir(const fs::path& out, const RankInfo& rk, const std::vector<int>& gpus) {
  fs::create_directories(out);
  json rec = run_record("extract", gpus);
  rec["rank"] = rk.rank;
  rec["world"] = rk.world;
  return DirLock(out, rec, rk.world > 1 ? fmt::format(".talon.rank-{}.lock", rk.rank) : ".talon.lock");
}

}  // namespace

OutputDir::OutputDir(const fs::path& out, const RankInfo& rk, const Plan& plan, const std::vector<int>& gpus)
    : out_(out),
      rk_(rk),
      multi_(rk.world > 1),
      shards_(plan.shards),
      my_progress_(out / fmt::format("progress.rank-{}.json", rk.rank)),
      mpath_(out / kManifestName),
      lock_(lock_dir(out, rk, gpus)) {
  bool have = fs::exists(mpath_);
  if (!have) {
    bool foreign = false;
    for (auto& e : fs::directory_iterator(out_)) foreign = foreign || !ours(e.path().filename().string());
    // Another rank may have created the manifest (and begun writing shards) since the check
    // above: with several ranks, that is the manifest to join, not a foreign directory.
    if (foreign && multi_ && fs::exists(mpath_)) have = true;
    else if (foreign)
      fail("{}: directory is not empty and has no {}; refusing to write into it", out_.string(), kManifestName);
  }
  if (have) {
    manifest_ = read_manifest(out_);
    std::vector<std::string> diffs;
    for (const char* k : kPinned)
      if (manifest_.value(k, json()) != plan.want.at(k))
        diffs.push_back(
            fmt::format("{}: existing {} vs now {}", k, manifest_.value(k, json()).dump(), plan.want.at(k).dump()));
    if (!diffs.empty())
      fail("{}: holds a different extraction ({}); use another --out or delete it", out_.string(),
           fmt::format("{}", fmt::join(diffs, "; ")));
  } else {
    // Any rank may create it (ranks start in any order); concurrent creators write the
    // same pinned fields, atomically.
    manifest_ = plan.want;
    manifest_["status"] = "in_progress";
    manifest_["shards"] = json::array();
    write_file_atomic(mpath_, manifest_.dump(2) + "\n");
  }
  // Temp files of a killed run. With several ranks only this rank's own progress file
  // (other ranks may be writing theirs); a stale shard temp is overwritten when redone.
  for (auto& e : fs::directory_iterator(out_)) {
    const std::string n = e.path().filename().string();
    if (n.find(".tmp-") != std::string::npos && (!multi_ || n.rfind(my_progress_.filename().string(), 0) == 0))
      fs::remove(e.path());
  }
  for (size_t i = 0; i < shards_.size(); ++i) index_of_first_[shards_[i].first] = int64_t(i);
  const json& ms = manifest_["shards"];
  TALON_CHECK(ms.size() <= shards_.size(), "{}: manifest lists {} shards but the plan has {}", mpath_.string(),
              ms.size(), shards_.size());
  for (size_t i = 0; i < ms.size(); ++i) {
    const json& s = ms[i];
    const fs::path p = out_ / s.at("file").get<std::string>();
    TALON_CHECK(s.at("file") == shard_file_name(int64_t(i)) && s.at("first_sample") == shards_[i].first &&
                    s.at("samples") == shards_[i].count,
                "{}: shard {} does not match the plan; the dataset is inconsistent, use a fresh --out", mpath_.string(),
                i);
    TALON_CHECK(fs::exists(p) && int64_t(fs::file_size(p)) == s.at("bytes").get<int64_t>(),
                "{}: missing or wrong size although the manifest lists it; run `talon inspect {}`", p.string(),
                out_.string());
    if (!complete()) verify_shard(out_, s, i);  // kept shards are checksummed
    done_[int64_t(i)] = s;
  }
  read_progress(done_, multi_ ? &my_records_ : nullptr);
  next_to_record_ = int64_t(manifest_["shards"].size());
}

// Valid records of every rank's progress file go into `into`; those of this rank's own
// file also into `mine` when given.
void OutputDir::read_progress(std::map<int64_t, json>& into, json* mine) const {
  for (auto& e : fs::directory_iterator(out_)) {
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
      auto it = index_of_first_.find(r["first_sample"].get<int64_t>());
      if (it == index_of_first_.end()) continue;
      const int64_t i = it->second;
      std::error_code ec;
      const fs::path p = out_ / shard_file_name(i);
      if (r.value("file", "") == shard_file_name(i) && r.value("samples", int64_t(-1)) == shards_[size_t(i)].count &&
          r.contains("bytes") && r["bytes"].is_number_integer() && fs::exists(p, ec) &&
          int64_t(fs::file_size(p, ec)) == r["bytes"].get<int64_t>()) {
        into.emplace(i, r);
        if (mine && e.path().filename() == my_progress_.filename()) mine->push_back(r);
      }
    }
  }
}

void OutputDir::record(int64_t shard, json rec) {
  if (multi_) {
    // This rank's own record of finished shards; rank 0 merges them at the end.
    my_records_.push_back(rec);
    done_[shard] = std::move(rec);
    write_file_atomic(my_progress_,
                      json{{"rank", rk_.rank}, {"world", rk_.world}, {"shards", my_records_}}.dump(1) + "\n");
    return;
  }
  finished_[shard] = std::move(rec);
  // Record the contiguous prefix of finished shards (some may be done already, from the
  // progress files of an earlier multi-rank run).
  bool advanced = false;
  for (;;) {
    auto it = finished_.find(next_to_record_);
    auto dt = done_.find(next_to_record_);
    if (it == finished_.end() && dt == done_.end()) break;
    manifest_["shards"].push_back(it != finished_.end() ? it->second : dt->second);
    if (it != finished_.end()) {
      done_[next_to_record_] = it->second;
      finished_.erase(it);
    }
    ++next_to_record_;
    advanced = true;
  }
  if (advanced) write_file_atomic(mpath_, manifest_.dump(2) + "\n");
}

bool OutputDir::collect_ranks() {
  using Clock = std::chrono::steady_clock;
  const auto tw = Clock::now();
  double last_note = -1;
  for (;;) {
    std::map<int64_t, json> all = done_;
    read_progress(all, nullptr);
    if (all.size() == shards_.size()) {
      done_ = std::move(all);
      break;
    }
    if (stop_requested()) return false;
    const double waited = std::chrono::duration<double>(Clock::now() - tw).count();
    if (waited - last_note >= 30 || last_note < 0) {
      tlog::info("waiting for the other ranks: {} of {} shards written", all.size(), shards_.size());
      last_note = waited;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  manifest_["shards"] = json::array();
  for (auto& [i, r] : done_) manifest_["shards"].push_back(r);
  return true;
}

void OutputDir::finish() {
  TALON_CHECK(manifest_["shards"].size() == shards_.size(), "{}: {} of {} shards recorded at the end (internal error)",
              mpath_.string(), manifest_["shards"].size(), shards_.size());
  int64_t ns = 0, nt = 0, nl = 0;
  for (auto& s : manifest_["shards"]) {
    ns += s["samples"].get<int64_t>();
    nt += s["tokens"].get<int64_t>();
    nl += s["loss_tokens"].get<int64_t>();
  }
  manifest_["status"] = "complete";
  manifest_["num_samples"] = ns;
  manifest_["num_tokens"] = nt;
  manifest_["num_loss_tokens"] = nl;
  manifest_["num_shards"] = manifest_["shards"].size();
  write_file_atomic(mpath_, manifest_.dump(2) + "\n");
  for (auto& e : fs::directory_iterator(out_)) {  // folded into the manifest now
    const std::string n = e.path().filename().string();
    if (n.rfind("progress.rank-", 0) == 0) fs::remove(e.path());
  }
}

}  // namespace talon::extract
