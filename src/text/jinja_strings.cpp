// Python's str semantics for the Jinja subset: case mapping, strip / split / replace /
// splitlines, title / capitalize, over UTF-8 code points as CPython does.
#include <algorithm>
#include <cctype>

#include "text/jinja_runtime.h"
#include "text/jinja_util.h"

namespace talon::text::jinja {

bool all_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

uint32_t cp_upper(uint32_t c) {
  if (c < 128) return uint32_t(std::toupper(int(c)));
  if (c >= 0xe0 && c <= 0xfe && c != 0xf7) return c - 0x20;
  if (c == 0xff) return 0x178;
  if (c >= 0x100 && c <= 0x17f && c != 0x130 && c != 0x131 && c != 0x138 && c != 0x149 && c != 0x17f) {
    bool odd_lower = (c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17e);
    if (odd_lower ? (c % 2 == 0) : (c % 2 == 1)) return c - 1;
    return c;
  }
  if (c >= 0x3b1 && c <= 0x3c9 && c != 0x3c2) return c - 0x20;
  if (c == 0x3c2) return 0x3a3;
  if (c >= 0x430 && c <= 0x44f) return c - 0x20;
  if (c >= 0x450 && c <= 0x45f) return c - 0x50;
  return c;
}
uint32_t cp_lower(uint32_t c) {
  if (c < 128) return uint32_t(std::tolower(int(c)));
  if (c >= 0xc0 && c <= 0xde && c != 0xd7) return c + 0x20;
  if (c == 0x178) return 0xff;
  if (c >= 0x100 && c <= 0x17f && c != 0x130 && c != 0x131 && c != 0x138 && c != 0x149 && c != 0x17f) {
    bool odd_lower = (c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17e);
    if (odd_lower ? (c % 2 == 1) : (c % 2 == 0)) return c + 1;
    return c;
  }
  if (c >= 0x391 && c <= 0x3a9 && c != 0x3a2) return c + 0x20;
  if (c >= 0x410 && c <= 0x42f) return c + 0x20;
  if (c >= 0x400 && c <= 0x40f) return c + 0x50;
  return c;
}
namespace {
bool is_cased(uint32_t c) { return cp_upper(c) != c || cp_lower(c) != c; }
std::string map_case(const std::string& s, bool upper) {
  bool ascii = std::all_of(s.begin(), s.end(), [](char c) { return (static_cast<unsigned char>(c) & 0x80) == 0; });
  if (ascii) {
    std::string o = s;
    for (auto& c : o) c = char(upper ? std::toupper(static_cast<unsigned char>(c)) : std::tolower(static_cast<unsigned char>(c)));
    return o;
  }
  auto cps = utf8_decode(s);
  for (auto& c : cps) c = upper ? cp_upper(c) : cp_lower(c);
  return utf8_encode(cps, 0, cps.size());
}
}  // namespace

std::string ascii_upper(const std::string& s) { return map_case(s, true); }
std::string ascii_lower(const std::string& s) { return map_case(s, false); }

std::string py_title(const std::string& s) {
  auto cps = utf8_decode(s);
  bool prev = false;
  for (auto& c : cps) {
    if (is_cased(c)) {
      c = prev ? cp_lower(c) : cp_upper(c);
      prev = true;
    } else {
      prev = false;
    }
  }
  return utf8_encode(cps, 0, cps.size());
}
std::string py_capitalize(const std::string& s) {
  auto cps = utf8_decode(s);
  for (size_t i = 0; i < cps.size(); ++i) cps[i] = i == 0 ? cp_upper(cps[i]) : cp_lower(cps[i]);
  return utf8_encode(cps, 0, cps.size());
}

std::string py_strip(const std::string& s, const Value* chars, bool left, bool right) {
  auto cps = utf8_decode(s);
  std::vector<uint32_t> set;
  bool ws = !chars || chars->is_none() || chars->is_undefined();
  if (!ws) {
    if (!chars->is_string()) jfail("strip arg must be None or str");
    set = utf8_decode(chars->str());
  }
  auto strip_it = [&](uint32_t c) { return ws ? py_isspace(c) : std::find(set.begin(), set.end(), c) != set.end(); };
  size_t b = 0, e = cps.size();
  if (left)
    while (b < e && strip_it(cps[b])) ++b;
  if (right)
    while (e > b && strip_it(cps[e - 1])) --e;
  return utf8_encode(cps, b, e);
}

std::vector<std::string> py_split(const std::string& s, const Value* sepv, int64_t maxsplit, bool from_right) {
  std::vector<std::string> out;
  bool ws = !sepv || sepv->is_none();
  if (!ws) {
    if (!sepv->is_string()) jfail("must be str or None");
    const std::string& sep = sepv->str();
    if (sep.empty()) jfail("empty separator");
    if (!from_right) {
      size_t pos = 0;
      while (maxsplit < 0 || int64_t(out.size()) < maxsplit) {
        size_t f = s.find(sep, pos);
        if (f == std::string::npos) break;
        out.push_back(s.substr(pos, f - pos));
        pos = f + sep.size();
      }
      out.push_back(s.substr(pos));
    } else {
      size_t end = s.size();
      std::vector<std::string> rev;
      while (maxsplit < 0 || int64_t(rev.size()) < maxsplit) {
        if (end < sep.size()) break;
        size_t f = s.rfind(sep, end - sep.size());
        if (f == std::string::npos) break;
        rev.push_back(s.substr(f + sep.size(), end - f - sep.size()));
        end = f;
      }
      rev.push_back(s.substr(0, end));
      out.assign(rev.rbegin(), rev.rend());
    }
    return out;
  }
  auto cps = utf8_decode(s);
  size_t n = cps.size();
  if (!from_right) {
    size_t i = 0;
    while (true) {
      while (i < n && py_isspace(cps[i])) ++i;
      if (i >= n) break;
      if (maxsplit >= 0 && int64_t(out.size()) >= maxsplit) {
        size_t e = n;
        while (e > i && py_isspace(cps[e - 1])) --e;
        out.push_back(utf8_encode(cps, i, e));
        break;
      }
      size_t j = i;
      while (j < n && !py_isspace(cps[j])) ++j;
      out.push_back(utf8_encode(cps, i, j));
      i = j;
    }
  } else {
    size_t e = n;
    std::vector<std::string> rev;
    while (true) {
      while (e > 0 && py_isspace(cps[e - 1])) --e;
      if (e == 0) break;
      if (maxsplit >= 0 && int64_t(rev.size()) >= maxsplit) {
        size_t b = 0;
        while (b < e && py_isspace(cps[b])) ++b;
        rev.push_back(utf8_encode(cps, b, e));
        break;
      }
      size_t j = e;
      while (j > 0 && !py_isspace(cps[j - 1])) --j;
      rev.push_back(utf8_encode(cps, j, e));
      e = j;
    }
    out.assign(rev.rbegin(), rev.rend());
  }
  return out;
}

std::string py_replace(const std::string& s, const std::string& old, const std::string& rep, int64_t count) {
  std::string out;
  if (old.empty()) {
    auto cps = utf8_decode(s);
    int64_t done = 0;
    for (size_t i = 0; i <= cps.size(); ++i) {
      if (count < 0 || done < count) {
        out += rep;
        built(out.size());
        ++done;
      }
      if (i < cps.size()) utf8_append(out, cps[i]);
    }
    return out;
  }
  size_t pos = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    size_t f = s.find(old, pos);
    if (f == std::string::npos) break;
    out.append(s, pos, f - pos);
    out += rep;
    built(out.size());
    pos = f + old.size();
    ++done;
  }
  out.append(s, pos, std::string::npos);
  return out;
}

std::vector<std::string> py_splitlines(const std::string& s) {
  auto cps = utf8_decode(s);
  std::vector<std::string> out;
  size_t b = 0, i = 0;
  while (i < cps.size()) {
    uint32_t c = cps[i];
    bool br = c == '\n' || c == '\r' || c == 0x0b || c == 0x0c || c == 0x1c || c == 0x1d || c == 0x1e ||
              c == 0x85 || c == 0x2028 || c == 0x2029;
    if (!br) {
      ++i;
      continue;
    }
    out.push_back(utf8_encode(cps, b, i));
    if (c == '\r' && i + 1 < cps.size() && cps[i + 1] == '\n') ++i;
    ++i;
    b = i;
  }
  if (b < cps.size()) out.push_back(utf8_encode(cps, b, cps.size()));
  return out;
}

}  // namespace talon::text::jinja
