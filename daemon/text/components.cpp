#include "daemon/text/components.h"

#include <algorithm>
#include <array>
#include <utility>

#include "daemon/text/unicode.h"

namespace ferry::text {
namespace {

const std::array<char32_t, 256>& ByteToUnicodeTable() {
  static const std::array<char32_t, 256> table = [] {
    std::array<char32_t, 256> t{};
    char32_t n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      t[b] = printable ? static_cast<char32_t>(b) : 256 + n++;
    }
    return t;
  }();
  return table;
}

std::string Utf8Of(char32_t cp) {
  std::string s;
  AppendUtf8(cp, &s);
  return s;
}

// Splits `text` into the pieces `spans` describe under `behavior` (upstream
// NormalizedString::split), appending non-empty ones to *out.
void SplitBySpans(const Piece& piece, const std::vector<Pattern::Span>& spans, SplitBehavior behavior,
                  std::vector<Piece>* out) {
  struct Cut {
    size_t begin, end;
    bool remove;
  };
  std::vector<Cut> cuts;
  cuts.reserve(spans.size());
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (const auto& s : spans) cuts.push_back({s.begin, s.end, false});
      break;
    case SplitBehavior::kRemoved:
      for (const auto& s : spans) cuts.push_back({s.begin, s.end, s.match});
      break;
    case SplitBehavior::kContiguous: {
      bool previous_match = false;
      for (const auto& s : spans) {
        if (s.match == previous_match && !cuts.empty()) {
          cuts.back().end = s.end;
        } else {
          cuts.push_back({s.begin, s.end, false});
        }
        previous_match = s.match;
      }
      break;
    }
    case SplitBehavior::kMergedWithPrevious: {
      bool previous_match = false;
      for (const auto& s : spans) {
        if (s.match && !previous_match && !cuts.empty()) {
          cuts.back().end = s.end;
        } else {
          cuts.push_back({s.begin, s.end, false});
        }
        previous_match = s.match;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      bool previous_match = false;
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->match && !previous_match && !cuts.empty()) {
          cuts.back().begin = it->begin;
        } else {
          cuts.push_back({it->begin, it->end, false});
        }
        previous_match = it->match;
      }
      std::reverse(cuts.begin(), cuts.end());
      break;
    }
  }
  for (const Cut& c : cuts) {
    if (c.remove || c.end == c.begin) continue;
    out->push_back({piece.text.substr(c.begin, c.end - c.begin), piece.at_origin && c.begin == 0});
  }
}

// Replaces every ' ' of `text` by `rep`.
std::string ReplaceSpaces(std::string_view text, std::string_view rep) {
  std::string out;
  out.reserve(text.size() + 8);
  for (char c : text) {
    if (c == ' ') {
      out.append(rep);
    } else {
      out.push_back(c);
    }
  }
  return out;
}

// ---- normalizers ------------------------------------------------------------------------

class Nfc final : public Normalizer {
 public:
  Status Apply(std::string* text) const override {
    FERRY_ASSIGN_OR_RETURN(*text, NormalizeNfc(*text));
    return Status::OK();
  }
};

class Prepend final : public Normalizer {
 public:
  explicit Prepend(std::string prepend) : prepend_(std::move(prepend)) {}
  Status Apply(std::string* text) const override {
    if (!text->empty()) text->insert(0, prepend_);
    return Status::OK();
  }

 private:
  std::string prepend_;
};

// Replaces every match of the pattern by `content` (shared by the normalizer and decoder).
Status ReplaceMatches(const Pattern& pattern, const std::string& content, std::string* text) {
  std::vector<Pattern::Span> spans;
  FERRY_RETURN_IF_ERROR(pattern.FindSpans(*text, &spans));
  bool any = false;
  for (const auto& s : spans) any = any || s.match;
  if (!any) return Status::OK();
  std::string out;
  out.reserve(text->size());
  for (const auto& s : spans) {
    if (s.match) {
      out.append(content);
    } else {
      out.append(*text, s.begin, s.end - s.begin);
    }
  }
  *text = std::move(out);
  return Status::OK();
}

