// Evaluator for the Jinja subset: scopes, statements, expressions, filters, tests and
// the Python methods templates call on str / dict values (ImmutableSandboxedEnvironment rules).
#include <algorithm>
#include <charconv>
#include <cmath>
#include <unordered_map>

#include "text/jinja_internal.h"
#include "text/jinja_util.h"

namespace talon::text::jinja {

namespace {

// An error without a location yet; the innermost statement adds template name + line.
struct JErr : std::runtime_error {
  using std::runtime_error::runtime_error;
};
[[noreturn]] void jfail(const std::string& m) { throw JErr(m); }

// Strings that filters and methods build are bounded (the render's output has its own,
// configurable bound): a hostile template cannot make one allocation run away.
constexpr size_t kMaxBuilt = size_t(256) << 20;
void built(size_t n) {
  if (n > kMaxBuilt) jfail(fmt::format("a string of more than {} bytes would be built", kMaxBuilt));
}

// Operating on an undefined value fails with its hint (Jinja's UndefinedError).
[[noreturn]] void undefined_fail(const Value& v) {
  jfail(v.hint().empty() ? std::string("value is undefined") : v.hint());
}

// Non-empty and only ASCII digits.
bool all_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

std::string obj_type_repr(const Value& v) {
  if (v.is_none()) return "None";
  return v.type_name() + " object";
}

// Jinja's undefined for obj[key] where obj has no such element; key as Python prints it.
// Lists and strings name their type bare, everything else quoted (as Jinja's messages do).
Value no_element(const Value& obj, const std::string& key) {
  if (obj.is_list() || obj.is_string())
    return Value::undefined(fmt::format("{} has no element {}", obj_type_repr(obj), key));
  return Value::undefined(fmt::format("'{}' has no element {}", obj_type_repr(obj), key));
}

Value missing_attr(const Value& obj, const std::string& name) {
  return Value::undefined(fmt::format("'{}' has no attribute '{}'", obj_type_repr(obj), name));
}

// ---------------------------------------------------------------- string helpers
// Simple case mapping: ASCII, Latin-1, Latin Extended-A, Greek, Cyrillic (no multi-char
// mappings such as German sharp s -> "SS").
uint32_t cp_upper(uint32_t c) {
  if (c < 128) return uint32_t(std::toupper(int(c)));
  if (c >= 0xe0 && c <= 0xfe && c != 0xf7) return c - 0x20;
  if (c == 0xff) return 0x178;
  if (c >= 0x100 && c <= 0x17f && c != 0x130 && c != 0x131 && c != 0x138 && c != 0x149 && c != 0x17f) {
    bool odd_lower = (c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17e);
    if (odd_lower ? (c % 2 == 0) : (c % 2 == 1)) return c - 1;
    return c;
  }
  if (c >= 0x3b1 && c <= 0x3c9 && c != 0x3c2) return c - 0x20;
  if (c == 0x3c2) return 0x3a3;
  if (c >= 0x430 && c <= 0x44f) return c - 0x20;
  if (c >= 0x450 && c <= 0x45f) return c - 0x50;
  return c;
}
uint32_t cp_lower(uint32_t c) {
  if (c < 128) return uint32_t(std::tolower(int(c)));
  if (c >= 0xc0 && c <= 0xde && c != 0xd7) return c + 0x20;
  if (c == 0x178) return 0xff;
  if (c >= 0x100 && c <= 0x17f && c != 0x130 && c != 0x131 && c != 0x138 && c != 0x149 && c != 0x17f) {
    bool odd_lower = (c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17e);
    if (odd_lower ? (c % 2 == 1) : (c % 2 == 0)) return c + 1;
    return c;
  }
  if (c >= 0x391 && c <= 0x3a9 && c != 0x3a2) return c + 0x20;
  if (c >= 0x410 && c <= 0x42f) return c + 0x20;
  if (c >= 0x400 && c <= 0x40f) return c + 0x50;
  return c;
}
bool is_cased(uint32_t c) { return cp_upper(c) != c || cp_lower(c) != c; }
std::string map_case(const std::string& s, bool upper) {
  bool ascii = std::all_of(s.begin(), s.end(), [](char c) { return (static_cast<unsigned char>(c) & 0x80) == 0; });
  if (ascii) {
    std::string o = s;
    for (auto& c : o) c = char(upper ? std::toupper(static_cast<unsigned char>(c)) : std::tolower(static_cast<unsigned char>(c)));
    return o;
  }
  auto cps = utf8_decode(s);
  for (auto& c : cps) c = upper ? cp_upper(c) : cp_lower(c);
  return utf8_encode(cps, 0, cps.size());
}
std::string ascii_upper(const std::string& s) { return map_case(s, true); }
std::string ascii_lower(const std::string& s) { return map_case(s, false); }

std::string py_title(const std::string& s) {
  auto cps = utf8_decode(s);
  bool prev = false;
  for (auto& c : cps) {
    if (is_cased(c)) {
      c = prev ? cp_lower(c) : cp_upper(c);
      prev = true;
    } else {
      prev = false;
    }
  }
  return utf8_encode(cps, 0, cps.size());
}
std::string py_capitalize(const std::string& s) {
  auto cps = utf8_decode(s);
  for (size_t i = 0; i < cps.size(); ++i) cps[i] = i == 0 ? cp_upper(cps[i]) : cp_lower(cps[i]);
  return utf8_encode(cps, 0, cps.size());
}

std::string py_strip(const std::string& s, const Value* chars, bool left, bool right) {
  auto cps = utf8_decode(s);
  std::vector<uint32_t> set;
  bool ws = !chars || chars->is_none() || chars->is_undefined();
  if (!ws) {
    if (!chars->is_string()) jfail("strip arg must be None or str");
    set = utf8_decode(chars->str());
  }
  auto strip_it = [&](uint32_t c) { return ws ? py_isspace(c) : std::find(set.begin(), set.end(), c) != set.end(); };
  size_t b = 0, e = cps.size();
  if (left)
    while (b < e && strip_it(cps[b])) ++b;
  if (right)
    while (e > b && strip_it(cps[e - 1])) --e;
  return utf8_encode(cps, b, e);
}

std::vector<std::string> py_split(const std::string& s, const Value* sepv, int64_t maxsplit, bool from_right) {
  std::vector<std::string> out;
  bool ws = !sepv || sepv->is_none();
  if (!ws) {
    if (!sepv->is_string()) jfail("must be str or None");
    const std::string& sep = sepv->str();
    if (sep.empty()) jfail("empty separator");
    if (!from_right) {
      size_t pos = 0;
      while (maxsplit < 0 || int64_t(out.size()) < maxsplit) {
        size_t f = s.find(sep, pos);
        if (f == std::string::npos) break;
        out.push_back(s.substr(pos, f - pos));
        pos = f + sep.size();
      }
      out.push_back(s.substr(pos));
    } else {
      size_t end = s.size();
      std::vector<std::string> rev;
      while (maxsplit < 0 || int64_t(rev.size()) < maxsplit) {
        if (end < sep.size()) break;
        size_t f = s.rfind(sep, end - sep.size());
        if (f == std::string::npos) break;
        rev.push_back(s.substr(f + sep.size(), end - f - sep.size()));
        end = f;
      }
      rev.push_back(s.substr(0, end));
      out.assign(rev.rbegin(), rev.rend());
    }
    return out;
  }
  auto cps = utf8_decode(s);
  size_t n = cps.size();
  if (!from_right) {
    size_t i = 0;
    while (true) {
      while (i < n && py_isspace(cps[i])) ++i;
      if (i >= n) break;
      if (maxsplit >= 0 && int64_t(out.size()) >= maxsplit) {
        size_t e = n;
        while (e > i && py_isspace(cps[e - 1])) --e;
        out.push_back(utf8_encode(cps, i, e));
        break;
      }
      size_t j = i;
      while (j < n && !py_isspace(cps[j])) ++j;
      out.push_back(utf8_encode(cps, i, j));
      i = j;
    }
  } else {
    size_t e = n;
    std::vector<std::string> rev;
    while (true) {
      while (e > 0 && py_isspace(cps[e - 1])) --e;
      if (e == 0) break;
      if (maxsplit >= 0 && int64_t(rev.size()) >= maxsplit) {
        size_t b = 0;
        while (b < e && py_isspace(cps[b])) ++b;
        rev.push_back(utf8_encode(cps, b, e));
        break;
      }
      size_t j = e;
      while (j > 0 && !py_isspace(cps[j - 1])) --j;
      rev.push_back(utf8_encode(cps, j, e));
      e = j;
    }
    out.assign(rev.rbegin(), rev.rend());
  }
  return out;
}

std::string py_replace(const std::string& s, const std::string& old, const std::string& rep, int64_t count) {
  std::string out;
  if (old.empty()) {
    auto cps = utf8_decode(s);
    int64_t done = 0;
    for (size_t i = 0; i <= cps.size(); ++i) {
      if (count < 0 || done < count) {
        out += rep;
        built(out.size());
        ++done;
      }
      if (i < cps.size()) utf8_append(out, cps[i]);
    }
    return out;
  }
  size_t pos = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    size_t f = s.find(old, pos);
    if (f == std::string::npos) break;
    out.append(s, pos, f - pos);
    out += rep;
    built(out.size());
    pos = f + old.size();
    ++done;
  }
  out.append(s, pos, std::string::npos);
  return out;
}

std::vector<std::string> py_splitlines(const std::string& s) {
  auto cps = utf8_decode(s);
  std::vector<std::string> out;
  size_t b = 0, i = 0;
  while (i < cps.size()) {
    uint32_t c = cps[i];
    bool br = c == '\n' || c == '\r' || c == 0x0b || c == 0x0c || c == 0x1c || c == 0x1d || c == 0x1e ||
              c == 0x85 || c == 0x2028 || c == 0x2029;
    if (!br) {
      ++i;
      continue;
    }
    out.push_back(utf8_encode(cps, b, i));
    if (c == '\r' && i + 1 < cps.size() && cps[i + 1] == '\n') ++i;
    ++i;
    b = i;
  }
  if (b < cps.size()) out.push_back(utf8_encode(cps, b, cps.size()));
  return out;
}

// Python slice index normalisation.
void slice_indices(int64_t n, const Value* a, const Value* b, const Value* c, int64_t& start, int64_t& stop,
                   int64_t& step) {
  auto as_idx = [](const Value* v) -> const Value* { return (v && !v->is_none()) ? v : nullptr; };
  a = as_idx(a), b = as_idx(b), c = as_idx(c);
  for (const Value* v : {a, b, c})
    if (v && !v->is_int() && !v->is_bool()) jfail("slice indices must be integers or None");
  step = c ? c->as_int() : 1;
  if (step == 0) jfail("slice step cannot be zero");
  auto adjust = [&](const Value* v, int64_t def) {
    if (!v) return def;
    int64_t x = v->as_int();
    if (x < 0) {
      x += n;
      if (x < 0) x = step < 0 ? -1 : 0;
    } else if (x >= n) {
      x = step < 0 ? n - 1 : n;
    }
    return x;
  };
  start = adjust(a, step < 0 ? n - 1 : 0);
  stop = adjust(b, step < 0 ? -1 : n);
}

// Items of an iterable value (Python iter()).
List iterate(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::Undefined: return {};
    case Value::Kind::List: return v.items();
    case Value::Kind::Dict: {
      List l;
      for (const auto& e : v.map().entries) l.emplace_back(e.first);
      return l;
    }
    case Value::Kind::String: {
      List l;
      for (uint32_t c : utf8_decode(v.str())) {
        std::string s;
        utf8_append(s, c);
        l.emplace_back(std::move(s));
      }
      return l;
    }
    default: jfail(fmt::format("'{}' object is not iterable", v.type_name()));
  }
}

