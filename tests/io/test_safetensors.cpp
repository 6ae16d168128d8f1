#include <gtest/gtest.h>

#include <cstring>
#include <fstream>

#include "io/safetensors.h"
#include "util/error.h"

using namespace talon;

namespace {

fs::path tmpdir() {
  fs::path d = fs::temp_directory_path() / ("talon-st-" + std::to_string(::getpid()));
  fs::create_directories(d);
  return d;
}

std::string raw_file(const std::string& header, const std::string& data) {
  uint64_t n = header.size();
  std::string s(reinterpret_cast<const char*>(&n), 8);
  return s + header + data;
}

void write_bytes(const fs::path& p, const std::string& b) { std::ofstream(p, std::ios::binary) << b; }

TEST(Safetensors, WriteReadRoundTripAndChecksum) {
  const fs::path p = tmpdir() / "rt.safetensors";
  std::vector<float> a = {1, 2, 3, 4, 5, 6};
  std::vector<int64_t> b = {7, -8};
  st::Writer w;
  w.add("a", DType::F32, {2, 3}, a.data(), a.size() * 4);
  w.add("b", DType::I64, {2}, b.data(), 16);
  w.set_metadata("k", "v");
  size_t bytes = 0;
  const std::string sha = w.write(p, &bytes);
  EXPECT_EQ(bytes, fs::file_size(p));
  EXPECT_EQ(sha, sha256_file_hex(p));
  st::File f(p);
  const auto& ta = f.get("a", DType::F32, {2, 3});
  EXPECT_EQ(0, std::memcmp(ta.data, a.data(), 24));
  EXPECT_EQ(f.metadata().at("k"), "v");
  EXPECT_EQ((8 + std::memcmp(f.get("b").data, b.data(), 16)), 8);
  // Header JSON is padded so the data section starts 8-byte aligned.
  uint64_t n;
  std::ifstream(p, std::ios::binary).read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_THROW(f.get("a", DType::BF16, {2, 3}), Error);
  EXPECT_THROW(f.get("a", DType::F32, {3, 2}), Error);
  EXPECT_THROW(f.get("zz"), Error);
}

TEST(Safetensors, WriterRejectsSizeMismatchAndDuplicates) {
  float x[2] = {};
  st::Writer w;
  EXPECT_THROW(w.add("x", DType::F32, {3}, x, 8), Error);
  w.add("x", DType::F32, {2}, x, 8);
  EXPECT_THROW(w.add("x", DType::F32, {2}, x, 8), Error);
}

struct Bad {
  const char* name;
  std::string bytes;
  const char* expect;
};

TEST(Safetensors, MalformedFilesGiveNamedErrors) {
  const std::string d8(8, '\0');
  const std::vector<Bad> cases = {
      {"short", "abc", "need at least 8"},
      {"hdr_past_end", raw_file("{}", "").substr(0, 8) + "{", "runs past end"},
      {"not_json", raw_file("{nope", ""), "not valid JSON"},
      {"not_object", raw_file("[1,2]", ""), "must be a JSON object"},
      {"no_dtype", raw_file(R"({"t":{"shape":[2],"data_offsets":[0,8]}})", d8), "missing string field 'dtype'"},
      {"bad_dtype", raw_file(R"({"t":{"dtype":"F8","shape":[2],"data_offsets":[0,8]}})", d8), "unsupported dtype 'F8'"},
      {"neg_shape", raw_file(R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", d8), "non-negative"},
      {"size_mismatch", raw_file(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", d8), "needs 12 bytes"},
      {"past_data", raw_file(R"({"t":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", d8), "outside the data section"},
      {"overflow", raw_file(R"({"t":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]}})", d8), "overflows"},
      {"overlap", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", d8), "overlap"},
      {"bad_meta", raw_file(R"({"__metadata__":{"k":1}})", ""), "must be a string"},
      {"offsets_reversed", raw_file(R"({"t":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", d8), "outside the data section"},
  };
  for (auto& c : cases) {
    const fs::path p = tmpdir() / (std::string(c.name) + ".safetensors");
    write_bytes(p, c.bytes);
    try {
      st::File f(p);
      ADD_FAILURE() << c.name << ": no error";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(p.string()), std::string::npos) << c.name << ": " << m;
      EXPECT_NE(m.find(c.expect), std::string::npos) << c.name << ": " << m;
    }
  }
}

}  // namespace
