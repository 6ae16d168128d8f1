// cuDNN's fused attention over packed samples (backend/cuda/cudnn_sdpa.h) against a direct fp64
// evaluation of causal softmax attention: the forward's output and log-sum-exp; the backward
// given the forward's own statistics; and the backward given the statistics of a softmax over
// more keys than the causal ones (what the draft trainer passes when its diagonal keys join the
// row), where the exact gradients use P = exp(S - lse) and D = rowsum(dO * O) as given.
// Samples of 1, 70, 129, 5 and 200 rows (five samples: the plans' bucket pads to eight), GQA,
// head sizes 64 and 128; sentinels around every output.
#include <gtest/gtest.h>

#ifdef TALON_HAVE_CUDA
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cuda/cudnn_sdpa.h"
#include "tests/cuda_harness.h"
#include "tests/gpu_test.h"

using namespace talon;
using namespace talon::testing;

namespace {

struct Ref {
  std::vector<double> o, lse, dq, dk, dv;
};

// Causal attention of packed samples in fp64. lse_in/o_in: when given, the backward uses these
// statistics and output instead of its own (the merged row).
Ref reference(const std::vector<int64_t>& ss, int nh, int nkv, int hd, double scale, const std::vector<float>& q,
              const std::vector<float>& k, const std::vector<float>& v, const std::vector<float>& dO,
              const std::vector<double>* lse_in, const std::vector<double>* o_in) {
  const int64_t N = ss.back(), qd = int64_t(nh) * hd, kvd = int64_t(nkv) * hd;
  const int grp = nh / nkv;
  Ref r;
  r.o.assign(size_t(N * qd), 0.0);
  r.lse.assign(size_t(N * nh), 0.0);
  r.dq.assign(size_t(N * qd), 0.0);
  r.dk.assign(size_t(N * kvd), 0.0);
  r.dv.assign(size_t(N * kvd), 0.0);
  for (size_t b = 0; b + 1 < ss.size(); ++b)
    for (int64_t i = ss[b]; i < ss[b + 1]; ++i)
      for (int h = 0; h < nh; ++h) {
        const int kh = h / grp;
        const int64_t nk = i - ss[b] + 1;
        std::vector<double> sc(static_cast<size_t>(nk));
        double m = -1e300;
        for (int64_t j = 0; j < nk; ++j) {
          double acc = 0;
          for (int d = 0; d < hd; ++d)
            acc += double(q[size_t(i * qd + h * hd + d)]) * k[size_t((ss[b] + j) * kvd + kh * hd + d)];
          sc[size_t(j)] = acc * scale;
          m = std::max(m, sc[size_t(j)]);
        }
        double z = 0;
        for (double x : sc) z += std::exp(x - m);
        const double lse = m + std::log(z);
        r.lse[size_t(i * nh + h)] = lse;
        for (int64_t j = 0; j < nk; ++j)
          for (int d = 0; d < hd; ++d)
            r.o[size_t(i * qd + h * hd + d)] +=
                std::exp(sc[size_t(j)] - lse) * v[size_t((ss[b] + j) * kvd + kh * hd + d)];
        // Backward with the given (or own) statistics.
        const double L = lse_in ? (*lse_in)[size_t(i * nh + h)] : lse;
        double D = 0;
        for (int d = 0; d < hd; ++d) {
          const double o = o_in ? (*o_in)[size_t(i * qd + h * hd + d)] : r.o[size_t(i * qd + h * hd + d)];
          D += double(dO[size_t(i * qd + h * hd + d)]) * o;
        }
        for (int64_t j = 0; j < nk; ++j) {
          const double p = std::exp(sc[size_t(j)] - L);
          double dp = 0;
          for (int d = 0; d < hd; ++d)
            dp += double(dO[size_t(i * qd + h * hd + d)]) * v[size_t((ss[b] + j) * kvd + kh * hd + d)];
          const double ds = p * (dp - D) * scale;
          for (int d = 0; d < hd; ++d) {
            r.dq[size_t(i * qd + h * hd + d)] += ds * k[size_t((ss[b] + j) * kvd + kh * hd + d)];
            r.dk[size_t((ss[b] + j) * kvd + kh * hd + d)] += ds * q[size_t(i * qd + h * hd + d)];
            r.dv[size_t((ss[b] + j) * kvd + kh * hd + d)] += p * dO[size_t(i * qd + h * hd + d)];
          }
        }
      }
  return r;
}

template <class T>
double rel_err(const std::vector<T>& got, const std::vector<double>& want) {
  double mx = 0, md = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = double(got[i]);
    if (!std::isfinite(g)) return INFINITY;
    mx = std::max(mx, std::abs(want[i]));
    md = std::max(md, std::abs(g - want[i]));
  }
  return md / std::max(mx, 1e-30);
}