int64_t py_len(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::Undefined: return 0;
    case Value::Kind::String: return int64_t(utf8_length(v.str()));
    case Value::Kind::List: return int64_t(v.items().size());
    case Value::Kind::Dict: return int64_t(v.map().size());
    default: jfail(fmt::format("object of type '{}' has no len()", v.type_name()));
  }
}

int compare(const Value& a, const Value& b, const char* op) {
  if (a.is_undefined()) undefined_fail(a);
  if (b.is_undefined()) undefined_fail(b);
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) {
      double x = a.as_float(), y = b.as_float();
      return x < y ? -1 : x > y ? 1 : 0;
    }
    return a.as_int() < b.as_int() ? -1 : a.as_int() > b.as_int() ? 1 : 0;
  }
  if (a.is_string() && b.is_string()) {
    int c = a.str().compare(b.str());
    return c < 0 ? -1 : c > 0 ? 1 : 0;
  }
  if (a.is_list() && b.is_list()) {
    const auto &x = a.items(), &y = b.items();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (equals(x[i], y[i])) continue;
      return compare(x[i], y[i], op);
    }
    return x.size() < y.size() ? -1 : x.size() > y.size() ? 1 : 0;
  }
  jfail(fmt::format("'{}' not supported between instances of '{}' and '{}'", op, a.type_name(), b.type_name()));
}

bool contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Value::Kind::Undefined: return false;
    case Value::Kind::String:
      if (!item.is_string())
        jfail(fmt::format("'in <string>' requires string as left operand, not {}", item.type_name()));
      return container.str().find(item.str()) != std::string::npos;
    case Value::Kind::List:
      for (const auto& e : container.items())
        if (equals(e, item)) return true;
      return false;
    case Value::Kind::Dict:
      return item.is_string() && container.map().find(item.str()) != nullptr;
    default: jfail(fmt::format("argument of type '{}' is not iterable", container.type_name()));
  }
}

Value arg_or(const CallArgs& a, size_t i, std::string_view name, const Value& def) {
  const Value* v = a.get(i, name);
  return v ? *v : def;
}

Value to_int_value(const Value& v, const Value& def) {
  if (v.is_int() || v.is_bool()) return Value(v.as_int());
  if (v.is_float()) return Value(int64_t(std::trunc(v.as_float())));
  if (v.is_string()) {
    std::string s = py_strip(v.str(), nullptr, true, true);
    try {
      size_t used = 0;
      long long x = std::stoll(s, &used, 10);
      if (used == s.size()) return Value(int64_t(x));
      double d = std::stod(s, &used);
      if (used == s.size()) return Value(int64_t(std::trunc(d)));
    } catch (...) {
    }
  }
  return def;
}

// ---------------------------------------------------------------- interpreter
struct Scope {
  Scope* parent = nullptr;
  std::unordered_map<std::string, Value> vars;
  Value* find(const std::string& n) {
    for (Scope* s = this; s; s = s->parent) {
      auto it = s->vars.find(n);
      if (it != s->vars.end()) return &it->second;
    }
    return nullptr;
  }
};

enum class Flow { Normal, Break, Continue };

struct Located : talon::Error {
  using talon::Error::Error;
};

class Interp {
 public:
  Interp(const Template::Impl& t, const Dict& ctx) : t_(t), ctx_(ctx) {}

  std::string run() {
    Scope root;
    std::string out;
    exec(t_.body, root, out);
    return out;
  }

 private:
  const Template::Impl& t_;
  const Dict& ctx_;
  int depth_ = 0;

  [[noreturn]] void locate(int line, const std::string& msg) {
    throw Located(fmt::format("template '{}' line {}: {}", t_.name, line, msg));
  }

  // Sandbox bounds (Options): work, output size, nesting.
  int64_t steps_ = 0;
  int nest_ = 0;
  void step() {
    if (++steps_ > t_.opts.max_steps)
      jfail(fmt::format("the template ran more than {} steps (statements, loop iterations, calls); a loop that "
                        "does not end?", t_.opts.max_steps));
  }
  [[noreturn]] void too_big(const char* what) {
    jfail(fmt::format("{} larger than the {} byte limit of a template render", what, t_.opts.max_output));
  }
  void check_out(const std::string& out) {
    if (out.size() > t_.opts.max_output) too_big("output");
  }
  struct Nest {
    int& n;
    explicit Nest(int& c) : n(c) {
      if (++n > kMaxRenderNesting) {
        --n;
        jfail(fmt::format("template nesting deeper than {} levels while rendering (recursion?)", kMaxRenderNesting));
      }
    }
    ~Nest() { --n; }
  };
  static constexpr int kMaxRenderNesting = 1000;
  static int64_t checked(bool overflow, int64_t v) {
    if (overflow) jfail("integer overflow (talon's integers are 64-bit)");
    return v;
  }

