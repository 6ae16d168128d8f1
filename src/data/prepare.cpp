#include "data/prepare.h"

#include <omp.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <map>
#include <nlohmann/json.hpp>

#include "data/samples.h"
#include "text/unicode.h"
#include "util/error.h"
#include "util/log.h"
#include "util/progress.h"
#include "util/signals.h"

namespace talon {

using json = nlohmann::json;

const char* const kChatmlTemplate =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

// ---------------------------------------------------------------------------------------------
// Token bytes and offsets

TokenBytes::TokenBytes(const text::Tokenizer& tok) : kind_(tok.kind()) {
  const size_t V = tok.vocab_size();
  bytes_.resize(V);
  flags_.assign(V, 0);
  const bool bytelevel = kind_ == "bpe-bytelevel";
  for (size_t id = 0; id < V; ++id) {
    auto t = tok.id_to_token(int32_t(id));
    if (!t) continue;
    std::string b;
    bool ok = true;
    if (bytelevel) {
      size_t i = 0;
      while (i < t->size() && ok) {
        if (text::utf8_valid_len(*t, i) == 0) {
          ok = false;
          break;
        }
        int v = text::unicode_to_byte(text::utf8_next(*t, i));
        if (v < 0) ok = false;
        else b.push_back(char(v));
      }
    } else if (t->size() == 6 && t->compare(0, 3, "<0x") == 0 && (*t)[5] == '>' && std::isxdigit((*t)[3]) &&
               std::isxdigit((*t)[4])) {
      b.push_back(char(std::stoi(t->substr(3, 2), nullptr, 16)));
    } else {
      static const std::string kMeta = "\xE2\x96\x81";  // U+2581, SentencePiece's space
      for (size_t i = 0; i < t->size();) {
        if (t->compare(i, 3, kMeta) == 0) {
          b.push_back(' ');
          i += 3;
        } else {
          b.push_back((*t)[i++]);
        }
      }
    }
    if (ok) {
      bytes_[id] = std::move(b);
      flags_[id] = 1;
    }
  }
  for (const auto& a : tok.added_tokens()) {
    if (a.id < 0 || size_t(a.id) >= V) continue;
    bytes_[size_t(a.id)] = a.content;
    flags_[size_t(a.id)] = uint8_t(1 | 2 | (a.lstrip ? 4 : 0) | (a.rstrip ? 8 : 0));
  }
}

std::vector<std::pair<uint32_t, uint32_t>> TokenBytes::offsets(const std::vector<int32_t>& ids,
                                                               std::string_view text) const {
  try {
    return offsets_exact(ids, text);
  } catch (const RecordError&) {
    bool ascii = std::all_of(text.begin(), text.end(), [](char c) { return (unsigned char)c < 0x80; });
    if (ascii) throw;
    // The tokenizer's normalizer may have changed the text (Qwen2: NFC). Normalize piecewise:
    // every ASCII character starts a segment (no canonical or compatibility mapping joins
    // across a following ASCII character, so the pieces' normal forms concatenate to the
    // text's), align the tokens on the normalized text, and map offsets back: 1:1 inside
    // segments normalization left alone, to the whole segment inside ones it changed.
    for (text::NormForm form : {text::NormForm::NFC, text::NormForm::NFKC}) {
      struct Seg {
        size_t c, d, a, b;
        bool same;
      };
      std::vector<Seg> segs;
      std::string norm;
      size_t a = 0;
      while (a < text.size()) {
        size_t b = a + 1;
        while (b < text.size() && (unsigned char)text[b] >= 0x80) ++b;
        std::string_view piece = text.substr(a, b - a);
        std::string n = (unsigned char)piece[0] < 0x80 && piece.size() == 1 ? std::string(piece)
                                                                              : text::normalize(piece, form);
        segs.push_back(Seg{norm.size(), norm.size() + n.size(), a, b, n == piece});
        norm += n;
        a = b;
      }
      std::vector<std::pair<uint32_t, uint32_t>> off;
      try {
        off = offsets_exact(ids, norm);
      } catch (const RecordError&) {
        continue;
      }
      auto seg_at = [&](size_t x, bool end) -> const Seg& {
        // the segment holding byte x (end: holding byte x-1)
        size_t lo = 0, hi = segs.size();
        const size_t key = end && x > 0 ? x - 1 : x;
        while (hi - lo > 1) {
          size_t mid = (lo + hi) / 2;
          if (segs[mid].c <= key) lo = mid;
          else hi = mid;
        }
        return segs[lo];
      };
      for (auto& [s0, e0] : off) {
        const size_t s = s0, e = e0;
        if (segs.empty()) break;
        const Seg& S = seg_at(s, false);
        const Seg& E = seg_at(e, true);
        s0 = uint32_t(S.same ? S.a + (s - S.c) : S.a);
        e0 = e == s ? s0 : uint32_t(E.same ? E.a + (e - E.c) : E.b);
      }
      return off;
    }
    throw;
  }
}

std::vector<std::pair<uint32_t, uint32_t>> TokenBytes::offsets_exact(const std::vector<int32_t>& ids,
                                                                     std::string_view text) const {
  std::vector<std::pair<uint32_t, uint32_t>> off(ids.size());
  auto is_ws = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; };
  size_t pos = 0;
  bool prev_rstrip = false;
  auto mismatch = [&](size_t k, const std::string& why) {
    const std::string_view ctx = text.substr(std::min(pos, text.size()), 24);
    throw RecordError("offsets",
                      fmt::format("cannot give tokens byte offsets in the rendered text ({} tokenizer): token {} "
                                  "(id {}) {} at byte {} (text there: {}); the tokenizer must spell its input "
                                  "exactly (no normalizer that changes text)",
                                  kind_, k, k < ids.size() ? ids[k] : -1, why, pos, json(std::string(ctx)).dump(
                                      -1, ' ', false, json::error_handler_t::replace)));
  };
  for (size_t k = 0; k < ids.size(); ++k) {
    const int32_t id = ids[k];
    if (id < 0 || size_t(id) >= bytes_.size() || !(flags_[size_t(id)] & 1)) mismatch(k, "has no known bytes");
    const std::string& b = bytes_[size_t(id)];
    const uint8_t fl = flags_[size_t(id)];
    size_t start = pos;
    // whitespace swallowed by the previous token (rstrip) or by this one (lstrip)
    if (text.compare(pos, b.size(), b) != 0 && pos < text.size() && is_ws(text[pos]) && (prev_rstrip || (fl & 4))) {
      size_t q = pos;
      while (q < text.size() && is_ws(text[q])) ++q;
      if (text.compare(q, b.size(), b) == 0) {
        if (prev_rstrip && k > 0) {
          off[k - 1].second = uint32_t(q);
          start = q;
        }
        pos = q;
      }
    }
    if (text.compare(pos, b.size(), b) == 0) {
      off[k] = {uint32_t(start), uint32_t(pos + b.size())};
      pos += b.size();
    } else if (!(fl & 2) && !b.empty() && b[0] == ' ' && text.compare(pos, b.size() - 1, std::string_view(b).substr(1)) == 0) {
      // SentencePiece's dummy prefix: a space the normalizer added in front of the text
      off[k] = {uint32_t(pos), uint32_t(pos + b.size() - 1)};
      pos += b.size() - 1;
    } else {
      mismatch(k, fmt::format("spells {}", json(b).dump(-1, ' ', false, json::error_handler_t::replace)));
    }
    prev_rstrip = (fl & 8) != 0;
  }
  if (pos < text.size() && prev_rstrip && !ids.empty()) {
    size_t q = pos;
    while (q < text.size() && is_ws(text[q])) ++q;
    if (q == text.size()) {
      off.back().second = uint32_t(q);
      pos = q;
    }
  }
  if (pos != text.size()) mismatch(ids.size(), "is missing: the tokens end before the text");
  return off;
}

