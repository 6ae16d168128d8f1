#include "backend/cuda/graph_cache.h"

#include <cstdlib>

#include "backend/cuda/check.h"

namespace talon::cuda {

GraphCache::GraphCache() {
  const char* g = std::getenv("TALON_CUDA_GRAPHS");
  on_ = !(g && std::string(g) == "0");
  layers_per_part_ = default_layers_per_part();
}

int64_t GraphCache::default_layers_per_part() {
  const char* n = std::getenv("TALON_CUDA_GRAPH_LAYERS");
  return n && *n ? std::atoll(n) : 0;
}

void GraphCache::set_layers_per_part(int64_t n) {
  layers_per_part_ = n;
  clear();
}

GraphCache::~GraphCache() { clear(); }

void GraphCache::clear() {
  for (auto& [k, parts] : graphs_)
    for (cudaGraphExec_t e : parts) cudaGraphExecDestroy(e);
  graphs_.clear();
  seen_.clear();
}

void GraphCache::set_enabled(bool on) {
  on_ = on;
  clear();
}

void GraphCache::end_part(cudaStream_t s) {
  cudaGraph_t g = nullptr;
  CUDA_CHECK(cudaStreamEndCapture(s, &g));
  size_t nodes = 0;
  cudaError_t e = cudaGraphGetNodes(g, nullptr, &nodes);
  cudaGraphExec_t exec = nullptr;
  if (e == cudaSuccess && nodes > 0) e = cudaGraphInstantiate(&exec, g, 0);
  cudaGraphDestroy(g);
  CUDA_CHECK(e);
  if (exec) parts_.push_back(exec);
}

void GraphCache::drop_capture() {
  for (cudaGraphExec_t e : parts_) cudaGraphExecDestroy(e);
  parts_.clear();
  capturing_ = false;
}

void GraphCache::split(cudaStream_t s) {
  if (!capturing_) return;
  end_part(s);
  CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
}

void GraphCache::run(const std::string& key, cudaStream_t s, const std::function<void()>& work, bool allowed) {
  if (!allowed || !on_ || debug_sync()) {
    work();
    return;
  }
  auto it = graphs_.find(key);
  if (it == graphs_.end()) {
    if (seen_.size() >= kMaxShapes || ++seen_[key] < 3) {
      work();
      return;
    }
    if (graphs_.size() >= kMaxGraphs) clear();
    CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    capturing_ = true;
    try {
      work();
      capturing_ = false;
      end_part(s);
    } catch (...) {
      if (capturing_) {
        cudaGraph_t g = nullptr;
        cudaStreamEndCapture(s, &g);
        if (g) cudaGraphDestroy(g);
      }
      drop_capture();
      throw;
    }
    it = graphs_.emplace(key, std::move(parts_)).first;
    parts_.clear();
  }
  for (cudaGraphExec_t e : it->second) CUDA_CHECK(cudaGraphLaunch(e, s));
  last_parts_ = it->second.size();
  ++replays_;
}

}  // namespace talon::cuda
