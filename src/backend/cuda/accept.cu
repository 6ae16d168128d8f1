// Speculative sampling of a drafted chain or a picked (top-k) tree on the device (decode_ops.h:
// accept_chain, accept_tree), the decisions Decoder::forward_accept_chain / forward_accept_tree's
// host defaults make (model/decode.h), from the verify forward's bf16 logits: only the kept count
// (the kept path) and the next token come back.
//
// One block of 1024 threads walks the rows in order. For a row it builds what the host's
// sampling_distribution (model/sampling.h) builds, without sorting: a bf16 logit maps to a
// 16-bit key that orders like its value, and ids with the same key have the same probability,
// so the top-k / top-p cut is a key threshold `theta` plus how many ids at theta (lowest ids
// first) are kept. A histogram of the row's keys (65,536 counters in global scratch), scanned
// from the top in 1024 chunks of 64 keys, gives the normaliser, the threshold and the kept mass
// in fp64. Probabilities are then a function of the id: its key's weight, renormalised, or 0.
// The residual max(0, p - q) and the inverse-CDF draws take contiguous chunks of ids per thread,
// chunk sums scanned in a fixed order (deterministic). Against the host only the order of fp64
// additions differs: they decide differently only when a uniform lands within rounding of a
// boundary (or a kept mass within rounding of top_p).
#include <cfloat>
#include <cstdint>

#include "backend/cuda/check.h"
#include "backend/cuda/decode_ops.h"
#include "backend/cuda/kernels/bf16_keys.cuh"

