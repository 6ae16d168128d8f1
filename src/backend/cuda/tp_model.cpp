// Entry point of the CUDA backend: a single-GPU model, or a tensor-parallel group of
// rank models in one process, each driven by its own thread, joined by NCCL.
//
// NCCL is loaded at run time (dlopen of libnccl.so.2), so a build made where only the
// headers exist still runs on machines without NCCL; only --tp > 1 needs it.
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "backend/cuda/check.h"
#include "backend/cuda/cuda_model.h"
#include "util/error.h"
#include "backend/cuda/nccl_lib.h"
#include "util/log.h"

namespace talon {

namespace {

#if TALON_HAVE_NCCL_H
// Tensor-parallel group: rank r runs on devices[r] in worker thread r.
class TpModel final : public Model {
 public:
  TpModel(const Checkpoint& ckpt, const GpuOptions& go) : cfg_(ckpt.config()), devices_(go.devices) {
    const Nccl& nc = Nccl::get();
    const int n = go.tp;
    comms_.resize(size_t(n));
    nc.check(nc.comm_init_all(comms_.data(), n, devices_.data()), "ncclCommInitAll");
    ranks_.resize(size_t(n));
    // Load every rank in parallel, each from its own thread (the rank's thread-to-be).
    std::vector<std::exception_ptr> errs(static_cast<size_t>(n));
    std::vector<std::thread> loaders;
    for (int r = 0; r < n; ++r)
      loaders.emplace_back([&, r] {
        set_thread_log_tag(fmt::format("gpu {}", devices_[size_t(r)]));
        try {
          cuda::RankOptions ro;
          ro.device = devices_[size_t(r)];
          ro.rank = r;
          ro.size = n;
          ncclComm_t comm = comms_[size_t(r)];
          ro.allreduce = [comm, this](cuda::bf16* p, int64_t count, cudaStream_t s) {
            const Nccl& x = Nccl::get();
            x.check(x.all_reduce(p, p, size_t(count), ncclBfloat16, ncclSum, comm, s), "all-reduce");
          };
          ranks_[size_t(r)] = cuda::make_rank_model(ckpt, ro, go);
        } catch (...) {
          errs[size_t(r)] = std::current_exception();
        }
      });
    for (auto& t : loaders) t.join();
    for (auto& e : errs)
      if (e) {
        destroy();
        std::rethrow_exception(e);
      }
    for (int r = 0; r < n; ++r) workers_.emplace_back([this, r] { worker(r); });
  }

  ~TpModel() override {
    {
      std::lock_guard lk(mu_);
      quit_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    destroy();
  }

  const ModelConfig& config() const override { return cfg_; }
  std::string backend() const override {
    std::string s = "cuda:";
    for (size_t i = 0; i < devices_.size(); ++i) s += (i ? "," : "") + std::to_string(devices_[i]);
    return s + " (tp " + std::to_string(devices_.size()) + ")";
  }
  std::shared_ptr<uint8_t> host_buffer(size_t bytes) override { return ranks_[0]->host_buffer(bytes); }

  void forward(const Batch& b, const Capture& cap, float* logits) override {
    std::unique_lock lk(mu_);
    job_ = {&b, &cap, logits};
    pending_ = int(ranks_.size());
    errors_.assign(ranks_.size(), nullptr);
    ++generation_;
    cv_.notify_all();
    done_cv_.wait(lk, [&] { return pending_ == 0; });
    for (auto& e : errors_)
      if (e) std::rethrow_exception(e);
  }

 private:
  struct Job {
    const Batch* b;
    const Capture* cap;
    float* logits;
  };

  void worker(int r) {
    set_thread_log_tag(fmt::format("gpu {}", devices_[size_t(r)]));
    uint64_t seen = 0;
    static const Capture none;
    for (;;) {
      Job j;
      {
        std::unique_lock lk(mu_);
        cv_.wait(lk, [&] { return quit_ || generation_ != seen; });
        if (quit_) return;
        seen = generation_;
        j = job_;
      }
      std::exception_ptr err;
      try {
        // Rank 0 holds the full residual stream after each all-reduce: it captures.
        ranks_[size_t(r)]->forward(*j.b, r == 0 ? *j.cap : none, r == 0 ? j.logits : nullptr);
      } catch (...) {
        err = std::current_exception();
        // Unblock the other ranks waiting in a collective.
        const Nccl& nc = Nccl::get();
        for (auto c : comms_) nc.comm_abort(c);
        aborted_ = true;
      }
      std::lock_guard lk(mu_);
      errors_[size_t(r)] = err;
      if (--pending_ == 0) done_cv_.notify_all();
    }
  }

  void destroy() {
    ranks_.clear();
    if (!aborted_) {
      const Nccl& nc = Nccl::get();
      for (auto c : comms_)
        if (c) nc.comm_destroy(c);
    }
    comms_.clear();
  }

  ModelConfig cfg_;
  std::vector<int> devices_;
  std::vector<ncclComm_t> comms_;
  std::vector<std::unique_ptr<Model>> ranks_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  Job job_{};
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool quit_ = false;
  std::atomic<bool> aborted_{false};
  std::vector<std::exception_ptr> errors_;
};
#endif

}  // namespace

std::unique_ptr<Model> make_cuda_model(const Checkpoint& ckpt, const GpuOptions& go) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0)
    fail("--device cuda: no CUDA device available ({})", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
  if (is_deepseek(ckpt.config().arch)) {
    // MLA + MoE on one GPU; tensor and expert parallelism for this family are not built yet.
    TALON_CHECK(go.tp == 1 && go.devices.size() == 1,
                "{}: {} models run on one GPU for now (--tp 1); tensor/expert parallelism is not built yet",
                ckpt.source(), arch_name(ckpt.config().arch));
    TALON_CHECK(go.devices[0] >= 0 && go.devices[0] < n, "cuda:{}: only {} CUDA device(s) present", go.devices[0], n);
    return make_cuda_deepseek_model(ckpt, go.devices[0]);
  }
  const ModelConfig& c = ckpt.config();
  TALON_CHECK(go.tp >= 1, "--tp must be >= 1, got {}", go.tp);
  TALON_CHECK(int(go.devices.size()) == go.tp, "--tp {} needs {} devices, got {}", go.tp, go.tp, go.devices.size());
  for (int d : go.devices) TALON_CHECK(d >= 0 && d < n, "cuda:{}: only {} CUDA device(s) present", d, n);
  for (size_t i = 0; i < go.devices.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      TALON_CHECK(go.devices[i] != go.devices[j], "cuda:{} is listed twice", go.devices[i]);
  if (go.tp > 1) {
    TALON_CHECK(c.n_heads % go.tp == 0 && c.n_kv_heads % go.tp == 0 && c.intermediate % go.tp == 0,
                "--tp {}: the model's {} attention heads, {} kv heads and intermediate size {} must all divide by it",
                go.tp, c.n_heads, c.n_kv_heads, c.intermediate);
  }
  cuda::check_memory_plan(c, go);
  if (go.tp == 1) {
    cuda::RankOptions ro;
    ro.device = go.devices[0];
    return cuda::make_rank_model(ckpt, ro, go);
  }
#if TALON_HAVE_NCCL_H
  return std::make_unique<TpModel>(ckpt, go);
#else
  fail("--tp {}: this build has no NCCL headers; rebuild with NCCL installed", go.tp);
#endif
}

std::unique_ptr<Model> make_cuda_model(const Checkpoint& ckpt, int device) {
  GpuOptions go;
  go.devices = {device};
  return make_cuda_model(ckpt, go);
}

}  // namespace talon