std::vector<float> from_dev(Guarded<__nv_bfloat16>& g) {
  const auto v = g.download();
  std::vector<float> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = __bfloat162float(v[i]);
  return o;
}

// bf16 outputs: a few units of bf16 rounding over the row's largest value.
constexpr double kTol = 2e-2;

// The packed batch the backward checks run: samples of 1, 70, 129, 5 and 200 rows (ss), random
// q, k, v and dO (seeds seed .. seed + 3) on the host and as bf16 on the device, and device
// buffers (sentinel-guarded) for the output, the statistics (lse and a merged lm) and the
// gradients.
struct Batch {
  std::vector<int64_t> ss = {0, 1, 71, 200, 205, 405};
  int64_t N, qd, kvd;
  double scale;
  std::vector<float> q, k, v, dO;
  Guarded<__nv_bfloat16> gq, gk, gv, gdo, go, gdq, gdk, gdv;
  Guarded<float> glse, glm;
  Guarded<int64_t> gss;
  Batch(int nh, int nkv, int hd, uint32_t seed)
      : N(ss.back()),
        qd(int64_t(nh) * hd),
        kvd(int64_t(nkv) * hd),
        scale(1.0 / std::sqrt(double(hd))),
        q(randn(size_t(N * qd), seed, 1.f)),
        k(randn(size_t(N * kvd), seed + 1, 1.f)),
        v(randn(size_t(N * kvd), seed + 2, 1.f)),
        dO(randn(size_t(N * qd), seed + 3, 1.f)),
        gq(size_t(N * qd)),
        gk(size_t(N * kvd)),
        gv(size_t(N * kvd)),
        gdo(size_t(N * qd)),
        go(size_t(N * qd)),
        gdq(size_t(N * qd)),
        gdk(size_t(N * kvd)),
        gdv(size_t(N * kvd)),
        glse(size_t(N * nh)),
        glm(size_t(N * nh)),
        gss(ss.size()) {
    gq.upload(to_bf16(q));
    gk.upload(to_bf16(k));
    gv.upload(to_bf16(v));
    gdo.upload(to_bf16(dO));
    gss.upload(ss);
  }
};

