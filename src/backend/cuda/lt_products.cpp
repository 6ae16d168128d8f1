#include "backend/cuda/lt_products.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <string>
#include <vector>

#include "backend/cuda/check.h"

namespace talon::cuda {

LtProducts::LtProducts(Rule rule, int candidates, size_t kept_plans)
    : rule_(rule), candidates_(candidates < 1 ? 1 : candidates), kept_plans_(kept_plans < 1 ? 1 : kept_plans) {
  CUBLAS_CHECK(cublasLtCreate(&lt_));
  if (rule_ != Rule::Timed) return;
  const size_t bytes = size_t(kMaxTimed) * kCorner * kCorner * 4;
  for (Slot& sl : slots_) {
    CUDA_CHECK(cudaMalloc(&sl.dev, bytes));
    CUDA_CHECK(cudaHostAlloc(&sl.host, bytes, cudaHostAllocDefault));
    CUDA_CHECK(cudaEventCreateWithFlags(&sl.done, cudaEventDisableTiming));
  }
}

LtProducts::~LtProducts() {
  drop_plans();
  for (Slot& sl : slots_) {
    if (sl.done) cudaEventSynchronize(sl.done);
    if (sl.done) cudaEventDestroy(sl.done);
    if (sl.dev) cudaFree(sl.dev);
    if (sl.host) cudaFreeHost(sl.host);
  }
  for (cudaEvent_t e : all_events_) cudaEventDestroy(e);
  if (lt_) cublasLtDestroy(lt_);
}

void LtProducts::drop_plans() {
  for (auto& [k, p] : plans_) {
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.c);
    cublasLtMatmulDescDestroy(p.op);
  }
  plans_.clear();
}

namespace {

// How full the last wave of tiles is (1: every wave full); 0 where cuBLASLt gives no count.
double last_wave_fill(float waves) {
  if (!(waves > 0.f)) return 0.0;
  return double(waves) / std::ceil(double(waves));
}

// The largest power of two (up to 256, cuBLASLt's default assumption) dividing a pointer.
int64_t alignment(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  int64_t a = 256;
  while (a > 1 && v % uintptr_t(a) != 0) a /= 2;
  return a;
}

// A dimension rounded up to 4 steps an octave (exact up to 256): 1382 -> 1536, 2765 -> 3072.
int64_t round_dim(int64_t x) {
  if (x <= 256) return x;
  int64_t p = 1;
  while (p <= x / 2) p *= 2;
  const int64_t step = p / 4;
  return (x + step - 1) / step * step;
}

// cudaEventQuery without a wait: true when done; not ready is not an error (and is cleared).
bool done(cudaEvent_t e) {
  const cudaError_t st = cudaEventQuery(e);
  if (st == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  CUDA_CHECK(st);
  return true;
}

struct Layouts {
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  Layouts(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb,
          cudaDataType_t c_type, int64_t ldc) {
    // Stored shapes: op(A) is m x k, op(B) is k x n.
    const uint64_t ar = uint64_t(ta == CUBLAS_OP_N ? m : k), ac = uint64_t(ta == CUBLAS_OP_N ? k : m);
    const uint64_t br = uint64_t(tb == CUBLAS_OP_N ? k : n), bc = uint64_t(tb == CUBLAS_OP_N ? n : k);
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, ar, ac, lda));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, br, bc, ldb));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&c, c_type, uint64_t(m), uint64_t(n), ldc));
  }
  ~Layouts() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
  }
  Layouts(const Layouts&) = delete;
  Layouts& operator=(const Layouts&) = delete;
  void release() { a = b = c = nullptr; }
};

int split_k(const cublasLtMatmulAlgo_t& a) {
  int v = 1;
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &v, sizeof v, &written) !=
          CUBLAS_STATUS_SUCCESS ||
      written != sizeof v)
    return 1;
  return v;
}

