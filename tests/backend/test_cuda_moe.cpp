// The CUDA mixture-of-experts (backend/cuda/moe.h) against the CPU reference: routing
// (softmax / sigmoid scoring; greedy, group-limited greedy and noaux_tc with a correction
// bias; normalised and scaled weights) must pick the same experts as cpu::moe_router_forward
// with the same weights; the grouped expert GEMMs must equal per-token fp32 SwiGLU MLPs over
// weights dequantized by talon::dequantize (the int4 layout the CPU reference reads, checked
// there against torch), for bf16, int4 (group 32) and FP8 block-quantized experts (e4m3 with
// fp32 block scales: 16x16, blocks that do not divide O and I, and a K block that is not a
// multiple of 16, which takes the CUDA-core kernel). The reference rounds the SwiGLU
// activations to bf16 as the GPU does, so what is left is fp32 summation order. Skips without
// a GPU.
#include <gtest/gtest.h>

#ifdef TALON_HAVE_CUDA
#include <cuda_runtime.h>

#include "tests/gpu_test.h"

#include <cmath>
#include <random>

#include "backend/cpu/ops.h"
#include "backend/cuda/moe.h"
#include "backend/cuda/moe_cutlass.h"
#include "backend/cuda/moe_weights.h"
#include "model/deepseek.h"
#include "model/quant.h"
#include "tests/test_util.h"
#include "util/dtype.h"

using namespace talon;

namespace {


template <typename T>
T* to_dev(const std::vector<T>& v) {
  T* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(1, v.size()) * sizeof(T)), cudaSuccess);
  cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  return p;
}
template <typename T>
std::vector<T> to_host(const T* p, size_t n) {
  std::vector<T> v(n);
  cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
  return v;
}

// One matrix kind for E experts, random, in the device layouts' host form and fp32 dequantized.
struct HostMatrix {
  int64_t E, O, I, group;
  std::vector<uint16_t> w;       // bf16 [E, O, I] (bf16 case)
  std::vector<int32_t> packed;   // [E, O, ceil(I/8)] (int4 case)
  std::vector<uint16_t> scale;   // bf16 [E, O, ceil(I/group)]
  std::vector<float> f32;        // [E, O, I] as the CPU reference dequantizes it
  int64_t bo = 0, bi = 0;        // FP8 case: block rows, columns
  std::vector<uint8_t> w8;       // e4m3 [E, O, I]
  std::vector<float> bscale;     // fp32 [E, ceil(O/bo), ceil(I/bi)]
};

// bf16 experts for group == 0 and bi == 0, int4 of that group, or FP8 with bo x bi blocks.
HostMatrix make_matrix(std::mt19937& rng, int64_t E, int64_t O, int64_t I, int64_t group, int64_t bo = 0,
                       int64_t bi = 0) {
  HostMatrix m{E, O, I, group, {}, {}, {}, {}, 0, 0, {}, {}};
  std::normal_distribution<float> nd(0.f, 1.f);
  m.f32.resize(size_t(E * O * I));
  if (bi > 0) {
    // Every e4m3 code but the NaNs (zeros, subnormals, +-448), and fp32 block scales of varied
    // exponents, different per (expert, row block, K block).
    m.bo = bo, m.bi = bi;
    const int64_t sr = (O + bo - 1) / bo, scn = (I + bi - 1) / bi;
    m.w8.resize(m.f32.size());
    for (auto& b : m.w8) {
      do b = uint8_t(rng()); while ((b & 0x7f) == 0x7f);
    }
    m.bscale.resize(size_t(E * sr * scn));
    for (auto& v : m.bscale) v = std::ldexp(1.f + float(rng() % 1024) / 1024.f, -int(rng() % 4)) / (64.f * std::sqrt(float(I)));
    for (int64_t e = 0; e < E; ++e) {
      QuantWeight q;
      q.kind = QuantWeight::Kind::Fp8Block;
      q.rows = O, q.cols = I, q.block_rows = bo, q.block_cols = bi;
      q.w = WeightRef{DType::F8_E4M3, m.w8.data() + e * O * I, {O, I}};
      q.scale = WeightRef{DType::F32, m.bscale.data() + e * sr * scn, {sr, scn}};
      dequantize(q, m.f32.data() + e * O * I);
    }
    return m;
  }
  if (group == 0) {
    m.w.resize(m.f32.size());
    for (size_t i = 0; i < m.w.size(); ++i) {
      m.w[i] = f32_to_bf16(nd(rng) / std::sqrt(float(I)));
      m.f32[i] = bf16_to_f32(m.w[i]);
    }
    return m;
  }
  const int64_t words = (I + 7) / 8, groups = (I + group - 1) / group;
  m.packed.assign(size_t(E * O * words), 0);
  m.scale.resize(size_t(E * O * groups));
  for (auto& s : m.scale) s = f32_to_bf16(std::fabs(nd(rng)) * 0.3f / std::sqrt(float(I)) + 1e-3f);
  for (int64_t r = 0; r < E * O; ++r)
    for (int64_t i = 0; i < I; ++i) {
      const uint32_t q = rng() % 16;  // stored q + 8
      m.packed[size_t(r * words + i / 8)] |= int32_t(q << (4 * (i % 8)));
    }
  // The CPU reference's dequantizer, one expert at a time.
  for (int64_t e = 0; e < E; ++e) {
    QuantWeight q;
    q.kind = QuantWeight::Kind::Int4Group;
    q.rows = O, q.cols = I, q.group = group;
    q.w = WeightRef{DType::I32, m.packed.data() + e * O * words, {O, words}};
    q.scale = WeightRef{DType::BF16, m.scale.data() + e * O * groups, {O, groups}};
    dequantize(q, m.f32.data() + e * O * I);
  }
  return m;
}

