// Loaders: tokenizer.json (HF `tokenizers` serialisation), GGUF tokenizer metadata (built as
// transformers' GGUF loader builds it) and SentencePiece ModelProto files (converted as
// transformers' LlamaTokenizer converts them).
#include <algorithm>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "io/gguf.h"
#include "text/tokenizer_impl.h"
#include "text/unicode.h"
#include "util/error.h"
#include "util/log.h"

namespace talon::text {
namespace detail {
namespace {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// tokenizer.json

struct J {
  const std::string& origin;
  [[noreturn]] void bad(const std::string& field, const std::string& what) const {
    fail("{}: field {}: {}", origin, field, what);
  }
  const json& need(const json& o, const char* key, const std::string& at) const {
    if (!o.is_object()) bad(at, "expected an object");
    auto it = o.find(key);
    if (it == o.end()) bad(at == "(root)" ? std::string(key) : at + "." + key, "missing");
    return *it;
  }
  std::string str(const json& o, const char* key, const std::string& at) const {
    const json& v = need(o, key, at);
    if (!v.is_string()) bad(at + "." + key, "expected a string");
    return v.get<std::string>();
  }
  bool flag(const json& o, const char* key, const std::string& at, bool def) const {
    if (!o.is_object()) bad(at, "expected an object");
    auto it = o.find(key);
    if (it == o.end() || it->is_null()) return def;
    if (!it->is_boolean()) bad(at + "." + key, "expected true or false");
    return it->get<bool>();
  }
  std::string type(const json& o, const std::string& at) const { return str(o, "type", at); }
};

std::shared_ptr<Regex> pattern_regex(const J& jj, const json& p, const std::string& at, std::string* literal) {
  if (!p.is_object()) jj.bad(at, "expected {\"String\": ...} or {\"Regex\": ...}");
  if (p.contains("Regex")) {
    if (!p["Regex"].is_string()) jj.bad(at + ".Regex", "expected a string");
    return std::make_shared<Regex>(p["Regex"].get<std::string>(), jj.origin + " (" + at + ")");
  }
  if (p.contains("String")) {
    if (!p["String"].is_string()) jj.bad(at + ".String", "expected a string");
    *literal = p["String"].get<std::string>();
    return nullptr;
  }
  jj.bad(at, "expected {\"String\": ...} or {\"Regex\": ...}");
}

void parse_normalizer(const J& jj, const json& n, const std::string& at, std::vector<NormOp>& out) {
  if (n.is_null()) return;
  std::string t = jj.type(n, at);
  if (t == "Sequence") {
    const json& arr = jj.need(n, "normalizers", at);
    if (!arr.is_array()) jj.bad(at + ".normalizers", "expected an array");
    for (size_t i = 0; i < arr.size(); ++i) parse_normalizer(jj, arr[i], fmt::format("{}.normalizers[{}]", at, i), out);
  } else if (t == "NFC") {
    out.push_back({NormOp::NFC});
  } else if (t == "NFD") {
    out.push_back({NormOp::NFD});
  } else if (t == "NFKC") {
    out.push_back({NormOp::NFKC});
  } else if (t == "NFKD") {
    out.push_back({NormOp::NFKD});
  } else if (t == "Lowercase") {
    out.push_back({NormOp::Lowercase});
  } else if (t == "Prepend") {
    NormOp op{NormOp::PrependStr};
    op.a = jj.str(n, "prepend", at);
    out.push_back(op);
  } else if (t == "Replace") {
    NormOp op{NormOp::ReplaceStr};
    op.re = pattern_regex(jj, jj.need(n, "pattern", at), at + ".pattern", &op.a);
    if (op.re) op.kind = NormOp::ReplaceRegex;
    op.b = jj.str(n, "content", at);
    out.push_back(op);
  } else if (t == "Strip") {
    NormOp op{NormOp::Strip};
    op.left = jj.flag(n, "strip_left", at, true);
    op.right = jj.flag(n, "strip_right", at, true);
    out.push_back(op);
  } else {
    jj.bad(at + ".type", fmt::format("normalizer {:?} is not supported", t));
  }
}

SplitBehavior parse_behavior(const J& jj, const std::string& b, const std::string& at) {
  if (b == "Isolated") return SplitBehavior::Isolated;
  if (b == "Removed") return SplitBehavior::Removed;
  if (b == "MergedWithPrevious") return SplitBehavior::MergedWithPrevious;
  if (b == "MergedWithNext") return SplitBehavior::MergedWithNext;
  if (b == "Contiguous") return SplitBehavior::Contiguous;
  jj.bad(at, fmt::format("unknown split behavior {:?}", b));
}

void parse_pre(const J& jj, const json& n, const std::string& at, std::vector<PreOp>& out) {
  if (n.is_null()) return;
  std::string t = jj.type(n, at);
  if (t == "Sequence") {
    const json& arr = jj.need(n, "pretokenizers", at);
    if (!arr.is_array()) jj.bad(at + ".pretokenizers", "expected an array");
    for (size_t i = 0; i < arr.size(); ++i) parse_pre(jj, arr[i], fmt::format("{}.pretokenizers[{}]", at, i), out);
  } else if (t == "Split") {
    PreOp op{PreOp::Split};
    op.re = pattern_regex(jj, jj.need(n, "pattern", at), at + ".pattern", &op.literal);
    op.behavior = parse_behavior(jj, jj.str(n, "behavior", at), at + ".behavior");
    op.invert = jj.flag(n, "invert", at, false);
    out.push_back(op);
  } else if (t == "ByteLevel") {
    PreOp op{PreOp::ByteLevel};
    op.add_prefix_space = jj.flag(n, "add_prefix_space", at, true);
    if (jj.flag(n, "use_regex", at, true)) op.re = std::make_shared<Regex>(kGpt2Regex, jj.origin);
    out.push_back(op);
  } else if (t == "Metaspace") {
    PreOp op{PreOp::Metaspace};
    op.replacement = jj.str(n, "replacement", at);
    if (n.contains("prepend_scheme") && !n["prepend_scheme"].is_null()) {
      std::string s = jj.str(n, "prepend_scheme", at);
      if (s == "first") op.prepend = Prepend::First;
      else if (s == "always") op.prepend = Prepend::Always;
      else if (s == "never") op.prepend = Prepend::Never;
      else jj.bad(at + ".prepend_scheme", fmt::format("unknown scheme {:?}", s));
    } else {
      op.prepend = jj.flag(n, "add_prefix_space", at, true) ? Prepend::Always : Prepend::Never;
    }
    op.split = jj.flag(n, "split", at, true);
    out.push_back(op);
  } else if (t == "Digits") {
    PreOp op{PreOp::Digits};
    op.individual_digits = jj.flag(n, "individual_digits", at, false);
    out.push_back(op);
  } else {
    jj.bad(at + ".type", fmt::format("pre-tokenizer {:?} is not supported", t));
  }
}

void parse_decoder(const J& jj, const json& n, const std::string& at, std::vector<DecOp>& out) {
  std::string t = jj.type(n, at);
  if (t == "Sequence") {
    const json& arr = jj.need(n, "decoders", at);
    if (!arr.is_array()) jj.bad(at + ".decoders", "expected an array");
    for (size_t i = 0; i < arr.size(); ++i) parse_decoder(jj, arr[i], fmt::format("{}.decoders[{}]", at, i), out);
  } else if (t == "ByteLevel") {
    out.push_back({DecOp::ByteLevel});
  } else if (t == "Replace") {
    DecOp op{DecOp::Replace};
    std::string lit;
    if (pattern_regex(jj, jj.need(n, "pattern", at), at + ".pattern", &lit))
      jj.bad(at + ".pattern", "regex Replace decoders are not supported");
    op.a = lit;
    op.b = jj.str(n, "content", at);
    out.push_back(op);
  } else if (t == "ByteFallback") {
    out.push_back({DecOp::ByteFallback});
  } else if (t == "Fuse") {
    out.push_back({DecOp::Fuse});
  } else if (t == "Strip") {
    DecOp op{DecOp::Strip};
    op.a = jj.str(n, "content", at);
    const json& s = jj.need(n, "start", at);
    const json& e = jj.need(n, "stop", at);
    if (!s.is_number_unsigned() || !e.is_number_unsigned()) jj.bad(at, "start/stop must be non-negative integers");
    op.start = s.get<size_t>();
    op.stop = e.get<size_t>();
    out.push_back(op);
  } else if (t == "Metaspace") {
    DecOp op{DecOp::Metaspace};
    op.a = jj.str(n, "replacement", at);
    if (n.contains("prepend_scheme") && n["prepend_scheme"].is_string())
      op.prepend = n["prepend_scheme"] == "never" ? Prepend::Never : Prepend::Always;
    else
      op.prepend = jj.flag(n, "add_prefix_space", at, true) ? Prepend::Always : Prepend::Never;
    out.push_back(op);
  } else {
    jj.bad(at + ".type", fmt::format("decoder {:?} is not supported", t));
  }
}

std::vector<int32_t> special_ids(const J& jj, const json& specials, const std::string& name, const std::string& at) {
  const json& s = jj.need(specials, name.c_str(), at);
  const json& ids = jj.need(s, "ids", at + "." + name);
  if (!ids.is_array()) jj.bad(at + "." + name + ".ids", "expected an array");
  std::vector<int32_t> r;
  for (auto& v : ids) {
    if (!v.is_number_integer()) jj.bad(at + "." + name + ".ids", "expected integers");
    r.push_back(v.get<int32_t>());
  }
  return r;
}

int32_t token_ref(const J& jj, const Config& c, const json& v, const std::string& at) {
  // Roberta/Bert: ["<s>", 0]
  if (!v.is_array() || v.size() != 2 || !v[1].is_number_integer()) jj.bad(at, "expected [token, id]");
  return v[1].get<int32_t>();
}

void parse_post(const J& jj, Config& c, const json& n, const std::string& at) {
  if (n.is_null()) return;
  std::string t = jj.type(n, at);
  if (t == "Sequence") {
    const json& arr = jj.need(n, "processors", at);
    if (!arr.is_array()) jj.bad(at + ".processors", "expected an array");
    for (size_t i = 0; i < arr.size(); ++i) parse_post(jj, c, arr[i], fmt::format("{}.processors[{}]", at, i));
  } else if (t == "ByteLevel") {
    // offsets only
  } else if (t == "TemplateProcessing") {
    const json& single = jj.need(n, "single", at);
    if (!single.is_array()) jj.bad(at + ".single", "expected an array");
    const json& specials = jj.need(n, "special_tokens", at);
    std::vector<PostItem> items;
    for (size_t i = 0; i < single.size(); ++i) {
      std::string ai = fmt::format("{}.single[{}]", at, i);
      const json& it = single[i];
      if (it.is_object() && it.contains("Sequence")) {
        items.push_back({true, {}});
      } else if (it.is_object() && it.contains("SpecialToken")) {
        std::string id = jj.str(it["SpecialToken"], "id", ai + ".SpecialToken");
        items.push_back({false, special_ids(jj, specials, id, at + ".special_tokens")});
      } else {
        jj.bad(ai, "expected {\"Sequence\": ...} or {\"SpecialToken\": ...}");
      }
    }
    if (c.has_post) {
      // A template after another processor wraps its result.
      std::vector<PostItem> merged;
      for (auto& it : items) {
        if (it.is_sequence) merged.insert(merged.end(), c.post_single.begin(), c.post_single.end());
        else merged.push_back(it);
      }
      items.swap(merged);
    }
    c.post_single = std::move(items);
    c.has_post = true;
    for (auto& it : c.post_single)
      if (!it.is_sequence && !it.ids.empty()) {
        if (!c.bos && &it == &c.post_single.front()) c.bos = it.ids.front();
      }
  } else if (t == "RobertaProcessing" || t == "BertProcessing") {
    int32_t cls = token_ref(jj, c, jj.need(n, "cls", at), at + ".cls");
    int32_t sep = token_ref(jj, c, jj.need(n, "sep", at), at + ".sep");
    c.post_single = {{false, {cls}}, {true, {}}, {false, {sep}}};
    c.has_post = true;
  } else {
    jj.bad(at + ".type", fmt::format("post-processor {:?} is not supported", t));
  }
}

// Token ids index tables, so hostile ids are refused before anything is sized by them:
// below kMaxTokenId, and the table at most a few times the number of tokens.
constexpr int64_t kMaxTokenId = int64_t(1) << 24;
void check_token_id(const std::string& origin, const std::string& field, int64_t id, size_t count) {
  if (id < 0 || id >= kMaxTokenId || size_t(id) > 4 * count + 65536)
    fail("{}: field {}: token id {} is out of range (ids must be below {} and at most 4 x {} + 65536 for {} tokens)",
         origin, field, id, kMaxTokenId, count, count);
}

void finish_vocab(Config& c) {
  int32_t max_id = -1;
  for (auto& [k, v] : c.vocab) max_id = std::max(max_id, v);
  if (max_id >= 0) check_token_id(c.origin, "vocab", max_id, c.vocab.size());
  c.id_to_token.assign(size_t(max_id + 1), std::string());
  c.has_id.assign(size_t(max_id + 1), false);
  for (auto& [k, v] : c.vocab) {
    if (v < 0) fail("{}: vocabulary token {:?} has a negative id {}", c.origin, k, v);
    c.id_to_token[size_t(v)] = k;
    c.has_id[size_t(v)] = true;
  }
}

}  // namespace

Config config_from_json(std::string_view text, const std::string& origin) {
  json j;
  try {
    j = json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    fail("{}: not valid JSON: {}", origin, e.what());
  }
  J jj{origin};
  Config c;
  c.origin = origin;
  if (!j.is_object()) jj.bad("(root)", "expected an object");
  const json& m = jj.need(j, "model", "(root)");
  if (!m.is_object()) jj.bad("model", "expected an object");
  std::string mt = m.contains("type") ? jj.str(m, "type", "model") : "BPE";
  if (mt != "BPE") jj.bad("model.type", fmt::format("model {:?} is not supported (only BPE)", mt));
  const json& vocab = jj.need(m, "vocab", "model");
  if (!vocab.is_object()) jj.bad("model.vocab", "expected an object {token: id}");
  c.vocab.reserve(vocab.size());
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (!it.value().is_number_integer()) jj.bad("model.vocab", fmt::format("id of {:?} is not an integer", it.key()));
    check_token_id(origin, fmt::format("model.vocab[{:?}]", it.key()), it.value().get<int64_t>(), vocab.size());
    c.vocab[it.key()] = it.value().get<int32_t>();
  }
  finish_vocab(c);
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (m.contains(k) && !m[k].is_null() && !(m[k].is_string() && m[k].get<std::string>().empty()))
      jj.bad(std::string("model.") + k, "non-empty values are not supported");
  }
  if (m.contains("dropout") && !m["dropout"].is_null() && !(m["dropout"].is_number() && m["dropout"].get<double>() == 0))
    jj.bad("model.dropout", "BPE dropout is not supported");
  c.byte_fallback = jj.flag(m, "byte_fallback", "model", false);
  c.fuse_unk = jj.flag(m, "fuse_unk", "model", false);
  c.ignore_merges = jj.flag(m, "ignore_merges", "model", false);
  if (m.contains("unk_token") && !m["unk_token"].is_null()) {
    std::string u = jj.str(m, "unk_token", "model");
    auto it = c.vocab.find(u);
    if (it != c.vocab.end()) c.unk_id = it->second;
  }
  const json& merges = jj.need(m, "merges", "model");
  if (!merges.is_array()) jj.bad("model.merges", "expected an array");
  c.merges.reserve(merges.size() * 2);
  for (size_t i = 0; i < merges.size(); ++i) {
    const json& mg = merges[i];
    if (mg.is_string()) {
      const std::string& s = mg.get_ref<const std::string&>();
      size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        jj.bad(fmt::format("model.merges[{}]", i), fmt::format("{:?} is not two tokens separated by one space", s));
      c.add_merge(std::string_view(s).substr(0, sp), std::string_view(s).substr(sp + 1), int32_t(i));
    } else if (mg.is_array() && mg.size() == 2 && mg[0].is_string() && mg[1].is_string()) {
      c.add_merge(mg[0].get_ref<const std::string&>(), mg[1].get_ref<const std::string&>(), int32_t(i));
    } else {
      jj.bad(fmt::format("model.merges[{}]", i), "expected \"a b\" or [\"a\", \"b\"]");
    }
  }
  if (j.contains("added_tokens") && !j["added_tokens"].is_null()) {
    const json& at = j["added_tokens"];
    if (!at.is_array()) jj.bad("added_tokens", "expected an array");
    for (size_t i = 0; i < at.size(); ++i) {
      std::string p = fmt::format("added_tokens[{}]", i);
      AddedToken a;
      a.content = jj.str(at[i], "content", p);
      const json& id = jj.need(at[i], "id", p);
      if (!id.is_number_integer() || id.get<int64_t>() < 0) jj.bad(p + ".id", "expected a non-negative integer");
      check_token_id(origin, p + ".id", id.get<int64_t>(), c.vocab.size() + at.size());
      a.id = id.get<int32_t>();
      a.single_word = jj.flag(at[i], "single_word", p, false);
      a.lstrip = jj.flag(at[i], "lstrip", p, false);
      a.rstrip = jj.flag(at[i], "rstrip", p, false);
      a.special = jj.flag(at[i], "special", p, false);
      a.normalized = jj.flag(at[i], "normalized", p, !a.special);
      c.added.push_back(a);
    }
  }
  if (j.contains("normalizer")) parse_normalizer(jj, j["normalizer"], "normalizer", c.normalizer);
  if (j.contains("pre_tokenizer")) parse_pre(jj, j["pre_tokenizer"], "pre_tokenizer", c.pre);
  if (j.contains("post_processor")) parse_post(jj, c, j["post_processor"], "post_processor");
  if (j.contains("decoder") && !j["decoder"].is_null()) {
    parse_decoder(jj, j["decoder"], "decoder", c.decoder);
    c.has_decoder = true;
  }
  bool bytelevel = std::any_of(c.pre.begin(), c.pre.end(), [](auto& p) { return p.kind == PreOp::ByteLevel; });
  c.kind = bytelevel ? "bpe-bytelevel" : c.byte_fallback ? "bpe-sentencepiece" : "bpe";
  return c;
}