// What identifies a kernel configuration (the opaque algo also carries per-shape state): its
// id, tile, stages, split-K, reduction scheme, swizzle, custom option, cluster and inner shapes.
std::array<uint64_t, 9> signature(const cublasLtMatmulAlgo_t& a) {
  const cublasLtMatmulAlgoConfigAttributes_t attrs[9] = {CUBLASLT_ALGO_CONFIG_ID,
                                                         CUBLASLT_ALGO_CONFIG_TILE_ID,
                                                         CUBLASLT_ALGO_CONFIG_STAGES_ID,
                                                         CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                                         CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
                                                         CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING,
                                                         CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION,
                                                         CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID,
                                                         CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID};
  std::array<uint64_t, 9> sig{};
  for (size_t i = 0; i < 9; ++i) {
    size_t need = 0, written = 0;
    uint64_t v = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&a, attrs[i], nullptr, 0, &need) != CUBLAS_STATUS_SUCCESS || need == 0 ||
        need > sizeof v ||
        cublasLtMatmulAlgoConfigGetAttribute(&a, attrs[i], &v, need, &written) != CUBLAS_STATUS_SUCCESS)
      v = ~uint64_t(0);
    sig[i] = v;
  }
  return sig;
}

}  // namespace

namespace {

// The heuristic's candidates for a product that need no workspace and no split-K, in its order.
std::vector<cublasLtMatmulHeuristicResult_t> usable(cublasLtHandle_t lt, cublasLtMatmulDesc_t op,
                                                    cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                                    cublasLtMatrixLayout_t c, const uint32_t align[3], int count,
                                                    cublasStatus_t& st) {
  cublasLtMatmulPreference_t pref = nullptr;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const size_t no_workspace = 0;
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &no_workspace,
                                                    sizeof no_workspace));
  // The pointers' alignment (cuBLASLt assumes 256 bytes unless told; the trainer's operands
  // start at row offsets inside larger buffers).
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align[0],
                                                    sizeof align[0]));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align[1],
                                                    sizeof align[1]));
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &align[2], sizeof align[2]));
  std::vector<cublasLtMatmulHeuristicResult_t> res(static_cast<size_t>(count));
  int found = 0;
  st = cublasLtMatmulAlgoGetHeuristic(lt, op, a, b, c, c, pref, count, res.data(), &found);
  cublasLtMatmulPreferenceDestroy(pref);
  std::vector<cublasLtMatmulHeuristicResult_t> out;
  for (int i = 0; st == CUBLAS_STATUS_SUCCESS && i < found; ++i) {
    const auto& r = res[size_t(i)];
    if (r.state == CUBLAS_STATUS_SUCCESS && r.workspaceSize == 0 && split_k(r.algo) <= 1) out.push_back(r);
  }
  return out;
}

cublasLtMatmulDesc_t make_op(cublasOperation_t ta, cublasOperation_t tb) {
  cublasLtMatmulDesc_t op = nullptr;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  return op;
}

std::string shape_text(int64_t m, int64_t n, int64_t k) {
  return "m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k);
}

}  // namespace

LtProducts::Plan& LtProducts::plan(const Key& key) {
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;
  if (plans_.size() >= kept_plans_) drop_plans();
  const auto ta = static_cast<cublasOperation_t>(key[0]), tb = static_cast<cublasOperation_t>(key[1]);
  Plan p;
  p.op = make_op(ta, tb);
  Layouts l(ta, tb, key[2], key[3], key[4], key[5], key[6], static_cast<cudaDataType_t>(key[8]), key[7]);
  p.a = l.a, p.b = l.b, p.c = l.c;
  l.release();
  Plan& q = plans_.emplace(key, p).first->second;
  ++planned_;
  if (rule_ != Rule::Timed) first_algo(q, key);  // the timed rule lists the candidates itself
  return q;
}

void LtProducts::first_algo(Plan& p, const Key& key) {
  const uint32_t align[3] = {uint32_t(key[9]), uint32_t(key[10]), uint32_t(key[11])};
  cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
  const auto res = usable(lt_, p.op, p.a, p.b, p.c, align, candidates_, st);
  if (res.empty())
    fail_msg("cuBLASLt: no algorithm without workspace or split-K for the bf16 product " +
             shape_text(key[2], key[3], key[4]) +
             (st == CUBLAS_STATUS_SUCCESS ? std::string() : std::string(": ") + cublasLtGetStatusString(st)));
  size_t pick = 0;
  if (rule_ == Rule::Waves)
    for (size_t i = 1; i < res.size(); ++i)
      // A later candidate wins only by a clearly fuller last wave (0.05: the heuristic's order
      // decides near ties).
      if (last_wave_fill(res[i].wavesCount) > last_wave_fill(res[pick].wavesCount) + 0.05) pick = i;
  if (pick != 0) ++moved_;
  p.algo = res[pick].algo;
}

