#include "draft/export.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <deque>
#include <cstring>
#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "model/checkpoint.h"
#include "model/model.h"
#include "draft/trainer.h"
#include "util/error.h"
#include "util/log.h"

namespace talon::train {

using json = nlohmann::json;
using namespace talon::eagle3;

namespace {

constexpr const char* kConfigName = "config.json";
constexpr const char* kWeightsName = "model.safetensors";
// Written into speculators configs; vLLM does not read it (its speculators adapter keys
// on speculators_model_type), the speculators library records its own version here.
constexpr const char* kSpeculatorsVersion = "0.3.0";

// ---- JSON fields with messages that name the file and the field ----------------------

const json& field(const json& j, const std::string& key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) fail("{}: missing field '{}'", where, key);
  return *it;
}

int64_t int_field(const json& j, const std::string& key, const std::string& where) {
  const json& v = field(j, key, where);
  if (!v.is_number_integer()) fail("{}: field '{}' must be an integer, got {}", where, key, v.dump());
  return v.get<int64_t>();
}

double num_field(const json& j, const std::string& key, const std::string& where) {
  const json& v = field(j, key, where);
  if (!v.is_number()) fail("{}: field '{}' must be a number, got {}", where, key, v.dump());
  return v.get<double>();
}

bool bool_field(const json& j, const std::string& key, const std::string& where) {
  const json& v = field(j, key, where);
  if (!v.is_boolean()) fail("{}: field '{}' must be true or false, got {}", where, key, v.dump());
  return v.get<bool>();
}

std::vector<int64_t> ids_field(const json& j, const std::string& key, const std::string& where) {
  const json& v = field(j, key, where);
  if (!v.is_array()) fail("{}: field '{}' must be an array of layer ids, got {}", where, key, v.dump());
  std::vector<int64_t> ids;
  for (auto& x : v) {
    if (!x.is_number_integer()) fail("{}: field '{}' must hold integers, got {}", where, key, v.dump());
    ids.push_back(x.get<int64_t>());
  }
  return ids;
}

// ---- the draft vocabulary mapping ------------------------------------------------------

// d2t[i] + i must be strictly increasing target ids below V; t2d (0/1) must mark exactly
// those ids. Returns the kept ids.
std::vector<int64_t> check_vocab_mapping(const std::vector<int64_t>& d2t, const std::vector<uint8_t>& t2d, int64_t V,
                                         const std::string& where) {
  std::vector<int64_t> kept(d2t.size());
  for (size_t i = 0; i < d2t.size(); ++i) {
    const int64_t t = d2t[i] + int64_t(i);
    if (t < 0 || t >= V)
      fail("{}: d2t[{}] = {} maps draft id {} to target id {}, outside [0, {})", where, i, d2t[i], i, t, V);
    if (i > 0 && t <= kept[i - 1])
      fail("{}: d2t is not strictly increasing: draft ids {} and {} map to target ids {} and {}", where, i - 1, i,
           kept[i - 1], t);
    kept[i] = t;
  }
  size_t k = 0;
  for (int64_t j = 0; j < V; ++j) {
    const uint8_t v = t2d[size_t(j)];
    if (v > 1) fail("{}: t2d[{}] = {}, expected 0 or 1", where, j, int(v));
    const bool in_d2t = k < kept.size() && kept[k] == j;
    if (bool(v) != in_d2t)
      fail("{}: t2d[{}] = {} but target id {} is {} d2t; t2d must mark exactly the ids d2t maps to", where, j, int(v),
           j, in_d2t ? "in" : "not in");
    if (in_d2t) ++k;
  }
  return kept;
}

void check_aux_ids(const std::vector<int64_t>& ids, int64_t L, const std::string& where) {
  if (ids.size() != 3)
    fail("{}: aux_layer_ids has {} entries {}; EAGLE-3's fc takes exactly 3 hidden states", where, ids.size(),
         json(ids).dump());
  for (auto id : ids)
    if (id < 0 || id > L)
      fail("{}: aux layer id {} is outside [0, {}] (the target has {} layers)", where, id, L, L);
}

// ---- weights -----------------------------------------------------------------------------

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

// RoPE in transformers' config.json spelling (rope_theta + rope_scaling).
json rope_scaling_json(const RopeConfig& r) {
  if (r.type == "default") return nullptr;
  if (r.type == "linear") return {{"rope_type", "linear"}, {"factor", r.factor}};
  return {{"rope_type", "llama3"},
          {"factor", r.factor},
          {"low_freq_factor", r.low_freq_factor},
          {"high_freq_factor", r.high_freq_factor},
          {"original_max_position_embeddings", r.original_max_position}};
}

RopeConfig parse_rope(const json& j, const std::string& where) {
  RopeConfig r;
  r.theta = num_field(j, "rope_theta", where);
  auto it = j.find("rope_scaling");
  if (it == j.end() || it->is_null()) return r;
  const json& s = *it;
  if (!s.is_object()) fail("{}: rope_scaling must be an object or null, got {}", where, s.dump());
  const std::string sw = where + " rope_scaling";
  const json& t = s.contains("rope_type") ? s.at("rope_type") : field(s, "type", sw);
  if (!t.is_string()) fail("{}: rope_type must be a string", sw);
  r.type = t.get<std::string>();
  if (r.type == "default") return r;
  r.factor = num_field(s, "factor", sw);
  if (r.type == "linear") return r;
  if (r.type != "llama3") fail("{}: rope_type '{}' is not one Talon writes (default, linear, llama3)", sw, r.type);
  r.low_freq_factor = num_field(s, "low_freq_factor", sw);
  r.high_freq_factor = num_field(s, "high_freq_factor", sw);
  r.original_max_position = int_field(s, "original_max_position_embeddings", sw);
  return r;
}

const char* verifier_architecture(Arch a) {
  switch (a) {
    case Arch::Llama: return "LlamaForCausalLM";
    case Arch::Mistral: return "MistralForCausalLM";
    case Arch::Qwen2: return "Qwen2ForCausalLM";
    case Arch::Qwen3: return "Qwen3ForCausalLM";
    case Arch::DeepseekV2: return "DeepseekV2ForCausalLM";
    case Arch::DeepseekV3: return "DeepseekV3ForCausalLM";  // Kimi-K2's text model too
  }
  return "LlamaForCausalLM";
}

// The decoder-layer fields both formats share (a Llama layer: the draft has no biases
// and no q/k norm whatever the target's architecture).
json layer_config(const DraftConfig& c, const ModelConfig& tc, DType dtype) {
  json j = {{"model_type", "llama"},
            {"hidden_size", c.H},
            {"intermediate_size", c.I},
            {"num_attention_heads", c.n_heads},
            {"num_key_value_heads", c.n_kv_heads},
            {"head_dim", c.head_dim},
            {"num_hidden_layers", 1},
            {"vocab_size", c.V},
            {"rms_norm_eps", c.rms_eps},
            {"hidden_act", "silu"},
            {"attention_bias", false},
            {"mlp_bias", false},
            {"tie_word_embeddings", false},
            {"rope_theta", c.rope.theta},
            {"rope_scaling", rope_scaling_json(c.rope)},
            {"torch_dtype", dtype == DType::BF16 ? "bfloat16" : "float32"}};
  if (tc.max_position > 0) j["max_position_embeddings"] = tc.max_position;
  return j;
}

void fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

// Removes a temporary directory unless released.
struct TempDir {
  fs::path path;
  bool keep = false;
  ~TempDir() {
    if (!keep) {
      std::error_code ec;
      fs::remove_all(path, ec);
    }
  }
};

}  // namespace

