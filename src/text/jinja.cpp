// Jinja2 subset: lexer (with Jinja's exact trim_blocks / lstrip_blocks / "-" rules),
// recursive-descent parser following jinja2/parser.py's precedence, and the evaluator.
#include "text/jinja.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <unordered_map>

#include "text/jinja_internal.h"
#include "text/jinja_util.h"

namespace talon::text::jinja {

// ============================================================================ lexer
namespace {

bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

std::string rstrip_ws(const std::string& s) {
  // Python str.rstrip(): unicode whitespace.
  auto cps = utf8_decode(s);
  size_t e = cps.size();
  while (e > 0 && py_isspace(cps[e - 1])) --e;
  if (e == cps.size()) return s;
  return utf8_encode(cps, 0, e);
}

// Python's unicode-escape decoding of a string literal body (non-ASCII passes through).
std::string unescape(const std::string& body, const std::string& tname, int line) {
  std::string out;
  for (size_t i = 0; i < body.size(); ++i) {
    char c = body[i];
    if (c != '\\' || i + 1 >= body.size()) {
      out += c;
      continue;
    }
    char n = body[++i];
    auto hex = [&](size_t digits) -> uint32_t {
      uint32_t v = 0;
      for (size_t k = 0; k < digits; ++k) {
        if (i + 1 >= body.size() || !std::isxdigit(static_cast<unsigned char>(body[i + 1])))
          throw SyntaxError(tname, line, "truncated escape sequence in string literal");
        char h = body[++i];
        v = v * 16 + uint32_t(std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : (std::tolower(h) - 'a' + 10));
      }
      return v;
    };
    switch (n) {
      case '\n': break;
      case '\\': out += '\\'; break;
      case '\'': out += '\''; break;
      case '"': out += '"'; break;
      case 'a': out += '\a'; break;
      case 'b': out += '\b'; break;
      case 'f': out += '\f'; break;
      case 'n': out += '\n'; break;
      case 'r': out += '\r'; break;
      case 't': out += '\t'; break;
      case 'v': out += '\v'; break;
      case 'x': utf8_append(out, hex(2)); break;
      case 'u': utf8_append(out, hex(4)); break;
      case 'U': utf8_append(out, hex(8)); break;
      default:
        if (n >= '0' && n <= '7') {
          uint32_t v = uint32_t(n - '0');
          for (int k = 0; k < 2 && i + 1 < body.size() && body[i + 1] >= '0' && body[i + 1] <= '7'; ++k)
            v = v * 8 + uint32_t(body[++i] - '0');
          utf8_append(out, v);
        } else {
          out += '\\';
          out += n;
        }
    }
  }
  return out;
}

class Lexer {
 public:
  Lexer(std::string_view source, const std::string& name, const Options& opt) : name_(name), opt_(opt) {
    src_.reserve(source.size());
    for (size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r') {
        src_ += '\n';
        if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
      } else {
        src_ += source[i];
      }
    }
    if (!opt_.keep_trailing_newline && !src_.empty() && src_.back() == '\n') src_.pop_back();
  }

  std::vector<Tok> run() {
    size_t n = src_.size();
    while (pos_ < n) {
      size_t p = pos_;
      while (true) {
        p = src_.find('{', p);
        if (p == std::string::npos || p + 1 >= n) {
          p = std::string::npos;
          break;
        }
        char c = src_[p + 1];
        if (c == '{' || c == '%' || c == '#') break;
        ++p;
      }
      if (p == std::string::npos) {
        push(T::Data, src_.substr(pos_));
        break;
      }
      std::string text = src_.substr(pos_, p - pos_);
      char kind = src_[p + 1];
      size_t q = p + 2;
      char sign = 0;
      if (q < n && (src_[q] == '-' || src_[q] == '+')) sign = src_[q++];
      int text_lines = int(std::count(text.begin(), text.end(), '\n'));
      // raw block?
      bool raw = false;
      size_t raw_body = 0;
      if (kind == '%') {
        size_t r = q;
        while (r < n && is_ws(src_[r])) ++r;
        if (src_.compare(r, 3, "raw") == 0) {
          r += 3;
          while (r < n && is_ws(src_[r])) ++r;
          if (src_.compare(r, 3, "-%}") == 0) {
            r += 3;
            while (r < n && is_ws(src_[r])) ++r;
            raw = true;
          } else if (src_.compare(r, 2, "%}") == 0) {
            r += 2;
            raw = true;
          }
          raw_body = r;
        }
      }
      if (sign == '-') {
        text = rstrip_ws(text);
      } else if (sign != '+' && opt_.lstrip_blocks && kind != '{') {
        size_t l = text.rfind('\n');
        l = (l == std::string::npos) ? 0 : l + 1;
        if ((l > 0 || line_starting_) && l < text.size() &&
            std::all_of(text.begin() + long(l), text.end(), [](char c) { return is_ws(c); }))
          text.resize(l);
      }
      if (!text.empty()) push(T::Data, text);
      line_ += text_lines;
      if (raw) {
        lex_raw(raw_body, p);
        continue;
      }
      pos_ = q;
      line_starting_ = false;
      if (kind == '#') {
        lex_comment();
      } else {
        push(kind == '{' ? T::VarBegin : T::BlockBegin, "");
        lex_tag(kind == '{');
      }
    }
    push(T::Eof, "");
    return std::move(toks_);
  }

