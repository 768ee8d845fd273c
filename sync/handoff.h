// In-process hand-off of snapshots to a co-located generator: the trainer publishes the
// same immutable Snapshot (sync/snapshot.h) it would send over the wire, and a generator
// thread in the same process takes a shared reference to it. Nothing is serialised or
// copied: the generator's tensors are the snapshot's buffers. A snapshot stays valid and
// unchanged for as long as anyone holds its shared_ptr, whatever the publisher publishes
// or drops afterwards.
//
// The proof is the same as over the network: the generator hashes the bytes it sees with
// ComputeManifestId (the store's manifest digest, recomputed, never the cached id) and
// acknowledges that digest; the channel checks it against the snapshot's manifest_id() and,
// with a store, records an `acknowledged` event exactly as the network publisher does
// (receiver id, version, computed digest; "MISMATCH" in the detail when they differ).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "core/status.h"
#include "store/store.h"
#include "sync/snapshot.h"

namespace ferry::sync {

// One published snapshot: its channel sequence (1, 2, ...) and a shared reference to it.
struct Handoff {
  uint64_t sequence = 0;
  std::shared_ptr<const Snapshot> snapshot;
};

// Recomputes the manifest digest of store/store.h over the tensor bytes and aux files that
// `snapshot` holds (every tensor is re-hashed; the cached manifest_id() is not used). Equals
// snapshot.manifest_id() unless its buffers were changed. Errors: kInternal when a tensor
// the snapshot lists cannot be read (a bug).
[[nodiscard]] Result<store::Digest> ComputeManifestId(const Snapshot& snapshot);

// A single-producer (or multi-producer) channel of snapshots to generators in the same
// process. Thread-safe: every method may be called from any thread.
class SnapshotChannel {
 public:
  // The last this many published sequences can be acknowledged (older ones: kNotFound).
  static constexpr size_t kAcknowledgeable = 8;

  // `store` (optional, may be null; must outlive the channel) receives a `published` event
  // per Publish and an `acknowledged` event per Acknowledge. Others may use the store at the
  // same time (Store is thread-safe).
  // `run` names the channel in events and errors. Default: "default".
  // `sync_events` false: the events are written without waiting for the disk (for an owner
  // whose next write to the store is synced, which makes them durable: the trainer, whose
  // step record follows every hand-off). Default: true.
  explicit SnapshotChannel(store::Store* store = nullptr, std::string run = "default", bool sync_events = true);
  // Wakes every waiter (as Close()).
  ~SnapshotChannel();
  SnapshotChannel(const SnapshotChannel&) = delete;
  SnapshotChannel& operator=(const SnapshotChannel&) = delete;

  // Makes `snapshot` the latest and wakes the waiters. Returns its sequence: 1 for the first,
  // then +1 each call. The channel keeps only the latest snapshot alive (plus the ids of the
  // last kAcknowledgeable). With a store, records a `published` event (history only: a
  // store error there is ignored, as the network publisher does). Errors: kInvalidArgument
  // for a null snapshot; kFailedPrecondition naming the run after Close().
  [[nodiscard]] Result<uint64_t> Publish(std::shared_ptr<const Snapshot> snapshot);

  // The latest published snapshot, or nullopt when nothing was published yet.
  std::optional<Handoff> Latest() const;

  // The latest snapshot once its sequence is greater than `after_sequence`: at once when it
  // already is, otherwise waits until Publish makes it so (woken by Publish, not polling) or
  // `timeout_ms` (>= 0) passes. Errors: kNotFound naming the sequence, the run and the
  // timeout when nothing newer arrived in time; kFailedPrecondition naming the run when the
  // channel is closed (before or while waiting) and nothing newer is there.
  [[nodiscard]] Result<Handoff> WaitForNewer(uint64_t after_sequence, int timeout_ms) const;

  // Closes the channel: later Publish calls fail and every waiter wakes with an error.
  void Close();

  // A generator reports the manifest digest it computed (ComputeManifestId) over the
  // snapshot of `sequence`. With a store, records an `acknowledged` event (receiver id,
  // version = that snapshot's manifest_id(), computed; detail "MISMATCH: receiver computed
  // <hex>" when they differ) before returning. Errors: kInvalidArgument for a receiver id not
  // matching [A-Za-z0-9._-]{1,64}; kNotFound naming the sequence when it was never published
  // or is older than the last kAcknowledgeable; kCorruption naming both ids and the receiver
  // when `computed` differs; the store's error when the event cannot be recorded.
  [[nodiscard]] Status Acknowledge(std::string_view receiver_id, uint64_t sequence, const store::Digest& computed);

  // The run name given at construction.
  const std::string& run() const { return run_; }

 private:
  struct Published {
    uint64_t sequence = 0;
    store::Digest id;
  };

  store::Store* const store_;
  const std::string run_;
  const bool sync_events_;

  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  Handoff latest_;             // sequence 0: nothing published
  std::deque<Published> ids_;  // the last kAcknowledgeable published (sequence, id)
  bool closed_ = false;
};

}  // namespace ferry::sync
