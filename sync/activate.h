// Receiver-side activation step: turns a received, verified version directory into the
// directory a generator loads, for the cases where the receiver does more than keep the
// bytes it was sent:
//   - adapter mode: the publisher sent a LoRA adapter (adapter_model.safetensors +
//     adapter_config.json); the receiver merges it onto the base model it keeps locally
//     (the converter's arithmetic, via sync/snapshot.h) and proves by digest that its merged
//     weights equal the publisher's merged manifest (the hf merged version id);
//   - layout change: the publisher served hf names and the receiver wants the fused layout
//     (q/k/v -> qkv_proj, gate/up -> gate_up_proj, as `ferry convert --layout fused`).
// The receiver (sync/receiver.cpp) calls PrepareActivation after the received files were
// verified against the announced version id, and activates `out` instead of `received`.
#pragma once

#include <filesystem>
#include <optional>
#include <string>

#include "convert/layout.h"
#include "core/status.h"
#include "store/store.h"

namespace ferry::sync {

struct ActivationPlan {
  // What the publisher served (from the MANIFEST): the version's kind (kAdapter in adapter
  // mode) and layout. Default: full, hf.
  store::VersionKind served_kind = store::VersionKind::kFull;
  Layout served_layout = Layout::kHf;
  // Adapter mode: the publisher's merged version id (hf layout) the local merge must equal.
  std::optional<store::Digest> merged_version;
  // The layout the receiver wants on disk: kHf or kFused. Default: hf.
  Layout want_layout = Layout::kHf;
  // Adapter mode: the base model directory the receiver keeps (safetensors + config.json,
  // the same base the publisher merged onto). Required in adapter mode.
  std::optional<std::filesystem::path> base_dir;
  // Threads that merge, hash and write an adapter version (a restack copies on one). Default:
  // 0 = one per hardware thread, at most 4.
  int threads = 0;
};

// Whether `plan` needs PrepareActivation at all (false: activate the received directory as is,
// i.e. not an adapter and served_layout == want_layout).
bool NeedsPreparation(const ActivationPlan& plan);

struct Prepared {
  store::Digest id;                     // the manifest id of `out` (store::HashPath of it)
  std::optional<store::Digest> proven;  // adapter mode: the merged hf id the local merge produced
                                        // (== plan.merged_version, checked)
};

// Writes the directory to activate into `out` (which must not exist; created, written,
// fsynced; removed again on any error) from the verified `received` directory:
//   adapter: merges received adapter onto plan.base_dir in hf, checks its manifest id equals
//            plan.merged_version (kCorruption naming both ids and the base directory
//            otherwise), then writes it in want_layout (plus the base's aux files with the
//            converter's config.json rewrite);
//   layout:  hf -> fused re-layout of the received tensors (aux files copied).
// Errors: kInvalidArgument naming ActivationPlan.base_dir when adapter mode has none (the
// caller's plan lacks the local base), kFailedPrecondition naming base_dir when the base
// cannot be read; kInvalidArgument naming the layouts for fused -> hf or a lora layout wanted or served
// outside adapter mode.
[[nodiscard]] Result<Prepared> PrepareActivation(const std::filesystem::path& received, const ActivationPlan& plan,
                                                 const std::filesystem::path& out);

}  // namespace ferry::sync
