// Internals of the store shared by its .cpp files: digest streaming with per-tensor stats,
// key encodings, JSON codecs, auxiliary-file discovery. Not part of the public API.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/aux_files.h"
#include "core/status.h"
#include "core/tensor.h"
#include "core/text.h"
#include "kernels/hash.h"
#include "store/store.h"

namespace ferry::store::internal {

using store::TensorDigester;

// Tensors are hashed, copied and checked in pieces of this size (a multiple of every
// element size) so that the statistics pass finds each piece still in cache.
inline constexpr size_t kChunkBytes = size_t{1} << 20;

// The statistics TensorRow records for floating-point tensors, accumulated piece by piece.
// Pieces must end on element boundaries (kChunkBytes-sized pieces do).
class TensorStats {
 public:
  explicit TensorStats(DType dtype);
  void Update(std::span<const std::byte> bytes);
  // Writes l2_norm, nonfinite and all_zero into `row` (zeros for non-float dtypes).
  void Finish(TensorRow& row) const;

 private:
  DType dtype_;
  bool enabled_ = false;
  double sum_squares_ = 0;
  int64_t nonfinite_ = 0;
  bool any_nonzero_ = false;
  std::vector<float> scratch_;
  std::vector<uint16_t> halves_;
};

// Tests only: flips the lowest bit of byte `offset` of the object of tensor digest `digest` in
// `store` (writable), whichever form the object has: a file, or a small object's "objects" row.
Status DamageObjectForTesting(Store& store, const Digest& digest, uint64_t offset);

// Tests only: allows or forbids the AVX2 statistics kernel (forbidden: the SSE2 path).
// Returns whether this CPU has AVX2. Not thread-safe.
bool SetStatsAvx2ForTesting(bool allowed);

// Digest of the bytes as a 16-byte big-endian key (hi then lo): key order = hex order.
std::string DigestKey(const Digest& d);
Result<Digest> DigestFromKey(std::string_view key);
// XXH3-128 of arbitrary bytes as a Digest.
Digest HashBytes(std::span<const std::byte> bytes);
Digest HashString(std::string_view s);
using store::ManifestDigest;

// Key encodings (see the column-family table in store.h).
std::string U64Be(uint64_t v);
uint64_t ReadU64Be(std::string_view bytes);  // REQUIRES: bytes.size() >= 8
std::string U64Le(uint64_t v);

// "objects" rows (store.h): u64le(size) for an object file, u64le(size) || the bytes for a
// small object kept in its row.
std::string FileObjectRow(uint64_t size);
std::string SmallObjectRow(std::span<const std::byte> bytes);
// The bytes a row holds (empty for an object file); kCorruption when the row is neither form
// for a tensor of `nbytes` bytes.
Result<std::string_view> SmallObjectBytes(std::string_view row, uint64_t nbytes);
// OK when a small object's `bytes` hash to `row.digest`, else kCorruption "its small object
// hashes to X, expected Y".
Status CheckSmallObject(const TensorRow& row, std::string_view bytes);
// The largest StoreOptions::small_object_bytes a store accepts.
inline constexpr uint64_t kMaxSmallObjectBytes = uint64_t{1} << 20;
std::string RunKey(const std::string& run, uint64_t sequence);
std::string TensorKey(const Digest& version, const std::string& name);
std::string EventKey(int64_t time_ns, uint64_t counter);

// JSON codecs. The version record is stored without its tensors (they live in "tensors").
// Callers validate the text fields first (ImportCheckpoint does); text that is still not
// UTF-8 is kInternal naming the record, never an exception. Events are history, not hashed:
// EncodeEvent replaces bytes that are not UTF-8 with U+FFFD and never fails.
Result<std::string> EncodeVersion(const VersionRecord& r);
Result<VersionRecord> DecodeVersion(std::string_view json);
Result<std::string> EncodeTensorRow(const TensorRow& row);
Result<TensorRow> DecodeTensorRow(std::string_view json);
std::string EncodeEvent(const Event& e);
Result<Event> DecodeEvent(std::string_view json);

// Run names become key prefixes: non-empty, at most 256 bytes, well-formed UTF-8 (they are
// stored in JSON records), no NUL or control characters.
Status ValidateRunName(const std::string& run);

// Text that goes into a JSON record must be well-formed UTF-8 (core/text.h).
using ferry::EscapeForMessage;
using ferry::FirstInvalidUtf8;
// Auxiliary files and their names: core/aux_files.h (CollectAuxFiles, ValidateAuxFileName).

// What HashCheckpoint computes and calls besides the digests.
using TensorVisitor = std::function<Status(const Tensor&, const TensorRow&)>;
struct HashOptions {
  // Fill in TensorRow's statistics (l2_norm, nonfinite, all_zero). Default: true. HashPath
  // (ferry verify) compares digests only and turns them off.
  bool stats = true;
  // Called with (bytes hashed so far, total bytes), never concurrently with itself.
  std::function<void(uint64_t, uint64_t)> progress;
  // Called after each tensor is hashed, while its bytes are still mapped, with the tensor and
  // its row, on the thread that hashed it: calls for different tensors run at once (one at a
  // time, in name order, for a produced checkpoint). An error it returns stops the pass.
  TensorVisitor on_tensor;
};

// Hashes every tensor of `ckpt` and every auxiliary file into a record with id, tensors
// (sorted by name), aux and total_bytes filled in. Tensors are hashed on every hardware
// thread, one tensor per thread at a time (a produced checkpoint: one at a time, in name
// order, each released before the next is made). The first error in name order is returned.
Result<VersionRecord> HashCheckpoint(const Checkpoint& ckpt, const AuxFiles& aux_files, const HashOptions& options);

// "version V is derived from base B + adapter A; materialize it" (full ids): what reads and
// exports of a derived version's missing bytes say.
std::string DerivedMessage(const VersionRecord& r);

// Nanoseconds since the Unix epoch.
int64_t NowNs();

// Fills a version record about to be committed from the import options and the run's last
// (sequence, id): run, sequence (last + 1), parent (given, else the run's last), kind, layout,
// source, commit time, step, base/adapter versions, metrics. Shared by every commit path.
void StampRecord(VersionRecord& rec, const ImportOptions& options,
                 const std::pair<uint64_t, std::optional<Digest>>& last);

}  // namespace ferry::store::internal
