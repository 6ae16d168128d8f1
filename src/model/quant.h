// Quantized linear weights of the DeepSeek family, and their fp32 dequantisers. The CPU
// reference dequantises one matrix at a time into a scratch buffer before its matmul; the
// checkpoint itself stays memory-mapped as stored.
//
// Two storage schemes:
//  * FP8 block (DeepSeek-V3 official): `<p>.weight` F8_E4M3 [O, I] plus
//    `<p>.weight_scale_inv` fp32 [ceil(O/bo), ceil(I/bi)] (block bo x bi, 128 x 128);
//    w[o, i] = fp8(w[o, i]) * scale_inv[o / bo, i / bi].
//  * compressed-tensors int4 "pack-quantized", symmetric, group-wise (Kimi-K2-Thinking
//    experts): `<p>.weight_packed` int32 [O, ceil(I/8)], `<p>.weight_scale` [O, ceil(I/g)]
//    (bf16/fp16/fp32), `<p>.weight_shape` int [2] = {O, I}. Each int32 holds 8 consecutive
//    values of a row, element 8j+k in bits [4k, 4k+4) (low nibble first), each stored as
//    q + 8 (q in [-8, 7]); w[o, i] = q[o, i] * scale[o, i / g].
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/checkpoint.h"

namespace talon {

struct QuantWeight {
  enum class Kind { Plain, Fp8Block, Int4Group };
  Kind kind = Kind::Plain;
  int64_t rows = 0, cols = 0;  // O, I: the logical [out, in] shape
  WeightRef w;                 // Plain: F32/BF16/F16 [O, I]; Fp8Block: F8_E4M3 [O, I]; Int4Group: I32 packed
  WeightRef scale;             // Fp8Block: scale_inv; Int4Group: weight_scale
  int64_t block_rows = 0, block_cols = 0;  // Fp8Block
  int64_t group = 0;                       // Int4Group
  bool empty() const { return w.data == nullptr; }
};

// Dequantises into out[rows * cols] (fp32, row-major). Plain weights are widened.
void dequantize(const QuantWeight& q, float* out);

// Rows [r0, r1) only (out holds (r1 - r0) * cols values).
void dequantize_rows(const QuantWeight& q, int64_t r0, int64_t r1, float* out);

}  // namespace talon
