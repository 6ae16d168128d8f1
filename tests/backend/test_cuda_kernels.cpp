// Op harness for the shared kernels of backend/cuda/kernels/*.cuh in the variants the draft
// trainer and the MoE experts use (backend/cuda/kernel_ops.h): RMSNorm forward and backward,
// RoPE with fp64 angles (and its inverse), SwiGLU forward and backward (fp32, bf16 on the
// 8-wide and the one-value paths, the fused gate|up layout, fp32 in / bf16 out), and the
// fp32 <-> bf16 casts. Each is checked against an fp64 oracle written here from the formulas
// (the oracles' own derivatives are checked against finite differences on the CPU, so they
// run everywhere), on odd shapes, unaligned pointers and guarded buffers.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace {

// y = x / sqrt(mean(x^2) + eps) * w for one row of C values.
void rms_oracle(double* y, const double* x, const double* w, int64_t C, double eps) {
  double ss = 0;
  for (int64_t c = 0; c < C; ++c) ss += x[c] * x[c];
  const double r = std::sqrt(ss / double(C) + eps);
  for (int64_t c = 0; c < C; ++c) y[c] = x[c] / r * w[c];
}

// The gradients of sum(dy * y) with y = rms_oracle(x, w): dx and dw (one row).
void rms_oracle_backward(double* dx, double* dw, const double* dy, const double* x, const double* w, int64_t C,
                         double eps) {
  double ss = 0, dot = 0;
  for (int64_t c = 0; c < C; ++c) {
    ss += x[c] * x[c];
    dot += dy[c] * w[c] * x[c];
  }
  const double r = std::sqrt(ss / double(C) + eps);
  for (int64_t c = 0; c < C; ++c) {
    dx[c] = dy[c] * w[c] / r - x[c] * dot / (double(C) * r * r * r);
    dw[c] = dy[c] * x[c] / r;
  }
}

double silu_times(double g, double u) { return g / (1.0 + std::exp(-g)) * u; }
void swiglu_oracle_backward(double d, double g, double u, double* dg, double* du) {
  const double sg = 1.0 / (1.0 + std::exp(-g));
  *du = d * g * sg;
  *dg = d * u * (sg + g * sg * (1.0 - sg));
}

// (a, b) rotated by sign * (pos + offset) * inv.
void rope_oracle(double* a, double* b, int64_t pos, int offset, double inv, double sign) {
  const double t = sign * double(pos + offset) * inv, c = std::cos(t), s = std::sin(t);
  const double x = *a, y = *b;
  *a = x * c - y * s;
  *b = y * c + x * s;
}

