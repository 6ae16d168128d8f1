// `talon extract`, pipeline: one compute thread per model replica takes the next work
// unit (a run of shards), runs its samples in length-sorted batches and leaves the
// features in the unit's buffer (page-locked on GPUs: the device copies into it
// asynchronously while it computes). A small pool of writer threads hashes, writes and
// fsyncs the unit's shards. Buffers come from a fixed pool, so a slow disk stalls compute
// instead of growing memory (back-pressure); one allocator thread makes them while the
// first units compute. A stop request ends compute at the next batch; the shards of
// finished units are still written, and a resume recomputes the rest.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "data/extract_internal.h"
#include "data/features.h"
#include "data/samples.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "util/log.h"
#include "util/progress.h"
#include "util/signals.h"
#include "util/threads.h"

namespace talon::extract {

namespace {

using Clock = std::chrono::steady_clock;

double secs_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// A unit's buffer: goes back to the pool when its last shard is written (or dropped).
struct UnitBuf {
  std::shared_ptr<uint8_t> mem;
  std::function<void(std::shared_ptr<uint8_t>)> back;
  UnitBuf(std::shared_ptr<uint8_t> m, std::function<void(std::shared_ptr<uint8_t>)> b)
      : mem(std::move(m)), back(std::move(b)) {}
  ~UnitBuf() {
    if (mem) back(std::move(mem));
  }
};

// One shard for the writers: its tokens and masks, and its rows of the unit's features.
struct ShardJob {
  int64_t index;
  ShardPlan plan;
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;
  std::vector<int64_t> offsets, sample_index;
  std::shared_ptr<UnitBuf> unit;           // holds the memory aux/fin point into
  uint8_t *aux = nullptr, *fin = nullptr;  // [T, 3H] and [T, H] rows in feat_dt
};

class Pipeline {
 public:
  Pipeline(const ExtractOptions& opt, const std::vector<std::unique_ptr<Model>>& models,
           const std::vector<std::vector<int>>& groups, const SampleSource& src, const Plan& plan,
           const WorkUnits& work, const std::vector<int>& aux, int64_t final_layer, int64_t hidden,
           const RankInfo& rk, OutputDir& dir)
      : opt_(opt), models_(models), groups_(groups), src_(src), shards_(plan.shards), units_(work.units),
        aux_(aux), L_(final_layer), H_(hidden), feat_dt_(plan.feat_dt), esz_(int64_t(dtype_size(plan.feat_dt))),
        tag_prefix_(rk.world > 1 ? fmt::format("rank {} ", rk.rank) : ""), dir_(dir),
        progress_("extract", rk.world > 1 ? work.my_tokens : work.total_tokens, "tok",
                  rk.world > 1 ? 0 : work.total_tokens - work.my_tokens),
        n_writers_(std::max<int64_t>(1, std::min<int64_t>(4, int64_t(shards_.size()) - int64_t(dir.done().size())))),
        t_forward_(models.size(), 0.0), t_wait_(models.size(), 0.0) {
    cap_layers_ = aux;
    cap_layers_.push_back(int(L_));
  }

  PipelineResult run() {
    const auto t_run = Clock::now();
    std::vector<std::thread> writers;
    for (int64_t i = 0; i < n_writers_; ++i) writers.emplace_back([this, i] { writer_main(int(i)); });
    // The allocator and the compute threads run to completion; the writers then drain:
    // every finished shard is written and recorded.
    run_threads(int(models_.size()) + 1, [&](int i) {
      try {
        if (i == 0) allocate();
        else compute_main(size_t(i - 1));
      } catch (...) {
        fail(std::current_exception());
      }
    });
    {
      std::unique_lock lk(mu_);
      closing_ = true;
    }
    cv_.notify_all();
    for (auto& t : writers) t.join();
    if (failure_) std::rethrow_exception(failure_);
    progress_.finish();
    if (n_batches_ > 0)
      tlog::info("batches: {} of mean {:.0f} tokens ({:.1f}% of --max-batch-tokens {}; packed, no padding)",
                 n_batches_.load(), double(batch_tokens_) / double(n_batches_.load()),
                 100.0 * double(batch_tokens_) / double(n_batches_.load()) / double(opt_.max_batch_tokens),
                 opt_.max_batch_tokens);
    const double wall = secs_since(t_run);
    // Where the time went, per replica: forward passes vs waiting for a free unit buffer
    // (i.e. for the writers); and the writers' busy time.
    for (size_t g = 0; g < models_.size(); ++g)
      tlog::info("{}: forward {:.2f}s, waited {:.2f}s for writers, of {:.2f}s", models_[g]->backend(), t_forward_[g],
                 t_wait_[g], wall);
    tlog::info("writers: {} threads busy {:.2f}s in total (hash + write + fsync)", n_writers_,
               double(writer_us_) / 1e6);
    return {interrupted_, written_this_run_};
  }

