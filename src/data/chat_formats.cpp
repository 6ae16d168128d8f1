#include "data/chat_formats.h"

#include <csv.h>

#include <cctype>
#include <fstream>

#include "text/unicode.h"

namespace talon {

namespace {

const std::pair<ChatFormat, const char*> kNames[] = {
    {ChatFormat::Auto, "auto"},        {ChatFormat::ShareGPT, "sharegpt"},         {ChatFormat::OpenAI, "openai"},
    {ChatFormat::MTBench101, "mtbench101"}, {ChatFormat::UltraChat, "ultrachat"}, {ChatFormat::GSM8K, "gsm8k"},
    {ChatFormat::SelfInstruct, "self-instruct"}, {ChatFormat::Alpaca, "alpaca"}, {ChatFormat::Questions, "questions"}};

[[noreturn]] void bad(const std::string& msg) { throw RecordError("bad_record", msg); }

std::string keys_of(const ojson& j) {
  std::string s;
  for (auto it = j.begin(); it != j.end(); ++it) s += (s.empty() ? "" : ", ") + it.key();
  return s.empty() ? "none" : s;
}

const std::string& str_field(const ojson& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end()) bad(fmt::format("{}missing field '{}'", where, key));
  if (!it->is_string()) bad(fmt::format("{}field '{}' must be a string, got {}", where, key, it->type_name()));
  return it->get_ref<const std::string&>();
}

const ojson& array_field(const ojson& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end()) bad(fmt::format("{}missing field '{}'", where, key));
  if (!it->is_array()) bad(fmt::format("{}field '{}' must be an array, got {}", where, key, it->type_name()));
  return *it;
}

ojson msg(const char* role, const std::string& content) { return ojson{{"role", role}, {"content", content}}; }

std::string record_id(const ojson& r) {
  for (const char* k : {"id", "question_id", "task_id", "idx"}) {
    auto it = r.find(k);
    if (it != r.end() && !it->is_null()) return it->is_string() ? it->get<std::string>() : it->dump();
  }
  return "";
}

bool has(const ojson& r, const char* k) { return r.contains(k) && !r[k].is_null(); }

}  // namespace

const char* chat_format_name(ChatFormat f) {
  for (auto& [k, n] : kNames)
    if (k == f) return n;
  return "?";
}

ChatFormat parse_chat_format(const std::string& name) {
  std::string all;
  for (auto& [k, n] : kNames) {
    if (name == n) return k;
    all += (all.empty() ? "" : ", ") + std::string(n);
  }
  fail("--format '{}': expected one of {}", name, all);
}

ChatFormat detect_chat_format(const ojson& r) {
  if (!r.is_object()) throw RecordError("unrecognised_record", fmt::format("expected a JSON object, got {}", r.type_name()));
  if (has(r, "conversations")) return ChatFormat::ShareGPT;
  if (has(r, "messages")) return ChatFormat::OpenAI;
  if (has(r, "history")) return ChatFormat::MTBench101;
  if (has(r, "data")) return r["data"].is_array() ? ChatFormat::UltraChat : ChatFormat::Questions;
  if (has(r, "question") && has(r, "answer")) return ChatFormat::GSM8K;
  if (has(r, "instruction") && has(r, "instances")) return ChatFormat::SelfInstruct;
  if (has(r, "instruction") && has(r, "output")) return ChatFormat::Alpaca;
  if (has(r, "turns") || has(r, "question") || has(r, "prompt") || has(r, "instruction")) return ChatFormat::Questions;
  throw RecordError("unrecognised_record",
                    fmt::format("no known chat record shape (keys: {}); expected conversations, messages, history, "
                                "data, question+answer, instruction+instances, instruction+output, turns or prompt",
                                keys_of(r)));
}

