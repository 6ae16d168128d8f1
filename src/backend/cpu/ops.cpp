#include "backend/cpu/ops.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "model/model.h"

#include "util/error.h"

namespace talon::cpu {

namespace {

// One SIMD register of floats: 8 lanes; 16 with -DTALON_WIDE_SIMD on AVX-512 machines
// (measured slower on the 2-core AVX-512 build machine: 280 vs 336 tok/s extracting
// SmolLM2, so it is opt-in). The lane count fixes the summation order, so results are
// identical for a given build.
#if defined(__AVX512F__) && defined(TALON_WIDE_SIMD)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vec __attribute__((vector_size(kLanes * 4)));

inline vec loadv(const float* p) {
  vec r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

// acc + x * w per lane, rounded once where the machine has FMA. Explicit, because this file
// is compiled with -ffp-contract=off: left to the compiler, whether a multiply-add is fused
// can differ between the tile shapes below (seen with GCC 12 and -march=native on AVX-512),
// and a row's result would then depend on which tile it falls in, i.e. on its position in
// a packed batch.
inline vec fma_v(vec x, vec w, vec acc) {
#if defined(__FMA__) && !defined(TALON_WIDE_SIMD)
  return reinterpret_cast<vec>(_mm256_fmadd_ps(reinterpret_cast<__m256>(x), reinterpret_cast<__m256>(w),
                                               reinterpret_cast<__m256>(acc)));
#elif defined(__AVX512F__) && defined(TALON_WIDE_SIMD)
  return reinterpret_cast<vec>(_mm512_fmadd_ps(reinterpret_cast<__m512>(x), reinterpret_cast<__m512>(w),
                                               reinterpret_cast<__m512>(acc)));
#else
  return acc + x * w;
#endif
}

// Fixed-order horizontal sum (pairwise): the same for every tile shape.
inline float hsum(vec a) {
  float l[kLanes];
  std::memcpy(l, &a, sizeof l);
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) l[i] = l[i] + l[i + w];
  return l[0];
}

// A TT x OO tile of dot products: out[t, o] = x[t, :] . w[o, :].
template <int TT, int OO>
void tile(float* out, int64_t ldo, const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K,
          const float* bias) {
  vec acc[TT][OO] = {};
  const int64_t K8 = K - K % kLanes;
  // The weight rows two tiles on (matmul_forward walks contiguous rows) are fetched while
  // this tile multiplies, a cache line a row every 16 values: with several rows a tile is
  // bound by its multiply-adds, and without this the memory sat idle meanwhile. A prefetch
  // past the end of the matrix is harmless (no fault).
  const float* ahead = w + 2 * OO * ldw;
  for (int64_t k = 0; k < K8; k += kLanes) {
    if (k % 16 == 0)
      for (int o = 0; o < OO; ++o) __builtin_prefetch(ahead + o * ldw + k, 0, 3);
    vec wv[OO];
    for (int o = 0; o < OO; ++o) wv[o] = loadv(w + o * ldw + k);
    for (int t = 0; t < TT; ++t) {
      vec xv = loadv(x + t * ldx + k);
      for (int o = 0; o < OO; ++o) acc[t][o] = fma_v(xv, wv[o], acc[t][o]);
    }
  }
  for (int t = 0; t < TT; ++t)
    for (int o = 0; o < OO; ++o) {
      float s = hsum(acc[t][o]);
      for (int64_t k = K8; k < K; ++k) s += x[t * ldx + k] * w[o * ldw + k];
      if (bias) s += bias[o];
      out[t * ldo + o] = s;
    }
}

using TileFn = void (*)(float*, int64_t, const float*, int64_t, const float*, int64_t, int64_t, const float*);
constexpr int kTT = 4, kOO = 3;
template <int TT>
constexpr TileFn row_fns[kOO + 1] = {nullptr, tile<TT, 1>, tile<TT, 2>, tile<TT, 3>};
constexpr const TileFn* tile_fns[kTT + 1] = {nullptr, row_fns<1>, row_fns<2>, row_fns<3>, row_fns<4>};

}  // namespace

void matmul_forward(float* out, const float* in, const void* w, DType w_dtype, const float* bias, int64_t N,
                    int64_t K, int64_t O) {
  TALON_CHECK(w_dtype == DType::F32 || w_dtype == DType::BF16 || w_dtype == DType::F16,
              "matmul: unsupported weight dtype {}", dtype_name(w_dtype));
  constexpr int64_t kTokBlock = 128;  // rows of `in` kept hot in L2
  constexpr int64_t kOutChunk = 15;   // weight rows per task (a multiple of kOO)
  const int64_t n_chunks = (O + kOutChunk - 1) / kOutChunk;
  const bool widen = w_dtype != DType::F32;
  for (int64_t t0 = 0; t0 < N; t0 += kTokBlock) {
    const int64_t t1 = std::min(N, t0 + kTokBlock);
#pragma omp parallel if ((t1 - t0) * K * O >= kParallelMinWork)
    {
      std::vector<float> scratch(widen ? size_t(kOutChunk * K) : 0);
#pragma omp for schedule(static)
      for (int64_t c = 0; c < n_chunks; ++c) {
        const int64_t o0 = c * kOutChunk, o1 = std::min(O, o0 + kOutChunk);
        const float* wrows;
        if (widen) {
          const size_t esz = dtype_size(w_dtype);
          convert_to_f32(w_dtype, static_cast<const uint8_t*>(w) + size_t(o0 * K) * esz, scratch.data(),
                         size_t((o1 - o0) * K));
          wrows = scratch.data();
        } else {
          wrows = static_cast<const float*>(w) + o0 * K;
        }
        for (int64_t t = t0; t < t1; t += kTT) {
          const int tt = int(std::min<int64_t>(kTT, t1 - t));
          for (int64_t o = o0; o < o1; o += kOO) {
            const int oo = int(std::min<int64_t>(kOO, o1 - o));
            tile_fns[tt][oo](out + t * O + o, O, in + t * K, K, wrows + (o - o0) * K, K, K, bias ? bias + o : nullptr);
          }
        }
      }
    }
  }
}

void rmsnorm_forward(float* out, const float* in, const float* weight, int64_t N, int64_t C, float eps) {
#pragma omp parallel for schedule(static) if (N * C >= kParallelMinWork)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = in + n * C;
    float* y = out + n * C;
    double ss = 0;  // the sum of squares in fp64: cheap here and removes one source of drift
    for (int64_t c = 0; c < C; ++c) ss += double(x[c]) * x[c];
    const float r = float(1.0 / std::sqrt(ss / double(C) + double(eps)));
    for (int64_t c = 0; c < C; ++c) y[c] = weight[c] * (x[c] * r);
  }
}

