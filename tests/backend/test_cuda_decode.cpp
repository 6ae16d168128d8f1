// The CUDA cached decoder against the CPU one (model/decode.h) on the golden fixtures:
// both run the same requests and commits side by side and every logit row and capture is
// compared (bf16 vs fp32 tolerance): chain prefill and token-by-token decoding of several
// slots at once, trees (also wider than one 64-bit mask word), commits of a path followed
// by more decoding, a sliding window, long contexts (attention split over keys), greedy
// decoding, malformed requests and a cache that does not fit. Skips without a GPU.
#include <limits>
#include <gtest/gtest.h>

#ifdef TALON_HAVE_CUDA
#include <cuda_runtime.h>

#include "tests/gpu_test.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <regex>

#include "backend/backend.h"
#include "backend/cuda/cuda_decoder.h"
#include "backend/cuda/decode_ops.h"
#include "backend/cuda/decode_slots.h"
#include "backend/cuda/ops.h"
#include "model/decode.h"
#include "model/model.h"
#include "model/random_checkpoint.h"
#include "tests/cuda_harness.h"
#include "tests/decode_checks.h"
#include "tests/sampling_reference.h"
#include "tests/test_util.h"
#include "tests/tolerances.h"
#include "util/error.h"

using namespace talon;
using namespace talon::testing;

namespace {



std::vector<int32_t> random_ids(std::mt19937& rng, int64_t n, int64_t V) {
  std::uniform_int_distribution<int32_t> d(0, int32_t(V - 1));
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(rng);
  return v;
}

int64_t logit_rows(const std::vector<DecodeRequest>& reqs) {
  int64_t n = 0;
  for (auto& r : reqs) n += r.all_logits ? int64_t(r.tokens.size()) : 1;
  return n;
}

// Whether a model routes tokens to experts (a DeepSeek-family model with MoE layers).
bool routes(const ModelConfig& c) { return is_deepseek(c.arch) && c.ds.first_k_dense_replace < c.n_layers; }

// The CPU reference and the CUDA decoder driven in lockstep.
// Rows of a model that routes to experts are held to the tolerance only in bulk: routing is
// discrete, and where a token's k-th and (k+1)-th expert scores are closer than the bf16
// rounding of the GPU's residual stream (~1e-2 relative), the two sides pick different experts
// and that row (and the rows attending to it) differ by O(1). Such rows are counted, and at most
// kMaxFlipRows of all compared rows may exceed the tolerance (the dense-layer variants of
// DeepSeekLatentSizesOnRandomModels hold MLA itself to every row).
struct Twin {
  static constexpr double kMaxFlipRows = 0.1;
  std::unique_ptr<Decoder> cpu, gpu;
  bool bulk = false;
  int64_t rows = 0, over = 0;
  const ModelConfig& c() const { return cpu->config(); }
  Twin(const Checkpoint& ck, int slots, int64_t max_len, int64_t cache_tokens = 0)
      : cpu(make_cpu_decoder(ck, slots, max_len, cache_tokens)), gpu(make_cuda_decoder(ck, 0, slots, max_len, cache_tokens)),
        bulk(routes(ck.config())) {}
  // Against another GPU decoder (a tensor-parallel group).
  Twin(const Checkpoint& ck, int slots, int64_t max_len, std::unique_ptr<Decoder> other)
      : cpu(make_cpu_decoder(ck, slots, max_len)), gpu(std::move(other)), bulk(routes(ck.config())) {}
  ~Twin() {
    if (!bulk || rows == 0) return;
    EXPECT_LE(double(over), kMaxFlipRows * double(rows)) << over << " of " << rows << " rows beyond the tolerance";
    std::printf("cuda decode (experts routed): %lld of %lld rows beyond %.2f\n", (long long)over, (long long)rows,
                tol::kCudaDecodeRel);
  }
  void check(double err, const std::string& what) {
    ++rows;
    if (!bulk) {
      EXPECT_LE(err, tol::kCudaDecodeRel) << what;
      return;
    }
    over += err > tol::kCudaDecodeRel;
  }

  // Runs the requests on both, capturing `layer` (F32 or BF16 on the GPU side), and checks
  // every logit row and capture row; returns the CPU's logits.
  std::vector<float> forward(const std::vector<DecodeRequest>& reqs, const std::string& what, int layer = -1,
                             DType cap_dtype = DType::F32) {
    const int64_t V = c().vocab, H = c().hidden, NL = logit_rows(reqs);
    int64_t N = 0;
    for (auto& r : reqs) N += int64_t(r.tokens.size());
    std::vector<float> la(size_t(NL * V)), lb(size_t(NL * V), NAN), ha(size_t(N * H));
    std::vector<float> hb(size_t(N * H), NAN);
    std::vector<uint16_t> hb16(size_t(N * H), 0x7fc1);
    Capture ca, cb;
    if (layer >= 0) {
      ca = Capture({layer}, {ha.data()});
      cb = Capture({layer}, {hb.data()});
      if (cap_dtype == DType::BF16) {
        cb.dtype = DType::BF16;
        cb.out[0] = hb16.data();
      }
    }
    cpu->forward(reqs, ca, la.data());
    gpu->forward(reqs, cb, lb.data());
    for (int64_t r = 0; r < NL; ++r)
      check(rel_err(lb.data() + r * V, la.data() + r * V, size_t(V)), what + ": logit row " + std::to_string(r));
    if (layer >= 0) {
      if (cap_dtype == DType::BF16)
        for (size_t i = 0; i < hb.size(); ++i) hb[i] = bf16_to_f32(hb16[i]);
      for (int64_t r = 0; r < N; ++r)
        check(rel_err(hb.data() + r * H, ha.data() + r * H, size_t(H)), what + ": capture row " + std::to_string(r));
    }
    return la;
  }
  void commit(int slot, const std::vector<int32_t>& keep) {
    cpu->commit(slot, keep);
    gpu->commit(slot, keep);
    EXPECT_EQ(gpu->length(slot), cpu->length(slot));
  }
  void commit_all(int slot) {
    cpu->commit_all(slot);
    gpu->commit_all(slot);
    EXPECT_EQ(gpu->length(slot), cpu->length(slot));
  }
};

// Three slots against the CPU decoder (random ids from `seed`): prefills of slot 0 (all
// logits, capture of layer 1) and slot 2 (last logits); a chunk of prefill onto the empty slot
// 1 beside a decode step on slot 0 and a 6-node tree on slot 2 (bf16 capture of layer 2), a
// path of the tree kept; optionally a second chunk onto slot 1; then one-token steps of all.
void run_three_slot_scenario(Twin& t, int64_t V, const std::string& tag, uint32_t seed, int64_t prefill0,
                             int64_t prefill2, int64_t second_chunk, int steps) {
  std::mt19937 rng(seed);
  t.forward({{0, random_ids(rng, prefill0, V), {}, true}, {2, random_ids(rng, prefill2, V), {}, false}},
            tag + "prefill", 1);
  t.commit_all(0);
  t.commit_all(2);
  t.forward({{0, random_ids(rng, 1, V), {}, true}, {1, random_ids(rng, 90, V), {}, true},
             {2, random_ids(rng, 6, V), {-1, 0, 0, 1, 3, 3}, true}},
            tag + "mixed", 2, DType::BF16);
  t.commit_all(0);
  t.commit_all(1);
  t.commit(2, {0, 1, 3, 5});
  if (second_chunk > 0) {
    t.forward({{1, random_ids(rng, second_chunk, V), {}, false}}, tag + "second chunk");
    t.commit_all(1);
  }
  for (int step = 0; step < steps; ++step) {
    std::vector<DecodeRequest> reqs;
    for (int s = 0; s < 3; ++s) reqs.push_back({s, random_ids(rng, 1, V), {}, true});
    t.forward(reqs, tag + "step " + std::to_string(step));
    for (int s = 0; s < 3; ++s) t.commit_all(s);
  }
}

class CudaDecode : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaDecode, ChainPrefillAndTokenByTokenDecodingOfSeveralSlots) {
  REQUIRE_GPU();
  auto ck = open_checkpoint(golden_fixture(GetParam()));
  Twin t(*ck, 4, 64);
  const int64_t V = t.c().vocab;
  const int layer = int(t.c().n_layers / 2);
  std::mt19937 rng(5);
  // Slots prefilled with different lengths (one with all logits), slot 2 left empty for now.
  t.forward({{0, random_ids(rng, 7, V), {}, false}, {1, random_ids(rng, 12, V), {}, true},
             {3, random_ids(rng, 1, V), {}, false}},
            "prefill", layer);
  for (int s : {0, 1, 3}) t.commit_all(s);
  for (int step = 0; step < 16; ++step) {
    std::vector<DecodeRequest> reqs;
    for (int s : {3, 0, 1}) reqs.push_back({s, random_ids(rng, 1, V), {}, true});
    if (step == 4) reqs.push_back({2, random_ids(rng, 9, V), {}, false});  // a prefill joins mid-way
    if (step > 4) reqs.push_back({2, random_ids(rng, 1, V), {}, true});
    t.forward(reqs, "step " + std::to_string(step), layer, step % 2 ? DType::BF16 : DType::F32);
    for (auto& r : reqs) t.commit_all(r.slot);
    if (step == 10) {  // a slot emptied and refilled
      t.cpu->reset(1);
      t.gpu->reset(1);
      EXPECT_EQ(t.gpu->length(1), 0);
      t.forward({{1, random_ids(rng, 5, V), {}, false}}, "refill");
      t.commit_all(1);
    }
  }
}

// A paged cache smaller than its slots' max_len (model/kv_pages.h): 4 slots of up to 300 tokens
// share 512 rows (8 pages of 64). Slots grow across page boundaries in turn, are reset and
// refilled (their pages then come back in another order, so no slot's rows are contiguous), a
// tree is verified and a path committed across a page boundary, against the CPU decoder with
// the same capacity. A forward past the capacity is refused on both sides, naming the full
// cache, and changes nothing: the same slots decode on afterwards.
TEST_P(CudaDecode, SlotsShareAPagedCacheSmallerThanTheirMaxLen) {
  REQUIRE_GPU();
  auto ck = open_checkpoint(golden_fixture(GetParam()));
  Twin t(*ck, 4, 300, 512);
  EXPECT_EQ(t.gpu->cache_capacity(), 512);
  EXPECT_EQ(t.gpu->page_rows(), cuda::kPageRows);
  const int64_t V = t.c().vocab;
  std::mt19937 rng(41);
  t.forward({{0, random_ids(rng, 70, V), {}, false}, {1, random_ids(rng, 50, V), {}, true}}, "prefill");
  t.commit_all(0);
  t.commit_all(1);
  for (int step = 0; step < 20; ++step) {  // slot 1 crosses into its second page
    t.forward({{1, random_ids(rng, 1, V), {}, true}, {0, random_ids(rng, 1, V), {}, true}}, "step " + std::to_string(step));
    t.commit_all(0);
    t.commit_all(1);
  }
  t.cpu->reset(0);
  t.gpu->reset(0);
  t.forward({{2, random_ids(rng, 140, V), {}, false}, {3, random_ids(rng, 60, V), {}, true}}, "refill");
  t.commit_all(2);
  t.commit_all(3);
  // A 6-node tree on slot 3 (60 committed: its pending rows straddle the page boundary).
  const std::vector<int32_t> parents = {-1, 0, 0, 1, 3, 2};
  t.forward({{3, random_ids(rng, 6, V), parents, true}, {2, random_ids(rng, 1, V), {}, true}}, "tree");
  t.commit(3, {0, 1, 3, 4});
  t.commit_all(2);
  const std::string cpu_err = error_of([&] { t.cpu->forward({{0, random_ids(rng, 290, V), {}, false}}, Capture{}, nullptr); });
  const std::string gpu_err = error_of([&] { t.gpu->forward({{0, random_ids(rng, 290, V), {}, false}}, Capture{}, nullptr); });
  EXPECT_NE(cpu_err.find("the KV cache is full"), std::string::npos) << cpu_err;
  EXPECT_NE(gpu_err.find("the KV cache is full"), std::string::npos) << gpu_err;
  EXPECT_EQ(t.gpu->length(0), 0);
  for (int step = 0; step < 12; ++step) {
    std::vector<DecodeRequest> reqs;
    for (int s : {1, 2, 3}) reqs.push_back({s, random_ids(rng, 1, V), {}, true});
    if (step == 3) reqs.push_back({0, random_ids(rng, 30, V), {}, true});
    if (step > 3) reqs.push_back({0, random_ids(rng, 1, V), {}, true});
    t.forward(reqs, "after the refusal, step " + std::to_string(step));
    for (auto& r : reqs) t.commit_all(r.slot);
  }
}

