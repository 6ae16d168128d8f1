// The CUDA cached decoder (model/decode.h) of the DeepSeek-V2/V3 family (Kimi-K2 included) on
// one GPU: the packed forward's layer halves (deepseek_weights.h: MLA projections, MLP or
// mixture of experts, fp32 residual, bf16 weights) around MLA in its absorbed form, which
// attends over a latent cache of kvr + rope values a token instead of per-head keys and
// values (576 against 128 x 2 x 192 at the Kimi-K2 shape):
//
//   q_lat(h) = W_UK(h)^T q_nope(h)                       one strided-batched GEMM over heads
//   [q_lat | rot(q_pe)] . [c | rot(k_pe)] for each key   mla_decode_attention (deepseek_ops.h)
//   o_lat(h) = softmax(...) c;  o(h) = W_UV(h) o_lat(h)  a second batched GEMM
//
// W_UK and W_UV are read in place from kv_b ([nh (nope + vd), kvr], per head nope rows of
// W_UK then vd rows of W_UV). The CPU twin is CpuDeepseekDecoder (cpu_deepseek.cpp), the same
// arithmetic in fp32. Slots, rows and commits follow decode_slots.h; a forward's launches are
// a CUDA graph per shape after the shape's second run (graph_cache.h), prefills included
// (every forward attends over the cache).
//
// Tensor parallel (make_deepseek_decoder_group): rank r holds heads [r nh/n, (r+1) nh/n) of
// MLA, a slice of each dense / shared MLP and the routed experts of its window, as the packed
// forward's ranks do (cuda_deepseek.cpp); every rank runs every request, keeps the whole latent
// cache (it is shared by the heads), and sums its attention, MLP and expert partials with fp32
// all-reduces. Expert parallel: attention and the dense parts replicated, each rank holds its
// own slots (and their cache) and runs their requests; a MoE layer sends each routed slot's row
// to the rank owning its expert and back (MoeParallel: two all-to-alls), and a rank with no
// request that step still serves its experts. Parallel forwards run eagerly: the routed counts
// come to the host once a MoE layer, and shared-GPU collectives wait on host barriers.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/backend.h"
#include "backend/cuda/check.h"
#include "backend/cuda/collective.h"
#include "backend/cuda/cuda_decoder.h"
#include "backend/cuda/cuda_model.h"
#include "backend/cuda/decode_ops.h"
#include "backend/cuda/decode_slots.h"
#include "backend/cuda/deepseek_ops.h"
#include "backend/cuda/deepseek_weights.h"
#include "backend/cuda/device.h"
#include "backend/cuda/graph_cache.h"
#include "backend/cuda/ops.h"
#include "model/deepseek.h"
#include "util/error.h"
#include "util/log.h"

