#include "core/text.h"

#include <cstdio>

namespace ferry {
namespace {

// The length of the well-formed UTF-8 sequence starting at s[i] (1..4), or 0 when s[i]
// does not start one (RFC 3629, table 3-7 of the Unicode standard).
size_t Utf8SequenceLength(std::string_view s, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char b0 = byte(i);
  if (b0 < 0x80) return 1;
  size_t len = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // the range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    len = 2;
  } else if (b0 == 0xE0) {
    len = 3;
    lo = 0xA0;  // no overlong 3-byte forms
  } else if ((b0 >= 0xE1 && b0 <= 0xEC) || b0 == 0xEE || b0 == 0xEF) {
    len = 3;
  } else if (b0 == 0xED) {
    len = 3;
    hi = 0x9F;  // no surrogates
  } else if (b0 == 0xF0) {
    len = 4;
    lo = 0x90;  // no overlong 4-byte forms
  } else if (b0 >= 0xF1 && b0 <= 0xF3) {
    len = 4;
  } else if (b0 == 0xF4) {
    len = 4;
    hi = 0x8F;  // nothing above U+10FFFF
  } else {
    return 0;  // 0x80..0xC1 (continuation or overlong 2-byte lead), 0xF5..0xFF
  }
  if (s.size() - i < len) return 0;
  if (byte(i + 1) < lo || byte(i + 1) > hi) return 0;
  for (size_t k = 2; k < len; ++k) {
    if (byte(i + k) < 0x80 || byte(i + k) > 0xBF) return 0;
  }
  return len;
}

}  // namespace

size_t FirstInvalidUtf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t len = Utf8SequenceLength(s, i);
    if (len == 0) return i;
    i += len;
  }
  return std::string_view::npos;
}

std::string EscapeForMessage(std::string_view s) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t len = Utf8SequenceLength(s, i);
    if (c == '\\') {
      out += "\\\\";
    } else if (len == 0 || IsControlByte(c)) {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 0xF];
    } else {
      out.append(s.substr(i, len));
      i += len;
      continue;
    }
    ++i;
  }
  return out;
}

std::string QuoteForMessage(std::string_view s, size_t max_bytes) {
  const std::string_view shown = s.substr(0, max_bytes);
  std::string out = "\"";
  size_t from = 0;
  for (size_t i = 0; i <= shown.size(); ++i) {
    if (i == shown.size() || shown[i] == '"') {
      out += EscapeForMessage(shown.substr(from, i - from));
      if (i < shown.size()) out += "\\\"";
      from = i + 1;
    }
  }
  out += '"';
  if (s.size() > max_bytes) out += "... (" + std::to_string(s.size()) + " bytes)";
  return out;
}

std::string Quote(std::string_view s) { return "'" + std::string(s) + "'"; }

std::string FormatNumber(double v, int significant_digits) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*g", significant_digits, v);
  return buf;
}

Status CheckPrintableUtf8(std::string_view what, std::string_view name) {
  if (FirstInvalidUtf8(name) != std::string_view::npos) {
    return Status::InvalidArgument(std::string(what) + " '" + EscapeForMessage(name) + "' is not valid UTF-8");
  }
  for (char c : name) {
    if (IsControlByte(static_cast<unsigned char>(c))) {
      return Status::InvalidArgument(std::string(what) + " '" + EscapeForMessage(name) +
                                     "' contains a control character");
    }
  }
  return Status::OK();
}

}  // namespace ferry
