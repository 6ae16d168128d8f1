// DFlash's training forward and backward on one GPU (dflash_engine.h): the products on cuBLAS
// (exact fp32, TF32 or bf16-rounded operands, fp32 accumulation and storage), the norms, RoPE and
// SwiGLU from the shared kernels (backend/cuda/kernel_ops.h, each checked by the op harness), and
// the block attention, target distribution and loss kernels below. Every gradient is a fixed-order
// sum: key gradients are gathered per key over the queries that read it, never scattered with
// atomics.
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "backend/cuda/check.h"
#include "backend/cuda/device.h"
#include "backend/cuda/kernel_ops.h"
#include "backend/cuda/kernels/reduce.cuh"
#include "backend/cuda/warp.cuh"
#include "draft/cuda/dflash_engine.h"
#include "draft/cuda/train_kernels.cuh"

namespace talon::cuda {

namespace {

constexpr int kLayerTensors = 11;  // in_ln wq wk wv q_norm k_norm wo post_ln gate up down
enum LT : int { L_IN, L_WQ, L_WK, L_WV, L_QN, L_KN, L_WO, L_POST, L_GATE, L_UP, L_DOWN };
constexpr int kMaxHdLane = 8;  // head_dim <= 256

// ---------------------------------------------------------------- rows
// Softmax statistics of a row x[0..n) over the block: its maximum m, the first index holding
// it, and z = sum exp(x - m). Every thread gets them.
__device__ void dfl_row_stats(const float* x, int64_t n, float& m, int64_t& mi, float& z, float* shv, int64_t* shi) {
  m = -INFINITY;
  mi = INT64_MAX;
  for (int64_t d = threadIdx.x; d < n; d += blockDim.x)
    if (x[d] > m) m = x[d], mi = d;
  block_argmax(m, mi, shv, shi);
  z = 0;
  for (int64_t d = threadIdx.x; d < n; d += blockDim.x) z += expf(x[d] - m);
  z = block_sum(z, shv);
}

// out[n, :] = src[idx[n], :], zeros where idx[n] < 0. One block per row.
__global__ void dfl_gather_kernel(float* out, const float* src, const int32_t* idx, int64_t C) {
  const int64_t n = blockIdx.x;
  const int64_t r = idx[n];
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) out[n * C + c] = r < 0 ? 0.f : src[r * C + c];
}

// Target rows: the logits over the draft vocabulary in x[n, :] become their softmax, targ[n] their
// first argmax. Rows without a target (trow < 0) are left alone.
__global__ void dfl_target_kernel(float* x, int32_t* targ, const int32_t* trow, int64_t Vd) {
  __shared__ float shv[33];
  __shared__ int64_t shi[33];
  const int64_t n = blockIdx.x;
  if (trow[n] < 0) return;
  float* r = x + n * Vd;
  float m, z;
  int64_t mi;
  dfl_row_stats(r, Vd, m, mi, z, shv, shi);
  for (int64_t d = threadIdx.x; d < Vd; d += blockDim.x) r[d] = expf(r[d] - m) / z;
  if (threadIdx.x == 0) targ[n] = int32_t(mi);
}

// Per row with a target: the draft logits' log-sum-exp (lz), the row's loss (KL(P || draft) or the
// cross-entropy of the target's argmax) and whether the draft's first argmax is the target's.
__global__ void dfl_loss_kernel(const float* lg, const float* P, const int32_t* targ, const int32_t* trow, int64_t Vd,
                                bool ce, float* lz, float* loss, uint8_t* hit) {
  __shared__ float shv[33];
  __shared__ int64_t shi[33];
  const int64_t n = blockIdx.x;
  if (trow[n] < 0) {
    if (threadIdx.x == 0) lz[n] = 0.f, loss[n] = 0.f, hit[n] = 0;
    return;
  }
  const float* r = lg + n * Vd;
  const float* p = P + n * Vd;
  float m, z;
  int64_t mi;
  dfl_row_stats(r, Vd, m, mi, z, shv, shi);
  const float L = m + logf(z);
  float e = 0;
  if (!ce)
    for (int64_t d = threadIdx.x; d < Vd; d += blockDim.x)
      if (p[d] > 0.f) e += p[d] * (logf(p[d]) - (r[d] - L));
  e = ce ? 0.f : block_sum(e, shv);
  if (threadIdx.x == 0) {
    const int t = targ[n];
    lz[n] = L;
    loss[n] = ce ? L - r[t] : e;
    hit[n] = mi == t;
  }
}

// The loss gradient in place of the logits: scale[n] * (softmax - P), P the target distribution
// (KL) or its argmax's one-hot (CE); zero on rows that carry no loss.
__global__ void dfl_dlogits_kernel(float* lg, const float* P, const int32_t* targ, const int32_t* trow,
                                   const float* lz, const float* scale, int64_t Vd, bool ce) {
  const int64_t n = blockIdx.x;
  float* r = lg + n * Vd;
  const float s = trow[n] < 0 ? 0.f : scale[n];
  if (s == 0.f) {
    for (int64_t d = threadIdx.x; d < Vd; d += blockDim.x) r[d] = 0.f;
    return;
  }
  const float L = lz[n];
  const int t = targ[n];
  const float* p = P + n * Vd;
  for (int64_t d = threadIdx.x; d < Vd; d += blockDim.x) {
    const float q = expf(r[d] - L);
    const float pd = ce ? (d == t ? 1.f : 0.f) : p[d];
    r[d] = s * (q - pd);
  }
}

// ---------------------------------------------------------------- block attention
// Block row n (block j = n / B) reads the context rows ctx0[j] .. ctx0[j] + anchor[j] - 1 and the
// B rows of its own block. Queries, keys and values are already normed and rotated.
struct DflAttn {
  const float* q;   // [N, nh*hd]
  const float* kc;  // [Tc, nkv*hd] context keys / values
  const float* vc;
  const float* kb;  // [N, nkv*hd] block keys / values
  const float* vb;
  const int32_t* ctx0;
  const int32_t* anchor;
  int64_t N;
  int B, nh, nkv, hd;
  float scale;
};

// f(key pointer, value pointer) for every key of row n, kv head kh, in order.
template <class F>
__device__ __forceinline__ void dfl_for_keys(const DflAttn& a, int64_t n, int kh, F&& f) {
  const int64_t kvd = int64_t(a.nkv) * a.hd, j = n / a.B;
  const int64_t c0 = a.ctx0[j], na = a.anchor[j];
  for (int64_t t = 0; t < na; ++t) f(a.kc + (c0 + t) * kvd + kh * a.hd, a.vc + (c0 + t) * kvd + kh * a.hd);
  for (int64_t m = j * a.B; m < (j + 1) * a.B; ++m) f(a.kb + m * kvd + kh * a.hd, a.vb + m * kvd + kh * a.hd);
}

// One warp per (row, head): online softmax over its keys; out [N, qd], lse [N, nh].
__global__ void dfl_attn_forward_kernel(float* out, float* lse, DflAttn a) {
  const int64_t gw = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (gw >= a.N * a.nh) return;
  const int64_t n = gw / a.nh;
  const int h = int(gw % a.nh), kh = h / (a.nh / a.nkv);
  const int64_t qd = int64_t(a.nh) * a.hd;
  float qv[kMaxHdLane], acc[kMaxHdLane];
  for (int i = 0; i < kMaxHdLane; ++i) {
    const int d = lane + 32 * i;
    qv[i] = d < a.hd ? a.q[n * qd + h * a.hd + d] : 0.f;
    acc[i] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  dfl_for_keys(a, n, kh, [&](const float* kp, const float* vp) {
    float s = 0;
    for (int i = 0; i < kMaxHdLane; ++i) {
      const int d = lane + 32 * i;
      if (d < a.hd) s += qv[i] * kp[d];
    }
    s = warp_sum(s) * a.scale;
    const float mn = fmaxf(m, s), corr = expf(m - mn), pe = expf(s - mn);
    l = l * corr + pe;
    for (int i = 0; i < kMaxHdLane; ++i) {
      const int d = lane + 32 * i;
      if (d < a.hd) acc[i] = acc[i] * corr + pe * vp[d];
    }
    m = mn;
  });
  for (int i = 0; i < kMaxHdLane; ++i) {
    const int d = lane + 32 * i;
    if (d < a.hd) out[n * qd + h * a.hd + d] = acc[i] / l;
  }
  if (lane == 0) lse[n * a.nh + h] = m + logf(l);
}

// D[n, h] = dot(dO, O) over the head's values.
__global__ void dfl_delta_kernel(float* D, const float* dO, const float* O, int64_t rows, int hd) {
  const int64_t gw = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (gw >= rows) return;
  float s = 0;
  for (int d = lane; d < hd; d += 32) s += dO[gw * hd + d] * O[gw * hd + d];
  s = warp_sum(s);
  if (lane == 0) D[gw] = s;
}

// dq for every (row, head): the sum over its keys of p (dO.v - D) scale k.
__global__ void dfl_attn_dq_kernel(float* dq, const float* dO, const float* lse, const float* D, DflAttn a) {
  const int64_t gw = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (gw >= a.N * a.nh) return;
  const int64_t n = gw / a.nh;
  const int h = int(gw % a.nh), kh = h / (a.nh / a.nkv);
  const int64_t qd = int64_t(a.nh) * a.hd;
  float qv[kMaxHdLane], go[kMaxHdLane], acc[kMaxHdLane];
  for (int i = 0; i < kMaxHdLane; ++i) {
    const int d = lane + 32 * i;
    qv[i] = d < a.hd ? a.q[n * qd + h * a.hd + d] : 0.f;
    go[i] = d < a.hd ? dO[n * qd + h * a.hd + d] : 0.f;
    acc[i] = 0.f;
  }
  const float L = lse[gw], Dv = D[gw];
  dfl_for_keys(a, n, kh, [&](const float* kp, const float* vp) {
    float s = 0, dp = 0;
    for (int i = 0; i < kMaxHdLane; ++i) {
      const int d = lane + 32 * i;
      if (d < a.hd) s += qv[i] * kp[d], dp += go[i] * vp[d];
    }
    s = warp_sum(s) * a.scale;
    dp = warp_sum(dp);
    const float ds = expf(s - L) * (dp - Dv) * a.scale;
    for (int i = 0; i < kMaxHdLane; ++i) {
      const int d = lane + 32 * i;
      if (d < a.hd) acc[i] += ds * kp[d];
    }
  });
  for (int i = 0; i < kMaxHdLane; ++i) {
    const int d = lane + 32 * i;
    if (d < a.hd) dq[n * qd + h * a.hd + d] = acc[i];
  }
}

// dK, dV of one key row (kp, vp) and kv head kh, summed over query rows [r0, r1) and the heads
// that share kh; written (not added) to dkp, dvp. Called by a whole warp.
__device__ __forceinline__ void dfl_key_grad(float* dkp, float* dvp, const float* kp, const float* vp, int64_t r0,
                                             int64_t r1, int kh, const float* dO, const float* lse, const float* D,
                                             const DflAttn& a, int lane) {
  const int grp = a.nh / a.nkv;
  const int64_t qd = int64_t(a.nh) * a.hd;
  float kv[kMaxHdLane], vv[kMaxHdLane], dk[kMaxHdLane], dv[kMaxHdLane];
  for (int i = 0; i < kMaxHdLane; ++i) {
    const int d = lane + 32 * i;
    kv[i] = d < a.hd ? kp[d] : 0.f;
    vv[i] = d < a.hd ? vp[d] : 0.f;
    dk[i] = dv[i] = 0.f;
  }
  for (int64_t r = r0; r < r1; ++r)
    for (int h = kh * grp; h < (kh + 1) * grp; ++h) {
      const float* qp = a.q + r * qd + h * a.hd;
      const float* gp = dO + r * qd + h * a.hd;
      float s = 0, dp = 0;
      for (int i = 0; i < kMaxHdLane; ++i) {
        const int d = lane + 32 * i;
        if (d < a.hd) s += qp[d] * kv[i], dp += gp[d] * vv[i];
      }
      s = warp_sum(s) * a.scale;
      dp = warp_sum(dp);
      const float pr = expf(s - lse[r * a.nh + h]);
      const float ds = pr * (dp - D[r * a.nh + h]) * a.scale;
      for (int i = 0; i < kMaxHdLane; ++i) {
        const int d = lane + 32 * i;
        if (d < a.hd) dv[i] += pr * gp[d], dk[i] += ds * qp[d];
      }
    }
  for (int i = 0; i < kMaxHdLane; ++i) {
    const int d = lane + 32 * i;
    if (d < a.hd) dkp[d] = dk[i], dvp[d] = dv[i];
  }
}

// Context keys: row c is read by the block rows [q0[c], q1[c]) (the blocks of its sample
// anchored after it). One warp per (context row, kv head).
__global__ void dfl_attn_dkv_ctx_kernel(float* dK, float* dV, const float* dO, const float* lse, const float* D,
                                        const int32_t* q0, const int32_t* q1, int64_t Tc, DflAttn a) {
  const int64_t gw = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (gw >= Tc * a.nkv) return;
  const int64_t c = gw / a.nkv, kvd = int64_t(a.nkv) * a.hd;
  const int kh = int(gw % a.nkv);
  dfl_key_grad(dK + c * kvd + kh * a.hd, dV + c * kvd + kh * a.hd, a.kc + c * kvd + kh * a.hd,
               a.vc + c * kvd + kh * a.hd, q0[c], q1[c], kh, dO, lse, D, a, lane);
}

// Block keys: row m is read by the B rows of its own block. One warp per (block row, kv head).
__global__ void dfl_attn_dkv_blk_kernel(float* dK, float* dV, const float* dO, const float* lse, const float* D,
                                        DflAttn a) {
  const int64_t gw = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (gw >= a.N * a.nkv) return;
  const int64_t m = gw / a.nkv, kvd = int64_t(a.nkv) * a.hd, j = m / a.B;
  const int kh = int(gw % a.nkv);
  dfl_key_grad(dK + m * kvd + kh * a.hd, dV + m * kvd + kh * a.hd, a.kb + m * kvd + kh * a.hd,
               a.vb + m * kvd + kh * a.hd, j * a.B, (j + 1) * a.B, kh, dO, lse, D, a, lane);
}

}  // namespace

std::vector<int64_t> dflash_tensor_sizes(const DFlashDims& d) {
  const int64_t H = d.H, qd = d.nh * d.hd, kvd = d.nkv * d.hd;
  std::vector<int64_t> n = {H * d.n_aux * H, H};
  for (int64_t l = 0; l < d.layers; ++l)
    n.insert(n.end(), {H, qd * H, kvd * H, kvd * H, d.hd, d.hd, H * qd, H, d.I * H, d.I * H, H * d.I});
  n.insert(n.end(), {H, d.Vd * H});
  return n;
}

std::vector<std::string> dflash_tensor_names(const DFlashDims& d) {
  static const char* kLayer[kLayerTensors] = {"in_ln",  "wq",      "wk",   "wv", "q_norm", "k_norm",
                                              "wo",     "post_ln", "gate", "up", "down"};
  std::vector<std::string> n = {"fc", "hidden_norm"};
  for (int64_t l = 0; l < d.layers; ++l)
    for (const char* t : kLayer) n.push_back("layers." + std::to_string(l) + "." + t);
  n.insert(n.end(), {"norm", "lm_head"});
  return n;
}

struct DFlashEngine::Impl {
  std::unique_ptr<Device> dev;  // first: destroyed last (its arena holds every buffer below)
  DFlashDims d;
  DraftMath math = DraftMath::F32;
  int device = 0;
  cudaStream_t s = nullptr;
  cublasHandle_t blas = nullptr;
  int64_t Rc = 0, Rb = 0, qd = 0, kvd = 0, AW = 0;
  size_t bytes = 0;
  std::vector<int64_t> sizes, offs;
  int64_t total = 0;
  float *W = nullptr, *G = nullptr, *M = nullptr, *Vm = nullptr;
  double* partial = nullptr;
  // Frozen: the target's embedding [V, H], final norm [H], lm_head rows of the draft vocabulary
  // [Vd, H]; RoPE frequencies.
  float *embed = nullptr, *tnorm = nullptr, *thead = nullptr, *inv = nullptr;
  // The batch.
  int64_t Tc = 0, nb = 0, N = 0;
  float *aux = nullptr, *hidden = nullptr;
  int32_t *ctx_pos = nullptr, *ctx0 = nullptr, *anchor = nullptr, *tok = nullptr, *trow = nullptr, *bpos = nullptr;
  int32_t *cq0 = nullptr, *cq1 = nullptr;
  std::vector<int32_t> h_bpos, h_cq0, h_cq1;
  // Activations: the context (F = fc(aux), C = hidden_norm(F)) and per layer what its backward
  // reads; x[l] is layer l's input, x[layers] the last output.
  float *F = nullptr, *C = nullptr;
  struct LayerActs {
    float *xn, *q_raw, *q, *kb_raw, *kb, *vb, *kc_raw, *kc, *vc, *att, *lse, *x1, *hm, *ga, *up, *act;
  };
  std::vector<float*> x;
  std::vector<LayerActs> la;
  float *fn = nullptr, *logits = nullptr, *P = nullptr, *th = nullptr, *lz = nullptr, *rloss = nullptr;
  float* rscale = nullptr;
  int32_t* targ = nullptr;
  uint8_t* hit = nullptr;
  // Backward scratch.
  float *dX = nullptr, *dx1 = nullptr, *dhm = nullptr, *dact = nullptr, *dga = nullptr, *dup = nullptr;
  float *datt = nullptr, *Dd = nullptr, *dq = nullptr, *dq_raw = nullptr, *dkb = nullptr, *dvb = nullptr,
        *dkb_raw = nullptr;
  float *dkc = nullptr, *dvc = nullptr, *dkc_raw = nullptr, *dxn = nullptr, *dC = nullptr, *dF = nullptr,
        *tmp = nullptr;
  double* wpart = nullptr;  // the RMSNorm backward's weight parts
  bool have_forward = false;

