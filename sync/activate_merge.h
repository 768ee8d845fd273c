// Internal to sync/activate.cpp: the receiver's adapter merge, streamed and hashed as it is
// written. Not part of the public API.
#pragma once

#include <filesystem>

#include "core/status.h"
#include "store/store.h"

namespace ferry::sync::activate_internal {

// Merges the adapter in `received` (adapter_model.safetensors + adapter_config.json) onto the
// base model in `base_dir` in the hf layout, exactly as the publisher's watcher records the
// merged version (sync/snapshot.h LazySnapshot: the converter's rules and arithmetic, the
// fused 16-bit kernel, config.json rewritten), and writes it into the new directory `out`: one
// model.safetensors laid out from the merged tensors' specs and the aux files. `threads`
// workers (0: one per hardware thread, at most 4) each take whole tensors and merge, hash
// (store::TensorDigester) and write them a piece at a time, so no byte is read back from the
// file, or from memory between the three. The manifest id of what was written must be
// `expected` (the publisher's merged version); then the files are fsynced and `out` appears
// (renamed from a staging directory). Errors (nothing is left at `out`): kCorruption naming
// both ids and the base when the id differs; kFailedPrecondition naming the base when it
// cannot be read; the planner's errors (an adapter that does not fit the base, e.g. kNotFound
// naming a tensor it lacks) with the received and base directories named; kIOError naming the
// file for local I/O.
[[nodiscard]] Result<store::Digest> WriteMergedAdapter(const std::filesystem::path& received,
                                                       const std::filesystem::path& base_dir,
                                                       const store::Digest& expected, int threads,
                                                       const std::filesystem::path& out);

}  // namespace ferry::sync::activate_internal
