// Which tokenizer class transformers 5's AutoTokenizer.from_pretrained(dir) builds, and the
// pipeline LlamaTokenizer puts in place of tokenizer.json's (internal to ferry_text).
//
// TokenizersBackend, the class most directories get, runs tokenizer.json as written (the
// `tokenizers` package). LlamaTokenizer (models/llama/tokenization_llama.py) takes only the
// vocabulary, the merges, the added tokens and the post-processor from tokenizer.json and
// builds the rest itself:
//
//   model           BPE, fuse_unk, byte_fallback, no unk_token, no ignore_merges, no dropout
//   normalizer      none (the legacy Prepend("▁") + Replace(" ", "▁") is dropped)
//   pre_tokenizer   Metaspace("▁", prepend_scheme, split = false), where prepend_scheme is
//                   "never" when tokenizer_config.json's add_prefix_space is false (it
//                   defaults to true), else "always" when its `legacy` is true, else "first"
//                   (`legacy` defaults to false; tokenization_utils_base._get_prepend_scheme)
//   decoder         Replace("▁", " "), ByteFallback, Fuse, and Strip(" ", 1, 0) unless
//                   add_prefix_space is false
//
// AutoTokenizer builds LlamaTokenizer (models/auto/tokenization_auto.py, from_pretrained)
// when the declared class, tokenizer_config.json's tokenizer_class or else config.json's, is
// LlamaTokenizer or LlamaTokenizerFast, unless
//   - config.json's model_type is one for which transformers overrides that declaration
//     (Mistral, Mixtral, Phi-3, Qwen2, ... : kModelTypesOverridingLlamaTokenizer), or
//   - tokenizer.json contains the text "ByteLevel" in quotes (a Llama-3-style byte-level
//     tokenizer declared as LlamaTokenizer);
// both checks are skipped when tokenizer_config.json has an auto_map for AutoTokenizer
// (the declared class is then used as such, as without trust_remote_code). With no declared
// class it builds LlamaTokenizer for the model types registered to it
// (kModelTypesWithLlamaTokenizer). Truth values follow Python (`legacy: "false"` is true).
#pragma once

#include <optional>
#include <string_view>

#include <nlohmann/json_fwd.hpp>

#include "core/status.h"
#include "daemon/text/components.h"

namespace ferry::text {

// The settings of the pipeline LlamaTokenizer builds (above).
struct LlamaTokenizerPipeline {
  PrependScheme prepend_scheme = PrependScheme::kFirst;  // Default: "first" (legacy false).
  bool add_prefix_space = true;                          // Default: true (the Strip decoder).
};

// The pipeline LlamaTokenizer builds when AutoTokenizer.from_pretrained would build it for a
// directory with these files, nullopt when it keeps tokenizer.json's (TokenizersBackend, or
// another class). `tokenizer_config` / `model_config`: the parsed tokenizer_config.json and
// config.json, null when the directory has none; `tokenizer_json`: tokenizer.json's text.
// kCorruption naming the file and key for a tokenizer_class, model_type or auto_map of the
// wrong JSON type.
Result<std::optional<LlamaTokenizerPipeline>> AutoTokenizerLlamaPipeline(const nlohmann::json* tokenizer_config,
                                                                         std::string_view tokenizer_config_source,
                                                                         const nlohmann::json* model_config,
                                                                         std::string_view model_config_source,
                                                                         std::string_view tokenizer_json);

}  // namespace ferry::text
