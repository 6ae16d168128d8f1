// The CUDA cached decoder (model/decode.h) on one GPU: the CUDA model's layer stack
// (dense_block.h: bf16 weights and activations, fp32 residual stream, fused q|k|v and
// gate|up GEMMs), with a KV cache allocated up front and attention against it
// (decode_attention.cu; layout and row conventions in decode_ops.h).
//
// A forward packs all requests' new tokens into N rows. Per layer the new keys and values
// (after bias, qk-norm and RoPE) are written into each slot's cache at rows
// length .. length + n - 1 (pending); attention then reads every key from the cache, so a
// token sees the committed prefix and its pending ancestors alike. A forward whose
// requests are all chains on empty slots (prefill) uses the packed tensor-core attention
// of the CUDA model instead, where the head size allows. commit moves the kept rows down
// on the device; the host keeps each slot's length and pending tree.
#include "backend/cuda/cuda_decoder.h"

#include <cuda_runtime.h>

#include <fmt/ranges.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

#include "backend/backend.h"
#include "backend/cuda/check.h"
#include "backend/cuda/cuda_model.h"
#include "backend/cuda/decode_ops.h"
#include "backend/cuda/decode_slots.h"
#include "backend/cuda/dense_block.h"
#include "backend/cuda/device.h"
#include "backend/cuda/graph_cache.h"
#include "backend/cuda/ops.h"
#include "backend/cuda/weights.h"
#include "model/decode.h"
#include "util/error.h"
#include "util/log.h"

namespace talon {

namespace {

using cuda::bf16;
using cuda::DecodeRow;
using cuda::DeviceArena;

std::string gib(double b) { return fmt::format("{:.2f} GiB", b / double(1ll << 30)); }

class CudaDecoder final : public Decoder, public cuda::DecoderControls {
 public:
  CudaDecoder(const Checkpoint& ckpt, int device, int n_slots, int64_t max_len, int64_t cache_tokens)
      : dev_(checked(n_slots, max_len, device), "decoder"), cfg_(ckpt.config()), max_len_(max_len) {
    const ModelConfig& c = cfg_;
    const int device_ = dev_.index();
    w_ = cuda::upload_dense_weights(ckpt, device_, 0, 1, dev_.arena());
    // The cache: per layer K and V [pool rows, nkv, hd] bf16 in pages shared by the slots
    // (decode_slots.h), sized against what is free after the weights, keeping room for the
    // activations of one forward per slot.
    const int64_t kvd = c.n_kv_heads * c.head_dim, L = c.n_layers;
    const int64_t per_token = L * 2 * kvd * 2;
    const int64_t ldqkv = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim;
    const double reserve = double(1ll << 30) +
                           double(n_slots) * double(c.vocab * 6 + c.hidden * 12 + ldqkv * 2 + c.intermediate * 6);
    const auto [free_b, total_b] = dev_.memory();
    const bool fixed = cuda::kv_pages_fixed();
    const int64_t rows = cuda::cache_pool_rows(
        device_, n_slots, max_len, fixed ? 0 : cache_tokens, double(per_token), reserve, double(free_b),
        double(total_b), double(w_.weight_bytes),
        fmt::format("{} layers x K,V x {} kv heads x {} head_dim x 2 bytes", L, c.n_kv_heads, c.head_dim));
    slots_ = std::make_unique<cuda::DecodeSlots>(n_slots, max_len, rows, fixed);
    std::vector<bf16*> bufs;
    for (int64_t l = 0; l < L; ++l) {
      kc_.push_back(cache_arena_.alloc<bf16>(size_t(rows) * size_t(kvd)));
      vc_.push_back(cache_arena_.alloc<bf16>(size_t(rows) * size_t(kvd)));
      bufs.push_back(kc_.back());
      bufs.push_back(vc_.back());
    }
    cache_ptrs_ = cache_arena_.alloc<bf16*>(bufs.size());
    CUDA_CHECK(cudaMemcpy(cache_ptrs_, bufs.data(), bufs.size() * sizeof(bf16*), cudaMemcpyHostToDevice));
    move_pairs_ = cache_arena_.alloc<int32_t>(size_t(2 * max_len));
    page_table_ = cache_arena_.alloc<int32_t>(size_t(n_slots) * size_t(slots_->pages().max_pages()));
    tlog::info("cuda:{}: decoder with {} slots x {} tokens: KV cache {} tokens in pages of {} ({})", device_, n_slots,
               max_len, rows, cuda::kPageRows, gib(double(per_token) * double(rows)));
    pending_.assign(size_t(n_slots), 0);
    // Attention's key splits are merged by a separate combine launch: measured faster on an
    // H200 than the last split block merging them (8B shape, batch 1: 4.84 vs 5.02 ms a
    // step; SmolLM2 0.94 vs 1.01 ms). TALON_CUDA_SPLIT_MERGE=1 takes the in-kernel merge.
    const char* m = std::getenv("TALON_CUDA_SPLIT_MERGE");
    merge_in_kernel_ = m && std::string(m) == "1";
    // Sampling at temperature > 0 draws on the device (cuda::sample_rows) unless
    // TALON_CUDA_SAMPLE=0, which copies fp32 logits down and samples on the host.
    const char* sm = std::getenv("TALON_CUDA_SAMPLE");
    device_sampling_ = !(sm && std::string(sm) == "0");
  }

