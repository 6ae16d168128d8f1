// Capture::seq_dst: rows of each packed sequence land at their destination rows. On the
// CPU reference the result must be bitwise the unscattered capture, permuted.
#include <gtest/gtest.h>

#include "io/safetensors.h"
#include "backend/backend.h"
#include "model/checkpoint.h"
#include "model/model.h"
#include "tests/test_util.h"
#include "util/error.h"

using namespace talon;

TEST(CaptureScatter, CpuScatterIsAPermutationOfBatchOrder) {
  const fs::path dir = fs::path(talon::testing::source_dir()) / "tests/fixtures/golden/llama_gqa";
  auto ck = open_checkpoint(dir);
  auto m = make_cpu_model(*ck);
  const int64_t H = m->config().hidden;
  st::File g(dir / "golden.safetensors");
  auto ids64 = talon::testing::read_i64(g, "input_ids");
  std::vector<int32_t> ids(ids64.begin(), ids64.end());
  const int64_t T = int64_t(ids.size());
  Batch b;
  b.add(ids.data(), 3);
  b.add(ids.data(), T);
  b.add(ids.data() + 1, T - 1);
  const int64_t N = b.n_tokens();
  std::vector<float> plain(static_cast<size_t>(N * H)), scat(static_cast<size_t>(N * H));
  m->forward(b, Capture({2}, {plain.data()}), nullptr);
  Capture c({2}, {scat.data()});
  // Destinations: third sequence first, then the first, then the second.
  c.seq_dst = {T - 1, T - 1 + 3, 0};
  m->forward(b, c, nullptr);
  auto rows_equal = [&](int64_t src, int64_t dst, int64_t n) {
    return std::equal(plain.begin() + src * H, plain.begin() + (src + n) * H, scat.begin() + dst * H);
  };
  EXPECT_TRUE(rows_equal(0, T - 1, 3));
  EXPECT_TRUE(rows_equal(3, T + 2, T));
  EXPECT_TRUE(rows_equal(3 + T, 0, T - 1));
  // Wrong number of destinations is refused.
  c.seq_dst = {0, 1};
  EXPECT_THROW(m->forward(b, c, nullptr), Error);
}
