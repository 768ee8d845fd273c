// The sync publisher: serves store versions to receivers over ZeroMQ (see sync/protocol.h
// for the wire format) and records their acknowledgements as store events.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "store/store.h"
#include "sync/endpoints.h"
#include "sync/protocol.h"

namespace ferry::sync {

class Snapshot;

// PublishMode (how versions are published): sync/protocol.h.

// The newest version of `run` that `mode` can publish: a merged, full or base version, or
// in adapter mode an adapter whose merged version is recorded or a base version. A run's
// base is therefore what it serves until its first checkpoint is recorded. Empty when
// there is none.
[[nodiscard]] Result<std::optional<store::Digest>> NewestPublishable(store::Store& store, const std::string& run,
                                                                     PublishMode mode);

struct PublisherOptions {
  Endpoints endpoints;                // both bound by the publisher
  std::optional<CurveOptions> curve;  // Default: none (then tcp:// is refused)
  // When set, the publisher polls NewestPublishable(store, run, mode) and publishes each
  // new one itself (for a process that records versions into the same Store object, e.g.
  // the daemon; a version it cannot publish is tried once). Default: none (versions are
  // published with Publish()).
  std::optional<std::string> follow_run;
  int follow_interval_ms = 500;  // Default: 500
  // ZMTP heartbeat interval (0: no ZMTP heartbeats). Also the period of the ANNOUNCE
  // beacon and of the receiver liveness check (1000 ms when 0). Default: 1000
  int heartbeat_ivl_ms = 1000;
  // A receiver with no open connection and no message for this long is declared dead
  // (ReceiverInfo::alive false, one kAnomaly event); also the ZMTP heartbeat timeout.
  // Default: 5000
  int heartbeat_timeout_ms = 5000;
  PublishMode mode = PublishMode::kMerged;  // Default: merged
  // Published (sequence 1) by Start before the follower first looks at the run, which then
  // does not publish it again (Publish's errors, naming the id). Default: none
  std::optional<store::Digest> publish_first;
  // Offered (Publisher::Offer, under its manifest id) before publish_first is published: the
  // snapshot holding a derived publish_first's bytes (a resumed trainer's current version).
  // Default: none
  std::shared_ptr<const Snapshot> offer_first;
  // Caps the rate of CHUNK payload bytes sent to all receivers together (a token bucket
  // banking at most 1 MiB of credit; the serving thread waits for the rest), e.g. to leave
  // a shared link to the trainer, or to measure sync over a slower link
  // (bench/sync_bench.cpp). 0: no cap; negative: kInvalidArgument. Default: 0
  int64_t max_send_bytes_per_sec = 0;
  // With CURVE: called with the public key (Z85) of each receiver the allow-list refused,
  // once per key (RejectedKeyFn, sync/endpoints.h), on the serving thread; must not block.
  // Such a receiver only sees no reply, so this is where the refusal can be told. Default:
  // none
  RejectedKeyFn on_rejected_key;
};

// What the publisher knows about one receiver (from its messages and connections).
struct ReceiverInfo {
  std::string id;
  // The newest version it acknowledged (adapter mode: the merged version it proved).
  std::optional<store::Digest> acknowledged;
  uint64_t acknowledged_sequence = 0;  // its publish sequence (0: unknown)
  int64_t acknowledged_ns = 0;         // when it acknowledged, Unix epoch ns (0: never)
  int64_t last_seen_ns = 0;            // last message, Unix epoch ns
  // False once the receiver has had no open connection (closed, or dropped by the ZMTP
  // heartbeat timeout) and sent no message for heartbeat_timeout_ms; true again on its next
  // message. Connections are tracked per socket descriptor (ipc://, tcp://); over inproc://
  // only messages count.
  bool alive = true;
};

// Serves versions from a store on a background thread. Thread-safe. The store must
// outlive the publisher; the publisher reads tensors and writes events while other threads
// use the same store (Store is thread-safe).
class Publisher {
 public:
  // Binds the endpoints (and, with CURVE, a ZAP handler at inproc://zeromq.zap.01 of the
  // publisher's own context that admits only allowed keys) and starts serving.
  [[nodiscard]] static Result<std::unique_ptr<Publisher>> Start(store::Store* store, PublisherOptions options);
  // Stops serving and joins the thread.
  ~Publisher();
  Publisher(const Publisher&) = delete;
  Publisher& operator=(const Publisher&) = delete;

  // Makes `version` (a stored version id) the latest: assigns it the next sequence number
  // and announces it. Returns that sequence once every request handled afterwards sees it.
  // kNotFound naming the id when the store does not hold it. kFailedPrecondition naming
  // the id when it has no tensors; in merged/delta mode when it is an adapter; in adapter
  // mode when it is a merged version, or an adapter without base_version or whose merged
  // version is not stored ("record the merged version first"); in merged/delta mode when
  // it is derived (recorded by its digests only) and no snapshot of it was offered (Offer).
  [[nodiscard]] Result<uint64_t> Publish(const store::Digest& version);

  // Gives the publisher the tensor bytes of `version`, a merged version recorded by its
  // digests only (a derived version, store/store.h), from the immutable snapshot that
  // computed them (no copy: the publisher holds a reference). Served in merged and delta mode
  // for the rows whose object the store lacks; every such tensor is checked against its
  // recorded row (name, dtype, shape, digest) the first time it is served: a mismatch is
  // answered with kCorruption naming the tensor and the version, never served. Thread-safe
  // and non-blocking (a short lock, no wait for the serving thread or a receiver). Bounded,
  // newest wins: at most 2 offered snapshots wait to be published (older ones are dropped),
  // and once published a snapshot is kept only while its version is one of the 2 newest
  // published (a FETCH of an older one is kNotFound "no longer served": the receiver moves
  // to the latest). Publishing a derived version with no snapshot offered is
  // kFailedPrecondition naming the id.
  void Offer(const store::Digest& version, std::shared_ptr<const Snapshot> snapshot);

  // Receivers seen so far, sorted by id.
  std::vector<ReceiverInfo> Receivers() const;
  // The endpoints actually bound (a tcp:// port given as * resolved to the real port).
  Endpoints bound_endpoints() const;
  // The latest published sequence (0: nothing published yet).
  uint64_t latest_sequence() const;
  // This publisher's epoch: random, non-zero, chosen at Start.
  uint64_t epoch() const;

  // Test hook: flips one byte of each of the next `n` CHUNKs sent (0: stops flipping).
  void CorruptNextChunksForTesting(int n);

 private:
  class Impl;
  explicit Publisher(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry::sync
