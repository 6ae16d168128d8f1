// A tensor-parallel cached decoder (model/decode.h) over several GPUs in this process: one rank
// decoder per GPU (cuda_deepseek_decoder.cpp with its DeepseekParallel share), each driven by
// its own thread (rank_workers.h), joined by NCCL or, when ranks share a GPU, by device copies
// (collective.h). Every rank runs every request: the same slots, rows and commits, so their
// caches stay in step. Rank 0 holds the whole residual stream after each all-reduce, so it
// alone captures and computes logits or ids; the others stop after the last layer.
//
// The group keeps a host mirror of the ranks' slot bookkeeping (decode_slots.h, with the
// smallest rank's cache capacity): a request is checked and its pages taken there first, so a
// malformed request or a full cache is refused before any rank starts, and a failure inside a
// forward (which aborts the group's collectives, leaving the group unusable) means a real
// fault, not bad input.
#include <fmt/ranges.h>

#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/check.h"
#include "backend/cuda/collective.h"
#include "backend/cuda/cuda_decoder.h"
#include "backend/cuda/cuda_model.h"
#include "backend/cuda/decode_slots.h"
#include "backend/cuda/rank_workers.h"
#include "model/deepseek.h"
#include "util/error.h"
#include "util/log.h"

namespace talon::cuda {

namespace {

class GroupDecoder final : public Decoder, public DecoderControls {
 public:
  using MakeRank = std::function<std::unique_ptr<Decoder>(int rank, Collectives* comm)>;

  GroupDecoder(std::vector<int> devices, bool shared, const MakeRank& make) : devices_(std::move(devices)) {
    const int n = int(devices_.size());
    comm_ = shared ? make_shared_collectives(n) : make_nccl_collectives(devices_);
    ranks_.resize(size_t(n));
    workers_ = std::make_unique<RankWorkers>(
        n, [this](int r) { return fmt::format("gpu {} rank {}", devices_[size_t(r)], r); }, comm_.get());
    try {
      workers_->run([&](int r) {
        CUDA_CHECK(cudaSetDevice(devices_[size_t(r)]));
        ranks_[size_t(r)] = make(r, comm_.get());
      });
    } catch (...) {
      workers_.reset();
      ranks_.clear();
      comm_.reset();
      throw;
    }
    int64_t cap = ranks_[0]->cache_capacity();
    for (auto& d : ranks_) {
      TALON_CHECK(dynamic_cast<DecoderControls*>(d.get()) != nullptr, "decoder group: rank {} is not a CUDA decoder",
                  d->backend());
      cap = std::min(cap, d->cache_capacity());
    }
    mirror_ = std::make_unique<DecodeSlots>(ranks_[0]->n_slots(), ranks_[0]->max_len(), cap);
    pending_.assign(size_t(ranks_[0]->n_slots()), 0);
  }

  ~GroupDecoder() override {
    workers_.reset();
    ranks_.clear();
    comm_.reset();
  }

  const ModelConfig& config() const override { return ranks_[0]->config(); }
  std::string backend() const override {
    return fmt::format("cuda:{} (tp {}, absorbed MLA)", fmt::join(devices_, ","), devices_.size());
  }
  int n_slots() const override { return ranks_[0]->n_slots(); }
  int64_t max_len() const override { return ranks_[0]->max_len(); }
  int64_t length(int slot) const override { return mirror_->length(slot); }
  int64_t page_rows() const override { return mirror_->pages().page_rows(); }
  int64_t cache_capacity() const override { return mirror_->pages().capacity(); }

  void forward(const std::vector<DecodeRequest>& reqs, const Capture& cap, float* logits) override {
    each(reqs, [&](Decoder& d, bool lead) {
      if (lead) d.forward(reqs, cap, logits);
      else d.forward(reqs, Capture{}, nullptr);
    });
  }
  void forward_greedy(const std::vector<DecodeRequest>& reqs, const Capture& cap, int32_t* ids) override {
    each(reqs, [&](Decoder& d, bool lead) {
      if (lead) d.forward_greedy(reqs, cap, ids);
      else d.forward(reqs, Capture{}, nullptr);
    });
  }
  void forward_sample(const std::vector<DecodeRequest>& reqs, const Capture& cap, const SamplingParams& p,
                      const double* u, int32_t* ids) override {
    each(reqs, [&](Decoder& d, bool lead) {
      if (lead) d.forward_sample(reqs, cap, p, u, ids);
      else d.forward(reqs, Capture{}, nullptr);
    });
  }
  void commit(int slot, const std::vector<int32_t>& keep) override {
    mirror_->commit(slot, keep, pending_);  // checks the path first
    workers_->run([&](int r) { ranks_[size_t(r)]->commit(slot, keep); });
  }
  void reset(int slot) override {
    mirror_->reset(slot, pending_);
    workers_->run([&](int r) { ranks_[size_t(r)]->reset(slot); });
  }

  // DecoderControls: every rank alike.
  void assume_length(int slot, int64_t len) override {
    mirror_->reset(slot, pending_, len);
    workers_->run([&](int r) { controls(r).assume_length(slot, len); });
  }
  void use_graphs(bool on) override {
    workers_->run([&](int r) { controls(r).use_graphs(on); });
  }
  int64_t graph_launches() const override { return controls(0).graph_launches(); }

 private:
  DecoderControls& controls(int r) const { return *dynamic_cast<DecoderControls*>(ranks_[size_t(r)].get()); }

  // A forward on every rank (rank 0 leads: captures and logits or ids), after the mirror took
  // the requests (refusing bad ones before any rank runs); then the pending counts commit_all
  // reads.
  template <class F>
  void each(const std::vector<DecodeRequest>& reqs, F&& f) {
    DecodeBatch b = mirror_->plan(reqs, pending_, config().vocab);
    workers_->run([&](int r) { f(*ranks_[size_t(r)], r == 0); });
    mirror_->ran(reqs, b, pending_);
  }

  std::vector<int> devices_;
  std::unique_ptr<Collectives> comm_;
  std::vector<std::unique_ptr<Decoder>> ranks_;
  std::unique_ptr<RankWorkers> workers_;  // thread r drives ranks_[r]
  std::unique_ptr<DecodeSlots> mirror_;   // the ranks' slot bookkeeping, on the host
};

}  // namespace

std::unique_ptr<Decoder> make_deepseek_decoder_group(const Checkpoint& ckpt, const GpuOptions& go, int n_slots,
                                                     int64_t max_len, int64_t cache_tokens) {
  const ModelConfig& c = ckpt.config();
  TALON_CHECK(is_deepseek(c.arch), "{}: tensor-parallel decoding is built for the DeepSeek family; {} decodes on one GPU",
              ckpt.source(), arch_name(c.arch));
  TALON_CHECK(go.ep == 1, "--ep {}: expert-parallel decoding is not built; use --tp", go.ep);
  const int n = go.tp;
  TALON_CHECK(int(go.devices.size()) == n, "--tp {} needs {} devices, got {}", n, n, go.devices.size());
  TALON_CHECK(c.n_heads % n == 0 && c.ds.n_routed_experts % n == 0,
              "--tp {}: the model's {} attention heads and {} routed experts must divide by it", n, c.n_heads,
              c.ds.n_routed_experts);
  return std::make_unique<GroupDecoder>(go.devices, go.share_devices, [&](int r, Collectives* comm) {
    return make_deepseek_rank_decoder(ckpt, go.devices[size_t(r)], n_slots, max_len, cache_tokens,
                                      DeepseekParallel{DeepseekParallel::Mode::Tensor, r, n, comm});
  });
}

}  // namespace talon::cuda