namespace talon::cuda {

namespace {

std::string gib(double b) { return fmt::format("{:.2f} GiB", b / double(1ll << 30)); }

// C[b] = op(A[b]) B[b] for b < batch (column-major, cuBLAS's conventions), bf16 operands and
// fp32 accumulation; C bf16 or fp32.
void gemm_batched(cublasHandle_t h, cublasOperation_t ta, int64_t m, int64_t n, int64_t k, const bf16* A, int64_t lda,
                  int64_t sA, const bf16* B, int64_t ldb, int64_t sB, void* C, cudaDataType ct, int64_t ldc, int64_t sC,
                  int64_t batch) {
  const float one = 1.f, zero = 0.f;
  CUBLAS_CHECK(cublasGemmStridedBatchedEx(h, ta, CUBLAS_OP_N, int(m), int(n), int(k), &one, A, CUDA_R_16BF, int(lda), sA,
                                          B, CUDA_R_16BF, int(ldb), sB, &zero, C, ct, int(ldc), sC, int(batch),
                                          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

class CudaDeepseekDecoder final : public Decoder, public DecoderControls {
 public:
  CudaDeepseekDecoder(const Checkpoint& ckpt, int device, int n_slots, int64_t max_len, int64_t cache_tokens,
                      const DeepseekParallel& par = {})
      : dev_(checked(n_slots, max_len, device), "decoder"), cfg_(ckpt.config()), max_len_(max_len), par_(par),
        moe_par_(par, ckpt.config().hidden) {
    const ModelConfig& c = cfg_;
    const DeepseekConfig& d = c.ds;
    TALON_CHECK(d.kv_lora_rank <= 512 && d.kv_lora_rank % 2 == 0,
                "{}: kv_lora_rank {} is not supported by the CUDA decoder (even, at most 512)", ckpt.source(),
                d.kv_lora_rank);
    const int n = par_.size;
    const bool ep = par_.mode == DeepseekParallel::Mode::Expert;
    TALON_CHECK(n == 1 || (par_.comm && par_.rank >= 0 && par_.rank < n), "decoder rank {} of {}: bad parallel setup",
                par_.rank, n);
    TALON_CHECK(ep || c.n_heads % n == 0, "--tp {}: the model's {} attention heads must divide by it", n, c.n_heads);
    TALON_CHECK(n == 1 || d.n_routed_experts % n == 0, "--{} {}: the model's {} routed experts must divide by it",
                ep ? "ep" : "tp", n, d.n_routed_experts);
    w_ = upload_deepseek_weights(ckpt, dev_.arena(), par_);
    // The latent cache: per layer [pool rows, kvr + rope] bf16 in pages shared by the slots
    // (decode_slots.h), sized against what is free after the weights, keeping room for one
    // forward's activations per slot.
    const int64_t width = d.kv_lora_rank + d.qk_rope_head_dim, L = c.n_layers;
    const int64_t per_token = L * width * 2;
    const double reserve = double(1ll << 30) + double(n_slots) * double(c.vocab * 6 + c.hidden * 24);
    const auto [free_b, total_b] = dev_.memory();
    const bool fixed = kv_pages_fixed();
    const int64_t rows =
        cache_pool_rows(dev_.index(), n_slots, max_len, fixed ? 0 : cache_tokens, double(per_token), reserve,
                        double(free_b), double(total_b), double(dev_.arena().bytes()),
                        fmt::format("{} layers x {} latent + rope values x 2 bytes", L, width));
    slots_ = std::make_unique<DecodeSlots>(n_slots, max_len, rows, fixed);
    for (int64_t l = 0; l < L; ++l) cache_.push_back(cache_arena_.alloc<bf16>(size_t(rows) * size_t(width)));
    cache_ptrs_ = cache_arena_.alloc<bf16*>(cache_.size());
    CUDA_CHECK(cudaMemcpy(cache_ptrs_, cache_.data(), cache_.size() * sizeof(bf16*), cudaMemcpyHostToDevice));
    move_pairs_ = cache_arena_.alloc<int32_t>(size_t(2 * max_len));
    page_table_ = cache_arena_.alloc<int32_t>(size_t(n_slots) * size_t(slots_->pages().max_pages()));
    tlog::info("cuda:{}: {} decoder with {} slots x {} tokens: latent cache {} tokens in pages of {} ({})", dev_.index(),
               arch_name(c.arch), n_slots, max_len, rows, kPageRows, gib(double(per_token) * double(rows)));
    pending_.assign(size_t(n_slots), 0);
    const char* sm = std::getenv("TALON_CUDA_SAMPLE");
    device_sampling_ = !(sm && std::string(sm) == "0");
  }

  ~CudaDeepseekDecoder() override {
    dev_.activate();
    graphs_.clear();
  }

  const ModelConfig& config() const override { return cfg_; }
  std::string backend() const override { return dev_.name() + " (absorbed MLA)"; }
  int n_slots() const override { return slots_->size(); }
  int64_t max_len() const override { return max_len_; }
  int64_t length(int slot) const override { return slots_->length(slot); }
  int64_t page_rows() const override { return slots_->pages().page_rows(); }
  int64_t cache_capacity() const override { return slots_->pages().capacity(); }

  void forward(const std::vector<DecodeRequest>& reqs, const Capture& cap, float* logits) override {
    run(reqs, cap, logits, nullptr);
  }
  void forward_greedy(const std::vector<DecodeRequest>& reqs, const Capture& cap, int32_t* ids) override {
    run(reqs, cap, nullptr, ids);
  }
  void forward_sample(const std::vector<DecodeRequest>& reqs, const Capture& cap, const SamplingParams& p,
                      const double* u, int32_t* ids) override {
    if (p.greedy()) return run(reqs, cap, nullptr, ids);
    if (!device_sampling_) return Decoder::forward_sample(reqs, cap, p, u, ids);
    run(reqs, cap, nullptr, ids, &p, u);
  }

  ChainAcceptance forward_accept_chain(const DecodeRequest& req, const Capture& cap, const SamplingParams& p,
                                       const std::vector<std::vector<double>>& q, const double* u) override {
    if (!accepter_.on()) return Decoder::forward_accept_chain(req, cap, p, q, u);
    return accepter_.run(req, q, u, p, cfg_.vocab, dev_.stream(), [&] {
      run({req}, cap, nullptr, nullptr, nullptr, nullptr, true);  // logits stay on the device
      return acts_->logits;
    });
  }

  TreeAcceptance forward_accept_tree(const DecodeRequest& req, const Capture& cap, const SamplingParams& p,
                                     const double* u) override {
    if (!accepter_.tree_on()) return Decoder::forward_accept_tree(req, cap, p, u);
    return accepter_.run_tree(req, u, p, cfg_.vocab, dev_.stream(), [&] {
      run({req}, cap, nullptr, nullptr, nullptr, nullptr, true);  // logits stay on the device
      return acts_->logits;
    });
  }

  void commit(int slot, const std::vector<int32_t>& keep) override {
    const std::vector<int32_t> pairs = slots_->commit(slot, keep, pending_);
    if (pairs.empty()) return;
    dev_.activate();
    CUDA_CHECK(cudaMemcpyAsync(move_pairs_, pairs.data(), pairs.size() * 4, cudaMemcpyHostToDevice, dev_.stream()));
    kv_cache_move(cache_ptrs_, int64_t(cache_.size()), move_pairs_, int64_t(pairs.size() / 2),
                  cfg_.ds.kv_lora_rank + cfg_.ds.qk_rope_head_dim, dev_.stream());
  }
  void reset(int slot) override { slots_->reset(slot, pending_); }

  // DecoderControls
  void assume_length(int slot, int64_t len) override {
    slots_->check(slot);
    if (!filled_) {
      dev_.activate();
      const size_t n = size_t(slots_->cache_rows()) * size_t(cfg_.ds.kv_lora_rank + cfg_.ds.qk_rope_head_dim) * 2;
      for (bf16* c : cache_) CUDA_CHECK(cudaMemsetAsync(c, 0x3c, n, dev_.stream()));  // bf16 0x3c3c: about 0.0115
      CUDA_CHECK(cudaStreamSynchronize(dev_.stream()));
      filled_ = true;
    }
    slots_->reset(slot, pending_, len);
  }
  void use_graphs(bool on) override { graphs_.set_enabled(on); }
  int64_t graph_launches() const override { return graphs_.replays(); }
  void graph_layers(int64_t n) override { graphs_.set_layers_per_part(n); }
  size_t graph_parts() const override { return graphs_.last_parts(); }

 private:
  struct Acts {
    DeviceArena arena;
    int64_t n_tokens = 0, n_logits = 0, n_part = 0, n_cap = 0, n_in = 0;
    float *x, *t32, *xn32, *rlog, *moe_out, *part, *qd, *apart, *logits32;
    bf16 *xn, *qa, *q, *ckv, *lat, *olat, *attv, *gu, *act, *sel, *logits;
    uint8_t* cap;
    int32_t* top1;
    uint8_t* in;
    MoeScratch moe;
  };
  // keep_logits: the bf16 logits rows stay in acts_->logits (forward_accept_chain).
  void run(const std::vector<DecodeRequest>& reqs, const Capture& cap, float* logits, int32_t* ids,
           const SamplingParams* sp = nullptr, const double* u = nullptr, bool keep_logits = false) {
    dev_.activate();
    const ModelConfig& c = cfg_;
    const DeepseekConfig& d = c.ds;
    const int64_t H = c.hidden, V = c.vocab, nh = w_.nh;
    const int64_t nope = d.qk_nope_head_dim, rope = d.qk_rope_head_dim, qk = nope + rope, vd = d.v_head_dim;
    const int64_t kvr = d.kv_lora_rank, D = kvr + rope;
    cap.validate(c.n_layers);
    DecodeBatch batch = slots_->plan(reqs, pending_, V);
    slots_->sync_pages(page_table_, dev_.stream());
    const CacheMap map = slots_->cache_map(page_table_);
    const int64_t N = int64_t(batch.rows.size()),
                  NL = (logits || ids || keep_logits) ? int64_t(batch.logit_rows.size()) : 0;
    const bool ep = par_.size > 1 && par_.mode == DeepseekParallel::Mode::Expert;
    if (N == 0) {
      // An expert-parallel rank with no request this step still serves its experts to the others.
      if (ep)
        for (const DeepseekLayerDev& L : w_.layers)
          if (L.moe)
            moe_par_.run(L, 0, nullptr, acts_ ? acts_->xn : nullptr, acts_ ? &acts_->moe : nullptr, nullptr,
                         dev_.stream());
      return;
    }
    int64_t max_keys = 0;
    for (const DecodeRow& r : batch.rows) max_keys = std::max<int64_t>(max_keys, r.end - r.lo);
    const DecodeSplits ks = decode_splits(max_keys, N, mla_head_blocks(nh), dev_.multiprocessors());
    const int64_t splits = ks.splits, split_len = ks.split_len;
    const bool sampled = sp && ids && NL > 0;
    PackedOffsets po;
    const DecodeInputs lay(po, batch, sampled);
    const int64_t n_cap = int64_t(cap.layers.size());
    ensure_acts(N, NL, N * nh * splits * (kvr + 2), n_cap, int64_t(po.bytes()));
    Acts& a = *acts_;

    uint8_t* hb = in_h_.ensure(po.bytes());
    lay.stage(hb, batch, sampled ? sp : nullptr, u);
    cudaStream_t st = dev_.stream();
    CUDA_CHECK(cudaMemcpyAsync(a.in, hb, po.bytes(), cudaMemcpyHostToDevice, st));
    const auto* d_ids = reinterpret_cast<const int32_t*>(a.in + lay.ids);
    const auto* d_pos = reinterpret_cast<const int32_t*>(a.in + lay.pos);
    const auto* d_rows = reinterpret_cast<const DecodeRow*>(a.in + lay.rows);
    const auto* d_logit_rows = reinterpret_cast<const int32_t*>(a.in + lay.logit_rows);
    const auto* d_masks = reinterpret_cast<const uint64_t*>(a.in + lay.masks);
    const float scale = float(d.softmax_scale), af = float(c.rope.attention_factor);
    const bool tp = par_.size > 1 && par_.mode == DeepseekParallel::Mode::Tensor;

    auto device_work = [&] {
      cublasHandle_t blas = dev_.blas();
      auto capture = [&](int64_t layer_id) { capture_residual(a.cap, a.n_tokens, cap, layer_id, a.x, N, H, st); };
      embedding_forward(a.x, d_ids, w_.embed, N, H, V, st);
      for (int64_t l = 0; l < c.n_layers; ++l) {
        const DeepseekLayerDev& L = w_.layers[size_t(l)];
        capture(l);
        graphs_.layer_start(l, st);
        mla_project(L, c, nh, a.x, {a.xn, a.qa, a.q, a.ckv, a.lat, a.t32}, N, dev_.gemm(), st);
        // q_lat(h) [kvr, N] = W_UK(h) (col-major [kvr, nope], in place in kv_b) x q_nope(h)
        gemm_batched(blas, CUBLAS_OP_N, kvr, N, nope, L.kv_b, kvr, (nope + vd) * kvr, a.q, nh * qk, qk, a.qd,
                     CUDA_R_32F, nh * D, D, nh);
        mla_decode_prepare(a.qd, nh * D, a.q, nh * qk, a.ckv, kvr + rope, a.lat, d_pos, w_.inv_freq, d_rows,
                           cache_[size_t(l)], N, nh, nope, rope, kvr, map, d.rope_interleave, af, st);
        mla_decode_attention(a.olat, a.apart, a.qd, cache_[size_t(l)], d_rows, d_masks, N, nh, kvr, rope, map,
                             splits, split_len, scale, st);
        // o(h) [vd, N] = W_UV(h) (row-major [vd, kvr] after W_UK(h)) x o_lat(h)
        gemm_batched(blas, CUBLAS_OP_T, vd, N, kvr, L.kv_b + nope * kvr, kvr, (nope + vd) * kvr, a.olat, nh * kvr, kvr,
                     a.attv, CUDA_R_16BF, nh * vd, vd, nh);
        dev_.gemm().forward(a.part, a.attv, L.o, N, nh * vd, H, st);  // tensor parallel: this rank's heads
        if (tp) par_.comm->all_reduce(par_.rank, a.part, N * H, DType::F32, st);
        add_f32(a.x, a.part, N * H, st);
        std::function<void()> routed;
        std::function<void(float*, int64_t)> reduce;
        if (tp || ep) routed = [&] { moe_par_.run(L, N, a.rlog, a.xn, &a.moe, a.moe_out, st); };
        if (tp) reduce = [&](float* p, int64_t cnt) { par_.comm->all_reduce(par_.rank, p, cnt, DType::F32, st); };
        deepseek_mlp(L, c, a.x, {a.xn, a.gu, a.act, a.xn32, a.rlog, a.moe_out, a.part, &a.moe}, N, dev_.gemm(), st,
                     routed, reduce);
      }
      add_rmsnorm_forward(a.xn, a.x, nullptr, w_.final_norm, N, H, float(c.rms_eps), st);
      capture(c.n_layers);
      if (NL > 0) {
        dev_.gemm().forward(a.logits, logits_input(a.sel, a.xn, d_logit_rows, NL, N, H, st), w_.lm_head, NL, H, V, st);
        if (!keep_logits)
          finish_logits(a.top1, a.logits32, a.logits, NL, V,
                      sampled ? reinterpret_cast<const DeviceSampling*>(a.in + lay.sampling) : nullptr,
                      reinterpret_cast<const double*>(a.in + lay.uniforms), ids != nullptr, st);
      }
    };
    graphs_.run(fmt::format("{}/{}/{}/{}/{}/{}/{}/{}", N, NL, batch.masks.size(), splits, split_len,
                            keep_logits ? 3 : sampled ? 2 : ids ? 1 : 0, int(cap.dtype), fmt::join(cap.layers, ",")),
                st, device_work, !batch.prefill && par_.size == 1);

    results_down(cap, a.cap, a.n_tokens, N, H, keep_logits ? 0 : NL, a.top1, ids, a.logits32, logits, V, out_h_, st);
    slots_->ran(reqs, batch, pending_);
  }

  void ensure_acts(int64_t N, int64_t NL, int64_t part, int64_t n_cap, int64_t in_bytes) {
    if (acts_ && acts_->n_tokens >= N && acts_->n_logits >= NL && acts_->n_part >= part && acts_->n_cap >= n_cap &&
        acts_->n_in >= in_bytes)
      return;
    auto grow = [&](int64_t want, int64_t Acts::*have) { return std::max<int64_t>({want, acts_ ? (*acts_).*have : 0, 1}); };
    const int64_t n = grow(N, &Acts::n_tokens), nl = grow(NL, &Acts::n_logits), np = grow(part, &Acts::n_part),
                  nc = grow(n_cap, &Acts::n_cap), ni = grow(in_bytes, &Acts::n_in);
    const ModelConfig& c = cfg_;
    const DeepseekConfig& d = c.ds;
    const int64_t H = c.hidden, nh = w_.nh, qk = d.qk_head_dim(), vd = d.v_head_dim, kvr = d.kv_lora_rank;
    const int64_t rope = d.qk_rope_head_dim, qr = std::max<int64_t>(d.q_lora_rank, 1);
    int64_t inter = 1, E = 1;
    const DeepseekLayerDev* moe_layer = nullptr;
    for (const auto& L : w_.layers) {
      inter = std::max(inter, L.inter);
      if (L.moe) E = std::max<int64_t>(E, L.experts.routing.n_experts), moe_layer = &L;
    }
    graphs_.clear();
    acts_.reset();
    auto a = std::make_unique<Acts>();
    auto& ar = a->arena;
    a->x = ar.alloc<float>(size_t(n * H));
    a->t32 = ar.alloc<float>(size_t(n * std::max(qr, kvr)));
    a->xn32 = ar.alloc<float>(size_t(n * H));
    a->rlog = ar.alloc<float>(size_t(n * E));
    a->moe_out = ar.alloc<float>(size_t(n * H));
    a->part = ar.alloc<float>(size_t(n * H));
    a->qd = ar.alloc<float>(size_t(n * nh * (kvr + rope)));
    a->apart = ar.alloc<float>(size_t(np));
    a->logits32 = ar.alloc<float>(size_t(nl * c.vocab));
    a->xn = ar.alloc<bf16>(size_t(n * H));
    a->qa = ar.alloc<bf16>(size_t(n * qr));
    a->q = ar.alloc<bf16>(size_t(n * nh * qk));
    a->ckv = ar.alloc<bf16>(size_t(n * (kvr + rope)));
    a->lat = ar.alloc<bf16>(size_t(n * kvr));
    a->olat = ar.alloc<bf16>(size_t(n * nh * kvr));
    a->attv = ar.alloc<bf16>(size_t(n * nh * vd));
    a->gu = ar.alloc<bf16>(size_t(n * 2 * inter));
    a->act = ar.alloc<bf16>(size_t(n * inter));
    a->sel = ar.alloc<bf16>(size_t(nl * H));
    a->logits = ar.alloc<bf16>(size_t(nl * c.vocab));
    a->cap = ar.alloc<uint8_t>(size_t(nc * n * H * 4));
    a->top1 = ar.alloc<int32_t>(size_t(nl));
    a->in = ar.alloc<uint8_t>(size_t(ni));
    if (moe_layer) alloc_moe_scratch(a->moe, ar, n, moe_layer->experts.routing, H, moe_layer->experts.experts.gate.O);
    a->n_tokens = n, a->n_logits = nl, a->n_part = np, a->n_cap = nc, a->n_in = ni;
    acts_ = std::move(a);
  }

  static int checked(int n_slots, int64_t max_len, int device) {
    TALON_CHECK(n_slots > 0 && max_len > 0, "decoder: n_slots {} and max_len {} must be positive", n_slots, max_len);
    return device;
  }
  std::unique_ptr<DecodeSlots> slots_;  // sized once the weights are up
  Device dev_;         // destroyed after everything it allocated (device.h)
  ModelConfig cfg_;
  int64_t max_len_;
  DeepseekParallel par_;
  MoeParallel moe_par_;
  DeviceArena cache_arena_;
  DeepseekDevWeights w_;
  std::vector<bf16*> cache_;     // per layer [pool rows, kvr + rope], paged (decode_slots.h)
  int32_t* page_table_ = nullptr;  // [n_slots, max_pages] (DecodeSlots::sync_pages)
  bf16** cache_ptrs_ = nullptr;  // device array of the layers' caches, for moves
  int32_t* move_pairs_ = nullptr;
  bool filled_ = false;
  std::unique_ptr<Acts> acts_;
  PinnedBuffer in_h_, out_h_;  // staging of Acts::in; the greedy ids coming down
  GraphCache graphs_;
  bool device_sampling_ = true;
  ChainAccepter accepter_;
};

}  // namespace

std::unique_ptr<Decoder> make_deepseek_decoder(const Checkpoint& ckpt, int device, int n_slots, int64_t max_len,
                                               int64_t cache_tokens) {
  TALON_CHECK(is_deepseek(ckpt.config().arch), "{}: not a DeepSeek-family model", ckpt.source());
  return std::make_unique<CudaDeepseekDecoder>(ckpt, device, n_slots, max_len, cache_tokens);
}

std::unique_ptr<Decoder> make_deepseek_rank_decoder(const Checkpoint& ckpt, int device, int n_slots, int64_t max_len,
                                                    int64_t cache_tokens, const DeepseekParallel& par) {
  TALON_CHECK(is_deepseek(ckpt.config().arch), "{}: not a DeepSeek-family model", ckpt.source());
  return std::make_unique<CudaDeepseekDecoder>(ckpt, device, n_slots, max_len, cache_tokens, par);
}

}  // namespace talon::cuda
