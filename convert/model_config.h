// config.json beside merged weights: the one rewrite the converter writes and snapshots
// record (sync/snapshot.h), so that a snapshot's version id equals the store id of the
// converter's output by construction.
//
// The rewrite of the base's config.json (parsed keeping key order, written with 2-space
// indentation and a final newline):
//   - "quantization_config" removed (the output is never quantized);
//   - "tie_word_embeddings": false when the merge wrote a separate lm_head (untie);
//   - "torch_dtype" and "dtype", whichever are present, set to the torch name of the
//     output dtype ("float32", "float16", "bfloat16", "float64") when one is given.
// Everything else is kept as it is.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "core/dtype.h"
#include "core/status.h"

namespace ferry {

struct ModelConfigEdits {
  bool untie = false;          // tie_word_embeddings becomes false. Default: false.
  std::optional<DType> dtype;  // the dtype the weights are written in. Default: unset (kept).
};

// The rewritten config.json text. kCorruption "<where>: not a JSON object" when `text` is not
// a JSON object.
Result<std::string> RewriteModelConfig(std::string_view text, const ModelConfigEdits& edits, std::string_view where);

// The torch name of `dtype` ("float32", "float16", "bfloat16", "float64"; other dtypes by
// their safetensors name).
std::string TorchDTypeName(DType dtype);

}  // namespace ferry
