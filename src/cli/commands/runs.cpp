#include "cli/commands/runs.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <map>
#include <sstream>
#include <cstring>
#include <thread>

#include "backend/backend.h"
#include "model/model.h"
#include "util/error.h"
#include "util/log.h"
#include "util/runs.h"

namespace talon {

namespace {

struct SmiGpu {
  int index;
  std::string name;
  int64_t used_mib, total_mib;
  std::string uuid;
};

// Output lines of a command, or nullopt when it cannot run.
std::optional<std::vector<std::string>> run_lines(const std::string& cmd) {
  FILE* f = ::popen((cmd + " 2>/dev/null").c_str(), "r");
  if (!f) return std::nullopt;
  std::vector<std::string> lines;
  char buf[4096];
  std::string cur;
  while (fgets(buf, sizeof buf, f)) {
    cur += buf;
    if (!cur.empty() && cur.back() == '\n') {
      cur.pop_back();
      lines.push_back(cur);
      cur.clear();
    }
  }
  if (!cur.empty()) lines.push_back(cur);
  if (::pclose(f) != 0) return std::nullopt;
  return lines;
}

std::vector<std::string> split_csv(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string x;
  while (std::getline(ss, x, ',')) {
    const size_t a = x.find_first_not_of(' '), b = x.find_last_not_of(' ');
    out.push_back(a == std::string::npos ? "" : x.substr(a, b - a + 1));
  }
  return out;
}

int64_t to_i64(const std::string& s) {
  try {
    return std::stoll(s);
  } catch (...) {
    return -1;
  }
}

}  // namespace

int run_gpus() {
  const auto runs = list_active_runs();
  std::map<int, const RunInfo*> by_pid;
  for (auto& r : runs) by_pid[r.pid()] = &r;
  auto describe = [](const RunInfo& r) {
    return fmt::format("talon {} (pid {}, {})", r.record.value("command", "?"), r.pid(), r.dir.string());
  };

  // nvidia-smi sees every process's memory without creating a CUDA context.
  auto gpus = run_lines("nvidia-smi --query-gpu=index,name,memory.used,memory.total,uuid --format=csv,noheader,nounits");
  if (gpus) {
    std::map<std::string, std::vector<std::pair<int, int64_t>>> procs;  // uuid -> (pid, MiB)
    if (auto apps = run_lines("nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory --format=csv,noheader,nounits"))
      for (auto& l : *apps) {
        auto f = split_csv(l);
        if (f.size() >= 3) procs[f[0]].push_back({int(to_i64(f[1])), to_i64(f[2])});
      }
    for (auto& l : *gpus) {
      auto f = split_csv(l);
      if (f.size() < 5) continue;
      std::cout << fmt::format("cuda:{}  {}  {} / {} MiB used\n", f[0], f[1], f[2], f[3]);
      for (auto& [pid, mib] : procs[f[4]]) {
        auto it = by_pid.find(pid);
        std::cout << fmt::format("    pid {:>8}  {:>7} MiB  {}\n", pid, mib,
                                 it != by_pid.end() ? describe(*it->second) : "(not a registered talon run)");
      }
    }
  } else {
    const auto list = list_gpus();
    if (list.empty()) std::cout << "no CUDA devices visible (nvidia-smi not found and the CUDA runtime sees none)\n";
    for (auto& g : list)
      std::cout << fmt::format("cuda:{}  {}  {} / {} MiB used\n", g.index, g.name,
                               (g.total_bytes - g.free_bytes) >> 20, g.total_bytes >> 20);
  }
  std::cout << fmt::format("talon runs ({} active, registry {}):\n", runs.size(), run_registry_dir().string());
  for (auto& r : runs) {
    std::string gl;
    for (auto& g : r.record.value("gpus", nlohmann::json::array())) {
      if (!gl.empty()) gl += ',';
      gl += g.dump();
    }
    std::cout << fmt::format("  {}  gpus [{}]  since {}\n", describe(r), gl, r.record.value("started", "?"));
  }
  return 0;
}

int run_stop(const fs::path& dir, double wait_seconds) {
  if (!fs::is_directory(dir)) fail("{}: not a directory", dir.string());
  const auto runs = read_runs(dir);
  if (runs.empty()) fail("{}: no .talon*.lock here; not a talon run directory", dir.string());
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  std::vector<RunInfo> targets;
  for (auto& r : runs) {
    if (!r.active) continue;
    if (r.record.value("host", "") != host) {
      std::cout << fmt::format("pid {} runs on host {}; run `talon stop` there\n", r.pid(), r.record.value("host", "?"));
      continue;
    }
    targets.push_back(r);
  }
  if (targets.empty()) {
    std::cout << fmt::format("{}: no run is active on this host (last: pid {})\n", dir.string(), runs[0].pid());
    return 0;
  }
  for (auto& r : targets) {
    const int pid = r.pid();
    if (pid <= 1) fail("{}: no valid pid recorded", (dir / ".talon.lock").string());
    if (::kill(pid, SIGTERM) != 0) fail("cannot signal pid {}: {}", pid, std::strerror(errno));
    std::cout << fmt::format("sent SIGTERM to pid {} ({}); waiting for it to drain\n", pid,
                             r.record.value("cmdline", ""));
  }
  const auto t0 = std::chrono::steady_clock::now();
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < wait_seconds) {
    bool any = false;
    for (auto& r : read_runs(dir)) any |= r.active && r.record.value("host", "") == host;
    if (!any) {
      std::cout << "stopped; rerun the same command to resume\n";
      return 0;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::cout << fmt::format("still running after {:.0f}s\n", wait_seconds);
  return 1;
}

}  // namespace talon
