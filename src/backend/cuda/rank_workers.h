// Internal to the CUDA backend: one worker thread per rank of a group in this process (one
// thread per GPU, as everywhere in Talon), for the parallel models (tp_model.cpp) and the
// parallel decoders (decoder_group.cpp). run() hands every worker the same job, waits for all
// of them and rethrows the first failure; a failing rank aborts the group's collectives so the
// others leave theirs instead of waiting for it.
#pragma once
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backend/cuda/collective.h"
#include "util/log.h"

namespace talon::cuda {

class RankWorkers {
 public:
  // tag(r): the log prefix of rank r's thread.
  RankWorkers(int n, std::function<std::string(int)> tag, Collectives* comm) : tag_(std::move(tag)), comm_(comm) {
    for (int r = 0; r < n; ++r) threads_.emplace_back([this, r] { loop(r); });
  }
  ~RankWorkers() {
    {
      std::lock_guard lk(mu_);
      quit_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  RankWorkers(const RankWorkers&) = delete;
  RankWorkers& operator=(const RankWorkers&) = delete;
  int size() const { return int(threads_.size()); }

  // job(r) on rank r's thread, for every rank; returns when all are done.
  void run(const std::function<void(int)>& job) {
    std::unique_lock lk(mu_);
    job_ = &job;
    pending_ = size();
    errors_.assign(size_t(size()), nullptr);
    ++generation_;
    cv_.notify_all();
    done_cv_.wait(lk, [&] { return pending_ == 0; });
    job_ = nullptr;
    for (auto& e : errors_)
      if (e) std::rethrow_exception(e);
  }

 private:
  void loop(int r) {
    set_thread_log_tag(tag_(r));
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* job;
      {
        std::unique_lock lk(mu_);
        cv_.wait(lk, [&] { return quit_ || generation_ != seen; });
        if (quit_) return;
        seen = generation_;
        job = job_;
      }
      std::exception_ptr err;
      try {
        (*job)(r);
      } catch (...) {
        err = std::current_exception();
        if (comm_) comm_->abort();
      }
      std::lock_guard lk(mu_);
      errors_[size_t(r)] = err;
      if (--pending_ == 0) done_cv_.notify_all();
    }
  }

  std::function<std::string(int)> tag_;
  Collectives* comm_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* job_ = nullptr;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool quit_ = false;
  std::vector<std::exception_ptr> errors_;
};

}  // namespace talon::cuda
