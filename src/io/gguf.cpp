// GGUF reader. Layout (all little-endian):
//   u32 magic "GGUF", u32 version (2 or 3), u64 tensor_count, u64 kv_count,
//   kv_count x { string key, u32 kind, value },
//   tensor_count x { string name, u32 n_dims, u64 ne[n_dims], u32 type, u64 offset },
//   padding to general.alignment, data section (tensor offsets are relative to it).
// A string is u64 length + bytes; an array is u32 element kind + u64 count + elements.
//
// Every read is bounds-checked against the mapped file before it happens, every count
// is checked against the bytes left before anything is allocated for it, and every
// tensor's byte range is checked to lie inside the file before data is exposed.
#include "io/gguf.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>

#include "util/dtype.h"
#include "util/error.h"

namespace talon::gguf {

namespace {

using Kind = Value::Kind;

constexpr uint32_t kMagic = 0x46554747u;  // "GGUF" read as little-endian u32
constexpr int kMaxDims = 4;
constexpr int kMaxArrayDepth = 8;                  // nested arrays: real files use 0 or 1
constexpr uint64_t kMaxMetadataValues = 1u << 24;  // all array elements together
constexpr int64_t kQK = 256;                       // K-quant super-block

inline uint16_t ld16(const uint8_t* p) { return uint16_t(p[0] | (uint16_t(p[1]) << 8)); }
inline uint32_t ld32(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}
inline uint64_t ld64(const uint8_t* p) { return uint64_t(ld32(p)) | uint64_t(ld32(p + 4)) << 32; }
inline float ldh(const uint8_t* p) { return f16_to_f32(ld16(p)); }

struct TypeTraits {
  GgmlType type;
  const char* name;
  int64_t block_elems;
  int64_t block_bytes;
  bool supported;
};

// Block sizes follow ggml's type traits (ggml-common.h). Q8_1 is {f16 d, f16 s, i8 qs[32]}
// = 36 bytes there; note that gguf-py 0.19's GGML_QUANT_SIZES still says 40 (the old
// {f32 d, f32 s} layout). Q8_1 never appears in model files in practice.
constexpr TypeTraits kTypes[] = {
    {GgmlType::F32, "F32", 1, 4, true},
    {GgmlType::F16, "F16", 1, 2, true},
    {GgmlType::Q4_0, "Q4_0", 32, 18, true},
    {GgmlType::Q4_1, "Q4_1", 32, 20, true},
    {GgmlType::Q5_0, "Q5_0", 32, 22, true},
    {GgmlType::Q5_1, "Q5_1", 32, 24, true},
    {GgmlType::Q8_0, "Q8_0", 32, 34, true},
    {GgmlType::Q8_1, "Q8_1", 32, 36, true},
    {GgmlType::Q2_K, "Q2_K", 256, 84, true},
    {GgmlType::Q3_K, "Q3_K", 256, 110, true},
    {GgmlType::Q4_K, "Q4_K", 256, 144, true},
    {GgmlType::Q5_K, "Q5_K", 256, 176, true},
    {GgmlType::Q6_K, "Q6_K", 256, 210, true},
    {GgmlType::Q8_K, "Q8_K", 256, 292, false},
    {GgmlType::IQ2_XXS, "IQ2_XXS", 256, 66, false},
    {GgmlType::IQ2_XS, "IQ2_XS", 256, 74, false},
    {GgmlType::IQ3_XXS, "IQ3_XXS", 256, 98, false},
    {GgmlType::IQ1_S, "IQ1_S", 256, 50, false},
    {GgmlType::IQ4_NL, "IQ4_NL", 32, 18, false},
    {GgmlType::IQ3_S, "IQ3_S", 256, 110, false},
    {GgmlType::IQ2_S, "IQ2_S", 256, 82, false},
    {GgmlType::IQ4_XS, "IQ4_XS", 256, 136, false},
    {GgmlType::I8, "I8", 1, 1, true},
    {GgmlType::I16, "I16", 1, 2, true},
    {GgmlType::I32, "I32", 1, 4, true},
    {GgmlType::I64, "I64", 1, 8, true},
    {GgmlType::F64, "F64", 1, 8, true},
    {GgmlType::IQ1_M, "IQ1_M", 256, 56, false},
    {GgmlType::BF16, "BF16", 1, 2, true},
    {GgmlType::TQ1_0, "TQ1_0", 256, 54, false},
    {GgmlType::TQ2_0, "TQ2_0", 256, 66, false},
    {GgmlType::MXFP4, "MXFP4", 32, 17, false},
};

const TypeTraits* traits(GgmlType t) {
  for (const auto& tt : kTypes)
    if (tt.type == t) return &tt;
  return nullptr;
}

bool kind_known(uint32_t k) { return k <= uint32_t(Kind::F64); }

// Smallest encoding of one value of kind `k` (strings: the length field; arrays: kind+count).
uint64_t kind_min_bytes(Kind k) {
  switch (k) {
    case Kind::U8: case Kind::I8: case Kind::BOOL: return 1;
    case Kind::U16: case Kind::I16: return 2;
    case Kind::U32: case Kind::I32: case Kind::F32: return 4;
    case Kind::U64: case Kind::I64: case Kind::F64: return 8;
    case Kind::STRING: return 8;
    case Kind::ARRAY: return 12;
  }
  return 1;
}

// Position inside (possibly nested) arrays, for error messages only.
struct ArrayPos {
  uint64_t index, count;
  const ArrayPos* parent;
};

std::string describe_pos(const ArrayPos* p) {
  std::string s;
  for (; p; p = p->parent) s = fmt::format(" element {} of {}", p->index, p->count) + s;
  return s;
}

class Parser {
 public:
  Parser(std::string path, const uint8_t* data, size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}

  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }
  const std::string& path() const { return path_; }

