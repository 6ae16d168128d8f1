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
#include "draft/cuda/draft_tree.h"
#include "util/dtype.h"
#include "util/error.h"
#include "util/log.h"

namespace talon::spec {

namespace {

using cuda::bf16;
using cuda::DecodeRow;
using cuda::DeviceArena;


class CudaDraftBackend final : public DraftBackend {
 public:
  static constexpr int kMaxTop = 64;  // top-k outputs per row kept on the device
  CudaDraftBackend(const DraftModel& m, const Checkpoint& target, int device, int64_t max_rows)
      : dev_(checked(device, max_rows), "draft"), c_(m.config), max_rows_(max_rows) {
    const auto& c = c_;
    const auto& w = m.weights;
    fc_ = cuda::upload_bf16(dev_.arena(), {&w.fc});
    in_ln_ = cuda::upload_bf16(dev_.arena(), {&w.in_ln});
    hidden_norm_ = cuda::upload_bf16(dev_.arena(), {&w.hidden_norm});
    wqkv_ = cuda::upload_bf16(dev_.arena(), {&w.wq, &w.wk, &w.wv});
    wo_ = cuda::upload_bf16(dev_.arena(), {&w.wo});
    post_ln_ = cuda::upload_bf16(dev_.arena(), {&w.post_ln});
    wgu_ = cuda::upload_bf16(dev_.arena(), {&w.gate, &w.up});
    wdown_ = cuda::upload_bf16(dev_.arena(), {&w.down});
    norm_ = cuda::upload_bf16(dev_.arena(), {&w.norm});
    lm_head_ = cuda::upload_bf16(dev_.arena(), {&w.lm_head});
    if (!m.embed.empty()) {  // P-EAGLE's own
      TALON_CHECK(int64_t(m.embed.size()) == c.V * c.H, "draft: its embedding has {} values, expected {} x {}",
                  m.embed.size(), c.V, c.H);
      embed_ = cuda::upload_bf16(dev_.arena(), {&m.embed});
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
    TALON_CHECK(int64_t(m.vocab.d2t.size()) == c.Vd, "draft: its vocabulary map has {} entries, expected {}",
                m.vocab.d2t.size(), c.Vd);
    d2t_ = dev_.arena().alloc<int64_t>(size_t(c.Vd));
    CUDA_CHECK(cudaMemcpy(d2t_, m.vocab.d2t.data(), size_t(c.Vd) * 8, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&out_ids_), size_t(kMaxTop) * 4, cudaHostAllocPortable));
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
    const int64_t H = c.H, Vd = c.Vd;
    if (dr.size() == 0) return;
    const Step st = plan(tokens, from_aux, dr, last_only, top_k, 0);
    ensure_acts(st.N, st.part, int64_t(st.end));
    Acts& a = *acts_;
    uint8_t* hb = staged_.ensure(st.end);
    stage(st, hb, tokens, in, dr);
    cudaStream_t s = dev_.stream();
    CUDA_CHECK(cudaMemcpyAsync(a.inputs, hb, st.end, cudaMemcpyHostToDevice, s));
    graphs_.run(key(st), s, [&] { enqueue(st, nullptr, nullptr, a.top_ids, a.top_lp); });
    CUDA_CHECK(cudaMemcpyAsync(hidden, a.x + st.first * H, size_t(st.n_out * H) * 4, cudaMemcpyDeviceToHost, s));
    if (logits) CUDA_CHECK(cudaMemcpyAsync(logits, a.lg32, size_t(st.n_out * Vd) * 4, cudaMemcpyDeviceToHost, s));
    if (top_k > 0) {
      CUDA_CHECK(cudaMemcpyAsync(top_ids, a.top_ids, size_t(st.n_out * top_k) * 4, cudaMemcpyDeviceToHost, s));
      CUDA_CHECK(cudaMemcpyAsync(top_lp, a.top_lp, size_t(st.n_out * top_k) * 4, cudaMemcpyDeviceToHost, s));
    }
    CUDA_CHECK(cudaStreamSynchronize(s));
  }

