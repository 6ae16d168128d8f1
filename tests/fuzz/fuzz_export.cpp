// libFuzzer for the exported-draft reader (talon eval --draft DIR, talon inspect DIR): the
// input is config.json of an exported draft (speculators eagle3 / peagle / dflash, or SGLang's),
// read beside a weights file that is never valid, so every input ends in a clear error or at
// the weights. Nothing may crash, hang or read out of bounds on the way.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>

#include "draft/export.h"
#include "util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::filesystem::path dir = [] {
    const std::filesystem::path d = "/tmp/talon-fuzz-export-" + std::to_string(getpid());
    std::filesystem::create_directories(d);
    FILE* w = std::fopen((d / "model.safetensors").c_str(), "wb");  // 8 zero bytes: an empty header
    if (w) {
      const uint64_t zero = 0;
      std::fwrite(&zero, 8, 1, w);
      std::fclose(w);
    }
    return d;
  }();
  FILE* f = std::fopen((dir / "config.json").c_str(), "wb");
  if (!f) return 0;
  std::fwrite(data, 1, size, f);
  std::fclose(f);
  try {
    (void)talon::train::load_exported_draft(dir);
  } catch (const talon::Error&) {
  }
  return 0;
}
