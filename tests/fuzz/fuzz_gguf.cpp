// libFuzzer target for the GGUF reader: the input becomes a file (an anonymous memfd,
// opened through /proc/self/fd so talon::MappedFile maps it like any file), which is
// parsed; every tensor of a supported type is dequantised and all metadata is walked.
// talon::Error is the expected outcome for malformed input; anything else (crash,
// sanitizer report, other exception, leak) is a bug.
//
// Build: clang++ -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -Isrc \
//          tests/fuzz/fuzz_gguf.cpp src/io/gguf.cpp src/util/dtype.cpp src/util/file.cpp \
//          -lfmt -lcrypto -o fuzz_gguf
// Run:   ./fuzz_gguf -max_len=65536 corpus/ tests/fixtures/gguf/
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "io/gguf.h"
#include "util/error.h"

namespace {

// Touches every metadata value so the parsed tree is fully materialised.
size_t walk(const talon::gguf::Value& v, int depth) {
  using K = talon::gguf::Value::Kind;
  size_t n = 1;
  if (v.kind == K::ARRAY) {
    for (const auto& e : v.as_array()) n += walk(e, depth + 1);
  } else if (v.kind == K::STRING) {
    n += v.as_string().size();
  } else if (v.is_int()) {
    try { n += size_t(v.as_int()) & 1; } catch (const talon::Error&) {}
  } else if (v.is_float()) {
    n += v.as_float() > 0;
  }
  return n;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = talon::fuzz::as_file(data, size);
  try {
    talon::gguf::File f(path);
    volatile size_t sink = 0;
    for (const auto& [k, v] : f.metadata()) sink = sink + k.size() + walk(v, 0);
    (void)f.get_int_opt("general.alignment");
    std::vector<float> out;
    for (const auto& t : f.tensors()) {
      if (!talon::gguf::type_supported(t.type)) continue;
      out.assign(size_t(t.numel()), 0.0f);
      f.dequantize(t, out.data());
      float acc = 0;
      for (float x : out) acc += x;
      sink = sink + size_t(acc != acc);
    }
  } catch (const talon::Error&) {
  }
  return 0;
}
