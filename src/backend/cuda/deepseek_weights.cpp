// The DeepSeek-family weights on the device and the layer halves both CUDA paths share
// (deepseek_weights.h).
#include "backend/cuda/deepseek_weights.h"

#include <atomic>
#include <cstdlib>
#include <string>

#include <algorithm>

#include "backend/cuda/check.h"
#include "backend/cuda/collective.h"
#include "backend/cuda/deepseek_ops.h"
#include "backend/cuda/weights.h"
#include "model/deepseek.h"
#include "util/error.h"

namespace talon::cuda {

namespace {

constexpr float kLatentNormEps = 1e-6f;  // q_a / kv_a layernorms (transformers' RMSNorm default)

// A block of a weight: rows [r0, r1) and columns [c0, c1) (r1 / c1 < 0: to the end).
struct Part {
  const QuantWeight* w;
  int64_t r0 = 0, r1 = -1, c0 = 0, c1 = -1;
};

// Dequantized (any storage), sliced and stacked row-wise: [sum of rows, cols] bf16.
bf16* upload_linear(std::initializer_list<Part> parts, DeviceArena& arena) {
  size_t n = 0;
  for (Part p : parts) {
    if (p.r1 < 0) p.r1 = p.w->rows;
    if (p.c1 < 0) p.c1 = p.w->cols;
    n += size_t((p.r1 - p.r0) * (p.c1 - p.c0));
  }
  bf16* d = arena.alloc<bf16>(n);
  size_t at = 0;
  std::vector<float> f, sub;
  for (Part p : parts) {
    const int64_t R = p.w->rows, C = p.w->cols, r1 = p.r1 < 0 ? R : p.r1, c1 = p.c1 < 0 ? C : p.c1;
    f.resize(size_t(R * C));
    dequantize(*p.w, f.data());
    const int64_t w = c1 - p.c0;
    sub.resize(size_t((r1 - p.r0) * w));
    for (int64_t r = p.r0; r < r1; ++r) std::copy_n(f.data() + r * C + p.c0, w, sub.data() + (r - p.r0) * w);
    copy_bf16(d + at, sub.data(), sub.size());
    at += sub.size();
  }
  return d;
}

}  // namespace

DeepseekDevWeights upload_deepseek_weights(const Checkpoint& ckpt, DeviceArena& arena, const DeepseekParallel& par) {
  const ModelConfig& c = ckpt.config();
  const DeepseekConfig& d = c.ds;
  const int n = par.size, rk = par.rank;
  const bool tp = par.mode == DeepseekParallel::Mode::Tensor;
  DeepseekDevWeights w;
  w.nh = tp ? c.n_heads / n : c.n_heads;
  const int64_t h0 = tp ? rk * w.nh : 0, qk = d.qk_head_dim(), nv = d.qk_nope_head_dim + d.v_head_dim;
  const DeepseekWeights src = bind_deepseek_weights(ckpt);
  w.embed = upload_weight(src.embed, arena);
  w.lm_head = upload_weight(src.lm_head, arena);
  w.final_norm = upload_weight(src.final_norm, arena);
  for (const DeepseekLayer& l : src.layers) {
    DeepseekLayerDev L;
    L.attn_norm = upload_weight(l.attn_norm, arena);
    L.mlp_norm = upload_weight(l.mlp_norm, arena);
    L.kv_a_norm = upload_weight(l.kv_a_norm, arena);
    if (d.q_lora_rank > 0) {
      L.q_a_norm = upload_weight(l.q_a_norm, arena);
      L.q_a = upload_linear({{&l.q_a}}, arena);
      L.q = upload_linear({{&l.q_b, h0 * qk, (h0 + w.nh) * qk}}, arena);
    } else {
      L.q = upload_linear({{&l.q_proj, h0 * qk, (h0 + w.nh) * qk}}, arena);
    }
    L.kv_a = upload_linear({{&l.kv_a}}, arena);
    L.kv_b = upload_linear({{&l.kv_b, h0 * nv, (h0 + w.nh) * nv}}, arena);
    L.o = upload_linear({{&l.o_proj, 0, -1, h0 * d.v_head_dim, (h0 + w.nh) * d.v_head_dim}}, arena);
    L.moe = l.moe;
    const DeepseekMlp* mlp = l.moe ? (l.shared.gate.empty() ? nullptr : &l.shared) : &l.dense;
    if (mlp) {
      const int64_t I = mlp->gate.rows;
      TALON_CHECK(!tp || I % n == 0, "--tp {}: layer {} MLP width {} must divide by it", n, w.layers.size(), I);
      L.inter = tp ? I / n : I;
      const int64_t i0 = tp ? rk * L.inter : 0, i1 = i0 + L.inter;
      L.gu = upload_linear({{&mlp->gate, i0, i1}, {&mlp->up, i0, i1}}, arena);
      L.down = upload_linear({{&mlp->down, 0, -1, i0, i1}}, arena);
    }
    if (l.moe) {
      const std::vector<float> r = weight_to_f32(l.router);
      L.router = arena.alloc<float>(r.size());
      CUDA_CHECK(cudaMemcpy(L.router, r.data(), r.size() * 4, cudaMemcpyHostToDevice));
      const int64_t per = c.ds.n_routed_experts / n;
      L.experts = upload_moe_layer(l, c, arena, n > 1 ? rk * per : 0, n > 1 ? per : -1);
    }
    w.layers.push_back(L);
  }
  const std::vector<float> inv = rope_inv_freq(c.rope, d.qk_rope_head_dim);
  w.inv_freq = arena.alloc<float>(inv.size());
  CUDA_CHECK(cudaMemcpy(w.inv_freq, inv.data(), inv.size() * 4, cudaMemcpyHostToDevice));
  return w;
}

void alloc_moe_scratch(MoeScratch& m, DeviceArena& ar, int64_t n, const MoeRouting& r, int64_t H, int64_t Im) {
  const auto sz = moe_scratch_elems(n, r, H, Im);
  m.idx = ar.alloc<int32_t>(size_t(sz.idx));
  m.order = ar.alloc<int32_t>(size_t(sz.order));
  m.pos = ar.alloc<int32_t>(size_t(sz.pos));
  m.offsets = ar.alloc<int32_t>(size_t(sz.offsets));
  m.tiles = ar.alloc<int32_t>(size_t(sz.tiles));
  m.n_tiles = ar.alloc<int32_t>(1);
  m.weights = ar.alloc<float>(size_t(sz.weights));
  m.g = ar.alloc<float>(size_t(sz.g));
  m.u = ar.alloc<float>(size_t(sz.g));
  m.y = ar.alloc<float>(size_t(sz.y));
  m.act = ar.alloc<bf16>(size_t(sz.act));
  m.capacity = n;
}

void mla_project(const DeepseekLayerDev& L, const ModelConfig& c, int64_t nh, float* x, const MlaBuffers& b,
                 int64_t N, Gemm& gemm, cudaStream_t s) {
  const DeepseekConfig& d = c.ds;
  const int64_t H = c.hidden, qk = d.qk_head_dim(), kvr = d.kv_lora_rank, rope = d.qk_rope_head_dim;
  const int64_t qr = d.q_lora_rank;
  add_rmsnorm_forward(b.xn, x, nullptr, L.attn_norm, N, H, float(c.rms_eps), s);
  if (qr > 0) {
    gemm.forward(b.qa, b.xn, L.q_a, N, H, qr, s);
    bf16_to_f32(b.t32, b.qa, N * qr, s);
    add_rmsnorm_forward(b.qa, b.t32, nullptr, L.q_a_norm, N, qr, kLatentNormEps, s);
    gemm.forward(b.q, b.qa, L.q, N, qr, nh * qk, s);
  } else {
    gemm.forward(b.q, b.xn, L.q, N, H, nh * qk, s);
  }
  gemm.forward(b.ckv, b.xn, L.kv_a, N, H, kvr + rope, s);
  CUDA_CHECK(cudaMemcpy2DAsync(b.lat, size_t(kvr) * 2, b.ckv, size_t(kvr + rope) * 2, size_t(kvr) * 2, size_t(N),
                               cudaMemcpyDeviceToDevice, s));
  bf16_to_f32(b.t32, b.lat, N * kvr, s);
  add_rmsnorm_forward(b.lat, b.t32, nullptr, L.kv_a_norm, N, kvr, kLatentNormEps, s);
}

void deepseek_mlp(const DeepseekLayerDev& L, const ModelConfig& c, float* x, const MlpBuffers& b, int64_t N,
                  Gemm& gemm, cudaStream_t s, const std::function<void()>& routed,
                  const std::function<void(float*, int64_t)>& reduce) {
  const int64_t H = c.hidden;
  const float eps = float(c.rms_eps);
  add_rmsnorm_forward(b.xn, x, nullptr, L.mlp_norm, N, H, eps, s);
  if (L.moe) {
    const auto& r = L.experts.routing;
    rmsnorm_f32(b.xn32, x, L.mlp_norm, N, H, eps, s);
    router_logits_f32(b.rlog, b.xn32, L.router, N, r.n_experts, H, s);
    if (routed)
      routed();
    else
      moe_forward(b.moe_out, b.xn, b.rlog, L.experts.router_bias, N, H, r, L.experts.experts, *b.moe, s);
    add_f32(x, b.moe_out, N * H, s);
  }
  if (L.gu) {
    gemm.forward(b.gu, b.xn, L.gu, N, H, 2 * L.inter, s);
    swiglu_forward(b.act, b.gu, N, L.inter, s);
    gemm.forward(b.part, b.act, L.down, N, L.inter, H, s);  // tensor parallel: this rank's slice
    if (reduce) reduce(b.part, N * H);
    add_f32(x, b.part, N * H, s);
  }
}

namespace {
std::atomic<int> g_ep_overlap{-1};
bool ep_overlap() {
  static const bool env = [] {
    const char* e = std::getenv("TALON_EP_OVERLAP");
    return e && std::string(e) == "1";
  }();
  const int m = g_ep_overlap.load();
  return m < 0 ? env : m > 0;
}
}  // namespace

void moe_ep_overlap_use(int mode) { g_ep_overlap = mode; }

MoeParallel::~MoeParallel() {
  if (!s2_) return;
  int cur = 0;
  cudaGetDevice(&cur);
  cudaSetDevice(device_);
  cudaStreamSynchronize(s2_);
  cudaEventDestroy(ev_in_);
  cudaEventDestroy(ev_out_);
  cudaStreamDestroy(s2_);
  cudaSetDevice(cur);
}

void MoeParallel::run(const DeepseekLayerDev& L, int64_t N, const float* rlog, const bf16* xn, const MoeScratch* moe,
                      float* out, cudaStream_t s) {
  const bool tp = par_.mode == DeepseekParallel::Mode::Tensor;
  if (tp || !ep_overlap()) {
    Part p;
    p.e = &ep_, p.moe = moe, p.N = N, p.rlog = rlog, p.xn = xn, p.out = out, p.s = s;
    dispatch(L, p);
    finish(L, p);
    return;
  }
  if (!s2_) {
    CUDA_CHECK(cudaGetDevice(&device_));
    CUDA_CHECK(cudaStreamCreateWithFlags(&s2_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&ev_in_, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&ev_out_, cudaEventDisableTiming));
  }
  const auto& r = L.experts.routing;
  const int64_t H = H_, E = r.n_experts, N1 = N / 2, N2 = N - N1;
  // The second half routes with its own scratch (moe_forward's, for N2 tokens).
  if (N2 > 0 && ep2_.route_n < N2) {
    CUDA_CHECK(cudaStreamSynchronize(s2_));
    ep2_.route = MoeScratch{};
    ep2_.route_arena = std::make_unique<DeviceArena>();
    alloc_moe_scratch(ep2_.route, *ep2_.route_arena, N2, r, H, L.experts.experts.gate.O);
    ep2_.route_n = N2;
  }
  CUDA_CHECK(cudaEventRecord(ev_in_, s));  // rlog and xn are ready
  CUDA_CHECK(cudaStreamWaitEvent(s2_, ev_in_, 0));
  Part a, b;
  a.e = &ep_, a.moe = N1 > 0 ? moe : nullptr, a.N = N1, a.rlog = rlog, a.xn = xn, a.out = out, a.s = s;
  b.e = &ep2_, b.moe = N2 > 0 ? &ep2_.route : nullptr, b.N = N2, b.rlog = N2 > 0 ? rlog + N1 * E : nullptr;
  b.xn = N2 > 0 ? xn + N1 * H : nullptr, b.out = N2 > 0 ? out + N1 * H : nullptr, b.s = s2_;
  dispatch(L, a);
  dispatch(L, b);
  finish(L, a);
  finish(L, b);
  CUDA_CHECK(cudaEventRecord(ev_out_, s2_));  // the second half's rows of `out` are written
  CUDA_CHECK(cudaStreamWaitEvent(s, ev_out_, 0));
}

void MoeParallel::dispatch(const DeepseekLayerDev& L, Part& p) {
  const auto& r = L.experts.routing;
  const int n = par_.size, rk = par_.rank, K = r.top_k, per = r.n_experts / n;
  const int64_t H = H_, N = p.N, NK = N * K, Im = L.experts.experts.gate.O;
  const bool tp = par_.mode == DeepseekParallel::Mode::Tensor;
  p.off.assign(size_t(r.n_experts) + 1, 0);
  if (N > 0) {
    moe_route_sort(p.rlog, L.experts.router_bias, N, r, *p.moe, p.s);
    CUDA_CHECK(cudaMemcpyAsync(p.off.data(), p.moe->offsets, p.off.size() * 4, cudaMemcpyDeviceToHost, p.s));
    CUDA_CHECK(cudaStreamSynchronize(p.s));
  }
  // Slots bound for rank d: sorted positions [off[d per], off[(d + 1) per]).
  p.cnt.assign(size_t(n), 0);
  p.got.assign(size_t(n), 0);
  for (int d = 0; d < n; ++d) p.cnt[size_t(d)] = p.off[size_t((d + 1) * per)] - p.off[size_t(d * per)];
  p.R = 0;
  if (tp) {
    p.R = p.cnt[size_t(rk)];
  } else {
    const std::vector<int64_t> all = par_.comm->exchange(rk, p.cnt);
    for (int src = 0; src < n; ++src) p.R += p.got[size_t(src)] = all[size_t(src * n + rk)];
  }
  Ep& e = ensure(*p.e, NK, p.R, per, Im, p.s);
  moe_gather_sorted(e.send_rows, e.send_ids, p.xn, H, K, NK, per, p.moe ? *p.moe : e.sc, p.s);
  if (!tp) {
    std::vector<int64_t> sb(static_cast<size_t>(n)), rb(static_cast<size_t>(n));
    for (int d = 0; d < n; ++d) sb[size_t(d)] = p.cnt[size_t(d)] * H * 2, rb[size_t(d)] = p.got[size_t(d)] * H * 2;
    par_.comm->all_to_all(rk, e.send_rows, sb, e.recv_rows, rb, p.s);
    for (int d = 0; d < n; ++d) sb[size_t(d)] = p.cnt[size_t(d)] * 4, rb[size_t(d)] = p.got[size_t(d)] * 4;
    par_.comm->all_to_all(rk, e.send_ids, sb, e.recv_ids, rb, p.s);
  }
}

void MoeParallel::finish(const DeepseekLayerDev& L, Part& p) {
  const auto& r = L.experts.routing;
  const int n = par_.size, rk = par_.rank, K = r.top_k, per = r.n_experts / n;
  const int64_t H = H_, N = p.N, NK = N * K;
  const bool tp = par_.mode == DeepseekParallel::Mode::Tensor;
  Ep& e = *p.e;
  const bf16* rows = e.recv_rows;
  const int32_t* ids = e.recv_ids;
  if (tp) {
    rows = e.send_rows + p.off[size_t(rk * per)] * H;
    ids = e.send_ids + p.off[size_t(rk * per)];
  }
  moe_experts_forward(e.y_recv, rows, ids, p.R, H, per, L.experts.experts, e.sc, p.s);
  if (tp) {
    CUDA_CHECK(cudaMemsetAsync(e.y_sorted, 0, size_t(NK * H) * 4, p.s));
    CUDA_CHECK(cudaMemcpyAsync(e.y_sorted + p.off[size_t(rk * per)] * H, e.y_recv, size_t(p.R * H) * 4,
                               cudaMemcpyDeviceToDevice, p.s));
  } else {
    // The expert outputs go back to the ranks that sent the rows, in the order they came.
    std::vector<int64_t> sb(static_cast<size_t>(n)), rb(static_cast<size_t>(n));
    for (int d = 0; d < n; ++d) sb[size_t(d)] = p.got[size_t(d)] * H * 4, rb[size_t(d)] = p.cnt[size_t(d)] * H * 4;
    par_.comm->all_to_all(rk, e.y_recv, sb, e.y_sorted, rb, p.s);
  }
  if (N > 0) {
    moe_combine(p.out, e.y_sorted, N, H, K, *p.moe, p.s);
    if (tp) par_.comm->all_reduce(rk, p.out, N * H, DType::F32, p.s);
  }
}

MoeParallel::Ep& MoeParallel::ensure(Ep& ep, int64_t NK, int64_t R, int per, int64_t Im, cudaStream_t s) {
  if (ep.arena && ep.nk >= NK && ep.r >= R) return ep;
  CUDA_CHECK(cudaStreamSynchronize(s));
  const int64_t nk = std::max<int64_t>({NK, ep.nk, 1}), r = std::max<int64_t>({R, ep.r, 1}), H = H_;
  ep.arena = std::make_unique<DeviceArena>();
  auto& ar = *ep.arena;
  ep.send_rows = ar.alloc<bf16>(size_t(nk * H));
  ep.send_ids = ar.alloc<int32_t>(size_t(nk));
  ep.y_sorted = ar.alloc<float>(size_t(nk * H));
  ep.recv_rows = ar.alloc<bf16>(size_t(r * H));
  ep.recv_ids = ar.alloc<int32_t>(size_t(r));
  ep.y_recv = ar.alloc<float>(size_t(r * H));
  ep.sc = MoeScratch{};
  MoeRouting top1;
  top1.n_experts = per, top1.top_k = 1;
  alloc_moe_scratch(ep.sc, ar, r, top1, H, Im);
  ep.nk = nk, ep.r = r;
  return ep;
}

}  // namespace talon::cuda
