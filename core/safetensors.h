// safetensors files: a validating zero-copy reader and a streaming, atomic writer.
//
// On-disk format: u64 little-endian N, N bytes of UTF-8 JSON header, data section.
// Header: {"<name>": {"dtype": D, "shape": [...], "data_offsets": [b, e]}, ...,
//          "__metadata__": {str: str}}; offsets are relative to the data section.
//
// The parser enforces every check of the reference implementation
// (huggingface/safetensors src/tensor.rs): header length <= 100,000,000; N + 8 within
// the file; valid UTF-8 JSON object; no duplicate names; known dtypes; element count x
// bits computed with overflow checks equal to end - begin; entries sorted by offset
// contiguous from 0 with no gap or overlap; data section ends exactly at end of file.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/mapped_file.h"
#include "core/status.h"
#include "core/tensor.h"

namespace ferry {

inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  uint64_t begin = 0;  // relative to the data section
  uint64_t end = 0;
  uint64_t nbytes() const { return end - begin; }
};

struct SafetensorsHeader {
  std::vector<TensorInfo> tensors;  // in data-offset order
  std::map<std::string, std::string> metadata;
  uint64_t data_offset = 0;  // 8 + N: absolute offset of the data section
};

// Parses and validates a header. `file` is the whole file (or at least its first 8 + N
// bytes); `file_size` is the real size of the file. Errors are kCorruption or
// kUnsupported with a message naming the tensor where there is one (not the file: the
// caller adds that).
Result<SafetensorsHeader> ParseSafetensorsHeader(std::span<const std::byte> file, uint64_t file_size);

// One memory-mapped, validated safetensors file. Tensors returned by Get() keep the
// mapping alive.
class SafetensorsFile : public std::enable_shared_from_this<SafetensorsFile> {
 public:
  // Maps and validates `path`. Every error message starts with the path.
  static Result<std::shared_ptr<SafetensorsFile>> Open(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return file_->path(); }
  const std::vector<TensorInfo>& tensors() const { return header_.tensors; }
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  uint64_t data_offset() const { return header_.data_offset; }
  uint64_t file_size() const { return file_->size(); }

  // nullptr when there is no such tensor.
  const TensorInfo* Find(std::string_view name) const;
  // A zero-copy view of a tensor of this file. REQUIRES: `info` belongs to this file.
  Tensor View(const TensorInfo& info) const;
  // kNotFound naming the file and tensor when absent.
  Result<Tensor> Get(std::string_view name) const;

  void AdviseSequential(const TensorInfo& info) const;
  // Where a tensor's bytes sit in the file: an open descriptor (owned by this object) and
  // the absolute byte offset, for in-kernel copies (SafetensorsWriter::AppendFileRange).
  struct FileRange {
    int fd = -1;
    uint64_t offset = 0;
    uint64_t length = 0;
  };
  FileRange RangeOf(const TensorInfo& info) const {
    return {file_->fd(), header_.data_offset + info.begin, info.nbytes()};
  }
  // Drops the tensor's pages from the resident set (see MappedFile::Release). Views stay valid.
  void Release(const TensorInfo& info) const;

 private:
  SafetensorsFile() = default;
  std::shared_ptr<MappedFile> file_;
  SafetensorsHeader header_;
  std::map<std::string, size_t, std::less<>> by_name_;
};

// ---------------------------------------------------------------------------------
// Writing.

struct TensorSpec {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
};

struct WriterOptions {
  // Split into shards of at most this many data bytes (a larger tensor gets a shard of its
  // own), named "<basename>-00001-of-0000N.safetensors" with "<basename>.safetensors.index.json".
  // 0: one file. Default: 0.
  uint64_t max_shard_bytes = 0;
  // Explicit shard of each declared tensor (same length as the specs, non-decreasing,
  // starting at 0, no shard left empty); overrides max_shard_bytes. Used to shard an output
  // exactly like its input. Default: empty (use max_shard_bytes).
  std::vector<uint32_t> shard_of;
  // Used for shard and index names. Default: "model".
  std::string basename = "model";
  // Written as "__metadata__". Default: {"format": "pt"} (transformers requires it).
  std::map<std::string, std::string> metadata = {{"format", "pt"}};
  // fsync files before renaming them into place. Default: true.
  bool sync = true;
};

