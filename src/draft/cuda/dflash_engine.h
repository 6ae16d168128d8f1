// DFlash's forward and hand-written backward on one GPU, plus gradient clipping and AdamW on
// device: the CUDA twin of dflash::forward (src/draft/dflash.cpp, the fp64 reference), tested
// against it by tests/draft/test_draft_gpu.cpp (GpuDFlash*).
//
// A batch is a set of samples packed back to back as context rows (aux and hidden per row) and
// a set of blocks, each anchored in one of them. Per layer the context's keys and values are
// that layer's k/v projections of C = hidden_norm(fc(aux)); a block row reads the context rows
// of its sample before its anchor and every row of its own block. The host chooses anchors,
// which rows count and the per-row loss weights (D-PACE needs the forward's per-row losses), so
// a call is forward() then, for training, backward(). Plain types only (compiled by nvcc).
// Every reduction has a fixed order: the same inputs give the same bits on every run.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "draft/cuda/draft_engine.h"

namespace talon::cuda {

struct DFlashDims {
  int64_t H = 0, I = 0, nh = 0, nkv = 0, hd = 0, V = 0, Vd = 0;
  int64_t layers = 1, n_aux = 3, block = 8;
  float eps = 1e-6f;         // the draft's RMSNorms (hidden, layers, q/k per head, final)
  float target_eps = 1e-5f;  // the target's final norm
  bool ce = false;           // per-row loss: cross-entropy of the target's argmax, else KL
};

// The draft's tensors in the order of the trainer's DFlash family (fc, hidden_norm, each
// layer's in_ln wq wk wv q_norm k_norm wo post_ln gate up down, norm), then the frozen
// lm_head [Vd, H]; and their names ("layers.L.NAME" for a layer's).
std::vector<int64_t> dflash_tensor_sizes(const DFlashDims& d);
std::vector<std::string> dflash_tensor_names(const DFlashDims& d);

struct DFlashBatch {  // host arrays
  int64_t ctx_rows = 0;  // Tc: every sample's rows, packed
  // The samples' features in packed order (host memory, pinned or not, or device memory):
  // aux [rows, n_aux * H] and the target's last hidden states [rows, H].
  struct Part {
    const float* aux;
    const float* hidden;
    int64_t rows;
  };
  std::vector<Part> parts;
  const int32_t* ctx_pos = nullptr;  // [Tc] each row's position in its sample
  int64_t blocks = 0;                // nb; rows nb * block
  const int32_t* blk_ctx0 = nullptr;    // [nb] packed row of its sample's position 0
  const int32_t* blk_anchor = nullptr;  // [nb] its anchor a (it reads context rows ctx0 .. ctx0 + a - 1)
  const int32_t* blk_ctx_end = nullptr; // [nb] one past its sample's last packed row
  const int32_t* tok = nullptr;         // [nb * block] input token of each block row
  const int32_t* trow = nullptr;        // [nb * block] packed row of its target hidden state, -1: no loss
};

struct DFlashRowStats {  // [nb * block]
  std::vector<float> loss;  // per-row loss (KL or CE) of rows with a target, 0 elsewhere
  std::vector<uint8_t> hit;  // draft argmax == target argmax (over the draft vocabulary)
};

class DFlashEngine {
 public:
  // embed [V, H] (the target's, frozen), final_norm [H] and lm_head [V, H] of the target,
  // kept [Vd] target ids, inv_freq [hd/2]: host arrays, copied. Buffers are sized for
  // max_ctx context rows and max_block_rows block rows a call.
  DFlashEngine(int device, const DFlashDims& d, DraftMath math, const float* embed, const float* final_norm,
               const float* lm_head, const int64_t* kept, const float* inv_freq, int64_t max_ctx,
               int64_t max_block_rows);
  ~DFlashEngine();
  DFlashEngine(const DFlashEngine&) = delete;
  DFlashEngine& operator=(const DFlashEngine&) = delete;

  void set_weights(const std::vector<const float*>& w);
  void get_weights(const std::vector<float*>& w);
  void get_grads(const std::vector<float*>& g);
  void set_moments(const std::vector<const float*>& m, const std::vector<const float*>& v);
  void get_moments(const std::vector<float*>& m, const std::vector<float*>& v);

  // Uploads a batch and runs the forward; activations are kept for backward().
  void forward(const DFlashBatch& b, DFlashRowStats& out);
  // Adds the gradient of sum_n row_scale[n] * loss_n over the last forward's rows (zeroed
  // first when asked). The frozen lm_head and embedding get none.
  void backward(const std::vector<float>& row_scale, bool zero_grads);
  double clip_grad_norm(double max_norm);
  // One AdamW update as train::AdamW::step for every tensor but the lm_head; decay[i]: weight
  // decay applies to tensor i (one flag per tensor); t_after: the update's 1-based count.
  void adamw(double lr, double beta1, double beta2, double eps, double weight_decay, const std::vector<uint8_t>& decay,
             int64_t t_after);
  void zero_grads();
  float* grad_data();
  int64_t grad_elems() const;
  cudaStream_t stream() const;
  size_t device_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> p_;
};

}  // namespace talon::cuda
