// The CPU reference forward for the DeepSeek-V2/V3 family (Kimi-K2 included): multi-head
// latent attention (MLA) and mixture-of-experts MLPs, as transformers' DeepseekV2/V3
// modeling code computes them. fp32 throughout; quantized weights (FP8 block, int4 groups)
// are dequantized one matrix at a time into a scratch buffer right before their matmul.
//
// Per decoder layer (x = residual stream, h[l] = x on entry, as the dense model):
//   xn = rmsnorm(x)
//   q  = q_proj(xn)  or  q_b(rmsnorm_1e-6(q_a(xn)))             [N, nh, nope + rope]
//   c  = kv_a(xn) = [ckv (kv_lora_rank) | k_pe (rope)]            one shared rope key
//   kv = kv_b(rmsnorm_1e-6(ckv))                                  [N, nh, nope + v]
//   RoPE (YaRN, cos/sin scaled by the attention factor) on q's rope part and on k_pe;
//   k = [k_nope | k_pe] per head; softmax scale = qk^-0.5 * mscale(factor, mscale_all_dim)^2
//   x += o_proj(attention(q, k, v))
//   xn = rmsnorm(x)
//   x += dense SwiGLU MLP (layers < first_k_dense_replace), else
//        sum over the token's top-k routed experts e (by expert id) of w_e * expert_e(xn)
//        + shared_experts(xn)
// By default this is the "naive" expanded form of MLA (keys and values expanded per head).
// With absorbed_mla it computes the weight-absorbed form that decoding uses: kv_b's key half
// W_UK[h] [nope, kvr] is folded into the query (q_lat[h] = W_UK[h]^T q_nope[h]) and its value
// half W_UV[h] [v, kvr] applied after attention, so attention runs over the shared latent
// c = rmsnorm(ckv) [kvr] plus the shared k_pe — one key / value row per token for all heads
// (what a decode cache stores: kvr + rope values per token instead of nh (qk + v)):
//   score(i, j, h) = q_lat[i, h] . c[j] + q_pe[i, h] . k_pe[j]
//   out[i, h]      = W_UV[h] (sum_j p(i, j, h) c[j])
// The same function as the expanded form up to fp32 summation order (tested).
//
// RoPE layout: DeepSeek rotates adjacent pairs (x[2i], x[2i+1]) of the rope part.
// transformers' DeepseekV2 does so in place (complex form); DeepseekV3 with
// rope_interleave = true rotates the same pairs and writes them de-interleaved ([evens |
// odds]) for both q and k, a permutation that leaves every q.k unchanged, so rotating in
// place here is the same attention. rope_interleave = false rotates (i, i + rope/2).
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "backend/backend.h"
#include "backend/cpu/kv_slots.h"
#include "backend/cpu/ops.h"
#include "model/decode.h"
#include "model/deepseek.h"
#include "model/model.h"
#include "util/error.h"

namespace talon {

namespace {


// transformers builds q_a_layernorm / kv_a_layernorm with the RMSNorm default eps, not
// the config's rms_norm_eps.
constexpr float kLatentNormEps = 1e-6f;

struct DsLayer {
  std::vector<float> attn_norm, mlp_norm, q_a_norm, kv_a_norm, router_bias;
  std::vector<float> router;  // [E, H] fp32 (transformers routes in fp32)
  const DeepseekLayer* w;     // the linear weights (views into the checkpoint)
};

class CpuDeepseekModel final : public Model {
 public:
  CpuDeepseekModel(const Checkpoint& ckpt, bool absorbed)
      : cfg_(ckpt.config()), w_(bind_deepseek_weights(ckpt)), absorbed_(absorbed) {
    embed_ = w_.embed;
    final_norm_ = weight_to_f32(w_.final_norm);
    lm_head_ = {QuantWeight::Kind::Plain, cfg_.vocab, cfg_.hidden, w_.lm_head, {}, 0, 0, 0};
    for (auto& l : w_.layers) {
      DsLayer L;
      L.attn_norm = weight_to_f32(l.attn_norm);
      L.mlp_norm = weight_to_f32(l.mlp_norm);
      L.q_a_norm = weight_to_f32(l.q_a_norm);
      L.kv_a_norm = weight_to_f32(l.kv_a_norm);
      L.router = weight_to_f32(l.router);
      L.router_bias = weight_to_f32(l.router_bias);
      L.w = &l;
      layers_.push_back(std::move(L));
    }
    inv_freq_ = rope_inv_freq(cfg_.rope, cfg_.ds.qk_rope_head_dim);
  }

