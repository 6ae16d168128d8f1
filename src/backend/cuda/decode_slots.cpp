// The host half of the CUDA cached decoders (decode_slots.h).
#include "backend/cuda/decode_slots.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "backend/cuda/check.h"
#include "backend/cuda/ops.h"
#include "util/dtype.h"
#include "util/error.h"
#include "util/log.h"

namespace talon::cuda {

DecodeSlots::DecodeSlots(int n_slots, int64_t max_len, int64_t cache_tokens, bool fixed)
    : max_len_(max_len), pages_(n_slots, max_len, kPageRows, cache_tokens, fixed) {
  len_.assign(size_t(n_slots), 0);
  parents_.resize(size_t(n_slots));
}

int DecodeSlots::check(int slot) const {
  TALON_CHECK(slot >= 0 && slot < int(len_.size()), "decoder: slot {} outside [0, {})", slot, len_.size());
  return slot;
}

DecodeBatch DecodeSlots::plan(const std::vector<DecodeRequest>& reqs, const std::vector<int64_t>& pending, int64_t V,
                              int64_t W) {
  DecodeBatch b;
  std::vector<uint8_t> seen(len_.size(), 0);
  std::vector<std::pair<int, int64_t>> grow;
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
    grow.emplace_back(r.slot, len + n);
  }
  pages_.resize(grow);  // throws, changing nothing, when the pool is short
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
  for (size_t i = 0; i < keep.size(); ++i)
    if (int64_t(keep[i]) != int64_t(i)) {
      pairs.push_back(int32_t(pages_.row(slot, len + keep[i])));
      pairs.push_back(int32_t(pages_.row(slot, len + int64_t(i))));
    }
  len_[size_t(slot)] += int64_t(keep.size());
  pending[size_t(slot)] = 0;
  parents_[size_t(slot)].clear();
  pages_.resize(slot, len_[size_t(slot)]);
  return pairs;
}

void DecodeSlots::reset(int slot, std::vector<int64_t>& pending, int64_t len) {
  check(slot);
  TALON_CHECK(len >= 0 && len <= max_len_, "decoder: length {} outside [0, {}]", len, max_len_);
  pages_.resize(slot, len);
  len_[size_t(slot)] = len;
  pending[size_t(slot)] = 0;
  parents_[size_t(slot)].clear();
}

void DecodeSlots::sync_pages(int32_t* table, cudaStream_t s) {
  std::vector<int> dirty = pages_.take_dirty();
  if (pages_.fixed()) return;  // the kernels do not read the table
  const int64_t mp = pages_.max_pages();
  const int32_t* host = pages_.table().data();
  // A copy from pageable memory has read its source when it returns (the table may change
  // right after); past a few slots one copy of the whole table costs less than many.
  if (!synced_ || int64_t(dirty.size()) * 8 > int64_t(size())) {
    CUDA_CHECK(cudaMemcpyAsync(table, host, size_t(size()) * size_t(mp) * 4, cudaMemcpyHostToDevice, s));
    synced_ = true;
    return;
  }
  for (int slot : dirty)
    CUDA_CHECK(cudaMemcpyAsync(table + int64_t(slot) * mp, host + int64_t(slot) * mp, size_t(mp) * 4,
                               cudaMemcpyHostToDevice, s));
}

SlotBooks::SlotBooks(int n_slots, bool split, int per, int64_t max_len, const std::vector<Book>& books)
    : n_slots_(n_slots), per_(per), split_(split) {
  TALON_CHECK(!books.empty() && (split || books.size() == 1) && (!split || int64_t(books.size()) * per >= n_slots),
              "decoder group: {} books of {} slots cannot hold {} slots", books.size(), per, n_slots);
  for (const Book& b : books)
    books_.push_back({std::make_unique<DecodeSlots>(b.slots, max_len, b.capacity), std::vector<int64_t>(size_t(b.slots), 0)});
}

std::pair<int, int> SlotBooks::where(int slot) const {
  TALON_CHECK(slot >= 0 && slot < n_slots_, "decoder: slot {} outside [0, {})", slot, n_slots_);
  return split_ ? std::pair{slot / per_, slot % per_} : std::pair{0, slot};
}

