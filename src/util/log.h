// Logging: spdlog with one line format for every thread; each GPU/worker thread gets
// a rank prefix so interleaved lines stay attributable.
#pragma once
#include <spdlog/spdlog.h>

#include <string>

namespace talon {

// level: trace|debug|info|warn|error|off. Throws on an unknown level.
void init_logging(const std::string& level);
// Prefix for lines logged from the calling thread, e.g. "rank 3". Empty for main.
void set_thread_log_tag(const std::string& tag);

}  // namespace talon

namespace tlog = spdlog;