  ~CudaDecoder() override {
    dev_.activate();
    graphs_.clear();
  }

  const ModelConfig& config() const override { return cfg_; }
  std::string backend() const override { return dev_.name(); }
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

  void use_graphs(bool on) override { graphs_.set_enabled(on); }
  int64_t graph_launches() const override { return graphs_.replays(); }
  void graph_layers(int64_t n) override { graphs_.set_layers_per_part(n); }
  size_t graph_parts() const override { return graphs_.last_parts(); }

  void commit(int slot, const std::vector<int32_t>& keep) override {
    // Kept rows that are not in place move down, in order (decode_ops.h: kv_cache_move).
    const std::vector<int32_t> pairs = slots_->commit(slot, keep, pending_);
    if (!pairs.empty()) {
      dev_.activate();
      CUDA_CHECK(cudaMemcpyAsync(move_pairs_, pairs.data(), pairs.size() * 4, cudaMemcpyHostToDevice, dev_.stream()));
      // No wait: the next forward is ordered after the move on the stream, and a copy from
      // pageable memory has read `pairs` when it returns.
      cuda::kv_cache_move(cache_ptrs_, int64_t(2 * kc_.size()), move_pairs_, int64_t(pairs.size() / 2),
                          cfg_.n_kv_heads * cfg_.head_dim, dev_.stream());
    }
  }

  void reset(int slot) override { slots_->reset(slot, pending_); }

  void assume_length(int slot, int64_t len) override {
    slots_->check(slot);
    TALON_CHECK(len >= 0 && len <= max_len_, "decoder: length {} outside [0, {}]", len, max_len_);
    if (!filled_) {
      dev_.activate();
      const size_t n = size_t(slots_->cache_rows()) * size_t(cfg_.n_kv_heads * cfg_.head_dim) * 2;
      for (size_t l = 0; l < kc_.size(); ++l) {
        CUDA_CHECK(cudaMemsetAsync(kc_[l], 0x3c, n, dev_.stream()));  // bf16 0x3c3c: about 0.0115
        CUDA_CHECK(cudaMemsetAsync(vc_[l], 0x3c, n, dev_.stream()));
      }
      CUDA_CHECK(cudaStreamSynchronize(dev_.stream()));
      filled_ = true;
    }
    slots_->reset(slot, pending_, len);
  }