TEST_P(CudaDecode, TreesCommitsAndDecodingAfterwards) {
  REQUIRE_GPU();
  auto ck = open_checkpoint(golden_fixture(GetParam()));
  Twin t(*ck, 2, 160);
  const int64_t V = t.c().vocab;
  std::mt19937 rng(11);
  t.forward({{0, random_ids(rng, 9, V), {}, false}, {1, random_ids(rng, 4, V), {}, false}}, "prefill");
  t.commit_all(0);
  t.commit_all(1);
  // A 10-node tree on slot 0 beside a 3-token chain on slot 1.
  const std::vector<int32_t> parents = {-1, 0, 0, -1, 1, 1, 3, 4, 6, 2};
  t.forward({{0, random_ids(rng, 10, V), parents, true}, {1, random_ids(rng, 3, V), {}, true}}, "tree", 1);
  t.commit(0, {0, 1, 4, 7});
  t.commit(1, {0, 1});
  for (int step = 0; step < 3; ++step) {
    t.forward({{0, random_ids(rng, 1, V), {}, true}, {1, random_ids(rng, 1, V), {}, true}},
              "after the commit " + std::to_string(step));
    t.commit_all(0);
    t.commit_all(1);
  }
  // Dropping every pending token, then more.
  t.forward({{0, random_ids(rng, 3, V), {}, true}}, "to drop");
  t.commit(0, {});
  t.forward({{0, random_ids(rng, 2, V), {}, true}}, "after the drop");
  t.commit(0, {0});
  // A tree of 100 nodes (two 64-bit mask words per deep row), random shape.
  std::vector<int32_t> big(100);
  for (int i = 0; i < 100; ++i) big[size_t(i)] = i == 0 ? -1 : int32_t(rng() % uint32_t(i + 1)) - 1;
  t.forward({{1, random_ids(rng, 100, V), big, true}}, "big tree");
  std::vector<int32_t> path;  // root to node 99
  for (int32_t a = 99; a >= 0; a = big[size_t(a)]) path.insert(path.begin(), a);
  t.commit(1, path);
  t.forward({{1, random_ids(rng, 1, V), {}, true}}, "after the big tree");
  t.commit_all(1);
}

TEST_P(CudaDecode, LongContextSplitsTheKeys) {
  REQUIRE_GPU();
  auto ck = open_checkpoint(golden_fixture(GetParam()));
  Twin t(*ck, 2, 800);
  const int64_t V = t.c().vocab;
  std::mt19937 rng(17);
  t.forward({{0, random_ids(rng, 700, V), {}, false}}, "long prefill");
  t.commit_all(0);
  t.forward({{1, random_ids(rng, 130, V), {}, false}}, "second prefill");
  t.commit_all(1);
  for (int step = 0; step < 4; ++step) {
    t.forward({{0, random_ids(rng, 1, V), {}, true}, {1, random_ids(rng, 1, V), {}, true}},
              "step " + std::to_string(step));
    t.commit_all(0);
    t.commit_all(1);
  }
  t.forward({{0, random_ids(rng, 5, V), {-1, 0, 0, 1, 3}, true}}, "tree on a long context");
  t.commit(0, {0, 1, 3});
  t.forward({{0, random_ids(rng, 1, V), {}, true}}, "after");
}

// Greedy decoding of 32 tokens on 3 slots: where the CPU's top-2 logit margin is clear the
// GPU picks the same token; both continue with the CPU's token, so one close call does not
// end the comparison.
TEST_P(CudaDecode, GreedyDecodingPicksTheSameTokens) {
  REQUIRE_GPU();
  auto ck = open_checkpoint(golden_fixture(GetParam()));
  Twin t(*ck, 3, 64);
  const int64_t V = t.c().vocab;
  std::mt19937 rng(23);
  std::vector<DecodeRequest> reqs;
  for (int s = 0; s < 3; ++s) reqs.push_back({s, random_ids(rng, 4 + 3 * s, V), {}, false});
  int agree = 0, checked = 0;
  for (int step = 0; step < 32; ++step) {
    std::vector<float> lb(size_t(3 * V));
    std::vector<float> la(size_t(3 * V));
    t.cpu->forward(reqs, Capture{}, la.data());
    t.gpu->forward(reqs, Capture{}, lb.data());
    for (int s = 0; s < 3; ++s) {
      t.commit_all(s);
      const float* a = la.data() + s * V;
      const float* b = lb.data() + s * V;
      std::vector<float> sorted(a, a + V);
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
      const int32_t want = int32_t(std::max_element(a, a + V) - a), got = int32_t(std::max_element(b, b + V) - b);
      if (sorted[0] - sorted[1] >= tol::kCudaGreedyMargin) {
        ++checked;
        agree += got == want;
        if (!routes(t.c())) {
          EXPECT_EQ(got, want) << "slot " << s << ", step " << step;
        }
      }
      reqs[size_t(s)] = {s, {want}, {}, true};
    }
  }
  std::printf("cuda decode %s: greedy agree %d/%d (margin >= %.2f)\n", GetParam().c_str(), agree, checked,
              tol::kCudaGreedyMargin);
  // With experts routed, a near-tie routing choice can move a clear margin (see Twin).
  if (routes(t.c())) {
    EXPECT_GE(double(agree), (1.0 - Twin::kMaxFlipRows) * double(checked));
  }
}

// One-token steps of one slot, where the layers fold their norms, SwiGLU and residual adds
// into the skinny products (the fixtures are small enough), and the same steps with folding
// off: both against the CPU decoder, and the two GPU paths may differ only by rounding.
TEST_P(CudaDecode, OneTokenStepsFoldedOrNotMatchTheCpu) {
  REQUIRE_GPU();
  auto ck = open_checkpoint(golden_fixture(GetParam()));
  if (is_deepseek(ck->config().arch)) GTEST_SKIP() << "the DeepSeek-family decoder has no folded one-token layers";
  Twin t(*ck, 1, 64);
  auto plain = make_cuda_decoder(*ck, 0, 1, 64);
  cuda::decoder_fold_one_token(*plain, false);
  const int64_t V = t.c().vocab;
  const int layer = int(t.c().n_layers / 2);
  std::mt19937 rng(53);
  std::vector<int32_t> history = random_ids(rng, 6, V);
  t.forward({{0, history, {}, false}}, "prefill", layer);
  plain->forward({{0, history, {}, false}}, Capture{}, nullptr);
  t.commit_all(0);
  plain->commit_all(0);
  for (int i = 0; i < 12; ++i) {
    const std::vector<DecodeRequest> reqs = {{0, random_ids(rng, 1, V), {}, true}};
    const std::string what = "step " + std::to_string(i);
    std::vector<float> lp(static_cast<size_t>(V));
    plain->forward(reqs, Capture{}, lp.data());
    const std::vector<float> lc = t.forward(reqs, what, layer);  // the folded GPU path vs the CPU
    EXPECT_LE(rel_err(lp.data(), lc.data(), size_t(V)), tol::kCudaDecodeRel) << what << ": unfolded logits";
    t.commit_all(0);
    plain->commit_all(0);
  }
}

