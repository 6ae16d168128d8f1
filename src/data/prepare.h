// `talon prepare`: chat datasets -> the tokenized dataset `extract` consumes (tokens.jsonl +
// manifest.json, docs/tokens-format.md), with loss masks on assistant turns found structurally.
//
// Per conversation: render it once with the chat template (add_generation_prompt = false),
// tokenize the rendering once with add_special_tokens = false (as apply_chat_template does),
// give every token its byte range in the rendering (from each id's bytes; checked to
// concatenate to the rendering exactly), locate each assistant turn as a byte span
// (locate_assistant_turns) and set loss_mask = 1 on the tokens that overlap a span.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "data/chat_formats.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"
#include "util/file.h"

namespace talon {

struct PrepareOptions {
  std::vector<fs::path> inputs;  // files, or directories (every *.jsonl / *.json below, sorted)
  fs::path out;
  fs::path model;                // tokenizer + chat template from here unless given separately
  fs::path tokenizer, chat_template;
  std::string fallback_template;  // "" or "chatml": used only when no chat template is found
  std::string template_kwargs;    // JSON object passed to the template (e.g. {"enable_thinking": false})
  std::string format = "auto";
  int64_t max_length = 0;         // 0: no limit
  std::string on_error = "fail";  // fail | skip
  std::string prompts = "skip";   // skip | keep (question records without answers)
  int threads = 0;                // 0: all cores
  int64_t batch_records = 256;
};

enum class PrepareStatus { Complete, Interrupted, AlreadyComplete };

struct PrepareReport {
  PrepareStatus status = PrepareStatus::Complete;
  int64_t records = 0, samples = 0, tokens = 0, masked_tokens = 0, truncated = 0, prompts = 0, skipped = 0;
  double seconds = 0;
  fs::path out;
};

PrepareReport run_prepare(const PrepareOptions& opt);

// The tokenizer and chat template of a model (or given separately), with bos/eos template
// variables filled from the tokenizer; fallback_template "chatml" uses the built-in ChatML
// template when none is found (loudly). Shared by prepare and generate.
struct ChatTokenizer {
  std::unique_ptr<text::Tokenizer> tok;
  std::unique_ptr<text::ChatTemplate> tpl;
  fs::path tokenizer_path;
  bool fallback = false;
};
ChatTokenizer load_chat_tokenizer(const fs::path& model, const fs::path& tokenizer, const fs::path& chat_template,
                                  const std::string& fallback_template, const std::string& command);
// --template-kwargs: "" or a JSON object.
ojson parse_template_kwargs(const std::string& text);
// Input files: files as given, directories expanded to every *.jsonl / *.json below, sorted.
std::vector<fs::path> expand_inputs(const std::vector<fs::path>& in);

// ---- pieces, exposed for tests ----

// The built-in ChatML template used by --fallback-template chatml.
extern const char* const kChatmlTemplate;

// Bytes each token id spells, for mapping tokens to byte offsets of the text they came from.
class TokenBytes {
 public:
  explicit TokenBytes(const text::Tokenizer& tok);
  // [begin, end) of every token in `text`, which `ids` must be the tokenization of. Throws
  // RecordError("offsets") when the tokens do not spell `text`, naming the first token that does
  // not fit. Tokenizers whose normalizer rewrites text (NFC, NFKC) are aligned on the
  // normalized text and mapped back (see prepare.cpp).
  std::vector<std::pair<uint32_t, uint32_t>> offsets(const std::vector<int32_t>& ids, std::string_view text) const;

 private:
  std::vector<std::pair<uint32_t, uint32_t>> offsets_exact(const std::vector<int32_t>& ids, std::string_view text) const;
  std::vector<std::string> bytes_;
  std::vector<uint8_t> flags_;  // 1: known, 2: added token, 4: lstrip, 8: rstrip
  std::string kind_;
};

struct TurnSpan {
  size_t message_index;
  size_t begin, end;  // bytes of the rendering; end is after the end-of-turn token (trailing whitespace cut)
  bool by_sentinel;   // begin located by the probe rule (see prepare.cpp)
  bool in_final = false;  // located in the final rendering: the template rewrites this turn once
                          // later turns exist (Qwen3's dropped <think> blocks; see prepare.cpp)
};

// Byte spans of every assistant turn of `messages` in `full` (= render(messages, false)).
// Turns the prefix renderings cannot locate (the template rewrites them once later turns exist)
// are located in `full` itself by content probes. Throws RecordError("unlocatable_turn") when a
// turn cannot be located either way (e.g. the template drops it entirely).
std::vector<TurnSpan> locate_assistant_turns(const text::ChatTemplate& tpl, const ojson& messages,
                                             const ojson& kwargs, const std::string& full);

// mask[k] = 1 iff token k's byte range overlaps a span (zero-length tokens: never).
std::vector<uint8_t> spans_to_mask(const std::vector<std::pair<uint32_t, uint32_t>>& offsets,
                                   const std::vector<TurnSpan>& spans);

}  // namespace talon