// ---------------------------------------------------------------------------------------------
// Spans

namespace {
const char* const kSentinelA = "<<talon-sentinel-A>>";
const char* const kSentinelB = "[[talon-sentinel-B]]";
bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
}  // namespace

// Each assistant turn i is located as
//   end   = |render(messages[0..i], add_generation_prompt=false)|, which must be a prefix of the
//           full rendering; trailing whitespace (separators after the end-of-turn token) is cut;
//   begin = |render(messages[0..i), add_generation_prompt=true)| when that is a prefix of the
//           rendering through turn i (ChatTemplate::assistant_spans' rule); otherwise (a
//           conversation that starts with an assistant turn: templates add their default system
//           turn only when messages are present, or fail on an empty list) by the sentinel rule:
//           render messages[0..i] twice with turn i's content replaced by two different strings;
//           their common prefix ends where the turn's content begins.
// When that prefix rule cannot locate turn i (the template renders turn i differently once later
// turns exist: Qwen3 drops the <think> blocks of assistant turns before the last user query), the
// turn is located in the final rendering instead (locate_in_final).
namespace {

size_t common_prefix(const std::string& a, const std::string& b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return n;
}
size_t common_suffix(const std::string& a, const std::string& b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[a.size() - 1 - n] == b[b.size() - 1 - n]) ++n;
  return n;
}

