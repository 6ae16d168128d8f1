#pragma once
#include "util/file.h"

namespace talon {
// `talon template --template PATH --input FILE [--output FILE]`
// PATH: a .jinja file, tokenizer_config.json, model directory or GGUF. Each input JSONL line
// {"messages": [...], "add_generation_prompt": bool, "bos_token": ..., "eos_token": ...,
//  "kwargs": {...}} is written back with "rendered": "..." added, or "error": "..." when the
// template raises (raise_exception) or fails on that conversation. Malformed lines throw
// talon::Error naming FILE:LINE. Output empty = stdout. Returns the exit code (0).
int run_template(const fs::path& template_path, const fs::path& input, const fs::path& output);
}  // namespace talon
