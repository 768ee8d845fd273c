// PEFT adapter configuration (adapter_config.json), PEFT's module-name rules, and the
// names of the tensors in adapter_model.safetensors.
//
// Module names. A module name M is a dotted path such as "model.layers.0.self_attn.q_proj":
// an adapter tensor key minus the "base_model.model." prefix and minus the LoRA suffix
// (".lora_A.weight", ...). Every rule below takes such a name.
//
// The rules, as PEFT applies them (peft/tuners/tuners_utils.py, peft/tuners/lora/model.py):
//   - rank_pattern / alpha_pattern: key K applies to M when Python's
//     re.match(rf"(.*\.)?({K})$", M) matches; the first key in FILE order wins. Emulated
//     exactly with RE2: the pattern "(.*\.)?(K)$" matched with the start anchored. File
//     order is kept as Python's json.loads keeps it: a repeated key keeps its first
//     position and takes its last value.
//   - target_modules: a list selects M when M equals an entry or ends with "." + entry; a
//     string is a regex that must match the whole of M (re.fullmatch); "all-linear" (any
//     case) selects every 2-D weight that is not an output or embedding layer, judged by
//     the last path segment (lm_head, embed_out, embed_tokens, wte, wpe, word_embeddings,
//     position_embeddings, token_type_embeddings, tok_embeddings).
//   - exclude_modules: the same list / regex forms; an excluded module is never targeted.
//   - layers_to_transform (list form and all-linear only, as in PEFT; a module matched by
//     exact equality with a list entry is not filtered, as in PEFT): the layer index of M
//     is the first dot-separated segment made only of ASCII digits whose preceding segment
//     equals one of layers_pattern (compared as plain names, not regexes), or, when
//     layers_pattern is empty, is one of "layers", "h", "blocks", "layer"; the digit
//     segment must not be the last one. A module without a layer index is not targeted.
//     (PEFT uses the regex r".*\.[^.]*\.(\d+)\." instead, which picks the LAST such
//     segment after any name; the two agree on every common decoder layout.)
//   - modules_to_save: M equals an entry or ends with "." + entry.
//
// Python `re` and RE2 agree on names, dots, alternation, classes, \d, \w and repetition.
// Patterns RE2 cannot compile (lookaround, backreferences) are rejected with kUnsupported
// naming the field and the pattern; plainly broken patterns give kCorruption.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "core/status.h"

namespace ferry {

// Limits on hostile input. Larger values are rejected with kUnsupported.
inline constexpr int64_t kMaxLoraRank = 65536;
inline constexpr size_t kMaxConfigPatternLength = 4096;       // chars in one regex / pattern key
inline constexpr size_t kMaxConfigListEntries = 1u << 18;     // entries of one list field
inline constexpr size_t kMaxConfigPatternEntries = 1u << 14;  // keys of rank_pattern / alpha_pattern
inline constexpr size_t kMaxConfigObjectKeys = 1u << 14;      // keys of any one JSON object
inline constexpr size_t kMaxConfigJsonDepth = 32;             // nesting of JSON containers
inline constexpr size_t kMaxAdapterConfigBytes = 16u << 20;
inline constexpr int64_t kMaxTokenId = (int64_t{1} << 31) - 1;

// A target_modules / exclude_modules field in any of the forms PEFT accepts.
struct ModuleSelector {
  enum class Form { kNone, kList, kRegex, kAllLinear };
  Form form = Form::kNone;         // Default: absent or null.
  std::vector<std::string> names;  // kList: the entries, in file order.
  std::string pattern;             // kRegex: the regex; kAllLinear: the text as written.

  bool empty() const { return form == Form::kNone; }
};

// Which base-layer biases the adapter saved ("bias" field).
enum class PeftBias { kNone, kAll, kLoraOnly };

// "none" / "all" / "lora_only".
std::string_view PeftBiasName(PeftBias bias);

struct RankPatternEntry {
  std::string key;
  int rank = 0;
};

struct AlphaPatternEntry {
  std::string key;
  double alpha = 0;
};

// trainable_token_indices: a list (rows of the input embedding, whatever it is called)
// or a dict from module name to rows.
struct TrainableTokenIndices {
  std::vector<int64_t> embedding;                                       // list form
  std::vector<std::pair<std::string, std::vector<int64_t>>> by_module;  // dict form, file order

  bool empty() const { return embedding.empty() && by_module.empty(); }
};

// Compiled regexes (RE2), private to peft_config.cpp.
struct CompiledPeftPatterns;

// The fields of adapter_config.json that change merged weights or matter to engines.
// Absent or null fields keep their defaults, which are PEFT's LoraConfig defaults.
struct PeftConfig {
  std::string source;                   // the file name used in messages
  std::string peft_type;                // Default: "" (absent). "LORA" for LoRA.
  std::string task_type;                // Default: "".
  std::string base_model_name_or_path;  // Default: "".
  int r = 8;                            // Default: 8.
  double lora_alpha = 8;                // Default: 8.
  bool use_rslora = false;              // scaling = alpha / sqrt(r). Default: false.
  bool use_dora = false;                // Default: false.
  bool use_qalora = false;              // Default: false.
  bool fan_in_fan_out = false;          // Default: false.
  PeftBias bias = PeftBias::kNone;      // Default: none.
  bool lora_bias = false;               // Default: false.
  ModuleSelector target_modules;
  ModuleSelector exclude_modules;
  std::vector<std::string> modules_to_save;
  std::vector<int64_t> layers_to_transform;                  // empty: every layer
  bool layers_to_transform_is_int = false;                   // written as a single int
  std::vector<std::string> layers_pattern;                   // empty: the default layer names
  std::vector<RankPatternEntry> rank_pattern;                // file order
  std::vector<AlphaPatternEntry> alpha_pattern;              // file order
  std::variant<bool, std::string> init_lora_weights = true;  // Default: true.
  TrainableTokenIndices trainable_token_indices;
  std::vector<int64_t> alora_invocation_tokens;
  std::string path_initial_model_for_weight_conversion;  // Default: "" (absent).
  std::vector<std::string> target_parameters;
  bool has_layer_replication = false;  // layer_replication is set
  std::string raw_json;                // the file's text, for passthrough

