// UTF-8 helpers for the tokenizers: decoding, lossy repair (as Rust's String::from_utf8_lossy),
// GPT-2's byte <-> unicode alphabet, and Unicode normalisation forms (via utf8proc).
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace talon::text {

// Length of the valid UTF-8 sequence starting at s[i], or 0 if it is not valid there.
size_t utf8_valid_len(std::string_view s, size_t i);
// Decodes the (valid) code point starting at s[i]; advances i.
uint32_t utf8_next(std::string_view s, size_t& i);
void utf8_append(std::string& out, uint32_t cp);
bool utf8_is_valid(std::string_view s);
// Replaces every maximal invalid subsequence with U+FFFD (the "substitution of maximal
// subparts" rule that Rust's from_utf8_lossy and Python's errors="replace" follow).
std::string utf8_lossy(std::string_view s);
// Number of code points.
size_t utf8_count(std::string_view s);

// GPT-2 byte-level alphabet: byte -> the code point that spells it, and back (-1: not in alphabet).
const std::array<uint32_t, 256>& byte_to_unicode();
int unicode_to_byte(uint32_t cp);
// Each byte of `bytes` spelled in the byte-level alphabet.
std::string bytes_to_bytelevel(std::string_view bytes);

enum class NormForm { NFC, NFD, NFKC, NFKD };
std::string normalize(std::string_view s, NormForm f);  // s must be valid UTF-8
std::string lowercase(std::string_view s);              // per code point simple lowercase
bool is_unicode_whitespace(uint32_t cp);                 // Rust char::is_whitespace
bool is_alnum_or_underscore(uint32_t cp);                // Rust is_alphanumeric || '_'
bool is_numeric(uint32_t cp);                            // Rust char::is_numeric (Nd, Nl, No)

}  // namespace talon::text
