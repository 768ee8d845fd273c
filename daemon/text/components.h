// The pipeline components of tokenizer.json that ferry_text runs (internal), each as
// `tokenizers` defines it (tokenizers/src/{normalizers,pre_tokenizers,processors,decoders}):
//
//   normalizers    NFC; Prepend (only to non-empty text); Replace (String or Regex pattern);
//                  Sequence.
//   pre_tokenizers ByteLevel (add_prefix_space: a space before a piece that does not start
//                  with one; use_regex: split by the GPT-2 pattern, Isolated; then every byte
//                  becomes its GPT-2 bytes_to_unicode character); Split (String or Regex,
//                  five delimiter behaviours, invert); Metaspace (' ' -> replacement, prepend
//                  scheme always/first/never, split MergedWithNext on the replacement);
//                  Sequence. Empty pieces are dropped after every step.
//   processors     ByteLevel (ids unchanged); TemplateProcessing (single template);
//                  Sequence.
//   decoders       ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip, Sequence.
//
// A String pattern matches its text literally, leftmost and non-overlapping (upstream
// escapes it into a regex, which is the same thing); a Regex pattern runs in Oniguruma
// (onig_regex.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "daemon/text/onig_regex.h"

namespace ferry::text {

// A split pattern: a literal (kString, never empty) or an Oniguruma regex (kRegex).
class Pattern {
 public:
  struct Span {
    size_t begin;
    size_t end;
    bool match;
  };

  static Pattern Literal(std::string text);
  static Result<Pattern> Regex(std::string_view pattern, std::string_view what);

  // The spans of `s` in order, covering it: matches and the text between them.
  // ((0, 0), no match) for empty `s`, as upstream.
  Status FindSpans(std::string_view s, std::vector<Span>* out) const;

 private:
  std::string literal_;
  std::shared_ptr<const OnigRegex> regex_;
};

// A piece of text on its way through the pre-tokenizers. `at_origin`: the piece starts at
// byte 0 of the text given to Encode (what Metaspace's "first" prepend scheme asks).
struct Piece {
  std::string text;
  bool at_origin = false;
};

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual Status Apply(std::string* text) const = 0;
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Replaces *pieces by their split (and transformed) pieces, empty ones dropped.
  virtual Status Apply(std::vector<Piece>* pieces) const = 0;
};

class PostProcessor {
 public:
  virtual ~PostProcessor() = default;
  virtual void Apply(bool add_special_tokens, std::vector<int32_t>* ids) const = 0;
};

// Decoders work on token strings, as upstream's decode_chain. Token strings are valid UTF-8.
class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual Status DecodeChain(std::vector<std::string>* tokens) const = 0;
  // The bytes one token contributes when it is not the first token and nothing before or
  // after it changes it (see Tokenizer::TokenBytes). `fused`: a decoder before this one
  // joined all tokens into one string (Fuse, ByteLevel), so positional steps (Strip) no
  // longer apply per token; set by the decoders that fuse.
  virtual void TokenBytes(std::string* token, bool* fused) const = 0;
};

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };
enum class PrependScheme { kAlways, kFirst, kNever };

std::unique_ptr<Normalizer> MakeNfc();
std::unique_ptr<Normalizer> MakePrepend(std::string prepend);
std::unique_ptr<Normalizer> MakeReplace(Pattern pattern, std::string content);
std::unique_ptr<Normalizer> MakeNormalizerSequence(std::vector<std::unique_ptr<Normalizer>> steps);

// `gpt2_regex`: the compiled GPT-2 pattern when use_regex, else null.
std::unique_ptr<PreTokenizer> MakeByteLevelPreTokenizer(bool add_prefix_space,
                                                        std::shared_ptr<const Pattern> gpt2_regex);
std::unique_ptr<PreTokenizer> MakeSplit(Pattern pattern, SplitBehavior behavior, bool invert);
std::unique_ptr<PreTokenizer> MakeMetaspace(char32_t replacement, PrependScheme scheme, bool split);
std::unique_ptr<PreTokenizer> MakePreTokenizerSequence(std::vector<std::unique_ptr<PreTokenizer>> steps);

// A TemplateProcessing single template: each element is a special token's ids or, for
// kSequenceA, the encoded text.
struct TemplatePiece {
  bool is_sequence = false;
  std::vector<int32_t> ids;  // the special token's ids when !is_sequence
};
std::unique_ptr<PostProcessor> MakeTemplateProcessing(std::vector<TemplatePiece> single);
std::unique_ptr<PostProcessor> MakeNoOpProcessor();
std::unique_ptr<PostProcessor> MakeProcessorSequence(std::vector<std::unique_ptr<PostProcessor>> steps);

std::unique_ptr<Decoder> MakeByteLevelDecoder();
std::unique_ptr<Decoder> MakeMetaspaceDecoder(char32_t replacement, PrependScheme scheme);
std::unique_ptr<Decoder> MakeReplaceDecoder(Pattern pattern, std::string content);
std::unique_ptr<Decoder> MakeByteFallbackDecoder();
std::unique_ptr<Decoder> MakeFuseDecoder();
std::unique_ptr<Decoder> MakeStripDecoder(char32_t content, size_t start, size_t stop);
std::unique_ptr<Decoder> MakeDecoderSequence(std::vector<std::unique_ptr<Decoder>> steps);

// GPT-2's bytes_to_unicode: the character each byte becomes in byte-level tokens.
char32_t ByteToUnicode(uint8_t byte);
// The inverse; -1 for characters that are not the image of a byte.
int ByteFromUnicode(char32_t cp);

// The GPT-2 pre-tokenizer pattern (ByteLevel with use_regex).
inline constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

}  // namespace ferry::text
