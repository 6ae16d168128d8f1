// DeepSeek-family models in every parallel layout against the same model on one GPU:
// tensor parallel (heads, MLP widths and experts split, all-reduce), expert parallel
// (tokens split by sequence, experts split, rows moved by all-to-all; with more ranks than
// sequences some ranks have no tokens and still serve their experts) and data parallel
// replicas (extract --dp). On a one-GPU machine the ranks share the GPU (share_devices:
// device-copy collectives); with two GPUs or more the same layouts also run over NCCL.
//
// Checked: every requested capture comes back as exactly one [T, H] block per layer id in
// its destination rows (rows are prefilled with NaN, so a row no rank wrote fails), h[L]
// included, and values and logits agree with the one-GPU model within bf16 tolerance. The
// extract test checks the written dataset: each sample's aux_hidden_states is [T, 3H] and
// hidden_states [T, H], equal to the one-GPU run's. Skips without a GPU.
#include <gtest/gtest.h>

#ifdef TALON_HAVE_CUDA
#include <cuda_runtime.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <map>
#include <random>

#include "data/extract.h"
#include "backend/backend.h"
#include "backend/cuda/deepseek_weights.h"
#include "data/features.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "tests/gpu_test.h"
#include "tests/test_util.h"
#include "tests/tolerances.h"

using namespace talon;
using namespace talon::testing;
using json = nlohmann::json;

