// The weight store: every set of weights Ferry produces, imports or moves becomes a
// content-addressed, verifiable version recorded in RocksDB.
//
// ---------------------------------------------------------------------------------------
// Digests (defined here, once; docs/store.md repeats them).
//   tensor digest   = XXH3-128( "ferry.tensor.v1\0" || dtype name || "\0" || u32le(ndim) ||
//                               i64le(dim_0) .. i64le(dim_n-1) || raw bytes )
//                     raw bytes little-endian, C order, exactly as in safetensors.
//   manifest digest = XXH3-128( "ferry.manifest.v1\0" || for each tensor sorted by name:
//                               name || "\0" || dtype name || "\0" || u32le(ndim) ||
//                               i64le dims || tensor digest (16 bytes, big-endian hi then lo)
//                               || "ferry.aux.v1\0" || for each auxiliary file sorted by
//                               name: name || "\0" || XXH3-128(contents) (16 bytes) )
//   Digests print as 32 lowercase hex characters (hi then lo). The version id IS the
//   manifest digest: the same weights (and configs) always get the same id.
//   Auxiliary files: config.json, generation_config.json, tokenizer*.json,
//   special_tokens_map.json, tokenizer.model, vocab.*, merges.txt, chat_template.*,
//   adapter_config.json — whichever exist beside the weights, except weight file names
//   (the one rule, core/aux_files.h, shared with the converter and sync).
//
// On-disk layout of a store at DB/:
//   DB/rocksdb/            RocksDB, column families below
//   DB/objects/ab/cdef…    tensor bytes, one file per tensor digest (raw bytes only, no
//                          header), written to a temp name, fsynced, renamed: shared by every
//                          version that holds the same tensor (frozen base weights are stored
//                          once). Chosen over RocksDB blob files so that tensors can be
//                          memory-mapped and copied with copy_file_range when materialised,
//                          and verified or collected file by file.
//                          Except small objects (StoreOptions::small_object_bytes, 64 KiB
//                          by default): their bytes live in their "objects" row, committed
//                          in the version's own batch (an adapter's tensors are mostly small,
//                          and a file each made every training step's record ~60 fsyncs).
//   DB/aux/ab/cdef…        auxiliary files by content digest, same rules.
//
// RocksDB column families (keys are bytes; u64be = 8-byte big-endian so keys sort numerically):
//   "versions"  version id (16 bytes)                    -> VersionRecord as JSON
//   "tensors"   version id || name                        -> TensorRow as JSON
//   "runs"      run || "\0" || u64be(sequence)            -> version id
//   "latest"    run                                       -> version id
//   "objects"   tensor digest (16 bytes)                  -> u64le(size) (presence = stored; the
//                                                            object is a file), or u64le(size)
//                                                            || the bytes (a small object)
//   "events"    u64be(time_ns) || u64be(event counter)    -> Event as JSON
//   "default"   "schema"                                  -> "2" ("1": written before small
//                                                            objects; read as is, relabelled
//                                                            "2" when opened for writing)
//
// Commit protocol: each new object file is written under a temporary name, its bytes
// re-hashed from the file and checked against its digest, fdatasynced and only then renamed
// to its digest name, so no object file ever holds wrong or partial bytes under that name;
// the directories touched are fsynced. Then ONE WriteBatch with sync = true adds the
// version record, its tensor rows, the "objects" rows of the objects it wrote (small objects'
// bytes included, re-hashed from the row's copy), the run index entry and the latest
// pointer. A version is
// visible iff its batch committed, so a crash at any point leaves either the whole version
// or none of it (orphan objects are removed by gc). Readers (the CLI) may open the store
// while a writer holds it: they open RocksDB as a secondary instance and see every version
// committed before they opened.
//
// Thread safety: a Store is thread-safe; one Store object is shared by every thread of a
// process (the daemon records versions while a publisher serves them and events arrive).
// RocksDB serialises its own writes; the store itself serialises only:
//   - a version's commit: the check that its id is not yet stored, the run's next sequence
//     and the batch (a synced WAL write), under one commit lock, so concurrent imports into
//     one run get sequences 1..N without gaps or duplicates, `latest` is the highest, and
//     the same version imported by several threads at once is committed exactly once (the
//     others return it with already_present);
//   - the writing of one object file: one import writes a digest at a time in a process;
//     another import needing the same digest meanwhile relies on that write (and rewrites
//     the object itself only if that writer fails);
//   - GarbageCollect against Import/ImportCheckpoint/Verify/Export (each waits for the
//     other: gc must not remove objects an import is writing or a verify is reading);
//   - Refresh calls of a read-only store, one at a time.
// Everything else (hashing and writing objects, reads, events, verify) runs in parallel.
//
// Derived versions (RecordDerived): a merged version recorded by its digests only. Its record
// (id, tensor rows with digest/dtype/shape/nbytes, aux files, kind merged, base_version,
// adapter_version, step, metrics, ...) and its auxiliary files are committed as any
// version's, with "derived": true in the record, but no tensor object is written and no
// "objects" row added: its bytes are DEFINED as the merge of adapter_version onto
// base_version by the converter (ferry::Convert, layout hf or fused as recorded), which is
// what sync's snapshots compute bit for bit. Its id is the manifest digest of its rows and
// aux files, as for any version: a derived version and a full import of the same bytes are
// the same version. Recording a training step so adds the adapter's bytes, not a model's.
//   - RecordDerived requires kind merged, base_version and adapter_version, both already
//     recorded; the adapter must be of kind adapter, the base not derived itself.
//   - Materialize (store/materialize.h) rebuilds the bytes from base + adapter and requires
//     the rebuilt id to equal the version's.
//   - Importing the full bytes of a derived version later (Import/ImportCheckpoint of a
//     checkpoint with its id) stores its objects and turns it into a stored version: the
//     record (run, sequence, step, ...) is kept, "derived" becomes false (ImportResult::
//     was_derived). Recording a derived version that is already stored changes nothing.
//   - Verify reports a derived version as such: its tensors have no objects to re-hash; its
//     aux files are checked, and its base and adapter versions must be recorded with every
//     stored byte intact (VerifyReport::dependencies names each that is not).
//   - ReadTensor of a row whose object is absent and that only derived versions hold, and
//     Export of a derived version whose objects are not all present, are kFailedPrecondition
//     "version V is derived from base B + adapter A; materialize it".
//   - GarbageCollect keeps the base and adapter of every kept version (the rule below).
//   - Records written before derived versions existed have no "derived" field: not derived.
//
// Decisions the implementation (store/*.cpp) makes where the above leaves room:
//   - Aux digests in the manifest are 16 bytes big-endian hi then lo, like tensor digests.
//     Version keys and object keys are the digest in that same byte order, so key order is
//     hex order (prefix lookups seek directly).
//   - "versions" values hold the record WITHOUT its tensors (they are the "tensors" rows);
//     GetVersion / ListVersions return records with tensors filled in. The "objects" rows
//     of a version's tensors are written in its commit batch; an object file without a row
//     (a crash between the write and the commit) is rewritten by the next import that
//     needs it and removed by gc.
//   - read_only: RocksDB's secondary instance keeps its own LOG/MANIFEST copy in a private
//     directory made with mkdtemp under $TMPDIR (default /tmp), "ferry-secondary-XXXXXX",
//     removed when the Store is destroyed; the store directory itself is never written, so
//     a reader needs no write permission there. Writing calls on a read-only store return
//     kFailedPrecondition. A second writer (another process, or a second writable Store
//     in the same process) gets kFailedPrecondition naming the directory.
//   - Import of weights whose version id is already stored commits nothing: the stored
//     record is returned (with its original run and sequence) and already_present is set.
//   - Import(path) sets kind = kAdapter (when options.kind is the default kFull) if the
//     weights file is adapter_model.* or adapter_config.json is beside it, and then fills
//     adapter_config. Auxiliary files come from the weights' directory (a file's parent), collected
//     by CollectAuxFiles (core/aux_files.h).
//     An explicit ImportOptions.parent must be a stored version (kNotFound otherwise);
//     base_version / adapter_version are recorded as given.
//   - Statistics: l2_norm sums the squares of the finite elements only (NaN/Inf are counted
//     in nonfinite); all_zero is true when every element is +0 or -0. Computed at import
//     (recorded rows; the audit and `ferry versions` show them) for F32, F64, F16, BF16,
//     F8_E4M3 and F8_E5M2; zero for every other dtype, and in HashPath's rows.
//   - Verify hashes each distinct object once per call; auxiliary files that are missing
//     or corrupted are reported in missing/corrupted under their file name.
//   - Export writes model.safetensors (adapter_model.safetensors for adapters), sharded at
//     5,000,000,000 bytes when larger, plus the aux files, into a hidden temporary directory
//     beside `out`, renamed into place (an existing `out` is replaced only with force).
//   - GarbageCollect(keep), keep >= 1 (kInvalidArgument otherwise): kept = exactly the newest
//     `keep` of each run, plus the base/adapter versions they reference, followed
//     transitively (dependencies for materialising); a parent link is history and keeps
//     nothing alive (the audit shows a collected parent as such). Removed
//     versions lose their records, tensor rows and run entries; events stay.
//   - Events are committed with sync = true; time_ns 0 means "now".
//   - Text recorded in JSON must be UTF-8. Import/ImportCheckpoint/HashPath refuse, before
//     anything is stored, with kInvalidArgument: an auxiliary file name that is not a plain
//     file name, not well-formed UTF-8 or holds a control character (core/aux_files.h);
//     a tensor name, run name or metric name that is not UTF-8 (run names: no
//     control characters either); HashPath checks the file and tensor names. An adapter's
//     adapter_config.json that is not UTF-8 is kCorruption. Event text (receiver, detail)
//     that is not UTF-8 is stored with U+FFFD instead.
// ---------------------------------------------------------------------------------------
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "convert/layout.h"
#include "core/aux_files.h"
#include "core/checkpoint.h"
#include "core/status.h"
#include "kernels/hash.h"

