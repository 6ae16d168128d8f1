// libFuzzer target for the Jinja chat-template parser and renderer. The input is a
// template; it is parsed and rendered with a fixed conversation under tight sandbox
// bounds (output, steps). A talon::Error (syntax error, raise_exception, a sandbox
// bound) is the expected outcome for bad templates; anything else is a bug.
#include <cstdint>
#include <string>
#include <string_view>

#include "text/jinja.h"
#include "util/error.h"

namespace jj = talon::text::jinja;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 16384) return 0;
  const std::string_view src(reinterpret_cast<const char*>(data), size);
  static const jj::Dict ctx = [] {
    auto ctx_json = jj::ojson::parse(R"({
      "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi <b>there</b>"},
        {"role": "assistant", "content": "Hello!", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "{\"ok\": true}"},
        {"role": "user", "content": [{"type": "text", "text": "and now?"}]}
      ],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
      "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>", "enable_thinking": false
    })");
    jj::Dict d;
    for (auto it = ctx_json.begin(); it != ctx_json.end(); ++it) d.set(it.key(), jj::Value::from_json(it.value()));
    return d;
  }();
  jj::Options opt;
  opt.max_output = 1 << 20;
  opt.max_steps = 200000;
  try {
    jj::Template t(src, "fuzz.jinja", opt);
    (void)t.render(ctx);
  } catch (const talon::Error&) {
  }
  return 0;
}