  Flow exec(const Body& body, Scope& sc, std::string& out) {
    Nest nest(nest_);
    for (const auto& s : body) {
      step();
      Flow f;
      try {
        f = exec_stmt(*s, sc, out);
      } catch (const Located&) {
        throw;
      } catch (const TemplateRaise&) {
        throw;
      } catch (const SyntaxError&) {
        throw;
      } catch (const talon::Error& e) {
        locate(s->line, e.what());
      } catch (const JErr& e) {
        locate(s->line, e.what());
      }
      if (f != Flow::Normal) return f;
    }
    return Flow::Normal;
  }

  void assign(Scope& sc, const std::vector<std::string>& targets, const Value& v) {
    if (targets.size() == 1) {
      sc.vars[targets[0]] = v;
      return;
    }
    List items = iterate(v);
    if (items.size() != targets.size())
      jfail(fmt::format("not enough values to unpack (expected {}, got {})", targets.size(), items.size()));
    for (size_t i = 0; i < targets.size(); ++i) sc.vars[targets[i]] = items[i];
  }

  Flow exec_stmt(const Stmt& s, Scope& sc, std::string& out) {
    switch (s.k) {
      case SK::Data: out += s.text; check_out(out); return Flow::Normal;
      case SK::Print: out += eval(*s.e, sc).to_str(); check_out(out); return Flow::Normal;
      case SK::If:
        for (size_t i = 0; i < s.conds.size(); ++i)
          if (eval(*s.conds[i], sc).truthy()) return exec(s.bodies[i], sc, out);
        if (s.bodies.size() > s.conds.size()) return exec(s.bodies.back(), sc, out);
        return Flow::Normal;
      case SK::For: exec_for(s, sc, out); return Flow::Normal;
      case SK::Set: assign(sc, s.targets, eval(*s.e, sc)); return Flow::Normal;
      case SK::SetAttr: {
        Value* ns = sc.find(s.targets[0]);
        if (!ns) {
          const Value* g = ctx_.find(s.targets[0]);
          if (g && g->is_namespace()) ns = const_cast<Value*>(g);
        }
        if (!ns || !ns->is_namespace()) jfail("cannot assign attribute on non-namespace object");
        if (!s.targets[1].empty() && s.targets[1][0] == '_')
          jfail(fmt::format("Chat templates cannot store underscore-prefixed attributes on a namespace, but got "
                            "'{}'. Please rename the attribute.", s.targets[1]));
        Value v = eval(*s.e, sc);
        ns->map_mut().set(s.targets[1], std::move(v));
        return Flow::Normal;
      }
      case SK::SetBlock: {
        std::string body;
        Scope inner{&sc, {}};
        exec(s.bodies[0], inner, body);
        Value v(std::move(body));
        if (s.cond) v = apply_filters(*s.cond, std::move(v), sc);
        sc.vars[s.targets[0]] = std::move(v);
        return Flow::Normal;
      }
      case SK::FilterBlock: {
        std::string body;
        exec(s.bodies[0], sc, body);
        out += apply_filters(*s.cond, Value(std::move(body)), sc).to_str();
        check_out(out);
        return Flow::Normal;
      }
      case SK::Macro: {
        const Stmt* def = &s;
        Scope* defscope = &sc;
        sc.vars[s.text] = Value::function(
            [this, def, defscope](const CallArgs& a) { return call_macro(*def, defscope, a); }, s.text);
        return Flow::Normal;
      }
      case SK::Break: return Flow::Break;
      case SK::Continue: return Flow::Continue;
      case SK::Generation: return exec(s.bodies[0], sc, out);
    }
    return Flow::Normal;
  }

  Value call_macro(const Stmt& def, Scope* defscope, const CallArgs& a) {
    step();
    if (++depth_ > t_.opts.max_macro_depth) jfail("maximum recursion depth exceeded in macro call");
    Scope sc{defscope, {}};
    if (a.pos.size() > def.targets.size())
      jfail(fmt::format("macro '{}' takes not more than {} argument(s)", def.text, def.targets.size()));
    for (size_t i = 0; i < def.targets.size(); ++i) {
      const Value* v = a.get(i, def.targets[i]);
      if (v) sc.vars[def.targets[i]] = *v;
      else if (def.defaults[i]) sc.vars[def.targets[i]] = eval(*def.defaults[i], sc);
      else sc.vars[def.targets[i]] = Value::undefined(fmt::format("parameter '{}' was not provided", def.targets[i]));
    }
    for (const auto& [k, v] : a.kw)
      if (std::find(def.targets.begin(), def.targets.end(), k) == def.targets.end())
        jfail(fmt::format("macro '{}' takes no keyword argument '{}'", def.text, k));
    std::string out;
    exec(def.bodies[0], sc, out);
    --depth_;
    return Value(std::move(out));
  }