namespace ferry::store {

struct Digest {
  uint64_t hi = 0;
  uint64_t lo = 0;
  bool operator==(const Digest&) const = default;
  auto operator<=>(const Digest&) const = default;
  std::string Hex() const;                              // 32 lowercase hex chars
  static Result<Digest> FromHex(std::string_view hex);  // kInvalidArgument on bad text
};

// How reports, tables and messages name a version: the first 12 hex characters of its id.
std::string ShortId(const Digest& id);

// The tensor digest defined above, streamed over `t`'s bytes.
Digest TensorDigest(const Tensor& t);
// The same over bytes held elsewhere (e.g. a file range being copied).
Digest TensorDigest(DType dtype, const Shape& shape, std::span<const std::byte> bytes);

// The tensor digest streamed over a tensor's bytes fed in any number of pieces (a receiver
// hashing chunks as they arrive): Finish() equals TensorDigest of the concatenation.
class TensorDigester {
 public:
  TensorDigester(DType dtype, const Shape& shape);
  void Update(std::span<const std::byte> bytes) { hash_.Update(bytes.data(), bytes.size()); }
  Digest Finish() const;

 private:
  kernels::Xxh3_128Stream hash_;
};

// The digest of an auxiliary file's contents (AuxFile::digest).
Digest AuxDigest(std::string_view contents);

enum class VersionKind { kBase, kAdapter, kMerged, kFull };
enum class VersionSource { kConvert, kImport, kDaemon, kSync };
std::string_view KindName(VersionKind k);
std::string_view SourceName(VersionSource s);
Result<VersionKind> ParseKind(std::string_view s);

// Per-tensor facts recorded at import (the audit uses them).
struct TensorRow {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  Digest digest;
  uint64_t nbytes = 0;
  // Floating-point tensors only (zeros otherwise):
  double l2_norm = 0;     // sqrt(sum x^2) in double
  int64_t nonfinite = 0;  // NaN or Inf elements
  bool all_zero = false;
};

struct AuxFile {
  std::string name;
  Digest digest;
  uint64_t size = 0;
};

struct VersionRecord {
  Digest id;                     // = manifest digest
  std::string run;               // Default: "default"
  uint64_t sequence = 0;         // 1, 2, ... within the run, assigned at commit
  std::optional<Digest> parent;  // the run's previous version, unless given
  VersionKind kind = VersionKind::kFull;
  Layout layout = Layout::kHf;
  VersionSource source = VersionSource::kImport;
  int64_t time_ns = 0;                    // commit time, Unix epoch
  std::optional<int64_t> step;            // training step
  std::optional<Digest> base_version;     // the base an adapter applies to / a merge came from
  std::optional<Digest> adapter_version;  // for merged versions: the adapter merged in
  std::string adapter_config;             // adapter_config.json text, for adapters
  std::map<std::string, double> metrics;  // free-form (reward_mean, ...)
  std::vector<TensorRow> tensors;         // sorted by name
  std::vector<AuxFile> aux;               // sorted by name
  uint64_t total_bytes = 0;
  // Recorded by its digests only (see "Derived versions" above): no tensor object was
  // written; its bytes are the merge of adapter_version onto base_version.
  bool derived = false;
};

// One thing that happened to a version, recorded by sync and the daemon.
//   kCheckpoint: ferryd wrote a training checkpoint of the step whose version this is;
//   `detail` is a JSON object {"run", "step", "checkpoint" (its directory name),
//   "trainer_state" (AuxDigest of its trainer_state.json)}: what a resume proves the
//   checkpoint against (daemon/run/checkpoint_state.h).
//   kEngine: an inference engine a receiver drives (vLLM) answered as this version, proven
//   from its own answers (sync/engine/probe.h); `receiver` names the receiver, `detail` is
//   a JSON object {"engine", "url", "model" (the name it serves the version under),
//   "tolerance", "max_diff", "previous_diff", "tokens", "seconds"}. One that answered as
//   something else is a kAnomaly (kEngineMismatch) with the same JSON plus "why".
struct Event {
  enum class Type { kPublished, kAcknowledged, kActivated, kAnomaly, kCheckpoint, kEngine };
  // What an anomaly is, where it is one a program acts on (kUnspecified otherwise).
  enum class Anomaly {
    kUnspecified,
    kReceiverLost,    // a publisher stopped hearing from `receiver`
    kEngineMismatch,  // an engine did not answer as the version it was given (detail: see kEngine)
  };
  Type type = Type::kPublished;
  int64_t time_ns = 0;
  std::string receiver;                     // receiver id for acks/activations
  Digest version;                           // the version concerned
  std::optional<Digest> computed;           // the manifest digest the receiver computed
  std::string detail;                       // free text (anomaly description, endpoint, ...)
  Anomaly anomaly = Anomaly::kUnspecified;  // kAnomaly events only
};
std::string_view EventTypeName(Event::Type t);
// "unspecified", "receiver_lost", "engine_mismatch".
std::string_view AnomalyName(Event::Anomaly a);

struct ImportOptions {
  std::string run = "default";
  VersionKind kind = VersionKind::kFull;  // Default: full (adapter when the path is a PEFT adapter)
  Layout layout = Layout::kHf;            // Default: hf
  VersionSource source = VersionSource::kImport;
  std::optional<int64_t> step;
  std::optional<Digest> base_version;
  std::optional<Digest> adapter_version;
  std::optional<Digest> parent;  // Default: the run's latest version
  std::map<std::string, double> metrics;
  // Called with (bytes hashed so far, total bytes).
  std::function<void(uint64_t, uint64_t)> progress;
};

struct ImportResult {
  VersionRecord record;
  bool already_present = false;  // the same version id was already stored (nothing new written,
                                 // unless was_derived)
  bool was_derived = false;      // the id was recorded as a derived version: this import stored
                                 // its objects and the record is no longer derived
  uint64_t bytes_written = 0;    // new object bytes this import wrote (0 when everything was stored;
                                 // an object another import was writing at the same time counts there)
  int64_t objects_written = 0;
};

struct VerifyReport {
  Digest version;
  std::vector<std::string> missing;    // tensors whose object file is gone
  std::vector<std::string> corrupted;  // object bytes whose digest differs from the record
  // A derived version: its tensors have no objects (none are re-hashed or reported missing);
  // `dependencies` names each of its base and adapter versions that is not recorded or not
  // intact ("base version <id>: not in the store", "adapter version <id>: tensor 'x' is
  // corrupted", ...). Always empty for stored versions.
  bool derived = false;
  std::vector<std::string> dependencies;
  bool ok() const { return missing.empty() && corrupted.empty() && dependencies.empty(); }
};

struct StoreOptions {
  bool create_if_missing = false;  // Default: false (opening a missing store is kNotFound)
  bool read_only = false;          // open as a RocksDB secondary: never blocks a writer
  bool sync_objects = true;        // fsync object files before committing. Default: true.
  // A tensor of at most this many bytes (and more than 0) is stored in its "objects" row, in
  // the commit's batch, not as a file: a training step's adapter then costs one synced
  // write, not a file, fdatasync, rename and directory fsync per tensor. At most 1 MiB;
  // 0: every object is a file. Reads find an object in either form, whatever this is.
  // Default: 64 KiB.
  uint64_t small_object_bytes = uint64_t{64} << 10;
};

// A store on disk. Thread-safe: every method may be called from any thread, concurrently
// with any other (see "Thread safety" at the top of this file for what is serialised).
// Results are consistent snapshots of committed versions: a reader never sees part of a
// version. Callbacks the caller passes (ImportOptions::progress) are never called
// concurrently with themselves.
class Store {
 public:
  // Opens (or creates) the store at `dir`. A writer fails with kFailedPrecondition naming
  // the directory when another process, or another Store object of this process, holds it
  // for writing: share one Store between threads instead of opening it twice.
  static Result<std::unique_ptr<Store>> Open(const std::filesystem::path& dir, const StoreOptions& options);
  // REQUIRES: no call on this store is running (the caller joins its threads first).
  virtual ~Store() = default;

