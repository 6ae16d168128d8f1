#include "model/quant.h"

#include <cstring>
#include <vector>

#include "util/error.h"

namespace talon {

namespace {

// n scale values starting at element i, as fp32.
void scale_row(const WeightRef& w, int64_t i, int64_t n, float* out) {
  const auto* b = static_cast<const unsigned char*>(w.data);
  convert_to_f32(w.dtype, b + size_t(i) * dtype_size(w.dtype), out, size_t(n));
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
      std::vector<float> srow(static_cast<size_t>(sc));
      for (int64_t o = r0; o < r1; ++o) {
        scale_row(q.scale, (o / q.block_rows) * sc, sc, srow.data());
        float* dst = out + (o - r0) * I;
        for (int64_t i = 0; i < I; ++i) dst[i] = f8e4m3_to_f32(b[o * I + i]) * srow[size_t(i / q.block_cols)];
      }
      return;
    }
    case QuantWeight::Kind::Int4Group: {
      const auto* b = static_cast<const unsigned char*>(q.w.data);
      const int64_t words = (I + 7) / 8, groups = (I + q.group - 1) / q.group;
      std::vector<float> srow(static_cast<size_t>(groups));
      for (int64_t o = r0; o < r1; ++o) {
        scale_row(q.scale, o * groups, groups, srow.data());
        float* dst = out + (o - r0) * I;
        for (int64_t i = 0; i < I; ++i) {
          uint32_t word;
          std::memcpy(&word, b + size_t(o * words + i / 8) * 4, 4);
          const int code = int((word >> (4 * (i % 8))) & 0xfu);  // low nibble first
          dst[i] = float(code - 8) * srow[size_t(i / q.group)];  // stored with offset 8: q in [-8, 7]
        }
      }
      return;
    }
  }
}

void dequantize(const QuantWeight& q, float* out) { dequantize_rows(q, 0, q.rows, out); }

}  // namespace talon
