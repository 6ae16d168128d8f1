// The KV cache page pool (kv_pages.h).
#include "model/kv_pages.h"

#include <algorithm>

#include "util/error.h"

namespace talon {

KvPages::KvPages(int n_slots, int64_t max_len, int64_t page_rows, int64_t capacity, bool fixed)
    : page_rows_(page_rows), fixed_(fixed) {
  TALON_CHECK(n_slots > 0 && max_len > 0, "decoder: need at least one slot and one token (got {} x {})", n_slots,
              max_len);
  TALON_CHECK(page_rows > 0, "decoder: KV cache pages of {} rows; need at least one", page_rows);
  TALON_CHECK(capacity >= 0, "decoder: a KV cache of {} tokens; need a positive count, or 0 for every slot full",
              capacity);
  max_pages_ = pages_for(max_len);
  const int64_t full = int64_t(n_slots) * max_pages_;
  n_pages_ = capacity > 0 ? std::min(capacity / page_rows, full) : full;
  TALON_CHECK(n_pages_ >= max_pages_,
              "decoder: a KV cache of {} tokens cannot hold one sequence of max_len {} ({} pages of {} tokens); "
              "give it at least {} tokens",
              capacity, max_len, max_pages_, page_rows, max_pages_ * page_rows);
  TALON_CHECK(n_pages_ * page_rows < (int64_t(1) << 31), "decoder: a KV cache of {} pages x {} tokens is more than 2^31 rows",
              n_pages_, page_rows);
  TALON_CHECK(!fixed || n_pages_ == full, "decoder: a fixed page layout needs every slot full ({} pages), not {}", full,
              n_pages_);
  if (!fixed) {
    free_.resize(size_t(n_pages_));
    for (int64_t i = 0; i < n_pages_; ++i) free_[size_t(i)] = int32_t(n_pages_ - 1 - i);  // page 0 first
  }
  held_.assign(size_t(n_slots), 0);
  table_.assign(size_t(full), -1);
  dirty_.assign(size_t(n_slots), 0);
}

int KvPages::check(int slot) const {
  TALON_CHECK(slot >= 0 && slot < int(held_.size()), "decoder: slot {} outside [0, {})", slot, held_.size());
  return slot;
}

void KvPages::resize(const std::vector<std::pair<int, int64_t>>& slot_rows) {
  std::vector<uint8_t> seen(held_.size(), 0);
  int64_t need = 0;
  for (const auto& [slot, rows] : slot_rows) {
    check(slot);
    TALON_CHECK(!seen[size_t(slot)], "decoder: slot {} listed twice in one cache resize", slot);
    seen[size_t(slot)] = 1;
    const int64_t want = pages_for(rows);
    TALON_CHECK(rows >= 0 && want <= max_pages_, "decoder: slot {} cannot hold {} tokens (max_len {} rows)", slot, rows,
                max_pages_ * page_rows_);
    need += std::max<int64_t>(0, want - held_[size_t(slot)]);
  }
  // Pages that shrinking slots give back count as free for the growing ones.
  int64_t back = 0;
  for (const auto& [slot, rows] : slot_rows) back += std::max<int64_t>(0, held_[size_t(slot)] - pages_for(rows));
  if (need > free_pages() + back) {
    for (const auto& [slot, rows] : slot_rows)
      if (pages_for(rows) > held_[size_t(slot)])
        fail("decoder: the KV cache is full: slot {} needs {} more pages of {} tokens for {} tokens, and this forward "
             "needs {} while {} of {} pages are free; run fewer slots at once or give the cache more tokens "
             "(--kv-cache-tokens)",
             slot, pages_for(rows) - held_[size_t(slot)], page_rows_, rows, need, free_pages() + back, n_pages_);
  }
  for (const auto& [slot, rows] : slot_rows) {
    int64_t& h = held_[size_t(slot)];
    int32_t* t = table_.data() + int64_t(slot) * max_pages_;
    const int64_t want = pages_for(rows);
    if (want != h) dirty_[size_t(slot)] = 1;
    for (; h > want; --h, --used_) {
      if (!fixed_) free_.push_back(t[h - 1]);
      t[h - 1] = -1;
    }
  }
  for (const auto& [slot, rows] : slot_rows) {
    int64_t& h = held_[size_t(slot)];
    int32_t* t = table_.data() + int64_t(slot) * max_pages_;
    for (const int64_t want = pages_for(rows); h < want; ++h, ++used_) {
      if (fixed_) {
        t[h] = int32_t(int64_t(slot) * max_pages_ + h);
      } else {
        t[h] = free_.back();
        free_.pop_back();
      }
    }
  }
}

int64_t KvPages::row(int slot, int64_t j) const {
  check(slot);
  TALON_CHECK(j >= 0 && j < held_[size_t(slot)] * page_rows_, "decoder: row {} of slot {} is not in its {} cache pages",
              j, slot, held_[size_t(slot)]);
  return int64_t(table_[size_t(int64_t(slot) * max_pages_ + j / page_rows_)]) * page_rows_ + j % page_rows_;
}

std::vector<int> KvPages::take_dirty() {
  std::vector<int> out;
  for (size_t s = 0; s < dirty_.size(); ++s)
    if (dirty_[s]) {
      out.push_back(int(s));
      dirty_[s] = 0;
    }
  return out;
}

}  // namespace talon