std::vector<double> rnd(size_t n, uint32_t seed, double scale = 1.0) {
  std::mt19937 g(seed);
  std::normal_distribution<double> d(0.0, scale);
  std::vector<double> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

// The oracles' backward formulas against central differences of their forward formulas.
TEST(KernelOracle, RmsNormBackwardMatchesFiniteDifferences) {
  const int64_t C = 7;
  const double eps = 1e-5, h = 1e-6;
  auto x = rnd(C, 1), w = rnd(C, 2), dy = rnd(C, 3);
  std::vector<double> dx(C), dw(C), y(C);
  rms_oracle_backward(dx.data(), dw.data(), dy.data(), x.data(), w.data(), C, eps);
  const auto loss = [&](const std::vector<double>& xv, const std::vector<double>& wv) {
    rms_oracle(y.data(), xv.data(), wv.data(), C, eps);
    double l = 0;
    for (int64_t c = 0; c < C; ++c) l += dy[size_t(c)] * y[size_t(c)];
    return l;
  };
  for (int64_t c = 0; c < C; ++c) {
    auto xp = x, xm = x, wp = w, wm = w;
    xp[size_t(c)] += h, xm[size_t(c)] -= h, wp[size_t(c)] += h, wm[size_t(c)] -= h;
    EXPECT_NEAR(dx[size_t(c)], (loss(xp, w) - loss(xm, w)) / (2 * h), 1e-7) << "dx " << c;
    EXPECT_NEAR(dw[size_t(c)], (loss(x, wp) - loss(x, wm)) / (2 * h), 1e-7) << "dw " << c;
  }
}

TEST(KernelOracle, SwigluBackwardMatchesFiniteDifferences) {
  const double h = 1e-6;
  for (double g : {-6.0, -1.3, 0.0, 0.4, 2.5, 9.0})
    for (double u : {-2.0, 0.7}) {
      double dg, du;
      swiglu_oracle_backward(1.7, g, u, &dg, &du);
      EXPECT_NEAR(dg, 1.7 * (silu_times(g + h, u) - silu_times(g - h, u)) / (2 * h), 1e-7) << g << " " << u;
      EXPECT_NEAR(du, 1.7 * (silu_times(g, u + h) - silu_times(g, u - h)) / (2 * h), 1e-7) << g << " " << u;
    }
}

TEST(KernelOracle, RopeInverseAndOrthogonality) {
  double a = 0.3, b = -1.1;
  rope_oracle(&a, &b, 70000, 3, 0.01, 1.0);
  EXPECT_NEAR(a * a + b * b, 0.3 * 0.3 + 1.1 * 1.1, 1e-12);
  rope_oracle(&a, &b, 70000, 3, 0.01, -1.0);
  EXPECT_NEAR(a, 0.3, 1e-9);
  EXPECT_NEAR(b, -1.1, 1e-9);
}

}  // namespace

#ifdef TALON_HAVE_CUDA
#include <cuda_runtime.h>

#include "backend/cpu/ops.h"
#include "backend/cuda/kernel_ops.h"
#include "backend/cuda/ops.h"
#include "model/model.h"
#include "tests/cuda_harness.h"
#include "tests/gpu_test.h"
#include "tests/test_util.h"
#include "tests/tolerances.h"

using namespace talon;
using namespace talon::testing;
using bf16 = __nv_bfloat16;