void embedding_forward(float* out, const int32_t* ids, const void* table, DType t_dtype, int64_t N, int64_t C,
                       int64_t V) {
  const size_t esz = dtype_size(t_dtype);
  for (int64_t n = 0; n < N; ++n) {
    TALON_CHECK(ids[n] >= 0 && ids[n] < V, "token id {} at position {} is outside the vocabulary [0, {})", ids[n], n, V);
    convert_to_f32(t_dtype, static_cast<const uint8_t*>(table) + size_t(ids[n]) * size_t(C) * esz, out + n * C,
                   size_t(C));
  }
}

void rope_forward(float* x, const int32_t* pos, const float* inv_freq, int64_t N, int64_t n_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (N * head_dim * n_heads >= kParallelMinWork)
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t i = 0; i < half; ++i) {
      // As transformers: the angle is an fp32 product, its cos/sin rounded to fp32.
      const float ang = float(pos[n]) * inv_freq[i];
      const float c = float(std::cos(double(ang))), s = float(std::sin(double(ang)));
      for (int64_t h = 0; h < n_heads; ++h) {
        float* p = x + (n * n_heads + h) * head_dim;
        const float a = p[i], b = p[i + half];
        p[i] = a * c - b * s;
        p[i + half] = b * c + a * s;
      }
    }
  }
}

void attend_row(float* out, const float* q, const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                const int64_t* rows, int64_t first, int64_t n, int64_t dk, int64_t dv, float scale,
                std::vector<float>& p, std::vector<double>& acc) {
  p.resize(size_t(n));
  acc.assign(size_t(dv), 0.0);
  float mx = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    const float* kr = k + (rows ? rows[j] : first + j) * k_stride;
    float d = 0;
    for (int64_t i = 0; i < dk; ++i) d += q[i] * kr[i];
    d *= scale;
    p[size_t(j)] = d;
    mx = std::max(mx, d);
  }
  double den = 0;
  for (auto& e : p) {
    e = std::exp(e - mx);
    den += e;
  }
  for (int64_t j = 0; j < n; ++j) {
    const float* vr = v + (rows ? rows[j] : first + j) * v_stride;
    const double w = p[size_t(j)];
    for (int64_t i = 0; i < dv; ++i) acc[size_t(i)] += w * vr[i];
  }
  for (int64_t i = 0; i < dv; ++i) out[i] = float(acc[size_t(i)] / den);
}

