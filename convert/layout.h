// The layouts weights are written and recorded in: one type for the converter's output,
// store versions (VersionRecord::layout), snapshots, sync manifests and a receiver's
// activation. Names ("hf", "fused", "lora") appear only at the edges: the CLI's flags and the
// JSON a record or manifest is written as.
#pragma once

#include <string_view>

#include "core/status.h"

namespace ferry {

enum class Layout {
  kHf,     // Hugging Face names, one tensor per parameter (merged weights)
  kFused,  // as kHf with q/k/v and gate/up stacked (convert/fused_layout.h)
  kLora,   // a clean LoRA adapter (convert/lora_layout.h)
};

// "hf", "fused" or "lora".
std::string_view LayoutName(Layout layout);
// The layout named `name`; kInvalidArgument naming it otherwise.
Result<Layout> ParseLayout(std::string_view name);

// True for the layouts that hold whole weights (hf and fused), which snapshots and a
// receiver's activation produce; false for lora.
constexpr bool IsTensorLayout(Layout layout) { return layout == Layout::kHf || layout == Layout::kFused; }

}  // namespace ferry
