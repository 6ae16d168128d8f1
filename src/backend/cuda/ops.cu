#include <cublasLt.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cstdlib>
#include <map>
#include <string>
#include <tuple>

#include "backend/cuda/check.h"
#include "backend/cuda/kernels/cast.cuh"
#include "backend/cuda/kernels/rmsnorm.cuh"
#include "backend/cuda/kernels/rope.cuh"
#include "backend/cuda/kernels/swiglu.cuh"
#include "backend/cuda/ops.h"
#include "backend/cuda/warp.cuh"

namespace talon::cuda {

bool debug_sync() {
  static const bool on = [] {
    const char* e = std::getenv("TALON_CUDA_SYNC");
    return e && e[0] == '1';
  }();
  return on;
}

namespace {

constexpr int kWarp = 32;


__global__ void embedding_kernel(float* out, const int32_t* ids, const bf16* table, int64_t C, int64_t V) {
  allow_dependents();
  const int64_t n = blockIdx.x;
  const int32_t id = ids[n];
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
    out[n * C + c] = (id >= 0 && id < V) ? __bfloat162float(table[int64_t(id) * C + c]) : NAN;
}

__global__ void bias_kernel(bf16* y, int64_t ld, const bf16* b, int64_t N, int64_t O) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= N * O) return;
  const int64_t n = idx / O, o = idx % O;
  y[n * ld + o] = __float2bfloat16(__bfloat162float(y[n * ld + o]) + __bfloat162float(b[o]));
}

// One warp per (query row, head); each lane owns E strided elements of head_dim.
// Online softmax over the keys of the row's sequence, in the exp2 domain.
template <int E>
__global__ void attention_kernel(bf16* out, const bf16* qkv, int64_t ld, const int64_t* seq_start,
                                 const int32_t* row_seq, int64_t N, int64_t nh, int64_t nkv, int64_t hd,
                                 int64_t window) {
  const int64_t task = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (task >= N * nh) return;
  const int64_t r = task / nh, h = task % nh, kh = h / (nh / nkv);
  const int64_t s0 = seq_start[row_seq[r]];
  const int64_t lo = window > 0 ? max(s0, r - window + 1) : s0;
  const float scale = rsqrtf(float(hd)) * 1.4426950408889634f;  // 1/sqrt(d) * log2(e)
  const bf16* qp = qkv + r * ld + h * hd;
  const bf16* kbase = qkv + nh * hd + kh * hd;
  const bf16* vbase = qkv + (nh + nkv) * hd + kh * hd;
  float q[E], acc[E];
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int64_t i = lane + e * kWarp;
    q[e] = i < hd ? __bfloat162float(qp[i]) * scale : 0.f;
    acc[e] = 0.f;
  }
  float m = -FLT_MAX, l = 0.f;
  for (int64_t j = lo; j <= r; ++j) {
    const bf16* kp = kbase + j * ld;
    float d = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int64_t i = lane + e * kWarp;
      if (i < hd) d += q[e] * __bfloat162float(kp[i]);
    }
    d = warp_sum(d);
    const float m_new = fmaxf(m, d);
    const float corr = exp2f(m - m_new), p = exp2f(d - m_new);
    l = l * corr + p;
    const bf16* vp = vbase + j * ld;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int64_t i = lane + e * kWarp;
      acc[e] = acc[e] * corr + (i < hd ? p * __bfloat162float(vp[i]) : 0.f);
    }
    m = m_new;
  }
  bf16* op = out + r * nh * hd + h * hd;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int64_t i = lane + e * kWarp;
    if (i < hd) op[i] = __float2bfloat16(acc[e] / l);
  }
}

unsigned blocks(int64_t n, int per) { return unsigned((n + per - 1) / per); }

}  // namespace

void embedding_forward(float* out, const int32_t* ids, const bf16* table, int64_t N, int64_t C, int64_t V,
                       cudaStream_t s) {
  if (N == 0) return;
  embedding_kernel<<<unsigned(N), 256, 0, s>>>(out, ids, table, C, V);
  CUDA_LAUNCH_CHECK();
}

