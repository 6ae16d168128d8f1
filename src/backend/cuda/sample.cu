// Sampling on the device (decode_ops.h: sample_rows): one block per logits row.
//
// What it computes is the host's draw(sampling_distribution(row, p), u) (model/sampling.h):
// softmax(logits / T) in fp64, cut to the top-k ids and then to the shortest prefix (by
// decreasing probability, ties to the lower id) whose mass reaches top_p, and an inverse-CDF
// draw in id order over the kept ids. Only the order of fp64 additions differs from the host,
// so the two pick different ids only when u lands within rounding of a boundary of the CDF
// (or the kept mass within rounding of top_p).
//
// How, with a bf16 row: probability is monotone in the logit, and a bf16 logit maps to a
// 16-bit key that orders like its value, so the cut is a key threshold plus how many of the
// ids at that key (lowest first) are kept: for top-k, the largest key with at least k ids at
// or above it; for top-p, the largest key whose ids at or above it hold top_p of the mass.
// Two 256-bin histograms (high byte, then low byte within the chosen high byte) find it: with
// exact counts for top-k; for top-p with fixed-point masses that give a candidate, confirmed
// (or moved a key at a time) by exact fp64 sums, with a bit-by-bit search as the last resort.
// The draw gives each thread a contiguous chunk of ids: chunk masses are scanned in a fixed
// order, the thread whose chunk holds u * total walks it. Every reduction has a fixed order,
// so the same row, parameters and u give the same id in any batch and on every run.
#include <cfloat>
#include <climits>
#include <cstdint>

#include "backend/cuda/check.h"
#include "backend/cuda/decode_ops.h"

