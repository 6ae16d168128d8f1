// Internal to the CUDA backend: one DeepSeek-family MoE layer's routed experts on the device,
// stacked per matrix kind for the grouped GEMMs of moe.h, plus its routing parameters.
// int4 pack-quantized experts stay int4 (words copied as stored, scales as bf16: the GEMM
// dequantizes in its tile loads); plain experts are converted to bf16. FP8 block-quantized
// experts are dequantized to bf16 here, one matrix at a time (an FP8 in-GEMM path is not
// written yet).
#pragma once
#include "backend/cuda/moe.h"
#include "backend/cuda/weights.h"
#include "model/config.h"
#include "model/deepseek.h"

namespace talon::cuda {

struct MoeLayerDev {
  MoeExperts experts;
  MoeRouting routing;
  float* router_bias = nullptr;  // [E] fp32, or null
  int64_t bytes = 0;
};

MoeLayerDev upload_moe_layer(const DeepseekLayer& L, const ModelConfig& c, DeviceArena& arena);

// The routing parameters of a config (n_group and topk_group only for grouped methods).
MoeRouting moe_routing(const ModelConfig& c);

}  // namespace talon::cuda
