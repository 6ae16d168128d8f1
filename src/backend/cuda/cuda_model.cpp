// The CUDA forward for the dense decoder family: same steps as the CPU reference
// (src/backend/cpu/cpu_model.cpp), bf16 weights/activations, fp32 residual stream.
// q|k|v and gate|up are fused into one GEMM each. Under tensor parallelism each rank
// holds a slice of the heads and of the MLP width (Megatron layout) and the partial
// outputs of o_proj and down_proj are summed across ranks by the all-reduce callback.
//
// Captures: at each captured layer the residual stream is converted into a per-layer
// device buffer on the compute stream; a second stream copies it to the host while
// later layers compute (page-locked destinations from host_buffer() make this truly
// asynchronous), scattering each sequence to its destination rows.
#include "backend/cuda/cuda_model.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/backend.h"
#include "backend/cuda/check.h"
#include "backend/cuda/cudnn_sdpa.h"
#include "backend/cuda/dense_block.h"
#include "backend/cuda/device.h"
#include "backend/cuda/ops.h"
#include "backend/cuda/weights.h"
#include "model/dense.h"
#include "util/error.h"
#include "util/log.h"

namespace talon {

namespace {

using cuda::bf16;
using cuda::DeviceArena;

bool force_warp_attention();

class CudaDenseModel final : public Model {
 public:
  CudaDenseModel(const Checkpoint& ckpt, const cuda::RankOptions& ro, const GpuOptions& go)
      : dev_(ro.device, "model", /*copy_stream=*/true), cfg_(ckpt.config()), ro_(ro) {
    const int tp = ro_.size, rk = ro_.rank;
    w_ = cuda::upload_dense_weights(ckpt, dev_.index(), rk, tp, dev_.arena());
    // Everything the planned batch size needs is allocated now, so a run cannot hit
    // an out-of-memory error halfway.
    if (go.max_tokens > 0) {
      ensure_activations(go.max_tokens, go.max_tokens, false);
      if (rk == 0) ensure_capture_buffers(go.n_capture, dtype_size(go.capture_dtype), go.max_tokens);
    }
    const auto [free_b, total_b] = dev_.memory();
    tlog::debug("{}: weights {:.1f} MiB; {:.1f} of {:.1f} GiB free after planning", dev_.name(),
                double(dev_.arena().bytes()) / (1 << 20), double(free_b) / (1 << 30), double(total_b) / (1 << 30));
  }

  const ModelConfig& config() const override { return cfg_; }
  std::string backend() const override { return dev_.name(); }

  std::shared_ptr<uint8_t> host_buffer(size_t bytes) override {
    dev_.activate();
    void* p = nullptr;
    CUDA_CHECK(cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocPortable));
    return std::shared_ptr<uint8_t>(static_cast<uint8_t*>(p), [](uint8_t* q) { cudaFreeHost(q); });
  }

