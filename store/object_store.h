// The object directories of a store: DB/objects/ab/<30 hex> holds a tensor's raw bytes,
// DB/aux/ab/<30 hex> an auxiliary file's contents, each named by its digest (store.h).
// Files are written under a temporary name, fsynced (when asked), then renamed; the
// directories touched are collected so that the caller can fsync them once per commit.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <set>
#include <span>
#include <string_view>

#include "core/mapped_file.h"
#include "core/status.h"
#include "store/store.h"

namespace ferry::store::internal {

class ObjectStore {
 public:
  enum class Kind { kTensor, kAux };

  // `root` is the store directory DB/. `sync`: fsync files before renaming them.
  ObjectStore(std::filesystem::path root, bool sync) : root_(std::move(root)), sync_(sync) {}

  std::filesystem::path PathOf(Kind kind, const Digest& d) const;
  const std::filesystem::path& root() const { return root_; }
  std::filesystem::path TopDir(Kind kind) const { return root_ / (kind == Kind::kTensor ? "objects" : "aux"); }

  // True when the object file exists with exactly `size` bytes.
  bool Present(Kind kind, const Digest& d, uint64_t size) const;

  // Writes a tensor object, re-hashing the bytes as they are written: kCorruption naming
  // `tensor` when they no longer match `d` (the source changed since it was hashed).
  // The directories to fsync before the commit are added to `dirty_dirs`.
  Status WriteTensor(const Digest& d, DType dtype, const Shape& shape, std::span<const std::byte> bytes,
                     const std::string& tensor, std::set<std::filesystem::path>& dirty_dirs) const;
  // Writes an auxiliary file object (the caller computed `d` from `contents`).
  Status WriteAux(const Digest& d, std::string_view contents, std::set<std::filesystem::path>& dirty_dirs) const;

  // fsyncs every directory of `dirs` (no-op unless sync was asked for).
  Status SyncDirs(const std::set<std::filesystem::path>& dirs) const;

  // Re-hashes a tensor object: OK when it is intact, else kNotFound (file gone) or
  // kCorruption (size or digest differs), naming the file.
  Status CheckTensor(const TensorRow& row) const;
  Status CheckAux(const AuxFile& aux) const;

 private:
  Status WriteFile(const std::filesystem::path& final_path, std::span<const std::byte> bytes,
                   const std::function<Status(std::span<const std::byte>)>& check_piece,
                   const std::function<Status()>& check_end, std::set<std::filesystem::path>& dirty_dirs) const;

  std::filesystem::path root_;
  bool sync_ = true;
};

}  // namespace ferry::store::internal