// ---------------------------------------------------------------------------------------------
// SentencePiece ModelProto

namespace {

struct Pb {
  const uint8_t* p;
  const uint8_t* end;
  const std::string& origin;
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p >= end) fail("{}: truncated protobuf varint", origin);
      uint8_t b = *p++;
      v |= uint64_t(b & 0x7F) << shift;
      if (!(b & 0x80)) return v;
    }
    fail("{}: malformed protobuf varint", origin);
  }
  // Skips a field of the given wire type; returns false for unknown wire types.
  void skip(uint32_t wt) {
    switch (wt) {
      case 0: varint(); break;
      case 1: need(8); p += 8; break;
      case 2: { uint64_t n = varint(); need(n); p += n; break; }
      case 5: need(4); p += 4; break;
      default: fail("{}: not a SentencePiece model (protobuf wire type {})", origin, wt);
    }
  }
  void need(uint64_t n) {
    if (uint64_t(end - p) < n) fail("{}: truncated protobuf field", origin);
  }
};

struct SpmPiece {
  std::string piece;
  float score = 0;
  int type = 1;  // NORMAL
};

}  // namespace

Config config_from_spm(const fs::path& path) {
  MappedFile f(path);
  std::string origin = path.string();
  Pb pb{f.data(), f.data() + f.size(), origin};
  std::vector<SpmPiece> pieces;
  int model_type = 1;  // UNIGRAM default
  int64_t unk_id = 0;
  while (pb.p < pb.end) {
    uint64_t key = pb.varint();
    uint32_t field = uint32_t(key >> 3), wt = uint32_t(key & 7);
    if (field == 1 && wt == 2) {  // pieces
      uint64_t n = pb.varint();
      pb.need(n);
      Pb sub{pb.p, pb.p + n, origin};
      pb.p += n;
      SpmPiece sp;
      while (sub.p < sub.end) {
        uint64_t k = sub.varint();
        uint32_t fl = uint32_t(k >> 3), w = uint32_t(k & 7);
        if (fl == 1 && w == 2) {
          uint64_t l = sub.varint();
          sub.need(l);
          sp.piece.assign(reinterpret_cast<const char*>(sub.p), l);
          sub.p += l;
        } else if (fl == 2 && w == 5) {
          sub.need(4);
          std::memcpy(&sp.score, sub.p, 4);
          sub.p += 4;
        } else if (fl == 3 && w == 0) {
          sp.type = int(sub.varint());
        } else {
          sub.skip(w);
        }
      }
      pieces.push_back(std::move(sp));
    } else if (field == 2 && wt == 2) {  // trainer_spec
      uint64_t n = pb.varint();
      pb.need(n);
      Pb sub{pb.p, pb.p + n, origin};
      pb.p += n;
      while (sub.p < sub.end) {
        uint64_t k = sub.varint();
        uint32_t fl = uint32_t(k >> 3), w = uint32_t(k & 7);
        if (fl == 3 && w == 0) model_type = int(sub.varint());
        else if (fl == 40 && w == 0) unk_id = int64_t(sub.varint());
        else sub.skip(w);
      }
    } else {
      pb.skip(wt);
    }
  }
  if (pieces.empty()) fail("{}: not a SentencePiece model (no pieces)", origin);
  if (model_type != 2)
    fail("{}: trainer_spec.model_type is {} ({}); only BPE SentencePiece models are supported", origin, model_type,
         model_type == 1 ? "unigram" : "other");
  for (auto& p : pieces)
    if (!utf8_is_valid(p.piece)) fail("{}: pieces: {:?} is not valid UTF-8", origin, p.piece);

  Config c;
  c.origin = origin;
  c.kind = "bpe-sentencepiece";
  for (size_t i = 0; i < pieces.size(); ++i) c.vocab.emplace(pieces[i].piece, int32_t(i));  // first wins
  finish_vocab(c);
  // SentencePiece BPE merges the adjacent pair whose concatenation is the best-scoring piece,
  // leftmost first among equal scores. As HF-style merges: rank = dense rank of the merged
  // piece's score (equal scores share a rank, so the BPE loop's position tie-break applies).
  // Only normal and user-defined pieces take part (control, unknown and byte pieces never merge).
  std::vector<float> uniq;
  for (auto& p : pieces)
    if (p.type == 1 || p.type == 4) uniq.push_back(p.score);
  std::sort(uniq.begin(), uniq.end(), std::greater<float>());
  uniq.erase(std::unique(uniq.begin(), uniq.end()), uniq.end());
  auto mergeable = [&](std::string_view s) {
    auto it = c.vocab.find(s);
    if (it == c.vocab.end()) return false;
    int t = pieces[size_t(it->second)].type;
    return t == 1 || t == 4;
  };
  c.merges.reserve(pieces.size() * 4);
  for (size_t i = 0; i < pieces.size(); ++i) {
    const std::string& s = pieces[i].piece;
    if (c.vocab.at(s) != int32_t(i) || !(pieces[i].type == 1 || pieces[i].type == 4)) continue;
    int32_t rank = int32_t(std::lower_bound(uniq.begin(), uniq.end(), pieces[i].score, std::greater<float>()) - uniq.begin());
    for (size_t k = 0; k < s.size();) {
      size_t l = utf8_valid_len(s, k);
      k += l ? l : 1;
      if (k >= s.size()) break;
      std::string_view L(s.data(), k), R(s.data() + k, s.size() - k);
      if (mergeable(L) && mergeable(R)) c.add_merge(L, R, rank);
    }
  }
  c.byte_fallback = true;
  c.fuse_unk = true;
  // Added tokens: the unknown piece and control pieces are special, user-defined ones are not.
  for (size_t i = 0; i < pieces.size(); ++i) {
    int t = pieces[i].type;
    if (t == 2 || t == 3 || t == 4) {
      AddedToken a;
      a.content = pieces[i].piece;
      a.id = int32_t(i);
      a.special = t != 4;
      c.added.push_back(a);
    }
  }
  // SentencePiece's own text handling (add_dummy_prefix, spaces as U+2581), which is also the
  // normalizer of Meta's Llama-2 tokenizer.json: Prepend("\u2581") + Replace(" ", "\u2581").
  // (transformers 5's LlamaTokenizer instead uses Metaspace(prepend_scheme="first"), which differs
  // only on text that starts with a space: " a" -> [▁, ▁a] here and in sentencepiece, [▁a] there.)
  NormOp pre{NormOp::PrependStr};
  pre.a = "\xE2\x96\x81";
  NormOp rsp{NormOp::ReplaceStr};
  rsp.a = " ";
  rsp.b = "\xE2\x96\x81";
  c.normalizer = {pre, rsp};
  c.has_decoder = true;
  DecOp rep{DecOp::Replace};
  rep.a = "\xE2\x96\x81";
  rep.b = " ";
  DecOp strip{DecOp::Strip};
  strip.a = " ";
  strip.start = 1;
  c.decoder = {rep, DecOp{DecOp::ByteFallback}, DecOp{DecOp::Fuse}, strip};
  (void)unk_id;
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (pieces[i].piece == "<s>") c.bos = int32_t(i);
    if (pieces[i].piece == "</s>") c.eos = int32_t(i);
  }
  return c;
}