 private:
  // Activations of one forward, grown on demand (capacities in n_*). Graphs hold these
  // pointers, so growing drops every graph.
  struct Acts {
    DeviceArena arena;
    int64_t n_tokens = 0, n_logits = 0, n_part = 0, n_cap = 0, n_in = 0;
    float *x, *part, *logits32;
    bf16 *xn, *qkv, *att, *tmp, *gu, *act, *sel, *logits;
    uint8_t* cap;   // captured rows, one [n_tokens, H] block (fp32 or bf16) per captured layer
    int32_t* top1;  // greedy ids of the logits rows
    int* counters;  // decode_attention's split counters, [n_tokens, nh], zero between launches
    uint8_t* in;    // the packed inputs of a forward (ids, positions, rows, ...), n_in bytes
  };
  // Where each input of a forward sits in the packed block (byte offsets): fixed by the
  // forward's shape, so a graph captured for that shape reads the next forward's inputs. The
  // common inputs (decode_slots.h), then the packed attention's (prefills) and the verify
  // tiles' lists.
  struct Layout {
    cuda::PackedOffsets o;
    cuda::DecodeInputs in;
    size_t seq_start, tiles, single, vtiles;
    Layout(const cuda::DecodeBatch& b, bool sampled, int64_t n_seq_start, int64_t n_tiles, int64_t n_single,
           int64_t n_vtiles)
        : in(o, b, sampled),
          seq_start(o.place(size_t(n_seq_start) * 8)),
          tiles(o.place(size_t(n_tiles) * 4)),
          single(o.place(size_t(n_single) * 4)),
          vtiles(o.place(size_t(n_vtiles) * sizeof(cuda::AttentionTile))) {}
    size_t bytes() const { return o.bytes(); }
  };

