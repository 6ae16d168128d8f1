// Run lifecycle: every long-running command holds <run dir>/.talon.lock (flock) and
// records itself there as JSON (pid, host, command, GPUs, start time). It also leaves
// a pointer to its run directory in a per-user registry so `talon gpus` can say which
// run holds which GPU; `talon stop DIR` signals exactly the PID recorded in DIR.
#pragma once
#include <optional>
#include <string>
#include <vector>
#include <nlohmann/json.hpp>

#include "util/file.h"

namespace talon {

// What this process is: pid, host, command line, GPUs, start time, talon version.
nlohmann::json run_record(const std::string& command, const std::vector<int>& gpus);

// Registry of live runs: $TALON_RUNS_DIR, else $XDG_RUNTIME_DIR/talon-runs, else
// /tmp/talon-runs-<uid>. One file per run, named by PID, holding the run directory.
fs::path run_registry_dir();
void register_run(const fs::path& run_dir, const std::string& lock_name = ".talon.lock");
void unregister_run();

// Holds an exclusive lock on <dir>/<name> for the life of the run and records the run
// there (run_record JSON), which `talon gpus` and `talon stop` read; registers the run.
// Fails naming the PID and host of the run that holds it already.
class DirLock {
 public:
  DirLock(const fs::path& dir, const nlohmann::json& record, const std::string& name = ".talon.lock");
  ~DirLock();
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;

 private:
  int fd_ = -1;
};

struct RunInfo {
  fs::path dir;
  nlohmann::json record;  // the lock file's JSON
  bool active = false;    // the lock is held right now
  int pid() const { return record.value("pid", 0); }
};

// Reads a run's lock file (<dir>/.talon.lock, or a rank's .talon.rank-R.lock); nullopt
// when there is none.
std::optional<RunInfo> read_run(const fs::path& dir, const std::string& lock_name = ".talon.lock");
// Every lock file in a run directory.
std::vector<RunInfo> read_runs(const fs::path& dir);
// Every registered run whose lock is still held (stale entries are removed).
std::vector<RunInfo> list_active_runs();

}  // namespace talon