// ---------------------------------------------------------------------------------------------
// GGUF

namespace {
const char* const kLlama3Split =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* const kQwen2Split =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* const kTekkenSplit =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* const kGpt4oSplit =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

const char* gguf_split_for(const std::string& pre) {
  static const std::pair<const char*, const char*> table[] = {
      {"llama3", kLlama3Split}, {"llama-v3", kLlama3Split}, {"llama-bpe", kLlama3Split},
      {"falcon3", kLlama3Split}, {"falcon-h1", kLlama3Split}, {"pixtral", kLlama3Split},
      {"midm-2.0", kLlama3Split}, {"lfm2", kLlama3Split}, {"jina-v5-nano", kLlama3Split},
      {"dbrx", kLlama3Split}, {"smaug-bpe", kLlama3Split}, {"tekken", kTekkenSplit},
      {"qwen2", kQwen2Split}, {"deepseek-r1-qwen", kQwen2Split}, {"kormo", kQwen2Split},
      {"f2llmv2", kQwen2Split}, {"megrez", kQwen2Split}, {"gpt-4o", kGpt4oSplit},
      {"llama4", kGpt4oSplit}, {"kanana2", kGpt4oSplit}, {"talkie", kGpt4oSplit},
      {"minimax-m2", kGpt4oSplit},
  };
  for (auto& [k, v] : table)
    if (pre == k) return v;
  return nullptr;
}
}  // namespace

