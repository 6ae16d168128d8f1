// Internal to the CUDA backend: one rank's model, and the memory-plan check that runs
// before any weight is loaded.
#pragma once
#include <cuda_runtime.h>

#include <functional>
#include <memory>

#include "backend/backend.h"
#include "backend/cuda/ops.h"
#include "model/model.h"

namespace talon::cuda {

struct RankOptions {
  int device = 0;
  int rank = 0, size = 1;  // tensor-parallel rank and degree
  // Sums n bf16 values across the tensor-parallel group in place (null when size == 1).
  std::function<void(bf16*, int64_t, cudaStream_t)> allreduce;
};

std::unique_ptr<Model> make_rank_model(const Checkpoint& ckpt, const RankOptions& ro, const GpuOptions& go);

class Collectives;
// One rank of a DeepSeek-family model in a parallel group (cuda_deepseek.cpp describes the
// layouts). Mode None: the whole model on one GPU.
struct DeepseekParallel {
  enum class Mode { None, Tensor, Expert } mode = Mode::None;
  int rank = 0, size = 1;
  Collectives* comm = nullptr;  // outlives the model
};
std::unique_ptr<Model> make_deepseek_rank_model(const Checkpoint& ckpt, int device, const DeepseekParallel& par);

// Fails (before anything is loaded) when the plan does not fit in a device's free memory,
// with the numbers and a --max-batch-tokens or --tp that would fit.
void check_memory_plan(const ModelConfig& cfg, const GpuOptions& o);

// The devices of a group: each below n_present, and distinct unless ranks may share a GPU.
void check_devices(const GpuOptions& go, int n_present);

}  // namespace talon::cuda
