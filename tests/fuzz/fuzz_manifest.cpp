// libFuzzer target for the manifest readers: the input becomes manifest.json of a feature
// dataset directory (read_manifest + check_dataset, which resolves every shard name) and
// of a prepared-tokens directory (open_samples). Names that leave the directory must be
// refused; a talon::Error is the expected outcome for anything malformed.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>

#include "data/features.h"
#include "data/samples.h"
#include "util/error.h"

namespace fs = std::filesystem;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const fs::path dir = [] {
    fs::path d = fs::temp_directory_path() / ("talon-fuzz-manifest-" + std::to_string(::getpid())) / "ds";
    fs::create_directories(d);
    FILE* t = std::fopen((d / "tokens.jsonl").c_str(), "wb");
    if (!t) std::abort();
    std::fputs("{\"input_ids\": [1, 2, 3], \"loss_mask\": [0, 1, 1]}\n", t);
    std::fclose(t);
    return d;
  }();
  FILE* f = std::fopen((dir / "manifest.json").c_str(), "wb");
  if (!f) return 0;
  std::fwrite(data, 1, size, f);
  std::fclose(f);
  try {
    (void)talon::read_manifest(dir);
    auto c = talon::check_dataset(dir, true);
    (void)c.ok;
  } catch (const talon::Error&) {
  }
  try {
    auto s = talon::open_samples(dir);
    (void)s->size();
  } catch (const talon::Error&) {
  }
  return 0;
}
