// Tokenizer unit tests. Expected ids/decodes come from HF `tokenizers` via
// tools/make_tokenizer_fixtures.py (committed in tests/fixtures/tokenizers/).
#include <gtest/gtest.h>

#include <atomic>
#include <fstream>
#include <functional>
#include <thread>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include "test_util.h"
#include "text/tokenizer.h"
#include "text/unicode.h"
#include "util/error.h"

using talon::text::Tokenizer;

namespace {

using talon::testing::error_of;

std::string tokenizer_fixture(const std::string& name) {
  return talon::testing::source_dir() + "/tests/fixtures/tokenizers/" + name;
}

nlohmann::json load_json(const std::string& path) {
  std::ifstream f(path);
  return nlohmann::json::parse(f);
}

std::string from_hex(const std::string& h) {
  std::string r;
  for (size_t i = 0; i + 1 < h.size(); i += 2) r.push_back(char(std::stoi(h.substr(i, 2), nullptr, 16)));
  return r;
}

}  // namespace

class TokenizerFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenizerFixture, MatchesHuggingFace) {
  auto cases = load_json(tokenizer_fixture("cases.json"));
  auto tok = Tokenizer::load(tokenizer_fixture(GetParam()));
  const auto& rows = cases.at(GetParam());
  ASSERT_GT(rows.size(), 10u);
  for (const auto& r : rows) {
    std::string text = r["text"];
    bool add = r["add_special_tokens"];
    auto ids = tok->encode(text, add);
    EXPECT_EQ(ids, r["ids"].get<std::vector<int32_t>>()) << GetParam() << " text=" << text << " add=" << add;
    EXPECT_EQ(tok->decode(ids, false), r["decoded"].get<std::string>()) << GetParam() << " text=" << text;
    EXPECT_EQ(tok->decode(ids, true), r["decoded_skip"].get<std::string>()) << GetParam() << " text=" << text;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TokenizerFixture,
                         ::testing::Values("bytelevel_tiny.json", "spm_tiny.json", "spm_legacy_tiny.json"));

TEST(Tokenizer, VocabularyAccessors) {
  auto tok = Tokenizer::load(tokenizer_fixture("bytelevel_tiny.json"));
  auto end = tok->token_to_id("<|end|>");
  ASSERT_TRUE(end.has_value());
  EXPECT_EQ(tok->id_to_token(*end).value(), "<|end|>");
  EXPECT_EQ(tok->kind(), "bpe-bytelevel");
  EXPECT_GT(tok->vocab_size(), size_t(*end));
  EXPECT_FALSE(tok->token_to_id("definitely not a token").has_value());
  EXPECT_FALSE(tok->id_to_token(1 << 30).has_value());
  auto sp = Tokenizer::load(tokenizer_fixture("spm_tiny.json"));
  EXPECT_EQ(sp->kind(), "bpe-sentencepiece");
  EXPECT_EQ(sp->bos_id(), sp->token_to_id("<s>"));  // from the TemplateProcessing post-processor
}

TEST(Tokenizer, InvalidUtf8IsReplacedNotFatal) {
  // Documented behaviour: each maximal invalid subsequence becomes U+FFFD, then HF semantics.
  auto lossy = load_json(tokenizer_fixture("lossy.json"));
  for (const char* name : {"bytelevel_tiny.json", "spm_tiny.json"}) {
    auto tok = Tokenizer::load(tokenizer_fixture(name));
    for (const auto& c : lossy) {
      std::string raw = from_hex(c["hex"]);
      std::string repaired = c["text"];
      EXPECT_EQ(talon::text::utf8_lossy(raw), repaired) << c["hex"];
      EXPECT_EQ(tok->encode(raw, false), tok->encode(repaired, false)) << name << " " << c["hex"];
    }
    // Random bytes never crash.
    std::string junk;
    uint32_t s = 12345;
    for (int i = 0; i < 4096; ++i) {
      s = s * 1103515245u + 12345u;
      junk.push_back(char(s >> 16));
    }
    auto ids = tok->encode(junk, true);
    EXPECT_FALSE(ids.empty());
    EXPECT_TRUE(talon::text::utf8_is_valid(tok->decode(ids, false)));
  }
}

TEST(Tokenizer, MalformedJsonNamesFileAndField) {
  auto err = [](const std::string& json) {
    return error_of([&] { Tokenizer::from_json_text(json, "bad/tokenizer.json"); });
  };
  EXPECT_NE(err("{").find("bad/tokenizer.json: not valid JSON"), std::string::npos);
  EXPECT_NE(err("[]").find("bad/tokenizer.json"), std::string::npos);
  EXPECT_NE(err(R"({"x": 1})").find("field model: missing"), std::string::npos);
  EXPECT_NE(err(R"({"model": {"type": "BPE", "merges": []}})").find("model.vocab"), std::string::npos);
  EXPECT_NE(err(R"({"model": {"type": "WordPiece", "vocab": {}}})").find("model.type"), std::string::npos);
  EXPECT_NE(err(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}})").find("model.merges[0]"),
            std::string::npos);
  EXPECT_NE(err(R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": ["a b"]}})")
                .find("merged token \"ab\""),
            std::string::npos);
  EXPECT_NE(err(R"({"model": {"type": "BPE", "vocab": {"a": "x"}, "merges": []}})").find("model.vocab"),
            std::string::npos);
  EXPECT_NE(err(R"({"model": {"type": "BPE", "vocab": {}, "merges": [1]}})").find("model.merges[0]"),
            std::string::npos);
  const char* base = R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, )";
  EXPECT_NE(err(std::string(base) + R"("pre_tokenizer": {"type": "Split", "pattern": {"Regex": "("}, "behavior": "Isolated"}})")
                .find("pre_tokenizer.pattern"),
            std::string::npos);
  EXPECT_NE(err(std::string(base) + R"("pre_tokenizer": {"type": "Whatever"}})").find("pre_tokenizer.type"),
            std::string::npos);
  EXPECT_NE(err(std::string(base) + R"("normalizer": {"type": "Sequence", "normalizers": [{"type": "Nope"}]}})")
                .find("normalizer.normalizers[0].type"),
            std::string::npos);
  EXPECT_NE(err(std::string(base) + R"("added_tokens": [{"id": 5}]})").find("added_tokens[0].content"),
            std::string::npos);
  EXPECT_NE(err(std::string(base) + R"("decoder": {"type": "Strip", "content": " ", "start": -1, "stop": 0}})")
                .find("decoder"),
            std::string::npos);
}