// Streams tensors into one safetensors file or a sharded set, never holding more than
// one write buffer in memory. Tensors are declared up front (the header precedes the
// data) and their bytes are then appended in the declared order, in any number of pieces.
// Everything is written under temporary names and renamed into place by Finish(); a
// writer destroyed before Finish() removes its temporary files, so a failure or a crash
// never leaves a file that looks whole.
class SafetensorsWriter {
 public:
  // Writes a single file at `path` (options.max_shard_bytes must be 0).
  static Result<std::unique_ptr<SafetensorsWriter>> CreateFile(const std::filesystem::path& path,
                                                               std::vector<TensorSpec> specs,
                                                               WriterOptions options = {});
  // Writes into directory `dir` (which must exist): one "<basename>.safetensors" when
  // everything fits in one shard, else shards and an index.
  static Result<std::unique_ptr<SafetensorsWriter>> CreateInDirectory(const std::filesystem::path& dir,
                                                                      std::vector<TensorSpec> specs,
                                                                      WriterOptions options = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // Appends bytes of the current tensor (the first declared one not yet complete).
  // A piece may not cross into the next tensor.
  Status Append(std::span<const std::byte> bytes);
  // Appends `length` bytes read from `fd` at `offset`, copied inside the kernel
  // (copy_file_range, as cp does; falls back to pread/write) without mapping them into
  // this process. Same rules as Append. `fd` must stay open during the call.
  Status AppendFileRange(int fd, uint64_t offset, uint64_t length);
  // Appends a whole tensor. REQUIRES: it is the next declared tensor, matching dtype/shape.
  Status Write(std::string_view name, const Tensor& t);

  // Flushes, fsyncs, renames every file into place, and writes the index when sharded.
  Status Finish();

  // The final paths of the files this writer produces (shards then index).
  std::vector<std::filesystem::path> OutputPaths() const;
  uint64_t bytes_written() const { return bytes_written_; }

 private:
  struct Shard;
  SafetensorsWriter() = default;
  Status Init(const std::filesystem::path& dir, const std::filesystem::path* single_file);
  Status OpenShard(size_t i);
  Status CloseShard();
  Status FlushBuffer();
  Status AppendRaw(std::string_view data);
  Status FlushPendingRange();
  Status WriteHeader();
  Status Advance();
  void Abort();

  std::vector<TensorSpec> specs_;
  std::vector<uint64_t> sizes_;
  WriterOptions options_;
  std::vector<Shard> shards_;
  std::filesystem::path index_path_;
  size_t cur_tensor_ = 0;
  uint64_t cur_offset_ = 0;  // bytes of the current tensor written
  size_t cur_shard_ = SIZE_MAX;
  int fd_ = -1;
  std::vector<std::byte> buffer_;
  int pending_src_ = -1;  // a coalesced AppendFileRange not yet copied
  uint64_t pending_off_ = 0;
  uint64_t pending_len_ = 0;
  // The current shard's header. Written before the shard's first byte of data, unless that
  // data is a file range starting at its source's data section: then the copy starts at byte
  // 0 of both files and the header, padded to the source's data offset, is written over the
  // source's header bytes afterwards (header_over_copy_).
  std::string header_;
  bool header_pending_ = false;
  bool header_over_copy_ = false;
  size_t buffered_ = 0;
  uint64_t bytes_written_ = 0;
  bool finished_ = false;
};

// Serialises a header for `specs` (8-byte length prefix + JSON padded with spaces so
// the data section starts 8-byte aligned). Exposed for tests and tools.
Result<std::string> SerializeSafetensorsHeader(const std::vector<TensorSpec>& specs,
                                               const std::map<std::string, std::string>& metadata);

// Shard file name: "<basename>-00001-of-00003.safetensors".
std::string ShardFileName(const std::string& basename, size_t index, size_t count);

}  // namespace ferry