struct DevMatrix {
  cuda::ExpertMatrix m;
  std::vector<void*> owned;
  explicit DevMatrix(const HostMatrix& h) {
    m.O = h.O, m.I = h.I, m.group = h.group;
    if (h.bi > 0) {
      auto* p = to_dev(h.w8);
      auto* s = to_dev(h.bscale);
      owned.push_back(p);
      owned.push_back(s);
      m.fp8 = p, m.block_scale = s, m.bo = h.bo, m.bi = h.bi, m.group = 0;
    } else if (h.group == 0) {
      auto* p = to_dev(h.w);
      owned.push_back(p);
      m.w = reinterpret_cast<const cuda::bf16*>(p);
    } else {
      auto* p = to_dev(h.packed);
      auto* s = to_dev(h.scale);
      owned.push_back(p);
      owned.push_back(s);
      m.packed = p;
      m.scale = reinterpret_cast<const cuda::bf16*>(s);
    }
  }
  ~DevMatrix() {
    for (void* p : owned) cudaFree(p);
  }
};

// The routed experts' weighted sum for bf16-exact inputs x [N, H], given routing and fp32
// expert weights [E, O, I]; SwiGLU activations rounded to bf16 as the GPU does.
std::vector<float> reference_moe(const std::vector<float>& x, const std::vector<int32_t>& idx,
                                 const std::vector<float>& wts, const std::vector<float>& gate,
                                 const std::vector<float>& up, const std::vector<float>& down, int64_t N, int64_t H,
                                 int64_t Im, int K) {
  std::vector<float> want(size_t(N * H), 0.f), g(static_cast<size_t>(Im)), u(static_cast<size_t>(Im)),
      y(static_cast<size_t>(H));
  for (int64_t n = 0; n < N; ++n)
    for (int t = 0; t < K; ++t) {
      const int64_t e = idx[size_t(n * K + t)];
      cpu::matmul_forward(g.data(), x.data() + n * H, gate.data() + e * Im * H, DType::F32, nullptr, 1, H, Im);
      cpu::matmul_forward(u.data(), x.data() + n * H, up.data() + e * Im * H, DType::F32, nullptr, 1, H, Im);
      cpu::swiglu_forward(g.data(), g.data(), u.data(), Im);
      for (auto& v : g) v = bf16_to_f32(f32_to_bf16(v));
      cpu::matmul_forward(y.data(), g.data(), down.data() + e * H * Im, DType::F32, nullptr, 1, Im, H);
      for (int64_t h = 0; h < H; ++h) want[size_t(n * H + h)] += y[size_t(h)] * wts[size_t(n * K + t)];
    }
  return want;
}

struct GpuMoeResult {
  std::vector<int32_t> idx;
  std::vector<float> weights, out;
};

