// The dense decoder family's layer stack on one GPU, shared by the model (cuda_model.cpp)
// and the cached decoder (cuda_decoder.cpp). They differ only in attention (packed sequences
// against a KV cache), in where captured hidden states go and in the tensor-parallel sum, so
// those are hooks; every other step is here, once, in the CPU reference's order
// (src/backend/cpu/cpu_model.cpp).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>

#include "backend/cuda/ops.h"
#include "backend/cuda/weights.h"
#include "model/config.h"

namespace talon::cuda {

// Device buffers of one forward of N rows (widths per rank: qd = nh * hd, kvd = nkv * hd).
struct DenseActs {
  const int32_t *ids, *pos;  // [N]
  float* x;                  // residual stream [N, H]
  bf16 *xn, *qkv, *att, *tmp, *gu, *act;
};

struct DenseHooks {
  // h[layer_id] (input-of-layer convention; L: after the last layer, before the final norm)
  // is in x; called once for each layer id 0..L in order.
  std::function<void(int64_t layer_id)> capture;
  // Layer `layer`'s q|k|v (after bias, qk-norm and RoPE) are in qkv: write att. `cached`:
  // the product already rotated q and k and wrote k and v to the cache (rope_cache below).
  std::function<void(int64_t layer, bool cached)> attention;
  // The cached decoder: where layer `layer`'s rotated k and v go (ops.h: SkinnyRope). When
  // set and it returns true, a folded layer without bias or q/k norms has its q|k|v product
  // rotate q and k and write the cache in its epilogue (one launch less a layer), and
  // `attention` is told so.
  std::function<bool(int64_t layer, SkinnyRope& out)> rope_cache;
  // True: qkv reaches `attention` before RoPE, which the hook applies itself (the cached
  // decoder fuses it with its cache write).
  bool attention_rotates = false;
  // One-token forwards of small models may fold norms, SwiGLU and residual adds into the
  // skinny products (dense_block.cpp); false keeps the unfused layer.
  bool fold_one_token = true;
  // Sums n partial values across the tensor-parallel group in place (empty: one rank).
  std::function<void(bf16*, int64_t, cudaStream_t)> allreduce;
};

// Embedding, every layer, and xn = final_norm(h[L]) for the LM head, on stream s. True when
// the layers were folded (every row's products through skinny_fused, one row at a time in the
// same order whatever the row count), so that a caller can keep the LM head on the same terms.
bool dense_stack_forward(const DenseDeviceWeights& w, const ModelConfig& c, int64_t N, const DenseActs& a, Gemm& gemm,
                         cudaStream_t s, const DenseHooks& hooks);

}  // namespace talon::cuda
