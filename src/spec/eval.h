// `talon eval`: real speculative decoding with the target and an EAGLE-3 draft on question
// sets, against target-only decoding measured in the same run.
//
// For every conversation (question files: each turn in turn, answers generated in context;
// any chat dataset: its user turns), every temperature and every drafting configuration:
// the target-only baseline and the speculative run decode the same turns; reported per
// category (the record's "category", else the file's name) and overall: mean acceptance
// length tau (tokens per target pass after the prefill), acceptance rate at each draft
// depth (kept / reached), tokens/s of both, speedup, and at temperature 0 whether the
// speculative output equals the baseline token for token (it must).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/sampling.h"
#include "spec/speculate.h"
#include "util/file.h"

namespace talon::spec {

struct EvalOptions {
  int threads = 0;  // CPU threads (0: all cores)
  fs::path model, draft;
  std::vector<fs::path> inputs;
  fs::path out;  // eval.json + eval.html
  fs::path tokenizer, chat_template;
  std::string fallback_template, template_kwargs, format = "auto";
  std::vector<SpecConfig> configs;
  bool default_trees = false;  // the trees are the CLI's default: a P-EAGLE draft drops them
  std::vector<double> temperatures{0.0};
  double top_p = 1.0;
  int64_t top_k = 0;
  uint64_t seed = 0;
  int64_t max_new_tokens = 256;
  int64_t max_len = 4096;
  int64_t limit = 0;           // conversations over all inputs (0: all), as generate counts them
  int64_t limit_per_file = 0;  // conversations of each input file (0: all): a few per category
  int64_t max_turns = 0;  // turns per conversation (0: all)
  std::string device = "cpu";
  std::string draft_device = "same";  // cpu | cuda:N | same (the target's first device)
  int tp = 1;                          // tensor-parallel GPUs of the target (DeepSeek family)
  int ep = 1;                          // expert-parallel GPUs of the target
  bool share_gpus = false;             // its ranks may share a GPU
};

struct EvalRow {
  double temperature = 0;
  std::string config;    // "baseline" rows are not listed; each row compares with it
  std::string category;  // "all" for the overall row
  int64_t conversations = 0, turns = 0, greedy_mismatches = 0, compared = 0;
  int64_t greedy_near_ties = 0;  // of the mismatches: GPU near-ties (see run_eval), not errors
  DecodeStats spec, base;
  double speedup() const;
  // A speculative round's cost in target-only tokens (both after the prefill): the tau at
  // which speculation breaks even; speedup ~ tau / break_even_tau.
  double break_even_tau() const;
};

struct EvalReport {
  std::vector<EvalRow> rows;
  std::string backend, draft_backend;
  fs::path json_path, html_path;
};

EvalReport run_eval(const EvalOptions& opt);

}  // namespace talon::spec
