#include "spec/eval.h"

#include <omp.h>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "data/chat_formats.h"
#include "data/prepare.h"
#include "model/checkpoint.h"
#include "model/decode.h"
#include "draft/draft_runner.h"
#include "spec/generate.h"
#include "draft/report.h"
#include "util/error.h"
#include "util/log.h"
#include "util/progress.h"
#include "util/signals.h"

namespace talon::spec {

using json = nlohmann::ordered_json;

double EvalRow::break_even_tau() const {
  const double token = base.round_ms();
  return token > 0 ? spec.round_ms() / token : 0;
}

double EvalRow::speedup() const {
  const double s = spec.seconds > 0 ? double(spec.new_tokens) / spec.seconds : 0;
  const double b = base.seconds > 0 ? double(base.new_tokens) / base.seconds : 0;
  return b > 0 ? s / b : 0;
}

namespace {

struct Question {
  std::string id, category, source;
  std::vector<std::vector<ojson>> turns;
};

json stats_json(const DecodeStats& s) {
  json rate = json::array();
  for (size_t i = 0; i < s.tried.size(); ++i) rate.push_back(s.tried[i] ? double(s.accepted[i]) / double(s.tried[i]) : 0.0);
  return {{"new_tokens", s.new_tokens},
          {"target_passes", s.rounds},
          {"drafted", s.drafted},
          {"tau", s.tau()},
          {"accept_rate_per_depth", rate},
          {"reached_per_depth", s.tried},
          {"accepted_per_depth", s.accepted},
          {"seconds", s.seconds},
          {"tokens_per_s", s.seconds > 0 ? double(s.new_tokens) / s.seconds : 0.0},
          {"target_seconds", s.target_seconds},
          {"draft_seconds", s.draft_seconds},
          {"prefill_seconds", s.prefill_seconds},
          {"round_seconds", s.round_seconds},
          {"round_target_seconds", s.round_target_seconds},
          {"round_ms", s.round_ms()},
          {"verify_ms", s.verify_ms()},
          {"draft_ms", s.draft_ms()}};
}

// A grouped bar chart: one group per label, one bar per series. Bars rise from `base` (1 for
// an acceptance length, which is at least 1); `ref` draws a dashed line (1.0: no speedup).
std::string bar_chart_svg(const std::string& id, const std::string& title, const std::vector<std::string>& labels,
                          const std::vector<std::pair<std::string, std::vector<double>>>& series, double base,
                          double ref, const std::string& ref_label) {
  constexpr double W = 960, Hh = 320, ml = 64, mr = 190, mt = 30, mb = 74;
  double ymax = base, ymin = base;
  for (const auto& s : series)
    for (double v : s.second) ymax = std::max(ymax, v), ymin = std::min(ymin, v);
  if (std::isfinite(ref)) ymax = std::max(ymax, ref), ymin = std::min(ymin, ref);
  const train::AxisTicks yt = train::nice_ticks(ymin, ymax * 1.05 + (ymax == ymin ? 1 : 0), 5);
  const double Y0 = std::min(yt.lo, base), Y1 = yt.hi;
  const double pw = W - ml - mr, ph = Hh - mt - mb;
  auto sy = [&](double v) { return mt + 8 + (ph - 8) * (1 - (v - Y0) / (Y1 - Y0)); };  // headroom under the frame
  const double gw = pw / double(std::max<size_t>(labels.size(), 1));
  const double bw = gw * 0.8 / double(std::max<size_t>(series.size(), 1));
  const char* font = "font-family=\"system-ui,sans-serif\"";
  std::string o = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"chart\" data-chart=\"{}\" viewBox=\"0 0 {} {}\" "
      "style=\"width:100%;height:auto;max-width:{}px;display:block;margin:8px 0 24px\">\n"
      "<rect x=\"0\" y=\"0\" width=\"{}\" height=\"{}\" fill=\"#ffffff\"/>\n"
      "<text x=\"{}\" y=\"19\" font-size=\"15\" font-weight=\"600\" fill=\"#222\" {}>{}</text>\n",
      train::html_escape(id), W, Hh, W * 1.5, W, Hh, ml, font, train::html_escape(title));
  for (double v : yt.values) {
    if (v < Y0 - 1e-12) continue;
    o += fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"#e6e6e6\"/>"
                     "<text x=\"{}\" y=\"{:.1f}\" font-size=\"11\" text-anchor=\"end\" fill=\"#444\" {}>{}</text>\n",
                     ml, sy(v), ml + pw, sy(v), ml - 6, sy(v) + 4, font, train::tick_label(v, yt.decimals));
  }
  for (size_t g = 0; g < labels.size(); ++g) {
    const double gx = ml + gw * double(g) + gw * 0.1;
    for (size_t s = 0; s < series.size(); ++s) {
      const double v = g < series[s].second.size() ? series[s].second[g] : base;
      const double top = sy(std::max(v, base)), bottom = sy(std::min(v, base));
      o += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"{}\" "
                       "data-series=\"{}\" data-value=\"{}\"><title>{} {}: {:.3f}</title></rect>\n",
                       gx + bw * double(s), top, bw, std::max(0.0, bottom - top), train::colour(s),
                       train::html_escape(series[s].first), v, train::html_escape(series[s].first),
                       train::html_escape(labels[g]), v);
    }
    o += fmt::format("<text x=\"{:.1f}\" y=\"{}\" font-size=\"11\" text-anchor=\"end\" fill=\"#222\" "
                     "transform=\"rotate(-30 {:.1f} {})\" {}>{}</text>\n",
                     gx + gw * 0.4, mt + ph + 16, gx + gw * 0.4, mt + ph + 16, font, train::html_escape(labels[g]));
  }
  o += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#888\" "
                   "class=\"plot-area\"/>\n",
                   ml, mt, pw, ph);
  if (std::isfinite(ref))
    o += fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"#333\" stroke-width=\"1.5\" "
                     "stroke-dasharray=\"6 4\" data-ref=\"{}\"/><text x=\"{}\" y=\"{:.1f}\" font-size=\"11\" "
                     "fill=\"#333\" {}>{}</text>\n",
                     ml, sy(ref), ml + pw, sy(ref), ref, ml + 6, sy(ref) - 5, font, train::html_escape(ref_label));
  for (size_t s = 0; s < series.size(); ++s)
    o += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"12\" height=\"12\" fill=\"{}\"/>"
                     "<text x=\"{}\" y=\"{}\" font-size=\"12\" fill=\"#222\" {}>{}</text>\n",
                     ml + pw + 12, mt + 17 * double(s), train::colour(s), ml + pw + 30, mt + 17 * double(s) + 10, font,
                     train::html_escape(series[s].first));
  o += "</svg>\n";
  return o;
}

