#include "util/dtype.h"

#include <cmath>

#include "util/error.h"

namespace talon {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F64: case DType::I64: return 8;
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: case DType::I16: return 2;
    case DType::I8: case DType::U8: case DType::BOOL: case DType::F8_E4M3: return 1;
  }
  return 0;
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::F64: return "F64";
    case DType::I64: return "I64";
    case DType::I32: return "I32";
    case DType::I16: return "I16";
    case DType::I8: return "I8";
    case DType::U8: return "U8";
    case DType::BOOL: return "BOOL";
    case DType::F8_E4M3: return "F8_E4M3";
  }
  return "?";
}

bool dtype_from_name(std::string_view s, DType* out) {
  static constexpr struct { std::string_view n; DType t; } table[] = {
      {"F32", DType::F32}, {"F16", DType::F16}, {"BF16", DType::BF16}, {"F64", DType::F64},
      {"I64", DType::I64}, {"I32", DType::I32}, {"I16", DType::I16},   {"I8", DType::I8},
      {"U8", DType::U8},   {"BOOL", DType::BOOL}, {"F8_E4M3", DType::F8_E4M3}};
  for (auto& e : table)
    if (e.n == s) { *out = e.t; return true; }
  return false;
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do { man <<= 1; ++e; } while (!(man & 0x400));
      u = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | man << 13;
  } else {
    u = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  return std::bit_cast<float>(u);
}

float f8e4m3_to_f32(uint8_t v) {
  const uint32_t sign = uint32_t(v & 0x80) << 24;
  const uint32_t exp = (v >> 3) & 0xf, man = v & 0x7;
  if (exp == 15 && man == 7) return std::bit_cast<float>(sign | 0x7fc00000u);  // the only NaN; no infinities
  float mag;
  if (exp == 0) mag = float(man) * 0x1p-9f;  // subnormal: man/8 * 2^(1-7)
  else mag = std::bit_cast<float>((exp + 127 - 7) << 23 | man << 20);
  return std::bit_cast<float>(std::bit_cast<uint32_t>(mag) | sign);
}

uint16_t f32_to_f16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00;           // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00;          // overflow -> inf
  if (a < 0x38800000u) {                               // subnormal or zero
    float m = std::bit_cast<float>(a) * 16777216.0f;   // scale by 2^24
    return sign | uint16_t(std::lrint(m));
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);          // round to nearest even
  return sign | uint16_t((r - 0x38000000u) >> 13);
}

void convert_to_f32(DType t, const void* src, float* dst, size_t n) {
  const auto* b = static_cast<const unsigned char*>(src);
  switch (t) {
    case DType::F32:
      std::memcpy(dst, b, n * 4);
      return;
    case DType::BF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t v; std::memcpy(&v, b + 2 * i, 2);
        dst[i] = bf16_to_f32(v);
      }
      return;
    case DType::F16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t v; std::memcpy(&v, b + 2 * i, 2);
        dst[i] = f16_to_f32(v);
      }
      return;
    case DType::F8_E4M3:
      for (size_t i = 0; i < n; ++i) dst[i] = f8e4m3_to_f32(b[i]);
      return;
    default:
      fail("cannot convert {} to F32", dtype_name(t));
  }
}

}  // namespace talon
