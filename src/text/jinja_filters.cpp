// Jinja's filters (`x | name(args)`) and tests (`x is name(args)`), each kind dispatched
// through one table of {name, function}. The tables are also what the parser accepts:
// any other name is a syntax error there, as in Jinja's compiler.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string_view>
#include <unordered_map>

#include "text/jinja_internal.h"
#include "text/jinja_runtime.h"
#include "text/jinja_util.h"

namespace talon::text::jinja {

namespace {

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

// ---------------------------------------------------------------- filters
// A filter gets its subject, its arguments and the render's options (bounds).
using FilterFn = Value (*)(Value v, const CallArgs& a, const Options& opts);

Value filter_length(Value v, const CallArgs&, const Options&) { return Value(py_len(v)); }
Value filter_string(Value v, const CallArgs&, const Options&) { return Value(v.to_str()); }
Value filter_safe(Value v, const CallArgs&, const Options&) { return v; }
Value filter_trim(Value v, const CallArgs& a, const Options&) {
  return Value(py_strip(v.to_str(), a.get(0, "chars"), true, true));
}
Value filter_upper(Value v, const CallArgs&, const Options&) { return Value(ascii_upper(v.to_str())); }
Value filter_lower(Value v, const CallArgs&, const Options&) { return Value(ascii_lower(v.to_str())); }
Value filter_capitalize(Value v, const CallArgs&, const Options&) { return Value(py_capitalize(v.to_str())); }

Value filter_title(Value v, const CallArgs&, const Options&) {
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

Value filter_replace(Value v, const CallArgs& a, const Options&) {
  const Value* o = a.get(0, "old");
  const Value* n = a.get(1, "new");
  const Value* c = a.get(2, "count");
  if (!o || !n) jfail("replace filter needs old and new");
  return Value(py_replace(v.to_str(), o->to_str(), n->to_str(), c && !c->is_none() ? c->as_int() : -1));
}

Value filter_default(Value v, const CallArgs& a, const Options&) {
  Value def = arg_or(a, 0, "default_value", Value(""));
  Value boolean = arg_or(a, 1, "boolean", Value(false));
  if (v.is_undefined() || (boolean.truthy() && !v.truthy())) return def;
  return v;
}

Value filter_join(Value v, const CallArgs& a, const Options&) {
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

Value filter_first(Value v, const CallArgs&, const Options&) {
  List l = iterate(v);
  return l.empty() ? Value::undefined("No first item, sequence was empty.") : l.front();
}
Value filter_last(Value v, const CallArgs&, const Options&) {
  List l = iterate(v);
  return l.empty() ? Value::undefined("No last item, sequence was empty.") : l.back();
}
Value filter_list(Value v, const CallArgs&, const Options&) { return Value::list(iterate(v)); }

Value filter_items(Value v, const CallArgs&, const Options&) {
  if (v.is_undefined()) return Value::list({});
  if (!v.is_dict()) jfail("Can only get item pairs from a mapping.");
  List l;
  for (const auto& [k, x] : v.map().entries) l.push_back(Value::list({Value(k), x}, true));
  return Value::list(std::move(l));
}

Value filter_reverse(Value v, const CallArgs&, const Options&) {
  if (v.is_string()) {
    auto cps = utf8_decode(v.str());
    std::reverse(cps.begin(), cps.end());
    return Value(utf8_encode(cps, 0, cps.size()));
  }
  List l = iterate(v);
  std::reverse(l.begin(), l.end());
  return Value::list(std::move(l));
}

Value filter_tojson(Value v, const CallArgs& a, const Options&) {
  Value ea = arg_or(a, 0, "ensure_ascii", Value(false));
  if (ea.truthy()) jfail("tojson(ensure_ascii=True) is not supported by talon's Jinja subset");
  Value ind = arg_or(a, 1, "indent", Value::none());
  Value seps = arg_or(a, 2, "separators", Value::none());
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

Value filter_int(Value v, const CallArgs& a, const Options&) {
  Value def = arg_or(a, 0, "default", Value(int64_t(0)));
  return to_int_value(v, def);
}

Value filter_float(Value v, const CallArgs& a, const Options&) {
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

Value filter_abs(Value v, const CallArgs&, const Options&) {
  if (v.is_float()) return Value(std::fabs(v.as_float()));
  if (v.is_int() || v.is_bool()) {
    if (v.as_int() == INT64_MIN) jfail("integer overflow (talon's integers are 64-bit)");
    return Value(int64_t(std::llabs(v.as_int())));
  }
  jfail(fmt::format("bad operand type for abs(): '{}'", v.type_name()));
}

Value filter_round(Value v, const CallArgs& a, const Options&) {
  int64_t prec = arg_or(a, 0, "precision", Value(int64_t(0))).as_int();
  std::string method = arg_or(a, 1, "method", Value("common")).to_str();
  double x = v.as_float(), m = std::pow(10.0, double(prec));
  double r = method == "ceil" ? std::ceil(x * m) / m : method == "floor" ? std::floor(x * m) / m
                                                                         : std::round(x * m) / m;
  return Value(r);
}

// select / reject (the item) and selectattr / rejectattr (the item's attribute, the first
// argument): the items whose test (truthiness when none is named) comes out `want`.
Value select_items(const Value& v, const CallArgs& a, const char* name, bool attr_mode, bool want) {
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
    bool r = test.empty() ? x.truthy() : call_test(test, x, targs);
    if (r == want) out.push_back(it);
  }
  return Value::list(std::move(out));
}
Value filter_select(Value v, const CallArgs& a, const Options&) { return select_items(v, a, "select", false, true); }
Value filter_reject(Value v, const CallArgs& a, const Options&) { return select_items(v, a, "reject", false, false); }
Value filter_selectattr(Value v, const CallArgs& a, const Options&) {
  return select_items(v, a, "selectattr", true, true);
}
Value filter_rejectattr(Value v, const CallArgs& a, const Options&) {
  return select_items(v, a, "rejectattr", true, false);
}

Value filter_map(Value v, const CallArgs& a, const Options& opts) {
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
  for (auto& it : iterate(v)) out.push_back(call_filter(fname, it, fa, opts));
  return Value::list(std::move(out));
}

// What unique / sort / min / max compare: the item or its attribute=, lowercased unless
// case_sensitive (argument `first`; attribute follows it).
struct SortKey {
  bool case_sensitive;
  const Value* attr;
  SortKey(const CallArgs& a, size_t first)
      : case_sensitive(arg_or(a, first, "case_sensitive", Value(false)).truthy()),
        attr(a.get(first + 1, "attribute")) {}
  Value operator()(const Value& it) const {
    Value k = attr ? attr_path(it, attr->to_str()) : it;
    if (!case_sensitive && k.is_string()) return Value(ascii_lower(k.str()));
    return k;
  }
};

Value filter_unique(Value v, const CallArgs& a, const Options&) {
  const SortKey key(a, 0);
  List out, seen;
  for (auto& it : iterate(v)) {
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

Value filter_sort(Value v, const CallArgs& a, const Options&) {
  const SortKey key(a, 1);
  List items = iterate(v);
  bool rev = arg_or(a, 0, "reverse", Value(false)).truthy();
  std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
    return rev ? compare(key(y), key(x), "<") < 0 : compare(key(x), key(y), "<") < 0;
  });
  return Value::list(std::move(items));
}

Value min_or_max(const Value& v, const CallArgs& a, bool max) {
  const SortKey key(a, 0);
  List items = iterate(v);
  if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
  size_t best = 0;
  for (size_t i = 1; i < items.size(); ++i) {
    int c = compare(key(items[i]), key(items[best]), "<");
    if (max ? c > 0 : c < 0) best = i;
  }
  return items[best];
}
Value filter_min(Value v, const CallArgs& a, const Options&) { return min_or_max(v, a, false); }
Value filter_max(Value v, const CallArgs& a, const Options&) { return min_or_max(v, a, true); }

Value filter_sum(Value v, const CallArgs& a, const Options& opts) {
  const Value* attr = a.get(0, "attribute");
  Value acc = arg_or(a, 1, "start", Value(int64_t(0)));
  for (auto& it : iterate(v)) acc = binop("+", acc, attr ? attr_path(it, attr->to_str()) : it, opts.max_output);
  return acc;
}

Value filter_indent(Value v, const CallArgs& a, const Options&) {
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

Value filter_attr(Value v, const CallArgs& a, const Options&) {
  const Value* n = a.get(0, "name");
  if (!n) jfail("attr filter needs a name");
  return get_attr(v, n->to_str());
}

Value filter_dictsort(Value v, const CallArgs& a, const Options&) {
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

Value filter_wordcount(Value v, const CallArgs&, const Options&) {
  return Value(int64_t(py_split(v.to_str(), nullptr, -1, false).size()));
}

Value filter_escape(Value v, const CallArgs&, const Options&) {
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

Value filter_format(Value v, const CallArgs& a, const Options&) {
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

const std::unordered_map<std::string_view, FilterFn>& filter_table() {
  static const std::unordered_map<std::string_view, FilterFn> table = {
      {"length", filter_length}, {"count", filter_length},
      {"string", filter_string},
      {"safe", filter_safe},
      {"trim", filter_trim},
      {"upper", filter_upper},
      {"lower", filter_lower},
      {"capitalize", filter_capitalize},
      {"title", filter_title},
      {"replace", filter_replace},
      {"default", filter_default}, {"d", filter_default},
      {"join", filter_join},
      {"first", filter_first},
      {"last", filter_last},
      {"list", filter_list},
      {"items", filter_items},
      {"reverse", filter_reverse},
      {"tojson", filter_tojson},
      {"int", filter_int},
      {"float", filter_float},
      {"abs", filter_abs},
      {"round", filter_round},
      {"selectattr", filter_selectattr},
      {"rejectattr", filter_rejectattr},
      {"select", filter_select},
      {"reject", filter_reject},
      {"map", filter_map},
      {"unique", filter_unique},
      {"sort", filter_sort},
      {"min", filter_min},
      {"max", filter_max},
      {"sum", filter_sum},
      {"indent", filter_indent},
      {"attr", filter_attr},
      {"dictsort", filter_dictsort},
      {"wordcount", filter_wordcount},
      {"escape", filter_escape}, {"e", filter_escape},
      {"format", filter_format},
  };
  return table;
}

// ---------------------------------------------------------------- tests
// A test's call: the name it was called by (for messages) and its arguments.
struct TestCall {
  const std::string& name;
  const CallArgs& args;
  // The test's argument; fails naming the test when there is none.
  const Value& arg() const {
    const Value* x = args.get(0, "");
    if (!x) jfail(fmt::format("test '{}' needs an argument", name));
    return *x;
  }
};
using TestFn = bool (*)(const Value& v, const TestCall& c);

bool test_iterable(const Value& v, const TestCall&) {
  return v.is_undefined() || v.is_string() || v.is_list() || v.is_dict();
}
bool is_odd(const Value& v) {
  if (!v.is_int() && !v.is_bool()) jfail("odd/even test needs an integer");
  return ((v.as_int() % 2) + 2) % 2 == 1;
}
bool test_divisibleby(const Value& v, const TestCall& c) {
  const Value& d = c.arg();
  if (d.as_int() == 0) jfail("integer division or modulo by zero");
  return v.as_int() % d.as_int() == 0;
}
bool test_eq(const Value& v, const TestCall& c) { return equals(v, c.arg()); }
bool test_ne(const Value& v, const TestCall& c) { return !equals(v, c.arg()); }
bool test_lt(const Value& v, const TestCall& c) { return compare(v, c.arg(), "<") < 0; }
bool test_le(const Value& v, const TestCall& c) { return compare(v, c.arg(), "<=") <= 0; }
bool test_gt(const Value& v, const TestCall& c) { return compare(v, c.arg(), ">") > 0; }
bool test_ge(const Value& v, const TestCall& c) { return compare(v, c.arg(), ">=") >= 0; }
// Python's `is`: the same object (small ints are cached, as in CPython).
bool test_sameas(const Value& v, const TestCall& c) {
  using K = Value::Kind;
  const Value& o = c.arg();
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

const std::unordered_map<std::string_view, TestFn>& test_table() {
  static const std::unordered_map<std::string_view, TestFn> table = {
      {"defined", [](const Value& v, const TestCall&) { return !v.is_undefined(); }},
      {"undefined", [](const Value& v, const TestCall&) { return v.is_undefined(); }},
      {"none", [](const Value& v, const TestCall&) { return v.is_none(); }},
      {"boolean", [](const Value& v, const TestCall&) { return v.is_bool(); }},
      {"true", [](const Value& v, const TestCall&) { return v.is_bool() && v.as_bool(); }},
      {"false", [](const Value& v, const TestCall&) { return v.is_bool() && !v.as_bool(); }},
      {"integer", [](const Value& v, const TestCall&) { return v.is_int(); }},
      {"float", [](const Value& v, const TestCall&) { return v.is_float(); }},
      {"number", [](const Value& v, const TestCall&) { return v.is_number(); }},
      {"string", [](const Value& v, const TestCall&) { return v.is_string(); }},
      {"mapping", [](const Value& v, const TestCall&) { return v.is_dict(); }},
      {"iterable", test_iterable},
      {"sequence", test_iterable},
      {"callable", [](const Value& v, const TestCall&) { return v.is_callable(); }},
      {"odd", [](const Value& v, const TestCall&) { return is_odd(v); }},
      {"even", [](const Value& v, const TestCall&) { return !is_odd(v); }},
      {"divisibleby", test_divisibleby},
      {"eq", test_eq}, {"equalto", test_eq}, {"==", test_eq},
      {"ne", test_ne}, {"!=", test_ne},
      {"lt", test_lt}, {"lessthan", test_lt}, {"<", test_lt},
      {"le", test_le}, {"<=", test_le},
      {"gt", test_gt}, {"greaterthan", test_gt}, {">", test_gt},
      {"ge", test_ge}, {">=", test_ge},
      {"in", [](const Value& v, const TestCall& c) { return contains(c.arg(), v); }},
      {"sameas", test_sameas},
      {"lower", [](const Value& v, const TestCall&) { return v.is_string() && ascii_lower(v.str()) == v.str(); }},
      {"upper", [](const Value& v, const TestCall&) { return v.is_string() && ascii_upper(v.str()) == v.str(); }},
      {"filter", [](const Value&, const TestCall& c) { return filter_known(c.arg().to_str()); }},
      {"test", [](const Value&, const TestCall& c) { return test_known(c.arg().to_str()); }},
      {"escaped", [](const Value&, const TestCall&) { return false; }},
  };
  return table;
}

}  // namespace

Value call_filter(const std::string& name, Value v, const CallArgs& a, const Options& opts) {
  const auto& table = filter_table();
  const auto it = table.find(name);
  if (it == table.end()) jfail(fmt::format("No filter named '{}'.", name));
  return it->second(std::move(v), a, opts);
}

bool call_test(const std::string& name, const Value& v, const CallArgs& a) {
  const auto& table = test_table();
  const auto it = table.find(name);
  if (it == table.end()) jfail(fmt::format("No test named '{}'.", name));
  return it->second(v, TestCall{name, a});
}

bool filter_known(const std::string& n) { return filter_table().count(n) > 0; }
bool test_known(const std::string& n) { return test_table().count(n) > 0; }

bool filter_jinja_builtin(const std::string& n) {
  static const char* names[] = {"batch", "center", "filesizeformat", "forceescape", "groupby", "pprint", "random",
                                "slice", "striptags", "truncate", "urlencode", "urlize", "wordwrap", "xmlattr"};
  for (const char* x : names)
    if (n == x) return true;
  return false;
}

}  // namespace talon::text::jinja