  void forward(const Batch& b, const Capture& cap, float* logits) override {
    dev_.activate();
    const ModelConfig& c = cfg_;
    const int64_t N = b.n_tokens(), H = c.hidden, hd = c.head_dim, V = c.vocab;
    const int64_t nh = w_.nh, nkv = w_.nkv, ldqkv = (nh + 2 * nkv) * hd;
    cudaStream_t stream = dev_.stream(), copy = dev_.copy_stream();
    cap.validate(c.n_layers, b);
    for (int64_t i = 0; i < N; ++i)
      TALON_CHECK(b.tokens[size_t(i)] >= 0 && b.tokens[size_t(i)] < V, "token id {} at position {} is outside the vocabulary [0, {})",
                  b.tokens[size_t(i)], i, V);
    ensure_activations(N, b.n_seqs(), logits != nullptr);
    const size_t esz = dtype_size(cap.dtype);
    ensure_capture_buffers(int64_t(cap.layers.size()), esz, N);
    Acts& a = *acts_;

    std::vector<int32_t> pos(static_cast<size_t>(N)), row_seq(static_cast<size_t>(N));
    for (int64_t s = 0; s < b.n_seqs(); ++s)
      for (int64_t r = b.seq_start[size_t(s)]; r < b.seq_start[size_t(s + 1)]; ++r) {
        pos[size_t(r)] = int32_t(r - b.seq_start[size_t(s)]);
        row_seq[size_t(r)] = int32_t(s);
      }
    // TALON_ATTENTION=cudnn|auto: cuDNN's fused attention, on the fused qkv buffer as it is, where
    // cuDNN serves the model (else the kernels below, said once).
    if (cuda::prefill_attention_cudnn()) {
      cuda::SdpaShape sh{int(nh), int(nkv), int(hd), float(1.0 / std::sqrt(double(hd))), a.cap_tokens};
      sh.ld_q = sh.ld_k = sh.ld_v = ldqkv;
      sh.backward = false;
      cuda::prefill_make(cudnn_, cudnn_off_, sh,
                         c.sliding_window > 0 ? fmt::format("sliding-window attention (window {})", c.sliding_window) : "",
                         stream, dev_.index());
    }
    CUDA_CHECK(cudaMemcpyAsync(a.ids, b.tokens.data(), size_t(N) * 4, cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaMemcpyAsync(a.pos, pos.data(), size_t(N) * 4, cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaMemcpyAsync(a.row_seq, row_seq.data(), size_t(N) * 4, cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaMemcpyAsync(a.seq_start, b.seq_start.data(), b.seq_start.size() * 8, cudaMemcpyHostToDevice, stream));
    cuda::prefill_set_batch(cudnn_, cudnn_off_, b.seq_start, a.seq_start, dev_.index());
    const bool flash = !cudnn_ && cuda::flash_attention_supported(hd) && !force_warp_attention();
    const std::vector<int32_t> tiles = flash ? cuda::attention_tiles(b.seq_start.data(), b.n_seqs()) : std::vector<int32_t>{};
    if (flash) CUDA_CHECK(cudaMemcpyAsync(a.tiles, tiles.data(), tiles.size() * 4, cudaMemcpyHostToDevice, stream));

    // Copy segments: runs of sequences whose destination rows are consecutive.
    struct Seg {
      int64_t src, dst, rows;
    };
    std::vector<Seg> segs;
    for (int64_t s = 0; s < b.n_seqs(); ++s) {
      const int64_t r0 = b.seq_start[size_t(s)], n = b.seq_start[size_t(s + 1)] - r0, d = cap.dst_row(b, s, r0);
      if (!segs.empty() && segs.back().src + segs.back().rows == r0 && segs.back().dst + segs.back().rows == d)
        segs.back().rows += n;
      else if (n > 0)
        segs.push_back({r0, d, n});
    }
    auto capture = [&](int64_t layer_id) {
      for (size_t i = 0; i < cap.layers.size(); ++i) {
        if (cap.layers[i] != layer_id) continue;
        void* buf = caps_->bufs[i];
        if (cap.dtype == DType::F32)
          CUDA_CHECK(cudaMemcpyAsync(buf, a.x, size_t(N * H) * 4, cudaMemcpyDeviceToDevice, stream));
        else
          cuda::f32_to_bf16(static_cast<bf16*>(buf), a.x, N * H, stream);
        CUDA_CHECK(cudaEventRecord(dev_.event(i), stream));
        CUDA_CHECK(cudaStreamWaitEvent(copy, dev_.event(i), 0));
        const int64_t ld = cap.stride(i, H);
        for (const Seg& g : segs)
          CUDA_CHECK(cudaMemcpy2DAsync(static_cast<uint8_t*>(cap.out[i]) + size_t(g.dst * ld) * esz, size_t(ld) * esz,
                                       static_cast<const uint8_t*>(buf) + size_t(g.src * H) * esz, size_t(H) * esz,
                                       size_t(H) * esz, size_t(g.rows), cudaMemcpyDeviceToHost, copy));
      }
    };
    cuda::DenseHooks hooks;
    hooks.capture = capture;
    hooks.attention = [&](int64_t, bool) {
      if (cudnn_)
        cudnn_->forward(a.att, nullptr, a.qkv, a.qkv + nh * hd, a.qkv + (nh + nkv) * hd);
      else if (flash)
        cuda::flash_attention_forward(a.att, a.qkv, ldqkv, a.seq_start, a.tiles, int64_t(tiles.size() / 2), nh, nkv,
                                      hd, c.sliding_window, stream);
      else
        cuda::attention_forward(a.att, a.qkv, ldqkv, a.seq_start, a.row_seq, N, nh, nkv, hd, c.sliding_window,
                                stream);
    };
    hooks.allreduce = ro_.allreduce;
    cuda::dense_stack_forward(w_, c, N, {a.ids, a.pos, a.x, a.xn, a.qkv, a.att, a.tmp, a.gu, a.act}, dev_.gemm(),
                              stream, hooks);
    if (logits) {
      dev_.gemm().forward(a.logits, a.xn, w_.lm_head, N, H, V, stream);
      cuda::bf16_to_f32(a.logits32, a.logits, N * V, stream);
      CUDA_CHECK(cudaMemcpyAsync(logits, a.logits32, size_t(N * V) * 4, cudaMemcpyDeviceToHost, stream));
    }
    dev_.sync();
  }

 private:
  struct Acts {
    DeviceArena arena;
    int64_t cap_tokens = 0, cap_seqs = 0;
    bool has_logits = false;
    float *x, *logits32 = nullptr;
    bf16 *xn, *qkv, *att, *tmp, *gu, *act, *logits = nullptr;
    int32_t *ids, *pos, *row_seq, *tiles;
    int64_t* seq_start;
  };
  struct CapBufs {
    DeviceArena arena;
    int64_t n = 0, tokens = 0;
    size_t esz = 0;
    std::vector<void*> bufs;
  };

  void ensure_capture_buffers(int64_t n, size_t esz, int64_t tokens) {
    if (n > 0) dev_.event(size_t(n - 1));
    if (n == 0 || (caps_ && caps_->n >= n && caps_->esz >= esz && caps_->tokens >= tokens)) return;
    const int64_t nn = std::max<int64_t>(n, caps_ ? caps_->n : 0), tk = std::max<int64_t>(tokens, caps_ ? caps_->tokens : 0);
    const size_t e = std::max(esz, caps_ ? caps_->esz : 0);
    caps_.reset();
    auto c = std::make_unique<CapBufs>();
    for (int64_t i = 0; i < nn; ++i) c->bufs.push_back(c->arena.alloc<uint8_t>(size_t(tk * cfg_.hidden) * e));
    c->n = nn;
    c->tokens = tk;
    c->esz = e;
    caps_ = std::move(c);
  }

  void ensure_activations(int64_t N, int64_t S, bool want_logits) {
    if (acts_ && acts_->cap_tokens >= N && acts_->cap_seqs >= S && (acts_->has_logits || !want_logits)) return;
    const ModelConfig& c = cfg_;
    const int64_t n = std::max<int64_t>(N, acts_ ? acts_->cap_tokens : 0);
    const int64_t s = std::max<int64_t>(S, acts_ ? acts_->cap_seqs : 0);
    const bool lg = want_logits || (acts_ && acts_->has_logits);
    acts_.reset();
    auto a = std::make_unique<Acts>();
    const int64_t qd = w_.nh * c.head_dim, ld = qd + 2 * w_.nkv * c.head_dim;
    a->x = a->arena.alloc<float>(size_t(n * c.hidden));
    a->xn = a->arena.alloc<bf16>(size_t(n * c.hidden));
    a->qkv = a->arena.alloc<bf16>(size_t(n * ld));
    a->att = a->arena.alloc<bf16>(size_t(n * qd));
    a->tmp = a->arena.alloc<bf16>(size_t(n * c.hidden));
    a->gu = a->arena.alloc<bf16>(size_t(n * 2 * w_.inter));
    a->act = a->arena.alloc<bf16>(size_t(n * w_.inter));
    if (lg) {
      a->logits = a->arena.alloc<bf16>(size_t(n * c.vocab));
      a->logits32 = a->arena.alloc<float>(size_t(n * c.vocab));
    }
    a->ids = a->arena.alloc<int32_t>(size_t(n));
    a->pos = a->arena.alloc<int32_t>(size_t(n));
    a->row_seq = a->arena.alloc<int32_t>(size_t(n));
    a->tiles = a->arena.alloc<int32_t>(size_t(2 * cuda::attention_max_tiles(n, s)));
    a->seq_start = a->arena.alloc<int64_t>(size_t(s + 1));
    a->cap_tokens = n;
    a->cap_seqs = s;
    a->has_logits = lg;
    acts_ = std::move(a);
  }

  cuda::Device dev_;  // first: destroyed last (device.h)
  ModelConfig cfg_;
  cuda::RankOptions ro_;
  cuda::DenseDeviceWeights w_;
  std::unique_ptr<Acts> acts_;
  std::unique_ptr<CapBufs> caps_;
  std::unique_ptr<cuda::CudnnSdpa> cudnn_;  // TALON_ATTENTION=cudnn|auto
  bool cudnn_off_ = false;                  // cuDNN does not serve this model
};

// TALON_ATTENTION=warp selects the one-warp-per-row kernel even where the tensor-core one
// applies (for comparisons and benchmarks).
bool force_warp_attention() {
  static const bool on = [] {
    const char* e = std::getenv("TALON_ATTENTION");
    return e && std::string(e) == "warp";
  }();
  return on;
}

std::string gib(int64_t b) { return fmt::format("{:.2f} GiB", double(b) / double(1ll << 30)); }

}  // namespace

namespace cuda {

std::unique_ptr<Model> make_rank_model(const Checkpoint& ckpt, const RankOptions& ro, const GpuOptions& go) {
  return std::make_unique<CudaDenseModel>(ckpt, ro, go);
}

void check_memory_plan(const ModelConfig& cfg, const GpuOptions& o) {
  const GpuMemoryPlan p = plan_gpu_memory(cfg, o);
  for (int d : o.devices) {
    CUDA_CHECK(cudaSetDevice(d));
    size_t free_b = 0, total_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    const int64_t fr = int64_t(free_b);
    tlog::info("cuda:{}: memory plan: weights {} + activations {} + captures {} ({} tokens) + reserve {} = {}; {} of "
               "{} free",
               d, gib(p.weights), gib(p.activations), gib(p.captures), o.max_tokens, gib(p.reserve), gib(p.total()),
               gib(fr), gib(int64_t(total_b)));
    if (p.total() <= fr) continue;
    std::string hint;
    const int64_t room = fr - p.weights - p.reserve;
    const int64_t fit_tokens = room > 0 ? room / std::max<int64_t>(1, p.per_token) : 0;
    if (fit_tokens >= 256) hint = fmt::format("--max-batch-tokens {}", (fit_tokens / 256) * 256);
    // The smallest tensor-parallel degree whose per-GPU share fits with the same budget.
    for (int tp = o.tp * 2; tp <= 64; tp *= 2) {
      GpuOptions t = o;
      t.tp = tp;
      if (cfg.n_heads % tp || cfg.n_kv_heads % tp || cfg.intermediate % tp) break;
      if (plan_gpu_memory(cfg, t).total() <= fr) {
        hint += fmt::format("{}--tp {} (on {} GPUs)", hint.empty() ? "" : " or ", tp, tp);
        break;
      }
    }
    fail("cuda:{}: the run needs {} (weights {} + activations {} + capture buffers {} for --max-batch-tokens {} + "
         "reserve {}) but only {} of {} is free; {}",
         d, gib(p.total()), gib(p.weights), gib(p.activations), gib(p.captures), o.max_tokens, gib(p.reserve),
         gib(fr), gib(int64_t(total_b)), hint.empty() ? "it does not fit on this GPU" : "try " + hint);
  }
}

}  // namespace cuda

std::vector<GpuInfo> list_gpus() {
  std::vector<GpuInfo> out;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return out;
  for (int d = 0; d < n; ++d) {
    cudaDeviceProp p{};
    size_t fr = 0, tot = 0;
    if (cudaGetDeviceProperties(&p, d) != cudaSuccess || cudaSetDevice(d) != cudaSuccess ||
        cudaMemGetInfo(&fr, &tot) != cudaSuccess)
      continue;
    out.push_back({d, p.name, int64_t(tot), int64_t(fr)});
  }
  return out;
}

}  // namespace talon