  template <class X>
  X* alloc(size_t n) {
    X* p = dev->arena().alloc<X>(std::max<size_t>(n, 1));
    CUDA_CHECK(cudaMemsetAsync(p, 0, std::max<size_t>(n, 1) * sizeof(X), s));
    bytes += std::max<size_t>(n, 1) * sizeof(X);
    return p;
  }
  int lt(int64_t l, int t) const { return int(2 + l * kLayerTensors + t); }
  int t_norm() const { return int(2 + d.layers * kLayerTensors); }
  int t_lm() const { return t_norm() + 1; }
  float* w(int t) { return W + offs[size_t(t)]; }
  float* g(int t) { return G + offs[size_t(t)]; }

  cublasComputeType_t compute() const {
    return math == DraftMath::F32    ? CUBLAS_COMPUTE_32F
           : math == DraftMath::TF32 ? CUBLAS_COMPUTE_32F_FAST_TF32
                                     : CUBLAS_COMPUTE_32F_FAST_16BF;
  }
  // Column-major C[m, n] = alpha op(A) op(B) + beta C, all fp32.
  void gemm(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, const float* A, int64_t lda,
            const float* B, int64_t ldb, float beta, float* Cm, int64_t ldc) {
    if (m == 0 || n == 0) return;
    const float alpha = 1.f;
    CUBLAS_CHECK(cublasGemmEx(blas, ta, tb, int(m), int(n), int(k), &alpha, A, CUDA_R_32F, int(lda), B, CUDA_R_32F,
                              int(ldb), &beta, Cm, CUDA_R_32F, int(ldc), compute(), CUBLAS_GEMM_DEFAULT));
  }
  // Row-major y[n, O] = beta y + x[n, K] @ w[O, K]^T
  void linear(float* y, const float* xx, const float* wt, int64_t n, int64_t K, int64_t O, float beta = 0.f) {
    gemm(CUBLAS_OP_T, CUBLAS_OP_N, O, n, K, wt, K, xx, K, beta, y, O);
  }
  // dx[n, K] = beta dx + dy[n, O] @ w[O, K]
  void linear_dx(float* dx, const float* dy, const float* wt, int64_t n, int64_t K, int64_t O, float beta) {
    gemm(CUBLAS_OP_N, CUBLAS_OP_N, K, n, O, wt, K, dy, O, beta, dx, K);
  }
  // dw[O, K] += dy[n, O]^T @ x[n, K]
  void linear_dw(float* dw, const float* dy, const float* xx, int64_t n, int64_t K, int64_t O) {
    if (n == 0) return;
    gemm(CUBLAS_OP_N, CUBLAS_OP_T, K, O, n, xx, K, dy, O, 1.f, dw, K);
  }
  void rmsnorm(float* y, const float* xx, const float* wt, int64_t n, int64_t Cc, float eps) {
    if (n > 0) kernel::rmsnorm_forward(y, xx, wt, n, Cc, eps, s);
  }
  // dx += the input gradient of y = rmsnorm(x) * w given dy; dw += the weight's.
  void rmsnorm_backward(float* dx, float* dw, const float* dy, const float* xx, const float* wt, int64_t n, int64_t Cc,
                        float eps) {
    if (n == 0) return;
    kernel::rmsnorm_backward(dx, dx, dw, wpart, dy, xx, wt, n, Cc, eps, s);
  }
  // Per-head norm then RoPE at pos: out[n, heads*hd] from in (in kept).
  void head_norm_rope(float* out, const float* in, const float* wt, const int32_t* pos, int64_t n, int64_t heads) {
    if (n == 0) return;
    kernel::rmsnorm_forward(out, in, wt, n * heads, d.hd, d.eps, s);
    kernel::rope(out, nullptr, pos, 0, inv, 1.0, n, heads, d.hd, s);
  }
  // Its backward: dout is rotated back in place, din (zeroed here) gets the input gradient and
  // dw += the norm weight's.
  void head_norm_rope_backward(float* din, float* dw, float* dout, const float* in, const float* wt,
                               const int32_t* pos, int64_t n, int64_t heads) {
    CUDA_CHECK(cudaMemsetAsync(din, 0, size_t(n * heads * d.hd) * 4, s));
    if (n == 0) return;
    kernel::rope(dout, nullptr, pos, 0, inv, -1.0, n, heads, d.hd, s);
    rmsnorm_backward(din, dw, dout, in, wt, n * heads, d.hd, d.eps);
  }
  void add(float* out, const float* a, const float* b, int64_t n, int64_t Cc) {
    if (n == 0) return;
    add_rows_kernel<<<nblocks(n * Cc, 256), 256, 0, s>>>(out, a, Cc, nullptr, b, n, Cc);
    CUDA_LAUNCH_CHECK();
  }
  DflAttn attn(int64_t l) const {
    const LayerActs& A = la[size_t(l)];
    return DflAttn{A.q,  A.kc,   A.vc,   A.kb,   A.vb,   ctx0, anchor, N, int(d.block), int(d.nh), int(d.nkv),
                   int(d.hd), float(1.0 / std::sqrt(double(d.hd)))};
  }
};

DFlashEngine::DFlashEngine(int device, const DFlashDims& dd, DraftMath math, const float* embed,
                           const float* final_norm, const float* lm_head, const int64_t* kept, const float* inv_freq,
                           int64_t max_ctx, int64_t max_block_rows)
    : p_(std::make_unique<Impl>()) {
  Impl& I = *p_;
  if (dd.H <= 0 || dd.I <= 0 || dd.V <= 0 || dd.Vd <= 0 || dd.layers < 1 || dd.block < 2 || dd.n_aux < 1)
    fail_msg("DFlash on GPU: sizes must be positive, with at least one layer and blocks of 2 or more");
  if (dd.hd > 32 * kMaxHdLane || dd.hd % 2 != 0 || dd.hd <= 0)
    fail_msg("DFlash on GPU: head_dim " + std::to_string(dd.hd) + " is not supported (even, at most 256)");
  if (dd.nkv <= 0 || dd.nh % dd.nkv != 0) fail_msg("DFlash on GPU: heads must be a multiple of kv heads");
  if (max_ctx < 1 || max_block_rows < dd.block)
    fail_msg("DFlash on GPU: buffers for " + std::to_string(max_ctx) + " context rows and " +
             std::to_string(max_block_rows) + " block rows cannot hold one block of " + std::to_string(dd.block));
  I.d = dd;
  I.math = math;
  I.device = device;
  I.dev = std::make_unique<Device>(device, "DFlash trainer");
  I.s = I.dev->stream();
  I.blas = I.dev->blas();
  const int64_t H = dd.H, V = dd.V, Vd = dd.Vd, Id = dd.I;
  I.Rc = max_ctx;
  I.Rb = max_block_rows / dd.block * dd.block;
  I.qd = dd.nh * dd.hd;
  I.kvd = dd.nkv * dd.hd;
  I.AW = dd.n_aux * H;
  const int64_t Rc = I.Rc, Rb = I.Rb, qd = I.qd, kvd = I.kvd;
  auto up = [&](void* dst, const void* src, size_t n) {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, I.s));
    CUDA_CHECK(cudaStreamSynchronize(I.s));
  };
  I.embed = I.alloc<float>(size_t(V * H));
  up(I.embed, embed, size_t(V * H) * 4);
  I.tnorm = I.alloc<float>(size_t(H));
  up(I.tnorm, final_norm, size_t(H) * 4);
  {
    std::vector<float> rows(size_t(Vd * H));
    for (int64_t i = 0; i < Vd; ++i) {
      if (kept[i] < 0 || kept[i] >= V) fail_msg("DFlash on GPU: draft vocabulary id " + std::to_string(kept[i]) +
                                                " is outside the target's vocabulary");
      std::copy(lm_head + kept[i] * H, lm_head + (kept[i] + 1) * H, rows.begin() + i * H);
    }
    I.thead = I.alloc<float>(size_t(Vd * H));
    up(I.thead, rows.data(), rows.size() * 4);
  }
  I.inv = I.alloc<float>(size_t(dd.hd / 2));
  up(I.inv, inv_freq, size_t(dd.hd / 2) * 4);

  I.sizes = dflash_tensor_sizes(dd);
  for (auto n : I.sizes) {
    I.offs.push_back(I.total);
    I.total += (n + 63) / 64 * 64;
  }
  I.W = I.alloc<float>(size_t(I.total));
  I.G = I.alloc<float>(size_t(I.total));
  I.M = I.alloc<float>(size_t(I.total));
  I.Vm = I.alloc<float>(size_t(I.total));
  I.partial = I.alloc<double>(I.sizes.size() * size_t(kNormBlocks));

  const int64_t nbm = Rb / dd.block;
  I.aux = I.alloc<float>(size_t(Rc * I.AW));
  I.hidden = I.alloc<float>(size_t(Rc * H));
  I.ctx_pos = I.alloc<int32_t>(size_t(Rc));
  I.cq0 = I.alloc<int32_t>(size_t(Rc));
  I.cq1 = I.alloc<int32_t>(size_t(Rc));
  I.ctx0 = I.alloc<int32_t>(size_t(nbm));
  I.anchor = I.alloc<int32_t>(size_t(nbm));
  I.tok = I.alloc<int32_t>(size_t(Rb));
  I.trow = I.alloc<int32_t>(size_t(Rb));
  I.bpos = I.alloc<int32_t>(size_t(Rb));
  I.F = I.alloc<float>(size_t(Rc * H));
  I.C = I.alloc<float>(size_t(Rc * H));
  for (int64_t l = 0; l <= dd.layers; ++l) I.x.push_back(I.alloc<float>(size_t(Rb * H)));
  for (int64_t l = 0; l < dd.layers; ++l) {
    Impl::LayerActs A;
    A.xn = I.alloc<float>(size_t(Rb * H));
    A.q_raw = I.alloc<float>(size_t(Rb * qd));
    A.q = I.alloc<float>(size_t(Rb * qd));
    A.kb_raw = I.alloc<float>(size_t(Rb * kvd));
    A.kb = I.alloc<float>(size_t(Rb * kvd));
    A.vb = I.alloc<float>(size_t(Rb * kvd));
    A.kc_raw = I.alloc<float>(size_t(Rc * kvd));
    A.kc = I.alloc<float>(size_t(Rc * kvd));
    A.vc = I.alloc<float>(size_t(Rc * kvd));
    A.att = I.alloc<float>(size_t(Rb * qd));
    A.lse = I.alloc<float>(size_t(Rb * dd.nh));
    A.x1 = I.alloc<float>(size_t(Rb * H));
    A.hm = I.alloc<float>(size_t(Rb * H));
    A.ga = I.alloc<float>(size_t(Rb * Id));
    A.up = I.alloc<float>(size_t(Rb * Id));
    A.act = I.alloc<float>(size_t(Rb * Id));
    I.la.push_back(A);
  }
  I.fn = I.alloc<float>(size_t(Rb * H));
  I.logits = I.alloc<float>(size_t(Rb * Vd));
  I.P = I.alloc<float>(size_t(Rb * Vd));
  I.th = I.alloc<float>(size_t(Rb * H));
  I.lz = I.alloc<float>(size_t(Rb));
  I.rloss = I.alloc<float>(size_t(Rb));
  I.rscale = I.alloc<float>(size_t(Rb));
  I.targ = I.alloc<int32_t>(size_t(Rb));
  I.hit = I.alloc<uint8_t>(size_t(Rb));
  I.dX = I.alloc<float>(size_t(Rb * H));
  I.dx1 = I.alloc<float>(size_t(Rb * H));
  I.dhm = I.alloc<float>(size_t(Rb * H));
  I.dact = I.alloc<float>(size_t(Rb * Id));
  I.dga = I.alloc<float>(size_t(Rb * Id));
  I.dup = I.alloc<float>(size_t(Rb * Id));
  I.datt = I.alloc<float>(size_t(Rb * qd));
  I.Dd = I.alloc<float>(size_t(Rb * dd.nh));
  I.dq = I.alloc<float>(size_t(Rb * qd));
  I.dq_raw = I.alloc<float>(size_t(Rb * qd));
  I.dkb = I.alloc<float>(size_t(Rb * kvd));
  I.dvb = I.alloc<float>(size_t(Rb * kvd));
  I.dkb_raw = I.alloc<float>(size_t(Rb * kvd));
  I.dkc = I.alloc<float>(size_t(Rc * kvd));
  I.dvc = I.alloc<float>(size_t(Rc * kvd));
  I.dkc_raw = I.alloc<float>(size_t(Rc * kvd));
  I.dxn = I.alloc<float>(size_t(Rb * H));
  I.dC = I.alloc<float>(size_t(Rc * H));
  I.dF = I.alloc<float>(size_t(Rc * H));
  {  // rows of H values, or rows x heads of hd values (the per-head norms)
    const int64_t rows = std::max(Rb, Rc), heads = std::max(qd, kvd) / dd.hd;
    I.wpart = I.alloc<double>(size_t(std::max(kernel::rmsnorm_backward_groups(rows) * H,
                                              kernel::rmsnorm_backward_groups(rows * heads) * dd.hd)));
  }
  I.tmp = I.alloc<float>(size_t(Rb * H));
  CUDA_CHECK(cudaStreamSynchronize(I.s));
}

