// CPU reference ops against naive fp64 loops written independently here.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <random>

#include "backend/cpu/ops.h"
#include "util/error.h"
#include "model/config.h"
#include "model/model.h"
#include "tests/test_util.h"
#include "tests/tolerances.h"

using namespace talon;
using talon::testing::rel_err;

namespace {

std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

struct MatmulShape {
  int64_t N, K, O;
};

class Matmul : public ::testing::TestWithParam<MatmulShape> {};

TEST_P(Matmul, MatchesFp64ForF32Bf16F16Weights) {
  auto [N, K, O] = GetParam();
  auto x = randn(size_t(N * K), 1), w = randn(size_t(O * K), 2), bias = randn(size_t(O), 3);
  // Weights rounded to each storage type; the reference uses the rounded values.
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    std::vector<uint16_t> w16(w.size());
    std::vector<float> wr(w.size());
    for (size_t i = 0; i < w.size(); ++i) {
      if (dt == DType::BF16) { w16[i] = f32_to_bf16(w[i]); wr[i] = bf16_to_f32(w16[i]); }
      else if (dt == DType::F16) { w16[i] = f32_to_f16(w[i]); wr[i] = f16_to_f32(w16[i]); }
      else wr[i] = w[i];
    }
    std::vector<float> out(size_t(N * O), NAN), ref(size_t(N * O));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < O; ++o) {
        double s = bias[size_t(o)];
        for (int64_t k = 0; k < K; ++k) s += double(x[size_t(n * K + k)]) * wr[size_t(o * K + k)];
        ref[size_t(n * O + o)] = float(s);
      }
    const void* wp = dt == DType::F32 ? static_cast<const void*>(w.data()) : w16.data();
    cpu::matmul_forward(out.data(), x.data(), wp, dt, bias.data(), N, K, O);
    // fp32 accumulation over K terms of unit variance: error ~ sqrt(K) ulps of the sum.
    EXPECT_LE(rel_err(out.data(), ref.data(), out.size()), tol::kOpRel * std::sqrt(double(K)) / 8)
        << dtype_name(dt) << " N=" << N << " K=" << K << " O=" << O;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, Matmul,
                         ::testing::Values(MatmulShape{1, 1, 1}, MatmulShape{3, 7, 5}, MatmulShape{4, 8, 3},
                                           MatmulShape{5, 17, 16}, MatmulShape{130, 33, 47},
                                           MatmulShape{257, 576, 31}, MatmulShape{9, 1536, 64}));

TEST(Matmul, BitwiseIndependentOfThreadsAndRowPosition) {
  const int64_t N = 37, K = 93, O = 41;
  auto x = randn(size_t(N * K), 4), w = randn(size_t(O * K), 5);
  std::vector<float> a(size_t(N * O)), b(size_t(N * O)), c(static_cast<size_t>(O));
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  cpu::matmul_forward(a.data(), x.data(), w.data(), DType::F32, nullptr, N, K, O);
  omp_set_num_threads(3);
  cpu::matmul_forward(b.data(), x.data(), w.data(), DType::F32, nullptr, N, K, O);
  omp_set_num_threads(saved);
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4));
  // Row 22 alone equals row 22 inside the batch (different tile shapes).
  cpu::matmul_forward(c.data(), x.data() + 22 * K, w.data(), DType::F32, nullptr, 1, K, O);
  EXPECT_EQ(0, std::memcmp(c.data(), a.data() + 22 * O, c.size() * 4));
}

TEST(RmsNorm, MatchesFp64) {
  const int64_t N = 5, C = 37;
  auto x = randn(size_t(N * C), 6, 3.0f), w = randn(size_t(C), 7);
  std::vector<float> out(x.size()), ref(x.size());
  cpu::rmsnorm_forward(out.data(), x.data(), w.data(), N, C, 1e-5f);
  for (int64_t n = 0; n < N; ++n) {
    double ss = 0;
    for (int64_t c = 0; c < C; ++c) ss += double(x[size_t(n * C + c)]) * x[size_t(n * C + c)];
    const double r = 1 / std::sqrt(ss / C + 1e-5);
    for (int64_t c = 0; c < C; ++c) ref[size_t(n * C + c)] = float(w[size_t(c)] * x[size_t(n * C + c)] * r);
  }
  EXPECT_LE(rel_err(out.data(), ref.data(), out.size()), tol::kOpRel);
}

TEST(Rope, RotatesHalvesByPositionTimesFrequency) {
  const int64_t N = 6, nh = 3, hd = 10;
  auto x = randn(size_t(N * nh * hd), 8);
  auto y = x;
  std::vector<int32_t> pos = {0, 1, 2, 7, 100, 4095};
  RopeConfig rc;
  rc.theta = 500000;
  auto f = rope_inv_freq(rc, hd);
  for (int64_t i = 0; i < hd / 2; ++i) EXPECT_NEAR(f[size_t(i)], std::pow(500000.0, -2.0 * double(i) / hd), 1e-6 * f[size_t(i)]);
  cpu::rope_forward(y.data(), pos.data(), f.data(), N, nh, hd);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t i = 0; i < hd / 2; ++i) {
        const double ang = double(float(pos[size_t(n)]) * f[size_t(i)]);
        const float* a = &x[size_t((n * nh + h) * hd)];
        const float* b = &y[size_t((n * nh + h) * hd)];
        EXPECT_NEAR(b[i], a[i] * std::cos(ang) - a[i + hd / 2] * std::sin(ang), 1e-5);
        EXPECT_NEAR(b[i + hd / 2], a[i + hd / 2] * std::cos(ang) + a[i] * std::sin(ang), 1e-5);
      }
  // Position 0 is the identity.
  for (int64_t k = 0; k < nh * hd; ++k) EXPECT_EQ(y[size_t(k)], x[size_t(k)]);
}

