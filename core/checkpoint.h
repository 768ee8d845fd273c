// Checkpoint: the tensors of a model or adapter, wherever they live on disk.
//
// Opens, by path:
//   - a single .safetensors file;
//   - a directory with "<name>.safetensors.index.json" (sharded; every shard and every
//     tensor the index names must exist, and every tensor in a shard must be indexed);
//   - a directory with exactly one of model.safetensors / adapter_model.safetensors /
//     adapter_model.bin (the legacy torch pickle, read through a loader registered by the
//     LibTorch-backed target, see core/torch/legacy_bin.h);
//   - a directory with a single *.safetensors file.
// Tensor names are unique across the checkpoint.
#pragma once

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "core/status.h"
#include "core/tensor.h"

namespace ferry {

enum class CheckpointFormat { kSafetensorsFile, kSafetensorsSharded, kTorchPickle };

class Checkpoint {
 public:
  // Opens `path` as described above. Errors name the file (and tensor) at fault.
  static Result<Checkpoint> Open(const std::filesystem::path& path);

  // A checkpoint over tensors already in memory (tests, the legacy loader).
  static Checkpoint FromTensors(std::filesystem::path origin, std::map<std::string, Tensor> tensors);

  // Makes tensor `name` on demand. Must return exactly the dtype and shape announced for it.
  using TensorProducer = std::function<Result<Tensor>(const std::string& name)>;
  // A checkpoint whose tensors are computed when asked for: `infos` announce every tensor
  // (name, dtype, shape; begin/end are ignored) and Get(name) calls `produce(name)`, afresh
  // on every call, so a consumer that takes one tensor at a time (the store's import)
  // holds one tensor at a time. Get fails with kInternal naming the tensor when the
  // producer breaks its announcement; Release is a no-op. `produce` is shared by copies.
  static Checkpoint FromProducer(std::filesystem::path origin, std::vector<TensorInfo> infos, TensorProducer produce);

  const std::filesystem::path& path() const { return path_; }
  CheckpointFormat format() const { return format_; }
  // True for a FromProducer checkpoint. Get, RangeOf, Release and the accessors may be
  // called from several threads at once on any other checkpoint; a produced one is only as
  // thread-safe as its producer, so callers that do not know it ask for one tensor at a time.
  bool produced() const { return producer_ != nullptr; }
  // Sorted tensor names.
  const std::vector<std::string>& names() const { return names_; }
  size_t size() const { return names_.size(); }
  bool Contains(const std::string& name) const { return entries_.count(name) != 0; }

  // A zero-copy view of `name` (a computed tensor for FromProducer); kNotFound naming the
  // checkpoint when absent.
  Result<Tensor> Get(const std::string& name) const;
  // dtype and shape without touching data. nullptr when absent.
  const TensorInfo* Info(const std::string& name) const;
  // Where a tensor's bytes sit on disk (fd < 0 for in-memory tensors). See
  // SafetensorsFile::RangeOf and SafetensorsWriter::AppendFileRange.
  SafetensorsFile::FileRange RangeOf(const std::string& name) const;
  // Drops a mapped tensor's pages from the resident set once the caller is done with it
  // (a streaming pass over a model stays at the size of one tensor). No-op in memory.
  void Release(const std::string& name) const;
  // The file a tensor lives in ("" for in-memory tensors).
  std::filesystem::path FileOf(const std::string& name) const;
  // Files that make up the checkpoint (shards, or the single file).
  std::vector<std::filesystem::path> files() const;
  uint64_t total_bytes() const;
  // __metadata__ of the first file (empty for pickles).
  std::map<std::string, std::string> metadata() const;

 private:
  static constexpr int kInMemory = -1;
  static constexpr int kProduced = -2;
  struct Entry {
    int file = kInMemory;  // index into files_, or kInMemory / kProduced
    TensorInfo info;
  };
  static Result<Checkpoint> OpenIndex(const std::filesystem::path& index_path);
  static Result<Checkpoint> OpenShards(const std::filesystem::path& index_path,
                                       const std::map<std::string, std::vector<std::string>>& by_file);
  Status AddFile(std::shared_ptr<SafetensorsFile> f);
  void Finalize();

  std::filesystem::path path_;
  CheckpointFormat format_ = CheckpointFormat::kSafetensorsFile;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, Entry> entries_;
  std::map<std::string, Tensor> memory_;
  std::shared_ptr<const TensorProducer> producer_;
  std::vector<std::string> names_;
};

// Loader for torch pickles (adapter_model.bin / pytorch_model.bin). By default the first
// pickle opened loads Ferry's LibTorch plugin, libferry_torchio.so (core/torch/), with
// dlopen: from $FERRY_TORCHIO when set, else beside the running executable, else the
// system's library path. So only users who read pickles pay for loading LibTorch, and
// nothing but the plugin links it. SetLegacyLoader replaces the loader; nullptr disables
// pickle reading (kUnsupported).
using LegacyLoader = std::function<Result<std::map<std::string, Tensor>>(const std::filesystem::path&)>;
void SetLegacyLoader(LegacyLoader loader);

// The C entry point the plugin exports: returns a LegacyLoader* (never freed).
inline constexpr const char* kTorchioEntryPoint = "ferry_torchio_loader";

// Finds the weights file(s) in a directory: the index, model.safetensors,
// adapter_model.safetensors, adapter_model.bin, or a lone *.safetensors.
Result<std::filesystem::path> FindWeights(const std::filesystem::path& dir);

}  // namespace ferry