// messages (all of them, or [0..upto]) with messages[i].content replaced by `probe`.
ojson with_probe(const ojson& messages, size_t i, size_t upto, const char* probe) {
  ojson m = ojson::array();
  for (size_t k = 0; k <= upto && k < messages.size(); ++k) m.push_back(messages[k]);
  m[i]["content"] = probe;
  return m;
}

// Turn i located in `full` itself:
//   content: render the whole conversation twice with turn i's content replaced by the two
//            sentinels (which differ in their first and last bytes); the bytes of `full` that
//            differ from both probe renderings ([longest common prefix, length - longest common
//            suffix)) are what the template made of turn i's content (for Qwen3 turns before the
//            last user query: the answer with its <think> block stripped);
//   tail:    the end of turn i as the template writes it when turn i is the last message
//            (render messages[0..i] with the two sentinels: what follows the sentinel, trailing
//            whitespace cut; ChatML: "<|im_end|>", tool calls included) must follow the content
//            in `full`; the span ends after it.
// Nothing of a turn is masked that is not in the final rendering: reasoning the template drops is
// not trained on.
TurnSpan locate_in_final(const text::ChatTemplate& tpl, const ojson& messages, const ojson& kwargs,
                         const std::string& full, size_t i, size_t floor) {
  std::string fa, fb, ta, tb;
  try {
    fa = tpl.render(with_probe(messages, i, messages.size(), kSentinelA), false, kwargs);
    fb = tpl.render(with_probe(messages, i, messages.size(), kSentinelB), false, kwargs);
    ta = tpl.render(with_probe(messages, i, i, kSentinelA), false, kwargs);
    tb = tpl.render(with_probe(messages, i, i, kSentinelB), false, kwargs);
  } catch (const std::exception& e) {
    throw RecordError("template_error", fmt::format("rendering the conversation with a probe content in message {}: {}",
                                                    i, e.what()));
  }
  auto fail = [&](const std::string& why) {
    return RecordError("unlocatable_turn",
                       fmt::format("assistant turn (message {}): the template renders it differently once later "
                                   "turns exist, and it cannot be located in the whole conversation's rendering: {}",
                                   i, why));
  };
  if (fa == fb) throw fail("its content does not appear in the rendering (the template drops the turn)");
  const size_t begin = std::min(common_prefix(full, fa), common_prefix(full, fb));
  const size_t suffix = std::min(common_suffix(full, fa), common_suffix(full, fb));
  if (begin < floor || begin + suffix > full.size())
    throw fail("the probe renderings differ from it outside the turn");
  const size_t content_end = full.size() - suffix;
  // the turn's tail as written when it is the last message (the sentinels differ in their last
  // byte, so the common suffix of the two probe renderings starts right after the content)
  std::string tail = ta.substr(ta.size() - common_suffix(ta, tb));
  while (!tail.empty() && is_space(tail.back())) tail.pop_back();
  if (full.compare(content_end, tail.size(), tail) != 0)
    throw fail(fmt::format("the turn's end {} does not follow its content",
                           json(tail).dump(-1, ' ', false, json::error_handler_t::replace)));
  size_t end = content_end + tail.size();
  while (end > begin && is_space(full[end - 1])) --end;
  TurnSpan s{i, begin, end, false};
  s.in_final = true;
  return s;
}

}  // namespace

std::vector<TurnSpan> locate_assistant_turns(const text::ChatTemplate& tpl, const ojson& messages,
                                             const ojson& kwargs, const std::string& full) {
  std::vector<TurnSpan> spans;
  auto is_prefix_of = [](const std::string& whole, const std::string& p) {
    return p.size() <= whole.size() && whole.compare(0, p.size(), p) == 0;
  };
  for (size_t i = 0; i < messages.size(); ++i) {
    const ojson& m = messages[i];
    if (!m.is_object() || m.value("role", std::string()) != "assistant") continue;
    const size_t floor = spans.empty() ? 0 : spans.back().end;
    std::string through;
    try {
      through = tpl.render_prefix(messages, i + 1, false, kwargs);
    } catch (const std::exception& e) {
      throw RecordError("template_error", fmt::format("rendering messages[0..{}]: {}", i, e.what()));
    }
    if (!is_prefix_of(full, through)) {
      spans.push_back(locate_in_final(tpl, messages, kwargs, full, i, floor));
      continue;
    }
    size_t begin = std::string::npos;
    bool by_sentinel = false;
    try {
      std::string before = tpl.render_prefix(messages, i, true, kwargs);
      if (is_prefix_of(through, before)) begin = before.size();
    } catch (const std::exception&) {
    }
    if (begin == std::string::npos) {
      ojson a = with_probe(messages, i, i, kSentinelA), b = with_probe(messages, i, i, kSentinelB);
      std::string ra, rb;
      try {
        ra = tpl.render(a, false, kwargs);
        rb = tpl.render(b, false, kwargs);
      } catch (const std::exception& e) {
        throw RecordError("template_error", fmt::format("rendering messages[0..{}] with a probe content: {}", i,
                                                        e.what()));
      }
      size_t cp = common_prefix(ra, rb);
      if (cp > through.size() || through.compare(0, cp, ra, 0, cp) != 0) {
        // the template renders the turn's own header differently for the probes (Qwen3 with
        // enable_thinking=false and a <think> block in the last turn): locate it in `full`
        spans.push_back(locate_in_final(tpl, messages, kwargs, full, i, floor));
        continue;
      }
      begin = cp;
      by_sentinel = true;
    }
    size_t end = through.size();
    while (end > begin && is_space(full[end - 1])) --end;
    spans.push_back(TurnSpan{i, begin, end, by_sentinel});
  }
  return spans;
}

