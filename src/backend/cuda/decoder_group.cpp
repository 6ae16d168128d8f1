// A parallel cached decoder (model/decode.h) over several GPUs in this process: one rank decoder
// per GPU (cuda_deepseek_decoder.cpp with its DeepseekParallel share), each driven by its own
// thread (rank_workers.h), joined by NCCL or, when ranks share a GPU, by device copies
// (collective.h).
//  * Tensor parallel: every rank runs every request (the same slots, rows and commits, so their
//    caches stay in step). Rank 0 holds the whole residual stream after each all-reduce, so it
//    alone captures and computes logits or ids; the others stop after the last layer.
//  * Expert parallel: the slots are split in contiguous runs, one per rank, and a rank holds
//    only its own slots' caches; a forward gives each rank its slots' requests (a rank with none
//    still serves its experts), and their logits, ids and captures come back into the caller's
//    rows in request order.
//
// The group keeps the slot bookkeeping on the host (decode_slots.h: SlotBooks, one book per
// cache): a request is checked and its pages taken there first, so a malformed request or a
// full cache is refused before any rank starts, and a failure inside a forward (which aborts the
// group's collectives, leaving the group unusable) means a real fault, not bad input.
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
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
#include "util/dtype.h"
#include "util/error.h"
#include "util/log.h"

namespace talon::cuda {

namespace {

class GroupDecoder final : public Decoder, public DecoderControls {
 public:
  using MakeRank = std::function<std::unique_ptr<Decoder>(int rank, int local_slots, Collectives* comm)>;

  GroupDecoder(std::vector<int> devices, bool shared, bool by_slot, int n_slots, const MakeRank& make)
      : devices_(std::move(devices)), by_slot_(by_slot), n_slots_(n_slots) {
    const int n = int(devices_.size());
    per_ = by_slot_ ? (n_slots + n - 1) / n : n_slots;
    comm_ = shared ? make_shared_collectives(n) : make_nccl_collectives(devices_);
    ranks_.resize(size_t(n));
    workers_ = std::make_unique<RankWorkers>(
        n, [this](int r) { return fmt::format("gpu {} rank {}", devices_[size_t(r)], r); }, comm_.get());
    try {
      workers_->run([&](int r) {
        CUDA_CHECK(cudaSetDevice(devices_[size_t(r)]));
        ranks_[size_t(r)] = make(r, std::max(1, local_slots(r)), comm_.get());
      });
    } catch (...) {
      workers_.reset();
      ranks_.clear();
      comm_.reset();
      throw;
    }
    for (auto& d : ranks_)
      TALON_CHECK(dynamic_cast<DecoderControls*>(d.get()) != nullptr, "decoder group: rank {} is not a CUDA decoder",
                  d->backend());
    // Each book: its rank's slots and the very pool size the rank took.
    std::vector<SlotBooks::Book> books;
    for (int r = 0; r < (by_slot_ ? n : 1); ++r)
      books.push_back({ranks_[size_t(r)]->n_slots(), ranks_[size_t(r)]->cache_capacity()});
    books_ = std::make_unique<SlotBooks>(n_slots, by_slot_, per_, ranks_[0]->max_len(), books);
    pending_.assign(size_t(n_slots), 0);  // Decoder::commit_all reads it
  }

  ~GroupDecoder() override {
    workers_.reset();
    ranks_.clear();
    comm_.reset();
  }

  const ModelConfig& config() const override { return ranks_[0]->config(); }
  std::string backend() const override {
    return fmt::format("cuda:{} ({} {}, absorbed MLA)", fmt::join(devices_, ","), by_slot_ ? "ep" : "tp",
                       devices_.size());
  }
  int n_slots() const override { return n_slots_; }
  int64_t max_len() const override { return ranks_[0]->max_len(); }
  int64_t length(int slot) const override { return books_->length(slot); }
  int64_t page_rows() const override { return books_->page_rows(); }
  int64_t cache_capacity() const override { return books_->capacity(); }

