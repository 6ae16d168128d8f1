// The EAGLE-3 feature dataset that `extract` writes (format documented in
// docs/features-format.md). A directory of safetensors shards plus manifest.json.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "util/file.h"

namespace talon {

inline constexpr const char* kFeaturesFormat = "talon.features";
inline constexpr int kFeaturesVersion = 1;
inline constexpr const char* kManifestName = "manifest.json";

std::string shard_file_name(int64_t index);  // "shard-00000.safetensors"

// Shard tensor names.
namespace shard_tensors {
inline constexpr const char* input_ids = "input_ids";                  // I32 [N]
inline constexpr const char* loss_mask = "loss_mask";                  // U8  [N]
inline constexpr const char* aux_hidden = "aux_hidden_states";         // BF16|F32 [N, 3H]
inline constexpr const char* hidden = "hidden_states";                 // BF16|F32 [N, H]  (h[L])
inline constexpr const char* sample_offsets = "sample_offsets";        // I64 [n+1]
inline constexpr const char* sample_index = "sample_index";            // I64 [n]: record index in the input
}  // namespace shard_tensors

struct DatasetCheck {
  bool ok = true;
  std::vector<std::string> problems;
  int64_t samples = 0, tokens = 0, loss_tokens = 0, shards = 0, bytes = 0;
};

// Validates a dataset directory: manifest fields, every shard's presence, size and
// (when `checksums`) SHA-256, and each shard's tensors against the manifest.
DatasetCheck check_dataset(const fs::path& dir, bool checksums);

nlohmann::json read_manifest(const fs::path& dir);  // throws naming the file on bad JSON

// The path of the manifest's shards[i] (its "file" must name a file inside `dir`).
fs::path shard_path(const fs::path& dir, const nlohmann::json& shard, size_t i);

// Checks a shard's size and SHA-256 against its manifest record; throws naming the file.
void verify_shard(const fs::path& dir, const nlohmann::json& shard, size_t i);

}  // namespace talon
