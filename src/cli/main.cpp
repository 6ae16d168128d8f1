// talon: command-line entry point. The only place that turns errors into exit codes.
#include <CLI/CLI.hpp>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <vector>
#include <iostream>

#include "cli/commands/inspect.h"
#include "cli/commands/runs.h"
#include "cli/commands/spec.h"
#include "cli/commands/prepare.h"
#include "cli/commands/template.h"
#include "cli/commands/tokenize.h"
#include "data/extract.h"
#include "draft/export.h"
#include "draft/report.h"
#include "draft/trainer.h"
#include "util/error.h"
#include "util/log.h"
#include "util/signals.h"

using namespace talon;

namespace {
// After a graceful stop: print the command that resumes the run; the exit status says
// which signal stopped it (SIGTERM when it was the test hook).
int resume_hint(int argc, char** argv) {
  std::string cmd;
  for (int i = 0; i < argc; ++i) {
    if (i) cmd += ' ';
    cmd += argv[i];
  }
  std::cerr << "resume with: " << cmd << "\n";
  return 128 + (stop_signal() ? stop_signal() : 15);
}

// Edit distance (insertions, deletions, substitutions, adjacent swaps) for "did you mean".
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i)
    for (size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1])});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

// The closest of `names` to `bad`: a known synonym from other tools first, else the nearest
// by edit distance when it is close enough to be a typo. Empty when nothing is close.
std::string closest(const std::string& bad, const std::vector<std::string>& names) {
  static const std::map<std::string, std::vector<std::string>> synonyms = {
      {"--learning-rate", {"--lr"}}, {"--lr-schedule", {"--schedule"}}, {"--num-epochs", {"--epochs"}},
      {"--output", {"--out"}}, {"--output-dir", {"--out"}}, {"--out-dir", {"--out"}}, {"--input", {"--data"}},
      {"--dataset", {"--data"}}, {"--model-path", {"--model"}}, {"--target", {"--model"}},
      {"--max-seq-len", {"--max-length"}}, {"--max-seq-length", {"--max-length"}}, {"--batch-size", {"--batch-samples", "--batch"}},
      {"--num-speculative-tokens", {"--speculative-tokens"}}, {"--draft-vocab-size", {"--draft-vocab"}},
      {"--ttt-length", {"--ttt-steps"}}, {"--aux-layers", {"--layers"}}, {"--num-threads", {"--threads"}},
      {"--run", {"--checkpoint"}}, {"--checkpoint", {"--run", "--draft"}}, {"--draft-model", {"--draft"}}};
  const std::string key = bad.substr(0, bad.find('='));
  if (auto it = synonyms.find(key); it != synonyms.end())
    for (const auto& s : it->second)
      if (std::find(names.begin(), names.end(), s) != names.end()) return s;
  std::string best;
  size_t best_d = std::max<size_t>(2, key.size() / 3) + 1;
  for (const auto& n : names) {
    const size_t d = edit_distance(key, n);
    if (d < best_d) best_d = d, best = n;
  }
  return best;
}

// Every long option name of a subcommand (with its aliases), for suggestions.
std::vector<std::string> option_names(const CLI::App* c) {
  std::vector<std::string> names;
  for (const CLI::Option* o : c->get_options())
    for (const auto& n : o->get_lnames()) names.push_back("--" + n);
  return names;
}
}  // namespace

