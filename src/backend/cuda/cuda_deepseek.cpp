// The CUDA forward for the DeepSeek-V2/V3 family (Kimi-K2 included) on one GPU: the CPU
// reference's steps (src/backend/cpu/cpu_deepseek.cpp) with bf16 weights and activations,
// an fp32 residual stream, MLA in its expanded form (keys and values per head, v padded to
// the qk head size so the packed attention kernel runs it) and the MoE of moe.h: routing
// in fp32 on an fp32-normalized input, experts as grouped GEMMs, int4 experts kept int4.
// Other weights (plain, FP8 block) are dequantized to bf16 at load, one matrix at a time.
// Captures are h[l], the input of layer l, and h[L] before the final norm, as everywhere.
//
// Not yet: tensor / expert parallelism, the absorbed MLA form, tensor-core expert GEMMs,
// FP8 kept in FP8.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "backend/cuda/check.h"
#include "backend/cuda/deepseek_ops.h"
#include "backend/cuda/moe.h"
#include "backend/cuda/moe_weights.h"
#include "backend/cuda/ops.h"
#include "backend/cuda/weights.h"
#include "model/deepseek.h"
#include "model/model.h"
#include "util/dtype.h"
#include "util/error.h"
#include "util/log.h"

namespace talon {

namespace {

using cuda::bf16;
using cuda::DeviceArena;

constexpr float kLatentNormEps = 1e-6f;  // q_a / kv_a layernorms (transformers' RMSNorm default)

// Dequantized (any storage) and stacked row-wise: [sum of rows, cols] bf16.
bf16* upload_linear(std::initializer_list<const QuantWeight*> ws, DeviceArena& arena) {
  size_t n = 0;
  for (const QuantWeight* w : ws) n += size_t(w->rows * w->cols);
  bf16* d = arena.alloc<bf16>(n);
  size_t at = 0;
  std::vector<float> f;
  for (const QuantWeight* w : ws) {
    f.resize(size_t(w->rows * w->cols));
    dequantize(*w, f.data());
    cuda::copy_bf16(d + at, f.data(), f.size());
    at += f.size();
  }
  return d;
}

struct LayerDev {
  bf16 *attn_norm, *mlp_norm, *q_a_norm = nullptr, *kv_a_norm;
  bf16 *q = nullptr, *q_a = nullptr, *kv_a, *kv_b, *o;
  bf16 *gu = nullptr, *down = nullptr;  // dense MLP, or the shared experts (null when none)
  int64_t inter = 0;
  bool moe = false;
  float* router = nullptr;  // [E, H] fp32
  cuda::MoeLayerDev experts;
};

class CudaDeepseekModel final : public Model {
 public:
  CudaDeepseekModel(const Checkpoint& ckpt, int device) : cfg_(ckpt.config()), device_(device) {
    CUDA_CHECK(cudaSetDevice(device_));
    const ModelConfig& c = cfg_;
    const DeepseekConfig& d = c.ds;
    const DeepseekWeights w = bind_deepseek_weights(ckpt);
    embed_ = cuda::upload_weight(w.embed, arena_);
    lm_head_ = cuda::upload_weight(w.lm_head, arena_);
    final_norm_ = cuda::upload_weight(w.final_norm, arena_);
    for (const DeepseekLayer& l : w.layers) {
      LayerDev L;
      L.attn_norm = cuda::upload_weight(l.attn_norm, arena_);
      L.mlp_norm = cuda::upload_weight(l.mlp_norm, arena_);
      L.kv_a_norm = cuda::upload_weight(l.kv_a_norm, arena_);
      if (d.q_lora_rank > 0) {
        L.q_a_norm = cuda::upload_weight(l.q_a_norm, arena_);
        L.q_a = upload_linear({&l.q_a}, arena_);
        L.q = upload_linear({&l.q_b}, arena_);
      } else {
        L.q = upload_linear({&l.q_proj}, arena_);
      }
      L.kv_a = upload_linear({&l.kv_a}, arena_);
      L.kv_b = upload_linear({&l.kv_b}, arena_);
      L.o = upload_linear({&l.o_proj}, arena_);
      L.moe = l.moe;
      const DeepseekMlp* mlp = l.moe ? (l.shared.gate.empty() ? nullptr : &l.shared) : &l.dense;
      if (mlp) {
        L.inter = mlp->gate.rows;
        L.gu = upload_linear({&mlp->gate, &mlp->up}, arena_);
        L.down = upload_linear({&mlp->down}, arena_);
      }
      if (l.moe) {
        const std::vector<float> r = weight_to_f32(l.router);
        L.router = arena_.alloc<float>(r.size());
        CUDA_CHECK(cudaMemcpy(L.router, r.data(), r.size() * 4, cudaMemcpyHostToDevice));
        L.experts = cuda::upload_moe_layer(l, c, arena_);
      }
      layers_.push_back(L);
    }
    const std::vector<float> inv = rope_inv_freq(c.rope, d.qk_rope_head_dim);
    inv_freq_ = arena_.alloc<float>(inv.size());
    CUDA_CHECK(cudaMemcpy(inv_freq_, inv.data(), inv.size() * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    gemm_ = std::make_unique<cuda::Gemm>();
    tlog::info("cuda:{}: {} weights on the device: {:.2f} GiB", device_, arch_name(c.arch),
               double(arena_.bytes()) / double(1ll << 30));
  }

  ~CudaDeepseekModel() override {
    cudaSetDevice(device_);
    if (stream_) cudaStreamSynchronize(stream_);
    acts_.reset();
    gemm_.reset();
    if (stream_) cudaStreamDestroy(stream_);
  }

  const ModelConfig& config() const override { return cfg_; }
  std::string backend() const override { return "cuda:" + std::to_string(device_); }

  void forward(const Batch& b, const Capture& cap, float* logits) override {
    CUDA_CHECK(cudaSetDevice(device_));
    const ModelConfig& c = cfg_;
    const DeepseekConfig& d = c.ds;
    const int64_t N = b.n_tokens(), H = c.hidden, V = c.vocab, nh = c.n_heads;
    const int64_t nope = d.qk_nope_head_dim, rope = d.qk_rope_head_dim, qk = nope + rope, vd = d.v_head_dim;
    const int64_t kvr = d.kv_lora_rank, qr = d.q_lora_rank;
    const float eps = float(c.rms_eps);
    cap.validate(c.n_layers, b);
    if (N == 0) return;
    for (int64_t i = 0; i < N; ++i)
      TALON_CHECK(b.tokens[size_t(i)] >= 0 && b.tokens[size_t(i)] < V, "token id {} at {} outside [0, {})",
                  b.tokens[size_t(i)], i, V);
    const std::vector<int32_t> pos = b.positions();
    const std::vector<int64_t> dst = cap.dst_rows(b);
    std::vector<int32_t> row_seq(static_cast<size_t>(N));
    for (int64_t s = 0; s < b.n_seqs(); ++s)
      for (int64_t r = b.seq_start[size_t(s)]; r < b.seq_start[size_t(s + 1)]; ++r) row_seq[size_t(r)] = int32_t(s);
    ensure_acts(N, b.n_seqs());
    Acts& a = *acts_;
    cudaStream_t s = stream_;
    CUDA_CHECK(cudaMemcpyAsync(a.ids, b.tokens.data(), size_t(N) * 4, cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(a.pos, pos.data(), size_t(N) * 4, cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(a.row_seq, row_seq.data(), size_t(N) * 4, cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(a.seq_start, b.seq_start.data(), b.seq_start.size() * 8, cudaMemcpyHostToDevice, s));

    // h[layer_id] = the residual stream, rows scattered to their destinations (runs of
    // consecutive destination rows go in one copy).
    const size_t esz = dtype_size(cap.dtype);
    auto capture = [&](int64_t layer_id) {
      for (size_t i = 0; i < cap.layers.size(); ++i) {
        if (cap.layers[i] != layer_id) continue;
        const uint8_t* src = reinterpret_cast<const uint8_t*>(a.x);
        if (cap.dtype == DType::BF16) {
          cuda::f32_to_bf16(a.cap, a.x, N * H, s);
          src = reinterpret_cast<const uint8_t*>(a.cap);
        }
        const int64_t ld = cap.stride(i, H);
        for (int64_t r = 0; r < N;) {
          int64_t e = r + 1;
          while (e < N && dst[size_t(e)] == dst[size_t(e - 1)] + 1) ++e;
          CUDA_CHECK(cudaMemcpy2DAsync(static_cast<uint8_t*>(cap.out[i]) + size_t(dst[size_t(r)] * ld) * esz,
                                       size_t(ld) * esz, src + size_t(r * H) * esz, size_t(H) * esz, size_t(H) * esz,
                                       size_t(e - r), cudaMemcpyDeviceToHost, s));
          r = e;
        }
      }
    };
    const float q_scale = float(d.softmax_scale * std::sqrt(double(qk)));
    cuda::embedding_forward(a.x, a.ids, embed_, N, H, V, s);
    const bf16* pending = nullptr;  // a branch output not yet added to x
    for (int64_t l = 0; l < c.n_layers; ++l) {
      const LayerDev& L = layers_[size_t(l)];
      if (pending) {
        cuda::add_rmsnorm_forward(a.xn, a.x, pending, L.attn_norm, N, H, eps, s);
        capture(l);
      } else {
        capture(l);
        cuda::add_rmsnorm_forward(a.xn, a.x, nullptr, L.attn_norm, N, H, eps, s);
      }
      // ---- MLA
      if (qr > 0) {
        gemm_->forward(a.qa, a.xn, L.q_a, N, H, qr, s);
        cuda::bf16_to_f32(a.t32, a.qa, N * qr, s);
        cuda::add_rmsnorm_forward(a.qa, a.t32, nullptr, L.q_a_norm, N, qr, kLatentNormEps, s);
        gemm_->forward(a.q, a.qa, L.q, N, qr, nh * qk, s);
      } else {
        gemm_->forward(a.q, a.xn, L.q, N, H, nh * qk, s);
      }
      gemm_->forward(a.ckv, a.xn, L.kv_a, N, H, kvr + rope, s);
      CUDA_CHECK(cudaMemcpy2DAsync(a.lat, size_t(kvr) * 2, a.ckv, size_t(kvr + rope) * 2, size_t(kvr) * 2, size_t(N),
                                   cudaMemcpyDeviceToDevice, s));
      cuda::bf16_to_f32(a.t32, a.lat, N * kvr, s);
      cuda::add_rmsnorm_forward(a.lat, a.t32, nullptr, L.kv_a_norm, N, kvr, kLatentNormEps, s);
      gemm_->forward(a.kv, a.lat, L.kv_b, N, kvr, nh * (nope + vd), s);
      cuda::mla_assemble(a.qkv, a.q, a.kv, a.ckv, kvr + rope, kvr, a.pos, inv_freq_, N, nh, nope, rope, vd,
                         d.rope_interleave, float(c.rope.attention_factor), q_scale, s);
      cuda::attention_forward(a.att, a.qkv, 3 * nh * qk, a.seq_start, a.row_seq, N, nh, nh, qk, 0, s);
      cuda::unpad_heads(a.attv, a.att, N, nh, qk, vd, s);
      gemm_->forward(a.tmp, a.attv, L.o, N, nh * vd, H, s);
      cuda::add_rmsnorm_forward(a.xn, a.x, a.tmp, L.mlp_norm, N, H, eps, s);
      // ---- MLP: dense, or routed experts (+ shared experts)
      pending = nullptr;
      if (L.moe) {
        const auto& r = L.experts.routing;
        cuda::rmsnorm_f32(a.xn32, a.x, L.mlp_norm, N, H, eps, s);
        cuda::router_logits_f32(a.rlog, a.xn32, L.router, N, r.n_experts, H, s);
        cuda::moe_forward(a.moe_out, a.xn, a.rlog, L.experts.router_bias, N, H, r, L.experts.experts, a.moe, s);
        cuda::add_f32(a.x, a.moe_out, N * H, s);
      }
      if (L.gu) {
        gemm_->forward(a.gu, a.xn, L.gu, N, H, 2 * L.inter, s);
        cuda::swiglu_forward(a.act, a.gu, N, L.inter, s);
        gemm_->forward(a.tmp, a.act, L.down, N, L.inter, H, s);
        pending = a.tmp;
      }
    }
    cuda::add_rmsnorm_forward(a.xn, a.x, pending, final_norm_, N, H, eps, s);
    capture(c.n_layers);
    if (logits) {
      gemm_->forward(a.logits, a.xn, lm_head_, N, H, V, s);
      cuda::bf16_to_f32(a.logits32, a.logits, N * V, s);
      CUDA_CHECK(cudaMemcpyAsync(logits, a.logits32, size_t(N * V) * 4, cudaMemcpyDeviceToHost, s));
    }
    CUDA_CHECK(cudaStreamSynchronize(s));
  }

 private:
  struct Acts {
    DeviceArena arena;
    int64_t n = 0, seqs = 0;
    float *x, *t32, *xn32, *rlog, *moe_out, *logits32;
    bf16 *xn, *cap, *qa, *q, *ckv, *lat, *kv, *qkv, *att, *attv, *tmp, *gu, *act, *logits;
    int32_t *ids, *pos, *row_seq;
    int64_t* seq_start;
    cuda::MoeScratch moe;
  };

  void ensure_acts(int64_t N, int64_t S) {
    if (acts_ && acts_->n >= N && acts_->seqs >= S) return;
    const int64_t n = std::max<int64_t>(N, acts_ ? acts_->n : 0), sq = std::max<int64_t>(S, acts_ ? acts_->seqs : 0);
    const ModelConfig& c = cfg_;
    const DeepseekConfig& d = c.ds;
    const int64_t H = c.hidden, nh = c.n_heads, qk = d.qk_head_dim(), vd = d.v_head_dim, kvr = d.kv_lora_rank;
    const int64_t rope = d.qk_rope_head_dim, qr = std::max<int64_t>(d.q_lora_rank, 1);
    int64_t inter = 1, E = 1;
    for (const auto& L : layers_) {
      inter = std::max(inter, L.inter);
      if (L.moe) E = std::max<int64_t>(E, L.experts.routing.n_experts);
    }
    acts_.reset();
    auto a = std::make_unique<Acts>();
    auto& ar = a->arena;
    a->x = ar.alloc<float>(size_t(n * H));
    a->t32 = ar.alloc<float>(size_t(n * std::max(qr, kvr)));
    a->xn32 = ar.alloc<float>(size_t(n * H));
    a->rlog = ar.alloc<float>(size_t(n * E));
    a->moe_out = ar.alloc<float>(size_t(n * H));
    a->logits32 = ar.alloc<float>(size_t(n * c.vocab));
    a->xn = ar.alloc<bf16>(size_t(n * H));
    a->cap = ar.alloc<bf16>(size_t(n * H));
    a->qa = ar.alloc<bf16>(size_t(n * qr));
    a->q = ar.alloc<bf16>(size_t(n * nh * qk));
    a->ckv = ar.alloc<bf16>(size_t(n * (kvr + rope)));
    a->lat = ar.alloc<bf16>(size_t(n * kvr));
    a->kv = ar.alloc<bf16>(size_t(n * nh * (d.qk_nope_head_dim + vd)));
    a->qkv = ar.alloc<bf16>(size_t(n * 3 * nh * qk));
    a->att = ar.alloc<bf16>(size_t(n * nh * qk));
    a->attv = ar.alloc<bf16>(size_t(n * nh * vd));
    a->tmp = ar.alloc<bf16>(size_t(n * H));
    a->gu = ar.alloc<bf16>(size_t(n * 2 * inter));
    a->act = ar.alloc<bf16>(size_t(n * inter));
    a->logits = ar.alloc<bf16>(size_t(n * c.vocab));
    a->ids = ar.alloc<int32_t>(size_t(n));
    a->pos = ar.alloc<int32_t>(size_t(n));
    a->row_seq = ar.alloc<int32_t>(size_t(n));
    a->seq_start = ar.alloc<int64_t>(size_t(sq + 1));
    const LayerDev* moe_layer = nullptr;
    for (const auto& L : layers_)
      if (L.moe) moe_layer = &L;
    if (moe_layer) {
      const auto& r = moe_layer->experts.routing;
      const auto sz = cuda::moe_scratch_elems(n, r, H, moe_layer->experts.experts.gate.O);
      auto& m = a->moe;
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
    a->n = n, a->seqs = sq;
    acts_ = std::move(a);
  }

  ModelConfig cfg_;
  int device_;
  cudaStream_t stream_ = nullptr;
  DeviceArena arena_;
  std::unique_ptr<cuda::Gemm> gemm_;
  bf16 *embed_, *lm_head_, *final_norm_;
  float* inv_freq_;
  std::vector<LayerDev> layers_;
  std::unique_ptr<Acts> acts_;
};

}  // namespace

std::unique_ptr<Model> make_cuda_deepseek_model(const Checkpoint& ckpt, int device) {
  TALON_CHECK(is_deepseek(ckpt.config().arch), "{}: not a DeepSeek-family model", ckpt.source());
  return std::make_unique<CudaDeepseekModel>(ckpt, device);
}

}  // namespace talon
