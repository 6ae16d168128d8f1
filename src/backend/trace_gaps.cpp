#include "backend/trace_gaps.h"

#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>

namespace talon {

GapReport analyze_gaps(std::vector<TraceEvent> events, uint64_t min_gap_ns, size_t keep) {
  GapReport r;
  std::vector<const TraceEvent*> dev, host;
  for (const TraceEvent& e : events) {
    if (e.end < e.start) continue;  // a malformed record: ignored rather than trusted
    (on_device(e.kind) ? dev : host).push_back(&e);
  }
  r.device_events = int64_t(dev.size());
  if (dev.empty()) return r;
  const auto by_start = [](const TraceEvent* a, const TraceEvent* b) {
    return a->start != b->start ? a->start < b->start : a->end < b->end;
  };
  std::sort(dev.begin(), dev.end(), by_start);
  std::sort(host.begin(), host.end(), by_start);
  // Host calls end times are not sorted; a running maximum bounds the scan below.
  std::vector<uint64_t> host_max_end(host.size());
  for (size_t i = 0; i < host.size(); ++i) host_max_end[i] = std::max(i ? host_max_end[i - 1] : 0, host[i]->end);

  const auto cause_of = [&](uint64_t g0, uint64_t g1) {
    // The host call with the largest overlap with [g0, g1); ties go to the earlier call.
    std::string best;
    uint64_t best_ov = 0;
    // First host call that could overlap: the first whose running maximum end passes g0.
    const size_t i0 = size_t(std::lower_bound(host_max_end.begin(), host_max_end.end(), g0 + 1) - host_max_end.begin());
    for (size_t i = i0; i < host.size() && host[i]->start < g1; ++i) {
      const uint64_t a = std::max(g0, host[i]->start), b = std::min(g1, host[i]->end);
      if (b > a && b - a > best_ov) {
        best_ov = b - a;
        best = host[i]->name;
      }
    }
    return best.empty() ? std::string("host code (no CUDA call)") : best;
  };

  const uint64_t first = dev.front()->start;
  uint64_t cur_end = dev.front()->end, last_end = dev.front()->end;
  const TraceEvent* prev = dev.front();  // the event whose end is cur_end
  r.busy_ns = dev.front()->end - dev.front()->start;
  for (size_t i = 1; i < dev.size(); ++i) {
    const TraceEvent* e = dev[i];
    if (e->start > cur_end) {
      GapReport::Gap g{cur_end, e->start, prev->name, e->name, cause_of(cur_end, e->start)};
      r.by_cause[g.cause] += g.end - g.start;
      r.idle_ns += g.end - g.start;
      if (g.end - g.start >= min_gap_ns) r.gaps.push_back(std::move(g));
      r.busy_ns += e->end - e->start;
      cur_end = e->end;
      prev = e;
    } else if (e->end > cur_end) {
      r.busy_ns += e->end - cur_end;
      cur_end = e->end;
      prev = e;
    }
    last_end = std::max(last_end, e->end);
  }
  r.span_ns = last_end - first;
  std::stable_sort(r.gaps.begin(), r.gaps.end(),
                   [](const GapReport::Gap& a, const GapReport::Gap& b) { return a.end - a.start > b.end - b.start; });
  if (r.gaps.size() > keep) r.gaps.resize(keep);
  return r;
}

namespace {
std::string short_name(const std::string& s, size_t n = 90) { return s.size() <= n ? s : s.substr(0, n - 3) + "..."; }
}  // namespace

std::string format_gap_report(const GapReport& r) {
  std::string o;
  const double ms = 1e-6;
  o += fmt::format("device: {} events over {:.3f} ms, busy {:.3f} ms ({:.1f}%), idle {:.3f} ms\n", r.device_events,
                   double(r.span_ns) * ms, double(r.busy_ns) * ms,
                   r.span_ns ? 100.0 * double(r.busy_ns) / double(r.span_ns) : 0.0, double(r.idle_ns) * ms);
  std::vector<std::pair<std::string, uint64_t>> causes(r.by_cause.begin(), r.by_cause.end());
  std::sort(causes.begin(), causes.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  o += "idle time by what the host was doing:\n";
  for (const auto& [c, ns] : causes) o += fmt::format("  {:>10.3f} ms  {}\n", double(ns) * ms, c);
  if (!r.gaps.empty()) o += "longest gaps:\n";
  for (const auto& g : r.gaps)
    o += fmt::format("  {:>8.1f} us  {}\n              after  {}\n              before {}\n",
                     double(g.end - g.start) * 1e-3, g.cause, short_name(g.before), short_name(g.after));
  return o;
}

std::vector<TraceEvent> events_from(const std::vector<TraceEvent>& events, uint64_t t0) {
  std::vector<TraceEvent> out;
  for (const TraceEvent& e : events) {
    if (e.end < e.start || e.end <= t0) continue;
    out.push_back(e);
    out.back().start = std::max(e.start, t0);
  }
  return out;
}

std::string chrome_trace_json(const std::vector<TraceEvent>& events) {
  uint64_t t0 = UINT64_MAX;
  for (const auto& e : events)
    if (e.end >= e.start) t0 = std::min(t0, e.start);
  nlohmann::json arr = nlohmann::json::array();
  for (const auto& e : events) {
    if (e.end < e.start) continue;
    const bool dev = on_device(e.kind);
    nlohmann::json j = {{"name", e.name},
                        {"ph", "X"},
                        {"ts", double(e.start - t0) * 1e-3},
                        {"dur", double(e.end - e.start) * 1e-3},
                        {"pid", dev ? "device" : "host"},
                        {"tid", dev ? fmt::format("stream {}", e.stream) : fmt::format("thread {}", e.stream)}};
    if (e.bytes) j["args"] = {{"bytes", e.bytes}};
    arr.push_back(std::move(j));
  }
  return nlohmann::json{{"traceEvents", arr}, {"displayTimeUnit", "ms"}}.dump();
}

}  // namespace talon
