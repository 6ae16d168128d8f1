#include "draft/report.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "draft/trainer.h"
#include "io/safetensors.h"
#include "util/error.h"
#include "util/log.h"

namespace talon::train {

using json = nlohmann::json;

namespace {

constexpr const char* kScalarKeys[] = {"loss", "sim_accept_len", "lr", "grad_norm", "tokens_per_s", "epoch",
                                       "tokens_trained"};
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

AxisTicks nice_ticks(double lo, double hi, int target, bool integer) {
  AxisTicks t;
  if (!std::isfinite(lo) || !std::isfinite(hi)) lo = 0, hi = 1;
  if (hi < lo) std::swap(lo, hi);
  if (hi == lo) {
    const double pad = lo == 0 ? 1 : std::fabs(lo) * 0.1;
    lo -= pad, hi += pad;
  }
  const double raw = (hi - lo) / std::max(1, target);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = 10 * mag;
  for (double m : {1.0, 2.0, 5.0})
    if (m * mag >= raw * 0.999) {
      step = m * mag;
      break;
    }
  if (integer) step = std::max(1.0, std::round(step));
  t.step = step;
  t.lo = std::floor(lo / step + 1e-9) * step;
  t.hi = std::ceil(hi / step - 1e-9) * step;
  if (t.hi <= t.lo) t.hi = t.lo + step;
  for (double v = t.lo; v <= t.hi + step * 1e-6; v += step) t.values.push_back(std::fabs(v) < step * 1e-9 ? 0.0 : v);
  t.decimals = step >= 1 ? 0 : int(std::ceil(-std::log10(step) - 1e-9));
  return t;
}

std::string tick_label(double v, int decimals) {
  const double a = std::fabs(v);
  if (a >= 1e6 && decimals == 0) return fmt::format("{:g}M", v / 1e6);
  if (a >= 1e4 && decimals == 0) return fmt::format("{:g}k", v / 1e3);
  return fmt::format("{:.{}f}", v, decimals);
}

// One inline SVG line chart that styles itself (presentation attributes only, so it draws
// the same on any page): a frame, ticks at round values, a legend, reference lines, and the
// full width of the page (viewBox scaling).
std::string render_line_chart_svg(const Chart& ch) {
  constexpr double W = 960, Hh = 320, ml = 70, mr = 190, mt = 30, mb = 44;
  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  bool integer_x = true;
  for (auto& s : ch.series)
    for (auto& [x, y] : s.points) {
      x0 = std::min(x0, x), x1 = std::max(x1, x);
      y0 = std::min(y0, y), y1 = std::max(y1, y);
      integer_x = integer_x && x == std::round(x);
    }
  for (auto& [v, label] : ch.ref_lines) y0 = std::min(y0, v), y1 = std::max(y1, v);
  if (!std::isfinite(x0)) x0 = 0, x1 = 1;
  if (!std::isfinite(y0)) y0 = 0, y1 = 1;
  if (std::isfinite(ch.y_min)) y0 = std::min(ch.y_min, y0);
  if (std::isfinite(ch.y_max)) y1 = std::max(ch.y_max, y1);
  const AxisTicks xt = nice_ticks(x0, x1, 6, integer_x);
  const AxisTicks yt = nice_ticks(y0, y1, 5, false);
  const double X0 = xt.lo, X1 = xt.hi;
  const double Y0 = std::isfinite(ch.y_min) && ch.y_min <= y0 ? ch.y_min : yt.lo;
  const double Y1 = std::isfinite(ch.y_max) && ch.y_max >= y1 ? ch.y_max : yt.hi;
  const double pw = W - ml - mr, ph = Hh - mt - mb;
  // Values map inside the frame with a small margin, so points on an axis end stay visible.
  constexpr double inset = 8;
  auto sx = [&](double x) { return ml + inset + (x - X0) / (X1 - X0) * (pw - 2 * inset); };
  auto sy = [&](double y) { return mt + inset + (1 - (y - Y0) / (Y1 - Y0)) * (ph - 2 * inset); };
  const char* font = "font-family=\"system-ui,sans-serif\"";

  std::string o = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"chart\" data-chart=\"{}\" viewBox=\"0 0 {} {}\" "
      "style=\"width:100%;height:auto;max-width:{}px;display:block;margin:8px 0 24px\" role=\"img\" "
      "aria-label=\"{}\">\n",
      html_escape(ch.id), W, Hh, W * 1.5, html_escape(ch.title));
  o += fmt::format("<rect x=\"0\" y=\"0\" width=\"{}\" height=\"{}\" fill=\"#ffffff\"/>\n", W, Hh);
  o += fmt::format("<text x=\"{}\" y=\"19\" font-size=\"15\" font-weight=\"600\" fill=\"#222\" {}>{}</text>\n", ml, font,
                   html_escape(ch.title));
  for (double v : yt.values) {
    if (v < Y0 - 1e-12 || v > Y1 + 1e-12) continue;
    o += fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"#e6e6e6\" stroke-width=\"1\"/>"
                     "<text x=\"{}\" y=\"{:.1f}\" font-size=\"11\" text-anchor=\"end\" fill=\"#444\" {}>{}</text>\n",
                     ml, sy(v), ml + pw, sy(v), ml - 6, sy(v) + 4, font, tick_label(v, yt.decimals));
  }
  for (double v : xt.values)
    o += fmt::format("<line x1=\"{:.1f}\" y1=\"{}\" x2=\"{:.1f}\" y2=\"{}\" stroke=\"#888\" stroke-width=\"1\"/>"
                     "<text x=\"{:.1f}\" y=\"{}\" font-size=\"11\" text-anchor=\"middle\" fill=\"#444\" {}>{}</text>\n",
                     sx(v), mt + ph, sx(v), mt + ph + 4, sx(v), mt + ph + 17, font, tick_label(v, xt.decimals));
  o += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#888\" "
                   "stroke-width=\"1\" class=\"plot-area\"/>\n",
                   ml, mt, pw, ph);
  for (auto& [v, label] : ch.ref_lines)
    o += fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"#555\" stroke-width=\"1.2\" "
                     "stroke-dasharray=\"6 4\" data-ref=\"{}\"/><text x=\"{}\" y=\"{:.1f}\" font-size=\"11\" "
                     "fill=\"#555\" {}>{}</text>\n",
                     ml, sy(v), ml + pw, sy(v), v, ml + 6, sy(v) - 5, font, html_escape(label));
  o += fmt::format("<text x=\"{:.1f}\" y=\"{}\" font-size=\"12\" text-anchor=\"middle\" fill=\"#222\" {}>{}</text>\n",
                   ml + pw / 2, Hh - 6, font, html_escape(ch.x_label));
  o += fmt::format("<text x=\"16\" y=\"{:.1f}\" font-size=\"12\" text-anchor=\"middle\" fill=\"#222\" "
                   "transform=\"rotate(-90 16 {:.1f})\" {}>{}</text>\n",
                   mt + ph / 2, mt + ph / 2, font, html_escape(ch.y_label));
  const double legend_y0 = mt + 12;
  for (size_t i = 0; i < ch.series.size(); ++i) {
    const ChartSeries& s = ch.series[i];
    std::string pts;
    for (auto& [x, y] : s.points) pts += fmt::format("{}{:.2f},{:.2f}", pts.empty() ? "" : " ", sx(x), sy(y));
    o += fmt::format(
        "<polyline data-series=\"{}\" data-points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\" "
        "stroke-linejoin=\"round\" points=\"{}\"/>\n",
        html_escape(s.name), s.points.size(), colour(i), pts);
    if (s.points.size() <= 12)  // few points: mark each one
      for (auto& [x, y] : s.points)
        o += fmt::format("<circle cx=\"{:.2f}\" cy=\"{:.2f}\" r=\"3\" fill=\"{}\"/>", sx(x), sy(y), colour(i));
    const double ly = legend_y0 + 17 * double(i);
    o += fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"{}\" stroke-width=\"3\"/>", ml + pw + 10,
                     ly - 4, ml + pw + 30, ly - 4, colour(i));
    o += fmt::format("<text x=\"{}\" y=\"{:.1f}\" font-size=\"12\" fill=\"#222\" {}>{}</text>\n", ml + pw + 36, ly,
                     font, html_escape(s.name));
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
  for (auto& ch : charts) {
    if (ch.id == "acc" || ch.id == "cond_acc") ch.y_min = 0, ch.y_max = 1;  // rates
    if (ch.id == "sim_accept_len") ch.y_min = 1;                          // one token per round at least
    if (ch.id == "loss" || ch.id == "lr" || ch.id == "grad_norm" || ch.id == "tokens_per_s") ch.y_min = 0;
  }
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
  const fs::path page = fs::path(source).parent_path() / "eval.html";
  if (fs::exists(page))
    o += fmt::format("<p>The evaluation's own page: <a href=\"{}\">{}</a></p>\n",
                     html_escape(fs::absolute(page).lexically_normal().string()), html_escape(page.string()));
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
  ch.y_min = 0, ch.y_max = 1;
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


