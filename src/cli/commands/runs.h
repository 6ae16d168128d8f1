// `talon gpus` and `talon stop`.
#pragma once
#include "util/file.h"

namespace talon {
int run_gpus();
int run_stop(const fs::path& dir, double wait_seconds);
}  // namespace talon
