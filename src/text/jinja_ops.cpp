// Python's semantics of the operations on values that the evaluator, the filters and the
// methods share: iteration, len(), ordering, `in`, the binary operators, subscripts,
// slices and attribute lookup (ImmutableSandboxedEnvironment rules).
#include <algorithm>
#include <charconv>
#include <cmath>

#include "text/jinja_runtime.h"
#include "text/jinja_util.h"

namespace talon::text::jinja {

[[noreturn]] void jfail(const std::string& m) { throw JErr(m); }

void built(size_t n) {
  constexpr size_t kMaxBuilt = size_t(256) << 20;
  if (n > kMaxBuilt) jfail(fmt::format("a string of more than {} bytes would be built", kMaxBuilt));
}

void too_big(const char* what, size_t max_output) {
  jfail(fmt::format("{} larger than the {} byte limit of a template render", what, max_output));
}

int64_t checked(bool overflow, int64_t v) {
  if (overflow) jfail("integer overflow (talon's integers are 64-bit)");
  return v;
}

void undefined_fail(const Value& v) {
  jfail(v.hint().empty() ? std::string("value is undefined") : v.hint());
}

namespace {
std::string obj_type_repr(const Value& v) {
  if (v.is_none()) return "None";
  return v.type_name() + " object";
}

}  // namespace

// `key` as Python prints it. Lists and strings name their type bare, everything else
// quoted (as Jinja's messages do).
Value no_element(const Value& obj, const std::string& key) {
  if (obj.is_list() || obj.is_string())
    return Value::undefined(fmt::format("{} has no element {}", obj_type_repr(obj), key));
  return Value::undefined(fmt::format("'{}' has no element {}", obj_type_repr(obj), key));
}

Value missing_attr(const Value& obj, const std::string& name) {
  return Value::undefined(fmt::format("'{}' has no attribute '{}'", obj_type_repr(obj), name));
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

Value binop(const std::string& op, const Value& l, const Value& r, size_t max_output) {
  if (op == "~") {
    std::string a = l.to_str(), b = r.to_str();
    if (a.size() + b.size() > max_output) too_big("string", max_output);
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
      if (l.str().size() + r.str().size() > max_output) too_big("string", max_output);
      return Value(l.str() + r.str());
    }
    if (l.is_list() && r.is_list() && l.is_tuple() == r.is_tuple()) {
      if ((l.items().size() + r.items().size()) * sizeof(Value) > max_output) too_big("list", max_output);
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
    if (unit > 0 && uint64_t(k) > max_output / unit) too_big("repetition", max_output);
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

}  // namespace talon::text::jinja
