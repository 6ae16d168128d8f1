// Evaluator for the Jinja subset: scopes, statements (loops, macros, assignments, blocks),
// expressions and the built-in globals, under the sandbox bounds of Options. What values
// do is in jinja_ops.cpp, filters and tests in jinja_filters.cpp, methods in jinja_methods.cpp.
#include <algorithm>
#include <unordered_map>

#include "text/jinja_internal.h"
#include "text/jinja_runtime.h"

namespace talon::text::jinja {

namespace {

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
  void check_out(const std::string& out) {
    if (out.size() > t_.opts.max_output) too_big("output", t_.opts.max_output);
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
        bool r = call_test(e.name, subject, args);
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
      case EK::Bin: return binop(e.name, eval(*e.a[0], sc), eval(*e.a[1], sc), t_.opts.max_output);
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

  // ---------------------------------------------------------------- filters
  Value apply_filters(const Expr& chain, Value subject, Scope& sc) {
    // chain is Filter(Filter(null, f1), f2): apply innermost first
    if (chain.a[0]) subject = apply_filters(*chain.a[0], std::move(subject), sc);
    return apply_filter(chain, std::move(subject), sc);
  }

  Value apply_filter(const Expr& f, Value v, Scope& sc) {
    CallArgs a = eval_args(f, sc);
    return call_filter(f.name, std::move(v), a, t_.opts);
  }
};

}  // namespace

std::string render_impl(const Template::Impl& t, const Dict& context) {
  Interp in(t, context);
  try {
    return in.run();
  } catch (const JErr& e) {
    throw talon::Error(fmt::format("template '{}': {}", t.name, e.what()));
  }
}

}  // namespace talon::text::jinja
