// tiktoken BPE files (Meta's Llama-3 tokenizer.model): ids must equal Hugging Face `tokenizers`
// with Meta's Llama-3 tokenizer.json. Expected values come from tools/make_tiktoken_fixtures.py
// (tests/fixtures/tokenizers/tiktoken_llama3_cases.json).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "test_util.h"
#include "text/tokenizer.h"
#include "util/error.h"

using talon::text::Tokenizer;
namespace fs = std::filesystem;

namespace {

using talon::testing::error_of;

std::string llama3_model() {
  return talon::testing::source_dir() + "/../shared/data/tokenizers/files/llama3_tiktoken/tokenizer.model";
}

fs::path write_temp(const std::string& name, const std::string& content) {
  fs::path d = fs::temp_directory_path() / ("talon_tiktoken_" + std::to_string(::getpid()));
  fs::create_directories(d);
  fs::path p = d / name;
  std::ofstream(p, std::ios::binary) << content;
  return p;
}

}  // namespace

TEST(Tiktoken, Llama3MatchesHuggingFace) {
  if (!fs::exists(llama3_model())) GTEST_SKIP() << llama3_model() << " not present";
  auto tok = Tokenizer::load(llama3_model());
  EXPECT_EQ(tok->kind(), "bpe-bytelevel");
  EXPECT_EQ(tok->vocab_size(), 128256u);
  EXPECT_EQ(tok->bos_id(), 128000);
  EXPECT_EQ(tok->token_to_id("<|begin_of_text|>"), 128000);
  EXPECT_EQ(tok->token_to_id("<|end_of_text|>"), 128001);
  EXPECT_EQ(tok->token_to_id("<|start_header_id|>"), 128006);
  EXPECT_EQ(tok->token_to_id("<|end_header_id|>"), 128007);
  EXPECT_EQ(tok->token_to_id("<|eot_id|>"), 128009);
  EXPECT_EQ(tok->token_to_id("<|reserved_special_token_250|>"), 128255);
  std::ifstream f(talon::testing::source_dir() + "/tests/fixtures/tokenizers/tiktoken_llama3_cases.json");
  auto rows = nlohmann::json::parse(f);
  ASSERT_GT(rows.size(), 50u);
  for (const auto& r : rows) {
    std::string text = r["text"];
    bool add = r["add_special_tokens"];
    auto ids = tok->encode(text, add);
    EXPECT_EQ(ids, r["ids"].get<std::vector<int32_t>>()) << "text=" << text << " add=" << add;
    EXPECT_EQ(tok->decode(ids, false), r["decoded"].get<std::string>()) << "text=" << text;
    EXPECT_EQ(tok->decode(ids, true), r["decoded_skip"].get<std::string>()) << "text=" << text;
  }
}

TEST(Tiktoken, SmallFileByContent) {
  // Not Llama-3 (cl100k pattern, no special tokens). "ab" has rank 2 and "abc" rank 3, so
  // "abc" -> one token; "cab" -> c + ab.
  std::string body = "YQ== 0\nYg== 1\nYWI= 2\nYWJj 3\nYw== 4\nIA== 5\n";
  auto tok = Tokenizer::load(write_temp("tokenizer.model", body));
  EXPECT_EQ(tok->encode("abc", true), (std::vector<int32_t>{3}));
  EXPECT_EQ(tok->encode("cab", true), (std::vector<int32_t>{4, 2}));
  EXPECT_EQ(tok->encode("ab c", false), (std::vector<int32_t>{2, 5, 4}));
  EXPECT_EQ(tok->decode({4, 2}, false), "cab");
  EXPECT_FALSE(tok->bos_id().has_value());
}

TEST(Tiktoken, MalformedLineNamesFileAndLine) {
  auto p = write_temp("bad_b64.tiktoken", "YQ== 0\nYg== 1\nY!== 2\n");
  std::string e = error_of([&] { Tokenizer::load(p); });
  EXPECT_NE(e.find(p.string() + ":3:"), std::string::npos) << e;
  p = write_temp("bad_rank.tiktoken", "YQ== 0\nYg== x1\n");
  e = error_of([&] { Tokenizer::load(p); });
  EXPECT_NE(e.find(p.string() + ":2:"), std::string::npos) << e;
  p = write_temp("bad_shape.tiktoken", "YQ== 0\nYg==1\n");
  e = error_of([&] { Tokenizer::load(p); });
  EXPECT_NE(e.find(p.string() + ":2:"), std::string::npos) << e;
  p = write_temp("dup.tiktoken", "YQ== 0\nYQ== 1\n");
  e = error_of([&] { Tokenizer::load(p); });
  EXPECT_NE(e.find(p.string() + ":2:"), std::string::npos) << e;
}
