// Internals of the sync receiver (sync/receiver.h) shared by its .cpp files, one per concern.
// Not part of the public API.
//   receiver.cpp           Receiver: options, Connect, SyncLatest (one version from HELLO
//                          to ACK, including activation), WaitForNewer
//   receiver_session.cpp   the transport session: DEALER requests and replies, SUB
//                          announcements, credit-based FETCH, ACK
//   receiver_transfer.cpp  one version into DIR/versions/<id>: the file laid out from the
//                          manifest, chunks hashed as they arrive and written by a writer thread
//                          (WriteBehind), delta/base copies, verify
//   receiver_resume.cpp    partial transfers: what a killed or failed transfer left
//                          (versions/<id>.partial) and taking it over
//   receiver_dir.cpp       the receiver directory: .lock, activation records in manifests/,
//                          the current link, renames, pruning old versions
// Directory layout: the top of sync/receiver.h.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>
#include <zmq.hpp>

#include "convert/layout.h"
#include "core/checkpoint.h"
#include "core/status.h"
#include "store/store.h"
#include "sync/protocol.h"
#include "sync/receiver.h"

namespace ferry::sync::receiver_internal {

using Clock = std::chrono::steady_clock;

// Local copies and re-hashing read files in pieces of this size.
inline constexpr size_t kCopyPieceBytes = size_t{1} << 20;
// Epochs of publishers this receiver moved away from, remembered so that their stale
// announcements (still queued, or from a publisher that did not really die) are ignored.
inline constexpr size_t kRetiredEpochsKept = 16;
// versions/<id><kPartialSuffix>: a transfer cut short, kept for the next one (resume).
inline constexpr std::string_view kPartialSuffix = ".partial";

// ---- file helpers (core lacks them) ------------------------------------------------------

// Closes a descriptor when destroyed.
class FdGuard {
 public:
  explicit FdGuard(int fd) : fd_(fd) {}
  ~FdGuard();
  FdGuard(const FdGuard&) = delete;
  FdGuard& operator=(const FdGuard&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// Removes a directory tree when destroyed unless released.
class TempDirGuard {
 public:
  explicit TempDirGuard(std::filesystem::path p) : path_(std::move(p)) {}
  ~TempDirGuard();
  TempDirGuard(const TempDirGuard&) = delete;
  TempDirGuard& operator=(const TempDirGuard&) = delete;
  void Release() { path_.clear(); }

 private:
  std::filesystem::path path_;
};

// `s`, with kNotFound (a local file missing: errno ENOENT) turned into kIOError: from a
// sync, kNotFound means only that the publisher lacks something.
[[nodiscard]] Status LocalIO(Status s);

// Receives each piece read and its offset within the range; a non-OK Status stops the read.
using PieceSink = std::function<Status(std::span<const std::byte> bytes, uint64_t offset)>;

// Feeds the `length` bytes of `fd` at `offset` to `digester` in pieces of `piece`'s
// capacity (resized to kCopyPieceBytes), handing each piece and its offset within the range
// to `sink` (may be empty). False when they cannot all be read; sink errors pass through.
[[nodiscard]] Result<bool> HashRange(int fd, uint64_t offset, uint64_t length, store::TensorDigester& digester,
                                     std::vector<std::byte>& piece, const PieceSink& sink);

// HashRange over `row.nbytes` bytes at `offset`: true when they have the row's digest,
// false when they differ or cannot be read.
[[nodiscard]] Result<bool> ReadAndHash(int fd, uint64_t offset, const store::TensorRow& row,
                                       std::vector<std::byte>& piece, const PieceSink& sink);

// ---- transport session (receiver_session.cpp) --------------------------------------------

// The bytes a ZeroMQ message holds.
inline std::span<const std::byte> Bytes(const zmq::message_t& m) {
  return {static_cast<const std::byte*>(m.data()), m.size()};
}

// What the receiver knows about its publisher link.
struct Link {
  Clock::time_point last_heard;         // last message of any kind from the publisher
  bool heard = false;                   // anything at all came from the publisher since Connect
  std::deque<uint64_t> retired_epochs;  // at most kRetiredEpochsKept

  bool Retired(uint64_t epoch) const;
  void Retire(uint64_t epoch);
  // Records that a message came from the publisher now.
  void Heard();
};

// One thing that arrived: an announcement or a reply. `msg.bytes` views `payload`.
struct Incoming {
  bool announce = false;
  Message msg;
  zmq::message_t header, payload;
};

// How a transfer ended: done, or abandoned for a newer version (or a restarted publisher).
enum class Outcome { kDone, kNewer };

// The receiver's requests to its publisher over one DEALER socket, with announcements read
// from the SUB socket meanwhile. Lives for one SyncLatest.
class Session {
 public:
  Session(const ReceiverOptions& o, zmq::socket_t& dealer, zmq::socket_t& sub, Link* link)
      : o_(o), dealer_(dealer), sub_(sub), link_(link) {}

  // Sends HELLO and waits for the MANIFEST of the latest version, or of `wanted` when given;
  // `json` receives its text. kUnavailable when no reply comes within timeout_ms; the
  // publisher's ERROR as its Status (kNotFound: `wanted` is not served); kCorruption for a
  // manifest that does not validate or has no tensors.
  Result<Manifest> Hello(std::string* json, const std::optional<store::Digest>& wanted = std::nullopt);

  // Fetches bytes [start, size) of one item of `size` bytes with at most `credit` FETCHes
  // in flight, handing each chunk, in order, to `sink(bytes, offset within the item)`.
  // kNewer as soon as an announcement, a chunk or a restarted publisher shows a newer version,
  // or the publisher answers that the version is no longer served (kNotFound: newer ones
  // replaced it); for the pinned version only a restarted publisher does. The replies still
  // due to requests abandoned this way are skipped as they arrive, whatever they hold.
  Result<Outcome> Fetch(const Manifest& man, ItemKind kind, uint32_t index, uint64_t start, uint64_t size,
                        const PieceSink& sink);

  // One item of a run: bytes [start, size) of item `index` of `kind`.
  struct RunItem {
    ItemKind kind = ItemKind::kTensor;
    uint32_t index = 0;
    uint64_t start = 0, size = 0;
  };
  // Fetch over several items with one credit window: the requests for the next items go out
  // while the current one arrives, so a version of many small tensors (an adapter: hundreds
  // of a few hundred KB) does not wait a round trip per tensor. Chunks arrive in the order
  // asked, item after item, each handed to `sink(position in items, chunk, offset within
  // the item)`, the chunk's bytes being the whole of the message (the sink may move it away
  // to keep them past the call); `done(position)` is called, in order, once all of an item's
  // bytes are in (at once for an item with nothing left to fetch). kNewer as Fetch.
  using RunSink = std::function<Status(size_t, zmq::message_t&, uint64_t)>;
  Result<Outcome> FetchRun(const Manifest& man, const std::vector<RunItem>& items, const RunSink& sink,
                           const std::function<Status(size_t)>& done);

  // Sends ACK (served id, computed id, proven merged id in adapter mode) and waits for ACKED.
  Status Ack(const store::Digest& v, const store::Digest& computed, const std::optional<store::Digest>& proven);

  // Sends ENGINE (the version an engine was given and the report JSON) and waits for ACKED.
  Status ReportEngine(const store::Digest& v, const std::string& report);

  // Tensor and aux bytes fetched so far.
  uint64_t bytes_received() const { return bytes_received_; }

  // A version fetched to the end even when newer ones are published meanwhile (the base an
  // adapter applies to, which newer adapters do not replace); nullopt: none.
  void Pin(const std::optional<store::Digest>& v) { pinned_ = v; }

 private:
  Status Send(const Message& m, std::span<const std::byte> payload);
  Status SendWithId(MsgType type, const Message& base);
  // Waits (timeout_ms) for the ACKED of `v`; the publisher's ERROR as its Status.
  Status WaitForAcked(const store::Digest& v);
  // Waits (until `deadline`) for the next announcement or reply.
  Status Next(Clock::time_point deadline, Incoming* in);
  Status PublisherError(const Message& m) const;
  Clock::time_point Deadline() const { return Clock::now() + std::chrono::milliseconds(o_.timeout_ms); }

  const ReceiverOptions& o_;
  zmq::socket_t& dealer_;
  zmq::socket_t& sub_;
  Link* link_;
  uint64_t bytes_received_ = 0;
  std::optional<store::Digest> pinned_;
  // Replies still due to FETCHes a run abandoned (they come before any later reply: one
  // connection, answered in order), skipped by Next so that none is taken for an answer to a
  // later request (an ERROR for a version no longer served would fail the next HELLO).
  size_t abandoned_ = 0;
};

// Reads one announcement from `sub` if one is queued (draining a malformed multipart
// message); nullopt when nothing usable was read (not an ANNOUNCE, or of a retired epoch).
std::optional<Message> ReadAnnouncement(zmq::socket_t& sub, const Link& link);

// What ends a "no reply from the publisher" message: with CURVE, while nothing at all has
// come from the publisher, that it may not allow this receiver's public key (a refused
// CURVE handshake looks like silence to the client); otherwise nothing.
std::string SilenceHint(const ReceiverOptions& o, const Link& link);

// ---- one version into DIR/versions/<id> (receiver_transfer.cpp) ---------------------------

// Writes received chunks into one file on a thread of its own, in the order queued, so that
// the receiving thread takes and hashes the next chunk while the page cache takes this one.
// The copy into the page cache costs several times the hashing and, for one file, runs on
// one core at a time (the file's inode lock), so one writer is as fast as several. At most
// `depth` chunks wait; Submit blocks beyond that.
class WriteBehind {
 public:
  // `fd` stays open for the writer's life; `path` names it in errors.
  WriteBehind(int fd, std::filesystem::path path, size_t depth);
  // Stops after the write under way; chunks still queued are not written.
  ~WriteBehind();
  WriteBehind(const WriteBehind&) = delete;
  WriteBehind& operator=(const WriteBehind&) = delete;

  // Queues the whole of `chunk` to be written at `offset`. The first write error once there
  // was one (nothing more is written then).
  [[nodiscard]] Status Submit(zmq::message_t&& chunk, uint64_t offset);
  // Waits until every queued chunk is written; the first write error.
  [[nodiscard]] Status Drain();

 private:
  struct Piece {
    zmq::message_t chunk;
    uint64_t offset;
  };
  void Run();

  const int fd_;
  const std::filesystem::path path_;
  const size_t depth_;
  std::mutex mu_;
  std::condition_variable work_;  // a chunk queued, or stop
  std::condition_variable room_;  // a chunk written, or an error
  std::deque<Piece> queue_;       // guarded by mu_, as are the three below
  bool writing_ = false;
  bool stop_ = false;
  Status error_;
  std::thread thread_;  // last: started once everything above is set up
};

// Where tensors may be copied from instead of fetched. Every copy is hashed while it is
// written and kept only when it has the manifest row's digest (else the tensor is fetched).
struct ReuseSource {
  Checkpoint checkpoint;
  // Delta mode: tensor digest -> the name of a tensor of `checkpoint` known to have it.
  std::map<store::Digest, std::string> by_digest;
  // A base model directory: a row is tried under its own name (its digest is learnt by
  // hashing the copy).
  bool by_name = false;
  // The tensor of `checkpoint` to try for `row` (same dtype, shape and size), if any.
  std::optional<std::string> Find(const store::TensorRow& row) const;
};

// Delta mode: the active version's received files (DIR/manifests/<active>.json names the
// served version whose directory holds them). Null when there is none or it cannot be read.
std::unique_ptr<ReuseSource> OpenActiveReuse(const std::filesystem::path& dir, const store::Digest& active);
// A served base: the receiver's local base model directory (--base), matched by tensor
// name. Null when it cannot be opened (everything is then fetched).
std::unique_ptr<ReuseSource> OpenBaseReuse(const std::filesystem::path& base_dir);

// Receives `man` into DIR/versions/<id>, verified (every tensor and aux file against its
// digest, the manifest digest against the id), fsynced and renamed into place; a version
// already there is reused as is. Tensors `reuse` holds are copied, not fetched. kNewer
// when abandoned (its temporary directory is removed); on an error, what arrived is kept
// as versions/<id>.partial for the next attempt.
Result<Outcome> ReceiveVersion(Session& s, const ReceiverOptions& o, const Manifest& man, const ReuseSource* reuse,
                               SyncResult* result);

// ---- partial transfers (receiver_resume.cpp) ---------------------------------------------

// Removes what a killed receiver may have left: temporary version directories, manifest
// temp files and symlink temp names. The newest transfer directory of each version that
// holds model.safetensors is kept as versions/<id>.partial. REQUIRES: DIR/.lock held.
void RemoveStaleTemporaries(const std::filesystem::path& dir);

// Keeps the failed transfer directory `tmp` of `version` as versions/<id>.partial when it
// holds model.safetensors (replacing an older one). True when kept (renamed).
bool KeepPartial(const std::filesystem::path& versions, const store::Digest& version, const std::filesystem::path& tmp);

// Makes the partial transfer of `version` (versions/<id>.partial) the temporary directory
// `tmp` when its model.safetensors is laid out exactly as this transfer's (same header
// bytes, same size `total`): a rename, nothing copied; its other files are removed.
// Partial transfers of other versions are deleted. True when taken over.
bool TakeOverPartial(const std::filesystem::path& versions, const store::Digest& version, const std::string& header,
                     uint64_t total, const std::filesystem::path& tmp);

// What the partial transfer `fd` holds of tensor `row` at `offset`: all of it (row.nbytes:
// no hole in its range and the row's digest), or the whole chunks written before the
// first hole (unverified: the caller hashes them ahead of what it fetches), or 0.
uint64_t HeldPrefix(int fd, const store::TensorRow& row, uint64_t offset, uint64_t chunk_bytes,
                    std::vector<std::byte>& piece);

// ---- the receiver directory (receiver_dir.cpp) -------------------------------------------

// Whether `name` is a temporary name (".tmp-" inside).
bool IsTempName(std::string_view name);

// Creates DIR/versions and DIR/manifests, opens and flocks DIR/.lock; returns the
// descriptor (the lock lives as long as it is open). kFailedPrecondition naming DIR when
// another receiver holds it; kIOError naming the file otherwise.
Result<int> LockDirectory(const std::filesystem::path& dir, const std::string& receiver_id);

// What DIR/current holds and how it came to be (from DIR/manifests/<active>.json).
struct ActiveState {
  std::optional<store::Digest> active;  // DIR/current
  std::optional<store::Digest> served;  // the served version it was activated from
  std::optional<Layout> layout;         // the layout it was activated in
  std::optional<store::Digest> proven;  // adapter mode
  // Adapter mode: the base the active adapter was merged onto (SyncResult::adapter_base_dir).
  std::optional<std::filesystem::path> adapter_base_dir;
};
// Reads DIR/current and its activation record (fields it cannot read stay unset).
Result<ActiveState> LoadActiveState(const std::filesystem::path& dir);

// Writes DIR/manifests/<activated>.json: the MANIFEST JSON received (`manifest_json`) plus
// activated_as, activated_ns (now), activated_layout and (adapter mode) proven.
Status WriteActivationRecord(const std::filesystem::path& dir, const std::string& manifest_json,
                             const store::Digest& activated, Layout layout, const std::optional<store::Digest>& proven);

// Points DIR/current at versions/<v>: a symlink made under a temporary name, rename(2)d
// over the old one, the directory fsynced.
Status SwitchCurrent(const std::filesystem::path& dir, const store::Digest& v);

// Renames the directory `tmp` to `final_dir` (removing `tmp` instead when `final_dir`
// already exists: an identical, verified version) and syncs the parent.
Status RenameIntoPlace(const std::filesystem::path& tmp, const std::filesystem::path& final_dir);

// Deletes what DIR no longer needs after an activation: every version directory except
// the `keep` most recently activated versions (by the activated_ns their records hold), the
// received directories they were prepared from and the bases their adapters were merged
// onto (their records' base_version: a received base), and the manifests of deleted versions.
// The active version is always kept. Best effort: what cannot be deleted now is tried again
// after the next activation. REQUIRES: DIR/.lock held.
void PruneVersions(const std::filesystem::path& dir, int keep, const store::Digest& active);

}  // namespace ferry::sync::receiver_internal