// Replayed CUDA graphs against eager launches, and greedy ids picked on the device against
// the host's argmax of the logits: two CUDA decoders run the same requests (repeated shapes:
// one-token steps of three slots, chain-4 verifies, a 7-node tree, captures in both dtypes,
// a context growing past a power of two), one with graphs and every kernel of the decode path a
// dependent launch (launch.cuh: resident before the kernel it waits for ends), one eager with
// each kernel launched only once the one before it has ended; logits and captures must be
// bit-identical (same kernels, same arguments: a kernel that read its input before its
// grid_dependency_wait would show here as differing bits), and every few steps the
// graph decoder gives ids only, which must equal the argmax (ties to the lower id) of the
// other's logits, or the ids the sampling oracle draws from them (tests/sampling_reference.h).
TEST_P(CudaDecode, GraphReplayAndDeviceArgmaxMatchEagerLaunches) {
  REQUIRE_GPU();
  cuda::set_dependent_launches(cuda::kDependAll);
  struct Restore {
    ~Restore() { cuda::set_dependent_launches(cuda::kDependDefault); }
  } restore;
  auto ck = open_checkpoint(golden_fixture(GetParam()));
  auto ga = make_cuda_decoder(*ck, 0, 3, 160), gb = make_cuda_decoder(*ck, 0, 3, 160);
  cuda::decoder_use_graphs(*gb, false);
  // The graph decoder's forwards in parts of one layer (graph_cache.h), launched one after
  // the other: the same launches, so the same bits.
  cuda::decoder_graph_layers(*ga, 1);
  const ModelConfig& c = ga->config();
  const int64_t V = c.vocab, H = c.hidden;
  const int layer = int(c.n_layers / 2);
  std::mt19937 rng(41);
  int greedy_rows = 0;
  // mode 0: logits from both; 1: greedy ids from ga; 2: sampled ids from ga (parameters
  // changing from call to call, so a replayed graph must read them as inputs).
  int sampled_rows = 0, sample_call = 0;
  auto both = [&](const std::vector<DecodeRequest>& reqs, const std::string& what, int mode, DType dt) {
    const bool greedy = mode == 1;
    const int64_t NL = logit_rows(reqs);
    int64_t N = 0;
    for (auto& r : reqs) N += int64_t(r.tokens.size());
    const size_t esz = dt == DType::BF16 ? 2 : 4;
    std::vector<uint8_t> ca(size_t(N * H) * esz, 0xa5), cb(size_t(N * H) * esz, 0x5a);
    Capture pa({layer}, {reinterpret_cast<float*>(ca.data())}), pb({layer}, {reinterpret_cast<float*>(cb.data())});
    pa.dtype = pb.dtype = dt;
    std::vector<float> lb(size_t(NL * V), NAN);
    cuda::set_dependent_launches(0);
    gb->forward(reqs, pb, lb.data());
    cuda::set_dependent_launches(cuda::kDependAll);
    if (greedy) {
      std::vector<int32_t> ids(size_t(NL), -1);
      ga->forward_greedy(reqs, pa, ids.data());
      for (int64_t r = 0; r < NL; ++r) {
        const float* l = lb.data() + r * V;
        int64_t best = 0;
        for (int64_t i = 1; i < V; ++i)
          if (l[i] > l[best]) best = i;
        EXPECT_EQ(ids[size_t(r)], int32_t(best)) << what << ": greedy row " << r;
        ++greedy_rows;
      }
    } else if (mode == 2) {
      struct P {
        double t;
        int64_t k;
        double p;
      };
      const P sets[] = {{0.7, 0, 1}, {1.0, 0, 0.9}, {1.5, 40, 1}, {0.5, 10, 0.8}};
      const P prm = sets[sample_call++ % 4];
      SamplingParams sp;
      sp.temperature = prm.t, sp.top_k = prm.k, sp.top_p = prm.p;
      std::vector<double> u(static_cast<size_t>(NL));
      for (int64_t r = 0; r < NL; ++r) u[size_t(r)] = uniform01(3, uint64_t(sample_call), uint64_t(r));
      std::vector<int32_t> ids(size_t(NL), -1);
      ga->forward_sample(reqs, pa, sp, u.data(), ids.data());
      for (int64_t r = 0; r < NL; ++r) {
        const auto want = reference_draw(lb.data() + r * V, V, prm.t, prm.k, prm.p, u[size_t(r)]);
        if (!want.ambiguous) {
          EXPECT_EQ(ids[size_t(r)], want.id) << what << ": sampled row " << r;
        }
        ++sampled_rows;
      }
    } else {
      std::vector<float> la(size_t(NL * V), NAN);
      ga->forward(reqs, pa, la.data());
      EXPECT_EQ(std::memcmp(la.data(), lb.data(), la.size() * 4), 0) << what << ": logits differ";
    }
    EXPECT_EQ(std::memcmp(ca.data(), cb.data(), ca.size()), 0) << what << ": captures differ";
  };
  auto commit = [&](int slot, const std::vector<int32_t>& keep) {
    ga->commit(slot, keep);
    gb->commit(slot, keep);
  };
  both({{0, random_ids(rng, 5, V), {}, false}, {1, random_ids(rng, 9, V), {}, true}, {2, random_ids(rng, 2, V), {}, false}},
       "prefill", 0, DType::F32);
  for (int s = 0; s < 3; ++s) {
    ga->commit_all(s);
    gb->commit_all(s);
  }
  for (int step = 0; step < 40; ++step) {
    const std::string what = "step " + std::to_string(step);
    const DType dt = step % 3 == 0 ? DType::BF16 : DType::F32;
    if (step % 8 == 7) {
      // A chain-4 verify on slot 0 and a 7-node tree on slot 2; keep a path of each.
      both({{0, random_ids(rng, 4, V), {}, true}, {2, random_ids(rng, 7, V), {-1, 0, 0, 1, 1, 2, 4}, true}}, what,
           step % 16 == 15 ? 1 : step % 16 == 7 ? 2 : 0, dt);
      commit(0, {0, 1});
      commit(2, {0, 1, 4, 6});
      continue;
    }
    std::vector<DecodeRequest> reqs;
    for (int s = 0; s < 3; ++s) reqs.push_back({s, random_ids(rng, 1, V), {}, true});
    both(reqs, what, step % 4 == 1 ? 1 : step % 4 == 3 ? 2 : 0, dt);
    for (int s = 0; s < 3; ++s) commit(s, {0});
  }
  // Logits, greedy ids and sampled ids are three graphs of each step shape.
  EXPECT_GT(cuda::decoder_graph_launches(*ga), 12) << "the repeated shapes should have replayed graphs";
  EXPECT_EQ(cuda::decoder_graph_parts(*ga), size_t(c.n_layers)) << "one graph per layer";
  EXPECT_EQ(cuda::decoder_graph_launches(*gb), 0);
  EXPECT_GT(greedy_rows, 20);
  EXPECT_GT(sampled_rows, 20);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaDecode,
                         ::testing::Values("llama_gqa", "llama_tied", "qwen2", "qwen3", "mistral"));
// The DeepSeek family (cuda_deepseek_decoder.cpp: MLA absorbed over a latent cache, MoE):
// plain, without q LoRA, FP8-block and int4 experts.
INSTANTIATE_TEST_SUITE_P(DeepSeek, CudaDecode,
                         ::testing::Values("deepseek_v2", "deepseek_v3", "deepseek_v3_noqlora", "deepseek_v3_fp8",
                                           "kimi_k2_int4"));

// The latent sizes of DeepSeek-V3 / Kimi-K2 (kv LoRA 512, rope 64, nope 128, v 128: 576 values a
// cached token, 16-byte loads) with 16 heads (the attention kernel's widest head group) and
// narrow other widths, against the CPU decoder: long prefills (the keys cut into splits), a
// chunk onto a non-empty slot beside a step and a tree, then steps; and a 32-head variant
// without q LoRA; every layer dense (each row checked) and with MoE layers (int4, bf16 experts).
// Parallel decoding of the DeepSeek family (decoder_group.cpp), two ranks sharing this GPU
// (device-copy collectives), against the CPU decoder. Tensor parallel: each rank with half the
// heads, half of every MLP and its window of routed experts, every request on both. Expert
// parallel: attention replicated, slots 0-1 on rank 0 and slot 2 on rank 1 (so one-slot
// forwards leave a rank with no request, which must still serve its experts), rows coming back
// in request order. Both: the three-slot scenario (prefills, a tree and a kept path, chunks,
// captures), greedy ids picked on the device, and malformed requests refused by the group's
// host mirror before any rank runs, after which it still decodes.
TEST(CudaDecode, ParallelDeepSeekGroupsMatchTheCpu) {
  REQUIRE_GPU();
  for (const char* fx : {"deepseek_v3", "kimi_k2_int4"})
  for (const bool ep : {false, true}) {
    auto ck = open_checkpoint(golden_fixture(fx));
    GpuOptions go;
    go.devices = {0, 0};
    (ep ? go.ep : go.tp) = 2;
    go.share_devices = true;
    const std::string tag = std::string(fx) + (ep ? " ep 2: " : " tp 2: ");
    auto group = make_cuda_decoder(*ck, go, 3, 300);
    EXPECT_NE(group->backend().find(ep ? "ep 2" : "tp 2"), std::string::npos) << group->backend();
    Twin t(*ck, 3, 300, std::move(group));
    const int64_t V = t.c().vocab;
    run_three_slot_scenario(t, V, tag, 53, 90, 30, 40, 5);
    // Requests out of slot order (rank 1's first): rows must come back in request order.
    {
      std::mt19937 r2(4);
      t.forward({{2, random_ids(r2, 1, V), {}, true}, {0, random_ids(r2, 1, V), {}, true}}, tag + "out of order", 1);
      t.commit_all(2);
      t.commit_all(0);
      t.forward({{1, random_ids(r2, 2, V), {}, true}}, tag + "one slot of rank 0");
      t.commit_all(1);
    }
    {  // refusals by the host mirror leave the group's collectives usable (the helper decodes after them)
      auto small = make_cuda_decoder(*ck, go, 2, 8);
      expect_malformed_requests_refused(*small);
      std::vector<int32_t> id(1, -1);
      small->forward_greedy({{0, {5, 6, 7}, {}, false}}, Capture{}, id.data());
      EXPECT_GE(id[0], 0) << tag;
    }
    std::mt19937 rng(8);
    for (int s = 0; s < 3; ++s) {
      t.cpu->reset(s);
      t.gpu->reset(s);
    }
    std::vector<DecodeRequest> reqs;
    for (int s = 0; s < 3; ++s) reqs.push_back({s, random_ids(rng, 10 + 7 * s, V), {}, false});
    t.forward(reqs, tag + "refilled");
    for (int s = 0; s < 3; ++s) t.commit_all(s);
    // Greedy ids from rank 0 against the CPU's argmax where the margin is clear.
    int checked = 0, agree = 0;
    for (int step = 0; step < 8; ++step) {
      reqs.clear();
      for (int s = 0; s < 3; ++s) reqs.push_back({s, random_ids(rng, 1, V), {}, true});
      std::vector<float> la(size_t(3 * V));
      std::vector<int32_t> ids(3, -1);
      t.cpu->forward(reqs, Capture{}, la.data());
      t.gpu->forward_greedy(reqs, Capture{}, ids.data());
      for (int s = 0; s < 3; ++s) {
        t.commit_all(s);
        const float* a = la.data() + s * V;
        std::vector<float> sorted(a, a + V);
        std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
        if (sorted[0] - sorted[1] < tol::kCudaGreedyMargin) continue;
        ++checked;
        agree += ids[size_t(s)] == int32_t(std::max_element(a, a + V) - a);
      }
    }
    EXPECT_GT(checked, 6) << tag;
    EXPECT_GE(agree, checked - 1) << tag << "routed experts may flip one clear row at most";
  }
}

