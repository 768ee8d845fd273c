// Text that Ferry records or writes as JSON (tensor names, file names, run names): checks
// and printable forms for error messages. nlohmann::json::dump throws on text that is not
// UTF-8, so every name that reaches a JSON document is checked first with these. Also the
// two small forms every message and report uses: a quoted name and a number.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "core/status.h"

namespace ferry {

// The offset of the first byte of `s` that does not start a well-formed UTF-8 sequence
// (RFC 3629: no overlong forms, no surrogates U+D800..U+DFFF, nothing above U+10FFFF, no
// truncated sequence), or std::string_view::npos when `s` is well-formed.
size_t FirstInvalidUtf8(std::string_view s);

// True for the bytes Ferry calls control characters: < 0x20 and 0x7F.
constexpr bool IsControlByte(unsigned char c) { return c < 0x20 || c == 0x7F; }

// `s` for an error message, always printable: ASCII other than control characters and
// well-formed multi-byte UTF-8 as they are, '\\' doubled, every other byte (< 0x20, 0x7F,
// bytes outside a well-formed sequence) as \xHH. "vocab.\xff" for the bytes 'vocab.' 0xFF.
std::string EscapeForMessage(std::string_view s);

// `s` between double quotes for a message: escaped as EscapeForMessage does, '"' as \", and
// cut after `max_bytes` bytes, "... (N bytes)" then following the closing quote. A value read
// from a config, a reply or a dataset line shown in an error.
std::string QuoteForMessage(std::string_view s, size_t max_bytes);

// `s` between single quotes, as it is: "'q_proj'" (nothing escaped: where `s` may hold bytes
// that are not printable, quote EscapeForMessage(s)).
std::string Quote(std::string_view s);

// `v` with at most `significant_digits` significant digits, as printf's "%.*g" writes it
// ("0.25", "1e-06", "inf", "nan"; the C locale's decimal point). Reports and messages use
// 3 to 8 digits; 6 is what `std::ostream << v` writes.
std::string FormatNumber(double v, int significant_digits);

// OK when `name` is well-formed UTF-8 without control characters; otherwise
// kInvalidArgument "<what> '<escaped name>' is not valid UTF-8" or "... contains a control
// character" (`what` e.g. "tensor name").
Status CheckPrintableUtf8(std::string_view what, std::string_view name);

}  // namespace ferry
