// DeepSeek-V2/V3 / Kimi-K2 support outside the golden forward (tests/model/test_golden.cpp):
// config parsing and its errors, the FP8 / int4 dequantizers against torch-made vectors
// (tests/fixtures/quant/known.safetensors, tools/make_golden_deepseek.py), weight binding
// errors, and extract's captures on a DeepSeek checkpoint.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <unistd.h>

#include "data/extract.h"
#include "backend/backend.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/deepseek.h"
#include "model/model.h"
#include "model/quant.h"
#include "model/random_checkpoint.h"
#include "tests/test_util.h"
#include "tests/tolerances.h"
#include "util/file.h"

using namespace talon;
using namespace talon::testing;
using json = nlohmann::json;

namespace {

// A DeepSeek-V3 671B-shaped config.json (the fields the official one has).
json v3() {
  return json::parse(R"({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": true,
    "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06,
    "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
    "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
    "tie_word_embeddings": false, "vocab_size": 129280,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]}})");
}

json int4_quant() {
  return json::parse(R"({"config_groups": {"group_0": {"input_activations": null, "output_activations": null,
    "targets": ["Linear"], "weights": {"actorder": null, "block_structure": null, "dynamic": false, "group_size": 32,
    "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": true,
    "type": "int"}}}, "format": "pack-quantized", "ignore": ["lm_head"], "kv_cache_scheme": null,
    "quant_method": "compressed-tensors", "quantization_status": "compressed"})");
}

std::string err(const json& j) {
  return error_of([&] { parse_hf_config(j, "cfg.json"); });
}

TEST(DeepseekConfig, ParsesTheOfficialV3Config) {
  ModelConfig c = parse_hf_config(v3(), "cfg.json");
  EXPECT_EQ(c.arch, Arch::DeepseekV3);
  EXPECT_EQ(c.ds.q_lora_rank, 1536);
  EXPECT_EQ(c.ds.kv_lora_rank, 512);
  EXPECT_EQ(c.ds.qk_head_dim(), 192);
  EXPECT_EQ(c.head_dim, 64);  // RoPE covers the rope part only
  EXPECT_EQ(c.ds.topk_method, MoeTopk::NoauxTc);
  EXPECT_EQ(c.ds.scoring_func, MoeScoring::Sigmoid);
  EXPECT_EQ(c.ds.quant_method, "fp8");
  EXPECT_EQ(c.ds.fp8_block_out, 128);
  EXPECT_EQ(c.rope.type, "yarn");
  EXPECT_EQ(c.rope.factor, 40.0);
  EXPECT_EQ(c.rope.original_max_position, 4096);
  // transformers: attention_factor = mscale(40, 1) / mscale(40, 1) = 1; softmax scale
  // 192^-0.5 * (0.1 * 1 * ln 40 + 1)^2.
  EXPECT_DOUBLE_EQ(c.rope.attention_factor, 1.0);
  const double m = 0.1 * std::log(40.0) + 1.0;
  EXPECT_NEAR(c.ds.softmax_scale, m * m / std::sqrt(192.0), 1e-12);
}

TEST(DeepseekConfig, YarnAttentionFactorIsTheMscaleRatio) {
  json j = v3();
  j["rope_scaling"]["mscale"] = 0.9;
  j["rope_scaling"]["mscale_all_dim"] = 0.8;
  ModelConfig c = parse_hf_config(j, "cfg.json");
  const double l = std::log(40.0);
  EXPECT_NEAR(c.rope.attention_factor, (0.09 * l + 1) / (0.08 * l + 1), 1e-12);
  EXPECT_NEAR(c.ds.softmax_scale, (0.08 * l + 1) * (0.08 * l + 1) / std::sqrt(192.0), 1e-12);
}

TEST(DeepseekConfig, KimiK2AndNestedTextConfig) {
  json k2 = v3();
  k2["model_type"] = "kimi_k2";
  k2["quantization_config"] = int4_quant();
  ModelConfig a = parse_hf_config(k2, "k2.json");
  EXPECT_EQ(a.arch, Arch::DeepseekV3);
  EXPECT_EQ(a.ds.quant_method, "compressed-tensors");
  EXPECT_EQ(a.ds.int4_group, 32);
  // K2.5-style multimodal wrapper: the text model's config under "text_config" and the
  // quantization_config at the top level.
  json text = v3();
  text.erase("quantization_config");
  json wrap = {{"model_type", "kimi_k25"}, {"architectures", {"KimiK25ForConditionalGeneration"}},
               {"text_config", text}, {"quantization_config", int4_quant()}};
  ModelConfig b = parse_hf_config(wrap, "k25.json");
  EXPECT_EQ(b.arch, Arch::DeepseekV3);
  EXPECT_EQ(b.ds.int4_group, 32);
  EXPECT_EQ(b.n_layers, 61);
  // Errors inside name the nested config.
  wrap["text_config"]["scoring_func"] = "tanh";
  EXPECT_NE(error_of([&] { parse_hf_config(wrap, "k25.json"); }).find("k25.json (text_config)"), std::string::npos);
}