  void forward(const std::vector<DecodeRequest>& reqs, const Capture& cap, float* logits) override {
    run(reqs, cap, logits, nullptr, nullptr, nullptr);
  }
  void forward_greedy(const std::vector<DecodeRequest>& reqs, const Capture& cap, int32_t* ids) override {
    run(reqs, cap, nullptr, ids, nullptr, nullptr);
  }
  void forward_sample(const std::vector<DecodeRequest>& reqs, const Capture& cap, const SamplingParams& p,
                      const double* u, int32_t* ids) override {
    run(reqs, cap, nullptr, ids, &p, u);
  }
  void commit(int slot, const std::vector<int32_t>& keep) override {
    books_->commit(slot, keep);  // checks the path first
    pending_[size_t(slot)] = 0;
    on_owners(slot, [&](Decoder& d, int local) { d.commit(local, keep); });
  }
  void reset(int slot) override {
    books_->reset(slot);
    pending_[size_t(slot)] = 0;
    on_owners(slot, [&](Decoder& d, int local) { d.reset(local); });
  }

  // DecoderControls: the owning ranks alike.
  void assume_length(int slot, int64_t len) override {
    books_->reset(slot, len);
    pending_[size_t(slot)] = 0;
    on_owners(slot, [&](Decoder& d, int local) { dynamic_cast<DecoderControls&>(d).assume_length(local, len); });
  }
  void use_graphs(bool on) override {
    workers_->run([&](int r) { controls(r).use_graphs(on); });
  }
  int64_t graph_launches() const override { return controls(0).graph_launches(); }
  void graph_layers(int64_t n) override {
    workers_->run([&](int r) { controls(r).graph_layers(n); });
  }
  size_t graph_parts() const override { return controls(0).graph_parts(); }

 private:
  DecoderControls& controls(int r) const { return *dynamic_cast<DecoderControls*>(ranks_[size_t(r)].get()); }
  int n_ranks() const { return int(ranks_.size()); }
  // Expert parallel: rank r owns slots [r per, min((r + 1) per, n_slots)).
  int local_slots(int r) const { return by_slot_ ? std::clamp(n_slots_ - r * per_, 0, per_) : n_slots_; }

  // f(rank decoder, local slot) on every rank holding the slot (all under tensor parallelism;
  // under expert parallelism the rank of the slot's book), each on its own thread.
  template <class F>
  void on_owners(int slot, F&& f) {
    const std::pair<int, int> at = books_->where(slot);  // (book = rank, local slot)
    workers_->run([&](int r) {
      if (!by_slot_) f(*ranks_[size_t(r)], slot);
      else if (r == at.first) f(*ranks_[size_t(r)], at.second);
    });
  }

  void run(const std::vector<DecodeRequest>& reqs, const Capture& cap, float* logits, int32_t* ids,
           const SamplingParams* sp, const double* u) {
    cap.validate(config().n_layers);
    SlotBooks::Plan plan = books_->plan(reqs, config().vocab);  // refuses bad input before any rank runs
    const auto call = [&](Decoder& d, const std::vector<DecodeRequest>& rq, const Capture& c, float* lg, int32_t* id,
                          const double* uu) {
      if (id && sp) d.forward_sample(rq, c, *sp, uu, id);
      else if (id) d.forward_greedy(rq, c, id);
      else d.forward(rq, c, lg);
    };
    if (!by_slot_) {
      workers_->run([&](int r) {
        if (r == 0) call(*ranks_[0], reqs, cap, logits, ids, u);
        else ranks_[size_t(r)]->forward(reqs, Capture{}, nullptr);
      });
      ran(reqs, plan);
      return;
    }
    // Expert parallel: each rank's requests are its book's (plan.reqs: local slots, in the
    // caller's order); where their token rows and logits rows sit among the caller's.
    const int n = n_ranks();
    const int64_t V = config().vocab, H = config().hidden;
    struct Part {
      std::vector<int64_t> tok_rows, logit_rows;  // caller's rows, in this rank's order
      std::vector<double> u;
      std::vector<float> logits;
      std::vector<int32_t> ids;
      std::vector<std::vector<uint8_t>> cap;  // per captured layer [rows, H]
      Capture c;
    };
    std::vector<Part> parts(static_cast<size_t>(n));
    int64_t tok = 0, lrow = 0;
    for (const DecodeRequest& q : reqs) {
      Part& p = parts[size_t(books_->where(q.slot).first)];
      const int64_t nt = int64_t(q.tokens.size()), nl = q.all_logits ? nt : 1;
      for (int64_t i = 0; i < nt; ++i) p.tok_rows.push_back(tok + i);
      for (int64_t i = 0; i < nl; ++i) {
        p.logit_rows.push_back(lrow + i);
        if (u) p.u.push_back(u[lrow + i]);
      }
      tok += nt;
      lrow += nl;
    }
    const size_t esz = dtype_size(cap.dtype);
    for (Part& p : parts) {
      const size_t rows = p.tok_rows.size(), nl = p.logit_rows.size();
      if (logits) p.logits.resize(nl * size_t(V));
      if (ids) p.ids.resize(nl);
      p.c.layers = cap.layers;
      p.c.dtype = cap.dtype;
      for (size_t i = 0; i < cap.layers.size(); ++i) {
        p.cap.emplace_back(rows * size_t(H) * esz);
        p.c.out.push_back(p.cap.back().data());
      }
    }
    workers_->run([&](int r) {
      Part& p = parts[size_t(r)];
      call(*ranks_[size_t(r)], plan.reqs[size_t(r)], p.c, logits ? p.logits.data() : nullptr, ids ? p.ids.data() : nullptr,
           u ? p.u.data() : nullptr);
    });
    for (const Part& p : parts) {
      for (size_t k = 0; k < p.logit_rows.size(); ++k) {
        if (logits) std::memcpy(logits + p.logit_rows[k] * V, p.logits.data() + k * size_t(V), size_t(V) * 4);
        if (ids) ids[p.logit_rows[k]] = p.ids[k];
      }
      for (size_t i = 0; i < cap.layers.size(); ++i) {
        const int64_t ld = cap.stride(i, H);
        for (size_t k = 0; k < p.tok_rows.size(); ++k)
          std::memcpy(static_cast<uint8_t*>(cap.out[i]) + size_t(p.tok_rows[k] * ld) * esz,
                      p.cap[i].data() + k * size_t(H) * esz, size_t(H) * esz);
      }
    }
    ran(reqs, plan);
  }

