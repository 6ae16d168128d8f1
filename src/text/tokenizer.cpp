// The BPE pipeline: added-token splitting, normalizers, pre-tokenizers, BPE merges, post-processor
// and decoders, each following the behaviour of the Hugging Face `tokenizers` component it names.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <atomic>
#include <pcre2.h>

#include <algorithm>
#include <cstring>
#include <queue>

#include "text/tokenizer_impl.h"
#include "text/unicode.h"
#include "util/error.h"

namespace talon::text::detail {

const char* const kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// ---------------------------------------------------------------------------------------------
// Regex

Regex::Regex(const std::string& pattern, const std::string& origin) : pattern_(pattern) {
  int err = 0;
  PCRE2_SIZE off = 0;
  auto* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                             PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &err, &off, nullptr);
  if (!code) {
    PCRE2_UCHAR buf[256];
    pcre2_get_error_message(err, buf, sizeof buf);
    fail("{}: pre-tokenizer regex {:?} does not compile at offset {}: {}", origin, pattern, off,
         reinterpret_cast<char*>(buf));
  }
  jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  code_ = code;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

namespace {
struct MatchState {
  pcre2_match_data* md = nullptr;
  pcre2_match_context* mc = nullptr;
  pcre2_jit_stack* js = nullptr;
  MatchState() {
    md = pcre2_match_data_create(1, nullptr);
    mc = pcre2_match_context_create(nullptr);
    js = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
    pcre2_jit_stack_assign(mc, nullptr, js);
  }
  ~MatchState() {
    pcre2_match_data_free(md);
    pcre2_match_context_free(mc);
    pcre2_jit_stack_free(js);
  }
};
}  // namespace

void Regex::find_all(std::string_view s, std::vector<std::pair<size_t, size_t>>& out) const {
  thread_local MatchState st;
  auto* code = static_cast<pcre2_code*>(code_);
  size_t pos = 0;
  const auto* subj = reinterpret_cast<PCRE2_SPTR>(s.data());
  while (pos <= s.size()) {
    int rc = jit_ ? pcre2_jit_match(code, subj, s.size(), pos, 0, st.md, st.mc)
                  : pcre2_match(code, subj, s.size(), pos, PCRE2_NO_UTF_CHECK, st.md, st.mc);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR buf[256];
      pcre2_get_error_message(rc, buf, sizeof buf);
      fail("regex {:?} failed on a {}-byte input: {}", pattern_, s.size(), reinterpret_cast<char*>(buf));
    }
    PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.md);
    size_t b = ov[0], e = ov[1];
    if (e == b) {  // empty match: skip one code point (Rust find_iter semantics, empty matches dropped)
      if (b >= s.size()) break;
      size_t l = utf8_valid_len(s, b);
      pos = b + (l ? l : 1);
      continue;
    }
    out.emplace_back(b, e);
    pos = e;
  }
}

void Config::add_merge(std::string_view a, std::string_view b, int32_t rank) {
  auto ia = vocab.find(a), ib = vocab.find(b);
  if (ia == vocab.end() || ib == vocab.end())
    fail("{}: model.merges[{}]: token {:?} of the merge is not in the vocabulary", origin, rank,
         std::string(ia == vocab.end() ? a : b));
  std::string m;
  m.reserve(a.size() + b.size());
  m.append(a).append(b);
  auto im = vocab.find(m);
  if (im == vocab.end())
    fail("{}: model.merges[{}]: merged token {:?} is not in the vocabulary", origin, rank, m);
  uint64_t key = (uint64_t(uint32_t(ia->second)) << 32) | uint32_t(ib->second);
  merges.try_emplace(key, rank, im->second);  // first (lowest rank) wins, as HF
}