int64_t SlotBooks::length(int slot) const {
  const auto [b, l] = where(slot);
  return books_[size_t(b)].slots->length(l);
}

int64_t SlotBooks::capacity() const {
  int64_t cap = books_[0].slots->pages().capacity();
  for (const Entry& e : books_) cap = std::min(cap, e.slots->pages().capacity());
  return cap;
}

SlotBooks::Plan SlotBooks::plan(const std::vector<DecodeRequest>& reqs, int64_t vocab) {
  Plan p;
  p.reqs.resize(books_.size());
  for (const DecodeRequest& q : reqs) {
    const auto [b, l] = where(q.slot);
    DecodeRequest lq = q;
    lq.slot = l;
    p.reqs[size_t(b)].push_back(std::move(lq));
  }
  for (size_t k = 0; k < books_.size(); ++k) {
    try {
      p.batches.push_back(books_[k].slots->plan(p.reqs[k], books_[k].pending, vocab));
    } catch (const std::exception& e) {
      // Give back what the books before this one took (their slots had nothing pending).
      for (size_t j = 0; j < k; ++j)
        for (const DecodeRequest& q : p.reqs[j])
          books_[j].slots->reset(q.slot, books_[j].pending, books_[j].slots->length(q.slot));
      if (!split_) throw;
      throw Error(
          fmt::format("{} (expert-parallel rank {}, whose slot 0 is the group's slot {})", e.what(), k, int(k) * per_));
    }
  }
  return p;
}

void SlotBooks::ran(Plan& p) {
  for (size_t k = 0; k < books_.size(); ++k) books_[k].slots->ran(p.reqs[k], p.batches[k], books_[k].pending);
}

void SlotBooks::commit(int slot, const std::vector<int32_t>& keep) {
  const auto [b, l] = where(slot);
  books_[size_t(b)].slots->commit(l, keep, books_[size_t(b)].pending);
}

void SlotBooks::reset(int slot, int64_t len) {
  const auto [b, l] = where(slot);
  books_[size_t(b)].slots->reset(l, books_[size_t(b)].pending, len);
}

bool kv_pages_fixed() {
  const char* e = std::getenv("TALON_CUDA_KV_PAGED");
  return e && std::string(e) == "0";
}

int64_t cache_pool_rows(int device, int n_slots, int64_t max_len, int64_t cache_tokens, double per_token, double reserve,
                        double free_b, double total_b, double weight_bytes, const std::string& layout) {
  auto gib = [](double b) { return fmt::format("{:.2f} GiB", b / double(1ll << 30)); };
  const int64_t page = kPageRows, seq = (max_len + page - 1) / page * page;
  const int64_t full = int64_t(n_slots) * seq;
  const int64_t want = cache_tokens > 0 ? std::min((cache_tokens + page - 1) / page * page, full) : full;
  const double room = double(free_b) - reserve;
  const int64_t fit = room > 0 ? int64_t(room / per_token) / page * page : 0;
  if (double(want) * per_token <= room) return want;
  if (cache_tokens <= 0 && fit >= seq) {
    tlog::info("cuda:{}: {} slots x {} tokens ({}) do not fit beside the weights and activations; the KV cache gets "
               "the {} tokens that do ({}), and slots share them",
               device, n_slots, max_len, gib(double(full) * per_token), fit, gib(double(fit) * per_token));
    return fit;
  }
  fail("cuda:{}: the KV cache needs {} ({} tokens x {}) plus {} kept for activations, but only {} of {} is free after "
       "{} of weights; {} tokens fit{}",
       device, gib(double(want) * per_token), want, layout, gib(reserve), gib(free_b), gib(total_b), gib(weight_bytes),
       fit,
       fit < seq ? fmt::format(", less than one sequence of max_len {}: lower --max-len", max_len)
                 : std::string(": lower --kv-cache-tokens"));
}

bool ChainAccepter::enabled() {
  const char* e = std::getenv("TALON_CUDA_ACCEPT");
  return !(e && std::string(e) == "0");
}