 private:
  void push(T t, std::string v) { toks_.push_back(Tok{t, std::move(v), line_, 0, 0}); }
  [[noreturn]] void err(const std::string& m) { throw SyntaxError(name_, line_, m); }

  // consume the end marker of a block/comment starting at i (src_[i..] is "+X}", "-X}" or "X}")
  void finish_end(size_t i, char marker) {
    size_t n = src_.size();
    size_t e;
    if (src_[i] == '+') {
      e = i + 3;
    } else if (src_[i] == '-') {
      e = i + 3;
      while (e < n && is_ws(src_[e])) ++e;
    } else {
      e = i + 2;
      if (marker != '}' && opt_.trim_blocks && e < n && src_[e] == '\n') ++e;
    }
    line_ += int(std::count(src_.begin() + long(i), src_.begin() + long(e), '\n'));
    line_starting_ = e > 0 && src_[e - 1] == '\n';
    pos_ = e;
  }

  void lex_comment() {
    size_t n = src_.size();
    for (size_t i = pos_; i < n; ++i) {
      bool signed_end = (src_[i] == '+' || src_[i] == '-') && src_.compare(i + 1, 2, "#}") == 0;
      if (signed_end || src_.compare(i, 2, "#}") == 0) {
        line_ += int(std::count(src_.begin() + long(pos_), src_.begin() + long(i), '\n'));
        finish_end(i, '#');
        return;
      }
    }
    err("Missing end of comment tag");
  }

  void lex_raw(size_t body, size_t tag_start) {
    size_t n = src_.size();
    line_ += int(std::count(src_.begin() + long(tag_start), src_.begin() + long(body), '\n'));
    for (size_t i = body; i + 1 < n; ++i) {
      if (src_[i] != '{' || src_[i + 1] != '%') continue;
      size_t r = i + 2;
      char sign = 0;
      if (r < n && (src_[r] == '-' || src_[r] == '+')) sign = src_[r++];
      while (r < n && is_ws(src_[r])) ++r;
      if (src_.compare(r, 6, "endraw") != 0) continue;
      r += 6;
      while (r < n && is_ws(src_[r])) ++r;
      bool signed_end = (src_[r] == '+' || src_[r] == '-') && src_.compare(r + 1, 2, "%}") == 0;
      if (!signed_end && src_.compare(r, 2, "%}") != 0) continue;
      std::string text = src_.substr(body, i - body);
      int text_lines = int(std::count(text.begin(), text.end(), '\n'));
      if (sign == '-') {
        text = rstrip_ws(text);
      } else if (sign != '+' && opt_.lstrip_blocks) {
        size_t l = text.rfind('\n');
        l = (l == std::string::npos) ? 0 : l + 1;
        if (l > 0 && l < text.size() &&
            std::all_of(text.begin() + long(l), text.end(), [](char c) { return is_ws(c); }))
          text.resize(l);
      }
      if (!text.empty()) push(T::Data, text);
      line_ += text_lines;
      line_ += int(std::count(src_.begin() + long(i), src_.begin() + long(r), '\n'));
      finish_end(r, '%');
      return;
    }
    err("Missing end of raw directive");
  }