std::vector<uint8_t> spans_to_mask(const std::vector<std::pair<uint32_t, uint32_t>>& off,
                                   const std::vector<TurnSpan>& spans) {
  std::vector<uint8_t> mask(off.size(), 0);
  size_t k = 0;
  for (const TurnSpan& s : spans) {  // spans are in text order
    while (k < off.size() && off[k].second <= s.begin) ++k;
    for (size_t j = k; j < off.size() && off[j].first < s.end; ++j)
      if (off[j].second > off[j].first && off[j].second > s.begin) mask[j] = 1;
  }
  return mask;
}

// ---------------------------------------------------------------------------------------------
// The command

namespace {

using Clock = std::chrono::steady_clock;

struct Job {
  int64_t line = 0;
  std::string text;
};

struct Result {
  std::string id;
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;
  bool truncated = false, prompt = false;
  std::vector<std::string> later_turns;
  std::string reason, message;  // reason set: not emitted
  ChatFormat format = ChatFormat::Auto;
  bool policy = false;          // a skip by policy (not an error)
};

struct Ctx {
  const text::Tokenizer* tok;
  const text::ChatTemplate* tpl;
  const TokenBytes* bytes;
  ojson kwargs;
  int64_t max_length;
  bool keep_prompts;
};

Result prepare_one(const Ctx& c, const Conversation& conv) {
  Result r;
  r.id = conv.id;
  bool any_assistant = false;
  for (auto& m : conv.messages)
    if (m.is_object() && m.value("role", std::string()) == "assistant") any_assistant = true;
  if (conv.prompt_only && !c.keep_prompts) {
    r.reason = "prompt_only";
    r.message = "a question without an answer (use --prompts keep to emit it as a prompt)";
    r.policy = true;
    return r;
  }
  if (!conv.prompt_only && !any_assistant) {
    r.reason = "no_assistant_turn";
    r.message = "the conversation has no assistant turn: nothing to train on";
    r.policy = true;
    return r;
  }
  std::string full;
  try {
    full = c.tpl->render(conv.messages, conv.prompt_only, c.kwargs);
  } catch (const std::exception& e) {
    throw RecordError("template_error", fmt::format("chat template: {}", e.what()));
  }
  std::vector<TurnSpan> spans;
  if (!conv.prompt_only) spans = locate_assistant_turns(*c.tpl, conv.messages, c.kwargs, full);
  r.ids = c.tok->encode(full, false);
  auto off = c.bytes->offsets(r.ids, full);
  r.mask = spans_to_mask(off, spans);
  r.prompt = conv.prompt_only;
  r.later_turns = conv.later_turns;
  if (r.ids.empty()) {
    r.reason = "empty";
    r.message = "the rendering has no tokens";
    r.policy = true;
    return r;
  }
  if (c.max_length > 0 && int64_t(r.ids.size()) > c.max_length) {
    r.ids.resize(size_t(c.max_length));
    r.mask.resize(size_t(c.max_length));
    r.truncated = true;
    if (!r.prompt && std::find(r.mask.begin(), r.mask.end(), 1) == r.mask.end()) {
      r.reason = "no_loss_after_truncation";
      r.message = fmt::format("no assistant token within the first {} tokens (--max-length)", c.max_length);
      r.policy = true;
    }
  }
  return r;
}

std::vector<Result> process_job(const Ctx& c, const Job& j, ChatFormat fmt_) {
  std::vector<Result> out;
  try {
    ojson rec = parse_record(j.text);
    ChatFormat f = fmt_ == ChatFormat::Auto ? detect_chat_format(rec) : fmt_;
    for (auto& conv : record_to_conversations(rec, f)) {
      try {
        out.push_back(prepare_one(c, conv));
        out.back().format = f;
      } catch (const RecordError& e) {
        Result r;
        r.format = f;
        r.id = conv.id;
        r.reason = e.reason;
        r.message = e.what();
        out.push_back(std::move(r));
      }
    }
  } catch (const RecordError& e) {
    Result r;
    r.reason = e.reason;
    r.message = e.what();
    out.push_back(std::move(r));
  } catch (const std::exception& e) {
    Result r;
    r.reason = "error";
    r.message = e.what();
    out.push_back(std::move(r));
  }
  return out;
}

// Removes the output directory on the way out unless the run committed.
struct OutGuard {
  fs::path dir;
  bool created = false, committed = false;
  ~OutGuard() {
    if (committed || !created) return;
    std::error_code ec;
    fs::remove(dir / ".talon.lock", ec);
    if (fs::is_empty(dir, ec)) fs::remove(dir, ec);
  }
};

std::string json_str(const std::string& s) { return json(s).dump(-1, ' ', false, json::error_handler_t::replace); }

}  // namespace