  void exec_for(const Stmt& s, Scope& sc, std::string& out) {
    Value seq = eval(*s.e, sc);
    List items = iterate(seq);
    if (s.cond) {
      List kept;
      for (auto& it : items) {
        Scope f{&sc, {}};
        assign(f, s.targets, it);
        if (eval(*s.cond, f).truthy()) kept.push_back(std::move(it));
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      if (s.bodies.size() > 1) exec(s.bodies[1], sc, out);
      return;
    }
    int64_t n = int64_t(items.size());
    for (int64_t i = 0; i < n; ++i) {
      step();
      Scope f{&sc, {}};
      assign(f, s.targets, items[size_t(i)]);
      Dict loop;
      loop.set("index", Value(i + 1));
      loop.set("index0", Value(i));
      loop.set("revindex", Value(n - i));
      loop.set("revindex0", Value(n - i - 1));
      loop.set("first", Value(i == 0));
      loop.set("last", Value(i == n - 1));
      loop.set("length", Value(n));
      loop.set("depth", Value(int64_t(1)));
      loop.set("depth0", Value(int64_t(0)));
      loop.set("previtem", i > 0 ? items[size_t(i - 1)] : Value::undefined("there is no previous item"));
      loop.set("nextitem", i + 1 < n ? items[size_t(i + 1)] : Value::undefined("there is no next item"));
      loop.set("cycle", Value::function(
                            [i](const CallArgs& a) -> Value {
                              if (a.pos.empty()) jfail("no items for cycling given");
                              return a.pos[size_t(i) % a.pos.size()];
                            },
                            "cycle"));
      f.vars["loop"] = Value::dict(std::move(loop));
      Flow fl = exec(s.bodies[0], f, out);
      if (fl == Flow::Break) break;
    }
  }

  Value lookup(const std::string& name, Scope& sc) {
    if (Value* v = sc.find(name)) return *v;
    if (const Value* g = ctx_.find(name)) return *g;
    Value b = builtin_global(name);
    if (!b.is_undefined()) return b;
    return Value::undefined(fmt::format("'{}' is undefined", name));
  }

  static Value builtin_global(const std::string& name) {
    if (name == "range")
      return Value::function(
          [](const CallArgs& a) -> Value {
            int64_t start = 0, stop, step = 1;
            for (const auto& v : a.pos)
              if (!v.is_int() && !v.is_bool())
                jfail(fmt::format("'{}' object cannot be interpreted as an integer", v.type_name()));
            if (a.pos.size() == 1) stop = a.pos[0].as_int();
            else if (a.pos.size() >= 2) {
              start = a.pos[0].as_int();
              stop = a.pos[1].as_int();
              if (a.pos.size() >= 3) step = a.pos[2].as_int();
            } else jfail("range expected at least 1 argument, got 0");
            if (step == 0) jfail("range() arg 3 must not be zero");
            List l;
            for (int64_t x = start; step > 0 ? x < stop : x > stop; x += step) {
              l.emplace_back(x);
              if (l.size() > 100000) jfail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
            }
            return Value::list(std::move(l));
          },
          "range");
    if (name == "namespace" || name == "dict")
      return Value::function(
          [name](const CallArgs& a) -> Value {
            Dict d;
            for (const auto& p : a.pos) {
              if (!p.is_dict()) jfail("namespace()/dict() positional argument must be a mapping");
              for (const auto& [k, v] : p.map().entries) d.set(k, v);
            }
            for (const auto& [k, v] : a.kw) d.set(k, v);
            if (name == "namespace") {
              for (const auto& [k, v] : d.entries)
                if (!k.empty() && k[0] == '_')
                  jfail(fmt::format("Chat templates cannot store underscore-prefixed attributes on a namespace, "
                                    "but got '{}'. Please rename the attribute.", k));
              return Value::namespace_(std::move(d));
            }
            return Value::dict(std::move(d));
          },
          name);
    return Value();
  }

  // ---------------------------------------------------------------- expressions
  Value eval(const Expr& e, Scope& sc) {
    Nest nest(nest_);
    switch (e.k) {
      case EK::Lit: return e.lit;
      case EK::Name: return lookup(e.name, sc);
      case EK::Attr: return get_attr(eval(*e.a[0], sc), e.name);
      case EK::Item: return get_item(eval(*e.a[0], sc), eval(*e.a[1], sc));
      case EK::Slice: {
        Value obj = eval(*e.a[0], sc);
        Value parts[3];
        for (int i = 0; i < 3; ++i)
          if (e.a[size_t(i) + 1]) parts[i] = eval(*e.a[size_t(i) + 1], sc);
        auto p = [&](int i) -> const Value* { return e.a[size_t(i) + 1] ? &parts[i] : nullptr; };
        return slice(obj, p(0), p(1), p(2));
      }
      case EK::Call: {
        Value fn = eval(*e.a[0], sc);
        CallArgs args = eval_args(e, sc);
        return call(fn, args);
      }
      case EK::Filter: {
        Value subject = eval(*e.a[0], sc);
        return apply_filter(e, std::move(subject), sc);
      }
      case EK::Test: {
        Value subject = eval(*e.a[0], sc);
        CallArgs args = eval_args(e, sc);
        bool r = apply_test(e.name, subject, args);
        return Value(e.negated ? !r : r);
      }
      case EK::Neg: {
        Value v = eval(*e.a[0], sc);
        if (v.is_float()) return Value(-v.as_float());
        if (v.is_int() || v.is_bool()) {
          if (v.as_int() == INT64_MIN) checked(true, 0);
          return Value(-v.as_int());
        }
        if (v.is_undefined()) undefined_fail(v);
        jfail(fmt::format("bad operand type for unary -: '{}'", v.type_name()));
      }
      case EK::Pos: {
        Value v = eval(*e.a[0], sc);
        if (v.is_bool()) return Value(v.as_int());
        if (v.is_number()) return v;
        if (v.is_undefined()) undefined_fail(v);
        jfail(fmt::format("bad operand type for unary +: '{}'", v.type_name()));
      }
      case EK::Not: return Value(!eval(*e.a[0], sc).truthy());
      case EK::And: {
        Value l = eval(*e.a[0], sc);
        return l.truthy() ? eval(*e.a[1], sc) : l;
      }
      case EK::Or: {
        Value l = eval(*e.a[0], sc);
        return l.truthy() ? l : eval(*e.a[1], sc);
      }
      case EK::Bin: return binop(e.name, eval(*e.a[0], sc), eval(*e.a[1], sc));
      case EK::Cmp: {
        Value l = eval(*e.a[0], sc);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value r = eval(*e.a[i + 1], sc);
          const std::string& op = e.ops[i];
          bool ok;
          if (op == "==") ok = equals(l, r);
          else if (op == "!=") ok = !equals(l, r);
          else if (op == "in") ok = contains(r, l);
          else if (op == "notin") ok = !contains(r, l);
          else {
            int c = compare(l, r, op.c_str());
            ok = op == "<" ? c < 0 : op == "<=" ? c <= 0 : op == ">" ? c > 0 : c >= 0;
          }
          if (!ok) return Value(false);
          l = std::move(r);
        }
        return Value(true);
      }
      case EK::Cond:
        if (eval(*e.a[0], sc).truthy()) return eval(*e.a[1], sc);
        if (e.a[2]) return eval(*e.a[2], sc);
        return Value::undefined(fmt::format(
            "the inline if-expression on line {} evaluated to false and no else section was defined.", e.line));
      case EK::ListLit:
      case EK::TupleLit: {
        List l;
        for (const auto& x : e.a) l.push_back(eval(*x, sc));
        return Value::list(std::move(l), e.k == EK::TupleLit);
      }
      case EK::DictLit: {
        Dict d;
        for (size_t i = 0; i + 1 < e.a.size(); i += 2) {
          Value k = eval(*e.a[i], sc);
          if (!k.is_string()) jfail("talon's Jinja subset only supports string dict keys");
          d.set(k.str(), eval(*e.a[i + 1], sc));
        }
        return Value::dict(std::move(d));
      }
    }
    jfail("bad expression");
  }

  CallArgs eval_args(const Expr& e, Scope& sc) {
    CallArgs a;
    for (size_t i = 1; i < e.a.size(); ++i) a.pos.push_back(eval(*e.a[i], sc));
    for (const auto& [k, v] : e.kw) a.kw.emplace_back(k, eval(*v, sc));
    return a;
  }

  Value call(const Value& fn, const CallArgs& args) {
    if (fn.is_callable()) return fn.fn()(args);
    if (fn.is_undefined()) undefined_fail(fn);
    jfail(fmt::format("'{}' object is not callable", fn.type_name()));
  }

  Value binop(const std::string& op, const Value& l, const Value& r) {
    if (op == "~") {
      std::string a = l.to_str(), b = r.to_str();
      if (a.size() + b.size() > t_.opts.max_output) too_big("string");
      return Value(std::move(a) + b);
    }
    if (l.is_undefined()) undefined_fail(l);
    if (r.is_undefined()) undefined_fail(r);
    auto unsupported = [&]() -> Value {
      if (op == "+" && l.is_string())
        jfail(fmt::format("can only concatenate str (not \"{}\") to str", r.type_name()));
      if (op == "+" && l.is_list() && !l.is_tuple())
        jfail(fmt::format("can only concatenate list (not \"{}\") to list", r.type_name()));
      jfail(fmt::format("unsupported operand type(s) for {}: '{}' and '{}'", op, l.type_name(), r.type_name()));
    };
    if (l.is_number() && r.is_number()) {
      bool fl = l.is_float() || r.is_float();
      int64_t res = 0;
      if (op == "+") {
        if (fl) return Value(l.as_float() + r.as_float());
        checked(__builtin_add_overflow(l.as_int(), r.as_int(), &res), 0);
        return Value(res);
      }
      if (op == "-") {
        if (fl) return Value(l.as_float() - r.as_float());
        checked(__builtin_sub_overflow(l.as_int(), r.as_int(), &res), 0);
        return Value(res);
      }
      if (op == "*") {
        if (fl) return Value(l.as_float() * r.as_float());
        checked(__builtin_mul_overflow(l.as_int(), r.as_int(), &res), 0);
        return Value(res);
      }
      if (op == "/") {
        if (r.as_float() == 0) jfail("division by zero");
        return Value(l.as_float() / r.as_float());
      }
      if (op == "//" || op == "%") {
        if (fl) {
          double a = l.as_float(), b = r.as_float();
          if (b == 0) jfail("float divmod()");
          double m = std::fmod(a, b);
          if (m != 0 && ((m < 0) != (b < 0))) m += b;
          if (op == "%") return Value(m);
          return Value(std::floor(a / b));
        }
        int64_t a = l.as_int(), b = r.as_int();
        if (b == 0) jfail(op == "%" ? "integer modulo by zero" : "integer division or modulo by zero");
        if (b == -1 && a == INT64_MIN) checked(true, 0);
        int64_t q = a / b, m = a % b;
        if (m != 0 && ((m < 0) != (b < 0))) {
          m += b;
          q -= 1;
        }
        return op == "%" ? Value(m) : Value(q);
      }
      if (op == "**") {
        if (!fl && r.as_int() >= 0) {
          int64_t p = 1, base = l.as_int(), e = r.as_int();  // by squaring: at most 63 rounds
          while (e > 0) {
            if (e & 1) checked(__builtin_mul_overflow(p, base, &p), 0);
            e >>= 1;
            if (e > 0) checked(__builtin_mul_overflow(base, base, &base), 0);
          }
          return Value(p);
        }
        return Value(std::pow(l.as_float(), r.as_float()));
      }
      return unsupported();
    }
    if (op == "+") {
      if (l.is_string() && r.is_string()) {
        if (l.str().size() + r.str().size() > t_.opts.max_output) too_big("string");
        return Value(l.str() + r.str());
      }
      if (l.is_list() && r.is_list() && l.is_tuple() == r.is_tuple()) {
        if ((l.items().size() + r.items().size()) * sizeof(Value) > t_.opts.max_output) too_big("list");
        List out = l.items();
        out.insert(out.end(), r.items().begin(), r.items().end());
        return Value::list(std::move(out), l.is_tuple());
      }
      return unsupported();
    }
    if (op == "*") {
      const Value *seq = nullptr, *cnt = nullptr;
      if ((l.is_string() || l.is_list()) && (r.is_int() || r.is_bool())) seq = &l, cnt = &r;
      if ((r.is_string() || r.is_list()) && (l.is_int() || l.is_bool())) seq = &r, cnt = &l;
      if (!seq) return unsupported();
      int64_t k = std::max<int64_t>(0, cnt->as_int());
      const size_t unit = seq->is_string() ? seq->str().size() : seq->items().size() * sizeof(Value);
      if (unit > 0 && uint64_t(k) > t_.opts.max_output / unit) too_big("repetition");
      if (seq->is_string()) {
        std::string o;
        for (int64_t i = 0; i < k; ++i) o += seq->str();
        return Value(std::move(o));
      }
      List o;
      for (int64_t i = 0; i < k; ++i) o.insert(o.end(), seq->items().begin(), seq->items().end());
      return Value::list(std::move(o), seq->is_tuple());
    }
    return unsupported();
  }

