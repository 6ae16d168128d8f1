// CUDA graphs of repeated launch sequences, by shape: the cached decoder's and the draft
// layer's forwards launch 10-400 small kernels each whose arguments depend only on the
// forward's shape (sizes and device buffers; the per-call inputs are uploaded into fixed
// buffers first), so a sequence captured once replays with one launch.
//
// A key names the shape. Its first two runs are eager (they also make cuBLAS's plans and
// kernel attributes, which capture must not do; a shape seen once or twice, common in
// batched generation, is not worth a capture); the third is captured, then replayed.
// Whoever owns the buffers the work uses calls clear() before freeing or moving them.
// TALON_CUDA_GRAPHS=0 in the environment (read when a cache is made) turns replay off;
// so does TALON_CUDA_SYNC=1, whose per-kernel waits capture cannot hold.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>

namespace talon::cuda {

class GraphCache {
 public:
  GraphCache();
  ~GraphCache();
  GraphCache(const GraphCache&) = delete;
  GraphCache& operator=(const GraphCache&) = delete;

  // Runs `work` (stream-ordered launches on s only) eagerly, or from the graph of `key`.
  // allowed = false: always eagerly (a shape not worth keeping, such as a prefill).
  void run(const std::string& key, cudaStream_t s, const std::function<void()>& work, bool allowed = true);
  // Destroys every graph and forgets the shapes seen (buffers are about to change).
  void clear();
  void set_enabled(bool on);
  bool enabled() const { return on_; }
  // Runs served by a replayed graph so far.
  int64_t replays() const { return replays_; }

 private:
  static constexpr size_t kMaxGraphs = 256, kMaxShapes = 4096;
  std::map<std::string, cudaGraphExec_t> graphs_;
  std::map<std::string, int> seen_;  // eager runs per shape
  bool on_ = true;
  int64_t replays_ = 0;
};

}  // namespace talon::cuda
