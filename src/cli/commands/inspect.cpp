#include "cli/commands/inspect.h"

#include <cstring>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "data/features.h"
#include "draft/export.h"
#include "draft/trainer.h"
#include "io/safetensors.h"
#include "model/checkpoint.h"
#include "util/error.h"

namespace talon {

using json = nlohmann::json;

namespace {

int inspect_dataset(const fs::path& dir, bool quick, int show_sample) {
  json m = read_manifest(dir);
  std::cout << fmt::format("feature dataset {}\n", dir.string());
  std::cout << fmt::format("  format        {} v{} ({})\n", m.value("format", ""), m.value("format_version", 0),
                           m.value("status", "?"));
  std::cout << fmt::format("  model         {} ({}), config sha256 {}\n", m.value("model", ""), m.value("model_arch", ""),
                           m.value("model_config_sha256", "").substr(0, 16));
  std::cout << fmt::format("  layers        aux {} + final {} ({})\n", m.value("aux_layer_ids", json()).dump(),
                           m.value("final_layer_id", 0), m.value("convention", ""));
  std::cout << fmt::format("  hidden        H = {}, dtype {}\n", m.value("hidden_size", 0), m.value("dtype", ""));
  std::cout << fmt::format("  input         {} ({} samples, sha256 {})\n", m.value("input", ""),
                           m.value("input_samples", 0), m.value("input_sha256", "").substr(0, 16));
  DatasetCheck c = check_dataset(dir, !quick);
  std::cout << fmt::format("  contents      {} shards, {} samples, {} tokens ({} loss tokens), {:.1f} MiB\n", c.shards,
                           c.samples, c.tokens, c.loss_tokens, double(c.bytes) / (1 << 20));
  if (m.value("status", "") != "complete")
    std::cout << fmt::format("  unfinished: {} of {} planned shards written; rerun the same extract command to resume\n",
                             c.shards, m.value("planned_shards", 0));
  if (show_sample >= 0 && c.ok) {
    int64_t base = 0;
    for (auto& s : m.at("shards")) {
      const int64_t n = s.at("samples").get<int64_t>();
      if (show_sample < base + n) {
        st::File f(dir / s.at("file").get<std::string>());
        const auto& off = f.get(shard_tensors::sample_offsets);
        const auto& ids = f.get(shard_tensors::input_ids);
        const auto& mask = f.get(shard_tensors::loss_mask);
        int64_t o0, o1;
        std::memcpy(&o0, off.data + 8 * (show_sample - base), 8);
        std::memcpy(&o1, off.data + 8 * (show_sample - base + 1), 8);
        std::cout << fmt::format("  sample {} ({} tokens; [brackets] = loss-masked):\n   ", show_sample, o1 - o0);
        for (int64_t t = o0; t < o1; ++t) {
          int32_t id;
          std::memcpy(&id, ids.data + 4 * t, 4);
          std::cout << (mask.data[t] ? fmt::format(" [{}]", id) : fmt::format(" {}", id));
        }
        std::cout << "\n";
        break;
      }
      base += n;
    }
  }
  if (!c.ok) {
    for (auto& p : c.problems) std::cout << "  PROBLEM: " << p << "\n";
    std::cout << fmt::format("verification FAILED: {} problem(s)\n", c.problems.size());
    return 1;
  }
  std::cout << (quick ? "sizes verified (checksums skipped)\n" : "all shard checksums verified\n");
  return 0;
}

int inspect_model(const fs::path& p) {
  auto ck = open_checkpoint(p);
  const ModelConfig& c = ck->config();
  std::cout << fmt::format("model {}\n", p.string());
  std::cout << fmt::format("  info          {}\n", ck->info().dump());
  std::cout << fmt::format("  arch          {}: L={} H={} I={} heads={}/{} head_dim={} V={} tied={} qkv_bias={} qk_norm={}\n",
                           arch_name(c.arch), c.n_layers, c.hidden, c.intermediate, c.n_heads, c.n_kv_heads, c.head_dim,
                           c.vocab, c.tied_embeddings, c.qkv_bias, c.qk_norm);
  std::cout << fmt::format("  rope          theta={} type={} factor={}{}\n", c.rope.theta, c.rope.type, c.rope.factor,
                           c.rope.freq_factors.empty() ? "" : " (with per-frequency factors)");
  if (is_deepseek(c.arch)) {
    const DeepseekConfig& d = c.ds;
    std::cout << fmt::format("  mla           q_lora_rank={} kv_lora_rank={} nope/rope/v={}/{}/{} softmax_scale={:.6g}{}\n",
                             d.q_lora_rank, d.kv_lora_rank, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim,
                             d.softmax_scale,
                             c.rope.type == "yarn" ? fmt::format(" (yarn attention_factor={:.6g})", c.rope.attention_factor)
                                                   : "");
    std::cout << fmt::format("  moe           experts={} top{} shared={} I_moe={} dense_layers={} {}+{} groups={}/{} "
                             "norm={} scale={}\n",
                             d.n_routed_experts, d.num_experts_per_tok, d.n_shared_experts, d.moe_intermediate_size,
                             d.first_k_dense_replace, moe_scoring_name(d.scoring_func), moe_topk_name(d.topk_method), d.topk_group, d.n_group,
                             d.norm_topk_prob, d.routed_scaling_factor);
    if (!d.quant_method.empty())
      std::cout << fmt::format("  quantization  {}{}\n", d.quant_method,
                               d.quant_method == "fp8" ? fmt::format(" block {}x{}", d.fp8_block_out, d.fp8_block_in)
                                                       : fmt::format(" int4 group {}", d.int4_group));
  }
  std::cout << fmt::format("  config sha256 {}\n", c.hash());
  int64_t params = 0;
  for (auto& t : ck->tensors()) params += t.numel();
  std::cout << fmt::format("  tensors       {} ({:.1f}M parameters)\n", ck->tensors().size(), double(params) / 1e6);
  return 0;
}

// A JSON file's top-level object, or a discarded value when it is missing or not JSON.
json read_json_object(const fs::path& p) {
  std::error_code ec;
  if (!fs::is_regular_file(p, ec)) return json(json::value_t::discarded);
  json j = json::parse(read_text_file(p), nullptr, false);
  return j.is_object() ? j : json(json::value_t::discarded);
}

std::string mib(double bytes) { return fmt::format("{:.1f} MiB", bytes / (1 << 20)); }

// `talon generate --out DIR`: the manifest, the job, and the output checked against its digest.
int inspect_generated(const fs::path& dir) {
  const json m = read_json_object(dir / "manifest.json");
  const json job = read_json_object(dir / "job.json");
  std::cout << fmt::format("generated answers {}\n", dir.string());
  if (m.is_discarded()) {
    std::cout << "  unfinished: job.json but no manifest.json; rerun the same `talon generate` command to resume\n";
    if (!job.is_discarded()) std::cout << fmt::format("  job           {}\n", job.dump());
    return 1;
  }
  const json& j = m.contains("job") ? m["job"] : json::object();
  std::cout << fmt::format("  model         {}\n", j.value("model", std::string("?")));
  std::cout << fmt::format("  sampling      temperature {} top_p {} top_k {}, seed {}, samples per prompt {}, "
                           "max new tokens {}\n",
                           j.value("temperature", json()).dump(), j.value("top_p", json()).dump(),
                           j.value("top_k", json()).dump(), j.value("seed", json()).dump(),
                           j.value("samples", json()).dump(), j.value("max_new_tokens", json()).dump());
  const json& c = m.contains("counts") ? m["counts"] : json::object();
  std::cout << fmt::format("  counts        {} conversations in, {} written, {} skipped, {} turns cut at max length\n",
                           c.value("conversations", 0), c.value("written", 0), c.value("skipped", 0),
                           c.value("turns_cut_by_max_len", 0));
  if (m.contains("this_run") && m["this_run"].is_object())
    std::cout << fmt::format("  last run      {} new tokens in {:.1f} s ({:.0f} tokens/s) on {}\n",
                             m["this_run"].value("new_tokens", 0), m["this_run"].value("seconds", 0.0),
                             m["this_run"].value("tokens_per_second", 0.0), m.value("backend", std::string("?")));
  const fs::path out = dir / m.value("output", std::string("generated.jsonl"));
  std::error_code ec;
  if (!fs::is_regular_file(out, ec)) {
    std::cout << fmt::format("PROBLEM: {} is missing\n", out.string());
    return 1;
  }
  const std::string want = m.value("output_sha256", std::string());
  const std::string got = sha256_file_hex(out);
  std::cout << fmt::format("  output        {} ({}), sha256 {}\n", out.string(), mib(double(fs::file_size(out))),
                           got == want ? "verified" : "MISMATCH");
  std::cout << fmt::format("next: talon prepare --model MODEL --data {} --out TOKENS\n", out.string());
  return got == want ? 0 : 1;
}

// A `talon train` checkpoint: the job's settings, the step, the draft's sizes and what the
// file holds (weights vs optimizer moments), plus the run directory's metrics when present.
int inspect_train(const fs::path& path) {
  const fs::path ck = fs::is_directory(path) ? path / train::kCheckpointName : path;
  const fs::path dir = ck.parent_path();
  st::File f(ck);
  auto mit = f.metadata().find("talon.train");
  TALON_CHECK(mit != f.metadata().end(), "{}: no 'talon.train' metadata; not a `talon train` checkpoint", ck.string());
  const json meta = json::parse(mit->second, nullptr, false);
  TALON_CHECK(meta.is_object(), "{}: 'talon.train' metadata is not a JSON object", ck.string());
  std::cout << fmt::format("training run {}\n", dir.string());
  std::cout << fmt::format("  step          {}{}\n", meta.value("step", 0),
                           meta.value("online", false) ? " (online: features made in process)" : "");
  if (meta.contains("draft") && meta["draft"].is_object()) {
    const json& d = meta["draft"];
    std::cout << fmt::format("  draft         H={} I={} heads={}/{} head_dim={} vocab {} of {} norm_before_residual={}\n",
                             d.value("hidden_size", 0), d.value("intermediate_size", 0),
                             d.value("num_attention_heads", 0), d.value("num_key_value_heads", 0),
                             d.value("head_dim", 0), d.value("draft_vocab_size", 0), d.value("vocab_size", 0),
                             d.value("norm_before_residual", false));
  }
  std::cout << fmt::format("  layers        aux {} + final {} ({})\n", meta.value("aux_layer_ids", json()).dump(),
                           meta.value("final_layer_id", json()).dump(), meta.value("convention", std::string()));
  if (meta.contains("job") && meta["job"].is_object()) {
    std::cout << "  settings\n";
    for (auto& [k, v] : meta["job"].items())
      std::cout << fmt::format("    {:<22}{}\n", k, v.is_string() ? v.get<std::string>() : v.dump());
  }
  int64_t weights = 0, moments = 0, other = 0;
  size_t weight_bytes = 0, moment_bytes = 0;
  for (auto& t : f.tensors()) {
    const bool moment = t.name.rfind("m.", 0) == 0 || t.name.rfind("v.", 0) == 0;
    const bool vocab = t.name == "d2t" || t.name == "t2d";
    (moment ? moments : vocab ? other : weights) += t.numel();
    (moment ? moment_bytes : weight_bytes) += vocab ? 0 : t.nbytes;
  }
  std::cout << fmt::format("  tensors       {:.2f}M trained parameters ({}), AdamW moments {:.2f}M ({}), file {} "
                           "(checksummed)\n",
                           double(weights) / 1e6, mib(double(weight_bytes)), double(moments) / 1e6,
                           mib(double(moment_bytes)), mib(double(f.file_size())));
  std::ifstream metrics(dir / train::kMetricsName);
  if (metrics) {
    std::string line;
    json last_train, last_eval;
    int64_t lines = 0;
    while (std::getline(metrics, line)) {
      json j = json::parse(line, nullptr, false);
      if (!j.is_object()) continue;
      ++lines;
      (j.value("split", std::string()) == "eval" ? last_eval : last_train) = j;
    }
    auto accs = [](const json& j) {
      std::string s;
      if (j.contains("acc") && j["acc"].is_array())
        for (auto& a : j["acc"]) s += fmt::format(" {:.3f}", a.is_number() ? a.get<double>() : 0.0);
      return s;
    };
    std::cout << fmt::format("  metrics       {} records in {}\n", lines, (dir / train::kMetricsName).string());
    if (last_train.is_object())
      std::cout << fmt::format("    last step   {}: loss {:.4f}, acc_k{}, {:.0f} tokens/s\n", last_train.value("step", 0),
                               last_train.value("loss", 0.0), accs(last_train), last_train.value("tokens_per_s", 0.0));
    if (last_eval.is_object())
      std::cout << fmt::format("    held back   after step {}: loss {:.4f}, acc_k{}, simulated acceptance length "
                               "{:.3f}\n",
                               last_eval.value("step", 0), last_eval.value("loss", 0.0), accs(last_eval),
                               last_eval.value("sim_accept_len", 0.0));
  }
  std::cout << fmt::format("next: talon export --run {} --model MODEL --format speculators --out DIR\n",
                           dir.string());
  return 0;
}

// `talon eval --out DIR` (or its eval.json): the run's settings and its table.
int inspect_eval(const fs::path& path) {
  const fs::path p = fs::is_directory(path) ? path / "eval.json" : path;
  const json doc = read_json_object(p);
  TALON_CHECK(!doc.is_discarded(), "{}: not a JSON object", p.string());
  std::cout << fmt::format("evaluation {}{}\n", p.string(), doc.value("complete", true) ? "" : " (INCOMPLETE: stopped)");
  std::cout << fmt::format("  target        {} on {}\n", doc.value("model", std::string()),
                           doc.value("backend", std::string()));
  std::cout << fmt::format("  draft         {} on {}\n", doc.value("draft", std::string()),
                           doc.value("draft_backend", std::string()));
  std::cout << fmt::format("  decoding      max new tokens {}, top_p {}, top_k {}, seed {}\n",
                           doc.value("max_new_tokens", json()).dump(), doc.value("top_p", json()).dump(),
                           doc.value("top_k", json()).dump(), doc.value("seed", json()).dump());
  std::cout << fmt::format("  {:>5}  {:<16} {:<14} {:>6} {:>7} {:>8} {:>10}\n", "temp", "config", "category", "turns",
                           "tau", "speedup", "break-even");
  if (doc.contains("results") && doc["results"].is_array())
    for (auto& r : doc["results"]) {
      if (!r.is_object()) continue;
      // break-even: a round's cost in target-only tokens (older eval.json files lack it).
      const double be = r.contains("break_even_tau") && r["break_even_tau"].is_number() ? r["break_even_tau"].get<double>()
                                                                                         : 0.0;
      std::cout << fmt::format("  {:>5.2f}  {:<16} {:<14} {:>6} {:>7.3f} {:>7.2f}x {:>10}\n", r.value("temperature", 0.0),
                               r.value("config", std::string()), r.value("category", std::string()),
                               r.value("turns", 0), r.value("tau", 0.0), r.value("speedup", 0.0),
                               be > 0 ? fmt::format("{:.2f}", be) : std::string("-"));
    }
  const fs::path html = p.parent_path() / "eval.html";
  if (fs::exists(html)) std::cout << fmt::format("  page          {}\n", html.string());
  return 0;
}

bool is_draft_export(const json& cfg) {
  if (!cfg.contains("architectures") || !cfg["architectures"].is_array()) return false;
  for (auto& a : cfg["architectures"])
    if (a == "Eagle3Speculator" || a == "PEagleSpeculator" || a == "DFlashSpeculator" || a == "LlamaForCausalLMEagle3")
      return true;
  return false;
}

// A `talon export` directory (either format) read back the way `talon eval --draft` reads it.
int inspect_export(const fs::path& dir) {
  train::ExportedDraft d = train::load_exported_draft(dir);
  const eagle3::DraftConfig& c = d.config;
  const bool sp = d.format == train::ExportFormat::Speculators;
  std::cout << fmt::format("draft export {} ({})\n", dir.string(),
                           sp ? "speculators format: vLLM" : "SpecForge format: SGLang");
  std::cout << fmt::format("  draft         H={} I={} heads={}/{} head_dim={} vocab {} of {} dtype {}\n", c.H, c.I,
                           c.n_heads, c.n_kv_heads, c.head_dim, c.Vd, c.V, dtype_name(d.dtype));
  std::vector<int64_t> engine_ids = d.aux_layer_ids;
  if (!sp)
    for (auto& id : engine_ids) id -= 1;
  std::cout << fmt::format("  aux layers    {} (input-of-layer){}\n", fmt::join(d.aux_layer_ids, ","),
                           sp ? std::string() : fmt::format("; stored as {} (SGLang's convention)",
                                                            fmt::join(engine_ids, ",")));
  int64_t params = 0;
  if (d.drafter == "dflash") {
    for (auto& [name, w] : train::dflash_named(d.dweights, d.dflash)) params += int64_t(w->size());
    std::cout << fmt::format("  drafter       DFlash (block drafter): {} layers, blocks of {}, {} aux layers, mask token {}\n",
                             d.dflash.layers, d.dflash.block, d.dflash.n_aux, d.mask_token_id);
  } else {
    for (auto& [name, w] : d.weights.named()) params += int64_t(w->size());
  }
  if (d.drafter == "peagle") {
    params += int64_t(d.embed.size() + d.mask_hidden.size());
    std::cout << fmt::format("  drafter       P-EAGLE (parallel drafting), mask token {}, own embeddings\n",
                             d.mask_token_id);
  }
  std::cout << fmt::format("  weights       {:.2f}M parameters\n", double(params) / 1e6);
  if (sp) {
    std::cout << fmt::format("  verifier      {}\n", d.verifier);
    std::cout << fmt::format("  proposal      {} speculative tokens\n", d.speculative_tokens);
  }
  std::cout << fmt::format("serve: {}\n", train::serve_command(d.format, dir, sp ? d.verifier : std::string("TARGET"),
                                                                 sp ? d.speculative_tokens : 3, d.drafter));
  return 0;
}

int inspect_safetensors(const fs::path& p) {
  st::File f(p);
  std::cout << fmt::format("safetensors {} ({} bytes, {} tensors)\n", p.string(), f.file_size(), f.tensors().size());
  for (auto& [k, v] : f.metadata()) std::cout << fmt::format("  meta {} = {}\n", k, v);
  for (auto& t : f.tensors())
    std::cout << fmt::format("  {} {} {}\n", t.name, dtype_name(t.dtype), st::shape_str(t.shape));
  return 0;
}

}  // namespace

int inspect_path(const fs::path& p, bool quick, int show_sample) {
  const bool dir = fs::is_directory(p);
  if (dir) {
    const std::string format = [&] {
      const json m = read_json_object(p / kManifestName);
      return m.is_discarded() ? std::string() : m.value("format", std::string());
    }();
    if (format == "talon.generate" || (format.empty() && fs::exists(p / "job.json") && fs::exists(p / "generated.jsonl")))
      return inspect_generated(p);
    if (fs::exists(p / kManifestName)) return inspect_dataset(p, quick, show_sample);
    if (fs::exists(p / train::kCheckpointName)) return inspect_train(p);
    if (fs::exists(p / "eval.json")) return inspect_eval(p);
    if (is_draft_export(read_json_object(p / "config.json"))) return inspect_export(p);
    if (fs::exists(p / train::kMetricsName))
      fail("{}: a `talon train` run directory without a checkpoint yet (the first one is written after --save-every "
           "steps or at the end); rerun the same train command to resume",
           p.string());
  }
  if (dir || p.extension() == ".gguf") return inspect_model(p);
  if (p.filename() == "eval.json") return inspect_eval(p);
  if (p.extension() == ".safetensors") {
    {
      st::File f(p);
      if (f.metadata().count("talon.train")) return inspect_train(p);
    }
    return inspect_safetensors(p);
  }
  if (!fs::exists(p)) fail("{}: no such file or directory", p.string());
  fail("{}: not a feature dataset, model directory, GGUF or safetensors file", p.string());
}

}  // namespace talon
