#include "data/samples.h"

#include <nlohmann/json.hpp>

#include "util/error.h"

namespace talon {

using json = nlohmann::json;

namespace {

class TokenJsonl final : public SampleSource {
 public:
  explicit TokenJsonl(const fs::path& p, std::string format = "token-jsonl")
      : path_(p.string()), format_(std::move(format)) {
    MappedFile m(p);
    sha_ = sha256_hex(m.data(), m.size());
    const char* s = reinterpret_cast<const char*>(m.data());
    const size_t n = m.size();
    size_t i = 0;
    int64_t line = 0;
    while (i < n) {
      size_t j = i;
      while (j < n && s[j] != '\n') ++j;
      ++line;
      std::string_view text(s + i, j - i);
      if (!text.empty() && text.back() == '\r') text.remove_suffix(1);
      if (text.find_first_not_of(" \t") != std::string_view::npos) parse_line(text, line);
      i = j + 1;
    }
    if (samples_.empty()) fail("{}: no samples (the file is empty)", path_);
  }

  size_t size() const override { return samples_.size(); }
  const Sample& at(size_t i) const override { return samples_.at(i); }
  std::string path() const override { return path_; }
  std::string sha256() const override { return sha_; }
  std::string format() const override { return format_; }

 private:
  void parse_line(std::string_view text, int64_t line) {
    const std::string where = path_ + ":" + std::to_string(line);
    json j = json::parse(text.begin(), text.end(), nullptr, false);
    if (j.is_discarded()) fail("{}: not valid JSON", where);
    if (!j.is_object()) fail("{}: expected a JSON object, got {}", where, j.type_name());
    Sample smp;
    smp.line = line;
    if (auto it = j.find("id"); it != j.end() && !it->is_null())
      smp.id = it->is_string() ? it->get<std::string>() : it->dump();
    else
      smp.id = "line:" + std::to_string(line);
    auto ids = j.find("input_ids");
    if (ids == j.end()) {
      const bool chat = j.contains("messages") || j.contains("conversations") || j.contains("turns") ||
                        j.contains("question") || j.contains("text") || j.contains("prompt");
      fail("{}: missing field 'input_ids'{}", where,
           chat ? " (this looks like chat data: tokenize it first with `talon prepare --model MODEL --data FILE "
                  "--out DIR`, then pass DIR)"
                : "");
    }
    if (!ids->is_array()) fail("{}: 'input_ids' must be an array of token ids, got {}", where, ids->type_name());
    if (ids->empty()) fail("{}: 'input_ids' is empty", where);
    smp.input_ids.reserve(ids->size());
    for (size_t k = 0; k < ids->size(); ++k) {
      const json& v = (*ids)[k];
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX)
        fail("{}: input_ids[{}] = {} is not a token id (expected an integer in [0, 2^31))", where, k, v.dump());
      smp.input_ids.push_back(int32_t(v.get<int64_t>()));
    }
    auto mask = j.find("loss_mask");
    if (mask == j.end()) fail("{}: missing field 'loss_mask'", where);
    if (!mask->is_array()) fail("{}: 'loss_mask' must be an array of 0/1, got {}", where, mask->type_name());
    if (mask->size() != ids->size())
      fail("{}: 'loss_mask' has {} entries but 'input_ids' has {}", where, mask->size(), ids->size());
    smp.loss_mask.reserve(mask->size());
    for (size_t k = 0; k < mask->size(); ++k) {
      const json& v = (*mask)[k];
      int64_t x = -1;
      if (v.is_boolean()) x = v.get<bool>();
      else if (v.is_number_integer()) x = v.get<int64_t>();
      if (x != 0 && x != 1) fail("{}: loss_mask[{}] = {} (expected 0 or 1)", where, k, v.dump());
      smp.loss_mask.push_back(uint8_t(x));
    }
    samples_.push_back(std::move(smp));
  }

  std::string path_, sha_, format_;
  std::vector<Sample> samples_;
};

}  // namespace

std::unique_ptr<SampleSource> open_token_jsonl(const fs::path& path) { return std::make_unique<TokenJsonl>(path); }

std::unique_ptr<SampleSource> open_samples(const fs::path& path) {
  fs::path dir;
  if (fs::is_directory(path)) dir = path;
  else if (path.filename() == "tokens.jsonl" && fs::exists(path.parent_path() / "manifest.json")) dir = path.parent_path();
  if (dir.empty()) return open_token_jsonl(path);
  const fs::path mpath = dir / "manifest.json";
  TALON_CHECK(fs::exists(mpath), "{}: not a prepared dataset (no manifest.json)", dir.string());
  json m = json::parse(read_text_file(mpath), nullptr, false);
  TALON_CHECK(!m.is_discarded() && m.is_object(), "{}: not valid JSON", mpath.string());
  // Field types are checked here: json::value() with a default of another type would throw.
  const json format = m.contains("format") ? m["format"] : json();
  TALON_CHECK(format == json("talon.tokens"), "{}: field 'format' is {}, expected \"talon.tokens\"", mpath.string(),
              format.dump());
  const json version = m.contains("format_version") ? m["format_version"] : json();
  TALON_CHECK(version == json(1), "{}: format_version {} is not supported (this talon reads 1)", mpath.string(),
              version.dump());
  auto tf = m.find("tokens_file");
  auto ts = m.find("tokens_sha256");
  TALON_CHECK(tf == m.end() || tf->is_string(), "{}: field 'tokens_file' must be a file name", mpath.string());
  TALON_CHECK(ts != m.end() && ts->is_string(), "{}: field 'tokens_sha256' must be a SHA-256 string", mpath.string());
  const fs::path tpath =
      path_inside(dir, tf == m.end() ? std::string("tokens.jsonl") : tf->get<std::string>(), mpath.string() + ": tokens_file");
  auto src = std::make_unique<TokenJsonl>(tpath, "talon.tokens");
  const std::string want = ts->get<std::string>();
  TALON_CHECK(src->sha256() == want, "{}: sha256 {} does not match manifest.json's tokens_sha256 {} (modified or "
              "partially written)", tpath.string(), src->sha256(), want);
  return src;
}

}  // namespace talon