  const ModelConfig& config() const override { return cfg_; }
  std::string backend() const override { return absorbed_ ? "cpu (absorbed MLA)" : "cpu"; }

  void forward(const Batch& b, const Capture& cap, float* logits) override {
    const ModelConfig& c = cfg_;
    const DeepseekConfig& d = c.ds;
    const int64_t N = b.n_tokens(), nh = c.n_heads;
    const int64_t nope = d.qk_nope_head_dim, rope = d.qk_rope_head_dim, qk = d.qk_head_dim(), vd = d.v_head_dim;
    const int64_t kvr = d.kv_lora_rank;
    cap.validate(c.n_layers, b);
    const std::vector<int32_t> pos = b.positions();
    const std::vector<int64_t> dst = cap.dst_rows(b);
    std::vector<float> kv, k, v;
    auto attend = [&](int64_t, const float* q, const float* lat, const float* ckv, const QuantWeight& kv_b,
                      float* att) {
      if (absorbed_) {
        absorbed_attention(att, q, N, lat, kvr, ckv + kvr, kvr + rope, kv_b, [&](int64_t n, std::vector<int64_t>& keys) {
          int64_t s = 0;
          while (b.seq_start[size_t(s + 1)] <= n) ++s;
          keys.clear();
          for (int64_t j = b.seq_start[size_t(s)]; j <= n; ++j) keys.push_back(j);
        });
        return;
      }
      kv.resize(size_t(N * nh * (nope + vd)));
      k.resize(size_t(N * nh * qk));
      v.resize(size_t(N * nh * vd));
      linear(kv.data(), lat, kv_b, N);  // [N, nh, nope + v]
      // Expand: k[n, h] = [k_nope(n, h) | k_pe(n)], v[n, h] from kv_b's output.
      for (int64_t n = 0; n < N; ++n)
        for (int64_t h = 0; h < nh; ++h) {
          const float* src = kv.data() + (n * nh + h) * (nope + vd);
          float* kd = k.data() + (n * nh + h) * qk;
          std::copy_n(src, nope, kd);
          std::copy_n(ckv + n * (kvr + rope) + kvr, rope, kd + nope);
          std::copy_n(src + nope, vd, v.data() + (n * nh + h) * vd);
        }
      cpu::attention_mha_forward(att, q, k.data(), v.data(), b.seq_start.data(), b.n_seqs(), nh, qk, vd,
                                 float(d.softmax_scale));
    };
    std::vector<int64_t> rows;
    if (logits)
      for (int64_t n = 0; n < N; ++n) rows.push_back(n);
    run(b.tokens.data(), pos.data(), N, attend,
        [&](int64_t l, const float* x) { cpu::capture_rows(cap, int(l), x, N, c.hidden, dst.data()); }, rows, logits);
  }

