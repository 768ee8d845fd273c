// The fused layout: the one planner behind `ferry convert --layout fused`, fused snapshots
// (sync/snapshot.h) and a receiver's hf -> fused activation (sync/activate.h), so that all
// three produce the same tensors by construction.
//
// Rules:
//   - Groups: {q_proj, k_proj, v_proj} -> qkv_proj and {gate_proj, up_proj} -> gate_up_proj,
//     for ".weight" and ".bias" alike: "P.q_proj.X", "P.k_proj.X", "P.v_proj.X" become
//     "P.qkv_proj.X", members stacked on axis 0 in that order (the layout vLLM builds
//     internally and Phi-3 stores natively).
//   - A group forms where every member is present; otherwise its tensors stay as they are.
//   - Members must have one dtype and equal shapes but for axis 0 (kInvalidArgument naming
//     both tensors, their shapes and dtypes, otherwise), and the fused name must not exist
//     already (kInvalidArgument naming both).
//   - Order: each fused tensor takes the place of its first member (q_proj, gate_proj);
//     every other tensor keeps its place.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "core/safetensors.h"
#include "core/status.h"

namespace ferry {

// One output tensor of a layout: its spec and the input tensors whose bytes it is, stacked
// on axis 0 in order (one part, the tensor itself, unless fused).
struct LaidOutTensor {
  TensorSpec spec;
  std::vector<std::string> parts;
};

// `tensors` (names unique) in the fused layout, by the rules above. Only names, dtypes and
// shapes are read. Errors begin with `where` (the directory or source being laid out).
Result<std::vector<LaidOutTensor>> FuseLayout(const std::vector<TensorSpec>& tensors, std::string_view where);

}  // namespace ferry