  // Throws unless `n` more bytes are available; `what` names the field.
  template <typename What>
  void need(uint64_t n, const What& what) const {
    if (n > remaining())
      fail("{}: {}: needs {} bytes at offset {} but the file ends at {} (truncated?)", path_,
           what(), n, pos_, size_);
  }
  template <typename What>
  uint8_t u8(const What& w) { need(1, w); return data_[pos_++]; }
  template <typename What>
  uint16_t u16(const What& w) { need(2, w); uint16_t v = ld16(data_ + pos_); pos_ += 2; return v; }
  template <typename What>
  uint32_t u32(const What& w) { need(4, w); uint32_t v = ld32(data_ + pos_); pos_ += 4; return v; }
  template <typename What>
  uint64_t u64(const What& w) { need(8, w); uint64_t v = ld64(data_ + pos_); pos_ += 8; return v; }

  template <typename What>
  std::string str(const What& what) {
    size_t at = pos_;
    uint64_t n = u64([&] { return what() + " (string length)"; });
    if (n > remaining())
      fail("{}: {}: string length {} at offset {} runs past end of file (size {}, {} bytes left)",
           path_, what(), n, at, size_, remaining());
    std::string s(reinterpret_cast<const char*>(data_ + pos_), size_t(n));
    pos_ += size_t(n);
    return s;
  }

  // Reads one value of kind `k`. `key` names the metadata entry.
  Value value(Kind k, const std::string& key, int depth, const ArrayPos* ap) {
    auto what = [&] { return fmt::format("metadata '{}'{}", key, describe_pos(ap)); };
    Value out;
    out.kind = k;
    switch (k) {
      case Kind::U8: out.v = uint64_t(u8(what)); break;
      case Kind::I8: out.v = int64_t(int8_t(u8(what))); break;
      case Kind::U16: out.v = uint64_t(u16(what)); break;
      case Kind::I16: out.v = int64_t(int16_t(u16(what))); break;
      case Kind::U32: out.v = uint64_t(u32(what)); break;
      case Kind::I32: out.v = int64_t(int32_t(u32(what))); break;
      case Kind::U64: out.v = u64(what); break;
      case Kind::I64: out.v = int64_t(u64(what)); break;
      case Kind::F32: out.v = double(std::bit_cast<float>(u32(what))); break;
      case Kind::F64: out.v = std::bit_cast<double>(u64(what)); break;
      case Kind::BOOL: {
        size_t at = pos_;
        uint8_t b = u8(what);
        if (b > 1) fail("{}: {}: bool at offset {} is {}, expected 0 or 1", path_, what(), at, b);
        out.v = b != 0;
        break;
      }
      case Kind::STRING: out.v = str(what); break;
      case Kind::ARRAY: {
        size_t at = pos_;
        uint32_t ek = u32([&] { return what() + " (array element kind)"; });
        if (!kind_known(ek))
          fail("{}: {}: array element kind {} at offset {} is unknown (expected 0..12)", path_,
               what(), ek, at);
        Kind ekind = Kind(ek);
        if (ekind == Kind::ARRAY && depth + 1 >= kMaxArrayDepth)
          fail("{}: {}: arrays nested deeper than {} levels", path_, what(), kMaxArrayDepth);
        at = pos_;
        uint64_t count = u64([&] { return what() + " (array count)"; });
        uint64_t minb = kind_min_bytes(ekind);
        if (count > remaining() / minb)
          fail("{}: {}: array count {} at offset {} needs at least {} bytes per {} element but "
               "only {} bytes are left in the file (size {})",
               path_, what(), count, at, minb, Value::kind_name(ekind), remaining(), size_);
        total_values_ += count;
        if (total_values_ > kMaxMetadataValues)
          fail("{}: {}: metadata holds more than {} array elements in total", path_, what(),
               kMaxMetadataValues);
        auto arr = std::make_shared<Array>();
        arr->reserve(size_t(count));
        for (uint64_t i = 0; i < count; ++i) {
          ArrayPos here{i, count, ap};
          arr->push_back(value(ekind, key, depth + 1, &here));
        }
        out.elem = ekind;
        out.v = std::move(arr);
        break;
      }
    }
    return out;
  }

