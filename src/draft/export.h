// `talon export`: turns a `talon train` checkpoint into a draft model directory that a
// serving engine loads as is (SPEC-EAGLE3 section 5), and reads such a directory back.
//
// Formats (every name and convention checked against the engines' loaders; see
// docs/export.md):
//   speculators  config.json (speculators eagle3 config, vLLM reads it) + model.safetensors
//                with layers.0.*; aux layer ids in vLLM's input-of-layer convention (Talon's).
//   sglang       config.json (LlamaForCausalLMEagle3, SpecForge layout) + model.safetensors
//                with midlayer.*; aux layer ids under eagle_config in SGLang's convention,
//                which is Talon's id - 1 (SGLang adds 1 when it installs the capture).
// Both carry fc, norm, lm_head, d2t (int64) and t2d (bool) and no embedding (the engines
// share the target's). Matrices are 2-D [out, in]; norms 1-D.
// A DFlash draft (`--drafter dflash`) exports in the speculators format only, as speculators
// 0.9 saves DFlashDraftModel: speculators_model_type "dflash", a Qwen3 transformer_layer_config
// with its layer count, block_size, aux_hidden_state_layer_ids, mask_token_id, and the layers'
// tensors (no embedding; lm_head kept for a reduced vocabulary); vLLM serves it as "dflash".
// A P-EAGLE draft (`talon train --drafter peagle`) exports in the speculators format only,
// as speculators 0.9 saves it: speculators_model_type "peagle", mask_token_id,
// embed_requires_grad, plus its trained embed_tokens.weight [V, H] and mask_hidden
// [1, 1, 3H]; vLLM serves it as EAGLE-3 with parallel drafting.
//
// Nothing half-written: the directory is assembled under a temporary name next to --out,
// every file fsynced, and renamed into place at the end.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "draft/dflash.h"
#include "draft/eagle3.h"
#include "util/dtype.h"
#include "util/file.h"

namespace talon::train {

enum class ExportFormat { Speculators, SGLang };
const char* export_format_name(ExportFormat f);
// "speculators" | "sglang"; throws otherwise.
ExportFormat parse_export_format(const std::string& s);

// A `talon train` checkpoint, validated in itself (sizes, vocabulary mapping, layer ids).
struct TrainedDraft {
  eagle3::DraftConfig config;  // rope is not in the checkpoint: taken from the target
  eagle3::DraftWeights weights;
  eagle3::DraftVocab vocab;
  std::string drafter = "eagle3";       // or "peagle", "dflash"
  int64_t mask_token_id = -1;           // peagle, dflash
  std::vector<float> mask_hidden, embed;  // peagle: [3H], [V, H]
  dflash::Config dflash;                // dflash: its sizes (config/weights above unused but for the sizes)
  dflash::Weights dweights;             // dflash
  std::vector<int64_t> aux_layer_ids;  // Talon's input-of-layer convention
  int64_t final_layer_id = 0;
  std::string convention;
  std::string target_config_sha256;
  int64_t step = 0;
  fs::path path;  // the checkpoint file
};

// `path`: a run directory or its checkpoint.safetensors. `target` supplies RoPE and is the
// model the draft must belong to (config hash, hidden and vocabulary sizes, layer count).
TrainedDraft load_trained_draft(const fs::path& path, const ModelConfig& target, const std::string& target_source);

struct ExportOptions {
  fs::path checkpoint;  // run directory or checkpoint.safetensors
  fs::path model;       // the target model
  fs::path out;         // output directory (must not exist, or be empty)
  ExportFormat format = ExportFormat::Speculators;
  int64_t speculative_tokens = 3;  // speculators_config proposal length (vLLM's default k)
  DType dtype = DType::BF16;       // BF16 or F32 for the floating-point weights
  std::string verifier;            // verifier name_or_path written in the config (default: --model, absolute)
};

struct ExportReport {
  fs::path out;
  int64_t tensors = 0;
  size_t bytes = 0;
  std::string verifier;  // as written in the config
  std::string drafter;   // eagle3 | peagle | dflash
  int64_t speculative_tokens = 0;  // as written in the config
};

// The command that serves an exported draft `dir` beside `target` (a Hugging Face id or
// model directory): `vllm serve` for the speculators format, SGLang's launcher for sglang.
// `drafter`: eagle3, peagle (vLLM's EAGLE-3 with parallel drafting) or dflash.
std::string serve_command(ExportFormat f, const fs::path& dir, const std::string& target, int64_t speculative_tokens,
                          const std::string& drafter = "eagle3");

ExportReport run_export(const ExportOptions& opt);

// An exported directory read back (either format, detected from config.json), weights
// converted to fp32, aux ids converted to Talon's convention. Fails naming the file and
// field / tensor when anything is missing or inconsistent.
struct ExportedDraft {
  ExportFormat format = ExportFormat::Speculators;
  eagle3::DraftConfig config;
  eagle3::DraftWeights weights;
  eagle3::DraftVocab vocab;
  std::string drafter = "eagle3";       // or "peagle", "dflash" (speculators format only)
  int64_t mask_token_id = -1;           // peagle, dflash
  std::vector<float> mask_hidden, embed;  // peagle: [3H], [V, H]
  dflash::Config dflash;                // dflash
  dflash::Weights dweights;             // dflash
  std::vector<int64_t> aux_layer_ids;  // Talon's convention
  DType dtype = DType::F32;            // as stored
  int64_t speculative_tokens = 0;      // speculators only; 0 for sglang
  std::string verifier;                // speculators only
};

ExportedDraft load_exported_draft(const fs::path& dir);

// Engine tensor name of each draft weight (DraftWeights::named() order), for `format`.
std::vector<std::string> exported_weight_names(ExportFormat format);
// Shape of each draft weight (DraftWeights::named() order) for a config.
std::vector<std::vector<int64_t>> draft_weight_shapes(const eagle3::DraftConfig& c);

// A DFlash draft's tensors in one order: the trainer's checkpoint names (fc, hidden_norm,
// layers.L.NAME in Layer::named() order, norm, lm_head) with the weights (sized for c), their
// shapes, and speculators' names (fc.weight, layers.L.self_attn.q_proj.weight, ...).
std::vector<std::pair<std::string, std::vector<float>*>> dflash_named(dflash::Weights& w, const dflash::Config& c);
std::vector<std::vector<int64_t>> dflash_weight_shapes(const dflash::Config& c);
std::vector<std::string> dflash_exported_names(const dflash::Config& c);

}  // namespace talon::train
