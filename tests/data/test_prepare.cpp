// Unit pieces of `talon prepare`: record formats, readers, span -> token mapping, turn location.
// End-to-end parity with transformers is in tests/cli/prepare.sh (committed expected outputs).
#include <gtest/gtest.h>

#include <fstream>

#include "data/chat_formats.h"
#include "data/prepare.h"
#include "data/samples.h"
#include "test_util.h"

using namespace talon;
using talon::testing::source_dir;

namespace {

ojson J(const char* s) { return ojson::parse(s); }

fs::path tmpfile(const std::string& name, const std::string& content) {
  fs::path p = fs::temp_directory_path() / ("talon-test-prepare-" + std::to_string(::getpid()) + "-" + name);
  std::ofstream(p, std::ios::binary) << content;
  return p;
}

std::string reason_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const RecordError& e) {
    return e.reason;
  }
  return "";
}

}  // namespace

TEST(ChatFormats, DetectsEveryShape) {
  EXPECT_EQ(detect_chat_format(J(R"({"id":"a","conversations":[{"from":"human","value":"x"}]})")), ChatFormat::ShareGPT);
  EXPECT_EQ(detect_chat_format(J(R"({"messages":[]})")), ChatFormat::OpenAI);
  EXPECT_EQ(detect_chat_format(J(R"({"task":"GR","id":1,"history":[]})")), ChatFormat::MTBench101);
  EXPECT_EQ(detect_chat_format(J(R"({"data":["q","a"]})")), ChatFormat::UltraChat);
  EXPECT_EQ(detect_chat_format(J(R"({"class":"x","data":"q"})")), ChatFormat::Questions);
  EXPECT_EQ(detect_chat_format(J(R"({"question":"q","answer":"a"})")), ChatFormat::GSM8K);
  EXPECT_EQ(detect_chat_format(J(R"({"instruction":"i","instances":[]})")), ChatFormat::SelfInstruct);
  EXPECT_EQ(detect_chat_format(J(R"({"instruction":"i","input":"","output":"o"})")), ChatFormat::Alpaca);
  EXPECT_EQ(detect_chat_format(J(R"({"question_id":1,"turns":["a","b"]})")), ChatFormat::Questions);
  EXPECT_EQ(detect_chat_format(J(R"({"task_id":"H/0","prompt":"def f():"})")), ChatFormat::Questions);
  EXPECT_EQ(detect_chat_format(J(R"({"instruction":"i","input":"x"})")), ChatFormat::Questions);
  EXPECT_EQ(detect_chat_format(J(R"({"question":"q"})")), ChatFormat::Questions);
  EXPECT_EQ(reason_of([] { detect_chat_format(J(R"({"foo":1})")); }), "unrecognised_record");
  EXPECT_EQ(reason_of([] { detect_chat_format(J(R"([1,2])")); }), "unrecognised_record");
}