DFlashEngine::~DFlashEngine() = default;

void DFlashEngine::set_weights(const std::vector<const float*>& w) {
  Impl& I = *p_;
  I.dev->activate();
  copy_tensors(I.W, I.offs, I.sizes, unconst(w), false, I.s);
}
void DFlashEngine::get_weights(const std::vector<float*>& w) {
  Impl& I = *p_;
  I.dev->activate();
  copy_tensors(I.W, I.offs, I.sizes, w, true, I.s);
}
void DFlashEngine::get_grads(const std::vector<float*>& g) {
  Impl& I = *p_;
  I.dev->activate();
  copy_tensors(I.G, I.offs, I.sizes, g, true, I.s);
}
void DFlashEngine::set_moments(const std::vector<const float*>& m, const std::vector<const float*>& v) {
  Impl& I = *p_;
  I.dev->activate();
  copy_tensors(I.M, I.offs, I.sizes, unconst(m), false, I.s);
  copy_tensors(I.Vm, I.offs, I.sizes, unconst(v), false, I.s);
}
void DFlashEngine::get_moments(const std::vector<float*>& m, const std::vector<float*>& v) {
  Impl& I = *p_;
  I.dev->activate();
  copy_tensors(I.M, I.offs, I.sizes, m, true, I.s);
  copy_tensors(I.Vm, I.offs, I.sizes, v, true, I.s);
}

