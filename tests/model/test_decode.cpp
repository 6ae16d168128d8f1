// The cached decoder (model/decode.h) against full forwards of the same tokens: chains
// decoded token by token, trees whose every node must equal a forward of its own path,
// commits of a path followed by further decoding, captures, and malformed requests.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "model/decode.h"
#include "backend/backend.h"
#include "model/model.h"
#include "tests/decode_checks.h"
#include "tests/sampling_reference.h"
#include "tests/test_util.h"
#include "tests/tolerances.h"

using namespace talon;
using namespace talon::testing;

namespace {


// Last-row logits and h[layer] of a full forward over `ids`.
struct Full {
  std::vector<float> logits, hidden;
};
Full full_forward(Model& m, const std::vector<int32_t>& ids, int layer) {
  const auto& c = m.config();
  Batch b;
  b.add(ids.data(), int64_t(ids.size()));
  const int64_t T = int64_t(ids.size());
  std::vector<float> lg(size_t(T * c.vocab)), hs(size_t(T * c.hidden));
  Capture cap({layer}, {hs.data()});
  m.forward(b, cap, lg.data());
  Full f;
  f.logits.assign(lg.end() - c.vocab, lg.end());
  f.hidden.assign(hs.end() - c.hidden, hs.end());
  return f;
}

std::vector<int32_t> random_ids(std::mt19937& rng, int64_t n, int64_t V) {
  std::uniform_int_distribution<int32_t> d(0, int32_t(V - 1));
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(rng);
  return v;
}

class Decode : public ::testing::TestWithParam<std::string> {};

TEST_P(Decode, ChainTokenByTokenEqualsFullForward) {
  auto ck = open_checkpoint(golden_fixture(GetParam()));
  auto model = make_cpu_model(*ck);
  const ModelConfig& c = model->config();
  auto dec = make_cpu_decoder(*ck, 2, 64);
  std::mt19937 rng(7);
  const auto ids = random_ids(rng, 20, c.vocab);
  const int layer = int(c.n_layers / 2);
  // Prefill 8 tokens (last logits only), then one token at a time; slot 1 runs another
  // sequence in the same forwards, so packing cannot leak between slots.
  const auto other = random_ids(rng, 20, c.vocab);
  std::vector<float> lg(size_t(2 * c.vocab)), hs(size_t(16 * c.hidden));
  Capture cap({layer}, {hs.data()});
  dec->forward({{0, {ids.begin(), ids.begin() + 8}, {}, false}, {1, {other.begin(), other.begin() + 8}, {}, false}},
               cap, lg.data());
  dec->commit_all(0);
  dec->commit_all(1);
  for (int64_t t = 8; t <= 20; ++t) {
    const auto a = full_forward(*model, {ids.begin(), ids.begin() + t}, layer);
    const auto b = full_forward(*model, {other.begin(), other.begin() + t}, layer);
    EXPECT_LE(rel_err(lg.data(), a.logits.data(), size_t(c.vocab)), tol::kDecodeRel) << "slot 0, length " << t;
    EXPECT_LE(rel_err(lg.data() + c.vocab, b.logits.data(), size_t(c.vocab)), tol::kDecodeRel) << "slot 1, length " << t;
    const int64_t last = t == 8 ? 7 : 0;  // capture row of the sequence's last token in slot 0
    EXPECT_LE(rel_err(hs.data() + last * c.hidden, a.hidden.data(), size_t(c.hidden)), tol::kDecodeRel) << t;
    if (t == 20) break;
    dec->forward({{0, {ids[size_t(t)]}, {}, true}, {1, {other[size_t(t)]}, {}, true}}, cap, lg.data());
    dec->commit_all(0);
    dec->commit_all(1);
    EXPECT_EQ(dec->length(0), t + 1);
  }
}

TEST_P(Decode, TreeNodesEqualForwardsOfTheirPaths) {
  auto ck = open_checkpoint(golden_fixture(GetParam()));
  auto model = make_cpu_model(*ck);
  const ModelConfig& c = model->config();
  auto dec = make_cpu_decoder(*ck, 1, 64);
  std::mt19937 rng(11);
  const auto prefix = random_ids(rng, 9, c.vocab);
  dec->forward({{0, prefix, {}, false}}, Capture{}, nullptr);
  dec->commit_all(0);
  // A tree of 10 nodes: two roots, branching at several depths.
  const std::vector<int32_t> parents = {-1, 0, 0, -1, 1, 1, 3, 4, 6, 2};
  const auto tokens = random_ids(rng, int64_t(parents.size()), c.vocab);
  std::vector<float> lg(parents.size() * size_t(c.vocab));
  dec->forward({{0, tokens, parents, true}}, Capture{}, lg.data());
  auto path_of = [&](int32_t node) {
    std::vector<int32_t> p;
    for (int32_t a = node; a >= 0; a = parents[size_t(a)]) p.insert(p.begin(), a);
    return p;
  };
  for (size_t i = 0; i < parents.size(); ++i) {
    std::vector<int32_t> ids = prefix;
    for (int32_t a : path_of(int32_t(i))) ids.push_back(tokens[size_t(a)]);
    const auto f = full_forward(*model, ids, 0);
    EXPECT_LE(rel_err(lg.data() + i * size_t(c.vocab), f.logits.data(), size_t(c.vocab)), tol::kDecodeRel)
        << "node " << i;
  }
  // Keep the path to node 7 (0 -> 1 -> 4 -> 7), then decode two more tokens on top of it.
  dec->commit(0, {0, 1, 4, 7});
  EXPECT_EQ(dec->length(0), 13);
  std::vector<int32_t> ids = prefix;
  for (int32_t a : {0, 1, 4, 7}) ids.push_back(tokens[size_t(a)]);
  for (int step = 0; step < 2; ++step) {
    const int32_t next = random_ids(rng, 1, c.vocab)[0];
    ids.push_back(next);
    dec->forward({{0, {next}, {}, true}}, Capture{}, lg.data());
    dec->commit_all(0);
    const auto f = full_forward(*model, ids, 0);
    EXPECT_LE(rel_err(lg.data(), f.logits.data(), size_t(c.vocab)), tol::kDecodeRel) << "after the commit, " << step;
  }
  // Dropping every pending token leaves the prefix as it was.
  dec->forward({{0, {1, 2, 3}, {}, true}}, Capture{}, lg.data());
  dec->commit(0, {});
  EXPECT_EQ(dec->length(0), int64_t(ids.size()));
  dec->forward({{0, {5}, {}, true}}, Capture{}, lg.data());
  ids.push_back(5);
  EXPECT_LE(rel_err(lg.data(), full_forward(*model, ids, 0).logits.data(), size_t(c.vocab)), tol::kDecodeRel);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Decode, ::testing::Values("llama_gqa", "qwen2", "qwen3", "mistral"));
// MLA + MoE: the decoder caches the normalized latent and k_pe and attends in the absorbed
// form; the reference is the expanded-form forward.
INSTANTIATE_TEST_SUITE_P(DeepSeek, Decode,
                         ::testing::Values("deepseek_v2", "deepseek_v3", "deepseek_v3_noqlora", "kimi_k2_int4"));

TEST(Decode, SlidingWindowMatchesTheFullForward) {
  // The mistral fixture with a 5-token window (the full forward's window rule is the reference).
  const fs::path dir = fs::path(::testing::TempDir()) / "talon_decode_window";
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy_file(golden_fixture("mistral") / "model.safetensors", dir / "model.safetensors");
  auto cfg = nlohmann::json::parse(read_text_file(golden_fixture("mistral") / "config.json"));
  cfg["sliding_window"] = 5;
  write_file_atomic(dir / "config.json", cfg.dump(2));
  auto ck = open_checkpoint(dir);
  ASSERT_EQ(ck->config().sliding_window, 5);
  auto model = make_cpu_model(*ck);
  const int64_t V = model->config().vocab;
  auto dec = make_cpu_decoder(*ck, 1, 32);
  std::mt19937 rng(3);
  auto ids = random_ids(rng, 12, V);
  dec->forward({{0, {ids.begin(), ids.begin() + 6}, {}, false}}, Capture{}, nullptr);
  dec->commit_all(0);
  std::vector<float> lg(size_t(3 * V));
  // A small tree on top: its deeper nodes see fewer prefix keys.
  const std::vector<int32_t> parents = {-1, 0, 1};
  dec->forward({{0, {ids[6], ids[7], ids[8]}, parents, true}}, Capture{}, lg.data());
  for (int i = 0; i < 3; ++i) {
    const auto f = full_forward(*model, {ids.begin(), ids.begin() + 7 + i}, 0);
    EXPECT_LE(rel_err(lg.data() + i * V, f.logits.data(), size_t(V)), tol::kDecodeRel) << i;
  }
}

// forward_greedy (the default: forward, then the argmax on the host) gives one id per logits
// row, in forward's row order: a prefill's last row, every row of an all-logits chain and
// of a tree, slots mixed in one call. Checked against a twin decoder's logits, scanned here.
TEST(Decode, GreedyIdsFollowTheLogitsRows) {
  for (const char* name : {"llama_gqa", "deepseek_v3"}) {
    SCOPED_TRACE(name);
    auto ck = open_checkpoint(golden_fixture(name));
    auto a = make_cpu_decoder(*ck, 2, 40), b = make_cpu_decoder(*ck, 2, 40);
    const int64_t V = a->config().vocab;
    std::mt19937 rng(7);
    const std::vector<std::vector<DecodeRequest>> calls = {
        {{0, random_ids(rng, 6, V), {}, false}, {1, random_ids(rng, 3, V), {}, true}},
        {{1, random_ids(rng, 1, V), {}, true}, {0, random_ids(rng, 5, V), {-1, 0, 0, 2, 1}, true}},
        {{0, random_ids(rng, 4, V), {}, false}}};
    int rows = 0;
    for (const auto& reqs : calls) {
      const int64_t NL = logits_rows(reqs);
      std::vector<float> lb(size_t(NL * V));
      std::vector<int32_t> ids(size_t(NL), -1);
      b->forward(reqs, Capture{}, lb.data());
      a->forward_greedy(reqs, Capture{}, ids.data());
      for (int64_t r = 0; r < NL; ++r, ++rows) {
        const float* l = lb.data() + r * V;
        const int32_t want = int32_t(std::max_element(l, l + V) - l);  // first of the maxima
        EXPECT_EQ(ids[size_t(r)], want) << "row " << r;
      }
      for (const auto& r : reqs) {
        a->commit(r.slot, {0});
        b->commit(r.slot, {0});
      }
    }
    EXPECT_EQ(rows, 1 + 3 + 1 + 5 + 1);
  }
}

// forward_sample (the default: forward, then sampling on the host) draws one id per logits
// row with that row's uniform number, in forward's row order; checked against a twin
// decoder's logits and the sampling oracle (tests/sampling_reference.h) for several
// parameter sets, greedy included.
TEST(Decode, SampledIdsFollowTheLogitsRows) {
  auto ck = open_checkpoint(golden_fixture("llama_gqa"));
  struct P {
    double t;
    int64_t k;
    double p;
  };
  int checked = 0, ambiguous = 0;
  for (const P prm : {P{0, 0, 1}, P{0.8, 0, 1}, P{1.3, 5, 1}, P{0.7, 0, 0.6}, P{1.0, 7, 0.9}}) {
    SCOPED_TRACE(fmt::format("T {} top_k {} top_p {}", prm.t, prm.k, prm.p));
    SamplingParams sp;
    sp.temperature = prm.t, sp.top_k = prm.k, sp.top_p = prm.p;
    auto a = make_cpu_decoder(*ck, 2, 40), b = make_cpu_decoder(*ck, 2, 40);
    const int64_t V = a->config().vocab;
    std::mt19937 rng(11);
    const std::vector<std::vector<DecodeRequest>> calls = {
        {{0, random_ids(rng, 6, V), {}, false}, {1, random_ids(rng, 3, V), {}, true}},
        {{1, random_ids(rng, 1, V), {}, true}, {0, random_ids(rng, 5, V), {-1, 0, 0, 2, 1}, true}}};
    for (const auto& reqs : calls) {
      const int64_t NL = logits_rows(reqs);
      std::vector<float> lb(size_t(NL * V));
      std::vector<int32_t> ids(size_t(NL), -1);
      std::vector<double> u(static_cast<size_t>(NL));
      for (int64_t r = 0; r < NL; ++r) u[size_t(r)] = uniform01(5, uint64_t(checked), uint64_t(r));
      b->forward(reqs, Capture{}, lb.data());
      a->forward_sample(reqs, Capture{}, sp, u.data(), ids.data());
      for (int64_t r = 0; r < NL; ++r, ++checked) {
        const auto want = reference_draw(lb.data() + r * V, V, prm.t, prm.k, prm.p, u[size_t(r)]);
        if (!want.ambiguous) {
          EXPECT_EQ(ids[size_t(r)], want.id) << "row " << r;
        }
        ambiguous += want.ambiguous;
      }
      for (const auto& r : reqs) {
        a->commit(r.slot, {0});
        b->commit(r.slot, {0});
      }
    }
  }
  EXPECT_EQ(checked, 5 * (1 + 3 + 1 + 5));
  EXPECT_LE(ambiguous, 1);
}

TEST(Decode, MalformedRequestsAreRefused) {
  for (const char* name : {"llama_gqa", "deepseek_v3"}) {
    SCOPED_TRACE(name);
    auto ck = open_checkpoint(golden_fixture(name));
    auto dec = make_cpu_decoder(*ck, 2, 8);
    expect_malformed_requests_refused(*dec);
  }
}

// Decoder::forward_accept_chain (the host decision every decoder has) against the definition of
// speculative sampling, with each row's target distribution p_i taken from a plain forward of the
// same chain on a second decoder: (a) q_i = p_i keeps every draft token (the test u < min(1, 1)
// always passes) and draws the next token from p_k with u[k]; (b) a draft token outside the
// target's top-1 with q = one-hot on it is tested (u[0] used) and rejected, and the next token is
// drawn from max(0, p_0 - q_0) = p_0, i.e. the argmax, with u[1]; (c) q_0(d) = 0 rejects without
// a test, so the residual draw takes u[0]. Chain parents given as i - 1 are a chain too; trees,
// greedy parameters and a wrong q count are refused.
TEST(Decode, ChainAcceptanceFollowsTheDefinition) {
  auto ck = open_checkpoint(golden_fixture("llama_gqa"));
  auto dec = make_cpu_decoder(*ck, 1, 64), ref = make_cpu_decoder(*ck, 1, 64);
  const int64_t V = dec->config().vocab;
  std::mt19937 rng(23);
  const auto prompt = random_ids(rng, 6, V);
  const int k = 3;
  const std::vector<int32_t> chain = random_ids(rng, k + 1, V);
  auto prefill = [&](Decoder& d) {
    d.reset(0);
    d.forward({{0, prompt, {}, false}}, Capture{}, nullptr);
    d.commit_all(0);
  };
  auto dists = [&](const SamplingParams& sp) {  // p_0 .. p_k of the chain
    prefill(*ref);
    std::vector<float> lg(size_t((k + 1) * V));
    ref->forward({{0, chain, {}, true}}, Capture{}, lg.data());
    ref->commit(0, {});
    std::vector<std::vector<double>> p(static_cast<size_t>(k + 1));
    for (int i = 0; i <= k; ++i) sampling_distribution(lg.data() + i * V, V, sp, p[size_t(i)]);
    return p;
  };
  const std::vector<double> u = {0.37, 0.81, 0.12, 0.64};
  SamplingParams sp;
  sp.temperature = 0.9;
  sp.top_p = 0.95;
  {  // (a)
    const auto p = dists(sp);
    std::vector<int32_t> toks = {chain[0]};
    for (int i = 0; i < k; ++i)  // a token the target gives mass to
      toks.push_back(int32_t(std::max_element(p[size_t(i)].begin(), p[size_t(i)].end()) - p[size_t(i)].begin()));
    // p_i depends on the chain so far: recompute for these tokens.
    prefill(*ref);
    std::vector<float> lg(size_t((k + 1) * V));
    ref->forward({{0, toks, {}, true}}, Capture{}, lg.data());
    ref->commit(0, {});
    std::vector<std::vector<double>> q(static_cast<size_t>(k));
    std::vector<double> pk;
    for (int i = 0; i < k; ++i) sampling_distribution(lg.data() + i * V, V, sp, q[size_t(i)]);
    sampling_distribution(lg.data() + k * V, V, sp, pk);
    prefill(*dec);
    std::vector<int32_t> parents = {-1, 0, 1, 2};
    const auto r = dec->forward_accept_chain({0, toks, parents, true}, Capture{}, sp, q, u.data());
    EXPECT_EQ(r.kept, k);
    EXPECT_EQ(r.next, draw(pk, u[size_t(k)]));
    dec->commit(0, {});
  }
  SamplingParams top1 = sp;
  top1.top_k = 1;
  const auto p1 = dists(top1);
  const int32_t best = int32_t(std::max_element(p1[0].begin(), p1[0].end()) - p1[0].begin());
  const int32_t other = (chain[1] == best) ? int32_t((best + 1) % V) : chain[1];
  std::vector<int32_t> toks = {chain[0], other, chain[2], chain[3]};
  std::vector<std::vector<double>> q(static_cast<size_t>(k), std::vector<double>(size_t(V), 1.0 / double(V)));
  {  // (b) rejected after a test: the argmax, with u[1]
    q[0].assign(size_t(V), 0.0);
    q[0][size_t(other)] = 1.0;
    prefill(*dec);
    const auto r = dec->forward_accept_chain({0, toks, {}, true}, Capture{}, top1, q, u.data());
    EXPECT_EQ(r.kept, 0);
    EXPECT_EQ(r.next, best);
    dec->commit(0, {});
  }
  {  // (c) q(d) = 0: no test; the residual max(0, p - q) drawn with u[0]
    q[0].assign(size_t(V), 1.0 / double(V - 1));
    q[0][size_t(other)] = 0.0;
    const auto p = dists(sp);  // the same chain start: p_0 under sp
    std::vector<double> res(static_cast<size_t>(V));
    for (int64_t v = 0; v < V; ++v) res[size_t(v)] = std::max(0.0, p[0][size_t(v)] - q[0][size_t(v)]);
    double mass = 0;
    for (double x : res) mass += x;
    prefill(*dec);
    const auto r = dec->forward_accept_chain({0, toks, {}, true}, Capture{}, sp, q, u.data());
    EXPECT_EQ(r.kept, 0);
    EXPECT_EQ(r.next, draw(mass > 0 ? res : p[0], u[0]));
    dec->commit(0, {});
  }
  // Refusals.
  prefill(*dec);
  EXPECT_NE(error_of([&] { dec->forward_accept_chain({0, toks, {-1, 0, 0, 2}, true}, Capture{}, sp, q, u.data()); })
                .find("takes a chain"),
            std::string::npos);
  EXPECT_NE(error_of([&] { dec->forward_accept_chain({0, toks, {}, true}, Capture{}, SamplingParams{}, q, u.data()); })
                .find("temperature > 0"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              dec->forward_accept_chain({0, toks, {}, true}, Capture{}, sp, {q[0]}, u.data());
            }).find("3 draft tokens with 1 draft distributions"),
            std::string::npos);
}

}  // namespace