LtProducts::Family& LtProducts::family(Plan& p, const Key& key, bool reads_c) {
  const auto ta = static_cast<cublasOperation_t>(key[0]), tb = static_cast<cublasOperation_t>(key[1]);
  const int64_t lda = key[5], ldb = key[6], ldc = key[7];
  // The rounded shape, within what the leading dimensions allow.
  int64_t m = std::min(round_dim(key[2]), ldc), n = round_dim(key[3]), k = round_dim(key[4]);
  if (ta == CUBLAS_OP_N) m = std::min(m, lda);
  if (ta != CUBLAS_OP_N) k = std::min(k, lda);
  if (tb == CUBLAS_OP_N) k = std::min(k, ldb);
  if (tb != CUBLAS_OP_N) n = std::min(n, ldb);
  const FamilyKey fk = {key[0], key[1], m, n, k, lda, ldb, ldc, key[8], key[9], key[10], key[11], reads_c ? 1 : 0};
  auto it = families_.find(fk);
  if (it != families_.end()) return it->second;
  Family f;
  const std::vector<cublasLtMatmulAlgo_t>& own = candidates(p, key);
  for (size_t i = 0; i < own.size() && i < size_t(kMaxTimed); ++i) f.sig.push_back(signature(own[i]));
  Family& g = families_.emplace(fk, std::move(f)).first->second;
  if (g.sig.size() <= 1) decide(g, 0);  // nothing to choose (none: every shape runs its own first)
  return g;
}

const std::vector<cublasLtMatmulAlgo_t>& LtProducts::candidates(Plan& p, const Key& key) {
  if (!p.listed) {
    const uint32_t align[3] = {uint32_t(key[9]), uint32_t(key[10]), uint32_t(key[11])};
    cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
    for (const auto& r : usable(lt_, p.op, p.a, p.b, p.c, align, candidates_, st))
      if (p.own.size() < size_t(kMaxTimed)) p.own.push_back(r.algo);
    p.listed = true;
  }
  return p.own;
}

int LtProducts::match(Plan& p, int side, int i) {
  const Family& f = *p.fam[side];
  auto& v = p.match[side];
  if (v.empty()) {
    v.assign(f.sig.size(), -1);
    std::vector<std::array<uint64_t, 9>> mine;
    for (const auto& a : p.own) mine.push_back(signature(a));
    for (size_t j = 0; j < f.sig.size(); ++j)
      for (size_t l = 0; l < mine.size(); ++l)
        if (mine[l] == f.sig[j]) {
          v[j] = int(l);
          break;
        }
  }
  return v[size_t(i)];
}

void LtProducts::decide(Family& f, int chosen) {
  f.state = Family::State::Decided;
  f.chosen = chosen;
  ++decided_;
  if (chosen != 0) ++moved_;
}