const char* export_format_name(ExportFormat f) { return f == ExportFormat::SGLang ? "sglang" : "speculators"; }

ExportFormat parse_export_format(const std::string& s) {
  if (s == "speculators" || s == "vllm") return ExportFormat::Speculators;
  if (s == "sglang" || s == "specforge") return ExportFormat::SGLang;
  fail("unknown export format '{}' (expected speculators or sglang)", s);
}

std::vector<std::string> exported_weight_names(ExportFormat format) {
  const std::string L = format == ExportFormat::SGLang ? "midlayer." : "layers.0.";
  // DraftWeights::named() order: fc, in_ln, hidden_norm, wq, wk, wv, wo, post_ln, gate, up, down, norm, lm_head.
  return {"fc.weight",
          L + "input_layernorm.weight",
          L + "hidden_norm.weight",
          L + "self_attn.q_proj.weight",
          L + "self_attn.k_proj.weight",
          L + "self_attn.v_proj.weight",
          L + "self_attn.o_proj.weight",
          L + "post_attention_layernorm.weight",
          L + "mlp.gate_proj.weight",
          L + "mlp.up_proj.weight",
          L + "mlp.down_proj.weight",
          "norm.weight",
          "lm_head.weight"};
}

std::vector<std::vector<int64_t>> draft_weight_shapes(const DraftConfig& c) {
  const int64_t H = c.H, qd = c.n_heads * c.head_dim, kvd = c.n_kv_heads * c.head_dim;
  return {{H, 3 * H}, {H},     {H},     {qd, 2 * H}, {kvd, 2 * H}, {kvd, 2 * H}, {H, qd},
          {H},        {c.I, H}, {c.I, H}, {H, c.I},   {H},          {c.Vd, H}};
}

std::vector<std::pair<std::string, std::vector<float>*>> dflash_named(dflash::Weights& w, const dflash::Config& c) {
  w.layers.resize(size_t(c.layers));
  std::vector<std::pair<std::string, std::vector<float>*>> out = {{"fc", &w.fc}, {"hidden_norm", &w.hidden_norm}};
  for (int64_t l = 0; l < c.layers; ++l)
    for (auto& [n, v] : w.layers[size_t(l)].named()) out.push_back({fmt::format("layers.{}.{}", l, n), v});
  out.push_back({"norm", &w.norm});
  out.push_back({"lm_head", &w.lm_head});
  return out;
}

std::vector<std::vector<int64_t>> dflash_weight_shapes(const dflash::Config& c) {
  const int64_t H = c.H, qd = c.n_heads * c.head_dim, kvd = c.n_kv_heads * c.head_dim, hd = c.head_dim;
  std::vector<std::vector<int64_t>> out = {{H, c.n_aux * H}, {H}};
  for (int64_t l = 0; l < c.layers; ++l)
    for (auto& s : std::vector<std::vector<int64_t>>{{H}, {qd, H}, {kvd, H}, {kvd, H}, {hd}, {hd}, {H, qd}, {H},
                                                      {c.I, H}, {c.I, H}, {H, c.I}})
      out.push_back(s);
  out.push_back({H});
  out.push_back({c.Vd, H});
  return out;
}

