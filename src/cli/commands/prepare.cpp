#include "cli/commands/prepare.h"

#include <iostream>
#include <nlohmann/json.hpp>

#include "data/samples.h"
#include "text/tokenizer.h"
#include "util/error.h"
#include "util/log.h"
#include "util/signals.h"

namespace talon {

using json = nlohmann::json;

CLI::App* add_prepare_subcommand(CLI::App& app, PrepareOptions& o) {
  auto* c = app.add_subcommand("prepare", "Tokenize chat datasets with the model's chat template and assistant-only "
                                          "loss masks (input of extract)");
  c->add_option("--data", o.inputs, "Input files or directories (JSONL, JSON arrays, CSV or TSV; directories: every "
                                    "*.jsonl/*.json/*.csv/*.tsv below)")
      ->required()
      ->expected(1, -1);
  c->add_option("--out", o.out, "Output directory (new or empty): tokens.jsonl + manifest.json")->required();
  c->add_option("--model", o.model, "Model directory (tokenizer.json + tokenizer_config.json) or .gguf");
  c->add_option("--tokenizer", o.tokenizer, "Tokenizer (tokenizer.json, model directory, .gguf), overrides --model");
  c->add_option("--template", o.chat_template, "Chat template (.jinja, tokenizer_config.json, model dir, .gguf), "
                                               "overrides --model");
  c->add_option("--fallback-template", o.fallback_template, "Built-in template when none is found: chatml");
  c->add_option("--template-kwargs", o.template_kwargs, "JSON object of extra template variables");
  c->add_option("--format", o.format, "auto|sharegpt|openai|mtbench101|ultrachat|gsm8k|self-instruct|alpaca|questions")
      ->capture_default_str();
  c->add_option("--max-length", o.max_length, "Truncate samples to N tokens (0: no limit)")->capture_default_str();
  c->add_option("--on-error", o.on_error, "fail: stop at the first bad record; skip: count and list it")
      ->capture_default_str();
  c->add_option("--prompts", o.prompts, "Question records without answers: skip (counted) or keep (empty loss mask)")
      ->capture_default_str();
  c->add_option("--threads", o.threads, "Threads (default: all cores)");
  return c;
}

int run_prepare_command(const PrepareOptions& opt) {
  PrepareReport r = run_prepare(opt);
  if (r.status == PrepareStatus::Interrupted) {
    std::cerr << "prepare interrupted; nothing was kept (rerunning starts over from the first record)\n";
    return 128 + (stop_signal() ? stop_signal() : 15);
  }
  if (r.status == PrepareStatus::AlreadyComplete) {
    std::cout << fmt::format("prepare already complete: {} records -> {} samples\n  output: {}\n", r.records, r.samples,
                             r.out.string());
    return 0;
  }
  std::cout << fmt::format("prepare complete: {} records -> {} samples, {} tokens ({} masked), {} truncated, {} "
                           "skipped, {} prompts in {:.1f}s\n",
                           r.records, r.samples, r.tokens, r.masked_tokens, r.truncated, r.skipped, r.prompts,
                           r.seconds);
  std::cout << fmt::format("  output: {}\n", r.out.string());
  return 0;
}

bool is_tokens_dir(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec) || !fs::exists(dir / "manifest.json", ec)) return false;
  json m = json::parse(read_text_file(dir / "manifest.json"), nullptr, false);
  return !m.is_discarded() && m.is_object() && m.value("format", std::string()) == "talon.tokens";
}

