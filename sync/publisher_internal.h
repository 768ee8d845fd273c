// Internals of the sync publisher (sync/publisher.h) shared by its .cpp files, one per
// concern. Not part of the public API.
//   publisher.cpp          Publisher and Start: options checked, sockets bound, the serving
//                          thread's loop (control channel, connection events, requests, the
//                          periodic tick), requests dispatched, replies and announcements sent
//   publisher_serve.cpp    serving and pacing: publishing a version (sequence, manifest,
//                          ANNOUNCE, the published event), offered snapshots, follow mode,
//                          HELLO -> MANIFEST, FETCH -> CHUNK (store objects verified once,
//                          derived versions from their offered snapshot), the rate cap
//   publisher_acks.cpp     acknowledgements and liveness: receivers tracked by id and CURVE
//                          key, ACK -> acknowledged event, connections seen through the socket
//                          monitor, the periodic ANNOUNCE beacon, lost receivers (events)
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>
#include <zmq.hpp>

#include "core/status.h"
#include "core/tensor.h"
#include "store/store.h"
#include "sync/endpoints.h"
#include "sync/protocol.h"
#include "sync/publisher.h"

namespace ferry::sync {

namespace publisher_internal {

// A frame holding a copy of `s`.
inline zmq::message_t Frame(std::string_view s) { return zmq::message_t(s.data(), s.size()); }

}  // namespace publisher_internal

class Publisher::Impl {
 public:
  using Clock = std::chrono::steady_clock;

  Impl(store::Store* store, PublisherOptions options);

  // ---- set-up, control and the serving thread (publisher.cpp) ----------------------------

  // Binds the sockets (and with CURVE the ZAP handler) of PublisherOptions::endpoints.
  Status Bind();
  void StartThread();
  // Tells the thread to stop and joins it.
  void Stop();
  // Publisher::Publish: asks the serving thread to publish `v` and waits for its answer.
  Result<uint64_t> Publish(const store::Digest& v);

  uint64_t latest_sequence() const { return sequence_.load(); }
  uint64_t epoch() const { return epoch_; }
  const Endpoints& bound() const { return bound_; }
  void Corrupt(int n) { corrupt_.store(n); }

  // ---- serving and pacing (publisher_serve.cpp) -----------------------------------------

  // Publisher::Offer. Any thread.
  void Offer(const store::Digest& version, std::shared_ptr<const Snapshot> snapshot);
  // PublisherOptions::offer_first and publish_first, before the serving thread starts.
  Status PublishFirst();

  // ---- acknowledgements and liveness (publisher_acks.cpp) ---------------------------------

  // Publisher::Receivers. Any thread.
  std::vector<ReceiverInfo> Receivers() const;

 private:
  // A version served: its record, the manifest every HELLO for it gets, and what serving
  // it needs.
  struct Published {
    store::VersionRecord record;
    uint64_t sequence = 0;
    std::optional<store::Digest> merged_version;  // adapter mode
    bool base_itself = false;                     // adapter mode: the base, served whole
    // Merged/delta mode, a derived version: the offered snapshot holding the bytes its store
    // rows lack (null once newer versions replaced it), and the tensor indexes already checked
    // against their rows.
    std::shared_ptr<const Snapshot> snapshot;
    std::set<uint32_t> snapshot_verified;
    std::shared_ptr<const std::string> manifest_json;  // shared by every queued MANIFEST reply
  };

  // A receiver as the publisher thread tracks it (guarded by info_mu_).
  struct Peer {
    ReceiverInfo info;
    std::set<int> fds;            // open connections it sent messages over
    std::string key;              // CURVE public key (Z85) the id is bound to; "" without CURVE
    Clock::time_point last_sign;  // last message or connection close
  };

  // ---- publisher.cpp ----------------------------------------------------------------------

  // The period of the beacon and the liveness check (PublisherOptions::heartbeat_ivl_ms).
  int TickMs() const { return options_.heartbeat_ivl_ms > 0 ? options_.heartbeat_ivl_ms : 1000; }
  // The serving thread: polls the control, request and monitor sockets (and the ZAP
  // handler), following the run and ticking on time, until Stop or the context ends.
  void Loop();
  // One control request (publish a version, or stop). False: stop.
  bool HandleControl();
  // One request from a receiver, dispatched by type once its sender is recorded (Touch).
  void HandleRequest();
  // Sends `m` (with `payload` when its type has one) to routing id `rid`; a peer that went
  // away or whose queue is full is dropped.
  void Reply(const zmq::message_t& rid, const Message& m, std::span<const std::byte> payload);
  // As Reply, with a payload frame that is sent as is (no copy).
  void ReplyOwned(const zmq::message_t& rid, const Message& m, zmq::message_t payload);
  // An ERROR carrying `st`.
  void ReplyError(const zmq::message_t& rid, const Status& st);
  // Sends ANNOUNCE of the latest published version (the epoch alone before any) on the PUB
  // socket, unless its queue is full (the beacon repeats it).
  void Announce();

