// Chat templates rendered like transformers' apply_chat_template(tokenize=False):
// same Jinja environment (trim_blocks, lstrip_blocks, loopcontrols, {% generation %},
// tojson = json.dumps(ensure_ascii=False), raise_exception, strftime_now), same input
// preparation (None-valued message keys dropped, reasoning fields aliased to
// reasoning_content / thinking, tools=None and documents=None passed explicitly).
#pragma once
#include <ctime>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "text/jinja.h"
#include "util/file.h"

namespace talon::text {

using ojson = nlohmann::ordered_json;

// Thrown when the template calls raise_exception(msg); message() is msg verbatim.
using TemplateError = jinja::TemplateRaise;

struct TemplateSource {
  std::string source;   // the Jinja text
  std::string origin;   // where it came from, for messages: "path/tokenizer_config.json:chat_template"
  ojson special_tokens = ojson::object();  // bos_token / eos_token / ... found next to it (strings only)
};

// Finds the chat template of PATH: a .jinja (or any text) file, a tokenizer_config.json
// ("chat_template" string, or a list of {name, template} -> "default"), a chat_template.json,
// a model directory (chat_template.jinja, then tokenizer_config.json, then chat_template.json)
// or a GGUF file (tokenizer.chat_template). Throws talon::Error naming the file when absent.
TemplateSource find_chat_template(const fs::path& path);

class ChatTemplate {
 public:
  ChatTemplate(std::string source, std::string name);   // throws jinja::SyntaxError
  static ChatTemplate from_path(const fs::path& path);  // find_chat_template + defaults

  const std::string& name() const { return name_; }
  const std::string& source() const { return source_; }

  // Keyword arguments merged under every render's kwargs (transformers passes the
  // tokenizer's special_tokens_map this way). from_path fills bos_token / eos_token.
  void set_default_kwargs(ojson kw) { defaults_ = std::move(kw); }
  const ojson& default_kwargs() const { return defaults_; }

  // strftime_now() returns this time (local time fields) instead of the clock's.
  void set_now(std::optional<std::tm> t) { now_ = t; }

  // messages: JSON array of message objects. kwargs: extra template variables
  // (bos_token, eos_token, enable_thinking, tools, documents, ...). Throws TemplateError
  // when the template raises, talon::Error for bad input or template runtime errors.
  std::string render(const ojson& messages, bool add_generation_prompt, const ojson& kwargs = ojson::object()) const;

  // Renders messages[0..k) only (k may be 0: an empty conversation is passed to the template).
  std::string render_prefix(const ojson& messages, size_t k, bool add_generation_prompt,
                            const ojson& kwargs = ojson::object()) const;

  // For loss masks: byte spans of each assistant turn, located structurally as
  //   start = |render(messages[0..i), add_generation_prompt=true)|
  //   end   = |render(messages[0..i+1), add_generation_prompt=false)|
  // after checking that both renders are prefixes of the full render (templates that
  // rewrite earlier turns, e.g. Qwen3 dropping old <think> blocks, fail that check:
  // `ok` is false for that turn and the span is empty).
  struct Span {
    size_t message_index;
    size_t begin, end;
    bool ok;
  };
  std::vector<Span> assistant_spans(const ojson& messages, const ojson& kwargs = ojson::object()) const;

 private:
  std::string render_impl(const ojson& messages, bool add_generation_prompt, const ojson& kwargs,
                          bool allow_empty) const;
  std::string name_, source_;
  std::shared_ptr<jinja::Template> tpl_;
  ojson defaults_ = ojson::object();
  std::optional<std::tm> now_;
};

}  // namespace talon::text