 private:
  std::string path_;
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  uint64_t total_values_ = 0;
};

// ---- dequantisation kernels: `nb` whole blocks from `x` to `y` ----
// Each follows the ggml block layout; element order within a block is spelled out.

void deq_q4_0(const uint8_t* x, float* y, int64_t nb) {  // {f16 d; u8 qs[16]}
  for (int64_t i = 0; i < nb; ++i, x += 18, y += 32) {
    const float d = ldh(x);
    const uint8_t* qs = x + 2;
    for (int j = 0; j < 16; ++j) {  // low nibbles: elements 0..15, high: 16..31
      y[j] = d * float(int(qs[j] & 0x0F) - 8);
      y[j + 16] = d * float(int(qs[j] >> 4) - 8);
    }
  }
}

void deq_q4_1(const uint8_t* x, float* y, int64_t nb) {  // {f16 d; f16 m; u8 qs[16]}
  for (int64_t i = 0; i < nb; ++i, x += 20, y += 32) {
    const float d = ldh(x), m = ldh(x + 2);
    const uint8_t* qs = x + 4;
    for (int j = 0; j < 16; ++j) {
      y[j] = d * float(qs[j] & 0x0F) + m;
      y[j + 16] = d * float(qs[j] >> 4) + m;
    }
  }
}

void deq_q5_0(const uint8_t* x, float* y, int64_t nb) {  // {f16 d; u8 qh[4]; u8 qs[16]}
  for (int64_t i = 0; i < nb; ++i, x += 22, y += 32) {
    const float d = ldh(x);
    const uint32_t qh = ld32(x + 2);  // bit j = 5th bit of element j
    const uint8_t* qs = x + 6;
    for (int j = 0; j < 16; ++j) {
      int lo = int(qs[j] & 0x0F) | int((qh >> j) & 1u) << 4;
      int hi = int(qs[j] >> 4) | int((qh >> (j + 16)) & 1u) << 4;
      y[j] = d * float(lo - 16);
      y[j + 16] = d * float(hi - 16);
    }
  }
}

void deq_q5_1(const uint8_t* x, float* y, int64_t nb) {  // {f16 d; f16 m; u8 qh[4]; u8 qs[16]}
  for (int64_t i = 0; i < nb; ++i, x += 24, y += 32) {
    const float d = ldh(x), m = ldh(x + 2);
    const uint32_t qh = ld32(x + 4);
    const uint8_t* qs = x + 8;
    for (int j = 0; j < 16; ++j) {
      int lo = int(qs[j] & 0x0F) | int((qh >> j) & 1u) << 4;
      int hi = int(qs[j] >> 4) | int((qh >> (j + 16)) & 1u) << 4;
      y[j] = d * float(lo) + m;
      y[j + 16] = d * float(hi) + m;
    }
  }
}

void deq_q8_0(const uint8_t* x, float* y, int64_t nb) {  // {f16 d; i8 qs[32]}
  for (int64_t i = 0; i < nb; ++i, x += 34, y += 32) {
    const float d = ldh(x);
    for (int j = 0; j < 32; ++j) y[j] = float(int8_t(x[2 + j])) * d;
  }
}

void deq_q8_1(const uint8_t* x, float* y, int64_t nb) {  // {f16 d; f16 s; i8 qs[32]}
  for (int64_t i = 0; i < nb; ++i, x += 36, y += 32) {
    const float d = ldh(x);  // s = d * sum(qs) is only used by dot products
    for (int j = 0; j < 32; ++j) y[j] = float(int8_t(x[4 + j])) * d;
  }
}

// Q2_K: {u8 scales[16]; u8 qs[64]; f16 d; f16 dmin}. Element e = 128h + 32j + l (h < 2,
// j < 4, l < 32) is bits 2j..2j+1 of qs[32h + l]; its 16-element group is e / 16 and the
// group's scale byte holds a 4-bit scale (low) and a 4-bit min (high).
void deq_q2_k(const uint8_t* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += 84, y += kQK) {
    const uint8_t* sc = x;
    const uint8_t* qs = x + 16;
    const float d = ldh(x + 80), dmin = ldh(x + 82);
    for (int g = 0; g < 16; ++g) {
      const float dl = d * float(sc[g] & 0x0F);
      const float ml = dmin * float(sc[g] >> 4);
      const int h = g / 8, j = (g % 8) / 2, l0 = (g % 2) * 16;
      for (int l = l0; l < l0 + 16; ++l) {
        int q = (qs[32 * h + l] >> (2 * j)) & 3;
        y[128 * h + 32 * j + l] = dl * float(q) - ml;
      }
    }
  }
}