class ReplaceNormalizer final : public Normalizer {
 public:
  ReplaceNormalizer(Pattern pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  Status Apply(std::string* text) const override { return ReplaceMatches(pattern_, content_, text); }

 private:
  Pattern pattern_;
  std::string content_;
};

class NormalizerSequence final : public Normalizer {
 public:
  explicit NormalizerSequence(std::vector<std::unique_ptr<Normalizer>> steps) : steps_(std::move(steps)) {}
  Status Apply(std::string* text) const override {
    for (const auto& s : steps_) FERRY_RETURN_IF_ERROR(s->Apply(text));
    return Status::OK();
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> steps_;
};

// ---- pre-tokenizers ----------------------------------------------------------------------

class ByteLevelPreTokenizer final : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, std::shared_ptr<const Pattern> regex)
      : add_prefix_space_(add_prefix_space), regex_(std::move(regex)) {}

  Status Apply(std::vector<Piece>* pieces) const override {
    std::vector<Piece> out;
    out.reserve(pieces->size());
    std::vector<Pattern::Span> spans;
    for (Piece& p : *pieces) {
      if (add_prefix_space_ && !p.text.empty() && p.text[0] != ' ') p.text.insert(0, " ");
      if (regex_ != nullptr) {
        spans.clear();
        FERRY_RETURN_IF_ERROR(regex_->FindSpans(p.text, &spans));
        SplitBySpans(p, spans, SplitBehavior::kIsolated, &out);
      } else if (!p.text.empty()) {
        out.push_back(std::move(p));
      }
    }
    const auto& table = ByteToUnicodeTable();
    for (Piece& p : out) {
      std::string mapped;
      mapped.reserve(p.text.size() * 2);
      for (char c : p.text) AppendUtf8(table[static_cast<unsigned char>(c)], &mapped);
      p.text = std::move(mapped);
    }
    *pieces = std::move(out);
    return Status::OK();
  }

 private:
  bool add_prefix_space_;
  std::shared_ptr<const Pattern> regex_;
};

class Split final : public PreTokenizer {
 public:
  Split(Pattern pattern, SplitBehavior behavior, bool invert)
      : pattern_(std::move(pattern)), behavior_(behavior), invert_(invert) {}

  Status Apply(std::vector<Piece>* pieces) const override {
    std::vector<Piece> out;
    out.reserve(pieces->size());
    std::vector<Pattern::Span> spans;
    for (const Piece& p : *pieces) {
      spans.clear();
      FERRY_RETURN_IF_ERROR(pattern_.FindSpans(p.text, &spans));
      if (invert_) {
        for (auto& s : spans) s.match = !s.match;
      }
      SplitBySpans(p, spans, behavior_, &out);
    }
    *pieces = std::move(out);
    return Status::OK();
  }

 private:
  Pattern pattern_;
  SplitBehavior behavior_;
  bool invert_;
};

class Metaspace final : public PreTokenizer {
 public:
  Metaspace(char32_t replacement, PrependScheme scheme, bool split)
      : rep_(Utf8Of(replacement)), split_pattern_(Pattern::Literal(rep_)), scheme_(scheme), split_(split) {}

  Status Apply(std::vector<Piece>* pieces) const override {
    std::vector<Piece> out;
    out.reserve(pieces->size());
    std::vector<Pattern::Span> spans;
    for (Piece& p : *pieces) {
      p.text = ReplaceSpaces(p.text, rep_);
      const bool starts_with_rep = p.text.compare(0, rep_.size(), rep_) == 0;
      if (!p.text.empty() && !starts_with_rep &&
          (scheme_ == PrependScheme::kAlways || (scheme_ == PrependScheme::kFirst && p.at_origin))) {
        p.text.insert(0, rep_);
      }
      if (split_) {
        spans.clear();
        FERRY_RETURN_IF_ERROR(split_pattern_.FindSpans(p.text, &spans));
        SplitBySpans(p, spans, SplitBehavior::kMergedWithNext, &out);
      } else if (!p.text.empty()) {
        out.push_back(std::move(p));
      }
    }
    *pieces = std::move(out);
    return Status::OK();
  }

 private:
  std::string rep_;
  Pattern split_pattern_;
  PrependScheme scheme_;
  bool split_;
};

class PreTokenizerSequence final : public PreTokenizer {
 public:
  explicit PreTokenizerSequence(std::vector<std::unique_ptr<PreTokenizer>> steps) : steps_(std::move(steps)) {}
  Status Apply(std::vector<Piece>* pieces) const override {
    for (const auto& s : steps_) FERRY_RETURN_IF_ERROR(s->Apply(pieces));
    return Status::OK();
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> steps_;
};

// ---- post-processors ---------------------------------------------------------------------

class TemplateProcessing final : public PostProcessor {
 public:
  explicit TemplateProcessing(std::vector<TemplatePiece> single) : single_(std::move(single)) {}
  void Apply(bool add_special_tokens, std::vector<int32_t>* ids) const override {
    std::vector<int32_t> out;
    out.reserve(ids->size() + 4);
    for (const TemplatePiece& p : single_) {
      if (p.is_sequence) {
        out.insert(out.end(), ids->begin(), ids->end());
      } else if (add_special_tokens) {
        out.insert(out.end(), p.ids.begin(), p.ids.end());
      }
    }
    *ids = std::move(out);
  }

