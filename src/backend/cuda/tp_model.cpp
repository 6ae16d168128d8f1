// Entry point of the CUDA backend: a single-GPU model, or a tensor- / expert-parallel group
// of rank models in one process, each driven by its own thread, joined by collective.h.
//
// NCCL is loaded at run time (dlopen of libnccl.so.2), so a build made where only the
// headers exist still runs on machines without NCCL; only groups of distinct GPUs need it.
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

#include "backend/cuda/check.h"
#include "backend/backend.h"
#include "backend/cuda/collective.h"
#include "backend/cuda/cuda_model.h"
#include "backend/cuda/rank_workers.h"
#include "util/threads.h"
#include "util/error.h"
#include "util/log.h"

namespace talon {

namespace {

// A group of rank models in one process, rank r on devices[r] driven by worker thread r,
// joined by a Collectives (NCCL, or device copies when ranks share a GPU).
//  * Replicated: every rank runs the whole batch (tensor parallel); rank 0 holds the full
//    residual stream after each all-reduce, so it alone captures and writes logits.
//  * BySequence: the batch's sequences are split into n contiguous runs of about equal token
//    counts, one per rank (expert parallel: data-parallel attention); each rank captures its
//    own rows straight into the caller's buffers (destinations remapped per sequence) and
//    writes its rows of the logits. A rank may get no sequence; it still takes part.
class GroupModel final : public Model {
 public:
  enum class Split { Replicated, BySequence };
  using MakeRank = std::function<std::unique_ptr<Model>(int rank, cuda::Collectives* comm)>;

  GroupModel(const ModelConfig& cfg, std::vector<int> devices, std::string kind, Split split, bool shared,
             const MakeRank& make)
      : cfg_(cfg), devices_(std::move(devices)), kind_(std::move(kind)), split_(split) {
    const int n = int(devices_.size());
    comm_ = shared ? cuda::make_shared_collectives(n) : cuda::make_nccl_collectives(devices_);
    ranks_.resize(size_t(n));
    // Load every rank in parallel, each from its own thread (the rank's thread-to-be).
    try {
      run_threads(n, [&](int r) {
        set_thread_log_tag(tag(r));
        CUDA_CHECK(cudaSetDevice(devices_[size_t(r)]));
        ranks_[size_t(r)] = make(r, comm_.get());
      });
    } catch (...) {
      ranks_.clear();
      comm_.reset();
      throw;
    }
    workers_ = std::make_unique<cuda::RankWorkers>(n, [this](int r) { return tag(r); }, comm_.get());
  }

  ~GroupModel() override {
    workers_.reset();
    ranks_.clear();
    comm_.reset();
  }

  const ModelConfig& config() const override { return cfg_; }
  std::string backend() const override {
    return fmt::format("cuda:{} ({} {})", fmt::join(devices_, ","), kind_, devices_.size());
  }
  std::shared_ptr<uint8_t> host_buffer(size_t bytes) override { return ranks_[0]->host_buffer(bytes); }

  void forward(const Batch& b, const Capture& cap, float* logits) override {
    cap.validate(cfg_.n_layers, b);
    const int n = int(ranks_.size());
    std::vector<Job> jobs(static_cast<size_t>(n));
    static const Capture none;
    if (split_ == Split::Replicated) {
      for (int r = 0; r < n; ++r) jobs[size_t(r)] = {&b, r == 0 ? &cap : &none, r == 0 ? logits : nullptr};
    } else {
      parts_.assign(size_t(n), Batch{});
      caps_.assign(size_t(n), Capture{});
      const int64_t N = b.n_tokens(), S = b.n_seqs();
      int64_t s0 = 0;
      for (int r = 0; r < n; ++r) {
        int64_t s1 = S;
        if (r + 1 < n) {  // first sequence starting at or after the r+1-th share of the tokens
          s1 = s0;
          while (s1 < S && b.seq_start[size_t(s1)] * n < N * (r + 1)) ++s1;
        }
        Batch& p = parts_[size_t(r)];
        Capture& c = caps_[size_t(r)];
        c.layers = cap.layers, c.out = cap.out, c.dtype = cap.dtype, c.ld = cap.ld;
        for (int64_t q = s0; q < s1; ++q) {
          const int64_t a = b.seq_start[size_t(q)], e = b.seq_start[size_t(q + 1)];
          p.add(b.tokens.data() + a, e - a);
          c.seq_dst.push_back(cap.dst_row(b, q, a));
        }
        if (p.seq_start.empty()) p.seq_start.push_back(0);
        float* lg = logits ? logits + b.seq_start[size_t(s0)] * cfg_.vocab : nullptr;
        jobs[size_t(r)] = {&p, &c, lg};
        s0 = s1;
      }
    }
    workers_->run([&](int r) {
      const Job& j = jobs[size_t(r)];
      ranks_[size_t(r)]->forward(*j.b, *j.cap, j.logits);
    });
  }