 private:
  // The first error of any thread is the run's; the others stop at their next check.
  void fail(std::exception_ptr e) {
    {
      std::unique_lock lk(mu_);
      if (!failure_) failure_ = std::move(e);
      failed_ = true;
    }
    cv_.notify_all();
  }

  void give_back(std::shared_ptr<uint8_t> mem) {
    {
      std::unique_lock lk(mu_);
      free_bufs_.push_back(std::move(mem));
    }
    cv_.notify_all();
  }

  // Page-locked buffers take ~0.3 s per GB to allocate: one thread makes them while the
  // first units compute, instead of the compute threads stalling on each.
  void allocate() {
    int64_t max_unit_tokens = 0;
    for (auto& u : units_) {
      int64_t t = 0;
      for (int64_t si = u.first; si < u.second; ++si) t += shards_[size_t(si)].tokens;
      max_unit_tokens = std::max(max_unit_tokens, t);
    }
    const size_t buf_bytes = size_t(max_unit_tokens) * size_t(4 * H_ * esz_);
    const int64_t max_bufs = 2 * int64_t(models_.size()) + 1;
    for (int64_t i = 0; i < max_bufs && !units_.empty(); ++i) {
      auto mem = models_[size_t(i) % models_.size()]->host_buffer(buf_bytes);
      {
        std::unique_lock lk(mu_);
        if (failure_) break;
        free_bufs_.push_back(std::move(mem));
      }
      cv_.notify_all();
    }
  }

