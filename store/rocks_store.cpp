// Opening a store, reads, events, verification and the Status translation at the RocksDB edge.
#include "store/rocks_store.h"

#include <stdlib.h>

#include <algorithm>
#include <deque>
#include <map>

#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include "store/internal.h"

namespace ferry::store {

Result<std::unique_ptr<Store>> Store::Open(const std::filesystem::path& dir, const StoreOptions& options) {
  return internal::RocksStore::OpenImpl(dir, options);
}

namespace internal {
namespace {

constexpr char kSchemaKey[] = "schema";
// 2: "objects" rows may hold a small object's bytes. A version-1 store is a version-2 store
// without small objects: opening it for writing relabels it.
constexpr char kSchemaVersion[] = "2";
constexpr char kSchemaVersion1[] = "1";

bool IsHex(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

std::string ShortList(const std::vector<Digest>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size() && i < 3; ++i) s += (i ? ", " : "") + ids[i].Hex();
  if (ids.size() > 3) s += " and " + std::to_string(ids.size() - 3) + " more";
  return s;
}

}  // namespace

const char* RocksStore::CfName(int cf) {
  static const char* const kNames[kNumCf] = {"default", "versions", "tensors", "runs", "latest", "objects", "events"};
  return kNames[cf];
}

std::string RocksStore::Where(std::string_view msg) const { return "store " + dir_.string() + ": " + std::string(msg); }

Status RocksStore::Translate(const rocksdb::Status& s, std::string_view what) const {
  const std::string text = s.ToString();
  const std::string msg = Where(what) + ": " + text;
  if (s.IsNotFound()) return Status::NotFound(msg);
  if (s.IsCorruption()) return Status::Corruption(msg);
  if (s.IsIOError() && (text.find("lock") != std::string::npos || text.find("LOCK") != std::string::npos)) {
    return Status::FailedPrecondition(Where("another writer holds the store (" + text + ")"));
  }
  if (s.IsInvalidArgument() || s.IsNotSupported()) return Status::Corruption(msg);
  return Status::IOError(msg);
}

Status RocksStore::RequireWritable(std::string_view operation) const {
  if (options_.read_only) {
    return Status::FailedPrecondition(Where(std::string(operation) + " needs a writable store (opened read-only)"));
  }
  return Status::OK();
}

Result<std::unique_ptr<Store>> RocksStore::OpenImpl(const std::filesystem::path& dir, const StoreOptions& options) {
  std::unique_ptr<RocksStore> store(new RocksStore(dir, options));
  if (options.small_object_bytes > kMaxSmallObjectBytes) {
    return Status::InvalidArgument(store->Where("small_object_bytes " + std::to_string(options.small_object_bytes) +
                                                " is above the limit of " + std::to_string(kMaxSmallObjectBytes)));
  }
  const auto rdir = dir / "rocksdb";
  std::error_code ec;
  const bool exists = std::filesystem::exists(rdir / "CURRENT", ec);
  if (!exists) {
    if (options.read_only || !options.create_if_missing) {
      return Status::NotFound(store->Where("no Ferry store here (" + (rdir / "CURRENT").string() + " is missing)"));
    }
  }
  if (!options.read_only) {
    for (const auto& d : {rdir, dir / "objects", dir / "aux"}) {
      std::filesystem::create_directories(d, ec);
      if (ec) return Status::IOError(store->Where("cannot create " + d.string() + ": " + ec.message()));
    }
  }

  rocksdb::Options opts;
  opts.create_if_missing = !options.read_only;
  opts.create_missing_column_families = !options.read_only;
  opts.keep_log_file_num = 4;
  opts.max_log_file_size = 4 << 20;
  // Small objects put a training run's adapter bytes through the WAL and the memtables: keep
  // both bounded (RocksDB's defaults, 64 MiB memtables and a WAL kept until the quietest column
  // family flushes, doubled a run's store on disk and grew the writer's memory by the memtable).
  opts.write_buffer_size = 8 << 20;
  opts.max_total_wal_size = 32 << 20;
  std::vector<rocksdb::ColumnFamilyDescriptor> descs;
  for (int i = 0; i < kNumCf; ++i) descs.emplace_back(CfName(i), rocksdb::ColumnFamilyOptions(opts));
  rocksdb::DB* raw = nullptr;
  rocksdb::Status st;
  if (options.read_only) {
    // A secondary instance keeps its own LOG and MANIFEST copy in a private directory.
    std::string tmpl = (std::filesystem::temp_directory_path() / "ferry-secondary-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) return ErrnoStatus(store->Where("cannot create " + tmpl), errno);
    store->secondary_dir_ = tmpl;
    opts.max_open_files = -1;  // required for secondaries
    st = rocksdb::DB::OpenAsSecondary(opts, rdir.string(), store->secondary_dir_.string(), descs, &store->cfs_, &raw);
  } else {
    st = rocksdb::DB::Open(rocksdb::DBOptions(opts), rdir.string(), descs, &store->cfs_, &raw);
  }
  if (!st.ok()) return store->Translate(st, options.read_only ? "open as a reader" : "open");
  store->db_.reset(raw);

  FERRY_ASSIGN_OR_RETURN(auto schema, store->Get(rocksdb::ReadOptions(), kDefault, kSchemaKey));
  if (schema && *schema != kSchemaVersion && *schema != kSchemaVersion1) {
    return Status::Unsupported(store->Where("schema version " + *schema + "; this Ferry reads versions " +
                                            kSchemaVersion1 + " and " + kSchemaVersion));
  }
  if (!options.read_only && (!schema || *schema == kSchemaVersion1)) {  // a new store, or relabelling a 1
    rocksdb::WriteBatch batch;
    batch.Put(store->cfs_[kDefault], kSchemaKey, kSchemaVersion);
    FERRY_RETURN_IF_ERROR(store->Write(batch, "write schema"));
  }

  std::unique_ptr<rocksdb::Iterator> it(store->db_->NewIterator(rocksdb::ReadOptions(), store->cfs_[kEvents]));
  it->SeekToLast();
  if (it->Valid() && it->key().size() == 16) store->event_counter_ = ReadU64Be(it->key().ToStringView().substr(8)) + 1;
  if (!it->status().ok()) return store->Translate(it->status(), "read events");
  return std::unique_ptr<Store>(std::move(store));
}

RocksStore::~RocksStore() {
  if (db_) {
    for (auto* h : cfs_) db_->DestroyColumnFamilyHandle(h);
    cfs_.clear();
    (void)db_->Close();
    db_.reset();
  }
  if (!secondary_dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(secondary_dir_, ec);
  }
}

RocksStore::View RocksStore::MakeView() const {
  View v;
  if (options_.read_only) {
    v.refresh_lock_ = std::shared_lock<std::shared_mutex>(refresh_mu_);
  } else {
    v.snapshot_ = std::make_unique<rocksdb::ManagedSnapshot>(db_.get());
    v.options_.snapshot = v.snapshot_->snapshot();
  }
  return v;
}

Result<std::optional<std::string>> RocksStore::Get(const rocksdb::ReadOptions& ro, Cf cf,
                                                   const std::string& key) const {
  std::string value;
  rocksdb::Status st = db_->Get(ro, cfs_[cf], key, &value);
  if (st.IsNotFound()) return std::optional<std::string>();
  if (!st.ok()) return Translate(st, std::string("read ") + CfName(cf));
  return std::optional<std::string>(std::move(value));
}

Status RocksStore::Write(rocksdb::WriteBatch& batch, std::string_view what, bool sync) {
  rocksdb::WriteOptions wo;
  wo.sync = sync;
  rocksdb::Status st = db_->Write(wo, &batch);
  if (!st.ok()) return Translate(st, what);
  return Status::OK();
}

Result<bool> RocksStore::HasVersion(const rocksdb::ReadOptions& ro, const Digest& id) const {
  FERRY_ASSIGN_OR_RETURN(auto v, Get(ro, kVersions, DigestKey(id)));
  return v.has_value();
}

Result<std::vector<TensorRow>> RocksStore::LoadTensors(const rocksdb::ReadOptions& ro, const Digest& id) const {
  std::vector<TensorRow> rows;
  const std::string prefix = DigestKey(id);
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(ro, cfs_[kTensors]));
  for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
    auto row = DecodeTensorRow(it->value().ToStringView());
    if (!row.ok()) return Status::Corruption(Where("version " + id.Hex() + ": " + row.status().message()));
    rows.push_back(std::move(*row));
  }
  if (!it->status().ok()) return Translate(it->status(), "read tensors of version " + id.Hex());
  return rows;
}

Result<VersionRecord> RocksStore::LoadVersionHeader(const rocksdb::ReadOptions& ro, const Digest& id) const {
  FERRY_ASSIGN_OR_RETURN(auto json, Get(ro, kVersions, DigestKey(id)));
  if (!json) return Status::NotFound(Where("version " + id.Hex() + " not found"));
  auto rec = DecodeVersion(*json);
  if (!rec.ok()) return Status::Corruption(Where(rec.status().message()));
  return std::move(*rec);
}

Result<VersionRecord> RocksStore::LoadVersion(const rocksdb::ReadOptions& ro, const Digest& id) const {
  FERRY_ASSIGN_OR_RETURN(VersionRecord rec, LoadVersionHeader(ro, id));
  FERRY_ASSIGN_OR_RETURN(rec.tensors, LoadTensors(ro, id));
  return rec;
}

Result<std::vector<VersionRecord>> RocksStore::LoadAllVersions(const rocksdb::ReadOptions& ro) const {
  std::vector<VersionRecord> out;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(ro, cfs_[kVersions]));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    auto rec = DecodeVersion(it->value().ToStringView());
    if (!rec.ok()) return Status::Corruption(Where(rec.status().message()));
    FERRY_ASSIGN_OR_RETURN(rec->tensors, LoadTensors(ro, rec->id));
    out.push_back(std::move(*rec));
  }
  if (!it->status().ok()) return Translate(it->status(), "read versions");
  std::sort(out.begin(), out.end(), [](const VersionRecord& a, const VersionRecord& b) {
    return std::tie(a.time_ns, a.run, a.sequence) < std::tie(b.time_ns, b.run, b.sequence);
  });
  return out;
}