// moe_forward on the device for bf16 inputs xb [N, H] and router logits [N, E].
GpuMoeResult run_gpu_moe(const std::vector<uint16_t>& xb, const std::vector<float>& logits, const float* d_bias,
                         int64_t N, int64_t H, const cuda::MoeRouting& r, const cuda::MoeExperts& ex) {
  const int64_t Im = ex.gate.O, K = r.top_k;
  const auto sz = cuda::moe_scratch_elems(N, r, H, Im);
  std::vector<void*> bufs;
  auto alloc = [&](int64_t n, size_t es) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, size_t(std::max<int64_t>(n, 1)) * es), cudaSuccess);
    bufs.push_back(p);
    return p;
  };
  cuda::MoeScratch sc;
  sc.idx = static_cast<int32_t*>(alloc(sz.idx, 4));
  sc.order = static_cast<int32_t*>(alloc(sz.order, 4));
  sc.pos = static_cast<int32_t*>(alloc(sz.pos, 4));
  sc.offsets = static_cast<int32_t*>(alloc(sz.offsets, 4));
  sc.tiles = static_cast<int32_t*>(alloc(sz.tiles, 4));
  sc.n_tiles = static_cast<int32_t*>(alloc(1, 4));
  sc.weights = static_cast<float*>(alloc(sz.weights, 4));
  sc.g = static_cast<float*>(alloc(sz.g, 4));
  sc.u = static_cast<float*>(alloc(sz.g, 4));
  sc.y = static_cast<float*>(alloc(sz.y, 4));
  sc.act = static_cast<cuda::bf16*>(alloc(sz.act, 2));
  sc.capacity = N;
  auto* d_x = to_dev(xb);
  auto* d_logits = to_dev(logits);
  bufs.push_back(d_x);
  bufs.push_back(d_logits);
  float* d_out = static_cast<float*>(alloc(N * H, 4));
  cuda::moe_forward(d_out, reinterpret_cast<const cuda::bf16*>(d_x), d_logits, d_bias, N, H, r, ex, sc, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  GpuMoeResult res{to_host(sc.idx, size_t(N * K)), to_host(sc.weights, size_t(N * K)), to_host(d_out, size_t(N * H))};
  for (void* p : bufs) cudaFree(p);
  return res;
}

struct Case {
  const char* name;
  MoeScoring scoring;
  MoeTopk method;
  int n_group, topk_group;
  bool norm, bias;
  float scale;
  int64_t group;  // 0: bf16 experts (or FP8), else int4 group size
  int64_t fp8_bo = 0, fp8_bi = 0;  // > 0: FP8 block-quantized experts, blocks fp8_bo x fp8_bi
  int64_t H = 96, Im = 64;
  const char* storage() const { return fp8_bi > 0 ? "fp8" : group > 0 ? "int4" : "bf16"; }
};

class CudaMoe : public ::testing::TestWithParam<Case> {};

void check_moe_case(const Case& cs, int64_t N);

// 37 tokens (several experts get more than 8 rows: more than one pass of the decode-sized
// kernel), 160 (about 40 rows an expert: more than one 64-row tile, and more than one pass of
// the int4 tensor-core decode kernel), and decode sizes: 3 tokens and 1 (every expert one row
// at most).
TEST_P(CudaMoe, MatchesTheCpuReference) {
  REQUIRE_GPU();
  for (const int64_t n_tokens : {int64_t(37), int64_t(160), int64_t(3), int64_t(1)}) {
    SCOPED_TRACE("tokens " + std::to_string(n_tokens));
    check_moe_case(GetParam(), n_tokens);
  }
}