void check(int nh, int nkv, int hd) {
  SCOPED_TRACE(fmt::format("{} heads, {} kv heads, head size {}", nh, nkv, hd));
  Batch b(nh, nkv, hd, 11);
  Guarded<__nv_bfloat16> gom(size_t(b.N * b.qd));
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  {
    cuda::CudnnSdpa att({nh, nkv, hd, float(b.scale), 512}, s);
    att.set_batch(b.ss, b.gss.ptr());
    att.forward(b.go.ptr(), b.glse.ptr(), b.gq.ptr(), b.gk.ptr(), b.gv.ptr());
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    const Ref own = reference(b.ss, nh, nkv, hd, b.scale, b.q, b.k, b.v, b.dO, nullptr, nullptr);
    const auto o = from_dev(b.go);
    const auto lse = b.glse.download();
    EXPECT_LE(rel_err(o, own.o), kTol) << "forward output";
    double worst = 0;
    for (size_t i = 0; i < lse.size(); ++i) worst = std::max(worst, std::abs(double(lse[i]) - own.lse[i]));
    EXPECT_LE(worst, 2e-3) << "log-sum-exp (natural log of the scaled scores)";
    EXPECT_TRUE(b.go.guards_intact() && b.glse.guards_intact());

    // Backward with its own statistics (dO against cuDNN's output, as the trainer does).
    att.backward(b.gdq.ptr(), b.gdk.ptr(), b.gdv.ptr(), b.gq.ptr(), b.gk.ptr(), b.gv.ptr(), b.go.ptr(), b.gdo.ptr(),
                 b.glse.ptr());
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    std::vector<double> o_d(o.begin(), o.end()), lse_d(lse.begin(), lse.end());
    const Ref r1 = reference(b.ss, nh, nkv, hd, b.scale, b.q, b.k, b.v, b.dO, &lse_d, &o_d);
    EXPECT_LE(rel_err(from_dev(b.gdq), r1.dq), kTol) << "dQ";
    EXPECT_LE(rel_err(from_dev(b.gdk), r1.dk), kTol) << "dK";
    EXPECT_LE(rel_err(from_dev(b.gdv), r1.dv), kTol) << "dV";
    EXPECT_TRUE(b.gdq.guards_intact() && b.gdk.guards_intact() && b.gdv.guards_intact());

    // Backward given a merged row: lse raised as if more keys had joined, and another output.
    std::vector<float> lm(lse.size()), om = randn(size_t(b.N * b.qd), 15, 0.5f);
    for (size_t i = 0; i < lse.size(); ++i) lm[i] = lse[i] + std::log1p(float(i % 7) * 0.3f);
    b.glm.upload(lm);
    gom.upload(to_bf16(om));
    att.backward(b.gdq.ptr(), b.gdk.ptr(), b.gdv.ptr(), b.gq.ptr(), b.gk.ptr(), b.gv.ptr(), gom.ptr(), b.gdo.ptr(),
                 b.glm.ptr());
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    std::vector<double> lm_d(lm.begin(), lm.end()), om_d(om.begin(), om.end());
    const Ref r2 = reference(b.ss, nh, nkv, hd, b.scale, b.q, b.k, b.v, b.dO, &lm_d, &om_d);
    EXPECT_LE(rel_err(from_dev(b.gdq), r2.dq), kTol) << "dQ, merged statistics";
    EXPECT_LE(rel_err(from_dev(b.gdk), r2.dk), kTol) << "dK, merged statistics";
    EXPECT_LE(rel_err(from_dev(b.gdv), r2.dv), kTol) << "dV, merged statistics";
    // The backward is deterministic: the same inputs give the same bits.
    const auto dq1 = b.gdq.download(), dk1 = b.gdk.download();
    att.backward(b.gdq.ptr(), b.gdk.ptr(), b.gdv.ptr(), b.gq.ptr(), b.gk.ptr(), b.gv.ptr(), gom.ptr(), b.gdo.ptr(),
                 b.glm.ptr());
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    const auto dq2 = b.gdq.download(), dk2 = b.gdk.download();
    EXPECT_EQ(0, std::memcmp(dq1.data(), dq2.data(), dq1.size() * 2)) << "dQ differs between identical runs";
    EXPECT_EQ(0, std::memcmp(dk1.data(), dk2.data(), dk1.size() * 2)) << "dK differs between identical runs";

    // A second batch in another bucket (one sample), then the first again: plans are per bucket.
    const std::vector<int64_t> one = {0, 97};
    Guarded<int64_t> gone(one.size());
    gone.upload(one);
    att.set_batch(one, gone.ptr());
    att.forward(b.go.ptr(), b.glse.ptr(), b.gq.ptr(), b.gk.ptr(), b.gv.ptr());
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    const Ref r3 = reference(one, nh, nkv, hd, b.scale, b.q, b.k, b.v, b.dO, nullptr, nullptr);
    auto o3 = from_dev(b.go);
    o3.resize(size_t(97 * b.qd));
    EXPECT_LE(rel_err(o3, r3.o), kTol) << "one-sample batch";
  }
  cudaStreamDestroy(s);
}