// Speculative sampling of a chain decided on the device (the default: accept.cu) against
// the host's decision (Decoder::forward_accept_chain's default) on the same GPU forwards, for the
// dense and DeepSeek decoders: chains of 1-6 draft tokens after random prompts, temperatures
// 0.6-1.5, top-p 1 / 0.9 / 0.3, top-k 0 / 5 / 40, draft distributions from nearly the target's
// own to far from it, some with q(d) = 0 (a rejection without a test). Kept counts and next
// tokens must agree except where a uniform lands within rounding of a boundary (at most 1 in
// 100 cases), and a second run must give the same decisions.
TEST(CudaDecode, ChainAcceptanceOnTheDeviceMatchesTheHost) {
  REQUIRE_GPU();
  for (const char* fx : {"llama_gqa", "deepseek_v3"}) {
    auto ck = open_checkpoint(golden_fixture(fx));
    auto dev = make_cuda_decoder(*ck, 0, 1, 128);  // the default: decided on the device
    setenv("TALON_CUDA_ACCEPT", "0", 1);
    auto host = make_cuda_decoder(*ck, 0, 1, 128);
    unsetenv("TALON_CUDA_ACCEPT");
    const int64_t V = dev->config().vocab;
    std::mt19937 rng(71);
    std::uniform_real_distribution<double> unif(0.0, 1.0);
    int cases = 0, differ = 0, kept_some = 0, rejected = 0;
    for (int c = 0; c < 150; ++c) {
      SamplingParams sp;
      sp.temperature = 0.6 + 0.9 * unif(rng);
      sp.top_p = c % 3 == 0 ? 1.0 : c % 3 == 1 ? 0.9 : 0.3;
      sp.top_k = (c / 3) % 3 == 0 ? 0 : (c / 3) % 3 == 1 ? 5 : 40;
      const int k = 1 + c % 6;
      const auto prompt = random_ids(rng, 3 + c % 9, V);
      // Draft tokens and their q: a peaked distribution on a random token (often the same few
      // ids, so the target sometimes likes them), spread with some mass on every id. In every
      // other case the first draft token is the target's own greedy pick, so that plenty of
      // chains keep a token whatever the fixture's target prefers.
      std::vector<int32_t> toks = {int32_t(rng() % uint32_t(V))};
      int32_t greedy = -1;
      if (c % 2 == 0) {
        std::vector<int32_t> ctx = prompt;
        ctx.push_back(toks[0]);
        host->reset(0);
        host->forward_greedy({{0, ctx, {}, false}}, Capture{}, &greedy);  // reset before its round below
      }
      std::vector<std::vector<double>> q(static_cast<size_t>(k), std::vector<double>(size_t(V)));
      for (int i = 0; i < k; ++i) {
        const int32_t d =
            i == 0 && greedy >= 0 ? greedy : int32_t(rng() % uint32_t(std::min<int64_t>(V, 8)));
        toks.push_back(d);
        const double peak = unif(rng);
        const bool zero_d = c % 17 == 5 && i == 0;
        for (int64_t v = 0; v < V; ++v) q[size_t(i)][size_t(v)] = (1 - peak) * unif(rng) / double(V) * 2;
        q[size_t(i)][size_t(d)] = zero_d ? 0.0 : peak;
        double z = 0;
        for (double x : q[size_t(i)]) z += x;
        for (double& x : q[size_t(i)]) x /= z;
      }
      std::vector<double> u(static_cast<size_t>(k + 1));
      for (auto& x : u) x = c % 4 == 0 ? 0.02 * unif(rng) : unif(rng);
      const DecodeRequest req{0, toks, {}, true};
      Decoder::ChainAcceptance got[2], want;
      for (int rep = 0; rep < 2; ++rep) {
        dev->reset(0);
        dev->forward({{0, prompt, {}, false}}, Capture{}, nullptr);
        dev->commit_all(0);
        got[rep] = dev->forward_accept_chain(req, Capture{}, sp, q, u.data());
        dev->commit(0, {});
      }
      host->reset(0);
      host->forward({{0, prompt, {}, false}}, Capture{}, nullptr);
      host->commit_all(0);
      want = host->forward_accept_chain(req, Capture{}, sp, q, u.data());
      host->commit(0, {});
      ++cases;
      EXPECT_EQ(got[0].kept, got[1].kept) << fx << " case " << c << ": not deterministic";
      EXPECT_EQ(got[0].next, got[1].next) << fx << " case " << c << ": not deterministic";
      ASSERT_GE(got[0].next, 0) << fx << " case " << c;
      ASSERT_LT(got[0].next, V) << fx << " case " << c;
      differ += got[0].kept != want.kept || got[0].next != want.next;
      kept_some += want.kept > 0;
      rejected += want.kept < k;
    }
    EXPECT_LE(differ, cases / 100) << fx << ": " << differ << " of " << cases << " decisions differ from the host's";
    EXPECT_GT(kept_some, 10) << fx << ": too few chains kept a token to test acceptance";
    EXPECT_GT(rejected, 10) << fx << ": too few rejections to test the residual draw";
  }
}

// The same for picked (top-k) trees: Decoder::forward_accept_tree decided by the device kernel
// (the default) against the host default on the same decoder type, on random trees of 2 to 12
// rows with 1 to 4 children a node, whose first child is, in every other case, the target's
// own greedy pick at the root (so that paths go deep), and runs of small uniforms (so that
// children are kept). Decisions may differ only where a uniform lands within fp64 rounding of a
// boundary; paths must be trees' paths from the root, and the device deterministic.
TEST(CudaDecode, TreeAcceptanceOnTheDeviceMatchesTheHost) {
  REQUIRE_GPU();
  for (const char* fx : {"llama_gqa", "deepseek_v3"}) {
    auto ck = open_checkpoint(golden_fixture(fx));
    auto dev = make_cuda_decoder(*ck, 0, 1, 128);
    setenv("TALON_CUDA_ACCEPT", "0", 1);
    auto host = make_cuda_decoder(*ck, 0, 1, 128);
    unsetenv("TALON_CUDA_ACCEPT");
    const int64_t V = dev->config().vocab;
    std::mt19937 rng(73);
    std::uniform_real_distribution<double> unif(0.0, 1.0);
    int cases = 0, differ = 0, deep = 0, drawn_after_rejection = 0;
    for (int c = 0; c < 150; ++c) {
      SamplingParams sp;
      sp.temperature = 0.6 + 0.9 * unif(rng);
      sp.top_p = c % 3 == 0 ? 1.0 : c % 3 == 1 ? 0.9 : 0.3;
      sp.top_k = (c / 3) % 3 == 0 ? 0 : (c / 3) % 3 == 1 ? 5 : 40;
      const auto prompt = random_ids(rng, 3 + c % 9, V);
      const int32_t root = int32_t(rng() % uint32_t(V));
      int32_t greedy = -1;
      if (c % 2 == 0) {
        std::vector<int32_t> ctx = prompt;
        ctx.push_back(root);
        host->reset(0);
        host->forward_greedy({{0, ctx, {}, false}}, Capture{}, &greedy);
      }
      // Row 0 the root; each later row's parent an earlier row with fewer than 4 children, the
      // children of a node distinct small ids (the target's greedy pick first at the root).
      const int n = 2 + c % 11;
      DecodeRequest req{0, {root}, {-1}, true};
      std::vector<std::vector<int32_t>> kids(1);
      for (int i = 1; i < n; ++i) {
        int par = int(rng() % uint32_t(i));
        while (kids[size_t(par)].size() >= 4) par = int(rng() % uint32_t(i));
        int32_t t = par == 0 && kids[0].empty() && greedy >= 0 ? greedy : int32_t(rng() % uint32_t(std::min<int64_t>(V, 8)));
        while (std::find(kids[size_t(par)].begin(), kids[size_t(par)].end(), t) != kids[size_t(par)].end())
          t = int32_t((t + 1) % V);
        kids[size_t(par)].push_back(t);
        kids.emplace_back();
        req.tokens.push_back(t);
        req.parents.push_back(par);
      }
      std::vector<double> u(static_cast<size_t>(n));
      for (auto& x : u) x = c % 4 == 0 ? 0.02 * unif(rng) : unif(rng);
      Decoder::TreeAcceptance got[2], want;
      for (int rep = 0; rep < 2; ++rep) {
        dev->reset(0);
        dev->forward({{0, prompt, {}, false}}, Capture{}, nullptr);
        dev->commit_all(0);
        got[rep] = dev->forward_accept_tree(req, Capture{}, sp, u.data());
        dev->commit(0, {});
      }
      host->reset(0);
      host->forward({{0, prompt, {}, false}}, Capture{}, nullptr);
      host->commit_all(0);
      want = host->forward_accept_tree(req, Capture{}, sp, u.data());
      host->commit(0, {});
      ++cases;
      EXPECT_EQ(got[0].path, got[1].path) << fx << " case " << c << ": not deterministic";
      EXPECT_EQ(got[0].next, got[1].next) << fx << " case " << c << ": not deterministic";
      ASSERT_FALSE(got[0].path.empty()) << fx << " case " << c;
      EXPECT_EQ(got[0].path[0], 0) << fx << " case " << c;
      for (size_t i = 1; i < got[0].path.size(); ++i)
        EXPECT_EQ(req.parents[size_t(got[0].path[i])], got[0].path[i - 1]) << fx << " case " << c << ": not a path";
      ASSERT_GE(got[0].next, 0) << fx << " case " << c;
      ASSERT_LT(got[0].next, V) << fx << " case " << c;
      differ += got[0].path != want.path || got[0].next != want.next;
      deep += want.path.size() > 1;
      // The last node had children, all rejected: the draw came from what was left of p.
      drawn_after_rejection += !kids[size_t(want.path.back())].empty();
    }
    EXPECT_LE(differ, cases / 100) << fx << ": " << differ << " of " << cases << " decisions differ from the host's";
    EXPECT_GT(deep, 10) << fx << ": too few trees kept a child to test acceptance";
    EXPECT_GT(drawn_after_rejection, 10) << fx << ": too few rejections to test the residual draw";
  }
}

TEST(CudaDecode, DeepSeekLatentSizesOnRandomModels) {
  REQUIRE_GPU();
  for (const int variant : {0, 1, 2, 3}) {
    // 0, 1: every layer dense (no routing: each row is held to the tolerance); 2, 3: MoE.
    const int64_t nh = variant % 2 ? 32 : 16;
    ModelConfig c = kimi_k2_shape(2, variant == 2);
    c.hidden = 256, c.intermediate = 384, c.vocab = 384, c.n_heads = c.n_kv_heads = nh;
    c.ds.n_routed_experts = 16, c.ds.num_experts_per_tok = 4, c.ds.moe_intermediate_size = 64;
    if (nh == 32) c.ds.q_lora_rank = 0;
    if (variant < 2) c.ds.first_k_dense_replace = c.n_layers;
    c.max_position = 4096;
    auto ck = make_random_checkpoint(c, 0.05f, uint64_t(variant + 1));
    Twin t(*ck, 3, 700);
    run_three_slot_scenario(t, c.vocab, "variant " + std::to_string(variant) + ": ", 31, 520, 40, 0, 4);
  }
}

// Random models with the head sizes of real ones (64 and 128, GQA 4:1 and 2:1; one with a
// sliding window): prefill of empty slots goes through the tensor-core attention, the rest
// through the cache kernel's 16-byte path; more keys than one tile, trees, commits.
TEST(CudaDecode, RealHeadSizesOnRandomModels) {
  REQUIRE_GPU();
  for (const int64_t hd : {64, 128}) {
    ModelConfig c;
    c.arch = Arch::Llama;
    c.n_layers = 2, c.hidden = 256, c.intermediate = 512, c.vocab = 512, c.head_dim = hd;
    c.n_heads = hd == 64 ? 8 : 4, c.n_kv_heads = 2, c.rms_eps = 1e-5, c.max_position = 4096;
    c.sliding_window = hd == 128 ? 100 : 0;
    auto ck = make_random_checkpoint(c, 0.2f, uint64_t(hd));
    Twin t(*ck, 3, 400);
    run_three_slot_scenario(t, c.vocab, "hd " + std::to_string(hd) + ": ", 29, 150, 70, 80, 5);
  }
}

