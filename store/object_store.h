// The object directories of a store: DB/objects/ab/<30 hex> holds a tensor's raw bytes,
// DB/aux/ab/<30 hex> an auxiliary file's contents, each named by its digest (store.h).
//
// An import writes its new objects through one ObjectBatch (the commit protocol of store.h):
// each object goes to a temporary name beside its final one (copied in the kernel from the
// source file when there is one, else written from memory), its bytes are hashed back from
// the file and checked against the digest, and writeback is started at once
// (sync_file_range), so the disk writes while the next object is copied. Finish() then
// fdatasyncs every object (by then mostly written back) and renames it to its digest name:
// a name never holds bytes that are not durable or not checked. SyncDirs() fsyncs the
// directories once, before the commit.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string_view>
#include <vector>

#include "core/mapped_file.h"
#include "core/safetensors.h"
#include "core/status.h"
#include "store/store.h"

namespace ferry::store::internal {

class ObjectBatch;

// Thread-safe.
class ObjectStore {
 public:
  enum class Kind { kTensor, kAux };

  // `root` is the store directory DB/. `sync`: make objects durable before they are renamed
  // into place (fdatasync) and their directories before the commit (fsync).
  ObjectStore(std::filesystem::path root, bool sync) : root_(std::move(root)), sync_(sync) {}

  std::filesystem::path PathOf(Kind kind, const Digest& d) const;
  const std::filesystem::path& root() const { return root_; }
  std::filesystem::path TopDir(Kind kind) const { return root_ / (kind == Kind::kTensor ? "objects" : "aux"); }
  bool sync() const { return sync_; }

  // True when the object file exists with exactly `size` bytes.
  bool Present(Kind kind, const Digest& d, uint64_t size) const;

  // Re-hashes a tensor object: OK when it is intact, else kNotFound (file gone) or
  // kCorruption (size or digest differs), naming the file.
  Status CheckTensor(const TensorRow& row) const;
  Status CheckAux(const AuxFile& aux) const;

 private:
  friend class ObjectBatch;

  // A tensor object written by one batch of this process: in claims_ from the moment the
  // batch starts writing it until the batch is destroyed (after its commit), or until the
  // write fails.
  struct Claim {
    const ObjectBatch* owner = nullptr;
    Digest digest;
    bool done = false;  // the owner finished (ok) or gave up (!ok)
    bool ok = false;    // the object is in place under its digest name, durable when sync_
  };

  std::filesystem::path root_;
  bool sync_ = true;
  std::mutex claims_mu_;
  std::condition_variable claims_cv_;
  std::map<Digest, std::shared_ptr<Claim>> claims_;  // guarded by claims_mu_
};

// The object files one import writes (see the top of this file). Thread-safe: the worker
// threads of one import call WriteTensor at once. Objects are invisible until Finish; the
// destructor removes the temporary files of those never finished.
class ObjectBatch {
 public:
  explicit ObjectBatch(ObjectStore& objects) : objects_(objects) {}
  ~ObjectBatch();
  ObjectBatch(const ObjectBatch&) = delete;
  ObjectBatch& operator=(const ObjectBatch&) = delete;

  // Writes the tensor object of `row` unless this batch already holds it, or another live
  // batch of this process claimed it (Finish then waits for that write to finish). `bytes` are the
  // tensor's bytes; `source` is where the same bytes lie in an open file (fd < 0: nowhere;
  // they are written from memory), copied with copy_file_range. The bytes written are
  // hashed back from the new file: kCorruption naming `row.name` when they are not
  // `row.digest` (the source changed since it was hashed). Errors name the object file.
  Status WriteTensor(const TensorRow& row, std::span<const std::byte> bytes, const SafetensorsFile::FileRange& source);
  // Writes an auxiliary file object unless one with `contents.size()` bytes is in place
  // (the caller computed `d` from `contents`).
  Status WriteAux(const Digest& d, std::string_view contents);

  // Makes every object written so far durable and visible (fdatasync, rename), then waits
  // for the objects this batch relies on that other batches were writing. Returns the rows
  // of those whose writer failed: this batch has claimed them and must WriteTensor them and
  // call Finish again. On error the objects not yet renamed are removed.
  [[nodiscard]] Result<std::vector<TensorRow>> Finish();
  // fsyncs every directory holding an object this batch wrote or relies on, and the parent
  // of every directory it created (no-op without sync). REQUIRES: Finish returned no rows.
  [[nodiscard]] Status SyncDirs();

  uint64_t bytes_written() const { return bytes_written_.load(); }
  int64_t objects_written() const { return objects_written_.load(); }

 private:
  // An object written under a temporary name, not yet renamed.
  struct Pending {
    int fd = -1;
    std::filesystem::path tmp, final_path;
    std::shared_ptr<ObjectStore::Claim> claim;  // tensors only
  };
  // Another batch's write this batch relies on.
  struct Borrowed {
    TensorRow row;
    std::shared_ptr<ObjectStore::Claim> claim;
  };

  // Creates `dir` when missing (its parent becomes dirty).
  Status MakeDir(const std::filesystem::path& dir);
  // Writes the bytes to a new temporary file beside `final_path` and checks them (see
  // WriteTensor). On success the file is open in `out.fd`.
  Status WriteTemp(const std::filesystem::path& final_path, std::span<const std::byte> bytes,
                   const SafetensorsFile::FileRange& source, const TensorRow* row, Pending& out);
  // fdatasync, close, rename, mark the claim done. Closes the descriptor whatever happens.
  Status Complete(Pending& p);
  // Marks `claim` done and wakes the batches waiting for it.
  void Release(const std::shared_ptr<ObjectStore::Claim>& claim, bool ok);
  // Claims `digest` for this batch (ours = true), or returns the claim of the batch writing
  // it; nullptr when this batch claimed it before.
  std::shared_ptr<ObjectStore::Claim> ClaimOrFind(const Digest& digest, bool& ours);

  ObjectStore& objects_;
  std::atomic<uint64_t> bytes_written_{0};
  std::atomic<int64_t> objects_written_{0};
  std::mutex mu_;  // guards the members below
  std::vector<Pending> pending_;
  std::vector<Borrowed> borrowed_;
  std::set<std::filesystem::path> dirty_dirs_;
  std::set<Digest> claimed_;  // every digest this batch claimed; guarded by objects_.claims_mu_
};

}  // namespace ferry::store::internal
