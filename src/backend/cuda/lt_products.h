// Column-major products C = op(A) op(B) + beta C (cuBLAS conventions) through cuBLASLt, with
// the algorithm chosen once per shape (and operand alignment) by a fixed rule, never by timing,
// so that the same shape always runs the same algorithm and its results keep their bits from
// run to run.
//   first: cuBLASLt's first heuristic candidate (about what cublasGemmEx picks);
//   waves: among the first `candidates` heuristic candidates that need no workspace and no
//          split-K, the one whose last wave of tiles is fullest (cuBLASLt's own wave count),
//          the heuristic's order breaking near ties. Products with few output tiles (4096
//          outputs at ~1400 rows fill 1.33 waves of 128x256 tiles on 132 SMs) are where it can
//          differ from `first`.
// Neither rule beats cublasGemmEx's choice in the draft trainer (docs/train.md, "bf16 operands":
// the time left is in the weight gradients' tile sizes, which neither rule looks at).
// Only products with bf16 operands, fp32 accumulation and fp32 or bf16 outputs come here; no
// workspace is used, so the choice costs no device memory.
#pragma once
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <map>

namespace talon::cuda {

class LtProducts {
 public:
  enum class Rule { First, Waves };

  // kept_plans: how many shapes' plans are kept (below).
  explicit LtProducts(Rule rule, int candidates = 8, size_t kept_plans = 4096);
  ~LtProducts();
  LtProducts(const LtProducts&) = delete;
  LtProducts& operator=(const LtProducts&) = delete;

  // As cublasGemmEx with CUBLAS_COMPUTE_32F: A and B bf16, C of c_type (CUDA_R_32F or
  // CUDA_R_16BF), alpha 1, on stream s.
  void run(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, const void* a, int64_t lda,
           const void* b, int64_t ldb, float beta, void* c, cudaDataType_t c_type, int64_t ldc, cudaStream_t s);

  // Shapes planned so far, and how many of them the rule gave another algorithm than the
  // heuristic's first candidate. Training meets a new row count with almost every batch, so
  // the plans kept are capped (kept_plans; all dropped at once when full, remade on demand: the
  // rule picks the same algorithm again).
  size_t plans() const { return planned_; }
  size_t moved() const { return moved_; }

 private:
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  // ta, tb, m, n, k, lda, ldb, ldc, C's type, and the alignment in bytes of A, B and C
  using Key = std::array<int64_t, 12>;
  Plan& plan(const Key& key);

  Rule rule_;
  int candidates_;
  size_t kept_plans_;
  cublasLtHandle_t lt_ = nullptr;
  std::map<Key, Plan> plans_;
  size_t planned_ = 0, moved_ = 0;
  void drop_plans();
};

}  // namespace talon::cuda