// Q3_K: {u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d}. Element e = 128h + 32j + l:
// low two bits are bits 2j.. of qs[32h + l], the third bit is bit (4h + j) of hmask[l]
// (set = +0, clear = -4). Group g = e / 16 has a 6-bit scale: low 4 bits from
// scales[g % 8] (nibble g / 8), high 2 bits from scales[8 + g % 4] (bits 2*(g / 4)); bias 32.
void deq_q3_k(const uint8_t* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += 110, y += kQK) {
    const uint8_t* hm = x;
    const uint8_t* qs = x + 32;
    const uint8_t* s = x + 96;
    const float d = ldh(x + 108);
    for (int g = 0; g < 16; ++g) {
      int lo = (s[g % 8] >> (4 * (g / 8))) & 0x0F;
      int hi = (s[8 + g % 4] >> (2 * (g / 4))) & 0x03;
      const float dl = d * float((lo | hi << 4) - 32);
      const int h = g / 8, j = (g % 8) / 2, l0 = (g % 2) * 16;
      for (int l = l0; l < l0 + 16; ++l) {
        int q = (qs[32 * h + l] >> (2 * j)) & 3;
        if (!((hm[l] >> (4 * h + j)) & 1)) q -= 4;
        y[128 * h + 32 * j + l] = dl * float(q);
      }
    }
  }
}

// 6-bit scale and min of sub-block s (0..7) from the 12 packed bytes shared by Q4_K/Q5_K:
// s < 4: scale = b[s] & 63, min = b[s+4] & 63; s >= 4: the low 4 bits come from b[s+4]
// (scale: low nibble, min: high nibble) and the high 2 bits from the top bits of
// b[s-4] (scale) and b[s] (min).
inline void k4_scale_min(const uint8_t* b, int s, int* sc, int* mn) {
  if (s < 4) {
    *sc = b[s] & 63;
    *mn = b[s + 4] & 63;
  } else {
    *sc = (b[s + 4] & 0x0F) | (b[s - 4] >> 6) << 4;
    *mn = (b[s + 4] >> 4) | (b[s] >> 6) << 4;
  }
}

// Q4_K: {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}. Sub-block s (32 elements) uses
// nibble (s % 2) of qs[32 * (s / 2) + l].
void deq_q4_k(const uint8_t* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += 144, y += kQK) {
    const float d = ldh(x), dmin = ldh(x + 2);
    const uint8_t* sb = x + 4;
    const uint8_t* qs = x + 16;
    for (int s = 0; s < 8; ++s) {
      int sc, mn;
      k4_scale_min(sb, s, &sc, &mn);
      const float d1 = d * float(sc), m1 = dmin * float(mn);
      const uint8_t* q = qs + 32 * (s / 2);
      const int sh = 4 * (s % 2);
      for (int l = 0; l < 32; ++l) y[32 * s + l] = d1 * float((q[l] >> sh) & 0x0F) - m1;
    }
  }
}

// Q5_K: {f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}: as Q4_K plus a fifth
// bit, bit s of qh[l], for element 32s + l.
void deq_q5_k(const uint8_t* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += 176, y += kQK) {
    const float d = ldh(x), dmin = ldh(x + 2);
    const uint8_t* sb = x + 4;
    const uint8_t* qh = x + 16;
    const uint8_t* qs = x + 48;
    for (int s = 0; s < 8; ++s) {
      int sc, mn;
      k4_scale_min(sb, s, &sc, &mn);
      const float d1 = d * float(sc), m1 = dmin * float(mn);
      const uint8_t* q = qs + 32 * (s / 2);
      const int sh = 4 * (s % 2);
      for (int l = 0; l < 32; ++l) {
        int v = ((q[l] >> sh) & 0x0F) | ((qh[l] >> s) & 1) << 4;
        y[32 * s + l] = d1 * float(v) - m1;
      }
    }
  }
}

// Q6_K: {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}. Element e = 128h + 32j + l:
// low 4 bits are nibble (j / 2) of ql[64h + 32(j % 2) + l], high 2 bits are bits 2j.. of
// qh[32h + l]; value - 32, scaled by scales[e / 16].
void deq_q6_k(const uint8_t* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += 210, y += kQK) {
    const uint8_t* ql = x;
    const uint8_t* qh = x + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(x + 192);
    const float d = ldh(x + 208);
    for (int g = 0; g < 16; ++g) {
      const float dl = d * float(sc[g]);
      const int h = g / 8, j = (g % 8) / 2, l0 = (g % 2) * 16;
      for (int l = l0; l < l0 + 16; ++l) {
        int lo = (ql[64 * h + 32 * (j % 2) + l] >> (4 * (j / 2))) & 0x0F;
        int hi = (qh[32 * h + l] >> (2 * j)) & 0x03;
        y[128 * h + 32 * j + l] = dl * float((lo | hi << 4) - 32);
      }
    }
  }
}

