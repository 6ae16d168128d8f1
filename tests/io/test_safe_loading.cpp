// Safe loading of files from strangers: names from manifests cannot leave their
// directory, checksummed safetensors detect flipped bytes, hostile sizes are refused
// before anything is allocated, and Jinja templates run inside bounds.
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "data/chat_formats.h"
#include "data/features.h"
#include "data/samples.h"
#include "io/safetensors.h"
#include "test_util.h"
#include "text/jinja.h"
#include "text/tokenizer.h"
#include "util/error.h"
#include "util/file.h"

using namespace talon;
using talon::testing::error_of;
using json = nlohmann::json;

namespace {

fs::path fresh_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("talon-safe-" + std::to_string(::getpid())) / name;
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

void put(const fs::path& p, const std::string& s) { std::ofstream(p, std::ios::binary) << s; }

bool has(const std::string& s, const std::string& sub) { return s.find(sub) != std::string::npos; }

TEST(PathInside, PlainNamesResolveInsideTheDirectory) {
  const fs::path d = fresh_dir("plain");
  put(d / "a.bin", "x");
  fs::create_directories(d / "sub");
  EXPECT_EQ(path_inside(d, "a.bin", "m.json: f"), d / "a.bin");
  EXPECT_EQ(path_inside(d, "sub/b.bin", "m.json: f"), d / "sub" / "b.bin");  // need not exist
  EXPECT_EQ(path_inside(d, "./a.bin", "m.json: f"), d / "./a.bin");
}

TEST(PathInside, EscapesAreRefusedNamingTheField) {
  const fs::path d = fresh_dir("escape");
  for (const std::string bad : {"../x", "sub/../../x", "..", "/etc/passwd", ""}) {
    const std::string e = error_of([&] { path_inside(d, bad, "out/manifest.json: shards[3].file"); });
    EXPECT_TRUE(has(e, "out/manifest.json: shards[3].file")) << bad << ": " << e;
    EXPECT_FALSE(has(e, "(no error)")) << bad;
  }
  EXPECT_TRUE(has(error_of([&] { path_inside(d, "../x", "f"); }), "leaves its directory"));
  EXPECT_TRUE(has(error_of([&] { path_inside(d, "/etc/passwd", "f"); }), "absolute path"));
  EXPECT_TRUE(has(error_of([&] { path_inside(d, std::string("a\0b", 3), "f"); }), "NUL"));
}

TEST(PathInside, SymlinksMustStayInside) {
  const fs::path d = fresh_dir("links");
  const fs::path outside = fresh_dir("links-outside");
  put(outside / "secret", "s");
  put(d / "real.bin", "r");
  fs::create_symlink(outside / "secret", d / "out.bin");
  fs::create_symlink("real.bin", d / "in.bin");
  fs::create_symlink(outside, d / "outdir");
  fs::create_symlink(d / "missing", d / "dangling");
  EXPECT_EQ(path_inside(d, "in.bin", "f"), d / "in.bin");
  EXPECT_TRUE(has(error_of([&] { path_inside(d, "out.bin", "f"); }), "outside"));
  EXPECT_TRUE(has(error_of([&] { path_inside(d, "outdir/secret", "f"); }), "outside"));
  EXPECT_TRUE(has(error_of([&] { path_inside(d, "dangling", "f"); }), "cannot resolve"));
}

TEST(PathInside, ManifestsCannotPointOutside) {
  // A feature dataset whose manifest names a file outside: check_dataset reports it.
  const fs::path d = fresh_dir("features");
  put(d / "manifest.json",
      json{{"format", "talon.features"}, {"format_version", 1}, {"status", "in_progress"}, {"hidden_size", 4},
           {"dtype", "f32"}, {"aux_layer_ids", {1, 2, 3}},
           {"shards", {{{"file", "../../etc/passwd"}, {"samples", 1}, {"tokens", 1}, {"bytes", 1}, {"sha256", "0"}}}}}
          .dump());
  const DatasetCheck c = check_dataset(d, true);
  ASSERT_FALSE(c.ok);
  ASSERT_EQ(c.problems.size(), 1u);
  EXPECT_TRUE(has(c.problems[0], "shards[0].file")) << c.problems[0];
  EXPECT_TRUE(has(c.problems[0], "leaves its directory")) << c.problems[0];
  // A prepared-tokens directory whose manifest points tokens_file elsewhere.
  const fs::path t = fresh_dir("tokens");
  put(t / "manifest.json", R"({"format": "talon.tokens", "format_version": 1, "tokens_file": "/etc/hostname",
                              "tokens_sha256": "00"})");
  const std::string e = error_of([&] { open_samples(t); });
  EXPECT_TRUE(has(e, "tokens_file")) << e;
  EXPECT_TRUE(has(e, "absolute path")) << e;
}