  // Regexes compiled by ParsePeftConfig. Lookups stay correct without it (or after the
  // pattern fields are edited): a pattern not found here is compiled on the spot.
  std::shared_ptr<const CompiledPeftPatterns> compiled;

  // Rank of `module`: the first matching rank_pattern key's value, else r.
  int RankFor(std::string_view module) const;
  // Alpha of `module`: the first matching alpha_pattern key's value, else lora_alpha.
  double AlphaFor(std::string_view module) const;
  // AlphaFor / RankFor, or AlphaFor / sqrt(RankFor) with use_rslora.
  double ScalingFor(std::string_view module) const;

  // Whether PEFT would wrap `module` with LoRA (see the rules at the top of this file).
  // `weight_ndim` matters only for "all-linear": a known ndim other than 2 is not linear;
  // nullopt counts as linear.
  bool IsTargeted(std::string_view module, std::optional<size_t> weight_ndim = std::nullopt) const;
  // Whether exclude_modules names `module`.
  bool IsExcluded(std::string_view module) const;
  // Whether modules_to_save names `module`.
  bool IsModuleToSave(std::string_view module) const;
  // The layer index of `module` per the layers_pattern rule above; nullopt when none.
  std::optional<int64_t> LayerIndexOf(std::string_view module) const;

  // OK when the adapter can be merged into its base model as plain LoRA. Otherwise
  // kUnsupported naming the file and field, saying why and what the user can do: a
  // peft_type other than LORA; init_lora_weights pissa / pissa_niter_* / olora / corda /
  // loftq without path_initial_model_for_weight_conversion; alora_invocation_tokens;
  // target_parameters; layer_replication; use_qalora.
  [[nodiscard]] Status CheckMergeable() const;
};

// Parses the text of an adapter_config.json. `source_name` (usually the path) starts
// every error message, which also names the field: kCorruption for text that is not a
// JSON object, a field of the wrong type or out of range, or a regex that does not
// compile; kUnsupported for limits exceeded and regexes RE2 cannot run (lookaround,
// backreferences). Never throws.
[[nodiscard]] Result<PeftConfig> ParsePeftConfig(std::string_view json_text, std::string_view source_name);

// Reads and parses "<dir>/adapter_config.json", or the file itself when given a file.
// kNotFound naming the path when absent; otherwise as ParsePeftConfig.
[[nodiscard]] Result<PeftConfig> LoadPeftConfig(const std::filesystem::path& adapter_dir_or_file);

// One tensor key of adapter_model.safetensors, taken apart.
struct AdapterKey {
  enum Kind {
    kLoraA,            // <M>.lora_A[.<adapter>].weight            [r, in]
    kLoraB,            // <M>.lora_B[.<adapter>].weight            [out, r]
    kLoraBBias,        // <M>.lora_B[.<adapter>].bias              [out]
    kEmbeddingA,       // <M>.lora_embedding_A[.<adapter>]          [r, num_embeddings]
    kEmbeddingB,       // <M>.lora_embedding_B[.<adapter>]          [dim, r]
    kMagnitude,        // <M>.lora_magnitude_vector[.<adapter>][.weight]   [out]
    kModulesToSave,    // <M>.modules_to_save.<adapter>.<param>, or a full tensor of a
                       // modules_to_save module when the config is given
    kTrainableTokens,  // <M>.token_adapter.trainable_tokens_delta[.<adapter>]
    kBaseLayer,        // <M>.base_layer.<param> (saved embeddings, bias="all")
    kOther,            // <M>.<param>: any other tensor (a full tensor, a bias, ia3_l...)
  };
  std::string module;  // M, without "base_model.model."
  Kind kind = kOther;
  std::string adapter_name;  // e.g. "default" when the key carries one, else ""
  std::string param;         // kModulesToSave / kBaseLayer / kOther: the last segment
  bool had_prefix = false;   // the key started with "base_model.model."
};

// "lora_A", "lora_B", "lora_B.bias", "lora_embedding_A", ... (for messages and reports).
std::string_view AdapterKeyKindName(AdapterKey::Kind kind);

// Takes `key` apart. With `config`, a plain full tensor of a modules_to_save module is
// kModulesToSave instead of kOther. kCorruption naming the key when it is empty, longer
// than 4096 chars, has an empty segment, has no module before a LoRA marker, or has a
// LoRA marker in a form PEFT never writes (e.g. "q_proj.lora_A.x.y.weight").
[[nodiscard]] Result<AdapterKey> ParseAdapterKey(std::string_view key, const PeftConfig* config = nullptr);

}  // namespace ferry
