// `talon report`: one self-contained HTML page (inline SVG line charts, no scripts) from
// a training run's metrics.jsonl.
//
// Records are JSON objects, one a line. A record without "split" (or with "split":
// "train") is a training step: step, epoch, loss, acc [K], sim_accept_len, lr, grad_norm,
// tokens_per_s. Any other split (e.g. "eval") is its own series: step, loss, acc, cond_acc,
// sim_accept_len. Every chart draws each split that has the metric as its own line.
#pragma once
#include <cstdint>
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
};

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

std::string render_report_html(const std::vector<MetricRecord>& records, const std::string& title,
                               const std::vector<ServedAcceptance>* served = nullptr,
                               const std::string& served_source = "");

struct ReportOptions {
  fs::path run;   // a `talon train` output directory (metrics.jsonl), or the file itself
  fs::path out;   // the HTML file to write
  fs::path eval;  // optional: a `talon eval` output directory (eval.json) of this run's drafter
};
struct ReportSummary {
  int64_t records = 0;
  int64_t charts = 0;
};
ReportSummary run_report(const ReportOptions& opt);

}  // namespace talon::train
