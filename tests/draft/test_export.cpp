// talon export: a checkpoint written here (as `talon train` writes it) for the llama_gqa
// fixture target is exported to both engine formats, the files are read back raw (names,
// shapes, dtypes, config keys in each engine's convention) and through
// load_exported_draft(); every refusal is triggered once. Also `talon report`'s parsing and
// rendering.
#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <functional>
#include <set>
#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "model/checkpoint.h"
#include "tests/test_util.h"
#include "draft/export.h"
#include "draft/report.h"

using namespace talon;
using namespace talon::train;
using talon::testing::error_of;
using json = nlohmann::json;

namespace {

// llama_gqa: H 40, I 72, 5 heads / 1 kv head of 8, V 97, L 3, llama3 RoPE.
constexpr int64_t H = 40, I = 72, NH = 5, NKV = 1, HD = 8, V = 97, VD = 20, L = 3;

fs::path target_dir() { return fs::path(talon::testing::source_dir()) / "tests/fixtures/golden/llama_gqa"; }

struct CkptSpec {
  json meta;
  std::map<std::string, std::vector<float>> w;  // trainer names, flat
  std::vector<int64_t> d2t;
  std::vector<uint8_t> t2d;
};

// What `talon train` would write for this target, with values that are not bf16-exact.
CkptSpec make_spec() {
  CkptSpec s;
  const std::string sha = open_checkpoint(target_dir())->config().hash();
  s.meta = {{"job", {{"target_config_sha256", sha}, {"ttt_steps", 3}}},
            {"step", 7},
            {"draft",
             {{"hidden_size", H}, {"intermediate_size", I}, {"num_attention_heads", NH}, {"num_key_value_heads", NKV},
              {"head_dim", HD}, {"vocab_size", V}, {"draft_vocab_size", VD}, {"rms_norm_eps", 1e-5},
              {"norm_before_residual", false}}},
            {"aux_layer_ids", {1, 2, 3}},
            {"final_layer_id", L},
            {"convention", "input-of-layer"}};
  const std::vector<std::pair<std::string, int64_t>> sizes = {
      {"fc", H * 3 * H},   {"in_ln", H},        {"hidden_norm", H},  {"wq", NH * HD * 2 * H}, {"wk", NKV * HD * 2 * H},
      {"wv", NKV * HD * 2 * H}, {"wo", H * NH * HD}, {"post_ln", H}, {"gate", I * H},        {"up", I * H},
      {"down", H * I},     {"norm", H},         {"lm_head", VD * H}};
  uint64_t x = 88172645463325252ull;
  for (auto& [n, k] : sizes) {
    auto& v = s.w[n];
    for (int64_t i = 0; i < k; ++i) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      v.push_back(float(double(x >> 11) * 0x1.0p-53 - 0.5) * 0.37f);
    }
  }
  // Draft ids: 20 ascending target ids, gaps of 2 to 5.
  s.t2d.assign(V, 0);
  for (int64_t i = 0; i < VD; ++i) {
    const int64_t t = 3 + 4 * i + (i % 3);
    s.d2t.push_back(t - i);
    s.t2d[size_t(t)] = 1;
  }
  return s;
}

void write_ckpt(const CkptSpec& s, const fs::path& file) {
  st::Writer w;
  for (auto& [n, v] : s.w) w.add("w." + n, DType::F32, {int64_t(v.size())}, v.data(), v.size() * 4);
  w.add("d2t", DType::I64, {int64_t(s.d2t.size())}, s.d2t.data(), s.d2t.size() * 8);
  w.add("t2d", DType::U8, {int64_t(s.t2d.size())}, s.t2d.data(), s.t2d.size());
  w.set_metadata("talon.train", s.meta.dump());
  fs::create_directories(file.parent_path());
  w.write(file);
}