  // The layer stack over N rows at positions pos. attend(l, q, lat, ckv, kv_b, att) fills
  // att [N, nh * v] from q [N, nh, nope + rope] and ckv [N, kvr + rope] (RoPE applied to
  // their rope parts) and the normalized latent lat [N, kvr]; capture(l, x) sees h[l]
  // (l = 0..L); logits [rows, V] for the rows listed (in that order).
  template <class Attend, class CaptureFn>
  void run(const int32_t* tokens, const int32_t* pos, int64_t N, Attend&& attend, CaptureFn&& capture,
           const std::vector<int64_t>& logit_rows, float* logits) {
    const ModelConfig& c = cfg_;
    const DeepseekConfig& d = c.ds;
    const int64_t H = c.hidden, nh = c.n_heads;
    const int64_t nope = d.qk_nope_head_dim, rope = d.qk_rope_head_dim, qk = d.qk_head_dim(), vd = d.v_head_dim;
    const int64_t kvr = d.kv_lora_rank, K = d.num_experts_per_tok;
    const float eps = float(c.rms_eps);
    auto buf = [](int64_t n) { return std::vector<float>(static_cast<size_t>(n)); };
    std::vector<float> x = buf(N * H), xn = buf(N * H), tmp = buf(N * H);
    std::vector<float> qa = buf(N * std::max<int64_t>(d.q_lora_rank, 1)), q = buf(N * nh * qk);
    std::vector<float> ckv = buf(N * (kvr + rope)), lat = buf(N * kvr), att = buf(N * nh * vd);

    cpu::embedding_forward(x.data(), tokens, embed_.data, embed_.dtype, N, H, c.vocab);  // h[0]
    for (int64_t l = 0; l < c.n_layers; ++l) {
      capture(l, x.data());  // h[l]: the input of layer l
      const DsLayer& L = layers_[size_t(l)];
      const DeepseekLayer& W = *L.w;
      // ---- MLA attention block
      cpu::rmsnorm_forward(xn.data(), x.data(), L.attn_norm.data(), N, H, eps);
      if (d.q_lora_rank > 0) {
        linear(qa.data(), xn.data(), W.q_a, N);
        cpu::rmsnorm_forward(qa.data(), qa.data(), L.q_a_norm.data(), N, d.q_lora_rank, kLatentNormEps);
        linear(q.data(), qa.data(), W.q_b, N);
      } else {
        linear(q.data(), xn.data(), W.q_proj, N);
      }
      linear(ckv.data(), xn.data(), W.kv_a, N);  // [N, kvr + rope]
      for (int64_t n = 0; n < N; ++n)
        std::copy_n(ckv.data() + n * (kvr + rope), kvr, lat.data() + n * kvr);
      cpu::rmsnorm_forward(lat.data(), lat.data(), L.kv_a_norm.data(), N, kvr, kLatentNormEps);
      // RoPE on q's rope part (every head) and on the single shared k_pe.
      const float af = float(c.rope.attention_factor);
      cpu::rope_strided_forward(q.data() + nope, pos, inv_freq_.data(), N, nh, nh * qk, qk, rope, d.rope_interleave,
                                af);
      cpu::rope_strided_forward(ckv.data() + kvr, pos, inv_freq_.data(), N, 1, kvr + rope, 0, rope, d.rope_interleave,
                                af);
      attend(l, q.data(), lat.data(), ckv.data(), W.kv_b, att.data());
      linear(tmp.data(), att.data(), W.o_proj, N);
      cpu::residual_forward(x.data(), tmp.data(), N * H);
      mlp_block(x, xn, tmp, L, N, K);
    }
    capture(c.n_layers, x.data());  // h[L]: before the final norm
    if (!logits || logit_rows.empty()) return;
    const int64_t R = int64_t(logit_rows.size());
    std::vector<float> xr = buf(R * H);
    for (int64_t i = 0; i < R; ++i) std::copy_n(x.data() + logit_rows[size_t(i)] * H, H, xr.data() + i * H);
    cpu::rmsnorm_forward(xr.data(), xr.data(), final_norm_.data(), R, H, eps);
    linear(logits, xr.data(), lm_head_, R);
  }

