// The common base of the CPU decoders (model/decode.h): their cache bookkeeping. Per slot
// and layer it keeps `width` floats per token (what that model's attention keeps: keys then
// values for the dense family; the normalized latent then k_pe for MLA), the committed
// tokens first and after them the pending tokens of the slot's last forward. It plans a
// forward (the packed rows, their positions, the logit rows), lists the cache rows a row
// attends to, and commits or drops pending rows; the pending counts are Decoder::pending_.
// Its rows are plain per-slot vectors, but it keeps the page accounting of a paged cache
// (model/kv_pages.h, pages of kPageRows tokens) and refuses a forward past the capacity as
// the CUDA decoders do, so that schedulers are tested against the same contract on the CPU.
// The arithmetic (config, backend, forward) stays with each model's decoder.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "model/decode.h"
#include "model/kv_pages.h"
#include "util/error.h"

namespace talon::cpu {

class KvSlots : public Decoder {
 public:
  struct Row {
    int slot;
    int64_t first;  // the request's first row in the packed forward
    int64_t index;  // index within the request
    size_t req;     // the request
  };
  struct Plan {
    std::vector<Row> rows;
    std::vector<int32_t> tokens, pos;
    std::vector<int64_t> logit_rows;
    std::vector<std::vector<int32_t>> parents;  // per request (a chain: i - 1)
  };

  int n_slots() const override { return int(slots_.size()); }
  int64_t max_len() const override { return max_len_; }
  int64_t length(int slot) const override { return at(slot).len; }
  int64_t page_rows() const override { return pages_.page_rows(); }
  int64_t cache_capacity() const override { return pages_.capacity(); }
  static constexpr int64_t kPageRows = 16;

  void commit(int slot, const std::vector<int32_t>& keep) override {
    Slot& s = at(slot);
    const int64_t n = pending_[size_t(slot)];
    int32_t prev = -1;
    for (size_t i = 0; i < keep.size(); ++i) {
      const int32_t k = keep[i];
      TALON_CHECK(k >= 0 && k < n && k > prev && s.parents[size_t(k)] == prev,
                  "decoder: commit of slot {}: token {} (entry {}) does not continue the kept path", slot, k, i);
      prev = k;
    }
    for (auto& l : s.rows)
      for (size_t i = 0; i < keep.size(); ++i)
        if (int64_t(keep[i]) != int64_t(i))
          std::copy_n(l.data() + (s.len + keep[i]) * width_, width_, l.data() + (s.len + int64_t(i)) * width_);
    s.len += int64_t(keep.size());
    for (auto& l : s.rows) l.resize(size_t(s.len * width_));
    pages_.resize(slot, s.len);
    pending_[size_t(slot)] = 0;
    s.parents.clear();
  }

  void reset(int slot) override {
    Slot& s = at(slot);
    s.len = 0;
    for (auto& l : s.rows) std::vector<float>().swap(l);
    s.parents.clear();
    pending_[size_t(slot)] = 0;
    pages_.resize(slot, 0);
  }

 protected:
  // cache_tokens: the capacity in token rows (0: every slot full at once).
  KvSlots(int n_slots, int64_t n_layers, int64_t width, int64_t max_len, int64_t cache_tokens = 0)
      : width_(width), max_len_(max_len), pages_(n_slots, max_len, kPageRows, cache_tokens) {
    slots_.resize(size_t(n_slots));
    for (auto& s : slots_) s.rows.resize(size_t(n_layers));
    pending_.assign(size_t(n_slots), 0);
  }