struct train_export : ::testing::Test {
  fs::path dir;
  void SetUp() override {
    dir = fs::temp_directory_path() /
          ("talon-export-" + std::to_string(::getpid()) + "-" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  void TearDown() override { fs::remove_all(dir); }

  ExportOptions opts(const fs::path& run, const std::string& out, ExportFormat f, DType dt) {
    ExportOptions o;
    o.checkpoint = run;
    o.model = target_dir();
    o.out = dir / out;
    o.format = f;
    o.dtype = dt;
    o.speculative_tokens = 4;
    return o;
  }
};

const std::vector<std::string> kTrainerNames = {"fc", "in_ln", "hidden_norm", "wq",   "wk",   "wv",     "wo",
                                                "post_ln", "gate", "up",    "down", "norm", "lm_head"};

// Bits of a float.
uint32_t bits(float f) { return std::bit_cast<uint32_t>(f); }

// True when b is the bf16 value nearest to a (ties to even), checked against both bf16
// neighbours of a rather than by re-running a rounding routine.
bool is_nearest_bf16(float a, float b) {
  if ((bits(b) & 0xffffu) != 0) return false;
  const float lo = std::bit_cast<float>(bits(a) & 0xffff0000u);
  const float hi = std::bit_cast<float>((bits(a) & 0xffff0000u) + 0x10000u);
  const double dl = std::fabs(double(a) - lo), dh = std::fabs(double(hi) - a);
  if (dl < dh) return b == lo;
  if (dh < dl) return b == hi;
  return b == (((bits(lo) >> 16) & 1u) ? hi : lo);
}

json read_json(const fs::path& p) { return json::parse(read_text_file(p)); }

}  // namespace

TEST_F(train_export, SpeculatorsFp32RoundTripIsBitExact) {
  const CkptSpec s = make_spec();
  write_ckpt(s, dir / "run/checkpoint.safetensors");
  run_export(opts(dir / "run", "spec", ExportFormat::Speculators, DType::F32));

  // Raw files, as vLLM reads them.
  const json cfg = read_json(dir / "spec/config.json");
  EXPECT_EQ(cfg["architectures"], json({"Eagle3Speculator"}));
  EXPECT_EQ(cfg["speculators_model_type"], "eagle3");
  EXPECT_TRUE(cfg["speculators_version"].is_string());
  EXPECT_EQ(cfg["draft_vocab_size"], VD);
  EXPECT_EQ(cfg["norm_before_residual"], false);  // explicit: vLLM assumes true when absent
  EXPECT_EQ(cfg["target_hidden_size"], H);
  EXPECT_EQ(cfg["eagle_aux_hidden_state_layer_ids"], json({1, 2, 3}));  // input-of-layer, as trained
  const json& tl = cfg["transformer_layer_config"];
  EXPECT_EQ(tl["num_hidden_layers"], 1);
  EXPECT_EQ(tl["vocab_size"], V);
  EXPECT_EQ(tl["hidden_size"], H);
  EXPECT_EQ(tl["intermediate_size"], I);
  EXPECT_EQ(tl["num_attention_heads"], NH);
  EXPECT_EQ(tl["num_key_value_heads"], NKV);
  EXPECT_EQ(tl["head_dim"], HD);
  EXPECT_EQ(tl["rope_theta"], 10000.0);
  EXPECT_EQ(tl["rope_scaling"]["rope_type"], "llama3");
  EXPECT_EQ(tl["rope_scaling"]["factor"], 8.0);
  EXPECT_EQ(tl["rope_scaling"]["original_max_position_embeddings"], 32);
  EXPECT_EQ(tl["max_position_embeddings"], 64);
  const json& sc = cfg["speculators_config"];
  EXPECT_EQ(sc["algorithm"], "eagle3");
  EXPECT_EQ(sc["default_proposal_method"], "greedy");
  EXPECT_EQ(sc["proposal_methods"][0]["proposal_type"], "greedy");
  EXPECT_EQ(sc["proposal_methods"][0]["speculative_tokens"], 4);
  EXPECT_EQ(sc["verifier"]["architectures"], json({"LlamaForCausalLM"}));
  EXPECT_EQ(fs::path(sc["verifier"]["name_or_path"].get<std::string>()), fs::absolute(target_dir()).lexically_normal());

  st::File f(dir / "spec/model.safetensors");
  const std::vector<std::pair<std::string, std::vector<int64_t>>> expect = {
      {"fc.weight", {H, 3 * H}},
      {"layers.0.input_layernorm.weight", {H}},
      {"layers.0.hidden_norm.weight", {H}},
      {"layers.0.self_attn.q_proj.weight", {NH * HD, 2 * H}},
      {"layers.0.self_attn.k_proj.weight", {NKV * HD, 2 * H}},
      {"layers.0.self_attn.v_proj.weight", {NKV * HD, 2 * H}},
      {"layers.0.self_attn.o_proj.weight", {H, NH * HD}},
      {"layers.0.post_attention_layernorm.weight", {H}},
      {"layers.0.mlp.gate_proj.weight", {I, H}},
      {"layers.0.mlp.up_proj.weight", {I, H}},
      {"layers.0.mlp.down_proj.weight", {H, I}},
      {"norm.weight", {H}},
      {"lm_head.weight", {VD, H}}};
  EXPECT_EQ(f.tensors().size(), expect.size() + 2);  // + d2t, t2d; no embedding
  for (size_t i = 0; i < expect.size(); ++i) {
    const auto& t = f.get(expect[i].first, DType::F32, expect[i].second);
    const auto& src = s.w.at(kTrainerNames[i]);
    ASSERT_EQ(t.nbytes, src.size() * 4) << expect[i].first;
    EXPECT_EQ(std::memcmp(t.data, src.data(), t.nbytes), 0) << expect[i].first;
  }
  EXPECT_EQ(talon::testing::read_i64(f, "d2t"), s.d2t);
  const auto& t2d = f.get("t2d", DType::BOOL, {V});
  EXPECT_EQ(std::vector<uint8_t>(t2d.data, t2d.data + V), s.t2d);

  // Read back.
  ExportedDraft e = load_exported_draft(dir / "spec");
  EXPECT_EQ(e.format, ExportFormat::Speculators);
  EXPECT_EQ(e.dtype, DType::F32);
  EXPECT_EQ(e.aux_layer_ids, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(e.speculative_tokens, 4);
  EXPECT_EQ(e.config.H, H);
  EXPECT_EQ(e.config.I, I);
  EXPECT_EQ(e.config.n_heads, NH);
  EXPECT_EQ(e.config.n_kv_heads, NKV);
  EXPECT_EQ(e.config.head_dim, HD);
  EXPECT_EQ(e.config.V, V);
  EXPECT_EQ(e.config.Vd, VD);
  EXPECT_EQ(e.config.rms_eps, 1e-5);
  EXPECT_FALSE(e.config.norm_before_residual);
  EXPECT_EQ(e.config.rope.type, "llama3");
  EXPECT_EQ(e.config.rope.theta, 10000.0);
  EXPECT_EQ(e.config.rope.factor, 8.0);
  EXPECT_EQ(e.config.rope.low_freq_factor, 1.0);
  EXPECT_EQ(e.config.rope.high_freq_factor, 4.0);
  EXPECT_EQ(e.config.rope.original_max_position, 32);
  auto named = e.weights.named();
  for (size_t i = 0; i < named.size(); ++i) EXPECT_EQ(*named[i].second, s.w.at(named[i].first)) << named[i].first;
  EXPECT_EQ(e.vocab.d2t, s.d2t);
  EXPECT_EQ(e.vocab.t2d, s.t2d);
  for (int64_t i = 0; i < VD; ++i) EXPECT_EQ(e.vocab.kept[size_t(i)], 3 + 4 * i + (i % 3));
}

TEST_F(train_export, SGLangBf16RoundTripIsNearestBf16) {
  const CkptSpec s = make_spec();
  write_ckpt(s, dir / "run/checkpoint.safetensors");
  run_export(opts(dir / "run/checkpoint.safetensors", "sg", ExportFormat::SGLang, DType::BF16));

  const json cfg = read_json(dir / "sg/config.json");
  EXPECT_EQ(cfg["architectures"], json({"LlamaForCausalLMEagle3"}));
  EXPECT_EQ(cfg["num_hidden_layers"], 1);
  EXPECT_EQ(cfg["vocab_size"], V);
  EXPECT_EQ(cfg["draft_vocab_size"], VD);
  EXPECT_EQ(cfg["tie_word_embeddings"], false);
  EXPECT_EQ(cfg["hidden_size"], H);
  EXPECT_EQ(cfg["torch_dtype"], "bfloat16");
  // SGLang adds 1 to these: Talon's input-of-layer ids 1, 2, 3 are written as 0, 1, 2.
  EXPECT_EQ(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"], json({0, 1, 2}));
  EXPECT_FALSE(cfg.contains("speculators_model_type"));

  st::File f(dir / "sg/model.safetensors");
  EXPECT_EQ(f.tensors().size(), 15u);
  EXPECT_NE(f.find("midlayer.self_attn.q_proj.weight"), nullptr);
  EXPECT_EQ(f.find("layers.0.self_attn.q_proj.weight"), nullptr);
  EXPECT_EQ(f.find("embed_tokens.weight"), nullptr);
  f.get("midlayer.mlp.down_proj.weight", DType::BF16, {H, I});
  f.get("fc.weight", DType::BF16, {H, 3 * H});
  f.get("lm_head.weight", DType::BF16, {VD, H});

  ExportedDraft e = load_exported_draft(dir / "sg");
  EXPECT_EQ(e.format, ExportFormat::SGLang);
  EXPECT_EQ(e.dtype, DType::BF16);
  EXPECT_EQ(e.aux_layer_ids, (std::vector<int64_t>{1, 2, 3}));
  auto named = e.weights.named();
  int64_t rounded = 0;
  for (auto& [n, v] : named) {
    const auto& src = s.w.at(n);
    ASSERT_EQ(v->size(), src.size()) << n;
    for (size_t i = 0; i < src.size(); ++i) {
      ASSERT_TRUE(is_nearest_bf16(src[i], (*v)[i])) << n << "[" << i << "]: " << src[i] << " -> " << (*v)[i];
      rounded += (*v)[i] != src[i];
    }
  }
  EXPECT_GT(rounded, 0);  // the values are not bf16-exact, so the check above is not vacuous
  EXPECT_EQ(e.vocab.d2t, s.d2t);
  EXPECT_EQ(e.vocab.t2d, s.t2d);
}

TEST_F(train_export, BothFormatsReadBackAsTheCheckpoint) {
  write_ckpt(make_spec(), dir / "run/checkpoint.safetensors");
  auto tc = open_checkpoint(target_dir());
  TrainedDraft t = load_trained_draft(dir / "run", tc->config(), "target");
  for (ExportFormat f : {ExportFormat::Speculators, ExportFormat::SGLang}) {
    const std::string name = export_format_name(f);
    run_export(opts(dir / "run", name, f, DType::F32));
    ExportedDraft e = load_exported_draft(dir / name);
    EXPECT_EQ(e.format, f);
    auto a = t.weights.named(), b = e.weights.named();
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(*a[i].second, *b[i].second) << name << " " << a[i].first;
    EXPECT_EQ(e.vocab.kept, t.vocab.kept) << name;
    EXPECT_EQ(e.vocab.d2t, t.vocab.d2t) << name;
    EXPECT_EQ(e.vocab.t2d, t.vocab.t2d) << name;
    EXPECT_EQ(e.aux_layer_ids, t.aux_layer_ids) << name;
    EXPECT_EQ(e.config.H, t.config.H);
    EXPECT_EQ(e.config.I, t.config.I);
    EXPECT_EQ(e.config.n_heads, t.config.n_heads);
    EXPECT_EQ(e.config.n_kv_heads, t.config.n_kv_heads);
    EXPECT_EQ(e.config.head_dim, t.config.head_dim);
    EXPECT_EQ(e.config.V, t.config.V);
    EXPECT_EQ(e.config.Vd, t.config.Vd);
    EXPECT_EQ(e.config.rms_eps, t.config.rms_eps);
    EXPECT_EQ(e.config.norm_before_residual, t.config.norm_before_residual);
    EXPECT_EQ(e.config.rope.type, t.config.rope.type);
    EXPECT_EQ(e.config.rope.theta, t.config.rope.theta);
    EXPECT_EQ(e.config.rope.factor, t.config.rope.factor);
    EXPECT_EQ(e.config.rope.low_freq_factor, t.config.rope.low_freq_factor);
    EXPECT_EQ(e.config.rope.high_freq_factor, t.config.rope.high_freq_factor);
    EXPECT_EQ(e.config.rope.original_max_position, t.config.rope.original_max_position);
  }
}

TEST_F(train_export, RefusalsNameTheFieldAndWriteNothing) {
  struct Case {
    const char* what;
    std::function<void(CkptSpec&)> mutate;
    const char* expect;
    ExportFormat format = ExportFormat::Speculators;
  };
  const std::vector<Case> cases = {
      {"target hash", [](CkptSpec& s) { s.meta["job"]["target_config_sha256"] = std::string(64, 'a'); },
       "job.target_config_sha256 is aaaa"},
      {"hidden size", [](CkptSpec& s) { s.meta["draft"]["hidden_size"] = 48; }, "hidden_size is 48, but --model"},
      {"vocab size", [](CkptSpec& s) { s.meta["draft"]["vocab_size"] = 98; }, "vocab_size is 98, but --model"},
      {"d2t length", [](CkptSpec& s) { s.d2t.push_back(s.d2t.back() + 1); },
       "tensor 'd2t' has 21 entries, expected draft_vocab_size 20"},
      {"t2d length", [](CkptSpec& s) { s.t2d.pop_back(); }, "tensor 't2d' has 96 entries, expected the target's vocab_size 97"},
      {"d2t order", [](CkptSpec& s) { std::swap(s.d2t[4], s.d2t[5]), s.d2t[4] += 1, s.d2t[5] -= 1; },
       "d2t is not strictly increasing"},
      {"d2t range", [](CkptSpec& s) { s.d2t.back() += 40; }, "outside [0, 97)"},
      {"t2d set", [](CkptSpec& s) { s.t2d[0] = 1; }, "t2d[0] = 1 but target id 0 is not in d2t"},
      {"aux range", [](CkptSpec& s) { s.meta["aux_layer_ids"] = {1, 2, 4}; }, "aux layer id 4 is outside [0, 3]"},
      {"aux negative", [](CkptSpec& s) { s.meta["aux_layer_ids"] = {-1, 2, 3}; }, "aux layer id -1 is outside [0, 3]"},
      {"aux count", [](CkptSpec& s) { s.meta["aux_layer_ids"] = {1, 2}; }, "exactly 3 hidden states"},
      {"convention", [](CkptSpec& s) { s.meta["convention"] = "output-of-layer"; },
       "convention is \"output-of-layer\", expected \"input-of-layer\""},
      {"weight size", [](CkptSpec& s) { s.w["wq"].pop_back(); }, "tensor 'w.wq' has 3199 elements"},
      {"nbr for sglang", [](CkptSpec& s) { s.meta["draft"]["norm_before_residual"] = true; },
       "norm_before_residual = true, which SGLang", ExportFormat::SGLang},
      {"embedding id for sglang", [](CkptSpec& s) { s.meta["aux_layer_ids"] = {0, 1, 2}; },
       "aux layer id 0 (the embeddings) cannot be written for SGLang", ExportFormat::SGLang},
  };
  for (const Case& c : cases) {
    CkptSpec s = make_spec();
    c.mutate(s);
    const fs::path run = dir / "bad";
    fs::remove_all(run);
    write_ckpt(s, run / "checkpoint.safetensors");
    const std::string err = error_of([&] { run_export(opts(run, "out", c.format, DType::F32)); });
    EXPECT_NE(err.find(c.expect), std::string::npos) << c.what << ": " << err;
    EXPECT_FALSE(fs::exists(dir / "out")) << c.what;
  }
  // The unmutated spec exports, so each refusal above is due to its one change.
  write_ckpt(make_spec(), dir / "good/checkpoint.safetensors");
  EXPECT_EQ(error_of([&] { run_export(opts(dir / "good", "out", ExportFormat::SGLang, DType::F32)); }), "(no error)");
  // A checkpoint of this target refused against another target.
  ExportOptions o = opts(dir / "good", "other", ExportFormat::Speculators, DType::F32);
  o.model = fs::path(talon::testing::source_dir()) / "tests/fixtures/golden/llama_tied";
  EXPECT_NE(error_of([&] { run_export(o); }).find("has config sha256"), std::string::npos);
  // An existing, non-empty output directory is not overwritten.
  EXPECT_NE(error_of([&] { run_export(opts(dir / "good", "out", ExportFormat::Speculators, DType::F32)); })
                .find("already exists and is not an empty directory"),
            std::string::npos);
  EXPECT_EQ(read_json(dir / "out/config.json")["architectures"], json({"LlamaForCausalLMEagle3"}));
  // No temporary directories left behind.
  for (auto& p : fs::directory_iterator(dir))
    EXPECT_EQ(p.path().filename().string().find(".tmp-"), std::string::npos) << p.path();
}

TEST_F(train_export, LoadExportedDraftRejectsTamperedDirectories) {
  write_ckpt(make_spec(), dir / "run/checkpoint.safetensors");
  run_export(opts(dir / "run", "spec", ExportFormat::Speculators, DType::F32));
  const fs::path cpath = dir / "spec/config.json";
  const std::string good = read_text_file(cpath);
  auto with = [&](const std::function<void(json&)>& m) {
    json j = json::parse(good);
    m(j);
    write_file_atomic(cpath, j.dump());
    return error_of([&] { load_exported_draft(dir / "spec"); });
  };
  EXPECT_NE(with([](json& j) { j["transformer_layer_config"]["num_hidden_layers"] = 2; }).find("num_hidden_layers is 2"),
            std::string::npos);
  EXPECT_NE(with([](json& j) { j.erase("norm_before_residual"); }).find("missing field 'norm_before_residual'"),
            std::string::npos);
  EXPECT_NE(with([](json& j) { j.erase("eagle_aux_hidden_state_layer_ids"); })
                .find("missing field 'eagle_aux_hidden_state_layer_ids'"),
            std::string::npos);
  EXPECT_NE(with([](json& j) { j["draft_vocab_size"] = 21; }).find("tensor 'lm_head.weight' has shape [20, 40], expected [21, 40]"),
            std::string::npos);
  EXPECT_EQ(with([](json&) {}), "(no error)");
}

// ---- talon report -----------------------------------------------------------------------

namespace {
size_t count(const std::string& s, const std::string& sub) {
  size_t n = 0;
  for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + 1)) ++n;
  return n;
}
// The data-points attribute of the polyline of `series` inside the chart `chart`; -1 if absent.
long points_of(const std::string& html, const std::string& chart, const std::string& series) {
  const size_t a = html.find("data-chart=\"" + chart + "\"");
  if (a == std::string::npos) return -1;
  const size_t b = html.find("</svg>", a);
  const size_t p = html.find("data-series=\"" + series + "\" data-points=\"", a);
  if (p == std::string::npos || p > b) return -1;
  return std::stol(html.substr(p + series.size() + 28));
}
std::string train_line(int step, double loss) {
  return json{{"step", step}, {"epoch", 0}, {"loss", loss}, {"acc", {0.5, 0.25, 0.125}}, {"sim_accept_len", 1.7},
              {"lr", 1e-4}, {"grad_norm", 0.3}, {"tokens_per_s", 1000.0}}
             .dump() +
         "\n";
}
}  // namespace

TEST(train_report, OneChartPerMetricWithOnePointPerRecord) {
  std::string text;
  for (int i = 0; i < 5; ++i) text += train_line(i, 3.0 - 0.1 * i);
  const auto rs = parse_metrics(text, "m.jsonl");
  ASSERT_EQ(rs.size(), 5u);
  const std::string html = render_report_html(rs, "run <x>");
  EXPECT_EQ(count(html, "<svg"), 6u);  // loss, acc, sim_accept_len, lr, grad_norm, tokens_per_s
  EXPECT_EQ(count(html, "<script"), 0u);
  EXPECT_NE(html.find("run &lt;x&gt;"), std::string::npos);
  EXPECT_EQ(points_of(html, "loss", "train"), 5);
  for (int k = 0; k < 3; ++k) EXPECT_EQ(points_of(html, "acc", "k=" + std::to_string(k)), 5) << k;
  EXPECT_EQ(points_of(html, "acc", "k=3"), -1);
  EXPECT_EQ(points_of(html, "sim_accept_len", "train"), 5);
  EXPECT_EQ(points_of(html, "lr", "train"), 5);
  EXPECT_EQ(points_of(html, "tokens_per_s", "train"), 5);
  EXPECT_EQ(html.find("data-chart=\"cond_acc\""), std::string::npos);
  // The summary's best loss is the lowest one, at step 4.
  EXPECT_NE(html.find("<td>loss</td><td>2.6</td><td>2.6</td><td>4</td>"), std::string::npos);
}

TEST(train_report, EvalRecordsAreTheirOwnSeries) {
  std::string text;
  for (int i = 0; i < 4; ++i) text += train_line(i, 2.0);
  text += json{{"split", "eval"}, {"step", 1}, {"loss", 2.5}, {"acc", {0.4, 0.2}}, {"cond_acc", {0.4, 0.5}},
               {"sim_accept_len", 1.5}}.dump() + "\n";
  text += json{{"split", "eval"}, {"step", 3}, {"loss", 2.4}, {"acc", {0.45, 0.25}}, {"cond_acc", {0.45, 0.55}},
               {"sim_accept_len", 1.6}}.dump() + "\n";
  const std::string html = render_report_html(parse_metrics(text, "m.jsonl"), "r");
  EXPECT_EQ(points_of(html, "loss", "train"), 4);
  EXPECT_EQ(points_of(html, "loss", "eval"), 2);
  EXPECT_EQ(points_of(html, "acc", "train k=2"), 4);
  EXPECT_EQ(points_of(html, "acc", "eval k=1"), 2);
  EXPECT_EQ(points_of(html, "acc", "eval k=2"), -1);
  EXPECT_EQ(points_of(html, "cond_acc", "eval k=0"), 2);
  EXPECT_EQ(points_of(html, "sim_accept_len", "eval"), 2);
  EXPECT_EQ(points_of(html, "lr", "eval"), -1);
  EXPECT_EQ(count(html, "<svg"), 7u);
}

TEST(train_report, BadMetricsNameTheLine) {
  const std::string ok = train_line(0, 1.0);
  EXPECT_NE(error_of([&] { parse_metrics(ok + ok + "{not json\n", "run/metrics.jsonl"); }).find("run/metrics.jsonl:3: not a JSON object"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse_metrics(ok + "{\"loss\": 1}\n", "m"); }).find("m:2: field 'step' must be an integer"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse_metrics("{\"step\": 0, \"acc\": 0.5}\n", "m"); }).find("m:1: field 'acc' must be an array"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse_metrics("{\"step\": 0, \"loss\": \"x\"}\n", "m"); }).find("m:1: field 'loss' must be a number"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse_metrics("\n", "m"); }).find("m: no metric records"), std::string::npos);
  EXPECT_NE(error_of([&] { run_report({{"/nonexistent/run"}, "/tmp/x.html", {}}); }).find("/nonexistent/run: missing"),
            std::string::npos);
}

