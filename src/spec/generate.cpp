#include "spec/generate.h"

#include <omp.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>
#include <set>

#include "backend/backend.h"
#include "data/chat_formats.h"
#include "data/prepare.h"
#include "model/checkpoint.h"
#include "model/decode.h"
#include "util/error.h"
#include "util/log.h"
#include "util/progress.h"
#include "util/runs.h"
#include "util/signals.h"

namespace talon::spec {

using json = nlohmann::json;

namespace {

using Clock = std::chrono::steady_clock;
constexpr const char* kJournal = "progress.jsonl";
constexpr const char* kOutput = "generated.jsonl";
constexpr const char* kManifest = "manifest.json";
constexpr const char* kJob = "job.json";

// One conversation to regenerate: messages to append before each generated turn.
struct Conv {
  int64_t index = 0;
  std::string id, source;
  ojson head = ojson::array();              // messages before the first segment (none today)
  std::vector<std::vector<ojson>> segments;  // each followed by one generated assistant turn
};

// The job's identity: a rerun must be the same job to continue a directory.
json job_identity(const GenerateOptions& o, const std::vector<fs::path>& files, const std::string& model_hash,
                  const std::string& tpl_sha, const ojson& kwargs) {
  json inputs = json::array();
  for (const auto& f : files) inputs.push_back({{"path", f.string()}, {"sha256", sha256_file_hex(f)}});
  return {{"format", "talon.generate.job"},
          {"inputs", inputs},
          {"model_config_sha256", model_hash},
          {"chat_template_sha256", tpl_sha},
          {"template_kwargs", json::parse(kwargs.dump())},
          {"data_format", o.format},
          {"temperature", o.sampling.temperature},
          {"top_p", o.sampling.top_p},
          {"top_k", o.sampling.top_k},
          {"seed", o.sampling.seed},
          {"max_new_tokens", o.max_new_tokens},
          {"max_len", o.max_len},
          {"stop", o.stop},
          {"limit", o.limit}};
}

// Journal of finished conversations: one JSON line each. A line cut short by a kill is
// dropped (and truncated away) on resume.
std::map<int64_t, std::string> read_journal(const fs::path& p, int64_t n_convs) {
  std::map<int64_t, std::string> done;
  if (!fs::exists(p)) return done;
  const std::string text = read_text_file(p);
  size_t pos = 0, good_end = 0;
  int64_t line_no = 0;
  while (pos < text.size()) {
    const size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) break;  // an unfinished last line
    ++line_no;
    const std::string line = text.substr(pos, nl - pos);
    const json j = json::parse(line, nullptr, false);
    TALON_CHECK(j.is_object() && j.contains("index") && j["index"].is_number_integer() && j.contains("messages"),
                "{}:{}: not a journal line of this generate run (delete the directory to start over)", p.string(),
                line_no);
    const int64_t idx = j["index"].get<int64_t>();
    TALON_CHECK(idx >= 0 && idx < n_convs, "{}:{}: conversation index {} outside [0, {})", p.string(), line_no, idx,
                n_convs);
    done[idx] = line;  // a conversation journaled twice (cannot happen) keeps its last line
    pos = good_end = nl + 1;
  }
  if (good_end < text.size()) {
    tlog::warn("{}: dropping an unfinished last line ({} bytes) left by an interrupted run", p.string(),
               text.size() - good_end);
    fs::resize_file(p, good_end);
  }
  return done;
}

class Journal {
 public:
  explicit Journal(const fs::path& p) : path_(p) {
    fd_ = ::open(p.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    TALON_CHECK(fd_ >= 0, "{}: cannot open for appending", p.string());
  }
  ~Journal() {
    if (fd_ >= 0) {
      ::fsync(fd_);
      ::close(fd_);
    }
  }
  void append(const std::string& line) {
    const std::string s = line + "\n";
    size_t off = 0;
    while (off < s.size()) {
      const ssize_t w = ::write(fd_, s.data() + off, s.size() - off);
      if (w < 0 && errno == EINTR) continue;
      TALON_CHECK(w > 0, "{}: write failed ({}); finished conversations are kept, rerun to continue", path_.string(),
                  std::strerror(errno));
      off += size_t(w);
    }
    dirty_ = true;
  }
  void sync() {
    if (dirty_) TALON_CHECK(::fsync(fd_) == 0, "{}: fsync failed ({})", path_.string(), std::strerror(errno));
    dirty_ = false;
  }

 private:
  fs::path path_;
  int fd_ = -1;
  bool dirty_ = false;
};

}  // namespace

std::vector<std::vector<ojson>> turn_segments(const Conversation& c, int64_t* leading_assistant_dropped) {
  std::vector<std::vector<ojson>> segs;
  int64_t dropped = 0;
  std::vector<ojson> cur;
  bool user_seen = false, cur_has_user = false;
  for (const auto& m : c.messages) {
    const std::string role = m.value("role", "");
    if (role == "assistant") {
      if (!user_seen) {
        ++dropped;
      } else if (cur_has_user) {
        segs.push_back(std::move(cur));
        cur.clear();
        cur_has_user = false;
      }
      continue;
    }
    ojson msg = {{"role", role}, {"content", m.contains("content") ? m["content"] : ojson("")}};
    if (role == "user") user_seen = cur_has_user = true;
    cur.push_back(std::move(msg));
  }
  if (cur_has_user) segs.push_back(std::move(cur));
  for (const auto& t : c.later_turns) segs.push_back({ojson{{"role", "user"}, {"content", t}}});
  if (leading_assistant_dropped) *leading_assistant_dropped += dropped;
  return segs;
}

// (declared in generate.h) the tokenizer's eos, generation_config.json's eos_token_id (HF
// directories) and the end-of-turn markers of common chat formats that the vocabulary
// has as added tokens.
std::vector<int32_t> eos_ids(const text::Tokenizer& tok, const fs::path& model) {
  std::set<int32_t> ids;
  if (tok.eos_id()) ids.insert(*tok.eos_id());
  const fs::path gc = fs::is_directory(model) ? model / "generation_config.json" : fs::path();
  if (!gc.empty() && fs::exists(gc)) {
    const json j = json::parse(read_text_file(gc), nullptr, false);
    if (j.is_object() && j.contains("eos_token_id")) {
      const json& e = j["eos_token_id"];
      if (e.is_number_integer()) ids.insert(e.get<int32_t>());
      if (e.is_array())
        for (const auto& x : e)
          if (x.is_number_integer()) ids.insert(x.get<int32_t>());
    }
  }
  for (const auto& a : tok.added_tokens())
    for (const char* name : {"<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>"})
      if (a.special && a.content == name) ids.insert(a.id);
  return {ids.begin(), ids.end()};
}

GenerateReport run_generate(const GenerateOptions& opt) {
  if (opt.threads > 0) omp_set_num_threads(opt.threads);
  GenerateReport rep;
  rep.out = opt.out;
  const auto t0 = Clock::now();
  opt.sampling.validate();
  TALON_CHECK(!opt.out.empty(), "generate: --out is required");
  TALON_CHECK(opt.max_new_tokens > 0, "--max-new-tokens must be > 0 (got {})", opt.max_new_tokens);
  TALON_CHECK(opt.max_len > 1, "--max-len must be > 1 (got {})", opt.max_len);
  TALON_CHECK(opt.batch >= 0, "--batch must be >= 0 (got {})", opt.batch);
  TALON_CHECK(opt.max_prefill_tokens > 0, "--max-prefill-tokens must be > 0 (got {})", opt.max_prefill_tokens);
  TALON_CHECK(opt.kv_cache_tokens >= 0, "--kv-cache-tokens must be >= 0 (got {})", opt.kv_cache_tokens);
  const ChatFormat forced = parse_chat_format(opt.format);
  const ojson kwargs = parse_template_kwargs(opt.template_kwargs);
  const auto files = expand_inputs(opt.inputs);
  ChatTokenizer ct = load_chat_tokenizer(opt.model, opt.tokenizer, opt.chat_template, opt.fallback_template, "generate");
  const auto& tok = *ct.tok;
  const auto& tpl = *ct.tpl;
  const std::string tpl_sha = sha256_hex(tpl.source().data(), tpl.source().size());
  const DeviceSpec dev = parse_device(opt.device, opt.share_gpus);
  auto ckpt = open_checkpoint(opt.model);
  const ModelConfig& mc = ckpt->config();
  TALON_CHECK(int64_t(tok.vocab_size()) <= mc.vocab, "{}: the tokenizer has {} ids but the model's vocabulary is {}",
              ct.tokenizer_path.string(), tok.vocab_size(), mc.vocab);

  // Conversations, in input order.
  std::vector<Conv> convs;
  for (const auto& f : files) {
    RecordReader rr(f);
    RecordReader::Item it;
    while (true) {
      bool got;
      try {
        got = rr.next(it);
      } catch (const RecordError& e) {
        fail("{}: {} ({})", f.string(), e.what(), e.reason);
      }
      if (!got) break;
      const std::string where = fmt::format("{}:{}", f.string(), it.line);
      std::vector<Conversation> cs;
      try {
        const ojson rec = parse_record(it.text);
        cs = record_to_conversations(rec, forced == ChatFormat::Auto ? detect_chat_format(rec) : forced);
      } catch (const RecordError& e) {
        fail("{}: {} [{}]", where, e.what(), e.reason);
      }
      for (size_t k = 0; k < cs.size(); ++k) {
        Conv c;
        c.index = int64_t(convs.size());
        c.id = cs[k].id.empty() ? fmt::format("{}:{}", f.filename().string(), it.line) : cs[k].id;
        if (cs.size() > 1) c.id += fmt::format("#{}", k);
        c.source = where;
        c.segments = turn_segments(cs[k], &rep.leading_assistant_dropped);
        convs.push_back(std::move(c));
      }
      if (opt.limit > 0 && int64_t(convs.size()) >= opt.limit) break;
    }
    if (opt.limit > 0 && int64_t(convs.size()) >= opt.limit) break;
  }
  if (opt.limit > 0 && int64_t(convs.size()) > opt.limit) convs.resize(size_t(opt.limit));
  const int64_t n_convs = int64_t(convs.size());
  TALON_CHECK(n_convs > 0, "generate: the inputs hold no conversations");

  // Output directory: new, or this same job unfinished (continue) or finished (nothing to do).
  const json job = job_identity(opt, files, mc.hash(), tpl_sha, kwargs);
  if (fs::exists(opt.out)) {
    TALON_CHECK(fs::is_directory(opt.out), "{}: exists and is not a directory", opt.out.string());
    if (fs::exists(opt.out / kJob)) {
      const json have = json::parse(read_text_file(opt.out / kJob), nullptr, false);
      if (have != job) {
        std::vector<std::string> diffs;
        for (auto& [k, v] : job.items())
          if (!have.is_object() || !have.contains(k) || have[k] != v) diffs.push_back(k);
        fail("{}: holds a different generate job ({} differ); delete it or use another --out", opt.out.string(),
             fmt::format("{}", fmt::join(diffs, ", ")));
      }
      if (fs::exists(opt.out / kManifest) && fs::exists(opt.out / kOutput)) {
        tlog::info("{} is already complete (same job); nothing to do", opt.out.string());
        rep.status = GenerateStatus::AlreadyComplete;
        rep.conversations = n_convs;
        return rep;
      }
    } else {
      for (auto& e : fs::directory_iterator(opt.out))
        fail("{}: directory is not empty (holds {}) and is not a generate run; delete it or use another --out",
             opt.out.string(), e.path().filename().string());
    }
  }
  // The decoder comes up before anything is written, so a start that fails (no GPU, out of
  // memory) leaves no directory or job file behind to trip the next attempt.
  const std::vector<int32_t> eos = eos_ids(tok, opt.model);
  TALON_CHECK(!eos.empty(), "generate: the tokenizer names no end-of-sequence token; generation could not stop");
  const int batch = opt.batch > 0 ? opt.batch : (dev.cuda ? 256 : 8);
  std::unique_ptr<Decoder> dec = make_decoder(*ckpt, dev, opt.tp, opt.ep, opt.share_gpus, batch, opt.max_len, opt.kv_cache_tokens);
  rep.cache_tokens = dec->cache_capacity();

  fs::create_directories(opt.out);
  DirLock lock(opt.out, run_record("generate", dev.cuda ? dev.devices : std::vector<int>{}));
  remove_stale_temps(opt.out, {kOutput, kManifest, kJob});
  if (!fs::exists(opt.out / kJob)) write_file_atomic(opt.out / kJob, job.dump(2) + "\n");
  std::map<int64_t, std::string> done = read_journal(opt.out / kJournal, n_convs);
  rep.resumed = int64_t(done.size());
  if (rep.resumed) tlog::info("{}: {} of {} conversations already generated; continuing", opt.out.string(), rep.resumed, n_convs);

  tlog::info("generate: {} conversations ({} to do) with {} on {}, {} slots x {} tokens sharing a {}-token KV cache, "
             "eos ids [{}], {}",
             n_convs, n_convs - rep.resumed, opt.model.string(), dec->backend(), batch, opt.max_len,
             dec->cache_capacity(), fmt::join(eos, ", "),
             opt.sampling.greedy() ? std::string("greedy")
                                   : fmt::format("T={} top_p={} top_k={} seed={}", opt.sampling.temperature,
                                                 opt.sampling.top_p, opt.sampling.top_k, opt.sampling.seed));

  // Work: (conversation, segment) turns; a conversation's next turn is queued first.
  struct ConvRun {
    ojson messages = ojson::array();
    size_t seg = 0;
  };
  std::vector<ConvRun> runs(convs.size());
  std::deque<int64_t> queue;
  for (const auto& c : convs) {
    if (done.count(c.index)) continue;
    if (c.segments.empty()) {
      ++rep.skipped;
      tlog::warn("{} (id {}): no user turn to answer; skipped", c.source, c.id);
      done[c.index] = json{{"index", c.index}, {"id", c.id}, {"source", c.source}, {"skipped", "no_user_turn"},
                           {"messages", json::array()}}
                          .dump();
      continue;
    }
    queue.push_back(c.index);
  }
  struct Active {
    int64_t conv = -1;
    std::vector<int32_t> prompt, gen;
    bool prefilled = false;
    int64_t fed = 0;  // prompt tokens already in the cache (a long prompt goes in chunks)
    int64_t max_new = 0;
    uint64_t stream = 0;
  };
  std::vector<Active> slots(static_cast<size_t>(batch));
  Journal journal(opt.out / kJournal);
  Progress progress("generate", n_convs, "conversations", int64_t(done.size()));
  auto last_sync = Clock::now();
  std::vector<double> uniforms;
  std::vector<int32_t> picked;
  int64_t finished_convs = 0;

  auto finish_conv = [&](int64_t ci, const char* skipped) {
    json line = {{"index", ci}, {"id", convs[size_t(ci)].id}, {"source", convs[size_t(ci)].source}};
    if (skipped) line["skipped"] = skipped;
    line["messages"] = json::parse(runs[size_t(ci)].messages.dump());
    const std::string text = line.dump(-1, ' ', false, json::error_handler_t::replace);
    journal.append(text);
    done[ci] = text;
    ++finished_convs;
    progress.advance(1);
  };
  // The next turn of conversation ci, rendered and tokenized: its prompt, or nothing when the
  // conversation ends there (its prompt no longer fits under --max-len).
  struct Staged {
    int64_t conv = -1;
    std::vector<int32_t> prompt;
  };
  auto prepare_turn = [&](int64_t ci) -> std::optional<Staged> {
    ConvRun& r = runs[size_t(ci)];
    const Conv& c = convs[size_t(ci)];
    for (const auto& m : c.segments[r.seg]) r.messages.push_back(m);
    const std::string text = tpl.render(r.messages, true, kwargs);
    std::vector<int32_t> ids = tok.encode(text, false);
    if (int64_t(ids.size()) + 1 >= opt.max_len) {
      ++rep.truncated_turns;
      tlog::warn("{} (id {}): turn {} has a {}-token prompt, no room under --max-len {}; the conversation ends "
                 "before it",
                 c.source, c.id, r.seg + 1, ids.size(), opt.max_len);
      for (size_t k = 0; k < c.segments[r.seg].size(); ++k) r.messages.erase(r.messages.size() - 1);
      if (r.seg == 0) {
        ++rep.skipped;
        finish_conv(ci, "prompt_too_long");
      } else {
        finish_conv(ci, nullptr);
      }
      return std::nullopt;
    }
    return Staged{ci, std::move(ids)};
  };
  // A turn's answer budget, and the cache rows it holds at most: its prompt and every answer
  // token but the last are fed (in whole pages).
  auto max_new_of = [&](const std::vector<int32_t>& prompt) {
    return std::min<int64_t>(opt.max_new_tokens, opt.max_len - int64_t(prompt.size()));
  };
  auto turn_rows = [&](const std::vector<int32_t>& prompt) {
    return dec->cache_rows(int64_t(prompt.size()) + max_new_of(prompt));
  };
  // Starts a prepared turn in the free slot s (empty: a slot is reset when its turn ends).
  auto start_turn = [&](int s, Staged&& t) {
    const int64_t ci = t.conv;
    Active& a = slots[size_t(s)];
    a.conv = ci;
    a.prompt = std::move(t.prompt);
    a.gen.clear();
    a.prefilled = false;
    a.fed = 0;
    a.max_new = max_new_of(a.prompt);
    a.stream = uint64_t(ci) * 4096 + uint64_t(runs[size_t(ci)].seg);
    rep.prompt_tokens += int64_t(a.prompt.size());
  };
  // The answer text: special tokens and the eos dropped, cut at the first stop string.
  auto answer_text = [&](const std::vector<int32_t>& gen) {
    std::vector<int32_t> ids = gen;
    if (!ids.empty() && std::find(eos.begin(), eos.end(), ids.back()) != eos.end()) ids.pop_back();
    std::string text = tok.decode(ids, true);
    for (const auto& st : opt.stop) {
      const size_t p = text.find(st);
      if (p != std::string::npos) text.resize(p);
    }
    return text;
  };
  auto hit_stop = [&](const std::vector<int32_t>& gen) {
    if (opt.stop.empty()) return false;
    // Only the tail can hold a new stop string: decode the last few tokens.
    const size_t n = std::min<size_t>(gen.size(), 16);
    const std::string tail = tok.decode(std::vector<int32_t>(gen.end() - std::ptrdiff_t(n), gen.end()), true);
    for (const auto& st : opt.stop)
      if (tail.find(st) != std::string::npos) return true;
    return false;
  };

  std::optional<Staged> staged;  // the queue's head turn, prepared, waiting for a slot or cache room
  bool stopped = false;
  while (true) {
    if (stop_requested()) {
      stopped = true;
      break;
    }
    // Fill free slots, in queue order, while the cache can hold each new turn whole beside
    // the running ones (the next turn waits at the head of the queue until it can).
    int64_t running = 0, reserved = 0;  // running turns, and the cache rows held for them
    for (const Active& a : slots)
      if (a.conv >= 0) ++running, reserved += turn_rows(a.prompt);
    for (int s = 0; s < batch; ++s) {
      if (slots[size_t(s)].conv >= 0) continue;
      while (!staged && !queue.empty()) {
        const int64_t ci = queue.front();
        queue.pop_front();
        staged = prepare_turn(ci);
      }
      if (!staged) break;
      if (reserved + turn_rows(staged->prompt) > dec->cache_capacity()) {
        TALON_CHECK(running > 0, "generate: a {}-token turn does not fit the {}-token KV cache alone (internal error)",
                    turn_rows(staged->prompt), dec->cache_capacity());
        ++rep.waits_for_cache;
        break;
      }
      reserved += turn_rows(staged->prompt);
      start_turn(s, std::move(*staged));
      staged.reset();
      ++running;
    }
    rep.peak_running = std::max(rep.peak_running, running);
    // One forward: a decode step of every running slot, and prompt tokens of new ones up to
    // the prefill budget: a prompt longer than what is left of it goes in chunks over the
    // next forwards, beside the decode steps (which never wait for a whole long prompt).
    std::vector<DecodeRequest> reqs;
    std::vector<int> req_slot;
    std::vector<uint8_t> produces;  // the request's last row gives the slot's next token
    int64_t budget = opt.max_prefill_tokens;
    for (int s = 0; s < batch; ++s) {
      Active& a = slots[size_t(s)];
      if (a.conv < 0) continue;
      if (!a.prefilled) {
        const int64_t take = std::min<int64_t>(int64_t(a.prompt.size()) - a.fed, budget);
        if (take <= 0) continue;
        budget -= take;
        reqs.push_back({s, std::vector<int32_t>(a.prompt.begin() + a.fed, a.prompt.begin() + a.fed + take), {}, false});
        produces.push_back(a.fed + take == int64_t(a.prompt.size()));
      } else {
        reqs.push_back({s, {a.gen.back()}, {}, true});
        produces.push_back(1);
      }
      req_slot.push_back(s);
    }
    if (reqs.empty()) break;  // nothing running and nothing queued
    picked.resize(reqs.size());
    const int64_t n_reqs = int64_t(reqs.size());
    if (opt.sampling.greedy()) {
      // Greedy: the decoder picks each slot's argmax where the logits are.
      dec->forward_greedy(reqs, Capture{}, picked.data());
    } else {
      // Each row's uniform number comes from its sequence's stream and position, so a
      // sequence draws the same tokens alone or among hundreds; the decoder samples where
      // the logits are (on the device for the CUDA decoder) and only ids come back.
      uniforms.assign(reqs.size(), 0.0);
      for (int64_t i = 0; i < n_reqs; ++i) {
        if (!produces[size_t(i)]) continue;  // a prompt chunk: no token yet
        const Active& a = slots[size_t(req_slot[size_t(i)])];
        uniforms[size_t(i)] = uniform01(opt.sampling.seed, a.stream, uint64_t(a.gen.size()));
      }
      dec->forward_sample(reqs, Capture{}, opt.sampling, uniforms.data(), picked.data());
    }
    int64_t produced = 0;
    for (size_t i = 0; i < reqs.size(); ++i) {
      const int s = req_slot[i];
      Active& a = slots[size_t(s)];
      dec->commit_all(s);
      if (!a.prefilled) {
        a.fed += int64_t(reqs[i].tokens.size());
        if (!produces[i]) continue;
        a.prefilled = true;
      }
      const int32_t t = picked[i];
      a.gen.push_back(t);
      ++produced;
      const bool end = std::find(eos.begin(), eos.end(), t) != eos.end() || int64_t(a.gen.size()) >= a.max_new ||
                       dec->length(s) + 1 >= dec->max_len() || hit_stop(a.gen);
      if (!end) continue;
      const int64_t ci = a.conv;
      ConvRun& r = runs[size_t(ci)];
      r.messages.push_back(ojson{{"role", "assistant"}, {"content", answer_text(a.gen)}});
      ++rep.turns;
      a.conv = -1;
      dec->reset(s);  // its pages go back to the cache now, not when the slot is reused
      if (++r.seg < convs[size_t(ci)].segments.size()) {
        queue.push_front(ci);
      } else {
        finish_conv(ci, nullptr);
      }
    }
    rep.new_tokens += produced;
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    progress.set_note(fmt::format("{:.0f} tok/s, {} running", double(rep.new_tokens) / std::max(secs, 1e-9),
                                  reqs.size()));
    if (std::chrono::duration<double>(Clock::now() - last_sync).count() >= opt.flush_seconds) {
      journal.sync();
      last_sync = Clock::now();
    }
  }
  journal.sync();
  rep.conversations = n_convs;
  rep.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  rep.tokens_per_second = double(rep.new_tokens) / std::max(rep.seconds, 1e-9);
  if (stopped) {
    progress.finish();
    tlog::warn("generate: stopped by signal {}; {} of {} conversations are kept in {}", stop_signal(), done.size(),
               n_convs, (opt.out / kJournal).string());
    rep.status = GenerateStatus::Interrupted;
    return rep;
  }
  progress.finish();
  TALON_CHECK(int64_t(done.size()) == n_convs, "generate: {} of {} conversations finished (internal error)",
              done.size(), n_convs);

  // generated.jsonl in input order (skipped conversations are listed in the manifest only).
  AtomicFile out(opt.out / kOutput);
  int64_t written = 0, skipped_total = 0;
  json skipped = json::array();
  for (const auto& [idx, line] : done) {
    json j = json::parse(line);
    if (j.contains("skipped")) {
      ++skipped_total;
      if (skipped.size() < 50) skipped.push_back({{"id", j["id"]}, {"source", j["source"]}, {"reason", j["skipped"]}});
      continue;
    }
    j.erase("index");
    out.write(j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n");
    ++written;
  }
  out.commit();
  json manifest = {{"format", "talon.generate"},
                   {"output", kOutput},
                   {"output_sha256", sha256_file_hex(opt.out / kOutput)},
                   {"job", job},
                   {"eos_ids", eos},
                   {"backend", dec->backend()},
                   {"counts",
                    {{"conversations", n_convs},
                     {"written", written},
                     {"skipped", skipped_total},
                     {"skipped_examples", skipped},
                     {"leading_assistant_turns_dropped", rep.leading_assistant_dropped},
                     {"turns_cut_by_max_len", rep.truncated_turns}}},
                   {"kv_cache", {{"tokens", rep.cache_tokens}, {"page_tokens", dec->page_rows()},
                                 {"slots", batch}, {"peak_running", rep.peak_running},
                                 {"forwards_with_a_turn_waiting_for_room", rep.waits_for_cache}}},
                   {"this_run", {{"turns", rep.turns}, {"new_tokens", rep.new_tokens}, {"seconds", rep.seconds},
                                 {"tokens_per_second", rep.tokens_per_second}}}};
  write_file_atomic(opt.out / kManifest, manifest.dump(2) + "\n");
  rep.skipped = skipped_total;
  tlog::info("generate: {} conversations written to {} ({} skipped); this run {} turns, {} tokens in {} ({:.0f} tok/s)",
             written, (opt.out / kOutput).string(), skipped_total, rep.turns, rep.new_tokens,
             format_duration(rep.seconds), rep.tokens_per_second);
  return rep;
}

}  // namespace talon::spec
