// A Jinja2 subset interpreter (lexer -> AST -> tree-walking evaluator) with the
// semantics transformers' chat templates rely on: trim_blocks + lstrip_blocks,
// Python-like values (str()/repr()/truthiness, int vs float), Jinja's default
// Undefined, sandboxed attribute lookup (dict methods, str methods), loop controls.
//
// Errors: syntax errors throw jinja::SyntaxError ("template NAME line N: ..."),
// runtime errors throw talon::Error naming template and line, and a template's
// raise_exception(msg) (installed by the caller as a global) throws TemplateRaise,
// whose message() is exactly the template's text.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "util/error.h"

namespace talon::text::jinja {

using ojson = nlohmann::ordered_json;

class Value;
using List = std::vector<Value>;
struct Dict;
struct CallArgs;
using Function = std::function<Value(const CallArgs&)>;

class Value {
 public:
  enum class Kind { Undefined, None, Bool, Int, Float, String, List, Dict, Namespace, Callable };

  Value() = default;  // undefined
  static Value undefined(std::string hint = {});
  static Value none();
  Value(bool b);
  Value(int v) : Value(int64_t(v)) {}
  Value(int64_t v);
  Value(double v);
  Value(const char* s);
  Value(std::string s);
  Value(std::string_view s) : Value(std::string(s)) {}
  static Value list(List items = {}, bool tuple = false);
  static Value dict(Dict d);
  static Value dict();
  static Value namespace_(Dict d);
  static Value function(Function f, std::string name = {});

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::Undefined; }
  bool is_none() const { return kind_ == Kind::None; }
  bool is_bool() const { return kind_ == Kind::Bool; }
  bool is_int() const { return kind_ == Kind::Int; }
  bool is_float() const { return kind_ == Kind::Float; }
  bool is_number() const { return kind_ == Kind::Int || kind_ == Kind::Float || kind_ == Kind::Bool; }
  bool is_string() const { return kind_ == Kind::String; }
  bool is_list() const { return kind_ == Kind::List; }
  bool is_tuple() const { return kind_ == Kind::List && tuple_; }
  bool is_dict() const { return kind_ == Kind::Dict; }
  bool is_namespace() const { return kind_ == Kind::Namespace; }
  bool is_callable() const { return kind_ == Kind::Callable; }

  bool as_bool() const { return b_; }
  int64_t as_int() const { return i_; }     // Int (or Bool) payload
  double as_float() const;                  // Int/Float/Bool as double
  const std::string& str() const;           // String payload
  const List& items() const;                // List payload
  List& items_mut();
  const Dict& map() const;                  // Dict / Namespace payload
  Dict& map_mut();
  const Function& fn() const;
  const std::string& hint() const { return str_ ? *str_ : empty_(); }  // undefined: why / callable: name

  bool truthy() const;                      // Python truthiness (undefined -> false)
  std::string to_str() const;               // Python str() (undefined -> "")
  std::string repr() const;                 // Python repr()
  std::string type_name() const;            // Python type name: "str", "int", "dict", ...

  static Value from_json(const ojson& j);
  ojson to_json() const;                    // throws for undefined / namespace / callable

 private:
  static const std::string& empty_();
  Kind kind_ = Kind::Undefined;
  bool b_ = false;
  bool tuple_ = false;
  int64_t i_ = 0;
  double f_ = 0;
  std::shared_ptr<const std::string> str_;  // String payload / undefined hint / callable name
  std::shared_ptr<List> list_;
  std::shared_ptr<Dict> dict_;
  std::shared_ptr<Function> fn_;
};

// Insertion-ordered string-keyed mapping (Python dict semantics for our purposes).
struct Dict {
  std::vector<std::pair<std::string, Value>> entries;
  const Value* find(std::string_view key) const;
  Value* find(std::string_view key);
  void set(const std::string& key, Value v);
  bool erase(std::string_view key);
  size_t size() const { return entries.size(); }
};

struct CallArgs {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  // Argument `i` by position or by keyword `name`; nullptr when absent.
  const Value* get(size_t i, std::string_view name) const;
};

// Python-style equality / ordering used by ==, <, sort, unique, `in`.
bool equals(const Value& a, const Value& b);
// json.dumps(v, ensure_ascii=False, indent=indent, separators=..., sort_keys=...)
// indent < 0 means None (compact with ", " / ": " separators).
std::string json_dumps(const Value& v, int indent = -1, const std::string* item_sep = nullptr,
                       const std::string* key_sep = nullptr, bool sort_keys = false);

// raise_exception(msg) from a template.
struct TemplateRaise : talon::Error {
  TemplateRaise(std::string template_name, std::string message)
      : talon::Error(fmt::format("template '{}' raised: {}", template_name, message)),
        message_(std::move(message)) {}
  const std::string& message() const { return message_; }

 private:
  std::string message_;
};

// Unparsable template (also unknown filter / test names, like Jinja's compile-time checks).
struct SyntaxError : talon::Error {
  SyntaxError(const std::string& name, int line, const std::string& msg)
      : talon::Error(fmt::format("template '{}' line {}: {}", name, line, msg)), line_(line), msg_(msg) {}
  int line() const { return line_; }
  const std::string& message() const { return msg_; }

 private:
  int line_;
  std::string msg_;
};

// The renderer is a sandbox: templates reach only the context they are given and the
// built-ins (no file, environment or process access), and every render is bounded.
struct Options {
  bool trim_blocks = true;
  bool lstrip_blocks = true;
  bool keep_trailing_newline = false;
  size_t max_output = size_t(64) << 20;   // bytes of output, and of any one string or list built
  int64_t max_steps = int64_t(1) << 24;   // statements executed + loop iterations + macro calls, per render
  int max_macro_depth = 100;              // nested macro calls
};

class Template {
 public:
  // Parses now; throws SyntaxError.
  Template(std::string_view source, std::string name = "<template>", Options opts = {});
  ~Template();
  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;

  // Renders with `context` as the global variables (on top of range/namespace/dict).
  std::string render(const Dict& context) const;
  const std::string& name() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace talon::text::jinja
