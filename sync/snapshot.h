// Snapshots: immutable, hashed copies of a model's weights, taken after an optimiser step
// and before anything is sent, so the trainer may keep mutating (or free) its parameters.
//
// A snapshot is built from named tensors from any source (memory-mapped files, LibTorch
// parameters wrapped as Tensors) plus, for LoRA, the adapter tensors and its config:
//   1. Names are normalised to the generator's: "base_model.model." is stripped and the
//      ".base_layer" and ".original_module" segments dropped
//      ("base_model.model.M.base_layer.weight" -> "M.weight").
//      LoRA tensors found among the source tensors ("M.lora_A.default.weight", ...) join the
//      adapter tensors when an adapter config is given and are an error otherwise.
//   2. Every output tensor is written into a NEW buffer owned by the snapshot: unchanged
//      tensors are copied, LoRA targets are merged exactly as `ferry convert` merges them
//      (convert/merge_plan.h resolves the adapter; fp32 accumulation, one rounding to the
//      base dtype; bit-identical to the converter's hf output). The snapshot never aliases
//      the source: changing or freeing the source after BuildSnapshot returns cannot change
//      it (a bug TRL once had: state_dict() tensors aliasing live, later unmerged parameters).
//      The one exception is asked for: with SnapshotOptions::share_unchanged, unchanged
//      tensors are the source's own (views holding its owner), for a source nothing can write
//      (a read-only mapping): a co-located generator then holds one copy of the base plus
//      the merged modules, not a second base per step. Digests and ids do not change.
//   2b. A bitsandbytes 4-bit base (NF4/FP4, double quant or not: convert/bnb4.h) is read as
//      the converter reads it: each packed weight is dequantised with its quant state
//      (Dequantize4bitAsLoaded: rounded to the quant state's dtype), merged, and written in
//      that dtype and its unpacked shape; the quant-state companions (absmax, quant_map,
//      nested_*, quant_state.*) are dropped and config.json loses quantization_config (its
//      torch_dtype/dtype become the quant state's), bit-identical to `ferry convert`. A
//      4-bit base without an adapter is dequantised the same way (what `ferry convert`
//      writes for an adapter that changes nothing).
//   3. The fused layout stacks q/k/v into self_attn.qkv_proj and gate/up into
//      mlp.gate_up_proj on the output axis (as `ferry convert --layout fused`).
//   4. Every tensor digest and the manifest digest (= the store's version id) are computed
//      exactly as store/store.h defines them, so RecordSnapshot's version id equals
//      manifest_id() and a receiver can prove what it holds by digest.
// Nothing here copies or serialises model objects: only tensors' bytes are read.
//
// Modes of publication:
//   merged-full   the Snapshot itself;
//   adapter-only  AdapterSnapshot: copied adapter tensors + config + the merged manifest id
//                 the publisher computed; a receiver that keeps the base merges locally
//                 (ApplyAdapterSnapshot) and proves its result has that id;
//   delta         MissingTensors: only the tensors whose digest the receiver lacks.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "convert/layout.h"
#include "convert/peft_config.h"
#include "core/checkpoint.h"
#include "core/status.h"
#include "core/tensor.h"
#include "store/store.h"