namespace talon::cuda {

namespace {

constexpr int kThreads = 1024;
constexpr int kKeys = 65536;
constexpr int kKeyChunk = kKeys / kThreads;  // 64 keys a thread, top-down

__device__ __forceinline__ float value_of_key(uint32_t k) { return value16(bits_of_key(k)); }

struct Shared {
  float fmax[32];
  int cnt[kThreads];
  double sum[kThreads];
  int tie_base[kThreads];
  // The row's distribution (written by thread 0).
  double mx, z, kept, total, target;
  uint32_t theta;
  int ties, cut, pick_chunk, last_chunk, result;
};

// Per row: the cut and normaliser of sampling_distribution over the bf16 logits l [V].
__device__ void row_distribution(Shared& sh, const uint16_t* l, int64_t V, double T, double top_p, int64_t top_k,
                                 int* counts) {
  const int tid = threadIdx.x;
  // The largest logit (NaN never counts).
  float m = -INFINITY;
  for (int64_t i = tid; i < V; i += kThreads) {
    const uint32_t b = l[i];
    if (!nan16(b)) m = fmaxf(m, value16(b));
  }
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (tid % 32 == 0) sh.fmax[tid / 32] = m;
  for (int i = tid; i < kKeys; i += kThreads) counts[i] = 0;
  __syncthreads();
  if (tid == 0) {
    float mm = sh.fmax[0];
    for (int w = 1; w < 32; ++w) mm = fmaxf(mm, sh.fmax[w]);
    sh.mx = double(mm);
  }
  for (int64_t i = tid; i < V; i += kThreads) {
    const uint32_t b = l[i];
    if (!nan16(b)) atomicAdd(&counts[key16(b)], 1);
  }
  __syncthreads();
  // Chunk t holds keys [kKeys - (t + 1) 64, kKeys - t 64): ids and weight, top-down.
  const double mx = sh.mx;
  int c = 0;
  double w = 0;
  for (int j = 0; j < kKeyChunk; ++j) {
    const int key = kKeys - 1 - (tid * kKeyChunk + j);
    const int n = counts[key];
    if (n == 0) continue;
    c += n;
    w += double(n) * exp((double(value_of_key(uint32_t(key))) - mx) / T);
  }
  sh.cnt[tid] = c;
  sh.sum[tid] = w;
  __syncthreads();
  if (tid == 0) {
    double z = 0;
    for (int t = 0; t < kThreads; ++t) z += sh.sum[t];
    sh.z = z;
    const int64_t cap = top_k > 0 && top_k < V ? top_k : V;
    sh.cut = (top_k > 0 && top_k < V) || top_p < 1;
    sh.kept = 1.0;
    sh.theta = 0;
    sh.ties = 0;
    if (sh.cut) {
      // From the top: ids and normalised mass above; the key where top_k or top_p is reached.
      int64_t above = 0;
      double mass = 0;
      bool done = false;
      for (int t = 0; t < kThreads && !done; ++t) {
        if (above + sh.cnt[t] < cap && !(top_p < 1 && mass + sh.sum[t] / z >= top_p)) {
          above += sh.cnt[t];
          mass += sh.sum[t] / z;
          continue;
        }
        for (int j = 0; j < kKeyChunk; ++j) {
          const int key = kKeys - 1 - (t * kKeyChunk + j);
          const int n = counts[key];
          if (n == 0) continue;
          const double pk = exp((double(value_of_key(uint32_t(key))) - mx) / T) / z;
          const int64_t need_k = cap - above;
          int64_t need_p = INT64_MAX;
          if (top_p < 1 && pk > 0) {
            // The fewest ids at this key that bring the mass to top_p (at most n + 1 tried).
            const double est = ceil((top_p - mass) / pk);
            int64_t m = est < 1 ? 1 : est > double(n) ? int64_t(n) + 1 : int64_t(est);
            while (m > 1 && mass + double(m - 1) * pk >= top_p) --m;
            while (m <= n && mass + double(m) * pk < top_p) ++m;
            if (m <= n) need_p = m;
          }
          const int64_t need = need_k < need_p ? need_k : need_p;
          if (need <= n) {
            sh.theta = uint32_t(key);
            sh.ties = int(need);
            sh.kept = mass + double(need) * pk;
            done = true;
            break;
          }
          above += n;
          mass += double(n) * pk;
        }
      }
      if (!done) sh.cut = 0;  // nothing to cut (every id kept within rounding)
    }
  }
  __syncthreads();
}

// Probability of id i under the row's distribution; `rank` counts the ids at theta before i.
__device__ __forceinline__ double prob(const Shared& sh, uint32_t b, double T, int rank) {
  if (nan16(b)) return 0;
  const uint32_t key = key16(b);
  const double pn = exp((double(value16(b)) - sh.mx) / T) / sh.z;
  if (!sh.cut) return pn;
  if (key > sh.theta || (key == sh.theta && rank < sh.ties)) return pn / sh.kept;
  return 0;
}

// Chunk of ids of thread t: [t cs, min(V, (t + 1) cs)).
__device__ __forceinline__ int64_t chunk_size(int64_t V) { return (V + kThreads - 1) / kThreads; }

// The ids at theta before each thread's chunk (sh.tie_base), for prob's rank.
__device__ void tie_bases(Shared& sh, const uint16_t* l, int64_t V) {
  const int tid = threadIdx.x;
  const int64_t cs = chunk_size(V), a = int64_t(tid) * cs, e = a + cs < V ? a + cs : V;
  int n = 0;
  if (sh.cut)
    for (int64_t i = a; i < e; ++i) n += !nan16(l[i]) && key16(l[i]) == sh.theta;
  sh.cnt[tid] = n;
  __syncthreads();
  if (tid == 0) {
    int acc = 0;
    for (int t = 0; t < kThreads; ++t) {
      const int x = sh.cnt[t];
      sh.tie_base[t] = acc;
      acc += x;
    }
  }
  __syncthreads();
}

// Inverse-CDF draw, in id order, over r(i) = resid(i, p(i)) (residual) or p(i), with uniform u:
// the host's draw() over those values. `residual` falls back to p when it has no mass.
template <class Resid>
__device__ int draw_row(Shared& sh, const uint16_t* l, int64_t V, double T, Resid resid, bool residual, double u) {
  const int tid = threadIdx.x;
  const int64_t cs = chunk_size(V), a = int64_t(tid) * cs, e = a + cs < V ? a + cs : V;
  for (int pass = 0; pass < 2; ++pass) {
    const bool res = residual && pass == 0;
    auto value = [&](int64_t i, int& rank) {
      const uint32_t b = l[i];
      const double p = prob(sh, b, T, rank);
      if (sh.cut && !nan16(b) && key16(b) == sh.theta) ++rank;
      return res ? resid(i, p) : p;
    };
    double m = 0;
    int rank = sh.tie_base[tid];
    for (int64_t i = a; i < e; ++i) m += value(i, rank);
    sh.sum[tid] = m;
    __syncthreads();
    if (tid == 0) {
      double tot = 0;
      int last = -1;
      for (int t = 0; t < kThreads; ++t) {
        tot += sh.sum[t];
        if (sh.sum[t] > 0) last = t;
      }
      sh.total = tot;
      sh.last_chunk = last;
      sh.pick_chunk = -1;
      if (tot > 0) {
        const double target = u * tot;
        double acc = 0;
        for (int t = 0; t < kThreads; ++t) {
          if (sh.sum[t] > 0 && target < acc + sh.sum[t]) {
            sh.pick_chunk = t;
            break;
          }
          acc += sh.sum[t];
        }
        sh.target = target - acc;  // within the chunk
        if (sh.pick_chunk < 0) sh.pick_chunk = last, sh.target = INFINITY;  // rounding: the last id with mass
      }
      sh.result = -1;
    }
    __syncthreads();
    if (sh.total > 0) {
      if (tid == sh.pick_chunk) {
        double acc = 0;
        int r = sh.tie_base[tid], last = -1;
        for (int64_t i = a; i < e; ++i) {
          const double x = value(i, r);
          if (x <= 0) continue;
          acc += x;
          last = int(i);
          if (sh.target < acc) {
            sh.result = int(i);
            break;
          }
        }
        if (sh.result < 0) sh.result = last;
      }
      __syncthreads();
      return sh.result;
    }
    __syncthreads();
  }
  return 0;  // no mass at all (a row of NaNs)
}

// The rank of id d among the ids at theta before it (prob's `rank`), in every thread.
__device__ int rank_at_theta(const Shared& sh, const uint16_t* l, int d, int* s_rank) {
  const int tid = threadIdx.x;
  if (tid == 0) *s_rank = 0;
  __syncthreads();
  if (sh.cut && !nan16(l[d]) && key16(l[d]) == sh.theta) {
    int n = 0;
    for (int64_t j = tid; j < d; j += kThreads) n += !nan16(l[j]) && key16(l[j]) == sh.theta;
    for (int o = 16; o > 0; o >>= 1) n += __shfl_xor_sync(0xffffffffu, n, o);
    if (tid % 32 == 0) atomicAdd(s_rank, n);
  }
  __syncthreads();
  const int rank = *s_rank;
  __syncthreads();  // every thread has read it before a next call resets it
  return rank;
}

__global__ void __launch_bounds__(kThreads) accept_chain_kernel(int32_t* out, const uint16_t* logits, int64_t V, int k,
                                                                const int32_t* draft, const double* q, const double* u,
                                                                double T, double top_p, int64_t top_k, int* counts) {
  __shared__ Shared sh;
  __shared__ int s_rank;
  const int tid = threadIdx.x;
  int kept = 0, tests = 0;
  for (int i = 0;; ++i) {
    const uint16_t* l = logits + int64_t(i) * V;
    row_distribution(sh, l, V, T, top_p, top_k, counts);
    tie_bases(sh, l, V);
    if (i == k) {
      const int next = draw_row(sh, l, V, T, [](int64_t, double p) { return p; }, false, u[tests]);
      if (tid == 0) out[0] = kept, out[1] = next;
      return;
    }
    const int d = draft[i];
    // p(d): its rank among the ids at theta is the ids at theta before it.
    const double pd = prob(sh, l[d], T, rank_at_theta(sh, l, d, &s_rank)), qd = q[int64_t(i) * V + d];
    bool keep = false;
    if (qd > 0) keep = u[tests++] < fmin(1.0, pd / qd);  // a uniform only where the test is made
    if (keep) {
      ++kept;
      __syncthreads();  // sh is rewritten by the next row
      continue;
    }
    const double* qi = q + int64_t(i) * V;
    const int next = draw_row(sh, l, V, T, [qi](int64_t j, double p) { return fmax(0.0, p - qi[j]); }, true, u[tests]);
    if (tid == 0) out[0] = kept, out[1] = next;
    return;
  }
}

// The sum of p over the row (chunk sums in thread order, fixed), in every thread.
__device__ double row_mass(Shared& sh, const uint16_t* l, int64_t V, double T) {
  const int tid = threadIdx.x;
  const int64_t cs = chunk_size(V), a = int64_t(tid) * cs, e = a + cs < V ? a + cs : V;
  double m = 0;
  int rank = sh.tie_base[tid];
  for (int64_t i = a; i < e; ++i) {
    const uint32_t b = l[i];
    m += prob(sh, b, T, rank);
    if (sh.cut && !nan16(b) && key16(b) == sh.theta) ++rank;
  }
  sh.sum[tid] = m;
  __syncthreads();
  if (tid == 0) {
    double tot = 0;
    for (int t = 0; t < kThreads; ++t) tot += sh.sum[t];
    sh.total = tot;
  }
  __syncthreads();
  const double tot = sh.total;
  __syncthreads();
  return tot;
}

// Decoder::forward_accept_tree's decision (model/decode.h) over the verify rows' logits: out[0]
// the path's length L, out[1] the next token, out[2 .. 2 + L) the path's rows. Every thread
// walks the same path (the decisions use values all threads compute alike); the rejected
// siblings' tokens of the current node (at most kMaxTried) leave its distribution.
constexpr int kMaxTried = 64;
__global__ void __launch_bounds__(kThreads) accept_tree_kernel(int32_t* out, const uint16_t* logits, int64_t V, int n,
                                                               const int32_t* tokens, const int32_t* parents,
                                                               const double* u, double T, double top_p, int64_t top_k,
                                                               int* counts) {
  __shared__ Shared sh;
  __shared__ int s_rank;
  const int tid = threadIdx.x;
  int at = 0, used = 0, len = 1;
  if (tid == 0) out[2] = 0;
  int32_t gone[kMaxTried];
  for (;;) {
    const uint16_t* l = logits + int64_t(at) * V;
    row_distribution(sh, l, V, T, top_p, top_k, counts);
    tie_bases(sh, l, V);
    double mass = row_mass(sh, l, V, T);
    int n_gone = 0, kept = -1;
    for (int c = at + 1; c < n; ++c) {
      if (parents[c] != at) continue;
      const int t = tokens[c];
      const int rank = rank_at_theta(sh, l, t, &s_rank);
      bool dup = false;
      for (int g = 0; g < n_gone; ++g) dup = dup || gone[g] == t;
      const double pt = dup ? 0.0 : prob(sh, l[t], T, rank);
      if (pt > 0 && u[used++] * mass < pt) {
        kept = c;
        break;
      }
      mass -= pt;
      if (!dup && n_gone < kMaxTried) gone[n_gone++] = t;
    }
    if (kept < 0) {
      const int next = draw_row(
          sh, l, V, T,
          [&](int64_t i, double p) {
            for (int g = 0; g < n_gone; ++g)
              if (gone[g] == int32_t(i)) return 0.0;
            return p;
          },
          true, u[used]);
      if (tid == 0) out[0] = len, out[1] = next;
      return;
    }
    if (tid == 0) out[2 + len] = kept;
    ++len;
    at = kept;
    __syncthreads();  // sh is rewritten for the next node
  }
}

}  // namespace

void accept_tree(int32_t* out, const bf16* logits, int64_t V, int n, const int32_t* tokens, const int32_t* parents,
                 const double* u, double temperature, double top_p, int64_t top_k, int* counts, cudaStream_t s) {
  accept_tree_kernel<<<1, kThreads, 0, s>>>(out, reinterpret_cast<const uint16_t*>(logits), V, n, tokens, parents, u,
                                            temperature, top_p, top_k, counts);
  CUDA_LAUNCH_CHECK();
}

void accept_chain(int32_t* out, const bf16* logits, int64_t V, int k, const int32_t* draft, const double* q,
                  const double* u, double temperature, double top_p, int64_t top_k, int* counts, cudaStream_t s) {
  accept_chain_kernel<<<1, kThreads, 0, s>>>(out, reinterpret_cast<const uint16_t*>(logits), V, k, draft, q, u,
                                             temperature, top_p, top_k, counts);
  CUDA_LAUNCH_CHECK();
}

}  // namespace talon::cuda
