// Jinja2 subset, second stage: a recursive-descent parser from tokens to the AST of
// jinja_internal.h, following jinja2/parser.py's precedence and its error messages.
// Unknown filter and test names are syntax errors here, as in Jinja's compiler.
#include <algorithm>

#include "text/jinja_internal.h"

namespace talon::text::jinja {

namespace {

class Parser {
 public:
  Parser(std::vector<Tok> toks, const std::string& name) : t_(std::move(toks)), name_(name) {}

  Body parse_template() {
    Body b = subparse({});
    if (cur().type != T::Eof) err("unexpected token");
    return b;
  }

 private:
  const Tok& cur() const { return t_[i_]; }
  const Tok& peek(size_t k = 1) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  const Tok& next() {
    const Tok& t = t_[i_];
    if (i_ + 1 < t_.size()) ++i_;
    return t;
  }
  [[noreturn]] void err(const std::string& m) const { throw SyntaxError(name_, cur().line, m); }
  // Children go in through add()/grow(), which track the tree's height.
  void grow(Expr* p, const ExprP& c) {
    if (c && c->depth + 1 > p->depth) {
      p->depth = c->depth + 1;
      if (p->depth > kMaxExprDepth) err(fmt::format("expression nested deeper than {} levels", kMaxExprDepth));
    }
  }
  void add(Expr* p, ExprP c) {
    grow(p, c);
    p->a.push_back(std::move(c));
  }
  // Bounds the parser's own recursion (parentheses, unary chains, nested blocks).
  struct Nest {
    int& n;
    Nest(const Parser& p, int& counter, int limit, const char* what) : n(counter) {
      if (++n > limit) {
        --n;
        p.err(fmt::format("{} nested deeper than {} levels", what, limit));
      }
    }
    ~Nest() { --n; }
  };
  int expr_nest_ = 0, block_nest_ = 0;
  bool is_op(const char* o) const { return cur().type == T::Op && cur().val == o; }
  bool is_name(const char* n) const { return cur().type == T::Name && cur().val == n; }
  bool skip_op(const char* o) {
    if (!is_op(o)) return false;
    next();
    return true;
  }
  bool skip_name(const char* n) {
    if (!is_name(n)) return false;
    next();
    return true;
  }
  static std::string describe(const Tok& t) {
    switch (t.type) {
      case T::Eof: return "end of template";
      case T::BlockEnd: return "end of statement block";
      case T::VarEnd: return "end of print statement";
      case T::BlockBegin: return "begin of statement block";
      case T::VarBegin: return "begin of print statement";
      case T::Data: return "template data";
      default: return t.val;
    }
  }
  void expect_op(const char* o) {
    if (!skip_op(o)) err(fmt::format("expected token '{}', got '{}'", o, describe(cur())));
  }
  void expect(T type, const char* what) {
    if (cur().type != type) err(fmt::format("expected token '{}', got '{}'", what, describe(cur())));
    next();
  }
  std::string expect_name() {
    if (cur().type != T::Name) err(fmt::format("expected token 'name', got '{}'", describe(cur())));
    return next().val;
  }

  ExprP mk(EK k, int line) {
    auto e = std::make_unique<Expr>();
    e->k = k;
    e->line = line;
    return e;
  }

  // ---- statements
  Body subparse(const std::vector<std::string>& end_tokens) {
    Nest guard(*this, block_nest_, kMaxBlockDepth, "blocks");
    Body body;
    while (true) {
      const Tok& t = cur();
      if (t.type == T::Eof) {
        if (!end_tokens.empty())
          err(fmt::format("Unexpected end of template. Jinja was looking for the following tags: '{}'.",
                          end_tokens[0]));
        return body;
      }
      if (t.type == T::Data) {
        auto s = std::make_unique<Stmt>();
        s->k = SK::Data;
        s->line = t.line;
        s->text = t.val;
        next();
        body.push_back(std::move(s));
      } else if (t.type == T::VarBegin) {
        next();
        auto s = std::make_unique<Stmt>();
        s->k = SK::Print;
        s->line = cur().line;
        s->e = parse_tuple(true);
        expect(T::VarEnd, "end of print statement");
        body.push_back(std::move(s));
      } else if (t.type == T::BlockBegin) {
        next();
        if (cur().type == T::Name &&
            std::find(end_tokens.begin(), end_tokens.end(), cur().val) != end_tokens.end())
          return body;
        body.push_back(parse_statement());
        expect(T::BlockEnd, "end of statement block");
      } else {
        err("unexpected token '" + describe(t) + "'");
      }
    }
  }

