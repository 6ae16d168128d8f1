// The EAGLE-3 draft trainer on a GPU: the same objective, gradients and AdamW update as
// the CPU reference (eagle3::ttt_forward, train::AdamW), with samples packed into one
// batch per call. It also trains P-EAGLE (draft/peagle.h: the same layer, all depths in one
// pass) against peagle::forward, and DFlash (draft/dflash.h, its own engine) against
// dflash::forward. Built only with the CUDA backend; elsewhere the factory fails clearly.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "draft/dflash.h"
#include "draft/eagle3.h"
#include "draft/gpu_draft_options.h"
#include "draft/peagle.h"
#include "draft/optim.h"
#include "util/dist.h"

namespace talon::eagle3 {

// Matrix products in exact fp32, TF32, or bf16 on tensor cores (fp32 storage and
// accumulation either way).
enum class GpuMath { F32, TF32, BF16 };
GpuMath parse_gpu_math(const std::string& s);

// Which drafter the GPU trainer trains: EAGLE-3; P-EAGLE with its mask token and COD
// sampling (each sample's elements drawn from the seed run() is given for it, as
// peagle::cod_sample; without a backward, peagle::all_chains); or DFlash (dflash.h) with its
// configuration, mask token and anchors (up to max_anchors a sample drawn from its seed, as
// dflash::select_anchors; without a backward, every candidate).
struct GpuFamily {
  std::string drafter = "eagle3";  // eagle3 | peagle | dflash
  int32_t mask_token = -1;
  peagle::CodOptions cod;
  dflash::Config dflash;
  int64_t max_anchors = 512;
};

class GpuDraftTrainer {
 public:
  using Named = std::vector<std::pair<std::string, const std::vector<float>*>>;
  using NamedOut = std::vector<std::pair<std::string, std::vector<float>*>>;
  virtual ~GpuDraftTrainer() = default;
  // Any family's tensors by name: DraftWeights::named()'s and P-EAGLE's mask_hidden and
  // embed, or DFlash's (the CPU family's names, lm_head included). set_tensors needs every
  // one; the get functions fill those asked for (gradients as the last clip left them).
  virtual void set_tensors(const Named& w) = 0;
  virtual void get_tensors(const NamedOut& w) = 0;
  virtual void get_tensor_grads(const NamedOut& g) = 0;
  // The trained tensors, in the order of set_moments / get_moments (P-EAGLE and DFlash:
  // without the frozen lm_head; as the CPU family's params()).
  virtual std::vector<std::string> trainable() const = 0;
  virtual void set_weights(DraftWeights& w) = 0;
  virtual void get_weights(DraftWeights& w) = 0;
  virtual void get_grads(DraftGrads& g) = 0;
  virtual void set_moments(const std::vector<std::vector<float>>& m, const std::vector<std::vector<float>>& v) = 0;
  virtual void get_moments(std::vector<std::vector<float>>& m, std::vector<std::vector<float>>& v) = 0;
  // Forward of every sample (packed into one batch); with backward, adds
  // weight * d(loss_i)/d(weights) for each sample i to the gradients (zeroed first when
  // asked). Per-sample results as ttt_forward's (logits are not kept). P-EAGLE and DFlash:
  // seeds[i] draws sample i's elements or anchors when training; results as the CPU
  // family's run() gives them.
  virtual std::vector<TttResult> run(const std::vector<Sample>& batch, double weight, bool backward,
                                     bool zero_grads, const std::vector<uint64_t>& seeds = {}) = 0;
  // As train::clip_grad_norm and train::AdamW::step (t_before: updates already applied).
  virtual double clip_grad_norm(double max_norm) = 0;
  virtual void adamw_step(const train::OptimConfig& c, int64_t t_before) = 0;
  // run() and clip_grad_norm() in halves, so a training step holds no sync between its
  // backward and its update: run_start(); clip_grad_norm_start(); adamw_step(); then
  // run_finish() (run()'s results) and grad_norm() (clip_grad_norm()'s value) wait only for the
  // statistics and the norm, while the device goes on with the update. Nothing else may run
  // between run_start() and run_finish(). The same bits as the whole calls. By default (the
  // trainers that have no halves) the first half does all the work.
  virtual void run_start(const std::vector<Sample>& batch, double weight, bool backward, bool zero_grads,
                         const std::vector<uint64_t>& seeds = {}) {
    started_ = run(batch, weight, backward, zero_grads, seeds);
  }
  virtual std::vector<TttResult> run_finish() { return std::move(started_); }
  virtual void clip_grad_norm_start(double max_norm) { norm_ = clip_grad_norm(max_norm); }
  virtual double grad_norm() { return norm_; }
  virtual void zero_grads() = 0;
  // GPU milliseconds per phase (GpuDraftOptions::profile), of the first GPU.
  virtual std::vector<std::pair<std::string, double>> profile() const = 0;
  virtual int64_t max_rows() const = 0;
  virtual size_t device_bytes() const = 0;
  // Rows run through the draft's layer so far, summed over steps, batches and GPUs (EAGLE-3 and
  // P-EAGLE: N x K a batch of N rows, fewer with GpuDraftOptions::row_cut); 0 where not counted.
  virtual int64_t row_steps() const { return 0; }
  // FLOPs of the linear products enqueued so far (EAGLE-3 and P-EAGLE), summed over GPUs; 0
  // where not counted.
  virtual double product_flops() const { return 0; }
  // Batches whose causal attention went through cuDNN's fused attention (GpuDraftOptions::
  // attention), summed over GPUs (a batch split over n GPUs counts n times); 0 where not counted.
  virtual int64_t cudnn_batches() const { return 0; }
  // GpuDraftOptions::products first, waves or timed, GPU 0 (all zero with cublas).
  virtual ProductPlans product_plans() const { return {}; }

