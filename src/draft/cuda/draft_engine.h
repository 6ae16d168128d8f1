// The EAGLE-3 draft's training-time-test forward and hand-written backward on one GPU,
// plus gradient clipping and AdamW on device: the CUDA twin of eagle3::ttt_forward
// (src/draft/eagle3.cpp), op for op, tested against it by tests/draft/test_draft_gpu.cpp.
//
// Plain types only (this header is compiled by nvcc). Rows of a batch are samples packed
// back to back; every per-row quantity the host needs (cross-entropy, hit, whether the
// row counts) comes back per row, so per-sample losses are summed on the host in the
// CPU reference's order. Every reduction on the device has a fixed order: the same
// inputs give the same bits on every run, which exact resume relies on.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "draft/gpu_draft_options.h"

namespace talon::cuda {

struct DraftDims {
  int64_t H = 0, I = 0, nh = 0, nkv = 0, hd = 0, V = 0, Vd = 0;
  float eps = 1e-5f;         // the draft's RMSNorms
  float target_eps = 1e-5f;  // the target's final norm
  int K = 7;                 // TTT steps
  bool norm_before_residual = false;
  // P-EAGLE (draft/peagle.h) instead of EAGLE-3: step k >= 1 of row a is the element (a, k),
  // fed the mask token's embedding and fc(mask_hidden) instead of the next token and the
  // previous step's output; the embedding and mask_hidden are trained, the lm_head is not,
  // and which elements have a loss comes with the batch (DraftBatch::counts).
  bool peagle = false;
  int32_t mask_token = -1;
};

// Matrix products: exact fp32, TF32 tensor cores, or bf16 tensor cores (fp32 storage and
// accumulation, inputs rounded to bf16 inside cuBLAS).
enum class DraftMath { F32, TF32, BF16 };

// The 13 draft tensors in eagle3::DraftWeights::named() order, and their sizes; P-EAGLE adds
// mask_hidden [3H] and embed [V, H] after them.
constexpr int kDraftTensors = 13;
std::vector<int64_t> draft_tensor_sizes(const DraftDims& d);

struct DraftBatch {  // host pointers, N packed rows
  int64_t N = 0;
  const int32_t* ids = nullptr;
  const uint8_t* mask = nullptr;
  const float* aux = nullptr;     // [N, 3H]
  const float* hidden = nullptr;  // [N, H] h[L]
  const int32_t* pos = nullptr;   // each row's position in its sample
  const int32_t* len = nullptr;   // each row's sample length
  // Instead of aux and hidden (then both null): the features of each sample, in row order,
  // in pinned host memory or device memory (rows of them each), copied from there without a
  // staging copy.
  struct Part {
    const float* aux;
    const float* hidden;
    int64_t rows;
  };
  std::vector<Part> parts;
  // P-EAGLE: counts[k * N + n] = 1 when element (row n, step k) has a loss (COD-sampled and
  // its target row loss-masked); only those get draft logits. Null for EAGLE-3 (loss_rows()).
  const uint8_t* counts = nullptr;
};

// Whether p points into page-locked host memory (cudaHostAlloc or cudaHostRegister), from
// which copies to the device run asynchronously.
bool is_pinned_host(const void* p);
// Whether p points into device memory (cudaMalloc): features already on a GPU, copied from
// there device to device.
bool is_device_memory(const void* p);

// Which rows of a packed batch each step's loss reads. Row n counts at step k when its
// target row n+1+k lies in the same sample, is loss-masked and in_vocab (the full-vocab
// argmax of the target is a draft token). rows[k*N + i] for i < count[k]: the rows that
// count at step k, ascending; slot[k*N + n]: n's index in that list, or -1. Only these
// rows get draft logits, a loss and a gradient through the lm_head.
struct LossRows {
  std::vector<int32_t> rows, slot;
  std::vector<int64_t> count;
};
LossRows loss_rows(int64_t K, int64_t N, const uint8_t* mask, const int32_t* pos, const int32_t* len,
                   const uint8_t* in_vocab);
// The rows steps 1..K-1 run when rows no later loss reads are cut (GpuDraftOptions::row_cut):
// those some step k >= 1 counts (lr), in order; at least one, so that no launch is empty.
// crow[c]: the batch row of kept row c; cinv[n]: n's kept row, or -1 when it is left out.
// clrow[k*N + i] (i < lr.count[k], k >= 1): lr's rows of step k as kept rows; clslot[k*N + c]
// (c < crow.size()): kept row c's slot in step k's list, or -1. cut: fewer rows than N kept
// (else the vectors other than crow and cinv stay empty and every row runs every step).
// Step 0 needs every row's keys and values, but after its attention (o_proj, norms, MLP and
// its loss) only the rows step 0 counts and the kept rows: cut0 (with cut, when that is fewer
// than N) cuts the others there. crow0[c]: the batch row of step-0 row c; cinv0[n]: n's
// step-0 row or -1; clrow0[i] (i < lr.count[0]): step 0's loss rows as step-0 rows;
// clslot0[c]: step-0 row c's slot in step 0's list or -1; c10[c] (c < crow.size()): kept row
// c's step-0 row; cinv10[c] (c < crow0.size()): step-0 row c's kept row, or -1.
struct RowCut {
  std::vector<int32_t> crow, cinv, clrow, clslot;
  bool cut = false;
  std::vector<int32_t> crow0, cinv0, clrow0, clslot0, c10, cinv10;
  bool cut0 = false;
};
RowCut row_cut(const LossRows& lr, int64_t K, int64_t N);
// The rows whose target distribution a loss can read: loss-masked rows after the first of
// their sample (a row is only ever the target of earlier rows). Ascending.
std::vector<int32_t> target_rows(int64_t N, const uint8_t* mask, const int32_t* pos);

struct DraftRowStats {            // [K * N], step-major
  std::vector<float> ce;          // cross-entropy of rows that count (0 elsewhere)
  std::vector<uint8_t> hit, counts;
};

class DraftEngine {
 public:
  // embed, lm_head [V, H], final_norm [H], kept [Vd] target ids, t2d [V], inv_freq [hd/2]:
  // host arrays, copied. max_rows bounds N of every batch (buffers are allocated here).
  DraftEngine(int device, const DraftDims& d, DraftMath math, const float* embed, const float* final_norm,
              const float* lm_head, const int64_t* kept, const uint8_t* t2d, const float* inv_freq, int64_t max_rows,
              const eagle3::GpuDraftOptions& opt = {});
  ~DraftEngine();
  DraftEngine(const DraftEngine&) = delete;
  DraftEngine& operator=(const DraftEngine&) = delete;