  Value slice(const Value& obj, const Value* a, const Value* b, const Value* c) {
    if (obj.is_undefined()) undefined_fail(obj);
    int64_t start, stop, step;
    if (obj.is_string()) {
      auto cps = utf8_decode(obj.str());
      slice_indices(int64_t(cps.size()), a, b, c, start, stop, step);
      std::string out;
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) utf8_append(out, cps[size_t(i)]);
      return Value(std::move(out));
    }
    if (obj.is_list()) {
      const auto& l = obj.items();
      slice_indices(int64_t(l.size()), a, b, c, start, stop, step);
      List out;
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) out.push_back(l[size_t(i)]);
      return Value::list(std::move(out), obj.is_tuple());
    }
    jfail(fmt::format("'{}' object is not subscriptable", obj.type_name()));
  }

  Value get_item(const Value& obj, const Value& key) {
    switch (obj.kind()) {
      case Value::Kind::Undefined: undefined_fail(obj);
      case Value::Kind::Dict:
        if (key.is_string()) {
          if (const Value* v = obj.map().find(key.str())) return *v;
          Value m = method(obj, key.str());
          if (!m.is_undefined()) return m;
          return missing_attr(obj, key.str());
        }
        return no_element(obj, key.repr());
      case Value::Kind::List:
      case Value::Kind::String: {
        if (key.is_int() || key.is_bool()) {
          int64_t n = py_len(obj), i = key.as_int();
          if (i < 0) i += n;
          if (i < 0 || i >= n) return no_element(obj, std::to_string(key.as_int()));
          if (obj.is_list()) return obj.items()[size_t(i)];
          auto cps = utf8_decode(obj.str());
          return Value(utf8_encode(cps, size_t(i), size_t(i) + 1));
        }
        if (key.is_string()) return get_attr(obj, key.str());
        return no_element(obj, key.repr());
      }
      case Value::Kind::Namespace:
        if (key.is_string()) return get_attr(obj, key.str());
        [[fallthrough]];
      default:
        if (key.is_string()) return get_attr(obj, key.str());
        return no_element(obj, key.repr());
    }
  }

  Value get_attr(const Value& obj, const std::string& name) {
    switch (obj.kind()) {
      case Value::Kind::Undefined: undefined_fail(obj);
      case Value::Kind::Dict: {
        Value m = method(obj, name);
        if (!m.is_undefined() || !m.hint().empty()) return m;
        if (const Value* v = obj.map().find(name)) return *v;
        return missing_attr(obj, name);
      }
      case Value::Kind::Namespace: {
        if (const Value* v = obj.map().find(name)) return *v;
        return missing_attr(obj, name);
      }
      default: {
        Value m = method(obj, name);
        if (!m.is_undefined() || !m.hint().empty()) return m;
        return missing_attr(obj, name);
      }
    }
  }

  // Bound Python methods of str / dict / list (undefined when not a method).
  Value method(const Value& obj, const std::string& name) {
    if (obj.is_string()) return str_method(obj, name);
    if (obj.is_dict()) {
      if (name == "items" || name == "keys" || name == "values")
        return Value::function(
            [obj, name](const CallArgs&) -> Value {
              List l;
              for (const auto& [k, v] : obj.map().entries) {
                if (name == "items") l.push_back(Value::list({Value(k), v}, true));
                else if (name == "keys") l.emplace_back(k);
                else l.push_back(v);
              }
              return Value::list(std::move(l));
            },
            name);
      if (name == "get")
        return Value::function(
            [obj](const CallArgs& a) -> Value {
              const Value* k = a.get(0, "key");
              if (!k) jfail("get expected at least 1 argument, got 0");
              if (k->is_string())
                if (const Value* v = obj.map().find(k->str())) return *v;
              const Value* d = a.get(1, "default");
              return d ? *d : Value::none();
            },
            name);
      if (name == "copy")
        return Value::function([obj](const CallArgs&) { return Value::dict(obj.map()); }, name);
      if (name == "pop" || name == "popitem" || name == "update" || name == "setdefault" || name == "clear")
        return Value::undefined(fmt::format("access to attribute '{}' of 'dict' object is unsafe.", name));
    }
    if (obj.is_list()) {
      if (name == "append" || name == "pop" || name == "extend" || name == "insert" || name == "remove" ||
          name == "sort" || name == "reverse" || name == "clear")
        return Value::undefined(fmt::format("access to attribute '{}' of '{}' object is unsafe.", name,
                                            obj.type_name()));
      if (name == "index" || name == "count")
        return Value::function(
            [obj, name](const CallArgs& a) -> Value {
              const Value* x = a.get(0, "value");
              if (!x) jfail(fmt::format("{} expected 1 argument", name));
              int64_t c = 0;
              const auto& l = obj.items();
              for (size_t i = 0; i < l.size(); ++i)
                if (equals(l[i], *x)) {
                  if (name == "index") return Value(int64_t(i));
                  ++c;
                }
              if (name == "index") jfail(fmt::format("{} is not in list", x->repr()));
              return Value(c);
            },
            name);
    }
    return Value();
  }

  Value str_method(const Value& obj, const std::string& name) {
    const std::string s = obj.str();
    auto mk = [&](auto f) { return Value::function(f, name); };
    auto need_str = [&](const Value* v, const char* what) -> const std::string& {
      if (!v || !v->is_string()) jfail(fmt::format("{}() argument must be str", what));
      return v->str();
    };
    if (name == "strip" || name == "lstrip" || name == "rstrip")
      return mk([s, name](const CallArgs& a) {
        return Value(py_strip(s, a.get(0, "chars"), name != "rstrip", name != "lstrip"));
      });
    if (name == "split" || name == "rsplit")
      return mk([s, name](const CallArgs& a) {
        const Value* ms = a.get(1, "maxsplit");
        List l;
        for (auto& p : py_split(s, a.get(0, "sep"), ms ? ms->as_int() : -1, name == "rsplit")) l.emplace_back(p);
        return Value::list(std::move(l));
      });
    if (name == "startswith" || name == "endswith")
      return mk([s, name](const CallArgs& a) {
        const Value* p = a.get(0, "prefix");
        if (!p) jfail(fmt::format("{} takes at least 1 argument", name));
        List cands = p->is_tuple() ? p->items() : List{*p};
        for (const auto& c : cands) {
          if (!c.is_string()) jfail(fmt::format("{} first arg must be str or a tuple of str", name));
          const std::string& x = c.str();
          bool ok = name == "startswith" ? s.compare(0, x.size(), x) == 0
                                         : (s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0);
          if (ok) return Value(true);
        }
        return Value(false);
      });
    if (name == "replace")
      return mk([s, need_str](const CallArgs& a) {
        const Value* c = a.get(2, "count");
        return Value(py_replace(s, need_str(a.get(0, "old"), "replace"), need_str(a.get(1, "new"), "replace"),
                                c ? c->as_int() : -1));
      });
    if (name == "upper") return mk([s](const CallArgs&) { return Value(ascii_upper(s)); });
    if (name == "lower") return mk([s](const CallArgs&) { return Value(ascii_lower(s)); });
    if (name == "title") return mk([s](const CallArgs&) { return Value(py_title(s)); });
    if (name == "capitalize") return mk([s](const CallArgs&) { return Value(py_capitalize(s)); });
    if (name == "find" || name == "rfind" || name == "index" || name == "rindex" || name == "count")
      return mk([s, name, need_str](const CallArgs& a) -> Value {
        const std::string& sub = need_str(a.get(0, "sub"), name.c_str());
        auto cps = utf8_decode(s);
        int64_t n = int64_t(cps.size());
        const Value* sv = a.get(1, "start");
        const Value* ev = a.get(2, "end");
        int64_t st, en, step;
        slice_indices(n, sv, ev, nullptr, st, en, step);
        std::string hay = utf8_encode(cps, size_t(st), size_t(std::max(st, en)));
        if (name == "count") {
          if (sub.empty()) return Value(int64_t(utf8_length(hay)) + 1);
          int64_t c = 0;
          for (size_t p = hay.find(sub); p != std::string::npos; p = hay.find(sub, p + sub.size())) ++c;
          return Value(c);
        }
        size_t p = (name[0] == 'r') ? hay.rfind(sub) : hay.find(sub);
        if (p == std::string::npos) {
          if (name == "index" || name == "rindex") jfail("substring not found");
          return Value(int64_t(-1));
        }
        return Value(st + int64_t(utf8_length(std::string_view(hay).substr(0, p))));
      });
    if (name == "join")
      return mk([s](const CallArgs& a) {
        const Value* it = a.get(0, "iterable");
        if (!it) jfail("join() takes exactly one argument");
        std::string out;
        bool first = true;
        for (const auto& v : iterate(*it)) {
          if (!v.is_string()) jfail(fmt::format("sequence item: expected str instance, {} found", v.type_name()));
          if (!first) out += s;
          first = false;
          out += v.str();
          built(out.size());
        }
        return Value(std::move(out));
      });
    if (name == "splitlines")
      return mk([s](const CallArgs&) {
        List l;
        for (auto& p : py_splitlines(s)) l.emplace_back(p);
        return Value::list(std::move(l));
      });
    if (name == "isdigit" || name == "isalpha" || name == "isalnum" || name == "isspace" || name == "isupper" ||
        name == "islower")
      return mk([s, name](const CallArgs&) {
        if (s.empty()) return Value(false);
        bool any_cased = false;
        for (uint32_t c : utf8_decode(s)) {
          bool ok;
          if (name == "isdigit") ok = c < 128 && std::isdigit(int(c));
          else if (name == "isalpha") ok = c < 128 && std::isalpha(int(c));
          else if (name == "isalnum") ok = c < 128 && std::isalnum(int(c));
          else if (name == "isspace") ok = py_isspace(c);
          else {
            if (c < 128 && std::isalpha(int(c))) any_cased = true;
            ok = !(c < 128 && std::isalpha(int(c))) || (name == "isupper" ? std::isupper(int(c)) : std::islower(int(c)));
          }
          if (!ok) return Value(false);
        }
        return Value(name == "isupper" || name == "islower" ? any_cased : true);
      });
    if (name == "format")
      return mk([s](const CallArgs& a) {
        std::string out;
        size_t auto_idx = 0;
        for (size_t i = 0; i < s.size(); ++i) {
          char c = s[i];
          if (c == '{' && i + 1 < s.size() && s[i + 1] == '{') {
            out += '{';
            ++i;
          } else if (c == '}' && i + 1 < s.size() && s[i + 1] == '}') {
            out += '}';
            ++i;
          } else if (c == '{') {
            size_t e = s.find('}', i);
            if (e == std::string::npos) jfail("Single '{' encountered in format string");
            std::string field = s.substr(i + 1, e - i - 1);
            if (field.find(':') != std::string::npos || field.find('!') != std::string::npos)
              jfail("format specs are not supported by talon's Jinja subset");
            const Value* v;
            if (field.empty()) v = auto_idx < a.pos.size() ? &a.pos[auto_idx++] : nullptr;
            else if (all_digits(field)) {
              int64_t k = 0;  // Python's index is a Py_ssize_t
              if (std::from_chars(field.data(), field.data() + field.size(), k).ec != std::errc())
                jfail("Too many decimal digits in format string");
              v = size_t(k) < a.pos.size() ? &a.pos[size_t(k)] : nullptr;
            } else {
              v = nullptr;
              for (const auto& [k, x] : a.kw)
                if (k == field) v = &x;
            }
            if (!v) jfail(fmt::format("Replacement index {} out of range for positional args tuple", field));
            out += v->to_str();
            i = e;
          } else {
            out += c;
          }
        }
        return Value(std::move(out));
      });
    return Value();
  }

  // ---------------------------------------------------------------- filters
  Value apply_filters(const Expr& chain, Value subject, Scope& sc) {
    // chain is Filter(Filter(null, f1), f2): apply innermost first
    if (chain.a[0]) subject = apply_filters(*chain.a[0], std::move(subject), sc);
    return apply_filter(chain, std::move(subject), sc);
  }

  Value attr_path(const Value& item, const std::string& path) {
    Value v = item;
    size_t b = 0;
    while (true) {
      size_t e = path.find('.', b);
      std::string part = path.substr(b, e == std::string::npos ? std::string::npos : e - b);
      if (all_digits(part)) {
        int64_t idx = 0;
        if (std::from_chars(part.data(), part.data() + part.size(), idx).ec == std::errc())
          v = get_item(v, Value(idx));
        else if (v.is_undefined())
          undefined_fail(v);
        else  // past int64: nothing here has that element
          v = no_element(v, part);
      } else
        v = get_item(v, Value(part));
      if (e == std::string::npos) break;
      b = e + 1;
    }
    return v;
  }

  Value apply_filter(const Expr& f, Value v, Scope& sc) {
    CallArgs a = eval_args(f, sc);
    return filter(f.name, std::move(v), a);
  }

  Value filter(const std::string& name, Value v, const CallArgs& a) {
    static const Value kNone = Value::none();
    if (name == "length" || name == "count") return Value(py_len(v));
    if (name == "string") return Value(v.to_str());
    if (name == "safe") return v;
    if (name == "trim") return Value(py_strip(v.to_str(), a.get(0, "chars"), true, true));
    if (name == "upper") return Value(ascii_upper(v.to_str()));
    if (name == "lower") return Value(ascii_lower(v.to_str()));
    if (name == "capitalize") return Value(py_capitalize(v.to_str()));
    if (name == "title") {
      // jinja: words split on [-\s({\[<]+, each capitalised
      auto cps = utf8_decode(v.to_str());
      bool start = true;
      for (auto& c : cps) {
        bool sep = c == '-' || py_isspace(c) || c == '(' || c == '{' || c == '[' || c == '<';
        if (sep) {
          start = true;
        } else {
          c = start ? cp_upper(c) : cp_lower(c);
          start = false;
        }
      }
      return Value(utf8_encode(cps, 0, cps.size()));
    }
    if (name == "replace") {
      const Value* o = a.get(0, "old");
      const Value* n = a.get(1, "new");
      const Value* c = a.get(2, "count");
      if (!o || !n) jfail("replace filter needs old and new");
      return Value(py_replace(v.to_str(), o->to_str(), n->to_str(), c && !c->is_none() ? c->as_int() : -1));
    }
    if (name == "default" || name == "d") {
      Value def = arg_or(a, 0, "default_value", Value(""));
      Value boolean = arg_or(a, 1, "boolean", Value(false));
      if (v.is_undefined() || (boolean.truthy() && !v.truthy())) return def;
      return v;
    }
    if (name == "join") {
      Value sep = arg_or(a, 0, "d", Value(""));
      const Value* attr = a.get(1, "attribute");
      std::string out;
      bool first = true;
      for (auto& it : iterate(v)) {
        if (!first) out += sep.to_str();
        first = false;
        out += (attr ? attr_path(it, attr->to_str()) : it).to_str();
      }
      return Value(std::move(out));
    }
    if (name == "first") {
      List l = iterate(v);
      return l.empty() ? Value::undefined("No first item, sequence was empty.") : l.front();
    }
    if (name == "last") {
      List l = iterate(v);
      return l.empty() ? Value::undefined("No last item, sequence was empty.") : l.back();
    }
    if (name == "list") return Value::list(iterate(v));
    if (name == "items") {
      if (v.is_undefined()) return Value::list({});
      if (!v.is_dict()) jfail("Can only get item pairs from a mapping.");
      List l;
      for (const auto& [k, x] : v.map().entries) l.push_back(Value::list({Value(k), x}, true));
      return Value::list(std::move(l));
    }
    if (name == "reverse") {
      if (v.is_string()) {
        auto cps = utf8_decode(v.str());
        std::reverse(cps.begin(), cps.end());
        return Value(utf8_encode(cps, 0, cps.size()));
      }
      List l = iterate(v);
      std::reverse(l.begin(), l.end());
      return Value::list(std::move(l));
    }
    if (name == "tojson") {
      Value ea = arg_or(a, 0, "ensure_ascii", Value(false));
      if (ea.truthy()) jfail("tojson(ensure_ascii=True) is not supported by talon's Jinja subset");
      Value ind = arg_or(a, 1, "indent", kNone);
      Value seps = arg_or(a, 2, "separators", kNone);
      Value sk = arg_or(a, 3, "sort_keys", Value(false));
      int indent = -1;
      if (ind.is_int()) {
        if (ind.as_int() > 1024) jfail("tojson indent above 1024 is not supported");
        indent = int(std::max<int64_t>(0, ind.as_int()));
      }
      else if (!ind.is_none()) jfail("tojson indent must be an int or None");
      std::string isep, ksep;
      if (!seps.is_none()) {
        if (!seps.is_list() || seps.items().size() != 2) jfail("tojson separators must be a (item, key) pair");
        isep = seps.items()[0].to_str();
        ksep = seps.items()[1].to_str();
      }
      return Value(json_dumps(v, indent, seps.is_none() ? nullptr : &isep, seps.is_none() ? nullptr : &ksep,
                              sk.truthy()));
    }
    if (name == "int") {
      Value def = arg_or(a, 0, "default", Value(int64_t(0)));
      return to_int_value(v, def);
    }
    if (name == "float") {
      Value def = arg_or(a, 0, "default", Value(0.0));
      if (v.is_number()) return Value(v.as_float());
      if (v.is_string()) {
        try {
          size_t used = 0;
          std::string s = py_strip(v.str(), nullptr, true, true);
          double d = std::stod(s, &used);
          if (used == s.size()) return Value(d);
        } catch (...) {
        }
      }
      return def;
    }
    if (name == "abs") {
      if (v.is_float()) return Value(std::fabs(v.as_float()));
      if (v.is_int() || v.is_bool()) {
        if (v.as_int() == INT64_MIN) jfail("integer overflow (talon's integers are 64-bit)");
        return Value(int64_t(std::llabs(v.as_int())));
      }
      jfail(fmt::format("bad operand type for abs(): '{}'", v.type_name()));
    }
    if (name == "round") {
      int64_t prec = arg_or(a, 0, "precision", Value(int64_t(0))).as_int();
      std::string method = arg_or(a, 1, "method", Value("common")).to_str();
      double x = v.as_float(), m = std::pow(10.0, double(prec));
      double r = method == "ceil" ? std::ceil(x * m) / m : method == "floor" ? std::floor(x * m) / m
                                                                             : std::round(x * m) / m;
      return Value(r);
    }
    if (name == "selectattr" || name == "rejectattr" || name == "select" || name == "reject") {
      bool attr_mode = name == "selectattr" || name == "rejectattr";
      bool want = name == "selectattr" || name == "select";
      size_t k = 0;
      std::string attr;
      if (attr_mode) {
        if (a.pos.empty()) jfail(fmt::format("{} needs an attribute name", name));
        attr = a.pos[k++].to_str();
      }
      std::string test;
      if (k < a.pos.size()) test = a.pos[k++].to_str();
      CallArgs targs;
      for (; k < a.pos.size(); ++k) targs.pos.push_back(a.pos[k]);
      if (!test.empty() && !test_known(test)) jfail(fmt::format("No test named '{}'.", test));
      List out;
      for (auto& it : iterate(v)) {
        Value x = attr_mode ? attr_path(it, attr) : it;
        bool r = test.empty() ? x.truthy() : apply_test(test, x, targs);
        if (r == want) out.push_back(it);
      }
      return Value::list(std::move(out));
    }
    if (name == "map") {
      List out;
      const Value* attr = nullptr;
      for (const auto& [k, x] : a.kw)
        if (k == "attribute") attr = &x;
      if (attr) {
        const Value* def = nullptr;
        for (const auto& [k, x] : a.kw)
          if (k == "default") def = &x;
        for (auto& it : iterate(v)) {
          Value x = attr_path(it, attr->to_str());
          out.push_back(x.is_undefined() && def ? *def : x);
        }
        return Value::list(std::move(out));
      }
      if (a.pos.empty()) jfail("map requires a filter name or attribute=");
      std::string fname = a.pos[0].to_str();
      if (!filter_known(fname)) jfail(fmt::format("No filter named '{}'.", fname));
      CallArgs fa;
      fa.pos.assign(a.pos.begin() + 1, a.pos.end());
      fa.kw = a.kw;
      for (auto& it : iterate(v)) out.push_back(filter(fname, it, fa));
      return Value::list(std::move(out));
    }
    if (name == "unique" || name == "sort" || name == "min" || name == "max") {
      bool cs = arg_or(a, name == "sort" ? 1 : 0, "case_sensitive", Value(false)).truthy();
      const Value* attr = a.get(name == "sort" ? 2 : 1, "attribute");
      auto key = [&](const Value& it) {
        Value k = attr ? attr_path(it, attr->to_str()) : it;
        if (!cs && k.is_string()) return Value(ascii_lower(k.str()));
        return k;
      };
      List items = iterate(v);
      if (name == "unique") {
        List out, seen;
        for (auto& it : items) {
          Value k = key(it);
          bool dup = false;
          for (auto& s : seen)
            if (equals(s, k)) dup = true;
          if (!dup) {
            seen.push_back(k);
            out.push_back(it);
          }
        }
        return Value::list(std::move(out));
      }
      if (name == "sort") {
        bool rev = arg_or(a, 0, "reverse", Value(false)).truthy();
        std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
          return rev ? compare(key(y), key(x), "<") < 0 : compare(key(x), key(y), "<") < 0;
        });
        return Value::list(std::move(items));
      }
      if (items.empty()) return Value::undefined(fmt::format("No aggregated item, sequence was empty."));
      size_t best = 0;
      for (size_t i = 1; i < items.size(); ++i) {
        int c = compare(key(items[i]), key(items[best]), "<");
        if (name == "min" ? c < 0 : c > 0) best = i;
      }
      return items[best];
    }
    if (name == "sum") {
      const Value* attr = a.get(0, "attribute");
      Value acc = arg_or(a, 1, "start", Value(int64_t(0)));
      for (auto& it : iterate(v)) acc = binop("+", acc, attr ? attr_path(it, attr->to_str()) : it);
      return acc;
    }
    if (name == "indent") {
      Value w = arg_or(a, 0, "width", Value(int64_t(4)));
      bool first = arg_or(a, 1, "first", Value(false)).truthy();
      bool blank = arg_or(a, 2, "blank", Value(false)).truthy();
      if (!w.is_string()) built(size_t(std::max<int64_t>(0, w.as_int())));
      std::string ind = w.is_string() ? w.str() : std::string(size_t(std::max<int64_t>(0, w.as_int())), ' ');
      std::string s = v.to_str() + "\n";
      auto lines = py_splitlines(s);
      std::string rv;
      if (blank) {
        for (size_t i = 0; i < lines.size(); ++i) {
          rv += (i ? "\n" + ind : "") + lines[i];
          built(rv.size());
        }
      } else {
        rv = lines.empty() ? "" : lines[0];
        for (size_t i = 1; i < lines.size(); ++i) {
          rv += "\n" + (lines[i].empty() ? "" : ind + lines[i]);
          built(rv.size());
        }
      }
      if (first) rv = ind + rv;
      return Value(std::move(rv));
    }
    if (name == "attr") {
      const Value* n = a.get(0, "name");
      if (!n) jfail("attr filter needs a name");
      return get_attr(v, n->to_str());
    }
    if (name == "dictsort") {
      if (!v.is_dict()) jfail("dictsort expects a mapping");
      bool cs = arg_or(a, 0, "case_sensitive", Value(false)).truthy();
      std::string by = arg_or(a, 1, "by", Value("key")).to_str();
      bool rev = arg_or(a, 2, "reverse", Value(false)).truthy();
      List l;
      for (const auto& [k, x] : v.map().entries) l.push_back(Value::list({Value(k), x}, true));
      size_t idx = by == "value" ? 1 : 0;
      auto key = [&](const Value& p) {
        const Value& k = p.items()[idx];
        return (!cs && k.is_string()) ? Value(ascii_lower(k.str())) : k;
      };
      std::stable_sort(l.begin(), l.end(), [&](const Value& x, const Value& y) {
        return rev ? compare(key(y), key(x), "<") < 0 : compare(key(x), key(y), "<") < 0;
      });
      return Value::list(std::move(l));
    }
    if (name == "wordcount") return Value(int64_t(py_split(v.to_str(), nullptr, -1, false).size()));
    if (name == "escape" || name == "e") {
      std::string o;
      for (char c : v.to_str()) {
        switch (c) {
          case '&': o += "&amp;"; break;
          case '<': o += "&lt;"; break;
          case '>': o += "&gt;"; break;
          case '"': o += "&#34;"; break;
          case '\'': o += "&#39;"; break;
          default: o += c;
        }
      }
      return Value(std::move(o));
    }
    if (name == "format") {
      std::string fmtstr = v.to_str(), out;
      size_t k = 0;
      for (size_t i = 0; i < fmtstr.size(); ++i) {
        if (fmtstr[i] != '%' || i + 1 >= fmtstr.size()) {
          out += fmtstr[i];
          continue;
        }
        char c = fmtstr[++i];
        if (c == '%') {
          out += '%';
          continue;
        }
        if (k >= a.pos.size()) jfail("not enough arguments for format string");
        const Value& x = a.pos[k++];
        if (c == 's') out += x.to_str();
        else if (c == 'r') out += x.repr();
        else if (c == 'd' || c == 'i') out += std::to_string(to_int_value(x, Value(int64_t(0))).as_int());
        else jfail(fmt::format("format code '%{}' is not supported by talon's Jinja subset", c));
      }
      return Value(std::move(out));
    }
    jfail(fmt::format("No filter named '{}'.", name));
  }

  // ---------------------------------------------------------------- tests
  bool apply_test(const std::string& name, const Value& v, const CallArgs& a) {
    auto arg = [&](size_t i) -> const Value& {
      const Value* x = a.get(i, "");
      if (!x) jfail(fmt::format("test '{}' needs an argument", name));
      return *x;
    };
    using K = Value::Kind;
    if (name == "defined") return !v.is_undefined();
    if (name == "undefined") return v.is_undefined();
    if (name == "none") return v.is_none();
    if (name == "boolean") return v.is_bool();
    if (name == "true") return v.is_bool() && v.as_bool();
    if (name == "false") return v.is_bool() && !v.as_bool();
    if (name == "integer") return v.is_int();
    if (name == "float") return v.is_float();
    if (name == "number") return v.is_number();
    if (name == "string") return v.is_string();
    if (name == "mapping") return v.is_dict();
    if (name == "iterable") return v.is_undefined() || v.is_string() || v.is_list() || v.is_dict();
    if (name == "sequence") return v.is_undefined() || v.is_string() || v.is_list() || v.is_dict();
    if (name == "callable") return v.is_callable();
    if (name == "odd" || name == "even") {
      if (!v.is_int() && !v.is_bool()) jfail("odd/even test needs an integer");
      return (((v.as_int() % 2) + 2) % 2 == 1) == (name == "odd");
    }
    if (name == "divisibleby") {
      const Value& d = arg(0);
      if (d.as_int() == 0) jfail("integer division or modulo by zero");
      return v.as_int() % d.as_int() == 0;
    }
    if (name == "eq" || name == "equalto" || name == "==") return equals(v, arg(0));
    if (name == "ne" || name == "!=") return !equals(v, arg(0));
    if (name == "lt" || name == "lessthan" || name == "<") return compare(v, arg(0), "<") < 0;
    if (name == "le" || name == "<=") return compare(v, arg(0), "<=") <= 0;
    if (name == "gt" || name == "greaterthan" || name == ">") return compare(v, arg(0), ">") > 0;
    if (name == "ge" || name == ">=") return compare(v, arg(0), ">=") >= 0;
    if (name == "in") return contains(arg(0), v);
    if (name == "sameas") {
      const Value& o = arg(0);
      if (v.kind() != o.kind()) return false;
      switch (v.kind()) {
        case K::None: case K::Undefined: return true;
        case K::Bool: return v.as_bool() == o.as_bool();
        case K::Int: return v.as_int() == o.as_int() && v.as_int() >= -5 && v.as_int() <= 256;
        case K::List: return &v.items() == &o.items();
        case K::Dict: case K::Namespace: return &v.map() == &o.map();
        default: return false;
      }
    }
    if (name == "lower") return v.is_string() && ascii_lower(v.str()) == v.str();
    if (name == "upper") return v.is_string() && ascii_upper(v.str()) == v.str();
    if (name == "filter") return filter_known(arg(0).to_str());
    if (name == "test") return test_known(arg(0).to_str());
    if (name == "escaped") return false;
    jfail(fmt::format("No test named '{}'.", name));
  }
};

}  // namespace

