// Internal to the CUDA backend: the host half of a cached decoder (model/decode.h), shared by
// the dense decoder (cuda_decoder.cpp) and the DeepSeek-family one (cuda_deepseek_decoder.cpp).
// Per slot it keeps the committed length and the parents of the pending tokens; it checks a
// forward's requests and lays out their rows (what each new token attends to, decode_ops.h:
// DecodeRow, and its RoPE position), and turns a commit into the cache moves that bring the
// kept rows down, and it owns the cache's page pool (model/kv_pages.h, pages of kPageRows
// rows): a slot holds pages for its committed and pending rows, and the decoders address
// their caches through cache_map(), a device copy of the page table that sync_pages() keeps
// current. It also holds the input and output plumbing both forwards share: the packed
// inputs every forward has, captures, the logits rows' last step, and the results coming down.
// The caches themselves, and their layouts, stay with each decoder.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "backend/cuda/decode_ops.h"
#include "backend/cuda/device.h"
#include "model/decode.h"
#include "model/kv_pages.h"
#include "model/model.h"
#include "model/sampling.h"

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
  // cache_tokens: the page pool's rows (0: every slot full at once; KvPages). fixed: each slot
  // keeps its own max_pages pages and the kernels address a flat [n_slots, max_pages *
  // kPageRows] cache without the table (kv_pages_fixed()).
  DecodeSlots(int n_slots, int64_t max_len, int64_t cache_tokens = 0, bool fixed = false);
  int size() const { return int(len_.size()); }
  int64_t max_len() const { return max_len_; }
  int64_t length(int slot) const { return len_[size_t(check(slot))]; }
  // Throws naming the slot when it is out of range.
  int check(int slot) const;
  const KvPages& pages() const { return pages_; }
  // Rows a cache buffer needs: the whole pool.
  int64_t cache_rows() const { return pages_.capacity(); }

  // Checks the requests (each slot once, nothing pending, within max_len, token ids below
  // `vocab`, well-formed parents), takes the pages their rows need (throwing, with nothing
  // changed, when the pool is short) and lays out their rows. window > 0: a sliding window of
  // that many keys (the token itself included).
  DecodeBatch plan(const std::vector<DecodeRequest>& reqs, const std::vector<int64_t>& pending, int64_t vocab,
                   int64_t window = 0);
  // After the forward ran: each request's tokens are its slot's pending tree.
  void ran(const std::vector<DecodeRequest>& reqs, DecodeBatch& b, std::vector<int64_t>& pending);
  // Checks `keep` (a path from the committed prefix through the slot's pending tree) and
  // commits it; returns the cache moves as (from, to) pairs of physical cache rows
  // (CacheMap::row), in order, for the kept rows that are not in place. The slot's pages past
  // its new length go back to the pool.
  std::vector<int32_t> commit(int slot, const std::vector<int32_t>& keep, std::vector<int64_t>& pending);
  // Empties a slot, or (benchmarks) declares its first `len` rows committed.
  void reset(int slot, std::vector<int64_t>& pending, int64_t len = 0);

  // The page table on the device: `table` holds [size(), pages().max_pages()] ints. Copies the
  // rows of slots whose pages changed since the last call (all of them on the first) on `s`,
  // before the forward that reads them.
  void sync_pages(int32_t* table, cudaStream_t s);
  CacheMap cache_map(const int32_t* table) const {
    return pages_.fixed() ? CacheMap(pages_.max_pages() * kPageRows) : CacheMap(table, pages_.max_pages());
  }

 private:
  int64_t max_len_;
  KvPages pages_;
  std::vector<int64_t> len_;
  std::vector<std::vector<int32_t>> parents_;  // of each slot's pending tokens
  bool synced_ = false;
};

// The host bookkeeping of a decoder group (decoder_group.cpp): one DecodeSlots per cache. Under
// tensor parallelism one book holds every slot (every rank keeps every slot's cache); under
// expert parallelism (`split`) book r holds the group's slots [r per, (r + 1) per) as its slots
// 0, 1, ..., with rank r's pool. A forward is planned on every book it touches or on none: when
// one book refuses (bad input, a full pool), the pages the books before it took go back and the
// error names the rank. capacity() is the smallest book's pool: a scheduler that keeps the
// group's rows within it never overflows a book.
class SlotBooks {
 public:
  struct Book {
    int slots;         // the rank decoder's slots (at least 1)
    int64_t capacity;  // its pool's rows
  };
  SlotBooks(int n_slots, bool split, int per, int64_t max_len, const std::vector<Book>& books);
  int n_books() const { return int(books_.size()); }
  // The book holding a group slot (checked) and the slot's index there.
  std::pair<int, int> where(int slot) const;
  int64_t length(int slot) const;
  int64_t page_rows() const { return books_[0].slots->pages().page_rows(); }
  int64_t capacity() const;
  const DecodeSlots& book(int b) const { return *books_[size_t(b)].slots; }

