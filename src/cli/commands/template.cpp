#include "cli/commands/template.h"

#include <fstream>
#include <iostream>

#include "text/chat_template.h"
#include "util/error.h"

namespace talon {

int run_template(const fs::path& template_path, const fs::path& input, const fs::path& output) {
  using ojson = nlohmann::ordered_json;
  text::ChatTemplate tpl = text::ChatTemplate::from_path(template_path);
  std::ifstream in(input, std::ios::binary);
  TALON_CHECK(in.good(), "{}: cannot open input", input.string());
  std::string out, line;
  size_t lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    std::string where = fmt::format("{}:{}", input.string(), lineno);
    ojson j;
    try {
      j = ojson::parse(line);
    } catch (const std::exception& e) {
      fail("{}: not valid JSON: {}", where, e.what());
    }
    TALON_CHECK(j.is_object(), "{}: expected a JSON object", where);
    TALON_CHECK(j.contains("messages") && j["messages"].is_array(), "{}: field messages must be an array", where);
    for (size_t i = 0; i < j["messages"].size(); ++i)
      TALON_CHECK(j["messages"][i].is_object(), "{}: messages[{}] must be an object", where, i);
    bool agp = false;
    if (j.contains("add_generation_prompt")) {
      TALON_CHECK(j["add_generation_prompt"].is_boolean(), "{}: field add_generation_prompt must be a bool", where);
      agp = j["add_generation_prompt"].get<bool>();
    }
    ojson kwargs = ojson::object();
    if (j.contains("kwargs")) {
      TALON_CHECK(j["kwargs"].is_object(), "{}: field kwargs must be an object", where);
      kwargs = j["kwargs"];
    }
    for (const char* k : {"bos_token", "eos_token"})
      if (j.contains(k)) {
        TALON_CHECK(j[k].is_string() || j[k].is_null(), "{}: field {} must be a string", where, k);
        kwargs[k] = j[k];
      }
    TALON_CHECK(!kwargs.contains("messages") && !kwargs.contains("add_generation_prompt"),
                "{}: kwargs cannot set messages / add_generation_prompt", where);
    try {
      j["rendered"] = tpl.render(j["messages"], agp, kwargs);
    } catch (const text::TemplateError& e) {
      j["error"] = e.message();
    } catch (const Error& e) {
      j["error"] = std::string(e.what());
    }
    out += j.dump(-1, ' ', false, ojson::error_handler_t::replace);
    out += '\n';
  }
  if (output.empty()) {
    std::cout << out;
    std::cout.flush();
  } else {
    write_file_atomic(output, out);
  }
  return 0;
}

}  // namespace talon