 private:
  std::vector<TemplatePiece> single_;
};

class NoOpProcessor final : public PostProcessor {
 public:
  void Apply(bool, std::vector<int32_t>*) const override {}
};

class ProcessorSequence final : public PostProcessor {
 public:
  explicit ProcessorSequence(std::vector<std::unique_ptr<PostProcessor>> steps) : steps_(std::move(steps)) {}
  void Apply(bool add_special_tokens, std::vector<int32_t>* ids) const override {
    for (const auto& s : steps_) s->Apply(add_special_tokens, ids);
  }

 private:
  std::vector<std::unique_ptr<PostProcessor>> steps_;
};

// ---- decoders ----------------------------------------------------------------------------

// The bytes of a byte-level token: each character mapped back to its byte, or the token's
// own text when one of its characters is not a byte image (upstream ByteLevel decoder).
std::string ByteLevelBytes(std::string_view token) {
  std::string bytes;
  bytes.reserve(token.size());
  size_t i = 0;
  while (i < token.size()) {
    const int b = ByteFromUnicode(NextCodePoint(token, &i));
    if (b < 0) return std::string(token);
    bytes.push_back(static_cast<char>(b));
  }
  return bytes;
}

class ByteLevelDecoder final : public Decoder {
 public:
  Status DecodeChain(std::vector<std::string>* tokens) const override {
    std::string bytes;
    for (const std::string& t : *tokens) bytes += ByteLevelBytes(t);
    tokens->assign(1, Utf8Lossy(bytes));
    return Status::OK();
  }
  void TokenBytes(std::string* token, bool* fused) const override {
    *token = ByteLevelBytes(*token);
    *fused = true;
  }
};

class MetaspaceDecoder final : public Decoder {
 public:
  MetaspaceDecoder(char32_t replacement, PrependScheme scheme) : replacement_(replacement), scheme_(scheme) {}
  Status DecodeChain(std::vector<std::string>* tokens) const override {
    for (size_t k = 0; k < tokens->size(); ++k) (*tokens)[k] = Map((*tokens)[k], k == 0);
    return Status::OK();
  }
  void TokenBytes(std::string* token, bool*) const override { *token = Map(*token, false); }

 private:
  std::string Map(std::string_view token, bool first) const {
    std::string out;
    out.reserve(token.size());
    size_t i = 0;
    while (i < token.size()) {
      const size_t start = i;
      const char32_t cp = NextCodePoint(token, &i);
      if (cp == replacement_) {
        if (!(first && scheme_ != PrependScheme::kNever)) out.push_back(' ');
      } else {
        out.append(token.substr(start, i - start));
      }
    }
    return out;
  }
  char32_t replacement_;
  PrependScheme scheme_;
};

class ReplaceDecoder final : public Decoder {
 public:
  ReplaceDecoder(Pattern pattern, std::string content) : pattern_(std::move(pattern)), content_(std::move(content)) {}
  Status DecodeChain(std::vector<std::string>* tokens) const override {
    for (std::string& t : *tokens) FERRY_RETURN_IF_ERROR(ReplaceMatches(pattern_, content_, &t));
    return Status::OK();
  }
  void TokenBytes(std::string* token, bool*) const override {
    // Token strings are valid UTF-8 here unless a ByteLevel decoder ran first; a regex that
    // gives up leaves the token as it is.
    if (FirstInvalidUtf8(*token)) return;
    std::string copy = *token;
    if (ReplaceMatches(pattern_, content_, &copy).ok()) *token = std::move(copy);
  }