namespace {
// An eval.json with chain-3 at T=0 over two categories, a tree, a T=1 chain and a baseline-only
// result; counts chosen by hand.
std::string eval_json() {
  auto res = [](const char* config, double t, const char* cat, std::vector<int64_t> reached,
                std::vector<int64_t> accepted) {
    return json{{"config", config},
                {"temperature", t},
                {"category", cat},
                {"turns", 2},
                {"speculative", {{"reached_per_depth", reached}, {"accepted_per_depth", accepted}}}};
  };
  json j = {{"format", "talon.eval"}, {"results", json::array()}};
  j["results"].push_back(res("chain-3", 0, "a", {100, 40, 10}, {40, 10, 5}));
  j["results"].push_back(res("chain-3", 0, "b", {300, 200, 100}, {200, 100, 30}));
  j["results"].push_back(res("tree-d6-k8-n32", 0, "a", {100, 90}, {90, 50}));
  j["results"].push_back(res("chain-3", 1, "a", {100, 10, 1}, {10, 1, 0}));
  j["results"].push_back(json{{"config", "chain-3"}, {"temperature", 0}, {"category", "c"}, {"speculative", nullptr}});
  return j.dump();
}
std::string heldout(double c0, double c1) {
  return json{{"split", "eval"}, {"step", 9}, {"loss", 2.0}, {"acc", {c0, c0 * c1}}, {"cond_acc", {c0, c1}},
              {"sim_accept_len", 1.5}}.dump() + "\n";
}
}  // namespace

