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
// Counts of ids by key find it: for top-k, two 256-bin histograms (high byte, then low byte
// within the chosen high byte), exact; for top-p, the high-byte counts bound each bin's mass
// (count times the weights of its lowest and highest keys), the bins the threshold can be in
// are counted key by key and scanned from the top with fp64 masses, and a bit-by-bit search
// over exact sums is the last resort.
// The draw gives each thread a contiguous chunk of ids: chunk masses are scanned in a fixed
// order, the thread whose chunk holds u * total walks it. Every reduction has a fixed order,
// so the same row, parameters and u give the same id in any batch and on every run.
#include <cfloat>
#include <climits>
#include <cstdint>

#include "backend/cuda/check.h"
#include "backend/cuda/decode_ops.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/warp.cuh"
#include "backend/cuda/kernels/bf16_keys.cuh"

namespace talon::cuda {

namespace {

constexpr int kSampleThreads = 1024;
constexpr int kSampleWarps = kSampleThreads / 32;
// High-byte bins top-p counts key by key (16 x 256 keys: 16 KB of shared memory).
constexpr int kWindowBins = 16;

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

// counts[bin] += 1 for every lane of the warp with this bin (0xffffffff: none), one atomic
// per distinct bin: most ids of a row share a few bins. Every lane of the warp must call it.
__device__ __forceinline__ void count_once(uint32_t* counts, uint32_t bin) {
  const unsigned peers = __match_any_sync(0xffffffffu, bin);
  if (bin != 0xffffffffu && int(threadIdx.x % 32) == __ffs(peers) - 1) atomicAdd(&counts[bin], uint32_t(__popc(peers)));
}

struct Located {
  int bin;        // the bin where the count from the top reaches what was asked
  int64_t above;  // the count over the bins above it (and what came before)
};

__global__ void __launch_bounds__(kSampleThreads)
    sample_kernel(int32_t* ids, const bf16* logits, int V, const DeviceSampling* prm, const double* uniforms) {
  allow_dependents();
  grid_dependency_wait();  // launched dependent (launch.cuh)
  __shared__ double shd[kSampleWarps];
  __shared__ int shi[kSampleWarps];
  __shared__ float shf[kSampleWarps];
  __shared__ double lane_d[kSampleThreads];
  __shared__ double base_d[kSampleWarps + 1];
  __shared__ int lane_i[kSampleThreads];
  __shared__ int base_i[kSampleWarps + 1];
  __shared__ int picked;
  __shared__ uint32_t hist[256];
  __shared__ uint32_t window[kWindowBins * 256];
  __shared__ double bound_lo[256], bound_hi[256];
  __shared__ int loc_bin, loc_at;
  __shared__ int64_t loc_above;
  __shared__ uint32_t loc_t;
  __shared__ double loc_mass;
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

  // Counts of ids by one byte of the key (256 bins, 32-bit integer atomics, the lanes of a
  // warp that fall in one bin adding once): level 1 the high byte of every id; level 2 the
  // low byte of the ids whose high byte is `hi`. Exact whatever the order of the atomics.
  auto histogram = [&](int level, uint32_t hi) {
    for (int i = tid; i < 256; i += kSampleThreads) hist[i] = 0;
    __syncthreads();
    for (int i0 = 0; i0 < V; i0 += kSampleThreads) {
      const int i = i0 + tid;
      uint32_t bin = 0xffffffffu;
      if (i < V) {
        const uint32_t b = x[i];
        const uint32_t k = key16(b);
        if (!nan16(b) && (level == 1 || (k >> 8) == hi)) bin = level == 1 ? k >> 8 : k & 255u;
      }
      count_once(hist, bin);
    }
    __syncthreads();
  };
  // The highest bin at which the count from the top, starting at `above`, reaches `need`,
  // and the count above it (thread 0 scans; every thread gets the answer).
  auto locate = [&](int64_t above, int64_t need) {
    if (tid == 0) {
      int64_t cum = above, before = above;
      int at = 0;
      for (int i = 255; i >= 0; --i) {
        before = cum;
        cum += hist[i];
        if (cum >= need) {
          at = i;
          break;
        }
      }
      loc_bin = at;
      loc_above = before;
    }
    __syncthreads();
    const Located r{loc_bin, loc_above};
    __syncthreads();
    return r;
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
    histogram(1, 0);
    const Located h = locate(0, top_k);
    histogram(2, uint32_t(h.bin));
    const Located l = locate(h.above, top_k);
    theta = (uint32_t(h.bin) << 8) | uint32_t(l.bin);
    ties = int(top_k - l.above);
    keep_k = top_k;
    cut = true;
  }
  if (top_p < 1) {
    // The threshold key t: the largest key whose ids at or above it hold top_p of the mass.
    // Level 1 counts ids by high byte; a bin's mass lies between its count times the weight
    // of its lowest and of its highest key, which bounds the bins t can be in. Those bins (at
    // most kWindowBins of them) are then counted key by key, each key's mass is its count
    // times its weight, and a scan from the top finds t; the mass above the window is summed
    // id by id. When the bounds leave a wider window, a bit-by-bit search over exact sums.
    histogram(1, 0);
    double zs = 0;
    for (int i = tid; i < V; i += kSampleThreads) zs += weight(x[i]);
    const double z = block_sum(zs, shd), target = top_p * z;
    const uint32_t kmax = key16(__float_as_uint(m) >> 16);
    if (tid < 256) {
      const uint32_t lo = uint32_t(tid) << 8, hi = min(lo | 255u, kmax);
      const double c = double(hist[tid]);
      bound_lo[tid] = c > 0 && lo <= kmax ? c * weight(bits_of_key(lo)) : 0.0;
      bound_hi[tid] = c > 0 && lo <= kmax ? c * weight(bits_of_key(hi)) : 0.0;
    }
    __syncthreads();
    if (tid == 0) {
      double cl = 0, cu = 0;
      int ha = -1, hb = -1;
      for (int i = 255; i >= 0 && ha < 0; --i) {
        cl += bound_lo[i];
        cu += bound_hi[i];
        if (hb < 0 && cu >= target) hb = i;
        if (cl >= target) ha = i;
      }
      loc_bin = hb < 0 ? -1 : (ha < 0 ? 0 : ha) | (hb << 8);
    }
    __syncthreads();
    const int hab = loc_bin;
    __syncthreads();
    const int ha = hab & 255, hb = hab >> 8;
    uint32_t t = 0;
    double above = 0;
    int n_above = 0, n_at = 0;
    bool found = false;
    if (hab >= 0 && hb - ha < kWindowBins && !prm->search_only) {
      const uint32_t base = uint32_t(ha) << 8, top = (uint32_t(hb) << 8) | 255u, n_keys = top - base + 1;
      for (uint32_t i = tid; i < n_keys; i += kSampleThreads) window[i] = 0;
      __syncthreads();
      double sa = 0;
      int na = 0;
      for (int i0 = 0; i0 < V; i0 += kSampleThreads) {
        const int i = i0 + tid;
        uint32_t slot = 0xffffffffu;
        if (i < V) {
          const uint32_t b = x[i];
          const uint32_t k = key16(b);
          if (!nan16(b)) {
            if (k > top)
              sa += weight(b), ++na;
            else if (k >= base)
              slot = k - base;
          }
        }
        count_once(window, slot);
      }
      const double above_win = block_sum(sa, shd);
      const int n_above_win = block_sum(na, shi);  // its syncs also end the window's atomics
      // Each thread a run of keys from the top down; runs scanned in that order.
      const int per = int((n_keys + kSampleThreads - 1) / kSampleThreads);
      const int r0 = tid * per, r1 = min(int(n_keys), r0 + per);  // offsets down from `top`
      double ms = 0;
      int cs = 0;
      for (int r = r0; r < r1; ++r) {
        const uint32_t c = window[top - base - uint32_t(r)];
        if (c) ms += double(c) * weight(bits_of_key(top - uint32_t(r))), cs += int(c);
      }
      const Scan<double> sm = block_scan(ms, lane_d, base_d);
      const Scan<int> sc = block_scan(cs, lane_i, base_i);
      if (tid == 0) loc_bin = -1;
      __syncthreads();
      if (above_win + sm.prefix < target && target <= above_win + sm.next && cs > 0) {
        double acc = above_win + sm.prefix;
        int cnt = n_above_win + sc.prefix;
        uint32_t last = 0;
        int last_n = 0, last_c = 0;
        double last_acc = acc;
        bool hit = false;
        for (int r = r0; r < r1 && !hit; ++r) {
          const uint32_t k = top - uint32_t(r), c = window[k - base];
          if (!c) continue;
          const double before = acc;
          acc += double(c) * weight(bits_of_key(k));
          last = k, last_n = cnt, last_c = int(c), last_acc = before;
          cnt += int(c);
          hit = acc >= target;
        }
        // (Rounding may leave the walk short of the scan's end: its last key is t then.)
        loc_t = last, loc_above = last_n, loc_at = last_c, loc_mass = last_acc;
        loc_bin = 1;
      }
      __syncthreads();
      if (loc_bin == 1) {
        found = true;
        t = loc_t, n_above = int(loc_above), n_at = loc_at, above = loc_mass;
      }
      __syncthreads();
    }
    if (!found) {
      t = 0;
      for (int bit = 15; bit >= 0; --bit) {
        const uint32_t c = t | (1u << bit);
        if (mass_ge(c) >= target) t = c;
      }
      above = mass_ge(t + 1);
      n_above = count_ge(t + 1), n_at = count_ge(t) - n_above;
    }
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
  launch_dependent(kDependPick, sample_kernel, dim3(unsigned(rows)), dim3(kSampleThreads), 0, s, ids, logits, int(V),
                   params, uniforms);
}

}  // namespace talon::cuda
