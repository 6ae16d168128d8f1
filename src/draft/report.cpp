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
  o += fmt::format("<text x=\"{:.1f}\" y=\"{}\" class=\"xlabel\">{}</text>\n", ml + pw / 2, Hh - 4,
                   html_escape(ch.x_label));
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

std::vector<ServedAcceptance> parse_served_acceptance(const std::string& text, const std::string& source) {
  const json j = json::parse(text, nullptr, false);
  TALON_CHECK(j.is_object() && j.contains("results") && j["results"].is_array(),
              "{}: not a `talon eval` eval.json (expected an object with a 'results' array)", source);
  std::vector<ServedAcceptance> out;
  const auto& results = j["results"];
  for (size_t i = 0; i < results.size(); ++i) {
    const json& r = results[i];
    const std::string where = fmt::format("{}: results[{}]", source, i);
    TALON_CHECK(r.is_object() && r.contains("config") && r["config"].is_string(),
                "{}: field 'config' must be a string", where);
    TALON_CHECK(r.contains("temperature") && r["temperature"].is_number(), "{}: field 'temperature' must be a number",
                where);
    if (!r.contains("speculative") || r["speculative"].is_null()) continue;  // a baseline-only result
    const json& sp = r["speculative"];
    std::vector<int64_t> reached, accepted;
    for (auto [key, dst] : {std::pair<const char*, std::vector<int64_t>*>{"reached_per_depth", &reached},
                            {"accepted_per_depth", &accepted}}) {
      TALON_CHECK(sp.is_object() && sp.contains(key) && sp[key].is_array(),
                  "{}.speculative: field '{}' must be an array of counts", where, key);
      for (const auto& x : sp[key]) {
        TALON_CHECK(x.is_number_integer() && x.get<int64_t>() >= 0,
                    "{}.speculative: field '{}' must hold non-negative integers, got {}", where, key, x.dump());
        dst->push_back(x.get<int64_t>());
      }
    }
    TALON_CHECK(reached.size() == accepted.size(), "{}.speculative: reached_per_depth has {} depths, accepted_per_depth {}",
                where, reached.size(), accepted.size());
    for (size_t k = 0; k < reached.size(); ++k)
      TALON_CHECK(accepted[k] <= reached[k], "{}.speculative: depth {} accepts {} of {} reached", where, k, accepted[k],
                  reached[k]);
    const std::string config = r["config"].get<std::string>();
    const double t = r["temperature"].get<double>();
    auto it = std::find_if(out.begin(), out.end(),
                           [&](const ServedAcceptance& a) { return a.config == config && a.temperature == t; });
    if (it == out.end()) {
      out.push_back(ServedAcceptance{config, t, {}, {}, 0});
      it = out.end() - 1;
    }
    if (it->reached.size() < reached.size()) {
      it->reached.resize(reached.size(), 0);
      it->accepted.resize(reached.size(), 0);
    }
    for (size_t k = 0; k < reached.size(); ++k) it->reached[k] += reached[k], it->accepted[k] += accepted[k];
    if (r.contains("turns") && r["turns"].is_number_integer()) it->turns += r["turns"].get<int64_t>();
  }
  return out;
}

AcceptanceComparison compare_acceptance(const std::vector<MetricRecord>& rs,
                                        const std::vector<ServedAcceptance>& served) {
  AcceptanceComparison c;
  for (auto& r : rs)
    if (r.split == "eval")
      if (auto it = r.arrays.find("cond_acc"); it != r.arrays.end()) c.trained = it->second, c.trained_step = r.step;
  for (auto& s : served)
    if (s.chain() && s.temperature == 0 && !s.reached.empty() && s.reached[0] > 0) c.served.push_back(&s);
  if (c.trained.empty()) {
    c.verdict = "no held-back records in metrics.jsonl (train with --eval-fraction > 0 to compare)";
    return c;
  }
  if (c.served.empty()) {
    c.verdict = "eval.json holds no greedy chain configuration (run `talon eval --chain K --temperatures 0`)";
    return c;
  }
  // Depth 0 is what every round reaches: the most counts and the clearest comparison.
  int64_t n = 0, a = 0;
  for (auto* s : c.served) n += s->reached[0], a += s->accepted[0];
  const double p = double(a) / double(n), t = c.trained[0];
  const double se = std::sqrt(std::max(p * (1 - p), 1e-4) / double(n)), margin = std::max(0.05, 3 * se);
  if (std::fabs(p - t) <= margin)
    c.verdict = fmt::format("served acceptance at depth 0 ({:.3f} over {} drafts) agrees with the trainer's held-back "
                            "simulation ({:.3f}) within {:.3f}",
                            p, n, t, margin);
  else if (p < t)
    c.verdict = fmt::format(
        "served acceptance at depth 0 ({:.3f} over {} drafts) is {:.3f} below the trainer's held-back simulation "
        "({:.3f}): either the served prompts are unlike the training data (evaluate on prompts of the training "
        "split to tell), or training and serving disagree (aux layer ids, RoPE settings, draft vocabulary mapping, "
        "norm order, chat template)",
        p, n, t - p, t);
  else
    c.verdict = fmt::format("served acceptance at depth 0 ({:.3f} over {} drafts) is {:.3f} above the trainer's "
                            "held-back simulation ({:.3f}): the served prompts are easier than the held-back data",
                            p, n, p - t, t);
  return c;
}

