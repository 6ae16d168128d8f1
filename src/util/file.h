// Files: read-only memory maps, atomic writes (temp name, fsync, rename), hashing.
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <string>
#include <string_view>

namespace talon {

namespace fs = std::filesystem;

// A read-only private mapping of a whole file. Zero-length files map to an empty span.
class MappedFile {
 public:
  MappedFile() = default;
  explicit MappedFile(const fs::path& path);
  ~MappedFile();
  MappedFile(MappedFile&& o) noexcept { *this = std::move(o); }
  MappedFile& operator=(MappedFile&& o) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

std::string read_text_file(const fs::path& path);

// `dir / name` for a file name read from a file in `dir` (a manifest, an index): `name`
// must be relative, non-empty and free of ".." components, and when the file exists its
// real path (symlinks resolved) must lie inside `dir`'s real path. `origin` names the field
// that held the name, for the error ("out/manifest.json: shards[3].file").
fs::path path_inside(const fs::path& dir, const std::string& name, const std::string& origin);

// Writes to "<path>.tmp-<pid>", fsyncs it, renames it over `path` and fsyncs the
// directory, so `path` is either absent, the old content, or the whole new content.
class AtomicFile {
 public:
  explicit AtomicFile(fs::path path);
  ~AtomicFile();  // not committed -> temp file removed
  void write(const void* data, size_t n);
  void write(std::string_view s) { write(s.data(), s.size()); }
  void commit();
  const fs::path& temp_path() const { return tmp_; }

 private:
  fs::path path_, tmp_;
  int fd_ = -1;
  bool committed_ = false;
};

void write_file_atomic(const fs::path& path, std::string_view content);

// Removes "<name>.tmp-<pid>" files in `dir` (the temporaries of AtomicFile) for each of
// `names`, left by a run that was killed; a temporary of a process still alive is kept.
// Returns how many were removed.
int remove_stale_temps(const fs::path& dir, std::initializer_list<std::string_view> names);

// Lower-case hex SHA-256.
std::string sha256_hex(const void* data, size_t n);
std::string sha256_file_hex(const fs::path& path);

// For a path that does not exist and reads like a Hugging Face model id ("org/name"): a hint,
// starting with a space, to download it first (talon reads local files only); else "".
std::string hub_id_hint(const fs::path& path);

class Sha256 {
 public:
  Sha256();
  ~Sha256();
  void update(const void* data, size_t n);
  std::string hex();  // finalises
 private:
  void* ctx_;
};

}  // namespace talon