TEST(Checksum, FlippedBytesAreDetectedNamingTheFile) {
  const fs::path d = fresh_dir("ck");
  std::vector<float> w(64);
  for (size_t i = 0; i < w.size(); ++i) w[i] = float(i) * 0.5f;
  st::Writer wr;
  wr.add("w", DType::F32, {8, 8}, w.data(), w.size() * 4);
  wr.set_metadata("talon.train", R"({"step": 4})");
  wr.set_checksum(true);
  const fs::path p = d / "checkpoint.safetensors";
  wr.write(p);
  {
    st::File f(p);
    EXPECT_NO_THROW(f.verify_checksum(true));
    ASSERT_TRUE(f.metadata().count(st::kChecksumKey));
  }
  const std::string good = read_text_file(p);
  // Every byte of the data section and of the metadata value: a flip is caught (by the
  // checksum or, where it breaks the header, by the header checks), always naming the file.
  uint64_t n = 0;
  std::memcpy(&n, good.data(), 8);
  const size_t meta = good.find(R"(\"step\": 4)");
  ASSERT_NE(meta, std::string::npos);
  std::vector<size_t> offsets;
  for (size_t i = 8 + n; i < good.size(); i += 7) offsets.push_back(i);
  offsets.push_back(meta + 10);  // the digit 4
  for (size_t off : offsets) {
    std::string bad = good;
    bad[off] = off == meta + 10 ? '5' : char(bad[off] ^ 0x01);
    put(p, bad);
    const std::string e = error_of([&] { st::File(p).verify_checksum(true); });
    EXPECT_TRUE(has(e, p.string())) << off << ": " << e;
    EXPECT_TRUE(has(e, "checksum mismatch")) << off << ": " << e;
  }
  // A file without a checksum: refused when one is required, accepted otherwise.
  st::Writer plain;
  plain.add("w", DType::F32, {8, 8}, w.data(), w.size() * 4);
  plain.write(p);
  EXPECT_TRUE(has(error_of([&] { st::File(p).verify_checksum(true); }), "no checksum"));
  EXPECT_NO_THROW(st::File(p).verify_checksum(false));
}

TEST(HostileSizes, SafetensorsShapeWhoseByteCountWraps) {
  // 2^61 f64 elements: numel * 8 wraps to 0, which matched empty data_offsets before.
  const fs::path p = fresh_dir("st") / "wrap.safetensors";
  const std::string h = R"({"t":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0]}})";
  uint64_t n = h.size();
  put(p, std::string(reinterpret_cast<const char*>(&n), 8) + h);
  const std::string e = error_of([&] { st::File f(p); });
  EXPECT_TRUE(has(e, p.string()) && has(e, "tensor 't'")) << e;
  EXPECT_TRUE(has(e, "overflows")) << e;
}

TEST(HostileSizes, TokenizerIdsAreBoundedBeforeTablesAreSized) {
  // One token with id 2e9 would size a 2e9-entry table; it is refused naming the field.
  const std::string huge = R"({"model": {"type": "BPE", "vocab": {"a": 2000000000}, "merges": []}})";
  std::string e = error_of([&] { text::Tokenizer::from_json_text(huge, "t/tokenizer.json"); });
  EXPECT_TRUE(has(e, "t/tokenizer.json") && has(e, "model.vocab") && has(e, "out of range")) << e;
  const std::string wraps = R"({"model": {"type": "BPE", "vocab": {"a": 4294967297}, "merges": []}})";
  e = error_of([&] { text::Tokenizer::from_json_text(wraps, "t/tokenizer.json"); });
  EXPECT_TRUE(has(e, "out of range")) << e;
  const std::string added = R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},
      "added_tokens": [{"id": 1500000000, "content": "<x>", "special": true}]})";
  e = error_of([&] { text::Tokenizer::from_json_text(added, "t/tokenizer.json"); });
  EXPECT_TRUE(has(e, "added_tokens[0].id") && has(e, "out of range")) << e;
  // Ordinary sparse ids (added tokens after a gap) still load.
  const std::string ok = R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": []},
      "added_tokens": [{"id": 1000, "content": "<x>", "special": true}]})";
  EXPECT_NO_THROW(text::Tokenizer::from_json_text(ok, "t/tokenizer.json"));
}

TEST(HostileInputs, BrokenJsonArrayDatasetsEndWithAnError) {
  // Found by fuzz_dataset: a '}' at the top level of an array made the reader return empty
  // elements forever (count() and prepare never ended).
  const fs::path d = fresh_dir("arrays");
  for (const std::string body : {R"([{"question": "q", "answer": "a"}, }, {"x": 1}])", "[1,,2]", "[ } ]"}) {
    put(d / "a.json", body);
    (void)RecordReader::count(d / "a.json");  // terminates
    RecordReader r(d / "a.json");
    RecordReader::Item it;
    int n = 0;
    const std::string e = error_of([&] {
      while (r.next(it)) ++n;
    });
    EXPECT_TRUE(has(e, "JSON array")) << body << ": " << e;
    EXPECT_LE(n, 2) << body;
  }
}