  // Checks the requests (each slot once, nothing pending, within max_len, well-formed
  // parents), makes room for their rows and returns the packed forward.
  Plan plan_forward(const std::vector<DecodeRequest>& reqs) {
    Plan p;
    std::vector<uint8_t> seen(slots_.size(), 0);
    std::vector<std::pair<int, int64_t>> grow;
    for (size_t ri = 0; ri < reqs.size(); ++ri) {
      const DecodeRequest& r = reqs[ri];
      Slot& s = at(r.slot);
      TALON_CHECK(!seen[size_t(r.slot)], "decoder: slot {} appears twice in one forward", r.slot);
      seen[size_t(r.slot)] = 1;
      TALON_CHECK(pending_[size_t(r.slot)] == 0, "decoder: slot {} has {} uncommitted tokens from its last forward",
                  r.slot, pending_[size_t(r.slot)]);
      const int64_t n = int64_t(r.tokens.size());
      TALON_CHECK(n > 0, "decoder: request for slot {} has no tokens", r.slot);
      TALON_CHECK(s.len + n <= max_len_, "decoder: slot {} would hold {} tokens, more than max_len {}", r.slot,
                  s.len + n, max_len_);
      const std::vector<int32_t> depth = request_depths(r);
      std::vector<int32_t> par(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) par[size_t(i)] = r.parents.empty() ? int32_t(i - 1) : r.parents[size_t(i)];
      p.parents.push_back(std::move(par));
      const int64_t first = int64_t(p.rows.size());
      for (int64_t i = 0; i < n; ++i) {
        p.rows.push_back({r.slot, first, i, ri});
        p.tokens.push_back(r.tokens[size_t(i)]);
        p.pos.push_back(int32_t(s.len + depth[size_t(i)]));
      }
      if (r.all_logits)
        for (int64_t i = 0; i < n; ++i) p.logit_rows.push_back(first + i);
      else
        p.logit_rows.push_back(first + n - 1);
      grow.emplace_back(r.slot, s.len + n);
    }
    pages_.resize(grow);  // throws, changing nothing, when the pages run out
    for (const auto& [slot, rows] : grow)
      for (auto& l : at(slot).rows) l.resize(size_t(rows * width_));
    return p;
  }

  // Cache row `i` (committed rows, then pending) of a slot at a layer.
  float* cache_ptr(int slot, int64_t layer, int64_t i) { return at(slot).rows[size_t(layer)].data() + i * width_; }
  const float* layer_rows(int slot, int64_t layer) const { return at(slot).rows[size_t(layer)].data(); }
  // Where packed row r of the plan lives in its slot's cache.
  int64_t cache_row(const Plan& p, int64_t r) const {
    const Row& row = p.rows[size_t(r)];
    return at(row.slot).len + row.index;
  }

  // The cache rows packed row r attends to, ascending (= position order): the committed
  // rows inside the sliding window (window <= 0: all), then its pending ancestors and itself.
  void attended_rows(const Plan& p, int64_t r, int64_t window, std::vector<int64_t>& out) const {
    const Row& row = p.rows[size_t(r)];
    const Slot& s = at(row.slot);
    const std::vector<int32_t>& par = p.parents[row.req];
    const int64_t qpos = p.pos[size_t(r)];
    out.clear();
    const int64_t lo = window > 0 ? std::max<int64_t>(0, qpos - window + 1) : 0;
    for (int64_t j = lo; j < s.len; ++j) out.push_back(j);
    const size_t mark = out.size();
    for (int64_t a = row.index; a >= 0; a = par[size_t(a)])
      if (window <= 0 || qpos - p.pos[size_t(row.first + a)] < window) out.push_back(s.len + a);
    std::reverse(out.begin() + std::ptrdiff_t(mark), out.end());
  }

  // After the forward: the requests' tokens are pending.
  void finish(const std::vector<DecodeRequest>& reqs, Plan& p) {
    for (size_t ri = 0; ri < reqs.size(); ++ri) {
      pending_[size_t(reqs[ri].slot)] = int64_t(reqs[ri].tokens.size());
      at(reqs[ri].slot).parents = std::move(p.parents[ri]);
    }
  }

 private:
  struct Slot {
    int64_t len = 0;
    std::vector<std::vector<float>> rows;  // per layer [tokens, width]
    std::vector<int32_t> parents;          // of the pending tokens
  };
  int check(int slot) const {
    TALON_CHECK(slot >= 0 && slot < int(slots_.size()), "decoder: slot {} outside [0, {})", slot, slots_.size());
    return slot;
  }
  Slot& at(int slot) { return slots_[size_t(check(slot))]; }
  const Slot& at(int slot) const { return slots_[size_t(check(slot))]; }

  int64_t width_, max_len_;
  KvPages pages_;
  std::vector<Slot> slots_;
};

}  // namespace talon::cpu