void check_moe_case(const Case& cs, int64_t N) {
  const int64_t H = cs.H, Im = cs.Im, E = 16;
  const int K = 4;
  std::mt19937 rng(uint32_t(7 + N));
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint16_t> xb(size_t(N * H));
  std::vector<float> x(size_t(N * H)), logits(size_t(N * E)), bias(static_cast<size_t>(E));
  for (size_t i = 0; i < xb.size(); ++i) x[i] = bf16_to_f32(xb[i] = f32_to_bf16(nd(rng)));
  for (auto& v : logits) v = 2.f * nd(rng);
  for (auto& v : bias) v = 0.3f * nd(rng);
  const HostMatrix gate = make_matrix(rng, E, Im, H, cs.group, cs.fp8_bo, cs.fp8_bi),
                   up = make_matrix(rng, E, Im, H, cs.group, cs.fp8_bo, cs.fp8_bi),
                   down = make_matrix(rng, E, H, Im, cs.group, cs.fp8_bo, cs.fp8_bi);

  // CPU: routing, then each (token, slot)'s expert MLP, weighted and summed in slot order.
  std::vector<int32_t> idx(size_t(N * K));
  std::vector<float> wts(size_t(N * K));
  cpu::moe_router_forward(idx.data(), wts.data(), logits.data(), cs.bias ? bias.data() : nullptr, N, E, K,
                          cs.scoring, cs.method, cs.n_group,
                          cs.topk_group, cs.norm, cs.scale);
  const auto want = reference_moe(x, idx, wts, gate.f32, up.f32, down.f32, N, H, Im, K);

  cuda::MoeRouting r;
  r.n_experts = int(E), r.top_k = K, r.scoring = cs.scoring, r.method = cs.method, r.n_group = cs.n_group;
  r.topk_group = cs.topk_group, r.norm_topk = cs.norm, r.routed_scale = cs.scale;
  DevMatrix dg(gate), du(up), dd(down);
  float* d_bias = to_dev(bias);
  // Every expert GEMM path: the tensor-core tiles (skinny off), the decode-sized kernel, for
  // bf16 experts CUTLASS's wgmma grouped GEMM where the build has it (their default there),
  // and for int4 experts of group 32 with H and Im multiples of 128 the tensor-core decode
  // kernel (weights as the M operand; several passes over the weights past 32 rows an expert;
  // 16 and 32 weight rows a warp; the gate and up products with the SwiGLU in one pass; the
  // reduction split over a block's warps at 3 tokens and 1), each but the split with the
  // activations staged once a block and loaded by each warp, and with a tile's passes on one
  // block, on a block each at 32 rows a pass (the default) and at every pass size; and for int4
  // experts of group 32 and FP8 experts of K blocks 128 (with H or Im a multiple of 128) and bf16
  // experts (H or Im a multiple of 64) the warpgroup (wgmma) kernel at every size, the products apart and gate | up with the SwiGLU in
  // one pass, each with its grid in groups of 4 tiles (the default), tile-major and
  // weight-block-major.
  enum Path { kTiles, kSkinny, kCutlass, kInt4Mma, kInt4Mma2, kInt4Swiglu, kInt4KSplit, kWgmma, kWgmmaSwiglu };
  const bool cutlass = cs.group == 0 && cs.fp8_bi == 0 && cuda::moe_cutlass_built();
  // The kernel takes a matrix whose I (H for gate and up, Im for down) is a multiple of 128.
  const bool int4_mma = cs.group == 32 && cs.fp8_bi == 0 && (H % 128 == 0 || Im % 128 == 0);
  // The wgmma kernel: int4 of group 32 and FP8 of K blocks 128 with an I of 128s, bf16 with an I
  // of 64s (at least one of the two products).
  const bool wgmma_case = cs.group == 32    ? H % 128 == 0 || Im % 128 == 0
                          : cs.fp8_bi > 0   ? cs.fp8_bi % 128 == 0 && (H % 128 == 0 || Im % 128 == 0)
                          : cs.group == 0   ? H % 64 == 0 || Im % 64 == 0
                                            : false;
  for (const Path path :
       {kTiles, kSkinny, kCutlass, kInt4Mma, kInt4Mma2, kInt4Swiglu, kInt4KSplit, kWgmma, kWgmmaSwiglu}) {
    const bool wgmma = path == kWgmma || path == kWgmmaSwiglu;
    if ((path == kCutlass && !cutlass) || (path >= kInt4Mma && !wgmma && !int4_mma) || (wgmma && !wgmma_case)) continue;
    // 0: defaults; 1: warps load the activations (wgmma: the grid tile-major; CUTLASS: the
    // product transposed, tiles of 128 outputs x 64 rows); 2: one block a tile (wgmma: the grid
    // weight-block-major; CUTLASS: 128 outputs x 128 rows); 3: a block a pass always; 4 (the
    // tiles and the int4 decode kernel): the grid in groups of 3 tiles.
    auto runs = [&](int variant) {
      if (variant == 0) return true;
      if (path == kCutlass || wgmma) return variant <= 2;
      if (variant == 4) return path == kTiles || path == kInt4Mma || path == kInt4Swiglu;
      return path >= kInt4Mma && path != kInt4KSplit;
    };
    for (const int variant : {0, 1, 2, 3, 4}) {
      if (!runs(variant)) continue;
      const int staged = variant != 1, split = variant == 2 ? 0 : variant == 3 ? 2 : 1;
      cuda::moe_grid_group(variant == 4 ? 3 : -1);
      cuda::moe_skinny_max_slots(path == kSkinny ? 1 << 20 : 0);
      cuda::moe_int4_mma_max_slots(path >= kInt4Mma ? 1 << 20 : 0);
      cuda::moe_int4_mma_tiles(path == kInt4Mma2 ? 2 : 1);
      cuda::moe_int4_mma_swiglu(path == kInt4Swiglu || path == kWgmmaSwiglu ? 1 : 0);
      cuda::moe_wgmma_min_slots(wgmma ? 0 : int64_t(1) << 62);  // never: the other kernels stay tested
      cuda::moe_wgmma_group(wgmma && variant == 1 ? 1 : wgmma && variant == 2 ? 1 << 20 : -1);
      cuda::moe_int4_mma_ksplit(path == kInt4KSplit ? 1 << 20 : 0);
      cuda::moe_int4_mma_staged(staged);
      cuda::moe_int4_mma_split(split);
      cuda::moe_cutlass_use(path == kCutlass ? 1 : 0);
      cuda::moe_cutlass_tiles(path == kCutlass ? variant : -1);
      const auto got = run_gpu_moe(xb, logits, cs.bias ? d_bias : nullptr, N, H, r, {dg.m, du.m, dd.m});
      cuda::moe_cutlass_use(-1);
      cuda::moe_cutlass_tiles(-1);
      const char* names[] = {" (tiles)", " (decode-sized kernel)", " (CUTLASS grouped GEMM)", " (int4 tensor-core decode kernel)",
                             " (int4 tensor-core decode kernel, 32 rows a warp)",
                             " (int4 tensor-core decode kernel, gate and up with SwiGLU in one pass)",
                             " (int4 tensor-core decode kernel, reduction split over warps up to 8 tokens)",
                             " (wgmma kernel)", " (wgmma kernel, gate and up with SwiGLU in one pass)"};
      const std::string tag =
          std::string(cs.name) + names[path] +
          (path == kCutlass ? (variant == 1 ? " [128 outputs x 64 rows]" : variant == 2 ? " [128 outputs x 128 rows]" : "")
           : wgmma          ? (variant == 1 ? " [grid tile-major]" : variant == 2 ? " [grid weight-block-major]" : "")
           : variant == 1   ? " [warps load the activations]"
           : variant == 2   ? " [one block a tile]"
           : variant == 3   ? " [a block a pass]"
           : variant == 4   ? " [grid in groups of 3 tiles]"
                            : "");
      EXPECT_EQ(got.idx, idx) << tag << ": routing picked other experts";
      for (size_t i = 0; i < got.weights.size(); ++i)
        EXPECT_NEAR(got.weights[i], wts[i], 1e-5 * std::max(1.f, std::fabs(wts[i]))) << i;
      const double err = talon::testing::rel_err(got.out.data(), want.data(), got.out.size());
      // Both sides round the SwiGLU activations to bf16; where an activation lies at a rounding
      // boundary, fp32 summation-order noise can round it the other way on one side: one bf16 step
      // (2^-8 relative) of one activation times its down-projection weights, measured up to 2e-4
      // of the output's largest value (FP8 on the CUDA-core kernel, 37 tokens). A wrong weight,
      // scale or row gives O(1).
      EXPECT_LE(err, 5e-4) << tag;
      std::printf("cuda moe %s (%s experts, H %lld, Im %lld, %lld tokens): routing %s, output rel err %.2e\n",
                  tag.c_str(), cs.storage(), (long long)H, (long long)Im, (long long)N, got.idx == idx ? "equal" : "DIFFERENT",
                  err);
    }
  }
  cuda::moe_skinny_max_slots(256);
  cuda::moe_int4_mma_max_slots(-1);
  cuda::moe_int4_mma_tiles(0);
  cuda::moe_int4_mma_swiglu(-1);
  cuda::moe_int4_mma_ksplit(-1);
  cuda::moe_int4_mma_staged(-1);
  cuda::moe_int4_mma_split(-1);
  cuda::moe_wgmma_min_slots(-1);
  cuda::moe_wgmma_group(-1);
  cuda::moe_grid_group(-1);
  cudaFree(d_bias);
}