  // One forward: host bookkeeping, the packed inputs up in one copy, the layer stack (from a
  // CUDA graph when this shape ran before), then logits, or greedy or sampled ids (with
  // `sp`: drawn with the uniforms u, one a logits row), and captures down.
  // keep_logits: the bf16 logits rows stay in acts_->logits (forward_accept_chain), nothing comes
  // down but captures.
  void run(const std::vector<DecodeRequest>& reqs, const Capture& cap, float* logits, int32_t* ids,
           const SamplingParams* sp = nullptr, const double* u = nullptr, bool keep_logits = false) {
    dev_.activate();
    const ModelConfig& c = cfg_;
    const int64_t H = c.hidden, hd = c.head_dim, V = c.vocab, W = c.sliding_window;
    const int64_t nh = w_.nh, nkv = w_.nkv, ldqkv = (nh + 2 * nkv) * hd;
    cap.validate(c.n_layers);
    // Rows: what each new token attends to (decode_ops.h) and its RoPE position.
    cuda::DecodeBatch batch = slots_->plan(reqs, pending_, V, W);
    slots_->sync_pages(page_table_, dev_.stream());
    const cuda::CacheMap map = slots_->cache_map(page_table_);
    const std::vector<DecodeRow>& rows = batch.rows;
    const std::vector<uint64_t>& masks = batch.masks;
    const std::vector<int64_t>& seq_start = batch.seq_start;
    const int64_t N = int64_t(rows.size()),
                  NL = (logits || ids || keep_logits) ? int64_t(batch.logit_rows.size()) : 0;
    if (N == 0) return;
    const bool flash = batch.prefill && cuda::flash_attention_supported(hd);
    const std::vector<int32_t> tiles =
        flash ? cuda::attention_tiles(seq_start.data(), int64_t(reqs.size())) : std::vector<int32_t>{};
    // Rows sharing a slot go through the tile kernel together (plan_attention); with no such
    // group every row keeps the per-row kernel, as single-token steps do.
    const cuda::AttentionPlan plan =
        cuda::plan_attention(rows.data(), N, nh, nkv, hd, verify_tiles_ && !flash, dev_.multiprocessors());
    const bool tiled = !plan.tiles.empty();
    const int64_t n_single = tiled ? int64_t(plan.single.size()) : 0, n_vtiles = int64_t(plan.tiles.size());
    const int64_t splits = plan.splits.splits, split_len = plan.splits.split_len;
    const int64_t n_cap = int64_t(cap.layers.size());
    const bool sampled = sp && ids && NL > 0;
    const Layout lay(batch, sampled, flash ? int64_t(seq_start.size()) : 0, int64_t(tiles.size()), n_single, n_vtiles);
    ensure_acts(N, NL, flash ? 0 : N * nh * splits * (hd + 2), n_cap, int64_t(lay.bytes()));
    Acts& a = *acts_;

    // The packed inputs: staged in pinned memory, one copy up.
    uint8_t* hb = in_h_.ensure(lay.bytes());
    lay.in.stage(hb, batch, sampled ? sp : nullptr, u);
    if (flash) {
      std::memcpy(hb + lay.seq_start, seq_start.data(), seq_start.size() * 8);
      std::memcpy(hb + lay.tiles, tiles.data(), tiles.size() * 4);
    }
    if (tiled) {
      if (n_single > 0) std::memcpy(hb + lay.single, plan.single.data(), size_t(n_single) * 4);
      std::memcpy(hb + lay.vtiles, plan.tiles.data(), size_t(n_vtiles) * sizeof(cuda::AttentionTile));
    }
    CUDA_CHECK(cudaMemcpyAsync(a.in, hb, lay.bytes(), cudaMemcpyHostToDevice, dev_.stream()));
    const auto* d_ids = reinterpret_cast<const int32_t*>(a.in + lay.in.ids);
    const auto* d_pos = reinterpret_cast<const int32_t*>(a.in + lay.in.pos);
    const auto* d_rows = reinterpret_cast<const DecodeRow*>(a.in + lay.in.rows);
    const auto* d_logit_rows = reinterpret_cast<const int32_t*>(a.in + lay.in.logit_rows);
    const auto* d_masks = reinterpret_cast<const uint64_t*>(a.in + lay.in.masks);
    const auto* d_seq_start = reinterpret_cast<const int64_t*>(a.in + lay.seq_start);
    const auto* d_tiles = reinterpret_cast<const int32_t*>(a.in + lay.tiles);
    cuda::AttentionWork work;
    if (tiled) {
      work.single = reinterpret_cast<const int32_t*>(a.in + lay.single);
      work.n_single = n_single;
      work.tiles = reinterpret_cast<const cuda::AttentionTile*>(a.in + lay.vtiles);
      work.n_tiles = n_vtiles;
    }
    cudaStream_t st = dev_.stream();

    // Everything from the embedding to the logits or greedy ids, on device buffers only.
    auto device_work = [&] {
      // Captures: rows are the packed tokens in order, kept on the device (the residual
      // stream is overwritten by the next layer) and copied down after the forward.
      auto capture = [&](int64_t layer_id) {
        cuda::capture_residual(a.cap, a.n_tokens, cap, layer_id, a.x, N, H, st);
        if (layer_id < c.n_layers) graphs_.layer_start(layer_id, st);
      };
      cuda::DenseHooks hooks;
      hooks.capture = capture;
      hooks.attention_rotates = true;
      hooks.fold_one_token = fold_;
      // One-token steps and short verifies (folded layers): RoPE and the cache write ride in the
      // q|k|v product's epilogue.
      hooks.rope_cache = [&](int64_t l, cuda::SkinnyRope& r) {
        if (flash || !fold_rope_) return false;
        r.rows = d_rows;
        r.kc = kc_[size_t(l)];
        r.vc = vc_[size_t(l)];
        r.cache = map;
        return true;
      };
      hooks.attention = [&](int64_t l, bool cached) {
        if (flash) {
          cuda::rope_forward(a.qkv, ldqkv, d_pos, w_.inv_freq, N, nh, hd, st);
          cuda::rope_forward(a.qkv + nh * hd, ldqkv, d_pos, w_.inv_freq, N, nkv, hd, st);
          cuda::kv_cache_write(kc_[size_t(l)], vc_[size_t(l)], a.qkv, ldqkv, d_rows, N, nh, nkv, hd, map, st);
          cuda::flash_attention_forward(a.att, a.qkv, ldqkv, d_seq_start, d_tiles, int64_t(tiles.size() / 2), nh, nkv,
                                        hd, W, st);
        } else {
          if (!cached)
            cuda::rope_kv_cache_write(kc_[size_t(l)], vc_[size_t(l)], a.qkv, ldqkv, d_pos, w_.inv_freq, d_rows, N, nh,
                                      nkv, hd, map, st);
          cuda::decode_attention(a.att, a.part, a.qkv, ldqkv, kc_[size_t(l)], vc_[size_t(l)], d_rows, d_masks, N, nh,
                                 nkv, hd, map, splits, split_len, st, merge_in_kernel_ ? a.counters : nullptr,
                                 tiled ? &work : nullptr);
        }
      };
      const bool folded = cuda::dense_stack_forward(
          w_, c, N, {d_ids, d_pos, a.x, a.xn, a.qkv, a.att, a.tmp, a.gu, a.act}, dev_.gemm(), st, hooks);
      if (NL > 0) {
        // Only the rows that want logits go through the LM head.
        const bf16* in = cuda::logits_input(a.sel, a.xn, d_logit_rows, NL, N, H, st);
        // After folded layers (at most kSkinnyMaxRows rows) the LM head stays on the skinny
        // kernel too (a row's logits are then the same bits in a one-token step and in a
        // verify: greedy speculative decoding picks what target-only decoding picks, near-ties
        // included); skinny_gemm refuses what it cannot take.
        if (!(folded && cuda::skinny_gemm(a.logits, in, w_.lm_head, NL, H, V, st)))
          dev_.gemm().forward(a.logits, in, w_.lm_head, NL, H, V, st);
        if (!keep_logits)
          cuda::finish_logits(a.top1, a.logits32, a.logits, NL, V,
                            sampled ? reinterpret_cast<const cuda::DeviceSampling*>(a.in + lay.in.sampling) : nullptr,
                            reinterpret_cast<const double*>(a.in + lay.in.uniforms), ids != nullptr, st);
      }
    };
    // A graph per shape (graph_cache.h); prefills (the packed attention) run eagerly.
    graphs_.run(fmt::format("{}/{}/{}/{}/{}/{}/{}/{}/{}/{}", N, NL, masks.size(), splits, split_len, n_single, n_vtiles,
                            keep_logits ? 3 : sampled ? 2 : ids ? 1 : 0, int(cap.dtype), fmt::join(cap.layers, ",")),
                st, device_work, !flash);

    cuda::results_down(cap, a.cap, a.n_tokens, N, H, keep_logits ? 0 : NL, a.top1, ids, a.logits32, logits, V, out_h_,
                       st);
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
    const int64_t qd = w_.nh * c.head_dim, ld = qd + 2 * w_.nkv * c.head_dim;
    graphs_.clear();
    acts_.reset();
    auto a = std::make_unique<Acts>();
    a->x = a->arena.alloc<float>(size_t(n * c.hidden));
    a->xn = a->arena.alloc<bf16>(size_t(n * c.hidden));
    a->qkv = a->arena.alloc<bf16>(size_t(n * ld));
    a->att = a->arena.alloc<bf16>(size_t(n * qd));
    a->tmp = a->arena.alloc<bf16>(size_t(n * c.hidden));
    a->gu = a->arena.alloc<bf16>(size_t(n * 2 * w_.inter));
    a->act = a->arena.alloc<bf16>(size_t(n * w_.inter));
    a->sel = a->arena.alloc<bf16>(size_t(nl * c.hidden));
    a->logits = a->arena.alloc<bf16>(size_t(nl * c.vocab));
    a->logits32 = a->arena.alloc<float>(size_t(nl * c.vocab));
    a->top1 = a->arena.alloc<int32_t>(size_t(nl));
    a->part = a->arena.alloc<float>(size_t(np));
    a->cap = a->arena.alloc<uint8_t>(size_t(nc * n * c.hidden * 4));
    a->in = a->arena.alloc<uint8_t>(size_t(ni));
    a->counters = a->arena.alloc<int>(size_t(n * w_.nh));
    CUDA_CHECK(cudaMemsetAsync(a->counters, 0, size_t(n * w_.nh) * sizeof(int), dev_.stream()));
    a->n_tokens = n, a->n_logits = nl, a->n_part = np, a->n_cap = nc, a->n_in = ni;
    acts_ = std::move(a);
  }