std::vector<std::string> dflash_exported_names(const dflash::Config& c) {
  // Layer::named() order: in_ln, wq, wk, wv, q_norm, k_norm, wo, post_ln, gate, up, down.
  static const char* const layer[] = {"input_layernorm.weight",  "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                      "self_attn.v_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                                      "self_attn.o_proj.weight", "post_attention_layernorm.weight",
                                      "mlp.gate_proj.weight",    "mlp.up_proj.weight",      "mlp.down_proj.weight"};
  std::vector<std::string> out = {"fc.weight", "hidden_norm.weight"};
  for (int64_t l = 0; l < c.layers; ++l)
    for (const char* n : layer) out.push_back(fmt::format("layers.{}.{}", l, n));
  out.push_back("norm.weight");
  out.push_back("lm_head.weight");
  return out;
}

TrainedDraft load_trained_draft(const fs::path& path, const ModelConfig& tc, const std::string& target_source) {
  TrainedDraft d;
  d.path = fs::is_directory(path) ? path / kCheckpointName : path;
  TALON_CHECK(fs::exists(d.path), "{}: no such checkpoint (expected a `talon train` run directory or its {})",
              d.path.string(), kCheckpointName);
  const std::string where = d.path.string();
  st::File f(d.path);
  auto mit = f.metadata().find("talon.train");
  TALON_CHECK(mit != f.metadata().end(), "{}: no 'talon.train' metadata; not a `talon train` checkpoint", where);
  const json meta = json::parse(mit->second, nullptr, false);
  TALON_CHECK(meta.is_object(), "{}: 'talon.train' metadata is not a JSON object", where);
  const std::string mw = where + " (talon.train metadata)";

  // Identity: the draft belongs to exactly this target.
  const json& job = field(meta, "job", mw);
  const json& sha = field(job, "target_config_sha256", mw + " job");
  TALON_CHECK(sha.is_string(), "{} job: target_config_sha256 must be a string", mw);
  d.target_config_sha256 = sha.get<std::string>();
  TALON_CHECK(d.target_config_sha256 == tc.hash(),
              "{}: job.target_config_sha256 is {}, but --model {} has config sha256 {}; export with the target the "
              "draft was trained for",
              mw, d.target_config_sha256, target_source, tc.hash());
  d.step = int_field(meta, "step", mw);

  const json& dj = field(meta, "draft", mw);
  const std::string dw = mw + " draft";
  DraftConfig& c = d.config;
  c.H = int_field(dj, "hidden_size", dw);
  c.I = int_field(dj, "intermediate_size", dw);
  c.n_heads = int_field(dj, "num_attention_heads", dw);
  c.n_kv_heads = int_field(dj, "num_key_value_heads", dw);
  c.head_dim = int_field(dj, "head_dim", dw);
  c.V = int_field(dj, "vocab_size", dw);
  c.Vd = int_field(dj, "draft_vocab_size", dw);
  c.rms_eps = num_field(dj, "rms_norm_eps", dw);
  c.norm_before_residual = bool_field(dj, "norm_before_residual", dw);
  c.rope = eagle3::draft_rope_for(tc);
  if (job.contains("ttt_steps") && job["ttt_steps"].is_number_integer()) c.ttt_steps = job["ttt_steps"].get<int>();
  TALON_CHECK(c.H == tc.hidden, "{}: hidden_size is {}, but --model {} has hidden_size {}", dw, c.H, target_source,
              tc.hidden);
  TALON_CHECK(c.V == tc.vocab, "{}: vocab_size is {}, but --model {} has vocab_size {}", dw, c.V, target_source,
              tc.vocab);
  TALON_CHECK(c.Vd >= 1 && c.Vd <= c.V, "{}: draft_vocab_size {} must be in [1, vocab_size {}]", dw, c.Vd, c.V);
  TALON_CHECK(c.I > 0 && c.n_heads > 0 && c.n_kv_heads > 0 && c.head_dim > 0 && c.n_heads % c.n_kv_heads == 0,
              "{}: intermediate_size {}, heads {} / kv heads {}, head_dim {} do not describe a decoder layer", dw, c.I,
              c.n_heads, c.n_kv_heads, c.head_dim);
  TALON_CHECK(c.rms_eps > 0, "{}: rms_norm_eps must be positive, got {}", dw, c.rms_eps);

  // Layer ids and their convention.
  const json& conv = field(meta, "convention", mw);
  TALON_CHECK(conv.is_string() && conv.get<std::string>() == kLayerConvention,
              "{}: convention is {}, expected \"{}\" (the only layer-id convention Talon writes)", mw, conv.dump(),
              kLayerConvention);
  d.convention = conv.get<std::string>();
  d.aux_layer_ids = ids_field(meta, "aux_layer_ids", mw);
  check_aux_ids(d.aux_layer_ids, tc.n_layers, mw);
  d.final_layer_id = int_field(meta, "final_layer_id", mw);
  TALON_CHECK(d.final_layer_id == tc.n_layers, "{}: final_layer_id is {}, expected the target's layer count {}", mw,
              d.final_layer_id, tc.n_layers);

  // The drafter family (checkpoints written before P-EAGLE existed are EAGLE-3's).
  if (meta.contains("drafter")) {
    const json& dr = meta.at("drafter");
    TALON_CHECK(dr.is_string() && (dr == "eagle3" || dr == "peagle" || dr == "dflash"),
                "{}: drafter is {}, expected \"eagle3\", \"peagle\" or \"dflash\"", mw, dr.dump());
    d.drafter = dr.get<std::string>();
  }

  // Weights, stored flat by the trainer.
  auto read_f32 = [&](const std::string& name, std::vector<float>& v, int64_t n) {
    const st::TensorView* t = f.find(name);
    TALON_CHECK(t, "{}: missing tensor '{}'", where, name);
    TALON_CHECK(t->dtype == DType::F32 && t->numel() == n, "{}: tensor '{}' is {} with {} elements, expected F32 with {}",
                where, name, dtype_name(t->dtype), t->numel(), n);
    v.resize(size_t(n));
    std::memcpy(v.data(), t->data, t->nbytes);
  };
  if (d.drafter == "dflash") {
    dflash::Config& dc = d.dflash;
    dc.H = c.H, dc.I = c.I, dc.n_heads = c.n_heads, dc.n_kv_heads = c.n_kv_heads, dc.head_dim = c.head_dim;
    dc.V = c.V, dc.Vd = c.Vd, dc.rms_eps = c.rms_eps, dc.rope = c.rope;
    dc.layers = int_field(dj, "num_hidden_layers", dw);
    dc.block = int_field(dj, "block_size", dw);
    dc.n_aux = int_field(dj, "num_aux_layers", dw);
    TALON_CHECK(dc.layers >= 1 && dc.block >= 2 && dc.n_aux == int64_t(d.aux_layer_ids.size()),
                "{}: {} layers, block size {} and {} aux layers (with {} aux layer ids) do not make a DFlash draft", dw,
                dc.layers, dc.block, dc.n_aux, d.aux_layer_ids.size());
    d.mask_token_id = int_field(job, "mask_token_id", mw + " job");
    TALON_CHECK(d.mask_token_id >= 0 && d.mask_token_id < c.V, "{} job: mask_token_id {} is outside [0, {})", mw,
                d.mask_token_id, c.V);
    const auto shapes = dflash_weight_shapes(dc);
    auto named = dflash_named(d.dweights, dc);
    for (size_t i = 0; i < named.size(); ++i) read_f32("w." + named[i].first, *named[i].second, numel_of(shapes[i]));
  }
  const auto shapes = draft_weight_shapes(c);
  auto named = d.weights.named();
  for (size_t i = 0; i < named.size() && d.drafter != "dflash"; ++i) {
    const std::string name = std::string("w.") + named[i].first;
    const st::TensorView* t = f.find(name);
    TALON_CHECK(t, "{}: missing tensor '{}'", where, name);
    TALON_CHECK(t->dtype == DType::F32, "{}: tensor '{}' is {}, expected F32", where, name, dtype_name(t->dtype));
    const int64_t want = numel_of(shapes[i]);
    TALON_CHECK(t->numel() == want, "{}: tensor '{}' has {} elements (shape {}), expected {} for shape {}", where, name,
                t->numel(), st::shape_str(t->shape), want, st::shape_str(shapes[i]));
    named[i].second->resize(size_t(want));
    std::memcpy(named[i].second->data(), t->data, t->nbytes);
  }
  const st::TensorView* d2t = f.find("d2t");
  const st::TensorView* t2d = f.find("t2d");
  TALON_CHECK(d2t && t2d, "{}: missing tensor '{}'", where, d2t ? "t2d" : "d2t");
  TALON_CHECK(d2t->dtype == DType::I64 && d2t->shape.size() == 1,
              "{}: tensor 'd2t' is {} {}, expected I64 [{}]", where, dtype_name(d2t->dtype), st::shape_str(d2t->shape),
              c.Vd);
  TALON_CHECK(d2t->numel() == c.Vd, "{}: tensor 'd2t' has {} entries, expected draft_vocab_size {}", where,
              d2t->numel(), c.Vd);
  TALON_CHECK((t2d->dtype == DType::U8 || t2d->dtype == DType::BOOL) && t2d->shape.size() == 1,
              "{}: tensor 't2d' is {} {}, expected U8 [{}]", where, dtype_name(t2d->dtype), st::shape_str(t2d->shape),
              c.V);
  TALON_CHECK(t2d->numel() == c.V, "{}: tensor 't2d' has {} entries, expected the target's vocab_size {}", where,
              t2d->numel(), c.V);
  d.vocab.d2t.resize(size_t(c.Vd));
  std::memcpy(d.vocab.d2t.data(), d2t->data, d2t->nbytes);
  d.vocab.t2d.assign(t2d->data, t2d->data + t2d->nbytes);
  d.vocab.kept = check_vocab_mapping(d.vocab.d2t, d.vocab.t2d, c.V, where);

  if (d.drafter == "peagle") {
    d.mask_token_id = int_field(job, "mask_token_id", mw + " job");
    TALON_CHECK(d.mask_token_id >= 0 && d.mask_token_id < c.V, "{} job: mask_token_id {} is outside [0, {})", mw,
                d.mask_token_id, c.V);
    auto read = [&](const char* name, std::vector<float>& v, int64_t n) {
      const st::TensorView& t = f.get(name, DType::F32, {n});
      v.resize(size_t(n));
      std::memcpy(v.data(), t.data, t.nbytes);
    };
    read("w.mask_hidden", d.mask_hidden, 3 * c.H);
    read("w.embed", d.embed, c.V * c.H);
  }
  return d;
}

