// Exact re-implementations of Hugging Face `tokenizers` pipelines for the BPE families EAGLE-3
// targets use: byte-level BPE (GPT-2, GPT-NeoX, Llama-3, Qwen2/2.5/3, SmolLM2, DeepSeek-V3 style)
// and SentencePiece-style BPE with byte fallback (Llama-2, Mistral).
//
// Sources: a tokenizer.json (or a directory holding one, else a tokenizer.model), a .gguf
// (tokenizer.ggml.*, built the way transformers' GGUF loader builds it), or a SentencePiece
// .model (ModelProto, converted the way transformers' LlamaTokenizer converts it).
// Or a tiktoken BPE file ("<base64 bytes> <rank>" lines, e.g. Meta's Llama-3 tokenizer.model;
// detected by content), built as transformers' TikTokenConverter builds it, with Meta's Llama-3
// special tokens and <|begin_of_text|> prefix when it has Llama-3's 128000 ranks.
//
// Pipeline (as HF): added tokens split the raw text (non-normalized ones first, then the
// normalizer runs on the remaining pieces and normalized added tokens split those), the
// pre-tokenizer splits pieces into words, the BPE model turns words into ids, and the
// post-processor adds special tokens when asked.
//
// Invalid UTF-8 in encode() input: HF only accepts str, so there is no HF behaviour to copy;
// talon replaces each maximal invalid subsequence with U+FFFD first (as Rust's
// String::from_utf8_lossy), and then tokenizes that text. It never throws or crashes on it.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "util/file.h"

namespace talon::text {

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool single_word = false, lstrip = false, rstrip = false, normalized = false, special = false;
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // tokenizer.json, a model directory (tokenizer.json, else tokenizer.model inside), a .gguf,
  // or a SentencePiece model. Errors name the file and the field.
  static std::unique_ptr<Tokenizer> load(const fs::path& path);
  static std::unique_ptr<Tokenizer> from_json_text(std::string_view json, const std::string& origin);

  // Thread-safe (const; per-thread caches).
  virtual std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const = 0;
  virtual std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const = 0;

  virtual std::optional<int32_t> token_to_id(std::string_view token) const = 0;
  virtual std::optional<std::string> id_to_token(int32_t id) const = 0;
  virtual size_t vocab_size() const = 0;  // largest id + 1, added tokens included
  virtual const std::vector<AddedToken>& added_tokens() const = 0;
  std::optional<int32_t> bos_id() const { return bos_; }
  std::optional<int32_t> eos_id() const { return eos_; }
  const std::string& kind() const { return kind_; }  // "bpe-bytelevel", "bpe-sentencepiece", ...

 protected:
  std::optional<int32_t> bos_, eos_;
  std::string kind_;
};

}  // namespace talon::text
