#include "cli/commands/spec.h"

#include <iostream>
#include <sstream>

#include "util/error.h"
#include "util/log.h"

namespace talon {

namespace {
std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string x;
  while (std::getline(ss, x, sep))
    if (!x.empty()) out.push_back(x);
  return out;
}
int64_t to_int(const std::string& s, const std::string& opt) {
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TALON_CHECK(used == s.size() && !s.empty(), "{} '{}': expected an integer", opt, s);
  return v;
}
double to_double(const std::string& s, const std::string& opt) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TALON_CHECK(used == s.size() && !s.empty(), "{} '{}': expected a number", opt, s);
  return v;
}

void add_data_options(CLI::App* c, std::vector<fs::path>& inputs, fs::path& model, fs::path& tokenizer,
                      fs::path& tpl, std::string& fallback, std::string& kwargs, std::string& format) {
  c->add_option("--model", model, "Target model: HF directory or .gguf")->required();
  c->add_option("--data", inputs, "Input files or directories (JSONL, JSON arrays, CSV or TSV; directories: every "
                                  "*.jsonl/*.json/*.csv/*.tsv below)")
      ->required()
      ->expected(1, -1);
  c->add_option("--tokenizer", tokenizer, "Tokenizer (overrides --model)");
  c->add_option("--template", tpl, "Chat template (overrides --model)");
  c->add_option("--fallback-template", fallback, "Built-in template when none is found: chatml");
  c->add_option("--template-kwargs", kwargs, "JSON object of extra template variables");
  c->add_option("--format", format, "auto|sharegpt|openai|mtbench101|ultrachat|gsm8k|self-instruct|alpaca|questions")
      ->capture_default_str();
}
}  // namespace

CLI::App* add_generate_subcommand(CLI::App& app, spec::GenerateOptions& o) {
  auto* c = app.add_subcommand("generate", "Regenerate every assistant turn of chat data with the target model "
                                           "(output: messages JSONL for prepare); resumable");
  add_data_options(c, o.inputs, o.model, o.tokenizer, o.chat_template, o.fallback_template, o.template_kwargs, o.format);
  c->add_option("--out", o.out, "Output directory (generated.jsonl, manifest.json); rerun to resume")->required();
  c->add_option("--max-new-tokens", o.max_new_tokens, "Tokens per assistant turn at most")->capture_default_str();
  c->add_option("--max-length,--max-len", o.max_len, "Prompt + answer tokens per turn at most (KV cache per sequence)")
      ->capture_default_str();
  c->add_option("--temperature", o.sampling.temperature, "0: greedy")->capture_default_str();
  c->add_option("--top-p", o.sampling.top_p, "Nucleus sampling mass")->capture_default_str();
  c->add_option("--top-k", o.sampling.top_k, "Top-k sampling (0: off)")->capture_default_str();
  c->add_option("--seed", o.sampling.seed, "Sampling seed (per-sequence streams: the same tokens in any batch)")
      ->capture_default_str();
  c->add_option("--batch", o.batch, "Concurrent sequences (0: 8 on CPU, 256 on a GPU)")->capture_default_str();
  c->add_option("--max-prefill-tokens", o.max_prefill_tokens, "Prompt tokens per forward; a longer prompt is prefilled in chunks beside the running decode steps")
      ->capture_default_str();
  c->add_option("--kv-cache-tokens", o.kv_cache_tokens,
                "Token rows of the KV cache the sequences share in pages (0: batch x max-len, on a GPU at most what "
                "fits); a turn starts when its prompt + max-new-tokens fit beside the running ones")
      ->capture_default_str();
  c->add_option("--stop", o.stop, "Stop string (repeatable); the answer is cut before it");
  c->add_option("--limit", o.limit, "Only the first N conversations (0: all)")->capture_default_str();
  c->add_option("--device", o.device, "cpu | cuda | cuda:N | cuda:N,M,... (with --tp)")->capture_default_str();
  c->add_option("--tp", o.tp, "Tensor-parallel GPUs for the target (DeepSeek / Kimi family)")->capture_default_str();
  c->add_option("--ep", o.ep, "Expert-parallel GPUs for the target (DeepSeek / Kimi family): slots split among them")
      ->capture_default_str();
  c->add_flag("--share-gpus", o.share_gpus,
              "Let --tp / --ep ranks share GPUs (--device cuda:0 runs every rank there; device copies instead of NCCL)");
  c->add_option("--threads", o.threads, "CPU threads (default: all cores)");
  return c;
}

int run_generate_command(const spec::GenerateOptions& o) {
  const auto r = spec::run_generate(o);
  if (r.status == spec::GenerateStatus::Interrupted) return 143;
  if (r.status == spec::GenerateStatus::AlreadyComplete) {
    std::cout << fmt::format("generate: already complete ({} conversations)\n  output: {}\n", r.conversations,
                             (o.out / "generated.jsonl").string());
    return 0;
  }
  std::cout << fmt::format("generate complete: {} conversations ({} from an earlier run, {} skipped), {} turns, {} new "
                           "tokens, {:.1f} tok/s\n  output: {}\n",
                           r.conversations, r.resumed, r.skipped, r.turns, r.new_tokens, r.tokens_per_second,
                           (o.out / "generated.jsonl").string());
  return 0;
}

