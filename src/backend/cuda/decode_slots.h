// Internal to the CUDA backend: the host half of a cached decoder (model/decode.h), shared by
// the dense decoder (cuda_decoder.cpp) and the DeepSeek-family one (cuda_deepseek_decoder.cpp).
// Per slot it keeps the committed length and the parents of the pending tokens; it checks a
// forward's requests and lays out their rows (what each new token attends to, decode_ops.h:
// DecodeRow, and its RoPE position), and turns a commit into the cache moves that bring the
// kept rows down. The caches themselves, and their layouts, stay with each decoder.
#pragma once
#include <cstdint>
#include <vector>

#include "backend/cuda/decode_ops.h"
#include "model/decode.h"

namespace talon::cuda {

// The packed rows of one forward, requests in order.
struct DecodeBatch {
  std::vector<DecodeRow> rows;
  std::vector<uint64_t> masks;  // tree requests' ancestor bitmasks (DecodeRow::mask)
  std::vector<int32_t> tokens, pos, logit_rows;
  std::vector<int64_t> seq_start{0};             // first row of each request, then the row count
  std::vector<std::vector<int32_t>> parents;     // per request, one per token (a chain: i - 1)
  bool prefill = true;                           // every request a chain on an empty slot
};

class DecodeSlots {
 public:
  DecodeSlots(int n_slots, int64_t max_len);
  int size() const { return int(len_.size()); }
  int64_t max_len() const { return max_len_; }
  int64_t length(int slot) const { return len_[size_t(check(slot))]; }
  // Throws naming the slot when it is out of range.
  int check(int slot) const;

  // Checks the requests (each slot once, nothing pending, within max_len, token ids below
  // `vocab`, well-formed parents) and lays out their rows. window > 0: a sliding window of
  // that many keys (the token itself included).
  DecodeBatch plan(const std::vector<DecodeRequest>& reqs, const std::vector<int64_t>& pending, int64_t vocab,
                   int64_t window = 0) const;
  // After the forward ran: each request's tokens are its slot's pending tree.
  void ran(const std::vector<DecodeRequest>& reqs, DecodeBatch& b, std::vector<int64_t>& pending);
  // Checks `keep` (a path from the committed prefix through the slot's pending tree) and
  // commits it; returns the cache moves as (from, to) pairs of flat cache rows
  // (slot * max_len + row), in order, for the kept rows that are not in place.
  std::vector<int32_t> commit(int slot, const std::vector<int32_t>& keep, std::vector<int64_t>& pending);
  // Empties a slot, or (benchmarks) declares its first `len` rows committed.
  void reset(int slot, std::vector<int64_t>& pending, int64_t len = 0);

 private:
  int64_t max_len_;
  std::vector<int64_t> len_;
  std::vector<std::vector<int32_t>> parents_;  // of each slot's pending tokens
};

}  // namespace talon::cuda