TEST(ChatFormats, Conversions) {
  auto c = record_to_conversations(
      J(R"({"id":"s","conversations":[{"from":"gpt","value":"a"},{"from":"human","value":"q"},{"from":"system","value":"s"}]})"),
      ChatFormat::Auto);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].id, "s");
  EXPECT_EQ(c[0].messages.dump(),
            R"([{"role":"assistant","content":"a"},{"role":"user","content":"q"},{"role":"system","content":"s"}])");
  EXPECT_EQ(reason_of([] {
              record_to_conversations(J(R"({"conversations":[{"from":"narrator","value":"x"}]})"), ChatFormat::Auto);
            }),
            "unknown_role");
  EXPECT_EQ(reason_of([] { record_to_conversations(J(R"({"conversations":[{"from":"human"}]})"), ChatFormat::Auto); }),
            "bad_record");
  // OpenAI: passed through; text parts joined
  c = record_to_conversations(
      J(R"({"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},{"role":"assistant","content":"c","name":"x"}]})"),
      ChatFormat::Auto);
  EXPECT_EQ(c[0].messages.dump(), R"([{"role":"user","content":"ab"},{"role":"assistant","content":"c","name":"x"}])");
  // MT-Bench-101, UltraChat, GSM8K
  c = record_to_conversations(J(R"({"id":7,"history":[{"user":"u1","bot":"b1"},{"user":"u2","bot":"b2"}]})"),
                              ChatFormat::Auto);
  EXPECT_EQ(c[0].id, "7");
  EXPECT_EQ(c[0].messages.size(), 4u);
  EXPECT_EQ(c[0].messages[3]["content"], "b2");
  c = record_to_conversations(J(R"({"data":["q1","a1","q2"]})"), ChatFormat::Auto);
  EXPECT_EQ(c[0].messages[2]["role"], "user");
  c = record_to_conversations(J(R"({"question":"q","answer":"a"})"), ChatFormat::Auto);
  EXPECT_EQ(c[0].messages.dump(), R"([{"role":"user","content":"q"},{"role":"assistant","content":"a"}])");
  // self-instruct: one conversation per instance; input appended after a blank line
  c = record_to_conversations(
      J(R"({"id":"t","instruction":"Do","instances":[{"input":"","output":"o1"},{"input":"x","output":"o2"}]})"),
      ChatFormat::Auto);
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[0].id, "t#0");
  EXPECT_EQ(c[0].messages[0]["content"], "Do");
  EXPECT_EQ(c[1].messages[0]["content"], "Do\n\nx");
  // questions: prompt only, first turn + later turns
  c = record_to_conversations(J(R"({"question_id":81,"turns":["t1","t2"]})"), ChatFormat::Auto);
  EXPECT_TRUE(c[0].prompt_only);
  EXPECT_EQ(c[0].id, "81");
  EXPECT_EQ(c[0].messages.size(), 1u);
  EXPECT_EQ(c[0].later_turns, std::vector<std::string>{"t2"});
  // a forced format that does not fit names the field
  try {
    record_to_conversations(J(R"({"question":"q"})"), ChatFormat::GSM8K);
    FAIL();
  } catch (const RecordError& e) {
    EXPECT_EQ(e.reason, "bad_record");
    EXPECT_NE(std::string(e.what()).find("'answer'"), std::string::npos);
  }
  EXPECT_THROW(parse_chat_format("csv"), Error);
  EXPECT_EQ(parse_chat_format("self-instruct"), ChatFormat::SelfInstruct);
}

TEST(ChatFormats, ParseRecordReportsUtf8AndJson) {
  EXPECT_EQ(reason_of([] { parse_record("{\"a\": \"\xff\"}"); }), "invalid_utf8");
  EXPECT_EQ(reason_of([] { parse_record("{\"a\": "); }), "invalid_json");
  try {
    parse_record("{\"a\": \"ok\xc3\"}");
  } catch (const RecordError& e) {
    EXPECT_NE(std::string(e.what()).find("byte 9"), std::string::npos) << e.what();
  }
}

TEST(ChatFormats, ReaderJsonlAndArrays) {
  fs::path a = tmpfile("a.jsonl", "{\"x\":1}\n\n  \n{\"x\":2}\r\n");
  RecordReader r(a);
  RecordReader::Item it;
  ASSERT_TRUE(r.next(it));
  EXPECT_EQ(it.line, 1);
  ASSERT_TRUE(r.next(it));
  EXPECT_EQ(it.line, 4);
  EXPECT_EQ(it.text, "{\"x\":2}");
  EXPECT_FALSE(r.next(it));
  EXPECT_EQ(RecordReader::count(a), 2);

  fs::path b = tmpfile("b.json", "[\n  {\"s\": \"a,]}\\\"[\"},\n  {\"n\": [1, {\"k\": 2}]}\n]\n");
  RecordReader rb(b);
  EXPECT_TRUE(rb.is_array());
  ASSERT_TRUE(rb.next(it));
  EXPECT_EQ(it.line, 2);
  EXPECT_EQ(parse_record(it.text)["s"], "a,]}\"[");
  ASSERT_TRUE(rb.next(it));
  EXPECT_EQ(it.line, 3);
  EXPECT_EQ(parse_record(it.text)["n"][1]["k"], 2);
  EXPECT_FALSE(rb.next(it));
  EXPECT_EQ(RecordReader::count(b), 2);

  fs::path c = tmpfile("c.json", "[{\"a\": 1}, {\"b\": ");
  RecordReader rc(c);
  ASSERT_TRUE(rc.next(it));
  EXPECT_EQ(reason_of([&] { rc.next(it); }), "invalid_json");
  for (auto& p : {a, b, c}) fs::remove(p);
}

