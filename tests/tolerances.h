// Every numeric tolerance the tests use, in one table. Each loosened entry says why.
#pragma once

namespace talon::tol {

// CPU reference vs HF transformers fp32 (eager) on the tiny random models. Both are
// fp32 with different summation orders (our 8-lane dot products, fp64 RMSNorm
// statistics and attention accumulators vs torch's BLAS); differences are a few ulps
// per op, amplified through <= 4 layers with std-0.2 weights.
inline constexpr double kGoldenHiddenRel = 2e-5;  // max|a-b| / max(1, max|b|) per tensor
inline constexpr double kGoldenLogitsRel = 5e-5;

// SmolLM2 (30 layers, 135M params) vs transformers on the same dequantised weights.
// Deeper network -> more accumulated rounding; still far below bf16's 4e-3.
inline constexpr double kRealHiddenRel = 2e-4;
inline constexpr double kRealLogitsAbs = 2e-3;  // logits are O(10-30)

// Op tests: fp32 ops vs fp64 references.
inline constexpr double kOpRel = 1e-5;

}  // namespace talon::tol