  // The weight-absorbed MLA (see the header): att [N, nh, v] from q [N, nh, nope + rope] (RoPE
  // applied), latent rows lat (row j at lat + j * lat_stride, kvr values), k_pe rows (RoPE
  // applied, at kpe + j * kpe_stride) and kv_b [nh (nope + v), kvr]; keys_of(n, keys) lists
  // the rows query n attends to, in position order.
  template <class Keys>
  void absorbed_attention(float* att, const float* q, int64_t N, const float* lat, int64_t lat_stride, const float* kpe,
                          int64_t kpe_stride, const QuantWeight& kv_b, Keys&& keys_of) {
    const DeepseekConfig& d = cfg_.ds;
    const int64_t nh = cfg_.n_heads, nope = d.qk_nope_head_dim, rope = d.qk_rope_head_dim;
    const int64_t qk = nope + rope, vd = d.v_head_dim, kvr = d.kv_lora_rank;
    std::vector<float> wkv(size_t(kv_b.rows * kv_b.cols));
    dequantize(kv_b, wkv.data());
    // q_lat[n, h, :] = W_UK[h]^T q_nope[n, h]
    std::vector<float> q_lat(size_t(N * nh * kvr), 0.f);
#pragma omp parallel for collapse(2) schedule(static) if (N * nh * nope * kvr >= cpu::kParallelMinWork)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < nh; ++h) {
        float* ql = q_lat.data() + (n * nh + h) * kvr;
        for (int64_t j = 0; j < nope; ++j) {
          const float qv = q[(n * nh + h) * qk + j];
          const float* wr = wkv.data() + (h * (nope + vd) + j) * kvr;
          for (int64_t r = 0; r < kvr; ++r) ql[r] += qv * wr[r];
        }
      }
    const float scale = float(d.softmax_scale);
#pragma omp parallel if (N * nh * kvr >= cpu::kParallelMinWork / 4)
    {
      std::vector<float> p, o(static_cast<size_t>(kvr));
      std::vector<int64_t> keys;
#pragma omp for schedule(dynamic)
      for (int64_t n = 0; n < N; ++n) {
        keys_of(n, keys);
        for (int64_t h = 0; h < nh; ++h) {
          const float* ql = q_lat.data() + (n * nh + h) * kvr;
          const float* qp = q + (n * nh + h) * qk + nope;
          p.assign(keys.size(), 0.f);
          float mx = -INFINITY;
          for (size_t i = 0; i < keys.size(); ++i) {
            const float* cj = lat + keys[i] * lat_stride;
            const float* kp = kpe + keys[i] * kpe_stride;
            float sc = 0.f;
            for (int64_t r = 0; r < kvr; ++r) sc += ql[r] * cj[r];
            for (int64_t r = 0; r < rope; ++r) sc += qp[r] * kp[r];
            sc *= scale;
            p[i] = sc;
            mx = std::max(mx, sc);
          }
          double z = 0;
          for (auto& v : p) z += (v = std::exp(v - mx));
          std::fill(o.begin(), o.end(), 0.f);
          for (size_t i = 0; i < keys.size(); ++i) {
            const float w = float(p[i] / z);
            const float* cj = lat + keys[i] * lat_stride;
            for (int64_t r = 0; r < kvr; ++r) o[size_t(r)] += w * cj[r];
          }
          // out[n, h] = W_UV[h] o
          float* out = att + (n * nh + h) * vd;
          for (int64_t i = 0; i < vd; ++i) {
            const float* wr = wkv.data() + (h * (nope + vd) + nope + i) * kvr;
            float acc = 0.f;
            for (int64_t r = 0; r < kvr; ++r) acc += wr[r] * o[size_t(r)];
            out[i] = acc;
          }
        }
      }
    }
  }

 private:
  // x += the layer's MLP (dense, or routed + shared experts) of rmsnorm(x).
  void mlp_block(std::vector<float>& x, std::vector<float>& xn, std::vector<float>& tmp, const DsLayer& L, int64_t N,
                 int64_t K) {
    const int64_t H = cfg_.hidden;
    cpu::rmsnorm_forward(xn.data(), x.data(), L.mlp_norm.data(), N, H, float(cfg_.rms_eps));
    if (!L.w->moe)
      mlp(tmp.data(), xn.data(), L.w->dense, N);
    else
      moe(tmp.data(), xn.data(), L, N, K);
    cpu::residual_forward(x.data(), tmp.data(), N * H);
  }

