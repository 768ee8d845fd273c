// Hugging Face tokenizer.json tokenizers in C++, equal to the `tokenizers` package.
//
// Supported (everything else is refused with kUnsupported naming the file and the JSON
// path of the field, e.g. `tokenizer.json: pre_tokenizer.pretokenizers[1].type
// "Punctuation" is not supported`):
//   model           BPE (dropout null or 0, no continuing_subword_prefix/end_of_word_suffix
//                   other than "", unk_token, fuse_unk, byte_fallback, ignore_merges)
//   normalizer      null, NFC, Prepend, Replace, Sequence of these
//   pre_tokenizer   null, ByteLevel, Split, Metaspace, Sequence of these
//   post_processor  null, ByteLevel, TemplateProcessing (single template), Sequence
//   decoder         null, ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip, Sequence
//   added_tokens    special or not, normalized, lstrip, rstrip, single_word
//   truncation, padding: null only (they change what encode returns)
// That covers GPT-2, Qwen2 and Llama-3 (byte-level BPE) and Llama-2 / Mistral
// (SentencePiece-style BPE with byte fallback, either the Prepend+Replace normalizer or the
// Metaspace pre-tokenizer). FromDirectory reads a model directory as transformers does, which
// for LlamaTokenizer directories is not what the file says (see FromDirectory). How each component behaves:
// daemon/text/components.h, bpe.h, added_vocab.h, onig_regex.h; the evidence of equality: docs/tokenizer.md.
//
// Encode(text) runs, as upstream: added tokens split out of the raw text (normalized=false
// ones), each remaining piece normalized, added tokens split out of it (normalized=true
// ones), pre-tokenization, BPE per pre-token, then the post-processor.
//
// Deliberate differences from `tokenizers`: invalid UTF-8 input is kInvalidArgument (the
// Python package cannot receive it), and Decode refuses ids that are not in the vocabulary
// (kInvalidArgument naming the id) where upstream silently drops them.
//
// The file is treated as hostile: the size and nesting limits below, dense ids
// (0..N-1 in the model, added tokens either naming a model token or numbered N, N+1, ...
// in file order, as upstream assigns them), merges that name existing tokens whose
// concatenation exists, regexes Oniguruma compiles.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace ferry::text {

// Limits on hostile input. Larger inputs are refused with kUnsupported.
inline constexpr size_t kMaxTokenizerJsonBytes = size_t{512} << 20;
inline constexpr size_t kMaxTokenizerConfigBytes = size_t{16} << 20;
inline constexpr int kMaxTokenizerJsonDepth = 64;
inline constexpr size_t kMaxVocabSize = size_t{1} << 22;
inline constexpr size_t kMaxMerges = size_t{1} << 23;
inline constexpr size_t kMaxAddedTokens = size_t{1} << 20;
inline constexpr size_t kMaxTokenBytes = 16384;   // one vocabulary entry or added token
inline constexpr size_t kMaxPatternBytes = 4096;  // one regex or replacement pattern

struct EncodeOptions {
  // Apply the post-processor's special tokens (e.g. the BOS of Llama-style templates), as
  // Tokenizer.encode(text, add_special_tokens=True). Default: false.
  bool add_special_tokens = false;
};

struct DecodeOptions {
  // Leave out special added tokens, as Tokenizer.decode(ids, skip_special_tokens=True).
  // Default: false.
  bool skip_special_tokens = false;
};

struct TokenizerImpl;

class Tokenizer {
 public:
  // Reads a tokenizer.json. kNotFound / kIOError when it cannot be read; kCorruption for
  // malformed JSON or fields; kUnsupported for components this class does not implement.
  // Messages start with the path.
  static Result<Tokenizer> FromFile(const std::filesystem::path& path);

  // Parses tokenizer.json text; `source_name` starts every error message.
  static Result<Tokenizer> FromJson(std::string_view json, std::string_view source_name);

