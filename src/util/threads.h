// Running work on a few threads and keeping the first error: one place for the
// "start N threads, catch in each, join, rethrow" pattern.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace talon {

// fn(i) for i in [0, n), each on its own thread, all at once; waits for every one. Rethrows
// the error of the lowest i that failed (after all have finished), so what is reported does
// not depend on timing.
template <class F>
void run_threads(int n, F&& fn) {
  std::vector<std::exception_ptr> errs(static_cast<size_t>(std::max(n, 0)));
  std::vector<std::thread> th;
  th.reserve(errs.size());
  for (int i = 0; i < n; ++i)
    th.emplace_back([&, i] {
      try {
        fn(i);
      } catch (...) {
        errs[size_t(i)] = std::current_exception();
      }
    });
  for (auto& t : th) t.join();
  for (auto& e : errs)
    if (e) std::rethrow_exception(e);
}

// body(i) for i in [0, count), taken `chunk` at a time by `threads` threads (the calling
// thread is one of them). The first error stops further chunks and is rethrown.
template <class F>
void parallel_for_chunks(size_t count, int threads, size_t chunk, F&& body) {
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr err;
  std::mutex mu;
  auto work = [&] {
    try {
      for (;;) {
        if (failed.load(std::memory_order_relaxed)) break;
        const size_t b = next.fetch_add(chunk);
        if (b >= count) break;
        for (size_t i = b, e = std::min(count, b + chunk); i < e; ++i) body(i);
      }
    } catch (...) {
      std::lock_guard lk(mu);
      if (!err) err = std::current_exception();
      failed = true;
    }
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < threads; ++i) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (err) std::rethrow_exception(err);
}

}  // namespace talon
