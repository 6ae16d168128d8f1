// Causal packed-sample attention through cuDNN's fused SDPA (see cudnn_sdpa.h).
#include "backend/cuda/cudnn_sdpa.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <climits>
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include "backend/cuda/check.h"
#include "util/log.h"

#ifdef TALON_HAVE_CUDNN_FE
#include <dlfcn.h>

#include <cudnn_frontend.h>

// The frontend reaches cuDNN through this handle (NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING): Talon
// opens libcudnn itself, so a machine without cuDNN still runs everything else.
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}
#endif

namespace talon::cuda {

PrefillAttention prefill_attention() {
  static const PrefillAttention on = [] {
    const char* e = std::getenv("TALON_ATTENTION");
    const std::string v = e ? e : "";
    return v == "cudnn" ? PrefillAttention::Cudnn : v == "auto" ? PrefillAttention::Auto : PrefillAttention::Kernels;
  }();
  return on;
}

namespace {
// Under `auto`, a failure inside cuDNN: said, and the kernels serve the rest of the run.
void give_up_cudnn(std::unique_ptr<CudnnSdpa>& sdpa, bool& off, const std::exception& e, int device) {
  tlog::warn("cuda:{}: TALON_ATTENTION=auto: cuDNN failed ({}); Talon's kernels serve the rest of the run", device,
             e.what());
  sdpa.reset();
  off = true;
}
}  // namespace

void prefill_make(std::unique_ptr<CudnnSdpa>& sdpa, bool& off, const SdpaShape& shape, const std::string& refused,
                  cudaStream_t s, int device) {
  if (!prefill_attention_cudnn() || off || (sdpa && sdpa->rows() >= shape.max_rows)) return;
  const std::string why = refused.empty() ? cudnn_sdpa_unsupported(shape) : refused;
  sdpa.reset();
  if (!why.empty()) {
    off = true;
    tlog::info("cuda:{}: TALON_ATTENTION={}: cuDNN does not serve this model's attention ({}); Talon's kernels do",
               device, prefill_attention() == PrefillAttention::Auto ? "auto" : "cudnn", why);
    return;
  }
  try {
    sdpa = std::make_unique<CudnnSdpa>(shape, s);
  } catch (const std::exception& e) {
    if (prefill_attention() != PrefillAttention::Auto) throw;
    give_up_cudnn(sdpa, off, e, device);
  }
}

void prefill_set_batch(std::unique_ptr<CudnnSdpa>& sdpa, bool& off, const std::vector<int64_t>& seq_start,
                       const int64_t* seq_start_d, int device) {
  if (!sdpa) return;
  try {
    sdpa->set_batch(seq_start, seq_start_d);
  } catch (const std::exception& e) {
    if (prefill_attention() != PrefillAttention::Auto) throw;
    give_up_cudnn(sdpa, off, e, device);
  }
}

#ifdef TALON_HAVE_CUDNN_FE
namespace fe = cudnn_frontend;

namespace {

struct Loaded {
  bool ok = false;
  std::string why;
  int64_t version = 0;
};

// Opens libcudnn once: TALON_CUDNN_LIB (a path or name) if set, else libcudnn.so.9 from the
// loader's path (on the GPU machines, PyTorch's nvidia-cudnn wheel: build/env.sh adds it).
const Loaded& load_cudnn() {
  static Loaded L;
  static std::once_flag once;
  std::call_once(once, [] {
    const char* env = std::getenv("TALON_CUDNN_LIB");
    const std::string name = env && *env ? env : "libcudnn.so.9";
    void* h = dlopen(name.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (!h) {
      const char* e = dlerror();
      L.why = fmt::format("could not load {} ({}); put cuDNN 9's library directory on LD_LIBRARY_PATH or name "
                          "the library in TALON_CUDNN_LIB",
                          name, e ? e : "unknown error");
      return;
    }
    fe::cudnn_dlhandle = h;
    try {
      L.version = int64_t(fe::detail::get_backend_version());
    } catch (const std::exception& e) {
      L.why = fmt::format("{} loaded but cudnnGetVersion failed: {}", name, e.what());
      return;
    }
    if (L.version < 90500) {
      L.why = fmt::format("{} is cuDNN {}; the fused attention here needs 9.5 or newer", name, L.version);
      return;
    }
    L.ok = true;
    tlog::debug("cuDNN {} loaded from {}", L.version, name);
  });
  return L;
}

void check_fe(fe::error_object e, const char* what) {
  if (e.is_good()) return;
  fail_msg(fmt::format("cuDNN fused attention: {} failed: {}", what, e.get_message()));
}

// Tensor uids of the variant packs.
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV,
  kOffQ, kOffK, kOffV, kOffO, kOffStats, kSeqQ, kSeqKV,
};
constexpr int kOffsets = 5;  // Q (dQ), K (dK), V (dV), O (dO), Stats

// The layout of one operand: row stride and head stride in elements, heads, head size.
struct Layout {
  int64_t ld, hs, heads, d;
};

// The shape with its defaults filled in (see SdpaShape).
SdpaShape resolved(SdpaShape sh) {
  if (sh.hd_v == 0) sh.hd_v = sh.hd;
  if (sh.ld_q == 0) sh.ld_q = int64_t(sh.nh) * sh.hd;
  if (sh.ld_k == 0) sh.ld_k = int64_t(sh.nkv) * sh.hd;
  if (sh.hs_v == 0) sh.hs_v = sh.hd_v;
  if (sh.ld_v == 0) sh.ld_v = int64_t(sh.nkv) * sh.hs_v;
  if (sh.ld_o == 0) sh.ld_o = int64_t(sh.nh) * sh.hd_v;
  return sh;
}

int64_t pow2_at_least(int64_t x, int64_t lo) { return std::max<int64_t>(lo, int64_t(std::bit_ceil(uint64_t(std::max<int64_t>(x, 1))))); }

}  // namespace

bool cudnn_sdpa_built() { return true; }



bool cudnn_sdpa_available(std::string* why) {
  const Loaded& L = load_cudnn();
  if (!L.ok && why) *why = L.why;
  return L.ok;
}

int64_t cudnn_version() { return load_cudnn().ok ? load_cudnn().version : 0; }

// Free device memory as the driver reports it (what cuDNN's handle and plans take shows there,
// not in any buffer of ours).
static int64_t device_free_bytes() {
  size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) return 0;
  return int64_t(free);
}