  // The first forward and every one-node step in one graph: step j's token is the target id
  // of the argmax of the row before it (mapped on the device), its input that row's hidden
  // state, already in the residual buffer. One copy up, one down (the argmax ids).
  bool chain(const int32_t* tokens, const float* in, bool from_aux, const DraftRows& first,
             const std::vector<DraftRows>& steps, int32_t* ids) override {
    dev_.activate();
    const auto& c = c_;
    const int64_t H = c.H, n_steps = int64_t(steps.size());
    TALON_CHECK(first.size() > 0, "draft: a chain needs a first forward");
    TALON_CHECK(n_steps + 1 <= kMaxTop, "draft: a chain of {} steps, at most {} on the GPU", n_steps + 1, kMaxTop);
    std::vector<Step> plans;
    plans.push_back(plan(tokens, from_aux, first, true, 1, 0));
    int64_t most_rows = plans[0].N, most_part = plans[0].part;
    for (const DraftRows& r : steps) {
      TALON_CHECK(r.size() == 1, "draft: a chain step has {} rows, expected 1", r.size());
      plans.push_back(plan(nullptr, false, r, false, 1, plans.back().end));
      most_part = std::max(most_part, plans.back().part);
    }
    const size_t bytes = plans.back().end;
    ensure_acts(most_rows, most_part, int64_t(bytes));
    Acts& a = *acts_;
    uint8_t* hb = staged_.ensure(bytes);
    stage(plans[0], hb, tokens, in, first);
    for (int64_t j = 0; j < n_steps; ++j) stage(plans[size_t(j + 1)], hb, nullptr, nullptr, steps[size_t(j)]);
    cudaStream_t s = dev_.stream();
    CUDA_CHECK(cudaMemcpyAsync(a.inputs, hb, bytes, cudaMemcpyHostToDevice, s));
    std::string k = "chain";
    for (const Step& st : plans) k += "|" + key(st);
    graphs_.run(k, s, [&] {
      enqueue(plans[0], nullptr, nullptr, a.top_ids, a.top_lp);
      for (int64_t j = 1; j <= n_steps; ++j) {
        cuda::offset_ids(a.chain_ids + j, a.top_ids + j - 1, d2t_, 1, s);
        // Step 1 reads the last row of the first forward; later steps the one row before.
        enqueue(plans[size_t(j)], a.chain_ids + j, a.x + (j == 1 ? plans[0].N - 1 : 0) * H, a.top_ids + j, a.top_lp + j);
      }
    });
    CUDA_CHECK(cudaMemcpyAsync(out_ids_, a.top_ids, size_t(n_steps + 1) * 4, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
    std::memcpy(ids, out_ids_, size_t(n_steps + 1) * 4);
    return true;
  }

  bool tree(const std::vector<int32_t>& root_tok, const std::vector<double>& root_score, const float* root_hidden,
            const std::vector<DraftRows>& steps, std::vector<int32_t>& tok, std::vector<int32_t>& par,
            std::vector<double>& score, std::vector<int32_t>& runner) override {
    dev_.activate();
    const auto& c = c_;
    const int64_t H = c.H, k = int64_t(root_tok.size()), n_steps = int64_t(steps.size());
    if (k < 1 || k > kMaxTop || n_steps < 1) return false;
    const int64_t C = k + n_steps * k * k;  // candidates
    // Plans of every step (k rows from hidden states, top-k of each row), then the candidate
    // arrays and the frontier, all in the packed inputs (one copy up).
    std::vector<Step> plans;
    size_t end = 0;
    for (const DraftRows& r : steps) {
      TALON_CHECK(r.size() == k, "draft: a tree step of {} rows, expected {}", r.size(), k);
      plans.push_back(plan(nullptr, false, r, false, int(k), end));
      end = plans.back().end;
    }
    cuda::PackedOffsets po(end);
    const size_t o_score = po.place(size_t(C) * 8), o_tok = po.place(size_t(C) * 4), o_par = po.place(size_t(C) * 4),
                 o_run = po.place(size_t(C) * 4), o_front = po.place(size_t(k) * 4),
                 o_moff = po.place(size_t(n_steps * k) * 4), off = po.bytes();
    int64_t most_part = 0;
    for (const Step& st : plans) most_part = std::max(most_part, st.part);
    ensure_acts(k, most_part, int64_t(off));
    Acts& a = *acts_;
    uint8_t* hb = staged_.ensure(off);
    stage(plans[0], hb, nullptr, nullptr, steps[0]);
    // Step 0's rows are the root's children: their tokens, the root's hidden state, own bits.
    std::vector<float> hin(size_t(k * H));
    for (int64_t i = 0; i < k; ++i) std::copy_n(root_hidden, H, hin.data() + i * H);
    std::memcpy(hb + plans[0].o_ids, root_tok.data(), size_t(k) * 4);
    std::memcpy(hb + plans[0].o_in, hin.data(), hin.size() * 4);
    for (int64_t j = 1; j < n_steps; ++j) stage(plans[size_t(j)], hb, nullptr, nullptr, steps[size_t(j)]);
    std::vector<int32_t> moff(size_t(n_steps * k)), init_par(size_t(k), -1), init_run(size_t(k), -1),
        front(static_cast<size_t>(k));
    for (int64_t j = 0; j < n_steps; ++j)
      for (int64_t i = 0; i < k; ++i) moff[size_t(j * k + i)] = steps[size_t(j)].mask[size_t(i)];
    for (int64_t i = 0; i < k; ++i) front[size_t(i)] = int32_t(i);
    std::memcpy(hb + o_score, root_score.data(), size_t(k) * 8);
    std::memcpy(hb + o_tok, root_tok.data(), size_t(k) * 4);
    std::memcpy(hb + o_par, init_par.data(), size_t(k) * 4);
    std::memcpy(hb + o_run, init_run.data(), size_t(k) * 4);
    std::memcpy(hb + o_front, front.data(), size_t(k) * 4);
    std::memcpy(hb + o_moff, moff.data(), moff.size() * 4);
    cudaStream_t s = dev_.stream();
    CUDA_CHECK(cudaMemcpyAsync(a.inputs, hb, off, cudaMemcpyHostToDevice, s));
    auto* d_score = reinterpret_cast<double*>(a.inputs + o_score);
    auto* d_tok = reinterpret_cast<int32_t*>(a.inputs + o_tok);
    auto* d_par = reinterpret_cast<int32_t*>(a.inputs + o_par);
    auto* d_run = reinterpret_cast<int32_t*>(a.inputs + o_run);
    auto* d_front = reinterpret_cast<int32_t*>(a.inputs + o_front);
    const auto* d_moff = reinterpret_cast<const int32_t*>(a.inputs + o_moff);
    std::string key = "tree/" + std::to_string(k);
    for (const Step& st : plans) key += "|" + this->key(st);
    graphs_.run(key, s, [&] {
      for (int64_t j = 0; j < n_steps; ++j) {
        const Step& st = plans[size_t(j)];
        enqueue(st, nullptr, j == 0 ? nullptr : a.hnext, a.top_ids, a.top_lp);
        cuda::TreeExpandArgs ta;
        ta.k = int(k);
        ta.top_ids = a.top_ids, ta.top_lp = a.top_lp, ta.frontier = d_front;
        ta.cand_tok = d_tok, ta.cand_par = d_par, ta.cand_runner = d_run, ta.cand_score = d_score;
        ta.first_new = int(k + j * k * k);
        ta.base_id = steps[size_t(j)].end[0] - steps[size_t(j)].len[0] - 1;
        ta.d2t = d2t_;
        if (j + 1 < n_steps) {
          const Step& nx = plans[size_t(j + 1)];
          ta.next_ids = reinterpret_cast<int32_t*>(a.inputs + nx.o_ids);
          ta.next_hidden = a.hnext;
          ta.cur_hidden = a.x;
          ta.H = int(H);
          ta.next_masks = reinterpret_cast<uint64_t*>(a.inputs + nx.o_masks);
          ta.cur_masks = reinterpret_cast<const uint64_t*>(a.inputs + st.o_masks);
          ta.cur_mask_off = d_moff + j * k;
          ta.next_mask_off = d_moff + (j + 1) * k;
          ta.next_base_id = steps[size_t(j + 1)].end[0] - steps[size_t(j + 1)].len[0] - 1;
        }
        cuda::tree_expand(ta, s);
      }
    });
    tok.resize(size_t(C));
    par.resize(size_t(C));
    score.resize(size_t(C));
    runner.resize(size_t(C));
    CUDA_CHECK(cudaMemcpyAsync(tok.data(), d_tok, size_t(C) * 4, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaMemcpyAsync(par.data(), d_par, size_t(C) * 4, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaMemcpyAsync(score.data(), d_score, size_t(C) * 8, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaMemcpyAsync(runner.data(), d_run, size_t(C) * 4, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
    return true;
  }

  ~CudaDraftBackend() override {
    dev_.activate();
    graphs_.clear();
    if (out_ids_) cudaFreeHost(out_ids_);
  }

 private:
  // One forward's plan: its rows in the decoder's convention, the attention plan, and where
  // its packed inputs sit in the inputs buffer (a replayed graph reads them there).
  struct Step {
    int64_t N = 0, first = 0, n_out = 0, in_w = 0, part = 0;
    bool from_aux = false, fold = false;
    int top_k = 0;
    std::vector<DecodeRow> rows;
    cuda::AttentionPlan attn;
    size_t o_ids = 0, o_pos = 0, o_rows = 0, o_masks = 0, o_in = 0, o_single = 0, o_tiles = 0, end = 0;
    int64_t n_single() const { return attn.tiles.empty() ? 0 : int64_t(attn.single.size()); }
    int64_t n_tiles() const { return int64_t(attn.tiles.size()); }
  };

  // tokens: checked when given (null: they come from the device, a chain's steps).
  Step plan(const int32_t* tokens, bool from_aux, const DraftRows& dr, bool last_only, int top_k, size_t base) const {
    const auto& c = c_;
    const int64_t N = dr.size(), H = c.H, I = c.I, nh = c.n_heads, nkv = c.n_kv_heads, hd = c.head_dim;
    const int64_t qd = nh * hd;
    TALON_CHECK(top_k <= kMaxTop, "draft: top-k {} above {} on the GPU", top_k, kMaxTop);
    Step st;
    st.N = N, st.from_aux = from_aux, st.top_k = top_k;
    st.rows.resize(size_t(N));
    for (int64_t r = 0; r < N; ++r) {
      const int32_t end = dr.end[size_t(r)];
      TALON_CHECK(end >= 1 && end <= max_rows_, "draft: row {} goes to cache row {}, outside the GPU cache of {} rows", r,
                  end - 1, max_rows_);
      TALON_CHECK(!tokens || (tokens[r] >= 0 && tokens[r] < c.V),
                  "draft: token id {} (row {}) outside the vocabulary [0, {})", tokens ? tokens[r] : 0, r, c.V);
      st.rows[size_t(r)] = DecodeRow{0, 0, dr.len[size_t(r)], end, dr.mask[size_t(r)]};
    }
    // A tree step's rows share the step-0 prefix: one tile of query vectors reads it once
    // (decode_ops.h: AttentionTile).
    st.attn = cuda::plan_attention(st.rows.data(), N, nh, nkv, hd, cuda::verify_tiles_enabled(), dev_.multiprocessors());
    st.part = N * nh * st.attn.splits.splits * (hd + 2);
    st.in_w = from_aux ? 3 * H : H;
    st.first = last_only ? N - 1 : 0;
    st.n_out = N - st.first;
    // Folding (enqueue) needs the layer's rows in shared memory: up to skinny_fusion_rows() rows
    // of small widths; a draft whose residual is its normed input (norm_before_residual) keeps
    // the unfolded layer. TALON_CUDA_FUSE=0 turns folding off (ops.h: skinny_fusion_enabled).
    st.fold = !c.norm_before_residual && N <= cuda::skinny_fusion_rows() && cuda::skinny_fusion_enabled() &&
              H <= 2048 && I <= 2048 && hd % 8 == 0 && cuda::skinny_fused_fits(2 * H, N) &&
              cuda::skinny_fused_fits(qd, N) && cuda::skinny_fused_fits(H, N) && cuda::skinny_fused_fits(I, N);
    cuda::PackedOffsets po(base);
    st.o_ids = po.place(size_t(N) * 4);
    st.o_pos = po.place(size_t(N) * 4);
    st.o_rows = po.place(size_t(N) * sizeof(DecodeRow));
    st.o_masks = po.place(dr.masks.size() * 8);
    st.o_in = po.place(size_t(N * st.in_w) * 4);
    st.o_single = po.place(size_t(st.n_single()) * 4);
    st.o_tiles = po.place(size_t(st.n_tiles()) * sizeof(cuda::AttentionTile));
    st.end = po.bytes();
    return st;
  }

  // Packs a step's inputs into the staging buffer (tokens and in may be null: a chain step's
  // come from the device).
  void stage(const Step& st, uint8_t* hb, const int32_t* tokens, const float* in, const DraftRows& dr) const {
    const int64_t N = st.N;
    if (tokens) std::memcpy(hb + st.o_ids, tokens, size_t(N) * 4);
    std::memcpy(hb + st.o_pos, dr.pos.data(), size_t(N) * 4);
    std::memcpy(hb + st.o_rows, st.rows.data(), size_t(N) * sizeof(DecodeRow));
    if (!dr.masks.empty()) std::memcpy(hb + st.o_masks, dr.masks.data(), dr.masks.size() * 8);
    if (in) std::memcpy(hb + st.o_in, in, size_t(N * st.in_w) * 4);
    if (st.n_single() > 0) std::memcpy(hb + st.o_single, st.attn.single.data(), size_t(st.n_single()) * 4);
    if (st.n_tiles() > 0)
      std::memcpy(hb + st.o_tiles, st.attn.tiles.data(), size_t(st.n_tiles()) * sizeof(cuda::AttentionTile));
  }

  std::string key(const Step& st) const {
    return fmt::format("{}/{}/{}/{}/{}/{}/{}/{}/{}/{}", st.N, int(st.from_aux), st.first, st.o_in - st.o_masks,
                       st.attn.splits.splits, st.attn.splits.split_len, st.top_k, st.n_single(), st.n_tiles(),
                       int(st.fold));
  }

  // The device work of one forward. ids: device token ids (null: the staged ones); hidden_src:
  // the input hidden state on the device for a tree step (null: the staged one; a.x itself:
  // already in place). Top-k outputs to top_ids / top_lp.
  void enqueue(const Step& st, const int32_t* ids_dev, const float* hidden_src, int32_t* top_ids, float* top_lp) {
    const auto& c = c_;
    Acts& a = *acts_;
    const int64_t N = st.N, H = c.H, I = c.I, nh = c.n_heads, nkv = c.n_kv_heads, hd = c.head_dim;
    const int64_t qd = nh * hd, ld = qd + 2 * nkv * hd, Vd = c.Vd, first = st.first, n_out = st.n_out;
    const float eps = float(c.rms_eps);
    cudaStream_t s = dev_.stream();
    const auto* ids = ids_dev ? ids_dev : reinterpret_cast<const int32_t*>(a.inputs + st.o_ids);
    const auto* pos = reinterpret_cast<const int32_t*>(a.inputs + st.o_pos);
    const auto* drows = reinterpret_cast<const DecodeRow*>(a.inputs + st.o_rows);
    const auto* masks = reinterpret_cast<const uint64_t*>(a.inputs + st.o_masks);
    const auto* din = reinterpret_cast<const float*>(a.inputs + st.o_in);
    const bool tiled = st.n_tiles() > 0;
    const cuda::AttentionWork work{reinterpret_cast<const int32_t*>(a.inputs + st.o_single), st.n_single(),
                                   reinterpret_cast<const cuda::AttentionTile*>(a.inputs + st.o_tiles), st.n_tiles()};
    const int64_t splits = st.attn.splits.splits, split_len = st.attn.splits.split_len;
    // Input: [norm(embedding) | norm(g)], g = fc(aux) or the parent's hidden state.
    cuda::embedding_forward(a.e, ids, embed_, N, H, c.V, s);
    // Both norms write straight into their halves of the layer input rows.
    cuda::add_rmsnorm_forward(a.xin, a.e, nullptr, in_ln_, N, H, eps, s, 2 * H);
    if (st.from_aux) {
      cuda::f32_to_bf16(a.aux, din, N * 3 * H, s);
      dev_.gemm().forward(a.tmp, a.aux, fc_, N, 3 * H, H, s);
      cuda::bf16_to_f32(a.x, a.tmp, N * H, s);
    } else if (hidden_src != a.x) {
      CUDA_CHECK(cudaMemcpyAsync(a.x, hidden_src ? hidden_src : din, size_t(N * H) * 4, cudaMemcpyDeviceToDevice, s));
    }
    if (c.norm_before_residual) {  // the normed g is also the residual: keep a contiguous copy
      cuda::add_rmsnorm_forward(a.gn, a.x, nullptr, hidden_norm_, N, H, eps, s);
      CUDA_CHECK(cudaMemcpy2DAsync(a.xin + H, size_t(2 * H) * 2, a.gn, size_t(H) * 2, size_t(H) * 2, size_t(N),
                                   cudaMemcpyDeviceToDevice, s));
    } else {
      cuda::add_rmsnorm_forward(a.xin + H, a.x, nullptr, hidden_norm_, N, H, eps, s, 2 * H);
    }
    if (st.fold) {
      // A few rows (a chain step, the extension after a verify): RoPE and the cache write in
      // the q|k|v product's epilogue, the residual adds, the post-attention norm and SwiGLU
      // in the skinny products (ops.h: skinny_fused), as the target's folded layers do.
      auto run = [&](const cuda::SkinnyFused& f, const bf16* wt, int64_t K, int64_t O) {
        TALON_CHECK(cuda::skinny_fused(f, wt, K, O, s), "draft: a fused skinny product was refused ({} x {})", K, O);
      };
      cuda::SkinnyRope rope;
      rope.pos = pos, rope.inv_freq = inv_freq_, rope.rows = drows, rope.kc = kc_, rope.vc = vc_;
      rope.nh = int(nh), rope.nkv = int(nkv), rope.hd = int(hd), rope.cache = max_rows_;
      cuda::SkinnyFused fq{cuda::SkinnyIn::Plain, a.xin, nullptr, nullptr, 0.f, a.qkv, nullptr, N};
      fq.rope = &rope;
      run(fq, wqkv_, 2 * H, ld);
      cuda::decode_attention(a.att, a.part, a.qkv, ld, kc_, vc_, drows, masks, N, nh, nkv, hd, max_rows_, splits,
                             split_len, s, nullptr, tiled ? &work : nullptr);
      run({cuda::SkinnyIn::Plain, a.att, nullptr, nullptr, 0.f, nullptr, a.x, N}, wo_, qd, H);
      run({cuda::SkinnyIn::Norm, nullptr, a.x, post_ln_, eps, a.gu, nullptr, N}, wgu_, H, 2 * I);
      run({cuda::SkinnyIn::Swiglu, a.gu, nullptr, nullptr, 0.f, nullptr, a.x, N}, wdown_, I, H);
      cuda::add_rmsnorm_forward(a.hm, a.x, nullptr, norm_, N, H, eps, s);
    } else {
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
    }
    dev_.gemm().forward(a.lg, a.hm + first * H, lm_head_, n_out, H, Vd, s);
    cuda::bf16_to_f32(a.lg32, a.lg, n_out * Vd, s);
    if (st.top_k > 0) cuda::topk_logsoftmax(top_ids, top_lp, a.lg32, n_out, Vd, st.top_k, s);
  }

  struct Acts {
    DeviceArena arena;
    int64_t n = 0, n_part = 0, n_inputs = 0;
    float *e, *x, *part, *lg32, *top_lp;
    bf16 *aux, *gn, *xin, *qkv, *att, *tmp, *hm, *gu, *act, *lg;
    int32_t *top_ids, *chain_ids;  // chain_ids: a chain's step tokens, [kMaxTop]
    float* hnext;                  // a tree step's input hidden states, [n, H]
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
    a->chain_ids = a->arena.alloc<int32_t>(size_t(kMaxTop));
    a->hnext = a->arena.alloc<float>(size_t(n * H));
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
  int64_t* d2t_;  // [Vd]: target id = draft id + d2t[draft id]
  bf16 *kc_, *vc_;
  std::unique_ptr<Acts> acts_;
  cuda::PinnedBuffer staged_;  // pinned staging of the packed inputs
  int32_t* out_ids_ = nullptr;  // pinned: a chain's ids on their way down
  cuda::GraphCache graphs_;  // of forward()'s device work, by shape
};

}  // namespace

std::unique_ptr<DraftBackend> make_cuda_draft_backend(const DraftModel& m, const Checkpoint& target, int device,
                                                      int64_t max_rows) {
  return std::make_unique<CudaDraftBackend>(m, target, device, max_rows);
}

}  // namespace talon::spec
