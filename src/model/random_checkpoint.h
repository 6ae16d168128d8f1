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

}  // namespace talon