// Dequantises `nb` blocks; the type must be supported (checked by callers).
void deq_blocks(GgmlType t, const uint8_t* x, float* y, int64_t nb) {
  switch (t) {
    case GgmlType::F32: std::memcpy(y, x, size_t(nb) * 4); return;
    case GgmlType::F16:
      for (int64_t i = 0; i < nb; ++i) y[i] = f16_to_f32(ld16(x + 2 * i));
      return;
    case GgmlType::BF16:
      for (int64_t i = 0; i < nb; ++i) y[i] = bf16_to_f32(ld16(x + 2 * i));
      return;
    case GgmlType::F64:
      for (int64_t i = 0; i < nb; ++i) y[i] = float(std::bit_cast<double>(ld64(x + 8 * i)));
      return;
    case GgmlType::I8:
      for (int64_t i = 0; i < nb; ++i) y[i] = float(int8_t(x[i]));
      return;
    case GgmlType::I16:
      for (int64_t i = 0; i < nb; ++i) y[i] = float(int16_t(ld16(x + 2 * i)));
      return;
    case GgmlType::I32:
      for (int64_t i = 0; i < nb; ++i) y[i] = float(int32_t(ld32(x + 4 * i)));
      return;
    case GgmlType::I64:
      for (int64_t i = 0; i < nb; ++i) y[i] = float(int64_t(ld64(x + 8 * i)));
      return;
    case GgmlType::Q4_0: deq_q4_0(x, y, nb); return;
    case GgmlType::Q4_1: deq_q4_1(x, y, nb); return;
    case GgmlType::Q5_0: deq_q5_0(x, y, nb); return;
    case GgmlType::Q5_1: deq_q5_1(x, y, nb); return;
    case GgmlType::Q8_0: deq_q8_0(x, y, nb); return;
    case GgmlType::Q8_1: deq_q8_1(x, y, nb); return;
    case GgmlType::Q2_K: deq_q2_k(x, y, nb); return;
    case GgmlType::Q3_K: deq_q3_k(x, y, nb); return;
    case GgmlType::Q4_K: deq_q4_k(x, y, nb); return;
    case GgmlType::Q5_K: deq_q5_k(x, y, nb); return;
    case GgmlType::Q6_K: deq_q6_k(x, y, nb); return;
    default: return;  // unreachable: callers check type_supported()
  }
}

// Splits the work into chunks of whole blocks; parallel for large tensors.
void deq_parallel(GgmlType t, const uint8_t* x, float* y, int64_t nblocks, int64_t be,
                  int64_t bb) {
  constexpr int64_t kChunkElems = 1 << 16;
  const int64_t per = std::max<int64_t>(1, kChunkElems / be);
  const int64_t nchunks = (nblocks + per - 1) / per;
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (nchunks > 1)
#endif
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t b0 = c * per, n = std::min(per, nblocks - b0);
    deq_blocks(t, x + b0 * bb, y + b0 * be, n);
  }
}

}  // namespace

// ---------------------------------------------------------------- types

const char* type_name(GgmlType t) {
  const TypeTraits* tt = traits(t);
  return tt ? tt->name : "unknown";
}

bool type_supported(GgmlType t) {
  const TypeTraits* tt = traits(t);
  return tt && tt->supported;
}

bool type_block(GgmlType t, int64_t* block_elems, int64_t* block_bytes) {
  const TypeTraits* tt = traits(t);
  if (!tt) return false;
  if (block_elems) *block_elems = tt->block_elems;
  if (block_bytes) *block_bytes = tt->block_bytes;
  return true;
}

// ---------------------------------------------------------------- Value

const char* Value::kind_name(Kind k) {
  switch (k) {
    case Kind::U8: return "u8";
    case Kind::I8: return "i8";
    case Kind::U16: return "u16";
    case Kind::I16: return "i16";
    case Kind::U32: return "u32";
    case Kind::I32: return "i32";
    case Kind::F32: return "f32";
    case Kind::BOOL: return "bool";
    case Kind::STRING: return "string";
    case Kind::ARRAY: return "array";
    case Kind::U64: return "u64";
    case Kind::I64: return "i64";
    case Kind::F64: return "f64";
  }
  return "unknown";
}

bool Value::is_int() const {
  switch (kind) {
    case Kind::U8: case Kind::I8: case Kind::U16: case Kind::I16: case Kind::U32:
    case Kind::I32: case Kind::U64: case Kind::I64:
      return true;
    default:
      return false;
  }
}

