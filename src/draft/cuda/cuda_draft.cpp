// The EAGLE-3 draft layer on one GPU (spec/draft_backend.h): the CPU reference's steps
// (spec/draft_runner.cpp) with bf16 weights, activations and cache, fp32 accumulation and
// an fp32 residual stream. Attention runs the cached decoder's flash-decoding kernel
// (decode_ops.h): the runner's rows are already in its convention, with one slot.
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
#include "model/model.h"
#include "draft/draft_backend.h"
#include "draft/draft_runner.h"
#include "util/dtype.h"
#include "util/error.h"
#include "util/log.h"

namespace talon::spec {

namespace {

using cuda::bf16;
using cuda::DecodeRow;
using cuda::DeviceArena;

// Host fp32 -> device bf16, the parts concatenated (row-major blocks stacked in order).
bf16* upload(DeviceArena& arena, std::initializer_list<const std::vector<float>*> parts) {
  size_t n = 0;
  for (const auto* p : parts) n += p->size();
  bf16* d = arena.alloc<bf16>(n);
  size_t at = 0;
  for (const auto* p : parts) {
    cuda::copy_bf16(d + at, p->data(), p->size());
    at += p->size();
  }
  return d;
}

class CudaDraftBackend final : public DraftBackend {
 public:
  static constexpr int kMaxTop = 64;  // top-k outputs per row kept on the device
  CudaDraftBackend(const DraftModel& m, const Checkpoint& target, int device, int64_t max_rows)
      : dev_(checked(device, max_rows), "draft"), c_(m.config), max_rows_(max_rows) {
    const auto& c = c_;
    const auto& w = m.weights;
    fc_ = upload(dev_.arena(), {&w.fc});
    in_ln_ = upload(dev_.arena(), {&w.in_ln});
    hidden_norm_ = upload(dev_.arena(), {&w.hidden_norm});
    wqkv_ = upload(dev_.arena(), {&w.wq, &w.wk, &w.wv});
    wo_ = upload(dev_.arena(), {&w.wo});
    post_ln_ = upload(dev_.arena(), {&w.post_ln});
    wgu_ = upload(dev_.arena(), {&w.gate, &w.up});
    wdown_ = upload(dev_.arena(), {&w.down});
    norm_ = upload(dev_.arena(), {&w.norm});
    lm_head_ = upload(dev_.arena(), {&w.lm_head});
    if (!m.embed.empty()) {  // P-EAGLE's own
      TALON_CHECK(int64_t(m.embed.size()) == c.V * c.H, "draft: its embedding has {} values, expected {} x {}",
                  m.embed.size(), c.V, c.H);
      embed_ = upload(dev_.arena(), {&m.embed});
    } else {
      const std::string name = "model.embed_tokens.weight";
      const CkptTensor* t = target.find(name);
      TALON_CHECK(t, "{}: no tensor '{}' (the draft shares the target's token embedding)", target.source(), name);
      const WeightRef e = target.weight(*t);
      TALON_CHECK(e.shape.size() == 2 && e.shape[0] == c.V && e.shape[1] == c.H, "{}: '{}' is not [{}, {}]",
                  target.source(), name, c.V, c.H);
      embed_ = cuda::upload_weight(e, dev_.arena());
    }
    const std::vector<float> inv = rope_inv_freq(c.rope, c.head_dim);
    inv_freq_ = dev_.arena().alloc<float>(inv.size());
    CUDA_CHECK(cudaMemcpy(inv_freq_, inv.data(), inv.size() * 4, cudaMemcpyHostToDevice));
    const int64_t kvd = c.n_kv_heads * c.head_dim;
    kc_ = dev_.arena().alloc<bf16>(size_t(max_rows * kvd));
    vc_ = dev_.arena().alloc<bf16>(size_t(max_rows * kvd));
    tlog::debug("cuda:{}: draft layer on the GPU, {:.1f} MiB with a cache of {} rows", dev_.index(),
                double(dev_.arena().bytes()) / double(1 << 20), max_rows);
  }

  std::string name() const override { return dev_.name(); }

  void truncate(int64_t) override {}  // rows are addressed by index; nothing to free
  int64_t graph_replays() const override { return graphs_.replays(); }

