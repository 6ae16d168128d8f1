// libFuzzer for the JSON-facing readers: HF config.json parsing and the token JSONL reader.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "data/samples.h"
#include "model/config.h"
#include "util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const char* s = reinterpret_cast<const char*>(data);
  auto j = nlohmann::json::parse(s, s + size, nullptr, false);
  if (!j.is_discarded()) {
    try {
      auto c = talon::parse_hf_config(j, "fuzz/config.json");
      (void)c.hash();
    } catch (const talon::Error&) {
    }
  }
  static const std::string path = "/tmp/talon-fuzz-jsonl-" + std::to_string(getpid()) + ".jsonl";
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return 0;
  std::fwrite(data, 1, size, f);
  std::fclose(f);
  try {
    auto src = talon::open_token_jsonl(path);
    for (size_t i = 0; i < src->size(); ++i) (void)src->at(i).input_ids.size();
  } catch (const talon::Error&) {
  }
  return 0;
}
