#include "io/safetensors.h"

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>

#include "util/error.h"

namespace talon::st {

using json = nlohmann::json;

// Largest header we accept; real headers are a few MB for the biggest checkpoints.
static constexpr uint64_t kMaxHeader = 256ull << 20;

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

File::File(const fs::path& path) : map_(path) {
  const std::string p = path.string();
  const size_t size = map_.size();
  if (size < 8) fail("{}: not a safetensors file: {} bytes, need at least 8 for the header length", p, size);
  uint64_t n = 0;
  std::memcpy(&n, map_.data(), 8);
  if (n > size - 8) fail("{}: header length {} runs past end of file (size {})", p, n, size);
  if (n > kMaxHeader) fail("{}: header length {} exceeds the {} byte limit", p, n, kMaxHeader);
  const char* hdr = reinterpret_cast<const char*>(map_.data() + 8);
  json j = json::parse(hdr, hdr + n, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) fail("{}: header is not valid JSON", p);
  if (!j.is_object()) fail("{}: header must be a JSON object", p);
  const uint8_t* base = map_.data() + 8 + n;
  const uint64_t data_size = size - 8 - n;

  struct Span { uint64_t b, e; size_t i; };
  std::vector<Span> spans;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) fail("{}: __metadata__ must be an object of strings", p);
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) fail("{}: __metadata__['{}'] must be a string", p, m.key());
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!v.is_object()) fail("{}: tensor '{}': entry must be an object", p, name);
    auto dt = v.find("dtype");
    auto sh = v.find("shape");
    auto off = v.find("data_offsets");
    if (dt == v.end() || !dt->is_string()) fail("{}: tensor '{}': missing string field 'dtype'", p, name);
    if (sh == v.end() || !sh->is_array()) fail("{}: tensor '{}': missing array field 'shape'", p, name);
    if (off == v.end() || !off->is_array() || off->size() != 2)
      fail("{}: tensor '{}': 'data_offsets' must be [begin, end]", p, name);
    TensorView t;
    t.name = name;
    if (!dtype_from_name(dt->get<std::string>(), &t.dtype))
      fail("{}: tensor '{}': unsupported dtype '{}'", p, name, dt->get<std::string>());
    if (sh->size() > 8) fail("{}: tensor '{}': {} dimensions, at most 8 supported", p, name, sh->size());
    uint64_t numel = 1;
    for (auto& d : *sh) {
      if (!d.is_number_unsigned()) fail("{}: tensor '{}': shape entries must be non-negative integers", p, name);
      uint64_t x = d.get<uint64_t>();
      if (x != 0 && numel > (uint64_t(1) << 62) / x)
        fail("{}: tensor '{}': shape {} overflows", p, name, sh->dump());
      numel *= x;
      t.shape.push_back(int64_t(x));
    }
    for (auto& o : *off)
      if (!o.is_number_unsigned()) fail("{}: tensor '{}': data_offsets must be non-negative integers", p, name);
    uint64_t b = (*off)[0].get<uint64_t>(), e = (*off)[1].get<uint64_t>();
    if (b > e || e > data_size)
      fail("{}: tensor '{}': data_offsets [{}, {}] outside the data section of {} bytes", p, name, b, e, data_size);
    if (numel > ~uint64_t(0) / dtype_size(t.dtype))  // before multiplying: numel * size must not wrap
      fail("{}: tensor '{}': shape {} of {} overflows", p, name, sh->dump(), dtype_name(t.dtype));
    uint64_t want = numel * dtype_size(t.dtype);
    if (e - b != want)
      fail("{}: tensor '{}': {} {} needs {} bytes, data_offsets give {}", p, name, dtype_name(t.dtype),
           shape_str(t.shape), want, e - b);
    t.data = base + b;
    t.nbytes = size_t(want);
    spans.push_back({b, e, tensors_.size()});
    index_[name] = tensors_.size();
    tensors_.push_back(std::move(t));
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.b < b.b; });
  for (size_t i = 1; i < spans.size(); ++i)
    if (spans[i].b < spans[i - 1].e && spans[i].e > spans[i].b)
      fail("{}: tensors '{}' and '{}' overlap", p, tensors_[spans[i - 1].i].name, tensors_[spans[i].i].name);
}

