// Incremental decoding: a target model with a KV cache, for `generate` and `eval`.
//
// A decoder holds `n_slots` sequences. Each slot has a committed prefix (its tokens' keys
// and values are cached) and, after a forward, pending tokens: the new tokens of that
// forward, whose keys and values are held until `commit` keeps some of them (a path) and
// drops the rest. That one mechanism serves prefill (commit everything), plain decoding
// (one token, commit it), chain verification (commit the accepted prefix) and tree
// verification (commit the accepted root-to-leaf path).
//
// Pending tokens of one request form a tree: parents[i] < i is the pending token that
// token i follows, or -1 when it follows the committed prefix directly. An empty parents
// list means a chain (token i follows token i-1). A token attends to the committed prefix
// and to its own ancestors and itself; its RoPE position is length(slot) + depth, where
// depth counts its pending ancestors, so a committed path has the positions a plain
// forward of the same tokens would give it.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "model/checkpoint.h"
#include "model/model.h"
#include "model/sampling.h"

namespace talon {

struct DecodeRequest {
  int slot = 0;
  std::vector<int32_t> tokens;   // new tokens
  std::vector<int32_t> parents;  // empty: a chain; else one per token, -1 or an earlier index
  bool all_logits = true;        // false: logits of the last token only (prefill)
};

class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual const ModelConfig& config() const = 0;
  virtual std::string backend() const = 0;
  virtual int n_slots() const = 0;
  // Most tokens (committed + pending) one slot can hold.
  virtual int64_t max_len() const = 0;
  // Committed tokens of a slot.
  virtual int64_t length(int slot) const = 0;
  // The cache: the slots share cache_capacity() token rows, held in pages of page_rows()
  // tokens (model/kv_pages.h), enough at any time for a slot's committed and pending tokens.
  // A forward that needs more pages than are free throws before running, changing nothing;
  // a scheduler keeps the sum of cache_rows(tokens) of its running sequences within the
  // capacity (generate). n_slots() x max_len() when every slot can be full at once.
  virtual int64_t page_rows() const { return 1; }
  virtual int64_t cache_capacity() const { return int64_t(n_slots()) * max_len(); }
  // Rows a sequence of `tokens` tokens holds: whole pages.
  int64_t cache_rows(int64_t tokens) const { return (tokens + page_rows() - 1) / page_rows() * page_rows(); }

  // Runs every request's tokens against its slot (each slot at most once per call). Output
  // rows follow the requests in order and, within one, its tokens in order: `logits` gets
  // [rows, V] fp32 where a request with all_logits = false contributes only its last token;
  // `capture` (F32 or BF16, layers as for Model::forward) gets one row per token. Pending
  // tokens from an earlier forward of a slot must be committed first. Throws naming the slot
  // when a request would exceed max_len or has a malformed parents list.
  virtual void forward(const std::vector<DecodeRequest>& reqs, const Capture& capture, float* logits) = 0;

  // The same forward, giving for each logits row (the rows `forward` would return, in its
  // order) only its greedy token: the argmax, ties to the lower id, of the logits `forward`
  // computes. A decoder that can pick on the device overrides this and copies back ids, not
  // [rows, V] floats; the default runs `forward` and picks on the host.
  virtual void forward_greedy(const std::vector<DecodeRequest>& reqs, const Capture& capture, int32_t* ids);

  // The same forward, giving for each logits row the token sampling draws from it:
  // draw(sampling_distribution(row, p), u[row]) (sampling.h), with u[row] in [0, 1) the
  // caller's uniform number for that row (uniform01 of its sequence's stream and position).
  // Greedy parameters give forward_greedy's ids. A decoder that can sample on the device
  // overrides this and copies back ids; the default runs `forward` and samples on the host.
  // Each row's token depends on that row's logits, p and u only: not on the other rows.
  virtual void forward_sample(const std::vector<DecodeRequest>& reqs, const Capture& capture, const SamplingParams& p,
                              const double* u, int32_t* ids);

