#include "model/quant.h"

#include <cstring>

#include "util/error.h"

namespace talon {

namespace {

float scalar_at(const WeightRef& w, int64_t i) {
  float v;
  const auto* b = static_cast<const unsigned char*>(w.data);
  convert_to_f32(w.dtype, b + size_t(i) * dtype_size(w.dtype), &v, 1);
  return v;
}

}  // namespace

void dequantize_rows(const QuantWeight& q, int64_t r0, int64_t r1, float* out) {
  const int64_t I = q.cols;
  TALON_CHECK(0 <= r0 && r0 <= r1 && r1 <= q.rows, "dequantize_rows: rows [{}, {}) outside [0, {})", r0, r1, q.rows);
  switch (q.kind) {
    case QuantWeight::Kind::Plain: {
      const auto* b = static_cast<const unsigned char*>(q.w.data);
      convert_to_f32(q.w.dtype, b + size_t(r0 * I) * dtype_size(q.w.dtype), out, size_t((r1 - r0) * I));
      return;
    }
    case QuantWeight::Kind::Fp8Block: {
      const auto* b = static_cast<const uint8_t*>(q.w.data);
      const int64_t sc = (I + q.block_cols - 1) / q.block_cols;  // scale columns
      for (int64_t o = r0; o < r1; ++o) {
        float* dst = out + (o - r0) * I;
        for (int64_t i = 0; i < I; ++i) {
          const float s = scalar_at(q.scale, (o / q.block_rows) * sc + i / q.block_cols);
          dst[i] = f8e4m3_to_f32(b[o * I + i]) * s;
        }
      }
      return;
    }
    case QuantWeight::Kind::Int4Group: {
      const auto* b = static_cast<const unsigned char*>(q.w.data);
      const int64_t words = (I + 7) / 8, groups = (I + q.group - 1) / q.group;
      for (int64_t o = r0; o < r1; ++o) {
        float* dst = out + (o - r0) * I;
        for (int64_t i = 0; i < I; ++i) {
          uint32_t word;
          std::memcpy(&word, b + size_t(o * words + i / 8) * 4, 4);
          const int code = int((word >> (4 * (i % 8))) & 0xfu);  // low nibble first
          const float s = scalar_at(q.scale, o * groups + i / q.group);
          dst[i] = float(code - 8) * s;  // stored with offset 8: q in [-8, 7]
        }
      }
      return;
    }
  }
}

void dequantize(const QuantWeight& q, float* out) { dequantize_rows(q, 0, q.rows, out); }

}  // namespace talon