void attention_forward(float* out, const float* q, const float* k, const float* v, const int64_t* seq_start,
                       int64_t n_seqs, int64_t nh, int64_t nkv, int64_t hd, int64_t window) {
  const int64_t group = nh / nkv;
  const float scale = 1.0f / std::sqrt(float(hd));
  const int64_t N = seq_start[n_seqs];
  const int64_t qw = nh * hd, kw = nkv * hd;
  // One task per (query row, head); rows know their sequence through `seq_of`.
  std::vector<int64_t> seq_of(static_cast<size_t>(N));
  for (int64_t s = 0; s < n_seqs; ++s)
    for (int64_t r = seq_start[s]; r < seq_start[s + 1]; ++r) seq_of[size_t(r)] = s;
  // About N * (N / n_seqs) / 2 query-key pairs per head.
  const bool par = N * std::max<int64_t>(1, N / std::max<int64_t>(1, n_seqs)) * nh >= kParallelMinWork / 16;
#pragma omp parallel if (par)
  {
    std::vector<float> p;
    std::vector<double> acc(static_cast<size_t>(hd));
#pragma omp for schedule(dynamic, 16) collapse(2)
    for (int64_t r = 0; r < N; ++r) {
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t s0 = seq_start[seq_of[size_t(r)]];
        const int64_t lo = window > 0 ? std::max(s0, r - window + 1) : s0;
        const int64_t kh = h / group;
        attend_row(out + r * qw + h * hd, q + r * qw + h * hd, k + kh * hd, kw, v + kh * hd, kw, nullptr, lo, r - lo + 1,
                   hd, hd, scale, p, acc);
      }
    }
  }
}

void rope_strided_forward(float* x, const int32_t* pos, const float* inv_freq, int64_t N, int64_t n_heads,
                          int64_t row_stride, int64_t head_stride, int64_t dim, bool interleaved, float attn_factor) {
  const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) if (N * n_heads * dim >= kParallelMinWork)
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t i = 0; i < half; ++i) {
      // As transformers: fp32 angle, fp32 cos/sin, then scaled by the attention factor.
      const float ang = float(pos[n]) * inv_freq[i];
      const float c = float(std::cos(double(ang))) * attn_factor, s = float(std::sin(double(ang))) * attn_factor;
      const int64_t ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + half;
      for (int64_t h = 0; h < n_heads; ++h) {
        float* p = x + n * row_stride + h * head_stride;
        const float a = p[ia], b = p[ib];
        p[ia] = a * c - b * s;
        p[ib] = b * c + a * s;
      }
    }
  }
}

void attention_mha_forward(float* out, const float* q, const float* k, const float* v, const int64_t* seq_start,
                           int64_t n_seqs, int64_t nh, int64_t dk, int64_t dv, float scale) {
  const int64_t N = seq_start[n_seqs];
  std::vector<int64_t> seq_of(static_cast<size_t>(N));
  for (int64_t s = 0; s < n_seqs; ++s)
    for (int64_t r = seq_start[s]; r < seq_start[s + 1]; ++r) seq_of[size_t(r)] = s;
  // About N * (N / n_seqs) / 2 query-key pairs per head.
  const bool par = N * std::max<int64_t>(1, N / std::max<int64_t>(1, n_seqs)) * nh >= kParallelMinWork / 16;
#pragma omp parallel if (par)
  {
    std::vector<float> p;
    std::vector<double> acc(static_cast<size_t>(dv));
#pragma omp for schedule(dynamic, 16) collapse(2)
    for (int64_t r = 0; r < N; ++r) {
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t lo = seq_start[seq_of[size_t(r)]];
        attend_row(out + (r * nh + h) * dv, q + (r * nh + h) * dk, k + h * dk, nh * dk, v + h * dv, nh * dv, nullptr, lo,
                   r - lo + 1, dk, dv, scale, p, acc);
      }
    }
  }
}