Decoder::ChainAcceptance ChainAccepter::run(const DecodeRequest& req, const std::vector<std::vector<double>>& q,
                                            const double* u, const SamplingParams& p, int64_t V, cudaStream_t s,
                                            const std::function<const bf16*()>& forward) {
  check_chain_acceptance(req, q.size(), p);
  const bf16* logits = forward();
  const int k = int(req.tokens.size()) - 1;
  // One block up: q [k, V] fp64, u [k + 1] fp64, the draft tokens [k]; then out [2].
  PackedOffsets o;
  const size_t oq = o.place(size_t(k) * size_t(V) * 8), ou = o.place(size_t(k + 1) * 8), od = o.place(size_t(k) * 4),
               oo = o.place(8);
  ensure(o.bytes(), s);
  uint8_t* h = host_.ensure(o.bytes());
  for (int i = 0; i < k; ++i) {
    TALON_CHECK(int64_t(q[size_t(i)].size()) == V, "decoder: draft distribution {} has {} entries, the vocabulary {}", i,
                q[size_t(i)].size(), V);
    std::memcpy(h + oq + size_t(i) * size_t(V) * 8, q[size_t(i)].data(), size_t(V) * 8);
  }
  std::memcpy(h + ou, u, size_t(k + 1) * 8);
  std::memcpy(h + od, req.tokens.data() + 1, size_t(k) * 4);
  CUDA_CHECK(cudaMemcpyAsync(dev_, h, o.bytes(), cudaMemcpyHostToDevice, s));
  accept_chain(reinterpret_cast<int32_t*>(dev_ + oo), logits, V, k, reinterpret_cast<const int32_t*>(dev_ + od),
               reinterpret_cast<const double*>(dev_ + oq), reinterpret_cast<const double*>(dev_ + ou), p.temperature,
               p.top_p, p.top_k, counts_, s);
  int32_t res[2];
  CUDA_CHECK(cudaMemcpyAsync(res, dev_ + oo, 8, cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  Decoder::ChainAcceptance r;
  r.kept = res[0];
  r.next = res[1];
  return r;
}

bool ChainAccepter::tree_enabled() {
  const char* e = std::getenv("TALON_CUDA_ACCEPT_TREE");
  return !(e && std::string(e) == "0");
}

uint8_t* ChainAccepter::ensure(size_t bytes, cudaStream_t s) {
  if (!arena_ || bytes > cap_) {
    CUDA_CHECK(cudaStreamSynchronize(s));
    arena_ = std::make_unique<DeviceArena>();
    cap_ = bytes;
    dev_ = arena_->alloc<uint8_t>(cap_);
    counts_ = arena_->alloc<int>(65536);
  }
  return dev_;
}

Decoder::TreeAcceptance ChainAccepter::run_tree(const DecodeRequest& req, const double* u, const SamplingParams& p,
                                                int64_t V, cudaStream_t s,
                                                const std::function<const bf16*()>& forward) {
  check_tree_acceptance(req, p);
  const bf16* logits = forward();
  const int n = int(req.tokens.size());
  // One block up: u [n] fp64, tokens [n], parents [n]; then out [2 + n].
  PackedOffsets o;
  const size_t ou = o.place(size_t(n) * 8), ot = o.place(size_t(n) * 4), op = o.place(size_t(n) * 4),
               oo = o.place(size_t(n + 2) * 4);
  ensure(o.bytes(), s);
  uint8_t* h = host_.ensure(o.bytes());
  std::memcpy(h + ou, u, size_t(n) * 8);
  std::memcpy(h + ot, req.tokens.data(), size_t(n) * 4);
  std::memcpy(h + op, req.parents.data(), size_t(n) * 4);
  CUDA_CHECK(cudaMemcpyAsync(dev_, h, oo, cudaMemcpyHostToDevice, s));
  accept_tree(reinterpret_cast<int32_t*>(dev_ + oo), logits, V, n, reinterpret_cast<const int32_t*>(dev_ + ot),
              reinterpret_cast<const int32_t*>(dev_ + op), reinterpret_cast<const double*>(dev_ + ou), p.temperature,
              p.top_p, p.top_k, counts_, s);
  std::vector<int32_t> res(size_t(n) + 2);
  CUDA_CHECK(cudaMemcpyAsync(res.data(), dev_ + oo, res.size() * 4, cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  const int len = res[0];
  TALON_CHECK(len >= 1 && len <= n, "decoder: the device's tree acceptance returned a path of {} rows of {}", len, n);
  Decoder::TreeAcceptance r;
  r.path.assign(res.begin() + 2, res.begin() + 2 + len);
  r.next = res[1];
  return r;
}

DecodeInputs::DecodeInputs(PackedOffsets& o, const DecodeBatch& b, bool sampled) {
  const size_t N = b.rows.size(), NL = b.logit_rows.size();
  ids = o.place(N * 4);
  pos = o.place(N * 4);
  rows = o.place(N * sizeof(DecodeRow));
  logit_rows = o.place(NL * 4);
  masks = o.place(b.masks.size() * 8);
  sampling = o.place(sampled ? sizeof(DeviceSampling) : 0);
  uniforms = o.place(sampled ? NL * 8 : 0);
}

void DecodeInputs::stage(uint8_t* hb, const DecodeBatch& b, const SamplingParams* sp, const double* u) const {
  const size_t N = b.rows.size(), NL = b.logit_rows.size();
  std::memcpy(hb + ids, b.tokens.data(), N * 4);
  std::memcpy(hb + pos, b.pos.data(), N * 4);
  std::memcpy(hb + rows, b.rows.data(), N * sizeof(DecodeRow));
  if (NL > 0) std::memcpy(hb + logit_rows, b.logit_rows.data(), NL * 4);
  if (!b.masks.empty()) std::memcpy(hb + masks, b.masks.data(), b.masks.size() * 8);
  if (sp) {
    const DeviceSampling ds{sp->temperature, sp->top_p, sp->top_k, 0};
    std::memcpy(hb + sampling, &ds, sizeof ds);
    std::memcpy(hb + uniforms, u, NL * 8);
  }
}

void capture_residual(uint8_t* dev, int64_t rows, const Capture& cap, int64_t layer_id, const float* x, int64_t N,
                      int64_t H, cudaStream_t s) {
  for (size_t i = 0; i < cap.layers.size(); ++i) {
    if (cap.layers[i] != layer_id) continue;
    uint8_t* dst = dev + i * size_t(rows * H) * 4;
    if (cap.dtype == DType::BF16)
      f32_to_bf16(reinterpret_cast<bf16*>(dst), x, N * H, s);
    else
      CUDA_CHECK(cudaMemcpyAsync(dst, x, size_t(N * H) * 4, cudaMemcpyDeviceToDevice, s));
  }
}

const bf16* logits_input(bf16* sel, const bf16* xn, const int32_t* logit_rows, int64_t NL, int64_t N, int64_t H,
                         cudaStream_t s) {
  if (NL >= N) return xn;
  gather_rows(sel, xn, logit_rows, NL, H, s);
  return sel;
}

void finish_logits(int32_t* top1, float* logits32, const bf16* logits, int64_t NL, int64_t V,
                   const DeviceSampling* sampling, const double* uniforms, bool ids, cudaStream_t s) {
  if (sampling)
    sample_rows(top1, logits, NL, V, sampling, uniforms, s);
  else if (ids)
    argmax_rows(top1, logits, NL, V, s);
  else
    bf16_to_f32(logits32, logits, NL * V, s);
}

void results_down(const Capture& cap, const uint8_t* cap_dev, int64_t cap_rows, int64_t N, int64_t H, int64_t NL,
                  const int32_t* top1, int32_t* ids, const float* logits32, float* logits, int64_t V,
                  PinnedBuffer& staging, cudaStream_t s) {
  const size_t esz = dtype_size(cap.dtype);
  for (size_t i = 0; i < cap.layers.size(); ++i)
    CUDA_CHECK(cudaMemcpy2DAsync(cap.out[i], size_t(cap.stride(i, H)) * esz, cap_dev + i * size_t(cap_rows * H) * 4,
                                 size_t(H) * esz, size_t(H) * esz, size_t(N), cudaMemcpyDeviceToHost, s));
  if (NL > 0 && ids)
    CUDA_CHECK(cudaMemcpyAsync(staging.ensure(size_t(NL) * 4), top1, size_t(NL) * 4, cudaMemcpyDeviceToHost, s));
  else if (NL > 0)
    CUDA_CHECK(cudaMemcpyAsync(logits, logits32, size_t(NL * V) * 4, cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  if (NL > 0 && ids) std::memcpy(ids, staging.data(), size_t(NL) * 4);
}

}  // namespace talon::cuda
