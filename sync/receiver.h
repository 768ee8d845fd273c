// The sync receiver: fetches the publisher's latest version (sync/protocol.h), verifies
// every tensor and the manifest digest, and activates it atomically.
//
// Layout of a receiver directory DIR:
//   DIR/versions/<id>/            a verified version: model.safetensors + aux files
//   DIR/versions/<id>.tmp-XXXXXX  a version being received (never read by anyone; removed
//                                 on failure; a crash may leave one behind, never activated)
//   DIR/current -> versions/<id>  the active version: a relative symlink replaced with
//                                 rename(2), so readers see the old or the new one, never a mix
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "core/status.h"
#include "store/store.h"
#include "sync/publisher.h"

namespace ferry::sync {

struct ReceiverOptions {
  std::string id;                      // [A-Za-z0-9._-]{1,64}; recorded in the publisher's events
  Endpoints endpoints;                 // both connected by the receiver
  std::filesystem::path dir;           // the receiver directory (created if missing)
  std::optional<CurveOptions> curve;   // keypair + server_public_key. Default: none
  uint32_t chunk_bytes = 1u << 20;     // bytes per FETCH (<= kMaxChunkBytes). Default: 1 MiB
  uint32_t credit = 8;                 // FETCHes outstanding at once. Default: 8
  int timeout_ms = 10000;              // longest wait for any reply. Default: 10 s
  int max_retries = 3;                 // refetches of one tensor whose digest is wrong. Default: 3
  int heartbeat_ivl_ms = 1000;         // ZMTP heartbeats (0: off). Default: 1000
  // Test hook: called after each CHUNK is accepted (before the next FETCH is sent).
  std::function<void(uint64_t offset)> on_chunk_for_testing;
};

struct SyncResult {
  store::Digest version;      // the version now active (DIR/current)
  store::Digest computed;     // the manifest digest computed over the written files (== version)
  uint64_t sequence = 0;      // its publish sequence
  uint64_t bytes_received = 0;
  int refetches = 0;          // tensors fetched again after a digest mismatch
  int skipped = 0;            // versions abandoned mid-transfer for a newer one
  bool already_active = false;  // nothing fetched: DIR/current already was this version
};

// One receiver. Thread-compatible (use from one thread).
class Receiver {
 public:
  // Connects (subscribing to announcements first, clone pattern). Fails on bad options
  // (kInvalidArgument naming the field) or a tcp:// endpoint without CURVE.
  [[nodiscard]] static Result<std::unique_ptr<Receiver>> Connect(ReceiverOptions options);
  ~Receiver();
  Receiver(const Receiver&) = delete;
  Receiver& operator=(const Receiver&) = delete;

  // Asks for the latest version and makes it active: fetches, verifies, writes, renames,
  // switches DIR/current, acknowledges. Skips to a newer version announced mid-transfer.
  // kIOError naming the endpoint when the publisher does not answer within timeout_ms;
  // kCorruption naming the tensor when a tensor stays corrupt after max_retries refetches.
  // On any error nothing new is activated and the temporary directory is removed.
  [[nodiscard]] Result<SyncResult> SyncLatest();

  // Waits up to `timeout_ms` for an announcement newer than the active version, then
  // SyncLatest(). kNotFound when none arrives in time.
  [[nodiscard]] Result<SyncResult> WaitForNewer(int timeout_ms);

  // The sequence of the active version (0: none yet).
  uint64_t sequence() const { return sequence_; }

 private:
  struct Sockets;
  explicit Receiver(ReceiverOptions options);
  ReceiverOptions options_;
  std::unique_ptr<Sockets> sockets_;
  uint64_t sequence_ = 0;
  std::optional<store::Digest> active_;
};

// The version DIR/current points at, if any (kCorruption when it is not a versions/<id> link).
[[nodiscard]] Result<std::optional<store::Digest>> ActiveVersion(const std::filesystem::path& dir);

}  // namespace ferry::sync
