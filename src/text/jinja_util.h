// Internal helpers shared by the jinja_*.cpp files (UTF-8, Python formatting).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace talon::text::jinja {
std::vector<uint32_t> utf8_decode(std::string_view s);
void utf8_append(std::string& out, uint32_t cp);
std::string utf8_encode(const std::vector<uint32_t>& cps, size_t begin, size_t end);
size_t utf8_length(std::string_view s);
bool py_isspace(uint32_t c);           // Python str.isspace() for one code point
std::string python_float_repr(double d);
std::string python_str_repr(const std::string& s);
}  // namespace talon::text::jinja