bool Value::is_float() const { return kind == Kind::F32 || kind == Kind::F64; }

int64_t Value::as_int() const {
  if (kind == Kind::BOOL) return std::get<bool>(v) ? 1 : 0;
  if (!is_int()) fail("metadata value: expected an integer, found {}", kind_name(kind));
  if (const auto* u = std::get_if<uint64_t>(&v)) {
    if (*u > uint64_t(std::numeric_limits<int64_t>::max()))
      fail("metadata value: {} {} does not fit in int64", kind_name(kind), *u);
    return int64_t(*u);
  }
  return std::get<int64_t>(v);
}

double Value::as_float() const {
  if (is_float()) return std::get<double>(v);
  if (is_int()) {
    if (const auto* u = std::get_if<uint64_t>(&v)) return double(*u);
    return double(std::get<int64_t>(v));
  }
  fail("metadata value: expected a number, found {}", kind_name(kind));
}

const std::string& Value::as_string() const {
  if (kind != Kind::STRING) fail("metadata value: expected a string, found {}", kind_name(kind));
  return std::get<std::string>(v);
}

const Array& Value::as_array() const {
  if (kind != Kind::ARRAY) fail("metadata value: expected an array, found {}", kind_name(kind));
  return *std::get<std::shared_ptr<Array>>(v);
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;  // validated against overflow when parsed
  return n;
}

// ---------------------------------------------------------------- File

