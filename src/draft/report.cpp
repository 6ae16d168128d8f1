#include "draft/report.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "draft/trainer.h"
#include "util/error.h"
#include "util/log.h"

namespace talon::train {

using json = nlohmann::json;

namespace {

constexpr const char* kScalarKeys[] = {"loss", "sim_accept_len", "lr", "grad_norm", "tokens_per_s", "epoch"};
constexpr const char* kArrayKeys[] = {"acc", "cond_acc"};

}  // namespace

std::string html_escape(const std::string& s) {
  std::string o;
  for (char ch : s) {
    switch (ch) {
      case '&': o += "&amp;"; break;
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '"': o += "&quot;"; break;
      case '\'': o += "&#39;"; break;
      default: o += ch;
    }
  }
  return o;
}

// Short human number for axis labels and the table.
std::string num(double v) {
  if (v == 0) return "0";
  const double a = std::fabs(v);
  if (a >= 1e5 || a < 1e-3) return fmt::format("{:.3g}", v);
  if (a >= 100) return fmt::format("{:.1f}", v);
  return fmt::format("{:.4g}", v);
}

// A readable colour per line; wraps after ten.
const char* colour(size_t i) {
  static const char* c[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                            "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"};
  return c[i % 10];
}

// One inline SVG line chart: linear axes padded around the data, five ticks per axis.
std::string render_line_chart_svg(const Chart& ch) {
  constexpr double W = 640, Hh = 280, ml = 64, mr = 150, mt = 28, mb = 40;
  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  for (auto& s : ch.series)
    for (auto& [x, y] : s.points) {
      x0 = std::min(x0, x), x1 = std::max(x1, x);
      y0 = std::min(y0, y), y1 = std::max(y1, y);
    }
  if (x1 <= x0) x0 -= 1, x1 += 1;
  if (y1 <= y0) {
    const double pad = y0 == 0 ? 1 : std::fabs(y0) * 0.1;
    y0 -= pad, y1 += pad;
  } else {
    const double pad = (y1 - y0) * 0.05;
    y0 -= pad, y1 += pad;
  }
  const double pw = W - ml - mr, ph = Hh - mt - mb;
  auto sx = [&](double x) { return ml + (x - x0) / (x1 - x0) * pw; };
  auto sy = [&](double y) { return mt + (1 - (y - y0) / (y1 - y0)) * ph; };

  std::string o = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"chart\" data-chart=\"{}\" width=\"{}\" height=\"{}\" "
      "viewBox=\"0 0 {} {}\" role=\"img\" aria-label=\"{}\">\n",
      html_escape(ch.id), W, Hh, W, Hh, html_escape(ch.title));
  o += fmt::format("<text x=\"{}\" y=\"18\" class=\"title\">{}</text>\n", ml, html_escape(ch.title));
  o += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" class=\"frame\"/>\n", ml, mt, pw, ph);
  for (int i = 0; i <= 4; ++i) {
    const double fy = y0 + (y1 - y0) * i / 4, fx = x0 + (x1 - x0) * i / 4;
    o += fmt::format("<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" class=\"grid\"/>", ml, sy(fy),
                     ml + pw, sy(fy));
    o += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" class=\"ytick\">{}</text>", ml - 6, sy(fy) + 4, num(fy));
    o += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" class=\"xtick\">{}</text>\n", sx(fx), mt + ph + 16,
                     num(std::round(fx * 100) / 100));
  }
  o += fmt::format("<text x=\"{:.1f}\" y=\"{}\" class=\"xlabel\">step</text>\n", ml + pw / 2, Hh - 4);
  o += fmt::format("<text x=\"14\" y=\"{:.1f}\" class=\"ylabel\" transform=\"rotate(-90 14 {:.1f})\">{}</text>\n",
                   mt + ph / 2, mt + ph / 2, html_escape(ch.y_label));
  for (size_t i = 0; i < ch.series.size(); ++i) {
    const ChartSeries& s = ch.series[i];
    std::string pts;
    for (auto& [x, y] : s.points) pts += fmt::format("{}{:.2f},{:.2f}", pts.empty() ? "" : " ", sx(x), sy(y));
    o += fmt::format(
        "<polyline data-series=\"{}\" data-points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\" "
        "points=\"{}\"/>\n",
        html_escape(s.name), s.points.size(), colour(i), pts);
    if (s.points.size() == 1)  // a single point draws no line: mark it
      o += fmt::format("<circle cx=\"{:.2f}\" cy=\"{:.2f}\" r=\"3\" fill=\"{}\"/>\n", sx(s.points[0].first),
                       sy(s.points[0].second), colour(i));
    const double ly = mt + 12 + 16 * double(i);
    o += fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"{}\" stroke-width=\"2\"/>", ml + pw + 10,
                     ly - 4, ml + pw + 28, ly - 4, colour(i));
    o += fmt::format("<text x=\"{}\" y=\"{:.1f}\" class=\"legend\">{}</text>\n", ml + pw + 32, ly, html_escape(s.name));
  }
  o += "</svg>\n";
  return o;
}