std::vector<Conversation> record_to_conversations(const ojson& r, ChatFormat format) {
  if (!r.is_object()) throw RecordError("bad_record", fmt::format("expected a JSON object, got {}", r.type_name()));
  if (format == ChatFormat::Auto) format = detect_chat_format(r);
  std::vector<Conversation> out;
  Conversation c;
  c.id = record_id(r);
  switch (format) {
    case ChatFormat::ShareGPT: {
      const ojson& conv = array_field(r, "conversations", "");
      // SpecForge's layout: "conversations" holding OpenAI-style {role, content} turns.
      if (!conv.empty() && conv[0].is_object() && conv[0].contains("role") && !conv[0].contains("from")) {
        ojson as_messages = r;
        as_messages["messages"] = conv;
        as_messages.erase("conversations");
        return record_to_conversations(as_messages, ChatFormat::OpenAI);  // errors name messages[i]
      }
      for (size_t i = 0; i < conv.size(); ++i) {
        const std::string where = fmt::format("conversations[{}]: ", i);
        if (!conv[i].is_object()) bad(where + "expected an object {from, value}");
        const std::string& from = str_field(conv[i], "from", where);
        const std::string& value = str_field(conv[i], "value", where);
        const char* role = nullptr;
        if (from == "human" || from == "user") role = "user";
        else if (from == "gpt" || from == "assistant" || from == "chatgpt" || from == "bard" || from == "bing" ||
                 from == "model")
          role = "assistant";
        else if (from == "system") role = "system";
        else if (from == "tool" || from == "function" || from == "observation") role = "tool";
        else
          throw RecordError("unknown_role", fmt::format("{}unknown speaker '{}' (expected human, user, gpt, "
                                                        "assistant, system or tool)", where, from));
        c.messages.push_back(msg(role, value));
      }
      break;
    }
    case ChatFormat::OpenAI: {
      const ojson& ms = array_field(r, "messages", "");
      for (size_t i = 0; i < ms.size(); ++i) {
        const std::string where = fmt::format("messages[{}]: ", i);
        if (!ms[i].is_object()) bad(where + "expected an object {role, content}");
        ojson m = ms[i];
        const std::string& role = str_field(m, "role", where);
        if (role != "user" && role != "assistant" && role != "system" && role != "tool" && role != "developer")
          throw RecordError("unknown_role", fmt::format("{}unknown role '{}'", where, role));
        auto ct = m.find("content");
        if (ct != m.end() && ct->is_array()) {
          std::string joined;
          for (auto& part : *ct) {
            if (!part.is_object() || part.value("type", std::string()) != "text" || !part.contains("text") ||
                !part["text"].is_string())
              bad(where + "content parts must be {\"type\": \"text\", \"text\": str}");
            joined += part["text"].get<std::string>();
          }
          *ct = joined;
        } else if (ct != m.end() && !ct->is_string() && !ct->is_null()) {
          bad(fmt::format("{}field 'content' must be a string, got {}", where, ct->type_name()));
        } else if (ct == m.end() && role != "assistant") {
          bad(where + "missing field 'content'");
        }
        c.messages.push_back(std::move(m));
      }
      break;
    }
    case ChatFormat::MTBench101: {
      const ojson& h = array_field(r, "history", "");
      for (size_t i = 0; i < h.size(); ++i) {
        const std::string where = fmt::format("history[{}]: ", i);
        if (!h[i].is_object()) bad(where + "expected an object {user, bot}");
        c.messages.push_back(msg("user", str_field(h[i], "user", where)));
        c.messages.push_back(msg("assistant", str_field(h[i], "bot", where)));
      }
      break;
    }
    case ChatFormat::UltraChat: {
      const ojson& d = array_field(r, "data", "");
      for (size_t i = 0; i < d.size(); ++i) {
        if (!d[i].is_string()) bad(fmt::format("data[{}]: must be a string, got {}", i, d[i].type_name()));
        c.messages.push_back(msg(i % 2 == 0 ? "user" : "assistant", d[i].get<std::string>()));
      }
      break;
    }
    case ChatFormat::GSM8K:
      c.messages.push_back(msg("user", str_field(r, "question", "")));
      c.messages.push_back(msg("assistant", str_field(r, "answer", "")));
      break;
    case ChatFormat::SelfInstruct: {
      const std::string& ins = str_field(r, "instruction", "");
      const ojson& inst = array_field(r, "instances", "");
      if (inst.empty()) bad("'instances' is empty");
      for (size_t i = 0; i < inst.size(); ++i) {
        const std::string where = fmt::format("instances[{}]: ", i);
        if (!inst[i].is_object()) bad(where + "expected an object {input, output}");
        std::string input = inst[i].contains("input") ? str_field(inst[i], "input", where) : std::string();
        Conversation k;
        k.id = inst.size() == 1 ? c.id : fmt::format("{}#{}", c.id, i);
        k.messages.push_back(msg("user", input.empty() ? ins : ins + "\n\n" + input));
        k.messages.push_back(msg("assistant", str_field(inst[i], "output", where)));
        out.push_back(std::move(k));
      }
      return out;
    }
    case ChatFormat::Alpaca: {
      const std::string& ins = str_field(r, "instruction", "");
      std::string input = has(r, "input") ? str_field(r, "input", "") : std::string();
      c.messages.push_back(msg("user", input.empty() ? ins : ins + "\n\n" + input));
      c.messages.push_back(msg("assistant", str_field(r, "output", "")));
      break;
    }
    case ChatFormat::Questions: {
      std::vector<std::string> turns;
      if (has(r, "turns")) {
        const ojson& t = array_field(r, "turns", "");
        for (size_t i = 0; i < t.size(); ++i) {
          if (!t[i].is_string()) bad(fmt::format("turns[{}]: must be a string, got {}", i, t[i].type_name()));
          turns.push_back(t[i].get<std::string>());
        }
      } else if (has(r, "question")) {
        turns.push_back(str_field(r, "question", ""));
      } else if (has(r, "prompt")) {
        turns.push_back(str_field(r, "prompt", ""));
      } else if (has(r, "instruction")) {
        std::string ins = str_field(r, "instruction", "");
        std::string input = has(r, "input") ? str_field(r, "input", "") : std::string();
        turns.push_back(input.empty() ? ins : ins + "\n\n" + input);
      } else if (has(r, "data")) {
        turns.push_back(str_field(r, "data", ""));
      } else {
        bad(fmt::format("no question field (turns, question, prompt, instruction or data; keys: {})", keys_of(r)));
      }
      if (turns.empty()) bad("'turns' is empty");
      c.prompt_only = true;
      c.messages.push_back(msg("user", turns[0]));
      c.later_turns.assign(turns.begin() + 1, turns.end());
      break;
    }
    case ChatFormat::Auto:
      break;
  }
  out.push_back(std::move(c));
  return out;
}

