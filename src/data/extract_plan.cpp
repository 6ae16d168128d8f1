// `talon extract`, plan: the shards of the samples, the job's pinned description and the
// work units a rank computes. Everything here follows from the inputs alone, so a resumed
// or multi-rank run plans exactly what an uninterrupted single run does.
#include <algorithm>

#include "data/extract_internal.h"
#include "data/features.h"
#include "data/samples.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "util/file.h"

namespace talon::extract {

namespace {

// Identity of the weights: names, stored types and shapes of every tensor.
std::string weights_fingerprint(const Checkpoint& ck) {
  Sha256 h;
  for (auto& t : ck.tensors()) {
    std::string s = t.name + "|" + t.stored_type + "|" + st::shape_str(t.shape) + "\n";
    h.update(s.data(), s.size());
  }
  return h.hex();
}

// Consecutive samples until a shard holds at least shard_tokens tokens.
std::vector<ShardPlan> plan_shards(const SampleSource& src, int64_t shard_tokens) {
  std::vector<ShardPlan> plan;
  ShardPlan cur{0, 0, 0};
  for (size_t i = 0; i < src.size(); ++i) {
    cur.count++;
    cur.tokens += int64_t(src.at(i).input_ids.size());
    if (cur.tokens >= shard_tokens) {
      plan.push_back(cur);
      cur = {int64_t(i) + 1, 0, 0};
    }
  }
  if (cur.count) plan.push_back(cur);
  return plan;
}

}  // namespace

Plan make_plan(const ExtractOptions& opt, const Checkpoint& ck, const SampleSource& src, const std::vector<int>& aux,
               const std::string& backend) {
  const ModelConfig& cfg = ck.config();
  const int64_t L = cfg.n_layers, H = cfg.hidden;
  Plan p;
  p.feat_dt = opt.fp32 ? DType::F32 : DType::BF16;
  const int64_t bytes_per_token = (3 + 1) * H * int64_t(dtype_size(p.feat_dt)) + 5;
  p.shard_tokens = opt.shard_tokens > 0 ? opt.shard_tokens : std::max<int64_t>(1, (512ll << 20) / bytes_per_token);
  p.shards = plan_shards(src, p.shard_tokens);
  p.want = {{"format", kFeaturesFormat},
            {"format_version", kFeaturesVersion},
            {"convention", kLayerConvention},
            {"convention_text", kLayerConventionText},
            {"aux_layer_ids", aux},
            {"final_layer_id", L},
            {"num_layers", L},
            {"hidden_size", H},
            {"vocab_size", cfg.vocab},
            {"dtype", opt.fp32 ? "f32" : "bf16"},
            {"model", opt.model.string()},
            {"model_arch", arch_name(cfg.arch)},
            {"model_config", cfg.to_json()},
            {"model_config_sha256", cfg.hash()},
            {"model_weights_fingerprint", weights_fingerprint(ck)},
            {"input", src.path()},
            {"input_format", src.format()},
            {"input_sha256", src.sha256()},
            {"input_samples", src.size()},
            {"shard_tokens", p.shard_tokens},
            {"planned_shards", p.shards.size()},
            {"backend", backend},
            {"talon_version", TALON_VERSION}};
  return p;
}

// Work units: runs of consecutive shards holding at least 4 batches' worth of tokens,
// so batches fill the token budget even when shards are small. Unit boundaries are
// fixed by the plan alone (never by where a resume starts or by the number of ranks),
// so every unit is always computed in the same batches and a resumed dataset is
// byte-identical; a unit with some shards already written is recomputed, but only its
// missing shards are written. Rank r computes the units u with u % world == r.
WorkUnits plan_units(const std::vector<ShardPlan>& shards, int64_t max_batch_tokens,
                     const std::map<int64_t, json>& done, const RankInfo& rk) {
  WorkUnits w;
  const int64_t target = 4 * max_batch_tokens;
  int64_t b = 0, tok = 0, u = 0;
  for (int64_t si = 0; si < int64_t(shards.size()); ++si) {
    tok += shards[size_t(si)].tokens;
    if (tok >= target || si + 1 == int64_t(shards.size())) {
      bool missing = false;
      for (int64_t k = b; k <= si; ++k) missing |= !done.count(k);
      if (missing && u % rk.world == rk.rank) {
        w.units.push_back({b, si + 1});
        w.my_tokens += tok;
      }
      b = si + 1;
      tok = 0;
      ++u;
    }
  }
  for (size_t i = 0; i < shards.size(); ++i) {
    w.total_tokens += shards[i].tokens;
    if (done.count(int64_t(i))) w.done_tokens += shards[i].tokens;
  }
  return w;
}

}  // namespace talon::extract
