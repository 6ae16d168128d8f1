// A DFlash draft on one GPU (draft_backend.h: DFlashBackend): dflash::extend_context and
// dflash::block_logits (src/draft/dflash.cpp, the fp64 reference) with bf16 weights, bf16
// per-layer caches of the context's keys and values, fp32 accumulation and an fp32 residual
// stream, built from the cached decoder's kernels (decode_ops.h):
//
// * a context row joins once: C = hidden_norm(fc(aux)), then in every layer its k (normed per
//   head, rotated at its position) and v go to cache row `position`;
// * a block of B rows at positions a .. a+B-1 (a = rows()) writes its own keys and values at
//   cache rows a .. a+B-1 (scratch: the next context rows overwrite them) and every row
//   attends to cache rows [0, a + B): the context and the whole block, both ways (a decode
//   row of the convention with len = a and end = a + B, all pending rows visible).
#include <cuda_runtime.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "backend/cuda/check.h"
#include "backend/cuda/decode_ops.h"
#include "backend/cuda/device.h"
#include "backend/cuda/graph_cache.h"
#include "backend/cuda/ops.h"
#include "backend/cuda/weights.h"
#include "draft/draft_backend.h"
#include "draft/draft_runner.h"
#include "model/model.h"
#include "util/error.h"
#include "util/log.h"

namespace talon::spec {

namespace {

using cuda::bf16;
using cuda::DecodeRow;
using cuda::DeviceArena;


class CudaDFlashBackend final : public DFlashBackend {
 public:
  static constexpr int kMaxTop = 64;
  CudaDFlashBackend(const DraftModel& m, const Checkpoint& target, int device, int64_t max_rows)
      : dev_(device, "dflash draft"), c_(m.dflash) {
    const auto& c = c_;
    const auto& w = m.dweights;
    TALON_CHECK(max_rows > 0 && c.block >= 2 && int64_t(w.layers.size()) == c.layers && c.layers >= 1,
                "dflash: {} layers of {} given, block {}, a cache of {} rows", w.layers.size(), c.layers, c.block,
                max_rows);
    TALON_CHECK(c.n_heads > 0 && c.n_kv_heads > 0 && c.n_heads % c.n_kv_heads == 0 && c.head_dim % 2 == 0 &&
                    c.head_dim <= 256,
                "dflash: {} query heads over {} kv heads of {}: not a layout the GPU kernels take", c.n_heads,
                c.n_kv_heads, c.head_dim);
    cap_ = max_rows + c.block;
    fc_ = cuda::upload_bf16(dev_.arena(), {&w.fc});
    hidden_norm_ = cuda::upload_bf16(dev_.arena(), {&w.hidden_norm});
    norm_ = cuda::upload_bf16(dev_.arena(), {&w.norm});
    lm_head_ = cuda::upload_bf16(dev_.arena(), {&w.lm_head});
    const int64_t kvd = c.n_kv_heads * c.head_dim;
    for (const dflash::Layer& L : w.layers) {
      LayerDev d;
      d.in_ln = cuda::upload_bf16(dev_.arena(), {&L.in_ln});
      d.wqkv = cuda::upload_bf16(dev_.arena(), {&L.wq, &L.wk, &L.wv});
      d.q_norm = cuda::upload_bf16(dev_.arena(), {&L.q_norm});
      d.k_norm = cuda::upload_bf16(dev_.arena(), {&L.k_norm});
      d.wo = cuda::upload_bf16(dev_.arena(), {&L.wo});
      d.post_ln = cuda::upload_bf16(dev_.arena(), {&L.post_ln});
      d.wgu = cuda::upload_bf16(dev_.arena(), {&L.gate, &L.up});
      d.down = cuda::upload_bf16(dev_.arena(), {&L.down});
      d.kc = dev_.arena().alloc<bf16>(size_t(cap_ * kvd));
      d.vc = dev_.arena().alloc<bf16>(size_t(cap_ * kvd));
      layers_.push_back(d);
    }
    const CkptTensor* t = target.find("model.embed_tokens.weight");
    TALON_CHECK(t, "{}: no tensor 'model.embed_tokens.weight' (a DFlash draft reads the target's embedding)",
                target.source());
    const WeightRef e = target.weight(*t);
    TALON_CHECK(e.shape.size() == 2 && e.shape[0] == c.V && e.shape[1] == c.H, "{}: the embedding is not [{}, {}]",
                target.source(), c.V, c.H);
    embed_ = cuda::upload_weight(e, dev_.arena());
    const std::vector<float> inv = rope_inv_freq(c.rope, c.head_dim);
    inv_freq_ = dev_.arena().alloc<float>(inv.size());
    CUDA_CHECK(cudaMemcpy(inv_freq_, inv.data(), inv.size() * 4, cudaMemcpyHostToDevice));
    tlog::debug("cuda:{}: DFlash draft on the GPU ({} layers, block {}), {:.1f} MiB with caches of {} rows",
                dev_.index(), c.layers, c.block, double(dev_.arena().bytes()) / double(1 << 20), cap_);
  }

