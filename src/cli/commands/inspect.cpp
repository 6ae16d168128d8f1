#include "cli/commands/inspect.h"

#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>

#include "data/features.h"
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
  if (fs::is_directory(p) && fs::exists(p / kManifestName)) return inspect_dataset(p, quick, show_sample);
  if (fs::is_directory(p) || p.extension() == ".gguf") return inspect_model(p);
  if (p.extension() == ".safetensors") return inspect_safetensors(p);
  if (!fs::exists(p)) fail("{}: no such file or directory", p.string());
  fail("{}: not a feature dataset, model directory, GGUF or safetensors file", p.string());
}

}  // namespace talon