  // Batches within a unit: samples sorted by length (longest first), each batch filled
  // first-fit up to the token budget; a sample longer than the budget runs alone.
  // Batches are packed without padding; captures are scattered back to the samples'
  // places in the unit. A resume recomputes a unit with unwritten shards, but writes
  // only those.
  void compute_main(size_t g) {
    Model& m = *models_[g];
    set_thread_log_tag(tag_prefix_ +
                       (groups_[g].empty() ? std::string("compute") : fmt::format("gpu {}", groups_[g][0])));
    Batch batch;
    for (;;) {
      if (stop_requested()) {
        interrupted_ = true;
        return;
      }
      const int64_t ui = next_unit_++;
      if (ui >= int64_t(units_.size())) return;
      const int64_t s_begin = units_[size_t(ui)].first, s_end = units_[size_t(ui)].second;
      std::shared_ptr<UnitBuf> ub;
      {
        const auto tw = Clock::now();
        std::unique_lock lk(mu_);
        cv_.wait(lk, [&] { return !free_bufs_.empty() || failure_; });
        t_wait_[g] += secs_since(tw);
        if (failure_) return;
        std::shared_ptr<uint8_t> mem = std::move(free_bufs_.back());
        free_bufs_.pop_back();
        lk.unlock();
        ub = std::make_shared<UnitBuf>(std::move(mem), [this](std::shared_ptr<uint8_t> p) { give_back(std::move(p)); });
      }
      const int64_t first = shards_[size_t(s_begin)].first;
      const int64_t last = shards_[size_t(s_end - 1)].first + shards_[size_t(s_end - 1)].count;
      int64_t T = 0;
      for (int64_t si = s_begin; si < s_end; ++si) T += shards_[size_t(si)].tokens;
      uint8_t* aux_base = ub->mem.get();
      uint8_t* fin_base = aux_base + size_t(T * 3 * H_ * esz_);
      // Unit-wide token offsets of every sample.
      const int64_t n = last - first;
      std::vector<int64_t> off(static_cast<size_t>(n + 1), 0);
      for (int64_t k = 0; k < n; ++k)
        off[size_t(k + 1)] = off[size_t(k)] + int64_t(src_.at(size_t(first + k)).input_ids.size());
      std::vector<int64_t> order(static_cast<size_t>(n));
      for (int64_t k = 0; k < n; ++k) order[size_t(k)] = k;
      auto len = [&](int64_t k) { return off[size_t(k + 1)] - off[size_t(k)]; };
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return len(a) > len(b); });
      std::vector<bool> taken(static_cast<size_t>(n), false);
      size_t head = 0;
      while (head < order.size()) {
        if (stop_requested() || failed_) {  // a signal, or a writer failed (e.g. the disk is full):
          interrupted_ = true;              // the unfinished unit is dropped (its buffer goes back)
          return;
        }
        batch.clear();
        Capture cap;
        cap.layers = cap_layers_;
        cap.dtype = feat_dt_;
        for (int a = 0; a < 3; ++a) {
          cap.out.push_back(aux_base + size_t(a * H_ * esz_));
          cap.ld.push_back(3 * H_);
        }
        cap.out.push_back(fin_base);
        cap.ld.push_back(H_);
        for (size_t i = head; i < order.size(); ++i) {
          const int64_t k = order[i];
          if (taken[size_t(k)]) continue;
          if (batch.n_tokens() > 0 && batch.n_tokens() + len(k) > opt_.max_batch_tokens) continue;
          batch.add(src_.at(size_t(first + k)).input_ids.data(), len(k));
          cap.seq_dst.push_back(off[size_t(k)]);
          taken[size_t(k)] = true;
          if (batch.n_tokens() >= opt_.max_batch_tokens) break;
        }
        while (head < order.size() && taken[size_t(order[head])]) ++head;
        const auto tf = Clock::now();
        m.forward(batch, cap, nullptr);
        t_forward_[g] += secs_since(tf);
        n_batches_++;
        batch_tokens_ += batch.n_tokens();
        progress_.advance(batch.n_tokens());
      }
      // One writer job per shard of the unit not recorded yet.
      std::vector<std::unique_ptr<ShardJob>> jobs;
      std::vector<int64_t> missing;
      {
        std::unique_lock lk(mu_);
        for (int64_t si = s_begin; si < s_end; ++si)
          if (!dir_.done().count(si)) missing.push_back(si);
      }
      for (int64_t si : missing) {
        const ShardPlan& sp = shards_[size_t(si)];
        auto job = std::make_unique<ShardJob>();
        job->index = si;
        job->plan = sp;
        job->unit = ub;
        const int64_t r0 = off[size_t(sp.first - first)];
        job->aux = aux_base + size_t(r0 * 3 * H_ * esz_);
        job->fin = fin_base + size_t(r0 * H_ * esz_);
        job->offsets.assign(1, 0);
        for (int64_t k = sp.first; k < sp.first + sp.count; ++k) {
          const Sample& smp = src_.at(size_t(k));
          job->ids.insert(job->ids.end(), smp.input_ids.begin(), smp.input_ids.end());
          job->mask.insert(job->mask.end(), smp.loss_mask.begin(), smp.loss_mask.end());
          job->offsets.push_back(int64_t(job->ids.size()));
          job->sample_index.push_back(k);
        }
        written_this_run_ += sp.tokens;
        jobs.push_back(std::move(job));
      }
      ub.reset();  // the jobs hold the buffer now
      {
        std::unique_lock lk(mu_);
        for (auto& j : jobs) queue_.push_back(std::move(j));
      }
      cv_.notify_all();
      shards_queued_ += int64_t(missing.size());
      if (opt_.stop_after_shards >= 0 && shards_queued_ >= opt_.stop_after_shards && ui + 1 < int64_t(units_.size()))
        request_stop_for_test();
    }
  }

