#include "backend/cuda/lt_products.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "backend/cuda/check.h"

namespace talon::cuda {

LtProducts::LtProducts(Rule rule, int candidates, size_t kept_plans)
    : rule_(rule), candidates_(candidates < 1 ? 1 : candidates), kept_plans_(kept_plans < 1 ? 1 : kept_plans) {
  CUBLAS_CHECK(cublasLtCreate(&lt_));
}

LtProducts::~LtProducts() {
  drop_plans();
  if (lt_) cublasLtDestroy(lt_);
}

void LtProducts::drop_plans() {
  for (auto& [k, p] : plans_) {
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.c);
    cublasLtMatmulDescDestroy(p.op);
  }
  plans_.clear();
}

namespace {

// How full the last wave of tiles is (1: every wave full); 0 where cuBLASLt gives no count.
double last_wave_fill(float waves) {
  if (!(waves > 0.f)) return 0.0;
  return double(waves) / std::ceil(double(waves));
}

// The largest power of two (up to 256, cuBLASLt's default assumption) dividing a pointer.
int64_t alignment(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  int64_t a = 256;
  while (a > 1 && v % uintptr_t(a) != 0) a /= 2;
  return a;
}

int split_k(const cublasLtMatmulAlgo_t& a) {
  int v = 1;
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &v, sizeof v, &written) !=
          CUBLAS_STATUS_SUCCESS ||
      written != sizeof v)
    return 1;
  return v;
}

}  // namespace

LtProducts::Plan& LtProducts::plan(const Key& key) {
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;
  if (plans_.size() >= kept_plans_) drop_plans();
  const auto ta = static_cast<cublasOperation_t>(key[0]), tb = static_cast<cublasOperation_t>(key[1]);
  const int64_t m = key[2], n = key[3], k = key[4], lda = key[5], ldb = key[6], ldc = key[7];
  const auto c_type = static_cast<cudaDataType_t>(key[8]);
  const uint32_t align[3] = {uint32_t(key[9]), uint32_t(key[10]), uint32_t(key[11])};
  const std::string shape = "m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k);
  Plan p;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  // Stored shapes: op(A) is m x k, op(B) is k x n.
  const uint64_t ar = uint64_t(ta == CUBLAS_OP_N ? m : k), ac = uint64_t(ta == CUBLAS_OP_N ? k : m);
  const uint64_t br = uint64_t(tb == CUBLAS_OP_N ? k : n), bc = uint64_t(tb == CUBLAS_OP_N ? n : k);
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, ar, ac, lda));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, br, bc, ldb));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, c_type, uint64_t(m), uint64_t(n), ldc));
  cublasLtMatmulPreference_t pref = nullptr;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const size_t no_workspace = 0;
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &no_workspace,
                                                    sizeof no_workspace));
  // The pointers' alignment (cuBLASLt assumes 256 bytes unless told; the trainer's operands
  // start at row offsets inside larger buffers).
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align[0],
                                                    sizeof align[0]));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align[1],
                                                    sizeof align[1]));
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &align[2], sizeof align[2]));
  std::vector<cublasLtMatmulHeuristicResult_t> res(static_cast<size_t>(candidates_));
  int found = 0;
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(lt_, p.op, p.a, p.b, p.c, p.c, pref, candidates_, res.data(), &found);
  cublasLtMatmulPreferenceDestroy(pref);
  int pick = -1;
  for (int i = 0; st == CUBLAS_STATUS_SUCCESS && i < found; ++i) {
    const auto& r = res[size_t(i)];
    if (r.state != CUBLAS_STATUS_SUCCESS || r.workspaceSize != 0 || split_k(r.algo) > 1) continue;
    if (pick < 0) {
      pick = i;
      if (rule_ == Rule::First) break;
      continue;
    }
    // A later candidate wins only by a clearly fuller last wave (0.05: the heuristic's order
    // decides near ties).
    if (last_wave_fill(r.wavesCount) > last_wave_fill(res[size_t(pick)].wavesCount) + 0.05) pick = i;
  }
  if (pick < 0) {
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.c);
    cublasLtMatmulDescDestroy(p.op);
    fail_msg("cuBLASLt: no algorithm without workspace or split-K for the bf16 product " + shape +
             (st == CUBLAS_STATUS_SUCCESS ? std::string() : std::string(": ") + cublasLtGetStatusString(st)));
  }
  ++planned_;
  if (pick != 0) ++moved_;
  p.algo = res[size_t(pick)].algo;
  return plans_.emplace(key, p).first->second;
}

void LtProducts::run(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, const void* a,
                     int64_t lda, const void* b, int64_t ldb, float beta, void* c, cudaDataType_t c_type, int64_t ldc,
                     cudaStream_t s) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {  // no terms: C = beta C
    if (beta == 1.f) return;
    if (beta != 0.f) fail_msg("cuBLASLt products: a product over no terms with beta other than 0 or 1");
    const size_t elt = c_type == CUDA_R_32F ? 4 : 2;
    CUDA_CHECK(cudaMemset2DAsync(c, size_t(ldc) * elt, 0, size_t(m) * elt, size_t(n), s));
    return;
  }
  const Plan& p = plan(
      {int64_t(ta), int64_t(tb), m, n, k, lda, ldb, ldc, int64_t(c_type), alignment(a), alignment(b), alignment(c)});
  const float alpha = 1.f;
  CUBLAS_CHECK(cublasLtMatmul(lt_, p.op, &alpha, a, p.a, b, p.b, &beta, c, p.c, c, p.c, &p.algo, nullptr, 0, s));
}

}  // namespace talon::cuda
