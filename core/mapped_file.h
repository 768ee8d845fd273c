// Read-only memory mapping of a whole file. (The file helpers that used to live here, and
// that many callers reach through this header, are in core/file_util.h.)
#pragma once

#include <cstddef>
#include <filesystem>
#include <memory>
#include <span>
#include <string>

#include "core/file_util.h"
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

}  // namespace ferry
