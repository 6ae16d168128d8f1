// jinja::Value: Python-like values for the template interpreter, with str()/repr(),
// json.dumps-compatible serialisation and conversion from/to nlohmann::ordered_json.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>

#include "text/jinja.h"
#include "text/jinja_util.h"

namespace talon::text::jinja {

const std::string& Value::empty_() {
  static const std::string e;
  return e;
}

Value Value::undefined(std::string hint) {
  Value v;
  if (!hint.empty()) v.str_ = std::make_shared<const std::string>(std::move(hint));
  return v;
}
Value Value::none() {
  Value v;
  v.kind_ = Kind::None;
  return v;
}
Value::Value(bool b) : kind_(Kind::Bool), b_(b), i_(b ? 1 : 0) {}
Value::Value(int64_t v) : kind_(Kind::Int), i_(v) {}
Value::Value(double v) : kind_(Kind::Float), f_(v) {}
Value::Value(const char* s) : kind_(Kind::String), str_(std::make_shared<const std::string>(s)) {}
Value::Value(std::string s) : kind_(Kind::String), str_(std::make_shared<const std::string>(std::move(s))) {}
Value Value::list(List items, bool tuple) {
  Value v;
  v.kind_ = Kind::List;
  v.tuple_ = tuple;
  v.list_ = std::make_shared<List>(std::move(items));
  return v;
}
Value Value::dict(Dict d) {
  Value v;
  v.kind_ = Kind::Dict;
  v.dict_ = std::make_shared<Dict>(std::move(d));
  return v;
}
Value Value::dict() { return dict(Dict{}); }
Value Value::namespace_(Dict d) {
  Value v = dict(std::move(d));
  v.kind_ = Kind::Namespace;
  return v;
}
Value Value::function(Function f, std::string name) {
  Value v;
  v.kind_ = Kind::Callable;
  v.fn_ = std::make_shared<Function>(std::move(f));
  v.str_ = std::make_shared<const std::string>(std::move(name));
  return v;
}

double Value::as_float() const {
  if (kind_ == Kind::Float) return f_;
  return double(i_);
}
const std::string& Value::str() const { return str_ ? *str_ : empty_(); }
const List& Value::items() const {
  static const List e;
  return list_ ? *list_ : e;
}
List& Value::items_mut() { return *list_; }
const Dict& Value::map() const {
  static const Dict e;
  return dict_ ? *dict_ : e;
}
Dict& Value::map_mut() { return *dict_; }
const Function& Value::fn() const { return *fn_; }

bool Value::truthy() const {
  switch (kind_) {
    case Kind::Undefined: case Kind::None: return false;
    case Kind::Bool: return b_;
    case Kind::Int: return i_ != 0;
    case Kind::Float: return f_ != 0.0;
    case Kind::String: return !str().empty();
    case Kind::List: return !items().empty();
    case Kind::Dict: return map().size() != 0;
    default: return true;
  }
}

std::string python_float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  if (d == 0) return std::signbit(d) ? "-0.0" : "0.0";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string s(buf, r.ptr);
  bool neg = s[0] == '-';
  if (neg) s.erase(0, 1);
  size_t e = s.find('e');
  int exp = std::stoi(s.substr(e + 1));
  std::string digits;
  for (size_t i = 0; i < e; ++i)
    if (s[i] != '.') digits += s[i];
  std::string out;
  if (exp >= -5 + 1 && exp < 16) {  // Python 'r' format: fixed when -4 <= exp < 16
    if (exp >= 0) {
      if (int(digits.size()) <= exp + 1) {
        out = digits + std::string(size_t(exp + 1 - int(digits.size())), '0') + ".0";
      } else {
        out = digits.substr(0, size_t(exp + 1)) + "." + digits.substr(size_t(exp + 1));
      }
    } else {
      out = "0." + std::string(size_t(-exp - 1), '0') + digits;
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) {
      out += '.';
      out += digits.substr(1);
    }
    out += exp < 0 ? "e-" : "e+";
    std::string es = std::to_string(std::abs(exp));
    if (es.size() < 2) es = "0" + es;
    out += es;
  }
  return neg ? "-" + out : out;
}

static bool repr_escape_cp(uint32_t c) {
  if (c < 0x20 || c == 0x7f) return true;
  if (c >= 0x80 && c <= 0xa0) return true;
  if (c == 0xad) return true;
  if (c == 0x1680 || (c >= 0x2000 && c <= 0x200f) || (c >= 0x2028 && c <= 0x202f) ||
      (c >= 0x205f && c <= 0x2064) || c == 0x3000 || c == 0xfeff)
    return true;
  return false;
}