int main(int argc, char** argv) {
  // How long OpenMP threads spin between parallel regions before they sleep. Spinning
  // without end starves everything else on a shared or busy machine (decoding runs thousands
  // of small parallel regions: 5x slower measured on 2 busy cores), but sleeping at once costs
  // a wake-up per region: SmolLM2 decoding on 2 idle cores took 30.2 ms a token with passive
  // waits against 14.0 with a spin of 10,000 rounds (a few tens of microseconds; 3 million
  // rounds or active waits gave no more). libgomp reads this when it loads, so set it and
  // start again once; OMP_WAIT_POLICY or GOMP_SPINCOUNT from the environment win.
  if (!std::getenv("OMP_WAIT_POLICY") && !std::getenv("GOMP_SPINCOUNT") && !std::getenv("TALON_NO_REEXEC")) {
    ::setenv("GOMP_SPINCOUNT", "10000", 1);
    ::setenv("TALON_NO_REEXEC", "1", 1);
    ::execv("/proc/self/exe", argv);  // on failure, carry on with the default policy
  }
  CLI::App app{"talon: EAGLE-3 draft-model toolkit"};
  app.require_subcommand(1);
  std::string log_level = "info";
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error|off")->capture_default_str();
  app.set_version_flag("--version", std::string("talon ") + TALON_VERSION);

  PrepareOptions prep;
  auto* cmd_pr = add_prepare_subcommand(app, prep);
  spec::GenerateOptions gen;
  auto* cmd_gen = add_generate_subcommand(app, gen);
  ExtractOptions ex;
  auto* cmd_ex = app.add_subcommand("extract", "Run the target model over tokenized samples and write EAGLE-3 features");
  cmd_ex->add_option("--model", ex.model, "HF model directory or .gguf file")->required();
  cmd_ex->add_option("--data", ex.data, "Tokenized samples (JSONL with input_ids, loss_mask)")->required();
  cmd_ex->add_option("--out", ex.out, "Output dataset directory (rerun on an unfinished one to resume)")->required();
  cmd_ex->add_option("--layers", ex.layers, "Aux layer ids a,b,c (input-of-layer convention; default 2,L/2,L-3)");
  cmd_ex->add_option("--device", ex.device, "cpu | cuda (all visible GPUs) | cuda:N[,M...]")->capture_default_str();
  cmd_ex->add_option("--tp", ex.tp, "Tensor-parallel degree: GPUs per model replica (NCCL)")->capture_default_str();
  cmd_ex->add_option("--dp", ex.dp, "Data-parallel replicas (default: all the listed GPUs allow)");
  cmd_ex->add_option("--ep", ex.ep, "Expert-parallel degree for mixture-of-experts models: GPUs per replica, experts "
                                    "split, attention on each GPU's own tokens (NCCL all-to-all)")
      ->capture_default_str();
  cmd_ex->add_flag("--share-gpus", ex.share_gpus,
                   "Let --device list a GPU more than once: the ranks of a --tp/--ep group share it (device copies "
                   "instead of NCCL), to check a parallel layout on fewer GPUs");
  cmd_ex->add_flag("--fp32", ex.fp32, "Store features as F32 instead of BF16");
  cmd_ex->add_option("--shard-tokens", ex.shard_tokens, "Tokens per shard (default: ~512 MiB of features)");
  cmd_ex->add_option("--max-batch-tokens", ex.max_batch_tokens, "Token budget of one forward batch")->capture_default_str();
  cmd_ex->add_option("--threads", ex.threads, "CPU threads (default: all cores)");
  cmd_ex->add_option("--rank", ex.rank, "This process's rank when several share --out (default: launcher variables)");
  cmd_ex->add_option("--world", ex.world, "Number of ranks sharing --out");
  cmd_ex->add_option("--stop-after-shards", ex.stop_after_shards, "Testing: stop as if interrupted after N shards")
      ->group("");

  train::TrainOptions tr;
  auto* cmd_tr = app.add_subcommand("train", "Train a draft model (EAGLE-3, P-EAGLE or DFlash) from an extract dataset (CPU or GPUs)");
  cmd_tr->add_option("--data", tr.data, "Feature dataset written by `talon extract` (with --online: `talon prepare` output)")
      ->required();
  cmd_tr->add_flag("--online", tr.online, "Run the target in-process to make each batch's features (no disk)");
  cmd_tr->add_option("--layers", tr.layers, "--online: aux layer ids a,b,c (input-of-layer; default 2,L/2,L-3)");
  cmd_tr->add_option("--model", tr.model, "The target model the features came from")->required();
  cmd_tr->add_option("--out", tr.out, "Run directory (checkpoint.safetensors, metrics.jsonl); rerun to resume")->required();
  cmd_tr->add_option("--draft-vocab", tr.draft_vocab, "Draft vocabulary size (capped at the target's)")->capture_default_str();
  cmd_tr->add_option("--draft-intermediate", tr.draft_shape.intermediate,
                     "Draft MLP width (default: the target's intermediate_size)");
  cmd_tr->add_option("--draft-heads", tr.draft_shape.heads, "Draft attention heads (default: the target's)");
  cmd_tr->add_option("--draft-kv-heads", tr.draft_shape.kv_heads,
                     "Draft kv heads (default: the target's; as many as heads for MLA targets)");
  cmd_tr->add_option("--draft-head-dim", tr.draft_shape.head_dim,
                     "Draft head size (default: the target's; v_head_dim for MLA targets)");
  cmd_tr->add_option("--drafter", tr.drafter,
                     "eagle3 | peagle (parallel drafting) | dflash (block drafter); peagle and dflash: CPU only for now")
      ->capture_default_str()
      ->check(CLI::IsMember({"eagle3", "peagle", "dflash"}));
  cmd_tr->add_option("--ttt-steps", tr.ttt_steps, "Training-time-test steps K (peagle: draft positions per anchor)")
      ->capture_default_str();
  cmd_tr->add_option("--mask-token-id", tr.mask_token_id,
                     "peagle: the mask token id (default: the highest id the training data never uses)");
  cmd_tr->add_option("--cod-ratio", tr.cod_ratio, "peagle: depth d trains max(r^d, floor) of the chains")
      ->capture_default_str();
  cmd_tr->add_option("--cod-ratio-min", tr.cod_ratio_min, "peagle: that floor")->capture_default_str();
  cmd_tr->add_option("--draft-layers", tr.draft_layers, "dflash: decoder layers")->capture_default_str();
  cmd_tr->add_option("--block-size", tr.block_size, "dflash: tokens per block (the anchor + block-1 drafted)")
      ->capture_default_str();
  cmd_tr->add_option("--dflash-loss", tr.dflash_loss, "dflash: ce (the target's argmax) | kl")
      ->capture_default_str()
      ->check(CLI::IsMember({"ce", "kl"}));
  cmd_tr->add_option("--dflash-weighting", tr.dflash_weighting, "dflash: position weights, dpace | fixed-exp-decay")
      ->capture_default_str()
      ->check(CLI::IsMember({"dpace", "fixed-exp-decay"}));
  cmd_tr->add_option("--dflash-gamma", tr.dflash_gamma, "dflash: fixed-exp-decay's gamma")->capture_default_str();
  cmd_tr->add_option("--dpace-alpha", tr.dpace_alpha, "dflash: D-PACE's confidence smoothing")->capture_default_str();
  cmd_tr->add_option("--max-anchors", tr.max_anchors, "dflash: blocks drawn per sample")->capture_default_str();
  cmd_tr->add_option("--step-decay", tr.step_decay, "Loss weight decay per TTT step")->capture_default_str();
  cmd_tr->add_flag("--norm-before-residual", tr.norm_before_residual, "Residual from hidden_norm(g) instead of g");
  cmd_tr->add_option("--lr", tr.optim.lr, "Peak learning rate")->capture_default_str()->check(CLI::Validator(
      [](std::string& v) {
        char* end = nullptr;
        const double x = std::strtod(v.c_str(), &end);
        return end && *end == 0 && x > 0 && std::isfinite(x) ? std::string() : "expected a positive number, got " + v;
      },
      "POSITIVE"));
  cmd_tr->add_option("--warmup-steps", tr.optim.warmup_steps, "Linear warm-up steps")->capture_default_str();
  cmd_tr->add_option("--schedule", tr.optim.schedule, "cosine | linear | constant")
      ->capture_default_str()
      ->check(CLI::IsMember({"cosine", "linear", "constant"}));
  cmd_tr->add_option("--min-lr-ratio", tr.optim.min_lr_ratio, "Final lr as a fraction of the peak")->capture_default_str();
  cmd_tr->add_option("--weight-decay", tr.optim.weight_decay, "AdamW weight decay (matrices only)")->capture_default_str();
  cmd_tr->add_option("--clip", tr.optim.clip_norm, "Global gradient-norm clip (0: off)")->capture_default_str();
  cmd_tr->add_option("--batch-samples", tr.batch_samples, "Samples per optimizer step")->capture_default_str();
  cmd_tr->add_option("--max-length", tr.max_length, "Truncate samples to this many tokens")->capture_default_str();
  cmd_tr->add_option("--epochs", tr.epochs, "Passes over the data")->capture_default_str();
  cmd_tr->add_option("--max-steps", tr.max_steps, "Stop after this many optimizer steps (0: epochs decide)");
  cmd_tr->add_option("--save-every", tr.save_every, "Checkpoint every N optimizer steps")->capture_default_str();
  cmd_tr->add_option("--seed", tr.seed, "Seed of the initial weights and the sample order")->capture_default_str();
  cmd_tr->add_option("--threads", tr.threads, "CPU threads (default: all cores)");
  cmd_tr->add_option("--device", tr.device, "cpu, cuda or cuda:N")->capture_default_str();
  cmd_tr->add_option("--gpu-math", tr.gpu_math, "Matrix products on the GPU: f32, tf32 or bf16")->capture_default_str();
  cmd_tr->add_option("--max-batch-tokens", tr.max_batch_tokens,
                     "GPU: tokens per packed micro-batch; a step's samples beyond it accumulate gradients")
      ->capture_default_str();
  {
    const char* g = "GPU engine (how, not what, it computes)";
    cmd_tr->add_option("--gpu-attention", tr.gpu_engine.attention,
                       "TTT attention: auto (flash where it applies, else blocks; cuDNN's for each batch whose "
                       "workspace fits memory lent to it), flash (fused kernels), cudnn (cuDNN's fused attention), "
                       "blocks (score-buffer products), loop (fp32 warps)")
        ->capture_default_str()->group(g);
    cmd_tr->add_flag("--gpu-batch-embeddings", tr.gpu_engine.batch_embeddings,
                     "Keep the target's embedding in pinned host memory and upload each batch's rows, or fail (the "
                     "default where it applies: EAGLE-3 with bf16 operands; saves V x H x 2 bytes of GPU memory)")
        ->group(g);
    cmd_tr->add_flag("--gpu-device-embeddings", tr.gpu_engine.device_embeddings,
                     "Keep the target's whole embedding on the GPU")->group(g);
    cmd_tr->add_flag("--gpu-fp32-operands", tr.gpu_engine.fp32_operands,
                     "bf16 math rounds fp32 operands inside cuBLAS instead of keeping bf16 copies")->group(g);
    cmd_tr->add_option("--gpu-logit-rows", tr.gpu_engine.logit_rows, "Rows of logits per chunk (0: as many as fit)")
        ->capture_default_str()->group(g);
    cmd_tr->add_option("--gpu-attn-block", tr.gpu_engine.attn_block,
                       "blocks attention: causal key block size (-1: default, 0: no skipping)")
        ->capture_default_str()->group(g);
    cmd_tr->add_flag("--gpu-lm-grad-in-backward", tr.gpu_engine.lm_grad_in_backward,
                     "The lm_head's backward recomputes the logits in the backward pass (less memory)")->group(g);
    cmd_tr->add_flag("--gpu-row-cut,!--gpu-all-rows", tr.gpu_engine.row_cut,
                     "Steps after the first run only the rows a later step's loss reads (the default: same results, "
                     "less work); --gpu-all-rows runs every row at every step")
        ->group(g);
    cmd_tr->add_flag("--gpu-fused-products,!--gpu-separate-products", tr.gpu_engine.fused_products,
                     "With bf16 operands, gate|up and the q|k|v backward as one product each (the default); "
                     "--gpu-separate-products runs one product a matrix")
        ->group(g);
    cmd_tr->add_option("--gpu-products", tr.gpu_engine.products,
                       "Who picks each bf16 product's algorithm: auto (timed with bf16 operands, else cublas), "
                       "cublas (its own choice), first (cuBLASLt's first candidate), waves (the cuBLASLt candidate "
                       "with the fullest last wave of tiles) or timed (the fastest cuBLASLt candidate with the first "
                       "one's bits, timed on the run's products)")
        ->check(CLI::IsMember({"auto", "cublas", "first", "waves", "timed"}))
        ->capture_default_str()
        ->group(g);
    cmd_tr
        ->add_flag("--gpu-fresh-grads,!--gpu-zeroed-grads", tr.gpu_engine.fresh_grads,
                   "Each weight matrix's first gradient product of a step writes its gradient instead of adding "
                   "to a zeroed one (no memset of the whole gradient; the default); --gpu-zeroed-grads zeroes "
                   "the whole gradient first")
        ->group(g);
    cmd_tr
        ->add_flag("--gpu-diag-registers,!--gpu-no-diag-registers", tr.gpu_engine.diag_rows_in_registers,
                   "The diagonal keys' attention merge and backward with their rows in registers, loaded ahead "
                   "(the same bits; the default); --gpu-no-diag-registers: a load at a time")
        ->group(g);
    cmd_tr
        ->add_flag("--gpu-fused-rope,!--gpu-separate-rope", tr.gpu_engine.fused_rope_rows,
                   "RoPE, the row cut's moves and the bf16 casts of q, k, v (forward) and of their gradients "
                   "(backward) in one kernel each (the same bits; the default); --gpu-separate-rope: a kernel each")
        ->group(g);
    cmd_tr
        ->add_flag("--gpu-qkv-forward,!--gpu-no-qkv-forward", tr.gpu_engine.qkv_forward_product,
                   "With --gpu-fused-rope and fused products: the forward's q, k and v as one product (the "
                   "default); --gpu-no-qkv-forward: three")
        ->group(g);
    cmd_tr
        ->add_flag("--gpu-cudnn-head-groups", tr.gpu_engine.cudnn_head_groups,
                   "cuDNN's attention backward in head groups where one over every head would need more "
                   "workspace than the memory lent to it, so long samples go through cuDNN too (opt-in)")
        ->group(g);
    cmd_tr->add_flag("--gpu-profile", tr.gpu_engine.profile, "Log GPU time per phase at the end")->group(g);
  }
  cmd_tr->add_option("--noise", tr.noise, "Uniform noise amplitude added to the aux hidden states")->capture_default_str();
  cmd_tr->add_option("--eval-fraction", tr.eval_fraction, "Fraction of samples held back for evaluation")
      ->capture_default_str();
  cmd_tr->add_option("--eval-every", tr.eval_every, "Evaluate every N optimizer steps (0: at the end only)")
      ->capture_default_str();
  cmd_tr->add_option("--stop-after-steps", tr.stop_after_steps, "Testing: stop as if interrupted")->group("");

  train::ExportOptions exo;
  std::string ex_format, ex_dtype = "bf16";
  auto* cmd_exp = app.add_subcommand("export", "Write a trained draft as a vLLM (speculators) or SGLang model directory");
  cmd_exp->add_option("--run,--checkpoint", exo.checkpoint, "`talon train` run directory or its checkpoint.safetensors")->required();
  cmd_exp->add_option("--model", exo.model, "The target model the draft was trained for")->required();
  cmd_exp->add_option("--format", ex_format, "speculators (vLLM) | sglang (SpecForge layout)")->required();
  cmd_exp->add_option("--out", exo.out, "Output directory (must not exist, or be empty)")->required();
  cmd_exp->add_option("--speculative-tokens", exo.speculative_tokens, "Draft tokens per step in the speculators config")
      ->capture_default_str();
  cmd_exp->add_option("--dtype", ex_dtype, "bf16 | fp32 for the weights")->capture_default_str();
  cmd_exp->add_option("--verifier", exo.verifier,
                      "Required: the target as the engine serves it, its Hugging Face id (or HF directory); written in "
                      "the config and the printed serve command");

  EvalCli evo;
  auto* cmd_ev = add_eval_subcommand(app, evo);

  train::ReportOptions rpo;
  auto* cmd_rep = app.add_subcommand("report", "One HTML page of a training run's metrics and settings, or several runs compared");
  cmd_rep->add_option("--run", rpo.runs,
                      "`talon train` output directory (or its metrics.jsonl); several (or --run repeated): one page "
                      "comparing the runs")
      ->required();
  cmd_rep->add_option("--out", rpo.out, "HTML file to write")->required();
  cmd_rep->add_option("--eval", rpo.eval,
                      "`talon eval` output directory (or its eval.json) of this run's drafter: puts the acceptance "
                      "measured when serving next to the trainer's held-back simulation, per depth");

  fs::path inspect_target;
  bool quick = false;
  int show_sample = -1;
  auto* cmd_in = app.add_subcommand("inspect", "Summarise and verify what talon writes (tokens, answers, features, runs, "
                                                "exports, eval results), models and safetensors files");
  cmd_in->add_option("path", inspect_target, "Any talon output directory, a model directory, .gguf or .safetensors")->required();
  cmd_in->add_flag("--quick", quick, "Check sizes only, skip checksums");
  cmd_in->add_option("--sample", show_sample, "Print sample N's tokens with its loss mask");

  fs::path tpl_path, tpl_in, tpl_out;
  auto* cmd_tp = app.add_subcommand("template", "Render chat templates like transformers' apply_chat_template");
  cmd_tp->add_option("--template", tpl_path, ".jinja, tokenizer_config.json, model directory or .gguf")->required();
  cmd_tp->add_option("--input", tpl_in, "JSONL: {messages, add_generation_prompt, bos_token, eos_token, kwargs}")
      ->required();
  cmd_tp->add_option("--out,--output", tpl_out, "Output JSONL (default: stdout)");

  fs::path tk_tok, tk_in, tk_out;
  int tk_threads = 0;
  auto* cmd_tk = app.add_subcommand("tokenize", "Tokenize JSONL {\"text\"} lines exactly as HF tokenizers (adds \"ids\")");
  cmd_tk->add_option("--tokenizer", tk_tok, "tokenizer.json, model directory, .gguf or SentencePiece .model")->required();
  cmd_tk->add_option("--input", tk_in, "JSONL input")->required();
  cmd_tk->add_option("--out,--output", tk_out, "JSONL output (default: stdout)");
  cmd_tk->add_option("--threads", tk_threads, "Threads (default: all cores)");

  auto* cmd_gpus = app.add_subcommand("gpus", "Show each GPU's memory and the talon runs holding it");
  fs::path stop_dir;
  double stop_wait = 30;
  auto* cmd_stop = app.add_subcommand("stop", "Stop the talon run writing a directory (SIGTERM to the PID it recorded)");
  cmd_stop->add_option("run", stop_dir, "The run's output directory")->required();
  cmd_stop->add_option("--wait", stop_wait, "Seconds to wait for it to finish draining")->capture_default_str();

  // Unknown options are collected instead of failing inside the parser, so the error can
  // name the closest known option ("--learning-rate": did you mean --lr?).
  // --log-level may also follow the command (fallthrough to the top level).
  app.allow_extras();
  for (CLI::App* c : app.get_subcommands({})) c->fallthrough();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::vector<std::string> subs;
    for (const CLI::App* c : app.get_subcommands({})) subs.push_back(c->get_name());
    if (argc > 1 && argv[1][0] != '-' && std::find(subs.begin(), subs.end(), argv[1]) == subs.end()) {
      const std::string near = closest(argv[1], subs);
      std::cerr << fmt::format("error: unknown command '{}'{}; commands: {}\n", argv[1],
                               near.empty() ? "" : fmt::format(" (did you mean '{}'?)", near), fmt::join(subs, ", "));
      return 2;
    }
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);  // --help, --version
    std::cerr << fmt::format("error: {}; see talon{} --help\n", e.what(),
                             argc > 1 && std::find(subs.begin(), subs.end(), argv[1]) != subs.end()
                                 ? std::string(" ") + argv[1]
                                 : std::string());
    return e.get_exit_code();
  }
  for (const CLI::App* c : app.get_subcommands()) {
    const std::vector<std::string> extra = app.remaining(true);
    if (extra.empty()) continue;
    const std::string near = closest(extra.front(), option_names(c));
    std::cerr << fmt::format("error: talon {}: unexpected argument '{}'{}; see talon {} --help\n", c->get_name(),
                             extra.front(), near.empty() ? "" : fmt::format(" (did you mean {}?)", near),
                             c->get_name());
    return 2;
  }
  try {
    init_logging(log_level);
  } catch (const Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 2;
  }
  install_stop_handlers();
  try {
    if (*cmd_ex) {
      ExtractReport r = run_extract(ex);
      if (r.status == ExtractStatus::Interrupted) {
        tlog::warn("stopped by signal after {} finished shards; finished work is on disk", r.shards);
        return resume_hint(argc, argv);
      }
      if (r.status == ExtractStatus::RankDone) {
        std::cout << fmt::format("extract: this rank's work is written ({} shards, {} tokens); rank 0 writes the "
                                 "manifest when every rank is done\n", r.shards, r.tokens_this_run);
        return 0;
      }
      std::cout << fmt::format("extract {}: {} samples, {} tokens ({} loss tokens) in {} shards\n",
                               r.status == ExtractStatus::AlreadyComplete ? "already complete" : "complete", r.samples,
                               r.tokens, r.loss_tokens, r.shards);
      std::cout << fmt::format("  layers: aux {} + final {} (input-of-layer)\n", fmt::join(r.aux_layers, ","),
                               r.final_layer);
      std::cout << fmt::format("  output: {}\n", r.manifest.parent_path().string());
      return 0;
    }
    if (*cmd_in)
      return is_tokens_dir(inspect_target) ? inspect_tokens(inspect_target, show_sample)
                                           : inspect_path(inspect_target, quick, show_sample);
    if (*cmd_tp) return run_template(tpl_path, tpl_in, tpl_out);
    if (*cmd_tk) return run_tokenize(tk_tok, tk_in, tk_out, tk_threads);
    if (*cmd_pr) {
      const int rc = run_prepare_command(prep);
      return rc > 128 ? resume_hint(argc, argv) : rc;
    }
    if (*cmd_gen) {
      const int rc = run_generate_command(gen);
      return rc > 128 ? resume_hint(argc, argv) : rc;
    }
    if (*cmd_ev) return run_eval_command(evo);
    if (*cmd_gpus) return run_gpus();
    if (*cmd_tr) {
      auto r = train::run_train(tr);
      if (r.status == train::TrainStatus::Interrupted) {
        tlog::warn("stopped by signal at step {} of {}; checkpoint written", r.steps, r.total_steps);
        return resume_hint(argc, argv);
      }
      std::cout << fmt::format("train complete: {} steps, last loss {:.4f}\n  output: {}\n", r.steps, r.last_loss,
                               tr.out.string());
      return 0;
    }
    if (*cmd_stop) return run_stop(stop_dir, stop_wait);
    if (*cmd_exp) {
      exo.format = train::parse_export_format(ex_format);
      TALON_CHECK(!exo.verifier.empty(),
                  "--verifier is required (the target as vLLM or SGLang will serve it: its Hugging Face id, e.g. "
                  "--verifier meta-llama/Llama-3.1-8B-Instruct, or a Hugging Face model directory; --model may be a "
                  "GGUF file or a local copy the engine never sees); see talon export --help");
      TALON_CHECK(fs::path(exo.verifier).extension() != ".gguf",
                  "export: --verifier {} is a GGUF file; vLLM and SGLang serve the target from its Hugging Face id "
                  "(e.g. --verifier meta-llama/Llama-3.1-8B-Instruct) or a Hugging Face model directory",
                  exo.verifier);
      TALON_CHECK(ex_dtype == "bf16" || ex_dtype == "fp32", "export: --dtype must be bf16 or fp32, got '{}'", ex_dtype);
      exo.dtype = ex_dtype == "bf16" ? DType::BF16 : DType::F32;
      auto r = train::run_export(exo);
      std::cout << fmt::format("export complete: {} tensors, {} bytes\n  output: {}\n", r.tensors, r.bytes, r.out.string());
      const bool local = fs::exists(r.verifier);
      std::cout << fmt::format("serve it with the target{}:\n  {}\n",
                               local ? " (a local directory: the draft names this path as its verifier)" : "",
                               train::serve_command(exo.format, r.out, r.verifier, r.speculative_tokens, r.drafter));
      return 0;
    }
    if (*cmd_rep) {
      auto r = train::run_report(rpo);
      std::cout << fmt::format("report: {} records, {} charts\n  output: {}\n", r.records, r.charts, rpo.out.string());
      return 0;
    }
  } catch (const Error& e) {
    spdlog::default_logger()->flush();
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