bool filter_known(const std::string& n) {
  static const char* names[] = {"length", "count", "string", "safe", "trim", "upper", "lower", "capitalize", "title",
                                "replace", "default", "d", "join", "first", "last", "list", "items", "reverse",
                                "tojson", "int", "float", "abs", "round", "selectattr", "rejectattr", "select",
                                "reject", "map", "unique", "sort", "min", "max", "sum", "indent", "attr", "dictsort",
                                "wordcount", "escape", "e", "format"};
  for (const char* x : names)
    if (n == x) return true;
  return false;
}
bool filter_jinja_builtin(const std::string& n) {
  static const char* names[] = {"batch", "center", "filesizeformat", "forceescape", "groupby", "pprint", "random",
                                "slice", "striptags", "truncate", "urlencode", "urlize", "wordwrap", "xmlattr"};
  for (const char* x : names)
    if (n == x) return true;
  return false;
}
bool test_known(const std::string& n) {
  static const char* names[] = {"defined", "undefined", "none", "boolean", "true", "false", "integer", "float",
                                "number", "string", "mapping", "iterable", "sequence", "callable", "odd", "even",
                                "divisibleby", "eq", "equalto", "==", "ne", "!=", "lt", "lessthan", "<", "le", "<=",
                                "gt", "greaterthan", ">", "ge", ">=", "in", "sameas", "lower", "upper", "filter",
                                "test", "escaped"};
  for (const char* x : names)
    if (n == x) return true;
  return false;
}

std::string render_impl(const Template::Impl& t, const Dict& context) {
  Interp in(t, context);
  try {
    return in.run();
  } catch (const JErr& e) {
    throw talon::Error(fmt::format("template '{}': {}", t.name, e.what()));
  }
}

}  // namespace talon::text::jinja