std::string python_str_repr(const std::string& s) {
  bool has_single = s.find('\'') != std::string::npos, has_double = s.find('"') != std::string::npos;
  char q = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, q);
  auto cps = utf8_decode(s);
  for (uint32_t c : cps) {
    if (c == uint32_t(q) || c == '\\') {
      out += '\\';
      out += char(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (repr_escape_cp(c)) {
      out += c <= 0xff ? fmt::format("\\x{:02x}", c) : fmt::format("\\u{:04x}", c);
    } else {
      utf8_append(out, c);
    }
  }
  out += q;
  return out;
}

std::string Value::to_str() const {
  switch (kind_) {
    case Kind::Undefined: return "";
    case Kind::String: return str();
    default: return repr();
  }
}

std::string Value::repr() const {
  switch (kind_) {
    case Kind::Undefined: return "";
    case Kind::None: return "None";
    case Kind::Bool: return b_ ? "True" : "False";
    case Kind::Int: return std::to_string(i_);
    case Kind::Float: return python_float_repr(f_);
    case Kind::String: return python_str_repr(str());
    case Kind::List: {
      std::string o = tuple_ ? "(" : "[";
      const auto& l = items();
      for (size_t i = 0; i < l.size(); ++i) {
        if (i) o += ", ";
        o += l[i].repr();
      }
      if (tuple_ && l.size() == 1) o += ",";
      o += tuple_ ? ")" : "]";
      return o;
    }
    case Kind::Dict:
    case Kind::Namespace: {
      std::string o = "{";
      bool first = true;
      for (const auto& [k, v] : map().entries) {
        if (!first) o += ", ";
        first = false;
        o += python_str_repr(k) + ": " + v.repr();
      }
      o += "}";
      return kind_ == Kind::Namespace ? "<Namespace " + o + ">" : o;
    }
    case Kind::Callable: return "<function " + hint() + ">";
  }
  return "";
}

std::string Value::type_name() const {
  switch (kind_) {
    case Kind::Undefined: return "Undefined";
    case Kind::None: return "NoneType";
    case Kind::Bool: return "bool";
    case Kind::Int: return "int";
    case Kind::Float: return "float";
    case Kind::String: return "str";
    case Kind::List: return tuple_ ? "tuple" : "list";
    case Kind::Dict: return "dict";
    case Kind::Namespace: return "Namespace";
    case Kind::Callable: return "function";
  }
  return "object";
}

Value Value::from_json(const ojson& j) {
  switch (j.type()) {
    case ojson::value_t::null: return none();
    case ojson::value_t::boolean: return Value(j.get<bool>());
    case ojson::value_t::number_integer: return Value(j.get<int64_t>());
    case ojson::value_t::number_unsigned: return Value(int64_t(j.get<uint64_t>()));
    case ojson::value_t::number_float: return Value(j.get<double>());
    case ojson::value_t::string: return Value(j.get<std::string>());
    case ojson::value_t::array: {
      List l;
      l.reserve(j.size());
      for (const auto& e : j) l.push_back(from_json(e));
      return list(std::move(l));
    }
    case ojson::value_t::object: {
      Dict d;
      d.entries.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it) d.set(it.key(), from_json(it.value()));
      return dict(std::move(d));
    }
    default: return none();
  }
}

ojson Value::to_json() const {
  switch (kind_) {
    case Kind::None: return nullptr;
    case Kind::Bool: return b_;
    case Kind::Int: return i_;
    case Kind::Float: return f_;
    case Kind::String: return str();
    case Kind::List: {
      ojson a = ojson::array();
      for (const auto& e : items()) a.push_back(e.to_json());
      return a;
    }
    case Kind::Dict: {
      ojson o = ojson::object();
      for (const auto& [k, v] : map().entries) o[k] = v.to_json();
      return o;
    }
    default: talon::fail("Object of type {} is not JSON serializable", type_name());
  }
}

const Value* Dict::find(std::string_view key) const {
  for (const auto& e : entries)
    if (e.first == key) return &e.second;
  return nullptr;
}
Value* Dict::find(std::string_view key) {
  for (auto& e : entries)
    if (e.first == key) return &e.second;
  return nullptr;
}
void Dict::set(const std::string& key, Value v) {
  if (Value* p = find(key)) {
    *p = std::move(v);
    return;
  }
  entries.emplace_back(key, std::move(v));
}
bool Dict::erase(std::string_view key) {
  for (auto it = entries.begin(); it != entries.end(); ++it)
    if (it->first == key) {
      entries.erase(it);
      return true;
    }
  return false;
}

const Value* CallArgs::get(size_t i, std::string_view name) const {
  if (i < pos.size()) return &pos[i];
  for (const auto& [k, v] : kw)
    if (k == name) return &v;
  return nullptr;
}