ojson parse_record(std::string_view text) {
  if (!text::utf8_is_valid(text)) {
    size_t i = 0;
    while (i < text.size()) {
      size_t n = text::utf8_valid_len(text, i);
      if (n == 0) break;
      i += n;
    }
    throw RecordError("invalid_utf8", fmt::format("invalid UTF-8 at byte {} of the record", i));
  }
  ojson j = ojson::parse(text.begin(), text.end(), nullptr, false);
  if (j.is_discarded()) {
    // Re-parse for the message (rare path).
    try {
      ojson again = ojson::parse(text.begin(), text.end());
      (void)again;
    } catch (const ojson::exception& e) {
      std::string w = e.what();
      if (auto p = w.find("] "); p != std::string::npos) w = w.substr(p + 2);
      throw RecordError("invalid_json", "not valid JSON: " + w);
    }
    throw RecordError("invalid_json", "not valid JSON");
  }
  return j;
}

// ---------------------------------------------------------------------------------------------

namespace {

// CSV / TSV chat data, read with libcsv: a header row of column names, then one record per row
// (an object of column -> cell). A cell holding a JSON array or object (a `conversations` or
// `messages` column, as pandas' to_csv writes them after json.dumps) becomes that value, so
// the record's layout is detected as for JSON input; other cells stay strings; empty cells
// are left out of the record.
struct CsvRows {
  std::vector<std::vector<std::string>> rows;
  std::vector<std::string> cur;
};
void csv_on_field(void* s, size_t n, void* data) {
  static_cast<CsvRows*>(data)->cur.emplace_back(s ? static_cast<const char*>(s) : "", s ? n : 0);
}
void csv_on_row(int, void* data) {
  auto* r = static_cast<CsvRows*>(data);
  r->rows.push_back(std::move(r->cur));
  r->cur.clear();
}

std::vector<RecordReader::Item> read_csv_records(const fs::path& path, char delim) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open (no such file or not readable)", path.string());
  struct csv_parser p;
  if (csv_init(&p, CSV_STRICT | CSV_STRICT_FINI) != 0) fail("{}: cannot start the CSV parser", path.string());
  csv_set_delim(&p, static_cast<unsigned char>(delim));
  csv_set_space_func(&p, [](unsigned char) { return 0; });  // cells keep their spaces and tabs
  CsvRows rows;
  std::vector<char> buf(size_t(1) << 20);
  std::string err;
  while (err.empty() && in) {
    in.read(buf.data(), std::streamsize(buf.size()));
    const size_t n = size_t(in.gcount());
    if (n == 0) break;
    if (csv_parse(&p, buf.data(), n, csv_on_field, csv_on_row, &rows) != n)
      err = csv_strerror(csv_error(&p));
  }
  if (err.empty() && csv_fini(&p, csv_on_field, csv_on_row, &rows) != 0) err = csv_strerror(csv_error(&p));
  csv_free(&p);
  const char* kind = delim == '\t' ? "TSV" : "CSV";
  if (!err.empty())
    throw RecordError("invalid_csv", fmt::format("{}: malformed {} after row {} (libcsv: {}; an unclosed quote?)",
                                                 path.string(), kind, rows.rows.size(), err));
  if (rows.rows.empty()) fail("{}: empty {} file (expected a header row of column names)", path.string(), kind);
  const std::vector<std::string>& header = rows.rows[0];
  for (size_t c = 0; c < header.size(); ++c) {
    if (header[c].empty()) fail("{}: column {} of the header row has no name", path.string(), c + 1);
    for (size_t d = 0; d < c; ++d)
      if (header[d] == header[c]) fail("{}: the header row names column '{}' twice", path.string(), header[c]);
  }
  std::vector<RecordReader::Item> items;
  for (size_t r = 1; r < rows.rows.size(); ++r) {
    const auto& row = rows.rows[r];
    if (row.size() == 1 && row[0].empty()) continue;  // a blank line
    if (row.size() != header.size())
      throw RecordError("invalid_csv", fmt::format("{}: row {} has {} fields, the header row has {}", path.string(),
                                                   r + 1, row.size(), header.size()));
    ojson obj = ojson::object();
    for (size_t c = 0; c < row.size(); ++c) {
      const std::string& cell = row[c];
      if (cell.empty()) continue;  // an empty cell is a missing field (pandas writes NaN so)
      const size_t k = cell.find_first_not_of(" \t\r\n");
      if (k != std::string::npos && (cell[k] == '[' || cell[k] == '{')) {
        ojson v = ojson::parse(cell, nullptr, /*allow_exceptions=*/false);
        if (!v.is_discarded()) {
          obj[header[c]] = std::move(v);
          continue;
        }
      }
      obj[header[c]] = cell;
    }
    RecordReader::Item it;
    it.line = int64_t(r + 1);
    try {
      it.text = obj.dump();
    } catch (const ojson::exception&) {
      throw RecordError("invalid_utf8", fmt::format("{}: row {} is not valid UTF-8", path.string(), r + 1));
    }
    items.push_back(std::move(it));
  }
  return items;
}

}  // namespace