// Folded forwards (small models, up to kSkinnyFoldRows rows) compute each row on its own
// terms: the products one row at a time in the same order, the attention in the same tiles,
// the LM head through the same skinny kernel. So a verify of a chain of 2-4 tokens must give
// the very logits (bit for bit) that one-token steps give for the same tokens, and greedy
// speculative decoding picks what target-only decoding picks, near-ties included. Slot 0 takes
// the tokens one at a time, slot 1 as one chain, from the same prefix; a model with SmolLM2's
// head layout (9 query heads over 3 kv heads of 64) and with a 4:1 group of 128. A second
// decoder runs RoPE and the cache write as their own kernel instead of the q|k|v product's
// epilogue (decoder_fold_rope): every logit must be the same bits.
TEST(CudaDecode, FoldedVerifyComputesWhatOneTokenStepsCompute) {
  REQUIRE_GPU();
  // The third model's MLP (2560) is too wide to fold: RoPE keeps its own kernel there, and
  // its chains are not expected to match one-token steps bit for bit.
  for (const int64_t variant : {0, 1, 2}) {
    const int64_t hd = variant == 0 ? 64 : 128;
    const bool folds = variant < 2;
    ModelConfig c;
    c.arch = Arch::Llama;
    c.n_layers = 3, c.hidden = hd == 64 ? 576 : 512, c.intermediate = hd == 64 ? 1536 : folds ? 1024 : 2560;
    c.vocab = 1000;
    c.head_dim = hd, c.n_heads = hd == 64 ? 9 : 4, c.n_kv_heads = hd == 64 ? 3 : 1, c.rms_eps = 1e-5;
    c.max_position = 4096;
    auto ck = make_random_checkpoint(c, 0.2f, uint64_t(hd) + 7);
    // `dec` rotates and writes the cache in the q|k|v product's epilogue (the default);
    // `apart` runs the separate RoPE + cache-write kernel. Same bits expected everywhere.
    auto dec = make_cuda_decoder(*ck, 0, 2, 256), apart = make_cuda_decoder(*ck, 0, 2, 256);
    cuda::decoder_fold_rope(*dec, true);
    cuda::decoder_fold_rope(*apart, false);
    std::mt19937 rng(31);
    const std::vector<int32_t> prefix = random_ids(rng, 37, c.vocab);
    for (int slot : {0, 1})
      for (Decoder* d : {dec.get(), apart.get()}) {
        d->forward({{slot, prefix, {}, false}}, Capture{}, nullptr);
        d->commit_all(slot);
      }
    auto count_differ = [&](const float* a, const float* b) {
      int64_t differ = 0;
      for (int64_t v = 0; v < c.vocab; ++v) differ += std::memcmp(a + v, b + v, 4) != 0;
      return differ;
    };
    for (const int64_t n : {2, 4, 3}) {
      const std::vector<int32_t> toks = random_ids(rng, n, c.vocab);
      std::vector<float> steps(size_t(n * c.vocab)), chain(size_t(n * c.vocab)), steps_apart(steps.size()),
          chain_apart(chain.size());
      for (int64_t i = 0; i < n; ++i) {
        dec->forward({{0, {toks[size_t(i)]}, {}, true}}, Capture{}, steps.data() + i * c.vocab);
        dec->commit_all(0);
        apart->forward({{0, {toks[size_t(i)]}, {}, true}}, Capture{}, steps_apart.data() + i * c.vocab);
        apart->commit_all(0);
      }
      dec->forward({{1, toks, {}, true}}, Capture{}, chain.data());
      dec->commit_all(1);
      apart->forward({{1, toks, {}, true}}, Capture{}, chain_apart.data());
      apart->commit_all(1);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t at = i * c.vocab;
        if (folds) {
          EXPECT_EQ(count_differ(steps.data() + at, chain.data() + at), 0)
              << "hd " << hd << ", chain of " << n << ": row " << i << " differs from its one-token step";
        }
        EXPECT_EQ(count_differ(steps.data() + at, steps_apart.data() + at), 0)
            << "hd " << hd << ", step " << i << " of " << n << ": RoPE in the product's epilogue changed the logits";
        EXPECT_EQ(count_differ(chain.data() + at, chain_apart.data() + at), 0)
            << "hd " << hd << ", chain of " << n << ", row " << i << ": RoPE in the epilogue changed the logits";
      }
    }
  }
}

TEST(CudaDecode, SlidingWindow) {
  REQUIRE_GPU();
  // The mistral fixture with a 5-token window: prefill, trees, decoding well past the window.
  const fs::path dir = fs::path(::testing::TempDir()) / "talon_cuda_decode_window";
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy_file(golden_fixture("mistral") / "model.safetensors", dir / "model.safetensors");
  auto cfg = nlohmann::json::parse(read_text_file(golden_fixture("mistral") / "config.json"));
  cfg["sliding_window"] = 5;
  write_file_atomic(dir / "config.json", cfg.dump(2));
  auto ck = open_checkpoint(dir);
  ASSERT_EQ(ck->config().sliding_window, 5);
  Twin t(*ck, 2, 200);
  const int64_t V = t.c().vocab;
  std::mt19937 rng(3);
  t.forward({{0, random_ids(rng, 6, V), {}, true}, {1, random_ids(rng, 90, V), {}, true}}, "prefill");
  t.commit_all(0);
  t.commit_all(1);
  t.forward({{0, random_ids(rng, 8, V), {-1, 0, 1, 2, 3, 4, 5, 1}, true}, {1, random_ids(rng, 3, V), {-1, 0, 1}, true}},
            "trees");
  t.commit(0, {0, 1, 2, 3, 4, 5});
  t.commit(1, {0});
  for (int step = 0; step < 12; ++step) {
    t.forward({{0, random_ids(rng, 1, V), {}, true}, {1, random_ids(rng, 2, V), {}, true}},
              "step " + std::to_string(step));
    t.commit_all(0);
    t.commit_all(1);
  }
}

TEST(CudaDecode, MalformedRequestsAreRefusedLikeOnTheCpu) {
  REQUIRE_GPU();
  auto ck = open_checkpoint(golden_fixture("llama_gqa"));
  auto dec = make_cuda_decoder(*ck, 0, 2, 8);
  expect_malformed_requests_refused(*dec);
}

TEST(CudaDecode, ACacheThatDoesNotFitIsRefusedWithTheNumbers) {
  REQUIRE_GPU();
  auto ck = open_checkpoint(golden_fixture("llama_cfg4x"));
  // 3 layers x K,V x 3 kv heads x 16 x 2 bytes = 576 bytes per token: 2^30 tokens is 576 GiB.
  const std::string msg = error_of([&] { make_cuda_decoder(*ck, 0, 1, int64_t(1) << 30); });
  EXPECT_NE(msg.find("the KV cache needs 576.00 GiB"), std::string::npos) << msg;
  EXPECT_NE(msg.find("lower --max-len"), std::string::npos) << msg;
  // The tokens that fit follow from the free memory it names: (free - 1 GiB kept) / 576 bytes,
  // to within the rounding of the GiB figures and of whole pages.
  std::smatch m;
  ASSERT_TRUE(std::regex_search(msg, m, std::regex(R"(only ([0-9.]+) GiB of [0-9.]+ GiB is free.* ([0-9]+) tokens fit)")))
      << msg;
  const double free_gib = std::stod(m[1].str()), fit = std::stod(m[2].str());
  EXPECT_NEAR(fit * 576.0, (free_gib - 1.0) * double(1 << 30), 0.006 * double(1 << 30)) << msg;
}

// plan_attention is host code (no GPU needed): which rows go through tiles, how the tiles cut
// a group's vectors, and the key range the splits are sized for, on a forward that mixes a
// verify chain, a 20-row tree, lone one-token rows and rows of one slot at different lengths.
// cuda::sample_rows against the sampling oracle (tests/sampling_reference.h) on bf16 rows:
// vocabularies from 1 id to past 128k (odd sizes), rows with many equal logits (coarse
// values), one dominant logit, a flat row, -inf and NaN entries; temperatures from 0 (the
// argmax) to 2, top-k from 1 to past V, top-p from 0.05 to 1, and u at 0, near 1 and
// random. Ids must match except where the oracle says the draw hangs on rounding; the same
// row must give the same id at another position of a larger batch and on a second run.
// topk_logsoftmax (the draft's top-k on the device) against the definition: the k largest
// values, ties to the lower id, each with its value minus log(sum(exp(row))), on rows with
// many ties, -inf and NaN entries (NaN is never picked; its row's log-probabilities are not
// checked, as a NaN logit has none), for k on both sides
// of the per-thread list sizes (4, 8, 16) and V from 1 to past 128k.
TEST(CudaTopk, PicksAndLogProbsFollowTheDefinition) {
  REQUIRE_GPU();
  std::mt19937 rng(77);
  int checked = 0;
  for (const int64_t V : {int64_t(1), int64_t(5), int64_t(257), int64_t(8192), int64_t(32000), int64_t(128259)}) {
    for (const int k : {1, 3, 4, 5, 8, 9, 10, 16, 17, 40}) {
      if (k > V) continue;
      const int64_t R = 4;
      std::vector<float> rows(static_cast<size_t>(R * V));
      std::normal_distribution<float> nd(0.f, 4.f);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t i = 0; i < V; ++i) {
          float x = nd(rng);
          if (r == 1) x = std::round(x);  // many ties
          if (r == 2) x = float(int(rng() % 3));  // nearly flat: ties decide most picks
          rows[size_t(r * V + i)] = x;
        }
      if (V > 3) {
        rows[size_t(3 * V + 0)] = NAN;
        rows[size_t(3 * V + 1)] = -INFINITY;
        rows[size_t(3 * V + V - 1)] = 40.f;  // the best id is the last one
      }
      Guarded<float> d_logits(rows.size());
      d_logits.upload(rows);
      Guarded<int32_t> d_ids(static_cast<size_t>(R * k));
      Guarded<float> d_lp(static_cast<size_t>(R * k));
      cuda::topk_logsoftmax(d_ids.ptr(), d_lp.ptr(), d_logits.ptr(), R, V, k, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto ids = d_ids.download();
      const auto lp = d_lp.download();
      EXPECT_TRUE(d_ids.guards_intact() && d_lp.guards_intact());
      for (int64_t r = 0; r < R; ++r) {
        const float* x = rows.data() + r * V;
        std::vector<int32_t> order;
        for (int32_t i = 0; i < int32_t(V); ++i)
          if (!std::isnan(x[i])) order.push_back(i);
        std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return x[a] > x[b]; });
        double m = -INFINITY, z = 0;
        for (int32_t i : order) m = std::max(m, double(x[i]));
        for (int32_t i : order) z += std::exp(double(x[i]) - m);
        const double lse = m + std::log(z);
        const std::string tag = fmt::format("V {} k {} row {}", V, k, r);
        for (int j = 0; j < k && j < int(order.size()); ++j) {
          ASSERT_EQ(ids[size_t(r * k + j)], order[size_t(j)]) << tag << " pick " << j;
          const double want = double(x[order[size_t(j)]]) - lse;
          if (r != 3 || V <= 3) {
            EXPECT_NEAR(lp[size_t(r * k + j)], want, 1e-4 * std::max(1.0, std::fabs(want))) << tag << " pick " << j;
          }
        }
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 150);
}