int inspect_tokens(const fs::path& dir, int show_sample) {
  const fs::path mpath = dir / "manifest.json";
  json m = json::parse(read_text_file(mpath), nullptr, false);
  TALON_CHECK(!m.is_discarded() && m.is_object(), "{}: not valid JSON", mpath.string());
  auto src = open_samples(dir);  // checks format, version, checksum and every line
  const json& c = m["counts"];
  std::cout << fmt::format("{}: talon.tokens v{} (checksum ok), {} samples\n", dir.string(),
                           m.value("format_version", 0), src->size());
  std::cout << fmt::format("  tokenizer: {} ({}, vocab {})\n", m["tokenizer"].value("source", ""),
                           m["tokenizer"].value("kind", ""), m["tokenizer"].value("vocab_size", 0));
  std::cout << fmt::format("  chat template: {} (sha256 {}){}\n", m["chat_template"].value("source", ""),
                           m["chat_template"].value("sha256", "").substr(0, 16),
                           m["chat_template"].value("builtin_fallback", false) ? " BUILT-IN FALLBACK" : "");
  for (auto& in : m["inputs"])
    std::cout << fmt::format("  input {} [{}]: {} records -> {} samples, {} skipped\n", in.value("path", ""),
                             in.value("format", ""), in.value("records", 0), in.value("samples", 0),
                             in.value("skipped", 0));
  std::cout << fmt::format("  counts: {} records, {} samples, {} tokens, {} masked ({:.1f}%), {} truncated, {} prompts, "
                           "{} skipped\n",
                           c.value("records", 0), c.value("samples", 0), c.value("tokens", 0),
                           c.value("masked_tokens", 0),
                           100.0 * double(c.value("masked_tokens", 0)) / double(std::max<int64_t>(1, c.value("tokens", 0))),
                           c.value("truncated", 0), c.value("prompts", 0), c.value("skipped", 0));
  for (auto& [k, v] : c["skipped_by_reason"].items()) {
    std::cout << fmt::format("    skipped {}: {}\n", k, v.value("count", 0));
    for (size_t i = 0; i < std::min<size_t>(3, v["examples"].size()); ++i)
      std::cout << "      " << v["examples"][i].get<std::string>() << "\n";
  }
  int64_t counted_tokens = 0, counted_masked = 0;
  for (size_t i = 0; i < src->size(); ++i) {
    counted_tokens += int64_t(src->at(i).input_ids.size());
    for (uint8_t b : src->at(i).loss_mask) counted_masked += b;
  }
  int rc = 0;
  if (counted_tokens != c.value("tokens", int64_t(-1)) || counted_masked != c.value("masked_tokens", int64_t(-1))) {
    std::cout << fmt::format("  MISMATCH: tokens.jsonl holds {} tokens ({} masked), the manifest says {} ({})\n",
                             counted_tokens, counted_masked, c.value("tokens", 0), c.value("masked_tokens", 0));
    rc = 1;
  }
  const size_t n = size_t(std::max(0, show_sample));
  TALON_CHECK(n < src->size(), "--sample {}: the dataset has {} samples", n, src->size());
  const Sample& s = src->at(n);
  std::cout << fmt::format("sample {} (id {}, line {}): {} tokens, {} masked; masked spans in [[...]]\n", n, s.id,
                           s.line, s.input_ids.size(),
                           std::count(s.loss_mask.begin(), s.loss_mask.end(), uint8_t(1)));
  std::unique_ptr<text::Tokenizer> tok;
  const fs::path tpath = m["tokenizer"].value("source", "");
  try {
    if (!tpath.empty() && fs::exists(tpath)) tok = text::Tokenizer::load(tpath);
  } catch (const Error& e) {
    tlog::warn("cannot load the manifest's tokenizer {} ({}); showing ids", tpath.string(), e.what());
  }
  std::string out;
  for (size_t k = 0; k < s.input_ids.size();) {
    size_t e = k;
    while (e < s.input_ids.size() && s.loss_mask[e] == s.loss_mask[k]) ++e;
    std::vector<int32_t> run(s.input_ids.begin() + long(k), s.input_ids.begin() + long(e));
    std::string body = tok ? tok->decode(run, false) : fmt::format("{}", fmt::join(run, " "));
    out += s.loss_mask[k] ? "[[" + body + "]]" : body + (tok ? "" : " ");
    k = e;
  }
  std::cout << out << "\n";
  return rc;
}

}  // namespace talon