void DFlashEngine::forward(const DFlashBatch& b, DFlashRowStats& out) {
  Impl& I = *p_;
  const DFlashDims& d = I.d;
  I.dev->activate();
  const int64_t H = d.H, B = d.block, Tc = b.ctx_rows, nb = b.blocks, N = nb * B, Vd = d.Vd;
  if (Tc < 1 || Tc > I.Rc || N > I.Rb)
    fail_msg("DFlash on GPU: a batch of " + std::to_string(Tc) + " context rows and " + std::to_string(N) +
             " block rows; the buffers hold " + std::to_string(I.Rc) + " and " + std::to_string(I.Rb));
  // Check the layout, and find which block rows read each context row (the blocks of its
  // sample anchored after it: a suffix of that sample's blocks).
  I.h_cq0.assign(size_t(Tc), 0);
  I.h_cq1.assign(size_t(Tc), 0);
  I.h_bpos.resize(size_t(N));
  std::vector<int64_t> seen;  // the samples whose blocks came already (each sample's must be together)
  for (int64_t j = 0; j < nb;) {
    const int64_t c0 = b.blk_ctx0[j], ce = b.blk_ctx_end[j];
    if (std::find(seen.begin(), seen.end(), c0) != seen.end())
      fail_msg("DFlash on GPU: the blocks of the sample at row " + std::to_string(c0) + " are not together");
    seen.push_back(c0);
    int64_t je = j;
    while (je < nb && b.blk_ctx0[je] == c0) {
      const int64_t a = b.blk_anchor[je];
      if (b.blk_ctx_end[je] != ce || c0 < 0 || ce > Tc || a < 0 || c0 + a + B >= ce ||
          (je > j && a <= b.blk_anchor[je - 1]))
        fail_msg("DFlash on GPU: block " + std::to_string(je) + " (sample rows " + std::to_string(c0) + ".." +
                 std::to_string(ce) + ", anchor " + std::to_string(a) +
                 ") does not fit its sample or its anchors do not ascend");
      for (int64_t i = 0; i < B; ++i) {
        const int64_t n = je * B + i;
        I.h_bpos[size_t(n)] = int32_t(a + i);
        if (b.tok[n] < 0 || b.tok[n] >= d.V)
          fail_msg("DFlash on GPU: token id " + std::to_string(b.tok[n]) + " outside the vocabulary");
        if (b.trow[n] >= 0 && (b.trow[n] < c0 || b.trow[n] >= ce))
          fail_msg("DFlash on GPU: block row " + std::to_string(n) + " reads a target row outside its sample");
      }
      ++je;
    }
    int64_t k = j;
    for (int64_t t = 0; c0 + t < ce; ++t) {
      while (k < je && b.blk_anchor[k] <= t) ++k;
      if (k < je) I.h_cq0[size_t(c0 + t)] = int32_t(k * B), I.h_cq1[size_t(c0 + t)] = int32_t(je * B);
    }
    j = je;
  }
  I.Tc = Tc, I.nb = nb, I.N = N;
  cudaStream_t s = I.s;
  auto up = [&](void* dst, const void* src, size_t n) {
    if (n > 0) CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, s));
  };
  {
    int64_t r = 0;
    for (const auto& part : b.parts) {
      if (part.rows < 0 || r + part.rows > Tc) fail_msg("DFlash on GPU: the feature parts exceed the context rows");
      if (part.rows > 0) {
        CUDA_CHECK(cudaMemcpyAsync(I.aux + r * I.AW, part.aux, size_t(part.rows * I.AW) * 4, cudaMemcpyDefault, s));
        CUDA_CHECK(cudaMemcpyAsync(I.hidden + r * H, part.hidden, size_t(part.rows * H) * 4, cudaMemcpyDefault, s));
      }
      r += part.rows;
    }
    if (r != Tc)
      fail_msg("DFlash on GPU: feature parts of " + std::to_string(r) + " rows for " + std::to_string(Tc) +
               " context rows");
  }
  up(I.ctx_pos, b.ctx_pos, size_t(Tc) * 4);
  up(I.cq0, I.h_cq0.data(), size_t(Tc) * 4);
  up(I.cq1, I.h_cq1.data(), size_t(Tc) * 4);
  up(I.ctx0, b.blk_ctx0, size_t(nb) * 4);
  up(I.anchor, b.blk_anchor, size_t(nb) * 4);
  up(I.tok, b.tok, size_t(N) * 4);
  up(I.trow, b.trow, size_t(N) * 4);
  up(I.bpos, I.h_bpos.data(), size_t(N) * 4);

  // Context, then the layers over the block rows.
  I.linear(I.F, I.aux, I.w(0), Tc, I.AW, H);
  I.rmsnorm(I.C, I.F, I.w(1), Tc, H, d.eps);
  if (N > 0) {
    dfl_gather_kernel<<<unsigned(N), 256, 0, s>>>(I.x[0], I.embed, I.tok, H);
    CUDA_LAUNCH_CHECK();
  }
  for (int64_t l = 0; l < d.layers; ++l) {
    Impl::LayerActs& A = I.la[size_t(l)];
    const float* X = I.x[size_t(l)];
    I.rmsnorm(A.xn, X, I.w(I.lt(l, L_IN)), N, H, d.eps);
    I.linear(A.q_raw, A.xn, I.w(I.lt(l, L_WQ)), N, H, I.qd);
    I.linear(A.kb_raw, A.xn, I.w(I.lt(l, L_WK)), N, H, I.kvd);
    I.linear(A.vb, A.xn, I.w(I.lt(l, L_WV)), N, H, I.kvd);
    I.linear(A.kc_raw, I.C, I.w(I.lt(l, L_WK)), Tc, H, I.kvd);
    I.linear(A.vc, I.C, I.w(I.lt(l, L_WV)), Tc, H, I.kvd);
    I.head_norm_rope(A.q, A.q_raw, I.w(I.lt(l, L_QN)), I.bpos, N, d.nh);
    I.head_norm_rope(A.kb, A.kb_raw, I.w(I.lt(l, L_KN)), I.bpos, N, d.nkv);
    I.head_norm_rope(A.kc, A.kc_raw, I.w(I.lt(l, L_KN)), I.ctx_pos, Tc, d.nkv);
    if (N > 0) {
      dfl_attn_forward_kernel<<<nblocks(N * d.nh * 32, 256), 256, 0, s>>>(A.att, A.lse, I.attn(l));
      CUDA_LAUNCH_CHECK();
    }
    I.linear(I.tmp, A.att, I.w(I.lt(l, L_WO)), N, I.qd, H);
    I.add(A.x1, X, I.tmp, N, H);
    I.rmsnorm(A.hm, A.x1, I.w(I.lt(l, L_POST)), N, H, d.eps);
    I.linear(A.ga, A.hm, I.w(I.lt(l, L_GATE)), N, H, d.I);
    I.linear(A.up, A.hm, I.w(I.lt(l, L_UP)), N, H, d.I);
    if (N > 0) kernel::swiglu_forward(A.act, A.ga, A.up, d.I, N, d.I, s);
    I.linear(I.tmp, A.act, I.w(I.lt(l, L_DOWN)), N, d.I, H);
    I.add(I.x[size_t(l + 1)], A.x1, I.tmp, N, H);
  }
  I.rmsnorm(I.fn, I.x[size_t(d.layers)], I.w(I.t_norm()), N, H, d.eps);
  I.linear(I.logits, I.fn, I.w(I.t_lm()), N, H, Vd);
  // The target's distribution over the draft vocabulary at each row's target hidden state.
  if (N > 0) {
    dfl_gather_kernel<<<unsigned(N), 256, 0, s>>>(I.tmp, I.hidden, I.trow, H);
    CUDA_LAUNCH_CHECK();
    kernel::rmsnorm_forward(I.th, I.tmp, I.tnorm, N, H, d.target_eps, s);
  }
  I.linear(I.P, I.th, I.thead, N, H, Vd);
  if (N > 0) {
    dfl_target_kernel<<<unsigned(N), 512, 0, s>>>(I.P, I.targ, I.trow, Vd);
    CUDA_LAUNCH_CHECK();
    dfl_loss_kernel<<<unsigned(N), 512, 0, s>>>(I.logits, I.P, I.targ, I.trow, Vd, d.ce, I.lz, I.rloss, I.hit);
    CUDA_LAUNCH_CHECK();
  }
  out.loss.resize(size_t(N));
  out.hit.resize(size_t(N));
  if (N > 0) {
    CUDA_CHECK(cudaMemcpyAsync(out.loss.data(), I.rloss, size_t(N) * 4, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaMemcpyAsync(out.hit.data(), I.hit, size_t(N), cudaMemcpyDeviceToHost, s));
  }
  CUDA_CHECK(cudaStreamSynchronize(s));
  I.have_forward = true;
}

