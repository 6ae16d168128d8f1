#include "backend/cuda/graph_cache.h"

#include <cstdlib>

#include "backend/cuda/check.h"

namespace talon::cuda {

GraphCache::GraphCache() {
  const char* g = std::getenv("TALON_CUDA_GRAPHS");
  on_ = !(g && std::string(g) == "0");
}

GraphCache::~GraphCache() { clear(); }

void GraphCache::clear() {
  for (auto& [k, e] : graphs_) cudaGraphExecDestroy(e);
  graphs_.clear();
  seen_.clear();
}

void GraphCache::set_enabled(bool on) {
  on_ = on;
  clear();
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
    cudaGraph_t g = nullptr;
    CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    try {
      work();
    } catch (...) {
      cudaStreamEndCapture(s, &g);
      if (g) cudaGraphDestroy(g);
      throw;
    }
    CUDA_CHECK(cudaStreamEndCapture(s, &g));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t e = cudaGraphInstantiate(&exec, g, 0);
    cudaGraphDestroy(g);
    CUDA_CHECK(e);
    it = graphs_.emplace(key, exec).first;
  }
  CUDA_CHECK(cudaGraphLaunch(it->second, s));
  ++replays_;
}

}  // namespace talon::cuda