 private:
  Pattern pattern_;
  std::string content_;
};

// Upstream: a token of exactly six bytes "<0x" XX ">" where XX parses as a u8 in base 16
// (Rust's from_str_radix: an optional '+' then hex digits of either case).
int ByteFallbackValue(std::string_view t) {
  if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
  const auto hex = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  if (t[3] == '+') return hex(t[4]);
  const int hi = hex(t[3]), lo = hex(t[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

class ByteFallbackDecoder final : public Decoder {
 public:
  Status DecodeChain(std::vector<std::string>* tokens) const override {
    std::vector<std::string> out;
    out.reserve(tokens->size());
    std::string run;
    size_t run_len = 0;
    const auto flush = [&] {
      if (run_len == 0) return;
      if (!FirstInvalidUtf8(run)) {
        out.push_back(run);
      } else {
        for (size_t k = 0; k < run_len; ++k) out.emplace_back("\xEF\xBF\xBD");
      }
      run.clear();
      run_len = 0;
    };
    for (std::string& t : *tokens) {
      const int b = ByteFallbackValue(t);
      if (b >= 0) {
        run.push_back(static_cast<char>(b));
        ++run_len;
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    *tokens = std::move(out);
    return Status::OK();
  }
  void TokenBytes(std::string* token, bool*) const override {
    const int b = ByteFallbackValue(*token);
    if (b >= 0) token->assign(1, static_cast<char>(b));
  }
};

class FuseDecoder final : public Decoder {
 public:
  Status DecodeChain(std::vector<std::string>* tokens) const override {
    std::string all;
    for (const std::string& t : *tokens) all += t;
    tokens->assign(1, std::move(all));
    return Status::OK();
  }
  void TokenBytes(std::string*, bool* fused) const override { *fused = true; }
};

class StripDecoder final : public Decoder {
 public:
  StripDecoder(char32_t content, size_t start, size_t stop) : content_(content), start_(start), stop_(stop) {}
  Status DecodeChain(std::vector<std::string>* tokens) const override {
    for (std::string& t : *tokens) FERRY_RETURN_IF_ERROR(Strip(&t));
    return Status::OK();
  }
  void TokenBytes(std::string* token, bool* fused) const override {
    if (*fused || FirstInvalidUtf8(*token)) return;
    std::string copy = *token;
    if (Strip(&copy).ok()) *token = std::move(copy);
  }

 private:
  Status Strip(std::string* token) const {
    std::vector<std::pair<size_t, size_t>> chars;  // byte ranges of the characters
    std::vector<char32_t> cps;
    size_t i = 0;
    while (i < token->size()) {
      const size_t b = i;
      cps.push_back(NextCodePoint(*token, &i));
      chars.emplace_back(b, i);
    }
    size_t start_cut = 0;
    for (size_t k = 0; k < start_ && k < cps.size(); ++k) {
      if (cps[k] != content_) break;
      start_cut = k + 1;
    }
    size_t stop_cut = cps.size();
    for (size_t k = 0; k < stop_; ++k) {
      if (k >= cps.size()) {
        // Upstream indexes before the first character here and panics.
        return Status::InvalidArgument("Strip decoder: the token \"" + *token + "\" has fewer than " +
                                       std::to_string(stop_) + " characters to strip");
      }
      const size_t index = cps.size() - k - 1;
      if (cps[index] != content_) break;
      stop_cut = index;
    }
    if (start_cut > stop_cut) {
      return Status::InvalidArgument("Strip decoder: the token \"" + *token + "\" is shorter than what is stripped");
    }
    const size_t b = start_cut < chars.size() ? chars[start_cut].first : token->size();
    const size_t e = stop_cut < chars.size() ? chars[stop_cut].first : token->size();
    *token = token->substr(b, e - b);
    return Status::OK();
  }
  char32_t content_;
  size_t start_, stop_;
};

class DecoderSequence final : public Decoder {
 public:
  explicit DecoderSequence(std::vector<std::unique_ptr<Decoder>> steps) : steps_(std::move(steps)) {}
  Status DecodeChain(std::vector<std::string>* tokens) const override {
    for (const auto& s : steps_) FERRY_RETURN_IF_ERROR(s->DecodeChain(tokens));
    return Status::OK();
  }
  void TokenBytes(std::string* token, bool* fused) const override {
    for (const auto& s : steps_) s->TokenBytes(token, fused);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> steps_;
};

}  // namespace

Pattern Pattern::Literal(std::string text) {
  Pattern p;
  p.literal_ = std::move(text);
  return p;
}

Result<Pattern> Pattern::Regex(std::string_view pattern, std::string_view what) {
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<OnigRegex> re, OnigRegex::Compile(pattern, what));
  Pattern p;
  p.regex_ = std::move(re);
  return p;
}

Status Pattern::FindSpans(std::string_view s, std::vector<Span>* out) const {
  if (s.empty()) {
    out->push_back({0, 0, false});
    return Status::OK();
  }
  size_t prev = 0;
  const auto add_match = [&](size_t b, size_t e) {
    if (prev != b) out->push_back({prev, b, false});
    out->push_back({b, e, true});
    prev = e;
  };
  if (regex_ != nullptr) {
    std::vector<std::pair<size_t, size_t>> matches;
    FERRY_RETURN_IF_ERROR(regex_->FindAll(s, &matches));
    for (const auto& [b, e] : matches) add_match(b, e);
  } else {
    size_t pos = 0;
    while ((pos = s.find(literal_, pos)) != std::string_view::npos) {
      add_match(pos, pos + literal_.size());
      pos += literal_.size();
    }
  }
  if (prev != s.size()) out->push_back({prev, s.size(), false});
  return Status::OK();
}

std::unique_ptr<Normalizer> MakeNfc() { return std::make_unique<Nfc>(); }
std::unique_ptr<Normalizer> MakePrepend(std::string prepend) { return std::make_unique<Prepend>(std::move(prepend)); }
std::unique_ptr<Normalizer> MakeReplace(Pattern pattern, std::string content) {
  return std::make_unique<ReplaceNormalizer>(std::move(pattern), std::move(content));
}
std::unique_ptr<Normalizer> MakeNormalizerSequence(std::vector<std::unique_ptr<Normalizer>> steps) {
  return std::make_unique<NormalizerSequence>(std::move(steps));
}

std::unique_ptr<PreTokenizer> MakeByteLevelPreTokenizer(bool add_prefix_space,
                                                        std::shared_ptr<const Pattern> gpt2_regex) {
  return std::make_unique<ByteLevelPreTokenizer>(add_prefix_space, std::move(gpt2_regex));
}
std::unique_ptr<PreTokenizer> MakeSplit(Pattern pattern, SplitBehavior behavior, bool invert) {
  return std::make_unique<Split>(std::move(pattern), behavior, invert);
}
std::unique_ptr<PreTokenizer> MakeMetaspace(char32_t replacement, PrependScheme scheme, bool split) {
  return std::make_unique<Metaspace>(replacement, scheme, split);
}
std::unique_ptr<PreTokenizer> MakePreTokenizerSequence(std::vector<std::unique_ptr<PreTokenizer>> steps) {
  return std::make_unique<PreTokenizerSequence>(std::move(steps));
}

std::unique_ptr<PostProcessor> MakeTemplateProcessing(std::vector<TemplatePiece> single) {
  return std::make_unique<TemplateProcessing>(std::move(single));
}
std::unique_ptr<PostProcessor> MakeNoOpProcessor() { return std::make_unique<NoOpProcessor>(); }
std::unique_ptr<PostProcessor> MakeProcessorSequence(std::vector<std::unique_ptr<PostProcessor>> steps) {
  return std::make_unique<ProcessorSequence>(std::move(steps));
}

std::unique_ptr<Decoder> MakeByteLevelDecoder() { return std::make_unique<ByteLevelDecoder>(); }
std::unique_ptr<Decoder> MakeMetaspaceDecoder(char32_t replacement, PrependScheme scheme) {
  return std::make_unique<MetaspaceDecoder>(replacement, scheme);
}
std::unique_ptr<Decoder> MakeReplaceDecoder(Pattern pattern, std::string content) {
  return std::make_unique<ReplaceDecoder>(std::move(pattern), std::move(content));
}
std::unique_ptr<Decoder> MakeByteFallbackDecoder() { return std::make_unique<ByteFallbackDecoder>(); }
std::unique_ptr<Decoder> MakeFuseDecoder() { return std::make_unique<FuseDecoder>(); }
std::unique_ptr<Decoder> MakeStripDecoder(char32_t content, size_t start, size_t stop) {
  return std::make_unique<StripDecoder>(content, start, stop);
}
std::unique_ptr<Decoder> MakeDecoderSequence(std::vector<std::unique_ptr<Decoder>> steps) {
  return std::make_unique<DecoderSequence>(std::move(steps));
}

char32_t ByteToUnicode(uint8_t byte) { return ByteToUnicodeTable()[byte]; }

int ByteFromUnicode(char32_t cp) {
  static const std::array<int16_t, 324> inverse = [] {
    std::array<int16_t, 324> t;
    t.fill(-1);
    for (int b = 0; b < 256; ++b) t[ByteToUnicodeTable()[b]] = static_cast<int16_t>(b);
    return t;
  }();
  return cp < inverse.size() ? inverse[cp] : -1;
}

}  // namespace ferry::text
