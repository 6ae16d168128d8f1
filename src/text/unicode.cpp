#include "text/unicode.h"

#include <utf8proc.h>

#include <cstdlib>
#include <memory>

#include "util/error.h"

namespace talon::text {

size_t utf8_valid_len(std::string_view s, size_t i) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t n = s.size();
  unsigned char c = p[i];
  if (c < 0x80) return 1;
  if (c < 0xC2) return 0;
  if (c < 0xE0) return (i + 1 < n && (p[i + 1] & 0xC0) == 0x80) ? 2 : 0;
  if (c < 0xF0) {
    if (i + 2 >= n) return 0;
    unsigned char c1 = p[i + 1], c2 = p[i + 2];
    if ((c1 & 0xC0) != 0x80 || (c2 & 0xC0) != 0x80) return 0;
    if (c == 0xE0 && c1 < 0xA0) return 0;
    if (c == 0xED && c1 >= 0xA0) return 0;
    return 3;
  }
  if (c < 0xF5) {
    if (i + 3 >= n) return 0;
    unsigned char c1 = p[i + 1], c2 = p[i + 2], c3 = p[i + 3];
    if ((c1 & 0xC0) != 0x80 || (c2 & 0xC0) != 0x80 || (c3 & 0xC0) != 0x80) return 0;
    if (c == 0xF0 && c1 < 0x90) return 0;
    if (c == 0xF4 && c1 >= 0x90) return 0;
    return 4;
  }
  return 0;
}

uint32_t utf8_next(std::string_view s, size_t& i) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  unsigned char c = p[i];
  if (c < 0x80) { i += 1; return c; }
  if (c < 0xE0) { uint32_t cp = ((c & 0x1F) << 6) | (p[i + 1] & 0x3F); i += 2; return cp; }
  if (c < 0xF0) {
    uint32_t cp = ((c & 0x0F) << 12) | ((p[i + 1] & 0x3F) << 6) | (p[i + 2] & 0x3F);
    i += 3;
    return cp;
  }
  uint32_t cp = ((c & 0x07) << 18) | ((p[i + 1] & 0x3F) << 12) | ((p[i + 2] & 0x3F) << 6) | (p[i + 3] & 0x3F);
  i += 4;
  return cp;
}

void utf8_append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(char(cp));
  } else if (cp < 0x800) {
    out.push_back(char(0xC0 | (cp >> 6)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(char(0xE0 | (cp >> 12)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(char(0xF0 | (cp >> 18)));
    out.push_back(char(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  }
}

bool utf8_is_valid(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) { ++i; continue; }
    size_t l = utf8_valid_len(s, i);
    if (!l) return false;
    i += l;
  }
  return true;
}

// Length of the maximal prefix of a valid sequence at s[i] (at least 1).
static size_t maximal_subpart(std::string_view s, size_t i) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t n = s.size();
  unsigned char c = p[i];
  size_t need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c < 0xE0) need = 1;
  else if (c >= 0xE0 && c < 0xF0) { need = 2; if (c == 0xE0) lo = 0xA0; if (c == 0xED) hi = 0x9F; }
  else if (c >= 0xF0 && c < 0xF5) { need = 3; if (c == 0xF0) lo = 0x90; if (c == 0xF4) hi = 0x8F; }
  else return 1;
  size_t k = 1;
  for (; k <= need && i + k < n; ++k) {
    unsigned char b = p[i + k];
    if (k == 1 ? (b < lo || b > hi) : (b & 0xC0) != 0x80) break;
  }
  return k;
}

std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    size_t l = utf8_valid_len(s, i);
    if (l) {
      out.append(s.data() + i, l);
      i += l;
    } else {
      out.append("\xEF\xBF\xBD");
      i += maximal_subpart(s, i);
    }
  }
  return out;
}

size_t utf8_count(std::string_view s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

static std::array<uint32_t, 256> make_b2u() {
  std::array<uint32_t, 256> t{};
  bool direct[256] = {};
  for (int b = '!'; b <= '~'; ++b) direct[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) direct[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) direct[b] = true;
  uint32_t n = 0;
  for (int b = 0; b < 256; ++b) t[b] = direct[b] ? uint32_t(b) : 256 + n++;
  return t;
}

const std::array<uint32_t, 256>& byte_to_unicode() {
  static const std::array<uint32_t, 256> t = make_b2u();
  return t;
}

int unicode_to_byte(uint32_t cp) {
  static const auto rev = [] {
    std::array<int16_t, 324> r{};
    r.fill(-1);
    const auto& t = byte_to_unicode();
    for (int b = 0; b < 256; ++b) r[t[b]] = int16_t(b);
    return r;
  }();
  return cp < rev.size() ? rev[cp] : -1;
}

std::string bytes_to_bytelevel(std::string_view bytes) {
  static const auto spelled = [] {
    std::array<std::string, 256> r;
    const auto& t = byte_to_unicode();
    for (int b = 0; b < 256; ++b) utf8_append(r[b], t[b]);
    return r;
  }();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) out += spelled[c];
  return out;
}

std::string normalize(std::string_view s, NormForm f) {
  // Fast path: pure ASCII is invariant under every form.
  bool ascii = true;
  for (unsigned char c : s)
    if (c >= 0x80) { ascii = false; break; }
  if (ascii) return std::string(s);
  int opts = UTF8PROC_STABLE;
  switch (f) {
    case NormForm::NFC: opts |= UTF8PROC_COMPOSE; break;
    case NormForm::NFD: opts |= UTF8PROC_DECOMPOSE; break;
    case NormForm::NFKC: opts |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT; break;
    case NormForm::NFKD: opts |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT; break;
  }
  utf8proc_uint8_t* out = nullptr;
  utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()), utf8proc_ssize_t(s.size()),
                                    &out, utf8proc_option_t(opts));
  if (n < 0) fail("unicode normalisation failed: {}", utf8proc_errmsg(n));
  std::string r(reinterpret_cast<char*>(out), size_t(n));
  std::free(out);
  return r;
}

std::string lowercase(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) utf8_append(out, uint32_t(utf8proc_tolower(utf8_next(s, i))));
  return out;
}

bool is_unicode_whitespace(uint32_t cp) {
  switch (cp) {
    case 0x09: case 0x0A: case 0x0B: case 0x0C: case 0x0D: case 0x20: case 0x85: case 0xA0: case 0x1680:
    case 0x2028: case 0x2029: case 0x202F: case 0x205F: case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

bool is_alnum_or_underscore(uint32_t cp) {
  if (cp == '_') return true;
  auto c = utf8proc_category(utf8proc_int32_t(cp));
  switch (c) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT: case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_ND: case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_NO:
      return true;
    default:
      return false;
  }
}

bool is_numeric(uint32_t cp) {
  auto c = utf8proc_category(utf8proc_int32_t(cp));
  return c == UTF8PROC_CATEGORY_ND || c == UTF8PROC_CATEGORY_NL || c == UTF8PROC_CATEGORY_NO;
}

}  // namespace talon::text