  // out[N, O] = in[N, I] @ w^T. Plain 4-byte-aligned weights are used in place; anything
  // else (FP8, int4, misaligned F32) is dequantized into the scratch matrix first.
  void linear(float* out, const float* in, const QuantWeight& w, int64_t N) {
    const bool direct = w.kind == QuantWeight::Kind::Plain &&
                        (w.w.dtype != DType::F32 || reinterpret_cast<uintptr_t>(w.w.data) % alignof(float) == 0);
    if (direct) return cpu::matmul_forward(out, in, w.w.data, w.w.dtype, nullptr, N, w.cols, w.rows);
    scratch_.resize(size_t(w.rows * w.cols));
    const int64_t chunk = 16;
#pragma omp parallel for schedule(static) if (w.rows * w.cols >= cpu::kParallelMinWork)
    for (int64_t r0 = 0; r0 < w.rows; r0 += chunk)
      dequantize_rows(w, r0, std::min(w.rows, r0 + chunk), scratch_.data() + r0 * w.cols);
    cpu::matmul_forward(out, in, scratch_.data(), DType::F32, nullptr, N, w.cols, w.rows);
  }

  // out[N, H] = down(silu(gate(in)) * up(in)).
  void mlp(float* out, const float* in, const DeepseekMlp& m, int64_t N) {
    const int64_t I = m.gate.rows;
    g_.resize(size_t(N * I));
    u_.resize(size_t(N * I));
    linear(g_.data(), in, m.gate, N);
    linear(u_.data(), in, m.up, N);
    cpu::swiglu_forward(g_.data(), g_.data(), u_.data(), N * I);
    linear(out, g_.data(), m.down, N);
  }

  // out[N, H] = routed experts (weighted, summed in expert-id order per token) + shared.
  void moe(float* out, const float* xn, const DsLayer& L, int64_t N, int64_t K) {
    const ModelConfig& c = cfg_;
    const DeepseekConfig& d = c.ds;
    const int64_t H = c.hidden, E = d.n_routed_experts;
    std::vector<float> rl(size_t(N * E)), wts(size_t(N * K));
    std::vector<int32_t> idx(size_t(N * K));
    cpu::matmul_forward(rl.data(), xn, L.router.data(), DType::F32, nullptr, N, H, E);
    cpu::moe_router_forward(idx.data(), wts.data(), rl.data(), L.router_bias.empty() ? nullptr : L.router_bias.data(),
                            N, E, K, d.scoring_func, d.topk_method, d.n_group, d.topk_group, d.norm_topk_prob,
                            float(d.routed_scaling_factor));
    // Each expert runs on the rows routed to it; its output for (token n, slot t) lands in
    // y[n, t], so the per-token sum below has a fixed order whatever the batch.
    std::vector<float> y(size_t(N * K * H));
    std::vector<int64_t> rows;
    std::vector<float> xin, yout;
    for (int64_t e = 0; e < E; ++e) {
      rows.clear();
      for (int64_t i = 0; i < N * K; ++i)
        if (idx[size_t(i)] == e) rows.push_back(i);
      if (rows.empty()) continue;
      const int64_t n = int64_t(rows.size());
      xin.resize(size_t(n * H));
      yout.resize(size_t(n * H));
      for (int64_t r = 0; r < n; ++r) std::copy_n(xn + (rows[size_t(r)] / K) * H, H, xin.data() + r * H);
      mlp(yout.data(), xin.data(), L.w->experts[size_t(e)], n);
      for (int64_t r = 0; r < n; ++r) std::copy_n(yout.data() + r * H, H, y.data() + rows[size_t(r)] * H);
    }
    // As transformers: routed contributions (w * expert output, in fp32) accumulated from
    // zero in expert-id order, then the shared experts' output added.
#pragma omp parallel for schedule(static) if (N * H * K >= cpu::kParallelMinWork)
    for (int64_t n = 0; n < N; ++n) {
      float* o = out + n * H;
      std::fill(o, o + H, 0.0f);
      for (int64_t t = 0; t < K; ++t) {
        const float w = wts[size_t(n * K + t)];
        const float* src = y.data() + (n * K + t) * H;
        for (int64_t i = 0; i < H; ++i) o[i] += src[i] * w;
      }
    }
    if (!L.w->shared.gate.empty()) {
      std::vector<float> sh(size_t(N * H));
      mlp(sh.data(), xn, L.w->shared, N);
      cpu::residual_forward(out, sh.data(), N * H);
    }
  }