struct CudnnSdpa::Impl {
  SdpaShape sh;
  cudaStream_t s = nullptr;
  cudnnHandle_t handle = nullptr;
  // One forward and one backward graph per (bucketed samples, bucketed longest sample).
  // The backward over `groups` head groups (set_backward_limit), one execution each.
  struct Plans {
    std::shared_ptr<fe::graph::Graph> fwd, bwd;
    int64_t ws_fwd = 0, ws_bwd = 0;
    int groups = 1;
  };
  int64_t bwd_limit = 0;  // set_backward_limit (0: one backward over every head)
  std::map<std::pair<int64_t, int64_t>, Plans> plans;
  Plans* cur = nullptr;
  int64_t nb_pad = 0;
  // Device: offsets [kOffsets][off_cap + 1] and lengths [off_cap].
  int32_t *off = nullptr, *len = nullptr;
  int64_t off_cap = 0;
  void* ws = nullptr;  // owned
  int64_t ws_cap = 0;
  void* ws_ext = nullptr;  // the caller's (set_workspace), used where the plans' need fits
  int64_t ext_cap = 0;
  void* ws_use = nullptr;  // what the current plans execute with

  // The layouts of one of G head groups (the same strides, a G-th of the heads).
  Layout lq(int G = 1) const { return {sh.ld_q, sh.hd, sh.nh / G, sh.hd}; }
  Layout lk(int G = 1) const { return {sh.ld_k, sh.hd, sh.nkv / G, sh.hd}; }
  Layout lv(int G = 1) const { return {sh.ld_v, sh.hs_v, sh.nkv / G, sh.hd_v}; }
  Layout lo(int G = 1) const { return {sh.ld_o, sh.hd_v, sh.nh / G, sh.hd_v}; }
  // A ragged [B, H, S, D] view of rows `l.ld` apart, heads `l.hs` apart.
  static fe::graph::Tensor_attributes ragged_attrs(const char* name, int64_t uid, int64_t B, int64_t S, Layout l,
                                                   const std::shared_ptr<fe::graph::Tensor_attributes>& offs) {
    return fe::graph::Tensor_attributes()
        .set_name(name)
        .set_uid(uid)
        .set_dim({B, l.heads, S, l.d})
        .set_stride({S * l.ld, l.hs, l.ld, 1})
        .set_ragged_offset(offs);
  }
  std::shared_ptr<fe::graph::Tensor_attributes> ragged(fe::graph::Graph& g, const char* name, int64_t uid, int64_t B,
                                                       int64_t S, Layout l,
                                                       const std::shared_ptr<fe::graph::Tensor_attributes>& offs) {
    return g.tensor(ragged_attrs(name, uid, B, S, l, offs));
  }
  static void as_output(fe::graph::Tensor_attributes& t, int64_t uid, int64_t B, int64_t S, Layout l,
                        const std::shared_ptr<fe::graph::Tensor_attributes>& offs) {
    t.set_output(true).set_uid(uid).set_dim({B, l.heads, S, l.d}).set_stride({S * l.ld, l.hs, l.ld, 1}).set_ragged_offset(offs);
  }
  std::shared_ptr<fe::graph::Tensor_attributes> index(fe::graph::Graph& g, const char* name, int64_t uid, int64_t n) {
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(uid)
                        .set_dim({n, 1, 1, 1})
                        .set_stride({1, 1, 1, 1})
                        .set_data_type(fe::DataType_t::INT32));
  }
  std::shared_ptr<fe::graph::Graph> new_graph() {
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    if (validate_only) {  // Hopper (H100/H200), for checks on a machine without the device
      g->set_sm_version(90);
      g->set_sm_count(132);
    }
    return g;
  }
  bool validate_only = false;  // cudnn_sdpa_validate(): the frontend's own checks, no device
  void finish(fe::graph::Graph& g, int64_t& ws, const char* what) {
    check_fe(g.validate(), fmt::format("validating the {} graph", what).c_str());
    if (validate_only) return;
    check_fe(g.build_operation_graph(handle), fmt::format("building the {} operation graph", what).c_str());
    check_fe(g.create_execution_plans({fe::HeurMode_t::A}), fmt::format("finding {} plans", what).c_str());
    check_fe(g.check_support(handle), fmt::format("checking the {} plans' support", what).c_str());
    check_fe(g.build_plans(handle), fmt::format("building the {} plans", what).c_str());
    check_fe(g.get_workspace_size(ws), "workspace size");
  }
  // What the forward and backward graphs share: the ragged offsets of Q, K, V and O, the
  // per-sample lengths, and Q, K, V over them.
  struct Common {
    std::shared_ptr<fe::graph::Tensor_attributes> oq, ok, ov, oo, sq, skv, Q, K, V;
  };
  Common common(fe::graph::Graph& g, int64_t B, int64_t S, int G = 1) {
    Common c;
    c.oq = index(g, "off_q", kOffQ, B + 1);
    c.ok = index(g, "off_k", kOffK, B + 1);
    c.ov = index(g, "off_v", kOffV, B + 1);
    c.oo = index(g, "off_o", kOffO, B + 1);
    c.sq = index(g, "seq_q", kSeqQ, B);
    c.skv = index(g, "seq_kv", kSeqKV, B);
    c.Q = ragged(g, "Q", kQ, B, S, lq(G), c.oq);
    c.K = ragged(g, "K", kK, B, S, lk(G), c.ok);
    c.V = ragged(g, "V", kV, B, S, lv(G), c.ov);
    return c;
  }
  // The forward, and the backward over every head.
  Plans build(int64_t B, int64_t S) {
    const int64_t nh = sh.nh;
    Plans p;
    {
      auto g = new_graph();
      const Common c = common(*g, B, S);
      auto opt = fe::graph::SDPA_attributes()
                     .set_name("causal_fwd")
                     .set_generate_stats(sh.backward)
                     .set_attn_scale(sh.scale)
                     .set_padding_mask(true)
                     .set_seq_len_q(c.sq)
                     .set_seq_len_kv(c.skv)
                     .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                     .set_diagonal_band_right_bound(0)
                     .set_max_total_seq_len_q(sh.max_rows)
                     .set_max_total_seq_len_kv(sh.max_rows);
      auto [O, Stats] = g->sdpa(c.Q, c.K, c.V, opt);
      as_output(*O, kO, B, S, lo(), c.oo);
      if (sh.backward)
        Stats->set_output(true)
            .set_uid(kStats)
            .set_data_type(fe::DataType_t::FLOAT)
            .set_dim({B, nh, S, 1})
            .set_stride({S * nh, 1, nh, 1})
            .set_ragged_offset(index(*g, "off_stats", kOffStats, B + 1));
      finish(*g, p.ws_fwd, "forward");
      p.fwd = g;
    }
    if (sh.backward) build_backward(B, S, 1, p);
    return p;
  }
  // p's backward over G head groups (G divides the kv heads: whole groups of query heads).
  // Stats keep their row stride (nh); a group's view starts at its first head.
  void build_backward(int64_t B, int64_t S, int G, Plans& p) {
    const int64_t nh = sh.nh;
    {
      auto g = new_graph();
      const Common c = common(*g, B, S, G);
      auto ost = index(*g, "off_stats", kOffStats, B + 1);
      auto O = ragged(*g, "O", kO, B, S, lo(G), c.oo), dO = ragged(*g, "dO", kDO, B, S, lo(G), c.oo);
      auto Stats = g->tensor(fe::graph::Tensor_attributes()
                                 .set_name("Stats")
                                 .set_uid(kStats)
                                 .set_dim({B, nh / G, S, 1})
                                 .set_stride({S * nh, 1, nh, 1})
                                 .set_data_type(fe::DataType_t::FLOAT)
                                 .set_ragged_offset(ost));
      auto opt = fe::graph::SDPA_backward_attributes()
                     .set_name("causal_bwd")
                     .set_attn_scale(sh.scale)
                     .set_padding_mask(true)
                     .set_seq_len_q(c.sq)
                     .set_seq_len_kv(c.skv)
                     .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                     .set_diagonal_band_right_bound(0)
                     .set_max_total_seq_len_q(sh.max_rows)
                     .set_max_total_seq_len_kv(sh.max_rows)
                     .set_deterministic_algorithm(true);  // resume is bit-identical only with fixed sums
      auto [dQ, dK, dV] = g->sdpa_backward(c.Q, c.K, c.V, O, dO, Stats, opt);
      as_output(*dQ, kDQ, B, S, lq(G), c.oq);
      as_output(*dK, kDK, B, S, lk(G), c.ok);
      as_output(*dV, kDV, B, S, lv(G), c.ov);
      finish(*g, p.ws_bwd, "backward");
      p.bwd = g;
      p.groups = G;
    }
  }
  Plans& plans_for(int64_t nb, int64_t S) {
    auto it = plans.find({nb, S});
    if (it == plans.end()) {
      tlog::debug("cuDNN fused attention: plans for {} samples of up to {} rows (head size {}, {}/{} heads)", nb, S,
                  sh.hd, sh.nh, sh.nkv);
      const int64_t before = device_free_bytes();
      Plans p = build(nb, S);
      // Under a limit, the fewest head groups (a power of two dividing the kv heads, four
      // query heads or more each) whose backward's workspace fits it, where some do.
      const int64_t all_heads = p.ws_bwd;
      while (sh.backward && bwd_limit > 0 && p.ws_bwd > bwd_limit && sh.nkv % (2 * p.groups) == 0 &&
             (sh.nh / (2 * p.groups)) % 4 == 0)  // (a group's statistics 16-byte aligned)
        build_backward(nb, S, 2 * p.groups, p);
      it = plans.emplace(std::make_pair(nb, S), std::move(p)).first;
      tlog::info(
          "cuDNN fused attention: plans for {} samples of up to {} rows took {:.1f} MiB of device memory "
          "(workspace apart){}",
          nb, S, double(before - device_free_bytes()) / (1 << 20),
          it->second.groups > 1
              ? fmt::format("; the backward in {} head groups, {:.1f} MiB of workspace instead of {:.1f}",
                            it->second.groups, double(it->second.ws_bwd) / (1 << 20), double(all_heads) / (1 << 20))
              : std::string());
    }
    return it->second;
  }
  void ensure_workspace(int64_t need) {
    if (need <= ws_cap) return;
    CUDA_CHECK(cudaStreamSynchronize(s));
    if (ws) CUDA_CHECK(cudaFree(ws));
    ws = nullptr;
    CUDA_CHECK(cudaMalloc(&ws, size_t(need)));
    ws_cap = need;
    tlog::info("cuDNN fused attention: workspace {:.1f} MiB ({} heads of {}, up to {} rows{})", double(need) / (1 << 20),
               sh.nh, sh.hd, sh.max_rows, sh.backward ? ", with the deterministic backward" : "");
  }
  void execute(fe::graph::Graph& g, std::unordered_map<int64_t, void*>& pack, const char* what) {
    for (int t = 0; t < kOffsets; ++t) {
      const int64_t uid = t == 4 ? kOffStats : kOffQ + t;
      if (t < 4 || sh.backward) pack[uid] = off + t * (off_cap + 1);
    }
    pack[kSeqQ] = len;
    pack[kSeqKV] = len;
    if (fe::detail::set_stream(handle, s) != CUDNN_STATUS_SUCCESS)
      fail_msg("cuDNN fused attention: cudnnSetStream failed: " + fe::detail::get_last_error_string_());
    check_fe(g.execute(handle, pack, ws_use), what);
  }
};

