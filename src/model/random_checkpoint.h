// A checkpoint with random weights and no file behind it, for benchmarks and tests of
// target shapes that have no file at hand (an 8B-shaped model, odd head sizes).
#pragma once
#include <cstdint>
#include <memory>

#include "model/checkpoint.h"

namespace talon {

// The layout of `cfg` (dense, or the DeepSeek family with int4 pack-quantized routed experts
// when cfg.ds says compressed-tensors with a group size) in bf16: every matrix and bias views a window of one shared
// buffer of uniform random values with standard deviation `std` (each tensor at its own
// offset, so tensors differ), every norm weight is ones. Weights live as long as the
// checkpoint; the buffer is as large as the largest tensor plus 1M values (int4 words view
// a second such buffer of random bits).
std::unique_ptr<Checkpoint> make_random_checkpoint(const ModelConfig& cfg, float std = 0.02f, uint64_t seed = 1);

// The Kimi-K2 layer shapes with `layers` decoder layers (the real model has 61): hidden 7168,
// MLA (q LoRA 1536, kv LoRA 512, 64 heads of 128 + 64, v 128), 384 routed experts top-8 of
// width 2048 plus one shared expert, sigmoid noaux_tc routing, scaling 2.827, a dense first
// layer of width 18432, vocab 163840; routed experts int4 group 32 (else bf16).
ModelConfig kimi_k2_shape(int64_t layers, bool int4_experts = true);

// A model named by a spec instead of a path, for runs at full scale without a checkpoint on
// disk: "random:kimi-k2:LAYERS" (int4 experts) or "random:kimi-k2:LAYERS:bf16". Throws
// naming what was expected on anything else.
bool is_random_model_spec(const std::string& s);
std::unique_ptr<Checkpoint> open_random_model_spec(const std::string& spec);

}  // namespace talon
