// Oniguruma regexes as `tokenizers` runs them (internal to ferry_text).
//
// `tokenizers` compiles every regex of a tokenizer.json (Split and Replace patterns, the
// GPT-2 ByteLevel pattern) with the Rust `onig` crate: onig_new(pattern, ONIG_OPTION_NONE,
// ONIG_ENCODING_UTF8, ONIG_SYNTAX_DEFAULT) and iterates matches with `find_iter`, which
// searches from the end of the previous match over the whole text (so look-behind sees
// what precedes) and handles empty matches as follows: an empty match moves the search
// start one character on, and the first empty match found after a non-empty one is
// dropped. This is the only translation unit of ferry_text that includes oniguruma.h.
//
// Unicode version: Debian's Oniguruma 6.9.8 has Unicode 14.0 tables, the package's bundled
// one Unicode 16.0. Compile adds the code points of Unicode 15 and 16 letters and numbers
// to every \p{L} and \p{N} of a pattern (the classes of the GPT-2, Llama-3 and Qwen2
// patterns; table unicode_classes.inc, generated from the package by
// fixtures/tokenizers/generate.py). \s is the same in both. Other property classes
// (\p{Lu}, \w, \d, scripts, \P{L}) keep Unicode 14.0.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"

namespace ferry::text {

class OnigRegex {
 public:
  // Compiles `pattern`. kCorruption naming `what` (e.g. `tokenizer.json: pre_tokenizer.pattern`)
  // when Oniguruma refuses it.
  static Result<std::unique_ptr<OnigRegex>> Compile(std::string_view pattern, std::string_view what);

  ~OnigRegex();
  OnigRegex(const OnigRegex&) = delete;
  OnigRegex& operator=(const OnigRegex&) = delete;

  // Appends the [begin, end) byte ranges of the successive matches in `text` (valid UTF-8)
  // to *out, as the onig crate's find_iter yields them. kUnsupported when Oniguruma gives up
  // (its retry limit), naming the pattern. Thread-safe.
  Status FindAll(std::string_view text, std::vector<std::pair<size_t, size_t>>* out) const;

  const std::string& pattern() const { return pattern_; }

 private:
  OnigRegex() = default;
  void* regex_ = nullptr;  // regex_t*
  std::string pattern_;
};

}  // namespace ferry::text