void add_rmsnorm_forward(bf16* out, float* x, const bf16* add, const bf16* w, int64_t N, int64_t C, float eps,
                         cudaStream_t s, int64_t ld_out) {
  if (N == 0) return;
  const NormRows ry{ld_out > 0 ? ld_out : C};
  if (add)
    rmsnorm_forward(out, ry, x, NormRows{C}, add, w, N, C, eps, s);
  else
    rmsnorm_forward<bf16, float, void>(out, ry, x, NormRows{C}, nullptr, w, N, C, eps, s);
  CUDA_LAUNCH_CHECK();
}

void head_rmsnorm_forward(bf16* x, int64_t ld, const bf16* w, int64_t N, int64_t nh, int64_t hd, float eps,
                          cudaStream_t s) {
  if (N == 0) return;
  // The heads of each row are rows of hd values, nh to a line of ld.
  rmsnorm_forward<bf16, bf16, void>(x, NormRows{ld, nh}, x, NormRows{ld, nh}, nullptr, w, N * nh, hd, eps, s);
  CUDA_LAUNCH_CHECK();
}

void rope_forward(bf16* x, int64_t ld, const int32_t* pos, const float* inv_freq, int64_t N, int64_t nh, int64_t hd,
                  cudaStream_t s) {
  if (N == 0) return;
  launch_rope(x, ld, x, ld, pos, 0, inv_freq, 1.f, N, nh, hd, s);
}

void bias_forward(bf16* y, int64_t ld, const bf16* b, int64_t N, int64_t O, cudaStream_t s) {
  if (N == 0) return;
  bias_kernel<<<blocks(N * O, 256), 256, 0, s>>>(y, ld, b, N, O);
  CUDA_LAUNCH_CHECK();
}

void swiglu_forward(bf16* out, const bf16* gu, int64_t N, int64_t I, cudaStream_t s) {
  if (N == 0) return;
  launch_swiglu_forward(out, gu, gu + I, 2 * I, N, I, s);
}

void attention_forward(bf16* out, const bf16* qkv, int64_t ld, const int64_t* seq_start, const int32_t* row_seq,
                       int64_t N, int64_t nh, int64_t nkv, int64_t hd, int64_t window, cudaStream_t s) {
  if (N == 0) return;
  if (hd > 8 * kWarp) fail_msg("attention: head_dim " + std::to_string(hd) + " > 256 unsupported");
  const unsigned g = blocks(N * nh * kWarp, 128);
  if (hd <= 32) attention_kernel<1><<<g, 128, 0, s>>>(out, qkv, ld, seq_start, row_seq, N, nh, nkv, hd, window);
  else if (hd <= 64) attention_kernel<2><<<g, 128, 0, s>>>(out, qkv, ld, seq_start, row_seq, N, nh, nkv, hd, window);
  else if (hd <= 128) attention_kernel<4><<<g, 128, 0, s>>>(out, qkv, ld, seq_start, row_seq, N, nh, nkv, hd, window);
  else attention_kernel<8><<<g, 128, 0, s>>>(out, qkv, ld, seq_start, row_seq, N, nh, nkv, hd, window);
  CUDA_LAUNCH_CHECK();
}

void f32_to_bf16(bf16* out, const float* in, int64_t n, cudaStream_t s) { cast(out, in, n, s); }

void bf16_to_f32(float* out, const bf16* in, int64_t n, cudaStream_t s) { cast(out, in, n, s); }

// ------------------------------------------------------------------ cuBLASLt GEMM
struct Gemm::Impl {
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  size_t ws_size = 64ull << 20;
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  std::map<std::tuple<int64_t, int64_t, int64_t, bool>, Plan> plans;

  // Row-major out[N,O] = in[N,K] @ w[O,K]^T is column-major D[O,N] = op(A)[O,K] B[K,N]
  // with A = w stored [K,O] (ld K) transposed, B = in stored [K,N] (ld K).
  Plan& plan(int64_t N, int64_t K, int64_t O, bool f32_out) {
    auto key = std::make_tuple(N, K, O, f32_out);
    auto it = plans.find(key);
    if (it != plans.end()) return it->second;
    Plan p;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, uint64_t(K), uint64_t(O), K));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, uint64_t(K), uint64_t(N), K));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, f32_out ? CUDA_R_32F : CUDA_R_16BF, uint64_t(O), uint64_t(N), O));
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_size,
                                                      sizeof ws_size));
    cublasLtMatmulHeuristicResult_t res{};
    int found = 0;
    CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt, p.op, p.a, p.b, p.c, p.c, pref, 1, &res, &found));
    cublasLtMatmulPreferenceDestroy(pref);
    if (found == 0)
      fail_msg("cuBLASLt: no algorithm for bf16 GEMM N=" + std::to_string(N) + " K=" + std::to_string(K) +
               " O=" + std::to_string(O));
    p.algo = res.algo;
    return plans.emplace(key, p).first->second;
  }
};