bool cudnn_or_skip() {
  if (!cuda::cudnn_sdpa_built()) return false;
  std::string why;
  EXPECT_TRUE(cuda::cudnn_sdpa_available(&why)) << why;  // built with it: the GPU machine must have it
  return cuda::cudnn_sdpa_available();
}

}  // namespace

TEST(CudnnSdpa, PackedCausalAttentionMatchesFp64) {
  REQUIRE_GPU();
  if (!cuda::cudnn_sdpa_built()) GTEST_SKIP() << "built without the cuDNN frontend";
  if (!cudnn_or_skip()) return;
  check(4, 2, 64);
  check(8, 2, 128);
  check(4, 4, 128);
}

// Extraction's prefill layouts, forward only: GQA read from a fused qkv buffer (q, k, v at their
// columns of one row), and MLA's query/key heads of 192 over values of 128 read from the padded
// qkv buffer (each value head in a slot of 192) and written unpadded.
void check_layout(int nh, int nkv, int hd, int hd_v, bool mla) {
  SCOPED_TRACE(fmt::format("{} heads, {} kv heads, head size {}/{}{}", nh, nkv, hd, hd_v, mla ? ", MLA" : ""));
  const std::vector<int64_t> ss = {0, 33, 163, 164, 300};
  const int64_t N = ss.back(), hs_v = mla ? hd : hd_v;
  const int64_t ld = mla ? 3 * int64_t(nh) * hd : int64_t(nh + 2 * nkv) * hd;
  const int64_t k0 = int64_t(nh) * hd, v0 = mla ? 2 * int64_t(nh) * hd : int64_t(nh + nkv) * hd;
  const auto qkv = randn(size_t(N * ld), 21, 1.f);
  // The packed operands the reference reads (values zero-padded to hd for its single head size).
  std::vector<float> q(size_t(N * nh * hd)), k(size_t(N * nkv * hd)), v(size_t(N * nkv * hd), 0.f);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t i = 0; i < nh * hd; ++i) q[size_t(n * nh * hd + i)] = qkv[size_t(n * ld + i)];
    for (int64_t i = 0; i < nkv * hd; ++i) k[size_t(n * nkv * hd + i)] = qkv[size_t(n * ld + k0 + i)];
    for (int64_t h = 0; h < nkv; ++h)
      for (int64_t d = 0; d < hd_v; ++d) v[size_t(n * nkv * hd + h * hd + d)] = qkv[size_t(n * ld + v0 + h * hs_v + d)];
  }
  const double scale = 1.0 / std::sqrt(double(hd));
  const Ref r = reference(ss, nh, nkv, hd, scale, q, k, v, q, nullptr, nullptr);
  std::vector<double> want(size_t(N * nh * hd_v));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t d = 0; d < hd_v; ++d) want[size_t((n * nh + h) * hd_v + d)] = r.o[size_t((n * nh + h) * hd + d)];
  Guarded<__nv_bfloat16> gqkv(size_t(N * ld)), go(size_t(N * nh * hd_v));
  Guarded<int64_t> gss(ss.size());
  gqkv.upload(to_bf16(qkv));
  gss.upload(ss);
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  {
    cuda::SdpaShape sh{nh, nkv, hd, float(scale), 1024};
    sh.hd_v = hd_v;
    sh.ld_q = sh.ld_k = sh.ld_v = ld;
    sh.hs_v = hs_v;
    sh.backward = false;
    cuda::CudnnSdpa att(sh, s);
    att.set_batch(ss, gss.ptr());
    att.forward(go.ptr(), nullptr, gqkv.ptr(), gqkv.ptr() + k0, gqkv.ptr() + v0);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    EXPECT_LE(rel_err(from_dev(go), want), kTol);
    EXPECT_TRUE(go.guards_intact());
    EXPECT_THROW(att.backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr),
                 std::exception);
  }
  cudaStreamDestroy(s);
}

TEST(CudnnSdpa, PrefillLayoutsMatchFp64) {
  REQUIRE_GPU();
  if (!cuda::cudnn_sdpa_built()) GTEST_SKIP() << "built without the cuDNN frontend";
  if (!cudnn_or_skip()) return;
  check_layout(8, 2, 128, 128, false);
  check_layout(6, 6, 64, 64, false);
  check_layout(4, 4, 192, 128, true);
}