TEST(CudaSample, DrawsWhatTheReferenceDraws) {
  REQUIRE_GPU();
  struct P {
    double t;
    int64_t k;
    double p;
  };
  const std::vector<P> sets = {{0, 0, 1},     {0.7, 0, 1},   {1.0, 0, 0.9},  {1.3, 50, 1},   {0.5, 1, 1},
                               {2.0, 0, 0.05}, {1.0, 7, 0.95}, {0.9, 0, 0.999}, {0.6, 1000, 0.5}};
  std::mt19937 rng(2026);
  int strict = 0, ambiguous = 0;
  for (const int64_t V : {int64_t(1), int64_t(3), int64_t(1000), int64_t(4097), int64_t(49152), int64_t(128259)}) {
    for (int kind = 0; kind < 5; ++kind) {
      // Rows of this V and kind, one per (parameter set, u).
      std::vector<float> row(static_cast<size_t>(V));
      std::normal_distribution<float> nd(0.f, 3.f);
      for (int64_t i = 0; i < V; ++i) {
        float x = nd(rng);
        if (kind == 1) x = std::round(x);  // many ties
        if (kind == 2) x = -x * x;
        if (kind == 3) x = 0.25f;  // flat
        row[size_t(i)] = x;
      }
      if (kind == 2) row[size_t(rng() % uint32_t(V))] = 30.f;  // one dominant id
      if (kind == 4 && V > 4) {
        row[size_t(rng() % uint32_t(V))] = -INFINITY;
        row[1] = NAN;  // never picked; the oracle below sees it as -inf
      }
      const auto row16 = to_bf16(row);
      std::vector<float> seen = to_f32(row16);  // the values the device reads
      for (float& x : seen)
        if (std::isnan(x)) x = -INFINITY;
      std::vector<P> prm;
      std::vector<double> us;
      for (const P& p : sets)
        for (const double u : {0.0, 1.0 - 0x1.0p-53, uniform01(9, uint64_t(V), uint64_t(kind)),
                               uniform01(10, uint64_t(V), uint64_t(kind))}) {
          prm.push_back(p);
          us.push_back(u);
        }
      const int64_t R = int64_t(prm.size());
      std::vector<__nv_bfloat16> all;
      for (int64_t r = 0; r < R; ++r) all.insert(all.end(), row16.begin(), row16.end());
      // One launch per parameter set (the parameters are per launch), rows = its u values.
      Guarded<__nv_bfloat16> d_logits(all.size());
      d_logits.upload(all);
      Guarded<double> d_u(us.size());
      d_u.upload(us);
      Guarded<cuda::DeviceSampling> d_prm(sets.size());
      Guarded<int32_t> d_ids{size_t(R)};
      const int64_t per = R / int64_t(sets.size());
      std::vector<int32_t> first;
      // Run 0 checks against the oracle, run 1 must repeat run 0, run 2 finds top-p's
      // threshold by the bit-by-bit search alone (the fallback) and is checked again.
      for (int run = 0; run < 3; ++run) {
        std::vector<cuda::DeviceSampling> dp;
        for (const P& p : sets) dp.push_back({p.t, p.p, p.k, run == 2 ? 1 : 0});
        d_prm.upload(dp);
        for (size_t si = 0; si < sets.size(); ++si)
          cuda::sample_rows(d_ids.ptr() + si * size_t(per),
                            reinterpret_cast<const cuda::bf16*>(d_logits.ptr()) + si * size_t(per * V), per, V,
                            d_prm.ptr() + si, d_u.ptr() + si * size_t(per), nullptr);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const auto ids = d_ids.download();
        EXPECT_TRUE(d_ids.guards_intact());
        for (int64_t r = 0; r < R; ++r) {
          const P& p = prm[size_t(r)];
          const auto want = reference_draw(seen.data(), V, p.t, p.k, p.p, us[size_t(r)]);
          const std::string what = fmt::format("V {} kind {} T {} top_k {} top_p {} u {}", V, kind, p.t, p.k, p.p,
                                               us[size_t(r)]);
          ASSERT_TRUE(ids[size_t(r)] >= 0 && ids[size_t(r)] < V) << what;
          EXPECT_FALSE(kind == 4 && V > 4 && ids[size_t(r)] == 1) << what << ": picked a NaN";
          if (run == 1) {
            EXPECT_EQ(ids[size_t(r)], first[size_t(r)]) << what << ": a second run differs";
            continue;
          }
          if (want.ambiguous) {
            if (run == 0) ambiguous += r % 4 >= 2;  // u near 1 hangs on rounding by design; random u should not
            continue;
          }
          strict += run == 0;
          EXPECT_EQ(ids[size_t(r)], want.id) << what << (run == 2 ? " (bit-by-bit search)" : "");
        }
        if (run == 0) first = ids;
        if (run != 0) continue;
        // The same rows again at other positions of one bigger launch (parameter set 2).
        const int64_t big = 37;
        std::vector<__nv_bfloat16> many;
        std::vector<double> ub(static_cast<size_t>(big));
        for (int64_t r = 0; r < big; ++r) {
          many.insert(many.end(), row16.begin(), row16.end());
          ub[size_t(r)] = us[size_t(2 * per + r % per)];
        }
        Guarded<__nv_bfloat16> d_many(many.size());
        d_many.upload(many);
        Guarded<double> d_ub(ub.size());
        d_ub.upload(ub);
        Guarded<int32_t> d_big{size_t(big)};
        cuda::sample_rows(d_big.ptr(), reinterpret_cast<const cuda::bf16*>(d_many.ptr()), big, V, d_prm.ptr() + 2,
                          d_ub.ptr(), nullptr);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const auto got = d_big.download();
        for (int64_t r = 0; r < big; ++r)
          EXPECT_EQ(got[size_t(r)], ids[size_t(2 * per + r % per)]) << "V " << V << " kind " << kind << " position " << r;
      }
    }
  }
  EXPECT_GT(strict, 700);
  EXPECT_LT(ambiguous, 20);
}

