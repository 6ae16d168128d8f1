// GGUF v3 (and v2) single-file reader: metadata, tensor directory, dequantisation to fp32.
// Every size and offset is validated against the file length before data is touched;
// malformed files raise talon::Error naming the file and the field.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "util/file.h"

namespace talon::gguf {

// ggml tensor types (numbering from the GGUF specification). The IQ*/TQ*/MXFP4
// types are known (so files holding them parse and their sizes are checked) but
// dequantize() does not support them.
enum class GgmlType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15,
  IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21,
  IQ2_S = 22, IQ4_XS = 23,
  I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28, IQ1_M = 29, BF16 = 30,
  TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39,
};
const char* type_name(GgmlType t);
// True where dequantize() supports the type.
bool type_supported(GgmlType t);
// Elements per block and bytes per block; false for unknown types.
bool type_block(GgmlType t, int64_t* block_elems, int64_t* block_bytes);

// A metadata value. Arrays hold values of one element type.
struct Value;
using Array = std::vector<Value>;
struct Value {
  enum class Kind : uint32_t {
    U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, BOOL = 7,
    STRING = 8, ARRAY = 9, U64 = 10, I64 = 11, F64 = 12,
  };
  Kind kind = Kind::U8;
  Kind elem = Kind::U8;  // element kind when kind == ARRAY (kept for empty arrays)
  // U8/U16/U32/U64 -> uint64_t, I8/I16/I32/I64 -> int64_t, F32/F64 -> double.
  std::variant<uint64_t, int64_t, double, bool, std::string, std::shared_ptr<Array>> v;

  bool is_int() const;       // any integer kind
  bool is_float() const;     // F32 / F64
  int64_t as_int() const;    // throws unless integer (or bool) and representable
  double as_float() const;   // integers convert too
  const std::string& as_string() const;
  const Array& as_array() const;
  static const char* kind_name(Kind k);  // "u32", "string", ...; "unknown" otherwise
};

struct TensorInfo {
  std::string name;
  std::vector<int64_t> ne;  // GGUF order: ne[0] is the contiguous (fastest) dimension
  GgmlType type;
  uint64_t offset;          // absolute offset in the file
  uint64_t nbytes;
  int64_t numel() const;
};

class File {
 public:
  explicit File(const fs::path& path);

  const fs::path& path() const { return map_.path(); }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  const std::map<std::string, Value>& metadata() const { return kv_; }
  const Value* find(const std::string& key) const;

  // Typed getters: throw naming the key when absent or of the wrong kind.
  const std::string& get_string(const std::string& key) const;
  int64_t get_int(const std::string& key) const;
  double get_float(const std::string& key) const;
  std::optional<int64_t> get_int_opt(const std::string& key) const;
  std::optional<double> get_float_opt(const std::string& key) const;
  std::optional<std::string> get_string_opt(const std::string& key) const;
  std::vector<std::string> get_string_array(const std::string& key) const;

  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find_tensor(const std::string& name) const;  // nullptr if absent

  // Dequantises the whole tensor to fp32, `out` holds numel() floats.
  void dequantize(const TensorInfo& t, float* out) const;
  const uint8_t* tensor_data(const TensorInfo& t) const { return map_.data() + t.offset; }

 private:
  MappedFile map_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  std::map<std::string, Value> kv_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> tensor_index_;
};

// Dequantise `n` elements (a multiple of the type's block size) of `src` to fp32.
void dequantize_row(GgmlType t, const void* src, float* dst, int64_t n);

}  // namespace talon::gguf