// A workspace lent by the caller (the draft trainer lends memory idle during the attention):
// the same bits as with cuDNN's own, nothing written outside it, and not counted as cuDNN's.
// Lent too little, it takes its own again, with the same bits.
TEST(CudnnSdpa, LentWorkspaceGivesTheSameBits) {
  REQUIRE_GPU();
  if (!cuda::cudnn_sdpa_built()) GTEST_SKIP() << "built without the cuDNN frontend";
  if (!cudnn_or_skip()) return;
  const int nh = 8, nkv = 2, hd = 128;
  const std::vector<int64_t> ss = {0, 1, 71, 200, 205, 405};
  const int64_t N = ss.back(), qd = int64_t(nh) * hd, kvd = int64_t(nkv) * hd;
  const float scale = float(1.0 / std::sqrt(double(hd)));
  Guarded<__nv_bfloat16> gq(size_t(N * qd)), gk(size_t(N * kvd)), gv(size_t(N * kvd)), gdo(size_t(N * qd));
  gq.upload(to_bf16(randn(size_t(N * qd), 31, 1.f)));
  gk.upload(to_bf16(randn(size_t(N * kvd), 32, 1.f)));
  gv.upload(to_bf16(randn(size_t(N * kvd), 33, 1.f)));
  gdo.upload(to_bf16(randn(size_t(N * qd), 34, 1.f)));
  Guarded<int64_t> gss(ss.size());
  gss.upload(ss);
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  struct Out {
    std::vector<__nv_bfloat16> o, dq, dk, dv;
    std::vector<float> lse;
  };
  // lend: bytes lent (-1: none); `ws`: the lent buffer, sentinels (NaN patterns) inside and out.
  auto run = [&](cuda::CudnnSdpa& att, Guarded<float4>* ws, int64_t lend) {
    if (lend >= 0) att.set_workspace(ws->ptr(), lend);
    att.set_batch(ss, gss.ptr());
    Guarded<__nv_bfloat16> go(size_t(N * qd)), gdq(size_t(N * qd)), gdk(size_t(N * kvd)), gdv(size_t(N * kvd));
    Guarded<float> glse(size_t(N * nh));
    att.forward(go.ptr(), glse.ptr(), gq.ptr(), gk.ptr(), gv.ptr());
    att.backward(gdq.ptr(), gdk.ptr(), gdv.ptr(), gq.ptr(), gk.ptr(), gv.ptr(), go.ptr(), gdo.ptr(), glse.ptr());
    EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    return Out{go.download(), gdq.download(), gdk.download(), gdv.download(), glse.download()};
  };
  auto same = [](const Out& a, const Out& b, const char* what) {
    EXPECT_EQ(0, std::memcmp(a.o.data(), b.o.data(), a.o.size() * 2)) << what << ": output";
    EXPECT_EQ(0, std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * 4)) << what << ": log-sum-exp";
    EXPECT_EQ(0, std::memcmp(a.dq.data(), b.dq.data(), a.dq.size() * 2)) << what << ": dQ";
    EXPECT_EQ(0, std::memcmp(a.dk.data(), b.dk.data(), a.dk.size() * 2)) << what << ": dK";
    EXPECT_EQ(0, std::memcmp(a.dv.data(), b.dv.data(), a.dv.size() * 2)) << what << ": dV";
  };
  {
    cuda::CudnnSdpa own({nh, nkv, hd, scale, 512}, s), lent({nh, nkv, hd, scale, 512}, s);
    const Out want = run(own, nullptr, -1);
    const int64_t need = lent.workspace_bytes(5, 200);  // this batch's bucket
    ASSERT_GT(need, 0) << "the deterministic backward needs a workspace";
    EXPECT_EQ(need, own.workspace_bytes(5, 200));
    EXPECT_GE(own.bytes(), need);
    Guarded<float4> ws(size_t((need + 15) / 16));
    same(want, run(lent, &ws, need), "lent workspace");
    EXPECT_TRUE(ws.guards_intact()) << "cuDNN wrote outside the lent workspace";
    EXPECT_LT(lent.bytes(), need) << "a lent workspace is not cuDNN's own";
    same(want, run(lent, &ws, need / 2), "half the workspace lent");
    EXPECT_GE(lent.bytes(), need) << "lent too little, it takes its own";
    same(want, run(lent, &ws, 0), "none lent");
  }
  cudaStreamDestroy(s);
}

