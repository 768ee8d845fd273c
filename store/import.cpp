// Hashing checkpoints (HashPath, HashCheckpoint) and importing them (the commit protocol).
#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <shared_mutex>
#include <thread>

#include <rocksdb/write_batch.h>

#include "store/internal.h"
#include "store/rocks_store.h"

namespace ferry::store {
namespace internal {

void StampRecord(VersionRecord& rec, const ImportOptions& options,
                 const std::pair<uint64_t, std::optional<Digest>>& last) {
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
}

}  // namespace internal

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

Result<VersionRecord> HashCheckpoint(const Checkpoint& ckpt, const AuxFiles& aux_files, const HashOptions& options) {
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
  const uint64_t total = ckpt.total_bytes();
  std::mutex progress_mu;
  uint64_t done = 0;
  auto report = [&](uint64_t n) {
    if (!options.progress) return;
    std::lock_guard<std::mutex> lock(progress_mu);
    done += n;
    options.progress(done, total);
  };
  // One tensor: digest (and statistics) in cache-sized pieces, then the visitor.
  auto visit = [&](const std::string& name) -> Result<TensorRow> {
    FERRY_ASSIGN_OR_RETURN(Tensor t, ckpt.Get(name));
    TensorDigester digester(t.dtype(), t.shape());
    std::optional<TensorStats> stats;
    if (options.stats) stats.emplace(t.dtype());
    auto bytes = t.bytes();
    for (size_t off = 0; off < bytes.size(); off += kChunkBytes) {
      auto piece = bytes.subspan(off, std::min(kChunkBytes, bytes.size() - off));
      digester.Update(piece);
      if (stats) stats->Update(piece);
      report(piece.size());
    }
    TensorRow row;
    row.name = name;
    row.dtype = t.dtype();
    row.shape = t.shape();
    row.digest = digester.Finish();
    row.nbytes = t.nbytes();
    if (stats) stats->Finish(row);
    Status s = options.on_tensor ? options.on_tensor(t, row) : Status::OK();
    ckpt.Release(name);
    if (!s.ok()) return s;
    return row;
  };

  const auto& names = ckpt.names();
  std::vector<std::optional<Result<TensorRow>>> rows(names.size());  // nullopt: skipped after an error
  if (ckpt.produced()) {
    for (size_t i = 0; i < names.size(); ++i) {
      rows[i] = visit(names[i]);
      if (!rows[i]->ok()) return rows[i]->status();
    }
  } else {
    // Tensors are independent: every core takes the next one.
    std::atomic<size_t> next{0};
    std::atomic<bool> failed{false};
    auto worker = [&] {
      for (size_t i = next++; i < names.size() && !failed.load(); i = next++) {
        rows[i] = visit(names[i]);
        if (!rows[i]->ok()) failed = true;
      }
    };
    // Below ~1 MiB (a trainer's adapter per step) starting a thread costs about what hashing
    // the whole checkpoint does: the caller's thread does it alone.
    constexpr uint64_t kParallelBytes = uint64_t{1} << 20;
    const size_t threads =
        total < kParallelBytes ? 1 : std::min<size_t>(std::max(1u, std::thread::hardware_concurrency()), names.size());
    std::vector<std::thread> pool;
    for (size_t k = 1; k < threads; ++k) pool.emplace_back(worker);
    worker();
    for (auto& th : pool) th.join();
  }
  for (const auto& r : rows) {
    if (r && !r->ok()) return r->status();
  }
  VersionRecord rec;
  for (auto& r : rows) {
    rec.total_bytes += (*r)->nbytes;
    rec.tensors.push_back(std::move(*r).value());
  }
  for (const auto& [name, contents] : aux_files) {
    rec.aux.push_back(AuxFile{name, HashString(contents), contents.size()});
  }
  std::sort(rec.aux.begin(), rec.aux.end(), [](const AuxFile& a, const AuxFile& b) { return a.name < b.name; });
  rec.id = ManifestDigest(rec.tensors, rec.aux);
  return rec;
}

Result<ImportResult> RocksStore::Import(const std::filesystem::path& path, const ImportOptions& options) {
  FERRY_RETURN_IF_ERROR(RequireWritable("import"));
  FERRY_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::Open(path));
  FERRY_ASSIGN_OR_RETURN(auto aux, AuxOf(path));
  ImportOptions opts = options;
  const bool adapter = LooksLikeAdapter(ckpt, aux);
  if (opts.kind == VersionKind::kFull && adapter) opts.kind = VersionKind::kAdapter;
  if (adapter && opts.kind != VersionKind::kAdapter) {
    return Status::InvalidArgument(path.string() +
                                   " is a PEFT adapter (adapter_config.json or adapter_model.*) and "
                                   "cannot be recorded as kind " +
                                   std::string(KindName(opts.kind)));
  }
  if (!adapter && opts.kind == VersionKind::kAdapter) {
    return Status::InvalidArgument(path.string() +
                                   " is not a PEFT adapter (no adapter_config.json or adapter_model.*) "
                                   "and cannot be recorded as kind adapter");
  }
  return ImportCheckpoint(ckpt, aux, opts);
}

