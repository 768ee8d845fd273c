// UTF-8 and Unicode helpers for the tokenizers (internal to ferry_text).
//
// "Valid UTF-8" is Rust's `str` rule (RFC 3629): shortest forms only, no surrogates
// (U+D800..U+DFFF), nothing above U+10FFFF. Character classes follow the Rust `regex` crate,
// which `tokenizers` uses for the added-token rules (\w and \s), with ICU's property data.
// NFC uses ICU (this is the only translation unit of ferry_text that includes ICU headers:
// ICU and Oniguruma both define `UChar`).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "core/status.h"

namespace ferry::text {

// The byte offset of the first byte that does not start a valid UTF-8 sequence (or of a
// sequence cut short by the end), or nullopt when all of `s` is valid UTF-8.
std::optional<size_t> FirstInvalidUtf8(std::string_view s);

// Decodes the code point at s[*i] and advances *i past it.
// REQUIRES: s is valid UTF-8 and *i < s.size() is the start of a sequence.
char32_t NextCodePoint(std::string_view s, size_t* i);

// The length in bytes of the UTF-8 sequence that starts with `lead`.
// REQUIRES: `lead` starts a valid sequence.
inline size_t Utf8SequenceLength(unsigned char lead) { return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4; }

// Appends the UTF-8 encoding of `cp` (REQUIRES: a Unicode scalar value).
void AppendUtf8(char32_t cp, std::string* out);

// Rust's String::from_utf8_lossy: each maximal invalid subpart becomes one U+FFFD.
std::string Utf8Lossy(std::string_view bytes);

// Unicode Normalization Form C of valid UTF-8 text as `tokenizers` computes it: Unicode 9.0
// NFC (characters assigned later are left alone). kInternal if ICU fails.
Result<std::string> NormalizeNfc(std::string_view text);

// The Rust regex crate's \w: Alphabetic, Mark, Decimal_Number, Connector_Punctuation or
// Join_Control.
bool IsWordChar(char32_t cp);

// The Rust regex crate's \s: the White_Space property.
bool IsWhiteSpace(char32_t cp);

// Python's str.isspace() (what Jinja's `trim` strips): characters of bidirectional class
// WS, B or S, or of general category Zs.
bool IsPythonSpace(char32_t cp);

}  // namespace ferry::text
