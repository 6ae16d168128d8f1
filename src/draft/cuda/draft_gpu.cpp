#include <algorithm>
#include <cmath>
#include <cstring>

#include <thread>

#include "backend/cuda/check.h"
#include "draft/cuda/draft_engine.h"
#include "backend/cuda/nccl_lib.h"
#include "util/threads.h"
#include "util/log.h"
#include "model/model.h"
#include "draft/draft_gpu.h"
#include "util/error.h"

namespace talon::eagle3 {

namespace {

class CudaDraftTrainer final : public GpuDraftTrainer {
 public:
  CudaDraftTrainer(const DraftConfig& c, const TargetHead& tgt, const DraftVocab& vocab, int device, GpuMath math,
                   int64_t max_rows, const GpuDraftOptions& opt)
      : c_(c), max_rows_(max_rows) {
    TALON_CHECK(max_rows >= 2, "draft on GPU: the batch budget must be at least 2 tokens, got {}", max_rows);
    TALON_CHECK(int64_t(vocab.kept.size()) == c.Vd && int64_t(vocab.t2d.size()) == c.V,
                "draft vocabulary has {} of {} ids", vocab.kept.size(), c.Vd);
    cuda::DraftDims d = dims();
    d.target_eps = float(tgt.rms_eps);
    const auto m = math == GpuMath::F32 ? cuda::DraftMath::F32
                   : math == GpuMath::TF32 ? cuda::DraftMath::TF32
                                           : cuda::DraftMath::BF16;
    const std::vector<float> inv = rope_inv_freq(c.rope, c.head_dim);
    eng_ = std::make_unique<cuda::DraftEngine>(device, d, m, tgt.embed, tgt.final_norm, tgt.lm_head, vocab.kept.data(),
                                               vocab.t2d.data(), inv.data(), max_rows, opt);
    DraftWeights probe;
    for (auto& [name, v] : probe.named()) decay_.push_back(is_norm_weight(name) ? 0 : 1);
  }

  void set_weights(DraftWeights& w) override {
    std::vector<const float*> p;
    check_sizes(w);
    for (auto& [n, v] : w.named()) p.push_back(v->data());
    eng_->set_weights(p);
  }
  void get_weights(DraftWeights& w) override {
    std::vector<float*> p;
    resize(w);
    for (auto& [n, v] : w.named()) p.push_back(v->data());
    eng_->get_weights(p);
  }
  void get_grads(DraftGrads& g) override {
    DraftWeights tmp;
    resize(tmp);
    std::vector<float*> p;
    for (auto& [n, v] : tmp.named()) p.push_back(v->data());
    eng_->get_grads(p);
    auto ng = g.named();
    auto nw = tmp.named();
    for (size_t i = 0; i < ng.size(); ++i) ng[i].second->assign(nw[i].second->begin(), nw[i].second->end());
  }
  void set_moments(const std::vector<std::vector<float>>& m, const std::vector<std::vector<float>>& v) override {
    const auto sizes = cuda::draft_tensor_sizes(dims());
    TALON_CHECK(m.size() == sizes.size() && v.size() == sizes.size(), "optimizer state: {} tensors, expected {}",
                m.size(), sizes.size());
    std::vector<const float*> pm, pv;
    for (size_t i = 0; i < sizes.size(); ++i) {
      TALON_CHECK(int64_t(m[i].size()) == sizes[i] && int64_t(v[i].size()) == sizes[i],
                  "optimizer state: tensor {} has {} values, expected {}", i, m[i].size(), sizes[i]);
      pm.push_back(m[i].data());
      pv.push_back(v[i].data());
    }
    eng_->set_moments(pm, pv);
  }
  void get_moments(std::vector<std::vector<float>>& m, std::vector<std::vector<float>>& v) override {
    const auto sizes = cuda::draft_tensor_sizes(dims());
    m.assign(sizes.size(), {});
    v.assign(sizes.size(), {});
    std::vector<float*> pm, pv;
    for (size_t i = 0; i < sizes.size(); ++i) {
      m[i].resize(size_t(sizes[i]));
      v[i].resize(size_t(sizes[i]));
      pm.push_back(m[i].data());
      pv.push_back(v[i].data());
    }
    eng_->get_moments(pm, pv);
  }

