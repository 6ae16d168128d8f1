// The CUDA forward for the DeepSeek-V2/V3 family (Kimi-K2 included) on one GPU: the CPU
// reference's steps (src/backend/cpu/cpu_deepseek.cpp) with bf16 weights and activations,
// an fp32 residual stream, MLA in its expanded form (keys and values per head, v padded to
// the qk head size so the packed attention kernel runs it) and the MoE of moe.h: routing
// in fp32 on an fp32-normalized input, experts as grouped GEMMs, int4 experts kept int4.
// Other weights (plain, FP8 block) are dequantized to bf16 at load, one matrix at a time.
// Captures are h[l], the input of layer l, and h[L] before the final norm, as everywhere.
//
// Parallel layouts (one such model per rank, driven by the group in tp_model.cpp):
//  * tensor parallel: rank r holds heads [r nh/n, (r+1) nh/n) of MLA (q / kv_b rows, o_proj
//    columns), a slice of every dense / shared-expert MLP width, and the routed experts of its
//    window; every rank sees all tokens, and the partial attention, MLP and MoE outputs are
//    summed by fp32 all-reduces (bf16 partials would add a rounding per rank and layer, enough
//    to flip near-tie expert choices against the one-GPU model);
//  * expert parallel: attention and dense parts replicated, each rank runs its own tokens
//    (data-parallel attention) and owns one window of routed experts; a MoE layer routes
//    locally, sends each slot's row to the rank owning its expert and gets the expert
//    outputs back (two all-to-alls), then combines them exactly as one GPU does.
//
// Not yet: the absorbed MLA form, FP8 kept in FP8.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "backend/backend.h"
#include "backend/cuda/check.h"
#include "backend/cuda/cudnn_sdpa.h"
#include "backend/cuda/collective.h"
#include "backend/cuda/cuda_model.h"
#include "backend/cuda/deepseek_ops.h"
#include "backend/cuda/deepseek_weights.h"
#include "backend/cuda/device.h"
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

using LayerDev = cuda::DeepseekLayerDev;
using Par = cuda::DeepseekParallel;

class CudaDeepseekModel final : public Model {
 public:
  CudaDeepseekModel(const Checkpoint& ckpt, int device, const Par& par)
      : dev_(device, "deepseek model"), cfg_(ckpt.config()), par_(par), moe_par_(par, ckpt.config().hidden) {
    const ModelConfig& c = cfg_;
    const int n = par_.size, rk = par_.rank;
    const bool tp = par_.mode == Par::Mode::Tensor;
    TALON_CHECK(n >= 1 && rk >= 0 && rk < n && (n == 1 || par_.comm), "deepseek rank {} of {}: bad parallel setup", rk,
                n);
    TALON_CHECK(!tp || c.n_heads % n == 0, "--tp {}: the model's {} attention heads must divide by it", n, c.n_heads);
    TALON_CHECK(n == 1 || c.ds.n_routed_experts % n == 0, "--{} {}: the model's {} routed experts must divide by it",
                tp ? "tp" : "ep", n, c.ds.n_routed_experts);
    cuda::DeepseekDevWeights w = cuda::upload_deepseek_weights(ckpt, dev_.arena(), par_);
    embed_ = w.embed, lm_head_ = w.lm_head, final_norm_ = w.final_norm, inv_freq_ = w.inv_freq;
    layers_ = std::move(w.layers);
    nh_ = w.nh;
    tlog::info("cuda:{}: {} weights on the device{}: {:.2f} GiB", dev_.index(), arch_name(c.arch),
               n > 1 ? fmt::format(" ({} rank {} of {})", tp ? "tensor-parallel" : "expert-parallel", rk, n) : "",
               double(dev_.arena().bytes()) / double(1ll << 30));
  }

  const ModelConfig& config() const override { return cfg_; }
  std::string backend() const override { return dev_.name(); }

