#include "util/mem.h"

#include <fmt/format.h>

#include <fstream>
#include <sstream>

namespace talon {

MemUsage mem_usage() {
  MemUsage m;
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ss(line);
    std::string key;
    int64_t kb = 0;
    ss >> key >> kb;
    if (key == "RssAnon:") m.rss_anon = kb * 1024;
    else if (key == "RssFile:") m.rss_file = kb * 1024;
    else if (key == "VmHWM:") m.peak_rss = kb * 1024;
  }
  return m;
}

std::string format_mem(const MemUsage& m) {
  return fmt::format("RSS anon {:.0f} MiB, file-backed {:.0f} MiB, peak {:.0f} MiB", double(m.rss_anon) / (1 << 20),
                     double(m.rss_file) / (1 << 20), double(m.peak_rss) / (1 << 20));
}

}  // namespace talon