  std::vector<TttResult> run(const std::vector<Sample>& batch, double weight, bool backward,
                             bool zero_grads) override {
    const int64_t H = c_.H;
    int64_t N = 0;
    for (auto& s : batch) N += s.T;
    TALON_CHECK(N >= 1 && N <= max_rows_, "draft on GPU: {} tokens in one batch, the budget is {}", N, max_rows_);
    ids_.resize(size_t(N));
    mask_.resize(size_t(N));
    pos_.resize(size_t(N));
    len_.resize(size_t(N));
    // Features already in pinned memory (or on a GPU) upload from there; otherwise they go
    // into the engine's pinned staging first, in pieces of about 1M values copied in parallel
    // (a batch is hundreds of MB at the 8B shape).
    const auto direct = [](const float* p) { return cuda::is_pinned_host(p) || cuda::is_device_memory(p); };
    bool all_direct = true;
    for (auto& s : batch) all_direct = all_direct && direct(s.aux) && direct(s.hidden);
    if (all_direct) {
      int64_t r = 0;
      cuda::DraftBatch b{N, ids_.data(), mask_.data(), nullptr, nullptr, pos_.data(), len_.data(), {}};
      for (auto& s : batch) {
        pack_tokens(s, r);
        b.parts.push_back({s.aux, s.hidden, s.T});
        r += s.T;
      }
      return finish(batch, N, weight, backward, zero_grads, eng_->prepare(b));
    }
    auto [aux, hid] = eng_->host_features();
    if (!aux) {
      if (!warned_unpinned_) {
        tlog::warn("draft on GPU: could not pin {:.1f} GiB of host memory for batch staging; batches upload from "
                   "pageable memory (slower)", double(max_rows_ * 4 * H) * 4 / double(1 << 30));
        warned_unpinned_ = true;
      }
      aux_.resize(size_t(N * 3 * H));
      hid_.resize(size_t(N * H));
      aux = aux_.data();
      hid = hid_.data();
    }
    struct Piece {
      float* dst;
      const float* src;
      int64_t n;
    };
    std::vector<Piece> pieces;
    const auto split = [&pieces](float* dst, const float* src, int64_t n) {
      constexpr int64_t kPiece = int64_t(1) << 20;
      for (int64_t o = 0; o < n; o += kPiece) pieces.push_back({dst + o, src + o, std::min(kPiece, n - o)});
    };
    int64_t r = 0;
    for (auto& s : batch) {
      pack_tokens(s, r);
      split(aux + r * 3 * H, s.aux, s.T * 3 * H);
      split(hid + r * H, s.hidden, s.T * H);
      r += s.T;
    }
#pragma omp parallel for schedule(dynamic, 4) if (pieces.size() > 8)
    for (size_t i = 0; i < pieces.size(); ++i) std::copy(pieces[i].src, pieces[i].src + pieces[i].n, pieces[i].dst);
    cuda::DraftBatch b{N, ids_.data(), mask_.data(), aux, hid, pos_.data(), len_.data(), {}};
    return finish(batch, N, weight, backward, zero_grads, eng_->prepare(b));
  }

  // Sample s's tokens into rows [r, r + s.T) of the packed token arrays.
  void pack_tokens(const Sample& s, int64_t r) {
    for (int64_t t = 0; t < s.T; ++t) {
      TALON_CHECK(s.ids[t] >= 0 && s.ids[t] < c_.V, "draft: token id {} outside the vocabulary", s.ids[t]);
      ids_[size_t(r + t)] = s.ids[t];
      mask_[size_t(r + t)] = s.mask[t];
      pos_[size_t(r + t)] = int32_t(t);
      len_[size_t(r + t)] = int32_t(s.T);
    }
  }

