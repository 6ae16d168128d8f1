// The CPU reference forward for the dense decoder family. Read top to bottom, this
// is the definition of what every other backend must compute.
#include <omp.h>

#include <cmath>

#include "backend/cpu/ops.h"
#include "model/dense.h"
#include "model/model.h"
#include "util/error.h"

namespace talon {

namespace {

// Small vectors (norms, biases) as owned fp32.
std::vector<float> to_f32(const WeightRef& w) {
  if (!w.data) return {};
  int64_t n = 1;
  for (auto d : w.shape) n *= d;
  std::vector<float> out(static_cast<size_t>(n));
  convert_to_f32(w.dtype, w.data, out.data(), out.size());
  return out;
}

// Matrices stay where they are (mmap, zero-copy) unless an F32 view is misaligned.
struct Mat {
  const void* data = nullptr;
  DType dtype = DType::F32;
  std::vector<float> owned;
};

Mat to_mat(const WeightRef& w) {
  Mat m{w.data, w.dtype, {}};
  if (w.dtype == DType::F32 && reinterpret_cast<uintptr_t>(w.data) % alignof(float) != 0) {
    m.owned = to_f32(w);
    m.data = m.owned.data();
  }
  return m;
}

struct Layer {
  std::vector<float> attn_norm, mlp_norm, bq, bk, bv, q_norm, k_norm;
  Mat wq, wk, wv, wo, w_gate, w_up, w_down;
};

class CpuDenseModel final : public Model {
 public:
  explicit CpuDenseModel(const Checkpoint& ckpt) : cfg_(ckpt.config()) {
    DenseWeights w = bind_dense_weights(ckpt);
    embed_ = to_mat(w.embed);
    lm_head_ = to_mat(w.lm_head);
    final_norm_ = to_f32(w.final_norm);
    for (auto& l : w.layers) {
      Layer L;
      L.attn_norm = to_f32(l.attn_norm);
      L.mlp_norm = to_f32(l.mlp_norm);
      L.bq = to_f32(l.bq);
      L.bk = to_f32(l.bk);
      L.bv = to_f32(l.bv);
      L.q_norm = to_f32(l.q_norm);
      L.k_norm = to_f32(l.k_norm);
      L.wq = to_mat(l.wq);
      L.wk = to_mat(l.wk);
      L.wv = to_mat(l.wv);
      L.wo = to_mat(l.wo);
      L.w_gate = to_mat(l.w_gate);
      L.w_up = to_mat(l.w_up);
      L.w_down = to_mat(l.w_down);
      layers_.push_back(std::move(L));
    }
    inv_freq_ = rope_inv_freq(cfg_.rope, cfg_.head_dim);
  }

  const ModelConfig& config() const override { return cfg_; }
  std::string backend() const override { return "cpu"; }

  void forward(const Batch& b, const Capture& cap, float* logits) override {
    const ModelConfig& c = cfg_;
    const int64_t N = b.n_tokens(), H = c.hidden, I = c.intermediate, hd = c.head_dim;
    const int64_t nh = c.n_heads, nkv = c.n_kv_heads, qd = nh * hd, kvd = nkv * hd;
    const float eps = float(c.rms_eps);
    cap.validate(c.n_layers, b);

    std::vector<int32_t> pos(static_cast<size_t>(N));
    std::vector<int64_t> dst(static_cast<size_t>(N));
    for (int64_t s = 0; s < b.n_seqs(); ++s)
      for (int64_t r = b.seq_start[size_t(s)]; r < b.seq_start[size_t(s + 1)]; ++r) {
        pos[size_t(r)] = int32_t(r - b.seq_start[size_t(s)]);
        dst[size_t(r)] = cap.dst_row(b, s, r);
      }

    std::vector<float> x(size_t(N * H)), xn(size_t(N * H)), q(size_t(N * qd)), k(size_t(N * kvd)),
        v(size_t(N * kvd)), att(size_t(N * qd)), tmp(size_t(N * H)), g(size_t(N * I)), u(size_t(N * I));
    auto capture = [&](int64_t layer_id) { cpu::capture_rows(cap, int(layer_id), x.data(), N, H, dst.data()); };
    auto mm = [&](float* out, const float* in, const Mat& w, const std::vector<float>& bias, int64_t K, int64_t O) {
      cpu::matmul_forward(out, in, w.data, w.dtype, bias.empty() ? nullptr : bias.data(), N, K, O);
    };
    static const std::vector<float> none;

    cpu::embedding_forward(x.data(), b.tokens.data(), embed_.data, embed_.dtype, N, H, c.vocab);  // h[0]
    for (int64_t l = 0; l < c.n_layers; ++l) {
      capture(l);  // h[l]: the input of layer l
      const Layer& L = layers_[size_t(l)];
      // attention block
      cpu::rmsnorm_forward(xn.data(), x.data(), L.attn_norm.data(), N, H, eps);
      mm(q.data(), xn.data(), L.wq, L.bq, H, qd);
      mm(k.data(), xn.data(), L.wk, L.bk, H, kvd);
      mm(v.data(), xn.data(), L.wv, L.bv, H, kvd);
      if (c.qk_norm) {  // per-head RMSNorm over head_dim, before RoPE
        cpu::rmsnorm_forward(q.data(), q.data(), L.q_norm.data(), N * nh, hd, eps);
        cpu::rmsnorm_forward(k.data(), k.data(), L.k_norm.data(), N * nkv, hd, eps);
      }
      cpu::rope_forward(q.data(), pos.data(), inv_freq_.data(), N, nh, hd);
      cpu::rope_forward(k.data(), pos.data(), inv_freq_.data(), N, nkv, hd);
      cpu::attention_forward(att.data(), q.data(), k.data(), v.data(), b.seq_start.data(), b.n_seqs(), nh, nkv, hd,
                             c.sliding_window);
      mm(tmp.data(), att.data(), L.wo, none, qd, H);
      cpu::residual_forward(x.data(), tmp.data(), N * H);
      // MLP block
      cpu::rmsnorm_forward(xn.data(), x.data(), L.mlp_norm.data(), N, H, eps);
      mm(g.data(), xn.data(), L.w_gate, none, H, I);
      mm(u.data(), xn.data(), L.w_up, none, H, I);
      cpu::swiglu_forward(g.data(), g.data(), u.data(), N * I);
      mm(tmp.data(), g.data(), L.w_down, none, I, H);
      cpu::residual_forward(x.data(), tmp.data(), N * H);
    }
    capture(c.n_layers);  // h[L]: before the final norm
    if (logits) {
      cpu::rmsnorm_forward(xn.data(), x.data(), final_norm_.data(), N, H, eps);
      cpu::matmul_forward(logits, xn.data(), lm_head_.data, lm_head_.dtype, nullptr, N, H, c.vocab);
    }
  }

 private:
  ModelConfig cfg_;
  Mat embed_, lm_head_;
  std::vector<float> final_norm_;
  std::vector<Layer> layers_;
  std::vector<float> inv_freq_;
};

}  // namespace

std::unique_ptr<Model> make_cpu_model(const Checkpoint& ckpt) {
  if (is_deepseek(ckpt.config().arch)) return make_cpu_deepseek_model(ckpt);  // MLA + MoE: cpu_deepseek.cpp
  return std::make_unique<CpuDenseModel>(ckpt);
}

}  // namespace talon
