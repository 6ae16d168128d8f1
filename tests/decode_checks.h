// Checks shared by the CPU and CUDA decoder tests.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <random>
#include <string>
#include <vector>

#include "model/decode.h"
#include "model/model.h"
#include "model/sampling.h"
#include "tests/test_util.h"

namespace talon::testing {

// A decoder of 2 slots and max_len 8 over a vocabulary smaller than 100000 refuses each
// malformed request with an error naming what is wrong, and a refused request leaves the
// slots usable: a tree forward, then a commit that must follow the kept path.
inline void expect_malformed_requests_refused(Decoder& dec) {
  const auto refused = [&](const std::vector<DecodeRequest>& reqs, const char* what) {
    const std::string msg = error_of([&] { dec.forward(reqs, Capture{}, nullptr); });
    EXPECT_NE(msg.find(what), std::string::npos) << "expected '" << what << "', got: " << msg;
  };
  refused({{2, {1}, {}, true}}, "slot 2 outside [0, 2)");
  refused({{0, {1, 2, 3, 4, 5, 6, 7, 8, 9}, {}, true}}, "more than max_len 8");
  refused({{0, {1, 2}, {-1, 1}, true}}, "parent 1 of token 1");
  refused({{0, {1, 2}, {-1}, true}}, "2 tokens but 1 parents");
  refused({{0, {1}, {}, true}, {0, {2}, {}, true}}, "appears twice");
  refused({{0, {100000}, {}, true}}, "outside the vocabulary");
  dec.forward({{1, {1, 2, 3}, {-1, -1, 1}, true}}, Capture{}, nullptr);
  refused({{1, {4}, {}, true}}, "uncommitted");
  const std::string msg = error_of([&] { dec.commit(1, {0, 2}); });
  EXPECT_NE(msg.find("does not continue the kept path"), std::string::npos) << msg;
  dec.commit(1, {1, 2});
  EXPECT_EQ(dec.length(1), 2);
}

// forward_steps on `a` against the rounds it stands for on `b` (a twin of the same model with
// at least 3 slots and max_len >= 80): forward_sample (or forward_greedy) and commit_all,
// step by step, each step fed the previous step's ids. Slots get random prompts first; then
// greedy chains over all three slots, a sampled chain over two of them named out of order,
// and a chain long enough to cross cache pages. Ids and lengths must be the same; with
// `refusals`, forward_steps' argument checks too.
inline void expect_steps_match_rounds(Decoder& a, Decoder& b, bool refusals) {
  const int64_t V = a.config().vocab;
  std::mt19937 rng(17);
  std::uniform_int_distribution<int32_t> tok(0, int32_t(V - 1));
  for (int s = 0; s < 3; ++s) {
    a.reset(s);
    b.reset(s);
    std::vector<int32_t> prompt(size_t(5 + 4 * s));
    for (auto& t : prompt) t = tok(rng);
    for (Decoder* d : {&a, &b}) {
      d->forward({{s, prompt, {}, false}}, Capture{}, nullptr);
      d->commit_all(s);
    }
  }
  int case_no = 0;
  auto check = [&](const std::vector<int>& slots, int64_t steps, const SamplingParams& p) {
    SCOPED_TRACE(::testing::Message() << "chain " << case_no);
    const size_t B = slots.size();
    std::vector<int32_t> first(B);
    for (auto& t : first) t = tok(rng);
    std::vector<double> u(size_t(steps) * B);
    for (size_t i = 0; i < u.size(); ++i) u[i] = uniform01(5, uint64_t(case_no), uint64_t(i));
    ++case_no;
    std::vector<int32_t> got(size_t(steps) * B, -1), want(size_t(steps) * B, -2);
    a.forward_steps(slots, first, steps, p, p.greedy() ? nullptr : u.data(), got.data());
    std::vector<DecodeRequest> reqs;
    for (size_t i = 0; i < B; ++i) reqs.push_back({slots[i], {first[i]}, {}, true});
    for (int64_t t = 0; t < steps; ++t) {
      int32_t* out = want.data() + size_t(t) * B;
      b.forward_sample(reqs, Capture{}, p, u.data() + size_t(t) * B, out);
      for (size_t i = 0; i < B; ++i) {
        b.commit_all(slots[i]);
        reqs[i].tokens[0] = out[i];
      }
    }
    for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], want[i]) << "step " << i / B << ", slot " << slots[i % B];
    for (int s = 0; s < 3; ++s) EXPECT_EQ(a.length(s), b.length(s)) << "slot " << s;
  };
  SamplingParams greedy, sampled;
  sampled.temperature = 0.9;
  sampled.top_p = 0.95;
  check({0, 1, 2}, 1, greedy);
  check({0, 1, 2}, 6, greedy);
  check({2, 0}, 5, sampled);
  check({1, 0, 2}, 40, greedy);
  if (!refusals) return;
  auto refused = [&](const std::function<void()>& f, const char* what) {
    const std::string msg = error_of(f);
    EXPECT_NE(msg.find(what), std::string::npos) << "expected '" << what << "', got: " << msg;
  };
  int32_t ids[64];
  refused([&] { a.forward_steps({0}, {1}, 0, greedy, nullptr, ids); }, "of 0 steps");
  refused([&] { a.forward_steps({0, 0}, {1, 2}, 2, greedy, nullptr, ids); }, "names slot 0 twice");
  refused([&] { a.forward_steps({0, 1}, {1}, 2, greedy, nullptr, ids); }, "2 slots with 1 first tokens");
  refused([&] { a.forward_steps({9}, {1}, 2, greedy, nullptr, ids); }, "slot 9 outside");
  refused([&] { a.forward_steps({0}, {int32_t(V)}, 2, greedy, nullptr, ids); }, "first token");
  refused([&] { a.forward_steps({0}, {1}, 2, sampled, nullptr, ids); }, "without uniforms");
  refused([&] { a.forward_steps({0}, {1}, a.max_len(), greedy, nullptr, ids); }, "exceed max_len");
}

}  // namespace talon::testing
