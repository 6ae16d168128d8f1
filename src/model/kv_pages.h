// The KV cache of a decoder as a pool of pages shared by its slots (model/decode.h).
//
// A slot holds whole pages of `page_rows` token rows: enough for its committed tokens and,
// during a forward, its pending ones. Row j of a slot lives in the slot's page j / page_rows,
// at row j % page_rows of it; the physical row is page * page_rows + j % page_rows. Pages come
// from one free list when a slot grows and go back when it shrinks (a commit dropping pending
// rows, a reset), so a cache sized for the tokens actually running serves more slots than one
// that reserves max_len rows for every slot. Which pages a slot gets depends on the order of
// earlier releases: nothing may assume a slot's rows are contiguous.
//
// The table is [n_slots, max_pages] page ids (-1 where a slot holds no page), the form the
// CUDA kernels read; `take_dirty` lists the slots whose row of it changed, so that a device
// copy of the table is refreshed only where needed.
#pragma once
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace talon {

class KvPages {
 public:
  // n_slots slots of at most max_len tokens each, in pages of page_rows tokens, sharing
  // `capacity` token rows rounded down to whole pages (0: n_slots x max_pages pages, enough for
  // every slot to be full at once). Throws when a slot could not hold max_len tokens even with
  // the whole pool, or when the pool has more than 2^31 rows.
  // fixed: slot s always gets pages s * max_pages, s * max_pages + 1, ... (the pool must then be
  // every slot full, capacity 0): a flat [n_slots, max_pages * page_rows] layout with the same
  // accounting, for measuring what the indirection costs.
  KvPages(int n_slots, int64_t max_len, int64_t page_rows, int64_t capacity = 0, bool fixed = false);

  int n_slots() const { return int(held_.size()); }
  int64_t page_rows() const { return page_rows_; }
  int64_t max_pages() const { return max_pages_; }  // per slot: max_len rounded up to pages
  int64_t n_pages() const { return n_pages_; }
  int64_t capacity() const { return n_pages_ * page_rows_; }  // token rows in the pool
  int64_t free_pages() const { return n_pages_ - used_; }
  bool fixed() const { return fixed_; }
  int64_t pages_for(int64_t rows) const { return (rows + page_rows_ - 1) / page_rows_; }
  int64_t held(int slot) const { return held_[size_t(check(slot))]; }

  // Makes each listed slot hold exactly pages_for(rows) pages: pages beyond that go back to
  // the pool, missing ones are taken from it. All or nothing: when the pool is short of what
  // the growing slots need together, throws (naming the first slot that would not fit, the
  // pages needed and free) and changes nothing. A slot may be listed once.
  void resize(const std::vector<std::pair<int, int64_t>>& slot_rows);
  void resize(int slot, int64_t rows) { resize({{slot, rows}}); }

  // The physical row of row j of a slot; j must lie in a page the slot holds.
  int64_t row(int slot, int64_t j) const;
  const std::vector<int32_t>& table() const { return table_; }
  // Slots whose table row changed since the last call, ascending.
  std::vector<int> take_dirty();

 private:
  int check(int slot) const;
  int64_t page_rows_, max_pages_, n_pages_, used_ = 0;
  bool fixed_;
  std::vector<int32_t> free_;   // page ids, popped from the back (not fixed)
  std::vector<int64_t> held_;   // pages per slot
  std::vector<int32_t> table_;  // [n_slots, max_pages]
  std::vector<uint8_t> dirty_;
};

}  // namespace talon
