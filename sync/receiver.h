// The sync receiver: fetches the publisher's latest version (sync/protocol.h), verifies
// every tensor and the manifest digest, and activates it atomically.
//
// Layout of a receiver directory DIR:
//   DIR/.lock                     flock(2)ed by the Receiver for its lifetime: one receiver
//                                 per DIR at a time
//   DIR/versions/<id>/            a verified version: model.safetensors + aux files (a served
//                                 version as received, or one prepared from it: an adapter
//                                 merged onto the local base, or the fused layout)
//   DIR/versions/<id>.tmp-XXXXXX  a version being received or prepared (never read by anyone;
//                                 removed on failure; one left by a crash is removed by the
//                                 next Connect, never activated)
//   DIR/versions/<id>.partial     a transfer cut short (a killed receiver's newest, or a failed
//                                 one): the next transfer of <id> takes it over (resume)
//   DIR/manifests/<id>.json       for each activated version <id>: the MANIFEST JSON received
//                                 for it (its "version" is the served id, whose directory
//                                 holds the received bytes) plus "activated_as",
//                                 "activated_layout" and, in adapter mode, "proven". Outside
//                                 the version directories, so HashPath never sees it.
//   DIR/current -> versions/<id>  the active version: a relative symlink replaced with
//                                 rename(2), so readers see the old or the new one, never a mix
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "convert/layout.h"
#include "core/status.h"
#include "store/store.h"
#include "sync/endpoints.h"
#include "sync/protocol.h"

namespace ferry::sync {

struct ReceiverOptions {
  std::string id;                     // [A-Za-z0-9._-]{1,64}; recorded in the publisher's events
  Endpoints endpoints;                // both connected by the receiver
  std::filesystem::path dir;          // the receiver directory (created if missing)
  std::optional<CurveOptions> curve;  // keypair + server_public_key. Default: none
  uint32_t chunk_bytes = 1u << 20;    // bytes per FETCH (<= kMaxChunkBytes). Default: 1 MiB
  uint32_t credit = 8;                // FETCHes outstanding at once. Default: 8
  int timeout_ms = 10000;             // longest wait for any reply. Default: 10 s
  int max_retries = 3;                // refetches of one tensor whose digest is wrong. Default: 3
  int heartbeat_ivl_ms = 1000;        // ZMTP heartbeats (0: off). Default: 1000
  // Versions kept in DIR/versions after each activation: the `keep_versions` most recently
  // activated ones (with the received directories they were prepared from, the received
  // base their adapters were merged onto, and their manifests); older ones are deleted, so
  // a receiver following a trainer for days does not
  // fill its disk. 2 keeps the previous version for a generator still loading it. 0: keep
  // everything. Default: 2
  int keep_versions = 2;
  // The layout activated in DIR/current: kHf or kFused (an hf version is re-laid out by
  // sync/activate.h's PrepareActivation). Default: hf
  Layout layout = Layout::kHf;
  // The base model directory this receiver keeps (the base the publisher's adapters apply
  // to). Adapter mode merges each adapter onto it, unless this receiver received the
  // publisher's base (served before the first adapter: DIR/versions/<base_version>, which
  // is then used). A served base (kind base, or the base in adapter mode) copies each
  // tensor this directory holds under the same name, dtype and shape (verified while
  // copying; fetched when it differs) instead of fetching it. Default: none (an adapter
  // with no base received then fails naming the missing base).
  std::optional<std::filesystem::path> base_dir;
  // Test hook: called after each CHUNK is accepted, a tensor's chunk once it is written to
  // the file (before the next FETCH is sent).
  std::function<void(uint64_t offset)> on_chunk_for_testing;
};

struct SyncResult {
  store::Digest version;                // the version the publisher served (and this receiver acknowledged)
  store::Digest computed;               // the manifest digest computed over the received files (== version)
  store::Digest active;                 // the id of what DIR/current holds (== version unless prepared)
  std::optional<store::Digest> proven;  // adapter mode: the merged hf id the local merge produced
  uint64_t sequence = 0;                // its publish sequence
  uint64_t epoch = 0;                   // the publisher's epoch
  uint64_t bytes_received = 0;          // tensor and aux bytes fetched from the publisher
  uint64_t bytes_reused = 0;            // tensor bytes copied locally: delta mode from the active
                                        // version, a served base from base_dir
  uint64_t bytes_resumed = 0;           // tensor bytes a killed receiver had already received of this
                                        // version (versions/<id>.partial: whole tensors, and the whole
                                        // chunks of a tensor cut short), verified and kept
  int refetches = 0;                    // tensors fetched again after a digest mismatch
  int skipped = 0;                      // versions abandoned mid-transfer for a newer one
  bool already_active = false;          // nothing fetched: DIR/current already was this version
  // Adapter mode, an adapter activated: the base directory it was merged onto (a received
  // base, DIR/versions/<base>, or ReceiverOptions::base_dir). Unset otherwise.
  std::optional<std::filesystem::path> adapter_base_dir;
};

// One receiver. Thread-compatible (use from one thread).
class Receiver {
 public:
  // Takes DIR/.lock, removes stale temporary directories left in DIR/versions by a killed
  // receiver (keeping the newest partial transfer of each version as versions/<id>.partial:
  // the next transfer of that version verifies its complete tensors and fetches only the
  // rest), and connects (subscribing to announcements first, clone pattern). Fails on
  // bad options (kInvalidArgument naming the field), a tcp:// endpoint without CURVE, or
  // DIR locked by another receiver (kFailedPrecondition naming DIR).
  [[nodiscard]] static Result<std::unique_ptr<Receiver>> Connect(ReceiverOptions options);
  ~Receiver();
  Receiver(const Receiver&) = delete;
  Receiver& operator=(const Receiver&) = delete;

