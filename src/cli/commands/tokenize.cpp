#include "cli/commands/tokenize.h"

#include <atomic>
#include <mutex>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#include "text/tokenizer.h"
#include "util/error.h"

namespace talon {

namespace {
using ojson = nlohmann::ordered_json;

struct Line {
  size_t lineno;
  ojson obj;
  bool encode;
};
}  // namespace

int run_tokenize(const fs::path& tokenizer_path, const fs::path& input, const fs::path& output, int threads) {
  auto tok = text::Tokenizer::load(tokenizer_path);
  std::string data = read_text_file(input);
  std::vector<Line> lines;
  std::vector<std::string> errors;
  size_t errors_total = 0;
  auto error = [&](size_t ln, const std::string& why) {
    ++errors_total;
    if (errors.size() < 20) errors.push_back(fmt::format("{}:{}: {}", input.string(), ln, why));
  };
  size_t pos = 0, lineno = 0;
  while (pos < data.size()) {
    size_t nl = data.find('\n', pos);
    if (nl == std::string::npos) nl = data.size();
    std::string_view s(data.data() + pos, nl - pos);
    pos = nl + 1;
    ++lineno;
    if (!s.empty() && s.back() == '\r') s.remove_suffix(1);
    if (s.find_first_not_of(" \t") == std::string_view::npos) continue;
    ojson obj;
    try {
      obj = ojson::parse(s.begin(), s.end());
    } catch (const ojson::exception& e) {
      error(lineno, fmt::format("not valid JSON: {}", e.what()));
      continue;
    }
    if (!obj.is_object()) {
      error(lineno, "expected a JSON object");
      continue;
    }
    auto t = obj.find("text");
    if (t != obj.end()) {
      if (!t->is_string()) {
        error(lineno, "\"text\" is not a string");
        continue;
      }
      lines.push_back({lineno, std::move(obj), true});
      continue;
    }
    auto ids = obj.find("ids");
    if (ids == obj.end()) {
      error(lineno, "no \"text\" (or \"ids\" to decode)");
      continue;
    }
    bool ok = ids->is_array();
    if (ok)
      for (auto& v : *ids) ok = ok && v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() <= INT32_MAX;
    if (!ok) {
      error(lineno, "\"ids\" is not an array of non-negative integers");
      continue;
    }
    lines.push_back({lineno, std::move(obj), false});
  }
  if (errors_total) {
    for (auto& e : errors) std::cerr << e << "\n";
    if (errors_total > errors.size()) std::cerr << fmt::format("... and {} more\n", errors_total - errors.size());
    fail("{}: {} malformed line(s); nothing written", input.string(), errors_total);
  }

  int nt = threads > 0 ? threads : int(std::max(1u, std::thread::hardware_concurrency()));
  nt = int(std::min<size_t>(size_t(nt), std::max<size_t>(1, lines.size())));
  std::vector<std::string> out(lines.size());
  std::atomic<size_t> next{0};
  std::exception_ptr err;
  std::mutex err_mu;
  auto work = [&] {
    try {
      while (true) {
        size_t b = next.fetch_add(64);
        if (b >= lines.size()) break;
        size_t e = std::min(lines.size(), b + 64);
        for (size_t i = b; i < e; ++i) {
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
        }
      }
    } catch (...) {
      std::lock_guard<std::mutex> g(err_mu);
      if (!err) err = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < nt; ++i) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (err) std::rethrow_exception(err);

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
