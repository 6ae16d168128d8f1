// Checks shared by the CPU and CUDA decoder tests.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "model/decode.h"
#include "model/model.h"
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

}  // namespace talon::testing