  Body parse_statements(const std::vector<std::string>& end, bool drop_needle) {
    expect(T::BlockEnd, "end of statement block");
    Body b = subparse(end);
    if (cur().type == T::Eof)
      err(fmt::format("Unexpected end of template. Jinja was looking for the following tags: '{}'.", end[0]));
    if (drop_needle) next();
    return b;
  }

  StmtP parse_statement() {
    if (cur().type != T::Name) err("tag name expected");
    std::string tag = cur().val;
    int line = cur().line;
    auto s = std::make_unique<Stmt>();
    s->line = line;
    if (tag == "if") {
      next();
      s->k = SK::If;
      s->conds.push_back(parse_tuple(false));
      s->bodies.push_back(parse_statements({"elif", "else", "endif"}, false));
      while (true) {
        std::string kw = next().val;
        if (kw == "elif") {
          s->conds.push_back(parse_tuple(false));
          s->bodies.push_back(parse_statements({"elif", "else", "endif"}, false));
        } else if (kw == "else") {
          s->bodies.push_back(parse_statements({"endif"}, true));
          break;
        } else {
          break;
        }
      }
    } else if (tag == "for") {
      next();
      s->k = SK::For;
      s->targets = parse_targets();
      if (!skip_name("in")) err(fmt::format("expected token 'in', got '{}'", describe(cur())));
      s->e = parse_tuple(false);
      if (is_name("recursive")) err("recursive for loops are not supported");
      if (skip_name("if")) s->cond = parse_expression(true);
      s->bodies.push_back(parse_statements({"endfor", "else"}, false));
      if (next().val == "else") s->bodies.push_back(parse_statements({"endfor"}, true));
    } else if (tag == "set") {
      next();
      std::string first = expect_name();
      if (skip_op(".")) {
        s->k = SK::SetAttr;
        s->targets = {first, expect_name()};
      } else {
        s->k = SK::Set;
        s->targets = {first};
        while (skip_op(",")) {
          if (cur().type != T::Name) break;
          s->targets.push_back(next().val);
        }
      }
      if (skip_op("=")) {
        s->e = parse_tuple(true);
      } else {
        if (s->k != SK::Set || s->targets.size() != 1) err("expected token '='");
        s->k = SK::SetBlock;
        if (is_op("|")) s->cond = parse_filter_chain(nullptr);
        s->bodies.push_back(parse_statements({"endset"}, true));
      }
    } else if (tag == "macro") {
      next();
      s->k = SK::Macro;
      s->text = expect_name();
      expect_op("(");
      while (!is_op(")")) {
        if (!s->targets.empty()) expect_op(",");
        if (is_op(")")) break;
        s->targets.push_back(expect_name());
        if (skip_op("=")) s->defaults.push_back(parse_expression(true));
        else s->defaults.push_back(nullptr);
      }
      expect_op(")");
      s->bodies.push_back(parse_statements({"endmacro"}, true));
    } else if (tag == "break" || tag == "continue") {
      next();
      s->k = tag == "break" ? SK::Break : SK::Continue;
    } else if (tag == "generation") {
      next();
      s->k = SK::Generation;
      s->bodies.push_back(parse_statements({"endgeneration"}, true));
    } else if (tag == "filter") {
      next();
      s->k = SK::FilterBlock;
      s->cond = parse_filter_chain(nullptr, true);
      s->bodies.push_back(parse_statements({"endfilter"}, true));
    } else if (tag == "call" || tag == "include" || tag == "import" || tag == "from" || tag == "extends" ||
               tag == "block" || tag == "with" || tag == "autoescape" || tag == "do") {
      err(fmt::format("tag '{}' is not supported by talon's Jinja subset", tag));
    } else {
      err(fmt::format("Encountered unknown tag '{}'.", tag));
    }
    return s;
  }

