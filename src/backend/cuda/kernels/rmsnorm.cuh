// RMSNorm, forward and backward, for every caller on the GPU: the target's layer norms (bf16
// out of the fp32 residual stream, with the residual add fused), Qwen3's per-head q/k norms
// (in place on bf16), DeepSeek's fp32 norms, and the draft trainer's fp32 norms and their
// backward. The CPU twin is rmsnorm in src/backend/cpu/ops.h (the specification):
//   y[r, :] = x[r, :] * rsqrt(sum(x[r, :]^2) / C + eps) * w,
// the sum of squares in fp32, the product formed as (x * rsqrt) * w.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "backend/cuda/kernels/convert.cuh"
#include "backend/cuda/kernels/reduce.cuh"
#include "backend/cuda/launch.cuh"

namespace talon::cuda {

// Where row r of an operand starts: rows of C values, `per` of them side by side in each line
// of `ld` values (per == 1: one row a line; per > 1: e.g. the heads of a fused q|k|v row).
struct NormRows {
  int64_t ld = 0, per = 1, C = 0;
  __host__ __device__ int64_t at(int64_t r) const { return per == 1 ? r * ld : (r / per) * ld + (r % per) * C; }
};

// The RMSNorm backward's rows a block when set (4 or 8; kernel::set_norm_back_rows, for the op
// harness), else 0: TALON_CUDA_NORM_BACK_ROWS decides (below). One variable for every
// translation unit.
inline std::atomic<int> g_norm_back_rows{0};

namespace {

// Optionally x += add (written back to x; A = void: no add, and x may be const), then
// y = rmsnorm(x) * w. One block per row, or with kWarpRow one warp per row (short rows such as
// per-head norms).
template <bool kWarpRow, class Y, class X, class A, class W>
__global__ void rmsnorm_forward_kernel(Y* y, NormRows ry, X* x, NormRows rx, const A* add, const W* w, int64_t rows,
                                       int64_t C, float eps) {
  allow_dependents();  // the product after a norm prefetches its weights meanwhile (warp.cuh)
  grid_dependency_wait();  // launched dependent (launch.cuh)
  __shared__ float sh[33];
  const int64_t r = kWarpRow ? (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32 : int64_t(blockIdx.x);
  const int lane = kWarpRow ? int(threadIdx.x % 32) : int(threadIdx.x), step = kWarpRow ? 32 : int(blockDim.x);
  if (kWarpRow && r >= rows) return;  // whole warps leave together
  X* xr = x + rx.at(r);
  float ss = 0.f;
  for (int64_t c = lane; c < C; c += step) {
    float v = load_f(xr + c);
    if constexpr (!std::is_void_v<A>) {
      v += load_f(add + r * C + c);
      store_as(xr + c, v);
    }
    ss += v * v;
  }
  ss = kWarpRow ? warp_sum(ss) : block_sum(ss, sh);
  const float k = rsqrtf(ss / float(C) + eps);
  Y* yr = y + ry.at(r);
  for (int64_t c = lane; c < C; c += step) store_as(yr + c, load_f(xr + c) * k * load_f(w + c));
}

// The backward of y = rmsnorm(x) * w (fp32), G rows a block (kNormBackRows, or norm_back_rows()):
//   dx[r, :] = res[r, :] + k*w*dy - x*k^3/C*sum(w*dy*x)   (res may be null, or dx itself; dx may
//   be null), and the weight gradient's part of the block's rows, wpart[block, :] = the sum over
//   those rows, in order, of dy*x*k (fp64). One pass writes dx and a small [groups, C] part
//   instead of a per-row weight matrix summed afterwards. The rows' sums come first, all at
//   once (one block-wide reduction for the group, many loads in flight); then each thread walks
//   its columns through the group's rows, the weight part of a column in a register.
// Four rows a block: the trainer's ~1400-row calls then spread ~350 blocks over the SMs instead
// of ~175 (some SMs two, most one), at twice the weight parts: 50.4 against 60.7 us a call in
// the 8B draft's traced step (one H100). TALON_CUDA_NORM_BACK_ROWS=8: eight rows a block, as
// before. The scratch (rmsnorm_backward_groups) is sized for four.
constexpr int kNormBackRows = 4;
constexpr int kNormBackRowsMax = 8;
inline int norm_back_rows() {
  static const int from_env = [] {
    const char* e = std::getenv("TALON_CUDA_NORM_BACK_ROWS");
    return e && std::string(e) == "8" ? kNormBackRowsMax : kNormBackRows;
  }();
  const int set = g_norm_back_rows.load(std::memory_order_relaxed);
  return set == kNormBackRowsMax || set == kNormBackRows ? set : from_env;
}

// V consecutive fp32 values of a row, loaded and stored at once (V = 4: float4, when every row
// start is 16-byte aligned).
template <int V>
using NormVec = std::conditional_t<V == 4, float4, float>;
template <int V>
__device__ __forceinline__ float lane_of(const NormVec<V>& v, int i) {
  if constexpr (V == 4) return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
  else return v;
}
template <int V>
__device__ __forceinline__ void set_lane(NormVec<V>& v, int i, float f) {
  if constexpr (V == 4) (i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w) = f;
  else v = f;
}

template <int V, int G>
__global__ void rmsnorm_backward_kernel(float* dx, int64_t lddx, const float* res, double* wpart, const float* dy,
                                        int64_t lddy, const float* x, int64_t ldx, const float* w, int64_t rows,
                                        int64_t C, float eps) {
  allow_dependents();
  grid_dependency_wait();  // launched dependent with kDependTrain (launch.cuh)
  using Vec = NormVec<V>;
  __shared__ float part[2 * G][32];
  __shared__ float tot[2 * G];
  const int64_t r0 = int64_t(blockIdx.x) * G;
  const int n = rows - r0 < G ? int(rows - r0) : G;
  const int64_t step = int64_t(blockDim.x) * V;
  auto at = [](const float* p, int64_t off) { return *reinterpret_cast<const Vec*>(p + off); };
  float ss[G], dot[G];
#pragma unroll
  for (int j = 0; j < G; ++j) ss[j] = dot[j] = 0.f;
  for (int64_t c = int64_t(threadIdx.x) * V; c < C; c += step) {
    const Vec wc = at(w, c);
#pragma unroll
    for (int j = 0; j < G; ++j)
      if (j < n) {
        const Vec xv = at(x, (r0 + j) * ldx + c), dv = at(dy, (r0 + j) * lddy + c);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float xi = lane_of<V>(xv, i);
          ss[j] += xi * xi;
          dot[j] += lane_of<V>(wc, i) * lane_of<V>(dv, i) * xi;
        }
      }
  }
  const int wid = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
#pragma unroll
  for (int j = 0; j < G; ++j) {
    ss[j] = warp_sum(ss[j]);
    dot[j] = warp_sum(dot[j]);
    if (lane == 0) part[j][wid] = ss[j], part[G + j][wid] = dot[j];
  }
  __syncthreads();
  if (threadIdx.x < 2 * G) {
    float t = 0.f;
    for (int i = 0; i < nw; ++i) t += part[threadIdx.x][i];
    tot[threadIdx.x] = t;
  }
  __syncthreads();
  float k[G], k3[G];
#pragma unroll
  for (int j = 0; j < G; ++j) {
    k[j] = rsqrtf(tot[j] / float(C) + eps);
    k3[j] = k[j] * k[j] * k[j] / float(C) * tot[G + j];
  }
  for (int64_t c = int64_t(threadIdx.x) * V; c < C; c += step) {
    const Vec wc = at(w, c);
    double a[V];
#pragma unroll
    for (int i = 0; i < V; ++i) a[i] = 0.0;
#pragma unroll
    for (int j = 0; j < G; ++j)
      if (j < n) {
        const int64_t r = r0 + j;
        const Vec xv = at(x, r * ldx + c), dv = at(dy, r * lddy + c);
        Vec o{};  // res, or zeros
        if (dx && res) o = at(res, r * lddx + c);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float xi = lane_of<V>(xv, i), di = lane_of<V>(dv, i);
          set_lane<V>(o, i, lane_of<V>(o, i) + (k[j] * lane_of<V>(wc, i) * di - xi * k3[j]));
          a[i] += double(di * xi * k[j]);
        }
        if (dx) *reinterpret_cast<Vec*>(dx + r * lddx + c) = o;
      }
#pragma unroll
    for (int i = 0; i < V; ++i) wpart[int64_t(blockIdx.x) * C + c + i] = a[i];
  }
}

// Launchers: `rows` rows of C values; add ([rows, C] contiguous) is read when A is not void.
template <class Y, class X, class A, class W>
void rmsnorm_forward(Y* y, NormRows ry, X* x, NormRows rx, const A* add, const W* w, int64_t rows, int64_t C, float eps,
                     cudaStream_t s) {
  if (rows <= 0) return;
  ry.C = rx.C = C;
  if (C <= 256)  // a warp per row: eight rows a block
    launch_dependent(kDependNorm, rmsnorm_forward_kernel<true, Y, X, A, W>, dim3(unsigned((rows * 32 + 255) / 256)),
                     dim3(256), 0, s, y, ry, x, rx, add, w, rows, C, eps);
  else  // a block per row; decode-sized calls (up to 512 rows: two blocks an SM at most) get
        // 1024 threads, so that each thread has few dependent loads instead of C / 256 (256
        // rows of 4096: 15.6 us with 256 threads, on an H200)
    launch_dependent(kDependNorm, rmsnorm_forward_kernel<false, Y, X, A, W>, dim3(unsigned(rows)),
                     dim3(rows <= 512 && C >= 2048 ? 1024 : 256), 0, s, y, ry, x, rx, add, w, rows, C, eps);
}

// The groups of rows the backward's weight parts cover: wpart holds this many rows of C doubles.
inline int64_t rmsnorm_backward_groups(int64_t rows) { return (rows + kNormBackRows - 1) / kNormBackRows; }

// dx (ld lddx; res, when given, has the same layout and may be dx) and dw += the weight
// gradient; wpart: scratch of rmsnorm_backward_groups(rows) x C doubles.
inline void rmsnorm_backward(float* dx, int64_t lddx, const float* res, float* dw, double* wpart, const float* dy,
                             int64_t lddy, const float* x, int64_t ldx, const float* w, int64_t rows, int64_t C,
                             float eps, cudaStream_t s) {
  if (rows <= 0) return;
  const int G = norm_back_rows();
  const int64_t groups = (rows + G - 1) / G;
  // float4 lanes where every row start and the width allow them (the trainer's [rows, 4096])
  auto aligned = [](const void* p, int64_t ld) { return p == nullptr || (uintptr_t(p) % 16 == 0 && ld % 4 == 0); };
  const unsigned threads = C <= 128 ? 128 : 256;
  auto launch = [&](auto kern) {
    launch_dependent(kDependTrain, kern, dim3(unsigned(groups)), dim3(threads), 0, s, dx, lddx, res, wpart, dy, lddy, x,
                     ldx, w, rows, C, eps);
  };
  const bool v4 =
      C % 4 == 0 && aligned(dx, lddx) && aligned(res, lddx) && aligned(dy, lddy) && aligned(x, ldx) && aligned(w, 0);
  if (G == kNormBackRows)
    v4 ? launch(rmsnorm_backward_kernel<4, kNormBackRows>) : launch(rmsnorm_backward_kernel<1, kNormBackRows>);
  else
    v4 ? launch(rmsnorm_backward_kernel<4, kNormBackRowsMax>) : launch(rmsnorm_backward_kernel<1, kNormBackRowsMax>);
  // the parts, in order
  launch_dependent(kDependTrain, colsum_kernel<double>, dim3(unsigned((C + 31) / 32)), dim3(32, 8), 0, s, dw,
                   static_cast<const double*>(wpart), groups, C);
}

}  // namespace
}  // namespace talon::cuda