// A directory's files are chosen by the same case-insensitive extension a file named directly is
// read by: an upper-case .JSONL or .CSV inside a directory is read, other files are not.
TEST(Prepare, ExpandInputsMatchesExtensionsWithoutCase) {
  const fs::path dir = fs::temp_directory_path() / ("talon-test-expand-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "sub");
  for (const char* name : {"a.JSONL", "b.Csv", "sub/c.json", "d.TSV", "notes.txt", "e.jsonl.bak"})
    std::ofstream(dir / name) << "{}\n";
  const auto files = expand_inputs({dir});
  std::vector<std::string> names;
  for (const auto& f : files) names.push_back(fs::relative(f, dir).generic_string());
  EXPECT_EQ(names, (std::vector<std::string>{"a.JSONL", "b.Csv", "d.TSV", "sub/c.json"}));
  EXPECT_EQ(lower_extension("x/Y.JsonL"), ".jsonl");
  EXPECT_EQ(lower_extension("noext"), "");
  fs::remove_all(dir);
}

TEST(Prepare, SpansToMask) {
  using Off = std::vector<std::pair<uint32_t, uint32_t>>;
  // tokens: [0,3) [3,5) [5,5) [5,9) [9,10) [10,14)
  Off off{{0, 3}, {3, 5}, {5, 5}, {5, 9}, {9, 10}, {10, 14}};
  auto m = spans_to_mask(off, {TurnSpan{1, 5, 10, false}});
  EXPECT_EQ(m, (std::vector<uint8_t>{0, 0, 0, 1, 1, 0}));  // zero-length token never masked
  // a token straddling the span start or end is masked (it carries assistant bytes)
  m = spans_to_mask(off, {TurnSpan{1, 4, 6, false}});
  EXPECT_EQ(m, (std::vector<uint8_t>{0, 1, 0, 1, 0, 0}));
  // two spans, adjacent tokens; an empty span masks nothing
  m = spans_to_mask(off, {TurnSpan{1, 0, 3, false}, TurnSpan{3, 9, 9, false}, TurnSpan{5, 10, 14, false}});
  EXPECT_EQ(m, (std::vector<uint8_t>{1, 0, 0, 0, 0, 1}));
}

TEST(Prepare, LocateTurnsChatml) {
  text::ChatTemplate tpl(kChatmlTemplate, "chatml");
  ojson msgs = J(R"([{"role":"system","content":"S"},{"role":"user","content":"U"},{"role":"assistant","content":"A1"},
                     {"role":"user","content":"V"},{"role":"assistant","content":""}])");
  const std::string full = tpl.render(msgs, false);
  auto spans = locate_assistant_turns(tpl, msgs, ojson::object(), full);
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_EQ(full.substr(spans[0].begin, spans[0].end - spans[0].begin), "A1<|im_end|>");
  EXPECT_EQ(full.substr(spans[1].begin, spans[1].end - spans[1].begin), "<|im_end|>");  // empty turn: EOT only
  EXPECT_FALSE(spans[0].by_sentinel);
  // agrees with ChatTemplate::assistant_spans on the begin, and ends before the separator
  auto ref = tpl.assistant_spans(msgs);
  ASSERT_EQ(ref.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_TRUE(ref[i].ok);
    EXPECT_EQ(ref[i].begin, spans[i].begin);
    EXPECT_EQ(ref[i].end, spans[i].end + 1);  // the "\n" after <|im_end|>
  }
}

TEST(Prepare, LocateTurnsAssistantFirst) {
  // A template that adds a default system turn only when messages exist (like SmolLM2's):
  // the generation-prompt rule fails for turn 0, the sentinel rule locates it.
  const char* src =
      "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nDefault<|im_end|>\n"
      "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
  text::ChatTemplate tpl(src, "smol-like");
  ojson msgs = J(R"([{"role":"assistant","content":"<<talon"},{"role":"user","content":"q"},{"role":"assistant","content":"b"}])");
  const std::string full = tpl.render(msgs, false);
  auto spans = locate_assistant_turns(tpl, msgs, ojson::object(), full);
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_TRUE(spans[0].by_sentinel);
  EXPECT_EQ(full.substr(spans[0].begin, spans[0].end - spans[0].begin), "<<talon<|im_end|>");
  EXPECT_FALSE(spans[1].by_sentinel);
  EXPECT_EQ(full.substr(spans[1].begin, spans[1].end - spans[1].begin), "b<|im_end|>");
}

