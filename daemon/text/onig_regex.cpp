#include "daemon/text/onig_regex.h"

#include <oniguruma.h>

#include <cstdio>
#include <mutex>

namespace ferry::text {
namespace {

#include "daemon/text/unicode_classes.inc"

template <size_t N>
std::string ClassItems(const char32_t (&ranges)[N][2]) {
  std::string items;
  char buf[32];
  for (const auto& r : ranges) {
    std::snprintf(buf, sizeof buf, "\\x{%X}-\\x{%X}", static_cast<unsigned>(r[0]), static_cast<unsigned>(r[1]));
    items += buf;
  }
  return items;
}

// Rewrites \p{L} and \p{N} into classes that also hold the code points that Unicode 15 and
// 16 added to them, so that Debian's Oniguruma (Unicode 14 tables) classifies letters and
// numbers as the `tokenizers` package's bundled Oniguruma (Unicode 16) does. Outside a
// bracket class \p{L} becomes [\p{L}<ranges>]; inside one the ranges are added next to it.
// Other property forms (\P{L}, \p{^L}, \p{Lu}, \w, POSIX brackets) are left as they are.
std::string ExtendLetterAndNumberClasses(std::string_view p) {
  if (p.find("\\p{L}") == std::string_view::npos && p.find("\\p{N}") == std::string_view::npos) {
    return std::string(p);
  }
  static const std::string letters = ClassItems(kExtraLetterRanges);
  static const std::string numbers = ClassItems(kExtraNumberRanges);
  std::string out;
  int depth = 0;             // bracket-class nesting
  bool class_start = false;  // just after "[" or "[^": a "]" here is a literal
  size_t i = 0;
  while (i < p.size()) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      if (p.compare(i, 5, "\\p{L}") == 0 || p.compare(i, 5, "\\p{N}") == 0) {
        const std::string items = std::string(p.substr(i, 5)) + (p[i + 3] == 'L' ? letters : numbers);
        out += depth > 0 ? items : "[" + items + "]";
        i += 5;
      } else {
        // The escape and the whole character it escapes.
        const auto lead = static_cast<unsigned char>(p[i + 1]);
        const size_t n = lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
        out.append(p.substr(i, 1 + n));
        i += 1 + n;
      }
      class_start = false;
      continue;
    }
    if (depth > 0 && c == '[' && i + 1 < p.size() && p[i + 1] == ':') {
      const size_t end = p.find(":]", i + 2);
      const size_t stop = end == std::string_view::npos ? p.size() : end + 2;
      out.append(p.substr(i, stop - i));
      i = stop;
      class_start = false;
      continue;
    }
    if (c == '[') {
      ++depth;
      out += c;
      ++i;
      if (i < p.size() && p[i] == '^') {
        out += '^';
        ++i;
      }
      class_start = true;
      continue;
    }
    if (c == ']' && depth > 0 && !class_start) --depth;
    out += c;
    ++i;
    class_start = false;
  }
  return out;
}

std::mutex& CompileMutex() {
  static std::mutex mu;
  return mu;
}

void InitializeOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    OnigEncoding encodings[] = {ONIG_ENCODING_UTF8};
    onig_initialize(encodings, 1);
  });
}

std::string ErrorText(int code, OnigErrorInfo* info) {
  OnigUChar buf[ONIG_MAX_ERROR_MESSAGE_LEN];
  const int n = info != nullptr ? onig_error_code_to_str(buf, code, info) : onig_error_code_to_str(buf, code);
  return std::string(reinterpret_cast<const char*>(buf), n > 0 ? static_cast<size_t>(n) : 0);
}

}  // namespace

Result<std::unique_ptr<OnigRegex>> OnigRegex::Compile(std::string_view pattern, std::string_view what) {
  InitializeOnce();
  std::unique_ptr<OnigRegex> out(new OnigRegex());
  out->pattern_ = std::string(pattern);
  const std::string compiled = ExtendLetterAndNumberClasses(pattern);
  const auto* p = reinterpret_cast<const OnigUChar*>(compiled.data());
  OnigErrorInfo info{};
  regex_t* reg = nullptr;
  int rc;
  {
    // onig_new is not thread-safe (the onig crate serialises it the same way).
    std::lock_guard<std::mutex> lock(CompileMutex());
    rc = onig_new(&reg, p, p + compiled.size(), ONIG_OPTION_NONE, ONIG_ENCODING_UTF8, ONIG_SYNTAX_DEFAULT, &info);
  }
  if (rc != ONIG_NORMAL) {
    std::string msg = ErrorText(rc, &info);
    if (reg != nullptr) onig_free(reg);
    return Status::Corruption(std::string(what) + ": regex does not compile (" + msg + ")");
  }
  out->regex_ = reg;
  return out;
}

OnigRegex::~OnigRegex() {
  if (regex_ != nullptr) onig_free(static_cast<regex_t*>(regex_));
}

Status OnigRegex::FindAll(std::string_view text, std::vector<std::pair<size_t, size_t>>* out) const {
  auto* reg = static_cast<regex_t*>(regex_);
  const auto* str = reinterpret_cast<const OnigUChar*>(text.data());
  const OnigUChar* end = str + text.size();
  OnigRegion region;
  onig_region_init(&region);
  size_t last_end = 0;
  bool skip_next_empty = false;
  Status status;
  while (last_end <= text.size()) {
    const int r = onig_search(reg, str, end, str + last_end, end, &region, ONIG_OPTION_NONE);
    if (r == ONIG_MISMATCH) break;
    if (r < 0) {
      status = Status::Unsupported("regex \"" + pattern_ + "\" gave up on the input (" + ErrorText(r, nullptr) + ")");
      break;
    }
    const auto s = static_cast<size_t>(region.beg[0]);
    const auto e = static_cast<size_t>(region.end[0]);
    last_end = e;
    if (e == s) {
      // Step one character on (one byte at the end of the text).
      if (last_end < text.size()) {
        const auto lead = static_cast<unsigned char>(text[last_end]);
        last_end += lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
      } else {
        last_end += 1;
      }
      if (skip_next_empty) {
        skip_next_empty = false;
        continue;
      }
    } else {
      skip_next_empty = true;
    }
    out->emplace_back(s, e);
  }
  onig_region_free(&region, 0);
  return status;
}

}  // namespace ferry::text