  // The rest of run() once the batch (N rows) is prepared (in_vocab: the engine's answer).
  std::vector<TttResult> finish(const std::vector<Sample>& batch, int64_t N, double weight, bool backward,
                                bool zero_grads, const std::vector<uint8_t>& in_vocab) {
    const int64_t K = c_.ttt_steps;
    // Which rows count at each step, per-sample counts, and each row's weight in the
    // objective: weight * decay^k / n_k(sample), as the CPU reference normalises.
    std::vector<uint8_t> counts(size_t(K * N), 0);
    std::vector<float> scale(size_t(K * N), 0.f);
    std::vector<std::vector<int64_t>> nk(batch.size(), std::vector<int64_t>(size_t(K), 0));
    int64_t r = 0;
    for (size_t i = 0; i < batch.size(); ++i) {
      const Sample& s = batch[i];
      for (int64_t k = 0; k < K; ++k)
        for (int64_t t = 0; t < s.T; ++t) {
          const int64_t tp = t + 1 + k;
          const bool c = tp < s.T && s.mask[tp] && in_vocab[size_t(r + tp)];
          counts[size_t(k * N + r + t)] = c;
          nk[i][size_t(k)] += c;
        }
      for (int64_t k = 0; k < K; ++k)
        if (nk[i][size_t(k)] > 0)
          for (int64_t t = 0; t < s.T; ++t)
            if (counts[size_t(k * N + r + t)])
              scale[size_t(k * N + r + t)] =
                  float(weight * std::pow(c_.step_decay, double(k)) / double(nk[i][size_t(k)]));
      r += s.T;
    }
    cuda::DraftRowStats st;
    eng_->run(scale, backward, zero_grads, st);
    TALON_CHECK(st.counts == counts, "draft on GPU: the device's positions that count disagree with the host's");

    std::vector<TttResult> out(batch.size());
    r = 0;
    for (size_t i = 0; i < batch.size(); ++i) {
      const Sample& s = batch[i];
      TttResult& res = out[i];
      std::vector<uint8_t> right(size_t(s.T), 1);
      res.accept_len = 1;
      for (int64_t k = 0; k < K; ++k) {
        StepTally tally;
        for (int64_t t = 0; t < s.T; ++t) {
          const size_t j = size_t(k * N + r + t);
          tally.add(st.counts[j], st.hit[j], double(st.ce[j]), right[size_t(t)]);
        }
        add_step(res, tally, std::pow(c_.step_decay, double(k)));
      }
      r += s.T;
    }
    return out;
  }

  double clip_grad_norm(double max_norm) override { return eng_->clip_grad_norm(max_norm); }
  void adamw_step(const train::OptimConfig& c, int64_t t_before) override {
    eng_->adamw(train::lr_at(c, t_before), c.beta1, c.beta2, c.eps, c.weight_decay, decay_, t_before + 1);
  }
  void zero_grads() override { eng_->zero_grads(); }
  std::vector<std::pair<std::string, double>> profile() const override { return eng_->profile(); }
  cuda::DraftEngine& engine() { return *eng_; }
  int64_t max_rows() const override { return max_rows_; }
  size_t device_bytes() const override { return eng_->device_bytes(); }

 private:
  cuda::DraftDims dims() const {
    cuda::DraftDims d;
    d.H = c_.H;
    d.I = c_.I;
    d.nh = c_.n_heads;
    d.nkv = c_.n_kv_heads;
    d.hd = c_.head_dim;
    d.V = c_.V;
    d.Vd = c_.Vd;
    d.eps = float(c_.rms_eps);
    d.K = c_.ttt_steps;
    d.norm_before_residual = c_.norm_before_residual;
    return d;
  }
  void resize(DraftWeights& w) const {
    const auto sizes = cuda::draft_tensor_sizes(dims());
    auto nw = w.named();
    for (size_t i = 0; i < nw.size(); ++i) nw[i].second->resize(size_t(sizes[i]));
  }
  void check_sizes(DraftWeights& w) const {
    const auto sizes = cuda::draft_tensor_sizes(dims());
    auto nw = w.named();
    for (size_t i = 0; i < nw.size(); ++i)
      TALON_CHECK(int64_t(nw[i].second->size()) == sizes[i], "draft weight {}: {} values, expected {}", nw[i].first,
                  nw[i].second->size(), sizes[i]);
  }

