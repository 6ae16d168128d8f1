// Element types that appear in checkpoints and datasets, and scalar conversions.
#pragma once
#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace talon {

// F8_E4M3: OCP float8 e4m3fn (bias 7, no infinities, S.1111.111 = NaN), max 448, as
// DeepSeek-V3's block-quantized checkpoints and torch.float8_e4m3fn store it.
enum class DType { F32, F16, BF16, F64, I64, I32, I16, I8, U8, BOOL, F8_E4M3 };

// Bytes per element.
size_t dtype_size(DType t);
// Safetensors spelling ("F32", "BF16", ...).
std::string_view dtype_name(DType t);
// Parse the safetensors spelling; returns false for unknown names.
bool dtype_from_name(std::string_view s, DType* out);

inline float bf16_to_f32(uint16_t v) { return std::bit_cast<float>(uint32_t(v) << 16); }

// Round to nearest even; NaN stays NaN (quiet).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

float f16_to_f32(uint16_t h);
float f8e4m3_to_f32(uint8_t v);
uint16_t f32_to_f16(float f);

// Convert `n` elements of type `t` at `src` (little-endian, possibly unaligned) to fp32.
void convert_to_f32(DType t, const void* src, float* dst, size_t n);

}  // namespace talon