  // Records the weights at `path` (a safetensors file, model directory or PEFT adapter
  // directory) as a version: hashes every tensor, stores bytes not yet stored, commits.
  // Thread-safe; runs in parallel with other imports, reads, events and Verify; waits for a
  // running GarbageCollect. Tensors are hashed and written on every hardware thread.
  virtual Result<ImportResult> Import(const std::filesystem::path& path, const ImportOptions& options) = 0;
  // The same for tensors already open (the sync publisher and daemon use this). The same
  // concurrency as Import. `ckpt.Get` is called from several threads at once, except for a
  // checkpoint made with Checkpoint::FromProducer, whose tensors are made one at a time in
  // name order (each released before the next is asked for).
  virtual Result<ImportResult> ImportCheckpoint(const Checkpoint& ckpt, const AuxFiles& aux_files,
                                                const ImportOptions& options) = 0;

  // Records a merged version by its digests only: a derived version (see "Derived versions"
  // above). `tensors` are its rows: name, dtype, shape, digest and nbytes (= the byte size of
  // dtype and shape), statistics as given (zeros when unknown); any order, names unique.
  // `aux_files` (name, contents) are stored as Import stores them. options.kind must be
  // kMerged and options.base_version / adapter_version given (kInvalidArgument naming what
  // is wrong, as for a row's nbytes, a duplicate or non-UTF-8 name, a layout other than hf or
  // fused), and both recorded (kNotFound naming the id), the adapter of kind adapter, the base
  // not derived, an adapter recording another base_version: kInvalidArgument. Writes no
  // tensor object (bytes_written counts the aux files only); commits as Import does
  // (already_present when the id is recorded, derived or not). Thread-safe, as Import.
  virtual Result<ImportResult> RecordDerived(const std::vector<TensorRow>& tensors, const AuxFiles& aux_files,
                                             const ImportOptions& options) = 0;

