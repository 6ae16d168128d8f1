// Internal: the steps of `talon extract`, which run_extract (extract.cpp) runs in order:
//   plan     (extract_plan.cpp)      what the job is: its shards, its pinned identity, the
//                                    work units this rank computes
//   resume   (extract_resume.cpp)    the output directory: its lock, its manifest, which
//                                    shards are already written, refusing a changed job
//   pipeline (extract_pipeline.cpp)  the allocator, compute and writer threads
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "data/extract.h"
#include "util/dist.h"
#include "util/dtype.h"
#include "util/runs.h"

namespace talon {

class Checkpoint;
class Model;
class SampleSource;

namespace extract {

using json = nlohmann::json;

// ---------------------------------------------------------------- plan
// A shard: samples [first, first + count) holding `tokens` tokens.
struct ShardPlan {
  int64_t first, count, tokens;
};

struct Plan {
  DType feat_dt;                   // of the stored features
  int64_t shard_tokens;
  std::vector<ShardPlan> shards;
  json want;                       // the manifest's description of the job
};
// The shards of the samples and the job's description (model identity, data hash, layers).
Plan make_plan(const ExtractOptions& opt, const Checkpoint& ck, const SampleSource& src, const std::vector<int>& aux,
               const std::string& backend);

// The runs of consecutive shards [first, end) this rank computes, and the token counts
// of the whole plan, of its written shards and of this rank's units.
struct WorkUnits {
  std::vector<std::pair<int64_t, int64_t>> units;
  int64_t total_tokens = 0, done_tokens = 0, my_tokens = 0;
};
WorkUnits plan_units(const std::vector<ShardPlan>& shards, int64_t max_batch_tokens,
                     const std::map<int64_t, json>& done, const RankInfo& rk);

// ---------------------------------------------------------------- resume
// The output directory, locked for this run: a new one, or one of the same job to resume
// (any other is refused). With several ranks (processes, usually one per node, sharing the
// directory) every rank records its finished shards in progress.rank-R.json, and rank 0
// folds them into the manifest once the whole plan is covered.
class OutputDir {
 public:
  // Checks the manifest there (or creates it), removes temp files of a killed run and
  // reads which shards are written already.
  OutputDir(const fs::path& out, const RankInfo& rk, const Plan& plan, const std::vector<int>& gpus);

  const fs::path& manifest_path() const { return mpath_; }
  const json& manifest() const { return manifest_; }
  bool complete() const { return manifest_.value("status", "") == "complete"; }
  // Shard index -> record, of the shards written (so far).
  const std::map<int64_t, json>& done() const { return done_; }
  // The shard records of this rank's own progress file.
  const json& my_records() const { return my_records_; }

  // A shard this run has written. Not thread-safe: the pipeline calls it under its lock.
  void record(int64_t shard, json rec);
  // Rank 0 of several: waits until the ranks' progress files cover the plan and folds
  // them in; false when a stop was requested while waiting.
  bool collect_ranks();
  // Marks the manifest complete (with the totals) and removes the progress files.
  void finish();

 private:
  void read_progress(std::map<int64_t, json>& into, json* mine) const;

  const fs::path out_;
  const RankInfo rk_;
  const bool multi_;
  const std::vector<ShardPlan>& shards_;
  const fs::path my_progress_, mpath_;
  std::map<int64_t, int64_t> index_of_first_;  // first sample -> shard index
  DirLock lock_;
  json manifest_;
  std::map<int64_t, json> done_;
  json my_records_ = json::array();
  std::map<int64_t, json> finished_;           // single rank: written, not in the manifest yet
  int64_t next_to_record_ = 0;
};

// ---------------------------------------------------------------- pipeline
struct PipelineResult {
  bool interrupted = false;        // a stop request (or its test hook) ended the run early
  int64_t tokens_written = 0;      // tokens of the shards written this run
};
// Computes this rank's work units with the model replicas and writes their shards that
// are not written yet; every shard it writes is recorded in `dir`. `groups[g]`: the GPUs
// of replica g (empty on CPU); `aux` / `final_layer`: the captured layers.
PipelineResult run_pipeline(const ExtractOptions& opt, const std::vector<std::unique_ptr<Model>>& models,
                            const std::vector<std::vector<int>>& groups, const SampleSource& src, const Plan& plan,
                            const WorkUnits& work, const std::vector<int>& aux, int64_t final_layer, int64_t hidden,
                            const RankInfo& rk, OutputDir& dir);

}  // namespace extract
}  // namespace talon