bool equals(const Value& a, const Value& b) {
  using K = Value::Kind;
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.as_float() == b.as_float();
    return a.as_int() == b.as_int();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case K::Undefined: case K::None: return true;
    case K::String: return a.str() == b.str();
    case K::List: {
      const auto &x = a.items(), &y = b.items();
      if (x.size() != y.size() || a.is_tuple() != b.is_tuple()) return false;
      for (size_t i = 0; i < x.size(); ++i)
        if (!equals(x[i], y[i])) return false;
      return true;
    }
    case K::Dict: {
      const auto &x = a.map(), &y = b.map();
      if (x.size() != y.size()) return false;
      for (const auto& [k, v] : x.entries) {
        const Value* o = y.find(k);
        if (!o || !equals(v, *o)) return false;
      }
      return true;
    }
    case K::Namespace: return &a.map() == &b.map();
    case K::Callable: return &a.fn() == &b.fn();
    default: return false;
  }
}

static void json_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) out += fmt::format("\\u{:04x}", c);
        else out += char(c);
    }
  }
  out += '"';
}

static void dumps_rec(std::string& out, const Value& v, int indent, const std::string& isep,
                      const std::string& ksep, bool sort_keys, int level) {
  using K = Value::Kind;
  auto newline = [&](int lvl) {
    out += '\n';
    out.append(size_t(indent) * size_t(lvl), ' ');
  };
  switch (v.kind()) {
    case K::None: out += "null"; return;
    case K::Bool: out += v.as_bool() ? "true" : "false"; return;
    case K::Int: out += std::to_string(v.as_int()); return;
    case K::Float: {
      double d = v.as_float();
      if (std::isnan(d)) out += "NaN";
      else if (std::isinf(d)) out += d < 0 ? "-Infinity" : "Infinity";
      else out += python_float_repr(d);
      return;
    }
    case K::String: json_string(out, v.str()); return;
    case K::List: {
      const auto& l = v.items();
      if (l.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < l.size(); ++i) {
        if (i) out += isep;
        if (indent >= 0) newline(level + 1);
        dumps_rec(out, l[i], indent, isep, ksep, sort_keys, level + 1);
      }
      if (indent >= 0) newline(level);
      out += ']';
      return;
    }
    case K::Dict: {
      const auto& d = v.map();
      if (d.size() == 0) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> es;
      for (const auto& e : d.entries) es.push_back(&e);
      if (sort_keys)
        std::stable_sort(es.begin(), es.end(), [](auto* a, auto* b) { return a->first < b->first; });
      out += '{';
      for (size_t i = 0; i < es.size(); ++i) {
        if (i) out += isep;
        if (indent >= 0) newline(level + 1);
        json_string(out, es[i]->first);
        out += ksep;
        dumps_rec(out, es[i]->second, indent, isep, ksep, sort_keys, level + 1);
      }
      if (indent >= 0) newline(level);
      out += '}';
      return;
    }
    default: talon::fail("Object of type {} is not JSON serializable", v.type_name());
  }
}

std::string json_dumps(const Value& v, int indent, const std::string* item_sep, const std::string* key_sep,
                       bool sort_keys) {
  std::string isep = item_sep ? *item_sep : (indent >= 0 ? "," : ", ");
  std::string ksep = key_sep ? *key_sep : ": ";
  std::string out;
  dumps_rec(out, v, indent, isep, ksep, sort_keys, 0);
  return out;
}

// ---- UTF-8 helpers ----
std::vector<uint32_t> utf8_decode(std::string_view s) {
  std::vector<uint32_t> out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    unsigned char c = s[i];
    uint32_t cp;
    size_t n;
    if (c < 0x80) { cp = c; n = 1; }
    else if ((c >> 5) == 6 && i + 1 < s.size()) { cp = c & 0x1f; n = 2; }
    else if ((c >> 4) == 14 && i + 2 < s.size()) { cp = c & 0x0f; n = 3; }
    else if ((c >> 3) == 30 && i + 3 < s.size()) { cp = c & 0x07; n = 4; }
    else { out.push_back(0xfffd); ++i; continue; }
    for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (uint32_t(s[i + k]) & 0x3f);
    out.push_back(cp);
    i += n;
  }
  return out;
}

void utf8_append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xc0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += char(0xe0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3f));
    out += char(0x80 | (cp & 0x3f));
  } else {
    out += char(0xf0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3f));
    out += char(0x80 | ((cp >> 6) & 0x3f));
    out += char(0x80 | (cp & 0x3f));
  }
}

std::string utf8_encode(const std::vector<uint32_t>& cps, size_t begin, size_t end) {
  std::string out;
  for (size_t i = begin; i < end && i < cps.size(); ++i) utf8_append(out, cps[i]);
  return out;
}

size_t utf8_length(std::string_view s) {
  size_t n = 0;
  for (unsigned char c : s)
    if ((c & 0xc0) != 0x80) ++n;
  return n;
}

bool py_isspace(uint32_t c) {
  return (c >= 9 && c <= 13) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f ||
         c == 0x3000;
}

}  // namespace talon::text::jinja