std::string serve_command(ExportFormat f, const fs::path& dir, const std::string& target, int64_t speculative_tokens,
                          const std::string& drafter) {
  const std::string d = fs::absolute(dir).lexically_normal().string();
  if (f == ExportFormat::Speculators)
    return fmt::format("vllm serve {} --speculative-config '{{\"model\": \"{}\", \"method\": \"{}\", "
                       "{}\"num_speculative_tokens\": {}}}'",
                       target, d, drafter == "dflash" ? "dflash" : "eagle3",
                       drafter == "peagle" ? "\"parallel_drafting\": true, " : "", speculative_tokens);
  return fmt::format("python -m sglang.launch_server --model-path {} --speculative-algorithm EAGLE3 "
                     "--speculative-draft-model-path {} --speculative-num-steps {} --speculative-eagle-topk 1 "
                     "--speculative-num-draft-tokens {}",
                     target, d, speculative_tokens, speculative_tokens + 1);
}

ExportReport run_export(const ExportOptions& opt) {
  TALON_CHECK(opt.dtype == DType::BF16 || opt.dtype == DType::F32, "export: --dtype must be bf16 or fp32, got {}",
              dtype_name(opt.dtype));
  TALON_CHECK(opt.speculative_tokens >= 1, "export: --speculative-tokens must be >= 1, got {}",
              opt.speculative_tokens);
  auto ckpt = open_checkpoint(opt.model);
  const ModelConfig& tc = ckpt->config();
  TrainedDraft d = load_trained_draft(opt.checkpoint, tc, opt.model.string());
  const DraftConfig& c = d.config;
  const std::string where = d.path.string();
  TALON_CHECK(tc.rope.freq_factors.empty(),
              "export: --model {} gives RoPE as per-frequency factors (GGUF rope_freqs), which a config.json cannot "
              "express; export with the target's HF model directory",
              opt.model.string());
  const bool peagle = d.drafter == "peagle", dfl = d.drafter == "dflash";
  TALON_CHECK(!dfl || opt.format == ExportFormat::Speculators,
              "{}: a DFlash draft exports in the speculators format only (vLLM serves it); use --format speculators",
              where);
  // DFlash drafts block_size - 1 tokens a round (the block's first row is the verified token).
  const int64_t spec_tokens = dfl ? d.dflash.block - 1 : opt.speculative_tokens;
  if (dfl && spec_tokens != opt.speculative_tokens)
    tlog::info("export: a DFlash draft with blocks of {} proposes {} tokens a round", d.dflash.block, spec_tokens);
  if (peagle) {
    TALON_CHECK(opt.format == ExportFormat::Speculators,
                "{}: a P-EAGLE draft exports in the speculators format only (vLLM serves it with parallel drafting); "
                "use --format speculators",
                where);
    TALON_CHECK(opt.speculative_tokens <= c.ttt_steps,
                "export: --speculative-tokens {} is more than the {} draft positions the P-EAGLE draft was trained for",
                opt.speculative_tokens, c.ttt_steps);
  }
  if (opt.format == ExportFormat::SGLang) {
    TALON_CHECK(!c.norm_before_residual,
                "{}: the draft was trained with norm_before_residual = true, which SGLang's LlamaForCausalLMEagle3 "
                "does not implement (its residual is the un-normed hidden input); export --format speculators for "
                "vLLM, or retrain without --norm-before-residual",
                where);
    for (auto id : d.aux_layer_ids)
      TALON_CHECK(id >= 1,
                  "{}: aux layer id {} (the embeddings) cannot be written for SGLang, whose ids are Talon's minus 1",
                  where, id);
  }

  if (opt.format == ExportFormat::Speculators)
    for (auto id : d.aux_layer_ids)
      if (id == 0 || id == tc.n_layers)
        tlog::warn("export: aux layer id {} is {}; vLLM's decoder loops capture the input of layers 1..L-1 only", id,
                   id == 0 ? "the embeddings" : "the last layer's output");

  // Output location: a fresh or empty directory, assembled under a temporary name.
  const fs::path out = fs::absolute(opt.out).lexically_normal();
  TALON_CHECK(!out.filename().empty(), "export: --out {} must name a directory", opt.out.string());
  if (fs::exists(out))
    TALON_CHECK(fs::is_directory(out) && fs::is_empty(out),
                "export: --out {} already exists and is not an empty directory; remove it or choose another", out.string());
  fs::create_directories(out.parent_path());
  TempDir tmp{out.parent_path() / fmt::format(".{}.tmp-{}", out.filename().string(), ::getpid())};
  fs::remove_all(tmp.path);
  fs::create_directories(tmp.path);

  // Tensors, in the engine's names and shapes (bf16 copies live until the file is written).
  std::deque<std::vector<uint16_t>> bf16;
  st::Writer wr;
  int64_t n_tensors = 2;  // d2t, t2d
  auto add = [&](const std::string& name, const std::vector<int64_t>& shape, const std::vector<float>& w) {
    TALON_CHECK(int64_t(w.size()) == numel_of(shape), "export: {} has {} values, expected {}", name, w.size(),
                numel_of(shape));
    if (opt.dtype == DType::BF16) {
      bf16.emplace_back(w.size());
      for (size_t k = 0; k < w.size(); ++k) bf16.back()[k] = f32_to_bf16(w[k]);
      wr.add(name, DType::BF16, shape, bf16.back().data(), bf16.back().size() * 2);
    } else {
      wr.add(name, DType::F32, shape, w.data(), w.size() * 4);
    }
    ++n_tensors;
  };
  if (dfl) {
    const auto names = dflash_exported_names(d.dflash);
    const auto shapes = dflash_weight_shapes(d.dflash);
    auto named = dflash_named(d.dweights, d.dflash);
    for (size_t i = 0; i < named.size(); ++i) add(names[i], shapes[i], *named[i].second);
  } else {
    const auto names = exported_weight_names(opt.format);
    const auto shapes = draft_weight_shapes(c);
    auto named = d.weights.named();
    for (size_t i = 0; i < named.size(); ++i) add(names[i], shapes[i], *named[i].second);
  }
  if (peagle) {
    add("embed_tokens.weight", {c.V, c.H}, d.embed);
    add("mask_hidden", {1, 1, 3 * c.H}, d.mask_hidden);
  }
  wr.add("d2t", DType::I64, {c.Vd}, d.vocab.d2t.data(), d.vocab.d2t.size() * 8);
  wr.add("t2d", DType::BOOL, {c.V}, d.vocab.t2d.data(), d.vocab.t2d.size());
  const json provenance = {{"checkpoint", fs::absolute(d.path).string()},
                           {"step", d.step},
                           {"target_config_sha256", d.target_config_sha256},
                           {"aux_layer_ids", d.aux_layer_ids},
                           {"convention", d.convention},
                           {"format", export_format_name(opt.format)}};
  wr.set_metadata("format", "pt");
  wr.set_metadata("talon.export", provenance.dump());

  // config.json
  const std::string verifier = opt.verifier.empty() ? fs::absolute(opt.model).lexically_normal().string() : opt.verifier;
  json cfg;
  if (opt.format == ExportFormat::Speculators) {
    // What every family's config has (speculators' SpeculatorModelConfig), then each one's.
    cfg = {{"speculators_version", kSpeculatorsVersion},
           {"draft_vocab_size", c.Vd},
           {"target_hidden_size", tc.hidden},
           {"speculators_config",
            {{"algorithm", d.drafter},
             {"default_proposal_method", "greedy"},
             {"proposal_methods",
              {{{"proposal_type", "greedy"},
                {"speculative_tokens", spec_tokens},
                {"verifier_accept_k", 1},
                {"accept_tolerance", 0.0}}}},
             {"verifier", {{"name_or_path", verifier}, {"architectures", {verifier_architecture(tc.arch)}}}}}},
           {"tie_word_embeddings", false},
           {"torch_dtype", opt.dtype == DType::BF16 ? "bfloat16" : "float32"},
           {"talon", provenance}};
    json layer = layer_config(c, tc, opt.dtype);
    if (dfl) {
      // DFlashSpeculatorConfig: a Qwen3 decoder config of the draft's layers, no EAGLE-3 fields.
      layer["model_type"] = "qwen3";
      layer["num_hidden_layers"] = d.dflash.layers;
      cfg.update({{"architectures", {"DFlashSpeculator"}},
                  {"speculators_model_type", "dflash"},
                  {"block_size", d.dflash.block},
                  {"aux_hidden_state_layer_ids", d.aux_layer_ids},
                  {"mask_token_id", d.mask_token_id},
                  {"sliding_window_non_causal", false},
                  {"sample_from_anchor", false}});
    } else {
      // Eagle3SpeculatorConfig; P-EAGLE's adds the mask token and trained embeddings.
      cfg.update({{"architectures", {peagle ? "PEagleSpeculator" : "Eagle3Speculator"}},
                  {"speculators_model_type", peagle ? "peagle" : "eagle3"},
                  {"norm_before_residual", c.norm_before_residual},
                  {"eagle_aux_hidden_state_layer_ids", d.aux_layer_ids}});
      if (peagle) cfg.update({{"mask_token_id", d.mask_token_id}, {"embed_requires_grad", true}});
    }
    cfg["transformer_layer_config"] = layer;
  } else {
    std::vector<int64_t> sg_ids;
    for (auto id : d.aux_layer_ids) sg_ids.push_back(id - 1);
    cfg = layer_config(c, tc, opt.dtype);
    cfg["architectures"] = {"LlamaForCausalLMEagle3"};
    cfg["draft_vocab_size"] = c.Vd;
    cfg["target_hidden_size"] = tc.hidden;
    cfg["norm_before_residual"] = false;
    cfg["eagle_config"] = {{"eagle_aux_hidden_state_layer_ids", sg_ids}, {"use_aux_hidden_state", true}};
    cfg["talon"] = provenance;
  }

  ExportReport rep;
  wr.write(tmp.path / kWeightsName, &rep.bytes);
  const std::string cfg_text = cfg.dump(2) + "\n";
  write_file_atomic(tmp.path / kConfigName, cfg_text);
  rep.bytes += cfg_text.size();
  rep.tensors = n_tensors;
  if (fs::exists(out)) fs::remove(out);  // empty, checked above
  fs::rename(tmp.path, out);
  tmp.keep = true;
  fsync_dir(out.parent_path());
  rep.out = out;
  rep.verifier = verifier;
  rep.drafter = d.drafter;
  rep.speculative_tokens = spec_tokens;
  tlog::info("export: {} step {} -> {} ({}, {}, {} tensors)", where, d.step, out.string(),
             export_format_name(opt.format), opt.dtype == DType::BF16 ? "bf16" : "fp32", rep.tensors);
  return rep;
}

