// `talon report`: one self-contained HTML page (inline SVG line charts, no scripts) from
// a training run's metrics.jsonl.
//
// Records are JSON objects, one a line. A record without "split" (or with "split":
// "train") is a training step: step, epoch, loss, acc [K], sim_accept_len, lr, grad_norm,
// tokens_per_s. Any other split (e.g. "eval") is its own series: step, loss, acc, cond_acc,
// sim_accept_len. Every chart draws each split that has the metric as its own line.
#pragma once
#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "util/file.h"

namespace talon::train {

struct MetricRecord {
  std::string split = "train";
  int64_t step = 0;
  // Scalars present in the record (loss, sim_accept_len, lr, grad_norm, tokens_per_s, epoch).
  std::map<std::string, double> scalars;
  // Per-TTT-step arrays present in the record (acc, cond_acc).
  std::map<std::string, std::vector<double>> arrays;
  int64_t line = 0;  // 1-based line in the file
};

// Parses metrics.jsonl text; `source` names the file in errors ("<file>:<line>: ...").
// Fails on a line that is not a JSON object, lacks an integer "step", or holds a known
// field of the wrong type, and when there is no record at all.
std::vector<MetricRecord> parse_metrics(const std::string& text, const std::string& source);

// One chart: a title and one line per (series name, points).
struct ChartSeries {
  std::string name;
  std::vector<std::pair<double, double>> points;  // (step, value)
};
struct Chart {
  std::string id, title, y_label;
  std::vector<ChartSeries> series;
  std::string x_label = "step";
  // Fixed ends of the value axis where the quantity has them (a rate: 0 and 1); NaN: from
  // the data, rounded out to whole ticks.
  double y_min = NAN, y_max = NAN;
  // Dashed horizontal reference lines with a label (e.g. 1.0 "no speedup").
  std::vector<std::pair<double, std::string>> ref_lines{};
};

// Axis ticks at 1, 2 or 5 times a power of ten covering [lo, hi] with about `target`
// intervals; `integer` keeps the step whole (steps, depths). The axis ends are rounded out to
// the first and last tick.
struct AxisTicks {
  double lo = 0, hi = 1, step = 1;
  std::vector<double> values;
  int decimals = 0;  // enough to tell neighbouring ticks apart
};
AxisTicks nice_ticks(double lo, double hi, int target = 5, bool integer = false);
// A tick's label: `decimals` places, large values shortened (12k, 1.5M).
std::string tick_label(double v, int decimals);

// The charts a report draws: loss, acc_k (one line per k and split), cond_acc_k when
// present, sim_accept_len, lr, grad_norm, tokens_per_s; a chart without points is left out.
std::vector<Chart> build_charts(const std::vector<MetricRecord>& records);

// Pieces shared with `talon eval`'s report: one inline SVG line chart, HTML escaping, a
// short human number, and the colour of series i.
std::string render_line_chart_svg(const Chart& ch);
std::string html_escape(const std::string& s);
std::string num(double v);
const char* colour(size_t i);

// What `talon eval` measured when a drafter was served: per configuration and temperature,
// the turns' drafted positions reached and accepted at each depth, pooled over categories
// (eval.json "results"[].speculative.reached_per_depth / accepted_per_depth).
struct ServedAcceptance {
  std::string config;  // e.g. "chain-3", "tree-d6-k8-n32"
  double temperature = 0;
  std::vector<int64_t> reached, accepted;
  int64_t turns = 0;
  bool chain() const { return config.rfind("chain", 0) == 0; }
};
// Parses eval.json text; `source` names the file in errors (field and result index).
std::vector<ServedAcceptance> parse_served_acceptance(const std::string& text, const std::string& source);

// Trained vs served acceptance per depth: the last held-back record's cond_acc (the trainer's
// simulated chain acceptance) next to each greedy chain configuration's measured rate
// accepted/reached. `verdict` gets one line: agree, or how far apart at depth 0 and what
// usually causes it.
struct AcceptanceComparison {
  std::vector<double> trained;  // cond_acc of the last "eval" record (empty: none)
  int64_t trained_step = -1;
  std::vector<const ServedAcceptance*> served;  // greedy chain configurations
  std::string verdict;
};
AcceptanceComparison compare_acceptance(const std::vector<MetricRecord>& records,
                                        const std::vector<ServedAcceptance>& served);

// `settings`: the run's job (the checkpoint's talon.train metadata; null when there is no
// checkpoint yet), shown as a table above the charts.
std::string render_report_html(const std::vector<MetricRecord>& records, const std::string& title,
                               const std::vector<ServedAcceptance>* served = nullptr,
                               const std::string& served_source = "", const nlohmann::json* settings = nullptr);

// Several runs on one page (a sweep): the settings that differ between them, then held-back
// acceptance, simulated acceptance length and loss of every run on shared charts, against
// the optimizer step and against the samples trained on (step x batch_samples).
struct RunMetrics {
  std::string label;  // the run directory's name
  std::vector<MetricRecord> records;
  nlohmann::json settings;  // as above; null when unknown
};
std::string render_comparison_html(const std::vector<RunMetrics>& runs, const std::string& title);

// A run directory's settings from its checkpoint's talon.train metadata (job, step, draft
// sizes, aux layers); null when the directory has no checkpoint.
nlohmann::json run_settings(const fs::path& run);

struct ReportOptions {
  std::vector<fs::path> runs;  // `talon train` output directories (metrics.jsonl), or the files; several: a comparison
  fs::path out;                // the HTML file to write
  fs::path eval;               // optional (one run): a `talon eval` output directory (eval.json) of its drafter
};
struct ReportSummary {
  int64_t records = 0;
  int64_t charts = 0;
};
ReportSummary run_report(const ReportOptions& opt);

}  // namespace talon::train