namespace {

fs::path golden(const std::string& name) { return fs::path(source_dir()) / "tests/fixtures/golden" / name; }

int gpu_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

struct Layout {
  std::string name;
  int tp = 1, ep = 1;
  std::vector<int> devices;
  bool shared = false;
};

std::vector<Layout> layouts(int64_t n_experts, int64_t n_heads) {
  std::vector<Layout> v;
  for (int n : {2, 4}) {
    if (n_heads % n == 0 && n_experts % n == 0)
      v.push_back({"tp" + std::to_string(n) + " shared", n, 1, std::vector<int>(size_t(n), 0), true});
    if (n_experts % n == 0)
      v.push_back({"ep" + std::to_string(n) + " shared", 1, n, std::vector<int>(size_t(n), 0), true});
  }
  const int g = gpu_count();
  if (g >= 2) {
    v.push_back({"tp2 nccl", 2, 1, {0, 1}, false});
    v.push_back({"ep2 nccl", 1, 2, {0, 1}, false});
  }
  return v;
}

// One forward of `b` capturing every layer id 0..L (fp32) into rows scattered in reverse
// sequence order, plus logits.
struct Outputs {
  std::vector<std::vector<float>> caps;  // [L + 1][N * H]
  std::vector<float> logits;
};

Outputs run(Model& m, const Batch& b) {
  const ModelConfig& c = m.config();
  const int64_t N = b.n_tokens(), H = c.hidden, L = c.n_layers;
  Outputs r;
  r.caps.assign(size_t(L + 1), std::vector<float>(size_t(N * H), std::nanf("")));
  r.logits.assign(size_t(N * c.vocab), std::nanf(""));
  Capture cap;
  for (int64_t l = 0; l <= L; ++l) {
    cap.layers.push_back(int(l));
    cap.out.push_back(r.caps[size_t(l)].data());
  }
  // Sequence s lands after all later sequences: destinations differ from batch rows.
  int64_t at = 0;
  cap.seq_dst.assign(size_t(b.n_seqs()), 0);
  for (int64_t s = b.n_seqs() - 1; s >= 0; --s) {
    cap.seq_dst[size_t(s)] = at;
    at += b.seq_start[size_t(s + 1)] - b.seq_start[size_t(s)];
  }
  m.forward(b, cap, r.logits.data());
  return r;
}

// Rows whose largest difference exceeds 0.1 of the reference's max |value| (a few rows:
// a different expert choice on a near tie; all rows: a wrong computation).
int rows_off(const std::vector<float>& got, const std::vector<float>& want, int64_t H) {
  float m = 1.f;
  for (float v : want) m = std::max(m, std::fabs(v));
  int n = 0;
  for (size_t r = 0; r * size_t(H) < want.size(); ++r) {
    float d = 0;
    for (int64_t h = 0; h < H; ++h) d = std::max(d, std::fabs(got[r * size_t(H) + size_t(h)] - want[r * size_t(H) + size_t(h)]));
    n += d > 0.1f * m;
  }
  return n;
}

TEST(CudaParallel, DeepseekLayoutsMatchOneGpu) {
  REQUIRE_GPU();
  for (const std::string fx : {"kimi_k2_int4", "deepseek_v3"}) {
    auto ck = open_checkpoint(golden(fx));
    const ModelConfig& c = ck->config();
    std::mt19937 rng(7);
    Batch b;
    for (int64_t len : {9, 17, 5}) {  // 3 sequences: ep4 leaves a rank without tokens
      std::vector<int32_t> ids(static_cast<size_t>(len));
      for (auto& x : ids) x = int32_t(rng() % uint32_t(c.vocab));
      b.add(ids.data(), len);
    }
    auto one = make_cuda_model(*ck, 0);
    const int64_t H = c.hidden;
    const Outputs want = run(*one, b);
    one.reset();
    for (const Layout& lay : layouts(c.ds.n_routed_experts, c.n_heads)) {
      GpuOptions go;
      go.devices = lay.devices;
      go.tp = lay.tp, go.ep = lay.ep, go.share_devices = lay.shared;
      auto m = make_cuda_model(*ck, go);
      const Outputs got = run(*m, b);
      ASSERT_EQ(got.caps.size(), want.caps.size()) << fx << " " << lay.name;
      std::string line;
      for (size_t l = 0; l < got.caps.size(); ++l) {
        size_t unwritten = 0;
        for (float v : got.caps[l]) unwritten += std::isnan(v);
        EXPECT_EQ(unwritten, 0u) << fx << " " << lay.name << " h" << l << ": rows no rank wrote";
        const double e = rel_err(got.caps[l].data(), want.caps[l].data(), want.caps[l].size());
        EXPECT_LE(e, tol::kCudaTpRel) << fx << " " << lay.name << " h" << l << " (" << rows_off(got.caps[l], want.caps[l], H)
                                      << " rows off by > 0.1)";
        line += fmt::format(" h{} {:.1e}", l, e);
      }
      const double el = rel_err(got.logits.data(), want.logits.data(), want.logits.size());
      EXPECT_LE(el, tol::kCudaTpRel) << fx << " " << lay.name << " logits";
      std::printf("cuda parallel %s %s (%s):%s logits %.1e\n", fx.c_str(), lay.name.c_str(), m->backend().c_str(),
                  line.c_str(), el);
    }
  }
}

// Expert parallelism with the overlap on (two halves of the tokens on two streams, their
// all-to-alls interleaved with the other half's experts) computes what it computes without:
// every row's experts and sums are the same, only which call carries the row differs. Against
// the run without overlap on the same layout, within the parallel tolerance, every capture
// written; 3 sequences (31 tokens): ep4 leaves a rank without tokens, whose halves are both empty.
TEST(CudaParallel, ExpertParallelOverlapMatchesWithout) {
  REQUIRE_GPU();
  for (const std::string fx : {"kimi_k2_int4", "deepseek_v3"}) {
    auto ck = open_checkpoint(golden(fx));
    const ModelConfig& c = ck->config();
    std::mt19937 rng(11);
    Batch b;
    for (int64_t len : {9, 17, 5}) {
      std::vector<int32_t> ids(static_cast<size_t>(len));
      for (auto& x : ids) x = int32_t(rng() % uint32_t(c.vocab));
      b.add(ids.data(), len);
    }
    for (const Layout& lay : layouts(c.ds.n_routed_experts, c.n_heads)) {
      if (lay.ep == 1) continue;
      GpuOptions go;
      go.devices = lay.devices;
      go.tp = lay.tp, go.ep = lay.ep, go.share_devices = lay.shared;
      Outputs want, got;
      {
        cuda::moe_ep_overlap_use(0);
        auto m = make_cuda_model(*ck, go);
        want = run(*m, b);
      }
      {
        cuda::moe_ep_overlap_use(1);
        auto m = make_cuda_model(*ck, go);
        got = run(*m, b);
      }
      cuda::moe_ep_overlap_use(-1);
      for (size_t l = 0; l < got.caps.size(); ++l) {
        size_t unwritten = 0;
        for (float v : got.caps[l]) unwritten += std::isnan(v);
        EXPECT_EQ(unwritten, 0u) << fx << " " << lay.name << " h" << l;
        EXPECT_LE(rel_err(got.caps[l].data(), want.caps[l].data(), want.caps[l].size()), tol::kCudaTpRel)
            << fx << " " << lay.name << " h" << l;
      }
      const double el = rel_err(got.logits.data(), want.logits.data(), want.logits.size());
      EXPECT_LE(el, tol::kCudaTpRel) << fx << " " << lay.name << " logits";
      std::printf("cuda ep overlap %s %s: logits %.1e from the run without\n", fx.c_str(), lay.name.c_str(), el);
    }
  }
}

// One extraction per layout over five samples; returns sample index -> (aux, final) rows.
using Features = std::map<int64_t, std::pair<std::vector<float>, std::vector<float>>>;

Features extract(const fs::path& work, const std::string& name, const std::string& device, int tp, int ep, int dp,
                 int64_t H) {
  ExtractOptions o;
  o.model = golden("kimi_k2_int4");
  o.data = work / "data.jsonl";
  o.out = work / name;
  o.layers = "0,1,2";
  o.fp32 = true;
  o.device = device;
  o.tp = tp, o.ep = ep, o.dp = dp;
  o.share_gpus = true;
  o.max_batch_tokens = 64;
  run_extract(o);
  Features f;
  const json man = read_manifest(o.out);
  for (size_t i = 0; i < man["shards"].size(); ++i) {
    st::File s(shard_path(o.out, man["shards"][i], i));
    const auto& aux = s.get(shard_tensors::aux_hidden);
    const auto& fin = s.get(shard_tensors::hidden);
    const int64_t N = s.get(shard_tensors::input_ids).shape.at(0);
    // Exactly the 3 requested aux captures side by side, and h[L]: [N, 3H] and [N, H].
    EXPECT_EQ(aux.shape, (std::vector<int64_t>{N, 3 * H})) << name;
    EXPECT_EQ(fin.shape, (std::vector<int64_t>{N, H})) << name;
    const auto a = read_f32(s, shard_tensors::aux_hidden), h = read_f32(s, shard_tensors::hidden);
    const auto off = read_i64(s, shard_tensors::sample_offsets), idx = read_i64(s, shard_tensors::sample_index);
    for (size_t k = 0; k < idx.size(); ++k) {
      auto& e = f[idx[k]];
      e.first.assign(a.begin() + off[k] * 3 * H, a.begin() + off[k + 1] * 3 * H);
      e.second.assign(h.begin() + off[k] * H, h.begin() + off[k + 1] * H);
    }
  }
  return f;
}

TEST(CudaParallel, ExtractWritesEveryCaptureInEveryLayout) {
  REQUIRE_GPU();
  const ModelConfig c = open_checkpoint(golden("kimi_k2_int4"))->config();
  const fs::path work = fs::temp_directory_path() / ("talon_par_extract_" + std::to_string(::getpid()));
  fs::remove_all(work);
  fs::create_directories(work);
  std::mt19937 rng(3);
  {
    std::ofstream out(work / "data.jsonl");
    int k = 0;
    for (int len : {9, 17, 5, 12, 21}) {
      std::vector<int> ids(static_cast<size_t>(len));
      for (auto& x : ids) x = int(rng() % uint32_t(c.vocab));
      out << json{{"id", fmt::format("s{}", k++)}, {"input_ids", ids}, {"loss_mask", std::vector<int>(ids.size(), 1)}}
                 .dump()
          << "\n";
    }
  }
  const Features want = extract(work, "one", "cuda:0", 1, 1, 1, c.hidden);
  ASSERT_EQ(want.size(), 5u);
  struct L {
    std::string name, device;
    int tp, ep, dp;
  };
  for (const L& l : {L{"tp2", "cuda:0,0", 2, 1, 1}, L{"ep2", "cuda:0,0", 1, 2, 1}, L{"dp2", "cuda:0,0", 1, 1, 2},
                     L{"ep2_dp2", "cuda:0,0,0,0", 1, 2, 2}}) {
    const Features got = extract(work, l.name, l.device, l.tp, l.ep, l.dp, c.hidden);
    ASSERT_EQ(got.size(), want.size()) << l.name;
    for (const auto& [i, w] : want) {
      const auto& g = got.at(i);
      ASSERT_EQ(g.first.size(), w.first.size()) << l.name << " sample " << i;
      ASSERT_EQ(g.second.size(), w.second.size()) << l.name << " sample " << i;
      EXPECT_LE(rel_err(g.first.data(), w.first.data(), w.first.size()), tol::kCudaTpRel) << l.name << " " << i;
      EXPECT_LE(rel_err(g.second.data(), w.second.data(), w.second.size()), tol::kCudaTpRel) << l.name << " " << i;
    }
  }
  fs::remove_all(work);
}

}  // namespace
#endif  // TALON_HAVE_CUDA
