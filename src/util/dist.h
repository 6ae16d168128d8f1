// Several processes working as one job: who this process is (rank and world from flags or
// the launcher's environment) and the host collectives that data-parallel training needs
// across processes.
//
// Launchers: SLURM (srun), Open MPI (mpirun), PMI-based MPIs and torchrun set the
// variables resolve_rank() reads. Host collectives go through MPI, loaded at run time
// (libmpi.so.40, Open MPI's ABI) so that single-process builds and runs need no MPI at all;
// GPU jobs launched without MPI exchange their NCCL ids through a file instead
// (exchange_id_file()) and do their collectives over NCCL.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "util/file.h"

namespace talon {

struct RankInfo {
  int rank = 0, world = 1;
  int local_rank = 0, local_world = 1;  // among the processes of this node
  std::string source = "single process";
  bool mpi = false;  // started by an MPI launcher (mpirun / mpiexec): MPI_Init will work
};
// Flags first, then the launchers' environment variables (SLURM_PROCID/SLURM_NTASKS,
// OMPI_COMM_WORLD_RANK/_SIZE, PMI_RANK/PMI_SIZE, RANK/WORLD_SIZE); fails naming a
// malformed one. The local rank comes from SLURM_LOCALID/SLURM_NTASKS_PER_NODE's count,
// OMPI_COMM_WORLD_LOCAL_RANK/_SIZE or LOCAL_RANK/LOCAL_WORLD_SIZE where set.
RankInfo resolve_rank(int flag_rank, int flag_world);

// Collectives among the processes of a job, on host memory, called from one thread per
// process. Every rank calls the same sequence; a rank that fails calls abort() so that the
// others do not wait forever.
class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  int rank() const { return rank_; }
  int world() const { return world_; }
  // Every rank's bytes, in rank order (sizes may differ between ranks).
  virtual std::vector<std::string> allgather(const std::string& mine) = 0;
  // root's bytes to every rank (`data` holds them on root; resized and filled elsewhere).
  virtual void broadcast(std::string& data, int root) = 0;
  virtual void barrier() = 0;
  // Ends the whole job after a failure on this rank (MPI_Abort); does not return.
  [[noreturn]] virtual void abort(int code) = 0;
  virtual std::string kind() const = 0;

  // True on every rank when it is true on any.
  bool any(bool mine);
  // Fails on every rank unless every rank passed the same bytes; `what` names them.
  void check_same(const std::string& mine, const std::string& what);

 protected:
  ProcessGroup(int rank, int world) : rank_(rank), world_(world) {}
  int rank_, world_;
};

// A group of one: every collective is local.
std::unique_ptr<ProcessGroup> single_process_group();
// The job's MPI group (MPI_COMM_WORLD), initialising MPI on first use. Fails clearly when
// libmpi cannot be loaded or is not Open MPI, or when MPI's rank/size disagree with `ri`.
std::unique_ptr<ProcessGroup> mpi_process_group(const RankInfo& ri);

// A file-based exchange of one small blob (an NCCL unique id) through a shared directory,
// for jobs started without MPI: rank 0 writes <dir>/.talon-id.<tag> atomically, the others
// wait for it (up to timeout_s). Rank 0 removes it with remove_id_file() once every rank
// has used it. The tag names the job instance (SLURM_JOB_ID, TORCHELASTIC_RUN_ID or
// MASTER_PORT) so a stale file of an earlier job is never read.
std::string exchange_id_file(const fs::path& dir, const std::string& name, const RankInfo& ri,
                             const std::string& mine_if_root, double timeout_s = 600);
void remove_id_file(const fs::path& dir, const std::string& name);

// Serialisation helpers for the collectives' byte strings.
template <class T>
void put_pod(std::string& s, const T& v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof v);
}
template <class T>
void put_pods(std::string& s, const std::vector<T>& v) {
  put_pod(s, uint64_t(v.size()));
  s.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}
// Reads back what put_pod/put_pods wrote; fails (naming `what`) on a short buffer.
class PodReader {
 public:
  PodReader(const std::string& s, std::string what) : s_(s), what_(std::move(what)) {}
  template <class T>
  T get() {
    T v;
    need(sizeof v);
    std::memcpy(&v, s_.data() + at_, sizeof v);
    at_ += sizeof v;
    return v;
  }
  template <class T>
  std::vector<T> get_vec() {
    const uint64_t n = get<uint64_t>();
    need(size_t(n) * sizeof(T));
    std::vector<T> v(static_cast<size_t>(n));
    std::memcpy(v.data(), s_.data() + at_, size_t(n) * sizeof(T));
    at_ += size_t(n) * sizeof(T);
    return v;
  }
  size_t pos() const { return at_; }
  bool done() const { return at_ == s_.size(); }

 private:
  void need(size_t n);
  const std::string& s_;
  std::string what_;
  size_t at_ = 0;
};

}  // namespace talon
