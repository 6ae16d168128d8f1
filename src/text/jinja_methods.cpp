// The Python methods templates call on str, dict and list values, one table per type. A
// template gets them as bound functions; the ones that would mutate a value are refused,
// as Jinja's ImmutableSandboxedEnvironment does.
#include <algorithm>
#include <cctype>
#include <charconv>
#include <string_view>
#include <unordered_map>

#include "text/jinja_runtime.h"
#include "text/jinja_util.h"

namespace talon::text::jinja {

namespace {

// A method of `self`, called by `name` (for its messages, and for the variants one
// function serves).
using MethodFn = Value (*)(const Value& self, const std::string& name, const CallArgs& a);
// A null entry: the method exists but the sandbox refuses it.
using MethodTable = std::unordered_map<std::string_view, MethodFn>;

// ---------------------------------------------------------------- str
const std::string& need_str(const Value* v, const char* what) {
  if (!v || !v->is_string()) jfail(fmt::format("{}() argument must be str", what));
  return v->str();
}

// strip / lstrip / rstrip
Value str_strip(const Value& self, const std::string& name, const CallArgs& a) {
  return Value(py_strip(self.str(), a.get(0, "chars"), name != "rstrip", name != "lstrip"));
}

// split / rsplit
Value str_split(const Value& self, const std::string& name, const CallArgs& a) {
  const Value* ms = a.get(1, "maxsplit");
  List l;
  for (auto& p : py_split(self.str(), a.get(0, "sep"), ms ? ms->as_int() : -1, name == "rsplit")) l.emplace_back(p);
  return Value::list(std::move(l));
}

// startswith / endswith
Value str_affix(const Value& self, const std::string& name, const CallArgs& a) {
  const std::string& s = self.str();
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
}

Value str_replace(const Value& self, const std::string&, const CallArgs& a) {
  const Value* c = a.get(2, "count");
  return Value(py_replace(self.str(), need_str(a.get(0, "old"), "replace"), need_str(a.get(1, "new"), "replace"),
                          c ? c->as_int() : -1));
}

Value str_upper(const Value& self, const std::string&, const CallArgs&) { return Value(ascii_upper(self.str())); }
Value str_lower(const Value& self, const std::string&, const CallArgs&) { return Value(ascii_lower(self.str())); }
Value str_title(const Value& self, const std::string&, const CallArgs&) { return Value(py_title(self.str())); }
Value str_capitalize(const Value& self, const std::string&, const CallArgs&) {
  return Value(py_capitalize(self.str()));
}

// find / rfind / index / rindex / count, over code points in [start, end)
Value str_find(const Value& self, const std::string& name, const CallArgs& a) {
  const std::string& sub = need_str(a.get(0, "sub"), name.c_str());
  auto cps = utf8_decode(self.str());
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
}

Value str_join(const Value& self, const std::string&, const CallArgs& a) {
  const Value* it = a.get(0, "iterable");
  if (!it) jfail("join() takes exactly one argument");
  std::string out;
  bool first = true;
  for (const auto& v : iterate(*it)) {
    if (!v.is_string()) jfail(fmt::format("sequence item: expected str instance, {} found", v.type_name()));
    if (!first) out += self.str();
    first = false;
    out += v.str();
    built(out.size());
  }
  return Value(std::move(out));
}

Value str_splitlines(const Value& self, const std::string&, const CallArgs&) {
  List l;
  for (auto& p : py_splitlines(self.str())) l.emplace_back(p);
  return Value::list(std::move(l));
}

// isdigit / isalpha / isalnum (ASCII classes) and isspace: non-empty, every code point in the class.
bool ascii_digit(uint32_t c) { return c < 128 && std::isdigit(int(c)); }
bool ascii_alpha(uint32_t c) { return c < 128 && std::isalpha(int(c)); }
bool ascii_alnum(uint32_t c) { return c < 128 && std::isalnum(int(c)); }
template <bool (*in_class)(uint32_t)>
Value str_is(const Value& self, const std::string&, const CallArgs&) {
  if (self.str().empty()) return Value(false);
  for (uint32_t c : utf8_decode(self.str()))
    if (!in_class(c)) return Value(false);
  return Value(true);
}

// isupper / islower: some cased (ASCII) letter, and all of them in that case.
template <bool upper>
Value str_is_case(const Value& self, const std::string&, const CallArgs&) {
  if (self.str().empty()) return Value(false);
  bool any_cased = false;
  for (uint32_t c : utf8_decode(self.str())) {
    if (!ascii_alpha(c)) continue;
    any_cased = true;
    if (!(upper ? std::isupper(int(c)) : std::islower(int(c)))) return Value(false);
  }
  return Value(any_cased);
}

// str.format with automatic / numbered / named fields and no format specs.
Value str_format(const Value& self, const std::string&, const CallArgs& a) {
  const std::string& s = self.str();
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
}

const MethodTable& str_methods() {
  static const MethodTable table = {
      {"strip", str_strip}, {"lstrip", str_strip}, {"rstrip", str_strip},
      {"split", str_split}, {"rsplit", str_split},
      {"startswith", str_affix}, {"endswith", str_affix},
      {"replace", str_replace},
      {"upper", str_upper},
      {"lower", str_lower},
      {"title", str_title},
      {"capitalize", str_capitalize},
      {"find", str_find}, {"rfind", str_find}, {"index", str_find}, {"rindex", str_find}, {"count", str_find},
      {"join", str_join},
      {"splitlines", str_splitlines},
      {"isdigit", str_is<ascii_digit>}, {"isalpha", str_is<ascii_alpha>}, {"isalnum", str_is<ascii_alnum>},
      {"isspace", str_is<py_isspace>},
      {"isupper", str_is_case<true>}, {"islower", str_is_case<false>},
      {"format", str_format},
  };
  return table;
}

// ---------------------------------------------------------------- dict
Value dict_items(const Value& self, const std::string&, const CallArgs&) {
  List l;
  for (const auto& [k, v] : self.map().entries) l.push_back(Value::list({Value(k), v}, true));
  return Value::list(std::move(l));
}
Value dict_keys(const Value& self, const std::string&, const CallArgs&) {
  List l;
  for (const auto& e : self.map().entries) l.emplace_back(e.first);
  return Value::list(std::move(l));
}
Value dict_values(const Value& self, const std::string&, const CallArgs&) {
  List l;
  for (const auto& e : self.map().entries) l.push_back(e.second);
  return Value::list(std::move(l));
}
Value dict_get(const Value& self, const std::string&, const CallArgs& a) {
  const Value* k = a.get(0, "key");
  if (!k) jfail("get expected at least 1 argument, got 0");
  if (k->is_string())
    if (const Value* v = self.map().find(k->str())) return *v;
  const Value* d = a.get(1, "default");
  return d ? *d : Value::none();
}
Value dict_copy(const Value& self, const std::string&, const CallArgs&) { return Value::dict(self.map()); }

const MethodTable& dict_methods() {
  static const MethodTable table = {
      {"items", dict_items}, {"keys", dict_keys}, {"values", dict_values}, {"get", dict_get}, {"copy", dict_copy},
      // mutating
      {"pop", nullptr}, {"popitem", nullptr}, {"update", nullptr}, {"setdefault", nullptr}, {"clear", nullptr},
  };
  return table;
}

// ---------------------------------------------------------------- list (and tuple)
// index / count
Value list_find(const Value& self, const std::string& name, const CallArgs& a) {
  const Value* x = a.get(0, "value");
  if (!x) jfail(fmt::format("{} expected 1 argument", name));
  int64_t c = 0;
  const auto& l = self.items();
  for (size_t i = 0; i < l.size(); ++i)
    if (equals(l[i], *x)) {
      if (name == "index") return Value(int64_t(i));
      ++c;
    }
  if (name == "index") jfail(fmt::format("{} is not in list", x->repr()));
  return Value(c);
}

const MethodTable& list_methods() {
  static const MethodTable table = {
      {"index", list_find}, {"count", list_find},
      // mutating
      {"append", nullptr}, {"pop", nullptr}, {"extend", nullptr}, {"insert", nullptr}, {"remove", nullptr},
      {"sort", nullptr}, {"reverse", nullptr}, {"clear", nullptr},
  };
  return table;
}

}  // namespace

Value method(const Value& obj, const std::string& name) {
  const MethodTable* table = obj.is_string() ? &str_methods()
                             : obj.is_dict() ? &dict_methods()
                             : obj.is_list() ? &list_methods()
                                             : nullptr;
  if (!table) return Value();
  const auto it = table->find(name);
  if (it == table->end()) return Value();
  const MethodFn fn = it->second;
  if (!fn)
    return Value::undefined(fmt::format("access to attribute '{}' of '{}' object is unsafe.", name, obj.type_name()));
  return Value::function([obj, name, fn](const CallArgs& a) { return fn(obj, name, a); }, name);
}

}  // namespace talon::text::jinja