struct RecordReader::Impl {
  std::vector<RecordReader::Item> csv;  // CSV / TSV: every record, read up front
  size_t csv_next = 0;
  bool is_csv = false;
  fs::path path;
  std::ifstream in;  // JSONL
  int64_t line = 0;
  MappedFile map;    // arrays
  size_t pos = 0;
  int64_t map_line = 1;
  bool done = false;

  // Scans the next top-level array element of the mapped file: [b, e) and its first line.
  bool next_element(size_t& b, size_t& e, int64_t& at_line) {
    const char* s = reinterpret_cast<const char*>(map.data());
    const size_t n = map.size();
    auto skip_ws = [&] {
      while (pos < n && (s[pos] == ' ' || s[pos] == '\t' || s[pos] == '\r' || s[pos] == '\n')) {
        if (s[pos] == '\n') ++map_line;
        ++pos;
      }
    };
    if (done) return false;
    skip_ws();
    if (pos >= n) throw RecordError("invalid_json", fmt::format("line {}: the JSON array is not closed", map_line));
    if (s[pos] == ']') {
      ++pos;
      skip_ws();
      if (pos < n) throw RecordError("invalid_json", fmt::format("line {}: data after the JSON array", map_line));
      done = true;
      return false;
    }
    b = pos;
    at_line = map_line;
    int depth = 0;
    bool in_str = false;
    for (; pos < n; ++pos) {
      char c = s[pos];
      if (c == '\n') ++map_line;
      if (in_str) {
        if (c == '\\') {
          ++pos;
          if (pos < n && s[pos] == '\n') ++map_line;
        } else if (c == '"') {
          in_str = false;
        }
        continue;
      }
      if (c == '"') in_str = true;
      else if (c == '{' || c == '[') ++depth;
      else if (c == '}' || c == ']') {
        if (depth == 0) {
          if (c == '}')  // would end no element and advance nothing
            throw RecordError("invalid_json", fmt::format("line {}: unexpected '}}' in the JSON array", map_line));
          break;  // the array's closing bracket
        }
        --depth;
      } else if (c == ',' && depth == 0) {
        break;
      }
    }
    if (pos >= n) throw RecordError("invalid_json", fmt::format("line {}: the JSON array is not closed", at_line));
    e = pos;
    while (e > b && (s[e - 1] == ' ' || s[e - 1] == '\t' || s[e - 1] == '\r' || s[e - 1] == '\n')) --e;
    if (e == b) throw RecordError("invalid_json", fmt::format("line {}: empty element in the JSON array", at_line));
    if (s[pos] == ',') ++pos;
    return true;
  }
};