std::vector<fs::path> expand_inputs(const std::vector<fs::path>& in) {
  std::vector<fs::path> files;
  for (const fs::path& p : in) {
    TALON_CHECK(fs::exists(p), "{}: no such file or directory", p.string());
    if (fs::is_directory(p)) {
      std::vector<fs::path> found;
      fs::path tabular;  // a Parquet or Arrow file: a Hugging Face dataset as downloaded or saved
      for (auto& e : fs::recursive_directory_iterator(p)) {
        if (!e.is_regular_file()) continue;
        const std::string ext = lower_extension(e.path());
        if (ext == ".jsonl" || ext == ".json" || ext == ".csv" || ext == ".tsv") found.push_back(e.path());
        if (ext == ".parquet" || ext == ".arrow") tabular = e.path();
      }
      if (!tabular.empty()) {
        const bool saved = fs::exists(p / "dataset_info.json") || fs::exists(p / "state.json");
        const std::string dir = p.string();
        std::string stem = fs::path(dir).lexically_normal().filename().string();
        if (stem.empty() || stem == ".") stem = "data";
        fail("{}: holds {} (a Hugging Face dataset); talon reads JSON Lines or JSON arrays of chat records. "
             "Convert it with: python3 -c \"import datasets; {}.to_json('{}.jsonl')\"",
             dir, tabular.string(),
             saved ? fmt::format("datasets.load_from_disk('{}')", dir)
                   : fmt::format("datasets.load_dataset('{}', data_files='{}/**/*{}', split='train')",
                                 lower_extension(tabular) == ".parquet" ? "parquet" : "arrow", dir,
                                 tabular.extension().string()),
             stem);
      }
      std::sort(found.begin(), found.end());
      TALON_CHECK(!found.empty(), "{}: directory holds no .jsonl, .json, .csv or .tsv files", p.string());
      files.insert(files.end(), found.begin(), found.end());
    } else {
      files.push_back(p);
    }
  }
  TALON_CHECK(!files.empty(), "no input files (--data)");
  return files;
}


ChatTokenizer load_chat_tokenizer(const fs::path& model, const fs::path& tokenizer, const fs::path& chat_template,
                                  const std::string& fallback_template, const std::string& command) {
  ChatTokenizer ct;
  const fs::path tok_path = tokenizer.empty() ? model : tokenizer;
  const fs::path tpl_path = chat_template.empty() ? model : chat_template;
  TALON_CHECK(!tok_path.empty(), "{}: give --model, or --tokenizer (and --template)", command);
  TALON_CHECK(fallback_template.empty() || fallback_template == "chatml",
              "--fallback-template '{}': the only built-in template is chatml", fallback_template);
  ct.tokenizer_path = tok_path;
  ct.tok = text::Tokenizer::load(tok_path);
  auto& tok = ct.tok;
  auto& tpl = ct.tpl;
  try {
    TALON_CHECK(!tpl_path.empty(), "{}: no chat template source (give --model or --template)", command);
    tpl = std::make_unique<text::ChatTemplate>(text::ChatTemplate::from_path(tpl_path));
  } catch (const Error& e) {
    if (fallback_template != "chatml")
      fail("{} (use --fallback-template chatml to use the built-in ChatML template instead)", e.what());
    tlog::warn("!!! {}: no chat template ({}); using the BUILT-IN ChatML template (--fallback-template chatml). "
               "Masks and tokens follow ChatML, which may not be the format this model was trained on !!!",
               tpl_path.string(), e.what());
    tpl = std::make_unique<text::ChatTemplate>(kChatmlTemplate, "builtin:chatml");
    ct.fallback = true;
    for (const char* t : {"<|im_start|>", "<|im_end|>"})
      if (!tok->token_to_id(t)) tlog::warn("the tokenizer has no {} token: ChatML markers will be split into pieces", t);
  }
  {  // bos/eos from the tokenizer where the template source had none
    ojson d = tpl->default_kwargs();
    if (!d.contains("bos_token") && tok->bos_id())
      if (auto s = tok->id_to_token(*tok->bos_id())) d["bos_token"] = *s;
    if (!d.contains("eos_token") && tok->eos_id())
      if (auto s = tok->id_to_token(*tok->eos_id())) d["eos_token"] = *s;
    tpl->set_default_kwargs(d);
  }
  return ct;
}