  DraftConfig c_;
  int64_t max_rows_;
  std::unique_ptr<cuda::DraftEngine> eng_;
  std::vector<uint8_t> decay_;
  std::vector<int32_t> ids_, pos_, len_;
  std::vector<uint8_t> mask_;
  std::vector<float> aux_, hid_;  // staging when the engine's pinned buffers are unavailable
  bool warned_unpinned_ = false;
};


#if TALON_HAVE_NCCL_H
// Data parallel over several GPUs in this process: one CudaDraftTrainer per GPU, each
// call fanned out to one thread per GPU.
class DataParallelDraftTrainer final : public GpuDraftTrainer {
 public:
  DataParallelDraftTrainer(const DraftConfig& c, const TargetHead& tgt, const DraftVocab& vocab,
                           const std::vector<int>& devices, GpuMath math, int64_t max_rows, const GpuGroup& group,
                           const GpuDraftOptions& opt)
      : devices_(devices) {
    const Nccl& nc = Nccl::get();
    const int n = int(devices.size());
    ranks_.resize(size_t(n));
    comms_.resize(size_t(n));
    each([&](int r) {
      ranks_[size_t(r)] = std::make_unique<CudaDraftTrainer>(c, tgt, vocab, devices_[size_t(r)], math, max_rows, opt);
    });
    if (group.size == 0) {
      nc.check(nc.comm_init_all(comms_.data(), n, devices_.data()), "ncclCommInitAll");
      return;
    }
    // Across processes: this process's GPUs are global ranks first_rank.. of group.size.
    TALON_CHECK(group.nccl_id.size() == sizeof(ncclUniqueId), "data parallel: an NCCL id of {} bytes, expected {}",
                group.nccl_id.size(), sizeof(ncclUniqueId));
    ncclUniqueId id;
    std::memcpy(&id, group.nccl_id.data(), sizeof id);
    nc.check(nc.group_start(), "ncclGroupStart");
    for (int r = 0; r < n; ++r) {
      CUDA_CHECK(cudaSetDevice(devices_[size_t(r)]));
      nc.check(nc.comm_init_rank(&comms_[size_t(r)], group.size, id, group.first_rank + r), "ncclCommInitRank");
    }
    nc.check(nc.group_end(), "ncclGroupEnd (joining the job's GPUs)");
  }
  ~DataParallelDraftTrainer() override {
    for (auto c : comms_)
      if (c) Nccl::get().comm_destroy(c);
  }

  void set_weights(DraftWeights& w) override {
    each([&](int r) { ranks_[size_t(r)]->set_weights(w); });
  }
  void get_weights(DraftWeights& w) override { ranks_[0]->get_weights(w); }
  void get_grads(DraftGrads& g) override { ranks_[0]->get_grads(g); }
  void set_moments(const std::vector<std::vector<float>>& m, const std::vector<std::vector<float>>& v) override {
    each([&](int r) { ranks_[size_t(r)]->set_moments(m, v); });
  }
  void get_moments(std::vector<std::vector<float>>& m, std::vector<std::vector<float>>& v) override {
    ranks_[0]->get_moments(m, v);
  }
  std::vector<TttResult> run(const std::vector<Sample>& batch, double weight, bool backward,
                             bool zero_grads) override {
    const size_t n = ranks_.size();
    std::vector<std::vector<Sample>> part(n);
    for (size_t i = 0; i < batch.size(); ++i) part[i % n].push_back(batch[i]);
    std::vector<std::vector<TttResult>> res(n);
    each([&](int r) {
      if (!part[size_t(r)].empty())
        res[size_t(r)] = ranks_[size_t(r)]->run(part[size_t(r)], weight, backward, zero_grads);
      else if (backward && zero_grads)
        ranks_[size_t(r)]->zero_grads();
    });
    std::vector<TttResult> out(batch.size());
    for (size_t i = 0; i < batch.size(); ++i) out[i] = std::move(res[i % n][i / n]);
    return out;
  }
  double clip_grad_norm(double max_norm) override {
    std::vector<double> norms(ranks_.size());
    each([&](int r) {
      cuda::DraftEngine& e = ranks_[size_t(r)]->engine();
      const Nccl& x = Nccl::get();
      x.check(x.all_reduce(e.grad_data(), e.grad_data(), size_t(e.grad_elems()), ncclFloat32, ncclSum,
                           comms_[size_t(r)], e.stream()),
              "all-reduce of the gradients");
      norms[size_t(r)] = ranks_[size_t(r)]->clip_grad_norm(max_norm);
    });
    for (double v : norms)
      TALON_CHECK(v == norms[0], "data parallel: the GPUs disagree on the gradient norm ({} vs {})", v, norms[0]);
    return norms[0];
  }
  void adamw_step(const train::OptimConfig& c, int64_t t_before) override {
    each([&](int r) { ranks_[size_t(r)]->adamw_step(c, t_before); });
  }
  void zero_grads() override {
    each([&](int r) { ranks_[size_t(r)]->zero_grads(); });
  }
  int64_t max_rows() const override { return ranks_[0]->max_rows(); }
  std::vector<std::pair<std::string, double>> profile() const override { return ranks_[0]->profile(); }
  size_t device_bytes() const override { return ranks_[0]->device_bytes(); }