namespace {

std::vector<float> as_f32(const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); }
std::vector<double> as_f64(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

// Widths around the kernels' paths: a warp per row up to 256 values, a block per row above.
const std::vector<std::pair<int64_t, int64_t>> kNormShapes = {{1, 1}, {7, 33}, {3, 256}, {5, 257}, {2, 4097}};

TEST(CudaKernels, RmsNormForwardAndBackwardMatchOracle) {
  REQUIRE_GPU();
  const float eps = 1e-5f;
  // Beyond the forward's widths: groups of rows (4 a block, the default, and 8) with a short
  // last one, 128-thread blocks, and the Kimi-K2 draft's width.
  auto shapes = kNormShapes;
  shapes.insert(shapes.end(), {{19, 4096}, {16, 128}, {9, 7168}});
  struct Reset {
    ~Reset() { cuda::kernel::set_norm_back_rows(0); }
  } reset;
  for (int rows_a_block : {4, 8})
    for (auto [N, C] : shapes) {
      SCOPED_TRACE(std::to_string(rows_a_block) + " rows a backward block");
      cuda::kernel::set_norm_back_rows(rows_a_block);
      const size_t n = size_t(N * C);
      auto x = randn(n, 11, 2.f), w = randn(size_t(C), 12), dy = randn(n, 13), res = randn(n, 14),
           dw0 = randn(size_t(C), 15);
      std::vector<double> ref(n), rdx(n), rdw(static_cast<size_t>(C)), row(static_cast<size_t>(C));
      const auto xd = as_f64(x), wd = as_f64(w), dyd = as_f64(dy);
      for (int64_t c = 0; c < C; ++c) rdw[size_t(c)] = dw0[size_t(c)];
      for (int64_t r = 0; r < N; ++r) {
        rms_oracle(ref.data() + r * C, xd.data() + r * C, wd.data(), C, eps);
        rms_oracle_backward(rdx.data() + r * C, row.data(), dyd.data() + r * C, xd.data() + r * C, wd.data(), C, eps);
        for (int64_t c = 0; c < C; ++c) {
          rdx[size_t(r * C + c)] += res[size_t(r * C + c)];  // dx = res + the gradient
          rdw[size_t(c)] += row[size_t(c)];
        }
      }
      const size_t parts = size_t(cuda::kernel::rmsnorm_backward_groups(N) * C);
      Guarded<float> gx{n}, gw{size_t(C)}, gy{n}, gdy{n}, gres{n}, gdx{n}, gdx2{n}, gdw{size_t(C)}, gdw2{size_t(C)};
      Guarded<double> gpart{parts};
      Guarded<bf16> gyb{n};
      gx.upload(x), gw.upload(w), gdy.upload(dy), gres.upload(res), gdx2.upload(res), gdw.upload(dw0), gdw2.upload(dw0);
      cuda::kernel::rmsnorm_forward(gy.ptr(), gx.ptr(), gw.ptr(), N, C, eps, nullptr);
      cuda::kernel::rmsnorm_forward(gyb.ptr(), gx.ptr(), gw.ptr(), N, C, eps, nullptr);
      cuda::kernel::rmsnorm_backward(gdx.ptr(), gres.ptr(), gdw.ptr(), gpart.ptr(), gdy.ptr(), gx.ptr(), gw.ptr(), N, C,
                                     eps, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto rf = as_f32(ref), rdxf = as_f32(rdx), rdwf = as_f32(rdw);
      const auto y = gy.download(), yb = to_f32(gyb.download()), dx = gdx.download(), dw = gdw.download();
      EXPECT_LE(rel_err(y.data(), rf.data(), n), tol::kOpRel) << "forward N=" << N << " C=" << C;
      EXPECT_LE(rel_err(yb.data(), rf.data(), n), tol::kCudaBf16Out) << "bf16 forward N=" << N << " C=" << C;
      EXPECT_LE(rel_err(dx.data(), rdxf.data(), n), tol::kOpRel) << "dx N=" << N << " C=" << C;
      EXPECT_LE(rel_err(dw.data(), rdwf.data(), size_t(C)), tol::kOpRel) << "dw N=" << N << " C=" << C;
      EXPECT_TRUE(gy.guards_intact() && gyb.guards_intact() && gdx.guards_intact() && gdw.guards_intact() &&
                  gpart.guards_intact());
      // In place (res is dx: the gradient accumulates), and with dx null (the input norm's input
      // is not trained): the same dx bits, and only the weight gradient written.
      cuda::kernel::rmsnorm_backward(gdx2.ptr(), gdx2.ptr(), gdw2.ptr(), gpart.ptr(), gdy.ptr(), gx.ptr(), gw.ptr(), N,
                                     C, eps, nullptr);
      Guarded<float> gdw3{size_t(C)};
      gdw3.upload(dw0);
      cuda::kernel::rmsnorm_backward(nullptr, nullptr, gdw3.ptr(), gpart.ptr(), gdy.ptr(), gx.ptr(), gw.ptr(), N, C,
                                     eps, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto dx2 = gdx2.download(), dw2 = gdw2.download(), dw3 = gdw3.download();
      EXPECT_EQ(0, std::memcmp(dx.data(), dx2.data(), n * sizeof(float))) << "in place N=" << N << " C=" << C;
      EXPECT_EQ(0, std::memcmp(dw.data(), dw2.data(), size_t(C) * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(dw.data(), dw3.data(), size_t(C) * sizeof(float)));
      EXPECT_TRUE(gdx2.guards_intact() && gdw3.guards_intact());
    }
}

TEST(CudaKernels, RopeMatchesOracleInvertsAndKeepsItsInput) {
  REQUIRE_GPU();
  std::vector<int32_t> pos = {0, 1, 2, 3, 10, 100, 1000, 4095, 70000};
  const int64_t N = int64_t(pos.size());
  for (int64_t hd : {10, 64, 128})
    for (int offset : {0, 3}) {
      const int64_t heads = 3, n = N * heads * hd;
      RopeConfig rc;
      rc.theta = 5e5;
      const auto inv = rope_inv_freq(rc, hd);
      auto x = randn(size_t(n), 21);
      std::vector<double> ref = as_f64(x);
      for (int64_t r = 0; r < N; ++r)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t i = 0; i < hd / 2; ++i) {
            double* p = ref.data() + (r * heads + h) * hd;
            rope_oracle(p + i, p + i + hd / 2, pos[size_t(r)], offset, inv[size_t(i)], 1.0);
          }
      Guarded<float> gx{size_t(n)}, ginv{inv.size()};
      Guarded<int32_t> gpos{pos.size()};
      Guarded<bf16> gb{size_t(n)};
      gx.upload(x), ginv.upload(inv), gpos.upload(pos);
      cuda::kernel::rope(gx.ptr(), gb.ptr(), gpos.ptr(), offset, ginv.ptr(), 1.0, N, heads, hd, nullptr);
      const auto kept = gx.download();
      EXPECT_EQ(0, std::memcmp(kept.data(), x.data(), size_t(n) * sizeof(float))) << "x changed by the bf16 copy";
      cuda::kernel::rope(gx.ptr(), nullptr, gpos.ptr(), offset, ginv.ptr(), 1.0, N, heads, hd, nullptr);
      const auto rf = as_f32(ref), y = gx.download(), yb = to_f32(gb.download());
      EXPECT_LE(rel_err(y.data(), rf.data(), size_t(n)), tol::kOpRel) << "hd " << hd << " offset " << offset;
      EXPECT_LE(rel_err(yb.data(), rf.data(), size_t(n)), tol::kCudaBf16Out) << "bf16 hd " << hd;
      // The CPU specification (fp32 angles, as transformers) agrees where fp32 angles are
      // still accurate: offset 0, positions below 4096 (angle error < 4096 ulp(1) ~ 5e-4).
      if (offset == 0) {
        std::vector<float> spec = x;
        cpu::rope_forward(spec.data(), pos.data(), inv.data(), N, heads, hd);
        const int64_t m = 8 * heads * hd;  // the first 8 positions are < 4096
        EXPECT_LE(rel_err(y.data(), spec.data(), size_t(m)), 1e-3) << "vs cpu::rope_forward, hd " << hd;
      }
      // sign -1 rotates back (the backward of an orthogonal map is its transpose).
      cuda::kernel::rope(gx.ptr(), nullptr, gpos.ptr(), offset, ginv.ptr(), -1.0, N, heads, hd, nullptr);
      const auto back = gx.download();
      EXPECT_LE(rel_err(back.data(), x.data(), size_t(n)), 1e-5) << "inverse hd " << hd;
      EXPECT_TRUE(gx.guards_intact() && gb.guards_intact());
    }
}

// SwiGLU on I values a row, gate/up rows every ld (ld = 2I: the fused gate|up layout).
struct SwigluCase {
  int64_t N, I;
  bool fused;
};

// The backward with its gradients written fused (dgate at 0, dup at I, rows every 2I, as one
// product reads them) from fused gate|up operands at g: the values, in that layout, as floats.
template <class T>
std::vector<float> fused_grads(const T* g, const float* dact, int shift, int64_t N, int64_t I) {
  Guarded<T> dgu{size_t(N * 2 * I + 8)};
  T* p = dgu.ptr() + shift;
  cuda::kernel::swiglu_backward(p, p + I, dact, g, g + I, 2 * I, 2 * I, N, I, nullptr);
  EXPECT_TRUE(dgu.guards_intact());
  std::vector<float> v;
  if constexpr (std::is_same_v<T, float>)
    v = dgu.download();
  else
    v = to_f32(dgu.download());
  return std::vector<float>(v.begin() + shift, v.begin() + shift + N * 2 * I);
}
// Fused gradients hold the separate ones' bits, row by row.
void expect_fused_grads(const std::vector<float>& dg, const std::vector<float>& du, const std::vector<float>& fused,
                        int64_t N, int64_t I, const std::string& what) {
  for (int64_t r = 0; r < N; ++r) {
    EXPECT_EQ(0, std::memcmp(&fused[size_t(r * 2 * I)], &dg[size_t(r * I)], size_t(I) * sizeof(float)))
        << what << ": fused dgate row " << r;
    EXPECT_EQ(0, std::memcmp(&fused[size_t(r * 2 * I + I)], &du[size_t(r * I)], size_t(I) * sizeof(float)))
        << what << ": fused dup row " << r;
  }
}

TEST(CudaKernels, SwigluForwardAndBackwardMatchOracle) {
  REQUIRE_GPU();
  for (SwigluCase sc : {SwigluCase{1, 1, false}, {9, 13, false}, {9, 13, true}, {5, 64, false}, {5, 64, true},
                        {3, 1000, false}}) {
    const int64_t N = sc.N, I = sc.I, ld = sc.fused ? 2 * I : I, n = N * I;
    // Operands in one buffer: gate at 0, up at I (fused) or at N*I (separate).
    const int64_t up_at = sc.fused ? I : N * I, span = sc.fused ? N * ld : 2 * N * I;
    auto gu = randn(size_t(span), 31, 3.f), dact = randn(size_t(n), 32);
    const size_t nn = static_cast<size_t>(n);
    std::vector<double> ra(nn), rg(nn), ru(nn);
    for (int64_t r = 0; r < N; ++r)
      for (int64_t i = 0; i < I; ++i) {
        const double g = gu[size_t(r * ld + i)], u = gu[size_t(up_at + r * ld + i)];
        const size_t k = size_t(r * I + i);
        ra[k] = silu_times(g, u);
        swiglu_oracle_backward(dact[k], g, u, &rg[k], &ru[k]);
      }
    const auto raf = as_f32(ra), rgf = as_f32(rg), ruf = as_f32(ru);
    std::string what = "N=" + std::to_string(N) + " I=" + std::to_string(I) + (sc.fused ? " fused" : "");
    {  // fp32
      Guarded<float> g{size_t(span)}, a{size_t(n)}, da{size_t(n)}, dg{size_t(n)}, du{size_t(n)};
      g.upload(gu), da.upload(dact);
      cuda::kernel::swiglu_forward(a.ptr(), g.ptr(), g.ptr() + up_at, ld, N, I, nullptr);
      cuda::kernel::swiglu_backward(dg.ptr(), du.ptr(), da.ptr(), g.ptr(), g.ptr() + up_at, ld, I, N, I, nullptr);
      const auto av = a.download(), dgv = dg.download(), duv = du.download();
      EXPECT_LE(rel_err(av.data(), raf.data(), size_t(n)), tol::kOpRel) << what;
      EXPECT_LE(rel_err(dgv.data(), rgf.data(), size_t(n)), tol::kOpRel) << what;
      EXPECT_LE(rel_err(duv.data(), ruf.data(), size_t(n)), tol::kOpRel) << what;
      EXPECT_TRUE(a.guards_intact() && dg.guards_intact() && du.guards_intact()) << what;
      if (sc.fused) expect_fused_grads(dgv, duv, fused_grads<float>(g.ptr(), da.ptr(), 0, N, I), N, I, what);
      // fp32 operands, bf16 out (the MoE experts).
      Guarded<bf16> ab{size_t(n)};
      cuda::kernel::swiglu_forward(ab.ptr(), g.ptr(), g.ptr() + up_at, ld, N, I, nullptr);
      const auto abv = to_f32(ab.download());
      EXPECT_LE(rel_err(abv.data(), raf.data(), size_t(n)), tol::kCudaBf16Out) << what;
      EXPECT_TRUE(ab.guards_intact()) << what;
    }
    // bf16 operands: aligned (8-wide path where I and ld allow) and shifted by one element
    // (one value a thread); both must give the same bits.
    std::vector<float> out[2][3];
    for (int shift : {0, 1}) {
      Guarded<bf16> g{size_t(span + 8)}, a{size_t(n + 8)}, dg{size_t(n + 8)}, du{size_t(n + 8)};
      Guarded<float> da{size_t(n + 8)};
      std::vector<float> padded(size_t(span + 8), 0.f), dpad(size_t(n + 8), 0.f);
      std::copy(gu.begin(), gu.end(), padded.begin() + shift);
      std::copy(dact.begin(), dact.end(), dpad.begin() + 4 * shift);  // dact stays 16-byte aligned
      g.upload(to_bf16(padded)), da.upload(dpad);
      bf16 *gp = g.ptr() + shift, *ap = a.ptr() + shift, *dgp = dg.ptr() + shift, *dup = du.ptr() + shift;
      cuda::kernel::swiglu_forward(ap, gp, gp + up_at, ld, N, I, nullptr);
      cuda::kernel::swiglu_backward(dgp, dup, da.ptr() + 4 * shift, gp, gp + up_at, ld, I, N, I, nullptr);
      const auto cut = [&](const std::vector<float>& v) {
        return std::vector<float>(v.begin() + shift, v.begin() + shift + n);
      };
      out[shift][0] = cut(to_f32(a.download()));
      out[shift][1] = cut(to_f32(dg.download()));
      out[shift][2] = cut(to_f32(du.download()));
      if (sc.fused)
        expect_fused_grads(out[shift][1], out[shift][2], fused_grads<bf16>(gp, da.ptr() + 4 * shift, shift, N, I), N, I,
                           what + " shift " + std::to_string(shift));
      EXPECT_LE(rel_err(out[shift][0].data(), raf.data(), size_t(n)), tol::kCudaBf16Out) << what << " shift " << shift;
      EXPECT_LE(rel_err(out[shift][1].data(), rgf.data(), size_t(n)), tol::kCudaBf16Out) << what << " shift " << shift;
      EXPECT_LE(rel_err(out[shift][2].data(), ruf.data(), size_t(n)), tol::kCudaBf16Out) << what << " shift " << shift;
      EXPECT_TRUE(a.guards_intact() && dg.guards_intact() && du.guards_intact()) << what;
    }
    for (int k = 0; k < 3; ++k)
      EXPECT_EQ(0, std::memcmp(out[0][k].data(), out[1][k].data(), size_t(n) * sizeof(float)))
          << what << ": the 8-wide and one-value paths differ (output " << k << ")";
  }
}

TEST(CudaKernels, CastsRoundToNearestEvenOnEveryPath) {
  REQUIRE_GPU();
  // Ties both ways, values just off a tie, denormals, the largest finite values (one rounds to
  // infinity), infinities, NaN, signed zeros, then random values.
  std::vector<float> v;
  for (uint32_t u : {0x3f808000u, 0x3f818000u, 0x3f808001u, 0x3f817fffu, 0x00000001u, 0x00008000u, 0x007fffffu,
                     0x7f7fffffu, 0x7f7f7fffu, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0x80000000u, 0x00000000u,
                     0xbf808000u, 0xc0ff8000u})
    v.push_back(std::bit_cast<float>(u));
  std::mt19937 rng(41);
  std::uniform_int_distribution<uint32_t> bits;
  while (v.size() < 1031) {
    const float f = std::bit_cast<float>(bits(rng));
    if (std::isfinite(f)) v.push_back(f);
  }
  for (size_t n : {size_t(1), size_t(3), size_t(4), size_t(7), v.size()})
    for (size_t shift : {size_t(0), size_t(1), size_t(2), size_t(3)}) {  // 16-byte aligned or not
      Guarded<float> in{n + 4}, back{n + 4};
      Guarded<bf16> out{n + 4};
      std::vector<float> src(n + 4, 0.f);
      std::copy(v.begin(), v.begin() + long(n), src.begin() + long(shift));
      in.upload(src);
      cuda::f32_to_bf16(out.ptr() + shift, in.ptr() + shift, int64_t(n), nullptr);
      cuda::bf16_to_f32(back.ptr() + shift, out.ptr() + shift, int64_t(n), nullptr);
      const auto o = out.download();
      const auto b = back.download();
      for (size_t i = 0; i < n; ++i) {
        uint16_t got;
        std::memcpy(&got, &o[shift + i], 2);
        const uint16_t want = f32_to_bf16(v[i]);
        if (std::isnan(v[i])) {
          EXPECT_TRUE(std::isnan(bf16_to_f32(got))) << "NaN at " << i;
          EXPECT_TRUE(std::isnan(b[shift + i]));
          continue;
        }
        ASSERT_EQ(got, want) << "value " << std::hexfloat << v[i] << " n=" << n << " shift=" << shift;
        ASSERT_EQ(std::bit_cast<uint32_t>(b[shift + i]), std::bit_cast<uint32_t>(bf16_to_f32(want)));
      }
      EXPECT_TRUE(in.guards_intact() && out.guards_intact() && back.guards_intact());
    }
  // Rows into a wider matrix (side by side with others): every value rounds as above, and the
  // columns between the rows keep what they held. Both paths: 4 a thread (cols and strides
  // multiples of 4, aligned) and one a thread (odd cols, odd strides or shifted pointers).
  struct RowsCase {
    int64_t rows, cols, ldi, ldo, shift;
  };
  for (const RowsCase rc : {RowsCase{1, 4, 4, 12, 0},
                            {7, 8, 12, 20, 0},
                            {5, 12, 12, 16, 4},
                            {3, 5, 7, 9, 0},
                            {6, 8, 8, 16, 1},
                            {33, 16, 16, 48, 0}}) {
    const int64_t n_in = rc.rows * rc.ldi + 4, n_out = rc.rows * rc.ldo + 4;
    std::vector<float> src(size_t(n_in), 0.f);
    for (int64_t i = 0; i < n_in; ++i) src[size_t(i)] = v[size_t(i) % v.size()];
    Guarded<float> in{size_t(n_in)};
    Guarded<bf16> out{size_t(n_out)};
    in.upload(src);
    const uint16_t sentinel = 0x7fc1;  // a NaN no cast makes
    std::vector<bf16> fill(static_cast<size_t>(n_out));
    for (auto& x : fill) std::memcpy(static_cast<void*>(&x), &sentinel, 2);
    out.upload(fill);
    cuda::kernel::cast_rows_bf16(out.ptr() + rc.shift, rc.ldo, in.ptr() + rc.shift, rc.ldi, rc.rows, rc.cols, nullptr);
    const auto o = out.download();
    const std::string what = "rows " + std::to_string(rc.rows) + " cols " + std::to_string(rc.cols) + " ldi " +
                             std::to_string(rc.ldi) + " ldo " + std::to_string(rc.ldo) + " shift " +
                             std::to_string(rc.shift);
    for (int64_t i = 0; i < n_out; ++i) {
      uint16_t got;
      std::memcpy(&got, &o[size_t(i)], 2);
      const int64_t at = i - rc.shift, r = at / rc.ldo, c = at % rc.ldo;
      if (at < 0 || r >= rc.rows || c >= rc.cols) {
        ASSERT_EQ(got, sentinel) << what << ": wrote outside the rows at " << i;
        continue;
      }
      const float x = src[size_t(rc.shift + r * rc.ldi + c)];
      if (std::isnan(x)) {
        EXPECT_TRUE(std::isnan(bf16_to_f32(got))) << what;
        continue;
      }
      ASSERT_EQ(got, f32_to_bf16(x)) << what << ": row " << r << " col " << c;
    }
    EXPECT_TRUE(in.guards_intact() && out.guards_intact()) << what;
  }
}

}  // namespace
#endif