TEST(DeepseekConfig, UnsupportedVariantsNameTheFileAndField) {
  auto expect = [](json j, const std::string& field) {
    const std::string e = err(j);
    EXPECT_NE(e.find("cfg.json"), std::string::npos) << e;
    EXPECT_NE(e.find(field), std::string::npos) << e;
  };
  json j = v3();
  j["scoring_func"] = "tanh";
  expect(j, "scoring_func");
  j = v3();
  j["topk_method"] = "random";
  expect(j, "topk_method");
  j = v3();
  j["moe_layer_freq"] = 2;
  expect(j, "moe_layer_freq");
  j = v3();
  j["n_group"] = 7;  // 256 experts do not split into 7 groups
  expect(j, "n_group");
  j = v3();
  j.erase("kv_lora_rank");
  expect(j, "kv_lora_rank");
  j = v3();
  j["quantization_config"]["weight_block_size"] = nullptr;
  expect(j, "weight_block_size");
  j = v3();
  j["quantization_config"] = int4_quant();
  j["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = false;
  expect(j, "asymmetric");
  j = v3();
  j["quantization_config"] = {{"quant_method", "awq"}};
  expect(j, "quant_method");
  // YaRN is wired for the DeepSeek forward only.
  json llama = json::parse(R"({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 100,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}})");
  expect(llama, "yarn");
}

TEST(DeepseekConfig, HashCoversTheDeepseekFields) {
  ModelConfig a = parse_hf_config(v3(), "a");
  json j = v3();
  j["topk_group"] = 3;
  ModelConfig b = parse_hf_config(j, "b");
  EXPECT_NE(a.hash(), b.hash());
  EXPECT_TRUE(a.to_json().contains("deepseek"));
}

// ------------------------------------------------------------------ dequantizers

struct Known {
  st::File f{fs::path(source_dir()) / "tests/fixtures/quant/known.safetensors"};
  WeightRef ref(const std::string& n) {
    const auto& t = f.get(n);
    return {t.dtype, t.data, t.shape};
  }
};

TEST(DeepseekQuant, Fp8E4m3EveryCodeMatchesTorch) {
  Known k;
  const auto& codes = k.f.get("fp8_codes");
  ASSERT_EQ(codes.dtype, DType::F8_E4M3);
  auto want = read_f32(k.f, "fp8_values");
  std::vector<float> got(256);
  convert_to_f32(DType::F8_E4M3, codes.data, got.data(), 256);
  for (int i = 0; i < 256; ++i) {
    if (std::isnan(want[size_t(i)])) {
      EXPECT_TRUE(std::isnan(got[size_t(i)])) << i;
    } else {
      EXPECT_EQ(std::bit_cast<uint32_t>(got[size_t(i)]), std::bit_cast<uint32_t>(want[size_t(i)])) << "code " << i;
    }
  }
}

TEST(DeepseekQuant, Fp8BlockDequantMatchesTorch) {
  Known k;
  QuantWeight q;
  q.kind = QuantWeight::Kind::Fp8Block;
  q.rows = 20;
  q.cols = 36;
  q.w = k.ref("fp8_w");
  q.scale = k.ref("fp8_scale_inv");
  q.block_rows = q.block_cols = 16;
  std::vector<float> got(20 * 36);
  dequantize(q, got.data());
  auto want = read_f32(k.f, "fp8_deq");
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4));  // the same fp32 products
  // A row range gives the same rows.
  std::vector<float> part(3 * 36);
  dequantize_rows(q, 15, 18, part.data());
  EXPECT_EQ(0, std::memcmp(part.data(), want.data() + 15 * 36, part.size() * 4));
}