  // Asks for the latest version and makes it active: fetches (streaming each chunk into
  // the pre-laid-out file and hashing as it goes; in delta mode copying tensors the active
  // version holds), verifies every tensor, aux file and the manifest digest, renames,
  // prepares it when sync/activate.h says so (adapter mode, fused layout), switches
  // DIR/current, acknowledges. Skips to a newer version (or a restarted publisher's)
  // announced mid-transfer. kUnavailable naming the endpoint when the publisher does not
  // answer within timeout_ms (or publishes faster than a version can be fetched, 64 times
  // in a row); the publisher's own errors with its code (kNotFound: nothing published
  // yet, or the version is no longer served); kIOError naming the file when a local read,
  // write, fsync or rename fails; kCorruption naming the tensor (aux file) when it stays
  // corrupt after max_retries refetches; PrepareActivation's errors (its kNotFound, e.g. a
  // tensor the adapter targets missing from the local base, as kFailedPrecondition: a
  // kNotFound from here always means the publisher lacks something). kUnavailable and
  // kNotFound are worth retrying later; the others are not. On any error nothing new is
  // activated and the temporary directories are removed.
  [[nodiscard]] Result<SyncResult> SyncLatest();

  // Waits up to `timeout_ms` for an announcement newer than the active version (or any of
  // another publisher epoch: a restarted publisher), then SyncLatest() (with SyncLatest's
  // errors). Works before anything is active: the first announced version is then synced.
  // kNotFound when none arrives in time; kUnavailable naming the endpoints when nothing at
  // all (not even the publisher's beacon) was heard for options.timeout_ms: the publisher is
  // gone. When the publisher was already silent that long on entry, kUnavailable comes only
  // after `timeout_ms` more of silence, so a caller may simply call again in a loop.
  [[nodiscard]] Result<SyncResult> WaitForNewer(int timeout_ms);

  // Tells the publisher what an inference engine this receiver drives did with `version`
  // (the merged hf id it was given): `report` is the ENGINE message's JSON (sync/protocol.h),
  // its "receiver" this receiver's id. The publisher records it in its store (kEngine, or an
  // anomaly kEngineMismatch when "proven" is false). kUnavailable when the publisher does not
  // answer; its ERROR otherwise (kNotFound: the version is not in its store).
  [[nodiscard]] Status ReportEngine(const store::Digest& version, const std::string& report);

  // The sequence of the active version (0: none yet).
  uint64_t sequence() const { return sequence_; }
  // The epoch of the publisher that served the active version (0: none yet).
  uint64_t epoch() const { return epoch_; }
  // The publication mode of the last MANIFEST received (unset before one arrived): lets a
  // caller tell what the publisher serves when a sync fails, without reading the error text.
  std::optional<PublishMode> served_mode() const { return served_mode_; }
  // Whether anything (a reply, an announcement or a beacon) has come from the publisher since
  // Connect. With CURVE, a publisher whose allow-list lacks this receiver's key stays silent,
  // so kUnavailable while this is false may mean that (the message then names the key).
  bool heard_from_publisher() const;

 private:
  struct Sockets;
  struct ActiveState;
  explicit Receiver(ReceiverOptions options);
  Result<SyncResult> SyncLatestOnce();
  Status ResetDealer();
  ReceiverOptions options_;
  std::unique_ptr<Sockets> sockets_;
  std::unique_ptr<ActiveState> state_;
  uint64_t sequence_ = 0;
  uint64_t epoch_ = 0;
  std::optional<PublishMode> served_mode_;
  int lock_fd_ = -1;
  bool reset_dealer_ = false;
};

// The version DIR/current points at, if any (kCorruption when it is not a versions/<id> link).
[[nodiscard]] Result<std::optional<store::Digest>> ActiveVersion(const std::filesystem::path& dir);

}  // namespace ferry::sync