Result<ImportResult> RocksStore::ImportCheckpoint(const Checkpoint& ckpt, const AuxFiles& aux_files,
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
  std::shared_lock gc_lock(gc_mu_);  // gc waits until this import committed or failed
  if (options.parent) {
    FERRY_ASSIGN_OR_RETURN(bool has, HasVersion(rocksdb::ReadOptions(), *options.parent));
    if (!has) return Status::NotFound(Where("parent version " + options.parent->Hex() + " not found"));
  }

  // 1. Hash every tensor (on every core); write the bytes of each one not yet stored while it
  //    is mapped, to a temporary name, its writeback started.
  //    A small tensor (at most small_object_bytes) goes into its "objects" row instead, in
  //    the commit batch: no file, no fdatasync of its own.
  ObjectBatch batch(objects_);
  std::mutex rows_mu;
  std::map<Digest, std::string> object_rows;  // the "objects" rows this import writes; guarded by rows_mu
  uint64_t small_bytes = 0;                   // guarded by rows_mu
  int64_t small_objects = 0;                  // guarded by rows_mu
  // Whether an object is stored: its row holds its bytes (a small object), or its row is
  // there and so is its file.
  auto stored = [&](const Digest& digest, uint64_t nbytes) -> Result<bool> {
    FERRY_ASSIGN_OR_RETURN(auto known, Get(rocksdb::ReadOptions(), kObjects, DigestKey(digest)));
    if (!known) return false;
    auto held = SmallObjectBytes(*known, nbytes);
    if (!held.ok()) return false;
    return !held->empty() || objects_.Present(ObjectStore::Kind::kTensor, digest, nbytes);
  };
  auto store_tensor = [&](const Tensor& t, const TensorRow& row) -> Status {
    FERRY_ASSIGN_OR_RETURN(const bool present, stored(row.digest, row.nbytes));
    if (present) return Status::OK();
    if (row.nbytes > 0 && row.nbytes <= options_.small_object_bytes) {
      // The bytes as they are in the row: nothing else is recorded under the digest.
      std::string value = SmallObjectRow(t.bytes());
      TensorDigester digester(row.dtype, row.shape);
      digester.Update(std::as_bytes(std::span<const char>(value.data() + 8, value.size() - 8)));
      if (const Digest got = digester.Finish(); got != row.digest) {
        return Status::Corruption(Where("tensor '" + row.name + "' changed while it was being stored (digest " +
                                        got.Hex() + ", hashed as " + row.digest.Hex() + "); nothing was committed"));
      }
      std::lock_guard lock(rows_mu);
      if (object_rows.insert_or_assign(row.digest, std::move(value)).second) {
        small_bytes += row.nbytes;
        ++small_objects;
      }
      return Status::OK();
    }
    Status s = batch.WriteTensor(row, t.bytes(), ckpt.RangeOf(row.name));
    if (!s.ok()) return Status(s.code(), Where(s.message()));
    std::lock_guard lock(rows_mu);
    object_rows[row.digest] = FileObjectRow(row.nbytes);
    return Status::OK();
  };
  HashOptions ho;
  ho.progress = options.progress;
  ho.on_tensor = store_tensor;
  auto hashed = HashCheckpoint(ckpt, aux_files, ho);
  if (!hashed.ok()) return hashed.status();
  VersionRecord rec = std::move(*hashed);
  for (const auto& [name, contents] : aux_files) {
    Status s = batch.WriteAux(HashString(contents), contents);
    if (!s.ok()) return Status(s.code(), Where("auxiliary file '" + name + "': " + s.message()));
  }
  // 2. The bytes are durable and in place before anything refers to them, including objects
  //    another import of this process was writing (rewritten here if that one failed).
  for (;;) {
    auto rewrite = batch.Finish();
    if (!rewrite.ok()) return Status(rewrite.status().code(), Where(rewrite.status().message()));
    if (rewrite->empty()) break;
    for (const TensorRow& row : *rewrite) {
      FERRY_ASSIGN_OR_RETURN(Tensor t, ckpt.Get(row.name));
      Status s = batch.WriteTensor(row, t.bytes(), ckpt.RangeOf(row.name));
      ckpt.Release(row.name);
      if (!s.ok()) return Status(s.code(), Where(s.message()));
      object_rows[row.digest] = FileObjectRow(row.nbytes);
    }
  }
  // Each tensor's "objects" row: the one written here, else the one stored (left as it is:
  // a small object's row holds its bytes).
  auto put_object_rows = [&](rocksdb::WriteBatch& wb) {
    for (const auto& [digest, value] : object_rows) wb.Put(cfs_[kObjects], DigestKey(digest), value);
  };
  if (Status s = batch.SyncDirs(); !s.ok()) return Status(s.code(), Where(s.message()));

  // 3. One synced batch makes the version visible. The existence check, the sequence and
  //    the write are one step for concurrent imports.
  std::lock_guard commit_lock(commit_mu_);
  // A small object that another import committed since this one looked for it is neither
  // written again nor counted as written here (its row holds the same bytes).
  for (auto it = object_rows.begin(); it != object_rows.end();) {
    const uint64_t n = it->second.size() - 8;  // a file's row is its size alone
    if (n == 0) {
      ++it;
      continue;
    }
    FERRY_ASSIGN_OR_RETURN(const bool present, stored(it->first, n));
    if (!present) {
      ++it;
      continue;
    }
    small_bytes -= n;
    --small_objects;
    it = object_rows.erase(it);
  }
  ImportResult result;
  result.bytes_written = batch.bytes_written() + small_bytes;
  result.objects_written = batch.objects_written() + small_objects;
  FERRY_ASSIGN_OR_RETURN(bool exists, HasVersion(rocksdb::ReadOptions(), rec.id));
  if (exists) {
    FERRY_ASSIGN_OR_RETURN(result.record, LoadVersion(MakeView().options(), rec.id));
    result.already_present = true;
    if (!result.record.derived) {
      if (object_rows.empty()) return result;
      rocksdb::WriteBatch wb;  // objects that were missing, written again
      put_object_rows(wb);
      FERRY_RETURN_IF_ERROR(Write(wb, "store the objects of version " + rec.id.Hex()));
      return result;
    }
    // A derived version's bytes: now stored, the record kept but no longer derived.
    result.record.derived = false;
    result.was_derived = true;
    rocksdb::WriteBatch wb;
    FERRY_ASSIGN_OR_RETURN(std::string encoded, EncodeVersion(result.record));
    wb.Put(cfs_[kVersions], DigestKey(rec.id), encoded);
    for (const TensorRow& row : rec.tensors) {  // the rows gain the statistics computed here
      FERRY_ASSIGN_OR_RETURN(encoded, EncodeTensorRow(row));
      wb.Put(cfs_[kTensors], TensorKey(rec.id, row.name), encoded);
    }
    put_object_rows(wb);
    result.record.tensors = rec.tensors;
    FERRY_RETURN_IF_ERROR(Write(wb, "store the bytes of derived version " + rec.id.Hex()));
    return result;
  }
  FERRY_ASSIGN_OR_RETURN(auto last, LastOfRun(options.run));
  internal::StampRecord(rec, options, last);
  if (rec.kind == VersionKind::kAdapter) rec.adapter_config = AdapterConfigOf(aux_files);

  rocksdb::WriteBatch wb;
  const std::string id_key = DigestKey(rec.id);
  FERRY_ASSIGN_OR_RETURN(std::string encoded, EncodeVersion(rec));
  wb.Put(cfs_[kVersions], id_key, encoded);
  for (const TensorRow& row : rec.tensors) {
    FERRY_ASSIGN_OR_RETURN(encoded, EncodeTensorRow(row));
    wb.Put(cfs_[kTensors], TensorKey(rec.id, row.name), encoded);
  }
  put_object_rows(wb);
  wb.Put(cfs_[kRuns], RunKey(rec.run, rec.sequence), id_key);
  wb.Put(cfs_[kLatest], rec.run, id_key);
  FERRY_RETURN_IF_ERROR(Write(wb, "commit version " + rec.id.Hex()));
  result.record = std::move(rec);
  return result;
}

}  // namespace internal

Result<VersionRecord> HashPath(const std::filesystem::path& path,
                               const std::function<void(uint64_t, uint64_t)>& progress) {
  FERRY_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::Open(path));
  FERRY_ASSIGN_OR_RETURN(auto aux, internal::AuxOf(path));
  internal::HashOptions ho;
  ho.stats = false;  // ferry verify compares digests; nothing shows statistics of a path
  ho.progress = progress;
  FERRY_ASSIGN_OR_RETURN(VersionRecord rec, internal::HashCheckpoint(ckpt, aux, ho));
  rec.run.clear();
  if (internal::LooksLikeAdapter(ckpt, aux)) {
    rec.kind = VersionKind::kAdapter;
    rec.adapter_config = internal::AdapterConfigOf(aux);
  }
  return rec;
}

}  // namespace ferry::store