  void forward(const int32_t* tokens, const float* in, bool from_aux, const DraftRows& dr, bool last_only,
               float* hidden, float* logits, int top_k, int32_t* top_ids, float* top_lp) override {
    dev_.activate();
    const auto& c = c_;
    const int64_t N = dr.size(), H = c.H, I = c.I, nh = c.n_heads, nkv = c.n_kv_heads, hd = c.head_dim;
    const int64_t qd = nh * hd, ld = qd + 2 * nkv * hd, Vd = c.Vd;
    const float eps = float(c.rms_eps);
    if (N == 0) return;
    TALON_CHECK(top_k <= kMaxTop, "draft: top-k {} above {} on the GPU", top_k, kMaxTop);
    std::vector<DecodeRow> rows(static_cast<size_t>(N));
    for (int64_t r = 0; r < N; ++r) {
      const int32_t end = dr.end[size_t(r)];
      TALON_CHECK(end >= 1 && end <= max_rows_, "draft: row {} goes to cache row {}, outside the GPU cache of {} rows", r,
                  end - 1, max_rows_);
      TALON_CHECK(tokens[r] >= 0 && tokens[r] < c.V, "draft: token id {} (row {}) outside the vocabulary [0, {})",
                  tokens[r], r, c.V);
      rows[size_t(r)] = DecodeRow{0, 0, dr.len[size_t(r)], end, dr.mask[size_t(r)]};
    }
    // A tree step's rows share the step-0 prefix: one tile of query vectors reads it once
    // (decode_ops.h: AttentionTile).
    const cuda::AttentionPlan plan =
        cuda::plan_attention(rows.data(), N, nh, nkv, hd, cuda::verify_tiles_enabled(), dev_.multiprocessors());
    const bool tiled = !plan.tiles.empty();
    const int64_t n_single = tiled ? int64_t(plan.single.size()) : 0, n_vtiles = int64_t(plan.tiles.size());
    const int64_t splits = plan.splits.splits, split_len = plan.splits.split_len;
    const int64_t in_w = from_aux ? 3 * H : H;
    // The inputs packed at offsets fixed by the shape (a replayed graph reads them there):
    // staged in pinned memory, one copy up.
    size_t off = 0;
    auto place = [&](size_t bytes) {
      const size_t at = off;
      off += (bytes + 15) / 16 * 16;
      return at;
    };
    const size_t o_ids = place(size_t(N) * 4), o_pos = place(size_t(N) * 4), o_rows = place(size_t(N) * sizeof(DecodeRow)),
                 o_masks = place(dr.masks.size() * 8), o_in = place(size_t(N * in_w) * 4),
                 o_single = place(size_t(n_single) * 4), o_tiles = place(size_t(n_vtiles) * sizeof(cuda::AttentionTile));
    ensure_acts(N, N * nh * splits * (hd + 2), int64_t(off));
    Acts& a = *acts_;
    if (staged_bytes_ < off) {
      if (staged_) CUDA_CHECK(cudaFreeHost(staged_));
      staged_ = nullptr;
      CUDA_CHECK(cudaHostAlloc(&staged_, off, cudaHostAllocPortable));
      staged_bytes_ = off;
    }
    auto* hb = static_cast<uint8_t*>(staged_);
    std::memcpy(hb + o_ids, tokens, size_t(N) * 4);
    std::memcpy(hb + o_pos, dr.pos.data(), size_t(N) * 4);
    std::memcpy(hb + o_rows, rows.data(), size_t(N) * sizeof(DecodeRow));
    if (!dr.masks.empty()) std::memcpy(hb + o_masks, dr.masks.data(), dr.masks.size() * 8);
    std::memcpy(hb + o_in, in, size_t(N * in_w) * 4);
    if (n_single > 0) std::memcpy(hb + o_single, plan.single.data(), size_t(n_single) * 4);
    if (tiled) std::memcpy(hb + o_tiles, plan.tiles.data(), size_t(n_vtiles) * sizeof(cuda::AttentionTile));
    cudaStream_t s = dev_.stream();
    CUDA_CHECK(cudaMemcpyAsync(a.inputs, hb, off, cudaMemcpyHostToDevice, s));
    const auto* ids = reinterpret_cast<const int32_t*>(a.inputs + o_ids);
    const auto* pos = reinterpret_cast<const int32_t*>(a.inputs + o_pos);
    const auto* drows = reinterpret_cast<const DecodeRow*>(a.inputs + o_rows);
    const auto* masks = reinterpret_cast<const uint64_t*>(a.inputs + o_masks);
    const auto* din = reinterpret_cast<const float*>(a.inputs + o_in);
    const cuda::AttentionWork work{reinterpret_cast<const int32_t*>(a.inputs + o_single), n_single,
                                   reinterpret_cast<const cuda::AttentionTile*>(a.inputs + o_tiles), n_vtiles};
    const int64_t first = last_only ? N - 1 : 0, n_out = N - first;

    auto device_work = [&] {
      // Input: [norm(embedding) | norm(g)], g = fc(aux) or the parent's hidden state.
      cuda::embedding_forward(a.e, ids, embed_, N, H, c.V, s);
      // Both norms write straight into their halves of the layer input rows.
      cuda::add_rmsnorm_forward(a.xin, a.e, nullptr, in_ln_, N, H, eps, s, 2 * H);
      if (from_aux) {
        cuda::f32_to_bf16(a.aux, din, N * 3 * H, s);
        dev_.gemm().forward(a.tmp, a.aux, fc_, N, 3 * H, H, s);
        cuda::bf16_to_f32(a.x, a.tmp, N * H, s);
      } else {
        CUDA_CHECK(cudaMemcpyAsync(a.x, din, size_t(N * H) * 4, cudaMemcpyDeviceToDevice, s));
      }
      if (c.norm_before_residual) {  // the normed g is also the residual: keep a contiguous copy
        cuda::add_rmsnorm_forward(a.gn, a.x, nullptr, hidden_norm_, N, H, eps, s);
        CUDA_CHECK(cudaMemcpy2DAsync(a.xin + H, size_t(2 * H) * 2, a.gn, size_t(H) * 2, size_t(H) * 2, size_t(N),
                                     cudaMemcpyDeviceToDevice, s));
      } else {
        cuda::add_rmsnorm_forward(a.xin + H, a.x, nullptr, hidden_norm_, N, H, eps, s, 2 * H);
      }
      // Attention over the cache.
      dev_.gemm().forward(a.qkv, a.xin, wqkv_, N, 2 * H, ld, s);
      cuda::rope_kv_cache_write(kc_, vc_, a.qkv, ld, pos, inv_freq_, drows, N, nh, nkv, hd, max_rows_, s);
      cuda::decode_attention(a.att, a.part, a.qkv, ld, kc_, vc_, drows, masks, N, nh, nkv, hd, max_rows_, splits,
                             split_len, s, nullptr, tiled ? &work : nullptr);
      dev_.gemm().forward(a.tmp, a.att, wo_, N, qd, H, s);
      if (c.norm_before_residual) cuda::bf16_to_f32(a.x, a.gn, N * H, s);
      cuda::add_rmsnorm_forward(a.hm, a.x, a.tmp, post_ln_, N, H, eps, s);
      // MLP, then the final norm and the draft-vocabulary head.
      dev_.gemm().forward(a.gu, a.hm, wgu_, N, H, 2 * I, s);
      cuda::swiglu_forward(a.act, a.gu, N, I, s);
      dev_.gemm().forward(a.tmp, a.act, wdown_, N, I, H, s);
      cuda::add_rmsnorm_forward(a.hm, a.x, a.tmp, norm_, N, H, eps, s);
      dev_.gemm().forward(a.lg, a.hm + first * H, lm_head_, n_out, H, Vd, s);
      cuda::bf16_to_f32(a.lg32, a.lg, n_out * Vd, s);
      if (top_k > 0) cuda::topk_logsoftmax(a.top_ids, a.top_lp, a.lg32, n_out, Vd, top_k, s);
    };
    graphs_.run(fmt::format("{}/{}/{}/{}/{}/{}/{}/{}/{}", N, int(from_aux), int(last_only), dr.masks.size(), splits,
                            split_len, top_k, n_single, n_vtiles),
                s, device_work);
    CUDA_CHECK(cudaMemcpyAsync(hidden, a.x + first * H, size_t(n_out * H) * 4, cudaMemcpyDeviceToHost, s));
    if (logits) CUDA_CHECK(cudaMemcpyAsync(logits, a.lg32, size_t(n_out * Vd) * 4, cudaMemcpyDeviceToHost, s));
    if (top_k > 0) {
      CUDA_CHECK(cudaMemcpyAsync(top_ids, a.top_ids, size_t(n_out * top_k) * 4, cudaMemcpyDeviceToHost, s));
      CUDA_CHECK(cudaMemcpyAsync(top_lp, a.top_lp, size_t(n_out * top_k) * 4, cudaMemcpyDeviceToHost, s));
    }
    CUDA_CHECK(cudaStreamSynchronize(s));
  }