// ---------------------------------------------------------------------------------------------
// tiktoken BPE files ("<base64 token bytes> <rank>" per line, e.g. Meta's Llama-3 tokenizer.model)

namespace {
const char* const kCl100kSplit =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

int b64_value(unsigned char ch) {
  if (ch >= 'A' && ch <= 'Z') return ch - 'A';
  if (ch >= 'a' && ch <= 'z') return ch - 'a' + 26;
  if (ch >= '0' && ch <= '9') return ch - '0' + 52;
  if (ch == '+') return 62;
  if (ch == '/') return 63;
  return -1;
}

// Strict standard base64 (padding required). False when malformed.
bool b64_decode(std::string_view s, std::string& out) {
  out.clear();
  if (s.empty() || s.size() % 4 != 0) return false;
  for (size_t i = 0; i < s.size(); i += 4) {
    int v[4];
    int pad = 0;
    for (int k = 0; k < 4; ++k) {
      unsigned char ch = static_cast<unsigned char>(s[i + size_t(k)]);
      if (ch == '=' && i + 4 == s.size() && k >= 2) {
        v[k] = 0;
        ++pad;
      } else {
        if (pad) return false;
        v[k] = b64_value(ch);
        if (v[k] < 0) return false;
      }
    }
    uint32_t n = (uint32_t(v[0]) << 18) | (uint32_t(v[1]) << 12) | (uint32_t(v[2]) << 6) | uint32_t(v[3]);
    out.push_back(char((n >> 16) & 0xFF));
    if (pad < 2) out.push_back(char((n >> 8) & 0xFF));
    if (pad < 1) out.push_back(char(n & 0xFF));
  }
  return true;
}

// "<base64> <decimal>" (a trailing '\r' allowed).
bool tiktoken_line_shape(std::string_view line) {
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  size_t sp = line.find(' ');
  if (sp == 0 || sp == std::string_view::npos || sp + 1 >= line.size()) return false;
  for (size_t i = 0; i < sp; ++i)
    if (b64_value(static_cast<unsigned char>(line[i])) < 0 && line[i] != '=') return false;
  for (size_t i = sp + 1; i < line.size(); ++i)
    if (line[i] < '0' || line[i] > '9') return false;
  return true;
}

// Meta's Llama-3 special tokens (llama3/tokenizer.py), ranks 128000..128255.
std::vector<std::string> llama3_special_tokens() {
  std::vector<std::string> s = {"<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                                "<|reserved_special_token_1|>", "<|reserved_special_token_2|>",
                                "<|reserved_special_token_3|>", "<|start_header_id|>", "<|end_header_id|>",
                                "<|reserved_special_token_4|>", "<|eot_id|>"};
  for (int i = 5; i < 251; ++i) s.push_back(fmt::format("<|reserved_special_token_{}|>", i));
  return s;
}
}  // namespace

