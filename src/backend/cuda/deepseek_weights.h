// Internal to the CUDA backend: the DeepSeek-family weights on one GPU (or one rank's share of
// them, cuda_model.h: DeepseekParallel) and the two halves of a layer that the packed
// forward (cuda_deepseek.cpp) and the cached decoder (cuda_deepseek_decoder.cpp) share: the
// MLA projections before attention, and the MLP or mixture of experts after it.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "backend/cuda/cuda_model.h"
#include "backend/cuda/device.h"
#include "backend/cuda/moe.h"
#include "backend/cuda/moe_weights.h"
#include "backend/cuda/ops.h"
#include "model/checkpoint.h"

namespace talon::cuda {

// One layer, bf16 unless said. kv_b is [nh (nope + vd), kvr]: per head, nope rows of W_UK
// then vd rows of W_UV (the absorbed form reads them in place).
struct DeepseekLayerDev {
  bf16 *attn_norm, *mlp_norm, *q_a_norm = nullptr, *kv_a_norm;
  bf16 *q = nullptr, *q_a = nullptr, *kv_a, *kv_b, *o;
  bf16 *gu = nullptr, *down = nullptr;  // dense MLP, or the shared experts (null when none)
  int64_t inter = 0;
  bool moe = false;
  float* router = nullptr;  // [E, H] fp32
  MoeLayerDev experts;
};

struct DeepseekDevWeights {
  int64_t nh = 0;  // attention heads on this rank
  bf16 *embed = nullptr, *lm_head = nullptr, *final_norm = nullptr;
  float* inv_freq = nullptr;  // RoPE frequencies of the rope part
  std::vector<DeepseekLayerDev> layers;
};

// Dequantizes (FP8 block, plain) to bf16 and uploads this rank's share; int4 experts stay int4.
DeepseekDevWeights upload_deepseek_weights(const Checkpoint& ckpt, DeviceArena& arena, const DeepseekParallel& par);

// The MLA inputs of layer L for N rows of the fp32 residual x: xn = attn_norm(x) (bf16);
// q [N, nh qk] (through q_a, its norm and q_b, or q_proj); ckv = kv_a(xn) [N, kvr + rope]
// (k_pe unrotated at column kvr); lat = kv_a_norm(ckv[:, :kvr]) [N, kvr]. t32 is fp32 scratch
// of N * max(q_lora_rank, kvr).
struct MlaBuffers {
  bf16 *xn, *qa, *q, *ckv, *lat;
  float* t32;
};
void mla_project(const DeepseekLayerDev& L, const ModelConfig& c, int64_t nh, float* x, const MlaBuffers& b,
                 int64_t N, Gemm& gemm, cudaStream_t s);

// x += the layer's MLP of mlp_norm(x): the dense MLP, or the routed experts (`routed`, given
// the router logits in b.rlog and the normalized input in b.xn, fills b.moe_out; null:
// moe_forward on this GPU) plus the shared experts. `reduce` sums an fp32 partial [n] over a
// tensor-parallel group in place (null: one GPU).
struct MlpBuffers {
  bf16 *xn, *gu, *act;
  float *xn32, *rlog, *moe_out, *part;
  const MoeScratch* moe;
};
void deepseek_mlp(const DeepseekLayerDev& L, const ModelConfig& c, float* x, const MlpBuffers& b, int64_t N,
                  Gemm& gemm, cudaStream_t s, const std::function<void()>& routed = nullptr,
                  const std::function<void(float*, int64_t)>& reduce = nullptr);

// Scratch of moe_forward for up to n tokens of routing r (experts of width Im), from `arena`.
void alloc_moe_scratch(MoeScratch& m, DeviceArena& arena, int64_t n, const MoeRouting& r, int64_t H, int64_t Im);

// The routed experts of one MoE layer across a tensor- or expert-parallel group (the packed
// forward's ranks, and the tensor-parallel decoder's), for this rank's N tokens: out [N, H]
// (fp32) = what moe_forward gives on one GPU, summed over the ranks under tensor parallelism.
// Routing is global; rank d owns the routed experts [d per, (d + 1) per). Under tensor
// parallelism every rank has every token and runs the slots routed to its experts; under
// expert parallelism the rows travel to their experts' ranks and back (two all-to-alls). In:
// router logits rlog [N, E], the normalized input xn [N, H], this rank's moe_forward scratch
// for N tokens (null when it has none: an expert-parallel rank without tokens still serves its
// experts). The host waits for the routed counts once a layer, so this is not graph-capturable.
//
// Overlap (expert parallelism, TALON_EP_OVERLAP=1 or moe_ep_overlap_use(1)): the tokens go as
// two halves, the second on a second stream, issued as dispatch 1, dispatch 2, experts 1 +
// combine 1, experts 2 + combine 2, so the second half's all-to-all runs while the first half's
// experts compute and the first half's return while the second's compute. Every rank splits
// (a rank without tokens runs two empty halves), so the collectives keep one order.
class MoeParallel {
 public:
  MoeParallel(const DeepseekParallel& par, int64_t hidden) : par_(par), H_(hidden) {}
  ~MoeParallel();
  MoeParallel(const MoeParallel&) = delete;
  MoeParallel& operator=(const MoeParallel&) = delete;
  void run(const DeepseekLayerDev& L, int64_t N, const float* rlog, const bf16* xn, const MoeScratch* moe, float* out,
           cudaStream_t s);

 private:
  // Buffers grown on demand: NK slots sent, R rows received; route: moe_forward scratch for the
  // second half's tokens (the caller's covers the first).
  struct Ep {
    std::unique_ptr<DeviceArena> arena;
    int64_t nk = -1, r = -1;
    bf16 *send_rows = nullptr, *recv_rows = nullptr;
    int32_t *send_ids = nullptr, *recv_ids = nullptr;
    float *y_recv = nullptr, *y_sorted = nullptr;
    MoeScratch sc{};
    std::unique_ptr<DeviceArena> route_arena;
    int64_t route_n = 0;
    MoeScratch route{};
  };
  // One run of tokens between its dispatch and its combine.
  struct Part {
    Ep* e = nullptr;
    const MoeScratch* moe = nullptr;
    int64_t N = 0, R = 0;
    const float* rlog = nullptr;
    const bf16* xn = nullptr;
    float* out = nullptr;
    cudaStream_t s = nullptr;
    std::vector<int32_t> off;
    std::vector<int64_t> cnt, got;
  };
  Ep& ensure(Ep& ep, int64_t NK, int64_t R, int per, int64_t Im, cudaStream_t s);
  void dispatch(const DeepseekLayerDev& L, Part& p);
  void finish(const DeepseekLayerDev& L, Part& p);
  DeepseekParallel par_;
  int64_t H_;
  Ep ep_, ep2_;
  int device_ = -1;  // of the second stream and its events
  cudaStream_t s2_ = nullptr;
  cudaEvent_t ev_in_ = nullptr, ev_out_ = nullptr;
};

// Tests: 1 splits expert-parallel MoE layers into two overlapped halves, 0 does not, -1 follows
// TALON_EP_OVERLAP.
void moe_ep_overlap_use(int mode);

}  // namespace talon::cuda
