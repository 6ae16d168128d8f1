// Where a GPU's time goes between its work: from a trace of device activity (kernels, copies,
// fills) and host CUDA calls on one clock (CUPTI's: backend/cuda/cupti_trace.h), the idle gaps of
// the device and what the host was doing during each one. Pure host code: the analysis is
// tested on CPU with made-up traces.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace talon {

struct TraceEvent {
  enum class Kind { Kernel, Memcpy, Memset, HostCall, Sync };
  Kind kind = Kind::Kernel;
  std::string name;      // kernel name, copy direction, CUDA runtime function, or sync kind
  uint64_t start = 0;    // ns
  uint64_t end = 0;      // ns, >= start
  uint32_t stream = 0;   // device events: the stream; host calls: the thread
  uint64_t bytes = 0;    // copies and fills
};

inline bool on_device(TraceEvent::Kind k) {
  return k == TraceEvent::Kind::Kernel || k == TraceEvent::Kind::Memcpy || k == TraceEvent::Kind::Memset;
}

struct GapReport {
  uint64_t span_ns = 0;  // first device event's start to the last one's end
  uint64_t busy_ns = 0;  // time at least one device event runs
  uint64_t idle_ns = 0;  // span - busy: the gaps
  int64_t device_events = 0;
  struct Gap {
    uint64_t start = 0, end = 0;
    std::string before, after;  // the device events around it
    std::string cause;          // the host call that overlaps it most, or "host code (no CUDA call)"
  };
  std::vector<Gap> gaps;                     // gaps of at least min_gap_ns, longest first
  std::map<std::string, uint64_t> by_cause;  // idle ns by cause, every gap counted
};

// The device's idle gaps within the span of its events; each gap's time is charged to the host
// call (or sync) that overlaps it most, else to host code. Keeps the `keep` longest gaps of at
// least min_gap_ns in `gaps` (by_cause counts all).
GapReport analyze_gaps(std::vector<TraceEvent> events, uint64_t min_gap_ns = 10'000, size_t keep = 20);

// The events of an interval that starts at t0 (a trace begun earlier, so that the interval opens
// with the device as busy as it was): those ending after t0, each starting at t0 at the earliest.
// Malformed events (end < start) are dropped.
std::vector<TraceEvent> events_from(const std::vector<TraceEvent>& events, uint64_t t0);

// A readable summary: busy share, idle by cause, the longest gaps with their neighbours.
std::string format_gap_report(const GapReport& r);

// The events as a Chrome trace (JSON; chrome://tracing or Perfetto): device events on one row per
// stream, host calls on one row per thread, times in microseconds from the first event.
std::string chrome_trace_json(const std::vector<TraceEvent>& events);

}  // namespace talon
