// libFuzzer target for the chat-dataset readers of `talon prepare`: the input is a dataset
// file (JSONL, or one JSON array), and the same bytes as a .csv file (libcsv, a header row and
// JSON cells); every record is read, parsed, its format detected and converted to
// conversations. Bad records must give a RecordError / talon::Error naming
// the problem; anything else is a bug.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "data/chat_formats.h"
#include "fuzz_util.h"
#include "util/error.h"

namespace {

void read_all(const std::string& path) {
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
}

// The CSV reader is picked by the file name: the input also goes to a .csv file in /dev/shm.
const std::string& csv_path() {
  static const std::string p = "/dev/shm/talon-fuzz-" + std::to_string(::getpid()) + ".csv";
  static const int removed_at_exit = std::atexit([] { std::remove(csv_path().c_str()); });
  (void)removed_at_exit;
  return p;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  read_all(talon::fuzz::as_file(data, size));
  {
    std::ofstream f(csv_path(), std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(data), std::streamsize(size));
  }
  read_all(csv_path());
  return 0;
}
