// libFuzzer target for the chat-dataset readers of `talon prepare`: the input is a dataset
// file (JSONL, or one JSON array); every record is read, parsed, its format detected and
// converted to conversations. Bad records must give a RecordError / talon::Error naming
// the problem; anything else is a bug.
#include <cstdint>
#include <string>

#include "data/chat_formats.h"
#include "fuzz_util.h"
#include "util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = talon::fuzz::as_file(data, size);
  try {
    (void)talon::RecordReader::count(path);
    talon::RecordReader reader(path);
    talon::RecordReader::Item it;
    size_t convs = 0;
    while (reader.next(it)) {
      try {
        const talon::ojson rec = talon::parse_record(it.text);
        const talon::ChatFormat f = talon::detect_chat_format(rec);
        for (auto& c : talon::record_to_conversations(rec, f)) convs += c.messages.size();
      } catch (const talon::RecordError&) {
      }
    }
    (void)convs;
  } catch (const talon::Error&) {
  }
  return 0;
}