std::string render_eval_html(const json& doc, const std::vector<EvalRow>& rows) {
  std::string o = "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>talon eval</title>\n"
                  "<style>body{font-family:system-ui,sans-serif;margin:24px;max-width:1500px;color:#222}table{border-collapse:collapse}"
                  "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#f4f4f4}"
                  "td:first-child,td:nth-child(2),td:nth-child(3){text-align:left}.chart{margin:12px 0}</style>"
                  "</head><body>\n<h1>Speculative decoding evaluation</h1>\n";
  o += fmt::format("<p>target <code>{}</code> on {}, draft <code>{}</code> on {}, max new tokens {}</p>\n",
                   train::html_escape(doc["model"].get<std::string>()),
                   train::html_escape(doc["backend"].get<std::string>()), train::html_escape(doc["draft"].get<std::string>()),
                   train::html_escape(doc.value("draft_backend", std::string("cpu"))), doc["max_new_tokens"].get<int64_t>());
  o += "<table><tr><th>T</th><th>config</th><th>category</th><th>turns</th><th>tau</th><th>tok/s</th>"
       "<th>baseline tok/s</th><th>speedup</th><th title=\"a round's cost in target-only tokens: speculation pays "
       "when tau exceeds it\">break-even tau</th><th>verify ms</th><th>draft ms</th><th>greedy equal</th></tr>\n";
  for (const auto& r : rows)
    o += fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.3f}</td><td>{:.1f}</td><td>{:.1f}</td>"
                     "<td>{:.3f}</td><td>{:.2f}</td><td>{:.3f}</td><td>{:.3f}</td><td>{}</td></tr>\n",
                     r.temperature, train::html_escape(r.config), train::html_escape(r.category), r.turns, r.spec.tau(),
                     r.spec.seconds > 0 ? r.spec.new_tokens / r.spec.seconds : 0.0,
                     r.base.seconds > 0 ? r.base.new_tokens / r.base.seconds : 0.0, r.speedup(), r.break_even_tau(),
                     r.spec.verify_ms(), r.spec.draft_ms(),
                     r.temperature > 0 ? std::string("-")
                                       : fmt::format("{}/{}{}", r.compared - r.greedy_mismatches, r.compared,
                                                     r.greedy_near_ties ? fmt::format(" ({} near-ties)", r.greedy_near_ties)
                                                                        : std::string()));
  o += "</table>\n";
  // Charts per temperature: tau and speedup by category, acceptance rate by depth.
  std::map<double, std::vector<const EvalRow*>> by_t;
  for (const auto& r : rows) by_t[r.temperature].push_back(&r);
  for (const auto& [t, rs] : by_t) {
    std::vector<std::string> cats, cfgs;
    for (auto* r : rs) {
      if (std::find(cats.begin(), cats.end(), r->category) == cats.end()) cats.push_back(r->category);
      if (std::find(cfgs.begin(), cfgs.end(), r->config) == cfgs.end()) cfgs.push_back(r->config);
    }
    std::vector<std::pair<std::string, std::vector<double>>> tau, speed;
    train::Chart acc{fmt::format("acc_T{}", t), fmt::format("Acceptance rate by draft depth (T={}, all categories)", t), "rate", {}};
    for (const auto& c : cfgs) {
      std::vector<double> tv(cats.size()), sv(cats.size());
      for (auto* r : rs) {
        if (r->config != c) continue;
        const size_t ci = size_t(std::find(cats.begin(), cats.end(), r->category) - cats.begin());
        tv[ci] = r->spec.tau();
        sv[ci] = r->speedup();
        if (r->category == "all") {
          train::ChartSeries s{c, {}};
          for (size_t d = 0; d < r->spec.tried.size(); ++d)
            if (r->spec.tried[d]) s.points.push_back({double(d + 1), double(r->spec.accepted[d]) / double(r->spec.tried[d])});
          acc.series.push_back(std::move(s));
        }
      }
      tau.push_back({c, tv});
      speed.push_back({c, sv});
    }
    o += fmt::format("<h2>Temperature {}</h2>\n", t);
    o += bar_chart_svg(fmt::format("tau_T{}", t), fmt::format("Mean acceptance length tau (T={}): tokens per target pass", t),
                       cats, tau, 1.0, NAN, "");
    o += bar_chart_svg(fmt::format("speedup_T{}", t), fmt::format("Speedup over target-only decoding (T={})", t), cats,
                       speed, 0.0, 1.0, "1.0: as fast as the target alone");
    acc.x_label = "draft depth";
    acc.y_min = 0, acc.y_max = 1;
    if (!acc.series.empty()) o += train::render_line_chart_svg(acc);
  }
  o += "</body></html>\n";
  return o;
}

}  // namespace

