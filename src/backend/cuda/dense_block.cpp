#include "backend/cuda/dense_block.h"

#include <cstdint>

#include "backend/cuda/check.h"

namespace talon::cuda {

bool dense_stack_forward(const DenseDeviceWeights& w, const ModelConfig& c, int64_t N, const DenseActs& a, Gemm& gemm,
                         cudaStream_t s, const DenseHooks& hooks) {
  const int64_t H = c.hidden, I = w.inter, hd = c.head_dim, V = c.vocab;
  const int64_t nh = w.nh, nkv = w.nkv, qd = nh * hd, ldqkv = qd + 2 * nkv * hd;
  const float eps = float(c.rms_eps);
  embedding_forward(a.x, a.ids, w.embed, N, H, V, s);
  const bf16* pending = nullptr;  // residual branch output not yet added to x
  // One token of a small model: the norms, SwiGLU and residual adds ride in the skinny
  // products (ops.h: skinny_fused), 7 launches a layer instead of 10. Only where every block can
  // form its input row cheaply (hidden and intermediate sizes at most kFoldMaxK). Measured on
  // an H200 (bench/RESULTS.md): SmolLM2 (576 / 1536) 0.90-0.93 -> 0.83 ms a token; the 8B
  // shape (4096 / 14336) went 4.9 -> 6.0 ms with everything folded (each block's prologue of
  // 16-56 values a thread delays its weight stream) and 4.77 -> 4.91 ms with the residual adds
  // alone, so it keeps the unfused layer. Not with a tensor-parallel all-reduce, which must see
  // each branch output before it is added.
  constexpr int64_t kFoldMaxK = 2048;
  // From the fused q|k|v rows to att: bias, Qwen3's q/k norms, RoPE (unless the hook rotates),
  // then the attention hook; the same in the folded and unfolded layers.
  auto attend = [&](int64_t l, const DenseLayerDev& L) {
    if (L.bqkv) bias_forward(a.qkv, ldqkv, L.bqkv, N, ldqkv, s);
    if (L.q_norm) {
      head_rmsnorm_forward(a.qkv, ldqkv, L.q_norm, N, nh, hd, eps, s);
      head_rmsnorm_forward(a.qkv + qd, ldqkv, L.k_norm, N, nkv, hd, eps, s);
    }
    if (!hooks.attention_rotates) {
      rope_forward(a.qkv, ldqkv, a.pos, w.inv_freq, N, nh, hd, s);
      rope_forward(a.qkv + qd, ldqkv, a.pos, w.inv_freq, N, nkv, hd, s);
    }
    hooks.attention(l, false);
  };
  // A forward of a few rows (skinny_fusion_rows(): 4 by default) folds the same way, each
  // block staging every row's input; beyond that the unfolded layer is faster (ops.h). Each
  // row's products are then the bits of that row alone: a verify of up to 4 tokens computes
  // what one-token steps compute.
  bool fuse = N >= 1 && N <= skinny_fusion_rows() && hooks.fold_one_token && !hooks.allreduce && skinny_fusion_enabled() &&
              H <= kFoldMaxK && I <= kFoldMaxK && skinny_fused_fits(H, N) && skinny_fused_fits(qd, N) &&
              skinny_fused_fits(I, N);
  for (size_t l = 0; l < w.layers.size() && fuse; ++l)
    for (const bf16* p : {w.layers[l].wqkv, w.layers[l].wo, w.layers[l].wgu, w.layers[l].wdown})
      fuse = fuse && reinterpret_cast<uintptr_t>(p) % 16 == 0;
  for (int64_t l = 0; l < c.n_layers && fuse; ++l) {
    const DenseLayerDev& L = w.layers[size_t(l)];
    hooks.capture(l);  // x = h[l]: the last layer's products went straight into it
    auto run = [&](const SkinnyFused& f, const bf16* wt, int64_t K, int64_t O) {
      if (!skinny_fused(f, wt, K, O, s)) fail_msg("dense stack: a fused skinny product was refused");
    };
    // RoPE and the cache write in the q|k|v product's epilogue where the hook gives a cache and
    // the shape fits (skinny_fused refuses, launching nothing, what it cannot take).
    SkinnyRope rope;
    SkinnyFused fq{SkinnyIn::Norm, nullptr, a.x, L.attn_norm, eps, a.qkv, nullptr, N};
    fq.rope = &rope;
    const bool one_launch = !L.bqkv && !L.q_norm && hooks.rope_cache && hooks.rope_cache(l, rope) && [&] {
      rope.pos = a.pos;
      rope.inv_freq = w.inv_freq;
      rope.nh = int(nh), rope.nkv = int(nkv), rope.hd = int(hd);
      return skinny_fused(fq, L.wqkv, H, ldqkv, s);
    }();
    if (one_launch) {
      hooks.attention(l, true);
    } else {
      run({SkinnyIn::Norm, nullptr, a.x, L.attn_norm, eps, a.qkv, nullptr, N}, L.wqkv, H, ldqkv);
      attend(l, L);
    }
    run({SkinnyIn::Plain, a.att, nullptr, nullptr, 0.f, nullptr, a.x, N}, L.wo, qd, H);
    run({SkinnyIn::Norm, nullptr, a.x, L.mlp_norm, eps, a.gu, nullptr, N}, L.wgu, H, 2 * I);
    run({SkinnyIn::Swiglu, a.gu, nullptr, nullptr, 0.f, nullptr, a.x, N}, L.wdown, I, H);
  }
  for (int64_t l = 0; l < c.n_layers && !fuse; ++l) {
    const DenseLayerDev& L = w.layers[size_t(l)];
    // x += pending (previous MLP); capture h[l]; xn = norm(x)
    if (pending) {
      add_rmsnorm_forward(a.xn, a.x, pending, L.attn_norm, N, H, eps, s);
      hooks.capture(l);
    } else {
      hooks.capture(l);
      add_rmsnorm_forward(a.xn, a.x, nullptr, L.attn_norm, N, H, eps, s);
    }
    gemm.forward(a.qkv, a.xn, L.wqkv, N, H, ldqkv, s);
    attend(l, L);
    gemm.forward(a.tmp, a.att, L.wo, N, qd, H, s);
    if (hooks.allreduce) hooks.allreduce(a.tmp, N * H, s);
    add_rmsnorm_forward(a.xn, a.x, a.tmp, L.mlp_norm, N, H, eps, s);
    gemm.forward(a.gu, a.xn, L.wgu, N, H, 2 * I, s);
    swiglu_forward(a.act, a.gu, N, I, s);
    gemm.forward(a.tmp, a.act, L.wdown, N, I, H, s);
    if (hooks.allreduce) hooks.allreduce(a.tmp, N * H, s);
    pending = a.tmp;
  }
  // h[L] = x + last MLP output; the final norm follows (only needed for logits).
  add_rmsnorm_forward(a.xn, a.x, pending, w.final_norm, N, H, eps, s);
  hooks.capture(c.n_layers);
  return fuse;
}

}  // namespace talon::cuda
