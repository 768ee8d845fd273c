#include "convert/layout.h"

#include <string>

namespace ferry {

std::string_view LayoutName(Layout layout) {
  switch (layout) {
    case Layout::kHf: return "hf";
    case Layout::kFused: return "fused";
    case Layout::kLora: return "lora";
  }
  return "?";
}

Result<Layout> ParseLayout(std::string_view name) {
  for (Layout l : {Layout::kHf, Layout::kFused, Layout::kLora}) {
    if (LayoutName(l) == name) return l;
  }
  return Status::InvalidArgument("unknown layout '" + std::string(name) + "' (expected hf, fused or lora)");
}

}  // namespace ferry