  std::vector<std::string> parse_targets() {
    std::vector<std::string> names;
    bool paren = skip_op("(");
    names.push_back(expect_name());
    while (skip_op(",")) {
      if (cur().type != T::Name) break;
      names.push_back(next().val);
    }
    if (paren) expect_op(")");
    return names;
  }

  // ---- expressions
  ExprP parse_tuple(bool with_condexpr) {
    int line = cur().line;
    ExprP first = parse_expression(with_condexpr);
    if (!is_op(",")) return first;
    auto t = mk(EK::TupleLit, line);
    add(t.get(), std::move(first));
    while (skip_op(",")) {
      if (cur().type == T::VarEnd || cur().type == T::BlockEnd || is_op(")") || is_name("if")) break;
      add(t.get(), parse_expression(with_condexpr));
    }
    return t;
  }

  ExprP parse_expression(bool with_condexpr) {
    Nest guard(*this, expr_nest_, kMaxExprDepth, "expression");
    if (!with_condexpr) return parse_or();
    int line = cur().line;
    ExprP e = parse_or();
    while (skip_name("if")) {
      auto c = mk(EK::Cond, line);
      ExprP test = parse_or();
      ExprP other = skip_name("else") ? parse_expression(true) : nullptr;
      add(c.get(), std::move(test));   // a[0] = test
      add(c.get(), std::move(e));      // a[1] = then
      add(c.get(), std::move(other));  // a[2] = else (may be null)
      e = std::move(c);
    }
    return e;
  }