Gemm::Gemm() : impl_(std::make_unique<Impl>()) {
  CUBLAS_CHECK(cublasLtCreate(&impl_->lt));
  CUDA_CHECK(cudaMalloc(&impl_->workspace, impl_->ws_size));
}

Gemm::~Gemm() {
  for (auto& [k, p] : impl_->plans) {
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.c);
    cublasLtMatmulDescDestroy(p.op);
  }
  cudaFree(impl_->workspace);
  cublasLtDestroy(impl_->lt);
}

bool skinny_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("TALON_CUDA_GEMV");
    return !(e && e[0] == '0');
  }();
  return on;
}

namespace {
bool dependent_launch_supported() {
  static const bool on = [] {
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess)
      return false;
    return major >= 9;
  }();
  return on;
}
std::atomic<unsigned> g_dependent_launch{[] {
  const char* e = std::getenv("TALON_CUDA_PDL");
  return e && *e ? unsigned(std::strtoul(e, nullptr, 0)) & kDependAll : kDependDefault;
}()};
}  // namespace

bool dependent_launch_enabled(unsigned kind) {
  return (g_dependent_launch.load(std::memory_order_relaxed) & kind) != 0 && dependent_launch_supported();
}

void set_dependent_launches(unsigned mask) { g_dependent_launch.store(mask & kDependAll, std::memory_order_relaxed); }

bool skinny_fusion_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("TALON_CUDA_FUSE");
    return skinny_enabled() && !(e && e[0] == '0');
  }();
  return on;
}

namespace {
// A row count from the environment variable `name`, clamped to 1..kSkinnyMaxRows; `dflt`
// when it is unset or empty.
int64_t rows_from_env(const char* name, int64_t dflt) {
  const char* e = std::getenv(name);
  const long v = e && *e ? std::strtol(e, nullptr, 10) : long(dflt);
  return std::clamp<int64_t>(v, 1, kSkinnyMaxRows);
}
}  // namespace

int64_t skinny_fusion_rows() {
  static const int64_t rows = rows_from_env("TALON_CUDA_FUSE_ROWS", kSkinnyFoldRows);
  return rows;
}

int64_t skinny_auto_rows() {
  static const int64_t rows = rows_from_env("TALON_CUDA_GEMV_ROWS", kSkinnyAutoRows);
  return rows;
}

void Gemm::forward(bf16* out, const bf16* in, const bf16* w, int64_t N, int64_t K, int64_t O, cudaStream_t s) {
  if (N == 0) return;
  if (N <= skinny_auto_rows() && skinny_enabled() && skinny_gemm(out, in, w, N, K, O, s)) return;
  auto& p = impl_->plan(N, K, O, false);
  const float alpha = 1.f, beta = 0.f;
  CUBLAS_CHECK(cublasLtMatmul(impl_->lt, p.op, &alpha, w, p.a, in, p.b, &beta, out, p.c, out, p.c, &p.algo,
                              impl_->workspace, impl_->ws_size, s));
  if (debug_sync()) CUDA_CHECK(cudaStreamSynchronize(s));
}

void Gemm::forward(float* out, const bf16* in, const bf16* w, int64_t N, int64_t K, int64_t O, cudaStream_t s) {
  if (N == 0) return;
  if (N <= skinny_auto_rows() && skinny_enabled() && skinny_gemm(out, in, w, N, K, O, s)) return;
  auto& p = impl_->plan(N, K, O, true);
  const float alpha = 1.f, beta = 0.f;
  CUBLAS_CHECK(cublasLtMatmul(impl_->lt, p.op, &alpha, w, p.a, in, p.b, &beta, out, p.c, out, p.c, &p.algo,
                              impl_->workspace, impl_->ws_size, s));
  if (debug_sync()) CUDA_CHECK(cudaStreamSynchronize(s));
}

}  // namespace talon::cuda