  // The books' pages and pending tokens, and Decoder's pending counts (commit_all), after a forward.
  void ran(const std::vector<DecodeRequest>& reqs, SlotBooks::Plan& plan) {
    books_->ran(plan);
    for (const DecodeRequest& q : reqs) pending_[size_t(q.slot)] = int64_t(q.tokens.size());
  }

  std::vector<int> devices_;
  bool by_slot_;
  int n_slots_, per_ = 0;
  std::unique_ptr<Collectives> comm_;
  std::vector<std::unique_ptr<Decoder>> ranks_;
  std::unique_ptr<RankWorkers> workers_;  // thread r drives ranks_[r]
  std::unique_ptr<SlotBooks> books_;  // the slot bookkeeping, on the host (decode_slots.h)
};

}  // namespace

std::unique_ptr<Decoder> make_deepseek_decoder_group(const Checkpoint& ckpt, const GpuOptions& go, int n_slots,
                                                     int64_t max_len, int64_t cache_tokens) {
  const ModelConfig& c = ckpt.config();
  TALON_CHECK(is_deepseek(c.arch), "{}: parallel decoding is built for the DeepSeek family; {} decodes on one GPU",
              ckpt.source(), arch_name(c.arch));
  TALON_CHECK(go.tp == 1 || go.ep == 1, "--tp {} with --ep {}: use one of them", go.tp, go.ep);
  const bool ep = go.ep > 1;
  const int n = ep ? go.ep : go.tp;
  TALON_CHECK(int(go.devices.size()) == n, "--{} {} needs {} devices, got {}", ep ? "ep" : "tp", n, n,
              go.devices.size());
  TALON_CHECK((ep || c.n_heads % n == 0) && c.ds.n_routed_experts % n == 0,
              "--{} {}: the model's {} routed experts{} must divide by it", ep ? "ep" : "tp", n, c.ds.n_routed_experts,
              ep ? "" : fmt::format(" and {} attention heads", c.n_heads));
  const DeepseekParallel::Mode mode = ep ? DeepseekParallel::Mode::Expert : DeepseekParallel::Mode::Tensor;
  return std::make_unique<GroupDecoder>(
      go.devices, go.share_devices, ep, n_slots, [&](int r, int local_slots, Collectives* comm) {
        return make_deepseek_rank_decoder(ckpt, go.devices[size_t(r)], local_slots, max_len, cache_tokens,
                                          DeepseekParallel{mode, r, n, comm});
      });
}

}  // namespace talon::cuda
