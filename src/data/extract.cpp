// `talon extract`: checks the inputs, loads the model replicas, then runs the steps of
// extract_internal.h: plan the job, resume its output directory, run the pipeline over
// the work units left to this rank, and complete the manifest.
#include "data/extract.h"

#include <omp.h>

#include <algorithm>
#include <chrono>

#include "backend/backend.h"
#include "data/extract_internal.h"
#include "data/features.h"
#include "data/samples.h"
#include "model/model.h"
#include "util/error.h"
#include "util/log.h"
#include "util/mem.h"
#include "util/threads.h"

namespace talon {

using Clock = std::chrono::steady_clock;

namespace {

void check_options(const ExtractOptions& opt, const DeviceSpec& dev) {
  if (dev.cuda && !cuda_backend_built())
    fail("--device {}: this build has no CUDA backend (nvcc was not found when it was configured); use --device cpu",
         opt.device);
  TALON_CHECK(opt.tp >= 1 && opt.ep >= 1 && opt.dp >= 0, "--tp and --ep must be >= 1 and --dp >= 0 (got {}, {} and {})",
              opt.tp, opt.ep, opt.dp);
  TALON_CHECK(opt.tp == 1 || opt.ep == 1, "--tp {} and --ep {}: a replica is either tensor or expert parallel", opt.tp,
              opt.ep);
  TALON_CHECK(dev.cuda || (opt.tp == 1 && opt.ep == 1 && opt.dp <= 1), "--tp/--ep/--dp need --device cuda");
  TALON_CHECK(opt.max_batch_tokens > 0, "--max-batch-tokens must be positive, got {}", opt.max_batch_tokens);
  TALON_CHECK(opt.shard_tokens >= 0, "--shard-tokens must be >= 0, got {}", opt.shard_tokens);
}

void check_vocab(const SampleSource& src, int64_t vocab) {
  for (size_t i = 0; i < src.size(); ++i) {
    const Sample& s = src.at(i);
    for (size_t k = 0; k < s.input_ids.size(); ++k)
      TALON_CHECK(s.input_ids[k] < vocab, "{}:{}: input_ids[{}] = {} outside the model's vocabulary [0, {})",
                  src.path(), s.line, k, s.input_ids[k], vocab);
  }
}

// Model replicas: data parallel groups of tp (or ep) devices each; one group of none on CPU.
std::vector<std::vector<int>> replica_groups(const ExtractOptions& opt, const DeviceSpec& dev) {
  std::vector<std::vector<int>> groups;
  if (!dev.cuda) {
    groups.push_back({});
    return groups;
  }
  std::vector<int> devs = dev.devices;
  if (devs.empty()) {
    const auto gpus = list_gpus();
    TALON_CHECK(!gpus.empty(), "--device {}: no CUDA device available", opt.device);
    for (auto& g : gpus) devs.push_back(g.index);
  }
  const int per = opt.tp * opt.ep;
  int dp = opt.dp > 0 ? opt.dp : int(devs.size()) / per;
  TALON_CHECK(dp >= 1 && int64_t(dp) * per <= int64_t(devs.size()),
              "--{} {} x --dp {} needs {} GPUs but --device {} gives {}", opt.ep > 1 ? "ep" : "tp", per,
              std::max(dp, 1), std::max(dp, 1) * per, opt.device, devs.size());
  for (int g = 0; g < dp; ++g) groups.emplace_back(devs.begin() + g * per, devs.begin() + (g + 1) * per);
  return groups;
}

// One model per group, loaded concurrently.
std::vector<std::unique_ptr<Model>> load_replicas(const ExtractOptions& opt, const DeviceSpec& dev,
                                                  const Checkpoint& ckpt, const std::vector<std::vector<int>>& groups,
                                                  const std::vector<int>& aux) {
  std::vector<std::unique_ptr<Model>> models(groups.size());
  run_threads(int(groups.size()), [&](int gi) {
    const size_t g = size_t(gi);
    if (!dev.cuda) {
      models[g] = make_cpu_model(ckpt);
      return;
    }
    set_thread_log_tag(fmt::format("gpu {}", groups[g][0]));
    GpuOptions go;
    go.devices = groups[g];
    go.tp = opt.tp;
    go.ep = opt.ep;
    go.share_devices = opt.share_gpus;
    go.max_tokens = opt.max_batch_tokens;
    go.n_capture = int64_t(aux.size()) + 1;
    go.capture_dtype = opt.fp32 ? DType::F32 : DType::BF16;
    models[g] = make_cuda_model(ckpt, go);
  });
  return models;
}

}  // namespace

ExtractReport run_extract(const ExtractOptions& opt) {
  ExtractReport rep;
  const auto t_start = Clock::now();
  const DeviceSpec dev = parse_device(opt.device, opt.share_gpus);
  check_options(opt, dev);
  if (opt.threads > 0) omp_set_num_threads(opt.threads);

  // Inputs first: every check that can fail runs before anything is written.
  auto ckpt = open_checkpoint(opt.model);
  const ModelConfig& cfg = ckpt->config();
  const int64_t L = cfg.n_layers, H = cfg.hidden;
  std::vector<int> aux = opt.layers.empty() ? default_aux_layers(L) : parse_layer_ids(opt.layers, L);
  auto src = open_samples(opt.data);
  check_vocab(*src, cfg.vocab);
  const auto groups = replica_groups(opt, dev);
  const auto models = load_replicas(opt, dev, *ckpt, groups, aux);
  Model* model = models[0].get();
  rep.load_seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
  tlog::info("model {} ({}, L={}, H={}, V={}) loaded in {:.2f}s on {}{}", opt.model.string(), arch_name(cfg.arch), L, H,
             cfg.vocab, rep.load_seconds, model->backend(),
             dev.cuda ? fmt::format(" x {} data-parallel replica(s)", models.size())
                      : fmt::format(" with {} threads", omp_get_max_threads()));
  tlog::info("memory after load: {}", format_mem(mem_usage()));
  tlog::info("layers: aux h{} + final h[{}] ({}: {})", fmt::format("{}", fmt::join(aux, ",")), L,
             kLayerConvention, kLayerConventionText);

  const extract::Plan plan = extract::make_plan(opt, *ckpt, *src, aux, model->backend());

  const RankInfo rk = resolve_rank(opt.rank, opt.world);
  const bool multi = rk.world > 1;
  if (multi) {
    set_thread_log_tag(fmt::format("rank {}", rk.rank));
    tlog::info("rank {} of {} ({}); this rank computes work units u with u % {} == {}", rk.rank, rk.world, rk.source,
               rk.world, rk.rank);
  }
  std::vector<int> all_gpus;
  for (auto& g : groups) all_gpus.insert(all_gpus.end(), g.begin(), g.end());
  extract::OutputDir dir(opt.out, rk, plan, all_gpus);
  rep.aux_layers = aux;
  rep.final_layer = int(L);
  rep.manifest = dir.manifest_path();
  if (dir.complete()) {
    rep.status = ExtractStatus::AlreadyComplete;
    rep.samples = dir.manifest().value("num_samples", 0);
    rep.tokens = dir.manifest().value("num_tokens", 0);
    rep.loss_tokens = dir.manifest().value("num_loss_tokens", 0);
    rep.shards = int64_t(dir.done().size());
    tlog::info("{} is already complete ({} samples); nothing to do", opt.out.string(), rep.samples);
    return rep;
  }
  const int64_t done_shards = int64_t(dir.done().size());
  const extract::WorkUnits work = extract::plan_units(plan.shards, opt.max_batch_tokens, dir.done(), rk);
  if (done_shards > 0)
    tlog::info("resuming: {} of {} shards already written ({} tokens)", done_shards, plan.shards.size(),
               work.done_tokens);

  const auto t_run = Clock::now();
  const extract::PipelineResult run = extract::run_pipeline(opt, models, groups, *src, plan, work, aux, L, H, rk, dir);
  auto interrupted_report = [&] {
    rep.status = ExtractStatus::Interrupted;
    rep.shards = int64_t(dir.done().size());
    rep.tokens_this_run = run.tokens_written;
    rep.seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
    return rep;
  };
  if (run.interrupted) return interrupted_report();
  if (multi && rk.rank != 0) {
    rep.status = ExtractStatus::RankDone;
    rep.shards = int64_t(dir.my_records().size());
    rep.tokens_this_run = run.tokens_written;
    rep.seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
    tlog::info("rank {}: all its work units are written ({} tokens this run); rank 0 completes the manifest", rk.rank,
               run.tokens_written);
    return rep;
  }
  // Rank 0 of several: wait until the ranks' progress files cover the whole plan, then
  // fold them into the manifest in shard order.
  if (multi && !dir.collect_ranks()) return interrupted_report();
  dir.finish();
  const auto& m = dir.manifest();
  rep.status = ExtractStatus::Complete;
  rep.samples = m.at("num_samples").get<int64_t>();
  rep.tokens = m.at("num_tokens").get<int64_t>();
  rep.loss_tokens = m.at("num_loss_tokens").get<int64_t>();
  rep.shards = int64_t(m.at("shards").size());
  rep.tokens_this_run = run.tokens_written;
  rep.seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
  const double run_s = std::chrono::duration<double>(Clock::now() - t_run).count();
  tlog::info("extract: {} tokens in {:.2f}s ({:.0f} tok/s); {}", run.tokens_written, run_s,
             run_s > 0 ? double(run.tokens_written) / run_s : 0.0, format_mem(mem_usage()));
  return rep;
}

}  // namespace talon
