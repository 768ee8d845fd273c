// File helpers every part shares: whole writes, atomic small files, fsync, temporary names,
// errno translation, and which file names hold weights.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>

#include "core/status.h"

namespace ferry {

// Writes all of `bytes` to `fd` (retrying on EINTR and short writes), handing the kernel at
// most kMaxWriteCall bytes per write(2): measured on Linux 6.18 / ext4 (bench/convert_bench.sh,
// 2.1 GB model), tensor-sized calls cost 3-6x the system time of the same bytes in 1 MiB
// calls. Errors are kIOError "<path>: write: <strerror>" (a write that returns 0 is EIO).
inline constexpr size_t kMaxWriteCall = size_t{1} << 20;
Status WriteAll(int fd, std::span<const std::byte> bytes, const std::filesystem::path& path);

// Writes all of `bytes` at `offset` of `fd` with pwrite(2) (retrying on EINTR and short
// writes; the file offset is not moved, so threads may write disjoint ranges of one fd).
// Errors are kIOError "<path>: write at offset <n> failed: <strerror>" (0 written is EIO).
[[nodiscard]] Status PwriteAll(int fd, std::span<const std::byte> bytes, uint64_t offset,
                               const std::filesystem::path& path);

// Reads a whole (small) file into a string. `limit` bounds the size accepted.
Result<std::string> ReadSmallFile(const std::filesystem::path& path, size_t limit = 64u << 20);

// Writes `contents` to `path` atomically: a temporary file in the same directory,
// fsync (file and directory, unless `sync` is false), rename. On failure nothing is left at
// `path` or at the temporary name.
Status WriteFileAtomic(const std::filesystem::path& path, std::string_view contents, bool sync = true);

// fsyncs the regular file at `path` (opened read-only). kIOError naming it on failure.
Status SyncFile(const std::filesystem::path& path);

// fsyncs a directory so that renames inside it are durable.
Status SyncDirectory(const std::filesystem::path& dir);

// A unique temporary name beside `final_path`: "<dir>/.<name>.tmp-<pid>-<n>".
std::filesystem::path TempNameFor(const std::filesystem::path& final_path);

// errno to a Status naming `what` (kNotFound for ENOENT, kIOError otherwise).
Status ErrnoStatus(const std::string& what, int err);

// True for the file names that hold weights or their index, never auxiliary files:
// "*.safetensors", "*.safetensors.index.json" (any "*.index.json"), and the pickle formats
// "*.bin", "*.pt", "*.pth".
bool IsWeightFileName(std::string_view name);

}  // namespace ferry
