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
//
// Parts: work that calls split() at a few points is captured as several graphs, launched in
// order on the same stream, so that the GPU could start on the first part while the host still
// launches the rest. Made to test whether the ~0.7 ms a CUPTI trace put inside cudaGraphLaunch of
// an 8B decode step was the host's launch cost by node count; measured on an H100 it was not (one
// graph 6.058 ms a step, parts of 1-16 layers 6.060-6.131; bench/RESULTS.md), so parts are opt-in.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

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
  // Called from inside run()'s work (on its stream s): while capturing, ends the part captured
  // so far and starts the next; otherwise (an eager run) does nothing.
  void split(cudaStream_t s);
  // Graphs launched for the last replayed run (its parts).
  size_t last_parts() const { return last_parts_; }
  // Layer stacks: layer_start(l) before layer l splits every `n` layers (n <= 0: one graph).
  // The default is TALON_CUDA_GRAPH_LAYERS from the environment, else 0 (one graph) until a GPU
  // benchmark has chosen the part size. Changing it drops the graphs made so far.
  void set_layers_per_part(int64_t n);
  // What a new cache starts with: TALON_CUDA_GRAPH_LAYERS, else 0.
  static int64_t default_layers_per_part();
  int64_t layers_per_part() const { return layers_per_part_; }
  void layer_start(int64_t l, cudaStream_t s) {
    if (capturing_ && layers_per_part_ > 0 && l > 0 && l % layers_per_part_ == 0) split(s);
  }
  // Destroys every graph and forgets the shapes seen (buffers are about to change).
  void clear();
  void set_enabled(bool on);
  bool enabled() const { return on_; }
  // Runs served by a replayed graph so far.
  int64_t replays() const { return replays_; }

 private:
  static constexpr size_t kMaxGraphs = 256, kMaxShapes = 4096;
  void end_part(cudaStream_t s);  // ends the capture on s; keeps the part unless it is empty
  void drop_capture();

  std::map<std::string, std::vector<cudaGraphExec_t>> graphs_;  // a shape's parts, in order
  std::map<std::string, int> seen_;  // eager runs per shape
  bool on_ = true;
  bool capturing_ = false;
  int64_t layers_per_part_ = 0;
  std::vector<cudaGraphExec_t> parts_;  // the parts captured so far of the run being captured
  int64_t replays_ = 0;
  size_t last_parts_ = 0;
};

}  // namespace talon::cuda