namespace ferry::sync {

// The weights to snapshot. The tensors are only read during BuildSnapshot.
struct SnapshotSource {
  // Base or full weights with HF names as a model's state_dict gives them; PEFT-wrapped
  // names ("base_model.model.X.base_layer.weight") are accepted and normalised.
  std::map<std::string, Tensor> tensors;
  // The LoRA adapter to merge in. Default: none (the tensors are the full weights).
  std::optional<PeftConfig> adapter_config;
  // Adapter tensors as adapter_model.safetensors names them ("base_model.model.M.lora_A.weight").
  std::map<std::string, Tensor> adapter_tensors;
  // Auxiliary files (name, contents) recorded with the weights: config.json,
  // generation_config.json, tokenizer files. Plain file names, each at most once.
  AuxFiles aux_files;
};

struct SnapshotOptions {
  // kHf or kFused (the store records it as the version's layout); kLora is kInvalidArgument.
  // Default: hf.
  Layout layout = Layout::kHf;
  int threads = 0;  // merge threads. Default: 0 = all hardware threads.
  // The base model ties lm_head to the input embedding (config.json's tie_word_embeddings).
  // Default: false.
  bool tie_word_embeddings = false;
  // Unchanged tensors (neither merged, stacked nor dequantised) are the source's own tensors
  // (the same bytes; the snapshot holds their owner) instead of copies. REQUIRES: nothing
  // writes those bytes while the snapshot lives, e.g. Checkpoint::Open's read-only mapping;
  // never LibTorch parameters or buffers the caller reuses. The tensors, digests and ids are
  // the same either way. Default: false (every tensor copied into the snapshot's buffers).
  bool share_unchanged = false;
};

// An immutable snapshot. Thread-safe: every accessor is const and the buffers never change.
class Snapshot {
 public:
  // The tensors, in buffers owned by the snapshot (names sorted), or for unchanged tensors
  // under SnapshotOptions::share_unchanged the source's. Tensors taken from it keep those
  // buffers alive on their own.
  const Checkpoint& checkpoint() const { return checkpoint_; }
  // The manifest digest of store.h over the tensors and aux files: the version id.
  const store::Digest& manifest_id() const { return manifest_id_; }
  // Tensor digests (store.h), by name.
  const std::map<std::string, store::Digest>& digests() const { return digests_; }
  // Auxiliary files, sorted by name (config.json rewritten as `ferry convert` writes it when
  // an adapter was merged or a 4-bit base dequantised: MergedModelConfig, convert/converter.h).
  const AuxFiles& aux_files() const { return aux_files_; }
  Layout layout() const { return layout_; }
  // True when an adapter was merged in.
  bool merged() const { return merged_; }
  // Total tensor bytes.
  uint64_t bytes() const { return bytes_; }

 private:
  friend Result<std::shared_ptr<const Snapshot>> BuildSnapshot(const SnapshotSource&, const SnapshotOptions&);
  Snapshot() = default;

  Checkpoint checkpoint_;
  store::Digest manifest_id_;
  std::map<std::string, store::Digest> digests_;
  AuxFiles aux_files_;
  Layout layout_ = Layout::kHf;
  bool merged_ = false;
  uint64_t bytes_ = 0;
};

// Builds a snapshot of `source` (see the top of this file). Errors (nothing is returned):
// kInvalidArgument naming the tensor for two source names that normalise to the same name,
// a LoRA tensor among the source tensors without an adapter config, q/k/v (gate/up) that
// cannot be stacked, a bad aux file name (core/aux_files.h), or the lora layout; PlanMerge's and
// CheckMergeable's errors for the adapter; FindQuantized4bit's errors (kCorruption, kUnsupported)
// for a 4-bit weight whose companion tensors are missing or malformed; kCorruption for an
// unreadable config.json when an adapter is merged or a 4-bit base dequantised. REQUIRES: nobody
// writes the source tensors during the call.
Result<std::shared_ptr<const Snapshot>> BuildSnapshot(const SnapshotSource& source, const SnapshotOptions& options);

// Records `snapshot` as a version in `store`. options.kind kFull (the default) becomes
// kMerged for a merged snapshot; options.source kImport (the default) becomes kDaemon;
// options.layout is set to the snapshot's layout. The stored version id equals
// snapshot.manifest_id() (kInternal otherwise). Store errors pass through.
Result<store::ImportResult> RecordSnapshot(store::Store& store, const Snapshot& snapshot,
                                           const store::ImportOptions& options);

// Records a merged `snapshot` as a DERIVED version (store.h, "Derived versions"): its rows
// (name, dtype, shape, nbytes and the digests BuildSnapshot computed: nothing is re-hashed;
// no statistics) and aux files, no tensor bytes: recording a training step adds the
// adapter's bytes (its own version), not a model's. `ferry versions materialize` rebuilds
// the bytes from the base and adapter versions with the converter, bit-identical to the
// snapshot when the adapter version holds the adapter tensors and config the snapshot merged
// (e.g. the adapter_model.safetensors + adapter_config.json the trainer saved and imported)
// and the base version the base tensors and aux files it started from.
// options.base_version and options.adapter_version are required (kInvalidArgument naming the
// missing one) and must be recorded (Store::RecordDerived's errors); kind and source are
// adjusted as RecordSnapshot adjusts them. kInvalidArgument for a snapshot that merged no
// adapter. The version id equals snapshot.manifest_id() (kInternal otherwise);
// bytes_written counts only new aux files (0 when the run already holds them).
Result<store::ImportResult> RecordSnapshotDigests(store::Store& store, const Snapshot& snapshot,
                                                  const store::ImportOptions& options);

// A snapshot planned but not made, for models too big to hold merged in memory (the
// `--watch` path): Plan makes every check BuildSnapshot makes and fixes every output
// tensor's name, dtype and shape, but makes no tensor; checkpoint().Get(name) makes one on
// demand (merged and stacked tensors into new buffers; an unchanged tensor is the source's
// own, not a copy). Record streams it into a store one tensor at a time: peak memory is the
// largest output tensor (with its fp32 working copy), not the model, and the version
// recorded is exactly the one BuildSnapshot + RecordSnapshot record (same id).
// REQUIRES: the source tensors stay alive and unchanged while the LazySnapshot is used.
// Thread-compatible: one Get or Record at a time.
struct SnapshotPlanState;
class LazySnapshot {
 public:
  // BuildSnapshot's errors, before any tensor is made.
  static Result<std::unique_ptr<const LazySnapshot>> Plan(const SnapshotSource& source, const SnapshotOptions& options);