namespace {
std::string content_sha(const std::vector<std::pair<const void*, size_t>>& data,
                        const std::map<std::string, std::string>& meta) {
  Sha256 h;
  for (auto& [d, n] : data) h.update(d, n);
  for (auto& [k, v] : meta) {
    if (k == kChecksumKey) continue;
    h.update(k.data(), k.size());
    h.update("", 1);
    h.update(v.data(), v.size());
    h.update("", 1);
  }
  return h.hex();
}
}  // namespace

void File::verify_checksum(bool required) const {
  auto it = metadata_.find(kChecksumKey);
  if (it == metadata_.end()) {
    if (required) fail("{}: no checksum ('{}' in __metadata__); the file was not written by this talon", path().string(), kChecksumKey);
    return;
  }
  uint64_t n = 0;
  std::memcpy(&n, map_.data(), 8);
  const uint8_t* base = map_.data() + 8 + n;
  const std::string got = content_sha({{base, map_.size() - 8 - n}}, metadata_);
  if (got != it->second)
    fail("{}: checksum mismatch: content SHA-256 is {}, the header records {}; the file is corrupt", path().string(), got,
         it->second);
}

const TensorView* File::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const TensorView& File::get(const std::string& name) const {
  const TensorView* t = find(name);
  if (!t) fail("{}: tensor '{}' not found", path().string(), name);
  return *t;
}

const TensorView& File::get(const std::string& name, DType dtype, const std::vector<int64_t>& shape) const {
  const TensorView& t = get(name);
  if (t.dtype != dtype)
    fail("{}: tensor '{}': expected dtype {}, got {}", path().string(), name, dtype_name(dtype), dtype_name(t.dtype));
  if (t.shape != shape)
    fail("{}: tensor '{}': expected shape {}, got {}", path().string(), name, shape_str(shape), shape_str(t.shape));
  return t;
}

void Writer::add(const std::string& name, DType dtype, std::vector<int64_t> shape, const void* data,
                 size_t nbytes) {
  int64_t numel = 1;
  for (auto d : shape) numel *= d;
  TALON_CHECK(size_t(numel) * dtype_size(dtype) == nbytes, "safetensors writer: tensor '{}' {} {} needs {} bytes, got {}",
              name, dtype_name(dtype), shape_str(shape), size_t(numel) * dtype_size(dtype), nbytes);
  for (auto& e : entries_) TALON_CHECK(e.name != name, "safetensors writer: duplicate tensor '{}'", name);
  entries_.push_back({name, dtype, std::move(shape), data, nbytes});
}

std::string Writer::write(const fs::path& path, size_t* bytes_written) const {
  json h = json::object();
  uint64_t off = 0;
  for (auto& e : entries_) {
    h[e.name] = {{"dtype", std::string(dtype_name(e.dtype))}, {"shape", e.shape}, {"data_offsets", {off, off + e.nbytes}}};
    off += e.nbytes;
  }
  if (checksum_) {
    std::vector<std::pair<const void*, size_t>> data;
    for (auto& e : entries_) data.push_back({e.data, e.nbytes});
    auto meta = metadata_;
    meta[kChecksumKey] = content_sha(data, metadata_);
    h["__metadata__"] = meta;
  } else if (!metadata_.empty()) {
    h["__metadata__"] = metadata_;
  }
  std::string hs = h.dump();
  while ((hs.size() + 8) % 8 != 0) hs += ' ';  // keep the data section 8-byte aligned
  uint64_t n = hs.size();
  Sha256 sha;
  AtomicFile f(path);
  auto put = [&](const void* d, size_t k) {
    f.write(d, k);
    sha.update(d, k);
  };
  put(&n, 8);
  put(hs.data(), hs.size());
  for (auto& e : entries_) put(e.data, e.nbytes);
  f.commit();
  if (bytes_written) *bytes_written = 8 + hs.size() + off;
  return sha.hex();
}

}  // namespace talon::st