  // Reads a model directory as transformers 5's AutoTokenizer.from_pretrained(DIR) does (what
  // TRL tokenizes prompts with): DIR/tokenizer.json, and DIR/tokenizer_config.json and
  // DIR/config.json when present.
  //   - The tokenizer class AutoTokenizer picks decides how tokenizer.json runs: most get
  //     TokenizersBackend, which runs it as written (as FromFile); LlamaTokenizer (a
  //     tokenizer_config.json naming LlamaTokenizer, as Llama-2 directories do) keeps the
  //     vocabulary, merges, added tokens and post-processor but replaces the normalizer,
  //     pre-tokenizer and decoder (the legacy Prepend + Replace normalizer becomes Metaspace),
  //     so its ids differ from the tokenizers package on leading spaces, space runs and text
  //     after an added token. The rules: daemon/text/auto_tokenizer.h.
  //   - tokenizer_config.json: bos_token / eos_token / pad_token (a string or {"content": ...};
  //     each must be a token), chat_template (kept for DetectChatFormat only; a list form keeps
  //     the entry named "default"). add_bos_token / add_eos_token change nothing: transformers
  //     5 drops them when tokenizer.json exists, so its post-processor alone decides what
  //     add_special_tokens adds.
  // kCorruption naming the file for a malformed tokenizer_config.json or config.json.
  static Result<Tokenizer> FromDirectory(const std::filesystem::path& dir);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Token ids of `text`, equal to Tokenizer.encode(text, add_special_tokens).ids.
  // kInvalidArgument naming the byte offset when `text` is not valid UTF-8; kUnsupported
  // when a regex of the file gives up on the text (Oniguruma's retry limit).
  // Thread-safe.
  Result<std::vector<int32_t>> Encode(std::string_view text, const EncodeOptions& options = {}) const;

  // Text of `ids`, equal to Tokenizer.decode(ids, skip_special_tokens). kInvalidArgument
  // naming the first id outside [0, vocab_size()). Thread-safe.
  Result<std::string> Decode(std::span<const int32_t> ids, const DecodeOptions& options = {}) const;

  // The raw bytes token `id` contributes to decoded text when it is not the first token:
  // the decoder chain applied to the token alone, before any UTF-8 repair (a byte-level
  // token's bytes; a "<0xHH>" byte-fallback token's one byte; "▁" as a space). What a
  // streaming generator needs to find stop strings across token boundaries. For ids
  // i1..in, Decode equals the concatenated TokenBytes:
  //   - byte-level tokenizers (ByteLevel decoder): after replacing each maximal invalid
  //     UTF-8 subpart by U+FFFD (the only difference);
  //   - Metaspace / Llama-2-style decoders: except that Decode drops the leading space of
  //     the first token (the Strip decoder, or Metaspace with a prepend scheme), and that a
  //     run of byte-fallback tokens that is not valid UTF-8 decodes to one U+FFFD per byte.
  // Special tokens give their text (Decode can skip them). The view lives as long as the
  // tokenizer. kInvalidArgument for an id out of range.
  Result<std::string_view> TokenBytes(int32_t id) const;

  // Ids are 0..vocab_size()-1: the model's tokens then the added tokens not in it.
  int32_t vocab_size() const;
  // The id of a token given by its text (added tokens first, as upstream token_to_id).
  std::optional<int32_t> TokenId(std::string_view token) const;
  // The text of token `id` as the vocabulary spells it (byte-level tokens in their
  // bytes_to_unicode form). kInvalidArgument for an id out of range.
  Result<std::string_view> TokenText(int32_t id) const;
  // From tokenizer_config.json (FromDirectory); nullopt when not given.
  std::optional<int32_t> bos_id() const;
  std::optional<int32_t> eos_id() const;
  std::optional<int32_t> pad_id() const;
  // True for special added tokens (what skip_special_tokens leaves out).
  bool IsSpecial(int32_t id) const;

  // The name used in messages (the tokenizer.json path or FromJson's source_name).
  const std::string& source() const;
  // tokenizer_config.json's chat_template text, "" when none.
  const std::string& chat_template() const;

 private:
  explicit Tokenizer(std::unique_ptr<TokenizerImpl> impl);
  std::unique_ptr<TokenizerImpl> impl_;
};

}  // namespace ferry::text