File::File(const fs::path& path) : map_(path) {
  const std::string p = path.string();
  const uint8_t* data = map_.data();
  const size_t size = map_.size();
  Parser in(p, data, size);

  // ---- header ----
  if (size < 4) fail("{}: file is {} bytes, too small for a GGUF header (24 bytes)", p, size);
  uint32_t magic = ld32(data);
  if (magic != kMagic)
    fail("{}: bad magic: expected 'GGUF' (47 47 55 46), found {:02x} {:02x} {:02x} {:02x}", p,
         data[0], data[1], data[2], data[3]);
  in.u32([] { return std::string("magic"); });
  version_ = in.u32([] { return std::string("header field 'version'"); });
  if (version_ != 2 && version_ != 3) {
    if (version_ == 1)
      fail("{}: GGUF version 1 is not supported (expected version 2 or 3)", p);
    if ((version_ & 0xFFFFu) == 0 && (version_ >> 24) >= 1 && (version_ >> 24) <= 3)
      fail("{}: GGUF version field reads {:#x}: a big-endian file? only little-endian GGUF "
           "(version 2 or 3) is supported", p, version_);
    fail("{}: unsupported GGUF version {} (expected 2 or 3)", p, version_);
  }
  const uint64_t n_tensors = in.u64([] { return std::string("header field 'tensor_count'"); });
  const uint64_t n_kv = in.u64([] { return std::string("header field 'kv_count'"); });
  // Cheapest encodings: a kv is key length + kind + 1 byte; a tensor info is name
  // length + n_dims + type + offset.
  constexpr uint64_t kMinKv = 8 + 4 + 1, kMinTensor = 8 + 4 + 4 + 8;
  if (n_kv > in.remaining() / kMinKv)
    fail("{}: header field 'kv_count' is {}, but the {} bytes after the header can hold at "
         "most {} entries", p, n_kv, in.remaining(), in.remaining() / kMinKv);
  if (n_tensors > in.remaining() / kMinTensor)
    fail("{}: header field 'tensor_count' is {}, but the {} bytes after the header can hold at "
         "most {} tensor infos", p, n_tensors, in.remaining(), in.remaining() / kMinTensor);

  // ---- metadata ----
  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key = in.str([&] { return fmt::format("metadata entry #{} key", i); });
    if (kv_.count(key)) fail("{}: metadata key '{}' appears more than once (entry #{})", p, key, i);
    size_t at = in.pos();
    uint32_t k = in.u32([&] { return fmt::format("metadata '{}' value kind", key); });
    if (!kind_known(k))
      fail("{}: metadata '{}': value kind {} at offset {} is unknown (expected 0..12)", p, key, k,
           at);
    Value val = in.value(Kind(k), key, 0, nullptr);
    kv_.emplace(std::move(key), std::move(val));
  }

  if (const Value* a = find("general.alignment")) {
    if (!a->is_int())
      fail("{}: metadata 'general.alignment': expected an unsigned integer (u32), found {}", p,
           Value::kind_name(a->kind));
    // Negative signed values are rejected below as "not a power of two".
    const auto* u = std::get_if<uint64_t>(&a->v);
    const int64_t sv = u ? 0 : std::get<int64_t>(a->v);
    const uint64_t al = u ? *u : (sv > 0 ? uint64_t(sv) : 0);
    if (al == 0 || (al & (al - 1)) != 0)
      fail("{}: metadata 'general.alignment': expected a nonzero power of two, found {}", p,
           u ? fmt::format("{}", *u) : fmt::format("{}", sv));
    alignment_ = al;
  }

  // ---- tensor infos ----
  tensors_.reserve(size_t(n_tensors));
  for (uint64_t i = 0; i < n_tensors; ++i) {
    TensorInfo t;
    t.name = in.str([&] { return fmt::format("tensor info #{} name", i); });
    auto tw = [&] { return fmt::format("tensor '{}'", t.name); };
    if (tensor_index_.count(t.name))
      fail("{}: tensor '{}' appears more than once (tensor info #{})", p, t.name, i);
    const uint32_t n_dims = in.u32([&] { return tw() + " n_dims"; });
    if (n_dims > uint32_t(kMaxDims))
      fail("{}: tensor '{}': n_dims is {}, expected at most {}", p, t.name, n_dims, kMaxDims);
    int64_t numel = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      uint64_t v = in.u64([&] { return fmt::format("{} ne[{}]", tw(), d); });
      if (v == 0 || v > uint64_t(std::numeric_limits<int64_t>::max()))
        fail("{}: tensor '{}': ne[{}] is {}, expected a positive dimension", p, t.name, d, v);
      if (__builtin_mul_overflow(numel, int64_t(v), &numel))
        fail("{}: tensor '{}': element count overflows int64 (ne[{}] = {})", p, t.name, d, v);
      t.ne.push_back(int64_t(v));
    }
    const uint32_t type = in.u32([&] { return tw() + " type"; });
    t.type = GgmlType(type);
    int64_t be = 0, bb = 0;
    if (!type_block(t.type, &be, &bb))
      fail("{}: tensor '{}': unknown ggml type {}", p, t.name, type);
    const int64_t ne0 = t.ne.empty() ? 1 : t.ne[0];
    if (ne0 % be != 0)
      fail("{}: tensor '{}': ne[0] is {}, expected a multiple of the {} block size {}", p, t.name,
           ne0, type_name(t.type), be);
    const uint64_t nblocks = uint64_t(numel / be);
    if (nblocks > std::numeric_limits<uint64_t>::max() / uint64_t(bb))
      fail("{}: tensor '{}': byte size overflows ({} blocks of {} bytes)", p, t.name, nblocks, bb);
    t.nbytes = nblocks * uint64_t(bb);
    t.offset = in.u64([&] { return tw() + " offset"; });  // relative for now
    if (t.offset % alignment_ != 0)
      fail("{}: tensor '{}': data offset {} is not a multiple of the alignment {}", p, t.name,
           t.offset, alignment_);
    tensor_index_.emplace(t.name, tensors_.size());
    tensors_.push_back(std::move(t));
  }

  // ---- data section ----
  const uint64_t info_end = in.pos();
  const uint64_t data_start = (info_end + alignment_ - 1) < info_end
                                  ? std::numeric_limits<uint64_t>::max()
                                  : (info_end + alignment_ - 1) / alignment_ * alignment_;
  if (!tensors_.empty() && data_start > size)
    fail("{}: data section starts at offset {} (tensor infos end at {}, alignment {}), past end "
         "of file (size {})", p, data_start, info_end, alignment_, size);
  for (TensorInfo& t : tensors_) {
    const uint64_t rel = t.offset;
    if (rel > size - data_start || t.nbytes > size - data_start - rel)
      fail("{}: tensor '{}': data [offset {} in data section at {}, {} bytes] runs past end of "
           "file (size {})", p, t.name, rel, data_start, t.nbytes, size);
    t.offset = data_start + rel;
  }
  // Tensors must not overlap.
  std::vector<const TensorInfo*> by_off;
  by_off.reserve(tensors_.size());
  for (const TensorInfo& t : tensors_) by_off.push_back(&t);
  std::sort(by_off.begin(), by_off.end(),
            [](const TensorInfo* a, const TensorInfo* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < by_off.size(); ++i) {
    const TensorInfo* a = by_off[i - 1];
    const TensorInfo* b = by_off[i];
    if (a->offset + a->nbytes > b->offset)
      fail("{}: tensors '{}' [offset {}, {} bytes] and '{}' [offset {}, {} bytes] overlap", p,
           a->name, a->offset, a->nbytes, b->name, b->offset, b->nbytes);
  }
}

const Value* File::find(const std::string& key) const {
  auto it = kv_.find(key);
  return it == kv_.end() ? nullptr : &it->second;
}

namespace {
[[noreturn]] void wrong_kind(const fs::path& p, const std::string& key, const char* expected,
                             const Value& v) {
  fail("{}: metadata '{}': expected {}, found {}", p.string(), key, expected,
       Value::kind_name(v.kind));
}
}  // namespace

