#include "spec/speculate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

#include "util/error.h"

namespace talon::spec {

namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Stream offsets keep the random draws of different purposes apart.
constexpr uint64_t kAcceptStream = 0x5eed0000a11ce000ULL;
constexpr uint64_t kDraftStream = 0x5eed0000d4af7000ULL;

// Appends tokens to out until a limit says stop; returns true when generation is over.
bool append_tokens(std::vector<int32_t>& out, const std::vector<int32_t>& toks, const GenLimits& lim) {
  for (int32_t t : toks) {
    out.push_back(t);
    if (int64_t(out.size()) >= lim.max_new_tokens) return true;
    if (std::find(lim.eos.begin(), lim.eos.end(), t) != lim.eos.end()) return true;
    if (lim.stop && lim.stop(out)) return true;
  }
  return false;
}

}  // namespace

std::string SpecConfig::name() const {
  if (mode == Mode::Chain) return "chain-" + std::to_string(k);
  return "tree-d" + std::to_string(depth) + "-k" + std::to_string(topk) + "-n" + std::to_string(tree_tokens);
}

void SpecConfig::validate() const {
  if (mode == Mode::Chain) {
    TALON_CHECK(k >= 1 && k <= 64, "chain length k must be in [1, 64] (got {})", k);
  } else {
    TALON_CHECK(depth >= 1 && depth <= 32, "tree depth must be in [1, 32] (got {})", depth);
    TALON_CHECK(topk >= 1 && topk <= 64, "tree top-k must be in [1, 64] (got {})", topk);
    TALON_CHECK(tree_tokens >= 1 && tree_tokens <= 256, "tree tokens must be in [1, 256] (got {})", tree_tokens);
  }
}

double DecodeStats::tau() const { return rounds ? double(new_tokens - std::min<int64_t>(new_tokens, 1)) / double(rounds) : 0; }

void DecodeStats::add(const DecodeStats& o) {
  rounds += o.rounds;
  new_tokens += o.new_tokens;
  drafted += o.drafted;
  if (tried.size() < o.tried.size()) {
    tried.resize(o.tried.size());
    accepted.resize(o.tried.size());
  }
  for (size_t i = 0; i < o.tried.size(); ++i) {
    tried[i] += o.tried[i];
    accepted[i] += o.accepted[i];
  }
  seconds += o.seconds;
  target_seconds += o.target_seconds;
  draft_seconds += o.draft_seconds;
  prefill_seconds += o.prefill_seconds;
  round_seconds += o.round_seconds;
  round_target_seconds += o.round_target_seconds;
}

DraftTree select_tree(const DraftTree& c, int n) {
  const size_t N = c.tokens.size();
  std::vector<int32_t> depth(N);
  for (size_t i = 0; i < N; ++i) depth[i] = c.parents[i] < 0 ? 1 : depth[size_t(c.parents[i])] + 1;
  std::vector<int32_t> order(N);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    if (c.scores[size_t(a)] != c.scores[size_t(b)]) return c.scores[size_t(a)] > c.scores[size_t(b)];
    return depth[size_t(a)] < depth[size_t(b)];
  });
  order.resize(std::min(N, size_t(std::max(n, 0))));
  // Parents before children: by depth, then by the selection order.
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return depth[size_t(a)] < depth[size_t(b)]; });
  std::vector<int32_t> new_id(N, -1);
  DraftTree t;
  for (size_t i = 0; i < order.size(); ++i) new_id[size_t(order[i])] = int32_t(i);
  for (int32_t o : order) {
    const int32_t p = c.parents[size_t(o)];
    TALON_CHECK(p < 0 || new_id[size_t(p)] >= 0, "draft tree: node {} kept without its parent {}", o, p);
    t.tokens.push_back(c.tokens[size_t(o)]);
    t.parents.push_back(p < 0 ? -1 : new_id[size_t(p)]);
    t.scores.push_back(c.scores[size_t(o)]);
    if (!c.q.empty()) t.q.push_back(c.q[size_t(o)]);
  }
  return t;
}

