#include <gtest/gtest.h>

#include "model/config.h"
#include "model/model.h"
#include "util/error.h"

using namespace talon;
using json = nlohmann::json;

namespace {

json base() {
  return json::parse(R"({"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "rms_norm_eps": 1e-5})");
}

std::string err(const json& j) {
  try {
    parse_hf_config(j, "cfg.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Config, RopeStylesOfTransformers4And5AgreeAndHashAlike) {
  json v5 = base(), v4 = base(), legacy = base();
  v5["rope_parameters"] = {{"rope_type", "llama3"}, {"rope_theta", 500000.0}, {"factor", 8.0},
                           {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                           {"original_max_position_embeddings", 8192}};
  v4["rope_theta"] = 500000.0;
  v4["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                        {"original_max_position_embeddings", 8192}};
  legacy["rope_theta"] = 500000.0;
  legacy["rope_scaling"] = {{"type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                            {"original_max_position_embeddings", 8192}};
  auto a = parse_hf_config(v5, "a"), b = parse_hf_config(v4, "b"), c = parse_hf_config(legacy, "c");
  EXPECT_EQ(a.rope.type, "llama3");
  EXPECT_EQ(a.rope.theta, 500000.0);
  EXPECT_EQ(a.head_dim, 128);
  EXPECT_EQ(a.hash(), b.hash());
  EXPECT_EQ(a.hash(), c.hash());
  json plain = base();
  EXPECT_NE(parse_hf_config(plain, "d").hash(), a.hash());
}

TEST(Config, ArchitectureFlags) {
  json q2 = base();
  q2["model_type"] = "qwen2";
  q2["tie_word_embeddings"] = true;
  auto c2 = parse_hf_config(q2, "q2");
  EXPECT_TRUE(c2.qkv_bias);
  EXPECT_TRUE(c2.tied_embeddings);
  EXPECT_FALSE(c2.qk_norm);
  json q3 = base();
  q3["model_type"] = "qwen3";
  q3["head_dim"] = 128;
  q3["hidden_size"] = 2560;
  auto c3 = parse_hf_config(q3, "q3");
  EXPECT_TRUE(c3.qk_norm);
  EXPECT_FALSE(c3.qkv_bias);
  EXPECT_EQ(c3.head_dim, 128);
  json m = base();
  m["model_type"] = "mistral";
  m["sliding_window"] = 4096;
  EXPECT_EQ(parse_hf_config(m, "m").sliding_window, 4096);
}

TEST(Config, ErrorsNameFileAndField) {
  json j = base();
  j.erase("hidden_size");
  EXPECT_NE(err(j).find("cfg.json: missing field 'hidden_size'"), std::string::npos);
  j = base();
  j["num_key_value_heads"] = 5;
  EXPECT_NE(err(j).find("not a multiple of num_key_value_heads 5"), std::string::npos);
  j = base();
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  EXPECT_NE(err(j).find("unsupported rope_type 'yarn'"), std::string::npos);
  j = base();
  j["vocab_size"] = "many";
  EXPECT_NE(err(j).find("'vocab_size' must be an integer"), std::string::npos);
  j = base();
  j["model_type"] = "bert";
  j["architectures"] = {"BertModel"};
  EXPECT_NE(err(j).find("unknown architecture"), std::string::npos);
  j = base();
  j["num_attention_heads"] = 0;
  EXPECT_NE(err(j).find("must be positive"), std::string::npos);
}

TEST(LayerIds, DefaultsAndValidation) {
  EXPECT_EQ(default_aux_layers(32), (std::vector<int>{2, 16, 29}));
  EXPECT_EQ(default_aux_layers(30), (std::vector<int>{2, 15, 27}));
  EXPECT_EQ(default_aux_layers(61), (std::vector<int>{2, 30, 58}));
  EXPECT_THROW(default_aux_layers(4), Error);
  EXPECT_EQ(parse_layer_ids("1, 5,30", 30), (std::vector<int>{1, 5, 30}));
  for (const char* bad : {"", "1,2", "1,2,3,4", "1,,3", "x,2,3", "3,2,1", "1,1,2", "1,2,31", "-1,2,3", "1.5,2,3"})
    EXPECT_THROW(parse_layer_ids(bad, 30), Error) << bad;
}

}  // namespace
