// Internal: the tokens, the AST and the entry points of the three stages (lexer, parser,
// evaluator) that jinja::Template chains.
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "text/jinja.h"

namespace talon::text::jinja {

// Sandbox bounds of the parser: nesting of expressions and of statement blocks. Real chat
// templates stay below 20 and 10; the bounds keep the parser's and the evaluator's
// recursion (and the destruction of the tree) far from the stack's end.
inline constexpr int kMaxExprDepth = 100;
inline constexpr int kMaxBlockDepth = 100;

enum class T { Data, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, Eof };
struct Tok {
  T type;
  std::string val;
  int line;
  int64_t ival;
  double fval;
};

enum class EK { Lit, Name, Attr, Item, Slice, Call, Filter, Test, Neg, Pos, Not, And, Or, Bin, Cmp, Cond,
                ListLit, TupleLit, DictLit };
struct Expr;
using ExprP = std::unique_ptr<Expr>;
// Children layout by kind:
//   Attr: a[0] . name          Item: a[0][a[1]]           Slice: a[0][a[1]:a[2]:a[3]] (nullable)
//   Call: a[0](a[1..], kw)     Filter: a[0]|name(a[1..], kw) (a[0] null in filter/set blocks)
//   Test: a[0] is [not] name(a[1..])   Bin: a[0] name a[1]   Cmp: a[0] ops[0] a[1] ops[1] a[2] ...
//   Cond: a[1] if a[0] else a[2]       DictLit: key, value, key, value ...
struct Expr {
  EK k;
  int line = 0;
  int depth = 1;  // height of this subtree (bounded by the parser: kMaxExprDepth)
  Value lit;
  std::string name;
  bool negated = false;
  std::vector<ExprP> a;
  std::vector<std::pair<std::string, ExprP>> kw;
  std::vector<std::string> ops;
};

enum class SK { Data, Print, If, For, Set, SetAttr, SetBlock, Macro, Break, Continue, Generation, FilterBlock };
struct Stmt;
using StmtP = std::unique_ptr<Stmt>;
using Body = std::vector<StmtP>;
// If: conds[i] -> bodies[i], bodies[conds.size()] = else.  For: targets in e [if cond] bodies[0] [else bodies[1]]
// Set: targets = e.  SetAttr: targets[0].targets[1] = e.  SetBlock: targets[0] = bodies[0] (| cond filters)
// Macro: text(targets = defaults) bodies[0].  FilterBlock: cond = filter chain over bodies[0].
struct Stmt {
  SK k;
  int line = 0;
  std::string text;
  ExprP e, cond;
  std::vector<std::string> targets;
  std::vector<ExprP> defaults;
  std::vector<ExprP> conds;
  std::vector<Body> bodies;
};

struct Template::Impl {
  std::string name;
  Options opts;
  Body body;
};

// jinja_lexer.cpp: the token stream of `source` (ends with T::Eof); throws SyntaxError.
std::vector<Tok> lex(std::string_view source, const std::string& name, const Options& opts);
// jinja_parser.cpp: the template's statements; throws SyntaxError.
Body parse(std::vector<Tok> toks, const std::string& name);
// jinja_eval.cpp: renders a parsed template.
std::string render_impl(const Template::Impl& t, const Dict& context);

// jinja_filters.cpp: the names the parser accepts after `|` and `is`, and the Jinja
// built-in filters talon leaves out (named as such in the error).
bool filter_known(const std::string& name);
bool filter_jinja_builtin(const std::string& name);
bool test_known(const std::string& name);

}  // namespace talon::text::jinja