TEST(DeepseekQuant, Int4PackQuantizedDequantMatchesTorch) {
  Known k;
  QuantWeight q;
  q.kind = QuantWeight::Kind::Int4Group;
  q.rows = 5;
  q.cols = 40;
  q.w = k.ref("int4_packed");
  q.scale = k.ref("int4_scale");
  q.group = 16;
  std::vector<float> got(5 * 40);
  dequantize(q, got.data());
  auto want = read_f32(k.f, "int4_deq");
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4));
  // With unit scales the dequantized values are the signed integers that were packed.
  std::vector<uint16_t> ones(15, f32_to_bf16(1.0f));
  q.scale = {DType::BF16, ones.data(), {5, 3}};
  dequantize(q, got.data());
  const auto& qi = k.f.get("int4_q");
  const auto* qv = reinterpret_cast<const int8_t*>(qi.data);
  for (int i = 0; i < 200; ++i) EXPECT_EQ(got[size_t(i)], float(qv[i])) << i;
}

// ------------------------------------------------------------------ weight binding

fs::path golden(const std::string& name) { return fs::path(source_dir()) / "tests/fixtures/golden" / name; }

// Copies a fixture with its model.safetensors edited by `edit`.
fs::path edited_copy(const std::string& name, const std::function<void(std::map<std::string, std::vector<uint8_t>>&,
                                                                       std::map<std::string, std::pair<DType, std::vector<int64_t>>>&)>& edit) {
  const fs::path dir = fs::temp_directory_path() / ("talon_ds_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy_file(golden(name) / "config.json", dir / "config.json");
  std::map<std::string, std::vector<uint8_t>> data;
  std::map<std::string, std::pair<DType, std::vector<int64_t>>> meta;
  {
    st::File f(golden(name) / "model.safetensors");
    for (auto& t : f.tensors()) {
      data[t.name].assign(t.data, t.data + t.nbytes);
      meta[t.name] = {t.dtype, t.shape};
    }
  }
  edit(data, meta);
  st::Writer w;
  for (auto& [n, bytes] : data) w.add(n, meta[n].first, meta[n].second, bytes.data(), bytes.size());
  w.write(dir / "model.safetensors");
  return dir;
}

TEST(DeepseekWeights, BindingListsMissingMisshapedAndUnusedTensors) {
  const fs::path dir = edited_copy("deepseek_v3", [](auto& data, auto& meta) {
    data.erase("model.layers.1.self_attn.kv_b_proj.weight");
    meta.erase("model.layers.1.self_attn.kv_b_proj.weight");
    // misshaped: a router with one expert too few
    auto& r = meta["model.layers.2.mlp.gate.weight"];
    r.second[0] -= 1;
    data["model.layers.2.mlp.gate.weight"].resize(size_t(r.second[0] * r.second[1] * 4));
    // unused: experts on the dense first layer
    data["model.layers.0.mlp.experts.0.up_proj.weight"] = std::vector<uint8_t>(16 * 32 * 4);
    meta["model.layers.0.mlp.experts.0.up_proj.weight"] = {DType::F32, {16, 32}};
  });
  auto ck = open_checkpoint(dir);
  const std::string e = error_of([&] { bind_deepseek_weights(*ck); });
  EXPECT_NE(e.find("3 problem(s)"), std::string::npos) << e;
  EXPECT_NE(e.find("missing tensor 'model.layers.1.self_attn.kv_b_proj.weight'"), std::string::npos) << e;
  EXPECT_NE(e.find("'model.layers.2.mlp.gate.weight'"), std::string::npos) << e;
  EXPECT_NE(e.find("expected shape [8, 32], got [7, 32]"), std::string::npos) << e;
  EXPECT_NE(e.find("unused tensor 'model.layers.0.mlp.experts.0.up_proj.weight'"), std::string::npos) << e;
  fs::remove_all(dir);
}

TEST(DeepseekWeights, QuantizedTensorsAreCheckedToo) {
  // fp8: a scale_inv of the wrong block grid; int4: a weight_shape that disagrees.
  const fs::path f8 = edited_copy("deepseek_v3_fp8", [](auto& data, auto& meta) {
    auto& s = meta["model.layers.1.self_attn.q_b_proj.weight_scale_inv"];
    s.second = {4, 1};
    data["model.layers.1.self_attn.q_b_proj.weight_scale_inv"].resize(16);
  });
  auto c8 = open_checkpoint(f8);
  const std::string e8 = error_of([&] { bind_deepseek_weights(*c8); });
  EXPECT_NE(e8.find("q_b_proj.weight_scale_inv"), std::string::npos) << e8;
  EXPECT_NE(e8.find("expected shape [4, 2], got [4, 1]"), std::string::npos) << e8;
  fs::remove_all(f8);

  const fs::path i4 = edited_copy("kimi_k2_int4", [](auto& data, auto&) {
    int64_t bad[2] = {32, 63};
    std::memcpy(data["model.layers.1.mlp.experts.3.up_proj.weight_shape"].data(), bad, 16);
  });
  auto c4 = open_checkpoint(i4);
  const std::string e4 = error_of([&] { bind_deepseek_weights(*c4); });
  EXPECT_NE(e4.find("experts.3.up_proj.weight_shape"), std::string::npos) << e4;
  EXPECT_NE(e4.find("holds [32, 63], expected [32, 64]"), std::string::npos) << e4;
  fs::remove_all(i4);
}

TEST(DeepseekWeights, DenseModelsStillRejectQuantizedDtypes) {
  const fs::path dir = fs::temp_directory_path() / ("talon_ds_dense_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy_file(golden("qwen3") / "config.json", dir / "config.json");
  std::vector<int32_t> v(4);
  st::Writer w;
  w.add("x", DType::I32, {4}, v.data(), 16);
  w.write(dir / "model.safetensors");
  const std::string e = error_of([&] { open_checkpoint(dir); });
  EXPECT_NE(e.find("dtype I32 unsupported"), std::string::npos) << e;
  fs::remove_all(dir);
}

// ------------------------------------------------------------------ random:kimi-k2 models

// `--model random:kimi-k2:L` builds Kimi-K2's published shapes without a file; bad specs
// are refused naming the expected form (the full-size model itself is exercised on the GPU).
TEST(RandomModelSpec, KimiShapesAndErrors) {
  const ModelConfig c = kimi_k2_shape(61);
  EXPECT_EQ(c.n_layers, 61);
  EXPECT_EQ(c.hidden, 7168);
  EXPECT_EQ(c.vocab, 163840);
  EXPECT_EQ(c.n_heads, 64);
  EXPECT_EQ(c.ds.n_routed_experts, 384);
  EXPECT_EQ(c.ds.num_experts_per_tok, 8);
  EXPECT_EQ(c.ds.moe_intermediate_size, 2048);
  EXPECT_EQ(c.ds.kv_lora_rank, 512);
  EXPECT_EQ(c.ds.q_lora_rank, 1536);
  EXPECT_EQ(c.ds.qk_head_dim(), 192);
  EXPECT_EQ(c.ds.int4_group, 32);
  EXPECT_EQ(kimi_k2_shape(4, false).ds.quant_method, "");
  for (const char* bad : {"random:kimi-k2:0", "random:kimi-k2:62", "random:kimi-k2:x", "random:kimi-k2:", "random:llama:4",
                          "random:kimi-k2:4:fp8"}) {
    const std::string e = error_of([&] { open_checkpoint(bad); });
    EXPECT_NE(e.find("expected random:kimi-k2:LAYERS"), std::string::npos) << bad << ": " << e;
  }
}

// ------------------------------------------------------------------ absorbed MLA

// The weight-absorbed MLA (attention over the shared latent, as decoding caches it) computes
// the expanded form's function: on every fixture, two packed sequences, every hidden state and
// the logits agree to fp32 summation order, and the golden sequence matches transformers.
TEST(DeepseekAbsorbedMla, EqualsTheExpandedFormAndTransformers) {
  for (const std::string name :
       {"deepseek_v2", "deepseek_v2_greedy", "deepseek_v3", "deepseek_v3_noqlora", "deepseek_v3_fp8", "kimi_k2_int4"}) {
    auto ck = open_checkpoint(golden(name));
    const ModelConfig& c = ck->config();
    st::File g(golden(name) / "golden.safetensors");
    const auto ids64 = read_i64(g, "input_ids");
    std::vector<int32_t> ids(ids64.begin(), ids64.end()), other;
    for (size_t i = 0; i < 7; ++i) other.push_back(int32_t((i * 13 + 5) % size_t(c.vocab)));
    Batch b;
    b.add(ids.data(), int64_t(ids.size()));
    b.add(other.data(), int64_t(other.size()));
    const int64_t N = b.n_tokens(), H = c.hidden, L = c.n_layers, T = int64_t(ids.size());
    auto run = [&](Model& m, std::vector<std::vector<float>>& hs, std::vector<float>& lg) {
      hs.assign(size_t(L + 1), std::vector<float>(size_t(N * H)));
      lg.assign(size_t(N * c.vocab), 0.f);
      Capture cap;
      for (int64_t l = 0; l <= L; ++l) {
        cap.layers.push_back(int(l));
        cap.out.push_back(hs[size_t(l)].data());
      }
      m.forward(b, cap, lg.data());
    };
    std::vector<std::vector<float>> he, ha;
    std::vector<float> le, la;
    auto expanded = make_cpu_deepseek_model(*ck, false), absorbed = make_cpu_deepseek_model(*ck, true);
    EXPECT_NE(absorbed->backend().find("absorbed"), std::string::npos);
    run(*expanded, he, le);
    run(*absorbed, ha, la);
    for (int64_t l = 0; l <= L; ++l) {
      EXPECT_LE(rel_err(ha[size_t(l)].data(), he[size_t(l)].data(), size_t(N * H)), tol::kGoldenHiddenRel)
          << name << " h" << l;
      const auto want = read_f32(g, "hidden." + std::to_string(l));
      EXPECT_LE(rel_err(ha[size_t(l)].data(), want.data(), size_t(T * H)), tol::kGoldenHiddenRel) << name << " golden h" << l;
    }
    EXPECT_LE(rel_err(la.data(), le.data(), la.size()), tol::kGoldenHiddenRel) << name << " logits";
  }
}

// ------------------------------------------------------------------ extract

// `talon extract` runs DeepSeek models through the same Model::forward + Capture path:
// one sample (the golden's ids) with 3 aux layers and h[L] stored as fp32 must give
// transformers' hidden states.
void check_extract(const std::string& name, const std::string& device, double tol) {
  st::File g(golden(name) / "golden.safetensors");
  auto ids = read_i64(g, "input_ids");
  const ModelConfig cfg = open_checkpoint(golden(name))->config();
  const int64_t T = int64_t(ids.size()), H = cfg.hidden, L = cfg.n_layers;
  const fs::path work = fs::temp_directory_path() / ("talon_ds_extract_" + std::to_string(::getpid()));
  fs::remove_all(work);
  fs::create_directories(work);
  {
    json rec = {{"id", "a"}, {"input_ids", ids}, {"loss_mask", std::vector<int>(size_t(T), 1)}};
    std::ofstream(work / "data.jsonl") << rec.dump() << "\n";
  }
  ExtractOptions o;
  o.model = golden(name);
  o.data = work / "data.jsonl";
  o.out = work / "out";
  o.layers = "0,1,2";
  o.fp32 = true;
  o.threads = 2;
  o.device = device;
  ExtractReport r = run_extract(o);
  EXPECT_EQ(r.samples, 1);
  EXPECT_EQ(r.tokens, T);
  EXPECT_EQ(r.aux_layers, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(r.final_layer, L);
  int found = 0;
  for (auto& e : fs::directory_iterator(o.out)) {
    if (e.path().extension() != ".safetensors") continue;
    st::File f(e.path());
    const auto& aux = f.get("aux_hidden_states");
    const auto& fin = f.get("hidden_states");
    ASSERT_EQ(aux.shape, (std::vector<int64_t>{T, 3 * H}));  // the 3 requested [T, H] captures side by side
    ASSERT_EQ(fin.shape, (std::vector<int64_t>{T, H}));
    auto a = read_f32(f, "aux_hidden_states"), h = read_f32(f, "hidden_states");
    for (int k = 0; k < 3; ++k) {
      auto want = read_f32(g, "hidden." + std::to_string(k));
      std::vector<float> got(size_t(T * H));
      for (int64_t t = 0; t < T; ++t) std::copy_n(a.data() + t * 3 * H + k * H, H, got.data() + t * H);
      EXPECT_LE(rel_err(got.data(), want.data(), want.size()), tol) << name << " " << device << " aux " << k;
    }
    auto want = read_f32(g, "hidden." + std::to_string(L));
    EXPECT_LE(rel_err(h.data(), want.data(), want.size()), tol) << name << " " << device << " h[L]";
    ++found;
  }
  EXPECT_EQ(found, 1);
  fs::remove_all(work);
}

TEST(DeepseekExtract, WritesTheRequestedCapturesMatchingTransformers) {
  check_extract("deepseek_v3_fp8", "cpu", tol::kGoldenHiddenRel);
}

// The same through the CUDA model (bf16), FP8 and int4 checkpoints; skips without a GPU.
TEST(DeepseekExtract, OnTheGpuMatchesTransformersWithinBf16) {
  if (!cuda_backend_built() || list_gpus().empty()) GTEST_SKIP() << "no CUDA device on this machine";
  for (const std::string name : {"deepseek_v3_fp8", "kimi_k2_int4"}) check_extract(name, "cuda", tol::kCudaModelRel);
}

}  // namespace
