// bf16 values as 16-bit keys that order like the values (sample.cu's sampler and accept.cu's
// chain acceptance): the top-k / top-p cut of a bf16 logits row is a key threshold, since ids
// with one key have one probability. b: the bf16 bits in the low 16 bits.
#pragma once
#include <cstdint>

namespace talon::cuda {

__device__ __forceinline__ bool nan16(uint32_t b) { return (b & 0x7fffu) > 0x7f80u; }
__device__ __forceinline__ float value16(uint32_t b) { return __uint_as_float(b << 16); }
// A key that orders like the value: larger value, larger key; -0 is +0 (equal values tie
// by id, as on the host). No NaN here.
__device__ __forceinline__ uint32_t key16(uint32_t b) {
  if (b == 0x8000u) b = 0;
  return (b & 0x8000u) ? (~b & 0xffffu) : (b | 0x8000u);
}
__device__ __forceinline__ uint32_t bits_of_key(uint32_t k) { return (k & 0x8000u) ? (k & 0x7fffu) : (~k & 0xffffu); }

}  // namespace talon::cuda