using M = MoeTopk;
constexpr MoeScoring kSoftmax = MoeScoring::Softmax, kSigmoid = MoeScoring::Sigmoid;
INSTANTIATE_TEST_SUITE_P(
    Routings, CudaMoe,
    ::testing::Values(Case{"softmax_greedy_bf16", kSoftmax, M::Greedy, 1, 1, false, false, 1.f, 0},
                      // bf16 with H 192 and Im 320 (multiples of 64: the wgmma kernel's 64-k stages;
                      // 320 rows: a partial last block of weight rows in both products).
                      Case{"softmax_greedy_bf16_wide", kSoftmax, M::Greedy, 1, 1, false, false, 1.f, 0, 0, 0, 192, 320},
                      Case{"softmax_group_limited_int4", kSoftmax, M::GroupLimitedGreedy, 4, 2, false, false, 1.f, 32},
                      Case{"sigmoid_noaux_tc_int4", kSigmoid, M::NoauxTc, 4, 2, true, true, 2.5f, 32},
                      // H and Im multiples of 128: the int4 tensor-core decode kernel takes it too.
                      Case{"sigmoid_noaux_tc_int4_wide", kSigmoid, M::NoauxTc, 4, 2, true, true, 2.5f, 32, 0, 0, 256, 128},
                      // Gate and up on that kernel with a width no block's rows divide (224: the last
                      // block's last warps hold no rows; with staged activations they still copy and
                      // wait); the down product (I 224) on the other kernels.
                      Case{"softmax_greedy_int4_ragged_width", kSoftmax, M::Greedy, 1, 1, false, false, 1.f, 32, 0, 0, 384, 224},
                      Case{"sigmoid_noaux_tc_one_group_bf16", kSigmoid, M::NoauxTc, 1, 1, true, true, 2.827f, 0},
                      // FP8: blocks 16x16 (tensor cores, 16-byte loads); 48x32 with H 112, Im 72 (no
                      // block divides O, partial last K blocks; down's I % 16 != 0: element loads);
                      // K block 24 (the CUDA-core kernel) with H 100.
                      Case{"sigmoid_noaux_tc_fp8_block16", kSigmoid, M::NoauxTc, 4, 2, true, true, 2.5f, 0, 16, 16},
                      Case{"softmax_greedy_fp8_block48x32_ragged", kSoftmax, M::Greedy, 1, 1, false, false, 1.f, 0, 48, 32,
                           112, 72},
                      Case{"softmax_group_limited_fp8_block16x24_core", kSoftmax, M::GroupLimitedGreedy, 4, 2, false, false,
                           1.f, 0, 16, 24, 100, 72},
                      // FP8 of K blocks 128 (DeepSeek-V3's 128 x 128), H and Im multiples of 128: the
                      // wgmma kernel takes it too; row blocks of 64 (two scales in a block's 128
                      // weight rows) with Im 256 (the down product there too).
                      Case{"sigmoid_noaux_tc_fp8_block128", kSigmoid, M::NoauxTc, 4, 2, true, true, 2.5f, 0, 128, 128, 256, 128},
                      Case{"softmax_greedy_fp8_block64x128", kSoftmax, M::Greedy, 1, 1, false, false, 1.f, 0, 64, 128, 384,
                           256}),
    [](const auto& info) { return std::string(info.param.name); });