EvalReport run_eval(const EvalOptions& opt) {
  if (opt.threads > 0) omp_set_num_threads(opt.threads);
  TALON_CHECK(!opt.configs.empty(), "eval: no drafting configuration (give --chain and/or --tree)");
  for (const auto& c : opt.configs) c.validate();
  TALON_CHECK(!opt.temperatures.empty(), "eval: no temperature");
  TALON_CHECK(opt.max_new_tokens > 0, "--max-new-tokens must be > 0 (got {})", opt.max_new_tokens);
  TALON_CHECK(!opt.out.empty(), "eval: --out is required");
  const ChatFormat forced = parse_chat_format(opt.format);
  const ojson kwargs = parse_template_kwargs(opt.template_kwargs);
  const auto files = expand_inputs(opt.inputs);
  ChatTokenizer ct = load_chat_tokenizer(opt.model, opt.tokenizer, opt.chat_template, opt.fallback_template, "eval");
  auto ckpt = open_checkpoint(opt.model);
  const DeviceSpec dev = parse_device(opt.device, opt.share_gpus);
  int max_draft = 0;
  for (const auto& c : opt.configs) max_draft = std::max(max_draft, c.max_draft_tokens());
  const int64_t cache = opt.max_len + max_draft + 2;
  std::unique_ptr<Decoder> dec = make_decoder(*ckpt, dev, opt.tp, opt.ep, opt.share_gpus, 1, cache);
  // After the decoder: a device that is not there is reported before the draft is read.
  const DraftModel dm = load_draft(opt.draft, *ckpt);
  tlog::info("eval: {} draft {} (aux layers {}, draft vocabulary {})",
             dm.parallel() ? "P-EAGLE" : dm.block() ? "DFlash" : "EAGLE-3",
             dm.origin, fmt::join(dm.aux_layer_ids, ","), dm.config.Vd);
  std::vector<SpecConfig> configs = opt.configs;
  if (dm.chain_only()) {
    if (opt.default_trees)
      std::erase_if(configs, [](const SpecConfig& c) { return c.mode != SpecConfig::Mode::Chain; });
    for (const auto& c : configs)
      TALON_CHECK(c.mode == SpecConfig::Mode::Chain,
                  "eval: --draft {} is a {} draft, which drafts one chain per round in one pass; give --chain "
                  "configurations only (--no-tree)",
                  opt.draft.string(), dm.parallel() ? "P-EAGLE" : "DFlash");
    TALON_CHECK(!configs.empty(), "eval: no chain configuration for the draft {} (give --chain)", opt.draft.string());
  }
  int max_tree_rows = 0;  // draft rows one round adds above the step-0 rows
  for (const auto& c : configs)
    max_tree_rows = std::max(max_tree_rows, c.mode == SpecConfig::Mode::Chain ? c.k : c.topk * c.depth);
  DeviceSpec ddev = opt.draft_device == "same" ? dev : parse_device(opt.draft_device);
  if (opt.draft_device == "same" && ddev.devices.size() > 1) ddev.devices.resize(1);  // a group's first GPU
  TALON_CHECK(!ddev.cuda || ddev.devices.size() <= 1, "eval: --draft-device {}: one GPU", opt.draft_device);
  DraftRunner draft(dm, *ckpt, ddev.cuda ? (ddev.devices.empty() ? 0 : ddev.devices[0]) : -1,
                    cache + max_tree_rows + 1);
  tlog::info("eval: target on {}, draft on {}", dec->backend(), draft.backend());
  const std::vector<int32_t> eos = eos_ids(*ct.tok, opt.model);

  // A greedy speculative output that leaves the target-only one. On the CPU the arithmetic of
  // both is identical, so any difference is an error. On a GPU the verify pass multiplies
  // bf16 matrices of other shapes than one-token decoding, so a near-tie can flip: the first
  // differing token is a near-tie when the fp32 CPU reference's logits of the two tokens on
  // the common prefix are closer than twice the GPU's own largest logit error on that row.
  std::unique_ptr<Decoder> ref;
  auto near_tie = [&](const std::vector<int32_t>& prompt, const std::vector<int32_t>& want,
                      const std::vector<int32_t>& got, const std::string& where) {
    size_t j = 0;
    while (j < want.size() && j < got.size() && want[j] == got[j]) ++j;
    if (dec->backend() == "cpu" || j == want.size() || j == got.size()) {
      tlog::error("{}: the greedy speculative output differs from target-only greedy decoding at token {}", where, j);
      return false;
    }
    if (!ref) ref = make_cpu_decoder(*ckpt, 1, cache);
    std::vector<int32_t> seq = prompt;
    seq.insert(seq.end(), want.begin(), want.begin() + std::ptrdiff_t(j));
    const int64_t V = ckpt->config().vocab;
    std::vector<float> lc(static_cast<size_t>(V)), lg(static_cast<size_t>(V));
    ref->reset(0);
    ref->forward({{0, seq, {}, false}}, {}, lc.data());
    dec->reset(0);
    dec->forward({{0, seq, {}, false}}, {}, lg.data());
    dec->reset(0);
    double err = 0;
    for (int64_t v = 0; v < V; ++v) err = std::max(err, std::fabs(double(lg[size_t(v)]) - double(lc[size_t(v)])));
    const double gap = double(lc[size_t(want[j])]) - double(lc[size_t(got[j])]);
    const bool tie = std::fabs(gap) <= 2 * err;
    const std::string msg = fmt::format(
        "{}: greedy output differs at token {} ({} instead of {}): fp32 logits {:.4f} apart, the GPU's logit error on "
        "that row {:.4f}: {}",
        where, j, got[j], want[j], gap, err, tie ? "a near-tie" : "NOT a near-tie");
    if (tie)
      tlog::warn("{}", msg);
    else
      tlog::error("{}", msg);
    return tie;
  };

  // Questions, with their category.
  std::vector<Question> qs;
  for (const auto& f : files) {
    RecordReader rr(f);
    RecordReader::Item it;
    int64_t taken = 0;
    while ((opt.limit_per_file <= 0 || taken < opt.limit_per_file) &&
           (opt.limit <= 0 || int64_t(qs.size()) < opt.limit) && rr.next(it)) {
      const std::string where = fmt::format("{}:{}", f.string(), it.line);
      try {
        const ojson rec = parse_record(it.text);
        std::string cat = rec.is_object() && rec.contains("category") && rec["category"].is_string()
                              ? rec["category"].get<std::string>()
                              : std::string();
        if (cat.empty()) cat = f.stem().string();
        for (const auto& c : record_to_conversations(rec, forced == ChatFormat::Auto ? detect_chat_format(rec) : forced)) {
          Question q{c.id.empty() ? where : c.id, cat, where, turn_segments(c, nullptr)};
          if (opt.max_turns > 0 && int64_t(q.turns.size()) > opt.max_turns) q.turns.resize(size_t(opt.max_turns));
          if (!q.turns.empty()) qs.push_back(std::move(q));
        }
      } catch (const RecordError& e) {
        fail("{}: {} [{}]", where, e.what(), e.reason);
      }
      ++taken;
    }
  }
  if (opt.limit > 0 && int64_t(qs.size()) > opt.limit) qs.resize(size_t(opt.limit));
  TALON_CHECK(!qs.empty(), "eval: the inputs hold no questions");
  int64_t total_turns = 0;
  for (const auto& q : qs) total_turns += int64_t(q.turns.size());
  tlog::info("eval: {} conversations ({} turns) x {} temperature(s) x {} configuration(s) on {}", qs.size(), total_turns,
             opt.temperatures.size(), configs.size(), dec->backend());

  // (temperature, config, category) -> row; "all" aggregates.
  std::map<std::tuple<double, std::string, std::string>, EvalRow> rows;
  auto row = [&](double t, const std::string& cfg, const std::string& cat) -> EvalRow& {
    EvalRow& r = rows[{t, cfg, cat}];
    r.temperature = t;
    r.config = cfg;
    r.category = cat;
    return r;
  };
  Progress progress("eval", int64_t(opt.temperatures.size() * configs.size()) * total_turns, "turns");
  bool stopped = false;
  for (double t : opt.temperatures) {
    SamplingParams sp;
    sp.temperature = t;
    sp.top_p = opt.top_p;
    sp.top_k = opt.top_k;
    sp.seed = opt.seed;
    sp.validate();
    for (size_t qi = 0; qi < qs.size() && !stopped; ++qi) {
      const Question& q = qs[qi];
      // Runs every turn of q with one decoder function, answers appended in context.
      auto run_conv = [&](const std::function<std::vector<int32_t>(const std::vector<int32_t>&, uint64_t,
                                                                   DecodeStats&)>& fn,
                          DecodeStats& st, std::vector<std::vector<int32_t>>& outs,
                          std::vector<std::vector<int32_t>>& prompts) {
        ojson msgs = ojson::array();
        for (size_t ti = 0; ti < q.turns.size(); ++ti) {
          for (const auto& m : q.turns[ti]) msgs.push_back(m);
          std::vector<int32_t> ids = ct.tok->encode(ct.tpl->render(msgs, true, kwargs), false);
          if (int64_t(ids.size()) + opt.max_new_tokens > opt.max_len) {
            tlog::warn("{}: turn {} has a {}-token prompt; with --max-new-tokens {} it exceeds --max-len {}: skipped",
                       q.source, ti + 1, ids.size(), opt.max_new_tokens, opt.max_len);
            break;
          }
          auto out = fn(ids, uint64_t(qi) * 64 + ti, st);
          prompts.push_back(ids);
          std::vector<int32_t> shown = out;
          if (!shown.empty() && std::find(eos.begin(), eos.end(), shown.back()) != eos.end()) shown.pop_back();
          msgs.push_back(ojson{{"role", "assistant"}, {"content", ct.tok->decode(shown, true)}});
          outs.push_back(std::move(out));
        }
      };
      GenLimits lim;
      lim.max_new_tokens = opt.max_new_tokens;
      lim.eos = eos;
      DecodeStats base;
      std::vector<std::vector<int32_t>> base_out, base_prompts;
      run_conv([&](const std::vector<int32_t>& p, uint64_t stream,
                   DecodeStats& st) { return decode_plain(*dec, 0, p, sp, stream, lim, &st); },
               base, base_out, base_prompts);
      for (const auto& cfg : configs) {
        if (stop_requested()) {
          stopped = true;
          break;
        }
        DecodeStats st;
        std::vector<std::vector<int32_t>> outs, prompts;
        run_conv([&](const std::vector<int32_t>& p, uint64_t stream,
                     DecodeStats& s) { return decode_speculative(*dec, 0, draft, p, cfg, sp, stream, lim, &s); },
                 st, outs, prompts);
        int64_t mism = 0, ties = 0;
        bool explained = true;  // every difference so far a near-tie (later turns inherit their prompts)
        if (sp.greedy())
          for (size_t i = 0; i < std::min(outs.size(), base_out.size()); ++i) {
            if (outs[i] == base_out[i]) continue;
            ++mism;
            if (prompts[i] != base_prompts[i]) {  // context changed by an earlier turn's difference
              ties += explained;
              continue;
            }
            const bool tie = near_tie(prompts[i], base_out[i], outs[i], q.source + " turn " + std::to_string(i + 1) +
                                                                           " (" + cfg.name() + ")");
            ties += tie;
            explained = explained && tie;
          }
        for (const std::string& cat : {q.category, std::string("all")}) {
          EvalRow& r = row(t, cfg.name(), cat);
          ++r.conversations;
          r.turns += int64_t(outs.size());
          r.spec.add(st);
          r.base.add(base);
          r.compared += sp.greedy() ? int64_t(std::min(outs.size(), base_out.size())) : 0;
          r.greedy_mismatches += mism;
          r.greedy_near_ties += ties;
        }
        progress.advance(int64_t(q.turns.size()));
        const EvalRow& all = rows[{t, cfg.name(), "all"}];
        progress.set_note(fmt::format("{} tau {:.2f} speedup {:.2f}", cfg.name(), all.spec.tau(), all.speedup()));
      }
    }
  }
  progress.finish();
  if (stopped) tlog::warn("eval: stopped by signal; the report covers the conversations finished so far");

  EvalReport rep;
  rep.backend = dec->backend();
  rep.draft_backend = draft.backend();
  for (auto& [k, r] : rows) rep.rows.push_back(r);
  // "all" last within each (temperature, config).
  std::stable_sort(rep.rows.begin(), rep.rows.end(), [](const EvalRow& a, const EvalRow& b) {
    if (a.temperature != b.temperature) return a.temperature < b.temperature;
    if (a.config != b.config) return a.config < b.config;
    return (a.category == "all") < (b.category == "all");
  });
  json doc = {{"format", "talon.eval"},
              {"model", opt.model.string()},
              {"draft", dm.origin},
              {"backend", dec->backend()},
              {"draft_backend", draft.backend()},
              {"max_new_tokens", opt.max_new_tokens},
              {"top_p", opt.top_p},
              {"top_k", opt.top_k},
              {"seed", opt.seed},
              {"complete", !stopped},
              {"inputs", json::array()},
              {"results", json::array()}};
  for (const auto& f : files) doc["inputs"].push_back(f.string());
  for (const auto& r : rep.rows) {
    json j = {{"temperature", r.temperature}, {"config", r.config},     {"category", r.category},
              {"conversations", r.conversations}, {"turns", r.turns}, {"tau", r.spec.tau()},
              {"speedup", r.speedup()}, {"break_even_tau", r.break_even_tau()}};
    if (r.temperature <= 0)
      j["greedy_equal"] = {{"compared", r.compared}, {"differ", r.greedy_mismatches}, {"near_ties", r.greedy_near_ties}};
    j["speculative"] = stats_json(r.spec);
    j["baseline"] = stats_json(r.base);
    doc["results"].push_back(std::move(j));
  }
  fs::create_directories(opt.out);
  rep.json_path = opt.out / "eval.json";
  rep.html_path = opt.out / "eval.html";
  write_file_atomic(rep.json_path, doc.dump(2) + "\n");
  write_file_atomic(rep.html_path, render_eval_html(doc, rep.rows));
  return rep;
}

}  // namespace talon::spec