  // Each book's requests (local slots, in the caller's order) and their planned rows.
  struct Plan {
    std::vector<std::vector<DecodeRequest>> reqs;
    std::vector<DecodeBatch> batches;
  };
  Plan plan(const std::vector<DecodeRequest>& reqs, int64_t vocab);
  void ran(Plan& p);
  void commit(int slot, const std::vector<int32_t>& keep);
  void reset(int slot, int64_t len = 0);

 private:
  struct Entry {
    std::unique_ptr<DecodeSlots> slots;
    std::vector<int64_t> pending;
  };
  int n_slots_, per_;
  bool split_;
  std::vector<Entry> books_;
};

// How many token rows a decoder's page pool gets. cache_tokens > 0: that many (throwing when
// they do not fit). 0: every slot full at once (n_slots x max_len) when that fits, else as many
// whole pages as fit. "Fits": per_token bytes a row, plus `reserve` bytes kept for activations,
// within free_b. Throws with the numbers when less than one max_len sequence would fit;
// `layout` spells out a token's bytes for that message.
// TALON_CUDA_KV_PAGED=0: the decoders keep a fixed flat cache (DecodeSlots' `fixed`) instead of
// the shared page pool, to measure what paging costs; the pool is then every slot full.
bool kv_pages_fixed();

int64_t cache_pool_rows(int device, int n_slots, int64_t max_len, int64_t cache_tokens, double per_token, double reserve,
                        double free_b, double total_b, double weight_bytes, const std::string& layout);

// Decoder::forward_accept_chain's device half for both decoders (decode_ops.h: accept_chain):
// checks the request, runs `forward` (the verify pass, leaving the logits rows [k + 1, V] on the
// device and returning them), sends the draft tokens of `req` (its tokens after the first), q and
// u up in one copy, lets the kernel decide and brings the kept count and next token down. Waits
// for the stream. on(): unless TALON_CUDA_ACCEPT=0, read when made (then the decoders take
// Decoder's host default: logits down, the host's acceptance test).
// run_tree: Decoder::forward_accept_tree's device half the same way (accept_tree): the tree's
// tokens, parents and u go up, the path and the next token come down. tree_on(): unless
// TALON_CUDA_ACCEPT_TREE=0 (read when made).
class ChainAccepter {
 public:
  bool on() const { return on_; }
  bool tree_on() const { return tree_on_; }
  Decoder::ChainAcceptance run(const DecodeRequest& req, const std::vector<std::vector<double>>& q, const double* u,
                               const SamplingParams& p, int64_t V, cudaStream_t s,
                               const std::function<const bf16*()>& forward);
  Decoder::TreeAcceptance run_tree(const DecodeRequest& req, const double* u, const SamplingParams& p, int64_t V,
                                   cudaStream_t s, const std::function<const bf16*()>& forward);

 private:
  static bool enabled();
  static bool tree_enabled();
  bool on_ = enabled();
  bool tree_on_ = on_ && tree_enabled();
  uint8_t* ensure(size_t bytes, cudaStream_t s);
  std::unique_ptr<DeviceArena> arena_;
  size_t cap_ = 0;
  uint8_t* dev_ = nullptr;
  int* counts_ = nullptr;
  PinnedBuffer host_;
};

// The inputs every decoder forward packs (PackedOffsets) and copies up in one block: token ids,
// positions, rows, logits rows, tree masks, and with sampling its parameters and uniforms.
struct DecodeInputs {
  size_t ids, pos, rows, logit_rows, masks, sampling, uniforms;
  DecodeInputs(PackedOffsets& o, const DecodeBatch& b, bool sampled);
  // Writes them at their offsets of the staging block hb (sp, u: with sampling).
  void stage(uint8_t* hb, const DecodeBatch& b, const SamplingParams* sp, const double* u) const;
};

// Capture rows: one block of `rows` x H 4-byte values per captured layer at dev. For every
// captured layer that is layer_id, the residual x [N, H] (fp32) into its block, as bf16 or
// fp32 as cap says.
void capture_residual(uint8_t* dev, int64_t rows, const Capture& cap, int64_t layer_id, const float* x, int64_t N,
                      int64_t H, cudaStream_t s);

// The LM head's input: the final normed rows xn [N, H] themselves when every row wants logits,
// else the logits rows gathered into sel.
const bf16* logits_input(bf16* sel, const bf16* xn, const int32_t* logit_rows, int64_t NL, int64_t N, int64_t H,
                         cudaStream_t s);

// The logits rows' last step on the device: ids drawn (sampling: parameters and uniforms in
// device memory) or the argmax (ids without sampling) into top1, or fp32 logits into logits32.
void finish_logits(int32_t* top1, float* logits32, const bf16* logits, int64_t NL, int64_t V,
                   const DeviceSampling* sampling, const double* uniforms, bool ids, cudaStream_t s);

// Results down, then waits for the stream: the capture blocks (capture_residual) into cap's
// buffers, and the ids (through the pinned `staging`) or the fp32 logits of the NL logits rows.
void results_down(const Capture& cap, const uint8_t* cap_dev, int64_t cap_rows, int64_t N, int64_t H, int64_t NL,
                  const int32_t* top1, int32_t* ids, const float* logits32, float* logits, int64_t V,
                  PinnedBuffer& staging, cudaStream_t s);

}  // namespace talon::cuda