TEST(Tokenizer, BadFilesNameThePath) {
  auto dir = std::filesystem::temp_directory_path() / ("talon-tok-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto write = [&](const std::string& name, const std::string& bytes) {
    std::ofstream(dir / name, std::ios::binary) << bytes;
    return dir / name;
  };
  auto trunc = write("trunc.model", std::string("\x0a\xff\x01", 3));
  EXPECT_NE(error_of([&] { Tokenizer::load(trunc); }).find(trunc.string()), std::string::npos);
  auto junk = write("junk.bin", "hello");
  EXPECT_NE(error_of([&] { Tokenizer::load(junk); }).find("not a tokenizer.json, GGUF or SentencePiece model"),
            std::string::npos);
  EXPECT_NE(error_of([&] { Tokenizer::load(dir / "missing.json"); }).find("missing.json"), std::string::npos);
  EXPECT_NE(error_of([&] { Tokenizer::load(dir); }).find("no tokenizer.json or tokenizer.model"), std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST(Tokenizer, ThreadSafeEncode) {
  auto tok = Tokenizer::load(tokenizer_fixture("bytelevel_tiny.json"));
  std::string text = "The quick brown fox 東京 😀 jumps <|end|> 12345 ";
  auto expect = tok->encode(text, true);
  std::vector<std::thread> ts;
  std::atomic<int> bad{0};
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([&] {
      for (int i = 0; i < 200; ++i)
        if (tok->encode(text, true) != expect) ++bad;
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(bad.load(), 0);
}
