#include "daemon/text/unicode.h"

#include <algorithm>
#include <iterator>
#include <memory>

#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/uniset.h>
#include <unicode/utypes.h>

#include "daemon/text/unicode_classes.inc"

namespace ferry::text {
namespace {

// The UTF-8 sequence starting at s[i], checked by the table of well-formed sequences
// (Unicode 15, table 3-7).
struct SeqCheck {
  bool valid;
  size_t length;  // valid: the sequence length; invalid: the maximal subpart length (>= 1)
};

SeqCheck CheckSequence(std::string_view s, size_t i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) return {true, 1};
  size_t need;
  unsigned char lo = 0x80, hi = 0xBF;  // range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 2;
  } else if (b0 == 0xE0) {
    need = 3, lo = 0xA0;
  } else if ((b0 >= 0xE1 && b0 <= 0xEC) || b0 == 0xEE || b0 == 0xEF) {
    need = 3;
  } else if (b0 == 0xED) {
    need = 3, hi = 0x9F;
  } else if (b0 == 0xF0) {
    need = 4, lo = 0x90;
  } else if (b0 >= 0xF1 && b0 <= 0xF3) {
    need = 4;
  } else if (b0 == 0xF4) {
    need = 4, hi = 0x8F;
  } else {
    return {false, 1};
  }
  for (size_t k = 1; k < need; ++k) {
    if (i + k >= s.size()) return {false, k};
    const auto b = static_cast<unsigned char>(s[i + k]);
    const unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (b < l || b > h) return {false, k};
  }
  return {true, need};
}

}  // namespace

std::optional<size_t> FirstInvalidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    // ASCII runs dominate; skip them eight bytes at a time.
    while (i + 8 <= s.size()) {
      uint64_t w;
      __builtin_memcpy(&w, s.data() + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= s.size()) break;
    const SeqCheck c = CheckSequence(s, i);
    if (!c.valid) return i;
    i += c.length;
  }
  return std::nullopt;
}

char32_t NextCodePoint(std::string_view s, size_t* i) {
  const auto b0 = static_cast<unsigned char>(s[*i]);
  if (b0 < 0x80) {
    ++*i;
    return b0;
  }
  const size_t n = Utf8SequenceLength(b0);
  char32_t cp = b0 & (n == 2 ? 0x1F : n == 3 ? 0x0F : 0x07);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[*i + k]) & 0x3F);
  *i += n;
  return cp;
}

void AppendUtf8(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string Utf8Lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t i = 0;
  while (i < bytes.size()) {
    const SeqCheck c = CheckSequence(bytes, i);
    if (c.valid) {
      out.append(bytes.substr(i, c.length));
    } else {
      out.append("\xEF\xBF\xBD");
    }
    i += c.length;
  }
  return out;
}

namespace {

// `tokenizers` normalizes with the unicode-normalization-alignments crate, whose tables are
// Unicode 9.0: characters assigned later are neither composed nor reordered. ICU's NFC
// restricted to [:age=9.0:] (later characters copied as they are and acting as boundaries)
// is that same function; checked on every code point alone and in five combining contexts
// (6.67 million strings, see fixtures/tokenizers/README.md).
struct Nfc9 {
  std::unique_ptr<icu::UnicodeSet> set;
  std::unique_ptr<icu::FilteredNormalizer2> normalizer;
  std::string error;
};

const Nfc9& GetNfc9() {
  static const Nfc9 nfc = [] {
    Nfc9 n;
    UErrorCode err = U_ZERO_ERROR;
    const icu::Normalizer2* base = icu::Normalizer2::getNFCInstance(err);
    if (U_FAILURE(err)) {
      n.error = std::string("ICU NFC instance: ") + u_errorName(err);
      return n;
    }
    n.set = std::make_unique<icu::UnicodeSet>(icu::UnicodeString(u"[:age=9.0:]"), err);
    if (U_FAILURE(err)) {
      n.error = std::string("ICU [:age=9.0:]: ") + u_errorName(err);
      return n;
    }
    n.set->freeze();
    n.normalizer = std::make_unique<icu::FilteredNormalizer2>(*base, *n.set);
    return n;
  }();
  return nfc;
}

}  // namespace

Result<std::string> NormalizeNfc(std::string_view text) {
  bool ascii = true;
  for (char c : text) {
    if (static_cast<unsigned char>(c) >= 0x80) {
      ascii = false;
      break;
    }
  }
  if (ascii) return std::string(text);
  const Nfc9& nfc = GetNfc9();
  if (nfc.normalizer == nullptr) return Status::Internal(nfc.error);
  UErrorCode err = U_ZERO_ERROR;
  std::string out;
  out.reserve(text.size());
  icu::StringByteSink<std::string> sink(&out);
  nfc.normalizer->normalizeUTF8(0, icu::StringPiece(text.data(), static_cast<int32_t>(text.size())), sink, nullptr,
                                err);
  if (U_FAILURE(err)) return Status::Internal(std::string("ICU NFC normalization: ") + u_errorName(err));
  return out;
}

bool IsWordChar(char32_t cp) {
  if (cp < 0x80) {
    return (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') || (cp >= '0' && cp <= '9') || cp == '_';
  }
  const auto c = static_cast<UChar32>(cp);
  if (u_hasBinaryProperty(c, UCHAR_ALPHABETIC) || u_hasBinaryProperty(c, UCHAR_JOIN_CONTROL)) return true;
  const int8_t type = u_charType(c);
  if (type == U_NON_SPACING_MARK || type == U_ENCLOSING_MARK || type == U_COMBINING_SPACING_MARK ||
      type == U_DECIMAL_DIGIT_NUMBER || type == U_CONNECTOR_PUNCTUATION) {
    return true;
  }
  // Characters of Unicode versions after the ICU's (Debian 12's ICU 72 has Unicode 15.0; the
  // Rust regex crate `tokenizers` uses has 16.0), from the generated table.
  const auto* end = std::end(kExtraWordRanges);
  const auto* it = std::upper_bound(std::begin(kExtraWordRanges), end, cp,
                                    [](char32_t v, const auto& range) { return v < range[0]; });
  return it != std::begin(kExtraWordRanges) && cp <= (*(it - 1))[1];
}

bool IsWhiteSpace(char32_t cp) {
  if (cp < 0x80) return cp == ' ' || (cp >= 0x09 && cp <= 0x0D);
  return u_hasBinaryProperty(static_cast<UChar32>(cp), UCHAR_WHITE_SPACE);
}

bool IsPythonSpace(char32_t cp) {
  switch (cp) {
    case 0x09:
    case 0x0A:
    case 0x0B:
    case 0x0C:
    case 0x0D:
    case 0x1C:
    case 0x1D:
    case 0x1E:
    case 0x1F:
    case 0x20:
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000: return true;
    default: return cp >= 0x2000 && cp <= 0x200A;
  }
}

}  // namespace ferry::text
