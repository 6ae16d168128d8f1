// Every numeric tolerance the tests use, in one table. Each loosened entry says why.
#pragma once

namespace talon::tol {

// CPU reference vs HF transformers fp32 (eager) on the tiny random models. Both are
// fp32 with different summation orders (our 8-lane dot products, fp64 RMSNorm
// statistics and attention accumulators vs torch's BLAS); differences are a few ulps
// per op, amplified through <= 4 layers with std-0.2 weights.
// The same bounds hold for the DeepSeek (MLA + MoE) fixtures, including the FP8 / int4 ones
// (both sides use the identical dequantized fp32 weights: dequantization is exact in fp32).
// Routing is discrete; tools/make_golden_deepseek.py only accepts fixtures whose every
// router decision has a score margin >= 1e-4, far above fp32 noise, so both pick the same
// experts and the bound stays that of the fp32 summation-order differences (measured
// h[L] errors ~1e-6).
inline constexpr double kGoldenHiddenRel = 2e-5;  // max|a-b| / max(1, max|b|) per tensor
inline constexpr double kGoldenLogitsRel = 5e-5;

// SmolLM2 (30 layers, 135M params) vs transformers on the same dequantised weights.
// Deeper network -> more accumulated rounding; still far below bf16's 4e-3.
inline constexpr double kRealHiddenRel = 2e-4;
inline constexpr double kRealLogitsAbs = 2e-3;  // logits are O(10-30)

// Op tests: fp32 ops vs fp64 references.
inline constexpr double kOpRel = 1e-5;

// CUDA ops write bf16: one rounding is a relative error of at most 2^-9 of the value;
// against the tensor's max magnitude plus fp32 summation-order noise, 8e-3 holds.
inline constexpr double kCudaBf16Out = 8e-3;
// Tensor-core attention: q, k, v are bf16 like the reference's inputs; P is kept as a
// sum of two bf16 terms, so the output has the same single bf16 rounding.
inline constexpr double kCudaFlashOut = 8e-3;
// Whole CUDA models (bf16 weights and activations, fp32 residual) vs transformers fp32:
// bf16 rounding of weights (2^-9) compounds over layers; 5e-2 of the tensor's max.
inline constexpr double kCudaModelRel = 5e-2;
// A fixture whose transformers-in-bf16 run is itself far from the fp32 golden (measured and
// recorded per fixture): the CUDA model may be off by up to this multiple of that error.
inline constexpr double kCudaVsTorchBf16 = 1.5;
// Tensor parallel vs one GPU: partial o_proj/down_proj outputs are rounded to bf16 on
// each rank before the all-reduce sums them (one extra 2^-9 rounding per branch per
// layer) and the GEMMs split K differently. Also used for expert parallel, whose rows see
// the same arithmetic as on one GPU except GEMMs over fewer rows (cuBLAS may pick other
// kernels, other summation orders).
inline constexpr double kCudaTpRel = 2e-2;
// CUDA cached decoder vs the CPU decoder (fp32) on the same requests: the CUDA model's
// bf16 rounding (see kCudaModelRel) plus the bf16 KV cache, whose keys and values are the
// same bf16 numbers the packed forward attends to. Measured per logit row on the H200
// (relative to max(1, the row's largest logit)): up to 0.085 on random head-128 models and
// 0.05-0.06 on the fixtures; a wrong mask or position gives O(1). Greedy tokens must also
// agree wherever the fp32 top-2 gap is clear (kCudaGreedyMargin).
inline constexpr double kCudaDecodeRel = 1.5e-1;
// Greedy agreement is only required where the fp32 top-2 logit gap exceeds this.
inline constexpr double kCudaGreedyMargin = 0.5;
// CUDA draft runner (one EAGLE-3 layer: bf16 weights, activations and draft KV cache, fp32
// residual) vs the fp32 CPU runner on the same inputs, per output row relative to
// max(1, the row's largest value), hidden states and draft logits. One layer against the
// decoder's many, so tighter than kCudaDecodeRel; a wrong mask, position or cache row gives O(1).
inline constexpr double kCudaDraftRel = 5e-2;

// EAGLE-3 TTT forward (fp64 accumulation over fp32 weights) vs the PyTorch fp64 oracle:
// only the RoPE frequencies differ (fp32 here, as transformers computes them, fp64 there).
inline constexpr double kTttLogitsRel = 1e-5;
inline constexpr double kTttLossRel = 1e-6;
// Hand-written gradients vs autograd (both fp64, fp32 weights): max |diff| / max |grad|.
inline constexpr double kTttGradRel = 1e-6;
// vs central differences with a 1e-3 step on fp32 weights: O(h^2) truncation.
inline constexpr double kTttFiniteDiffAbs = 1e-5;
inline constexpr double kTttFiniteDiffRel = 1e-3;
// 20 AdamW steps vs torch: same fp32 master weights and moments, fp32 vs fp32 updates in
// a different operation order; the loss curves agree to float rounding.
inline constexpr double kTrainCurveRel = 1e-4;

// GPU draft trainer (fp32 storage and accumulation, fp32 exp/rsqrt, cuBLAS fp32) vs the
// fp64 CPU reference on the same weights and packed samples.
inline constexpr double kGpuTttLossRel = 1e-5;
inline constexpr double kGpuTttGradRel = 1e-4;  // max |diff| / max |grad| per tensor
// After 5 AdamW steps: Adam divides by sqrt(v), so an element whose gradient is near zero
// moves by up to lr on rounding noise alone; require that at most this fraction of
// weights differ by more than 1% of lr.
inline constexpr double kGpuTttWeightOffFraction = 1e-2;
// bf16 tensor-core products: inputs rounded to 2^-9, through K steps of the draft.
inline constexpr double kGpuTttBf16LossRel = 2e-2;
inline constexpr double kGpuTttBf16GradRel = 5e-2;
// Per-sample accuracies (acc_k, cond_acc_k) with bf16 products against the fp64 reference:
// a rounding can flip a near tie of the draft's argmax. Seen on an H200 on 512-900-row
// samples: up to 2.4e-3 (one or two positions); a wrong attention moves them by 0.1 or more.
inline constexpr double kGpuTttBf16AccAbs = 2e-2;
// The fused attention kernels against the score-buffer products, both on the same bf16
// operands (P and dS rounded to bf16 in both): summation order and exp2 vs exp only, but a
// different rounding of the attention output flips bf16 roundings of every later operand
// through K steps. Seen on an H200: up to 1.6e-2 (max |diff| / max |grad| of a tensor); a
// dropped key tile or a wrong mask at a tile edge moves gradients by tens of percent.
inline constexpr double kGpuTttFusedVsBlocksRel = 3e-2;

// Cached decoding vs a full forward of the same tokens (CPU): the same fp32 arithmetic
// per row, so only the attention's key order differs (none for chains).
inline constexpr double kDecodeRel = 1e-5;

// The draft runner (fp32, incremental) vs the fp64 TTT forward on the same weights.
inline constexpr double kDraftRunnerRel = 1e-4;

}  // namespace talon::tol