// The backward in head groups (set_backward_limit): with a limit below every split's need, the
// most groups the shape allows (whole GQA groups, four query heads or more each), one execution
// each over strided views of the same buffers. dQ, dK, dV against the fp64 reference, with the
// forward's statistics and with merged ones; the same bits on a second run; nothing written
// outside the outputs; and a limit the whole backward fits keeps one group.
void check_groups(int nh, int nkv, int hd, int want_groups) {
  SCOPED_TRACE(fmt::format("{} heads, {} kv heads, head size {}", nh, nkv, hd));
  Batch b(nh, nkv, hd, 41);
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  {
    cuda::CudnnSdpa att({nh, nkv, hd, float(b.scale), 512}, s);
    const int64_t whole = att.workspace_bytes(5, 200);
    att.set_backward_limit(whole);
    EXPECT_EQ(att.backward_groups(5, 200), 1) << "the whole backward fits its own need";
    att.set_backward_limit(1);
    ASSERT_EQ(att.backward_groups(5, 200), want_groups);
    if (want_groups > 1) {
      EXPECT_LT(att.workspace_bytes(5, 200), whole) << "groups need less workspace";
    }
    att.set_batch(b.ss, b.gss.ptr());
    att.forward(b.go.ptr(), b.glse.ptr(), b.gq.ptr(), b.gk.ptr(), b.gv.ptr());
    att.backward(b.gdq.ptr(), b.gdk.ptr(), b.gdv.ptr(), b.gq.ptr(), b.gk.ptr(), b.gv.ptr(), b.go.ptr(), b.gdo.ptr(),
                 b.glse.ptr());
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    const auto o = from_dev(b.go);
    const auto lse = b.glse.download();
    std::vector<double> o_d(o.begin(), o.end()), lse_d(lse.begin(), lse.end());
    const Ref r1 = reference(b.ss, nh, nkv, hd, b.scale, b.q, b.k, b.v, b.dO, &lse_d, &o_d);
    EXPECT_LE(rel_err(o, r1.o), kTol) << "forward output";
    EXPECT_LE(rel_err(from_dev(b.gdq), r1.dq), kTol) << "dQ";
    EXPECT_LE(rel_err(from_dev(b.gdk), r1.dk), kTol) << "dK";
    EXPECT_LE(rel_err(from_dev(b.gdv), r1.dv), kTol) << "dV";
    EXPECT_TRUE(b.gdq.guards_intact() && b.gdk.guards_intact() && b.gdv.guards_intact());

    std::vector<float> lm(lse.size());
    for (size_t i = 0; i < lse.size(); ++i) lm[i] = lse[i] + std::log1p(float(i % 5) * 0.4f);
    b.glm.upload(lm);
    att.backward(b.gdq.ptr(), b.gdk.ptr(), b.gdv.ptr(), b.gq.ptr(), b.gk.ptr(), b.gv.ptr(), b.go.ptr(), b.gdo.ptr(),
                 b.glm.ptr());
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    std::vector<double> lm_d(lm.begin(), lm.end());
    const Ref r2 = reference(b.ss, nh, nkv, hd, b.scale, b.q, b.k, b.v, b.dO, &lm_d, &o_d);
    EXPECT_LE(rel_err(from_dev(b.gdq), r2.dq), kTol) << "dQ, merged statistics";
    EXPECT_LE(rel_err(from_dev(b.gdk), r2.dk), kTol) << "dK, merged statistics";
    EXPECT_LE(rel_err(from_dev(b.gdv), r2.dv), kTol) << "dV, merged statistics";
    const auto dq1 = b.gdq.download(), dk1 = b.gdk.download(), dv1 = b.gdv.download();
    att.backward(b.gdq.ptr(), b.gdk.ptr(), b.gdv.ptr(), b.gq.ptr(), b.gk.ptr(), b.gv.ptr(), b.go.ptr(), b.gdo.ptr(),
                 b.glm.ptr());
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    const auto dq2 = b.gdq.download(), dk2 = b.gdk.download(), dv2 = b.gdv.download();
    EXPECT_EQ(0, std::memcmp(dq1.data(), dq2.data(), dq1.size() * 2)) << "dQ differs between identical runs";
    EXPECT_EQ(0, std::memcmp(dk1.data(), dk2.data(), dk1.size() * 2)) << "dK differs between identical runs";
    EXPECT_EQ(0, std::memcmp(dv1.data(), dv2.data(), dv1.size() * 2)) << "dV differs between identical runs";
    EXPECT_TRUE(b.gdq.guards_intact() && b.gdk.guards_intact() && b.gdv.guards_intact());
  }
  cudaStreamDestroy(s);
}