Result<std::pair<uint64_t, std::optional<Digest>>> RocksStore::LastOfRun(const std::string& run) const {
  const std::string prefix = run + std::string(1, '\0');
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), cfs_[kRuns]));
  it->SeekForPrev(RunKey(run, UINT64_MAX));
  if (!it->status().ok()) return Translate(it->status(), "read run " + run);
  if (!it->Valid() || !it->key().starts_with(prefix) || it->key().size() != prefix.size() + 8) {
    return std::pair<uint64_t, std::optional<Digest>>{0, std::nullopt};
  }
  FERRY_ASSIGN_OR_RETURN(Digest id, DigestFromKey(it->value().ToStringView()));
  return std::pair<uint64_t, std::optional<Digest>>{ReadU64Be(it->key().ToStringView().substr(prefix.size())), id};
}

Result<VersionRecord> RocksStore::GetVersion(std::string_view id_or_prefix) {
  std::string p(id_or_prefix);
  std::transform(p.begin(), p.end(), p.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (!IsHex(p) || p.size() > 32) {
    return Status::InvalidArgument(
        Where("'" + std::string(id_or_prefix) + "' is not a version id (32 hex characters)"));
  }
  const View view = MakeView();
  if (p.size() == 32) {
    FERRY_ASSIGN_OR_RETURN(Digest id, Digest::FromHex(p));
    return LoadVersion(view.options(), id);
  }
  if (p.size() < 6) {
    return Status::InvalidArgument(Where("version prefix '" + p + "' is too short (at least 6 hex characters)"));
  }
  // Seek to the whole bytes of the prefix, then compare hex text.
  std::string padded = p + std::string(32 - p.size(), '0');
  FERRY_ASSIGN_OR_RETURN(Digest lower, Digest::FromHex(padded));
  std::vector<Digest> matches;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(view.options(), cfs_[kVersions]));
  for (it->Seek(DigestKey(lower)); it->Valid() && matches.size() < 2; it->Next()) {
    FERRY_ASSIGN_OR_RETURN(Digest id, DigestFromKey(it->key().ToStringView()));
    if (id.Hex().compare(0, p.size(), p) != 0) break;
    matches.push_back(id);
  }
  if (!it->status().ok()) return Translate(it->status(), "read versions");
  if (matches.empty()) return Status::NotFound(Where("no version matches '" + p + "'"));
  if (matches.size() > 1) {
    return Status::InvalidArgument(
        Where("version prefix '" + p + "' is ambiguous (" + matches[0].Hex() + ", " + matches[1].Hex() + ", ...)"));
  }
  return LoadVersion(view.options(), matches[0]);
}

