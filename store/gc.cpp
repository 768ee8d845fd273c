// GarbageCollect: drop old versions, then every object no kept version uses.
#include <map>
#include <set>

#include <rocksdb/write_batch.h>

#include "store/internal.h"
#include "store/rocks_store.h"

namespace ferry::store::internal {
namespace {

// Removes every file under `top` (two levels: ab/<rest>) whose digest is not in `keep`,
// including temporaries left by interrupted writes. Returns the first error.
Status RemoveUnused(const std::filesystem::path& top, const std::set<Digest>& keep) {
  std::error_code ec;
  if (!std::filesystem::exists(top, ec)) return Status::OK();
  std::vector<std::filesystem::path> doomed;
  for (std::filesystem::recursive_directory_iterator it(top, ec), end; it != end; it.increment(ec)) {
    if (ec) return Status::IOError(top.string() + ": cannot list: " + ec.message());
    if (it.depth() != 1 || it->is_directory(ec)) continue;
    const std::string hex = it->path().parent_path().filename().string() + it->path().filename().string();
    auto d = Digest::FromHex(hex);
    if (!d.ok() || it->path().parent_path().filename().string().size() != 2 || !keep.count(*d)) {
      doomed.push_back(it->path());
    }
  }
  if (ec) return Status::IOError(top.string() + ": cannot list: " + ec.message());
  for (const auto& p : doomed) {
    std::filesystem::remove(p, ec);
    if (ec) return Status::IOError(p.string() + ": cannot remove: " + ec.message());
  }
  return Status::OK();
}

}  // namespace

Result<int64_t> RocksStore::GarbageCollect(int64_t keep) {
  FERRY_RETURN_IF_ERROR(RequireWritable("garbage collection"));
  if (keep < 1) return Status::InvalidArgument(Where("gc: keep must be at least 1, got " + std::to_string(keep)));
  // No import, verify or export runs meanwhile: an import's objects are not yet referenced
  // by any record, and would be removed as unused.
  std::unique_lock gc_lock(gc_mu_);
  FERRY_ASSIGN_OR_RETURN(std::vector<VersionRecord> all, LoadAllVersions(rocksdb::ReadOptions()));
  std::map<Digest, const VersionRecord*> by_id;
  std::map<std::string, std::vector<const VersionRecord*>> by_run;
  for (const VersionRecord& r : all) {
    by_id[r.id] = &r;
    by_run[r.run].push_back(&r);
  }
  std::set<Digest> kept;
  for (auto& [run, list] : by_run) {
    std::sort(list.begin(), list.end(), [](auto* a, auto* b) { return a->sequence > b->sequence; });
    for (size_t i = 0; i < list.size() && i < static_cast<size_t>(keep); ++i) kept.insert(list[i]->id);
  }
  // Base/adapter references are dependencies (a merged or adapter version cannot be
  // materialised without them) and are followed transitively; a parent is history only.
  std::vector<Digest> work(kept.begin(), kept.end());
  while (!work.empty()) {
    const Digest id = work.back();
    work.pop_back();
    const VersionRecord* r = by_id[id];
    for (const auto& ref : {r->base_version, r->adapter_version}) {
      if (ref && by_id.count(*ref) && kept.insert(*ref).second) work.push_back(*ref);
    }
  }

  std::set<Digest> used_tensors, used_aux;
  for (const Digest& id : kept) {
    for (const TensorRow& row : by_id[id]->tensors) used_tensors.insert(row.digest);
    for (const AuxFile& a : by_id[id]->aux) used_aux.insert(a.digest);
  }
  rocksdb::WriteBatch batch;
  int64_t removed = 0;
  for (const VersionRecord& r : all) {
    if (kept.count(r.id)) continue;
    ++removed;
    batch.Delete(cfs_[kVersions], DigestKey(r.id));
    for (const TensorRow& row : r.tensors) batch.Delete(cfs_[kTensors], TensorKey(r.id, row.name));
    batch.Delete(cfs_[kRuns], RunKey(r.run, r.sequence));
  }
  {
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), cfs_[kObjects]));
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      auto d = DigestFromKey(it->key().ToStringView());
      if (!d.ok() || !used_tensors.count(*d)) batch.Delete(cfs_[kObjects], it->key());
    }
    if (!it->status().ok()) return Translate(it->status(), "gc: read objects");
  }
  // Records go first: a crash before the files are removed leaves orphans the next gc removes.
  FERRY_RETURN_IF_ERROR(Write(batch, "gc: delete " + std::to_string(removed) + " versions"));
  if (Status s = RemoveUnused(objects_.TopDir(ObjectStore::Kind::kTensor), used_tensors); !s.ok()) {
    return Status(s.code(), Where("gc: " + s.message()));
  }
  if (Status s = RemoveUnused(objects_.TopDir(ObjectStore::Kind::kAux), used_aux); !s.ok()) {
    return Status(s.code(), Where("gc: " + s.message()));
  }
  return removed;
}

}  // namespace ferry::store::internal
