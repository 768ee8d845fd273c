// Read-only memory mapping of a whole file, and small helpers for writing files safely.
#pragma once

#include <cstddef>
#include <filesystem>
#include <memory>
#include <span>
#include <string>

#include "core/status.h"

namespace ferry {

// A read-only, private mapping of a file. Move-only. An empty file maps to an empty span.
class MappedFile {
 public:
  // Maps `path`. Errors (kNotFound, kIOError) name the path.
  static Result<std::shared_ptr<MappedFile>> Open(const std::filesystem::path& path);

  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  std::span<const std::byte> bytes() const { return {static_cast<const std::byte*>(addr_), size_}; }
  size_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }
  // The open read-only descriptor of the file (valid for the object's lifetime).
  int fd() const { return fd_; }

  // Hints that the given range will be read sequentially soon (madvise WILLNEED/SEQUENTIAL).
  void AdviseSequential(size_t offset, size_t length) const;

  // Drops the pages of [offset, offset + length) from this process's resident set
  // (madvise DONTNEED); they are read again from the page cache on the next access. Lets a
  // streaming reader keep its RSS bounded by the tensor at hand, not the file size.
  void Release(size_t offset, size_t length) const;

 private:
  MappedFile() = default;
  void* addr_ = nullptr;
  int fd_ = -1;
  size_t size_ = 0;
  std::filesystem::path path_;
};

// Reads a whole (small) file into a string. `limit` bounds the size accepted.
Result<std::string> ReadSmallFile(const std::filesystem::path& path, size_t limit = 64u << 20);

// Writes `contents` to `path` atomically: a temporary file in the same directory,
// fsync (file and directory, unless `sync` is false), rename. On failure nothing is left at
// `path` or at the temporary name.
Status WriteFileAtomic(const std::filesystem::path& path, std::string_view contents, bool sync = true);

// fsyncs a directory so that renames inside it are durable.
Status SyncDirectory(const std::filesystem::path& dir);

// A unique temporary name beside `final_path`: "<dir>/.<name>.tmp-<pid>-<n>".
std::filesystem::path TempNameFor(const std::filesystem::path& final_path);

// errno to a Status naming `what`.
Status ErrnoStatus(const std::string& what, int err);

}  // namespace ferry