Result<std::vector<VersionRecord>> RocksStore::ListVersions(std::optional<std::string> run) {
  const View view = MakeView();
  if (!run) return LoadAllVersions(view.options());
  std::vector<VersionRecord> out;
  const std::string prefix = *run + std::string(1, '\0');
  std::vector<Digest> ids;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(view.options(), cfs_[kRuns]));
  for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
    if (it->key().size() != prefix.size() + 8) continue;  // a longer run name sharing the prefix
    FERRY_ASSIGN_OR_RETURN(Digest id, DigestFromKey(it->value().ToStringView()));
    ids.push_back(id);
  }
  if (!it->status().ok()) return Translate(it->status(), "read run " + *run);
  for (const Digest& id : ids) {
    FERRY_ASSIGN_OR_RETURN(VersionRecord r, LoadVersion(view.options(), id));
    out.push_back(std::move(r));
  }
  return out;
}

Result<std::vector<std::string>> RocksStore::ListRuns() {
  std::vector<std::string> runs;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), cfs_[kLatest]));
  for (it->SeekToFirst(); it->Valid(); it->Next()) runs.push_back(it->key().ToString());
  if (!it->status().ok()) return Translate(it->status(), "read runs");
  return runs;
}

Result<std::optional<Digest>> RocksStore::Latest(const std::string& run) {
  FERRY_ASSIGN_OR_RETURN(auto v, Get(rocksdb::ReadOptions(), kLatest, run));
  if (!v) return std::optional<Digest>();
  FERRY_ASSIGN_OR_RETURN(Digest id, DigestFromKey(*v));
  return std::optional<Digest>(id);
}

