// RecordDerived: a merged version recorded by its digests only (store.h, "Derived versions").
#include <algorithm>
#include <set>
#include <shared_mutex>

#include <rocksdb/write_batch.h>

#include "convert/converter.h"
#include "store/internal.h"
#include "store/rocks_store.h"

namespace ferry::store::internal {

std::string DerivedMessage(const VersionRecord& r) {
  return "version " + r.id.Hex() + " is derived from base " + (r.base_version ? r.base_version->Hex() : "?") +
         " + adapter " + (r.adapter_version ? r.adapter_version->Hex() : "?") + "; materialize it";
}

Result<ImportResult> RocksStore::RecordDerived(const std::vector<TensorRow>& tensors, const AuxFiles& aux_files,
                                               const ImportOptions& options) {
  FERRY_RETURN_IF_ERROR(RequireWritable("record a derived version"));
  const std::string what = "derived version";
  if (options.kind != VersionKind::kMerged) {
    return Status::InvalidArgument(Where(what + ": kind must be merged, not " + std::string(KindName(options.kind))));
  }
  if (!options.base_version) return Status::InvalidArgument(Where(what + ": no base_version given"));
  if (!options.adapter_version) return Status::InvalidArgument(Where(what + ": no adapter_version given"));
  if (!IsTensorLayout(options.layout)) {
    return Status::InvalidArgument(Where(what + ": layout '" + std::string(LayoutName(options.layout)) +
                                         "' is not one the converter merges into (hf or fused)"));
  }
  if (Status s = ValidateRunName(options.run); !s.ok()) return Status::InvalidArgument(Where(s.message()));
  for (const auto& [name, value] : options.metrics) {
    if (FirstInvalidUtf8(name) != std::string_view::npos) {
      return Status::InvalidArgument(Where("metric name '" + EscapeForMessage(name) + "' is not valid UTF-8"));
    }
  }
  std::set<std::string> aux_seen;
  for (const auto& [name, contents] : aux_files) {
    FERRY_RETURN_IF_ERROR(ValidateAuxFileName(name));
    if (!aux_seen.insert(name).second) return Status::InvalidArgument("auxiliary file '" + name + "' is given twice");
  }
  VersionRecord rec;
  rec.tensors = tensors;
  std::sort(rec.tensors.begin(), rec.tensors.end(),
            [](const TensorRow& a, const TensorRow& b) { return a.name < b.name; });
  for (size_t i = 0; i < rec.tensors.size(); ++i) {
    const TensorRow& row = rec.tensors[i];
    const std::string tensor = "tensor '" + EscapeForMessage(row.name) + "'";
    if (FirstInvalidUtf8(row.name) != std::string_view::npos) {
      return Status::InvalidArgument(Where(what + ": " + tensor + " is not valid UTF-8"));
    }
    if (i > 0 && rec.tensors[i - 1].name == row.name) {
      return Status::InvalidArgument(Where(what + ": " + tensor + " is given twice"));
    }
    auto size = CheckedByteSize(row.dtype, row.shape);
    if (!size.ok()) return Status::InvalidArgument(Where(what + ": " + tensor + ": " + size.status().message()));
    if (*size != row.nbytes) {
      return Status::InvalidArgument(Where(what + ": " + tensor + " has nbytes " + std::to_string(row.nbytes) +
                                           " but " + std::string(DTypeName(row.dtype)) + " " +
                                           ShapeToString(row.shape) + " holds " + std::to_string(*size)));
    }
    rec.total_bytes += row.nbytes;
  }
  for (const auto& [name, contents] : aux_files) {
    rec.aux.push_back(AuxFile{name, HashString(contents), contents.size()});
  }
  std::sort(rec.aux.begin(), rec.aux.end(), [](const AuxFile& a, const AuxFile& b) { return a.name < b.name; });
  rec.id = ManifestDigest(rec.tensors, rec.aux);

  std::shared_lock gc_lock(gc_mu_);  // the base and adapter stay while this commits
  // The versions it derives from (their records: the tensor rows are not needed).
  const View view = MakeView();
  auto base = LoadVersionHeader(view.options(), *options.base_version);
  if (!base.ok()) {
    if (base.status().code() != StatusCode::kNotFound) return base.status();
    return Status::NotFound(
        Where(what + " " + rec.id.Hex() + ": base version " + options.base_version->Hex() + " is not in the store"));
  }
  auto adapter = LoadVersionHeader(view.options(), *options.adapter_version);
  if (!adapter.ok()) {
    if (adapter.status().code() != StatusCode::kNotFound) return adapter.status();
    return Status::NotFound(Where(what + " " + rec.id.Hex() + ": adapter version " + options.adapter_version->Hex() +
                                  " is not in the store"));
  }
  if (adapter->kind != VersionKind::kAdapter) {
    return Status::InvalidArgument(Where(what + " " + rec.id.Hex() + ": adapter version " + adapter->id.Hex() +
                                         " is of kind " + std::string(KindName(adapter->kind)) + ", not adapter"));
  }
  if (adapter->base_version && *adapter->base_version != base->id) {
    return Status::InvalidArgument(Where(what + " " + rec.id.Hex() + ": adapter version " + adapter->id.Hex() +
                                         " applies to base " + adapter->base_version->Hex() + ", not " +
                                         base->id.Hex()));
  }
  if (base->derived) {
    return Status::InvalidArgument(Where(what + " " + rec.id.Hex() + ": base version " + base->id.Hex() +
                                         " is itself derived; record the base with its bytes"));
  }
  if (options.parent) {
    FERRY_ASSIGN_OR_RETURN(bool has, HasVersion(rocksdb::ReadOptions(), *options.parent));
    if (!has) return Status::NotFound(Where("parent version " + options.parent->Hex() + " not found"));
  }

  // Auxiliary files are stored (small); tensors are not.
  ObjectBatch batch(objects_);
  for (const auto& [name, contents] : aux_files) {
    Status s = batch.WriteAux(HashString(contents), contents);
    if (!s.ok()) return Status(s.code(), Where("auxiliary file '" + name + "': " + s.message()));
  }
  auto rewrite = batch.Finish();
  if (!rewrite.ok()) return Status(rewrite.status().code(), Where(rewrite.status().message()));
  if (Status s = batch.SyncDirs(); !s.ok()) return Status(s.code(), Where(s.message()));
  ImportResult result;
  result.bytes_written = batch.bytes_written();
  result.objects_written = batch.objects_written();

  std::lock_guard commit_lock(commit_mu_);
  FERRY_ASSIGN_OR_RETURN(bool exists, HasVersion(rocksdb::ReadOptions(), rec.id));
  if (exists) {
    FERRY_ASSIGN_OR_RETURN(result.record, LoadVersion(MakeView().options(), rec.id));
    result.already_present = true;
    return result;
  }
  FERRY_ASSIGN_OR_RETURN(auto last, LastOfRun(options.run));
  internal::StampRecord(rec, options, last);
  rec.derived = true;

  rocksdb::WriteBatch wb;
  const std::string id_key = DigestKey(rec.id);
  FERRY_ASSIGN_OR_RETURN(std::string encoded, EncodeVersion(rec));
  wb.Put(cfs_[kVersions], id_key, encoded);
  for (const TensorRow& row : rec.tensors) {  // no "objects" rows: nothing is stored
    FERRY_ASSIGN_OR_RETURN(encoded, EncodeTensorRow(row));
    wb.Put(cfs_[kTensors], TensorKey(rec.id, row.name), encoded);
  }
  wb.Put(cfs_[kRuns], RunKey(rec.run, rec.sequence), id_key);
  wb.Put(cfs_[kLatest], rec.run, id_key);
  FERRY_RETURN_IF_ERROR(Write(wb, "commit derived version " + rec.id.Hex()));
  result.record = std::move(rec);
  return result;
}

}  // namespace ferry::store::internal