namespace {

// Indices of the k largest values of v[0..n) where allowed (null: all), by value
// descending, ties to the lower index.
void top_k(const float* v, const bool* allowed, int64_t n, int64_t k, std::vector<int64_t>& out) {
  out.clear();
  std::vector<bool> taken(static_cast<size_t>(n), false);
  for (int64_t t = 0; t < k; ++t) {
    int64_t best = -1;
    for (int64_t i = 0; i < n; ++i) {
      if (taken[size_t(i)] || (allowed && !allowed[i])) continue;
      if (best < 0 || v[i] > v[best]) best = i;
    }
    if (best < 0) break;
    taken[size_t(best)] = true;
    out.push_back(best);
  }
}

}  // namespace

void moe_router_forward(int32_t* idx, float* weights, const float* logits, const float* bias, int64_t N, int64_t E,
                        int64_t topk, MoeScoring scoring, MoeTopk method, int64_t n_group, int64_t topk_group,
                        bool norm, float scale) {
  const int64_t per_group = E / n_group;
#pragma omp parallel if (N * E >= kParallelMinWork / 4)
  {
    std::vector<float> score(static_cast<size_t>(E)), choice(static_cast<size_t>(E)), gscore(static_cast<size_t>(n_group));
    std::unique_ptr<bool[]> allowed(new bool[size_t(E)]);
    std::vector<int64_t> sel, gsel;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* lg = logits + n * E;
      if (scoring == MoeScoring::Softmax) {
        float mx = -INFINITY;
        for (int64_t e = 0; e < E; ++e) mx = std::max(mx, lg[e]);
        double den = 0;
        for (int64_t e = 0; e < E; ++e) den += std::exp(double(lg[e]) - mx);
        for (int64_t e = 0; e < E; ++e) score[size_t(e)] = float(std::exp(double(lg[e]) - mx) / den);
      } else {
        for (int64_t e = 0; e < E; ++e) score[size_t(e)] = 1.0f / (1.0f + std::exp(-lg[e]));
      }
      for (int64_t e = 0; e < E; ++e) choice[size_t(e)] = score[size_t(e)] + (bias ? bias[e] : 0.0f);
      const bool* mask = nullptr;
      if (method != MoeTopk::Greedy) {
        for (int64_t g = 0; g < n_group; ++g) {
          const float* c = choice.data() + g * per_group;
          if (method == MoeTopk::GroupLimitedGreedy) {  // the group's best score
            float m = c[0];
            for (int64_t i = 1; i < per_group; ++i) m = std::max(m, c[i]);
            gscore[size_t(g)] = m;
          } else {  // noaux_tc: the sum of the group's two best (bias-corrected) scores
            top_k(c, nullptr, per_group, 2, sel);
            gscore[size_t(g)] = c[sel[0]] + c[sel[1]];
          }
        }
        top_k(gscore.data(), nullptr, n_group, topk_group, gsel);
        for (int64_t e = 0; e < E; ++e) allowed[size_t(e)] = false;
        for (int64_t g : gsel)
          for (int64_t i = 0; i < per_group; ++i) allowed[size_t(g * per_group + i)] = true;
        mask = allowed.get();
      }
      top_k(choice.data(), mask, E, topk, sel);
      std::sort(sel.begin(), sel.end());
      float sum = 0;
      for (int64_t e : sel) sum += score[size_t(e)];
      const float den = norm ? sum + 1e-20f : 1.0f;
      for (int64_t t = 0; t < topk; ++t) {
        idx[n * topk + t] = int32_t(sel[size_t(t)]);
        weights[n * topk + t] = score[size_t(sel[size_t(t)])] / den * scale;
      }
    }
  }
}

void capture_rows(const Capture& cap, int layer_id, const float* x, int64_t N, int64_t H, const int64_t* dst) {
  for (size_t i = 0; i < cap.layers.size(); ++i) {
    if (cap.layers[i] != layer_id) continue;
    const int64_t ld = cap.stride(i, H);
    for (int64_t r = 0; r < N; ++r) {
      const float* src = x + r * H;
      if (cap.dtype == DType::F32) {
        std::copy(src, src + H, static_cast<float*>(cap.out[i]) + dst[r] * ld);
      } else {
        uint16_t* d = static_cast<uint16_t*>(cap.out[i]) + dst[r] * ld;
        for (int64_t c = 0; c < H; ++c) d[c] = f32_to_bf16(src[c]);
      }
    }
  }
}

void swiglu_forward(float* out, const float* gate, const float* up, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMinWork)
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void residual_forward(float* out, const float* in, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMinWork)
  for (int64_t i = 0; i < n; ++i) out[i] += in[i];
}

}  // namespace talon::cpu