bool is_tiktoken_file(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  std::string line;
  if (!std::getline(f, line)) return false;
  return tiktoken_line_shape(line);
}

Config config_from_tiktoken(const fs::path& path) {
  std::string origin = path.string();
  std::string text = read_text_file(path);
  Config c;
  c.origin = origin;
  c.kind = "bpe-bytelevel";
  // rank -> raw bytes
  std::vector<std::string> by_rank;
  std::unordered_map<std::string, int32_t> raw;  // raw bytes -> rank
  raw.reserve(200000);
  std::string bytes;
  size_t lineno = 0;
  for (size_t pos = 0; pos < text.size();) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) nl = text.size();
    std::string_view line(text.data() + pos, nl - pos);
    pos = nl + 1;
    ++lineno;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    size_t sp = line.find(' ');
    if (sp == std::string_view::npos || line.find(' ', sp + 1) != std::string_view::npos)
      fail("{}:{}: expected \"<base64 token> <rank>\", got {:?}", origin, lineno, std::string(line.substr(0, 80)));
    std::string_view b64 = line.substr(0, sp), num = line.substr(sp + 1);
    if (!b64_decode(b64, bytes))
      fail("{}:{}: {:?} is not valid base64", origin, lineno, std::string(b64.substr(0, 80)));
    if (num.empty() || num.size() > 9 || !std::all_of(num.begin(), num.end(), [](char ch) { return ch >= '0' && ch <= '9'; }))
      fail("{}:{}: rank {:?} is not a non-negative integer", origin, lineno, std::string(num.substr(0, 80)));
    int32_t rank = int32_t(std::stol(std::string(num)));
    check_token_id(origin, fmt::format("line {} rank", lineno), rank, size_t(lineno));
    if (!raw.emplace(bytes, rank).second) fail("{}:{}: token {:?} appears twice", origin, lineno, bytes);
    if (size_t(rank) >= by_rank.size()) by_rank.resize(size_t(rank) + 1);
    if (!by_rank[size_t(rank)].empty())
      fail("{}:{}: rank {} appears twice", origin, lineno, rank);
    by_rank[size_t(rank)] = bytes;
  }
  if (raw.empty()) fail("{}: no tokens", origin);
  for (auto& [b, r] : raw) c.vocab.emplace(bytes_to_bytelevel(b), r);
  finish_vocab(c);
  // Merges as transformers' TikTokenConverter derives them (equal to Meta's Llama-3
  // tokenizer.json): for each token by rank, every split into two tokens, ordered by
  // (rank of left, rank of right); the merged token's rank orders the groups. With
  // ignore_merges, this is tiktoken's lowest-rank-first byte-pair merging.
  struct Split { int32_t l, r; };
  std::vector<Split> local;
  int32_t next = 0;
  c.merges.reserve(raw.size() * 3);
  for (size_t r = 0; r < by_rank.size(); ++r) {
    const std::string& t = by_rank[r];
    if (t.size() < 2) continue;
    local.clear();
    for (size_t k = 1; k < t.size(); ++k) {
      auto il = raw.find(t.substr(0, k));
      if (il == raw.end()) continue;
      auto ir = raw.find(t.substr(k));
      if (ir == raw.end()) continue;
      local.push_back({il->second, ir->second});
    }
    std::sort(local.begin(), local.end(), [](const Split& a, const Split& b) { return a.l != b.l ? a.l < b.l : a.r < b.r; });
    for (auto& s : local) {
      uint64_t key = (uint64_t(uint32_t(s.l)) << 32) | uint32_t(s.r);
      c.merges.try_emplace(key, next++, int32_t(r));
    }
  }
  c.ignore_merges = true;
  // Pre-tokenizer: the file carries no regex. Llama-3 (128000 ranks) uses its own pattern.
  const bool llama3 = raw.size() == 128000 && by_rank.size() == 128000;
  PreOp sp{PreOp::Split};
  sp.re = std::make_shared<Regex>(llama3 ? kLlama3Split : kCl100kSplit, origin);
  sp.behavior = SplitBehavior::Isolated;
  PreOp bl{PreOp::ByteLevel};
  bl.add_prefix_space = false;
  c.pre = {sp, bl};
  c.has_decoder = true;
  c.decoder = {DecOp{DecOp::ByteLevel}};
  if (llama3) {
    // Meta's special tokens follow the ranks; as Meta's HF tokenizer.json, <|begin_of_text|> is
    // prepended when special tokens are added (TemplateProcessing "<|begin_of_text|> $A").
    auto names = llama3_special_tokens();
    for (size_t i = 0; i < names.size(); ++i) {
      AddedToken a;
      a.content = names[i];
      a.id = int32_t(128000 + i);
      a.special = true;
      c.added.push_back(a);
    }
    c.bos = 128000;
    c.eos = 128001;
    c.has_post = true;
    c.post_single = {{false, {128000}}, {true, {}}};
    tlog::debug("{}: tiktoken file with 128000 ranks: Llama-3 pre-tokenizer and special tokens", origin);
  } else {
    tlog::warn("{}: tiktoken file with {} ranks is not Llama-3's; using the cl100k_base pre-tokenizer pattern "
               "and no special tokens",
               origin, raw.size());
  }
  return c;
}