  void lex_tag(bool var) {
    size_t n = src_.size();
    std::vector<char> balance;
    while (true) {
      while (pos_ < n && is_ws(src_[pos_])) {
        if (src_[pos_] == '\n') ++line_;
        ++pos_;
      }
      if (pos_ >= n) err(var ? "unexpected end of template, expected 'end of print statement'."
                             : "unexpected end of template, expected 'end of statement block'.");
      if (balance.empty()) {
        if (var) {
          if (src_.compare(pos_, 3, "-}}") == 0) {
            push(T::VarEnd, "");
            size_t e = pos_ + 3;
            while (e < n && is_ws(src_[e])) ++e;
            line_ += int(std::count(src_.begin() + long(pos_), src_.begin() + long(e), '\n'));
            line_starting_ = src_[e - 1] == '\n';
            pos_ = e;
            return;
          }
          if (src_.compare(pos_, 2, "}}") == 0) {
            push(T::VarEnd, "");
            pos_ += 2;
            line_starting_ = false;
            return;
          }
        } else {
          bool signed_end = (src_[pos_] == '+' || src_[pos_] == '-') && src_.compare(pos_ + 1, 2, "%}") == 0;
          if (signed_end || src_.compare(pos_, 2, "%}") == 0) {
            push(T::BlockEnd, "");
            finish_end(pos_, '%');
            return;
          }
        }
      }
      char c = src_[pos_];
      // float / integer
      if (std::isdigit(static_cast<unsigned char>(c))) {
        size_t e = pos_;
        while (e < n && (std::isdigit(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        bool is_float = false;
        if (e + 1 < n && src_[e] == '.' && std::isdigit(static_cast<unsigned char>(src_[e + 1]))) {
          is_float = true;
          ++e;
          while (e < n && (std::isdigit(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        }
        if (e < n && (src_[e] == 'e' || src_[e] == 'E')) {
          size_t f = e + 1;
          if (f < n && (src_[f] == '+' || src_[f] == '-')) ++f;
          if (f < n && std::isdigit(static_cast<unsigned char>(src_[f]))) {
            is_float = true;
            e = f;
            while (e < n && (std::isdigit(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
          }
        }
        std::string lit;
        for (size_t k = pos_; k < e; ++k)
          if (src_[k] != '_') lit += src_[k];
        if (is_float) {
          push(T::Float, lit);
          // As Python's float() does: past the double range a literal is inf (or 0), not an
          // error. strtod gives HUGE_VAL / 0 with ERANGE there (the C locale: talon never
          // sets another).
          toks_.back().fval = std::strtod(lit.c_str(), nullptr);
        } else {
          push(T::Int, lit);
          try {
            toks_.back().ival = std::stoll(lit);
          } catch (...) {
            err("integer literal out of range: " + lit);
          }
        }
        pos_ = e;
        continue;
      }
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t e = pos_;
        while (e < n && (std::isalnum(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        push(T::Name, src_.substr(pos_, e - pos_));
        pos_ = e;
        continue;
      }
      if (c == '\'' || c == '"') {
        size_t e = pos_ + 1;
        while (e < n && src_[e] != c) {
          if (src_[e] == '\\') ++e;
          ++e;
        }
        if (e >= n) err("unexpected char '" + std::string(1, c) + "'");
        std::string body = src_.substr(pos_ + 1, e - pos_ - 1);
        push(T::String, unescape(body, name_, line_));
        line_ += int(std::count(body.begin(), body.end(), '\n'));
        pos_ = e + 1;
        continue;
      }
      static const char* ops2[] = {"//", "**", "==", "!=", ">=", "<="};
      std::string op;
      for (const char* o : ops2)
        if (src_.compare(pos_, 2, o) == 0) op = o;
      if (op.empty() && std::strchr("+-/*%~[](){}=><.:|,;", c)) op = std::string(1, c);
      if (op.empty()) err(fmt::format("unexpected char '{}' at {}", c, pos_));
      if (op == "{" || op == "(" || op == "[") balance.push_back(op == "{" ? '}' : op == "(" ? ')' : ']');
      if (op == "}" || op == ")" || op == "]") {
        if (balance.empty()) err("unexpected '" + op + "'");
        if (balance.back() != op[0]) err(fmt::format("unexpected '{}', expected '{}'", op, balance.back()));
        balance.pop_back();
      }
      push(T::Op, op);
      pos_ += op.size();
    }
  }

  const std::string& name_;
  Options opt_;
  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
  bool line_starting_ = true;
  std::vector<Tok> toks_;
};

// ============================================================================ parser
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

// ============================================================================ Template
Template::Template(std::string_view source, std::string name, Options opts) : impl_(std::make_unique<Impl>()) {
  impl_->name = std::move(name);
  impl_->opts = opts;
  Lexer lx(source, impl_->name, opts);
  Parser p(lx.run(), impl_->name);
  impl_->body = p.parse_template();
}
Template::~Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;
const std::string& Template::name() const { return impl_->name; }

std::string Template::render(const Dict& context) const { return render_impl(*impl_, context); }

}  // namespace talon::text::jinja
