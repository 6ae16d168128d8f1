// Collectives of a group of ranks in one process (collective.h).
#include "backend/cuda/collective.h"

#include <atomic>

#include "backend/cuda/check.h"
#include "backend/cuda/nccl_lib.h"
#include "backend/cuda/ops.h"
#include "util/error.h"

namespace talon::cuda {

void HostBarrier::arrive_and_wait() {
  std::unique_lock lk(mu_);
  if (aborted_) fail("collective aborted: another rank failed");
  const uint64_t phase = phase_;
  if (++waiting_ == n_) {
    waiting_ = 0;
    ++phase_;
    cv_.notify_all();
    return;
  }
  cv_.wait(lk, [&] { return phase_ != phase || aborted_; });
  if (phase_ == phase) fail("collective aborted: another rank failed");
}

void HostBarrier::abort() {
  std::lock_guard lk(mu_);
  aborted_ = true;
  cv_.notify_all();
}

std::vector<int64_t> Collectives::exchange(int rank, const std::vector<int64_t>& mine) {
  TALON_CHECK(int(mine.size()) == size_, "exchange: {} values for {} ranks", mine.size(), size_);
  for (int d = 0; d < size_; ++d) table_[size_t(rank * size_ + d)] = mine[size_t(d)];
  barrier_.arrive_and_wait();
  std::vector<int64_t> all = table_;
  barrier_.arrive_and_wait();  // nobody writes the next exchange before everyone has read this one
  return all;
}

namespace {

// ------------------------------------------------------------------ shared device(s)

class SharedCollectives final : public Collectives {
 public:
  explicit SharedCollectives(int n) : Collectives(n), ptrs_(size_t(n)), offs_(size_t(n) * size_t(n)) {}

  void all_reduce(int rank, void* p, int64_t count, DType t, cudaStream_t s) override {
    TALON_CHECK(t == DType::F32 || t == DType::BF16, "all-reduce: {} unsupported", dtype_name(t));
    const size_t bytes = size_t(count) * dtype_size(t);
    CUDA_CHECK(cudaStreamSynchronize(s));
    ptrs_[size_t(rank)] = p;
    barrier_.arrive_and_wait();
    // Every rank sums all buffers in rank order into its own temporary: the same result everywhere.
    void *acc = nullptr, *tmp = nullptr;
    CUDA_CHECK(cudaMallocAsync(&acc, std::max<size_t>(bytes, 1), s));
    CUDA_CHECK(cudaMallocAsync(&tmp, std::max<size_t>(bytes, 1), s));
    CUDA_CHECK(cudaMemcpyAsync(acc, ptrs_[0], bytes, cudaMemcpyDefault, s));
    for (int r = 1; r < size_; ++r) {
      CUDA_CHECK(cudaMemcpyAsync(tmp, ptrs_[size_t(r)], bytes, cudaMemcpyDefault, s));
      accumulate(acc, tmp, count, t == DType::BF16, s);
    }
    CUDA_CHECK(cudaStreamSynchronize(s));
    barrier_.arrive_and_wait();  // all reads of the inputs done
    CUDA_CHECK(cudaMemcpyAsync(p, acc, bytes, cudaMemcpyDefault, s));
    CUDA_CHECK(cudaFreeAsync(tmp, s));
    CUDA_CHECK(cudaFreeAsync(acc, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
  }

  void all_to_all(int rank, const void* send, const std::vector<int64_t>& send_bytes, void* recv,
                  const std::vector<int64_t>& recv_bytes, cudaStream_t s) override {
    CUDA_CHECK(cudaStreamSynchronize(s));
    ptrs_[size_t(rank)] = const_cast<void*>(send);
    int64_t off = 0;
    for (int d = 0; d < size_; ++d) offs_[size_t(rank * size_ + d)] = off, off += send_bytes[size_t(d)];
    barrier_.arrive_and_wait();
    int64_t at = 0;
    for (int src = 0; src < size_; ++src) {
      const int64_t n = recv_bytes[size_t(src)];
      if (n > 0)
        CUDA_CHECK(cudaMemcpyAsync(static_cast<uint8_t*>(recv) + at,
                                   static_cast<const uint8_t*>(ptrs_[size_t(src)]) + offs_[size_t(src * size_ + rank)],
                                   size_t(n), cudaMemcpyDefault, s));
      at += n;
    }
    CUDA_CHECK(cudaStreamSynchronize(s));
    barrier_.arrive_and_wait();  // senders may reuse their buffers
  }

 private:
  std::vector<void*> ptrs_;
  std::vector<int64_t> offs_;
};

// ------------------------------------------------------------------ NCCL

#if TALON_HAVE_NCCL_H
class NcclCollectives final : public Collectives {
 public:
  explicit NcclCollectives(const std::vector<int>& devices) : Collectives(int(devices.size())) {
    const Nccl& nc = Nccl::get();
    comms_.resize(devices.size());
    nc.check(nc.comm_init_all(comms_.data(), size_, devices.data()), "ncclCommInitAll");
  }
  ~NcclCollectives() override {
    const Nccl& nc = Nccl::get();
    for (auto c : comms_)
      if (c) aborted_ ? nc.comm_abort(c) : nc.comm_destroy(c);
  }

  void all_reduce(int rank, void* p, int64_t count, DType t, cudaStream_t s) override {
    const Nccl& nc = Nccl::get();
    nc.check(nc.all_reduce(p, p, size_t(count), t == DType::F32 ? ncclFloat32 : ncclBfloat16, ncclSum,
                           comms_[size_t(rank)], s),
             "all-reduce");
  }

  void all_to_all(int rank, const void* send, const std::vector<int64_t>& send_bytes, void* recv,
                  const std::vector<int64_t>& recv_bytes, cudaStream_t s) override {
    const Nccl& nc = Nccl::get();
    ncclComm_t c = comms_[size_t(rank)];
    nc.check(nc.group_start(), "group start");
    int64_t so = 0, ro = 0;
    for (int d = 0; d < size_; ++d) {
      if (send_bytes[size_t(d)] > 0)
        nc.check(nc.send(static_cast<const uint8_t*>(send) + so, size_t(send_bytes[size_t(d)]), ncclUint8, d, c, s),
                 "send");
      if (recv_bytes[size_t(d)] > 0)
        nc.check(nc.recv(static_cast<uint8_t*>(recv) + ro, size_t(recv_bytes[size_t(d)]), ncclUint8, d, c, s), "recv");
      so += send_bytes[size_t(d)];
      ro += recv_bytes[size_t(d)];
    }
    nc.check(nc.group_end(), "group end");
  }

  void abort() override {
    Collectives::abort();
    if (aborted_.exchange(true)) return;
    const Nccl& nc = Nccl::get();
    for (auto c : comms_) nc.comm_abort(c);
    comms_.assign(comms_.size(), nullptr);
  }

 private:
  std::vector<ncclComm_t> comms_;
  std::atomic<bool> aborted_{false};
};
#endif

}  // namespace

std::unique_ptr<Collectives> make_shared_collectives(int size) { return std::make_unique<SharedCollectives>(size); }

std::unique_ptr<Collectives> make_nccl_collectives(const std::vector<int>& devices) {
#if TALON_HAVE_NCCL_H
  return std::make_unique<NcclCollectives>(devices);
#else
  fail("{} GPUs in one group need NCCL, and this build has no NCCL headers; rebuild with NCCL installed",
       devices.size());
#endif
}

}  // namespace talon::cuda
