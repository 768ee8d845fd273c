#include "daemon/text/auto_tokenizer.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <string>

namespace ferry::text {
namespace {

#include "daemon/text/auto_tokenizer_classes.inc"

using json = nlohmann::json;

// Python's truth value of a JSON value: null, false, 0, "", [] and {} are false.
bool Truthy(const json& v) {
  if (v.is_null()) return false;
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_number()) return v.get<double>() != 0.0;
  if (v.is_string()) return !v.get_ref<const std::string&>().empty();
  return !v.empty();  // arrays and objects (json::empty() is false for any string)
}

// `key` of `obj` when it is a string; nullopt when absent or null; kCorruption otherwise.
Result<std::optional<std::string>> OptionalString(const json* obj, std::string_view source, const char* key) {
  if (obj == nullptr || !obj->is_object()) return std::optional<std::string>();
  const auto it = obj->find(key);
  if (it == obj->end() || it->is_null()) return std::optional<std::string>();
  if (!it->is_string()) {
    return Status::Corruption(std::string(source) + ": " + key + " must be a string, not " + it->type_name());
  }
  return std::optional<std::string>(it->get<std::string>());
}

bool IsLlamaTokenizer(const std::optional<std::string>& name) {
  return name && (*name == "LlamaTokenizer" || *name == "LlamaTokenizerFast");
}

template <size_t N>
bool Contains(const std::string_view (&list)[N], const std::optional<std::string>& value) {
  return value && std::find(std::begin(list), std::end(list), *value) != std::end(list);
}

}  // namespace

Result<std::optional<LlamaTokenizerPipeline>> AutoTokenizerLlamaPipeline(const json* tokenizer_config,
                                                                         std::string_view tokenizer_config_source,
                                                                         const json* model_config,
                                                                         std::string_view model_config_source,
                                                                         std::string_view tokenizer_json) {
  FERRY_ASSIGN_OR_RETURN(const auto config_class,
                         OptionalString(tokenizer_config, tokenizer_config_source, "tokenizer_class"));
  FERRY_ASSIGN_OR_RETURN(const auto model_class, OptionalString(model_config, model_config_source, "tokenizer_class"));
  FERRY_ASSIGN_OR_RETURN(const auto model_type, OptionalString(model_config, model_config_source, "model_type"));

  // auto_map: {"AutoTokenizer": [slow, fast], ...} or the older bare list.
  bool remote = false;
  if (tokenizer_config != nullptr && tokenizer_config->is_object()) {
    const auto it = tokenizer_config->find("auto_map");
    if (it != tokenizer_config->end() && !it->is_null()) {
      if (it->is_array()) {
        remote = true;
      } else if (it->is_object()) {
        const auto entry = it->find("AutoTokenizer");
        remote = entry != it->end() && !entry->is_null();
      } else {
        return Status::Corruption(std::string(tokenizer_config_source) +
                                  ": auto_map must be an object or a list, not " + it->type_name());
      }
    }
  }

  const std::optional<std::string> declared = config_class ? config_class : model_class;
  bool llama = false;
  if (declared) {
    llama = IsLlamaTokenizer(declared);
    if (llama && !remote) {
      llama = !Contains(kModelTypesOverridingLlamaTokenizer, model_type) &&
              tokenizer_json.find("\"ByteLevel\"") == std::string_view::npos;
    }
  } else {
    llama = Contains(kModelTypesWithLlamaTokenizer, model_type);
  }
  if (!llama) return std::optional<LlamaTokenizerPipeline>();

  LlamaTokenizerPipeline p;
  if (tokenizer_config != nullptr && tokenizer_config->is_object()) {
    const auto aps = tokenizer_config->find("add_prefix_space");
    if (aps != tokenizer_config->end() && !aps->is_null()) p.add_prefix_space = Truthy(*aps);
    const auto legacy = tokenizer_config->find("legacy");
    if (legacy != tokenizer_config->end() && Truthy(*legacy)) p.prepend_scheme = PrependScheme::kAlways;
  }
  if (!p.add_prefix_space) p.prepend_scheme = PrependScheme::kNever;
  return std::optional<LlamaTokenizerPipeline>(p);
}

}  // namespace ferry::text