std::vector<int32_t> decode_plain(Decoder& target, int slot, const std::vector<int32_t>& prompt,
                                  const SamplingParams& params, uint64_t stream, const GenLimits& limits,
                                  DecodeStats* stats) {
  TALON_CHECK(!prompt.empty(), "decode: empty prompt");
  const auto t0 = Clock::now();
  std::vector<int32_t> out;
  DecodeStats st;
  // The target gives the next token only, picked where the logits are: its argmax, or its
  // draw with the uniform number of this sequence's next position (on a GPU, no logits come
  // down; the same tokens as sampling the logits on the host, sample_token).
  const bool greedy = params.greedy();
  int32_t next = 0;
  auto pass = [&](const DecodeRequest& r) {
    if (greedy) {
      target.forward_greedy({r}, Capture{}, &next);
    } else {
      const double u = uniform01(params.seed, stream, uint64_t(out.size()));
      target.forward_sample({r}, Capture{}, params, &u, &next);
    }
  };
  target.reset(slot);
  pass({slot, prompt, {}, false});
  target.commit_all(slot);
  st.prefill_seconds = since(t0);
  bool done = limits.max_new_tokens <= 0;
  while (!done) {
    const int32_t tok = next;
    done = append_tokens(out, {tok}, limits);
    if (done || target.length(slot) + 1 > target.max_len()) break;
    pass({slot, {tok}, {}, true});
    target.commit_all(slot);
    ++st.rounds;
  }
  st.new_tokens = int64_t(out.size());
  st.seconds = since(t0);
  st.target_seconds = st.seconds;
  st.round_seconds = st.round_target_seconds = std::max(0.0, st.seconds - st.prefill_seconds);
  if (stats) stats->add(st);
  return out;
}