  ~CudaDraftBackend() override {
    dev_.activate();
    graphs_.clear();
    if (staged_) cudaFreeHost(staged_);
  }

 private:
  struct Acts {
    DeviceArena arena;
    int64_t n = 0, n_part = 0, n_inputs = 0;
    float *e, *x, *part, *lg32, *top_lp;
    bf16 *aux, *gn, *xin, *qkv, *att, *tmp, *hm, *gu, *act, *lg;
    int32_t* top_ids;
    uint8_t* inputs;  // the packed inputs of a forward (ids, positions, rows, masks, in)
  };

  // Graphs hold the buffers' addresses: growing them drops every graph.
  void ensure_acts(int64_t N, int64_t part, int64_t input_bytes) {
    if (acts_ && acts_->n >= N && acts_->n_part >= part && acts_->n_inputs >= input_bytes) return;
    const int64_t n = std::max<int64_t>({N, acts_ ? acts_->n : 0, 1});
    const int64_t np = std::max<int64_t>({part, acts_ ? acts_->n_part : 0, 1});
    const int64_t ni = std::max<int64_t>({input_bytes, acts_ ? acts_->n_inputs : 0, 1});
    const auto& c = c_;
    const int64_t H = c.H, qd = c.n_heads * c.head_dim, ld = qd + 2 * c.n_kv_heads * c.head_dim;
    graphs_.clear();
    acts_.reset();
    auto a = std::make_unique<Acts>();
    a->e = a->arena.alloc<float>(size_t(n * H));
    a->x = a->arena.alloc<float>(size_t(n * H));
    a->part = a->arena.alloc<float>(size_t(np));
    a->lg32 = a->arena.alloc<float>(size_t(n * c.Vd));
    a->aux = a->arena.alloc<bf16>(size_t(n * 3 * H));
    a->gn = a->arena.alloc<bf16>(size_t(n * H));
    a->xin = a->arena.alloc<bf16>(size_t(n * 2 * H));
    a->qkv = a->arena.alloc<bf16>(size_t(n * ld));
    a->att = a->arena.alloc<bf16>(size_t(n * qd));
    a->tmp = a->arena.alloc<bf16>(size_t(n * H));
    a->hm = a->arena.alloc<bf16>(size_t(n * H));
    a->gu = a->arena.alloc<bf16>(size_t(n * 2 * c.I));
    a->act = a->arena.alloc<bf16>(size_t(n * c.I));
    a->lg = a->arena.alloc<bf16>(size_t(n * c.Vd));
    a->top_ids = a->arena.alloc<int32_t>(size_t(n * kMaxTop));
    a->top_lp = a->arena.alloc<float>(size_t(n * kMaxTop));
    a->inputs = a->arena.alloc<uint8_t>(size_t(ni));
    a->n = n, a->n_part = np, a->n_inputs = ni;
    acts_ = std::move(a);
  }

  // Checked before anything is allocated.
  static int checked(int device, int64_t max_rows) {
    TALON_CHECK(max_rows > 0, "draft: the GPU cache needs max_rows > 0 (got {})", max_rows);
    return device;
  }

  cuda::Device dev_;  // first: destroyed last (device.h)
  eagle3::DraftConfig c_;
  int64_t max_rows_;
  bf16 *fc_, *in_ln_, *hidden_norm_, *wqkv_, *wo_, *post_ln_, *wgu_, *wdown_, *norm_, *lm_head_, *embed_;
  float* inv_freq_;
  bf16 *kc_, *vc_;
  std::unique_ptr<Acts> acts_;
  void* staged_ = nullptr;  // pinned staging of the packed inputs
  size_t staged_bytes_ = 0;
  cuda::GraphCache graphs_;  // of forward()'s device work, by shape
};

}  // namespace

std::unique_ptr<DraftBackend> make_cuda_draft_backend(const DraftModel& m, const Checkpoint& target, int device,
                                                      int64_t max_rows) {
  return std::make_unique<CudaDraftBackend>(m, target, device, max_rows);
}

}  // namespace talon::spec
