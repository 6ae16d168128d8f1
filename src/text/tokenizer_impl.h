// Internal: the configurable BPE pipeline every loader fills in. Not part of the public API.
#pragma once
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "text/tokenizer.h"

namespace talon::text::detail {

// A compiled PCRE2 pattern (UTF + UCP, JIT when available).
class Regex {
 public:
  explicit Regex(const std::string& pattern, const std::string& origin);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  // Non-overlapping matches [begin, end) in byte offsets, left to right (as Rust find_iter).
  void find_all(std::string_view s, std::vector<std::pair<size_t, size_t>>& out) const;
  const std::string& pattern() const { return pattern_; }

 private:
  std::string pattern_;
  void* code_ = nullptr;
  bool jit_ = false;
};

struct StrHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};
using Vocab = std::unordered_map<std::string, int32_t, StrHash, std::equal_to<>>;

enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };
enum class Prepend { Always, First, Never };

struct NormOp {
  enum Kind { NFC, NFD, NFKC, NFKD, Lowercase, PrependStr, ReplaceStr, ReplaceRegex, Strip } kind;
  NormOp(Kind k = NFC) : kind(k) {}
  std::string a, b;  // Prepend: a; Replace: a -> b
  std::shared_ptr<Regex> re;
  bool left = false, right = false;
};

struct PreOp {
  enum Kind { Split, ByteLevel, Metaspace, Digits } kind;
  PreOp(Kind k = Split) : kind(k) {}
  std::shared_ptr<Regex> re;  // Split, ByteLevel(use_regex)
  std::string literal;        // Split on a literal string (re == nullptr)
  SplitBehavior behavior = SplitBehavior::Isolated;
  bool invert = false;
  bool add_prefix_space = false;
  std::string replacement;    // Metaspace
  Prepend prepend = Prepend::Always;
  bool split = true;          // Metaspace
  bool individual_digits = false;
};

struct DecOp {
  enum Kind { ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace } kind;
  DecOp(Kind k = ByteLevel) : kind(k) {}
  std::string a, b;           // Replace a -> b; Strip content; Metaspace replacement
  size_t start = 0, stop = 0; // Strip
  Prepend prepend = Prepend::Always;
};

struct PostItem {
  bool is_sequence = false;   // the input (A)
  std::vector<int32_t> ids;   // a special token's ids
};

struct Config {
  std::string origin;         // the file, for messages
  std::string kind;
  Vocab vocab;
  std::vector<std::string> id_to_token;  // model vocab by id ("" where absent)
  std::vector<bool> has_id;
  // merges: (left id, right id) -> (rank, merged id)
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;
  bool byte_fallback = false, fuse_unk = false, ignore_merges = false;
  int32_t unk_id = -1;
  std::vector<AddedToken> added;
  std::vector<NormOp> normalizer;
  std::vector<PreOp> pre;
  bool has_post = false;
  std::vector<PostItem> post_single;
  bool has_decoder = false;
  std::vector<DecOp> decoder;
  std::optional<int32_t> bos, eos;

  void add_merge(std::string_view a, std::string_view b, int32_t rank);  // fails naming the file
};

std::unique_ptr<Tokenizer> build(Config cfg);

// Loaders filling a Config.
Config config_from_json(std::string_view json, const std::string& origin);
Config config_from_gguf(const fs::path& path);
Config config_from_spm(const fs::path& path);
// tiktoken BPE ("<base64 bytes> <rank>" lines): detected by content, not by name.
bool is_tiktoken_file(const fs::path& path);
Config config_from_tiktoken(const fs::path& path);

// GPT-2's pre-tokenizer regex (HF ByteLevel use_regex).
extern const char* const kGpt2Regex;

}  // namespace talon::text::detail
