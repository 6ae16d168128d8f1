// Readers for chat datasets as users bring them: each record becomes one or more
// conversations ({role, content} messages, the shape chat templates take).
//
// Formats (detected per record from its keys, or forced with --format):
//   sharegpt      {conversations: [{from: human|user|gpt|assistant|system|..., value}]}
//   openai        {messages: [{role, content, ...}]}  (messages passed through unchanged;
//                 content given as a list of {type: "text", text} parts is joined)
//   mtbench101    {history: [{user, bot}]}
//   ultrachat     {data: [user, assistant, user, ...]}   (alternating strings)
//   gsm8k         {question, answer}
//   self-instruct {instruction, instances: [{input, output}]}  (one conversation per instance)
//   alpaca        {instruction, input?, output}
//   questions     {turns: [...]} | {question} | {prompt} | {instruction, input?} | {data: "..."}:
//                 prompts with no assistant answer (prompt_only = true)
// A file is JSONL (one record per line) or one JSON array of records.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "util/error.h"
#include "util/file.h"

namespace talon {

using ojson = nlohmann::ordered_json;

enum class ChatFormat { Auto, ShareGPT, OpenAI, MTBench101, UltraChat, GSM8K, SelfInstruct, Alpaca, Questions };

const char* chat_format_name(ChatFormat f);
ChatFormat parse_chat_format(const std::string& name);  // throws naming the valid names

// A record that cannot be used: `reason` is a short stable key (counted in the manifest),
// what() the human message (without file:line; the caller adds it).
struct RecordError : Error {
  RecordError(std::string reason, const std::string& msg) : Error(msg), reason(std::move(reason)) {}
  std::string reason;
};

struct Conversation {
  std::string id;       // the record's id (id / question_id / task_id), "" if none
  ojson messages = ojson::array();
  bool prompt_only = false;               // a question: messages end with a user turn, no answer
  std::vector<std::string> later_turns;   // prompt_only: the question's further user turns
};

// The format of a record (never Auto); throws RecordError("unrecognised_record") naming the keys.
ChatFormat detect_chat_format(const ojson& record);

// Converts one record. Throws RecordError with reasons: bad_record (a field is missing or has
// the wrong type), unknown_role.
std::vector<Conversation> record_to_conversations(const ojson& record, ChatFormat format);

// The file's extension, lower-cased (".JSONL" -> ".jsonl"): how every reader of chat data
// decides what a file holds, whether it was named directly or found in a directory.
std::string lower_extension(const fs::path& path);

// Iterates the records of one input file without holding it in memory (JSONL line by line;
// JSON arrays element by element from a memory map). Each record comes with its 1-based line.
class RecordReader {
 public:
  explicit RecordReader(const fs::path& path);
  ~RecordReader();
  RecordReader(const RecordReader&) = delete;
  RecordReader& operator=(const RecordReader&) = delete;

  struct Item {
    int64_t line = 0;
    std::string text;  // the record's JSON text
  };
  // false at the end. Blank JSONL lines are skipped. Throws RecordError("invalid_json") for an
  // array file whose structure is broken (the rest of the file cannot be read).
  bool next(Item& out);
  bool is_array() const { return array_; }
  // Number of records (a quick pre-pass: non-blank lines, or top-level array elements).
  static int64_t count(const fs::path& path);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;  // freed however the constructor leaves
  bool array_ = false;
};

// Parses a record's text: RecordError("invalid_utf8") naming the byte offset, or ("invalid_json").
ojson parse_record(std::string_view text);

}  // namespace talon