  // Writes one shard; its manifest record.
  json write_shard(const ShardJob& j) {
    const int64_t T = j.plan.tokens, n = j.plan.count;
    st::Writer w;
    w.add(shard_tensors::input_ids, DType::I32, {T}, j.ids.data(), j.ids.size() * 4);
    w.add(shard_tensors::loss_mask, DType::U8, {T}, j.mask.data(), j.mask.size());
    w.add(shard_tensors::aux_hidden, feat_dt_, {T, 3 * H_}, j.aux, size_t(T * 3 * H_ * esz_));
    w.add(shard_tensors::hidden, feat_dt_, {T, H_}, j.fin, size_t(T * H_ * esz_));
    w.add(shard_tensors::sample_offsets, DType::I64, {n + 1}, j.offsets.data(), j.offsets.size() * 8);
    w.add(shard_tensors::sample_index, DType::I64, {n}, j.sample_index.data(), j.sample_index.size() * 8);
    w.set_metadata("format", kFeaturesFormat);
    w.set_metadata("format_version", std::to_string(kFeaturesVersion));
    w.set_metadata("convention", kLayerConvention);
    w.set_metadata("aux_layer_ids", json(aux_).dump());
    w.set_metadata("final_layer_id", std::to_string(L_));
    size_t bytes = 0;
    const std::string fname = shard_file_name(j.index);
    const std::string sha = w.write(opt_.out / fname, &bytes);
    int64_t lt = 0;
    for (auto m : j.mask) lt += m;
    return json{{"file", fname}, {"first_sample", j.plan.first}, {"samples", n}, {"tokens", T},
                {"loss_tokens", lt}, {"bytes", bytes}, {"sha256", sha}};
  }

  void writer_main(int id) {
    set_thread_log_tag(tag_prefix_ + "writer " + std::to_string(id));
    for (;;) {
      std::unique_ptr<ShardJob> job;
      {
        std::unique_lock lk(mu_);
        cv_.wait(lk, [&] { return !queue_.empty() || closing_; });
        if (queue_.empty()) return;
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      try {
        const auto tw = Clock::now();
        json rec = write_shard(*job);
        writer_us_ += int64_t(secs_since(tw) * 1e6);
        tlog::debug("wrote {} ({} samples, {} tokens)", rec["file"].get<std::string>(), job->plan.count,
                    job->plan.tokens);
        std::unique_lock lk(mu_);
        dir_.record(job->index, std::move(rec));
      } catch (...) {
        fail(std::current_exception());
      }
      job.reset();  // may hand the unit's buffer back (takes the lock itself)
      cv_.notify_all();
    }
  }

  const ExtractOptions& opt_;
  const std::vector<std::unique_ptr<Model>>& models_;
  const std::vector<std::vector<int>>& groups_;
  const SampleSource& src_;
  const std::vector<ShardPlan>& shards_;
  const std::vector<std::pair<int64_t, int64_t>>& units_;
  const std::vector<int>& aux_;
  const int64_t L_, H_;
  const DType feat_dt_;
  const int64_t esz_;
  const std::string tag_prefix_;
  OutputDir& dir_;  // its record() and done() under mu_
  Progress progress_;
  const int64_t n_writers_;
  std::vector<int> cap_layers_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<ShardJob>> queue_;
  std::vector<std::shared_ptr<uint8_t>> free_bufs_;
  std::exception_ptr failure_;
  std::atomic<bool> failed_{false};  // mirrors failure_ for the compute loop (read without the lock)
  bool closing_ = false;
  std::atomic<int64_t> next_unit_{0}, shards_queued_{0};
  std::atomic<int64_t> written_this_run_{0}, n_batches_{0}, batch_tokens_{0};
  std::atomic<bool> interrupted_{false};
  std::vector<double> t_forward_, t_wait_;
  std::atomic<int64_t> writer_us_{0};
};

}  // namespace

PipelineResult run_pipeline(const ExtractOptions& opt, const std::vector<std::unique_ptr<Model>>& models,
                            const std::vector<std::vector<int>>& groups, const SampleSource& src, const Plan& plan,
                            const WorkUnits& work, const std::vector<int>& aux, int64_t final_layer, int64_t hidden,
                            const RankInfo& rk, OutputDir& dir) {
  return Pipeline(opt, models, groups, src, plan, work, aux, final_layer, hidden, rk, dir).run();
}

}  // namespace talon::extract
