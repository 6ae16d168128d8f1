// Tokenized samples, the input of extract/train/generate. The JSONL reader here is the
// first implementation of SampleSource; `prepare` output feeds the same interface.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "util/file.h"

namespace talon {

struct Sample {
  std::string id;                  // from the record's "id" field, else "line:<n>"
  int64_t line = 0;                // 1-based line in the source, for messages
  std::vector<int32_t> input_ids;  // [T]
  std::vector<uint8_t> loss_mask;  // [T], 1 on tokens the draft is trained on
};

class SampleSource {
 public:
  virtual ~SampleSource() = default;
  virtual size_t size() const = 0;
  virtual const Sample& at(size_t i) const = 0;
  virtual std::string path() const = 0;
  virtual std::string sha256() const = 0;  // identity of the input bytes
  virtual std::string format() const = 0;
};

// Pre-tokenized JSONL: one object per line, {"input_ids": [...], "loss_mask": [...], "id"?: ...}.
// Blank lines are skipped; anything else malformed fails naming file:line and the field.
std::unique_ptr<SampleSource> open_token_jsonl(const fs::path& path);

// A `talon prepare` output directory (manifest.json format "talon.tokens" + tokens.jsonl, whose
// sha256 must match the manifest's), its tokens.jsonl, or any token JSONL file.
std::unique_ptr<SampleSource> open_samples(const fs::path& path);

}  // namespace talon
