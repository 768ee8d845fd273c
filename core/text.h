// Text that Ferry records or writes as JSON (tensor names, file names, run names): checks
// and printable forms for error messages. nlohmann::json::dump throws on text that is not
// UTF-8, so every name that reaches a JSON document is checked first with these.
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

// OK when `name` is well-formed UTF-8 without control characters; otherwise
// kInvalidArgument "<what> '<escaped name>' is not valid UTF-8" or "... contains a control
// character" (`what` e.g. "tensor name").
Status CheckPrintableUtf8(std::string_view what, std::string_view name);

}  // namespace ferry