CLI::App* add_eval_subcommand(CLI::App& app, EvalCli& o) {
  auto* c = app.add_subcommand("eval", "Speculative decoding with the target and a draft (EAGLE-3, P-EAGLE or DFlash): acceptance length, "
                                       "acceptance per depth and speedup over target-only decoding");
  auto& e = o.opt;
  add_data_options(c, e.inputs, e.model, e.tokenizer, e.chat_template, e.fallback_template, e.template_kwargs, e.format);
  c->add_option("--draft", e.draft, "`talon train` run directory / checkpoint, or a `talon export` directory")->required();
  c->add_option("--out", e.out, "Output directory (eval.json, eval.html)")->required();
  c->add_option("--chain", o.chain, "Chain lengths k, comma-separated")->capture_default_str();
  o.tree_opt = c->add_option("--tree", o.tree,
                             "Trees as depth,topk,tokens; several separated by ';' (not with a P-EAGLE draft, whose "
                             "default is chains only)")
                   ->capture_default_str();
  c->add_flag("--no-chain", o.no_chain, "No chain drafting");
  c->add_flag("--no-tree", o.no_tree, "No tree drafting");
  c->add_option("--temperatures", o.temperatures, "Temperatures, comma-separated (0: greedy)")->capture_default_str();
  c->add_option("--top-p", e.top_p, "Nucleus sampling mass (T > 0)")->capture_default_str();
  c->add_option("--top-k", e.top_k, "Top-k sampling (T > 0; 0: off)")->capture_default_str();
  c->add_option("--seed", e.seed, "Sampling seed")->capture_default_str();
  c->add_option("--max-new-tokens", e.max_new_tokens, "Tokens per turn at most")->capture_default_str();
  c->add_option("--max-length,--max-len", e.max_len, "Prompt + answer tokens per turn at most")->capture_default_str();
  c->add_option("--limit", e.limit, "Only the first N conversations over all inputs (0: all)")->capture_default_str();
  c->add_option("--limit-per-file", e.limit_per_file, "Only the first N conversations of each input file (0: all)")
      ->capture_default_str();
  c->add_option("--max-turns", e.max_turns, "Turns per conversation (0: all)")->capture_default_str();
  c->add_option("--device", e.device, "cpu | cuda:N | cuda:N,M,... (with --tp)")->capture_default_str();
  c->add_option("--tp", e.tp, "Tensor-parallel GPUs for the target (DeepSeek / Kimi family)")->capture_default_str();
  c->add_option("--ep", e.ep, "Expert-parallel GPUs for the target (DeepSeek / Kimi family)")->capture_default_str();
  c->add_flag("--share-gpus", e.share_gpus,
              "Let --tp / --ep ranks share GPUs (--device cuda:0 runs every rank there; device copies instead of NCCL)");
  c->add_option("--draft-device", e.draft_device, "Where the draft runs: cpu | cuda:N | same (the target's device)")
      ->capture_default_str();
  c->add_option("--threads", e.threads, "CPU threads (default: all cores)");
  return c;
}

int run_eval_command(EvalCli& o) {
  auto& e = o.opt;
  e.configs.clear();
  e.default_trees = o.tree_opt && o.tree_opt->count() == 0;
  if (!o.no_chain)
    for (const auto& k : split(o.chain, ',')) {
      spec::SpecConfig c;
      c.k = int(to_int(k, "--chain"));
      e.configs.push_back(c);
    }
  if (!o.no_tree)
    for (const auto& t : split(o.tree, ';')) {
      const auto f = split(t, ',');
      TALON_CHECK(f.size() == 3, "--tree '{}': expected depth,topk,tokens", t);
      spec::SpecConfig c;
      c.mode = spec::SpecConfig::Mode::Tree;
      c.depth = int(to_int(f[0], "--tree depth"));
      c.topk = int(to_int(f[1], "--tree topk"));
      c.tree_tokens = int(to_int(f[2], "--tree tokens"));
      e.configs.push_back(c);
    }
  e.temperatures.clear();
  for (const auto& t : split(o.temperatures, ',')) e.temperatures.push_back(to_double(t, "--temperatures"));
  const auto r = spec::run_eval(e);
  // break-even: a round's cost in target-only tokens (verify + draft ms over a token's ms);
  // speculation pays when tau exceeds it.
  std::cout << fmt::format("{:<6} {:<16} {:<14} {:>6} {:>7} {:>9} {:>9} {:>8} {:>10} {:>18} {:>9}\n", "T", "config",
                           "category", "turns", "tau", "tok/s", "base", "speedup", "break-even", "verify+draft ms",
                           "greedy=");
  for (const auto& row : r.rows) {
    if (row.category != "all") continue;
    std::cout << fmt::format(
        "{:<6} {:<16} {:<14} {:>6} {:>7.3f} {:>9.1f} {:>9.1f} {:>8.3f} {:>10.2f} {:>18} {:>9}\n", row.temperature,
        row.config, row.category, row.turns, row.spec.tau(),
        row.spec.seconds > 0 ? row.spec.new_tokens / row.spec.seconds : 0.0,
        row.base.seconds > 0 ? row.base.new_tokens / row.base.seconds : 0.0, row.speedup(), row.break_even_tau(),
        fmt::format("{:.3f}+{:.3f}", row.spec.verify_ms(), row.spec.draft_ms()),
        row.temperature > 0 ? std::string("-")
                            : fmt::format("{}/{}", row.compared - row.greedy_mismatches, row.compared));
  }
  std::cout << fmt::format("  output: {}\n          {}\n", r.json_path.string(), r.html_path.string());
  // Greedy differences: errors, except GPU near-ties (run_eval checks each against the fp32
  // reference).
  int64_t differ = 0, ties = 0;
  for (const auto& row : r.rows)
    if (row.category == "all") differ += row.greedy_mismatches, ties += row.greedy_near_ties;
  if (differ > ties) {
    tlog::error("eval: {} greedy turns differ from target-only decoding ({} of them at near-ties on {})", differ, ties,
                r.backend);
    return 3;
  }
  if (differ)
    tlog::warn("eval: {} greedy turns differ from target-only decoding, each at a bf16 near-tie on {} (checked "
               "against the fp32 reference)",
               differ, r.backend);
  return 0;
}

}  // namespace talon
