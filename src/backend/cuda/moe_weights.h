// Internal to the CUDA backend: one DeepSeek-family MoE layer's routed experts on the device,
// stacked per matrix kind for the grouped GEMMs of moe.h, plus its routing parameters.
// int4 pack-quantized experts stay int4 (words copied as stored, scales as bf16) and FP8
// block-quantized experts stay FP8 (e4m3 bytes as stored, block scales as fp32): the GEMM
// dequantizes in its tile loads. Plain experts are converted to bf16.
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

// Experts [first, first + count) of the layer (count < 0: all of them); the routing stays
// global (n_experts is the layer's total).
MoeLayerDev upload_moe_layer(const DeepseekLayer& L, const ModelConfig& c, DeviceArena& arena, int64_t first = 0,
                             int64_t count = -1);

// The routing parameters of a config (n_group and topk_group only for grouped methods).
MoeRouting moe_routing(const ModelConfig& c);

}  // namespace talon::cuda