std::vector<int32_t> decode_speculative(Decoder& target, int slot, DraftRunner& draft,
                                        const std::vector<int32_t>& prompt, const SpecConfig& cfg,
                                        const SamplingParams& params, uint64_t stream, const GenLimits& limits,
                                        DecodeStats* stats) {
  cfg.validate();
  TALON_CHECK(!prompt.empty(), "decode: empty prompt");
  const auto t0 = Clock::now();
  const ModelConfig& tc = target.config();
  const DraftModel& dm = draft.model();
  const int64_t V = tc.vocab, H = tc.hidden, Vd = dm.config.Vd;
  const bool sampled_chain = cfg.mode == SpecConfig::Mode::Chain && !params.greedy();
  TALON_CHECK(!dm.chain_only() || cfg.mode == SpecConfig::Mode::Chain,
              "decode: {} is a {} draft, which proposes one chain per round; use a chain, not a tree", dm.origin,
              dm.parallel() ? "P-EAGLE" : "DFlash");
  DecodeStats st;
  st.tried.assign(size_t(cfg.mode == SpecConfig::Mode::Chain ? cfg.k : cfg.depth), 0);
  st.accepted = st.tried;

  // Target pass with the draft's aux layers captured (fp32, one row per token).
  std::vector<float> aux_rows;  // [rows, 3, H] as captured: three [rows, H] blocks
  std::vector<float> logits;    // sampling: [rows, V]
  std::vector<int32_t> top1;    // greedy: the argmax of each row
  const bool greedy = params.greedy();
  // Sampled chains: the target decides acceptance where its logits are (Decoder::
  // forward_accept_chain) from the draft distributions and uniforms set here.
  const std::vector<std::vector<double>>* accept_q = nullptr;
  std::vector<double> accept_u;
  Decoder::ChainAcceptance acc;
  // Sampled trees: the target decides where its logits are too (Decoder::forward_accept_tree).
  bool accept_tree = false;
  Decoder::TreeAcceptance tacc;
  auto run_target = [&](const DecodeRequest& r) {
    const int64_t n = int64_t(r.tokens.size());
    aux_rows.assign(size_t(3 * n * H), 0.f);
    Capture cap;
    for (int i = 0; i < 3; ++i) {
      cap.layers.push_back(int(dm.aux_layer_ids[size_t(i)]));
      cap.out.push_back(aux_rows.data() + i * n * H);
    }
    const auto ts = Clock::now();
    if (accept_q) {
      acc = target.forward_accept_chain(r, cap, params, *accept_q, accept_u.data());
    } else if (accept_tree) {
      tacc = target.forward_accept_tree(r, cap, params, accept_u.data());
    } else if (greedy) {
      // Acceptance needs only each row's argmax: the target picks it where the logits are.
      top1.resize(size_t(r.all_logits ? n : 1));
      target.forward_greedy({r}, cap, top1.data());
    } else {
      logits.resize(size_t((r.all_logits ? n : 1) * V));  // every entry is written by the forward
      target.forward({r}, cap, logits.data());
    }
    st.target_seconds += since(ts);
  };
  // concat(h[a0], h[a1], h[a2]) of the chosen rows, [rows.size(), 3H].
  auto aux_of = [&](const std::vector<int32_t>& rows, int64_t n) {
    std::vector<float> a(rows.size() * size_t(3 * H));
    for (size_t r = 0; r < rows.size(); ++r)
      for (int i = 0; i < 3; ++i)
        std::copy_n(aux_rows.data() + (i * n + rows[r]) * H, H, a.data() + (int64_t(r) * 3 + i) * H);
    return a;
  };

  // Prefill.
  target.reset(slot);
  draft.reset();
  run_target({slot, prompt, {}, false});
  target.commit_all(slot);
  std::vector<double> p, scratch;
  std::vector<int32_t> out;
  int32_t next = greedy ? top1[0] : sample_token(logits.data(), V, params, stream, 0, scratch);
  bool done = limits.max_new_tokens <= 0 || append_tokens(out, {next}, limits);
  std::vector<float> g_last(static_cast<size_t>(H)), dl_last(static_cast<size_t>(Vd));
  // What drafting reads of each draft row: the logits for a sampled chain (its proposal
  // distribution), else only the best ids and their log-probabilities (top-1 for a greedy
  // chain), which the draft runner computes where it runs.
  DraftTop top_last;
  top_last.k = sampled_chain ? 0 : cfg.mode == SpecConfig::Mode::Chain ? 1 : int(std::min<int64_t>(cfg.topk, Vd));
  float* const dl_out = sampled_chain ? dl_last.data() : nullptr;
  DraftTop* const top_out = sampled_chain ? nullptr : &top_last;
  // A greedy EAGLE-3 chain is drafted with the extension that precedes it, in one call
  // (DraftRunner::extend_chain: on a GPU one graph and one copy down instead of a round trip per
  // step): chain_ids holds the next round's draft ids, for as many tokens as it will have room for.
  const bool fast_chain = greedy && cfg.mode == SpecConfig::Mode::Chain && !dm.chain_only();
  std::vector<int32_t> chain_ids;
  auto extend_draft = [&](const int32_t* toks, const float* aux, int64_t n) {
    if (fast_chain) {
      const int64_t room = target.max_len() - target.length(slot) - 1;
      chain_ids = draft.extend_chain(toks, aux, n, int(std::clamp<int64_t>(room, 1, cfg.k)));
    } else {
      draft.extend(toks, aux, n, g_last.data(), dl_out, top_out);
    }
  };
  {
    std::vector<int32_t> rows(prompt.size()), nexts(prompt.size());
    for (size_t i = 0; i < prompt.size(); ++i) {
      rows[i] = int32_t(i);
      nexts[i] = i + 1 < prompt.size() ? prompt[i + 1] : next;
    }
    const auto a = aux_of(rows, int64_t(prompt.size()));
    const auto ts = Clock::now();
    extend_draft(nexts.data(), a.data(), int64_t(prompt.size()));
    st.draft_seconds += since(ts);
  }
  st.prefill_seconds = since(t0);
  const double prefill_target_seconds = st.target_seconds;

  uint64_t round = 0;
  while (!done) {
    ++round;
    const int64_t room = target.max_len() - target.length(slot) - 1;
    if (room < 0) break;
    // ---- draft ----
    const auto td = Clock::now();
    DraftTree cand;
    if (cfg.mode == SpecConfig::Mode::Chain) {
      // (a DFlash block drafts at most block - 1 tokens)
      const int k = int(std::min<int64_t>({int64_t(cfg.k), room, dm.block() ? dm.dflash.block - 1 : int64_t(cfg.k)}));
      std::vector<float> g = g_last, dl = dl_last, g2(static_cast<size_t>(H)), dl2(static_cast<size_t>(Vd));
      DraftTop top = top_last;
      // The i-th draft token from a row's logits (sampled chain) or its top-1 id (greedy).
      auto choose = [&](int i, const float* row_logits, int32_t row_top) {
        int32_t d = row_top;
        if (sampled_chain) {
          // q over target ids: the draft's distribution at the target's temperature/top-k/top-p.
          std::vector<double> qd;
          sampling_distribution(row_logits, Vd, params, qd);
          d = draw(qd, uniform01(params.seed, stream ^ kDraftStream, round * 1024 + uint64_t(i)));
          std::vector<double> q(size_t(V), 0.0);
          for (int64_t j = 0; j < Vd; ++j) q[size_t(draft.to_target(j))] = qd[size_t(j)];
          cand.q.push_back(std::move(q));
        }
        cand.tokens.push_back(draft.to_target(d));
        cand.parents.push_back(i - 1);
        cand.scores.push_back(-double(i));
      };
      // P-EAGLE: depth 1 from the last step-0 row, depths 2..k from one parallel step.
      std::vector<float> pl(dm.parallel() && sampled_chain ? size_t(std::max(k - 1, 0)) * size_t(Vd) : 0);
      DraftTop ptop;
      ptop.k = top_last.k;
      if (dm.parallel() && k > 1)
        draft.parallel_step(k - 1, sampled_chain ? pl.data() : nullptr, sampled_chain ? nullptr : &ptop);
      for (int i = 0; i < k && dm.parallel(); ++i)
        choose(i, i == 0 ? dl.data() : pl.data() + size_t(i - 1) * size_t(Vd),
               sampled_chain ? 0 : i == 0 ? top.ids[0] : ptop.ids[size_t(i - 1) * size_t(ptop.k)]);
      // DFlash: all k from the block at the next position.
      if (dm.block() && k > 0) {
        pl.resize(sampled_chain ? size_t(k) * size_t(Vd) : 0);
        draft.block_step(k, sampled_chain ? pl.data() : nullptr, sampled_chain ? nullptr : &ptop);
        for (int i = 0; i < k; ++i)
          choose(i, pl.data() + size_t(i) * size_t(Vd), sampled_chain ? 0 : ptop.ids[size_t(i) * size_t(ptop.k)]);
      }
      for (int i = 0; i < k && fast_chain; ++i) {
        TALON_CHECK(i < int(chain_ids.size()), "decode: the drafted chain has {} tokens, the round wants {}",
                    chain_ids.size(), k);
        choose(i, nullptr, chain_ids[size_t(i)]);
      }
      for (int i = 0; i < k && !dm.chain_only() && !fast_chain; ++i) {
        choose(i, dl.data(), sampled_chain ? 0 : top.ids[0]);
        if (i + 1 < k) {
          draft.tree_step({cand.tokens.back()}, {int32_t(i) - 1}, g.data(), g2.data(), sampled_chain ? dl2.data() : nullptr,
                          sampled_chain ? nullptr : &top);
          g.swap(g2);
          dl.swap(dl2);
        }
      }
    } else {
      // EAGLE-2 dynamic tree (DraftRunner::expand_tree: on a GPU one graph for all depths).
      draft.expand_tree(top_last, g_last.data(), cfg.depth, cand.tokens, cand.parents, cand.scores);
    }
    draft.clear_tree();
    const DraftTree tree =
        cfg.mode == SpecConfig::Mode::Chain ? cand : select_tree(cand, int(std::min<int64_t>(cfg.tree_tokens, room)));
    st.draft_seconds += since(td);

    // ---- verify: the pending token, then the tree ----
    DecodeRequest req{slot, {next}, {-1}, true};
    for (size_t i = 0; i < tree.tokens.size(); ++i) {
      req.tokens.push_back(tree.tokens[i]);
      req.parents.push_back(tree.parents[i] < 0 ? 0 : tree.parents[i] + 1);
    }
    const int64_t n = int64_t(req.tokens.size());
    if (!greedy) {
      // Uniform j of the round for the j-th acceptance test, then the draw.
      accept_u.resize(size_t(n));
      for (int64_t j = 0; j < n; ++j)
        accept_u[size_t(j)] = uniform01(params.seed, stream ^ kAcceptStream, round * 4096 + uint64_t(j));
      if (sampled_chain)
        accept_q = &tree.q;
      else
        accept_tree = true;
    }
    run_target(req);
    accept_q = nullptr;
    accept_tree = false;
    st.drafted += n - 1;
    ++st.rounds;

    // ---- accept ----
    std::vector<std::vector<int32_t>> children(static_cast<size_t>(n));
    for (int64_t i = 1; i < n; ++i) children[size_t(req.parents[size_t(i)])].push_back(int32_t(i));
    std::vector<int32_t> path = {0};
    int32_t bonus = -1;
    if (sampled_chain) {
      // Decided by the target: draft depths 1 .. kept+1 were tried (a depth past the chain is
      // not), 1 .. kept kept.
      const int64_t k = n - 1;
      for (int64_t d = 1; d <= std::min<int64_t>(acc.kept + 1, k) && d <= int64_t(st.tried.size()); ++d) {
        ++st.tried[size_t(d - 1)];
        if (d <= acc.kept) ++st.accepted[size_t(d - 1)];
      }
      for (int32_t i = 1; i <= acc.kept; ++i) path.push_back(i);
      bonus = acc.next;
    } else if (!greedy) {
      // Decided by the target too; each node on the path with children had them tried, and all
      // but the last kept one.
      TALON_CHECK(!tacc.path.empty() && tacc.path[0] == 0, "decode: the target's tree acceptance has no root");
      path = tacc.path;
      bonus = tacc.next;
      for (size_t i = 0; i < path.size(); ++i) {
        const int depth = int(i) + 1;
        if (children[size_t(path[i])].empty() || depth > int(st.tried.size())) continue;
        ++st.tried[size_t(depth - 1)];
        if (i + 1 < path.size()) ++st.accepted[size_t(depth - 1)];
      }
    }
    // Greedy chains and trees: decided here, from the target's argmax ids.
    for (; greedy && !sampled_chain;) {
      const int32_t at = path.back();
      int32_t kept = -1;
      // A child is kept iff it is the target's argmax.
      const int32_t best = top1[size_t(at)];
      for (int32_t c : children[size_t(at)])
        if (req.tokens[size_t(c)] == best) {
          kept = c;
          break;
        }
      const int depth = int(path.size());  // draft depth of the children tried here
      if (!children[size_t(at)].empty() && depth <= int(st.tried.size())) {
        ++st.tried[size_t(depth - 1)];
        if (kept >= 0) ++st.accepted[size_t(depth - 1)];
      }
      if (kept < 0) {
        bonus = best;
        break;
      }
      path.push_back(kept);
    }
    target.commit(slot, path);
    std::vector<int32_t> fresh;
    for (size_t i = 1; i < path.size(); ++i) fresh.push_back(req.tokens[size_t(path[i])]);
    fresh.push_back(bonus);
    done = append_tokens(out, fresh, limits);
    if (done) break;
    // The draft reads the committed rows: row path[i] with the token that followed it.
    const auto a = aux_of(path, n);
    const auto ts = Clock::now();
    extend_draft(fresh.data(), a.data(), int64_t(path.size()));
    st.draft_seconds += since(ts);
    next = bonus;
  }
  st.new_tokens = int64_t(out.size());
  st.seconds = since(t0);
  st.round_seconds = std::max(0.0, st.seconds - st.prefill_seconds);
  st.round_target_seconds = st.target_seconds - prefill_target_seconds;
  if (stats) stats->add(st);
  return out;
}

}  // namespace talon::spec
