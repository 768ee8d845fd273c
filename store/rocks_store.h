// RocksStore: the Store of store.h over RocksDB and the object directories. Internal; the
// implementation is split by concern: rocks_store.cpp (open, reads, events, verify),
// import.cpp, derived.cpp, export.cpp, gc.cpp.
#pragma once

#include <atomic>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <vector>

#include <rocksdb/db.h>
#include <rocksdb/snapshot.h>

#include "store/object_store.h"
#include "store/store.h"

namespace ferry::store::internal {

// Thread-safe (store.h). Locks, each held only for what it names:
//   commit_mu_   a version's existence check, its run's next sequence and its batch write;
//   gc_mu_       shared by Import/ImportCheckpoint/Verify/Export, exclusive for GarbageCollect;
//   refresh_mu_  read-only stores: shared by every read that spans several keys, exclusive
//                for Refresh (a writable store gives such reads a RocksDB snapshot instead:
//                secondaries cannot take one).
// Object-file claims live in ObjectStore; the event counter is atomic.
class RocksStore final : public Store {
 public:
  static Result<std::unique_ptr<Store>> OpenImpl(const std::filesystem::path& dir, const StoreOptions& options);
  ~RocksStore() override;

  Result<ImportResult> Import(const std::filesystem::path& path, const ImportOptions& options) override;
  Result<ImportResult> ImportCheckpoint(const Checkpoint& ckpt, const AuxFiles& aux_files,
                                        const ImportOptions& options) override;
  Result<ImportResult> RecordDerived(const std::vector<TensorRow>& tensors, const AuxFiles& aux_files,
                                     const ImportOptions& options) override;
  Result<VersionRecord> GetVersion(std::string_view id_or_prefix) override;
  Result<std::vector<VersionRecord>> ListVersions(std::optional<std::string> run) override;
  Result<std::vector<std::string>> ListRuns() override;
  Result<std::optional<Digest>> Latest(const std::string& run) override;
  Result<Tensor> ReadTensor(const TensorRow& row, bool verify) override;
  Result<std::string> ReadAux(const AuxFile& aux) override;
  Result<std::vector<VerifyReport>> Verify(std::optional<Digest> version) override;
  Status Export(const Digest& version, const std::filesystem::path& out, bool force) override;
  using Store::AddEvent;
  Status AddEvent(const Event& e, bool sync) override;
  Result<std::vector<Event>> ListEvents(std::optional<Digest> version) override;
  Result<int64_t> GarbageCollect(int64_t keep) override;
  Status Refresh() override;

  // DamageObjectForTesting (internal.h) on this store.
  Status DamageObject(const Digest& digest, uint64_t offset);

 private:
  // Column families, in the order they are opened.
  enum Cf { kDefault = 0, kVersions, kTensors, kRuns, kLatest, kObjects, kEvents, kNumCf };
  static const char* CfName(int cf);

  RocksStore(std::filesystem::path dir, const StoreOptions& options)
      : dir_(std::move(dir)), options_(options), objects_(dir_, options.sync_objects) {}

  // "store <dir>: <what>: <rocksdb message>" with the code mapped from `s`.
  Status Translate(const rocksdb::Status& s, std::string_view what) const;
  // "store <dir>: <msg>"
  std::string Where(std::string_view msg) const;
  Status RequireWritable(std::string_view operation) const;

  // A consistent view of the database for reads that span several keys (a version record
  // and its tensor rows): what every read through `options()` sees is one committed state.
  class View {
   public:
    const rocksdb::ReadOptions& options() const { return options_; }

   private:
    friend class RocksStore;
    rocksdb::ReadOptions options_;
    std::unique_ptr<rocksdb::ManagedSnapshot> snapshot_;  // writable stores
    std::shared_lock<std::shared_mutex> refresh_lock_;    // read-only stores
  };
  View MakeView() const;

  // nullopt when absent.
  Result<std::optional<std::string>> Get(const rocksdb::ReadOptions& ro, Cf cf, const std::string& key) const;
  Status Write(rocksdb::WriteBatch& batch, std::string_view what, bool sync = true);
  // The record (tensors included); kNotFound naming the id when absent.
  Result<VersionRecord> LoadVersion(const rocksdb::ReadOptions& ro, const Digest& id) const;
  // The record without its tensor rows (`tensors` empty): its id, kind, lineage and totals.
  Result<VersionRecord> LoadVersionHeader(const rocksdb::ReadOptions& ro, const Digest& id) const;
  Result<bool> HasVersion(const rocksdb::ReadOptions& ro, const Digest& id) const;
  Result<std::vector<TensorRow>> LoadTensors(const rocksdb::ReadOptions& ro, const Digest& id) const;
  // Every version (tensors included) as `ro` sees them, oldest first.
  Result<std::vector<VersionRecord>> LoadAllVersions(const rocksdb::ReadOptions& ro) const;
  // The highest sequence of `run` (0 when it has none) and the version holding it.
  // REQUIRES: commit_mu_ held (so that it stays the highest until the caller commits).
  Result<std::pair<uint64_t, std::optional<Digest>>> LastOfRun(const std::string& run) const;
  // A small object's bytes (store.h, "objects"): nullopt when `row`'s object is a file or
  // has no "objects" row; kCorruption naming the tensor when the row is malformed.
  Result<std::optional<std::string>> SmallObject(const rocksdb::ReadOptions& ro, const TensorRow& row) const;
  // Re-hashes the object of a tensor: OK when intact, else kNotFound (no object) or
  // kCorruption (size or digest differs).
  Status CheckObject(const TensorRow& row) const;
  // The versions holding a tensor `name` with digest `digest` (for error messages).
  std::vector<Digest> VersionsHolding(const std::string& name, const Digest& digest) const;

  std::filesystem::path dir_;
  StoreOptions options_;
  ObjectStore objects_;
  std::unique_ptr<rocksdb::DB> db_;
  std::vector<rocksdb::ColumnFamilyHandle*> cfs_;
  std::filesystem::path secondary_dir_;  // read-only stores: RocksDB's private directory
  std::atomic<uint64_t> event_counter_{0};
  std::mutex commit_mu_;
  std::shared_mutex gc_mu_;
  mutable std::shared_mutex refresh_mu_;
};

}  // namespace ferry::store::internal