  ~CudaDFlashBackend() override {
    dev_.activate();
    graphs_.clear();
  }

  std::string name() const override { return dev_.name(); }
  void reset() override { rows_ = 0; }
  int64_t rows() const override { return rows_; }

  void extend(const float* aux, int64_t n) override {
    if (n <= 0) return;
    dev_.activate();
    const auto& c = c_;
    const int64_t H = c.H, AW = c.n_aux * H, nkv = c.n_kv_heads, hd = c.head_dim, kvd = nkv * hd;
    const float eps = float(c.rms_eps);
    TALON_CHECK(rows_ + n + c.block <= cap_, "dflash: {} context rows after {} leave no room for a block in {} rows", n,
                rows_, cap_);
    cuda::PackedOffsets po;
    const size_t o_pos = po.place(size_t(n) * 4), o_rows = po.place(size_t(n) * sizeof(DecodeRow)),
                 o_aux = po.place(size_t(n * AW) * 4), off = po.bytes();
    ensure(n, 0, off);
    uint8_t* hb = staged_.ensure(off);
    for (int64_t i = 0; i < n; ++i) {
      const int32_t p = int32_t(rows_ + i);
      std::memcpy(hb + o_pos + size_t(i) * 4, &p, 4);
      const DecodeRow r{0, 0, p, p + 1, -1};
      std::memcpy(hb + o_rows + size_t(i) * sizeof(DecodeRow), &r, sizeof r);
    }
    std::memcpy(hb + o_aux, aux, size_t(n * AW) * 4);
    Acts& a = *acts_;
    cudaStream_t s = dev_.stream();
    CUDA_CHECK(cudaMemcpyAsync(a.inputs, hb, off, cudaMemcpyHostToDevice, s));
    const auto* pos = reinterpret_cast<const int32_t*>(a.inputs + o_pos);
    const auto* wr = reinterpret_cast<const DecodeRow*>(a.inputs + o_rows);
    const auto* din = reinterpret_cast<const float*>(a.inputs + o_aux);
    graphs_.run(fmt::format("ctx/{}", n), s, [&] {
      cuda::f32_to_bf16(a.auxb, din, n * AW, s);
      dev_.gemm().forward(a.tmp, a.auxb, fc_, n, AW, H, s);
      cuda::bf16_to_f32(a.x, a.tmp, n * H, s);
      cuda::add_rmsnorm_forward(a.xn, a.x, nullptr, hidden_norm_, n, H, eps, s);
      for (const LayerDev& L : layers_) {
        // The k|v rows of the fused weights (after the nh*hd q rows).
        dev_.gemm().forward(a.qkv, a.xn, L.wqkv + c.n_heads * hd * H, n, H, 2 * kvd, s);
        cuda::head_rmsnorm_forward(a.qkv, 2 * kvd, L.k_norm, n, nkv, hd, eps, s);
        cuda::rope_kv_cache_write(L.kc, L.vc, a.qkv, 2 * kvd, pos, inv_freq_, wr, n, 0, nkv, hd, cap_, s);
      }
    });
    CUDA_CHECK(cudaStreamSynchronize(s));  // the staging buffer is reused by the next call
    rows_ += n;
  }

