// Hashing checkpoints (HashPath, HashCheckpoint) and importing them (the commit protocol).
#include <algorithm>
#include <atomic>
#include <mutex>
#include <set>
#include <thread>

#include <rocksdb/write_batch.h>

#include "store/internal.h"
#include "store/rocks_store.h"

namespace ferry::store {
namespace internal {
namespace {

// The directory whose auxiliary files go with the weights at `path`.
std::filesystem::path AuxDirOf(const std::filesystem::path& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return path;
  auto parent = path.parent_path();
  return parent.empty() ? std::filesystem::path(".") : parent;
}

bool LooksLikeAdapter(const Checkpoint& ckpt, const AuxFiles& aux) {
  for (const auto& [name, contents] : aux) {
    if (name == "adapter_config.json") return true;
  }
  for (const auto& f : ckpt.files()) {
    if (f.filename().string().rfind("adapter_model", 0) == 0) return true;
  }
  return false;
}

std::string AdapterConfigOf(const AuxFiles& aux) {
  for (const auto& [name, contents] : aux) {
    if (name == "adapter_config.json") return contents;
  }
  return "";
}

Result<AuxFiles> AuxOf(const std::filesystem::path& path) {
  auto aux = CollectAuxFiles(AuxDirOf(path));
  if (!aux.ok()) return aux.status();
  return aux;
}

}  // namespace

Result<VersionRecord> HashCheckpoint(const Checkpoint& ckpt,
                                     const AuxFiles& aux_files,
                                     const std::function<void(uint64_t, uint64_t)>& progress,
                                     const TensorVisitor& on_tensor) {
  // Names are checked before any byte is hashed or stored: they are recorded (JSON) and
  // hashed into the version id, so one that cannot be recorded exactly refuses the version.
  std::set<std::string> seen;
  for (const auto& [name, contents] : aux_files) {
    FERRY_RETURN_IF_ERROR(CheckAuxFileName(name));
    if (!seen.insert(name).second) return Status::InvalidArgument("auxiliary file '" + name + "' is given twice");
  }
  for (const std::string& name : ckpt.names()) {
    if (FirstInvalidUtf8(name) != std::string_view::npos) {
      return Status::InvalidArgument("tensor name '" + EscapeForMessage(name) + "' is not valid UTF-8");
    }
  }
  VersionRecord rec;
  const uint64_t total = ckpt.total_bytes();
  std::mutex progress_mu;
  uint64_t done = 0;
  auto hash_one = [&](const std::string& name, Tensor& t) -> Result<TensorRow> {
    FERRY_ASSIGN_OR_RETURN(t, ckpt.Get(name));
    TensorDigester digester(t.dtype(), t.shape());
    TensorStats stats(t.dtype());
    auto bytes = t.bytes();
    for (size_t off = 0; off < bytes.size(); off += kChunkBytes) {
      auto piece = bytes.subspan(off, std::min(kChunkBytes, bytes.size() - off));
      digester.Update(piece);
      stats.Update(piece);
      if (progress) {
        std::lock_guard<std::mutex> lock(progress_mu);
        done += piece.size();
        progress(done, total);
      }
    }
    TensorRow row;
    row.name = name;
    row.dtype = t.dtype();
    row.shape = t.shape();
    row.digest = digester.Finish();
    row.nbytes = t.nbytes();
    stats.Finish(row);
    return row;
  };
  const auto& names = ckpt.names();
  if (!on_tensor) {
    // Hashing only (ferry verify): tensors are independent, so every core takes the next one.
    std::vector<Result<TensorRow>> rows(names.size(), Status::Internal("not hashed"));
    std::atomic<size_t> next{0};
    auto worker = [&] {
      for (size_t i = next++; i < names.size(); i = next++) {
        Tensor t;
        rows[i] = hash_one(names[i], t);
        ckpt.Release(names[i]);
      }
    };
    const size_t threads = std::min<size_t>(std::max(1u, std::thread::hardware_concurrency()), names.size());
    std::vector<std::thread> pool;
    for (size_t k = 1; k < threads; ++k) pool.emplace_back(worker);
    worker();
    for (auto& th : pool) th.join();
    for (auto& r : rows) {
      if (!r.ok()) return r.status();
      rec.total_bytes += r->nbytes;
      rec.tensors.push_back(std::move(r).value());
    }
  } else {
    for (const std::string& name : names) {
      Tensor t;
      FERRY_ASSIGN_OR_RETURN(TensorRow row, hash_one(name, t));
      Status s = on_tensor(t, row);
      ckpt.Release(name);
      if (!s.ok()) return s;
      rec.total_bytes += row.nbytes;
      rec.tensors.push_back(std::move(row));
    }
  }
  for (const auto& [name, contents] : aux_files) {
    rec.aux.push_back(AuxFile{name, HashString(contents), contents.size()});
  }
  std::sort(rec.aux.begin(), rec.aux.end(), [](const AuxFile& a, const AuxFile& b) { return a.name < b.name; });
  rec.id = ManifestDigest(rec.tensors, rec.aux);
  return rec;
}

Status RocksStore::StoreTensorObject(const Tensor& t, const TensorRow& row, std::set<std::filesystem::path>& dirty,
                                     std::set<Digest>& written, ImportResult& result) {
  if (written.count(row.digest)) return Status::OK();
  FERRY_ASSIGN_OR_RETURN(auto known, Get(kObjects, DigestKey(row.digest)));
  if (known && objects_.Present(ObjectStore::Kind::kTensor, row.digest, row.nbytes)) return Status::OK();
  Status s = objects_.WriteTensor(row.digest, row.dtype, row.shape, t.bytes(), row.name, dirty);
  if (!s.ok()) return Status(s.code(), Where(s.message()));
  written.insert(row.digest);
  result.bytes_written += row.nbytes;
  ++result.objects_written;
  return Status::OK();
}

Result<ImportResult> RocksStore::Import(const std::filesystem::path& path, const ImportOptions& options) {
  FERRY_RETURN_IF_ERROR(RequireWritable("import"));
  FERRY_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::Open(path));
  FERRY_ASSIGN_OR_RETURN(auto aux, AuxOf(path));
  ImportOptions opts = options;
  const bool adapter = LooksLikeAdapter(ckpt, aux);
  if (opts.kind == VersionKind::kFull && adapter) opts.kind = VersionKind::kAdapter;
  if (adapter && opts.kind != VersionKind::kAdapter) {
    return Status::InvalidArgument(path.string() + " is a PEFT adapter (adapter_config.json or adapter_model.*) and "
                                   "cannot be recorded as kind " + std::string(KindName(opts.kind)));
  }
  if (!adapter && opts.kind == VersionKind::kAdapter) {
    return Status::InvalidArgument(path.string() + " is not a PEFT adapter (no adapter_config.json or adapter_model.*) "
                                   "and cannot be recorded as kind adapter");
  }
  return ImportCheckpoint(ckpt, aux, opts);
}

Result<ImportResult> RocksStore::ImportCheckpoint(const Checkpoint& ckpt,
                                                  const AuxFiles& aux_files,
                                                  const ImportOptions& options) {
  FERRY_RETURN_IF_ERROR(RequireWritable("import"));
  if (Status s = ValidateRunName(options.run); !s.ok()) return Status::InvalidArgument(Where(s.message()));
  // Every other text the version record holds must be UTF-8 too (the record is JSON).
  for (const auto& [name, value] : options.metrics) {
    if (FirstInvalidUtf8(name) != std::string_view::npos) {
      return Status::InvalidArgument(Where("metric name '" + EscapeForMessage(name) + "' is not valid UTF-8"));
    }
  }
  if (options.kind == VersionKind::kAdapter) {
    const std::string config = AdapterConfigOf(aux_files);
    if (size_t at = FirstInvalidUtf8(config); at != std::string_view::npos) {
      return Status::Corruption(
          Where("auxiliary file 'adapter_config.json' is not valid UTF-8 (byte " + std::to_string(at) + ")"));
    }
  }
  if (options.parent) {
    FERRY_ASSIGN_OR_RETURN(bool has, HasVersion(*options.parent));
    if (!has) return Status::NotFound(Where("parent version " + options.parent->Hex() + " not found"));
  }

  // 1. Hash every tensor; store the bytes of each one not yet stored while it is mapped.
  ImportResult result;
  std::set<std::filesystem::path> dirty;
  std::set<Digest> written;
  auto hashed = HashCheckpoint(ckpt, aux_files, options.progress, [&](const Tensor& t, const TensorRow& row) {
    return StoreTensorObject(t, row, dirty, written, result);
  });
  if (!hashed.ok()) return hashed.status();
  VersionRecord rec = std::move(*hashed);
  for (const auto& [name, contents] : aux_files) {
    Digest d = HashString(contents);
    if (objects_.Present(ObjectStore::Kind::kAux, d, contents.size())) continue;
    Status s = objects_.WriteAux(d, contents, dirty);
    if (!s.ok()) return Status(s.code(), Where("auxiliary file '" + name + "': " + s.message()));
    result.bytes_written += contents.size();
    ++result.objects_written;
  }
  // 2. The bytes are durable before anything refers to them.
  if (Status s = objects_.SyncDirs(dirty); !s.ok()) return Status(s.code(), Where(s.message()));

  FERRY_ASSIGN_OR_RETURN(bool exists, HasVersion(rec.id));
  if (exists) {
    FERRY_ASSIGN_OR_RETURN(result.record, LoadVersion(rec.id));
    result.already_present = true;
    return result;
  }

  // 3. One synced batch makes the version visible.
  FERRY_ASSIGN_OR_RETURN(auto last, LastOfRun(options.run));
  rec.run = options.run;
  rec.sequence = last.first + 1;
  rec.parent = options.parent ? options.parent : last.second;
  rec.kind = options.kind;
  rec.layout = options.layout;
  rec.source = options.source;
  rec.time_ns = NowNs();
  rec.step = options.step;
  rec.base_version = options.base_version;
  rec.adapter_version = options.adapter_version;
  rec.metrics = options.metrics;
  if (rec.kind == VersionKind::kAdapter) rec.adapter_config = AdapterConfigOf(aux_files);

  rocksdb::WriteBatch batch;
  const std::string id_key = DigestKey(rec.id);
  FERRY_ASSIGN_OR_RETURN(std::string encoded, EncodeVersion(rec));
  batch.Put(cfs_[kVersions], id_key, encoded);
  for (const TensorRow& row : rec.tensors) {
    FERRY_ASSIGN_OR_RETURN(encoded, EncodeTensorRow(row));
    batch.Put(cfs_[kTensors], TensorKey(rec.id, row.name), encoded);
    batch.Put(cfs_[kObjects], DigestKey(row.digest), U64Le(row.nbytes));
  }
  batch.Put(cfs_[kRuns], RunKey(rec.run, rec.sequence), id_key);
  batch.Put(cfs_[kLatest], rec.run, id_key);
  FERRY_RETURN_IF_ERROR(Write(batch, "commit version " + rec.id.Hex()));
  result.record = std::move(rec);
  return result;
}

}  // namespace internal

Result<VersionRecord> HashPath(const std::filesystem::path& path,
                               const std::function<void(uint64_t, uint64_t)>& progress) {
  FERRY_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::Open(path));
  FERRY_ASSIGN_OR_RETURN(auto aux, internal::AuxOf(path));
  FERRY_ASSIGN_OR_RETURN(VersionRecord rec, internal::HashCheckpoint(ckpt, aux, progress, nullptr));
  rec.run.clear();
  if (internal::LooksLikeAdapter(ckpt, aux)) {
    rec.kind = VersionKind::kAdapter;
    rec.adapter_config = internal::AdapterConfigOf(aux);
  }
  return rec;
}

}  // namespace ferry::store