Config config_from_gguf(const fs::path& path) {
  gguf::File g(path);
  std::string origin = path.string();
  Config c;
  c.origin = origin;
  std::string model = g.get_string("tokenizer.ggml.model");
  std::vector<std::string> tokens = g.get_string_array("tokenizer.ggml.tokens");
  std::vector<int64_t> types;
  if (const auto* v = g.find("tokenizer.ggml.token_type")) {
    for (auto& e : v->as_array()) types.push_back(e.as_int());
    if (types.size() != tokens.size())
      fail("{}: tokenizer.ggml.token_type has {} entries for {} tokens", origin, types.size(), tokens.size());
  }
  std::vector<std::string> merges;
  if (g.find("tokenizer.ggml.merges")) merges = g.get_string_array("tokenizer.ggml.merges");
  auto tid = [&](const char* key) -> std::optional<int32_t> {
    auto v = g.get_int_opt(key);
    if (!v) return std::nullopt;
    if (*v < 0 || size_t(*v) >= tokens.size()) fail("{}: {} = {} is not a token id", origin, key, *v);
    return int32_t(*v);
  };
  c.bos = tid("tokenizer.ggml.bos_token_id");
  c.eos = tid("tokenizer.ggml.eos_token_id");
  auto type_of = [&](size_t i) { return types.empty() ? int64_t(1) : types[i]; };

  if (model == "gpt2") {
    c.kind = "bpe-bytelevel";
    // Tokens spelled outside the byte-level alphabet are respelled byte by byte.
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string& t = tokens[i];
      bool in = true;
      for (size_t k = 0; k < t.size() && in;) {
        size_t l = utf8_valid_len(t, k);
        if (!l) { in = false; break; }
        in = unicode_to_byte(utf8_next(t, k)) >= 0;
      }
      std::string key = in ? t : bytes_to_bytelevel(t);
      c.vocab[key] = int32_t(i);  // later duplicates win, as a Python dict comprehension
      if (!in) t = key;
    }
    finish_vocab(c);
    for (size_t i = 0; i < merges.size(); ++i) {
      const std::string& s = merges[i];
      size_t sp = s.find(' ');
      if (sp == std::string::npos) fail("{}: tokenizer.ggml.merges[{}] {:?} has no space", origin, i, s);
      c.add_merge(std::string_view(s).substr(0, sp), std::string_view(s).substr(sp + 1), int32_t(i));
    }
    PreOp bl{PreOp::ByteLevel};
    std::string pre = g.get_string_opt("tokenizer.ggml.pre").value_or("");
    if (const char* split = gguf_split_for(pre)) {
      PreOp sp{PreOp::Split};
      sp.re = std::make_shared<Regex>(split, origin);
      sp.behavior = SplitBehavior::Isolated;
      c.pre.push_back(sp);
    } else {
      bl.re = std::make_shared<Regex>(kGpt2Regex, origin);
    }
    c.pre.push_back(bl);
    c.has_decoder = true;
    c.decoder = {DecOp{DecOp::ByteLevel}};
    // Control tokens (type 3) spelled in the byte alphabet are special; user-defined (4) are not.
    for (size_t i = 0; i < tokens.size(); ++i) {
      int64_t t = type_of(i);
      if (t != 3 && t != 4) continue;
      if (t == 3) {
        bool in = true;
        for (size_t k = 0; k < tokens[i].size() && in;) in = unicode_to_byte(utf8_next(tokens[i], k)) >= 0;
        if (!in) continue;
      }
      auto it = c.vocab.find(tokens[i]);
      AddedToken a;
      a.content = tokens[i];
      a.id = it != c.vocab.end() ? it->second : int32_t(i);
      a.special = t == 3;
      c.added.push_back(a);
    }
  } else if (model == "llama") {
    c.kind = "bpe-sentencepiece";
    std::vector<float> scores;
    if (const auto* v = g.find("tokenizer.ggml.scores"))
      for (auto& e : v->as_array()) scores.push_back(float(e.as_float()));
    for (size_t i = 0; i < tokens.size(); ++i) c.vocab[tokens[i]] = int32_t(i);
    finish_vocab(c);
    if (!merges.empty()) {
      for (size_t i = 0; i < merges.size(); ++i) {
        const std::string& s = merges[i];
        size_t sp = s.find(' ');
        if (sp == std::string::npos) fail("{}: tokenizer.ggml.merges[{}] {:?} has no space", origin, i, s);
        c.add_merge(std::string_view(s).substr(0, sp), std::string_view(s).substr(sp + 1), int32_t(i));
      }
    } else {
      if (scores.size() != tokens.size()) fail("{}: tokenizer.ggml.scores missing or of the wrong length", origin);
      // generate_merges(vocab, scores): best score first, then longer left, then longer right.
      struct Mg { float score; size_t ll, lr, seq; std::string_view l, r; };
      std::vector<Mg> mg;
      for (size_t i = 0; i < tokens.size(); ++i) {
        const std::string& s = tokens[i];
        if (c.vocab.at(s) != int32_t(i)) continue;
        size_t cps = 0, total = utf8_count(s);
        for (size_t k = 0; k < s.size();) {
          size_t l = utf8_valid_len(s, k);
          k += l ? l : 1;
          ++cps;
          if (k >= s.size()) break;
          std::string_view L(s.data(), k), R(s.data() + k, s.size() - k);
          if (c.vocab.count(L) && c.vocab.count(R)) mg.push_back({scores[i], cps, total - cps, 0, L, R});
        }
      }
      for (size_t i = 0; i < mg.size(); ++i) mg[i].seq = i;
      std::stable_sort(mg.begin(), mg.end(), [](const Mg& a, const Mg& b) {
        if (a.score != b.score) return a.score > b.score;
        if (a.ll != b.ll) return a.ll > b.ll;
        return a.lr > b.lr;
      });
      for (size_t i = 0; i < mg.size(); ++i) c.add_merge(mg[i].l, mg[i].r, int32_t(i));
    }
    c.byte_fallback = true;
    c.fuse_unk = true;
    PreOp ms{PreOp::Metaspace};
    ms.replacement = "\xE2\x96\x81";
    ms.prepend = Prepend::First;
    ms.split = false;
    c.pre.push_back(ms);
    c.has_decoder = true;
    DecOp rep{DecOp::Replace};
    rep.a = "\xE2\x96\x81";
    rep.b = " ";
    DecOp strip{DecOp::Strip};
    strip.a = " ";
    strip.start = 1;
    c.decoder = {rep, DecOp{DecOp::ByteFallback}, DecOp{DecOp::Fuse}, strip};
    for (size_t i = 0; i < tokens.size(); ++i) {
      int64_t t = type_of(i);
      if (t != 3 && t != 4 && t != 2) continue;
      AddedToken a;
      a.content = tokens[i];
      a.id = int32_t(i);
      a.special = t != 4;
      c.added.push_back(a);
    }
    bool add_bos = true;
    if (const auto* v = g.find("tokenizer.ggml.add_bos_token"))
      add_bos = v->kind == gguf::Value::Kind::BOOL ? std::get<bool>(v->v) : v->as_int() != 0;
    if (add_bos && c.bos) {
      c.has_post = true;
      c.post_single = {{false, {*c.bos}}, {true, {}}};
    }
  } else {
    fail("{}: tokenizer.ggml.model {:?} is not supported (gpt2, llama)", origin, model);
  }
  return c;
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------

