#include "util/dist.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <thread>

#include "util/error.h"
#include "util/log.h"

namespace talon {

namespace {

// A non-negative integer of at most 7 digits, or nullopt.
std::optional<int> whole_number(const std::string& t) {
  if (t.empty() || t.size() >= 8 || t.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  return std::stoi(t);
}

int env_int(const char* var, const char* v) {
  const std::optional<int> n = whole_number(v);
  TALON_CHECK(n.has_value(), "environment variable {}='{}' is not a non-negative integer", var, v);
  return *n;
}

// The local rank and the number of processes on this node, where the launcher says.
void resolve_local(RankInfo& r) {
  static const char* kVars[][2] = {{"OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
                                   {"LOCAL_RANK", "LOCAL_WORLD_SIZE"},
                                   {"MPI_LOCALRANKID", "MPI_LOCALNRANKS"}};
  for (auto& pr : kVars) {
    const char *rv = std::getenv(pr[0]), *wv = std::getenv(pr[1]);
    if (!rv || !wv) continue;
    r.local_rank = env_int(pr[0], rv);
    r.local_world = env_int(pr[1], wv);
    TALON_CHECK(r.local_world >= 1 && r.local_rank < r.local_world, "{}={} is outside {}={}", pr[0], r.local_rank,
                pr[1], r.local_world);
    return;
  }
  // SLURM: SLURM_LOCALID, and this node's task count (SLURM_TASKS_PER_NODE is "4(x2),3"-like;
  // SLURM_NTASKS_PER_NODE is set only when asked for, so count from SLURM_STEP_TASKS_PER_NODE
  // when it is a plain number).
  if (const char* lid = std::getenv("SLURM_LOCALID")) {
    r.local_rank = env_int("SLURM_LOCALID", lid);
    r.local_world = r.local_rank + 1;
    for (const char* v : {"SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE"}) {
      const char* s = std::getenv(v);
      if (const std::optional<int> n = s ? whole_number(s) : std::nullopt) {
        r.local_world = std::max(r.local_world, *n);
        break;
      }
    }
  }
}

}  // namespace

RankInfo resolve_rank(int flag_rank, int flag_world) {
  RankInfo r;
  auto check = [](RankInfo x, const std::string& what) {
    TALON_CHECK(x.world >= 1 && x.rank >= 0 && x.rank < x.world,
                "{}: rank {} is outside a world of {} (need 0 <= rank < world)", what, x.rank, x.world);
    x.source = what;
    resolve_local(x);
    return x;
  };
  if (flag_rank >= 0 || flag_world >= 0) {
    TALON_CHECK(flag_rank >= 0 && flag_world >= 1, "--rank and --world go together (got --rank {} --world {})",
                flag_rank, flag_world);
    RankInfo x;
    x.rank = flag_rank;
    x.world = flag_world;
    return check(x, "--rank/--world");
  }
  static const char* kVars[][2] = {{"SLURM_PROCID", "SLURM_NTASKS"},
                                   {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
                                   {"PMI_RANK", "PMI_SIZE"},
                                   {"RANK", "WORLD_SIZE"}};
  for (auto& pr : kVars) {
    const char *rv = std::getenv(pr[0]), *wv = std::getenv(pr[1]);
    if (!rv || !wv) continue;
    RankInfo x;
    x.rank = env_int(pr[0], rv);
    x.world = env_int(pr[1], wv);
    // An MPI launcher's processes can call MPI_Init; srun's can when SLURM was built with
    // PMI/PMIx support for the MPI in use, which an Open MPI process finds by itself.
    x.mpi = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMIX_RANK") != nullptr ||
            std::getenv("PMI_SIZE") != nullptr;
    return check(x, fmt::format("{}/{}", pr[0], pr[1]));
  }
  return r;
}

bool ProcessGroup::any(bool mine) {
  if (world_ == 1) return mine;
  for (const std::string& s : allgather(std::string(1, mine ? '\1' : '\0')))
    if (!s.empty() && s[0]) return true;
  return false;
}

void ProcessGroup::check_same(const std::string& mine, const std::string& what) {
  if (world_ == 1) return;
  const auto all = allgather(mine);
  for (int r = 1; r < world_; ++r)
    TALON_CHECK(all[size_t(r)] == all[0], "{}: rank {} and rank 0 disagree ({} bytes vs {})", what, r,
                all[size_t(r)].size(), all[0].size());
}

void PodReader::need(size_t n) {
  TALON_CHECK(at_ + n <= s_.size(), "{}: {} bytes needed at offset {} of {}", what_, n, at_, s_.size());
}

// ------------------------------------------------------------------ one process

namespace {

class SingleGroup final : public ProcessGroup {
 public:
  SingleGroup() : ProcessGroup(0, 1) {}
  std::vector<std::string> allgather(const std::string& mine) override { return {mine}; }
  void broadcast(std::string&, int) override {}
  void barrier() override {}
  [[noreturn]] void abort(int code) override { std::_Exit(code); }
  std::string kind() const override { return "single process"; }
};

// ------------------------------------------------------------------ MPI (Open MPI ABI)

// Open MPI's handles are addresses of its predefined objects; the few entry points used
// take them as pointers.
using Handle = void*;
struct Mpi {
  int (*initialized)(int*) = nullptr;
  int (*finalized)(int*) = nullptr;
  int (*init_thread)(int*, char***, int, int*) = nullptr;
  int (*finalize)() = nullptr;
  int (*comm_rank)(Handle, int*) = nullptr;
  int (*comm_size)(Handle, int*) = nullptr;
  int (*allgather)(const void*, int, Handle, void*, int, Handle, Handle) = nullptr;
  int (*bcast)(void*, int, Handle, int, Handle) = nullptr;
  int (*barrier)(Handle) = nullptr;
  int (*abort)(Handle, int) = nullptr;
  int (*error_string)(int, char*, int*) = nullptr;
  Handle comm_world = nullptr, byte = nullptr;

  static const Mpi& get() {
    static const Mpi m = [] {
      Mpi x;
      void* h = nullptr;
      std::string errs;
      for (const char* name : {"libmpi.so.40", "libmpi.so"}) {
        if ((h = dlopen(name, RTLD_NOW | RTLD_GLOBAL))) break;
        errs += fmt::format("{}{}", errs.empty() ? "" : "; ", dlerror());
      }
      if (!h)
        fail("this job has several processes and needs MPI for its collectives, but libmpi.so.40 (Open MPI) "
             "could not be loaded ({}); install Open MPI (Debian: openmpi-bin) or add its lib directory to "
             "LD_LIBRARY_PATH",
             errs);
      auto sym = [&](const char* s) {
        void* p = dlsym(h, s);
        if (!p)
          fail("the loaded libmpi has no symbol {}: Talon speaks Open MPI's ABI (libmpi.so.40); another MPI is "
               "not supported",
               s);
        return p;
      };
      x.initialized = reinterpret_cast<decltype(x.initialized)>(sym("MPI_Initialized"));
      x.finalized = reinterpret_cast<decltype(x.finalized)>(sym("MPI_Finalized"));
      x.init_thread = reinterpret_cast<decltype(x.init_thread)>(sym("MPI_Init_thread"));
      x.finalize = reinterpret_cast<decltype(x.finalize)>(sym("MPI_Finalize"));
      x.comm_rank = reinterpret_cast<decltype(x.comm_rank)>(sym("MPI_Comm_rank"));
      x.comm_size = reinterpret_cast<decltype(x.comm_size)>(sym("MPI_Comm_size"));
      x.allgather = reinterpret_cast<decltype(x.allgather)>(sym("MPI_Allgather"));
      x.bcast = reinterpret_cast<decltype(x.bcast)>(sym("MPI_Bcast"));
      x.barrier = reinterpret_cast<decltype(x.barrier)>(sym("MPI_Barrier"));
      x.abort = reinterpret_cast<decltype(x.abort)>(sym("MPI_Abort"));
      x.error_string = reinterpret_cast<decltype(x.error_string)>(sym("MPI_Error_string"));
      x.comm_world = sym("ompi_mpi_comm_world");
      x.byte = sym("ompi_mpi_byte");
      return x;
    }();
    return m;
  }
  void check(int rc, const char* what) const {
    if (rc == 0) return;
    char buf[512];
    int n = 0;
    std::string msg = error_string && error_string(rc, buf, &n) == 0 ? std::string(buf, size_t(std::max(n, 0)))
                                                                      : fmt::format("code {}", rc);
    fail("MPI {} failed: {}", what, msg);
  }
};

constexpr int kMpiThreadFunneled = 1;
// Messages go in pieces of at most this many bytes (MPI counts are int).
constexpr size_t kMpiChunk = size_t(1) << 30;

class MpiGroup final : public ProcessGroup {
 public:
  explicit MpiGroup(const RankInfo& ri) : ProcessGroup(ri.rank, ri.world), m_(Mpi::get()) {
    int init = 0;
    m_.check(m_.initialized(&init), "MPI_Initialized");
    if (!init) {
      int provided = 0;
      m_.check(m_.init_thread(nullptr, nullptr, kMpiThreadFunneled, &provided), "MPI_Init_thread");
      owns_ = true;
    }
    int r = 0, w = 0;
    m_.check(m_.comm_rank(m_.comm_world, &r), "MPI_Comm_rank");
    m_.check(m_.comm_size(m_.comm_world, &w), "MPI_Comm_size");
    TALON_CHECK(r == ri.rank && w == ri.world,
                "MPI says rank {} of {}, but {} says rank {} of {}: start one talon process per rank with the same "
                "launcher",
                r, w, ri.source, ri.rank, ri.world);
  }
  ~MpiGroup() override {
    int fin = 0;
    if (owns_ && m_.finalized(&fin) == 0 && !fin) m_.finalize();
  }

  std::vector<std::string> allgather(const std::string& mine) override {
    std::vector<uint64_t> sizes(static_cast<size_t>(world_));
    const uint64_t n = mine.size();
    m_.check(m_.allgather(&n, 8, m_.byte, sizes.data(), 8, m_.byte, m_.comm_world), "MPI_Allgather");
    std::vector<std::string> all(static_cast<size_t>(world_));
    for (int r = 0; r < world_; ++r) {
      if (r == rank_) all[size_t(r)] = mine;
      else all[size_t(r)].resize(size_t(sizes[size_t(r)]));
      bcast_bytes(all[size_t(r)].data(), all[size_t(r)].size(), r);
    }
    return all;
  }
  void broadcast(std::string& data, int root) override {
    uint64_t n = data.size();
    m_.check(m_.bcast(&n, 8, m_.byte, root, m_.comm_world), "MPI_Bcast");
    if (rank_ != root) data.resize(size_t(n));
    bcast_bytes(data.data(), data.size(), root);
  }
  void barrier() override { m_.check(m_.barrier(m_.comm_world), "MPI_Barrier"); }
  [[noreturn]] void abort(int code) override {
    spdlog::default_logger()->flush();
    m_.abort(m_.comm_world, code);
    std::_Exit(code);
  }
  std::string kind() const override { return "MPI"; }

 private:
  void bcast_bytes(char* p, size_t n, int root) {
    for (size_t at = 0; at < n; at += kMpiChunk)
      m_.check(m_.bcast(p + at, int(std::min(kMpiChunk, n - at)), m_.byte, root, m_.comm_world), "MPI_Bcast");
  }
  const Mpi& m_;
  bool owns_ = false;
};

}  // namespace

std::unique_ptr<ProcessGroup> single_process_group() { return std::make_unique<SingleGroup>(); }

std::unique_ptr<ProcessGroup> mpi_process_group(const RankInfo& ri) { return std::make_unique<MpiGroup>(ri); }

// ------------------------------------------------------------------ id file

namespace {

// What tells this launch from an earlier one: the SLURM job and step, or torchrun's run id,
// restart count and port.
std::string job_tag() {
  std::string t;
  for (const char* v : {"SLURM_JOB_ID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                        "MASTER_PORT"})
    if (const char* s = std::getenv(v); s && *s) {
      if (!t.empty()) t += '.';
      t += s;
    }
  if (t.empty()) t = "job";
  for (char& ch : t)
    if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '-' && ch != '_' && ch != '.') ch = '_';
  return t.substr(0, 120);
}

fs::path id_file(const fs::path& dir, const std::string& name) {
  return dir / fmt::format(".talon-id.{}.{}", name, job_tag());
}

}  // namespace

std::string exchange_id_file(const fs::path& dir, const std::string& name, const RankInfo& ri,
                             const std::string& mine_if_root, double timeout_s) {
  const fs::path p = id_file(dir, name);
  if (ri.rank == 0) {
    write_file_atomic(p, mine_if_root);
    return mine_if_root;
  }
  const auto t0 = std::chrono::steady_clock::now();
  // A file left by a crashed earlier launch with the same tag is older than this one's
  // start: only a file written within the last 10 minutes counts.
  const auto fresh_after = fs::file_time_type::clock::now() - std::chrono::minutes(10);
  for (;;) {
    std::error_code ec;
    if (fs::exists(p, ec) && fs::last_write_time(p, ec) >= fresh_after && !ec) {
      std::string s = read_text_file(p);
      if (s.size() == mine_if_root.size()) return s;
    }
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > timeout_s)
      fail("rank {}: rank 0 did not write {} within {} s (is --out on a file system every node shares?)", ri.rank,
           p.string(), timeout_s);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

void remove_id_file(const fs::path& dir, const std::string& name) {
  std::error_code ec;
  fs::remove(id_file(dir, name), ec);
}

}  // namespace talon