// Every MoE layer of the DeepSeek-family fixtures (plain, FP8 block and int4 experts) through
// upload_moe_layer: the stacked device layout must compute what the CPU reference's
// dequantizer reads (plain weights rounded to bf16 as uploaded; int4 exact with bf16 scales;
// FP8 exact, e4m3 bytes with fp32 block scales).
TEST(CudaMoe, FixtureLayersMatchTheCpuReference) {
  REQUIRE_GPU();
  int layers = 0;
  for (const std::string fx : {"deepseek_v2", "deepseek_v2_greedy", "deepseek_v3", "deepseek_v3_fp8", "kimi_k2_int4"}) {
    auto ck = open_checkpoint(fs::path(talon::testing::source_dir()) / "tests/fixtures/golden" / fx);
    const ModelConfig& c = ck->config();
    const DeepseekWeights W = bind_deepseek_weights(*ck);
    const int64_t N = 29, H = c.hidden, E = c.ds.n_routed_experts, K = c.ds.num_experts_per_tok;
    for (size_t l = 0; l < W.layers.size(); ++l) {
      const DeepseekLayer& L = W.layers[l];
      if (!L.moe) continue;
      ++layers;
      cuda::DeviceArena arena;
      const cuda::MoeLayerDev d = cuda::upload_moe_layer(L, c, arena);
      const int64_t Im = d.experts.gate.O;
      std::mt19937 rng(uint32_t(l) + 3);
      std::normal_distribution<float> nd(0.f, 1.f);
      std::vector<uint16_t> xb(size_t(N * H));
      std::vector<float> x(xb.size()), logits(size_t(N * E));
      for (size_t i = 0; i < xb.size(); ++i) x[i] = bf16_to_f32(xb[i] = f32_to_bf16(nd(rng)));
      const std::vector<float> router = weight_to_f32(L.router), bias = weight_to_f32(L.router_bias);
      cpu::matmul_forward(logits.data(), x.data(), router.data(), DType::F32, nullptr, N, H, E);
      std::vector<int32_t> idx(size_t(N * K));
      std::vector<float> wts(size_t(N * K));
      const auto& ds = c.ds;
      cpu::moe_router_forward(idx.data(), wts.data(), logits.data(), bias.empty() ? nullptr : bias.data(), N, E, K,
                              ds.scoring_func, ds.topk_method,
                              ds.n_group, ds.topk_group, ds.norm_topk_prob, float(ds.routed_scaling_factor));
      // The experts as the CPU reference dequantizes them, then as stored on the device.
      auto stack = [&](QuantWeight DeepseekMlp::*pick) {
        const int64_t O = (L.experts[0].*pick).rows, I = (L.experts[0].*pick).cols;
        std::vector<float> all(size_t(E * O * I));
        for (int64_t e = 0; e < E; ++e) {
          const QuantWeight& q = L.experts[size_t(e)].*pick;
          dequantize(q, all.data() + e * O * I);
          if (q.kind == QuantWeight::Kind::Plain)
            for (int64_t i = 0; i < O * I; ++i) {
              float& v = all[size_t(e * O * I + i)];
              v = bf16_to_f32(f32_to_bf16(v));
            }
        }
        return all;
      };
      const auto want = reference_moe(x, idx, wts, stack(&DeepseekMlp::gate), stack(&DeepseekMlp::up),
                                      stack(&DeepseekMlp::down), N, H, Im, int(K));
      const auto got = run_gpu_moe(xb, logits, d.router_bias, N, H, d.routing, d.experts);
      EXPECT_EQ(got.idx, idx) << fx << " layer " << l;
      const double err = talon::testing::rel_err(got.out.data(), want.data(), got.out.size());
      EXPECT_LE(err, 1e-4) << fx << " layer " << l;
      std::printf("cuda moe %s layer %zu (%lld experts, top %lld, %s): output rel err %.2e\n", fx.c_str(), l,
                  (long long)E, (long long)K, d.experts.gate.packed ? "int4" : d.experts.gate.fp8 ? "fp8" : "bf16", err);
    }
  }
  EXPECT_GT(layers, 0);
}