std::vector<Digest> RocksStore::VersionsHolding(const std::string& name, const Digest& digest) const {
  std::vector<Digest> ids;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), cfs_[kTensors]));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    auto key = it->key().ToStringView();
    if (key.size() != 16 + name.size() || key.substr(16) != name) continue;
    auto row = DecodeTensorRow(it->value().ToStringView());
    if (row.ok() && row->digest == digest) {
      auto id = DigestFromKey(key);
      if (id.ok()) ids.push_back(*id);
    }
  }
  return ids;
}

Result<std::optional<std::string>> RocksStore::SmallObject(const rocksdb::ReadOptions& ro, const TensorRow& row) const {
  if (row.nbytes == 0 || row.nbytes > kMaxSmallObjectBytes) return std::optional<std::string>();
  FERRY_ASSIGN_OR_RETURN(auto value, Get(ro, kObjects, DigestKey(row.digest)));
  if (!value) return std::optional<std::string>();
  auto bytes = SmallObjectBytes(*value, row.nbytes);
  if (!bytes.ok()) return Status::Corruption(Where("tensor '" + row.name + "': " + bytes.status().message()));
  if (bytes->empty()) return std::optional<std::string>();
  value->erase(0, 8);
  return value;
}

Status RocksStore::CheckObject(const TensorRow& row) const {
  FERRY_ASSIGN_OR_RETURN(auto small, SmallObject(rocksdb::ReadOptions(), row));
  if (!small) return objects_.CheckTensor(row);
  return CheckSmallObject(row, *small);
}

