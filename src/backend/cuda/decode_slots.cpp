// The host half of the CUDA cached decoders (decode_slots.h).
#include "backend/cuda/decode_slots.h"

#include <algorithm>

#include "util/error.h"

namespace talon::cuda {

DecodeSlots::DecodeSlots(int n_slots, int64_t max_len) : max_len_(max_len) {
  TALON_CHECK(n_slots > 0 && max_len > 0, "decoder: n_slots {} and max_len {} must be positive", n_slots, max_len);
  TALON_CHECK(int64_t(n_slots) * max_len < (int64_t(1) << 31), "decoder: {} slots x {} tokens is more cache rows than 2^31",
              n_slots, max_len);
  len_.assign(size_t(n_slots), 0);
  parents_.resize(size_t(n_slots));
}

int DecodeSlots::check(int slot) const {
  TALON_CHECK(slot >= 0 && slot < int(len_.size()), "decoder: slot {} outside [0, {})", slot, len_.size());
  return slot;
}

DecodeBatch DecodeSlots::plan(const std::vector<DecodeRequest>& reqs, const std::vector<int64_t>& pending, int64_t V,
                              int64_t W) const {
  DecodeBatch b;
  std::vector<uint8_t> seen(len_.size(), 0);
  for (const DecodeRequest& r : reqs) {
    check(r.slot);
    TALON_CHECK(!seen[size_t(r.slot)], "decoder: slot {} appears twice in one forward", r.slot);
    seen[size_t(r.slot)] = 1;
    TALON_CHECK(pending[size_t(r.slot)] == 0, "decoder: slot {} has {} uncommitted tokens from its last forward", r.slot,
                pending[size_t(r.slot)]);
    const int64_t n = int64_t(r.tokens.size()), len = len_[size_t(r.slot)];
    TALON_CHECK(n > 0, "decoder: request for slot {} has no tokens", r.slot);
    TALON_CHECK(len + n <= max_len_, "decoder: slot {} would hold {} tokens, more than max_len {}", r.slot, len + n,
                max_len_);
    const std::vector<int32_t> depth = request_depths(r);
    std::vector<int32_t> par(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) par[size_t(i)] = r.parents.empty() ? int32_t(i - 1) : r.parents[size_t(i)];
    const bool chain = r.parents.empty();
    b.prefill = b.prefill && chain && len == 0;
    const int64_t first = int64_t(b.rows.size());
    for (int64_t i = 0; i < n; ++i) {
      const int32_t tok = r.tokens[size_t(i)];
      TALON_CHECK(tok >= 0 && tok < V, "decoder: token id {} (slot {}, index {}) is outside the vocabulary [0, {})", tok,
                  r.slot, i, V);
      const int64_t p = len + depth[size_t(i)];
      const int64_t win_lo = W > 0 ? std::max<int64_t>(0, p - W + 1) : 0;
      DecodeRow d{r.slot, int32_t(win_lo), int32_t(len), int32_t(len + i + 1), -1};
      if (!chain) {
        // Ancestors-or-self inside the window, as bits of the pending rows.
        d.lo = int32_t(std::min(win_lo, len));
        d.mask = int32_t(b.masks.size());
        b.masks.resize(b.masks.size() + size_t(i / 64 + 1), 0);
        for (int64_t a = i; a >= 0; a = par[size_t(a)])
          if (W <= 0 || p - (len + depth[size_t(a)]) < W) b.masks[size_t(d.mask + a / 64)] |= uint64_t(1) << (a % 64);
      }
      b.rows.push_back(d);
      b.tokens.push_back(tok);
      b.pos.push_back(int32_t(p));
    }
    if (r.all_logits)
      for (int64_t i = 0; i < n; ++i) b.logit_rows.push_back(int32_t(first + i));
    else
      b.logit_rows.push_back(int32_t(first + n - 1));
    b.seq_start.push_back(int64_t(b.rows.size()));
    b.parents.push_back(std::move(par));
  }
  return b;
}

void DecodeSlots::ran(const std::vector<DecodeRequest>& reqs, DecodeBatch& b, std::vector<int64_t>& pending) {
  for (size_t ri = 0; ri < reqs.size(); ++ri) {
    pending[size_t(reqs[ri].slot)] = int64_t(reqs[ri].tokens.size());
    parents_[size_t(reqs[ri].slot)] = std::move(b.parents[ri]);
  }
}

std::vector<int32_t> DecodeSlots::commit(int slot, const std::vector<int32_t>& keep, std::vector<int64_t>& pending) {
  check(slot);
  const int64_t n = pending[size_t(slot)], len = len_[size_t(slot)];
  const auto& par = parents_[size_t(slot)];
  int32_t prev = -1;
  for (size_t i = 0; i < keep.size(); ++i) {
    const int32_t k = keep[i];
    TALON_CHECK(k >= 0 && k < n && k > prev && par[size_t(k)] == prev,
                "decoder: commit of slot {}: token {} (entry {}) does not continue the kept path", slot, k, i);
    prev = k;
  }
  std::vector<int32_t> pairs;
  const int64_t base = int64_t(slot) * max_len_ + len;
  for (size_t i = 0; i < keep.size(); ++i)
    if (int64_t(keep[i]) != int64_t(i)) {
      pairs.push_back(int32_t(base + keep[i]));
      pairs.push_back(int32_t(base + int64_t(i)));
    }
  len_[size_t(slot)] += int64_t(keep.size());
  pending[size_t(slot)] = 0;
  parents_[size_t(slot)].clear();
  return pairs;
}

void DecodeSlots::reset(int slot, std::vector<int64_t>& pending, int64_t len) {
  check(slot);
  TALON_CHECK(len >= 0 && len <= max_len_, "decoder: length {} outside [0, {}]", len, max_len_);
  len_[size_t(slot)] = len;
  pending[size_t(slot)] = 0;
  parents_[size_t(slot)].clear();
}

}  // namespace talon::cuda