ExportedDraft load_exported_draft(const fs::path& dir) {
  ExportedDraft e;
  const fs::path cpath = dir / kConfigName, wpath = dir / kWeightsName;
  TALON_CHECK(fs::exists(cpath), "{}: missing; not an exported draft directory", cpath.string());
  const std::string cw = cpath.string();
  const json cfg = json::parse(read_text_file(cpath), nullptr, false);
  TALON_CHECK(cfg.is_object(), "{}: not a JSON object", cw);

  // Which format, and where the decoder-layer fields live.
  const json* layer = nullptr;
  std::string lw;
  std::vector<int64_t> aux;
  DraftConfig& c = e.config;
  if (cfg.contains("speculators_model_type")) {
    const json& t = cfg.at("speculators_model_type");
    TALON_CHECK(t.is_string() && (t == "eagle3" || t == "peagle" || t == "dflash"),
                "{}: speculators_model_type is {}, expected \"eagle3\", \"peagle\" or \"dflash\"", cw, t.dump());
    e.format = ExportFormat::Speculators;
    e.drafter = t.get<std::string>();
    if (e.drafter != "eagle3") e.mask_token_id = int_field(cfg, "mask_token_id", cw);
    layer = &field(cfg, "transformer_layer_config", cw);
    TALON_CHECK(layer->is_object(), "{}: transformer_layer_config must be an object", cw);
    lw = cw + " transformer_layer_config";
    c.Vd = int_field(cfg, "draft_vocab_size", cw);
    if (e.drafter == "dflash") {
      aux = ids_field(cfg, "aux_hidden_state_layer_ids", cw);
      e.dflash.block = int_field(cfg, "block_size", cw);
      TALON_CHECK(e.dflash.block >= 2, "{}: block_size {} (expected >= 2)", cw, e.dflash.block);
      for (const char* k : {"sample_from_anchor", "sliding_window_non_causal"})
        TALON_CHECK(!cfg.contains(k) || !bool_field(cfg, k, cw), "{}: {} = true is a variant Talon does not run", cw, k);
    } else {
      c.norm_before_residual = bool_field(cfg, "norm_before_residual", cw);
      aux = ids_field(cfg, "eagle_aux_hidden_state_layer_ids", cw);
    }
    const json& sc = field(cfg, "speculators_config", cw);
    const std::string sw = cw + " speculators_config";
    const json& pm = field(sc, "proposal_methods", sw);
    TALON_CHECK(pm.is_array() && !pm.empty(), "{}: proposal_methods must be a non-empty array", sw);
    e.speculative_tokens = int_field(pm[0], "speculative_tokens", sw + " proposal_methods[0]");
    const json& ver = field(field(sc, "verifier", sw), "name_or_path", sw + " verifier");
    TALON_CHECK(ver.is_string(), "{} verifier: name_or_path must be a string", sw);
    e.verifier = ver.get<std::string>();
  } else {
    const json& arch = field(cfg, "architectures", cw);
    TALON_CHECK(arch.is_array() && arch.size() == 1 && arch[0] == "LlamaForCausalLMEagle3",
                "{}: architectures is {}; expected a speculators eagle3 config (speculators_model_type) or "
                "[\"LlamaForCausalLMEagle3\"]",
                cw, arch.dump());
    e.format = ExportFormat::SGLang;
    layer = &cfg;
    lw = cw;
    c.Vd = int_field(cfg, "draft_vocab_size", cw);
    c.norm_before_residual = cfg.contains("norm_before_residual") ? bool_field(cfg, "norm_before_residual", cw) : false;
    TALON_CHECK(!c.norm_before_residual, "{}: norm_before_residual = true, which SGLang does not implement", cw);
    TALON_CHECK(!bool_field(cfg, "tie_word_embeddings", cw),
                "{}: tie_word_embeddings = true would make SGLang use the embedding as lm_head", cw);
    for (auto id : ids_field(field(cfg, "eagle_config", cw), "eagle_aux_hidden_state_layer_ids", cw + " eagle_config"))
      aux.push_back(id + 1);  // SGLang's ids are output-of-layer
  }
  c.H = int_field(*layer, "hidden_size", lw);
  c.I = int_field(*layer, "intermediate_size", lw);
  c.n_heads = int_field(*layer, "num_attention_heads", lw);
  c.n_kv_heads = int_field(*layer, "num_key_value_heads", lw);
  c.head_dim = int_field(*layer, "head_dim", lw);
  c.V = int_field(*layer, "vocab_size", lw);
  c.rms_eps = num_field(*layer, "rms_norm_eps", lw);
  c.rope = parse_rope(*layer, lw);
  const int64_t nl = int_field(*layer, "num_hidden_layers", lw);
  TALON_CHECK(nl == 1 || (e.drafter == "dflash" && nl >= 1),
              "{}: num_hidden_layers is {}, expected 1 (one EAGLE-3 decoder layer)", lw, nl);
  if (cfg.contains("target_hidden_size") && !cfg["target_hidden_size"].is_null()) {
    const int64_t th = int_field(cfg, "target_hidden_size", cw);
    TALON_CHECK(th == c.H, "{}: target_hidden_size {} differs from hidden_size {}; Talon drafts share the target's width",
                cw, th, c.H);
  }
  TALON_CHECK(c.Vd >= 1 && c.Vd <= c.V, "{}: draft_vocab_size {} must be in [1, vocab_size {}]", cw, c.Vd, c.V);
  TALON_CHECK(aux.size() == 3 || (e.drafter == "dflash" && !aux.empty()), "{}: {} aux layer ids, expected 3", cw,
              aux.size());
  for (auto id : aux) TALON_CHECK(id >= 0, "{}: aux layer id {} (Talon convention) is negative", cw, id);
  e.aux_layer_ids = aux;
  if (e.drafter == "dflash") {
    dflash::Config& dc = e.dflash;
    dc.H = c.H, dc.I = c.I, dc.n_heads = c.n_heads, dc.n_kv_heads = c.n_kv_heads, dc.head_dim = c.head_dim;
    dc.V = c.V, dc.Vd = c.Vd, dc.rms_eps = c.rms_eps, dc.rope = c.rope;
    dc.layers = nl;
    dc.n_aux = int64_t(aux.size());
  }

  // Weights: every tensor expected, of the expected shape, and nothing else.
  TALON_CHECK(fs::exists(wpath), "{}: missing", wpath.string());
  const std::string ww = wpath.string();
  st::File f(wpath);
  const bool dfl = e.drafter == "dflash";
  const auto names = dfl ? dflash_exported_names(e.dflash) : exported_weight_names(e.format);
  const auto shapes = dfl ? dflash_weight_shapes(e.dflash) : draft_weight_shapes(c);
  auto named = dfl ? dflash_named(e.dweights, e.dflash) : std::vector<std::pair<std::string, std::vector<float>*>>();
  if (!dfl)
    for (auto& [n, v] : e.weights.named()) named.push_back({n, v});
  for (size_t i = 0; i < named.size(); ++i) {
    const st::TensorView* t = f.find(names[i]);
    TALON_CHECK(t, "{}: missing tensor '{}'", ww, names[i]);
    TALON_CHECK(t->shape == shapes[i], "{}: tensor '{}' has shape {}, expected {}", ww, names[i],
                st::shape_str(t->shape), st::shape_str(shapes[i]));
    TALON_CHECK(t->dtype == DType::F32 || t->dtype == DType::BF16, "{}: tensor '{}' is {}, expected F32 or BF16", ww,
                names[i], dtype_name(t->dtype));
    if (i == 0) e.dtype = t->dtype;
    TALON_CHECK(t->dtype == e.dtype, "{}: tensor '{}' is {} but '{}' is {}; one dtype expected", ww, names[i],
                dtype_name(t->dtype), names[0], dtype_name(e.dtype));
    named[i].second->resize(size_t(t->numel()));
    convert_to_f32(t->dtype, t->data, named[i].second->data(), size_t(t->numel()));
  }
  const st::TensorView& d2t = f.get("d2t", DType::I64, {c.Vd});
  const st::TensorView& t2d = f.get("t2d", DType::BOOL, {c.V});
  e.vocab.d2t.resize(size_t(c.Vd));
  std::memcpy(e.vocab.d2t.data(), d2t.data, d2t.nbytes);
  e.vocab.t2d.assign(t2d.data, t2d.data + t2d.nbytes);
  e.vocab.kept = check_vocab_mapping(e.vocab.d2t, e.vocab.t2d, c.V, ww);
  std::vector<std::string> extra;
  if (e.drafter == "peagle") {
    TALON_CHECK(e.mask_token_id >= 0 && e.mask_token_id < c.V, "{}: mask_token_id {} is outside [0, {})", cw,
                e.mask_token_id, c.V);
    auto read = [&](const std::string& name, std::vector<float>& v, const std::vector<int64_t>& shape) {
      const st::TensorView* t = f.find(name);
      TALON_CHECK(t, "{}: missing tensor '{}' (a P-EAGLE draft carries it)", ww, name);
      TALON_CHECK(t->shape == shape && t->dtype == e.dtype, "{}: tensor '{}' is {} {}, expected {} {}", ww, name,
                  dtype_name(t->dtype), st::shape_str(t->shape), dtype_name(e.dtype), st::shape_str(shape));
      v.resize(size_t(t->numel()));
      convert_to_f32(t->dtype, t->data, v.data(), size_t(t->numel()));
      extra.push_back(name);
    };
    read("embed_tokens.weight", e.embed, {c.V, c.H});
    read("mask_hidden", e.mask_hidden, {1, 1, 3 * c.H});
  }
  for (auto& t : f.tensors())
    TALON_CHECK(t.name == "d2t" || t.name == "t2d" || std::find(names.begin(), names.end(), t.name) != names.end() ||
                    std::find(extra.begin(), extra.end(), t.name) != extra.end(),
                "{}: unexpected tensor '{}' for the {} {} format", ww, t.name, export_format_name(e.format), e.drafter);
  return e;
}

}  // namespace talon::train