 private:
  std::vector<TttResult> started_;  // the default run_start()'s results
  double norm_ = 0;                 // the default clip_grad_norm_start()'s value
};

// n floats of host memory, page-locked when `pinned` and the CUDA runtime can pin it (batches
// whose features lie there upload to the GPU without a staging copy), ordinary memory
// otherwise.
std::shared_ptr<float[]> host_floats(size_t n, bool pinned);

// The GPUs of a data-parallel job that spans several processes: this process's devices are
// global ranks first_rank .. first_rank + n - 1 of `size`, joined through `nccl_id` (an
// ncclUniqueId that every process got from rank 0). size 0: this process's GPUs only.
struct GpuGroup {
  int first_rank = 0, size = 0;
  std::string nccl_id;
};
// A fresh ncclUniqueId (rank 0 makes it; the others receive it through a ProcessGroup).
std::string nccl_unique_id();

// Host collectives over NCCL, one rank per process on `device`, for GPU jobs started without
// MPI (torchrun, srun without PMI): the communicator's id travels through a file in `dir`
// (exchange_id_file), which every process must share.
std::unique_ptr<ProcessGroup> nccl_process_group(const RankInfo& ri, int device, const fs::path& dir);

// max_rows: the most tokens one run() may pack (device buffers are sized for it, per GPU).
// Several devices: data parallel, one thread per GPU. Each step's samples are dealt to the
// GPUs in turn (sample i to GPU i mod n), gradients are summed with an NCCL all-reduce in
// clip_grad_norm(), and every GPU applies the same update, so the weights stay identical.
std::unique_ptr<GpuDraftTrainer> make_gpu_draft_trainer(const DraftConfig& c, const TargetHead& tgt,
                                                        const DraftVocab& vocab, const std::vector<int>& devices,
                                                        GpuMath math, int64_t max_rows,
                                                        const GpuGroup& group = {},
                                                        const GpuDraftOptions& opt = {},
                                                        const GpuFamily& family = {});

}  // namespace talon::eagle3
