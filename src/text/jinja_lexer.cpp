// Jinja2 subset, first stage: the lexer, with Jinja's exact trim_blocks / lstrip_blocks /
// "-" / "+" whitespace rules, raw blocks, comments and Python string-literal escapes.
#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>

#include "text/jinja_internal.h"
#include "text/jinja_util.h"

namespace talon::text::jinja {

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

}  // namespace

std::vector<Tok> lex(std::string_view source, const std::string& name, const Options& opts) {
  return Lexer(source, name, opts).run();
}

}  // namespace talon::text::jinja
