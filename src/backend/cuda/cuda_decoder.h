// Internal to the CUDA backend: hooks of the cached decoder for benchmarks.
#pragma once
#include <cstdint>

#include "model/decode.h"

namespace talon::cuda {

// Benchmarks only: marks the first `len` rows of a CUDA decoder's slot as committed without
// computing them (their keys and values are whatever the cache holds: a constant fill
// written once on the first call, so no NaN can come out of them).
void decoder_assume_length(Decoder& d, int slot, int64_t len);

}  // namespace talon::cuda