ojson parse_template_kwargs(const std::string& text) {
  if (text.empty()) return ojson::object();
  ojson kwargs = ojson::parse(text, nullptr, false);
  TALON_CHECK(!kwargs.is_discarded() && kwargs.is_object(), "--template-kwargs '{}': expected a JSON object", text);
  return kwargs;
}

PrepareReport run_prepare(const PrepareOptions& opt) {
  PrepareReport rep;
  const auto t0 = Clock::now();
  TALON_CHECK(opt.on_error == "fail" || opt.on_error == "skip", "--on-error '{}': expected fail or skip", opt.on_error);
  TALON_CHECK(opt.prompts == "skip" || opt.prompts == "keep", "--prompts '{}': expected skip or keep", opt.prompts);
  TALON_CHECK(opt.max_length >= 0, "--max-length must be >= 0, got {}", opt.max_length);
  TALON_CHECK(!opt.out.empty(), "prepare: --out is required");
  const ChatFormat forced = parse_chat_format(opt.format);
  const ojson kwargs = parse_template_kwargs(opt.template_kwargs);
  const auto files = expand_inputs(opt.inputs);
  // Tokenizer and template: every check that can fail runs before anything is written.
  ChatTokenizer ct = load_chat_tokenizer(opt.model, opt.tokenizer, opt.chat_template, opt.fallback_template, "prepare");
  auto& tok = ct.tok;
  auto& tpl = ct.tpl;
  const fs::path tok_path = ct.tokenizer_path;
  const TokenBytes bytes(*tok);
  const std::string tpl_sha = sha256_hex(tpl->source().data(), tpl->source().size());
  tlog::info("tokenizer {} ({}, vocab {}); chat template {} (sha256 {})", tok_path.string(), tok->kind(),
             tok->vocab_size(), tpl->name(), tpl_sha.substr(0, 16));

  // Output directory: new, empty, or what an interrupted prepare left (no manifest.json:
  // tokens.jsonl and its temporaries only), which is removed: prepare restarts from the
  // first record. A finished one of the same job (same inputs, tokenizer, template and
  // options) is left alone.
  OutGuard guard{opt.out};
  if (fs::exists(opt.out)) {
    TALON_CHECK(fs::is_directory(opt.out), "{}: exists and is not a directory", opt.out.string());
    const fs::path mpath = opt.out / "manifest.json";
    if (fs::exists(mpath)) {
      json m = json::parse(read_text_file(mpath), nullptr, false);
      std::vector<std::string> diffs;
      try {
      if (!m.is_object() || m.value("format", "") != "talon.tokens") {
        diffs.push_back("manifest.json is not a talon.tokens manifest");
      } else {
        json want_inputs = json::array();
        for (auto& f : files) want_inputs.push_back(json{{"path", f.string()}, {"sha256", sha256_file_hex(f)}});
        json have_inputs = json::array();
        if (m.contains("inputs") && m["inputs"].is_array())
          for (auto& i : m["inputs"])
            if (i.is_object()) have_inputs.push_back(json{{"path", i.value("path", "")}, {"sha256", i.value("sha256", "")}});
        if (have_inputs != want_inputs) diffs.push_back("inputs (paths or contents)");
        const json tk = m.value("tokenizer", json::object()), ct = m.value("chat_template", json::object());
        if (!tk.is_object() || tk.value("source", "") != tok_path.string() || tk.value("kind", "") != tok->kind() ||
            tk.value("vocab_size", int64_t(-1)) != int64_t(tok->vocab_size()))
          diffs.push_back("tokenizer");
        if (!ct.is_object() || ct.value("sha256", "") != tpl_sha) diffs.push_back("chat template");
        if (!ct.is_object() || ct.value("kwargs", json()) != json::parse(kwargs.dump())) diffs.push_back("--template-kwargs");
        const json want_opts = {{"format", opt.format}, {"max_length", opt.max_length}, {"on_error", opt.on_error},
                                {"prompts", opt.prompts}};
        if (m.value("options", json()) != want_opts) diffs.push_back("options");
      }
      } catch (const json::exception&) {  // a field of an unexpected type
        diffs.push_back("manifest.json fields");
      }
      if (!diffs.empty())
        fail("{}: holds a different finished prepare ({} differ); delete it or use another --out", opt.out.string(),
             fmt::format("{}", fmt::join(diffs, ", ")));
      (void)open_samples(opt.out);  // tokens.jsonl must match the manifest's checksum
      tlog::info("{} is already complete (same inputs, tokenizer, template and options); nothing to do",
                 opt.out.string());
      rep.status = PrepareStatus::AlreadyComplete;
      rep.out = opt.out;
      const json counts = m.value("counts", json::object());
      if (counts.is_object() && counts.contains("records") && counts["records"].is_number_integer())
        rep.records = counts["records"].get<int64_t>();
      if (counts.is_object() && counts.contains("samples") && counts["samples"].is_number_integer())
        rep.samples = counts["samples"].get<int64_t>();
      return rep;
    }
    std::vector<fs::path> leftovers;
    for (auto& e : fs::directory_iterator(opt.out)) {
      const std::string n = e.path().filename().string();
      const size_t t = n.find(".tmp-");
      if (t != std::string::npos && (n.rfind("tokens.jsonl", 0) == 0 || n.rfind("manifest.json", 0) == 0)) {
        const long pid = std::strtol(n.c_str() + t + 5, nullptr, 10);
        if (pid > 0 && pid != long(::getpid()) && (::kill(pid_t(pid), 0) == 0 || errno == EPERM))
          fail("{}: {} belongs to process {}, which is still running (another prepare on this --out?)", opt.out.string(),
               n, pid);
        leftovers.push_back(e.path());
      } else if (n == "tokens.jsonl") {
        leftovers.push_back(e.path());
      } else {
        fail("{}: directory is not empty (holds {}); delete it or use another --out", opt.out.string(), n);
      }
    }
    if (!leftovers.empty())
      tlog::warn("{}: removing {} file(s) of an interrupted prepare (no manifest.json); starting over", opt.out.string(),
                 leftovers.size());
    for (auto& f : leftovers) fs::remove(f);
  } else {
    fs::create_directories(opt.out);
    guard.created = true;
  }

  int64_t total = 0;
  for (auto& f : files) total += RecordReader::count(f);
  tlog::info("{} input file(s), {} records", files.size(), total);

  const int nthreads = opt.threads > 0 ? opt.threads : omp_get_max_threads();
  Ctx ctx{tok.get(), tpl.get(), &bytes, kwargs, opt.max_length, opt.prompts == "keep"};
  const bool skip_errors = opt.on_error == "skip";
  constexpr size_t kListCap = 50;
  struct Reason {
    int64_t count = 0;
    json examples = json::array();
  };
  std::map<std::string, Reason> skipped;
  json inputs = json::array();

  AtomicFile out_file(opt.out / "tokens.jsonl");
  Sha256 out_sha;
  int64_t out_bytes = 0;
  Progress progress("prepare", total, "records");
  std::string buf;
  bool stopped = false;

  for (const fs::path& file : files) {
    if (stopped) break;
    RecordReader reader(file);
    std::map<std::string, int64_t> f_formats;
    int64_t f_records = 0, f_samples = 0, f_skipped = 0;
    std::vector<Job> jobs;
    bool eof = false;
    while (!eof) {
      if (stop_requested()) {
        stopped = true;
        break;
      }
      jobs.clear();
      RecordReader::Item it;
      while (jobs.size() < size_t(opt.batch_records)) {
        bool got;
        try {
          got = reader.next(it);
        } catch (const RecordError& e) {
          fail("{}: {} ({}); the rest of the file cannot be read", file.string(), e.what(), e.reason);
        }
        if (!got) {
          eof = true;
          break;
        }
        jobs.push_back(Job{it.line, std::move(it.text)});
      }
      std::vector<std::vector<Result>> results(jobs.size());
#pragma omp parallel for schedule(dynamic, 4) num_threads(nthreads)
      for (size_t i = 0; i < jobs.size(); ++i) results[i] = process_job(ctx, jobs[i], forced);

      for (size_t i = 0; i < jobs.size(); ++i) {
        ++f_records;
        const std::string where = fmt::format("{}:{}", file.string(), jobs[i].line);
        for (Result& r : results[i]) {
          if (r.format != ChatFormat::Auto) f_formats[chat_format_name(r.format)]++;
          if (r.id.empty()) r.id = fmt::format("{}:{}", file.filename().string(), jobs[i].line);
          if (!r.reason.empty()) {
            if (!r.policy && !skip_errors)
              fail("{}: {} (id {}) [{}]; --on-error skip skips such records and lists them in the manifest", where,
                   r.message, r.id, r.reason);
            Reason& s = skipped[r.reason];
            ++s.count;
            if (s.examples.size() < kListCap) s.examples.push_back(fmt::format("{} ({}): {}", r.id, where, r.message));
            ++f_skipped;
            ++rep.skipped;
            continue;
          }
          int64_t masked = 0;
          for (uint8_t m : r.mask) masked += m;
          buf.clear();
          buf += "{\"id\": " + json_str(r.id) + ", \"source\": " + json_str(where) + ", \"input_ids\": [";
          for (size_t k = 0; k < r.ids.size(); ++k) {
            if (k) buf += ", ";
            buf += std::to_string(r.ids[k]);
          }
          buf += "], \"loss_mask\": [";
          for (size_t k = 0; k < r.mask.size(); ++k) {
            if (k) buf += ", ";
            buf.push_back(char('0' + r.mask[k]));
          }
          buf += "]";
          if (r.prompt) {
            buf += ", \"prompt\": true";
            if (!r.later_turns.empty()) buf += ", \"later_turns\": " + json(r.later_turns).dump(-1, ' ', false, json::error_handler_t::replace);
          }
          if (r.truncated) buf += ", \"truncated\": true";
          buf += "}\n";
          out_file.write(buf);
          out_sha.update(buf.data(), buf.size());
          out_bytes += int64_t(buf.size());
          ++rep.samples;
          ++f_samples;
          rep.tokens += int64_t(r.ids.size());
          rep.masked_tokens += masked;
          rep.truncated += r.truncated;
          rep.prompts += r.prompt;
        }
      }
      rep.records += int64_t(jobs.size());
      progress.advance(int64_t(jobs.size()));
    }
    inputs.push_back({{"path", file.string()},
                      {"sha256", sha256_file_hex(file)},
                      {"formats", f_formats},
                      {"records", f_records},
                      {"samples", f_samples},
                      {"skipped", f_skipped}});
  }
  rep.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (stopped) {
    tlog::warn("prepare stopped by signal after {} records; nothing was written", rep.records);
    rep.status = PrepareStatus::Interrupted;
    return rep;  // out_file is not committed: its temp file goes, and the guard removes the directory
  }
  progress.finish();
  TALON_CHECK(rep.samples > 0, "prepare: no samples from {} records ({} skipped); nothing written", rep.records,
              rep.skipped);

  json skipped_j = json::object();
  for (auto& [k, v] : skipped) skipped_j[k] = {{"count", v.count}, {"examples", v.examples}, {"examples_cap", kListCap}};
  json manifest = {
      {"format", "talon.tokens"},
      {"format_version", 1},
      {"tokens_file", "tokens.jsonl"},
      {"tokens_sha256", out_sha.hex()},
      {"tokens_bytes", out_bytes},
      {"tokenizer",
       {{"source", tok_path.string()},
        {"kind", tok->kind()},
        {"vocab_size", tok->vocab_size()},
        {"bos_id", tok->bos_id() ? json(*tok->bos_id()) : json()},
        {"eos_id", tok->eos_id() ? json(*tok->eos_id()) : json()}}},
      {"chat_template",
       {{"source", tpl->name()}, {"sha256", tpl_sha}, {"builtin_fallback", ct.fallback}, {"kwargs", json::parse(kwargs.dump())}}},
      {"options",
       {{"format", opt.format}, {"max_length", opt.max_length}, {"on_error", opt.on_error}, {"prompts", opt.prompts}}},
      {"loss_mask_rule",
       "1 on the tokens overlapping an assistant turn's span: from the end of the generation prompt (header) "
       "through the end-of-turn token; separators (whitespace) after the end-of-turn token are not included"},
      {"inputs", inputs},
      {"counts",
       {{"records", rep.records},
        {"samples", rep.samples},
        {"tokens", rep.tokens},
        {"masked_tokens", rep.masked_tokens},
        {"truncated", rep.truncated},
        {"prompts", rep.prompts},
        {"skipped", rep.skipped},
        {"skipped_by_reason", skipped_j}}},
      {"talon_version", TALON_VERSION}};
  out_file.commit();
  write_file_atomic(opt.out / "manifest.json", manifest.dump(2) + "\n");
  guard.committed = true;
  rep.out = opt.out;
  rep.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return rep;
}

}  // namespace talon