std::string cudnn_sdpa_validate(const SdpaShape& shape, int64_t n_samples, int64_t longest, int backward_groups) {
  if (!load_cudnn().ok) return load_cudnn().why;
  CudnnSdpa::Impl I;
  I.sh = resolved(shape);
  I.validate_only = true;
  if (backward_groups < 1 || I.sh.nkv % backward_groups != 0)
    return fmt::format("{} head groups do not divide {} kv heads", backward_groups, I.sh.nkv);
  try {
    const int64_t nb = pow2_at_least(n_samples, 1), S = pow2_at_least(longest, 64);
    CudnnSdpa::Impl::Plans p = I.build(nb, S);
    if (backward_groups > 1 && I.sh.backward) I.build_backward(nb, S, backward_groups, p);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

std::string cudnn_sdpa_unsupported(const SdpaShape& shape) {
  std::string why;
  if (!cudnn_sdpa_available(&why)) return why;
  const SdpaShape sh = resolved(shape);
  if (sh.nh <= 0 || sh.nkv <= 0 || sh.nh % sh.nkv != 0 || sh.hd <= 0 || sh.hd % 8 != 0 || sh.hd > 256 ||
      sh.hd_v <= 0 || sh.hd_v % 8 != 0 || sh.hd_v > 256 || sh.max_rows <= 0)
    return fmt::format("unsupported shape ({} heads, {} kv heads, head size {}, value head size {}; expected heads a "
                       "multiple of kv heads and head sizes that are multiples of 8 up to 256)",
                       sh.nh, sh.nkv, sh.hd, sh.hd_v);
  const int64_t widest = std::max({sh.ld_q, sh.ld_k, sh.ld_v, sh.ld_o});
  if (sh.max_rows * widest >= int64_t(INT32_MAX))
    return fmt::format("{} rows x {} values do not fit its 32-bit offsets", sh.max_rows, widest);
  return "";
}

CudnnSdpa::CudnnSdpa(const SdpaShape& shape, cudaStream_t s) : p_(std::make_unique<Impl>()) {
  const std::string why = cudnn_sdpa_unsupported(shape);
  if (!why.empty()) fail_msg("cuDNN fused attention: " + why);
  const SdpaShape sh = resolved(shape);
  Impl& I = *p_;
  I.sh = sh;
  I.s = s;
  const int64_t before = device_free_bytes();
  if (fe::detail::create_handle(&I.handle) != CUDNN_STATUS_SUCCESS)
    fail_msg("cuDNN fused attention: cudnnCreate failed: " + fe::detail::get_last_error_string_());
  tlog::info("cuDNN fused attention: the handle took {:.1f} MiB of device memory", double(before - device_free_bytes()) / (1 << 20));
}

CudnnSdpa::~CudnnSdpa() {
  Impl& I = *p_;
  if (I.s) cudaStreamSynchronize(I.s);
  I.plans.clear();
  if (I.handle) fe::detail::destroy_handle(I.handle);
  cudaFree(I.ws);
  cudaFree(I.off);
  cudaFree(I.len);
}

int64_t CudnnSdpa::workspace_bytes(int64_t n_samples, int64_t longest) {
  const auto& p = p_->plans_for(pow2_at_least(n_samples, 1), pow2_at_least(longest, 64));
  return std::max(p.ws_fwd, p.ws_bwd);
}

void CudnnSdpa::set_workspace(void* p, int64_t bytes) {
  Impl& I = *p_;
  I.ws_ext = bytes > 0 ? p : nullptr;
  I.ext_cap = I.ws_ext ? bytes : 0;
  I.cur = nullptr;  // set_batch picks the workspace again
}

int64_t CudnnSdpa::bytes() const { return p_->ws_cap + (p_->off_cap + 1) * kOffsets * 4 + p_->off_cap * 4; }

void CudnnSdpa::set_backward_limit(int64_t bytes) {
  Impl& I = *p_;
  if (bytes < 0) fail_msg("cuDNN fused attention: a backward workspace limit of " + std::to_string(bytes) + " bytes");
  if (bytes == I.bwd_limit) return;
  if (I.s) CUDA_CHECK(cudaStreamSynchronize(I.s));  // no plan of these still runs
  I.bwd_limit = bytes;
  I.plans.clear();
  I.cur = nullptr;  // set_batch picks the plans again
}

int CudnnSdpa::backward_groups(int64_t n_samples, int64_t longest) {
  return p_->plans_for(pow2_at_least(n_samples, 1), pow2_at_least(longest, 64)).groups;
}
int64_t CudnnSdpa::rows() const { return p_->sh.max_rows; }

void CudnnSdpa::set_batch(const std::vector<int64_t>& seq_start, const int64_t* seq_start_d) {
  Impl& I = *p_;
  if (seq_start.size() < 2) fail_msg("cuDNN fused attention: a batch needs at least one sample");
  const int64_t B = int64_t(seq_start.size()) - 1;
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) longest = std::max(longest, seq_start[size_t(b) + 1] - seq_start[size_t(b)]);
  if (seq_start.back() > I.sh.max_rows)
    fail_msg(fmt::format("cuDNN fused attention: a batch of {} rows is over the {} it was made for", seq_start.back(),
                         I.sh.max_rows));
  const int64_t nb = pow2_at_least(B, 1), S = pow2_at_least(longest, 64);
  I.cur = &I.plans_for(nb, S);
  I.nb_pad = nb;
  const int64_t need = std::max(I.cur->ws_fwd, I.cur->ws_bwd);
  if (I.ws_ext && need <= I.ext_cap) {
    I.ws_use = I.ws_ext;
  } else {
    if (I.ws_ext && !I.ws_cap)
      tlog::info("cuDNN fused attention: {} samples of up to {} rows need {:.1f} MiB of workspace, more than the "
                 "{:.1f} MiB lent to it: it takes its own", nb, S, double(need) / (1 << 20),
                 double(I.ext_cap) / (1 << 20));
    I.ensure_workspace(need);
    I.ws_use = I.ws;
  }
  if (nb > I.off_cap) {
    CUDA_CHECK(cudaStreamSynchronize(I.s));
    cudaFree(I.off);
    cudaFree(I.len);
    I.off = nullptr;
    I.len = nullptr;
    CUDA_CHECK(cudaMalloc(&I.off, size_t(kOffsets * (nb + 1)) * sizeof(int32_t)));
    CUDA_CHECK(cudaMalloc(&I.len, size_t(nb) * sizeof(int32_t)));
    I.off_cap = nb;
  }
  const int64_t per_row[kOffsets] = {I.sh.ld_q, I.sh.ld_k, I.sh.ld_v, I.sh.ld_o, int64_t(I.sh.nh)};
  // Each offset array is off_cap + 1 long; the graph reads its first nb + 1.
  for (int t = 0; t < (I.sh.backward ? kOffsets : kOffsets - 1); ++t)
    sdpa_ragged_offsets(I.off + t * (I.off_cap + 1), t == 0 ? I.len : nullptr, seq_start_d, int(B), int(nb),
                        per_row[t], I.s);
}

void CudnnSdpa::forward(__nv_bfloat16* o, float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k,
                        const __nv_bfloat16* v) {
  Impl& I = *p_;
  if (!I.cur) fail_msg("cuDNN fused attention: forward before set_batch");
  std::unordered_map<int64_t, void*> pack = {{kQ, const_cast<__nv_bfloat16*>(q)},
                                             {kK, const_cast<__nv_bfloat16*>(k)},
                                             {kV, const_cast<__nv_bfloat16*>(v)},
                                             {kO, o}};
  if (I.sh.backward) {
    if (!lse) fail_msg("cuDNN fused attention: a training forward needs its log-sum-exp buffer");
    pack[kStats] = lse;
  }
  I.execute(*I.cur->fwd, pack, "the forward");
}

void CudnnSdpa::backward(__nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, const __nv_bfloat16* q,
                         const __nv_bfloat16* k, const __nv_bfloat16* v, const __nv_bfloat16* o,
                         const __nv_bfloat16* dO, const float* lse) {
  Impl& I = *p_;
  if (!I.sh.backward) fail_msg("cuDNN fused attention: backward on an instance made for the forward only");
  if (!I.cur) fail_msg("cuDNN fused attention: backward before set_batch");
  // One execution a head group, each at its group's first heads (one group: the whole).
  const int G = I.cur->groups;
  const SdpaShape& sh = I.sh;
  const int64_t qh = sh.nh / G, kh = sh.nkv / G;
  for (int g = 0; g < G; ++g) {
    const int64_t oq = g * qh * sh.hd, ok = g * kh * sh.hd, ov = g * kh * sh.hs_v, oo = g * qh * sh.hd_v;
    std::unordered_map<int64_t, void*> pack = {{kQ, const_cast<__nv_bfloat16*>(q + oq)},
                                               {kK, const_cast<__nv_bfloat16*>(k + ok)},
                                               {kV, const_cast<__nv_bfloat16*>(v + ov)},
                                               {kO, const_cast<__nv_bfloat16*>(o + oo)},
                                               {kDO, const_cast<__nv_bfloat16*>(dO + oo)},
                                               {kStats, const_cast<float*>(lse + g * qh)},
                                               {kDQ, dq + oq},
                                               {kDK, dk + ok},
                                               {kDV, dv + ov}};
    I.execute(*I.cur->bwd, pack, "the backward");
  }
}

#else  // built without the cuDNN frontend

bool cudnn_sdpa_built() { return false; }
std::string cudnn_sdpa_validate(const SdpaShape&, int64_t, int64_t, int) { return "built without the cuDNN frontend"; }
bool cudnn_sdpa_available(std::string* why) {
  if (why) *why = "this build has no cuDNN frontend (scripts/setup.sh fetches it; then reconfigure)";
  return false;
}
int64_t cudnn_version() { return 0; }
struct CudnnSdpa::Impl {};
std::string cudnn_sdpa_unsupported(const SdpaShape&) {
  std::string why;
  cudnn_sdpa_available(&why);
  return why;
}
CudnnSdpa::CudnnSdpa(const SdpaShape&, cudaStream_t) {
  std::string why;
  cudnn_sdpa_available(&why);
  fail_msg("cuDNN fused attention: " + why);
}
CudnnSdpa::~CudnnSdpa() = default;
int64_t CudnnSdpa::workspace_bytes(int64_t, int64_t) { return 0; }
void CudnnSdpa::set_workspace(void*, int64_t) {}
int64_t CudnnSdpa::bytes() const { return 0; }
int64_t CudnnSdpa::rows() const { return 0; }
void CudnnSdpa::set_backward_limit(int64_t) {}
int CudnnSdpa::backward_groups(int64_t, int64_t) { return 1; }
void CudnnSdpa::set_batch(const std::vector<int64_t>&, const int64_t*) {}
void CudnnSdpa::forward(__nv_bfloat16*, float*, const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*) {}
void CudnnSdpa::backward(__nv_bfloat16*, __nv_bfloat16*, __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*,
                         const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, const float*) {}

#endif

}  // namespace talon::cuda