const std::string& File::get_string(const std::string& key) const {
  const Value* v = find(key);
  if (!v) fail("{}: metadata key '{}' is missing (expected a string)", path().string(), key);
  if (v->kind != Value::Kind::STRING) wrong_kind(path(), key, "a string", *v);
  return std::get<std::string>(v->v);
}

std::optional<int64_t> File::get_int_opt(const std::string& key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (!v->is_int()) wrong_kind(path(), key, "an integer", *v);
  if (const auto* u = std::get_if<uint64_t>(&v->v)) {
    if (*u > uint64_t(std::numeric_limits<int64_t>::max()))
      fail("{}: metadata '{}': {} value {} does not fit in int64", path().string(), key,
           Value::kind_name(v->kind), *u);
    return int64_t(*u);
  }
  return std::get<int64_t>(v->v);
}

int64_t File::get_int(const std::string& key) const {
  auto r = get_int_opt(key);
  if (!r) fail("{}: metadata key '{}' is missing (expected an integer)", path().string(), key);
  return *r;
}

std::optional<double> File::get_float_opt(const std::string& key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (!v->is_float() && !v->is_int()) wrong_kind(path(), key, "a number", *v);
  return v->as_float();
}

double File::get_float(const std::string& key) const {
  auto r = get_float_opt(key);
  if (!r) fail("{}: metadata key '{}' is missing (expected a number)", path().string(), key);
  return *r;
}

std::optional<std::string> File::get_string_opt(const std::string& key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (v->kind != Value::Kind::STRING) wrong_kind(path(), key, "a string", *v);
  return std::get<std::string>(v->v);
}

std::vector<std::string> File::get_string_array(const std::string& key) const {
  const Value* v = find(key);
  if (!v) fail("{}: metadata key '{}' is missing (expected an array of strings)", path().string(),
               key);
  if (v->kind != Value::Kind::ARRAY || v->elem != Value::Kind::STRING)
    fail("{}: metadata '{}': expected an array of strings, found {}{}{}", path().string(), key,
         Value::kind_name(v->kind), v->kind == Value::Kind::ARRAY ? " of " : "",
         v->kind == Value::Kind::ARRAY ? Value::kind_name(v->elem) : "");
  std::vector<std::string> out;
  const Array& a = v->as_array();
  out.reserve(a.size());
  for (const Value& e : a) out.push_back(std::get<std::string>(e.v));
  return out;
}

const TensorInfo* File::find_tensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

void File::dequantize(const TensorInfo& t, float* out) const {
  const std::string p = path().string();
  int64_t be = 0, bb = 0;
  if (!type_block(t.type, &be, &bb))
    fail("{}: tensor '{}': unknown ggml type {}", p, t.name, uint32_t(t.type));
  if (!type_supported(t.type))
    fail("{}: tensor '{}': dequantisation of {} is not supported", p, t.name, type_name(t.type));
  // Re-check the description against this file, so a TensorInfo from elsewhere (or a
  // modified copy) cannot cause an out-of-bounds read.
  int64_t numel = 1;
  for (int64_t d : t.ne) {
    if (d <= 0 || __builtin_mul_overflow(numel, d, &numel))
      fail("{}: tensor '{}': invalid shape", p, t.name);
  }
  if (numel % be != 0 || (!t.ne.empty() && t.ne[0] % be != 0))
    fail("{}: tensor '{}': ne[0] is not a multiple of the {} block size {}", p, t.name,
         type_name(t.type), be);
  const uint64_t nblocks = uint64_t(numel / be);
  if (nblocks > std::numeric_limits<uint64_t>::max() / uint64_t(bb) ||
      nblocks * uint64_t(bb) != t.nbytes)
    fail("{}: tensor '{}': {} bytes recorded, but {} elements of {} need {} blocks of {} bytes", p,
         t.name, t.nbytes, numel, type_name(t.type), nblocks, bb);
  if (t.offset > map_.size() || t.nbytes > map_.size() - t.offset)
    fail("{}: tensor '{}': data [offset {}, {} bytes] runs past end of file (size {})", p, t.name,
         t.offset, t.nbytes, map_.size());
  deq_parallel(t.type, map_.data() + t.offset, out, int64_t(nblocks), be, bb);
}

void dequantize_row(GgmlType t, const void* src, float* dst, int64_t n) {
  int64_t be = 0, bb = 0;
  if (!type_block(t, &be, &bb)) fail("dequantize_row: unknown ggml type {}", uint32_t(t));
  if (!type_supported(t)) fail("dequantize_row: dequantisation of {} is not supported", type_name(t));
  if (n < 0 || n % be != 0)
    fail("dequantize_row: {} elements is not a multiple of the {} block size {}", n, type_name(t),
         be);
  deq_blocks(t, static_cast<const uint8_t*>(src), dst, n / be);
}

}  // namespace talon::gguf