TEST(Prepare, LocateTurnsRewritingTemplateFails) {
  // Drops every assistant turn but the last (like Qwen3's reasoning handling): not locatable.
  const char* src =
      "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}<{{ m['role'] }}>{{ m['content'] }}</s>"
      "{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}";
  text::ChatTemplate tpl(src, "rewriter");
  ojson msgs = J(R"([{"role":"user","content":"q"},{"role":"assistant","content":"a"},{"role":"user","content":"r"},{"role":"assistant","content":"b"}])");
  const std::string full = tpl.render(msgs, false);
  EXPECT_EQ(reason_of([&] { locate_assistant_turns(tpl, msgs, ojson::object(), full); }), "unlocatable_turn");
}

TEST(Prepare, LocateTurnsInFinalRendering) {
  // Strips reasoning ("R|" before the answer) from assistant turns but the last (like Qwen3):
  // the prefix rule fails for turn 1, which is located in the final rendering: answer + EOT only.
  const char* src =
      "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
      "{% if m['role'] == 'assistant' and not loop.last and '|' in m['content'] %}{{ m['content'].split('|')[-1] }}"
      "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
  text::ChatTemplate tpl(src, "stripper");
  ojson msgs = J(R"([{"role":"user","content":"q"},{"role":"assistant","content":"R1|A1"},{"role":"user","content":"q"},)"
                 R"({"role":"assistant","content":""},{"role":"user","content":"r"},{"role":"assistant","content":"R3|A3"}])");
  const std::string full = tpl.render(msgs, false);
  auto spans = locate_assistant_turns(tpl, msgs, ojson::object(), full);
  ASSERT_EQ(spans.size(), 3u);
  auto text = [&](const TurnSpan& s) { return full.substr(s.begin, s.end - s.begin); };
  EXPECT_EQ(text(spans[0]), "A1<|im_end|>");
  EXPECT_TRUE(spans[0].in_final);
  EXPECT_EQ(text(spans[1]), "<|im_end|>");  // not rewritten: the prefix rule
  EXPECT_FALSE(spans[1].in_final);
  EXPECT_EQ(text(spans[2]), "R3|A3<|im_end|>");  // the last turn keeps its reasoning
  EXPECT_FALSE(spans[2].in_final);
}

TEST(Prepare, LocateTurnsQwen3) {
  const fs::path p = fs::path(source_dir()) / "../shared/data/tokenizers/chat_templates/qwen3.jinja";
  if (!fs::exists(p)) GTEST_SKIP() << p << " missing";
  auto tpl = text::ChatTemplate::from_path(p);
  ojson msgs = J(R"([{"role":"system","content":"s"},{"role":"user","content":"q1"},)"
                 R"({"role":"assistant","content":"<think>\nr1\n</think>\n\nA1"},{"role":"user","content":"q2"},)"
                 R"({"role":"assistant","content":"A2"},{"role":"user","content":"q3"},)"
                 R"({"role":"assistant","content":"<think>\nr3\n</think>\n\nA3"}])");
  for (bool thinking : {true, false}) {
    ojson kw = thinking ? ojson::object() : J(R"({"enable_thinking": false})");
    const std::string full = tpl.render(msgs, false, kw);
    auto spans = locate_assistant_turns(tpl, msgs, kw, full);
    ASSERT_EQ(spans.size(), 3u);
    auto text = [&](const TurnSpan& s) { return full.substr(s.begin, s.end - s.begin); };
    EXPECT_EQ(text(spans[0]), "A1<|im_end|>");  // r1 is not in the rendering: not trained on
    EXPECT_TRUE(spans[0].in_final);
    EXPECT_EQ(text(spans[1]), "A2<|im_end|>");
    EXPECT_TRUE(spans[1].in_final);
    // the last turn: its <think> block is part of it (with enable_thinking=false the turn departs
    // from the generation prompt "<think>\n\n</think>\n\n" after "<think>\n")
    EXPECT_EQ(text(spans[2]), thinking ? "<think>\nr3\n</think>\n\nA3<|im_end|>" : "r3\n</think>\n\nA3<|im_end|>");
    EXPECT_EQ(full.substr(spans[2].end), "\n");
  }
}