// Splits in order of first appearance, "train" first.
namespace {

std::vector<std::string> splits_of(const std::vector<MetricRecord>& rs) {
  std::vector<std::string> out;
  for (auto& r : rs)
    if (std::find(out.begin(), out.end(), r.split) == out.end()) out.push_back(r.split);
  std::stable_partition(out.begin(), out.end(), [](const std::string& s) { return s == "train"; });
  return out;
}

}  // namespace

std::vector<MetricRecord> parse_metrics(const std::string& text, const std::string& source) {
  std::vector<MetricRecord> rs;
  std::istringstream in(text);
  int64_t ln = 0;
  for (std::string line; std::getline(in, line);) {
    ++ln;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = fmt::format("{}:{}", source, ln);
    const json j = json::parse(line, nullptr, false);
    TALON_CHECK(j.is_object(), "{}: not a JSON object: {}", where, line.substr(0, 80));
    MetricRecord r;
    r.line = ln;
    if (j.contains("split")) {
      TALON_CHECK(j["split"].is_string() && !j["split"].get<std::string>().empty(),
                  "{}: field 'split' must be a non-empty string, got {}", where, j["split"].dump());
      r.split = j["split"].get<std::string>();
    }
    TALON_CHECK(j.contains("step") && j["step"].is_number_integer(), "{}: field 'step' must be an integer, got {}",
                where, j.contains("step") ? j["step"].dump() : "nothing");
    r.step = j["step"].get<int64_t>();
    for (const char* k : kScalarKeys) {
      auto it = j.find(k);
      if (it == j.end() || it->is_null()) continue;  // absent, or non-finite when written
      TALON_CHECK(it->is_number(), "{}: field '{}' must be a number, got {}", where, k, it->dump());
      r.scalars[k] = it->get<double>();
    }
    for (const char* k : kArrayKeys) {
      auto it = j.find(k);
      if (it == j.end() || it->is_null()) continue;
      TALON_CHECK(it->is_array(), "{}: field '{}' must be an array of numbers (one per TTT step), got {}", where, k,
                  it->dump());
      std::vector<double> v;
      for (auto& x : *it) {
        TALON_CHECK(x.is_number() || x.is_null(), "{}: field '{}' must hold numbers, got {}", where, k, it->dump());
        v.push_back(x.is_null() ? NAN : x.get<double>());
      }
      r.arrays[k] = std::move(v);
    }
    rs.push_back(std::move(r));
  }
  TALON_CHECK(!rs.empty(), "{}: no metric records (is the run started?)", source);
  return rs;
}

std::vector<Chart> build_charts(const std::vector<MetricRecord>& rs) {
  const auto splits = splits_of(rs);
  std::vector<Chart> charts;
  auto scalar_chart = [&](const char* id, const char* title, const char* key) {
    Chart ch{id, title, key, {}};
    for (auto& sp : splits) {
      ChartSeries s{sp, {}};
      for (auto& r : rs) {
        auto it = r.scalars.find(key);
        if (r.split == sp && it != r.scalars.end() && std::isfinite(it->second)) s.points.push_back({double(r.step), it->second});
      }
      if (!s.points.empty()) ch.series.push_back(std::move(s));
    }
    if (!ch.series.empty()) charts.push_back(std::move(ch));
  };
  auto array_chart = [&](const char* id, const char* title, const char* key) {
    Chart ch{id, title, key, {}};
    size_t K = 0;
    for (auto& r : rs)
      if (auto it = r.arrays.find(key); it != r.arrays.end()) K = std::max(K, it->second.size());
    for (auto& sp : splits)
      for (size_t k = 0; k < K; ++k) {
        ChartSeries s{splits.size() > 1 ? fmt::format("{} k={}", sp, k) : fmt::format("k={}", k), {}};
        for (auto& r : rs) {
          auto it = r.arrays.find(key);
          if (r.split == sp && it != r.arrays.end() && k < it->second.size() && std::isfinite(it->second[k]))
            s.points.push_back({double(r.step), it->second[k]});
        }
        if (!s.points.empty()) ch.series.push_back(std::move(s));
      }
    if (!ch.series.empty()) charts.push_back(std::move(ch));
  };
  scalar_chart("loss", "Loss", "loss");
  array_chart("acc", "Accuracy per TTT step (acc_k)", "acc");
  array_chart("cond_acc", "Conditional accuracy per TTT step", "cond_acc");
  scalar_chart("sim_accept_len", "Simulated acceptance length", "sim_accept_len");
  scalar_chart("lr", "Learning rate", "lr");
  scalar_chart("grad_norm", "Gradient norm (before clipping)", "grad_norm");
  scalar_chart("tokens_per_s", "Throughput (tokens/s)", "tokens_per_s");
  return charts;
}