namespace {

// ---------------------------------------------------------------------------------------------
// Splitting helpers

// Pieces of `s` given matches, per HF SplitDelimiterBehavior.
void split_by_matches(std::string_view s, const std::vector<std::pair<size_t, size_t>>& m, bool invert,
                      SplitBehavior beh, std::vector<std::string>& out) {
  // Segments covering s, flagged as delimiter or not.
  struct Seg { size_t b, e; bool delim; };
  std::vector<Seg> segs;
  size_t pos = 0;
  for (auto [b, e] : m) {
    if (b > pos) segs.push_back({pos, b, invert});
    segs.push_back({b, e, !invert});
    pos = e;
  }
  if (pos < s.size()) segs.push_back({pos, s.size(), invert});
  switch (beh) {
    case SplitBehavior::Isolated:
      for (auto& g : segs) out.emplace_back(s.substr(g.b, g.e - g.b));
      break;
    case SplitBehavior::Removed:
      for (auto& g : segs)
        if (!g.delim) out.emplace_back(s.substr(g.b, g.e - g.b));
      break;
    case SplitBehavior::MergedWithPrevious: {
      size_t start = 0;
      bool open = false;
      for (auto& g : segs) {
        if (g.delim) {
          out.emplace_back(s.substr(start, g.e - start));
          start = g.e;
          open = false;
        } else {
          open = true;
        }
      }
      if (open) out.emplace_back(s.substr(start));
      break;
    }
    case SplitBehavior::MergedWithNext: {
      size_t start = 0;
      for (auto& g : segs) {
        if (g.delim && g.b > start) {
          out.emplace_back(s.substr(start, g.b - start));
          start = g.b;
        }
      }
      if (start < s.size()) out.emplace_back(s.substr(start));
      break;
    }
    case SplitBehavior::Contiguous: {
      size_t start = 0;
      for (size_t i = 0; i < segs.size(); ++i) {
        bool last = i + 1 == segs.size();
        if (last || segs[i + 1].delim != segs[i].delim) {
          if (segs[i].e > start) out.emplace_back(s.substr(start, segs[i].e - start));
          start = segs[i].e;
        }
      }
      break;
    }
  }
}

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  if (from.empty()) return;
  std::string r;
  size_t pos = 0;
  bool any = false;
  while (true) {
    size_t f = s.find(from, pos);
    if (f == std::string::npos) break;
    any = true;
    r.append(s, pos, f - pos);
    r.append(to);
    pos = f + from.size();
  }
  if (!any) return;
  r.append(s, pos);
  s.swap(r);
}

// ---------------------------------------------------------------------------------------------

struct Piece {
  std::string text;
  int32_t added_id = -1;  // >= 0: an added token
  bool at_start = false;  // begins at offset 0 of the original text
};

// A byte trie over added-token contents for leftmost-longest matching.
struct Trie {
  struct Node { std::vector<std::pair<unsigned char, int32_t>> next; int32_t token = -1; };
  std::vector<Node> nodes{1};
  bool first_byte[256] = {};
  void insert(std::string_view s, int32_t tok) {
    if (s.empty()) return;
    int32_t n = 0;
    for (unsigned char c : s) {
      int32_t nx = -1;
      for (auto& [k, v] : nodes[n].next)
        if (k == c) { nx = v; break; }
      if (nx < 0) {
        nx = int32_t(nodes.size());
        nodes[n].next.emplace_back(c, nx);
        nodes.emplace_back();
      }
      n = nx;
    }
    if (nodes[n].token < 0) nodes[n].token = tok;
    first_byte[static_cast<unsigned char>(s[0])] = true;
  }
  bool empty() const { return nodes.size() == 1; }
  // Longest token starting at s[i]: (token index, length) or (-1, 0).
  std::pair<int32_t, size_t> longest(std::string_view s, size_t i) const {
    int32_t n = 0, best = -1;
    size_t best_len = 0;
    for (size_t j = i; j < s.size(); ++j) {
      unsigned char c = s[j];
      int32_t nx = -1;
      for (auto& [k, v] : nodes[n].next)
        if (k == c) { nx = v; break; }
      if (nx < 0) break;
      n = nx;
      if (nodes[n].token >= 0) { best = nodes[n].token; best_len = j + 1 - i; }
    }
    return {best, best_len};
  }
};

bool ends_with_word(std::string_view s) {
  if (s.empty()) return false;
  size_t i = s.size() - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  size_t j = i;
  return is_alnum_or_underscore(utf8_next(s, j));
}
bool starts_with_word(std::string_view s) {
  if (s.empty()) return false;
  size_t j = 0;
  return is_alnum_or_underscore(utf8_next(s, j));
}
size_t trim_end_len(std::string_view s) {  // length of s without trailing whitespace
  size_t end = s.size();
  while (end > 0) {
    size_t i = end - 1;
    while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
    size_t j = i;
    if (!is_unicode_whitespace(utf8_next(s, j))) break;
    end = i;
  }
  return end;
}
size_t leading_ws_len(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    size_t j = i;
    if (!is_unicode_whitespace(utf8_next(s, j))) break;
    i = j;
  }
  return i;
}

