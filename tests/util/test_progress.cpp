#include <gtest/gtest.h>

#include <limits>

#include "util/progress.h"

namespace talon {

// A slow run (a CPU training step takes seconds) must not read "0 step/s".
TEST(Progress, RatesStayReadableWhenSlow) {
  EXPECT_EQ(format_rate(0.25, "step"), "4.0 s/step");
  EXPECT_EQ(format_rate(0.5, "step"), "2.0 s/step");
  EXPECT_EQ(format_rate(2.5, "step"), "2.5 step/s");
  EXPECT_EQ(format_rate(12345, "tok"), "12.3k tok/s");
  EXPECT_EQ(format_rate(2.5e6, "tok"), "2.50M tok/s");
  EXPECT_EQ(format_rate(0, "step"), "-- step/s");
  EXPECT_EQ(format_rate(std::numeric_limits<double>::quiet_NaN(), "step"), "-- step/s");
}

TEST(Progress, DurationsAndCounts) {
  EXPECT_EQ(format_duration(3725), "01:02:05");
  EXPECT_EQ(format_duration(-1), "--:--:--");
  EXPECT_EQ(format_count(999), "999");
  EXPECT_EQ(format_count(45600), "45.6k");
}

}  // namespace talon