namespace {

// What each logged metric means (shown under the summary).
constexpr const char* kDefinitions[][2] = {
    {"loss", "Training objective: over the TTT steps k, decay^k times the soft cross-entropy between the draft's "
             "distribution and the target's next-token distribution restricted to the draft vocabulary, averaged "
             "over loss-masked positions and samples."},
    {"acc_k", "Share of the loss-masked positions at which the draft's top token at TTT step k (k tokens drafted "
              "ahead on its own outputs) equals the target's top token."},
    {"cond_acc_k", "acc at step k among the positions where steps 0..k-1 were all right: the chance that draft "
                   "position k is accepted once the ones before it were. Under greedy chain drafting this is what "
                   "serving measures per depth."},
    {"sim_accept_len", "Tokens per verify round a greedy chain of K drafts would give on these samples (the "
                       "target's own token plus the drafts accepted in a row), simulated from the per-position "
                       "results."},
    {"lr", "Learning rate of the step (warm-up, then the schedule)."},
    {"grad_norm", "Global L2 norm of the gradient before clipping."},
    {"tokens_per_s", "Tokens of the step's samples processed per second (forward, backward, optimizer)."},
    {"tokens_trained", "Tokens of every sample trained on so far, counted from the seeded sample order (the same "
                       "after a resume); the x axis of the comparison's held-back charts."},
    {"split eval", "Held-back samples (--eval-fraction): never trained on, never counted for the draft vocabulary."},
};

std::string definitions_section() {
  std::string o = "<h2>What the metrics mean</h2>\n<table class=\"definitions\">\n";
  for (auto& d : kDefinitions)
    o += fmt::format("<tr><td>{}</td><td style=\"text-align:left;max-width:900px\">{}</td></tr>\n", d[0],
                     html_escape(d[1]));
  return o + "</table>\n";
}

std::string setting_value(const json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

// The run's settings, flattened: job keys, then step, draft sizes and layers.
std::vector<std::pair<std::string, std::string>> flat_settings(const json& st) {
  std::vector<std::pair<std::string, std::string>> out;
  if (!st.is_object()) return out;
  if (st.contains("job") && st["job"].is_object())
    for (auto& [k, v] : st["job"].items()) out.push_back({k, setting_value(v)});
  if (st.contains("step")) out.push_back({"checkpoint step", setting_value(st["step"])});
  if (st.contains("draft") && st["draft"].is_object())
    for (auto& [k, v] : st["draft"].items()) out.push_back({"draft." + k, setting_value(v)});
  if (st.contains("aux_layer_ids")) out.push_back({"aux_layer_ids", setting_value(st["aux_layer_ids"])});
  return out;
}

std::string settings_section(const json& st) {
  const auto rows = flat_settings(st);
  if (rows.empty())
    return "<h2>Run settings</h2>\n<p>No checkpoint in the run directory yet, so its settings are unknown.</p>\n";
  std::string o = "<h2>Run settings</h2>\n<table class=\"settings\">\n";
  for (auto& [k, v] : rows) o += fmt::format("<tr><td>{}</td><td>{}</td></tr>\n", html_escape(k), html_escape(v));
  return o + "</table>\n";
}

const char* kPageStyle =
    "<style>\n"
    "body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1500px}\n"
    "table{border-collapse:collapse;margin:12px 0 24px}td,th{border:1px solid #ccc;padding:4px 10px;text-align:right}\n"
    "th{background:#f4f4f4}td:first-child,th:first-child{text-align:left}\n"
    "</style>\n";

}  // namespace

json run_settings(const fs::path& run) {
  const fs::path ck = fs::is_directory(run) ? run / kCheckpointName : run.parent_path() / kCheckpointName;
  std::error_code ec;
  if (!fs::is_regular_file(ck, ec)) return json();
  st::File f(ck);
  auto it = f.metadata().find("talon.train");
  if (it == f.metadata().end()) return json();
  json st = json::parse(it->second, nullptr, false);
  return st.is_object() ? st : json();
}

std::string render_report_html(const std::vector<MetricRecord>& rs, const std::string& title,
                               const std::vector<ServedAcceptance>* served, const std::string& served_source,
                               const json* settings) {
  const auto charts = build_charts(rs);
  const auto splits = splits_of(rs);
  std::string o;
  o += "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n";
  o += fmt::format("<title>{}</title>\n", html_escape(title));
  o += kPageStyle;
  o += "</head>\n<body>\n";
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
  if (settings) o += settings_section(*settings);
  o += definitions_section();
  if (served) o += acceptance_section(rs, *served, served_source);
  o += "<h2>Charts</h2>\n";
  for (auto& ch : charts) o += render_line_chart_svg(ch);
  o += "</body>\n</html>\n";
  return o;
}

std::string render_comparison_html(const std::vector<RunMetrics>& runs, const std::string& title) {
  std::string o = "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n";
  o += fmt::format("<title>{}</title>\n", html_escape(title));
  o += kPageStyle;
  o += "</head>\n<body>\n";
  o += fmt::format("<h1>{}</h1>\n", html_escape(title));
  // Settings: the keys whose values differ, one column per run; then the shared ones.
  std::vector<std::vector<std::pair<std::string, std::string>>> flat;
  std::vector<std::string> keys;
  for (auto& r : runs) {
    flat.push_back(flat_settings(r.settings));
    for (auto& [k, v] : flat.back())
      if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
  }
  auto value = [&](size_t i, const std::string& k) {
    for (auto& [kk, v] : flat[i])
      if (kk == k) return v;
    return std::string("-");
  };
  std::string differ, same;
  for (auto& k : keys) {
    if (k.find("sha256") != std::string::npos) continue;
    bool all_same = true;
    for (size_t i = 1; i < runs.size(); ++i) all_same = all_same && value(i, k) == value(0, k);
    if (all_same) {
      same += fmt::format("{}{} = {}", same.empty() ? "" : ", ", html_escape(k), html_escape(value(0, k)));
      continue;
    }
    differ += fmt::format("<tr><td>{}</td>", html_escape(k));
    for (size_t i = 0; i < runs.size(); ++i) differ += fmt::format("<td>{}</td>", html_escape(value(i, k)));
    differ += "</tr>\n";
  }
  o += "<h2>Runs and the settings that differ</h2>\n<table class=\"settings\">\n<tr><th>setting</th>";
  for (auto& r : runs) o += fmt::format("<th>{}</th>", html_escape(r.label));
  o += "</tr>\n" + differ;
  // The last held-back record of each run.
  o += "<tr><td><b>held-back sim_accept_len (last)</b></td>";
  for (auto& r : runs) {
    double v = NAN;
    for (auto& m : r.records)
      if (m.split == "eval")
        if (auto it = m.scalars.find("sim_accept_len"); it != m.scalars.end()) v = it->second;
    o += fmt::format("<td>{}</td>", std::isfinite(v) ? fmt::format("{:.3f}", v) : std::string("-"));
  }
  o += "</tr>\n</table>\n";
  if (!same.empty()) o += fmt::format("<p>Shared by every run: {}.</p>\n", same);
  o += definitions_section();

  // Shared charts: one series per run.
  auto batch_of = [](const RunMetrics& r) {
    if (r.settings.is_object() && r.settings.contains("job") && r.settings["job"].is_object() &&
        r.settings["job"].contains("batch_samples") && r.settings["job"]["batch_samples"].is_number())
      return r.settings["job"]["batch_samples"].get<double>();
    return double(NAN);
  };
  // Held-back charts put runs on one x axis: tokens trained on when every run's records
  // carry it (runs of one data set and of different sizes compare fairly), else samples
  // (step x batch_samples), else steps.
  enum class X { Step, Samples, Tokens };
  auto has_tokens = [](const RunMetrics& r, const std::string& split) {
    bool any = false;
    for (auto& m : r.records)
      if (m.split == split) {
        if (!m.scalars.count("tokens_trained")) return false;
        any = true;
      }
    return any;
  };
  auto chart = [&](const char* id, const std::string& ttl, const std::string& ylab, const std::string& split,
                   bool by_amount, auto value_of) {
    X x = X::Step;
    if (by_amount) {
      x = X::Tokens;
      for (auto& r : runs)
        if (!has_tokens(r, split)) x = X::Samples;
    }
    Chart ch{id, ttl, ylab, {},
             x == X::Tokens ? "tokens trained on" : x == X::Samples ? "samples trained on (step x batch_samples)" : "step"};
    for (auto& r : runs) {
      const double b = batch_of(r);
      if (x == X::Samples && !std::isfinite(b)) continue;
      ChartSeries s{r.label, {}};
      for (auto& m : r.records) {
        if (m.split != split) continue;
        const double v = value_of(m);
        const double at = x == X::Tokens    ? m.scalars.at("tokens_trained")
                          : x == X::Samples ? double(m.step) * b
                                            : double(m.step);
        if (std::isfinite(v)) s.points.push_back({at, v});
      }
      if (!s.points.empty()) ch.series.push_back(std::move(s));
    }
    return ch;
  };
  auto scalar = [](const char* k) {
    return [k](const MetricRecord& m) {
      auto it = m.scalars.find(k);
      return it == m.scalars.end() ? NAN : it->second;
    };
  };
  auto acc0 = [](const MetricRecord& m) {
    auto it = m.arrays.find("acc");
    return it == m.arrays.end() || it->second.empty() ? NAN : it->second[0];
  };
  std::vector<Chart> charts;
  charts.push_back(chart("cmp_sim_accept_len", "Held-back simulated acceptance length", "sim_accept_len", "eval",
                         true, scalar("sim_accept_len")));
  charts.back().y_min = 1;
  charts.push_back(chart("cmp_acc0", "Held-back acc_0 (first draft token right)", "acc_0", "eval", true, acc0));
  charts.back().y_min = 0, charts.back().y_max = 1;
  charts.push_back(chart("cmp_sim_accept_len_step", "Held-back simulated acceptance length by step", "sim_accept_len",
                         "eval", false, scalar("sim_accept_len")));
  charts.back().y_min = 1;
  charts.push_back(chart("cmp_loss", "Training loss", "loss", "train", false, scalar("loss")));
  charts.back().y_min = 0;
  o += "<h2>Charts</h2>\n";
  for (auto& ch : charts)
    if (!ch.series.empty()) o += render_line_chart_svg(ch);
  o += "</body>\n</html>\n";
  return o;
}

ReportSummary run_report(const ReportOptions& opt) {
  TALON_CHECK(!opt.runs.empty(), "report: --run is required");
  TALON_CHECK(opt.runs.size() == 1 || opt.eval.empty(),
              "report: --eval belongs to one run's drafter; give one --run with it");
  std::vector<RunMetrics> runs;
  for (const fs::path& run : opt.runs) {
    const fs::path mpath = fs::is_directory(run) ? run / kMetricsName : run;
    TALON_CHECK(fs::exists(mpath), "{}: missing; expected a `talon train` output directory with metrics.jsonl",
                mpath.string());
    RunMetrics r;
    r.records = parse_metrics(read_text_file(mpath), mpath.string());
    r.settings = run_settings(run);
    const fs::path dir = fs::is_directory(run) ? run : run.parent_path();
    r.label = fs::absolute(dir).lexically_normal().filename().string();
    if (r.label.empty()) r.label = dir.string();
    runs.push_back(std::move(r));
  }
  ReportSummary s;
  std::string html;
  if (runs.size() > 1) {
    html = render_comparison_html(runs, fmt::format("talon training runs compared ({} runs)", runs.size()));
    for (auto& r : runs) s.records += int64_t(r.records.size());
    for (size_t p = html.find("<svg"); p != std::string::npos; p = html.find("<svg", p + 1)) ++s.charts;
  } else {
    const auto& rs = runs[0].records;
    const std::string title =
        fmt::format("talon training report: {}", fs::absolute(opt.runs[0]).lexically_normal().string());
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
        for (auto* sv : c.served)
          if (k < sv->reached.size() && sv->reached[k] > 0)
            line += fmt::format(", served {} {:.3f} ({} drafts)", sv->config,
                                double(sv->accepted[k]) / double(sv->reached[k]), sv->reached[k]);
        tlog::info("{}", line);
      }
      tlog::info("report: {}", c.verdict);
    }
    html = render_report_html(rs, title, opt.eval.empty() ? nullptr : &served, served_source, &runs[0].settings);
    s.records = int64_t(rs.size());
    s.charts = int64_t(build_charts(rs).size());
  }
  if (!opt.out.parent_path().empty()) fs::create_directories(opt.out.parent_path());
  write_file_atomic(opt.out, html);
  tlog::info("report: {} records -> {} ({} charts)", s.records, opt.out.string(), s.charts);
  return s;
}

}  // namespace talon::train
