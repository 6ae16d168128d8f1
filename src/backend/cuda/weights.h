// Internal to the CUDA backend: the bf16 weight upload shared
// by the dense model (cuda_model.cpp) and the cached decoder (cuda_decoder.cpp).
#pragma once
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/device.h"
#include "backend/cuda/ops.h"
#include "model/checkpoint.h"

namespace talon::cuda {

// One decoder layer's weights on the device, bf16. q|k|v and gate|up are fused row-wise
// ([qd + 2 kvd, H] and [2 I, H]), so each is one GEMM; optional parts are null.
struct DenseLayerDev {
  bf16 *attn_norm, *mlp_norm, *wqkv, *bqkv = nullptr, *q_norm = nullptr, *k_norm = nullptr, *wo, *wgu, *wdown;
};

// A dense model's weights on one device: under tensor parallelism (tp > 1) rank `rank`
// holds a slice of the heads (nh, nkv per rank) and of the MLP width (inter per rank).
struct DenseDeviceWeights {
  int64_t nh = 0, nkv = 0, inter = 0;
  bf16 *embed = nullptr, *lm_head = nullptr, *final_norm = nullptr;
  float* inv_freq = nullptr;  // RoPE inverse frequencies [head_dim / 2]
  std::vector<DenseLayerDev> layers;
  int64_t weight_bytes = 0;
};

// Host fp32 values -> device bf16 at dst (which holds n values).
void copy_bf16(bf16* dst, const float* src, size_t n);

// Host fp32 arrays -> one new bf16 device block in `arena`, the parts concatenated in order
// (row-major blocks stacked: a fused weight such as q|k|v).
bf16* upload_bf16(DeviceArena& arena, std::initializer_list<const std::vector<float>*> parts);

// One whole checkpoint weight into new bf16 device memory: bf16 copied as stored, other
// dtypes converted a row at a time (never the whole tensor widened to fp32 on the host).
bf16* upload_weight(const WeightRef& w, DeviceArena& arena);

// Uploads the checkpoint's weights (converted to bf16) into `arena` on the current device,
// with a pool of host threads reading straight from the mapped file; logs the rate.
DenseDeviceWeights upload_dense_weights(const Checkpoint& ckpt, int device, int rank, int tp, DeviceArena& arena);

}  // namespace talon::cuda