namespace {
// First non-whitespace byte of the file ('\0' if none).
char first_byte(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) fail("{}: cannot open (no such file or not readable)", p.string());
  char c;
  while (f.get(c))
    if (!(c == ' ' || c == '\t' || c == '\r' || c == '\n')) return c;
  return '\0';
}
}  // namespace

std::string lower_extension(const fs::path& path) {
  std::string ext = path.extension().string();
  for (char& ch : ext) ch = char(std::tolower(static_cast<unsigned char>(ch)));
  return ext;
}

RecordReader::RecordReader(const fs::path& path) : impl_(std::make_unique<Impl>()) {
  impl_->path = path;
  {
    // Tabular files are refused by name, with the conversion that makes them readable.
    const std::string ext = lower_extension(path);
    char magic[4] = {0, 0, 0, 0};
    if (std::ifstream f{path, std::ios::binary}) f.read(magic, 4);
    const bool parquet = ext == ".parquet" || std::string_view(magic, 4) == "PAR1";
    if (ext == ".pt" || ext == ".pth" || std::string_view(magic, 4) == std::string_view("PK\x03\x04", 4))
      fail("{}: a PyTorch (torch.save) or zip file, such as speculators' or SpecForge's saved hidden states, is not "
           "read; talon makes its own features: give it the chat records (JSON Lines) and run talon prepare, then "
           "talon extract",
           path.string());
    if (!parquet && (ext == ".csv" || ext == ".tsv")) {
      impl_->csv = read_csv_records(path, ext == ".tsv" ? '\t' : ',');
      impl_->is_csv = true;
      return;
    }
    if (parquet || ext == ".arrow" || ext == ".xlsx") {
      const std::string f = path.string();
      const std::string read = parquet         ? fmt::format("pd.read_parquet('{}')", f)
                               : ext == ".arrow" ? fmt::format("pd.read_feather('{}')", f)
                                                 : fmt::format("pd.read_excel('{}')", f);
      fail("{}: {} files are not read; talon reads JSON Lines, a JSON array or CSV of chat records. Convert it with: "
           "python3 -c \"import pandas as pd; {}.to_json('{}.jsonl', orient='records', lines=True, "
           "force_ascii=False)\" (a Hugging Face dataset: ds.to_json('out.jsonl'))",
           f, parquet ? std::string("Parquet") : ext.substr(1), read, path.stem().string());
    }
  }
  array_ = first_byte(path) == '[';
  if (array_) {
    impl_->map = MappedFile(path);
    const char* s = reinterpret_cast<const char*>(impl_->map.data());
    while (s[impl_->pos] != '[') {
      if (s[impl_->pos] == '\n') ++impl_->map_line;
      ++impl_->pos;
    }
    ++impl_->pos;
  } else {
    impl_->in.open(path, std::ios::binary);
    if (!impl_->in) fail("{}: cannot open (no such file or not readable)", path.string());
  }
}

RecordReader::~RecordReader() = default;

bool RecordReader::next(Item& out) {
  if (impl_->is_csv) {
    if (impl_->csv_next >= impl_->csv.size()) return false;
    out = impl_->csv[impl_->csv_next++];
    return true;
  }
  if (array_) {
    size_t b = 0, e = 0;
    if (!impl_->next_element(b, e, out.line)) return false;
    out.text.assign(reinterpret_cast<const char*>(impl_->map.data()) + b, e - b);
    return true;
  }
  while (std::getline(impl_->in, out.text)) {
    ++impl_->line;
    if (!out.text.empty() && out.text.back() == '\r') out.text.pop_back();
    if (out.text.find_first_not_of(" \t") == std::string::npos) continue;
    out.line = impl_->line;
    return true;
  }
  return false;
}

int64_t RecordReader::count(const fs::path& path) {
  RecordReader r(path);
  if (r.impl_->is_csv) return int64_t(r.impl_->csv.size());
  if (r.array_) {
    int64_t n = 0;
    size_t b, e;
    int64_t l;
    try {
      while (r.impl_->next_element(b, e, l)) ++n;
    } catch (const RecordError&) {
    }
    return n;
  }
  int64_t n = 0;
  std::string line;
  while (std::getline(r.impl_->in, line))
    if (line.find_first_not_of(" \t\r") != std::string::npos) ++n;
  return n;
}

}  // namespace talon
