// Drafter families beside EAGLE-3 in `talon train` (--drafter peagle | dflash): what each brings
// to the shared trainer (src/draft/trainer.cpp), which keeps the features, the draft
// vocabulary, AdamW and its schedule, checkpoints with exact resume, metrics and the report.
// A family holds its weights and gradients, names its trainable tensors (the checkpoint's
// "w.NAME", "m.NAME", "v.NAME") and its frozen ones (saved as "w.NAME" for the exporter and the
// evaluator), and trains one sample at a time on its fp64 CPU reference.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "draft/dflash.h"
#include "draft/eagle3.h"
#include "draft/optim.h"

namespace talon::train {

struct TrainOptions;

class Family {
 public:
  virtual ~Family() = default;
  virtual const char* name() const = 0;  // "peagle" | "dflash"
  // Trainable tensors, in checkpoint order; their gradients are what run() accumulates.
  virtual std::vector<Param> params() = 0;
  // Saved but not trained.
  virtual std::vector<std::pair<std::string, const std::vector<float>*>> frozen() = 0;
  // Entries of the per-depth / per-position metrics (acc, cond_acc).
  virtual int width() const = 0;
  // Forward over one sample; with `backward`, the gradient of its loss added to params()'s.
  // `seed` draws what the family samples (COD elements, anchors). Evaluation (no backward)
  // uses the family's deterministic evaluation sample.
  virtual eagle3::TttResult run(const eagle3::Sample& s, uint64_t seed, bool backward) = 0;
  // Keys the family adds to the job identity (a checkpoint of another setting is refused) and
  // to the checkpoint's "draft" block.
  virtual nlohmann::json job() const = 0;
  virtual nlohmann::json draft() const = 0;
  virtual std::string describe() const = 0;  // one log line
  // A trainable table of rows (the embedding) whose per-sample gradient touches only the rows
  // touched_rows() adds for that sample; the trainer then sums those gradients over the step's
  // rows alone instead of the whole table (a vocabulary x hidden copy per sample and tree
  // level). nullptr: no such table.
  virtual const char* row_sparse_param() const { return nullptr; }
  virtual void touched_rows(const eagle3::Sample& s, std::vector<int64_t>& rows) const {}
};

// What a family is made from: the target-derived draft sizes, the target's frozen head and
// embeddings (fp32), the draft vocabulary, a seeded N(0, 1) source for fresh weights, the
// mask token, and the run's options.
struct FamilyInit {
  const eagle3::DraftConfig& c;
  const eagle3::TargetHead& tgt;
  const eagle3::DraftVocab& dv;
  const std::vector<float>& embed;  // [V, H]
  const std::vector<float>& head;   // [V, H]
  std::function<double()> normal;
  int32_t mask_token;
  const TrainOptions& opt;
};
std::unique_ptr<Family> make_family(const std::string& drafter, const FamilyInit& init);

// The DFlash draft a run trains: the target-derived sizes and the run's --draft-layers,
// --block-size and objective options; 3 aux layers (extract's).
dflash::Config dflash_config(const eagle3::DraftConfig& c, const TrainOptions& o);

}  // namespace talon::train
