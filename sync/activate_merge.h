// Internal to sync/activate.cpp: the receiver's adapter merge and the writer of laid-out
// tensors under it and the layout restack, streamed and hashed as they write. Not part of the
// public API.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "convert/fused_layout.h"
#include "convert/layout.h"
#include "core/checkpoint.h"
#include "core/status.h"
#include "core/tensor.h"
#include "store/store.h"

namespace ferry::sync::activate_internal {

// The output tensors of `ckpt` in `layout`: kHf (every tensor as is) or kFused (q/k/v and
// gate/up stacked: convert/fused_layout.h, the converter's and the snapshot builder's own
// planner), sorted by name. Only metadata is read. Errors begin with `where`.
[[nodiscard]] Result<std::vector<LaidOutTensor>> PlanLayout(const Checkpoint& ckpt, Layout layout,
                                                            std::string_view where);

// Workers by default: one per hardware thread, at most 4 (writes into one file are serialised
// by its inode lock, and merging a piece costs about what copying it does: two keep the lock
// busy, more would only spin on it).
int DefaultWorkers();

// Where a tensor's bytes go, a piece at a time, in order: (bytes, offset within the tensor).
using PieceSink = std::function<Status(std::span<const std::byte> bytes, uint64_t offset)>;

// Hashes `t` (store::TensorDigester) and hands it to `sink` in pieces of 256 KiB, each piece
// hashed and handed over while it is in cache; its digest, or the sink's first error.
[[nodiscard]] Result<store::Digest> HashAndWrite(const Tensor& t, const PieceSink& sink);

// Makes tensor `part` of an output tensor: hands its bytes to `sink` in order and returns its
// digest (store::TensorDigester). `piece` is the calling worker's scratch buffer.
using PartWriter =
    std::function<Result<store::Digest>(const std::string& part, const PieceSink& sink, std::vector<uint16_t>& piece)>;

// What WriteLaidOut wrote: each output tensor's row (its digest included) and the digests of
// its parts (parts[i][k] is outputs[i].parts[k]'s).
struct LaidOutDigests {
  std::vector<store::TensorRow> rows;
  std::vector<std::vector<store::Digest>> parts;
};

// Writes `outputs` (each output tensor the bytes of its parts one after the other) as the new
// safetensors file `file` (in this order), then fsyncs it. `workers` threads each take whole
// output tensors and have `write_part` make their parts a piece at a time, each piece written
// in place and, for a stacked tensor, hashed as a piece of it too: nothing is read back. Errors:
// the first of any part writer's; kIOError naming the file; kInternal naming the tensor when its
// parts do not fill it exactly. A failure leaves the file part-written (the caller's staging
// directory removes it).
[[nodiscard]] Result<LaidOutDigests> WriteLaidOut(const std::vector<LaidOutTensor>& outputs, int workers,
                                                  const PartWriter& write_part, const std::filesystem::path& file);

// What WriteMergedAdapter wrote: the proven merged id (hf layout) and the id of the files.
struct MergedAdapter {
  store::Digest proven;  // the manifest id of the merge in the hf layout (== the publisher's)
  store::Digest id;      // the manifest id of what was written (== proven for the hf layout)
};

// Merges the adapter in `received` (adapter_model.safetensors + adapter_config.json) onto the
// base model in `base_dir` exactly as the publisher's watcher records the merged version
// (sync/snapshot.h LazySnapshot: the converter's rules and arithmetic, the fused 16-bit
// kernel, config.json rewritten), and writes it into the new directory `out` in `layout`
// (kHf, or kFused: q/k/v and gate/up stacked as `ferry convert --layout fused` stacks them):
// one model.safetensors and the aux files. `threads` workers (0: one per hardware thread, at
// most 4) each take whole output tensors and merge, hash (store::TensorDigester) and write them
// a piece at a time, so no byte is read back from the file, or from memory between the three;
// a stacked tensor's parts are hashed as the hf tensors they are and as the stacked one at
// once. The manifest id of the merge in the hf layout must be `expected` (the publisher's
// merged version); then the files are fsynced and `out` appears (renamed from a staging
// directory). Errors (nothing is left at `out`): kCorruption naming both ids and the base when
// the id differs; kFailedPrecondition naming the base when it cannot be read; the planner's
// errors (an adapter that does not fit the base, e.g. kNotFound naming a tensor it lacks) with
// the received and base directories named; kIOError naming the file for local I/O.
[[nodiscard]] Result<MergedAdapter> WriteMergedAdapter(const std::filesystem::path& received,
                                                       const std::filesystem::path& base_dir,
                                                       const store::Digest& expected, int threads, Layout layout,
                                                       const std::filesystem::path& out);

}  // namespace ferry::sync::activate_internal
