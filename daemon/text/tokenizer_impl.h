// Tokenizer's state (internal to ferry_text): built by tokenizer_json.cpp, run by
// tokenizer.cpp.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include "core/status.h"
#include "daemon/text/added_vocab.h"
#include "daemon/text/bpe.h"
#include "daemon/text/components.h"
#include "daemon/text/tokenizer.h"

namespace ferry::text {

struct TokenizerImpl {
  std::string source;
  std::unique_ptr<BpeModel> model;
  AddedVocabulary added;
  std::unique_ptr<Normalizer> normalizer;         // null: none
  std::unique_ptr<PreTokenizer> pre_tokenizer;    // null: none
  std::unique_ptr<PostProcessor> post_processor;  // null: none
  std::unique_ptr<Decoder> decoder;               // null: tokens joined by " "
  int32_t vocab_size = 0;

  // Per id: the text decoding starts from (added tokens: their `form`).
  std::vector<std::string> token_text;
  std::vector<uint8_t> special;                   // per id: a special added token
  std::unordered_set<std::string> special_forms;  // contents of special added tokens
  TokenIndex added_index;                         // added token content -> id
  std::string token_bytes;                        // TokenBytes of every id, back to back
  std::vector<size_t> token_bytes_offset;         // vocab_size + 1 offsets

  std::optional<int32_t> bos, eos, pad;
  std::string chat_template;

  // The id of a token by its text: added tokens first, then the model (upstream token_to_id).
  std::optional<int32_t> Find(std::string_view token) const;
  // Fills token_text, special, special_forms, added_index and the TokenBytes table.
  void Index();
};

// Parses tokenizer.json (tokenizer_json.cpp) as the `tokenizers` package reads it.
Result<std::unique_ptr<TokenizerImpl>> ParseTokenizerJson(std::string_view json, std::string_view source);

// A file's text and the name its messages start with.
struct SourceText {
  std::string_view text;
  std::string_view source;
};

// A model directory's tokenizer.json with its tokenizer_config.json and config.json when
// present (tokenizer_json.cpp), as transformers' AutoTokenizer.from_pretrained builds it:
// tokenizer.json as the package reads it, or as LlamaTokenizer rebuilds it
// (auto_tokenizer.h), then tokenizer_config.json's special tokens and chat template.
Result<std::unique_ptr<TokenizerImpl>> ParseDirectory(SourceText tokenizer_json,
                                                      std::optional<SourceText> tokenizer_config,
                                                      std::optional<SourceText> model_config,
                                                      std::optional<SourceText> special_tokens_map = std::nullopt);

}  // namespace ferry::text