  void block(int32_t first, int32_t mask_token, int64_t n, float* logits, int top_k, int32_t* top_ids,
             float* top_lp) override {
    dev_.activate();
    const auto& c = c_;
    const int64_t B = c.block, H = c.H, I = c.I, nh = c.n_heads, nkv = c.n_kv_heads, hd = c.head_dim;
    const int64_t qd = nh * hd, ld = qd + 2 * nkv * hd, Vd = c.Vd, A = rows_;
    const float eps = float(c.rms_eps);
    TALON_CHECK(A > 0 && n >= 1 && n < B, "dflash: block of {} rows (blocks of {}) after {} context rows", n, B, A);
    TALON_CHECK(first >= 0 && first < c.V && mask_token >= 0 && mask_token < c.V,
                "dflash: block tokens {} / {} outside the vocabulary of {}", first, mask_token, c.V);
    TALON_CHECK(top_k >= 0 && top_k <= kMaxTop && top_k <= Vd, "dflash: top-k {} (at most {} on the GPU)", top_k,
                kMaxTop);
    TALON_CHECK(A + B <= cap_, "dflash: a block at {} needs {} cache rows, the GPU cache has {}", A, A + B, cap_);
    std::vector<DecodeRow> wr(static_cast<size_t>(B)), ar(static_cast<size_t>(B));
    std::vector<int32_t> ids(static_cast<size_t>(B), mask_token), pos(static_cast<size_t>(B));
    ids[0] = first;
    for (int64_t i = 0; i < B; ++i) {
      pos[size_t(i)] = int32_t(A + i);
      wr[size_t(i)] = DecodeRow{0, 0, int32_t(A + i), int32_t(A + i + 1), -1};  // where its k and v go
      ar[size_t(i)] = DecodeRow{0, 0, int32_t(A), int32_t(A + B), -1};          // what it reads
    }
    const cuda::AttentionPlan plan =
        cuda::plan_attention(ar.data(), B, nh, nkv, hd, cuda::verify_tiles_enabled(), dev_.multiprocessors());
    const bool tiled = !plan.tiles.empty();
    const int64_t n_single = tiled ? int64_t(plan.single.size()) : 0, n_tiles = int64_t(plan.tiles.size());
    const int64_t splits = plan.splits.splits, split_len = plan.splits.split_len;
    cuda::PackedOffsets po;
    const size_t o_ids = po.place(size_t(B) * 4), o_pos = po.place(size_t(B) * 4),
                 o_wr = po.place(size_t(B) * sizeof(DecodeRow)), o_ar = po.place(size_t(B) * sizeof(DecodeRow)),
                 o_single = po.place(size_t(n_single) * 4), o_tiles = po.place(size_t(n_tiles) * sizeof(cuda::AttentionTile)),
                 off = po.bytes();
    ensure(B, B * nh * splits * (hd + 2), off);
    uint8_t* hb = staged_.ensure(off);
    std::memcpy(hb + o_ids, ids.data(), size_t(B) * 4);
    std::memcpy(hb + o_pos, pos.data(), size_t(B) * 4);
    std::memcpy(hb + o_wr, wr.data(), size_t(B) * sizeof(DecodeRow));
    std::memcpy(hb + o_ar, ar.data(), size_t(B) * sizeof(DecodeRow));
    if (n_single > 0) std::memcpy(hb + o_single, plan.single.data(), size_t(n_single) * 4);
    if (tiled) std::memcpy(hb + o_tiles, plan.tiles.data(), size_t(n_tiles) * sizeof(cuda::AttentionTile));
    Acts& a = *acts_;
    cudaStream_t s = dev_.stream();
    CUDA_CHECK(cudaMemcpyAsync(a.inputs, hb, off, cudaMemcpyHostToDevice, s));
    const auto* d_ids = reinterpret_cast<const int32_t*>(a.inputs + o_ids);
    const auto* d_pos = reinterpret_cast<const int32_t*>(a.inputs + o_pos);
    const auto* d_wr = reinterpret_cast<const DecodeRow*>(a.inputs + o_wr);
    const auto* d_ar = reinterpret_cast<const DecodeRow*>(a.inputs + o_ar);
    const cuda::AttentionWork work{reinterpret_cast<const int32_t*>(a.inputs + o_single), n_single,
                                   reinterpret_cast<const cuda::AttentionTile*>(a.inputs + o_tiles), n_tiles};
    graphs_.run(fmt::format("block/{}/{}/{}/{}/{}/{}", n, top_k, splits, split_len, n_single, n_tiles), s, [&] {
      cuda::embedding_forward(a.x, d_ids, embed_, B, H, c.V, s);
      const bf16* pending = nullptr;  // the last MLP's output, added with the next norm
      for (const LayerDev& L : layers_) {
        cuda::add_rmsnorm_forward(a.xn, a.x, pending, L.in_ln, B, H, eps, s);
        dev_.gemm().forward(a.qkv, a.xn, L.wqkv, B, H, ld, s);
        cuda::head_rmsnorm_forward(a.qkv, ld, L.q_norm, B, nh, hd, eps, s);
        cuda::head_rmsnorm_forward(a.qkv + qd, ld, L.k_norm, B, nkv, hd, eps, s);
        cuda::rope_kv_cache_write(L.kc, L.vc, a.qkv, ld, d_pos, inv_freq_, d_wr, B, nh, nkv, hd, cap_, s);
        cuda::decode_attention(a.att, a.part, a.qkv, ld, L.kc, L.vc, d_ar, nullptr, B, nh, nkv, hd, cap_, splits,
                               split_len, s, nullptr, tiled ? &work : nullptr);
        dev_.gemm().forward(a.tmp, a.att, L.wo, B, qd, H, s);
        cuda::add_rmsnorm_forward(a.xn, a.x, a.tmp, L.post_ln, B, H, eps, s);
        dev_.gemm().forward(a.gu, a.xn, L.wgu, B, H, 2 * I, s);
        cuda::swiglu_forward(a.act, a.gu, B, I, s);
        dev_.gemm().forward(a.tmp, a.act, L.down, B, I, H, s);
        pending = a.tmp;
      }
      cuda::add_rmsnorm_forward(a.xn, a.x, pending, norm_, B, H, eps, s);
      dev_.gemm().forward(a.lg32, a.xn + H, lm_head_, n, H, Vd, s);  // slots 1..n
      if (top_k > 0) cuda::topk_logsoftmax(a.top_ids, a.top_lp, a.lg32, n, Vd, top_k, s);
    });
    if (logits) CUDA_CHECK(cudaMemcpyAsync(logits, a.lg32, size_t(n * Vd) * 4, cudaMemcpyDeviceToHost, s));
    if (top_k > 0) {
      CUDA_CHECK(cudaMemcpyAsync(top_ids, a.top_ids, size_t(n * top_k) * 4, cudaMemcpyDeviceToHost, s));
      CUDA_CHECK(cudaMemcpyAsync(top_lp, a.top_lp, size_t(n * top_k) * 4, cudaMemcpyDeviceToHost, s));
    }
    CUDA_CHECK(cudaStreamSynchronize(s));
  }

