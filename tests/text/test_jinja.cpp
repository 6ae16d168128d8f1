// Chat-template interpreter vs transformers/jinja2 goldens (tools/make_template_goldens.py).
#include <gtest/gtest.h>

#include <fstream>
#include <map>

#include "text/chat_template.h"
#include "text/jinja.h"
#include "util/file.h"

using namespace talon;
using namespace talon::text;
using ojson = nlohmann::ordered_json;

namespace {

fs::path fixtures() { return fs::path(TALON_SOURCE_DIR) / "tests" / "fixtures" / "templates"; }

std::vector<ojson> read_jsonl(const fs::path& p) {
  std::ifstream f(p);
  std::vector<ojson> out;
  std::string line;
  while (std::getline(f, line))
    if (!line.empty()) out.push_back(ojson::parse(line));
  return out;
}

std::tm pinned_time() {  // 2025-03-07 09:05:00, as pinned by the golden script
  std::tm tm{};
  tm.tm_year = 125;
  tm.tm_mon = 2;
  tm.tm_mday = 7;
  tm.tm_hour = 9;
  tm.tm_min = 5;
  tm.tm_wday = 5;
  tm.tm_yday = 65;
  return tm;
}

std::string diff_at(const std::string& got, const std::string& want) {
  size_t i = 0;
  while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
  auto ctx = [&](const std::string& s) {
    size_t b = i >= 20 ? i - 20 : 0;
    return ojson(s.substr(b, 60)).dump(-1, ' ', false, ojson::error_handler_t::replace);
  };
  return fmt::format("first difference at byte {} (got {} bytes, want {}): got {} want {}", i, got.size(),
                     want.size(), ctx(got), ctx(want));
}

jinja::Dict context_of(const ojson& ctx, std::tm now) {
  jinja::Dict d;
  for (auto it = ctx.begin(); it != ctx.end(); ++it) d.set(it.key(), jinja::Value::from_json(it.value()));
  d.set("raise_exception", jinja::Value::function([](const jinja::CallArgs& a) -> jinja::Value {
          throw jinja::TemplateRaise("unit", a.pos.at(0).to_str());
        }));
  d.set("strftime_now", jinja::Value::function([now](const jinja::CallArgs& a) -> jinja::Value {
          char buf[256];
          size_t n = std::strftime(buf, sizeof buf, a.pos.at(0).str().c_str(), &now);
          return jinja::Value(std::string(buf, n));
        }));
  return d;
}

}  // namespace

TEST(ChatTemplateGoldens, AllTemplatesByteEqual) {
  auto lines = read_jsonl(fixtures() / "goldens.jsonl");
  ASSERT_GT(lines.size(), 100u);
  std::map<std::string, ChatTemplate> templates;
  std::map<std::string, std::pair<int, int>> per_template;  // pass, total
  std::vector<std::string> failures;
  for (const auto& g : lines) {
    std::string name = g["template"];
    if (!templates.count(name)) {
      ChatTemplate t(read_text_file(fixtures() / name), name);
      t.set_now(pinned_time());
      templates.emplace(name, std::move(t));
    }
    const ChatTemplate& t = templates.at(name);
    auto& [pass, total] = per_template[name];
    ++total;
    std::string label = fmt::format("{} / {} / agp={}", name, g["case"].get<std::string>(),
                                    g["add_generation_prompt"].get<bool>());
    try {
      std::string got = t.render(g["messages"], g["add_generation_prompt"], g["kwargs"]);
      if (!g.contains("expected")) {
        failures.push_back(label + ": expected error '" + g["error"].get<std::string>() + "', rendered instead");
      } else if (got != g["expected"].get<std::string>()) {
        failures.push_back(label + ": " + diff_at(got, g["expected"]));
      } else {
        ++pass;
      }
    } catch (const TemplateError& e) {
      if (g.contains("error") && e.message() == g["error"].get<std::string>() && !g.contains("error_kind")) ++pass;
      else failures.push_back(label + ": raised '" + e.message() + "'");
    } catch (const std::exception& e) {
      if (g.contains("error") && g.contains("error_kind") &&
          std::string(e.what()).find(g["error"].get<std::string>()) != std::string::npos)
        ++pass;
      else
        failures.push_back(label + ": error " + e.what());
    }
  }
  for (const auto& [n, pt] : per_template) std::printf("  %-42s %d/%d byte-equal\n", n.c_str(), pt.first, pt.second);
  for (const auto& f : failures) ADD_FAILURE() << f;
  EXPECT_GE(per_template.size(), 15u);
}

