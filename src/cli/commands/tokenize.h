#pragma once
#include "util/file.h"

namespace talon {
// `talon tokenize`: reads JSONL lines {"text": ...} and writes the same lines with
// "ids": [...] added (the tokenizer's encode with add_special_tokens = true, as HF's default;
// a line may set "add_special_tokens": false).
// Lines holding "ids" but no "text" are decoded instead ("text" added, special tokens kept).
// Blank lines are skipped. Malformed lines are reported as FILE:LINE: reason and nothing is
// written. `output` empty = stdout. `threads` <= 0 = all cores. Returns the exit code.
int run_tokenize(const fs::path& tokenizer, const fs::path& input, const fs::path& output, int threads);
}  // namespace talon
