// The device-gap analysis of GPU traces (backend/trace_gaps.h) on hand-made traces whose gaps,
// busy time and causes are worked out by hand below.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "backend/trace_gaps.h"

using namespace talon;
using K = TraceEvent::Kind;

TEST(TraceGaps, GapsBusyTimeAndCauses) {
  // Device: A [0,100]; B [150,300] and C [250,400] overlap; D [1000,1100] on another stream.
  // Host: a stream sync [90,140] and a launch [140,150] around the first gap [100,150] (overlaps
  // 40 and 10 ns); a copy call [500,600] inside the second gap [400,1000], the rest of it host code.
  const std::vector<TraceEvent> ev = {
      {K::Kernel, "A", 0, 100, 7, 0},           {K::Kernel, "C", 250, 400, 7, 0},
      {K::Kernel, "B", 150, 300, 7, 0},         {K::Memcpy, "memcpy HtoD", 1000, 1100, 9, 4096},
      {K::HostCall, "cudaStreamSynchronize", 90, 140, 1, 0},
      {K::HostCall, "cudaLaunchKernel", 140, 150, 1, 0},
      {K::HostCall, "cudaMemcpyAsync", 500, 600, 1, 0},
  };
  const GapReport r = analyze_gaps(ev, 0);
  EXPECT_EQ(r.device_events, 4);
  EXPECT_EQ(r.span_ns, 1100u);
  EXPECT_EQ(r.busy_ns, 100u + 250u + 100u);  // A, B..C merged (150..400), D
  EXPECT_EQ(r.idle_ns, 50u + 600u);
  ASSERT_EQ(r.gaps.size(), 2u);
  EXPECT_EQ(r.gaps[0].start, 400u);  // the longest first
  EXPECT_EQ(r.gaps[0].end, 1000u);
  EXPECT_EQ(r.gaps[0].before, "C");
  EXPECT_EQ(r.gaps[0].after, "memcpy HtoD");
  EXPECT_EQ(r.gaps[0].cause, "cudaMemcpyAsync");
  EXPECT_EQ(r.gaps[1].before, "A");
  EXPECT_EQ(r.gaps[1].after, "B");
  EXPECT_EQ(r.gaps[1].cause, "cudaStreamSynchronize");
  EXPECT_EQ(r.by_cause.at("cudaMemcpyAsync"), 600u);
  EXPECT_EQ(r.by_cause.at("cudaStreamSynchronize"), 50u);
  // Only gaps of at least min_gap_ns are listed; every gap is still counted by cause.
  const GapReport big = analyze_gaps(ev, 100);
  ASSERT_EQ(big.gaps.size(), 1u);
  EXPECT_EQ(big.idle_ns, 650u);
  const std::string text = format_gap_report(r);
  EXPECT_NE(text.find("cudaMemcpyAsync"), std::string::npos) << text;
}

TEST(TraceGaps, GapsWithoutCudaCallsAreHostCode) {
  // A long host call that ended before the gap must not be charged with it.
  const std::vector<TraceEvent> ev = {{K::HostCall, "cudaMalloc", 0, 1000, 1, 0},
                                      {K::Kernel, "x", 900, 1100, 3, 0},
                                      {K::Kernel, "y", 2000, 2100, 3, 0},
                                      {K::Kernel, "bad", 3000, 2500, 3, 0}};  // end < start: ignored
  const GapReport r = analyze_gaps(ev, 0);
  EXPECT_EQ(r.device_events, 2);
  ASSERT_EQ(r.gaps.size(), 1u);
  EXPECT_EQ(r.gaps[0].cause, "host code (no CUDA call)");
  EXPECT_EQ(r.idle_ns, 900u);
  EXPECT_EQ(analyze_gaps({{K::HostCall, "cudaFree", 0, 5, 1, 0}}).device_events, 0);
}

TEST(TraceGaps, AnIntervalFromAMomentKeepsWhatRunsInIt) {
  // Device: A [0,100] before t0 = 120; B [100,200] across it; C [300,400] after. Host: a launch
  // [50,110] before t0, a sync [110,310] across it. A malformed event after t0 is dropped.
  const std::vector<TraceEvent> ev = {{K::Kernel, "A", 0, 100, 7, 0},
                                      {K::Kernel, "B", 100, 200, 7, 0},
                                      {K::Kernel, "C", 300, 400, 7, 0},
                                      {K::HostCall, "cudaLaunchKernel", 50, 110, 1, 0},
                                      {K::HostCall, "cudaStreamSynchronize", 110, 310, 1, 0},
                                      {K::Kernel, "bad", 500, 450, 7, 0}};
  const std::vector<TraceEvent> in = events_from(ev, 120);
  ASSERT_EQ(in.size(), 3u);
  EXPECT_EQ(in[0].name, "B");
  EXPECT_EQ(in[0].start, 120u);  // clipped to the interval
  EXPECT_EQ(in[0].end, 200u);
  EXPECT_EQ(in[1].name, "C");
  EXPECT_EQ(in[1].start, 300u);
  EXPECT_EQ(in[2].name, "cudaStreamSynchronize");
  EXPECT_EQ(in[2].start, 120u);
  // The interval's gaps: B's end to C's start, while the host waited.
  const GapReport r = analyze_gaps(in, 0);
  EXPECT_EQ(r.span_ns, 280u);
  EXPECT_EQ(r.busy_ns, 180u);
  EXPECT_EQ(r.idle_ns, 100u);
  EXPECT_EQ(r.by_cause.at("cudaStreamSynchronize"), 100u);
  EXPECT_TRUE(events_from(ev, 1000).empty());
}

TEST(TraceGaps, ChromeTraceHasEveryValidEventOnItsRow) {
  const std::vector<TraceEvent> ev = {{K::Kernel, "k", 1000, 3000, 7, 0},
                                      {K::HostCall, "cudaLaunchKernel", 500, 900, 42, 0},
                                      {K::Memset, "memset", 4000, 4500, 8, 64},
                                      {K::Kernel, "bad", 10, 5, 7, 0}};
  const auto j = nlohmann::json::parse(chrome_trace_json(ev));
  const auto& t = j.at("traceEvents");
  ASSERT_EQ(t.size(), 3u);
  EXPECT_EQ(t[0].at("name"), "k");
  EXPECT_EQ(t[0].at("pid"), "device");
  EXPECT_EQ(t[0].at("tid"), "stream 7");
  EXPECT_DOUBLE_EQ(t[0].at("ts").get<double>(), 0.5);  // us from the first event (500 ns)
  EXPECT_DOUBLE_EQ(t[0].at("dur").get<double>(), 2.0);
  EXPECT_EQ(t[1].at("tid"), "thread 42");
  EXPECT_EQ(t[2].at("args").at("bytes"), 64);
}
