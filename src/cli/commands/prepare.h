#pragma once
#include <CLI/CLI.hpp>

#include "data/prepare.h"
#include "util/file.h"

namespace talon {
// `talon prepare`: registers the subcommand on `app`, with its options bound to `opt`.
CLI::App* add_prepare_subcommand(CLI::App& app, PrepareOptions& opt);
// Runs it and prints the summary; returns the exit code (128 + signal when interrupted).
int run_prepare_command(const PrepareOptions& opt);

// True when `dir` is a `talon prepare` output (manifest.json with format "talon.tokens").
bool is_tokens_dir(const fs::path& dir);
// `talon inspect DIR` for a prepared dataset: prints the manifest's stats, verifies the
// tokens.jsonl checksum and every line, and shows sample `show_sample` (0 when < 0) with its
// masked tokens marked [[...]] (decoded with the manifest's tokenizer when it can be loaded,
// else as ids). Returns the exit code: 0 when everything checked out.
int inspect_tokens(const fs::path& dir, int show_sample);
}  // namespace talon