// The host half of the CUDA decoders (decode_slots.h) against model/decode.h's contract, worked
// out by hand: rows, positions, tree masks, logit rows, the sliding window, refusals, and the
// cache moves a commit of a tree path makes. No GPU needed.
TEST(DecodeSlots, PlansRowsAndCommitMovesByTheContract) {
  cuda::DecodeSlots slots(3, 100);
  std::vector<int64_t> pending(3, 0);
  const int64_t V = 50;
  // A 3-token prefill of slot 0, last logits only.
  std::vector<DecodeRequest> reqs = {{0, {7, 8, 9}, {}, false}};
  cuda::DecodeBatch b = slots.plan(reqs, pending, V);
  ASSERT_EQ(b.rows.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(b.rows[size_t(i)].slot, 0);
    EXPECT_EQ(b.rows[size_t(i)].lo, 0);
    EXPECT_EQ(b.rows[size_t(i)].len, 0);
    EXPECT_EQ(b.rows[size_t(i)].end, i + 1);
    EXPECT_EQ(b.rows[size_t(i)].mask, -1);
  }
  EXPECT_EQ(b.pos, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(b.tokens, (std::vector<int32_t>{7, 8, 9}));
  EXPECT_EQ(b.logit_rows, (std::vector<int32_t>{2}));
  EXPECT_EQ(b.seq_start, (std::vector<int64_t>{0, 3}));
  EXPECT_TRUE(b.prefill);
  slots.ran(reqs, b, pending);
  EXPECT_EQ(pending[0], 3);
  EXPECT_TRUE(slots.commit(0, {0, 1, 2}, pending).empty());  // a chain kept whole stays in place
  EXPECT_EQ(slots.length(0), 3);
  EXPECT_EQ(pending[0], 0);

  // A tree on slot 0 (0 <- 1, 0 <- 2 <- 3) beside a 2-token chain on the empty slot 2.
  reqs = {{0, {1, 2, 3, 4}, {-1, 0, 0, 2}, true}, {2, {5, 6}, {}, true}};
  b = slots.plan(reqs, pending, V);
  ASSERT_EQ(b.rows.size(), 6u);
  EXPECT_FALSE(b.prefill);
  EXPECT_EQ(b.pos, (std::vector<int32_t>{3, 4, 4, 5, 0, 1}));  // length + depth
  EXPECT_EQ(b.logit_rows, (std::vector<int32_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(b.seq_start, (std::vector<int64_t>{0, 4, 6}));
  const uint64_t bits[4] = {0b1, 0b11, 0b101, 0b1101};  // ancestors and self
  for (int i = 0; i < 4; ++i) {
    const cuda::DecodeRow& r = b.rows[size_t(i)];
    EXPECT_EQ(r.len, 3);
    EXPECT_EQ(r.lo, 0);
    EXPECT_EQ(r.end, 3 + i + 1);  // its own cache row is end - 1
    ASSERT_GE(r.mask, 0);
    EXPECT_EQ(b.masks[size_t(r.mask)], bits[i]) << "row " << i;
  }
  EXPECT_EQ(b.rows[4].mask, -1);
  EXPECT_EQ(b.rows[5].end, 2);
  slots.ran(reqs, b, pending);
  // Keeping the path 0, 2, 3 moves cache rows 3 + 2 -> 3 + 1 and 3 + 3 -> 3 + 2 of slot 0.
  EXPECT_EQ(slots.commit(0, {0, 2, 3}, pending), (std::vector<int32_t>{5, 4, 6, 5}));
  EXPECT_EQ(slots.length(0), 6);
  EXPECT_NE(error_of([&] { slots.commit(2, {1}, pending); }).find("does not continue the kept path"), std::string::npos);
  EXPECT_TRUE(slots.commit(2, {0, 1}, pending).empty());
  EXPECT_EQ(slots.length(2), 2);
  // Moves name physical rows of the page pool (pages of kPageRows, handed out from page 0 on):
  // slot 0 took page 0 with its prefill, slot 2 page 1 with its chain, so rows 3 -> 2 of slot 2
  // are rows P + 3 -> P + 2.
  const int32_t P = int32_t(cuda::kPageRows);
  reqs = {{2, {1, 2}, {-1, -1}, true}};
  b = slots.plan(reqs, pending, V);
  slots.ran(reqs, b, pending);
  EXPECT_EQ(slots.commit(2, {1}, pending), (std::vector<int32_t>{P + 3, P + 2}));
  EXPECT_EQ(slots.pages().held(0), 1);
  EXPECT_EQ(slots.pages().held(2), 1);

  // A sliding window of 2 keys: row at position p sees [p - 1, p].
  reqs = {{1, {1, 2, 3}, {}, true}};
  b = slots.plan(reqs, pending, V, 2);
  EXPECT_EQ(b.rows[0].lo, 0);
  EXPECT_EQ(b.rows[1].lo, 0);
  EXPECT_EQ(b.rows[2].lo, 1);

  // Refusals, each naming what is wrong.
  auto refused = [&](const std::vector<DecodeRequest>& r, const std::string& want) {
    const std::string e = error_of([&] { slots.plan(r, pending, V); });
    EXPECT_NE(e.find(want), std::string::npos) << e;
  };
  refused({{0, {1}, {}, true}, {0, {2}, {}, true}}, "appears twice");
  refused({{3, {1}, {}, true}}, "slot 3 outside [0, 3)");
  refused({{0, {50}, {}, true}}, "outside the vocabulary");
  refused({{0, std::vector<int32_t>(95, 1), {}, true}}, "more than max_len 100");
  refused({{0, {}, {}, true}}, "has no tokens");
  std::vector<int64_t> busy = pending;
  busy[1] = 2;
  EXPECT_NE(error_of([&] { slots.plan({{1, {1}, {}, true}}, busy, V); }).find("uncommitted"), std::string::npos);
  slots.reset(0, pending);
  EXPECT_EQ(slots.length(0), 0);
  slots.reset(0, pending, 40);
  EXPECT_EQ(slots.length(0), 40);
  EXPECT_NE(error_of([] { cuda::DecodeSlots bad(0, 10); }).find("at least one slot"), std::string::npos);

  // A pool of 3 pages for 2 slots of up to 2 pages each: slot 0 grows into its second page
  // beside slot 1's first; then slot 1 cannot take two more pages, and the refusal changes
  // nothing; slot 0's reset gives its pages back, and slot 1's second page is the last one
  // slot 0 gave back, so its rows P..2P-1 move to physical page 1.
  cuda::DecodeSlots small(2, 2 * P, 3 * P);
  std::vector<int64_t> pend(2, 0);
  reqs = {{0, std::vector<int32_t>(size_t(P + 5), 1), {}, false}, {1, {1, 2}, {}, false}};
  b = small.plan(reqs, pend, V);
  small.ran(reqs, b, pend);
  small.commit(0, std::vector<int32_t>([&] {
                 std::vector<int32_t> k(size_t(P + 5));
                 for (int32_t i = 0; i < P + 5; ++i) k[size_t(i)] = i;
                 return k;
               }()),
               pend);
  small.commit(1, {0, 1}, pend);
  EXPECT_EQ(small.pages().table(), (std::vector<int32_t>{0, 1, 2, -1}));
  EXPECT_EQ(small.pages().free_pages(), 0);
  const std::string full = error_of([&] { small.plan({{1, std::vector<int32_t>(size_t(P), 1), {}, true}}, pend, V); });
  EXPECT_NE(full.find("the KV cache is full"), std::string::npos) << full;
  EXPECT_NE(full.find("slot 1"), std::string::npos) << full;
  EXPECT_EQ(small.pages().table(), (std::vector<int32_t>{0, 1, 2, -1}));
  small.reset(0, pend);
  EXPECT_EQ(small.pages().free_pages(), 2);
  // A P-token tree on slot 1 (2 committed): tokens 0 .. P - 2 follow the prefix, token P - 1
  // follows token 0. Its rows 2 .. P + 1 take a second page: page 0, the last one slot 0 gave back.
  std::vector<int32_t> par(size_t(P), -1);
  par.back() = 0;
  reqs = {{1, std::vector<int32_t>(size_t(P), 1), par, true}};
  b = small.plan(reqs, pend, V);
  EXPECT_EQ(small.pages().table(), (std::vector<int32_t>{-1, -1, 2, 0}));
  small.ran(reqs, b, pend);
  // Keeping 0, P - 1: token P - 1 at slot row P + 1 (physical 0 * P + 1) moves to slot row 3
  // (physical 2P + 3); token 0 stays at row 2. Slot 1 then holds 4 rows: its second page goes back.
  EXPECT_EQ(small.commit(1, {0, P - 1}, pend), (std::vector<int32_t>{1, 2 * P + 3}));
  EXPECT_EQ(small.length(1), 4);
  EXPECT_EQ(small.pages().table(), (std::vector<int32_t>{-1, -1, 2, -1}));
  EXPECT_EQ(small.pages().free_pages(), 2);
}

// A decoder group's bookkeeping (decoder_group.cpp), host only. Expert parallel: 4 slots in two
// books of 2 (pools of 5 and 3 pages, max_len 3 pages). The group's 4 one-page slots fit (2 pages
// in each book) although they exceed the smallest pool's 3 pages together; a forward that fits
// book 0 but not book 1 is refused naming rank 1 and gives book 0's new page back; bad input in
// book 1 is refused the same way. Tensor parallel: one book, errors name no rank.
TEST(DecodeSlots, GroupBooksSplitSlotsAndPlanOnAllOrNone) {
  const int64_t P = cuda::kPageRows, V = 10;
  const auto npos = std::string::npos;
  const auto iota = [](int64_t n) {
    std::vector<int32_t> k(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) k[size_t(i)] = int32_t(i);
    return k;
  };
  cuda::SlotBooks ep(4, true, 2, 3 * P, {{2, 5 * P}, {2, 3 * P}});
  EXPECT_EQ(ep.n_books(), 2);
  EXPECT_EQ(ep.where(1), (std::pair<int, int>{0, 1}));
  EXPECT_EQ(ep.where(3), (std::pair<int, int>{1, 1}));
  EXPECT_NE(error_of([&] { ep.where(4); }).find("slot 4 outside [0, 4)"), npos);
  EXPECT_EQ(ep.capacity(), 3 * P);
  EXPECT_EQ(ep.page_rows(), P);
  std::vector<DecodeRequest> fill;
  for (int s = 0; s < 4; ++s) fill.push_back({s, std::vector<int32_t>(size_t(P), 1), {}, false});
  cuda::SlotBooks::Plan p = ep.plan(fill, V);
  ASSERT_EQ(p.reqs.size(), 2u);
  EXPECT_EQ(p.reqs[1][1].slot, 1);  // the group's slot 3 is book 1's slot 1
  ep.ran(p);
  for (int s = 0; s < 4; ++s) ep.commit(s, iota(P));
  for (int s = 0; s < 4; ++s) EXPECT_EQ(ep.length(s), P) << s;
  EXPECT_EQ(ep.book(0).pages().free_pages(), 3);
  EXPECT_EQ(ep.book(1).pages().free_pages(), 1);
  ep.reset(2, 2 * P);  // book 1 full
  EXPECT_EQ(ep.book(1).pages().free_pages(), 0);
  const std::string full = error_of([&] { ep.plan({{0, {1}, {}, false}, {2, {1}, {}, false}}, V); });
  EXPECT_NE(full.find("the KV cache is full"), npos) << full;
  EXPECT_NE(full.find("expert-parallel rank 1, whose slot 0 is the group's slot 2"), npos) << full;
  EXPECT_EQ(ep.book(0).pages().free_pages(), 3);
  EXPECT_EQ(ep.length(0), P);
  const std::string bad = error_of([&] { ep.plan({{1, {1}, {}, false}, {3, {V}, {}, false}}, V); });
  EXPECT_NE(bad.find("outside the vocabulary"), npos) << bad;
  EXPECT_NE(bad.find("rank 1"), npos) << bad;
  EXPECT_EQ(ep.book(0).pages().free_pages(), 3);
  p = ep.plan({{0, {1, 2}, {}, false}}, V);  // slot 0 alone still goes, and commits
  ep.ran(p);
  ep.commit(0, {0});
  EXPECT_EQ(ep.length(0), P + 1);
  EXPECT_EQ(ep.book(0).pages().free_pages(), 2);

  cuda::SlotBooks tp(2, false, 2, 2 * P, {{2, 2 * P}});
  EXPECT_EQ(tp.where(1), (std::pair<int, int>{0, 1}));
  tp.reset(0, 2 * P);
  const std::string tfull = error_of([&] { tp.plan({{1, {1}, {}, false}}, V); });
  EXPECT_NE(tfull.find("the KV cache is full"), npos) << tfull;
  EXPECT_EQ(tfull.find("rank"), npos) << tfull;
  EXPECT_NE(error_of([] { cuda::SlotBooks bad(5, true, 2, 64, {{2, 128}, {2, 128}}); }).find("cannot hold 5 slots"),
            npos);
}

TEST(DecodePlan, GroupsLoneRowsAndTiles) {
  const int64_t nh = 32, nkv = 8, group = nh / nkv;
  std::vector<cuda::DecodeRow> rows;
  for (int i = 0; i < 4; ++i) rows.push_back({0, 0, 700, 701 + i, -1});   // slot 0: chain of 4
  for (int i = 0; i < 20; ++i) rows.push_back({1, 0, 37, 38 + i, 0});     // slot 1: tree of 20
  rows.push_back({2, 0, 300, 301, -1});                                    // slot 2: one token
  rows.push_back({3, 5, 90, 91, -1});                                      // slot 3: one token
  rows.push_back({3, 0, 95, 96, -1});  // slot 3 again at another length: a group of its own
  const int64_t N = int64_t(rows.size());
  const auto lone_never = std::numeric_limits<int64_t>::max();
  auto vectors_of = [&](const cuda::AttentionPlan& p, int32_t first_row) {
    int64_t n = 0;
    for (const auto& t : p.tiles)
      if (t.first_row == first_row) n += std::min<int64_t>(cuda::kTileVectors, t.n_rows * group - t.first_vector);
    return n;
  };
  {  // groups of two or more rows in tiles, lone rows single
    const cuda::AttentionPlan p = cuda::plan_attention(rows.data(), N, nh, nkv, 128, true, 132, lone_never);
    EXPECT_EQ(p.single, (std::vector<int32_t>{24, 25, 26}));
    EXPECT_EQ(vectors_of(p, 0), 4 * group);
    EXPECT_EQ(vectors_of(p, 4), 20 * group);
    // 80 vectors of the tree: tiles of at most kTileVectors, each starting where the last ended
    int64_t expect_first = 0;
    for (const auto& t : p.tiles)
      if (t.first_row == 4) {
        EXPECT_EQ(t.n_rows, 20);
        EXPECT_EQ(t.first_vector, expect_first);
        expect_first += cuda::kTileVectors;
      }
    EXPECT_EQ(p.max_keys, 704);  // the chain's last row: keys [0, 704)
  }
  {  // three lone rows reach a threshold of 3: every row in tiles
    const cuda::AttentionPlan p = cuda::plan_attention(rows.data(), N, nh, nkv, 128, true, 132, 3);
    EXPECT_TRUE(p.single.empty());
    for (int32_t r : {24, 25, 26}) {
      EXPECT_EQ(vectors_of(p, r), group) << "row " << r;
    }
    EXPECT_EQ(p.max_keys, 704);
  }
  {  // ... but not a threshold of 4
    const cuda::AttentionPlan p = cuda::plan_attention(rows.data(), N, nh, nkv, 128, true, 132, 4);
    EXPECT_EQ(p.single.size(), 3u);
  }
  {  // no tiles when they are off or the head size has no tile kernel
    for (const auto& [ok, hd] : {std::pair{false, int64_t(128)}, std::pair{true, int64_t(96)}}) {
      const cuda::AttentionPlan p = cuda::plan_attention(rows.data(), N, nh, nkv, hd, ok, 132, 1);
      EXPECT_TRUE(p.tiles.empty()) << "hd " << hd;
      EXPECT_EQ(int64_t(p.single.size()), N) << "hd " << hd;
    }
  }
  {  // the splits cover every key: splits x split_len >= the longest range, in whole tiles
    const cuda::AttentionPlan p = cuda::plan_attention(rows.data(), N, nh, nkv, 128, true, 132, 1);
    EXPECT_GE(p.splits.splits * p.splits.split_len, p.max_keys);
    EXPECT_EQ(p.splits.split_len % cuda::kDecodeTile, 0);
    EXPECT_LT((p.splits.splits - 1) * p.splits.split_len, std::max<int64_t>(p.max_keys, 256) + 256);
  }
}

// The two attention kernels of the decoder against an fp64 reference on random caches: the
// per-row kernel alone, and the verify tiles beside it (plan_attention), over a chain of 4 on
// a long prefix (several key splits), a 100-node tree (two mask words per deep row, more
// vectors than one tile), a single row, and a sliding-window chain on an empty slot (rows
// with different lo); GQA groups of 3 and 4 and plain multi-head attention.
TEST(CudaDecodeAttention, VerifyTilesAndPerRowKernelMatchTheReference) {
  REQUIRE_GPU();
  struct Shape {
    int64_t nh, nkv, hd;
  };
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  for (const Shape sh : {Shape{9, 3, 64}, Shape{32, 8, 128}, Shape{4, 4, 64}, Shape{8, 2, 128}}) {
    const int64_t nh = sh.nh, nkv = sh.nkv, hd = sh.hd, n_slots = 4, max_len = 900, W = 3;
    const std::string tag = fmt::format("nh {} nkv {} hd {}", nh, nkv, hd);
    std::mt19937 rng(uint32_t(nh * 1000 + hd));
    std::vector<cuda::DecodeRow> rows;
    std::vector<uint64_t> masks;
    auto chain = [&](int slot, int len, int n, int64_t window) {
      for (int i = 0; i < n; ++i) {
        const int p = len + i;
        const int lo = window > 0 ? std::max<int>(0, p - int(window) + 1) : 0;
        rows.push_back({slot, lo, len, len + i + 1, -1});
      }
    };
    chain(0, 700, 4, 0);
    {  // slot 1: a random 100-node tree over 37 committed tokens
      const int len = 37, n = 100;
      std::vector<int> par(n);
      for (int i = 0; i < n; ++i) par[size_t(i)] = i == 0 ? -1 : int(rng() % uint32_t(i + 1)) - 1;
      for (int i = 0; i < n; ++i) {
        const int at = int(masks.size());
        masks.resize(masks.size() + size_t(i / 64 + 1), 0);
        for (int a = i; a >= 0; a = par[size_t(a)]) masks[size_t(at + a / 64)] |= uint64_t(1) << (a % 64);
        rows.push_back({1, 0, len, len + i + 1, at});
      }
    }
    chain(2, 300, 1, 0);
    chain(3, 0, 5, W);
    const int64_t N = int64_t(rows.size()), ld = (nh + 2 * nkv) * hd, kvd = nkv * hd;
    const auto qkv = randn(size_t(N * ld), 3);
    const auto kc = randn(size_t(n_slots * max_len * kvd), 4), vc = randn(size_t(n_slots * max_len * kvd), 5);
    // fp64 reference: softmax over each row's visible keys of its slot.
    std::vector<double> ref(size_t(N * nh * hd), 0.0);
    for (int64_t r = 0; r < N; ++r) {
      const cuda::DecodeRow& row = rows[size_t(r)];
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t kh = h / (nh / nkv);
        std::vector<double> sc;
        std::vector<int64_t> keys;
        for (int64_t j = row.lo; j < row.end; ++j) {
          if (j >= row.len && row.mask >= 0) {
            const int64_t a = j - row.len;
            if (!((masks[size_t(row.mask + a / 64)] >> (a % 64)) & 1)) continue;
          }
          double d = 0;
          for (int64_t i = 0; i < hd; ++i)
            d += double(qkv[size_t(r * ld + h * hd + i)]) *
                 double(kc[size_t((row.slot * max_len + j) * kvd + kh * hd + i)]);
          sc.push_back(d / std::sqrt(double(hd)));
          keys.push_back(j);
        }
        const double mx = *std::max_element(sc.begin(), sc.end());
        double sum = 0;
        for (double& x : sc) sum += (x = std::exp(x - mx));
        for (size_t k = 0; k < keys.size(); ++k)
          for (int64_t i = 0; i < hd; ++i)
            ref[size_t((r * nh + h) * hd + i)] +=
                sc[k] / sum * double(vc[size_t((row.slot * max_len + keys[k]) * kvd + kh * hd + i)]);
      }
    }
    Guarded<__nv_bfloat16> d_qkv(qkv.size()), d_kc(kc.size()), d_vc(vc.size()), d_out(size_t(N * nh * hd));
    d_qkv.upload(to_bf16(qkv));
    d_kc.upload(to_bf16(kc));
    d_vc.upload(to_bf16(vc));
    // The same caches paged (ops.h: CacheMap): every slot's pages of kPageRows rows placed at
    // shuffled pages of a pool with two spare pages, whose rows (and the unused tails) are NaN,
    // so that a key read from the wrong page shows. Same keys, same arithmetic: the outputs
    // must equal the flat cache's bit for bit.
    const int64_t mp = (max_len + cuda::kPageRows - 1) / cuda::kPageRows, n_pool = n_slots * mp + 2;
    std::vector<int32_t> table(size_t(n_slots * mp));
    {
      std::vector<int32_t> perm(static_cast<size_t>(n_pool));
      for (int64_t i = 0; i < n_pool; ++i) perm[size_t(i)] = int32_t(i);
      std::shuffle(perm.begin(), perm.end(), rng);
      std::copy_n(perm.begin(), table.size(), table.begin());
    }
    std::vector<float> pkc(size_t(n_pool * cuda::kPageRows * kvd), std::nanf("")), pvc = pkc;
    for (int64_t sl = 0; sl < n_slots; ++sl)
      for (int64_t j = 0; j < max_len; ++j) {
        const int64_t phys = int64_t(table[size_t(sl * mp + j / cuda::kPageRows)]) * cuda::kPageRows + j % cuda::kPageRows;
        std::copy_n(kc.begin() + (sl * max_len + j) * kvd, kvd, pkc.begin() + phys * kvd);
        std::copy_n(vc.begin() + (sl * max_len + j) * kvd, kvd, pvc.begin() + phys * kvd);
      }
    Guarded<__nv_bfloat16> d_pkc(pkc.size()), d_pvc(pvc.size()), d_pout(size_t(N * nh * hd));
    d_pkc.upload(to_bf16(pkc));
    d_pvc.upload(to_bf16(pvc));
    Guarded<int32_t> d_table(table.size());
    d_table.upload(table);
    const cuda::CacheMap paged(d_table.ptr(), mp);
    // Modes: rows only; tiles for groups (the lone row of slot 2 stays single); every row in
    // tiles, the lone row too (as lone_tile_rows has it by default); and every row in tiles
    // with one key split, where the tiles write the output without a combine pass.
    for (const int mode : {0, 1, 2, 3}) {
      const bool tiles = mode > 0;
      const std::string what = tag + (mode == 0   ? ", rows only"
                                       : mode == 1 ? ", tiles"
                                       : mode == 2 ? ", tiles for lone rows too"
                                                   : ", tiles, one split");
      const cuda::AttentionPlan plan = cuda::plan_attention(rows.data(), N, nh, nkv, hd, tiles, sms,
                                                            mode >= 2 ? 1 : std::numeric_limits<int64_t>::max());
      EXPECT_EQ(plan.tiles.empty(), !tiles) << what;
      if (tiles) {
        EXPECT_EQ(plan.single.size(), mode == 1 ? 1u : 0u) << what;
      }
      const cuda::DecodeSplits ks =
          mode == 3 ? cuda::DecodeSplits{1, (plan.max_keys + cuda::kDecodeTile - 1) / cuda::kDecodeTile * cuda::kDecodeTile}
                    : plan.splits;
      if (mode == 2) {
        EXPECT_GT(ks.splits, 1) << what;  // so that mode 3 is a different path
      }
      Guarded<float> part(size_t(N * nh * ks.splits * (hd + 2)));
      Guarded<cuda::DecodeRow> d_rows(rows.size());
      d_rows.upload(rows);
      Guarded<uint64_t> d_masks(masks.size());
      d_masks.upload(masks);
      Guarded<int32_t> d_single(std::max<size_t>(plan.single.size(), 1));
      if (!plan.single.empty()) cudaMemcpy(d_single.ptr(), plan.single.data(), plan.single.size() * 4, cudaMemcpyHostToDevice);
      Guarded<cuda::AttentionTile> d_tiles(std::max<size_t>(plan.tiles.size(), 1));
      if (!plan.tiles.empty())
        cudaMemcpy(d_tiles.ptr(), plan.tiles.data(), plan.tiles.size() * sizeof(cuda::AttentionTile),
                   cudaMemcpyHostToDevice);
      cuda::AttentionWork work{d_single.ptr(), int64_t(plan.single.size()), d_tiles.ptr(), int64_t(plan.tiles.size())};
      cuda::decode_attention(reinterpret_cast<cuda::bf16*>(d_out.ptr()), part.ptr(),
                             reinterpret_cast<const cuda::bf16*>(d_qkv.ptr()), ld, reinterpret_cast<const cuda::bf16*>(d_kc.ptr()),
                             reinterpret_cast<const cuda::bf16*>(d_vc.ptr()), d_rows.ptr(), d_masks.ptr(), N, nh, nkv, hd,
                             max_len, ks.splits, ks.split_len, nullptr, nullptr, tiles ? &work : nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
      const auto out = to_f32(d_out.download());
      EXPECT_TRUE(d_out.guards_intact()) << what;
      EXPECT_TRUE(part.guards_intact()) << what;
      cuda::decode_attention(reinterpret_cast<cuda::bf16*>(d_pout.ptr()), part.ptr(),
                             reinterpret_cast<const cuda::bf16*>(d_qkv.ptr()), ld,
                             reinterpret_cast<const cuda::bf16*>(d_pkc.ptr()),
                             reinterpret_cast<const cuda::bf16*>(d_pvc.ptr()), d_rows.ptr(), d_masks.ptr(), N, nh, nkv,
                             hd, paged, ks.splits, ks.split_len, nullptr, nullptr, tiles ? &work : nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what << ", paged";
      EXPECT_EQ(to_f32(d_pout.download()), out) << what << ": the paged cache gave other outputs";
      for (int64_t rh = 0; rh < N * nh; ++rh) {
        double err = 0, norm = 0;
        for (int64_t i = 0; i < hd; ++i) {
          const double want = ref[size_t(rh * hd + i)], got = out[size_t(rh * hd + i)];
          err = std::max(err, std::fabs(got - want));
          norm = std::max(norm, std::fabs(want));
        }
        ASSERT_LE(err, 8e-3 * std::max(norm, 0.1)) << what << ": row " << rh / nh << ", head " << rh % nh;
      }
    }
  }
}

// The real SmolLM2 (head_dim 64: prefill goes through the tensor-core attention, decoding
// through the cache kernel): three golden prompts prefilled in one forward, then 32 greedy
// steps against the CPU decoder on the same (dequantised) weights.
TEST(CudaDecodeSmolLM2, GreedyDecodingMatchesTheCpuDecoder) {
  REQUIRE_GPU();
  const char* env = std::getenv("TALON_SMOLLM2_GGUF");
  const fs::path gguf = env ? fs::path(env) : fs::path(source_dir()) / ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!fs::exists(gguf)) GTEST_SKIP() << gguf << " missing";
  auto ck = open_checkpoint(gguf);
  Twin t(*ck, 3, 256);
  const int64_t V = t.c().vocab;
  st::File g(golden_fixture("smollm2") / "golden.safetensors");
  std::vector<DecodeRequest> reqs;
  for (int p = 0; p < 3; ++p) {
    auto ids64 = read_i64(g, fmt::format("p{}.input_ids", p));
    reqs.push_back({p, std::vector<int32_t>(ids64.begin(), ids64.end()), {}, false});
  }
  int agree = 0, checked = 0;
  for (int step = 0; step < 32; ++step) {
    std::vector<float> la(size_t(3 * V)), lb(size_t(3 * V));
    t.cpu->forward(reqs, Capture{}, la.data());
    t.gpu->forward(reqs, Capture{}, lb.data());
    for (int s = 0; s < 3; ++s) {
      t.commit_all(s);
      const float* a = la.data() + s * V;
      const float* b = lb.data() + s * V;
      EXPECT_LE(rel_err(b, a, size_t(V)), tol::kCudaDecodeRel) << "slot " << s << ", step " << step;
      std::vector<float> sorted(a, a + V);
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
      const int32_t want = int32_t(std::max_element(a, a + V) - a), got = int32_t(std::max_element(b, b + V) - b);
      if (sorted[0] - sorted[1] >= tol::kCudaGreedyMargin) {
        ++checked;
        agree += got == want;
        EXPECT_EQ(got, want) << "slot " << s << ", step " << step;
      }
      reqs[size_t(s)] = {s, {want}, {}, true};
    }
  }
  std::printf("cuda decode smollm2: greedy agree %d/%d (margin >= %.2f)\n", agree, checked, tol::kCudaGreedyMargin);
}

}  // namespace
#endif  // TALON_HAVE_CUDA