void DFlashEngine::backward(const std::vector<float>& row_scale, bool zero_grads) {
  Impl& I = *p_;
  const DFlashDims& d = I.d;
  I.dev->activate();
  if (!I.have_forward) fail_msg("DFlash on GPU: backward() without a forward()");
  const int64_t H = d.H, N = I.N, Tc = I.Tc, Vd = d.Vd, Id = d.I;
  if (int64_t(row_scale.size()) != N)
    fail_msg("DFlash on GPU: " + std::to_string(row_scale.size()) + " row weights for " + std::to_string(N) + " rows");
  cudaStream_t s = I.s;
  if (zero_grads) CUDA_CHECK(cudaMemsetAsync(I.G, 0, size_t(I.total) * 4, s));
  if (N > 0) {
    CUDA_CHECK(cudaMemcpyAsync(I.rscale, row_scale.data(), size_t(N) * 4, cudaMemcpyHostToDevice, s));
    dfl_dlogits_kernel<<<unsigned(N), 256, 0, s>>>(I.logits, I.P, I.targ, I.trow, I.lz, I.rscale, Vd, d.ce);
    CUDA_LAUNCH_CHECK();
  }
  // logits = lm_head(norm(X)); the lm_head is frozen.
  float* dfn = I.tmp;
  I.linear_dx(dfn, I.logits, I.w(I.t_lm()), N, H, Vd, 0.f);
  CUDA_CHECK(cudaMemsetAsync(I.dX, 0, size_t(N * H) * 4, s));
  I.rmsnorm_backward(I.dX, I.g(I.t_norm()), dfn, I.x[size_t(d.layers)], I.w(I.t_norm()), N, H, d.eps);
  CUDA_CHECK(cudaMemsetAsync(I.dC, 0, size_t(Tc * H) * 4, s));
  for (int64_t l = d.layers - 1; l >= 0; --l) {
    Impl::LayerActs& A = I.la[size_t(l)];
    const float* X = I.x[size_t(l)];
    // MLP: out = x1 + down(silu(gate(hm)) * up(hm)), hm = post_ln(x1).
    I.linear_dw(I.g(I.lt(l, L_DOWN)), I.dX, A.act, N, Id, H);
    I.linear_dx(I.dact, I.dX, I.w(I.lt(l, L_DOWN)), N, Id, H, 0.f);
    if (N > 0) kernel::swiglu_backward(I.dga, I.dup, I.dact, A.ga, A.up, Id, Id, N, Id, s);
    I.linear_dx(I.dhm, I.dga, I.w(I.lt(l, L_GATE)), N, H, Id, 0.f);
    I.linear_dx(I.dhm, I.dup, I.w(I.lt(l, L_UP)), N, H, Id, 1.f);
    I.linear_dw(I.g(I.lt(l, L_GATE)), I.dga, A.hm, N, H, Id);
    I.linear_dw(I.g(I.lt(l, L_UP)), I.dup, A.hm, N, H, Id);
    if (N > 0) CUDA_CHECK(cudaMemcpyAsync(I.dx1, I.dX, size_t(N * H) * 4, cudaMemcpyDeviceToDevice, s));
    I.rmsnorm_backward(I.dx1, I.g(I.lt(l, L_POST)), I.dhm, A.x1, I.w(I.lt(l, L_POST)), N, H, d.eps);
    // Attention: x1 = x + wo(att).
    I.linear_dw(I.g(I.lt(l, L_WO)), I.dx1, A.att, N, I.qd, H);
    I.linear_dx(I.datt, I.dx1, I.w(I.lt(l, L_WO)), N, I.qd, H, 0.f);
    const DflAttn at = I.attn(l);
    if (N > 0) {
      dfl_delta_kernel<<<nblocks(N * d.nh * 32, 256), 256, 0, s>>>(I.Dd, I.datt, A.att, N * d.nh, int(d.hd));
      CUDA_LAUNCH_CHECK();
      dfl_attn_dq_kernel<<<nblocks(N * d.nh * 32, 256), 256, 0, s>>>(I.dq, I.datt, A.lse, I.Dd, at);
      CUDA_LAUNCH_CHECK();
      dfl_attn_dkv_blk_kernel<<<nblocks(N * d.nkv * 32, 256), 256, 0, s>>>(I.dkb, I.dvb, I.datt, A.lse, I.Dd, at);
      CUDA_LAUNCH_CHECK();
    }
    dfl_attn_dkv_ctx_kernel<<<nblocks(Tc * d.nkv * 32, 256), 256, 0, s>>>(I.dkc, I.dvc, I.datt, A.lse, I.Dd, I.cq0,
                                                                           I.cq1, Tc, at);
    CUDA_LAUNCH_CHECK();
    I.head_norm_rope_backward(I.dq_raw, I.g(I.lt(l, L_QN)), I.dq, A.q_raw, I.w(I.lt(l, L_QN)), I.bpos, N, d.nh);
    I.head_norm_rope_backward(I.dkb_raw, I.g(I.lt(l, L_KN)), I.dkb, A.kb_raw, I.w(I.lt(l, L_KN)), I.bpos, N, d.nkv);
    I.head_norm_rope_backward(I.dkc_raw, I.g(I.lt(l, L_KN)), I.dkc, A.kc_raw, I.w(I.lt(l, L_KN)), I.ctx_pos, Tc,
                              d.nkv);
    I.linear_dx(I.dxn, I.dq_raw, I.w(I.lt(l, L_WQ)), N, H, I.qd, 0.f);
    I.linear_dx(I.dxn, I.dkb_raw, I.w(I.lt(l, L_WK)), N, H, I.kvd, 1.f);
    I.linear_dx(I.dxn, I.dvb, I.w(I.lt(l, L_WV)), N, H, I.kvd, 1.f);
    I.linear_dw(I.g(I.lt(l, L_WQ)), I.dq_raw, A.xn, N, H, I.qd);
    I.linear_dw(I.g(I.lt(l, L_WK)), I.dkb_raw, A.xn, N, H, I.kvd);
    I.linear_dw(I.g(I.lt(l, L_WV)), I.dvb, A.xn, N, H, I.kvd);
    I.linear_dw(I.g(I.lt(l, L_WK)), I.dkc_raw, I.C, Tc, H, I.kvd);
    I.linear_dw(I.g(I.lt(l, L_WV)), I.dvc, I.C, Tc, H, I.kvd);
    I.linear_dx(I.dC, I.dkc_raw, I.w(I.lt(l, L_WK)), Tc, H, I.kvd, 1.f);
    I.linear_dx(I.dC, I.dvc, I.w(I.lt(l, L_WV)), Tc, H, I.kvd, 1.f);
    // x1 = x + ...: the layer input's gradient is dx1 plus in_ln's backward of dxn.
    if (N > 0) CUDA_CHECK(cudaMemcpyAsync(I.dX, I.dx1, size_t(N * H) * 4, cudaMemcpyDeviceToDevice, s));
    I.rmsnorm_backward(I.dX, I.g(I.lt(l, L_IN)), I.dxn, X, I.w(I.lt(l, L_IN)), N, H, d.eps);
  }
  // Context: C = hidden_norm(F), F = fc(aux).
  CUDA_CHECK(cudaMemsetAsync(I.dF, 0, size_t(Tc * H) * 4, s));
  I.rmsnorm_backward(I.dF, I.g(1), I.dC, I.F, I.w(1), Tc, H, d.eps);
  I.linear_dw(I.g(0), I.dF, I.aux, Tc, I.AW, H);
  CUDA_CHECK(cudaStreamSynchronize(s));
  I.have_forward = false;  // the logits now hold their gradient: another backward needs a forward
}