TEST(Jinja, UnitCasesMatchJinja2) {
  auto lines = read_jsonl(fixtures() / "jinja_cases.jsonl");
  ASSERT_GT(lines.size(), 30u);
  for (const auto& c : lines) {
    std::string name = c["name"];
    SCOPED_TRACE(name);
    const ojson* err = c.contains("error") ? &c["error"] : nullptr;
    try {
      jinja::Template t(c["template"].get<std::string>(), name);
      std::string got = t.render(context_of(c["context"], pinned_time()));
      if (err) {
        ADD_FAILURE() << name << ": expected error " << err->dump() << ", rendered " << ojson(got).dump();
      } else {
        EXPECT_EQ(got, c["expected"].get<std::string>()) << diff_at(got, c["expected"]);
      }
    } catch (const jinja::SyntaxError& e) {
      ASSERT_TRUE(err) << name << ": unexpected syntax error " << e.what();
      EXPECT_EQ((*err)["kind"], "syntax") << e.what();
      EXPECT_EQ(e.line(), (*err)["line"].get<int>()) << e.what();
      EXPECT_NE(std::string(e.what()).find("template '" + name + "'"), std::string::npos) << e.what();
      if (name == "err_unknown_filter" || name == "err_unknown_test" || name == "err_unknown_tag" ||
          name == "err_syntax_line") {
        EXPECT_EQ(e.message(), (*err)["message"].get<std::string>());
      }
    } catch (const jinja::TemplateRaise& e) {
      ASSERT_TRUE(err) << name << ": unexpected raise " << e.what();
      EXPECT_EQ((*err)["kind"], "raise");
      EXPECT_EQ(e.message(), (*err)["message"].get<std::string>());
    } catch (const talon::Error& e) {
      ASSERT_TRUE(err) << name << ": unexpected error " << e.what();
      EXPECT_EQ((*err)["kind"], "runtime") << e.what();
      // runtime errors carry jinja's message, prefixed with template name and line
      EXPECT_NE(std::string(e.what()).find((*err)["message"].get<std::string>()), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("template '" + name + "' line 1"), std::string::npos) << e.what();
    }
  }
}

TEST(ChatTemplate, FindsTemplateInConfigListAndDirectory) {
  fs::path dir = fs::temp_directory_path() / fmt::format("talon_tpl_{}", ::getpid());
  fs::create_directories(dir);
  {
    ojson cfg = {{"bos_token", {{"__type", "AddedToken"}, {"content", "<s>"}}},
                 {"eos_token", "</s>"},
                 {"chat_template", ojson::array({{{"name", "tool_use"}, {"template", "T"}},
                                                 {{"name", "default"}, {"template", "{{ bos_token }}D{{ eos_token }}"}}})}};
    write_file_atomic(dir / "tokenizer_config.json", cfg.dump());
  }
  auto t = ChatTemplate::from_path(dir);
  EXPECT_EQ(t.render(ojson::parse(R"([{"role":"user","content":"x"}])"), false), "<s>D</s>");
  write_file_atomic(dir / "chat_template.jinja", "J{{ messages|length }}\n");
  EXPECT_EQ(ChatTemplate::from_path(dir).render(ojson::parse(R"([{"role":"user","content":"x"}])"), false), "J1");
  EXPECT_THROW(ChatTemplate::from_path(dir / "missing.jinja"), talon::Error);
  fs::remove_all(dir);
}

TEST(ChatTemplate, GgufTemplate) {
  fs::path g = fs::path(TALON_SOURCE_DIR) / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!fs::exists(g)) GTEST_SKIP() << "no " << g;
  auto t = ChatTemplate::from_path(g);
  std::string want = read_text_file(fixtures() / "smollm2.jinja");
  EXPECT_EQ(t.source(), want);
  EXPECT_TRUE(t.default_kwargs().contains("eos_token"));
}

TEST(ChatTemplate, PrefixRenderAndAssistantSpans) {
  ChatTemplate t(read_text_file(fixtures() / "qwen2.5-instruct.jinja"), "qwen2.5");
  ojson msgs = ojson::parse(R"([{"role":"user","content":"hi"},{"role":"assistant","content":"hello"},
                               {"role":"user","content":"bye"},{"role":"assistant","content":"ciao"}])");
  std::string full = t.render(msgs, false);
  auto spans = t.assistant_spans(msgs);
  ASSERT_EQ(spans.size(), 2u);
  for (const auto& s : spans) ASSERT_TRUE(s.ok);
  EXPECT_EQ(full.substr(spans[0].begin, spans[0].end - spans[0].begin), "hello<|im_end|>\n");
  EXPECT_EQ(full.substr(spans[1].begin, spans[1].end - spans[1].begin), "ciao<|im_end|>\n");
  EXPECT_EQ(t.render_prefix(msgs, 1, true), full.substr(0, spans[0].begin));
}

TEST(ChatTemplate, RaiseExceptionCarriesMessage) {
  ChatTemplate t("{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok", "t");
  try {
    t.render(ojson::parse(R"([{"role":"assistant","content":"x"}])"), false);
    FAIL() << "no throw";
  } catch (const TemplateError& e) {
    EXPECT_EQ(e.message(), "first must be user");
  }
  EXPECT_EQ(t.render(ojson::parse(R"([{"role":"user","content":"x"}])"), false), "ok");
  EXPECT_THROW(t.render(ojson::array(), false), talon::Error);
}
