// libFuzzer target for the tokenizer.json loader: arbitrary bytes as the JSON text of a
// tokenizer. A talon::Error is the expected outcome for malformed input; a tokenizer that
// loads must encode and decode a few fixed strings (anything else: crash, sanitizer report,
// other exception, leak, timeout) is a bug.
#include <cstdint>
#include <string>
#include <string_view>

#include "text/tokenizer.h"
#include "util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    auto tok = talon::text::Tokenizer::from_json_text(text, "fuzz/tokenizer.json");
    static const char* inputs[] = {"Hello world", " a  b\n\tc ", "caf\xC3\xA9 \xE4\xB8\xAD\xE6\x96\x87 123 <|im_end|>", ""};
    for (const char* s : inputs) {
      auto ids = tok->encode(s, true);
      (void)tok->decode(ids, false);
    }
    for (int32_t id = 0; id < 64 && size_t(id) < tok->vocab_size(); ++id) (void)tok->id_to_token(id);
  } catch (const talon::Error&) {
  }
  return 0;
}