std::string render_report_html(const std::vector<MetricRecord>& rs, const std::string& title) {
  const auto charts = build_charts(rs);
  const auto splits = splits_of(rs);
  std::string o;
  o += "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n";
  o += fmt::format("<title>{}</title>\n", html_escape(title));
  o += "<style>\n"
       "body{font-family:system-ui,sans-serif;margin:24px;color:#222}\n"
       "table{border-collapse:collapse;margin:12px 0 24px}td,th{border:1px solid #ccc;padding:4px 10px;text-align:right}\n"
       "th{background:#f4f4f4}td:first-child,th:first-child{text-align:left}\n"
       ".chart{display:block;margin:8px 0 20px}.frame{fill:none;stroke:#888}.grid{stroke:#eee}\n"
       ".title{font-size:14px;font-weight:600}.ytick{font-size:10px;text-anchor:end}"
       ".xtick{font-size:10px;text-anchor:middle}.xlabel,.ylabel{font-size:11px;text-anchor:middle}"
       ".legend{font-size:11px}\n"
       "</style>\n</head>\n<body>\n";
  o += fmt::format("<h1>{}</h1>\n", html_escape(title));

  // Summary: per split, the last value and the best value (with its step) of each metric.
  o += "<h2>Summary</h2>\n<table class=\"summary\">\n<tr><th>split</th><th>records</th><th>steps</th><th>metric</th>"
       "<th>last</th><th>best</th><th>best at step</th></tr>\n";
  for (auto& sp : splits) {
    std::vector<const MetricRecord*> mine;
    for (auto& r : rs)
      if (r.split == sp) mine.push_back(&r);
    const std::string head = fmt::format("<td>{}</td><td>{}</td><td>{}..{}</td>", html_escape(sp), mine.size(),
                                         mine.front()->step, mine.back()->step);
    auto row = [&](const std::string& name, bool lower_better, auto value_of) {
      double last = NAN, best = NAN;
      int64_t best_step = 0;
      for (auto* r : mine) {
        const double v = value_of(*r);
        if (!std::isfinite(v)) continue;
        last = v;
        if (std::isnan(best) || (lower_better ? v < best : v > best)) best = v, best_step = r->step;
      }
      if (std::isnan(last)) return;
      o += fmt::format("<tr>{}<td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>\n", head, html_escape(name), num(last),
                       num(best), best_step);
    };
    auto scalar = [](const char* k) {
      return [k](const MetricRecord& r) {
        auto it = r.scalars.find(k);
        return it == r.scalars.end() ? NAN : it->second;
      };
    };
    row("loss", true, scalar("loss"));
    row("sim_accept_len", false, scalar("sim_accept_len"));
    for (const char* key : kArrayKeys) {
      size_t K = 0;
      for (auto* r : mine)
        if (auto it = r->arrays.find(key); it != r->arrays.end()) K = std::max(K, it->second.size());
      for (size_t k = 0; k < K; ++k)
        row(fmt::format("{}_{}", key, k), false, [&](const MetricRecord& r) {
          auto it = r.arrays.find(key);
          return it == r.arrays.end() || k >= it->second.size() ? NAN : it->second[k];
        });
    }
    row("tokens_per_s", false, scalar("tokens_per_s"));
  }
  o += "</table>\n<h2>Charts</h2>\n";
  for (auto& ch : charts) o += render_line_chart_svg(ch);
  o += "</body>\n</html>\n";
  return o;
}

ReportSummary run_report(const ReportOptions& opt) {
  const fs::path mpath = fs::is_directory(opt.run) ? opt.run / kMetricsName : opt.run;
  TALON_CHECK(fs::exists(mpath), "{}: missing; expected a `talon train` output directory with metrics.jsonl",
              mpath.string());
  const auto rs = parse_metrics(read_text_file(mpath), mpath.string());
  const std::string title = fmt::format("talon training report: {}", fs::absolute(opt.run).lexically_normal().string());
  const std::string html = render_report_html(rs, title);
  if (!opt.out.parent_path().empty()) fs::create_directories(opt.out.parent_path());
  write_file_atomic(opt.out, html);
  ReportSummary s;
  s.records = int64_t(rs.size());
  s.charts = int64_t(build_charts(rs).size());
  tlog::info("report: {} records -> {} ({} charts)", s.records, opt.out.string(), s.charts);
  return s;
}

}  // namespace talon::train
