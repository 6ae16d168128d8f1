// How a model gets a backend: the CPU reference and the CUDA backend's factories, the GPU
// memory plan they size themselves by, and --device parsing. model/ defines the interfaces
// (Model, Decoder); the backends under backend/ implement them, and layers above pick one here.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/checkpoint.h"
#include "model/config.h"
#include "model/decode.h"
#include "model/model.h"
#include "util/dtype.h"

namespace talon {

std::unique_ptr<Model> make_cpu_model(const Checkpoint& ckpt);
// The DeepSeek-V2/V3 (MLA + MoE) CPU reference; make_cpu_model dispatches to it.
// absorbed_mla: attention in the weight-absorbed form (over the shared latent; what decoding
// caches) instead of the expanded one; the same function.
std::unique_ptr<Model> make_cpu_deepseek_model(const Checkpoint& ckpt, bool absorbed_mla = false);
// The cached decoder of that family (the absorbed form over a latent + k_pe cache);
// make_cpu_decoder dispatches to it.
std::unique_ptr<Decoder> make_cpu_deepseek_decoder(const Checkpoint& ckpt, int n_slots, int64_t max_len,
                                                   int64_t cache_tokens = 0);
// The same family on one GPU (backend/cuda/cuda_deepseek.cpp); make_cuda_model dispatches here.
std::unique_ptr<Model> make_cuda_deepseek_model(const Checkpoint& ckpt, int device);

// A CUDA model on one GPU, or a group over several (one thread per GPU): tensor parallel
// (NCCL all-reduce after the attention output and MLP down projections), or for the
// DeepSeek family also expert parallel (attention on each rank's own tokens, experts split,
// rows moved by all-to-all).
struct GpuOptions {
  std::vector<int> devices{0};  // tp or ep > 1: one device per rank
  int tp = 1;
  int ep = 1;                   // expert parallel (mixture-of-experts models): ranks split experts and tokens
  // Ranks may share a GPU (devices listed more than once): collectives by device copies
  // instead of NCCL. For running a parallel layout's code on fewer GPUs (tests).
  bool share_devices = false;
  int64_t max_tokens = 0;       // tokens per forward to plan for (0: grown on demand)
  int64_t n_capture = 0;        // captured layers per forward
  DType capture_dtype = DType::BF16;
};

// What a CUDA model needs on each GPU, computed before anything is loaded.
struct GpuMemoryPlan {
  int64_t weights = 0, activations = 0, captures = 0, reserve = 0;
  int64_t per_token = 0;  // activation + capture bytes per token of --max-batch-tokens
  int64_t total() const { return weights + activations + captures + reserve; }
};
GpuMemoryPlan plan_gpu_memory(const ModelConfig& c, const GpuOptions& o);

// Throws when the build has no CUDA backend, no device is present, or the plan does not
// fit (naming the numbers and a --max-batch-tokens / --tp that would).
std::unique_ptr<Model> make_cuda_model(const Checkpoint& ckpt, const GpuOptions& opt);
std::unique_ptr<Model> make_cuda_model(const Checkpoint& ckpt, int device);
bool cuda_backend_built();

// --device: "cpu", "cuda" (every visible GPU), "cuda:N" or "cuda:N,M,...".
struct DeviceSpec {
  bool cuda = false;
  std::vector<int> devices;  // empty with cuda: all visible
};
// allow_repeats: a GPU may be listed more than once (ranks sharing it, GpuOptions::share_devices).
DeviceSpec parse_device(const std::string& spec, bool allow_repeats = false);

// One line per visible GPU: index, name, memory used/total (empty without CUDA).
struct GpuInfo {
  int index;
  std::string name;
  int64_t total_bytes, free_bytes;
};
std::vector<GpuInfo> list_gpus();

// The fp32 reference (same arithmetic as make_cpu_model's forward). Slots grow on demand up
// to max_len tokens each, within a capacity of cache_tokens rows counted in pages as a paged
// cache counts them (model/decode.h; 0: every slot full at once).
std::unique_ptr<Decoder> make_cpu_decoder(const Checkpoint& ckpt, int n_slots, int64_t max_len,
                                          int64_t cache_tokens = 0);

// A CUDA decoder on one GPU: bf16 weights and cache, fp32 accumulation. The KV cache is a pool
// of pages (model/kv_pages.h) allocated up front, shared by the n_slots slots of at most
// max_len tokens: cache_tokens rows, or with 0 enough for every slot full at once when that
// fits the free memory, else as many pages as fit (at least one max_len sequence). Throws
// when the build has no CUDA backend or the cache does not fit, naming the numbers.
std::unique_ptr<Decoder> make_cuda_decoder(const Checkpoint& ckpt, int device, int n_slots, int64_t max_len,
                                           int64_t cache_tokens = 0);
// The same on go.devices: one GPU, or a tensor-parallel group of go.tp or an expert-parallel
// group of go.ep (DeepSeek family only: one thread per GPU, NCCL, or device copies with
// go.share_devices). Throws naming what is unsupported (a dense model with --tp > 1).
std::unique_ptr<Decoder> make_cuda_decoder(const Checkpoint& ckpt, const GpuOptions& go, int n_slots, int64_t max_len,
                                           int64_t cache_tokens = 0);
// The decoder a command's --device / --tp / --ep / --share-gpus ask for: the CPU reference, or
// CUDA on dev.devices (cuda alone: the first tp x ep GPUs; --share-gpus with one GPU: every rank
// on it). Under --ep, cache_tokens is each GPU's cache.
std::unique_ptr<Decoder> make_decoder(const Checkpoint& ckpt, const DeviceSpec& dev, int tp, int ep, bool share_gpus,
                                      int n_slots, int64_t max_len, int64_t cache_tokens = 0);

}  // namespace talon
