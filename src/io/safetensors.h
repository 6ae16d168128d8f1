// Safetensors: memory-mapped reader that validates the header against the file length,
// and an atomic writer. Format: u64 LE header length N, N bytes of JSON
// {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}, data.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "util/dtype.h"
#include "util/file.h"

namespace talon::st {

// Metadata key of the file's own checksum: the SHA-256 of the data section followed by
// every other metadata entry as key, NUL, value, NUL in key order. It covers the tensor
// bytes and the metadata; a flipped byte in the tensor table makes the header
// inconsistent (offsets, sizes, dtypes) or renames a tensor, which readers reject.
inline constexpr const char* kChecksumKey = "talon.sha256";

struct TensorView {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const uint8_t* data;  // into the mapping
  size_t nbytes;
  int64_t numel() const;
};

class File {
 public:
  explicit File(const fs::path& path);
  const fs::path& path() const { return map_.path(); }
  const std::vector<TensorView>& tensors() const { return tensors_; }
  const TensorView* find(const std::string& name) const;  // nullptr if absent
  // Throws naming the file and tensor when absent or of another dtype / shape.
  const TensorView& get(const std::string& name, DType dtype, const std::vector<int64_t>& shape) const;
  const TensorView& get(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  size_t file_size() const { return map_.size(); }
  // Recomputes the checksum a Writer with set_checksum() recorded (metadata kChecksumKey)
  // and throws naming the file when it differs, or when it is absent and `required`.
  void verify_checksum(bool required) const;

 private:
  MappedFile map_;
  std::vector<TensorView> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// Collects tensors (copying nothing until write) and writes them atomically.
class Writer {
 public:
  void add(const std::string& name, DType dtype, std::vector<int64_t> shape, const void* data,
           size_t nbytes);
  void set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }
  void set_checksum(bool on) { checksum_ = on; }  // records kChecksumKey (File::verify_checksum)
  // Writes `path` atomically; returns the SHA-256 of the bytes written and their count.
  std::string write(const fs::path& path, size_t* bytes_written = nullptr) const;

 private:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    const void* data;
    size_t nbytes;
  };
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
  bool checksum_ = false;
};

std::string shape_str(const std::vector<int64_t>& shape);

}  // namespace talon::st
