// Internal: what the evaluator (jinja_eval.cpp), the filters and tests (jinja_filters.cpp)
// and the Python methods (jinja_methods.cpp) share: the runtime error without a location,
// Python's semantics of operations on values (jinja_ops.cpp) and of str (jinja_strings.cpp).
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "text/jinja.h"

namespace talon::text::jinja {

// An error without a location yet; the innermost statement adds template name + line.
struct JErr : std::runtime_error {
  using std::runtime_error::runtime_error;
};
[[noreturn]] void jfail(const std::string& m);

// Strings that filters and methods build are bounded (the render's output has its own,
// configurable bound): a hostile template cannot make one allocation run away.
void built(size_t n);
// `what` would pass the render's byte limit (Options::max_output).
[[noreturn]] void too_big(const char* what, size_t max_output);
// v, or the integer-overflow error when `overflow`.
int64_t checked(bool overflow, int64_t v);
// Operating on an undefined value fails with its hint (Jinja's UndefinedError).
[[noreturn]] void undefined_fail(const Value& v);

// ---------------------------------------------------------------- jinja_ops.cpp
// Jinja's undefined for obj[key] / obj.name where obj has no such element / attribute.
Value no_element(const Value& obj, const std::string& key);
Value missing_attr(const Value& obj, const std::string& name);
// Python slice index normalisation for a sequence of n items.
void slice_indices(int64_t n, const Value* a, const Value* b, const Value* c, int64_t& start, int64_t& stop,
                   int64_t& step);
List iterate(const Value& v);                                     // Python iter()
int64_t py_len(const Value& v);                                   // Python len()
int compare(const Value& a, const Value& b, const char* op);      // -1 / 0 / 1; op names the operator in errors
bool contains(const Value& container, const Value& item);         // item in container
// l op r for the binary operators + - * / // % ** ~ (results bounded by max_output bytes).
Value binop(const std::string& op, const Value& l, const Value& r, size_t max_output);
Value slice(const Value& obj, const Value* a, const Value* b, const Value* c);  // obj[a:b:c]
Value get_item(const Value& obj, const Value& key);               // obj[key]
Value get_attr(const Value& obj, const std::string& name);        // obj.name
Value attr_path(const Value& item, const std::string& path);      // "a.0.b" as filters' attribute= take it

// ---------------------------------------------------------------- jinja_strings.cpp
bool all_digits(std::string_view s);  // non-empty and only ASCII digits
// Simple case mapping: ASCII, Latin-1, Latin Extended-A, Greek, Cyrillic (no multi-char
// mappings such as German sharp s -> "SS").
uint32_t cp_upper(uint32_t c);
uint32_t cp_lower(uint32_t c);
std::string ascii_upper(const std::string& s);
std::string ascii_lower(const std::string& s);
// Python's str methods of the same names (chars / sep: None, undefined or a str).
std::string py_title(const std::string& s);
std::string py_capitalize(const std::string& s);
std::string py_strip(const std::string& s, const Value* chars, bool left, bool right);
std::vector<std::string> py_split(const std::string& s, const Value* sepv, int64_t maxsplit, bool from_right);
std::string py_replace(const std::string& s, const std::string& old, const std::string& rep, int64_t count);
std::vector<std::string> py_splitlines(const std::string& s);

// ---------------------------------------------------------------- jinja_filters.cpp
// v | name(a); `opts` are the render's (bounds).
Value call_filter(const std::string& name, Value v, const CallArgs& a, const Options& opts);
// v is name(a)
bool call_test(const std::string& name, const Value& v, const CallArgs& a);

// ---------------------------------------------------------------- jinja_methods.cpp
// The bound Python method `name` of a str / dict / list value; undefined when there is
// none (with a hint when it exists but the sandbox refuses it).
Value method(const Value& obj, const std::string& name);

}  // namespace talon::text::jinja