double DFlashEngine::clip_grad_norm(double max_norm) {
  Impl& I = *p_;
  I.dev->activate();
  const int nt = int(I.sizes.size());  // the frozen lm_head's gradient is zero
  for (int t = 0; t < nt; ++t) {
    sumsq_kernel<<<kNormBlocks, 256, 0, I.s>>>(I.partial + t * kNormBlocks, I.g(t), I.sizes[size_t(t)]);
    CUDA_LAUNCH_CHECK();
  }
  std::vector<double> part(size_t(nt) * kNormBlocks);
  CUDA_CHECK(cudaMemcpyAsync(part.data(), I.partial, part.size() * 8, cudaMemcpyDeviceToHost, I.s));
  CUDA_CHECK(cudaStreamSynchronize(I.s));
  double ss = 0;
  for (double x : part) ss += x;
  const double norm = std::sqrt(ss);
  if (max_norm > 0) {
    const double coef = max_norm / (norm + 1e-6);
    if (coef < 1.0) {
      scale_kernel<<<nblocks(I.total, 256), 256, 0, I.s>>>(I.G, float(coef), I.total);
      CUDA_LAUNCH_CHECK();
      CUDA_CHECK(cudaStreamSynchronize(I.s));
    }
  }
  return norm;
}

void DFlashEngine::adamw(double lr, double beta1, double beta2, double eps, double weight_decay,
                         const std::vector<uint8_t>& decay_on, int64_t t_after) {
  Impl& I = *p_;
  if (decay_on.size() != I.sizes.size())
    fail_msg("DFlash on GPU: " + std::to_string(decay_on.size()) + " weight-decay flags, expected " +
             std::to_string(I.sizes.size()));
  I.dev->activate();
  const double bc1 = 1.0 - std::pow(beta1, double(t_after)), bc2 = 1.0 - std::pow(beta2, double(t_after));
  for (int t = 0; t < I.t_lm(); ++t) {  // every tensor but the frozen lm_head (the last)
    const float decay = decay_on[size_t(t)] ? float(1.0 - lr * weight_decay) : 1.0f;
    const int64_t n = I.sizes[size_t(t)], o = I.offs[size_t(t)];
    const AdamWArgs a{decay, float(lr / bc1), float(std::sqrt(bc2)), float(beta1), float(beta2), float(eps), 1.f};
    adamw_update(I.W + o, I.M + o, I.Vm + o, I.G + o, n, a, nullptr, I.s);
    CUDA_LAUNCH_CHECK();
  }
  CUDA_CHECK(cudaStreamSynchronize(I.s));
}

void DFlashEngine::zero_grads() {
  Impl& I = *p_;
  I.dev->activate();
  CUDA_CHECK(cudaMemsetAsync(I.G, 0, size_t(I.total) * 4, I.s));
  CUDA_CHECK(cudaStreamSynchronize(I.s));
}
float* DFlashEngine::grad_data() { return p_->G; }
int64_t DFlashEngine::grad_elems() const { return p_->total; }
cudaStream_t DFlashEngine::stream() const { return p_->s; }
size_t DFlashEngine::device_bytes() const { return p_->bytes; }

}  // namespace talon::cuda
