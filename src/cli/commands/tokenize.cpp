#include "cli/commands/tokenize.h"

#include <atomic>
#include <mutex>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#include "text/tokenizer.h"
#include "util/threads.h"
#include "util/error.h"

namespace talon {

namespace {
using ojson = nlohmann::ordered_json;

struct Line {
  size_t lineno = 0;
  ojson obj;
  bool encode = true;
};
}  // namespace

int run_tokenize(const fs::path& tokenizer_path, const fs::path& input, const fs::path& output, int threads) {
  auto tok = text::Tokenizer::load(tokenizer_path);
  std::string data = read_text_file(input);
  int nt = threads > 0 ? threads : int(std::max(1u, std::thread::hardware_concurrency()));

  // Split lines (cheap, serial); parse, validate, encode and serialise them in parallel.
  struct Raw {
    size_t lineno;
    std::string_view text;
  };
  std::vector<Raw> raw;
  size_t pos = 0, lineno = 0;
  while (pos < data.size()) {
    size_t nl = data.find('\n', pos);
    if (nl == std::string::npos) nl = data.size();
    std::string_view s(data.data() + pos, nl - pos);
    pos = nl + 1;
    ++lineno;
    if (!s.empty() && s.back() == '\r') s.remove_suffix(1);
    if (s.find_first_not_of(" \t") == std::string_view::npos) continue;
    raw.push_back({lineno, s});
  }
  nt = int(std::min<size_t>(size_t(nt), std::max<size_t>(1, raw.size())));
  auto parallel_for = [&](auto&& body) { parallel_for_chunks(raw.size(), nt, 64, body); };

  std::vector<Line> lines(raw.size());
  std::vector<std::string> why(raw.size());  // non-empty: the line is malformed
  parallel_for([&](size_t i) {
    const std::string_view s = raw[i].text;
    Line& l = lines[i];
    l.lineno = raw[i].lineno;
    try {
      l.obj = ojson::parse(s.begin(), s.end());
    } catch (const ojson::exception& e) {
      why[i] = fmt::format("not valid JSON: {}", e.what());
      return;
    }
    if (!l.obj.is_object()) {
      why[i] = "expected a JSON object";
      return;
    }
    auto t = l.obj.find("text");
    if (t != l.obj.end()) {
      if (!t->is_string()) why[i] = "\"text\" is not a string";
      l.encode = true;
      return;
    }
    auto ids = l.obj.find("ids");
    if (ids == l.obj.end()) {
      why[i] = "no \"text\" (or \"ids\" to decode)";
      return;
    }
    bool ok = ids->is_array();
    if (ok)
      for (auto& v : *ids) ok = ok && v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() <= INT32_MAX;
    if (!ok) why[i] = "\"ids\" is not an array of non-negative integers";
    l.encode = false;
  });
  size_t errors_total = 0;
  for (size_t i = 0; i < raw.size(); ++i) {
    if (why[i].empty()) continue;
    if (++errors_total <= 20) std::cerr << fmt::format("{}:{}: {}\n", input.string(), raw[i].lineno, why[i]);
  }
  if (errors_total) {
    if (errors_total > 20) std::cerr << fmt::format("... and {} more\n", errors_total - 20);
    fail("{}: {} malformed line(s); nothing written", input.string(), errors_total);
  }

  std::vector<std::string> out(lines.size());
  parallel_for([&](size_t i) {
    Line& l = lines[i];
    if (l.encode) {
      bool add = true;
      auto a = l.obj.find("add_special_tokens");
      if (a != l.obj.end() && a->is_boolean()) add = a->get<bool>();
      l.obj["ids"] = tok->encode(l.obj["text"].get_ref<const std::string&>(), add);
    } else {
      l.obj["text"] = tok->decode(l.obj["ids"].get<std::vector<int32_t>>(), false);
    }
    out[i] = l.obj.dump(-1, ' ', false, ojson::error_handler_t::replace);
    out[i].push_back('\n');
    l.obj = ojson();
  });

  if (output.empty()) {
    for (auto& s : out) std::cout << s;
    std::cout.flush();
  } else {
    AtomicFile f(output);
    for (auto& s : out) f.write(s);
    f.commit();
  }
  return 0;
}

}  // namespace talon