  // kNotFound naming the id when absent. `prefix`: a unique hex prefix (>= 6 chars) is accepted.
  // Thread-safe; never waits for an import or event.
  virtual Result<VersionRecord> GetVersion(std::string_view id_or_prefix) = 0;
  // Versions, oldest first, optionally of one run. Thread-safe; never waits for an import.
  virtual Result<std::vector<VersionRecord>> ListVersions(std::optional<std::string> run) = 0;
  // Thread-safe; never waits for an import.
  virtual Result<std::vector<std::string>> ListRuns() = 0;
  // The run's newest committed version (the highest sequence). Thread-safe.
  virtual Result<std::optional<Digest>> Latest(const std::string& run) = 0;

  // A stored tensor's bytes (memory-mapped object file), checked against its digest when
  // `verify` is set (kCorruption naming the version and tensor otherwise). A row of a derived
  // version whose object is absent: kFailedPrecondition (see "Derived versions"). Thread-safe;
  // never waits for an import. The mapping stays valid after a GarbageCollect removes the
  // object; a call during one may fail with kNotFound for a version being removed.
  virtual Result<Tensor> ReadTensor(const TensorRow& row, bool verify) = 0;
  // A stored auxiliary file's contents. Thread-safe, as ReadTensor.
  virtual Result<std::string> ReadAux(const AuxFile& aux) = 0;

