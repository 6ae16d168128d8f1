#pragma once
#include "util/file.h"

namespace talon {
// Prints a summary of a feature dataset, a model (HF dir or GGUF) or a safetensors
// file. For datasets, verifies every shard (checksums unless `quick`). Returns the
// process exit code: 0 when everything checked out.
int inspect_path(const fs::path& path, bool quick, int show_sample);
}  // namespace talon