std::string render(const std::string& src, text::jinja::Options opt = {}) {
  text::jinja::Template t(src, "t.jinja", opt);
  text::jinja::Dict ctx;
  return t.render(ctx);
}

TEST(JinjaSandbox, RunawayTemplatesStopWithAnError) {
  text::jinja::Options small;
  small.max_steps = 10000;
  small.max_output = 4096;
  // loops: 300 x 300 iterations > 10000 steps
  std::string e = error_of([&] { render("{% for i in range(300) %}{% for j in range(300) %}{% endfor %}{% endfor %}", small); });
  EXPECT_TRUE(has(e, "t.jinja") && has(e, "more than 10000 steps")) << e;
  // output
  e = error_of([&] { render("{% for i in range(100) %}{{ 'x' * 100 }}{% endfor %}", small); });
  EXPECT_TRUE(has(e, "output larger than the 4096 byte limit")) << e;
  // one big string, before it is built
  e = error_of([&] { render("{{ 'abc' * 1000000000000 }}"); });
  EXPECT_TRUE(has(e, "repetition larger than")) << e;
  e = error_of([&] { render("{% set s = 'a' * 40000000 %}{{ (s ~ s ~ s) | length }}"); });
  EXPECT_TRUE(has(e, "string larger than")) << e;
  e = error_of([&] { render("{{ 'x' | indent(1000000000000) }}"); });
  EXPECT_TRUE(has(e, "more than")) << e;
  // recursion
  e = error_of([&] { render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"); });
  EXPECT_TRUE(has(e, "maximum recursion depth")) << e;
  // arithmetic that would overflow 64 bits (or spin: 2 ** huge)
  for (const char* src : {"{{ 9223372036854775807 + 1 }}", "{{ 3037000500 * 3037000500 }}", "{{ 2 ** 9999999999 }}",
                          "{{ -(-9223372036854775807 - 1) }}", "{{ (-9223372036854775807 - 1) // -1 }}"}) {
    e = error_of([&] { render(src); });
    EXPECT_TRUE(has(e, "integer overflow")) << src << ": " << e;
  }
  EXPECT_EQ(render("{{ 2 ** 62 }} {{ 3 ** 0 }} {{ (-2) ** 63 }}"), "4611686018427387904 1 -9223372036854775808");
}

TEST(JinjaSandbox, DeepNestingIsASyntaxErrorNotAStackOverflow) {
  auto rep = [](const std::string& x, int n) {
    std::string s;
    for (int i = 0; i < n; ++i) s += x;
    return s;
  };
  for (const std::string& src : {"{{ " + std::string(100000, '(') + "1" + std::string(100000, ')') + " }}",
                                 std::string("{{ ") + std::string(100000, '-') + "1 }}",
                                 "{{ 1" + rep(" + 1", 100000) + " }}",
                                 "{{ a" + rep(".b", 50000) + " }}",
                                 "{{ x" + rep(" | trim", 50000) + " }}",
                                 rep("{% if true %}", 5000),
                                 "{{ " + std::string(50000, '[') + std::string(50000, ']') + " }}"}) {
    const std::string e = error_of([&] { text::jinja::Template t(src, "deep.jinja"); });
    EXPECT_TRUE(has(e, "deep.jinja")) << e.substr(0, 200);
  }
  const std::string e = error_of([&] { text::jinja::Template t("{{ " + std::string(300, '(') + "1" + std::string(300, ')') + " }}", "d.jinja"); });
  EXPECT_TRUE(has(e, "nested deeper than")) << e;
  // Ordinary nesting renders.
  EXPECT_EQ(render("{{ ((((1 + 2)))) * -(-3) }}{% if true %}{% for i in [1] %}{% if i %}ok{% endif %}{% endfor %}{% endif %}"),
            "9ok");
}

TEST(JinjaSandbox, NoFileOrEnvironmentAccess) {
  // Nothing in the language reaches files, the environment or Python internals.
  for (const char* src : {"{% include 'x' %}", "{% import 'x' as y %}", "{% extends 'x' %}",
                          "{{ ''.__class__ }}", "{{ self }}", "{{ cycler }}", "{{ lipsum() }}", "{{ config }}",
                          "{{ namespace.__init__ }}", "{{ range.__globals__ }}"}) {
    std::string out;
    const std::string e = error_of([&] { out = render(src); });
    EXPECT_TRUE(e != "(no error)" || out.empty()) << src << " rendered " << out;
  }
}

}  // namespace
