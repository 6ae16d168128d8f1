// `talon generate`: the target model regenerates every assistant turn of a chat dataset
// (the EAGLE-3 recipe: drafts learn the target's own answers), turn by turn in context,
// with continuous batching over the decoder's slots. The slots share a paged KV cache
// (model/decode.h): a turn starts only when the cache can hold its whole prompt and answer
// (prompt + max_new_tokens rows, in pages) beside the running ones, in queue order, so a
// cache smaller than batch x max_len runs fewer turns at once and never overflows.
//
// Per conversation: system messages are kept; each user turn is followed by a generated
// assistant turn (rendered with the chat template, add_generation_prompt = true, and the
// turns generated so far); the dataset's own assistant answers are dropped; consecutive
// user turns stay together. Question files (prompts only) generate one answer per turn.
// Conversations whose first turns are the assistant's (split ShareGPT segments) lose those
// leading turns, counted in the manifest.
//
// Output (--out DIR): generated.jsonl, one {"id", "source", "messages"} line per
// conversation in input order (OpenAI messages, ready for `talon prepare`), and
// manifest.json. While running, finished conversations are journaled in progress.jsonl;
// a killed or stopped run continues from it when rerun (nothing lost, nothing twice), and
// generated.jsonl is written once at the end (temp file, fsync, rename).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "data/chat_formats.h"
#include "model/sampling.h"
#include "text/tokenizer.h"
#include "util/file.h"

namespace talon::spec {

struct GenerateOptions {
  int threads = 0;  // CPU threads (0: all cores)
  std::vector<fs::path> inputs;
  fs::path out;
  fs::path model;
  fs::path tokenizer, chat_template;
  std::string fallback_template;
  std::string template_kwargs;
  std::string format = "auto";
  SamplingParams sampling;
  int64_t max_new_tokens = 1024;  // per assistant turn
  int64_t max_len = 4096;         // prompt + answer tokens per turn (the KV cache per slot)
  int batch = 0;                  // concurrent sequences (0: 8 on CPU, 256 on GPU)
  int64_t max_prefill_tokens = 8192;  // prompt tokens per forward (longer prompts go in chunks)
  int64_t kv_cache_tokens = 0;    // the KV cache's token rows (0: batch x max_len, on a GPU what fits)
  std::vector<std::string> stop;  // stop strings (the answer is cut before them)
  int64_t limit = 0;              // first N conversations only (0: all)
  std::string device = "cpu";     // cpu | cuda | cuda:N | cuda:N,M,... (with tp)
  int tp = 1;                     // tensor-parallel GPUs (DeepSeek family)
  int ep = 1;                     // expert-parallel GPUs (DeepSeek family; slots split among them)
  bool share_gpus = false;        // ranks may share a GPU (collectives by device copies)
  double flush_seconds = 2.0;     // journal fsync interval
};

enum class GenerateStatus { Complete, Interrupted, AlreadyComplete };

struct GenerateReport {
  GenerateStatus status = GenerateStatus::Complete;
  int64_t conversations = 0, resumed = 0, turns = 0, new_tokens = 0, prompt_tokens = 0;
  int64_t skipped = 0, leading_assistant_dropped = 0, truncated_turns = 0;
  int64_t cache_tokens = 0, peak_running = 0, waits_for_cache = 0;  // capacity, most turns at once, forwards a turn waited
  double seconds = 0, tokens_per_second = 0;
  fs::path out;
};

GenerateReport run_generate(const GenerateOptions& opt);

// The turns to generate for a conversation: for each, the messages appended before the
// generated assistant answer (rules above). Leading assistant turns are counted.
std::vector<std::vector<ojson>> turn_segments(const Conversation& c, int64_t* leading_assistant_dropped);

// End-of-generation ids: the tokenizer's eos, generation_config.json's eos_token_id (HF
// model directories) and end-of-turn markers of common chat formats that the vocabulary
// has as special added tokens.
std::vector<int32_t> eos_ids(const text::Tokenizer& tok, const fs::path& model);

}  // namespace talon::spec
