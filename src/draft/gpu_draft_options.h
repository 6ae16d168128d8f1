// Choices that change how, not what, the GPU draft trainer computes: for comparisons,
// tests and memory tuning. The defaults are the fastest. Plain C++17 (the CUDA engine
// includes it too). `talon train` sets them with the --gpu-* options.
#pragma once
#include <cstdint>
#include <string>

namespace talon::eagle3 {

struct GpuDraftOptions {
  // TTT attention: auto (fused tensor-core kernels where they apply: bf16 math and a head size
  // that is a multiple of 16 up to 128, else the score-buffer products; and where cuDNN loads,
  // cuDNN's fused attention for each batch whose workspace fits cudnn_auto_bytes), flash (the
  // fused kernels, refused where they do not apply), cudnn (cuDNN's fused attention for the
  // causal part of every batch: bf16 operands, head sizes that are multiples of 8 up to 256;
  // faster at the 8B shape, but its deterministic backward's workspace grows with samples x S^2
  // of a batch, see docs/train.md), blocks (score-buffer products), loop (the fp32 one-warp
  // kernels, a second independent implementation).
  std::string attention = "auto";
  // auto: the most workspace bytes a batch may need to go through cuDNN. -1: the memory the
  // engine lends it (buffers idle while the attention runs, grown to one sample of max_rows
  // where that adds at most 1 GiB), so auto allocates nothing for cuDNN per batch; 0: never.
  int64_t cudnn_auto_bytes = -1;
  // bf16 math on fp32 operands, rounded inside cuBLAS, instead of bf16 copies in memory.
  bool fp32_operands = false;
  // Rows of draft (and full target) logits per chunk; 0: as many as the scratch memory holds.
  int64_t logit_rows = 0;
  // Score-buffer products: causal key block size; -1: the engine's default, 0: no skipping.
  int64_t attn_block = -1;
  // The lm_head's backward recomputes each step's logits in the backward pass, last step
  // first, instead of running in the forward pass right after each step's loss.
  bool lm_grad_in_backward = false;
  // GPU milliseconds per phase, from events between marks (GpuDraftTrainer::profile()).
  bool profile = false;
  // Where the target's embedding lives. By default (neither set), for EAGLE-3 with bf16
  // operands, in pinned host memory (bf16), each batch uploading the rows of the tokens it
  // holds: V x H x 2 bytes of device memory saved (1 GiB for Llama-3.1-8B's vocabulary) for
  // ~1% of the step (bench/RESULTS.md); on the device where the host cannot pin it, and
  // elsewhere (fp32 operands; P-EAGLE trains its embedding; DFlash's engine keeps its own).
  // batch_embeddings (--gpu-batch-embeddings) asks for the host copy and refuses a setup
  // without it; device_embeddings (--gpu-device-embeddings) keeps the whole table on the device.
  bool batch_embeddings = false;
  bool device_embeddings = false;
  // Steps after the first run only the rows some step after the first counts (a loss-masked
  // target row, in the draft vocabulary, inside the sample), as the CPU reference does; prompt
  // rows then go through step 0 only, and (EAGLE-3) through its attention only: after it, step
  // 0 runs only its own loss rows and the kept ones. Same losses, metrics and gradients; less
  // work in proportion to the rows left out (+12-14% tokens/s at 8B shape with a third of the
  // rows prompt, on an H100). false (--gpu-all-rows): every row through every step.
  bool row_cut = true;
  // The diagonal keys' backward (steps after the first) in one kernel where the head size (up
  // to 128) and the heads a kv head serves (up to 8) allow; false: the four kernels it
  // replaces, which compute the same bits (for tests).
  bool fused_diag_backward = true;
  // The diagonal keys' merge into the causal attention (forward: every step's key and value rows
  // of a row in registers, loaded at once) and their fused backward (the next step's rows loaded
  // while this one computes): more loads in flight for kernels bound by memory latency. The same
  // bits as the kernels before (false; --gpu-no-diag-registers). The default: +1.3% / +0.6%
  // tokens/s at 2048 / 4096 tokens on an H100 (docs/train.md).
  bool diag_rows_in_registers = true;
  // With bf16 operands: the forward's q, k, v rows expanded, rotated (RoPE) and the queries
  // cast to bf16 in one kernel (at step 0 also the bf16 copies of the keys and values every
  // later step attends to, made once instead of cast at each attention call), and the
  // backward's dq, dk, dv rotated back, compacted to the kept rows and cast to the q|k|v
  // product's bf16 operand in one (fused_products). Per TTT step at 2048 tokens (8B shape):
  // about nine launches and ~200 MB of memory traffic fewer; with qkv_forward_product +2.0% /
  // +1.2% tokens/s at 2048 / 4096 tokens on an H100 (docs/train.md). The same bits as the
  // separate kernels (false; --gpu-separate-rope).
  bool fused_rope_rows = true;
  // With fused_rope_rows and fused_products: the forward's q, k and v as one product too (its
  // rows read by the fused RoPE kernel); the same arithmetic as three up to the order of fp32
  // sums. false (--gpu-no-qkv-forward): three products.
  bool qkv_forward_product = true;
  // With bf16 operands (--gpu-fused-products, the default): the gate and up projections as one
  // product (forward) and one each for their backward (dhm, d[W_gate; W_up]), and one each for
  // the q, k, v backward (dxin, d[W_q; W_k; W_v]); +1.0% / +0.5% / +1.5% tokens/s at 2048 /
  // 4096 / 8192 tokens (8B shape, one H100). false (--gpu-separate-products): a product per
  // matrix. The same arithmetic up to the order of fp32 sums (docs/train.md, "bf16 operands").
  bool fused_products = true;
  // Who picks each product's algorithm (bf16 operands): cublas (cublasGemmEx's own choice),
  // first (cuBLASLt's first heuristic candidate without workspace), waves (among cuBLASLt's
  // first 8 candidates without workspace or split-K, the one whose last wave of output tiles is
  // fullest) or timed (the fastest of those 8 that compute the first one's bits, timed on the
  // run's own products; backend/cuda/lt_products.h). auto (the default): timed with bf16
  // operands, cublas otherwise. first and waves pick once per shape without timing anything;
  // timed's choice may differ between runs but not its bits. So reruns and resumes stay
  // bit-identical under each rule; the rules differ from each other in the order of fp32 sums
  // only (--gpu-products). Neither fixed rule measured faster than cublas; timed measured +2.5%
  // at 2048 tokens and the same at 4096 (docs/train.md).
  std::string products = "auto";
  // A run that starts the gradients anew zeroes only the tensors something other than a product
  // writes (norm weights, P-EAGLE's mask rows and embedding); each weight matrix's first
  // gradient product of the run writes its range (beta 0) instead of adding to zeros, and a
  // matrix no product wrote is zeroed at the run's end (--gpu-fresh-grads, the default). Saves
  // the memset of the whole gradient (1.7 GB, ~0.5 ms a step for the 8B draft on an H100:
  // +1.2-1.3% tokens/s, bench/RESULTS.md). The first product may take another cuBLAS kernel than
  // an accumulating one, so the sums' order may differ from --gpu-zeroed-grads' (false: the
  // whole gradient zeroed, every product adding to it); reruns and resumes stay bit-identical
  // either way.
  bool fresh_grads = true;
  // cuDNN's attention (auto or cudnn): its deterministic backward in head groups, the fewest
  // whose workspace fits the memory lent to it, or cudnn_auto_bytes where that is set
  // (CudnnSdpa::set_backward_limit), so that long
  // samples go through cuDNN too instead of the fused kernels (auto) or a workspace of its own
  // (cudnn). That backward takes samples x heads x S^2 x 2 bytes: 4 GiB for one sample of 8192
  // rows of the 8B draft, against a lent block of ~1.3 GiB. Opt-in
  // (--gpu-cudnn-head-groups) until measured on a GPU.
  bool cudnn_head_groups = false;
};

// The products' algorithms through cuBLASLt (GpuDraftOptions::products): the shapes planned;
// how many of them a fixed rule moved off the heuristic's first candidate, or under the timed
// rule how many families the timings moved; the timed rule's families met, decided, checking
// their corner and timing their candidates.
struct ProductPlans {
  int64_t shapes = 0, moved = 0, families = 0, decided = 0, checking = 0, timing = 0;
};

}  // namespace talon::eagle3