  // Re-hashes every stored byte of `version` (all versions when nullopt). Thread-safe; runs
  // in parallel with imports (it checks the versions committed when it starts); waits for a
  // running GarbageCollect.
  virtual Result<std::vector<VerifyReport>> Verify(std::optional<Digest> version) = 0;

  // Writes a version out as a loadable directory (safetensors + aux files), atomically. A
  // derived version whose objects are not all present: kFailedPrecondition, nothing written
  // (store::Materialize rebuilds it). Thread-safe, as Verify.
  virtual Status Export(const Digest& version, const std::filesystem::path& out, bool force) = 0;

  // Records an event: synced, or with `sync` false written to RocksDB's log without waiting
  // for the disk (durable once any later synced write of this store is: the log is in order;
  // for a caller whose next step writes synced anyway). Thread-safe: events appended from
  // several threads at once are all recorded, each under its own key.
  virtual Status AddEvent(const Event& e, bool sync) = 0;
  Status AddEvent(const Event& e) { return AddEvent(e, /*sync=*/true); }
  // Events in (time, arrival) order, optionally of one version. Thread-safe.
  virtual Result<std::vector<Event>> ListEvents(std::optional<Digest> version) = 0;

  // Keeps the newest `keep` versions of each run (and every version they reference as
  // base/adapter, transitively); deletes the rest and every object no kept version uses.
  // Returns the number of versions removed. Thread-safe; excludes Import, ImportCheckpoint,
  // Verify and Export (waits for the running ones, and new ones wait for it).
  virtual Result<int64_t> GarbageCollect(int64_t keep) = 0;

  // For read-only (secondary) stores: catch up with the writer's newest commits. Thread-safe;
  // reads running meanwhile see the store as before or after the catch-up, never between.
  virtual Status Refresh() = 0;
};

// The manifest digest defined above (a version's id) over its tensor rows and auxiliary
// files, each list sorted by name. A receiver that verified every row's digest proves the
// id of what it holds with this, without hashing the bytes again.
Digest ManifestDigest(const std::vector<TensorRow>& tensors, const std::vector<AuxFile>& aux);
// The rows ManifestDigest takes for auxiliary files held in memory (name, AuxDigest, size), in
// their order.
std::vector<AuxFile> AuxFileRows(const AuxFiles& aux);

// Hashes the weights at `path` without storing them (what `ferry verify PATH` does): a
// record with id, tensors and aux files filled in (run/sequence empty). The rows carry no
// statistics (l2_norm, nonfinite and all_zero are zero): only digests are compared, and
// the statistics pass would cost more than the hashing. Tensors are hashed on every
// hardware thread; `progress` is never called concurrently with itself.
Result<VersionRecord> HashPath(const std::filesystem::path& path,
                               const std::function<void(uint64_t, uint64_t)>& progress = {});

}  // namespace ferry::store