  void forward(const Batch& b, const Capture& cap, float* logits) override {
    dev_.activate();
    const ModelConfig& c = cfg_;
    const DeepseekConfig& d = c.ds;
    const int64_t N = b.n_tokens(), H = c.hidden, V = c.vocab, nh = nh_;
    const int64_t nope = d.qk_nope_head_dim, rope = d.qk_rope_head_dim, qk = nope + rope, vd = d.v_head_dim;
    const int64_t kvr = d.kv_lora_rank;
    const float eps = float(c.rms_eps);
    cap.validate(c.n_layers, b);
    const bool tp = par_.mode == Par::Mode::Tensor;
    if (N == 0) {
      // An expert-parallel rank without tokens still serves its experts to the others.
      if (par_.mode == Par::Mode::Expert)
        for (const LayerDev& L : layers_)
          if (L.moe)
            moe_par_.run(L, 0, nullptr, acts_ ? acts_->xn : nullptr, acts_ ? &acts_->moe : nullptr, nullptr,
                         dev_.stream());
      return;
    }
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
    cudaStream_t s = dev_.stream();
    CUDA_CHECK(cudaMemcpyAsync(a.ids, b.tokens.data(), size_t(N) * 4, cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(a.pos, pos.data(), size_t(N) * 4, cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(a.row_seq, row_seq.data(), size_t(N) * 4, cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(a.seq_start, b.seq_start.data(), b.seq_start.size() * 8, cudaMemcpyHostToDevice, s));
    // TALON_ATTENTION=cudnn|auto: cuDNN's fused attention with heads of qk over values of vd, read
    // from the padded qkv buffer and written unpadded (no unpad pass).
    if (cuda::prefill_attention_cudnn()) {
      cuda::SdpaShape sh{int(nh), int(nh), int(qk), float(1.0 / std::sqrt(double(qk))), a.n};
      sh.hd_v = int(vd);
      sh.ld_q = sh.ld_k = sh.ld_v = 3 * nh * qk;
      sh.hs_v = qk;
      sh.backward = false;
      cuda::prefill_make(cudnn_, cudnn_off_, sh, "", s, dev_.index());
    }
    cuda::prefill_set_batch(cudnn_, cudnn_off_, b.seq_start, a.seq_start, dev_.index());
    // Tensor-core attention when the head size allows (Kimi-K2 / DeepSeek-V3: qk 192).
    const bool flash = !cudnn_ && cuda::flash_attention_supported(qk);
    const std::vector<int32_t> tiles = flash ? cuda::attention_tiles(b.seq_start.data(), b.n_seqs()) : std::vector<int32_t>{};
    if (flash)
      CUDA_CHECK(cudaMemcpyAsync(a.tiles, tiles.data(), tiles.size() * 4, cudaMemcpyHostToDevice, s));

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
    // Branch outputs (attention, MLP, experts) are computed in fp32 and added to the fp32
    // residual as they are: no bf16 rounding of their sums, so a tensor-parallel group (which
    // sums per-rank fp32 partials) and one GPU differ only in fp32 summation order, too
    // little to flip a near-tie expert choice between them.
    for (int64_t l = 0; l < c.n_layers; ++l) {
      const LayerDev& L = layers_[size_t(l)];
      capture(l);
      // ---- MLA
      cuda::mla_project(L, c, nh, a.x, {a.xn, a.qa, a.q, a.ckv, a.lat, a.t32}, N, dev_.gemm(), s);
      dev_.gemm().forward(a.kv, a.lat, L.kv_b, N, kvr, nh * (nope + vd), s);
      cuda::mla_assemble(a.qkv, a.q, a.kv, a.ckv, kvr + rope, kvr, a.pos, inv_freq_, N, nh, nope, rope, vd,
                         d.rope_interleave, float(c.rope.attention_factor), q_scale, s);
      if (cudnn_) {
        cudnn_->forward(a.attv, nullptr, a.qkv, a.qkv + nh * qk, a.qkv + 2 * nh * qk);
      } else {
        if (flash)
          cuda::flash_attention_forward(a.att, a.qkv, 3 * nh * qk, a.seq_start, a.tiles, int64_t(tiles.size() / 2), nh,
                                        nh, qk, 0, s);
        else
          cuda::attention_forward(a.att, a.qkv, 3 * nh * qk, a.seq_start, a.row_seq, N, nh, nh, qk, 0, s);
        cuda::unpad_heads(a.attv, a.att, N, nh, qk, vd, s);
      }
      dev_.gemm().forward(a.part, a.attv, L.o, N, nh * vd, H, s);  // tensor parallel: this rank's heads
      if (tp) par_.comm->all_reduce(par_.rank, a.part, N * H, DType::F32, s);
      cuda::add_f32(a.x, a.part, N * H, s);
      // ---- MLP: dense, or routed experts (+ shared experts)
      std::function<void()> routed;
      std::function<void(float*, int64_t)> reduce;
      if (par_.size > 1) routed = [&] { moe_par_.run(L, N, a.rlog, a.xn, &a.moe, a.moe_out, s); };
      if (tp) reduce = [&](float* p, int64_t n) { par_.comm->all_reduce(par_.rank, p, n, DType::F32, s); };
      cuda::deepseek_mlp(L, c, a.x, {a.xn, a.gu, a.act, a.xn32, a.rlog, a.moe_out, a.part, &a.moe}, N, dev_.gemm(), s,
                         routed, reduce);
    }
    cuda::add_rmsnorm_forward(a.xn, a.x, nullptr, final_norm_, N, H, eps, s);
    capture(c.n_layers);
    if (logits) {
      dev_.gemm().forward(a.logits, a.xn, lm_head_, N, H, V, s);
      cuda::bf16_to_f32(a.logits32, a.logits, N * V, s);
      CUDA_CHECK(cudaMemcpyAsync(logits, a.logits32, size_t(N * V) * 4, cudaMemcpyDeviceToHost, s));
    }
    CUDA_CHECK(cudaStreamSynchronize(s));
  }

 private:
  struct Acts {
    DeviceArena arena;
    int64_t n = 0, seqs = 0;
    float *x, *t32, *xn32, *rlog, *moe_out, *logits32, *part;
    bf16 *xn, *cap, *qa, *q, *ckv, *lat, *kv, *qkv, *att, *attv, *gu, *act, *logits;
    int32_t *ids, *pos, *row_seq, *tiles;
    int64_t* seq_start;
    cuda::MoeScratch moe;
  };

  void ensure_acts(int64_t N, int64_t S) {
    if (acts_ && acts_->n >= N && acts_->seqs >= S) return;
    const int64_t n = std::max<int64_t>(N, acts_ ? acts_->n : 0), sq = std::max<int64_t>(S, acts_ ? acts_->seqs : 0);
    const ModelConfig& c = cfg_;
    const DeepseekConfig& d = c.ds;
    const int64_t H = c.hidden, nh = nh_, qk = d.qk_head_dim(), vd = d.v_head_dim, kvr = d.kv_lora_rank;
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
    a->part = ar.alloc<float>(size_t(n * H));
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
    a->gu = ar.alloc<bf16>(size_t(n * 2 * inter));
    a->act = ar.alloc<bf16>(size_t(n * inter));
    a->logits = ar.alloc<bf16>(size_t(n * c.vocab));
    a->ids = ar.alloc<int32_t>(size_t(n));
    a->pos = ar.alloc<int32_t>(size_t(n));
    a->row_seq = ar.alloc<int32_t>(size_t(n));
    a->tiles = ar.alloc<int32_t>(size_t(2 * cuda::attention_max_tiles(n, sq)));
    a->seq_start = ar.alloc<int64_t>(size_t(sq + 1));
    const LayerDev* moe_layer = nullptr;
    for (const auto& L : layers_)
      if (L.moe) moe_layer = &L;
    if (moe_layer) cuda::alloc_moe_scratch(a->moe, ar, n, moe_layer->experts.routing, H, moe_layer->experts.experts.gate.O);
    a->n = n, a->seqs = sq;
    acts_ = std::move(a);
  }

  cuda::Device dev_;  // first: destroyed last (device.h)
  ModelConfig cfg_;
  Par par_;
  int64_t nh_ = 0;  // attention heads on this rank
  cuda::MoeParallel moe_par_;
  bf16 *embed_, *lm_head_, *final_norm_;
  float* inv_freq_;
  std::vector<LayerDev> layers_;
  std::unique_ptr<Acts> acts_;
  std::unique_ptr<cuda::CudnnSdpa> cudnn_;  // TALON_ATTENTION=cudnn|auto
  bool cudnn_off_ = false;                  // cuDNN does not serve this model
};

}  // namespace

std::unique_ptr<Model> make_cuda_deepseek_model(const Checkpoint& ckpt, int device) {
  return cuda::make_deepseek_rank_model(ckpt, device, {});
}

namespace cuda {
std::unique_ptr<Model> make_deepseek_rank_model(const Checkpoint& ckpt, int device, const DeepseekParallel& par) {
  TALON_CHECK(is_deepseek(ckpt.config().arch), "{}: not a DeepSeek-family model", ckpt.source());
  return std::make_unique<CudaDeepseekModel>(ckpt, device, par);
}
}  // namespace cuda

}  // namespace talon
