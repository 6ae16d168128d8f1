// Column-major products C = op(A) op(B) + beta C (cuBLAS conventions) through cuBLASLt, with
// the algorithm chosen by a rule that keeps each product's bits from run to run:
//   first: cuBLASLt's first heuristic candidate (about what cublasGemmEx picks), once per shape;
//   waves: among the first `candidates` heuristic candidates that need no workspace and no
//          split-K, the one whose last wave of tiles is fullest (cuBLASLt's own wave count),
//          the heuristic's order breaking near ties, once per shape. Products with few output
//          tiles (4096 outputs at ~1400 rows fill 1.33 waves of 128x256 tiles on 132 SMs) are
//          where it can differ from `first`.
//   timed: the fastest of the candidates that compute the same bits as the first one. Shapes
//          are grouped into families: the dimensions rounded up to 4 steps an octave (a row
//          count changes with every batch), with the transposes, leading dimensions, output
//          type, pointer alignments and whether C is read (beta 0 or not). A family's
//          candidates are kernel configurations (algo id, tile, stages, ...: a signature) from
//          the heuristic's list for the first shape met; each shape runs the candidate of its
//          own list that has the signature wanted, and takes part only where its own first
//          candidate has the family's first signature (else it always runs its own first). So
//          what a shape computes does not depend on which shape came first.
//          At a family's first call its candidates compute the
//          output's first (up to) 256 x 256 corner from the real operands, into scratch (C's
//          corner copied in when beta reads it); the results come back without a wait, and
//          only candidates whose corner has the first candidate's exact bits are admitted
//          (a corner of mostly zeros proves nothing: checked again at a later call). The real
//          calls then time the admitted candidates with pairs of events read back without a
//          wait: where C is only written, every candidate runs in the same call, one after the
//          other on the real output; where C is read, one candidate a call, in turn. The first
//          launch of each is left out (it may load its kernel); once each has a timing, those
//          over 8% slower than the best leave; with two timings each, the family keeps the
//          fastest by time per multiply-add. Until then, and for shapes a candidate does not
//          fit, the first candidate runs. So every call computes the first candidate's bits
//          whichever candidate the timings chose, and reruns and resumes keep their bits.
//          (Signatures, not the heuristic's opaque algos of another shape: an algo made for a
//          row count rounded up would not run at most real row counts; the first version, with
//          those, left 15 of 25 families of the 8B draft unserved.)
// Neither fixed rule beats cublasGemmEx's choice in the draft trainer (docs/train.md, "bf16
// operands": the time left is in the weight gradients' tile sizes, which they do not look at).
// Only products with bf16 operands, fp32 accumulation and fp32 or bf16 outputs come here; no
// workspace is used. The timed rule keeps 4 corner checks' scratch (8 MiB on the device, as
// much pinned on the host).
#pragma once
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <deque>
#include <map>
#include <utility>
#include <vector>

namespace talon::cuda {

class LtProducts {
 public:
  enum class Rule { First, Waves, Timed };

  // kept_plans: how many shapes' plans are kept (below).
  explicit LtProducts(Rule rule, int candidates = 8, size_t kept_plans = 4096);
  ~LtProducts();
  LtProducts(const LtProducts&) = delete;
  LtProducts& operator=(const LtProducts&) = delete;

  // As cublasGemmEx with CUBLAS_COMPUTE_32F: A and B bf16, C of c_type (CUDA_R_32F or
  // CUDA_R_16BF), alpha 1, on stream s.
  void run(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, const void* a, int64_t lda,
           const void* b, int64_t ldb, float beta, void* c, cudaDataType_t c_type, int64_t ldc, cudaStream_t s);

  // Shapes planned so far, and how many of them the rule gave another algorithm than the
  // heuristic's first candidate. Training meets a new row count with almost every batch, so
  // the plans kept are capped (kept_plans; all dropped at once when full, remade on demand: the
  // rule picks the same algorithm again).
  // Under the timed rule moved() counts the families whose timings chose another candidate than
  // the first; families() counts the families met, decided() those whose choice is made.
  size_t plans() const { return planned_; }
  size_t moved() const { return moved_; }
  size_t families() const { return families_.size(); }
  size_t decided() const { return decided_; }
  // Families that admitted more than one candidate and so timed them.
  size_t explored() const { return explored_; }
  // Families now checking their corner, and now timing.
  std::pair<size_t, size_t> in_progress() const;

 private:
  // ta, tb, m, n, k, lda, ldb, ldc, C's type, and the alignment in bytes of A, B and C
  using Key = std::array<int64_t, 12>;
  // A family (timed rule): a key with m, n, k rounded up, and whether C is read (beta != 0).
  using FamilyKey = std::array<int64_t, 13>;
  struct Family {
    enum class State { Unchecked, Checking, Exploring, Decided };
    // The candidates' kernel signatures (algo id, tile, stages, ...), from the heuristic's list
    // (no workspace, no split-K) for the first shape met; [0] its first.
    std::vector<std::array<uint64_t, 9>> sig;
    State state = State::Unchecked;
    int slot = -1, checks = 0;            // the corner check in flight
    std::vector<char> ran;                // which candidates computed the corner
    int64_t mc = 0, nc = 0, elt = 0;      // the corner's shape and the output's bytes a value
    std::vector<int> admitted;            // candidates with the first one's bits
    std::vector<std::vector<double>> ns;  // per admitted: ns a multiply-add, the first launch left out
    std::vector<int> calls_of;            // per admitted: launches timed
    std::vector<char> out;                // per admitted: left out (did not fit a shape of the family)
    struct Pending {
      int which;  // index into admitted
      cudaEvent_t a, b;
      double madds;
      bool keep;
    };
    std::deque<Pending> pending;
    int64_t calls = 0;
    int chosen = 0;  // index into sig
  };
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};  // first and waves: the rule's pick
    // timed rule: this shape's own candidates (the heuristic's, no workspace, no split-K), and
    // per family (beta 0, beta read) which of them has each family candidate's signature (-1:
    // none). Where its own first is not the family's first, that first always runs.
    bool listed = false;
    std::vector<cublasLtMatmulAlgo_t> own;
    Family* fam[2] = {nullptr, nullptr};
    std::vector<int> match[2];
  };
  Plan& plan(const Key& key);
  void first_algo(Plan& p, const Key& key);
  Family& family(Plan& p, const Key& key, bool reads_c);
  const std::vector<cublasLtMatmulAlgo_t>& candidates(Plan& p, const Key& key);
  int match(Plan& p, int side, int i);
  void check_corner(Family& f, Plan& p, const Key& key, const void* a, const void* b, float beta,
                    const void* c, cudaStream_t s);
  void decide(Family& f, int chosen);
  void poll(Family& f);
  cudaEvent_t event();

  Rule rule_;
  int candidates_;
  size_t kept_plans_;
  cublasLtHandle_t lt_ = nullptr;
  std::map<Key, Plan> plans_;
  std::map<FamilyKey, Family> families_;
  size_t planned_ = 0, moved_ = 0, decided_ = 0, explored_ = 0;
  void drop_plans();
  // timed rule: corner-check slots (device scratch, pinned host copy, an event each) and spare
  // timing events.
  static constexpr int kSlots = 4, kCorner = 256, kMaxTimed = 8;
  struct Slot {
    void* dev = nullptr;
    void* host = nullptr;
    cudaEvent_t done = nullptr;
    Family* owner = nullptr;  // the family whose check it holds; null when free
  };
  std::array<Slot, kSlots> slots_{};
  std::vector<cudaEvent_t> spare_events_, all_events_;
};

}  // namespace talon::cuda