TEST(Rope, Llama3ScalingBands) {
  RopeConfig rc;
  rc.theta = 10000;
  rc.type = "llama3";
  rc.factor = 8;
  rc.low_freq_factor = 1;
  rc.high_freq_factor = 4;
  rc.original_max_position = 32;
  RopeConfig plain;
  plain.theta = 10000;
  const int64_t hd = 16;
  auto s = rope_inv_freq(rc, hd), p = rope_inv_freq(plain, hd);
  for (int64_t i = 0; i < hd / 2; ++i) {
    const double wl = 2 * M_PI / p[size_t(i)];
    if (wl < 32.0 / 4) EXPECT_FLOAT_EQ(s[size_t(i)], p[size_t(i)]);             // high frequency kept
    else if (wl > 32.0) EXPECT_FLOAT_EQ(s[size_t(i)], p[size_t(i)] / 8);         // low frequency scaled
    else {                                                                        // smooth blend in between
      EXPECT_LT(s[size_t(i)], p[size_t(i)]);
      EXPECT_GT(s[size_t(i)], p[size_t(i)] / 8);
    }
  }
}

struct AttnCase {
  std::vector<int64_t> lens;
  int64_t nh, nkv, hd, window;
};

class Attention : public ::testing::TestWithParam<AttnCase> {};

TEST_P(Attention, CausalGqaPackedMatchesFp64) {
  const AttnCase& c = GetParam();
  std::vector<int64_t> starts{0};
  for (auto l : c.lens) starts.push_back(starts.back() + l);
  const int64_t N = starts.back();
  auto q = randn(size_t(N * c.nh * c.hd), 9), k = randn(size_t(N * c.nkv * c.hd), 10),
       v = randn(size_t(N * c.nkv * c.hd), 11);
  std::vector<float> out(q.size(), NAN), ref(q.size());
  cpu::attention_forward(out.data(), q.data(), k.data(), v.data(), starts.data(), int64_t(c.lens.size()), c.nh, c.nkv,
                         c.hd, c.window);
  for (size_t s = 0; s < c.lens.size(); ++s)
    for (int64_t t = starts[s]; t < starts[s + 1]; ++t)
      for (int64_t h = 0; h < c.nh; ++h) {
        const int64_t kh = h / (c.nh / c.nkv);
        std::vector<double> sc;
        int64_t lo = starts[s];
        if (c.window > 0) lo = std::max(lo, t - c.window + 1);
        double mx = -1e300;
        for (int64_t j = lo; j <= t; ++j) {
          double d = 0;
          for (int64_t i = 0; i < c.hd; ++i)
            d += double(q[size_t((t * c.nh + h) * c.hd + i)]) * k[size_t((j * c.nkv + kh) * c.hd + i)];
          sc.push_back(d / std::sqrt(double(c.hd)));
          mx = std::max(mx, sc.back());
        }
        double den = 0;
        for (auto& e : sc) den += (e = std::exp(e - mx));
        for (int64_t i = 0; i < c.hd; ++i) {
          double a = 0;
          for (int64_t j = lo; j <= t; ++j) a += sc[size_t(j - lo)] * v[size_t((j * c.nkv + kh) * c.hd + i)];
          ref[size_t((t * c.nh + h) * c.hd + i)] = float(a / den);
        }
      }
  EXPECT_LE(rel_err(out.data(), ref.data(), out.size()), tol::kOpRel);
}

INSTANTIATE_TEST_SUITE_P(Cases, Attention,
                         ::testing::Values(AttnCase{{1}, 1, 1, 2, 0}, AttnCase{{13}, 4, 4, 8, 0},
                                           AttnCase{{5, 1, 17}, 6, 2, 10, 0}, AttnCase{{33, 9}, 9, 3, 64, 0},
                                           AttnCase{{40}, 4, 1, 16, 7}));

TEST(Embedding, RejectsOutOfVocabIds) {
  std::vector<float> table(12, 1.0f), out(3);
  int32_t bad = 4;
  EXPECT_THROW(cpu::embedding_forward(out.data(), &bad, table.data(), DType::F32, 1, 3, 4), Error);
}

TEST(Dtype, Bf16AndF16RoundTrip) {
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f)), 1.0f);
  EXPECT_EQ(f32_to_bf16(1.00390625f), 0x3f80);       // ties to even: 1 + 2^-8 rounds down
  EXPECT_EQ(f32_to_bf16(1.01171875f), 0x3f82);       // 1 + 3*2^-8 rounds up to even
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(f16_to_f32(0xfbff), -65504.0f);
  for (float v : {0.5f, -2.75f, 65504.0f, 6.1035156e-05f, 5.9604645e-08f}) EXPECT_EQ(f16_to_f32(f32_to_f16(v)), v);
  EXPECT_TRUE(std::isinf(f16_to_f32(f32_to_f16(1e6f))));
}

}  // namespace