 private:
  // f(rank) on one thread per GPU, all at once; the first error is rethrown.
  template <class F>
  void each(F&& f) {
    run_threads(int(devices_.size()), [&](int r) {
      set_thread_log_tag(fmt::format("gpu {}", devices_[size_t(r)]));
      CUDA_CHECK(cudaSetDevice(devices_[size_t(r)]));
      f(r);
    });
  }

  std::vector<int> devices_;
  std::vector<std::unique_ptr<CudaDraftTrainer>> ranks_;
  std::vector<ncclComm_t> comms_;
};
#endif

}  // namespace

#if TALON_HAVE_NCCL_H
// Host collectives over NCCL: one rank per process, bytes staged through device memory.
class NcclProcessGroup final : public ProcessGroup {
 public:
  NcclProcessGroup(const RankInfo& ri, int device, const fs::path& dir)
      : ProcessGroup(ri.rank, ri.world), device_(device) {
    const Nccl& nc = Nccl::get();
    const std::string id_bytes =
        exchange_id_file(dir, "nccl", ri, ri.rank == 0 ? nccl_unique_id() : std::string(sizeof(ncclUniqueId), '\0'));
    ncclUniqueId id;
    std::memcpy(&id, id_bytes.data(), sizeof id);
    CUDA_CHECK(cudaSetDevice(device_));
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    nc.check(nc.comm_init_rank(&comm_, world_, id, rank_), "ncclCommInitRank (the processes' host group)");
    barrier();
    if (rank_ == 0) remove_id_file(dir, "nccl");
  }
  ~NcclProcessGroup() override {
    if (comm_) Nccl::get().comm_destroy(comm_);
    if (buf_) cudaFree(buf_);
    if (stream_) cudaStreamDestroy(stream_);
  }
  std::vector<std::string> allgather(const std::string& mine) override {
    const Nccl& nc = Nccl::get();
    CUDA_CHECK(cudaSetDevice(device_));
    std::vector<uint64_t> sizes(static_cast<size_t>(world_));
    uint64_t n = mine.size();
    reserve(size_t(world_ + 1) * 8);
    CUDA_CHECK(cudaMemcpyAsync(buf_, &n, 8, cudaMemcpyHostToDevice, stream_));
    nc.check(nc.all_gather(buf_, buf_ + 8, 8, ncclUint8, comm_, stream_), "ncclAllGather (sizes)");
    CUDA_CHECK(cudaMemcpyAsync(sizes.data(), buf_ + 8, size_t(world_) * 8, cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    uint64_t most = 0;
    for (auto z : sizes) most = std::max(most, z);
    reserve(size_t(most) * size_t(world_ + 1));
    if (most > 0) {
      CUDA_CHECK(cudaMemcpyAsync(buf_, mine.data(), mine.size(), cudaMemcpyHostToDevice, stream_));
      nc.check(nc.all_gather(buf_, buf_ + most, size_t(most), ncclUint8, comm_, stream_), "ncclAllGather");
    }
    std::vector<std::string> all(static_cast<size_t>(world_));
    for (int r = 0; r < world_; ++r) {
      all[size_t(r)].resize(size_t(sizes[size_t(r)]));
      if (sizes[size_t(r)] > 0)
        CUDA_CHECK(cudaMemcpyAsync(all[size_t(r)].data(), buf_ + most * uint64_t(r + 1), size_t(sizes[size_t(r)]),
                                   cudaMemcpyDeviceToHost, stream_));
    }
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    return all;
  }
  void broadcast(std::string& data, int root) override {
    const Nccl& nc = Nccl::get();
    CUDA_CHECK(cudaSetDevice(device_));
    uint64_t n = data.size();
    reserve(8);
    CUDA_CHECK(cudaMemcpyAsync(buf_, &n, 8, cudaMemcpyHostToDevice, stream_));
    nc.check(nc.broadcast(buf_, buf_, 8, ncclUint8, root, comm_, stream_), "ncclBroadcast (size)");
    CUDA_CHECK(cudaMemcpyAsync(&n, buf_, 8, cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (rank_ != root) data.resize(size_t(n));
    if (n == 0) return;
    reserve(size_t(n));
    CUDA_CHECK(cudaMemcpyAsync(buf_, data.data(), size_t(n), cudaMemcpyHostToDevice, stream_));
    nc.check(nc.broadcast(buf_, buf_, size_t(n), ncclUint8, root, comm_, stream_), "ncclBroadcast");
    CUDA_CHECK(cudaMemcpyAsync(data.data(), buf_, size_t(n), cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void barrier() override { (void)allgather(std::string()); }
  [[noreturn]] void abort(int code) override {
    spdlog::default_logger()->flush();
    if (comm_) Nccl::get().comm_abort(comm_);
    std::_Exit(code);
  }
  std::string kind() const override { return "NCCL"; }

 private:
  void reserve(size_t n) {
    if (n <= cap_) return;
    if (buf_) CUDA_CHECK(cudaFree(buf_));
    buf_ = nullptr;
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&buf_), n));
    cap_ = n;
  }
  int device_;
  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;
  uint8_t* buf_ = nullptr;
  size_t cap_ = 0;
};
#endif

std::string nccl_unique_id() {
#if TALON_HAVE_NCCL_H
  const Nccl& nc = Nccl::get();
  ncclUniqueId id;
  nc.check(nc.get_unique_id(&id), "ncclGetUniqueId");
  return std::string(reinterpret_cast<const char*>(&id), sizeof id);
#else
  fail("training on GPUs across processes needs NCCL, and this build found no nccl.h (set TALON_NCCL_DIR)");
#endif
}

std::unique_ptr<ProcessGroup> nccl_process_group(const RankInfo& ri, int device, const fs::path& dir) {
#if TALON_HAVE_NCCL_H
  return std::make_unique<NcclProcessGroup>(ri, device, dir);
#else
  (void)ri, (void)device, (void)dir;
  fail("training on GPUs across processes needs NCCL, and this build found no nccl.h (set TALON_NCCL_DIR)");
#endif
}

std::shared_ptr<float[]> host_floats(size_t n, bool pinned) {
  void* p = nullptr;
  if (pinned && n > 0 && cudaHostAlloc(&p, n * sizeof(float), cudaHostAllocPortable) == cudaSuccess)
    return std::shared_ptr<float[]>(static_cast<float*>(p), [](float* q) { cudaFreeHost(q); });
  (void)cudaGetLastError();  // not sticky: ordinary memory instead
  return std::shared_ptr<float[]>(new float[n]);
}

std::unique_ptr<GpuDraftTrainer> make_gpu_draft_trainer(const DraftConfig& c, const TargetHead& tgt,
                                                        const DraftVocab& vocab, const std::vector<int>& devices,
                                                        GpuMath math, int64_t max_rows, const GpuGroup& group,
                                                        const GpuDraftOptions& opt) {
  TALON_CHECK(!devices.empty(), "draft on GPU: no device given");
  if (devices.size() == 1 && group.size == 0)
    return std::make_unique<CudaDraftTrainer>(c, tgt, vocab, devices[0], math, max_rows, opt);
#if TALON_HAVE_NCCL_H
  return std::make_unique<DataParallelDraftTrainer>(c, tgt, vocab, devices, math, max_rows, group, opt);
#else
  fail("training on {} GPUs needs NCCL, and this build found no nccl.h (set TALON_NCCL_DIR)", devices.size());
#endif
}

}  // namespace talon::eagle3