Result<Tensor> RocksStore::ReadTensor(const TensorRow& row, bool verify) {
  auto describe = [&] {
    auto holders = VersionsHolding(row.name, row.digest);
    std::string v = holders.empty() ? "no stored version" : "version " + ShortList(holders);
    return "tensor '" + row.name + "' of " + v;
  };
  FERRY_ASSIGN_OR_RETURN(auto small, SmallObject(rocksdb::ReadOptions(), row));
  if (small) {
    if (Status s = verify ? CheckSmallObject(row, *small) : Status::OK(); !s.ok()) {
      return Status::Corruption(Where(describe() + " is corrupted: " + s.message()));
    }
    auto owner = std::make_shared<const std::string>(std::move(*small));
    auto t =
        Tensor::Wrap(row.dtype, row.shape, std::as_bytes(std::span<const char>(owner->data(), owner->size())), owner);
    if (!t.ok()) return Status::Corruption(Where(describe() + ": " + t.status().message()));
    return t;
  }
  const auto path = objects_.PathOf(ObjectStore::Kind::kTensor, row.digest);
  auto file = MappedFile::Open(path);
  if (!file.ok()) {
    if (file.status().code() == StatusCode::kNotFound) {
      // Absent because only derived versions hold it: they have no objects of their own.
      const View view = MakeView();
      std::optional<VersionRecord> derived;
      bool only_derived = true;
      for (const Digest& id : VersionsHolding(row.name, row.digest)) {
        auto rec = LoadVersion(view.options(), id);
        if (!rec.ok() || !rec->derived) {
          only_derived = false;
          break;
        }
        if (!derived) derived = std::move(*rec);
      }
      if (derived && only_derived) {
        return Status::FailedPrecondition(Where("tensor '" + row.name + "': " + DerivedMessage(*derived)));
      }
    }
    return Status(file.status().code(),
                  Where(describe() + ": object " + path.string() + ": " + file.status().message()));
  }
  if ((*file)->size() != row.nbytes) {
    return Status::Corruption(Where(describe() + ": object " + path.string() + " has " +
                                    std::to_string((*file)->size()) + " bytes, expected " +
                                    std::to_string(row.nbytes)));
  }
  auto t = Tensor::Wrap(row.dtype, row.shape, (*file)->bytes(), *file);
  if (!t.ok()) return Status::Corruption(Where(describe() + ": " + t.status().message()));
  if (verify) {
    Digest got = TensorDigest(*t);
    if (got != row.digest) {
      return Status::Corruption(Where(describe() + " is corrupted: object " + path.string() + " hashes to " +
                                      got.Hex() + ", expected " + row.digest.Hex()));
    }
  }
  return t;
}

Result<std::string> RocksStore::ReadAux(const AuxFile& aux) {
  const auto path = objects_.PathOf(ObjectStore::Kind::kAux, aux.digest);
  auto text = ReadSmallFile(path, size_t{256} << 20);
  if (!text.ok()) {
    return Status(text.status().code(), Where("auxiliary file '" + aux.name + "': " + text.status().message()));
  }
  if (text->size() != aux.size || HashString(*text) != aux.digest) {
    return Status::Corruption(Where("auxiliary file '" + aux.name + "' is corrupted: object " + path.string() +
                                    " does not match digest " + aux.digest.Hex()));
  }
  return text;
}

Result<std::vector<VerifyReport>> RocksStore::Verify(std::optional<Digest> version) {
  std::shared_lock gc_lock(gc_mu_);  // gc must not remove objects while they are checked
  std::vector<VersionRecord> records;
  if (version) {
    FERRY_ASSIGN_OR_RETURN(VersionRecord r, LoadVersion(MakeView().options(), *version));
    records.push_back(std::move(r));
  } else {
    FERRY_ASSIGN_OR_RETURN(records, LoadAllVersions(MakeView().options()));
  }
  // An object shared by many versions is hashed once per call.
  std::map<Digest, StatusCode> tensor_state, aux_state;
  // Fills missing/corrupted of `rep` from `r`'s objects (a derived version's tensors have none).
  auto check = [&](const VersionRecord& r, VerifyReport& rep) {
    if (!r.derived) {
      for (const TensorRow& row : r.tensors) {
        auto [it, fresh] = tensor_state.try_emplace(row.digest, StatusCode::kOk);
        if (fresh) it->second = CheckObject(row).code();
        if (it->second == StatusCode::kNotFound) {
          rep.missing.push_back(row.name);
        } else if (it->second != StatusCode::kOk) {
          rep.corrupted.push_back(row.name);
        }
      }
    }
    for (const AuxFile& a : r.aux) {
      auto [it, fresh] = aux_state.try_emplace(a.digest, StatusCode::kOk);
      if (fresh) it->second = objects_.CheckAux(a).code();
      if (it->second == StatusCode::kNotFound) {
        rep.missing.push_back(a.name);
      } else if (it->second != StatusCode::kOk) {
        rep.corrupted.push_back(a.name);
      }
    }
  };
  std::map<Digest, const VersionRecord*> by_id;
  for (const VersionRecord& r : records) by_id[r.id] = &r;
  std::deque<VersionRecord> dependencies;  // loaded for a derived version verified alone
  std::vector<VerifyReport> reports;
  for (const VersionRecord& r : records) {
    VerifyReport rep;
    rep.version = r.id;
    rep.derived = r.derived;
    check(r, rep);
    if (r.derived) {
      // Its bytes are its base's and adapter's: those must be recorded and intact.
      for (const auto& [role, id] : {std::pair<const char*, std::optional<Digest>>{"base", r.base_version},
                                     std::pair<const char*, std::optional<Digest>>{"adapter", r.adapter_version}}) {
        const std::string who = std::string(role) + " version " + (id ? id->Hex() : "?");
        const VersionRecord* dep = nullptr;
        if (id) {
          if (auto it = by_id.find(*id); it != by_id.end()) {
            dep = it->second;
          } else {
            auto loaded = LoadVersion(MakeView().options(), *id);
            if (loaded.ok()) {
              dependencies.push_back(std::move(*loaded));
              dep = &dependencies.back();
              by_id[*id] = dep;
            } else if (loaded.status().code() != StatusCode::kNotFound) {
              return loaded.status();
            }
          }
        }
        if (dep == nullptr) {
          rep.dependencies.push_back(who + ": not in the store");
          continue;
        }
        VerifyReport dep_rep;
        check(*dep, dep_rep);
        for (const auto& name : dep_rep.missing) rep.dependencies.push_back(who + ": '" + name + "' is missing");
        for (const auto& name : dep_rep.corrupted) rep.dependencies.push_back(who + ": '" + name + "' is corrupted");
      }
    }
    reports.push_back(std::move(rep));
  }
  return reports;
}