  // Checked before anything is allocated.
  static int checked(int n_slots, int64_t max_len, int device) {
    TALON_CHECK(n_slots > 0 && max_len > 0, "decoder: n_slots {} and max_len {} must be positive", n_slots, max_len);
    return device;
  }

  cuda::Device dev_;  // first: destroyed last (device.h)
  ModelConfig cfg_;
  int64_t max_len_;
  std::unique_ptr<cuda::DecodeSlots> slots_;  // sized once the weights are up
  DeviceArena cache_arena_;
  cuda::DenseDeviceWeights w_;
  std::vector<bf16*> kc_, vc_;   // per layer [pool rows, nkv, hd], paged (decode_slots.h)
  bf16** cache_ptrs_ = nullptr;  // device array of every layer's K and V pointers, for moves
  int32_t* move_pairs_ = nullptr;
  int32_t* page_table_ = nullptr;  // [n_slots, max_pages] (DecodeSlots::sync_pages)
  bool filled_ = false;
  std::unique_ptr<Acts> acts_;
  cuda::PinnedBuffer in_h_, out_h_;  // staging of Acts::in; the greedy ids coming down
  cuda::GraphCache graphs_;  // of run()'s device work, by shape
  bool merge_in_kernel_ = false;
  bool device_sampling_ = true;
  cuda::ChainAccepter accepter_;
  // A request's rows (a verify chain or tree) read the committed prefix once per tile of query
  // vectors, not once per row (decode_ops.h: AttentionTile).
  bool verify_tiles_ = cuda::verify_tiles_enabled();
  bool fold_ = true;
  bool fold_rope_ = fold_rope_enabled();