 private:
  struct Job {
    const Batch* b;
    const Capture* cap;
    float* logits;
  };

  std::string tag(int r) const { return fmt::format("gpu {} rank {}", devices_[size_t(r)], r); }

  ModelConfig cfg_;
  std::vector<int> devices_;
  std::string kind_;
  Split split_;
  std::unique_ptr<cuda::Collectives> comm_;
  std::vector<std::unique_ptr<Model>> ranks_;
  std::unique_ptr<cuda::RankWorkers> workers_;  // thread r drives ranks_[r]
  std::vector<Batch> parts_;
  std::vector<Capture> caps_;
};

}  // namespace

namespace cuda {
void check_devices(const GpuOptions& go, int n_present) {
  for (int d : go.devices) TALON_CHECK(d >= 0 && d < n_present, "cuda:{}: only {} CUDA device(s) present", d, n_present);
  if (go.share_devices) return;
  for (size_t i = 0; i < go.devices.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      TALON_CHECK(go.devices[i] != go.devices[j], "cuda:{} is listed twice", go.devices[i]);
}
}  // namespace cuda

std::unique_ptr<Model> make_cuda_model(const Checkpoint& ckpt, const GpuOptions& go) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0)
    fail("--device cuda: no CUDA device available ({})", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
  const ModelConfig& c = ckpt.config();
  TALON_CHECK(go.tp >= 1 && go.ep >= 1, "--tp and --ep must be >= 1, got {} and {}", go.tp, go.ep);
  TALON_CHECK(go.tp == 1 || go.ep == 1, "--tp {} with --ep {}: use one of them per model replica", go.tp, go.ep);
  const int size = go.tp * go.ep;
  TALON_CHECK(int(go.devices.size()) == size, "--{} {} needs {} devices, got {}", go.ep > 1 ? "ep" : "tp", size, size,
              go.devices.size());
  cuda::check_devices(go, n);
  if (is_deepseek(c.arch)) {
    if (size == 1) return make_cuda_deepseek_model(ckpt, go.devices[0]);
    using P = cuda::DeepseekParallel;
    const P::Mode mode = go.ep > 1 ? P::Mode::Expert : P::Mode::Tensor;
    return std::make_unique<GroupModel>(
        c, go.devices, go.ep > 1 ? "ep" : "tp", go.ep > 1 ? GroupModel::Split::BySequence : GroupModel::Split::Replicated,
        go.share_devices, [&](int r, cuda::Collectives* comm) {
          return cuda::make_deepseek_rank_model(ckpt, go.devices[size_t(r)], P{mode, r, size, comm});
        });
  }
  TALON_CHECK(go.ep == 1, "--ep {}: expert parallelism is for mixture-of-experts models; {} is dense", go.ep,
              arch_name(c.arch));
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
  return std::make_unique<GroupModel>(
      c, go.devices, "tp", GroupModel::Split::Replicated, go.share_devices, [&](int r, cuda::Collectives* comm) {
        cuda::RankOptions ro;
        ro.device = go.devices[size_t(r)];
        ro.rank = r;
        ro.size = go.tp;
        ro.allreduce = [comm, r](cuda::bf16* p, int64_t count, cudaStream_t s) {
          comm->all_reduce(r, p, count, DType::BF16, s);
        };
        return cuda::make_rank_model(ckpt, ro, go);
      });
}

std::unique_ptr<Model> make_cuda_model(const Checkpoint& ckpt, int device) {
  GpuOptions go;
  go.devices = {device};
  return make_cuda_model(ckpt, go);
}

}  // namespace talon
