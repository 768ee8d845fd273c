// Watching a trainer's output directory: each new checkpoint directory it saves (a PEFT
// adapter or a full model, every N steps) becomes a store version ready to publish.
//
// A trainer writes a checkpoint non-atomically (file after file, each file in pieces), so a
// subdirectory of the watched directory is handled only once it has SETTLED: it holds a
// marker file (adapter_config.json or config.json) and the list of its files (recursively),
// their sizes and their mtimes are unchanged across two consecutive Poll() calls. A settled
// directory is then parsed:
//   adapter     adapter_config.json + adapter_model.safetensors (or .bin): imported as kind
//               adapter (base_version = the base, step), merged onto the base with
//               LazySnapshot (the converter's arithmetic, in the watcher's layout) and the
//               merged weights recorded tensor by tensor (kind merged, adapter_version,
//               base_version, step): memory holds one merged tensor at a time, never the
//               model. The merge is planned and checked BEFORE anything is imported, so an
//               adapter that does not fit the base leaves nothing behind.
//   full model  config.json + model.safetensors (or model.safetensors.index.json + shards):
//               imported as kind full (step).
// A settled directory that fails to parse, merge or record is reported once, as a
// per-checkpoint error naming the directory (and the file or tensor at fault), and never
// retried; the next directories are handled as usual. That includes a directory the store
// refuses (an auxiliary-looking file such as vocab.* whose name is not UTF-8 or holds a
// control character: kInvalidArgument) and an exception thrown while handling it (kInternal,
// "checkpoint DIR: unexpected exception: ..."). Each directory is handled at most once per
// watcher.
//
// Order: directories are handled in the natural order of their names (digit runs compare
// as numbers: checkpoint-100 before checkpoint-1000). The step is the trailing number of the
// name ("checkpoint-1500" -> 1500), none when the name does not end in digits.
// Start-up: of the subdirectories already present when the watcher is created that hold a
// marker file, only the newest (last in natural order) is handled; the older ones are
// history and are skipped. Subdirectories without a marker file at creation are watched
// like new ones. Names starting with '.' are ignored (temporary directories).
//
// The base is either a stored version id (a unique hex prefix is accepted; its tensors are
// read from the store, verified against their digests) or a base model directory (imported
// as kind base into the run first when the store lacks it, then read by mapping the
// directory's files). The base's auxiliary files (config.json, tokenizer files...) become
// the merged versions' auxiliary files, so a merged version is a directory an inference
// engine can load.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "store/store.h"
#include "sync/snapshot.h"

namespace ferry::sync {

struct WatchOptions {
  std::filesystem::path dir;    // the directory the trainer saves checkpoints into (must exist)
  std::string base;             // a stored version id (or unique prefix), or a base model directory
  std::string run = "default";  // run the versions are recorded in. Default: "default"
  Layout layout = Layout::kHf;  // layout of the merged snapshots (hf or fused). Default: hf
  int threads = 0;              // merge threads. Default: 0 = all hardware threads
};

// What became of one settled checkpoint directory.
struct WatchedCheckpoint {
  std::filesystem::path dir;
  std::optional<int64_t> step;                   // the trailing number of the directory name
  bool adapter = false;                          // an adapter checkpoint (else a full model)
  std::optional<store::Digest> adapter_version;  // adapters: the imported adapter version
  std::optional<store::Digest> version;          // the version to publish: merged (adapters) or full
  // Non-OK when the checkpoint was skipped; the message names the directory and the file or
  // tensor at fault. `version` and `adapter_version` are then unset (nothing was recorded,
  // except that an adapter whose merged version failed to record may stay imported).
  Status error;
};

// True when `a` sorts before `b` in natural order (runs of digits compare as numbers, then
// by length so "01" < "1" is deterministic; everything else bytewise).
bool NaturalLess(std::string_view a, std::string_view b);

// The trailing number of a directory name ("checkpoint-1500" -> 1500); none without one or
// when it does not fit an int64.
std::optional<int64_t> TrailingStep(std::string_view name);

// Turns new checkpoint directories into store versions (see the top of this file).
// Thread-compatible: call Poll() from one thread. The store must outlive the watcher; other
// threads (a Publisher serving what the watcher records) may use it meanwhile (Store is
// thread-safe, and an import does not hold up their reads).
class CheckpointWatcher {
 public:
  // Resolves the base (importing a base directory when the store lacks it), loads its
  // tensors and auxiliary files, and lists the directories already present (see start-up
  // above). Errors: kNotFound naming options.dir when it is not a directory; kNotFound naming
  // the base when it is neither a directory nor a stored version; kInvalidArgument naming
  // the base when it is an adapter; store and checkpoint errors pass through with the base
  // named.
  [[nodiscard]] static Result<std::unique_ptr<CheckpointWatcher>> Create(store::Store* store, WatchOptions options);

  // Scans the watched directory once and handles every directory that settled since the
  // previous call, in natural order. Returns one entry per handled directory (empty when
  // nothing settled). A broken checkpoint is an entry with `error` set, not a failed Poll;
  // Poll fails (kIOError naming the directory) only when the watched directory cannot be
  // listed.
  [[nodiscard]] Result<std::vector<WatchedCheckpoint>> Poll();

  // The base version id (merged versions record it as base_version).
  const store::Digest& base_version() const { return base_version_; }

 private:
  // A directory's file list: relative path -> (size, mtime in ns).
  using Fingerprint = std::map<std::string, std::pair<uint64_t, int64_t>>;

  CheckpointWatcher(store::Store* store, WatchOptions options) : store_(store), options_(std::move(options)) {}
  Status LoadBase();
  WatchedCheckpoint Handle(const std::filesystem::path& dir);
  Status ImportAdapter(const std::filesystem::path& dir, WatchedCheckpoint& out);
  Status ImportFull(const std::filesystem::path& dir, WatchedCheckpoint& out);

  store::Store* store_;
  WatchOptions options_;
  store::Digest base_version_;
  std::map<std::string, Tensor> base_tensors_;
  AuxFiles base_aux_;
  bool tie_word_embeddings_ = false;
  std::set<std::string> done_;                  // names handled or skipped
  std::map<std::string, Fingerprint> pending_;  // names seen, with their last fingerprint
};

}  // namespace ferry::sync