  ExprP parse_or() {
    ExprP l = parse_and();
    while (is_name("or")) {
      int line = next().line;
      auto o = mk(EK::Or, line);
      add(o.get(), std::move(l));
      add(o.get(), parse_and());
      l = std::move(o);
    }
    return l;
  }
  ExprP parse_and() {
    ExprP l = parse_not();
    while (is_name("and")) {
      int line = next().line;
      auto o = mk(EK::And, line);
      add(o.get(), std::move(l));
      add(o.get(), parse_not());
      l = std::move(o);
    }
    return l;
  }
  ExprP parse_not() {
    if (is_name("not")) {
      int line = next().line;
      auto o = mk(EK::Not, line);
      add(o.get(), parse_not());
      return o;
    }
    return parse_compare();
  }
  ExprP parse_compare() {
    int line = cur().line;
    ExprP e = parse_math1();
    ExprP cmp;
    while (true) {
      std::string op;
      if (cur().type == T::Op &&
          (cur().val == "==" || cur().val == "!=" || cur().val == "<" || cur().val == ">" || cur().val == "<=" ||
           cur().val == ">=")) {
        op = next().val;
      } else if (is_name("in")) {
        next();
        op = "in";
      } else if (is_name("not") && peek().type == T::Name && peek().val == "in") {
        next();
        next();
        op = "notin";
      } else {
        break;
      }
      if (!cmp) {
        cmp = mk(EK::Cmp, line);
        add(cmp.get(), std::move(e));
      }
      cmp->ops.push_back(op);
      add(cmp.get(), parse_math1());
    }
    return cmp ? std::move(cmp) : std::move(e);
  }
  ExprP bin(const std::string& op, ExprP l, ExprP r, int line) {
    auto b = mk(EK::Bin, line);
    b->name = op;
    add(b.get(), std::move(l));
    add(b.get(), std::move(r));
    return b;
  }
  ExprP parse_math1() {
    ExprP l = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Tok& t = next();
      std::string op = t.val;
      l = bin(op, std::move(l), parse_concat(), t.line);
    }
    return l;
  }
  ExprP parse_concat() {
    ExprP l = parse_math2();
    while (is_op("~")) {
      int line = next().line;
      l = bin("~", std::move(l), parse_math2(), line);
    }
    return l;
  }
  ExprP parse_math2() {
    ExprP l = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Tok& t = next();
      std::string op = t.val;
      l = bin(op, std::move(l), parse_pow(), t.line);
    }
    return l;
  }
  ExprP parse_pow() {
    ExprP l = parse_unary(true);
    while (is_op("**")) {
      int line = next().line;
      l = bin("**", std::move(l), parse_unary(true), line);
    }
    return l;
  }
  ExprP parse_unary(bool with_filter) {
    Nest guard(*this, expr_nest_, kMaxExprDepth, "expression");
    ExprP node;
    int line = cur().line;
    if (is_op("-") || is_op("+")) {
      bool neg = next().val == "-";
      node = mk(neg ? EK::Neg : EK::Pos, line);
      add(node.get(), parse_unary(false));
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }
  ExprP parse_primary() {
    const Tok& t = cur();
    int line = t.line;
    if (t.type == T::Name) {
      std::string v = next().val;
      if (v == "true" || v == "True") return lit(Value(true), line);
      if (v == "false" || v == "False") return lit(Value(false), line);
      if (v == "none" || v == "None") return lit(Value::none(), line);
      auto n = mk(EK::Name, line);
      n->name = v;
      return n;
    }
    if (t.type == T::String) {
      std::string s = next().val;
      while (cur().type == T::String) s += next().val;
      return lit(Value(std::move(s)), line);
    }
    if (t.type == T::Int) return lit(Value(next().ival), line);
    if (t.type == T::Float) return lit(Value(next().fval), line);
    if (is_op("(")) {
      next();
      if (skip_op(")")) {
        auto tup = mk(EK::TupleLit, line);
        return tup;
      }
      ExprP e = parse_tuple(true);
      if (e->k == EK::TupleLit && is_op(")")) {
        next();
        return e;
      }
      expect_op(")");
      return e;
    }
    if (is_op("[")) {
      next();
      auto l = mk(EK::ListLit, line);
      while (!is_op("]")) {
        if (!l->a.empty()) expect_op(",");
        if (is_op("]")) break;
        add(l.get(), parse_expression(true));
      }
      expect_op("]");
      return l;
    }
    if (is_op("{")) {
      next();
      auto d = mk(EK::DictLit, line);
      while (!is_op("}")) {
        if (!d->a.empty()) expect_op(",");
        if (is_op("}")) break;
        add(d.get(), parse_expression(true));
        expect_op(":");
        add(d.get(), parse_expression(true));
      }
      expect_op("}");
      return d;
    }
    err(fmt::format("unexpected '{}'", describe(t)));
  }
  ExprP lit(Value v, int line) {
    auto e = mk(EK::Lit, line);
    e->lit = std::move(v);
    return e;
  }
  ExprP parse_postfix(ExprP node) {
    while (true) {
      if (is_op(".")) {
        int line = next().line;
        if (cur().type == T::Name) {
          auto a = mk(EK::Attr, line);
          a->name = next().val;
          add(a.get(), std::move(node));
          node = std::move(a);
        } else if (cur().type == T::Int) {
          auto a = mk(EK::Item, line);
          add(a.get(), std::move(node));
          add(a.get(), lit(Value(next().ival), line));
          node = std::move(a);
        } else {
          err("expected name or number");
        }
      } else if (is_op("[")) {
        node = parse_subscript(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }
  ExprP parse_subscript(ExprP node) {
    int line = next().line;  // [
    ExprP parts[3];
    bool is_slice = false;
    if (!is_op(":")) parts[0] = parse_expression(true);
    if (skip_op(":")) {
      is_slice = true;
      if (!is_op("]") && !is_op(":")) parts[1] = parse_expression(true);
      if (skip_op(":"))
        if (!is_op("]")) parts[2] = parse_expression(true);
    }
    expect_op("]");
    if (!is_slice) {
      auto it = mk(EK::Item, line);
      add(it.get(), std::move(node));
      add(it.get(), std::move(parts[0]));
      return it;
    }
    auto s = mk(EK::Slice, line);
    add(s.get(), std::move(node));
    for (auto& p : parts) add(s.get(), std::move(p));
    return s;
  }
  void parse_args(Expr& call) {
    expect_op("(");
    bool first = true;
    while (!is_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (is_op(")")) break;
      if (is_op("*") || is_op("**")) err("*args / **kwargs calls are not supported");
      if (cur().type == T::Name && peek().type == T::Op && peek().val == "=") {
        std::string k = next().val;
        next();
        ExprP v = parse_expression(true);
        grow(&call, v);
        call.kw.emplace_back(k, std::move(v));
      } else {
        if (!call.kw.empty()) err("invalid syntax for function call expression");
        add(&call, parse_expression(true));
      }
    }
    expect_op(")");
  }
  ExprP parse_call(ExprP node) {
    auto c = mk(EK::Call, cur().line);
    add(c.get(), std::move(node));
    parse_args(*c);
    return c;
  }
  ExprP parse_filter_expr(ExprP node) {
    while (true) {
      if (is_op("|")) {
        node = parse_filter_chain(std::move(node), false, true);
      } else if (is_name("is")) {
        node = parse_test(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }
  // | f1(args) | f2 ... ; subject may be null (filter blocks / set blocks).
  ExprP parse_filter_chain(ExprP subject, bool start_without_pipe = false, bool single = false) {
    bool first = true;
    while (true) {
      if (!(first && start_without_pipe)) {
        if (!skip_op("|")) break;
      }
      first = false;
      int line = cur().line;
      std::string name = expect_name();
      while (skip_op(".")) {
        name += '.';
        name += expect_name();
      }
      check_filter(name);
      auto f = mk(EK::Filter, line);
      f->name = name;
      add(f.get(), std::move(subject));
      if (is_op("(")) parse_args(*f);
      subject = std::move(f);
      if (single) break;
    }
    return subject;
  }
  ExprP parse_test(ExprP node) {
    int line = next().line;  // is
    bool negated = skip_name("not");
    std::string name = expect_name();
    while (skip_op(".")) {
      name += '.';
      name += expect_name();
    }
    check_test(name);
    auto t = mk(EK::Test, line);
    t->name = name;
    t->negated = negated;
    add(t.get(), std::move(node));
    if (is_op("(")) {
      parse_args(*t);
    } else if ((cur().type == T::Name || cur().type == T::String || cur().type == T::Int ||
                cur().type == T::Float || is_op("(") || is_op("[") || is_op("{")) &&
               !is_name("else") && !is_name("or") && !is_name("and")) {
      if (is_name("is")) err("You cannot chain multiple tests with is");
      ExprP arg = parse_primary();
      arg = parse_postfix(std::move(arg));
      add(t.get(), std::move(arg));
    }
    return t;
  }
  void check_filter(const std::string& name) {
    if (filter_known(name)) return;
    if (filter_jinja_builtin(name)) err(fmt::format("filter '{}' is not supported by talon's Jinja subset", name));
    err(fmt::format("No filter named '{}'.", name));
  }
  void check_test(const std::string& name) {
    if (test_known(name)) return;
    err(fmt::format("No test named '{}'.", name));
  }

  std::vector<Tok> t_;
  size_t i_ = 0;
  const std::string& name_;
};

}  // namespace

Body parse(std::vector<Tok> toks, const std::string& name) { return Parser(std::move(toks), name).parse_template(); }

}  // namespace talon::text::jinja
