#include "convert/model_config.h"

#include <nlohmann/json.hpp>

namespace ferry {

std::string TorchDTypeName(DType d) {
  switch (d) {
    case DType::kF32: return "float32";
    case DType::kF16: return "float16";
    case DType::kBF16: return "bfloat16";
    case DType::kF64: return "float64";
    default: return std::string(DTypeName(d));
  }
}

Result<std::string> RewriteModelConfig(std::string_view text, const ModelConfigEdits& edits, std::string_view where) {
  using ojson = nlohmann::ordered_json;
  ojson j = ojson::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Status::Corruption(std::string(where) + ": not a JSON object");
  j.erase("quantization_config");
  if (edits.untie) j["tie_word_embeddings"] = false;
  if (edits.dtype) {
    for (const char* k : {"torch_dtype", "dtype"}) {
      if (j.contains(k)) j[k] = TorchDTypeName(*edits.dtype);
    }
  }
  // Parsed text is UTF-8 (the parser refuses anything else), so dump cannot throw.
  return j.dump(2) + "\n";
}

}  // namespace ferry