  ModelConfig cfg_;
  DeepseekWeights w_;
  WeightRef embed_;
  QuantWeight lm_head_;
  std::vector<float> final_norm_;
  std::vector<DsLayer> layers_;
  std::vector<float> inv_freq_;
  std::vector<float> scratch_, g_, u_;  // dequantized matrix; MLP intermediates
  bool absorbed_ = false;
};

// The cached decoder of this family: per slot and layer, each token's normalized latent and
// k_pe, [c | k_pe] (kv_lora_rank + rope floats: what the absorbed form attends over), in
// fp32. The layer stack is the absorbed CpuDeepseekModel's; only the attention differs: a
// row attends to its slot's cached rows (cpu::KvSlots).
class CpuDeepseekDecoder final : public cpu::KvSlots {
 public:
  CpuDeepseekDecoder(const Checkpoint& ckpt, int n_slots, int64_t max_len, int64_t cache_tokens)
      : KvSlots(n_slots, ckpt.config().n_layers, ckpt.config().ds.kv_lora_rank + ckpt.config().ds.qk_rope_head_dim,
                max_len, cache_tokens),
        m_(ckpt, true) {}
  const ModelConfig& config() const override { return m_.config(); }
  std::string backend() const override { return "cpu (absorbed MLA)"; }

  void forward(const std::vector<DecodeRequest>& reqs, const Capture& cap, float* logits) override {
    const ModelConfig& c = m_.config();
    const int64_t kvr = c.ds.kv_lora_rank, rope = c.ds.qk_rope_head_dim, lkv = kvr + rope;
    const int64_t qk = c.ds.qk_head_dim(), nh = c.n_heads, vd = c.ds.v_head_dim;
    cap.validate(c.n_layers);
    cpu::KvSlots::Plan plan = plan_forward(reqs);
    const int64_t N = int64_t(plan.rows.size());
    std::vector<int64_t> dst(static_cast<size_t>(N));
    for (int64_t r = 0; r < N; ++r) dst[size_t(r)] = r;
    auto attend = [&](int64_t l, const float* q, const float* lat, const float* ckv, const QuantWeight& kv_b,
                      float* att) {
      for (int64_t r = 0; r < N; ++r) {  // the new rows join their slots' caches (pending)
        float* row = cache_ptr(plan.rows[size_t(r)].slot, l, cache_row(plan, r));
        std::copy_n(lat + r * kvr, kvr, row);
        std::copy_n(ckv + r * lkv + kvr, rope, row + kvr);
      }
      // One request (one slot's cache) at a time.
      for (int64_t first = 0; first < N;) {
        const int slot = plan.rows[size_t(first)].slot;
        int64_t n = 0;
        while (first + n < N && plan.rows[size_t(first + n)].slot == slot) ++n;
        const float* base = layer_rows(slot, l);
        m_.absorbed_attention(att + first * nh * vd, q + first * nh * qk, n, base, lkv, base + kvr, lkv, kv_b,
                              [&](int64_t i, std::vector<int64_t>& keys) { attended_rows(plan, first + i, 0, keys); });
        first += n;
      }
    };
    m_.run(plan.tokens.data(), plan.pos.data(), N, attend,
           [&](int64_t l, const float* x) { cpu::capture_rows(cap, int(l), x, N, c.hidden, dst.data()); },
           logits ? plan.logit_rows : std::vector<int64_t>{}, logits);
    finish(reqs, plan);
  }

 private:
  CpuDeepseekModel m_;
};

}  // namespace

std::unique_ptr<Decoder> make_cpu_deepseek_decoder(const Checkpoint& ckpt, int n_slots, int64_t max_len,
                                                   int64_t cache_tokens) {
  TALON_CHECK(is_deepseek(ckpt.config().arch), "{}: not a DeepSeek-family model", ckpt.source());
  return std::make_unique<CpuDeepseekDecoder>(ckpt, n_slots, max_len, cache_tokens);
}

std::unique_ptr<Model> make_cpu_deepseek_model(const Checkpoint& ckpt, bool absorbed_mla) {
  TALON_CHECK(is_deepseek(ckpt.config().arch), "{}: not a DeepSeek-family model", ckpt.source());
  return std::make_unique<CpuDeepseekModel>(ckpt, absorbed_mla);
}

}  // namespace talon
