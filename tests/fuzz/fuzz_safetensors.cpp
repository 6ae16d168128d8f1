// libFuzzer: arbitrary bytes as a safetensors file must give a talon::Error or a valid
// view, never a crash or an out-of-bounds read.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "io/safetensors.h"
#include "util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = "/tmp/talon-fuzz-st-" + std::to_string(getpid()) + ".safetensors";
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return 0;
  std::fwrite(data, 1, size, f);
  std::fclose(f);
  try {
    talon::st::File st(path);
    uint64_t sum = 0;
    for (auto& t : st.tensors())
      for (size_t i = 0; i < t.nbytes; ++i) sum += t.data[i];  // touches every claimed byte
    (void)sum;
  } catch (const talon::Error&) {
  }
  return 0;
}
