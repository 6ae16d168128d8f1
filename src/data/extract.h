// `talon extract`: run the target over tokenized samples and write EAGLE-3 features.
// Resumable: shards are the unit of work; the manifest lists finished shards and pins
// every input (model identity, data hash, layer ids, shard plan), so rerunning the same
// command continues where a killed run stopped and the result is bit-identical to an
// uninterrupted run.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "util/dist.h"

#include "util/file.h"

namespace talon {

struct ExtractOptions {
  fs::path model;
  fs::path data;
  fs::path out;
  std::string layers;            // "a,b,c" or empty for the default [2, L/2, L-3]
  std::string device = "cpu";    // cpu | cuda | cuda:N[,M...]
  int tp = 1;                    // tensor-parallel degree (GPUs per model replica)
  int dp = 0;                    // data-parallel replicas (0: as many as the devices allow)
  int ep = 1;                    // expert-parallel degree (MoE models; GPUs per replica; excludes tp > 1)
  bool share_gpus = false;       // --device may list a GPU twice (ranks on one GPU; checking layouts)
  bool fp32 = false;             // store features as F32 instead of BF16
  int64_t shard_tokens = 0;      // 0: about 512 MiB of features per shard
  int64_t max_batch_tokens = 4096;
  int threads = 0;               // 0: all cores
  // Several processes (usually one per node) sharing --out: rank and world size from
  // these flags, else from SLURM_PROCID/SLURM_NTASKS, OMPI_COMM_WORLD_RANK/_SIZE,
  // PMI_RANK/PMI_SIZE or RANK/WORLD_SIZE (torchrun); -1: not given.
  int rank = -1, world = -1;
  // Test hook: stop (as if signalled) after this many shards were written this run.
  int64_t stop_after_shards = -1;
};

enum class ExtractStatus { Complete, AlreadyComplete, Interrupted, RankDone };


struct ExtractReport {
  ExtractStatus status = ExtractStatus::Complete;
  int64_t samples = 0, tokens = 0, loss_tokens = 0, shards = 0;
  int64_t tokens_this_run = 0;
  double seconds = 0, load_seconds = 0;
  std::vector<int> aux_layers;
  int final_layer = 0;
  fs::path manifest;
};

ExtractReport run_extract(const ExtractOptions& opt);

}  // namespace talon