TEST(train_report, ServedAcceptanceIsPooledPerConfigAndTemperature) {
  const auto served = parse_served_acceptance(eval_json(), "e.json");
  ASSERT_EQ(served.size(), 3u);  // chain-3 T=0, tree T=0, chain-3 T=1
  EXPECT_EQ(served[0].config, "chain-3");
  EXPECT_EQ(served[0].reached, (std::vector<int64_t>{400, 240, 110}));
  EXPECT_EQ(served[0].accepted, (std::vector<int64_t>{240, 110, 35}));
  EXPECT_EQ(served[0].turns, 4);
  EXPECT_EQ(served[2].temperature, 1.0);
}

TEST(train_report, TrainedAndServedAcceptanceSideBySide) {
  const auto served = parse_served_acceptance(eval_json(), "e.json");
  // Served depth 0: 240/400 = 0.6 over 400 drafts. Held-back 0.62 agrees; 0.9 does not.
  std::string text = train_line(0, 2.0) + heldout(0.62, 0.5);
  auto rs = parse_metrics(text, "m.jsonl");
  AcceptanceComparison c = compare_acceptance(rs, served);
  ASSERT_EQ(c.served.size(), 1u);  // only the greedy chain
  EXPECT_EQ(c.trained_step, 9);
  EXPECT_NE(c.verdict.find("agrees"), std::string::npos) << c.verdict;
  const std::string html = render_report_html(rs, "r", &served, "e.json");
  EXPECT_NE(html.find("<tr><td>0</td><td>0.620</td><td>0.600</td><td>400</td></tr>"), std::string::npos);
  EXPECT_NE(html.find("<tr><td>1</td><td>0.500</td><td>0.458</td><td>240</td></tr>"), std::string::npos);
  EXPECT_NE(html.find("<tr><td>2</td><td></td><td>0.318</td><td>110</td></tr>"), std::string::npos);
  EXPECT_EQ(points_of(html, "acceptance_per_depth", "trained (held-back)"), 2);
  EXPECT_EQ(points_of(html, "acceptance_per_depth", "served chain-3"), 3);
  EXPECT_EQ(html.find("served tree"), std::string::npos);

  rs = parse_metrics(train_line(0, 2.0) + heldout(0.9, 0.5), "m.jsonl");
  c = compare_acceptance(rs, served);
  EXPECT_NE(c.verdict.find("0.300 below"), std::string::npos) << c.verdict;
  rs = parse_metrics(train_line(0, 2.0) + heldout(0.3, 0.5), "m.jsonl");
  EXPECT_NE(compare_acceptance(rs, served).verdict.find("above"), std::string::npos);
  // Without held-back records or greedy chains the section says what to run.
  rs = parse_metrics(train_line(0, 2.0), "m.jsonl");
  EXPECT_NE(compare_acceptance(rs, served).verdict.find("--eval-fraction"), std::string::npos);
  std::vector<ServedAcceptance> trees(served.begin() + 1, served.begin() + 2);
  rs = parse_metrics(train_line(0, 2.0) + heldout(0.6, 0.5), "m.jsonl");
  EXPECT_NE(compare_acceptance(rs, trees).verdict.find("--chain"), std::string::npos);
}

