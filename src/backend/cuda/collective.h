// Internal to the CUDA backend: the collectives a group of ranks in one process uses (one
// thread per rank, as everywhere in Talon). Two implementations behind one interface:
//  * NCCL over distinct GPUs (ncclCommInitAll; all-reduce, and all-to-all as grouped
//    send/recv), for real tensor / expert parallelism;
//  * "shared": ranks that may share one GPU (NCCL refuses two ranks on one device), moving
//    data with device copies between host barriers. It computes what NCCL computes, slower;
//    it lets a one-GPU machine run every parallel layout's code path (tests, debugging).
// Small host-side values (row counts before an all-to-all) go through a host exchange in
// both, since every rank lives in this process.
#pragma once
#include <cuda_runtime.h>

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "util/dtype.h"

namespace talon::cuda {

// A barrier for n threads that can be aborted: waiting (or arriving later) then throws, so
// one rank's failure releases the others instead of leaving them blocked.
class HostBarrier {
 public:
  explicit HostBarrier(int n) : n_(n) {}
  void arrive_and_wait();
  void abort();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_, waiting_ = 0;
  uint64_t phase_ = 0;
  bool aborted_ = false;
};

class Collectives {
 public:
  explicit Collectives(int size) : size_(size), barrier_(size), table_(size_t(size) * size_t(size)) {}
  virtual ~Collectives() = default;
  int size() const { return size_; }

  // Every rank gives one value per destination rank; returns all of them, [src * size + dst].
  // A host barrier: all ranks must call it.
  std::vector<int64_t> exchange(int rank, const std::vector<int64_t>& mine);

  // In place: p[count] (F32 or BF16) summed over the ranks, the same result on every rank.
  virtual void all_reduce(int rank, void* p, int64_t count, DType t, cudaStream_t s) = 0;
  // Rank r sends send_bytes[d] bytes, laid out back to back by destination d in `send`, and
  // receives recv_bytes[src] bytes from each src, back to back by source in `recv`.
  virtual void all_to_all(int rank, const void* send, const std::vector<int64_t>& send_bytes, void* recv,
                          const std::vector<int64_t>& recv_bytes, cudaStream_t s) = 0;
  // Called by a failing rank: the others leave their collectives with an error.
  virtual void abort() { barrier_.abort(); }

 protected:
  int size_;
  HostBarrier barrier_;
  std::vector<int64_t> table_;
};

// NCCL over devices[0..n) (distinct GPUs). Throws when NCCL cannot be loaded.
std::unique_ptr<Collectives> make_nccl_collectives(const std::vector<int>& devices);
// Ranks that may share devices; each rank's buffers live on its own device.
std::unique_ptr<Collectives> make_shared_collectives(int size);

}  // namespace talon::cuda
