// Process memory as the kernel sees it (Linux /proc/self/status), for load reports.
#pragma once
#include <cstdint>
#include <string>

namespace talon {

struct MemUsage {
  int64_t rss_anon = 0;  // bytes of private memory (copies we made)
  int64_t rss_file = 0;  // bytes of mapped files resident (weights served from the page cache)
  int64_t peak_rss = 0;  // VmHWM
};
MemUsage mem_usage();
std::string format_mem(const MemUsage& m);

}  // namespace talon