// The tile kernels' grid orders (moe_grid_group, and the wgmma kernel's groups): every (tile,
// weight block) pair is computed by exactly one block, padding blocks are idle and fewer than a
// group's worth, neighbours in launch order within a group take the same weight block on
// consecutive tiles, and a group of all the tiles is the plain order. Host arithmetic, no GPU.
TEST(CudaMoeGrid, GroupedOrdersCoverEveryTileAndWeightBlockOnce) {
  for (int64_t gx = 1; gx <= 11; ++gx)
    for (int64_t gy = 1; gy <= 6; ++gy)
      for (const int64_t group : {int64_t(0), int64_t(1), int64_t(2), int64_t(3), int64_t(4), int64_t(7), int64_t(16)}) {
        SCOPED_TRACE("tiles " + std::to_string(gx) + ", weight blocks " + std::to_string(gy) + ", group " +
                     std::to_string(group));
        const cuda::MoeGridLaunch l = cuda::moe_grid_launch(gx, gy, group);
        EXPECT_EQ(l.group, group <= 0 || group >= gx ? 0 : group);
        std::vector<int> seen(size_t(gx * gy), 0);
        int64_t idle = 0;
        std::pair<int64_t, int64_t> prev{-1, -1};
        for (int64_t b = 0; b < l.blocks; ++b) {
          const auto [x, y] = cuda::moe_grid_block(b, gx, gy, l.group);
          ASSERT_GE(x, 0);
          ASSERT_GE(y, 0);
          ASSERT_LT(y, gy);
          if (x < gx)
            ++seen[size_t(x * gy + y)];
          else
            ++idle;
          if (l.group > 0 && b % l.group != 0) {  // within a group: the next tile, the same weight block
            EXPECT_EQ(x, prev.first + 1) << "block " << b;
            EXPECT_EQ(y, prev.second) << "block " << b;
          }
          prev = {x, y};
        }
        for (size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i], 1) << "tile " << i / size_t(gy) << ", block " << i % size_t(gy);
        EXPECT_EQ(idle, l.blocks - gx * gy);
        EXPECT_LT(idle, std::max<int64_t>(1, l.group) * gy);
        // A group of every tile (the wgmma kernel's weight-block-major order) is the plain order.
        for (int64_t b = 0; b < gx * gy; ++b) {
          const auto [x, y] = cuda::moe_grid_block(b, gx, gy, gx);
          EXPECT_EQ(x, b % gx);
          EXPECT_EQ(y, b / gx);
        }
      }
}