TEST(Prepare, TokenOffsetsSmolLM2) {
  const fs::path gguf = fs::path(source_dir()) / ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!fs::exists(gguf)) GTEST_SKIP() << gguf << " missing; run scripts/fetch_model.sh";
  auto tok = text::Tokenizer::load(gguf);
  TokenBytes tb(*tok);
  // byte-level tokens splitting one character: both tokens cover their own bytes
  const std::string text = "<|im_start|>user\nh\xC3\xA9llo \xF0\x9F\x8E\x89 x<|im_end|>\n";
  auto ids = tok->encode(text, false);
  auto off = tb.offsets(ids, text);
  ASSERT_EQ(off.size(), ids.size());
  EXPECT_EQ(off.front().first, 0u);
  EXPECT_EQ(off.back().second, text.size());
  for (size_t k = 1; k < off.size(); ++k) EXPECT_EQ(off[k].first, off[k - 1].second);  // tiles the text
  EXPECT_EQ(text.substr(off[0].first, off[0].second), "<|im_start|>");
  // tokens that do not spell the text are reported, not mis-mapped
  EXPECT_EQ(reason_of([&] { tb.offsets(ids, text + "extra"); }), "offsets");
  auto wrong = ids;
  std::swap(wrong[1], wrong[2]);
  EXPECT_EQ(reason_of([&] { tb.offsets(wrong, text); }), "offsets");
}

TEST(Samples, OpenSamplesChecksPreparedDir) {
  fs::path d = fs::temp_directory_path() / ("talon-test-prepdir-" + std::to_string(::getpid()));
  fs::create_directories(d);
  const std::string line = "{\"id\": \"a\", \"source\": \"x:1\", \"input_ids\": [1, 2], \"loss_mask\": [0, 1]}\n";
  { std::ofstream(d / "tokens.jsonl") << line; }
  nlohmann::json m = {{"format", "talon.tokens"}, {"format_version", 1}, {"tokens_sha256", sha256_hex(line.data(), line.size())}};
  { std::ofstream(d / "manifest.json") << m.dump(); }
  auto s = open_samples(d);
  EXPECT_EQ(s->size(), 1u);
  EXPECT_EQ(s->format(), "talon.tokens");
  EXPECT_EQ(s->at(0).id, "a");
  { std::ofstream(d / "tokens.jsonl", std::ios::app) << line; }
  EXPECT_THROW(open_samples(d), Error);  // checksum no longer matches
  m["format_version"] = 2;
  { std::ofstream(d / "manifest.json") << m.dump(); }
  EXPECT_THROW(open_samples(d), Error);
  fs::remove_all(d);
}

#include "cli/commands/prepare.h"

TEST(Prepare, RunAndInspectTokens) {
  const fs::path gguf = fs::path(source_dir()) / ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!fs::exists(gguf)) GTEST_SKIP() << gguf << " missing; run scripts/fetch_model.sh";
  PrepareOptions o;
  o.model = gguf;
  o.inputs = {fs::path(source_dir()) / "tests/fixtures/prepare/chats_openai.jsonl"};
  o.out = fs::temp_directory_path() / ("talon-test-prep-run-" + std::to_string(::getpid()));
  fs::remove_all(o.out);
  PrepareReport r = run_prepare(o);
  EXPECT_EQ(r.samples, 11);
  EXPECT_EQ(r.skipped, 0);
  EXPECT_TRUE(is_tokens_dir(o.out));
  ::testing::internal::CaptureStdout();
  int rc = inspect_tokens(o.out, 1);
  std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("checksum ok"), std::string::npos) << out;
  EXPECT_NE(out.find("[[7<|im_end|>]]"), std::string::npos) << out;  // system-multi's first answer
  // a rerun of the same job finds it complete and leaves it intact; another job is refused
  const std::string tokens = read_text_file(o.out / "tokens.jsonl"), manifest = read_text_file(o.out / "manifest.json");
  EXPECT_EQ(run_prepare(o).status, PrepareStatus::AlreadyComplete);
  PrepareOptions other = o;
  other.max_length = 16;
  try {
    run_prepare(other);
    ADD_FAILURE() << "a different job in a finished directory was not refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("holds a different finished prepare (options differ)"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(read_text_file(o.out / "tokens.jsonl"), tokens);
  EXPECT_EQ(read_text_file(o.out / "manifest.json"), manifest);
  // what a killed run leaves (no manifest, a partial tokens file, a dead process's
  // temporary) is cleared by the rerun, which then matches the first run
  fs::remove(o.out / "manifest.json");
  { std::ofstream(o.out / "tokens.jsonl.tmp-999999999") << "{\"partial"; }
  EXPECT_EQ(run_prepare(o).status, PrepareStatus::Complete);
  EXPECT_EQ(read_text_file(o.out / "tokens.jsonl"), tokens);
  EXPECT_EQ(read_text_file(o.out / "manifest.json"), manifest);
  EXPECT_FALSE(fs::exists(o.out / "tokens.jsonl.tmp-999999999"));
  fs::remove_all(o.out);
}