namespace {

std::string acceptance_section(const std::vector<MetricRecord>& rs, const std::vector<ServedAcceptance>& served,
                               const std::string& source) {
  const AcceptanceComparison c = compare_acceptance(rs, served);
  std::string o = "<h2>Trained vs served acceptance per depth</h2>\n";
  o += fmt::format(
      "<p>Trained: the conditional acceptance the trainer simulates on its held-back samples (cond_acc_k of the "
      "last held-back record, step {}): the chance that draft position k is right given positions 0..k-1 were. "
      "Served: what <code>talon eval</code> measured with the exported drafter at temperature 0 ({}): drafts "
      "accepted at depth k over rounds that reached depth k, pooled over categories. Under greedy chain drafting "
      "the two are the same quantity, so a gap means the served prompts differ from the training data or "
      "training and serving disagree. Tree configurations are not listed (a tree position is accepted if any of "
      "several candidates is).</p>\n",
      c.trained_step, html_escape(source));
  o += fmt::format("<p class=\"verdict\"><b>{}</b></p>\n", html_escape(c.verdict));
  if (c.trained.empty() || c.served.empty()) return o;
  size_t K = c.trained.size();
  for (auto* s : c.served) K = std::max(K, s->reached.size());
  o += "<table class=\"acceptance\">\n<tr><th>depth k</th><th>trained (held-back)</th>";
  for (auto* s : c.served) o += fmt::format("<th>served {}</th><th>reached</th>", html_escape(s->config));
  o += "</tr>\n";
  for (size_t k = 0; k < K; ++k) {
    o += fmt::format("<tr><td>{}</td><td>{}</td>", k, k < c.trained.size() ? fmt::format("{:.3f}", c.trained[k]) : "");
    for (auto* s : c.served) {
      if (k < s->reached.size() && s->reached[k] > 0)
        o += fmt::format("<td>{:.3f}</td><td>{}</td>", double(s->accepted[k]) / double(s->reached[k]), s->reached[k]);
      else
        o += "<td></td><td></td>";
    }
    o += "</tr>\n";
  }
  o += "</table>\n";
  Chart ch{"acceptance_per_depth", "Conditional acceptance per depth: trained vs served", "acceptance", {}, "depth k"};
  ChartSeries tr{"trained (held-back)", {}};
  for (size_t k = 0; k < c.trained.size(); ++k)
    if (std::isfinite(c.trained[k])) tr.points.push_back({double(k), c.trained[k]});
  ch.series.push_back(std::move(tr));
  for (auto* s : c.served) {
    ChartSeries sv{"served " + s->config, {}};
    for (size_t k = 0; k < s->reached.size(); ++k)
      if (s->reached[k] > 0) sv.points.push_back({double(k), double(s->accepted[k]) / double(s->reached[k])});
    ch.series.push_back(std::move(sv));
  }
  o += render_line_chart_svg(ch);
  return o;
}

}  // namespace

std::string render_report_html(const std::vector<MetricRecord>& rs, const std::string& title,
                               const std::vector<ServedAcceptance>* served, const std::string& served_source) {
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
  o += "</table>\n";
  if (served) o += acceptance_section(rs, *served, served_source);
  o += "<h2>Charts</h2>\n";
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
  std::vector<ServedAcceptance> served;
  std::string served_source;
  if (!opt.eval.empty()) {
    const fs::path epath = fs::is_directory(opt.eval) ? opt.eval / "eval.json" : opt.eval;
    TALON_CHECK(fs::exists(epath), "{}: missing; expected a `talon eval` output directory with eval.json",
                epath.string());
    served = parse_served_acceptance(read_text_file(epath), epath.string());
    served_source = epath.string();
    const AcceptanceComparison c = compare_acceptance(rs, served);
    for (size_t k = 0; k < c.trained.size(); ++k) {
      std::string line = fmt::format("report: depth {}: trained {:.3f}", k, c.trained[k]);
      for (auto* s : c.served)
        if (k < s->reached.size() && s->reached[k] > 0)
          line += fmt::format(", served {} {:.3f} ({} drafts)", s->config,
                              double(s->accepted[k]) / double(s->reached[k]), s->reached[k]);
      tlog::info("{}", line);
    }
    tlog::info("report: {}", c.verdict);
  }
  const std::string html = render_report_html(rs, title, opt.eval.empty() ? nullptr : &served, served_source);
  if (!opt.out.parent_path().empty()) fs::create_directories(opt.out.parent_path());
  write_file_atomic(opt.out, html);
  ReportSummary s;
  s.records = int64_t(rs.size());
  s.charts = int64_t(build_charts(rs).size());
  tlog::info("report: {} records -> {} ({} charts)", s.records, opt.out.string(), s.charts);
  return s;
}

}  // namespace talon::train