TEST(CudnnSdpa, BackwardInHeadGroupsMatchesFp64) {
  REQUIRE_GPU();
  if (!cuda::cudnn_sdpa_built()) GTEST_SKIP() << "built without the cuDNN frontend";
  if (!cudnn_or_skip()) return;
  check_groups(8, 2, 128, 2);   // a kv head and its 4 query heads a group
  check_groups(16, 4, 64, 4);   // 4 groups of one kv head and 4 query heads
  check_groups(16, 16, 64, 4);  // no GQA: 4 groups of 4 heads (no fewer than 4 query heads)
  check_groups(4, 2, 64, 1);    // 2 query heads a group would be too few: the whole backward
}

TEST(CudnnSdpa, UnsupportedShapesAreRefusedWithTheNumbers) {
  REQUIRE_GPU();
  if (!cuda::cudnn_sdpa_built()) GTEST_SKIP() << "built without the cuDNN frontend";
  if (!cudnn_or_skip()) return;
  try {
    cuda::CudnnSdpa att({6, 4, 64, 0.125f, 64}, nullptr);
    ADD_FAILURE() << "6 heads over 4 kv heads was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("6 heads, 4 kv heads"), std::string::npos) << e.what();
  }
  try {
    cuda::CudnnSdpa att({4, 2, 60, 0.125f, 64}, nullptr);
    ADD_FAILURE() << "head size 60 was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("head size 60"), std::string::npos) << e.what();
  }
}
#endif