Status RocksStore::AddEvent(const Event& e, bool sync) {
  FERRY_RETURN_IF_ERROR(RequireWritable("adding an event"));
  if (e.time_ns < 0) return Status::InvalidArgument(Where("event time " + std::to_string(e.time_ns) + " is negative"));
  Event stored = e;
  if (stored.time_ns == 0) stored.time_ns = NowNs();
  rocksdb::WriteBatch batch;
  batch.Put(cfs_[kEvents], EventKey(stored.time_ns, event_counter_.fetch_add(1)), EncodeEvent(stored));
  return Write(batch, "add event for version " + e.version.Hex(), sync);
}

Result<std::vector<Event>> RocksStore::ListEvents(std::optional<Digest> version) {
  std::vector<Event> out;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), cfs_[kEvents]));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    auto e = DecodeEvent(it->value().ToStringView());
    if (!e.ok()) {
      // Named by its key: (time in ns since the epoch, counter), 8 bytes each, big-endian.
      const std::string_view key = it->key().ToStringView();
      std::string name = "the event record with key ";
      if (key.size() == 16) {
        name += "(time " + std::to_string(ReadU64Be(key.substr(0, 8))) + " ns, counter " +
                std::to_string(ReadU64Be(key.substr(8))) + ")";
      } else {
        name += "of " + std::to_string(key.size()) + " bytes";
      }
      return Status::Corruption(Where(name + ": " + e.status().message()));
    }
    if (!version || e->version == *version) out.push_back(std::move(*e));
  }
  if (!it->status().ok()) return Translate(it->status(), "read events");
  return out;
}

Status RocksStore::Refresh() {
  if (!options_.read_only) return Status::OK();
  std::unique_lock lock(refresh_mu_);  // waits for reads spanning several keys (View)
  rocksdb::Status st = db_->TryCatchUpWithPrimary();
  if (!st.ok()) return Translate(st, "catch up with the writer");
  return Status::OK();
}

Status RocksStore::DamageObject(const Digest& digest, uint64_t offset) {
  FERRY_ASSIGN_OR_RETURN(auto value, Get(rocksdb::ReadOptions(), kObjects, DigestKey(digest)));
  if (value && value->size() > 8) {
    if (offset >= value->size() - 8) return Status::InvalidArgument(Where("offset past the small object"));
    (*value)[8 + offset] = static_cast<char>((*value)[8 + offset] ^ 1);
    rocksdb::WriteBatch batch;
    batch.Put(cfs_[kObjects], DigestKey(digest), *value);
    return Write(batch, "damage object " + digest.Hex());
  }
  const auto path = objects_.PathOf(ObjectStore::Kind::kTensor, digest);
  FERRY_ASSIGN_OR_RETURN(std::string bytes, ReadSmallFile(path, kMaxSmallObjectBytes << 10));
  if (offset >= bytes.size()) return Status::InvalidArgument(Where("offset past the object " + path.string()));
  bytes[offset] = static_cast<char>(bytes[offset] ^ 1);
  return WriteFileAtomic(path, bytes);
}

Status DamageObjectForTesting(Store& store, const Digest& digest, uint64_t offset) {
  return static_cast<RocksStore&>(store).DamageObject(digest, offset);
}

}  // namespace internal
}  // namespace ferry::store