  // Speculative sampling of one drafted chain (spec/speculate.h). `req` is a chain: its pending
  // token, then k draft tokens, draft token j drawn from q[j] (a distribution over the target's
  // vocabulary). Runs the forward (captures as `forward`), then for i = 0, 1, ...: with p_i the
  // sampling distribution (sampling.h) of logits row i, keeps draft token i + 1 (d) while
  // q[i][d] > 0 and u[i] < min(1, p_i(d) / q[i][d]); at the first rejection draws `next` from
  // max(0, p_i - q[i]) (from p_i when that has no mass), after all k from p_k, with u[t] where t
  // is the number of tests made (a test is made, and a uniform used, only where q[i][d] > 0).
  // u holds k + 1 uniforms. Returns how many draft tokens were kept
  // and the next token; the pending tokens stay for the caller's commit. Non-greedy parameters
  // only. The default copies the logits down and decides on the host; a decoder that can decide
  // where the logits are overrides it and copies back two numbers.
  struct ChainAcceptance {
    int32_t kept = 0, next = -1;
  };
  virtual ChainAcceptance forward_accept_chain(const DecodeRequest& req, const Capture& cap, const SamplingParams& p,
                                               const std::vector<std::vector<double>>& q, const double* u);

  // Speculative sampling of a drafted tree whose tokens were picked, not drawn (top-k trees,
  // spec/speculate.h). `req`: the pending token (row 0, parent -1) then the tree's tokens, each
  // with its parent's row, all logits. Runs the forward (captures as `forward`), then walks from
  // row 0: with p the sampling distribution of the node's logits row (sampling.h) and `mass` the
  // sum of p, for each child c of the node in row order whose token t has p(t) > 0, keeps c when
  // u[j] * mass < p(t) (j counting the uniforms used so far), else sets p(t) to 0 (mass -= p(t))
  // and tries the next child; a kept child becomes the node. Where no child is kept (or the
  // node has none), `next` is draw(p, u[j]) over what is left of p. u holds n uniforms (at most
  // n - 1 tests and one draw). Returns the kept rows (starting with 0) and `next`; the pending
  // tokens stay for the caller's commit. Non-greedy parameters only. The default copies the
  // logits down and decides on the host; a decoder that can decide where the logits are
  // overrides it and copies back the path.
  struct TreeAcceptance {
    std::vector<int32_t> path;
    int32_t next = -1;
  };
  virtual TreeAcceptance forward_accept_tree(const DecodeRequest& req, const Capture& cap, const SamplingParams& p,
                                             const double* u);

  // Keeps the pending tokens at `keep` (indices into the slot's last request, increasing,
  // each one's parent the previous kept one: a path from the committed prefix) and drops
  // the others. commit(slot, {}) drops them all.
  virtual void commit(int slot, const std::vector<int32_t>& keep) = 0;
  // Keeps every pending token (a chain) of the slot.
  void commit_all(int slot);
  // Empties a slot (committed and pending).
  virtual void reset(int slot) = 0;

 protected:
  // Pending token count per slot, for commit_all; kept by the implementations.
  std::vector<int64_t> pending_;
  // The default forward_greedy / forward_sample's logits, kept between calls (at 256 rows of
  // a 49k vocabulary a fresh 50 MB buffer every step costs more than the sampling).
  std::vector<float> host_logits_;
};

// Depth of each pending token of a request (0 for tokens that follow the prefix); throws
// naming the index when parents is malformed (wrong length, parent >= own index, < -1).
std::vector<int32_t> request_depths(const DecodeRequest& r);

// Throws unless forward_accept_chain can take these: sampling parameters (temperature > 0), a
// chain (parents empty or each i - 1) with all logits, and one draft distribution per draft token.
void check_chain_acceptance(const DecodeRequest& req, size_t n_q, const SamplingParams& p);

// Throws unless forward_accept_tree can take these: sampling parameters, a tree request (row 0
// the root, every other row's parent an earlier row) with all logits.
void check_tree_acceptance(const DecodeRequest& req, const SamplingParams& p);

// Logits rows of a forward: each request's tokens when all_logits, else one.
int64_t logits_rows(const std::vector<DecodeRequest>& reqs);

}  // namespace talon
