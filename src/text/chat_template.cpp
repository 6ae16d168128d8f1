#include "text/chat_template.h"

#include <chrono>

#include "io/gguf.h"

namespace talon::text {

namespace {

// A tokenizer_config special token: "str" or {"content": "str", ...} (AddedToken); else nullopt.
std::optional<std::string> token_string(const ojson& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return std::nullopt;
}

ojson parse_json_file(const fs::path& p) {
  std::string text = read_text_file(p);
  try {
    return ojson::parse(text);
  } catch (const std::exception& e) {
    fail("{}: not valid JSON: {}", p.string(), e.what());
  }
}

bool from_config(const fs::path& p, TemplateSource& out) {
  ojson cfg = parse_json_file(p);
  TALON_CHECK(cfg.is_object(), "{}: expected a JSON object", p.string());
  for (const char* k : {"bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"})
    if (cfg.contains(k))
      if (auto s = token_string(cfg[k])) out.special_tokens[k] = *s;
  if (!cfg.contains("chat_template") || cfg["chat_template"].is_null()) return false;
  const ojson& ct = cfg["chat_template"];
  if (ct.is_string()) {
    out.source = ct.get<std::string>();
    out.origin = p.string() + ":chat_template";
    return true;
  }
  TALON_CHECK(ct.is_array(), "{}: field chat_template must be a string or a list of {{name, template}}", p.string());
  std::vector<std::string> names;
  for (const auto& e : ct) {
    TALON_CHECK(e.is_object() && e.contains("name") && e.contains("template") && e["name"].is_string() &&
                    e["template"].is_string(),
                "{}: chat_template list entries must be {{\"name\": str, \"template\": str}}", p.string());
    names.push_back(e["name"].get<std::string>());
    if (names.back() == "default") {
      out.source = e["template"].get<std::string>();
      out.origin = p.string() + ":chat_template[default]";
      return true;
    }
  }
  fail("{}: chat_template has no template named 'default' (has: {})", p.string(), fmt::join(names, ", "));
}

}  // namespace

TemplateSource find_chat_template(const fs::path& path) {
  TemplateSource out;
  TALON_CHECK(fs::exists(path), "{}: no such file or directory", path.string());
  if (fs::is_directory(path)) {
    fs::path cfg = path / "tokenizer_config.json";
    bool have_cfg = fs::exists(cfg);
    TemplateSource from_cfg;
    bool cfg_has_template = have_cfg && from_config(cfg, from_cfg);
    if (have_cfg) out.special_tokens = from_cfg.special_tokens;
    if (fs::exists(path / "chat_template.jinja")) {
      out.source = read_text_file(path / "chat_template.jinja");
      out.origin = (path / "chat_template.jinja").string();
      return out;
    }
    if (cfg_has_template) return from_cfg;
    if (fs::exists(path / "chat_template.json")) {
      ojson j = parse_json_file(path / "chat_template.json");
      TALON_CHECK(j.is_object() && j.contains("chat_template") && j["chat_template"].is_string(),
                  "{}: expected {{\"chat_template\": str}}", (path / "chat_template.json").string());
      out.source = j["chat_template"].get<std::string>();
      out.origin = (path / "chat_template.json").string() + ":chat_template";
      return out;
    }
    fail("{}: no chat template (looked for chat_template.jinja, tokenizer_config.json:chat_template, "
         "chat_template.json)", path.string());
  }
  std::string ext = path.extension().string();
  if (ext == ".gguf") {
    gguf::File f(path);
    auto t = f.get_string_opt("tokenizer.chat_template");
    TALON_CHECK(t.has_value(), "{}: GGUF metadata has no tokenizer.chat_template", path.string());
    out.source = *t;
    out.origin = path.string() + ":tokenizer.chat_template";
    if (const gguf::Value* toks = f.find("tokenizer.ggml.tokens");
        toks && toks->kind == gguf::Value::Kind::ARRAY) {
      const auto& arr = toks->as_array();
      for (auto [key, name] : {std::pair{"tokenizer.ggml.bos_token_id", "bos_token"},
                               std::pair{"tokenizer.ggml.eos_token_id", "eos_token"},
                               std::pair{"tokenizer.ggml.unknown_token_id", "unk_token"},
                               std::pair{"tokenizer.ggml.padding_token_id", "pad_token"}}) {
        auto id = f.get_int_opt(key);
        if (id && *id >= 0 && size_t(*id) < arr.size() && arr[size_t(*id)].kind == gguf::Value::Kind::STRING)
          out.special_tokens[name] = arr[size_t(*id)].as_string();
      }
    }
    return out;
  }
  if (path.filename() == "chat_template.json") {
    ojson j = parse_json_file(path);
    TALON_CHECK(j.is_object() && j.contains("chat_template") && j["chat_template"].is_string(),
                "{}: expected {{\"chat_template\": str}}", path.string());
    out.source = j["chat_template"].get<std::string>();
    out.origin = path.string() + ":chat_template";
    return out;
  }
  if (ext == ".json") {
    if (!from_config(path, out)) fail("{}: no chat_template field", path.string());
    return out;
  }
  out.source = read_text_file(path);
  out.origin = path.string();
  return out;
}

ChatTemplate::ChatTemplate(std::string source, std::string name)
    : name_(std::move(name)),
      source_(std::move(source)),
      tpl_(std::make_shared<jinja::Template>(source_, name_)) {}

ChatTemplate ChatTemplate::from_path(const fs::path& path) {
  TemplateSource src = find_chat_template(path);
  ChatTemplate t(std::move(src.source), src.origin);
  ojson d = ojson::object();
  for (const char* k : {"bos_token", "eos_token", "unk_token", "pad_token"})
    if (src.special_tokens.contains(k)) d[k] = src.special_tokens[k];
  t.set_default_kwargs(std::move(d));
  return t;
}

std::string ChatTemplate::render(const ojson& messages, bool add_generation_prompt, const ojson& kwargs) const {
  return render_impl(messages, add_generation_prompt, kwargs, false);
}

std::string ChatTemplate::render_prefix(const ojson& messages, size_t k, bool add_generation_prompt,
                                        const ojson& kwargs) const {
  TALON_CHECK(messages.is_array(), "{}: messages must be a JSON array", name_);
  TALON_CHECK(k <= messages.size(), "{}: prefix of {} messages requested from a conversation of {}", name_, k,
              messages.size());
  ojson prefix = ojson::array();
  for (size_t i = 0; i < k; ++i) prefix.push_back(messages[i]);
  return render_impl(prefix, add_generation_prompt, kwargs, true);
}

std::string ChatTemplate::render_impl(const ojson& messages, bool add_generation_prompt, const ojson& kwargs,
                                      bool allow_empty) const {
  using jinja::Value;
  TALON_CHECK(messages.is_array(), "{}: messages must be a JSON array", name_);
  TALON_CHECK(allow_empty || !messages.empty(),
              "{}: Cannot apply chat template to an empty conversation. Provide at least one message.", name_);
  TALON_CHECK(kwargs.is_null() || kwargs.is_object(), "{}: template kwargs must be a JSON object", name_);
  // transformers: drop None-valued keys, then alias reasoning fields.
  jinja::List msgs;
  for (size_t i = 0; i < messages.size(); ++i) {
    const ojson& m = messages[i];
    TALON_CHECK(m.is_object(), "{}: message {} is not a JSON object", name_, i);
    ojson clean = ojson::object();
    for (auto it = m.begin(); it != m.end(); ++it)
      if (!it.value().is_null()) clean[it.key()] = it.value();
    const ojson* reasoning = nullptr;
    for (const char* k : {"reasoning_content", "thinking", "reasoning"})
      if (clean.contains(k)) {
        reasoning = &clean[k];
        break;
      }
    if (reasoning) {
      ojson r = *reasoning;
      ojson aliased = ojson::object();
      aliased["thinking"] = r;
      for (auto it = clean.begin(); it != clean.end(); ++it) aliased[it.key()] = it.value();
      aliased["reasoning_content"] = r;
      clean = std::move(aliased);
    }
    msgs.push_back(Value::from_json(clean));
  }
  jinja::Dict ctx;
  std::string tname = name_;
  ctx.set("raise_exception", Value::function(
                                 [tname](const jinja::CallArgs& a) -> Value {
                                   const Value* m = a.get(0, "message");
                                   throw jinja::TemplateRaise(tname, m ? m->to_str() : std::string());
                                 },
                                 "raise_exception"));
  std::optional<std::tm> now = now_;
  ctx.set("strftime_now", Value::function(
                              [now](const jinja::CallArgs& a) -> Value {
                                const Value* f = a.get(0, "format");
                                if (!f || !f->is_string()) fail("strftime_now() needs a format string");
                                std::tm tm{};
                                if (now) {
                                  tm = *now;
                                } else {
                                  std::time_t t = std::time(nullptr);
                                  localtime_r(&t, &tm);
                                }
                                char buf[512];
                                size_t n = std::strftime(buf, sizeof buf, f->str().c_str(), &tm);
                                return Value(std::string(buf, n));
                              },
                              "strftime_now"));
  ctx.set("messages", Value::list(std::move(msgs)));
  ctx.set("tools", Value::none());
  ctx.set("documents", Value::none());
  ctx.set("add_generation_prompt", Value(add_generation_prompt));
  auto merge = [&](const ojson& kw) {
    if (!kw.is_object()) return;
    for (auto it = kw.begin(); it != kw.end(); ++it) {
      TALON_CHECK(it.key() != "messages" && it.key() != "add_generation_prompt",
                  "{}: '{}' cannot be passed as a template kwarg", name_, it.key());
      ctx.set(it.key(), Value::from_json(it.value()));
    }
  };
  merge(defaults_);
  merge(kwargs);
  return tpl_->render(ctx);
}

std::vector<ChatTemplate::Span> ChatTemplate::assistant_spans(const ojson& messages, const ojson& kwargs) const {
  std::vector<Span> spans;
  std::string full = render(messages, false, kwargs);
  auto is_prefix = [&](const std::string& p) { return full.compare(0, p.size(), p) == 0; };
  for (size_t i = 0; i < messages.size(); ++i) {
    const ojson& m = messages[i];
    if (!m.is_object() || m.value("role", std::string()) != "assistant") continue;
    std::string before = render_prefix(messages, i, true, kwargs);
    std::string through = render_prefix(messages, i + 1, false, kwargs);
    bool ok = is_prefix(before) && is_prefix(through) && through.size() >= before.size();
    spans.push_back(Span{i, ok ? before.size() : 0, ok ? through.size() : 0, ok});
  }
  return spans;
}

}  // namespace talon::text