class BpeTokenizer final : public Tokenizer {
 public:
  explicit BpeTokenizer(Config c) : c_(std::move(c)) {
    kind_ = c_.kind;
    bos_ = c_.bos;
    eos_ = c_.eos;
    for (size_t i = 0; i < c_.added.size(); ++i) {
      const auto& a = c_.added[i];
      (a.normalized ? norm_trie_ : raw_trie_).insert(a.content, int32_t(i));
      if (a.id >= 0) {
        if (size_t(a.id) >= added_by_id_.size()) added_by_id_.resize(size_t(a.id) + 1, -1);
        added_by_id_[size_t(a.id)] = int32_t(i);
      }
    }
    size_ = c_.id_to_token.size();
    for (auto& a : c_.added) size_ = std::max(size_, size_t(a.id) + 1);
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof name, "<0x%02X>", b);
      auto it = c_.vocab.find(std::string_view(name));
      byte_ids_[b] = it == c_.vocab.end() ? -1 : it->second;
    }
    for (auto& op : c_.pre)
      if (op.kind == PreOp::ByteLevel) bytelevel_ = true;
  }

  std::vector<int32_t> encode(std::string_view text, bool add_special) const override {
    std::string owned;
    if (!utf8_is_valid(text)) {
      owned = utf8_lossy(text);
      text = owned;
    }
    std::vector<int32_t> ids;
    std::vector<Piece> pieces;
    split_added(text, true, raw_trie_, pieces);
    std::vector<Piece> sub;
    std::vector<std::string> words;
    for (auto& p : pieces) {
      if (p.added_id >= 0) {
        ids.push_back(p.added_id);
        continue;
      }
      std::string n = normalize_str(std::move(p.text));
      sub.clear();
      split_added(n, p.at_start, norm_trie_, sub);
      for (auto& q : sub) {
        if (q.added_id >= 0) {
          ids.push_back(q.added_id);
          continue;
        }
        words.clear();
        pre_tokenize(std::move(q.text), q.at_start, words);
        for (auto& w : words) tokenize_word(w, ids);
      }
    }
    if (add_special && c_.has_post) {
      std::vector<int32_t> out;
      out.reserve(ids.size() + 4);
      for (auto& it : c_.post_single) {
        if (it.is_sequence) out.insert(out.end(), ids.begin(), ids.end());
        else out.insert(out.end(), it.ids.begin(), it.ids.end());
      }
      return out;
    }
    return ids;
  }

  std::string decode(const std::vector<int32_t>& ids, bool skip_special) const override {
    std::vector<std::string> toks;
    toks.reserve(ids.size());
    for (int32_t id : ids) {
      const AddedToken* a = added_for(id);
      if (a) {
        if (skip_special && a->special) continue;
        toks.push_back(a->content);
        continue;
      }
      if (id >= 0 && size_t(id) < c_.id_to_token.size() && c_.has_id[size_t(id)])
        toks.push_back(c_.id_to_token[size_t(id)]);
      // unknown ids are dropped, as HF does
    }
    if (!c_.has_decoder) {
      std::string r;
      for (size_t i = 0; i < toks.size(); ++i) r += (i ? " " : "") + toks[i];
      return r;
    }
    for (auto& op : c_.decoder) run_decoder(op, toks);
    std::string r;
    for (auto& t : toks) r += t;
    return r;
  }

  std::optional<int32_t> token_to_id(std::string_view token) const override {
    for (auto& a : c_.added)
      if (a.content == token) return a.id;
    auto it = c_.vocab.find(token);
    if (it == c_.vocab.end()) return std::nullopt;
    return it->second;
  }
  std::optional<std::string> id_to_token(int32_t id) const override {
    if (const AddedToken* a = added_for(id)) return a->content;
    if (id >= 0 && size_t(id) < c_.id_to_token.size() && c_.has_id[size_t(id)]) return c_.id_to_token[size_t(id)];
    return std::nullopt;
  }
  size_t vocab_size() const override { return size_; }
  const std::vector<AddedToken>& added_tokens() const override { return c_.added; }

 private:
  const AddedToken* added_for(int32_t id) const {
    if (id < 0 || size_t(id) >= added_by_id_.size() || added_by_id_[size_t(id)] < 0) return nullptr;
    return &c_.added[size_t(added_by_id_[size_t(id)])];
  }

  // HF AddedVocabulary::split_with_indices: leftmost-longest matches, then single_word / lstrip /
  // rstrip applied to each match.
  void split_added(std::string_view s, bool at_start, const Trie& trie, std::vector<Piece>& out) const {
    if (trie.empty()) {
      if (!s.empty()) out.push_back({std::string(s), -1, at_start});
      return;
    }
    struct M { size_t b, e; int32_t tok; };
    std::vector<M> ms;
    size_t i = 0;
    while (i < s.size()) {
      if (!trie.first_byte[static_cast<unsigned char>(s[i])]) { ++i; continue; }
      auto [tok, len] = trie.longest(s, i);
      if (tok < 0) { ++i; continue; }
      ms.push_back({i, i + len, tok});
      i += len;
    }
    size_t prev = 0;
    for (auto& m : ms) {
      const AddedToken& a = c_.added[size_t(m.tok)];
      size_t b = m.b, e = m.e;
      if (a.single_word) {
        bool start_ok = b == 0 || !ends_with_word(s.substr(0, b));
        bool stop_ok = e == s.size() || !starts_with_word(s.substr(e));
        if (!start_ok || !stop_ok) continue;
      }
      if (a.lstrip) b = std::max(prev, trim_end_len(s.substr(0, b)));
      if (a.rstrip) e += leading_ws_len(s.substr(e));
      if (b < prev) continue;
      if (b > prev) out.push_back({std::string(s.substr(prev, b - prev)), -1, at_start && prev == 0});
      out.push_back({std::string(), a.id, false});
      prev = e;
    }
    if (prev < s.size()) out.push_back({std::string(s.substr(prev)), -1, at_start && prev == 0});
  }

  std::string normalize_str(std::string s) const {
    for (auto& op : c_.normalizer) {
      switch (op.kind) {
        case NormOp::NFC: s = normalize(s, NormForm::NFC); break;
        case NormOp::NFD: s = normalize(s, NormForm::NFD); break;
        case NormOp::NFKC: s = normalize(s, NormForm::NFKC); break;
        case NormOp::NFKD: s = normalize(s, NormForm::NFKD); break;
        case NormOp::Lowercase: s = lowercase(s); break;
        case NormOp::PrependStr:
          if (!s.empty()) s = op.a + s;  // HF Prepend leaves an empty string empty
          break;
        case NormOp::ReplaceStr: replace_all(s, op.a, op.b); break;
        case NormOp::ReplaceRegex: {
          std::vector<std::pair<size_t, size_t>> m;
          op.re->find_all(s, m);
          if (m.empty()) break;
          std::string r;
          size_t pos = 0;
          for (auto [b, e] : m) {
            r.append(s, pos, b - pos);
            r += op.b;
            pos = e;
          }
          r.append(s, pos);
          s.swap(r);
          break;
        }
        case NormOp::Strip: {
          size_t b = op.left ? leading_ws_len(s) : 0;
          size_t e = op.right ? trim_end_len(s) : s.size();
          s = e > b ? s.substr(b, e - b) : std::string();
          break;
        }
      }
    }
    return s;
  }

  void pre_tokenize(std::string s, bool at_start, std::vector<std::string>& words) const {
    if (s.empty()) return;
    words.push_back(std::move(s));
    std::vector<std::string> next;
    std::vector<std::pair<size_t, size_t>> m;
    for (auto& op : c_.pre) {
      next.clear();
      for (size_t wi = 0; wi < words.size(); ++wi) {
        std::string& w = words[wi];
        switch (op.kind) {
          case PreOp::Split:
            m.clear();
            if (op.re) {
              op.re->find_all(w, m);
            } else if (!op.literal.empty()) {
              for (size_t p = w.find(op.literal); p != std::string::npos; p = w.find(op.literal, p + op.literal.size()))
                m.emplace_back(p, p + op.literal.size());
            }
            split_by_matches(w, m, op.invert, op.behavior, next);
            break;
          case PreOp::ByteLevel: {
            if (op.add_prefix_space && !w.empty() && w[0] != ' ') w.insert(w.begin(), ' ');
            if (op.re) {
              m.clear();
              op.re->find_all(w, m);
              size_t first = next.size();
              split_by_matches(w, m, false, SplitBehavior::Isolated, next);
              for (size_t k = first; k < next.size(); ++k) next[k] = bytes_to_bytelevel(next[k]);
            } else {
              next.push_back(bytes_to_bytelevel(w));
            }
            break;
          }
          case PreOp::Metaspace: {
            replace_all(w, " ", op.replacement);
            bool prepend = op.prepend == Prepend::Always || (op.prepend == Prepend::First && at_start && wi == 0);
            if (prepend && w.compare(0, op.replacement.size(), op.replacement) != 0) w = op.replacement + w;
            if (op.split) {
              m.clear();
              for (size_t p = w.find(op.replacement); p != std::string::npos;
                   p = w.find(op.replacement, p + op.replacement.size()))
                m.emplace_back(p, p + op.replacement.size());
              split_by_matches(w, m, false, SplitBehavior::MergedWithNext, next);
            } else {
              next.push_back(std::move(w));
            }
            break;
          }
          case PreOp::Digits: {
            m.clear();
            size_t i = 0;
            while (i < w.size()) {
              size_t j = i;
              uint32_t cp = utf8_next(w, j);
              bool digit = is_numeric(cp);
              if (digit) {
                if (op.individual_digits || m.empty() || m.back().second != i) m.emplace_back(i, j);
                else m.back().second = j;
              }
              i = j;
            }
            split_by_matches(w, m, false, op.individual_digits ? SplitBehavior::Isolated : SplitBehavior::Contiguous,
                             next);
            break;
          }
        }
      }
      words.swap(next);
    }
  }

  // Per-thread cache of pre-token -> ids. Keyed by a process-unique instance id, not
  // by `this`: a new tokenizer can be allocated where a destroyed one lived, and a
  // pointer key would then serve the old tokenizer's ids.
  struct Cache {
    uint64_t owner = 0;
    std::unordered_map<std::string, std::vector<int32_t>> map;
  };
  static uint64_t next_instance_id() {
    static std::atomic<uint64_t> n{0};
    return ++n;
  }
  const uint64_t instance_id_ = next_instance_id();

  void tokenize_word(const std::string& w, std::vector<int32_t>& ids) const {
    if (w.empty()) return;
    if (c_.ignore_merges) {
      auto it = c_.vocab.find(w);
      if (it != c_.vocab.end()) {
        ids.push_back(it->second);
        return;
      }
    }
    thread_local Cache cache;
    const bool use_cache = w.size() < 256;
    if (use_cache) {
      if (cache.owner != instance_id_) {
        cache.map.clear();
        cache.owner = instance_id_;
      }
      auto it = cache.map.find(w);
      if (it != cache.map.end()) {
        ids.insert(ids.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    size_t before = ids.size();
    bpe(w, ids);
    if (use_cache) {
      if (cache.map.size() > 200000) cache.map.clear();
      cache.map.emplace(w, std::vector<int32_t>(ids.begin() + before, ids.end()));
    }
  }

  void bpe(std::string_view w, std::vector<int32_t>& ids) const {
    std::vector<int32_t> sym;
    sym.reserve(w.size());
    bool last_unk = false;
    size_t i = 0;
    while (i < w.size()) {
      size_t l = utf8_valid_len(w, i);
      if (!l) l = 1;
      std::string_view ch = w.substr(i, l);
      i += l;
      auto it = c_.vocab.find(ch);
      if (it != c_.vocab.end()) {
        sym.push_back(it->second);
        last_unk = false;
        continue;
      }
      if (c_.byte_fallback) {
        bool all = true;
        for (unsigned char b : ch) all = all && byte_ids_[b] >= 0;
        if (all) {
          for (unsigned char b : ch) sym.push_back(byte_ids_[b]);
          last_unk = false;
          continue;
        }
      }
      if (c_.unk_id >= 0) {
        if (!(c_.fuse_unk && last_unk)) sym.push_back(c_.unk_id);
        last_unk = true;
      }
    }
    const size_t n = sym.size();
    if (n <= 1 || c_.merges.empty()) {
      ids.insert(ids.end(), sym.begin(), sym.end());
      return;
    }
    std::vector<int32_t> prev(n), next(n);
    for (size_t k = 0; k < n; ++k) {
      prev[k] = int32_t(k) - 1;
      next[k] = k + 1 < n ? int32_t(k + 1) : -1;
    }
    struct Cand { int32_t rank; int32_t pos; int32_t left, right, merged; };
    auto cmp = [](const Cand& a, const Cand& b) { return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos; };
    std::priority_queue<Cand, std::vector<Cand>, decltype(cmp)> heap(cmp);
    auto push = [&](int32_t p) {
      int32_t q = next[size_t(p)];
      if (p < 0 || q < 0) return;
      uint64_t key = (uint64_t(uint32_t(sym[size_t(p)])) << 32) | uint32_t(sym[size_t(q)]);
      auto it = c_.merges.find(key);
      if (it != c_.merges.end()) heap.push({it->second.first, p, sym[size_t(p)], sym[size_t(q)], it->second.second});
    };
    for (size_t k = 0; k + 1 < n; ++k) push(int32_t(k));
    std::vector<bool> dead(n, false);
    while (!heap.empty()) {
      Cand c = heap.top();
      heap.pop();
      size_t p = size_t(c.pos);
      if (dead[p] || sym[p] != c.left) continue;
      int32_t q = next[p];
      if (q < 0 || sym[size_t(q)] != c.right) continue;
      sym[p] = c.merged;
      dead[size_t(q)] = true;
      next[p] = next[size_t(q)];
      if (next[p] >= 0) prev[size_t(next[p])] = int32_t(p);
      if (prev[p] >= 0) push(prev[p]);
      push(int32_t(p));
    }
    for (int32_t k = 0; k >= 0; k = next[size_t(k)]) ids.push_back(sym[size_t(k)]);
  }

  static void run_decoder(const DecOp& op, std::vector<std::string>& toks) {
    switch (op.kind) {
      case DecOp::ByteLevel: {
        std::string bytes;
        for (auto& t : toks) {
          std::string mine;
          bool ok = true;
          size_t i = 0;
          while (i < t.size()) {
            size_t l = utf8_valid_len(t, i);
            if (!l) { ok = false; break; }
            int b = unicode_to_byte(utf8_next(t, i));
            if (b < 0) { ok = false; break; }
            mine.push_back(char(b));
          }
          bytes += ok ? mine : t;
        }
        toks.assign(1, utf8_lossy(bytes));
        break;
      }
      case DecOp::Replace:
        for (auto& t : toks) replace_all(t, op.a, op.b);
        break;
      case DecOp::ByteFallback: {
        std::vector<std::string> out;
        std::string pending;
        size_t npending = 0;
        auto flush = [&] {
          if (!npending) return;
          if (utf8_is_valid(pending)) out.push_back(pending);
          else
            for (size_t k = 0; k < npending; ++k) out.emplace_back("\xEF\xBF\xBD");
          pending.clear();
          npending = 0;
        };
        for (auto& t : toks) {
          int byte = -1;
          if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>') {
            auto hex = [](char c) {
              return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
            };
            int h = hex(t[3]), l = hex(t[4]);
            if (h >= 0 && l >= 0) byte = h * 16 + l;
          }
          if (byte >= 0) {
            pending.push_back(char(byte));
            ++npending;
          } else {
            flush();
            out.push_back(std::move(t));
          }
        }
        flush();
        toks.swap(out);
        break;
      }
      case DecOp::Fuse: {
        std::string all;
        for (auto& t : toks) all += t;
        toks.assign(1, std::move(all));
        break;
      }
      case DecOp::Strip: {
        // Strips up to `start` leading and `stop` trailing code points equal to the content char.
        for (auto& t : toks) {
          size_t b = 0;
          for (size_t k = 0; k < op.start && t.compare(b, op.a.size(), op.a) == 0 && b < t.size(); ++k) b += op.a.size();
          size_t e = t.size();
          for (size_t k = 0; k < op.stop && e >= b + op.a.size() && t.compare(e - op.a.size(), op.a.size(), op.a) == 0; ++k)
            e -= op.a.size();
          t = t.substr(b, e - b);
        }
        break;
      }
      case DecOp::Metaspace: {
        for (size_t i = 0; i < toks.size(); ++i) {
          replace_all(toks[i], op.a, " ");
          if (i == 0 && op.prepend != Prepend::Never && !toks[i].empty() && toks[i][0] == ' ') toks[i].erase(0, 1);
        }
        break;
      }
    }
  }

  Config c_;
  Trie raw_trie_, norm_trie_;
  std::vector<int32_t> added_by_id_;
  size_t size_ = 0;
  int32_t byte_ids_[256];
  bool bytelevel_ = false;
};

}  // namespace

std::unique_ptr<Tokenizer> build(Config cfg) { return std::make_unique<BpeTokenizer>(std::move(cfg)); }

}  // namespace talon::text::detail