namespace talon::cuda {

namespace {

constexpr int kSampleThreads = 1024;
constexpr int kSampleWarps = kSampleThreads / 32;

__device__ __forceinline__ bool nan16(uint32_t b) { return (b & 0x7fffu) > 0x7f80u; }
__device__ __forceinline__ float value16(uint32_t b) { return __uint_as_float(b << 16); }
// A key that orders like the value: larger value, larger key; -0 is +0 (equal values tie
// by id, as on the host). No NaN here.
__device__ __forceinline__ uint32_t key16(uint32_t b) {
  if (b == 0x8000u) b = 0;
  return (b & 0x8000u) ? (~b & 0xffffu) : (b | 0x8000u);
}
__device__ __forceinline__ uint32_t bits_of_key(uint32_t k) { return (k & 0x8000u) ? (k & 0x7fffu) : (~k & 0xffffu); }

// Sum over the block, the same value in every thread; fixed order (butterfly within warps,
// then warp totals in order), so it is the same on every run. `sh` holds kSampleWarps values.
template <typename T>
__device__ T block_sum(T v, T* sh) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (threadIdx.x % 32 == 0) sh[threadIdx.x / 32] = v;
  __syncthreads();
  T s = sh[0];
  for (int w = 1; w < kSampleWarps; ++w) s += sh[w];
  return s;
}

// Exclusive prefix of v over threads in thread order, and the total. Lane 0 of each warp
// adds its lanes' values one by one, then thread 0 the warp totals; each thread's prefix is
// base(warp) + local(lane). The end of thread t's interval, [prefix_t, prefix_t + v_t), is
// computed as thread t + 1's prefix, so the intervals tile [0, total) with no gap or overlap
// whatever the rounding (an empty chunk gets an empty interval).
template <typename T>
struct Scan {
  T prefix, next, total;
};
template <typename T>
__device__ Scan<T> block_scan(T v, T* lane_v, T* warp_base) {
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
  __syncthreads();
  lane_v[threadIdx.x] = v;
  __syncthreads();
  if (lane == 0) {
    T acc = 0;
    for (int i = 0; i < 32; ++i) {
      const T x = lane_v[w * 32 + i];
      lane_v[w * 32 + i] = acc;  // local exclusive prefix
      acc += x;
    }
    warp_base[w] = acc;  // the warp's total, until thread 0 turns totals into bases
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    T acc = 0;
    for (int i = 0; i < kSampleWarps; ++i) {
      const T x = warp_base[i];
      warp_base[i] = acc;
      acc += x;
    }
    warp_base[kSampleWarps] = acc;
  }
  __syncthreads();
  Scan<T> s;
  s.prefix = warp_base[w] + lane_v[threadIdx.x];
  s.next = lane == 31 ? warp_base[w + 1] : warp_base[w] + lane_v[threadIdx.x + 1];
  s.total = warp_base[kSampleWarps];
  return s;
}

struct Located {
  int bin;       // the bin where the sum from the top reaches what was asked
  double above;  // the sum over the bins above it (and what came before)
};

__global__ void __launch_bounds__(kSampleThreads)
    sample_kernel(int32_t* ids, const bf16* logits, int V, const DeviceSampling* prm, const double* uniforms) {
  __shared__ double shd[kSampleWarps];
  __shared__ int shi[kSampleWarps];
  __shared__ float shf[kSampleWarps];
  __shared__ double lane_d[kSampleThreads];
  __shared__ double base_d[kSampleWarps + 1];
  __shared__ int lane_i[kSampleThreads];
  __shared__ int base_i[kSampleWarps + 1];
  __shared__ int picked;
  __shared__ unsigned long long hist[256];
  __shared__ int loc_bin;
  __shared__ double loc_above;
  const uint16_t* x = reinterpret_cast<const uint16_t*>(logits) + size_t(blockIdx.x) * size_t(V);
  const double T = prm->temperature, top_p = prm->top_p;
  const int64_t top_k = prm->top_k;
  const int tid = threadIdx.x;

  // The largest logit and its first id (NaN never counts).
  float m = -INFINITY;
  int am = INT_MAX;
  for (int i = tid; i < V; i += kSampleThreads) {
    const uint32_t b = x[i];
    if (nan16(b)) continue;
    const float v = value16(b);
    if (v > m || (v == m && i < am)) m = v, am = i;
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float om = __shfl_xor_sync(0xffffffffu, m, o);
    const int oa = __shfl_xor_sync(0xffffffffu, am, o);
    if (om > m || (om == m && oa < am)) m = om, am = oa;
  }
  if (tid % 32 == 0) shf[tid / 32] = m, shi[tid / 32] = am;
  __syncthreads();
  m = shf[0], am = shi[0];
  for (int w = 1; w < kSampleWarps; ++w)
    if (shf[w] > m || (shf[w] == m && shi[w] < am)) m = shf[w], am = shi[w];
  // Greedy parameters, a row of NaNs or a +inf logit: the argmax (0 for no number at all).
  if (!(T > 0) || am == INT_MAX || isinf(m)) {
    if (tid == 0) ids[blockIdx.x] = am == INT_MAX ? 0 : am;
    return;
  }
  const double md = m;
  auto weight = [&](uint32_t b) { return nan16(b) ? 0.0 : exp((double(value16(b)) - md) / T); };
  auto count_ge = [&](uint32_t t) {
    int c = 0;
    for (int i = tid; i < V; i += kSampleThreads) {
      const uint32_t b = x[i];
      c += !nan16(b) && key16(b) >= t;
    }
    return block_sum(c, shi);
  };
  auto mass_ge = [&](uint32_t t) {
    double s = 0;
    for (int i = tid; i < V; i += kSampleThreads) {
      const uint32_t b = x[i];
      if (!nan16(b) && key16(b) >= t) s += weight(b);
    }
    return block_sum(s, shd);
  };

  // 256-bin histograms over one byte of the key: level 1 the high byte of every id, level 2
  // the low byte of the ids whose high byte is `hi`. Counts are exact; masses are fixed point
  // (weight x 2^40, integers, so the sums do not depend on the order of the atomics) and only
  // locate a candidate threshold, which exact fp64 passes then confirm.
  auto histogram = [&](bool counts, int level, uint32_t hi) {
    for (int i = tid; i < 256; i += kSampleThreads) hist[i] = 0;
    __syncthreads();
    for (int i0 = 0; i0 < V; i0 += kSampleThreads) {
      const int i = i0 + tid;
      uint32_t bin = 0xffffffffu;
      unsigned long long add = 0;
      if (i < V) {
        const uint32_t b = x[i];
        const uint32_t k = key16(b);
        if (!nan16(b) && (level == 1 || (k >> 8) == hi)) {
          bin = level == 1 ? k >> 8 : k & 255u;
          add = counts ? 1ull : __double2ull_rn(weight(b) * 0x1p40);
        }
      }
      if (counts) {
        // Lanes of one bin add once (most ids share a few low bins).
        const unsigned peers = __match_any_sync(0xffffffffu, bin);
        if (bin != 0xffffffffu && tid % 32 == __ffs(peers) - 1) atomicAdd(&hist[bin], (unsigned long long)__popc(peers));
      } else if (add > 0) {
        atomicAdd(&hist[bin], add);
      }
    }
    __syncthreads();
  };
  // The highest bin at which the sum from the top, starting at `above`, reaches `need`
  // (thread 0; the answer and the sum above it go to every thread). 0 when none does.
  auto locate = [&](double above, double need) {
    if (tid == 0) {
      double cum = above;
      int at = 0;
      double before = above;
      for (int i = 255; i >= 0; --i) {
        before = cum;
        cum += double(hist[i]);
        if (cum >= need) {
          at = i;
          break;
        }
      }
      loc_bin = at;
      loc_above = before;
    }
    __syncthreads();
    const int at = loc_bin;
    const double before = loc_above;
    __syncthreads();
    return Located{at, before};
  };

  // The cut: ids with a key above `theta`, and the first `ties` ids at `theta` (cut false:
  // every id).
  bool cut = false;
  uint32_t theta = 0;
  int ties = 0;
  const bool cut_k = top_k > 0 && top_k < V;
  int64_t keep_k = V;
  if (cut_k) {
    // The k-th id in rank order has key theta_k: fewer than k ids above it, k or more at or
    // above it. Exact from two count histograms.
    const double k = double(top_k);
    histogram(true, 1, 0);
    const Located h = locate(0, k);
    histogram(true, 2, uint32_t(h.bin));
    const Located l = locate(h.above, k);
    theta = (uint32_t(h.bin) << 8) | uint32_t(l.bin);
    ties = int(top_k - int64_t(l.above));
    keep_k = top_k;
    cut = true;
  }
  if (top_p < 1) {
    // The threshold key t: ids at or above it hold top_p of the mass, those above it less.
    // A candidate from two fixed-point histograms, then exact fp64 checks, moving t a key at
    // a time while they fail (rounding near a boundary); after a few misses, bit by bit.
    histogram(false, 1, 0);
    double zs = 0;
    for (int i = tid; i < V; i += kSampleThreads) zs += weight(x[i]);
    const double z = block_sum(zs, shd), target = top_p * z;
    double total_f = 0;
    if (tid == 0)
      for (int i = 0; i < 256; ++i) total_f += double(hist[i]);
    const Located h = locate(0, top_p * total_f);  // (thread 0's total is the one read)
    histogram(false, 2, uint32_t(h.bin));
    const Located l = locate(h.above, top_p * total_f);
    uint32_t t = (uint32_t(h.bin) << 8) | uint32_t(l.bin);
    double above = 0, at_or_above = 0;
    bool found = false;
    for (int tries = 0; tries < (prm->search_only ? 0 : 8) && !found; ++tries) {
      double sa = 0, sb = 0;
      for (int i = tid; i < V; i += kSampleThreads) {
        const uint32_t b = x[i];
        if (nan16(b)) continue;
        const uint32_t k = key16(b);
        if (k < t) continue;
        const double w = weight(b);
        sb += w;
        if (k > t) sa += w;
      }
      above = block_sum(sa, shd);
      at_or_above = block_sum(sb, shd);
      if (at_or_above < target) {
        if (t == 0) break;
        --t;
      } else if (above >= target) {
        if (t == 0xffffu) break;
        ++t;
      } else {
        found = true;
      }
    }
    if (!found) {
      t = 0;
      for (int bit = 15; bit >= 0; --bit) {
        const uint32_t c = t | (1u << bit);
        if (mass_ge(c) >= target) t = c;
      }
      above = mass_ge(t + 1);
    }
    const int n_above = count_ge(t + 1), n_at = count_ge(t) - n_above;
    const double w = weight(bits_of_key(t));
    // The ids at key t are added one at a time, as the host adds them in rank order.
    int j = 1;
    if (w > 0) {
      const double need = (target - above) / w;
      j = need > 1 ? int(fmin(need, double(n_at))) : 1;
      while (j > 1 && above + double(j - 1) * w >= target) --j;
      while (j < n_at && above + double(j) * w < target) ++j;
    }
    j = max(1, min(j, max(n_at, 1)));
    if (!cut_k || int64_t(n_above) + j < keep_k) cut = true, theta = t, ties = j;
  }

  // Each thread's chunk of ids: which ties it keeps (ties are numbered in id order), its
  // kept mass, its last kept id.
  const int C = (V + kSampleThreads - 1) / kSampleThreads, lo = min(V, tid * C), hi = min(V, lo + C);
  int tie0 = 0;
  if (cut) {
    int n_at = 0;
    for (int i = lo; i < hi; ++i) {
      const uint32_t b = x[i];
      n_at += !nan16(b) && key16(b) == theta;
    }
    tie0 = block_scan(n_at, lane_i, base_i).prefix;
  }
  auto kept = [&](uint32_t b, int& tie) {
    if (nan16(b)) return false;
    if (!cut) return true;
    const uint32_t k = key16(b);
    if (k != theta) return k > theta;
    return tie++ < ties;
  };
  double s = 0;
  int last = -1;
  {
    int tie = tie0;
    for (int i = lo; i < hi; ++i) {
      const uint32_t b = x[i];
      if (kept(b, tie)) s += weight(b), last = i;
    }
  }
  const Scan<double> sc = block_scan(s, lane_d, base_d);
  const double target = uniforms[blockIdx.x] * sc.total;
  if (tid == 0) picked = -1;
  __syncthreads();
  if (last >= 0 && sc.prefix <= target && target < sc.next) {
    // This chunk holds the target: walk it. Rounding may leave the walk's sum short of
    // `next`; then the chunk's last kept id is the pick, as the host's walk ends on its last.
    int tie = tie0, pick = last;
    double acc = sc.prefix;
    for (int i = lo; i < hi; ++i) {
      const uint32_t b = x[i];
      if (!kept(b, tie)) continue;
      acc += weight(b);
      if (target < acc) {
        pick = i;
        break;
      }
    }
    picked = pick;
  }
  __syncthreads();
  if (picked < 0) {
    // u * total rounded up to the total: the last kept id (the host does the same).
    int l = last;
    for (int o = 16; o > 0; o >>= 1) l = max(l, __shfl_xor_sync(0xffffffffu, l, o));
    if (tid % 32 == 0) shi[tid / 32] = l;
    __syncthreads();
    if (tid == 0) {
      for (int w = 1; w < kSampleWarps; ++w) l = max(l, shi[w]);
      l = max(l, shi[0]);
      ids[blockIdx.x] = l >= 0 ? l : am;
    }
    return;
  }
  if (tid == 0) ids[blockIdx.x] = picked;
}

}  // namespace

void sample_rows(int32_t* ids, const bf16* logits, int64_t rows, int64_t V, const DeviceSampling* params,
                 const double* uniforms, cudaStream_t s) {
  if (rows == 0) return;
  if (V <= 0 || V > INT_MAX / 2) fail_msg("sample_rows: vocabulary " + std::to_string(V) + " out of range");
  sample_kernel<<<unsigned(rows), kSampleThreads, 0, s>>>(ids, logits, int(V), params, uniforms);
  CUDA_LAUNCH_CHECK();
}

}  // namespace talon::cuda