namespace {
std::optional<std::string> config_token(const nlohmann::json& cfg, const char* key) {
  auto it = cfg.find(key);
  if (it == cfg.end()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string())
    return (*it)["content"].get<std::string>();
  return std::nullopt;
}
}  // namespace

std::unique_ptr<Tokenizer> Tokenizer::from_json_text(std::string_view json, const std::string& origin) {
  return detail::build(detail::config_from_json(json, origin));
}

std::unique_ptr<Tokenizer> Tokenizer::load(const fs::path& path) {
  fs::path p = path;
  if (fs::is_directory(p)) {
    if (fs::exists(p / "tokenizer.json")) p = p / "tokenizer.json";
    else if (fs::exists(p / "tokenizer.model")) p = p / "tokenizer.model";
    else fail("{}: no tokenizer.json or tokenizer.model in this directory", path.string());
  }
  if (!fs::exists(p)) fail("{}: no such file or directory{}", p.string(), hub_id_hint(p));
  char head[4] = {};
  {
    std::ifstream f(p, std::ios::binary);
    if (!f) fail("{}: cannot open", p.string());
    f.read(head, 4);
  }
  if (std::memcmp(head, "GGUF", 4) == 0) return detail::build(detail::config_from_gguf(p));
  size_t k = 0;
  while (k < 4 && (head[k] == ' ' || head[k] == '\n' || head[k] == '\r' || head[k] == '\t')) ++k;
  if (k < 4 && head[k] == '{') {
    detail::Config c = detail::config_from_json(read_text_file(p), p.string());
    // bos/eos names from a tokenizer_config.json beside it, when present.
    fs::path tc = p.parent_path() / "tokenizer_config.json";
    if (fs::exists(tc)) {
      try {
        auto cfg = nlohmann::json::parse(read_text_file(tc));
        auto resolve = [&](const char* key) -> std::optional<int32_t> {
          auto name = config_token(cfg, key);
          if (!name) return std::nullopt;
          for (auto& a : c.added)
            if (a.content == *name) return a.id;
          auto it = c.vocab.find(*name);
          if (it != c.vocab.end()) return it->second;
          return std::nullopt;
        };
        if (auto b = resolve("bos_token")) c.bos = b;
        if (auto e = resolve("eos_token")) c.eos = e;
      } catch (const nlohmann::json::exception& e) {
        fail("{}: not valid JSON: {}", tc.string(), e.what());
      }
    }
    return detail::build(std::move(c));
  }
  if (static_cast<unsigned char>(head[0]) == 0x0A) return detail::build(detail::config_from_spm(p));
  if (detail::is_tiktoken_file(p)) return detail::build(detail::config_from_tiktoken(p));
  fail("{}: not a tokenizer.json, GGUF or SentencePiece model (nor a tiktoken BPE file)", p.string());
}

}  // namespace talon::text
