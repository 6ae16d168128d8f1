#include "util/runs.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <chrono>
#include <ctime>
#include <fstream>

#include "util/error.h"
#include "util/log.h"

namespace talon {

using json = nlohmann::json;

namespace {
fs::path g_registered;
}

json run_record(const std::string& command, const std::vector<int>& gpus) {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  std::string cmdline;
  {
    std::ifstream f("/proc/self/cmdline", std::ios::binary);
    std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    for (char& c : all)
      if (c == '\0') c = ' ';
    while (!all.empty() && all.back() == ' ') all.pop_back();
    cmdline = all;
  }
  const std::time_t now = std::time(nullptr);
  char ts[32] = {};
  std::strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return json{{"pid", int(getpid())}, {"host", host},     {"command", command}, {"cmdline", cmdline},
              {"gpus", gpus},         {"started", ts},     {"talon_version", TALON_VERSION}};
}

fs::path run_registry_dir() {
  if (const char* d = std::getenv("TALON_RUNS_DIR"); d && *d) return d;
  if (const char* d = std::getenv("XDG_RUNTIME_DIR"); d && *d) return fs::path(d) / "talon-runs";
  return fs::path("/tmp") / ("talon-runs-" + std::to_string(getuid()));
}

void register_run(const fs::path& run_dir, const std::string& lock_name) {
  try {
    const fs::path reg = run_registry_dir();
    fs::create_directories(reg);
    const fs::path p = reg / (std::to_string(getpid()) + ".json");
    write_file_atomic(p, json{{"dir", fs::absolute(run_dir).string()}, {"lock", lock_name}}.dump() + "\n");
    g_registered = p;
  } catch (const std::exception& e) {
    // Not fatal: the run works without it; only `talon gpus` loses track of it.
    tlog::warn("cannot register the run for `talon gpus`: {}", e.what());
  }
}

void unregister_run() {
  if (g_registered.empty()) return;
  std::error_code ec;
  fs::remove(g_registered, ec);
  g_registered.clear();
}

std::optional<RunInfo> read_run(const fs::path& dir, const std::string& lock_name) {
  const fs::path p = dir / lock_name;
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  RunInfo r;
  r.dir = dir;
  std::string buf(65536, '\0');
  const ssize_t n = ::pread(fd, buf.data(), buf.size(), 0);
  buf.resize(n > 0 ? size_t(n) : 0);
  r.record = json::parse(buf, nullptr, false);
  if (!r.record.is_object()) r.record = json::object();
  // A shared lock succeeds only when no run holds the exclusive one.
  if (::flock(fd, LOCK_SH | LOCK_NB) == 0) {
    ::flock(fd, LOCK_UN);
    r.active = false;
  } else {
    r.active = true;
  }
  ::close(fd);
  return r;
}

std::vector<RunInfo> read_runs(const fs::path& dir) {
  std::vector<RunInfo> out;
  std::error_code ec;
  for (auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(".talon", 0) == 0 && e.path().extension() == ".lock")
      if (auto r = read_run(dir, n)) out.push_back(*r);
  }
  return out;
}

std::vector<RunInfo> list_active_runs() {
  std::vector<RunInfo> out;
  const fs::path reg = run_registry_dir();
  std::error_code ec;
  if (!fs::is_directory(reg, ec)) return out;
  for (auto& e : fs::directory_iterator(reg, ec)) {
    if (e.path().extension() != ".json") continue;
    json j = json::parse(read_text_file(e.path()), nullptr, false);
    std::optional<RunInfo> r;
    if (j.is_object() && j.contains("dir") && j["dir"].is_string())
      r = read_run(j["dir"].get<std::string>(), j.value("lock", std::string(".talon.lock")));
    const std::string stem = e.path().stem().string();
    if (r && r->active && std::to_string(r->pid()) == stem) {
      out.push_back(*r);
    } else {
      fs::remove(e.path(), ec);  // the run ended without unregistering (killed)
    }
  }
  return out;
}


DirLock::DirLock(const fs::path& dir, const nlohmann::json& record, const std::string& name) {
  const fs::path p = dir / name;
  fd_ = ::open(p.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("{}: cannot create lock file", p.string());
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    std::string buf(4096, '\0');
    ssize_t n = ::pread(fd_, buf.data(), buf.size(), 0);
    ::close(fd_);
    buf.resize(n > 0 ? size_t(n) : 0);
    nlohmann::json j = nlohmann::json::parse(buf, nullptr, false);
    const std::string who = j.is_object() ? fmt::format("pid {} on {}", j.value("pid", 0), j.value("host", "?")) : buf;
    fail("{}: another talon run ({}) is writing this directory; stop it with `talon stop {}`", dir.string(), who,
         dir.string());
  }
  const std::string text = record.dump() + "\n";
  if (::ftruncate(fd_, 0) == 0) {
    ssize_t w = ::pwrite(fd_, text.data(), text.size(), 0);
    (void)w;
  }
  register_run(dir, name);
}

DirLock::~DirLock() {
  unregister_run();
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace talon