  // ---- publisher_serve.cpp ----------------------------------------------------------------

  // Publishes `v`: the next sequence, announced, recorded as a kPublished event; the oldest
  // served versions and offered snapshots beyond the limits are dropped.
  Result<uint64_t> DoPublish(const store::Digest& v);
  // Follow mode: publishes the run's newest publishable version once it changes.
  void Follow();
  // Whether version `v` is among those served.
  bool Served(const store::Digest& v) const;
  // The served version `v`, or null.
  Published* Find(const store::Digest& v);
  // Gives `p` its record, sequence and manifest (merged_version and base_itself already set).
  void Seal(Published& p, store::VersionRecord rec, uint64_t seq) const;
  // Adapter mode: the stored merged (hf) version of adapter `rec` onto its base.
  Result<store::Digest> FindMerged(const store::VersionRecord& rec);
  // The offered snapshot of `v` (removed from the offers), or null.
  std::shared_ptr<const Snapshot> TakeOffered(const store::Digest& v);
  // The latest version's manifest, or `wanted`'s while it is still served.
  void HandleHello(const zmq::message_t& rid, const std::optional<store::Digest>& wanted);
  // One CHUNK of a tensor or aux file of a served version.
  void HandleFetch(const zmq::message_t& rid, const Message& m);
  // The cached item (valid until the cache changes: use it at once).
  Result<const Tensor*> Item(Published& p, ItemKind kind, uint32_t index);
  // Tensor `index` of a derived version from its offered snapshot, checked against its row
  // the first time it is served.
  Result<Tensor> FromSnapshot(Published& p, uint32_t index);
  // Rate cap (PublisherOptions::max_send_bytes_per_sec): waits until `n` bytes may be sent.
  void Pace(size_t n);

  // ---- publisher_acks.cpp -----------------------------------------------------------------

  // Periodic work: the ANNOUNCE beacon and the receiver liveness check.
  void Tick();
  // Declares lost (one kAnomaly kReceiverLost event each) the receivers with no open
  // connection and no message for heartbeat_timeout_ms.
  void CheckLiveness();
  // Connection events of the ROUTER socket: a closed connection no longer keeps its
  // receiver alive.
  void HandleMonitor();
  // Records a message from receiver `id` over connection `fd`, authenticated with `key`.
  Status Touch(const std::string& id, int fd, const std::string& key);
  // The receiver id behind a message without one; "" when unknown.
  std::string SenderId(const zmq::message_t& rid, int fd) const;
  // Records an ACK as a kAcknowledged event and answers ACKED.
  void HandleAck(const zmq::message_t& rid, const Message& m, const std::string& key);
  // ENGINE: records what a receiver's inference engine answered (a kEngine event or an
  // anomaly kEngineMismatch) after checking the report's fields and that the version is stored.
  void HandleEngine(const zmq::message_t& rid, const Message& m, const std::string& key, int fd);

  // ---- state ------------------------------------------------------------------------------
  // Set before the serving thread starts and then only read: store_ (the pointer), options_,
  // epoch_, bound_. Used by the serving thread alone unless marked otherwise: the rest.

  store::Store* store_;
  PublisherOptions options_;
  const uint64_t epoch_;
  zmq::context_t ctx_;
  std::unique_ptr<ZapAllowList> zap_;  // with CURVE; declared after ctx_ (closed before it)
  zmq::socket_t router_, pub_, control_, caller_, monitor_;
  Endpoints bound_;
  std::thread thread_;
  std::mutex call_mu_;  // one Publish (or Stop) on the control socket at a time
  std::vector<Published> published_;
  std::map<std::tuple<store::Digest, ItemKind, uint32_t>, Tensor> cache_;
  std::set<store::Digest> verified_;     // store objects already checked against their digest
  std::map<int, std::string> fd_owner_;  // connection descriptor -> receiver id
  std::mutex offer_mu_;
  std::vector<std::pair<store::Digest, std::shared_ptr<const Snapshot>>> offered_;  // guarded by offer_mu_
  store::Digest follow_latest_;        // the run's latest record Follow() saw
  store::Digest follow_tried_;         // the newest version Follow() tried
  double pace_tokens_ = 0;             // Pace()'s bucket, in bytes
  Clock::time_point pace_last_;        // when the bucket was last filled
  std::atomic<uint64_t> sequence_{0};  // any thread
  std::atomic<int> corrupt_{0};        // any thread
  mutable std::mutex info_mu_;
  std::map<std::string, Peer> peers_;  // guarded by info_mu_
};

}  // namespace ferry::sync