 private:
  struct LayerDev {
    bf16 *in_ln, *wqkv, *q_norm, *k_norm, *wo, *post_ln, *wgu, *down, *kc, *vc;
  };
  struct Acts {
    DeviceArena arena;
    int64_t n = 0, n_part = 0, n_inputs = 0;
    float *x, *part, *lg32, *top_lp;
    bf16 *auxb, *xn, *qkv, *att, *tmp, *gu, *act;
    int32_t* top_ids;
    uint8_t* inputs;
  };

  // Activations for n rows (context rows or a block), attention partials, packed inputs.
  // Graphs hold the buffers' addresses: growing them drops every graph.
  void ensure(int64_t n, int64_t part, size_t input_bytes) {
    n = std::max<int64_t>(n, c_.block);
    if (acts_ && acts_->n >= n && acts_->n_part >= part && acts_->n_inputs >= int64_t(input_bytes)) return;
    const auto& c = c_;
    const int64_t nn = std::max<int64_t>({n, acts_ ? acts_->n : 0, 1});
    const int64_t np = std::max<int64_t>({part, acts_ ? acts_->n_part : 0, 1});
    const int64_t ni = std::max<int64_t>({int64_t(input_bytes), acts_ ? acts_->n_inputs : 0, 1});
    const int64_t H = c.H, qd = c.n_heads * c.head_dim, ld = qd + 2 * c.n_kv_heads * c.head_dim;
    graphs_.clear();
    acts_.reset();
    auto a = std::make_unique<Acts>();
    a->x = a->arena.alloc<float>(size_t(nn * H));
    a->part = a->arena.alloc<float>(size_t(np));
    a->lg32 = a->arena.alloc<float>(size_t(c.block * c.Vd));
    a->top_lp = a->arena.alloc<float>(size_t(c.block * kMaxTop));
    a->top_ids = a->arena.alloc<int32_t>(size_t(c.block * kMaxTop));
    a->auxb = a->arena.alloc<bf16>(size_t(nn * c.n_aux * H));
    a->xn = a->arena.alloc<bf16>(size_t(nn * H));
    a->qkv = a->arena.alloc<bf16>(size_t(nn * ld));
    a->att = a->arena.alloc<bf16>(size_t(c.block * qd));
    a->tmp = a->arena.alloc<bf16>(size_t(nn * H));
    a->gu = a->arena.alloc<bf16>(size_t(c.block * 2 * c.I));
    a->act = a->arena.alloc<bf16>(size_t(c.block * c.I));
    a->inputs = a->arena.alloc<uint8_t>(size_t(ni));
    a->n = nn, a->n_part = np, a->n_inputs = ni;
    acts_ = std::move(a);
  }

  cuda::Device dev_;  // first: destroyed last (device.h)
  dflash::Config c_;
  int64_t cap_ = 0, rows_ = 0;
  bf16 *fc_, *hidden_norm_, *norm_, *lm_head_, *embed_;
  float* inv_freq_;
  std::vector<LayerDev> layers_;
  std::unique_ptr<Acts> acts_;
  cuda::PinnedBuffer staged_;  // the packed inputs on their way up
  cuda::GraphCache graphs_;
};

}  // namespace

std::unique_ptr<DFlashBackend> make_cuda_dflash_backend(const DraftModel& m, const Checkpoint& target, int device,
                                                        int64_t max_rows) {
  return std::make_unique<CudaDFlashBackend>(m, target, device, max_rows);
}

}  // namespace talon::spec