// No GPU needed: the cuDNN frontend's own checks of the forward and backward graphs (ragged
// Q/K/V/O and log-sum-exp, padding mask, causal band, deterministic backward), for Hopper, at the
// head layouts of the drafts Talon trains (32/8 heads of 128 as Llama-3.1-8B's, 9/3 of 64 as
// SmolLM2's, 128/128 of 128, and the tests' 4/2 of 16) and batch buckets from one sample to many.
// A head size past cuDNN's limit must be refused by those same checks.
#ifdef TALON_HAVE_CUDA
TEST(CudnnSdpa, GraphsPassTheFrontendChecksForHopper) {
  if (!cuda::cudnn_sdpa_built()) GTEST_SKIP() << "built without the cuDNN frontend";
  std::string why;
  if (!cuda::cudnn_sdpa_available(&why)) GTEST_SKIP() << why;
  struct Shape {
    int nh, nkv, hd;
  };
  for (Shape sh : {Shape{32, 8, 128}, Shape{9, 3, 64}, Shape{128, 128, 128}, Shape{4, 2, 16}})
    for (auto [b, longest] : {std::pair<int64_t, int64_t>{1, 8192}, {5, 700}, {64, 64}}) {
      const std::string m = cuda::cudnn_sdpa_validate(
          {sh.nh, sh.nkv, sh.hd, float(1 / std::sqrt(double(sh.hd))), 8192}, b, longest);
      EXPECT_EQ(m, "") << sh.nh << "/" << sh.nkv << " heads of " << sh.hd << ", " << b << " samples of up to " << longest;
    }
  // Extraction's prefill layouts, forward only: GQA on the fused qkv buffer (Llama-3.1-8B), and
  // MLA's heads of 192 (query/key) over values of 128 in the padded qkv buffer (Kimi-K2's 64
  // heads), written unpadded.
  {
    cuda::SdpaShape gqa{32, 8, 128, 0.088f, 16384};
    gqa.ld_q = gqa.ld_k = gqa.ld_v = (32 + 2 * 8) * 128;
    gqa.backward = false;
    EXPECT_EQ(cuda::cudnn_sdpa_validate(gqa, 3, 4096), "") << "GQA on a fused qkv buffer";
    cuda::SdpaShape mla{64, 64, 192, 0.072f, 16384};
    mla.hd_v = 128;
    mla.ld_q = mla.ld_k = mla.ld_v = 3 * 64 * 192;
    mla.hs_v = 192;
    mla.backward = false;
    EXPECT_EQ(cuda::cudnn_sdpa_validate(mla, 3, 4096), "") << "MLA 192/128 on the padded qkv buffer";
  }
  // The backward over head groups (a G-th of the heads, the same strides; statistics a view of
  // the full [rows, heads] array): the 8B draft's 32/8 heads in 2, 4 and 8 groups at 8192 rows.
  for (int groups : {2, 4, 8})
    EXPECT_EQ(cuda::cudnn_sdpa_validate({32, 8, 128, 0.088f, 8192}, 1, 8192, groups), "") << groups << " head groups";
  EXPECT_NE(cuda::cudnn_sdpa_validate({32, 8, 128, 0.088f, 8192}, 1, 8192, 3), "") << "3 groups of 8 kv heads";
  const std::string bad = cuda::cudnn_sdpa_validate({8, 2, 264, 0.06f, 1024}, 2, 100);
  EXPECT_NE(bad.find("256"), std::string::npos) << "head size 264 passed cuDNN's checks: '" << bad << "'";
}

// What the prefill route asks before it takes cuDNN (TALON_ATTENTION=cudnn falls back to Talon's
// kernels where this says no): the fixtures' head sizes of 10 and 16 over values of 12 are not
// multiples of 8, heads must group evenly, and a batch too large for 32-bit offsets is refused;
// the layouts cuDNN serves pass.
TEST(CudnnSdpa, SaysWhichShapesItServes) {
  if (!cuda::cudnn_sdpa_built()) GTEST_SKIP() << "built without the cuDNN frontend";
  std::string why;
  if (!cuda::cudnn_sdpa_available(&why)) {
    EXPECT_EQ(cuda::cudnn_sdpa_unsupported({4, 2, 64, 0.125f, 64}), why) << "without cuDNN, the reason is that";
    GTEST_SKIP() << why;
  }
  EXPECT_EQ(cuda::cudnn_sdpa_unsupported({32, 8, 128, 0.088f, 16384}), "");
  cuda::SdpaShape mla{64, 64, 192, 0.072f, 16384};
  mla.hd_v = 128;
  mla.ld_q = mla.ld_k = mla.ld_v = 3 * 64 * 192;
  mla.hs_v = 192;
  EXPECT_EQ(cuda::cudnn_sdpa_unsupported(mla), "");
  EXPECT_NE(cuda::cudnn_sdpa_unsupported({4, 2, 10, 0.3f, 64}).find("head size 10"), std::string::npos);
  cuda::SdpaShape odd_v{4, 4, 16, 0.25f, 64};
  odd_v.hd_v = 12;
  EXPECT_NE(cuda::cudnn_sdpa_unsupported(odd_v).find("value head size 12"), std::string::npos);
  EXPECT_NE(cuda::cudnn_sdpa_unsupported({6, 4, 64, 0.125f, 64}), "") << "6 heads over 4 kv heads";
  EXPECT_NE(cuda::cudnn_sdpa_unsupported({32, 8, 128, 0.088f, int64_t(1) << 20}).find("32-bit"), std::string::npos);
}
#endif