void LtProducts::check_corner(Family& f, Plan& p, const Key& key, const void* a, const void* b, float beta,
                              const void* c, cudaStream_t s) {
  int idx = -1;
  for (int pass = 0; pass < 2 && idx < 0; ++pass)
    for (int i = 0; i < kSlots && idx < 0; ++i) {
      // (second pass: a slot whose family has not been called since its check may be done)
      if (pass == 1 && slots_[size_t(i)].owner) poll(*slots_[size_t(i)].owner);
      if (!slots_[size_t(i)].owner) idx = i;
    }
  if (idx < 0) return;  // every slot's check still in flight: a later call checks
  Slot& sl = slots_[size_t(idx)];
  const auto ta = static_cast<cublasOperation_t>(key[0]), tb = static_cast<cublasOperation_t>(key[1]);
  const auto c_type = static_cast<cudaDataType_t>(key[8]);
  f.mc = std::min<int64_t>(key[2], kCorner), f.nc = std::min<int64_t>(key[3], kCorner);
  f.elt = c_type == CUDA_R_32F ? 4 : 2;
  const size_t stride = size_t(kCorner) * kCorner * 4;
  // The corner: the first mc rows of op(A), the first nc columns of op(B), the same k and
  // leading dimensions; into scratch of leading dimension mc.
  Layouts l(ta, tb, f.mc, f.nc, key[4], key[5], key[6], c_type, f.mc);
  const float alpha = 1.f;
  f.ran.assign(f.sig.size(), 0);
  for (size_t i = 0; i < f.sig.size(); ++i) {
    const int j = match(p, int(beta != 0.f), int(i));
    if (j < 0) continue;
    const cublasLtMatmulAlgo_t& algo = p.own[size_t(j)];
    cublasLtMatmulHeuristicResult_t r{};
    if (cublasLtMatmulAlgoCheck(lt_, p.op, l.a, l.b, l.c, l.c, &algo, &r) != CUBLAS_STATUS_SUCCESS ||
        r.state != CUBLAS_STATUS_SUCCESS || r.workspaceSize != 0)
      continue;
    char* out = static_cast<char*>(sl.dev) + i * stride;
    if (beta != 0.f)
      CUDA_CHECK(cudaMemcpy2DAsync(out, size_t(f.mc * f.elt), c, size_t(key[7] * f.elt), size_t(f.mc * f.elt),
                                   size_t(f.nc), cudaMemcpyDeviceToDevice, s));
    CUBLAS_CHECK(cublasLtMatmul(lt_, p.op, &alpha, a, l.a, b, l.b, &beta, out, l.c, out, l.c, &algo, nullptr, 0, s));
    f.ran[i] = 1;
  }
  CUDA_CHECK(cudaMemcpyAsync(sl.host, sl.dev, f.sig.size() * stride, cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaEventRecord(sl.done, s));
  sl.owner = &f;
  f.slot = idx;
  f.state = Family::State::Checking;
}

void LtProducts::poll(Family& f) {
  if (f.state == Family::State::Checking && done(slots_[size_t(f.slot)].done)) {
    Slot& sl = slots_[size_t(f.slot)];
    sl.owner = nullptr;
    f.slot = -1;
    const size_t stride = size_t(kCorner) * kCorner * 4, bytes = size_t(f.mc * f.nc * f.elt);
    const char* h = static_cast<const char*>(sl.host);
    // How many of the first candidate's corner values are finite and not zero.
    int64_t telling = 0;
    for (int64_t i = 0; i < f.mc * f.nc; ++i) {
      float v = 0.f;
      if (f.elt == 4) {
        std::memcpy(&v, h + i * 4, 4);
      } else {
        uint16_t u = 0;
        std::memcpy(&u, h + i * 2, 2);
        const uint32_t w = uint32_t(u) << 16;
        std::memcpy(&v, &w, 4);
      }
      telling += std::isfinite(v) && v != 0.f;
    }
    if (!f.ran[0]) {
      decide(f, 0);
    } else if (telling * 4 < f.mc * f.nc) {  // proves nothing: check again at a later call (8 tries)
      if (++f.checks >= 8)
        decide(f, 0);
      else
        f.state = Family::State::Unchecked;
    } else {
      f.admitted = {0};
      for (size_t i = 1; i < f.sig.size(); ++i)
        if (f.ran[i] && std::memcmp(h + i * stride, h, bytes) == 0) f.admitted.push_back(int(i));
      if (f.admitted.size() == 1) {
        decide(f, 0);
      } else {
        f.state = Family::State::Exploring;
        ++explored_;
        f.ns.assign(f.admitted.size(), {});
        f.calls_of.assign(f.admitted.size(), 0);
        f.out.assign(f.admitted.size(), 0);
      }
    }
  }
  while (!f.pending.empty() && done(f.pending.front().b)) {
    const Family::Pending q = f.pending.front();
    f.pending.pop_front();
    float ms = 0.f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, q.a, q.b));
    spare_events_.push_back(q.a);
    spare_events_.push_back(q.b);
    if (q.keep) f.ns[size_t(q.which)].push_back(double(ms) * 1e6 / q.madds);
  }
  if (f.state != Family::State::Exploring) return;
  // Once every candidate has a timing, those over 8% slower than the best leave; the rest
  // need two, and the fastest by its best timing stays.
  int best = -1;
  double best_ns = 0;
  for (size_t i = 0; i < f.admitted.size(); ++i) {
    if (f.out[i]) continue;
    if (f.ns[i].empty()) return;
    const double t = *std::min_element(f.ns[i].begin(), f.ns[i].end());
    if (best < 0 || t < best_ns) best = int(i), best_ns = t;
  }
  for (size_t i = 0; i < f.admitted.size(); ++i) {
    if (f.out[i] || int(i) == best) continue;
    if (*std::min_element(f.ns[i].begin(), f.ns[i].end()) > 1.08 * best_ns) f.out[i] = 1;
  }
  for (size_t i = 0; i < f.admitted.size(); ++i)
    if (!f.out[i] && f.ns[i].size() < 2) return;
  decide(f, f.admitted[size_t(best)]);
}

