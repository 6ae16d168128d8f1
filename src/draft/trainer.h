// `talon train` (CPU reference): trains an EAGLE-3 draft offline from an `extract`
// dataset with training-time test, AdamW, periodic checkpoints and exact resume.
//
// Determinism: the sample order is a seeded permutation per epoch; every sum has a
// fixed order (independent of the thread count), so a run resumed from a checkpoint
// logs the same losses, bit for bit, as one that was never interrupted.
#pragma once
#include <cstdint>
#include <string>

#include "draft/eagle3.h"
#include "draft/gpu_draft_options.h"
#include "draft/optim.h"
#include "util/file.h"

namespace talon::train {

// The files of a training run directory.
inline constexpr const char* kCheckpointName = "checkpoint.safetensors";
inline constexpr const char* kMetricsName = "metrics.jsonl";

struct TrainOptions {
  fs::path data;   // extract output directory, or (online) a prepare output / token JSONL
  bool online = false;  // run the target in-process for features instead of reading them
  std::string layers;   // online: aux layer ids "a,b,c" (default [2, L/2, L-3])
  fs::path model;  // the target checkpoint (embeddings, final norm, lm_head)
  fs::path out;    // run directory: checkpoint.safetensors, metrics.jsonl
  int64_t draft_vocab = 32000;  // capped at the target vocabulary
  eagle3::DraftShape draft_shape;  // sizes that replace the target-derived ones (0: keep)
  // eagle3: the EAGLE-3 draft with training-time test; peagle: P-EAGLE (all ttt_steps draft
  // positions in one pass, COD-sampled chains, mask token + learned mask_hidden, trainable
  // embeddings, frozen lm_head; see draft/peagle.h); dflash: the block drafter (draft/dflash.h).
  // Every family trains on the CPU or on GPUs (draft/family.h, draft/draft_gpu.h).
  std::string drafter = "eagle3";
  int64_t mask_token_id = -1;   // peagle, dflash: the mask token (-1: the highest id the data never uses)
  double cod_ratio = 0.7;       // peagle: depth d keeps max(cod_ratio^d, cod_ratio_min) of the chains
  double cod_ratio_min = 0.2;
  // dflash (speculators' DFlash recipe by default): layers, block size, per-slot loss (ce | kl)
  // and position weights (dpace | fixed-exp-decay), anchors drawn per sample.
  int64_t draft_layers = 5;
  int64_t block_size = 16;
  std::string dflash_loss = "ce";
  std::string dflash_weighting = "dpace";
  double dflash_gamma = 4.0;
  double dpace_alpha = 0.5;
  int64_t max_anchors = 512;
  int ttt_steps = 7;            // eagle3: TTT steps K; peagle: draft positions (depths) per anchor
  double step_decay = 0.8;
  bool norm_before_residual = false;
  OptimConfig optim;
  int64_t batch_samples = 1;  // samples per optimizer step (gradients averaged)
  int64_t max_length = 2048;  // longer samples are truncated
  int64_t epochs = 1;
  int64_t max_steps = 0;      // 0: as many as the epochs give
  int64_t save_every = 100;   // optimizer steps between checkpoints (and at the end)
  uint64_t seed = 0;
  int threads = 0;
  double noise = 0;             // uniform noise in [-noise, noise] added to the aux states (0: off)
  double eval_fraction = 0.05;  // samples held back for evaluation (none when the data has < 2 samples)
  int64_t eval_every = 0;       // optimizer steps between evaluations (0: only at the end)
  std::string device = "cpu";   // cpu | cuda | cuda:N
  std::string gpu_math = "bf16";  // f32 | tf32 | bf16 (matrix products on the GPU)
  int64_t max_batch_tokens = 16384;  // GPU: tokens per packed micro-batch (gradients accumulate)
  eagle3::GpuDraftOptions gpu_engine;  // GPU: how the engine computes (--gpu-attention, ...)
  int64_t stop_after_steps = -1;  // test hook: stop as if signalled after this many steps
};

enum class TrainStatus { Complete, Interrupted };

struct TrainReport {
  TrainStatus status = TrainStatus::Complete;
  int64_t steps = 0, total_steps = 0;
  double last_loss = 0;
};

TrainReport run_train(const TrainOptions& opt);

// The optimizer's view of a draft: each weight with its gradient; weight decay applies
// to the matrices, not to the RMSNorm weights.
std::vector<Param> draft_params(eagle3::DraftWeights& w, eagle3::DraftGrads& g);

}  // namespace talon::train