  static bool fold_rope_enabled() {
    const char* e = std::getenv("TALON_CUDA_FOLD_ROPE");
    return !(e && e[0] == '0');
  }

 public:
  void fold_one_token(bool on) {
    fold_ = on;
    graphs_.clear();  // graphs hold the launches of the other choice
  }
  void fold_rope(bool on) {
    fold_rope_ = on;
    graphs_.clear();
  }
};

}  // namespace

std::unique_ptr<Decoder> make_cuda_decoder(const Checkpoint& ckpt, const GpuOptions& go, int n_slots, int64_t max_len,
                                           int64_t cache_tokens) {
  TALON_CHECK(go.tp >= 1 && go.ep >= 1 && (go.tp == 1 || go.ep == 1),
              "decoding: --tp {} --ep {}: one of them, each >= 1", go.tp, go.ep);
  TALON_CHECK(!go.devices.empty(), "decoding: no device given");
  if (go.tp == 1 && go.ep == 1) {
    TALON_CHECK(go.devices.size() == 1, "decoding on {} devices needs --tp or --ep {}", go.devices.size(),
                go.devices.size());
    return make_cuda_decoder(ckpt, go.devices[0], n_slots, max_len, cache_tokens);
  }
  int present = 0;
  if (cudaGetDeviceCount(&present) != cudaSuccess || present == 0) fail("--device cuda: no CUDA device available");
  cuda::check_devices(go, present);
  return cuda::make_deepseek_decoder_group(ckpt, go, n_slots, max_len, cache_tokens);
}

std::unique_ptr<Decoder> make_cuda_decoder(const Checkpoint& ckpt, int device, int n_slots, int64_t max_len,
                                           int64_t cache_tokens) {
  if (is_deepseek(ckpt.config().arch))
    return cuda::make_deepseek_decoder(ckpt, device, n_slots, max_len, cache_tokens);
  return std::make_unique<CudaDecoder>(ckpt, device, n_slots, max_len, cache_tokens);
}

namespace cuda {
namespace {
DecoderControls& as_cuda(Decoder& d, const char* who) {
  auto* cd = dynamic_cast<DecoderControls*>(&d);
  TALON_CHECK(cd != nullptr, "{}: {} is not a CUDA decoder", who, d.backend());
  return *cd;
}
CudaDecoder& as_dense(Decoder& d, const char* who) {
  auto* cd = dynamic_cast<CudaDecoder*>(&d);
  TALON_CHECK(cd != nullptr, "{}: {} is not the dense CUDA decoder", who, d.backend());
  return *cd;
}
}  // namespace
void decoder_assume_length(Decoder& d, int slot, int64_t len) { as_cuda(d, "decoder_assume_length").assume_length(slot, len); }
void decoder_use_graphs(Decoder& d, bool on) { as_cuda(d, "decoder_use_graphs").use_graphs(on); }
void decoder_fold_one_token(Decoder& d, bool on) { as_dense(d, "decoder_fold_one_token").fold_one_token(on); }
void decoder_fold_rope(Decoder& d, bool on) { as_dense(d, "decoder_fold_rope").fold_rope(on); }
int64_t decoder_graph_launches(Decoder& d) { return as_cuda(d, "decoder_graph_launches").graph_launches(); }
void decoder_graph_layers(Decoder& d, int64_t n) { as_cuda(d, "decoder_graph_layers").graph_layers(n); }
size_t decoder_graph_parts(Decoder& d) { return as_cuda(d, "decoder_graph_parts").graph_parts(); }
}  // namespace cuda

}  // namespace talon