  // The output tensors (names sorted), made on each Get.
  const Checkpoint& checkpoint() const { return checkpoint_; }
  // As Snapshot::aux_files().
  const AuxFiles& aux_files() const;
  Layout layout() const;
  bool merged() const;
  uint64_t bytes() const;

  // RecordSnapshot for the lazily made tensors (the same adjustments of `options`). A
  // failure part-way commits nothing (objects already written stay for GarbageCollect).
  Result<store::ImportResult> Record(store::Store& store, const store::ImportOptions& options) const;

 private:
  LazySnapshot() = default;
  std::shared_ptr<SnapshotPlanState> state_;
  Checkpoint checkpoint_;
};

// Adapter-only publication: what a receiver that keeps the base needs to rebuild the
// publisher's merged weights and prove it did.
struct AdapterSnapshot {
  PeftConfig config;
  std::shared_ptr<const Checkpoint> adapter;  // adapter tensors, in buffers owned here
  std::map<std::string, store::Digest> adapter_digests;
  // The manifest id of the publisher's merged snapshot (BuildSnapshot of the same source
  // and options): the receiver's local merge must have exactly this id.
  store::Digest expected_merged_id;
  Layout layout = Layout::kHf;
};

// Copies the adapter tensors of `source` (which must have an adapter config; kInvalidArgument
// otherwise) and computes the merged manifest id by building the merged snapshot.
Result<AdapterSnapshot> BuildAdapterSnapshot(const SnapshotSource& source, const SnapshotOptions& options);

// Receiver side: merges `adapter` into the receiver's own base (`base.tensors` and
// `base.aux_files`; its adapter fields are ignored) and returns the merged snapshot.
// kCorruption naming both ids when the result's manifest id differs from
// adapter.expected_merged_id (the receiver's base or the adapter is not the publisher's).
Result<std::shared_ptr<const Snapshot>> ApplyAdapterSnapshot(const AdapterSnapshot& adapter, const SnapshotSource& base,
                                                             const SnapshotOptions& options);

// Delta publication: the names (sorted) of the snapshot's tensors whose digest is not in
// `receiver_has`.
std::vector<std::string> MissingTensors(const Snapshot& snapshot, const std::set<store::Digest>& receiver_has);

}  // namespace ferry::sync