  void set_weights(const std::vector<const float*>& w);
  void get_weights(const std::vector<float*>& w);
  void get_grads(const std::vector<float*>& g);
  void set_moments(const std::vector<const float*>& m, const std::vector<const float*>& v);
  void get_moments(const std::vector<float*>& m, const std::vector<float*>& v);

  // Uploads a batch and computes the target side (distribution over the draft vocab,
  // its argmax, whether the full-vocab argmax is a draft token) for its target_rows().
  // Returns in_vocab [N] (0 on the other rows).
  std::vector<uint8_t> prepare(const DraftBatch& b);
  // P-EAGLE: the entropy of the target distribution over the draft vocabulary at each row of
  // the prepared batch (0 on rows no loss reads): cross-entropy minus it is the KL divergence.
  // Empty for EAGLE-3.
  const std::vector<float>& target_entropy() const;
  // All K steps over the prepared batch. With backward, also adds the gradient of
  // sum_rows row_scale[k*N + n] * ce_k[n] to the gradients (zeroed first when asked).
  // wait = false: returns once the work is enqueued, `out` untouched; finish_run() waits for it
  // and fills `out` (nothing else may be prepared or run in between; the clipping and the
  // update may be enqueued).
  void run(const std::vector<float>& row_scale, bool backward, bool zero_grads, DraftRowStats& out, bool wait = true);
  void finish_run(DraftRowStats& out);
  // Global L2 norm of the gradients; scales them to max_norm when larger (max_norm > 0).
  // clip_grad_norm_start() enqueues it (the factor stays on the device, the host does not
  // wait); grad_norm() waits for the norm alone, so called after adamw() the device has the
  // update to run meanwhile. clip_grad_norm() is the two together.
  double clip_grad_norm(double max_norm);
  void clip_grad_norm_start(double max_norm);
  double grad_norm();
  // One AdamW update as train::AdamW::step; decay[i]: weight decay applies to tensor i;
  // t_after: the update's 1-based count (for the bias corrections).
  void adamw(double lr, double beta1, double beta2, double eps, double weight_decay, const std::vector<uint8_t>& decay,
             int64_t t_after);
  size_t device_bytes() const;
  // The choices the options resolved to (which attention, where the embedding lives), for logs.
  std::string setup() const;
  // Batches whose causal attention went through cuDNN so far (every batch with `cudnn`; under
  // auto those whose workspace fit), and a fallback to report ("" when none), cleared on reading.
  int64_t cudnn_batches() const;
  std::string take_note();
  // Rows run through the draft's layer so far, summed over steps and batches: N x K a batch
  // of N rows, less (N - N1) x (K - 1) where rows no later loss reads are cut.
  int64_t row_steps() const;
  // FLOPs of the cuBLAS linear products (2 m n k each) enqueued so far: the target head, the
  // layer's and lm_head's forward and backward products (not the attention's).
  double product_flops() const;
  // GpuDraftOptions::products other than cublas: the products' plans so far
  // (gpu_draft_options.h); all zero with cublas.
  eagle3::ProductPlans product_plans() const;
  // Pinned host buffers [max_rows, 3H] (aux) and [max_rows, H] (hidden) a batch can be
  // packed into, so that prepare() uploads them asynchronously (made on first call; both
  // null when the host cannot pin that much, and the caller then uses its own memory).
  std::pair<float*, float*> host_features();
  // For data parallel: the gradient buffer (all tensors, padded), its length, the stream
  // every operation runs on, and zeroing it.
  float* grad_data();
  int64_t grad_elems() const;
  cudaStream_t stream() const;
  int device() const;
  void zero_grads();
  // With GpuDraftOptions::profile: milliseconds of GPU time per phase, summed over calls.
  std::vector<std::pair<std::string, double>> profile() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> p_;
};

}  // namespace talon::cuda