// The wgmma kernel's shared-memory descriptors against CUTLASS's own builder (cute's
// make_gmma_desc for the same K-major core-matrix layout): leading / stride byte offsets and
// layout type (no swizzle) equal; the start address field is checked apart (cute has none to give
// on the host). Host arithmetic, no GPU; needs the CUTLASS headers.
TEST(CudaWgmma, DescriptorsMatchCutlass) {
  if (!cuda::moe_cutlass_built()) GTEST_SKIP() << "built without CUTLASS's headers";
  for (const int form : {0, 1, 2}) {
    const int sbo = cuda::moe_wgmma_stage_sbo(form);
    SCOPED_TRACE("weights form " + std::to_string(form) + ", sbo " + std::to_string(sbo));
    ::testing::internal::CaptureStdout();  // cute's host path prints that it has no shared address
    const uint64_t want = cuda::moe_cutlass_k_major_desc(sbo);
    ::testing::internal::GetCapturedStdout();
    EXPECT_EQ(cuda::moe_wgmma_k_major_desc(0, sbo), want);
    // The start address: bits 0-13, in 16-byte units.
    EXPECT_EQ(cuda::moe_wgmma_k_major_desc(0x12340, sbo), want | (0x12340u >> 4));
  }
}

// One wgmma m64n64k16 from the expert kernel's pieces, alone (moe_wgmma_probe), A from registers
// and from shared memory, against the CPU: every one of the 64 x 64 outputs equals the fp32 sum
// of its 16 bf16 products (exact small integers, so any order gives the same bits).
TEST(CudaWgmma, ProbeMatchesTheCpu) {
  REQUIRE_GPU();
  std::mt19937 rng(11);
  std::vector<uint16_t> a(64 * 16), b(64 * 16);
  std::vector<float> af(a.size()), bf(b.size());
  for (size_t i = 0; i < a.size(); ++i) af[i] = bf16_to_f32(a[i] = f32_to_bf16(float(int(rng() % 17) - 8)));
  for (size_t i = 0; i < b.size(); ++i) bf[i] = bf16_to_f32(b[i] = f32_to_bf16(float(int(rng() % 17) - 8)));
  for (const bool a_in_smem : {false, true}) {
    SCOPED_TRACE(a_in_smem ? "A from shared memory" : "A from registers");
    const std::vector<float> d = cuda::moe_wgmma_probe(a, b, a_in_smem);
    int wrong = 0;
    for (int m = 0; m < 64; ++m)
      for (int n = 0; n < 64; ++n) {
        float want = 0.f;
        for (int k = 0; k < 16; ++k) want += af[size_t(m * 16 + k)] * bf[size_t(n * 16 + k)];
        if (!(d[size_t(m * 64 + n)] == want) && ++wrong <= 5)
          ADD_FAILURE() << "d[" << m << "][" << n << "] = " << d[size_t(m * 64 + n)] << ", expected " << want;
      }
    EXPECT_EQ(wrong, 0);
  }
}

// The fragment layouts the wgmma kernel converts its A operand into and stores its accumulators
// from, against CUTLASS's definitions (cute's ALayout_64x16 and CLayout_64x64): the same (row, k)
// for each of a warpgroup's 128 x 8 A values and (row, column) for its 128 x 32 accumulator
// values, and both cover their tiles once. Host arithmetic, no GPU; needs the CUTLASS headers.
TEST(CudaWgmma, FragmentLayoutsMatchCutlass) {
  if (!cuda::moe_cutlass_built()) GTEST_SKIP() << "built without CUTLASS's headers";
  std::vector<int> a_seen(64 * 16, 0), d_seen(64 * 64, 0);
  for (int tid = 0; tid < 128; ++tid) {
    for (int v = 0; v < 8; ++v) {
      const auto got = cuda::moe_wgmma_a_coord(tid, v), want = cuda::moe_cutlass_gmma_a_coord(tid, v);
      EXPECT_EQ(got, want) << "A: thread " << tid << ", value " << v;
      ++a_seen[size_t(got.first * 16 + got.second)];
    }
    for (int i = 0; i < 32; ++i) {
      const auto got = cuda::moe_wgmma_d_coord(tid, i), want = cuda::moe_cutlass_gmma_d_coord(tid, i);
      EXPECT_EQ(got, want) << "D: thread " << tid << ", value " << i;
      ++d_seen[size_t(got.first * 64 + got.second)];
    }
  }
  for (int c : a_seen) EXPECT_EQ(c, 1);
  for (int c : d_seen) EXPECT_EQ(c, 1);
}

}  // namespace
#endif  // TALON_HAVE_CUDA