TEST(train_report, BadEvalJsonNamesTheField) {
  EXPECT_NE(error_of([] { parse_served_acceptance("[1]", "e.json"); }).find("e.json: not a `talon eval`"),
            std::string::npos);
  json j = json::parse(eval_json());
  j["results"][1]["speculative"]["accepted_per_depth"] = {400, 1, 1};
  EXPECT_NE(error_of([&] { parse_served_acceptance(j.dump(), "e.json"); }).find("e.json: results[1].speculative: depth 0 accepts 400 of 300"),
            std::string::npos);
  j = json::parse(eval_json());
  j["results"][0]["speculative"]["reached_per_depth"] = {1, -2, 3};
  EXPECT_NE(error_of([&] { parse_served_acceptance(j.dump(), "e.json"); }).find("'reached_per_depth' must hold non-negative"),
            std::string::npos);
  j = json::parse(eval_json());
  j["results"][2].erase("config");
  EXPECT_NE(error_of([&] { parse_served_acceptance(j.dump(), "e.json"); }).find("results[2]: field 'config'"),
            std::string::npos);
}

namespace talon::train {

// Axis ticks sit at 1, 2 or 5 times a power of ten, cover the data, and read as distinct labels
// ("0.5 1.0 1.5", not "0.6457 1.364").
TEST(train_report, NiceTicksAreRoundAndCoverTheData) {
  const std::pair<double, double> ranges[] = {{0.3457, 1.364}, {0, 105000}, {1e-5, 1e-4}, {2.5, 2.5}, {-3, 7}};
  for (auto [lo, hi] : ranges) {
    const AxisTicks t = nice_ticks(lo, hi, 5);
    ASSERT_GE(t.values.size(), 3u) << lo << " " << hi;
    EXPECT_LE(t.values.size(), 12u) << lo << " " << hi;
    EXPECT_LE(t.lo, lo);
    EXPECT_GE(t.hi, hi);
    const double mant = t.step / std::pow(10.0, std::floor(std::log10(t.step) + 1e-9));
    EXPECT_TRUE(std::fabs(mant - 1) < 1e-9 || std::fabs(mant - 2) < 1e-9 || std::fabs(mant - 5) < 1e-9) << t.step;
    std::set<std::string> labels;
    for (double v : t.values) {
      EXPECT_NEAR(v / t.step, std::round(v / t.step), 1e-6) << v;
      labels.insert(tick_label(v, t.decimals));
    }
    EXPECT_EQ(labels.size(), t.values.size()) << lo << " " << hi;
  }
  const AxisTicks steps = nice_ticks(0, 3, 6, true);
  EXPECT_GE(steps.step, 1);
  EXPECT_EQ(steps.step, std::round(steps.step));
  EXPECT_EQ(tick_label(0.5, 1), "0.5");
  EXPECT_EQ(tick_label(50000, 0), "50k");
}

// A chart draws the same on any page: its frame is not filled (an unstyled rect is black), rates
// keep their 0..1 axis, and reference lines are drawn.
TEST(train_report, ChartsStyleThemselves) {
  Chart ch{"acc", "Acceptance", "rate", {{"k=0", {{0, 0.42}, {1, 0.47}}}}, "depth"};
  ch.y_min = 0, ch.y_max = 1;
  ch.ref_lines.push_back({0.5, "half"});
  const std::string svg = render_line_chart_svg(ch);
  EXPECT_NE(svg.find("fill=\"none\" stroke=\"#888\" stroke-width=\"1\" class=\"plot-area\""), std::string::npos);
  EXPECT_NE(svg.find(">0.0</text>"), std::string::npos);
  EXPECT_NE(svg.find(">1.0</text>"), std::string::npos);
  EXPECT_NE(svg.find("data-ref=\"0.5\""), std::string::npos);
  EXPECT_EQ(svg.find("class=\"frame\""), std::string::npos);
}

}  // namespace talon::train