std::pair<size_t, size_t> LtProducts::in_progress() const {
  std::pair<size_t, size_t> n{0, 0};
  for (const auto& [k, f] : families_) {
    n.first += f.state == Family::State::Checking;
    n.second += f.state == Family::State::Exploring;
  }
  return n;
}

cudaEvent_t LtProducts::event() {
  if (!spare_events_.empty()) {
    cudaEvent_t e = spare_events_.back();
    spare_events_.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  CUDA_CHECK(cudaEventCreate(&e));
  all_events_.push_back(e);
  return e;
}

void LtProducts::run(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, const void* a,
                     int64_t lda, const void* b, int64_t ldb, float beta, void* c, cudaDataType_t c_type, int64_t ldc,
                     cudaStream_t s) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {  // no terms: C = beta C
    if (beta == 1.f) return;
    if (beta != 0.f) fail_msg("cuBLASLt products: a product over no terms with beta other than 0 or 1");
    const size_t elt = c_type == CUDA_R_32F ? 4 : 2;
    CUDA_CHECK(cudaMemset2DAsync(c, size_t(ldc) * elt, 0, size_t(m) * elt, size_t(n), s));
    return;
  }
  const Key key = {int64_t(ta), int64_t(tb), m, n, k, lda, ldb, ldc, int64_t(c_type), alignment(a), alignment(b),
                   alignment(c)};
  Plan& p = plan(key);
  const float alpha = 1.f;
  auto launch = [&](const cublasLtMatmulAlgo_t& algo) {
    CUBLAS_CHECK(cublasLtMatmul(lt_, p.op, &alpha, a, p.a, b, p.b, &beta, c, p.c, c, p.c, &algo, nullptr, 0, s));
  };
  if (rule_ != Rule::Timed) return launch(p.algo);
  const int side = beta != 0.f ? 1 : 0;
  if (candidates(p, key).empty()) first_algo(p, key);  // (fails, naming the shape)
  if (!p.fam[side]) p.fam[side] = &family(p, key, side == 1);
  Family& f = *p.fam[side];
  poll(f);
  // A shape whose own first candidate is not the family's first runs it, always.
  if (f.sig.empty() || match(p, side, 0) != 0) return launch(p.own[0]);
  if (f.state == Family::State::Unchecked) check_corner(f, p, key, a, b, beta, c, s);
  if (f.state == Family::State::Decided) {
    const int j = match(p, side, f.chosen);
    return launch(p.own[j >= 0 ? size_t(j) : 0]);
  }
  if (f.state != Family::State::Exploring) return launch(p.own[0]);
  // Exploring. A candidate that is not among one shape's own leaves the family.
  const double madds = double(m) * double(n) * double(k);
  auto timed = [&](size_t which, int j) {
    const cudaEvent_t ea = event(), eb = event();
    CUDA_CHECK(cudaEventRecord(ea, s));
    launch(p.own[size_t(j)]);
    CUDA_CHECK(cudaEventRecord(eb, s));
    // (the first launch of each candidate is not kept: it may have loaded its kernel)
    f.pending.push_back({int(which), ea, eb, madds, f.calls_of[which]++ > 0});
  };
  if (side == 0) {
    // C is written, not read: every candidate left runs in this call, one after the other on
    // the real output (they compute the same bits), the first candidate last.
    for (size_t t = f.admitted.size(); t-- > 0;) {
      if (f.out[t]) continue;
      const int j = match(p, side, f.admitted[t]);
      if (j < 0) {
        f.out[t] = 1;
        continue;
      }
      if (f.calls_of[t] == 0) timed(t, j);
      timed(t, j);
    }
    return;
  }
  // C is read: one candidate a call, in turn.
  size_t which = size_t(f.calls++ % int64_t(f.admitted.size()));
  for (size_t t = 0; t < f.admitted.size() && f.out[which]; ++t) which = (which + 1) % f.admitted.size();
  const int j = match(p, side, f.admitted[which]);
  if (j < 0) {
    f.out[which] = 1;
    return launch(p.own[0]);
  }
  timed(which, j);
}

}  // namespace talon::cuda
