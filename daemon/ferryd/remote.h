// ferryd's remote side: the sync publisher that serves each step's version to generators on
// other hosts ([publish], `ferryd train --publish`), and the CURVE settings of the endpoints
// ([publish], [control]) read from their key files.
//
// Threads: the publisher serves from its own thread and follows the run in the store
// (sync::PublisherOptions::follow_run): it looks for the run's newest publishable version
// (adapter mode: the newest adapter; merged and delta mode: the newest merged version) every
// follow interval and publishes it, so the training thread never waits for it or for a
// receiver. Its queues are bounded (the newest version wins: a slow receiver skips the
// versions published while it was busy; at most 8 are kept to finish transfers in progress;
// replies beyond a receiver's credit are dropped, never queued).
//
// Modes (run::PublishSettings): adapter, merged, delta. The trainer records each merged
// version by its digests only (store::Store::RecordDerived), so in merged and delta mode the
// trainer hands the publisher the immutable snapshot it built for its co-located generator
// (Offer, from the training thread: a short lock, no copy, the newest two kept); the
// publisher serves the merged tensors from it, each checked against its recorded digest, and
// the unchanged ones from the store's base objects (sync::Publisher::Offer).
// The base is published first (sequence 1, once), before the first step, so a receiver
// started early holds it; an adapter's manifest then names that base. A resumed run in merged
// or delta mode publishes the version it resumed from first instead.
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "store/store.h"
#include "sync/endpoints.h"
#include "sync/publisher.h"
#include "sync/snapshot.h"

namespace ferry::ferryd {

// CURVE server options of the config table `what` ("publish", "control"): sync::LoadServerCurve
// of its keypair prefix `key` and allow-list file `allow`, its errors named WHAT.key and
// WHAT.allow; none when `key` is empty; kInvalidArgument "WHAT.key needs WHAT.allow" when
// `allow` is.
[[nodiscard]] Result<std::optional<sync::CurveOptions>> ServerCurve(const std::string& what,
                                                                    const std::filesystem::path& key,
                                                                    const std::filesystem::path& allow);

struct RemotePublisherOptions {
  std::string endpoint;                     // ipc://DIR or tcp://HOST:PORT (sync::ParseSyncEndpoint). REQUIRED
  std::optional<sync::CurveOptions> curve;  // required for tcp://. Default: none
  std::string run = "default";              // the store run the trainer records into. Default: "default"
  store::Digest base_version;               // the run's base, published first. REQUIRED
  // Merged and delta mode, a resumed run: the snapshot of the step it resumed from (the
  // generator's), published first instead of the base, so that no receiver is served the base
  // while the run is past it. Ignored when the store lacks its version. Default: none
  std::shared_ptr<const sync::Snapshot> resumed;
  int follow_interval_ms = 200;                          // how often the store is looked at. Default: 200
  sync::PublishMode mode = sync::PublishMode::kAdapter;  // Default: adapter
  // Hears of each receiver key [publish] allow refuses, once per key (sync::PublisherOptions).
  sync::RejectedKeyFn on_rejected_key;
};

// A sync publisher following one run. Thread-safe.
class RemotePublisher {
 public:
  // Parses and checks the endpoint (tcp:// without CURVE: kFailedPrecondition naming it),
  // binds, publishes the base (once: sequence 1) and starts following the run. Errors name
  // the endpoint.
  [[nodiscard]] static Result<std::unique_ptr<RemotePublisher>> Start(store::Store* store,
                                                                      RemotePublisherOptions options);
  // Hands the publisher the merged snapshot of version `version` (its id) that the trainer
  // built for a step, before the step is recorded: served in merged and delta mode (ignored
  // in adapter mode). Thread-safe, never waits (sync::Publisher::Offer).
  void Offer(const store::Digest& version, std::shared_ptr<const sync::Snapshot> snapshot);
  // The endpoints bound: "requests" and "updates".
  [[nodiscard]] const sync::Endpoints& endpoints() const { return bound_; }
  // `remote_generators` of `ferry daemon status --json`: one object per receiver seen, sorted
  // by id: {id, version (32 hex of the merged version it proved, or null), step (that
  // version's step, 0 for the base, null when none), lag (current_step - step, null when no
  // step), last_ack_at (Unix seconds, null before the first ack), last_seen_at, alive}.
  [[nodiscard]] nlohmann::json Generators(int64_t current_step) const;

 private:
  RemotePublisher(store::Store* store, std::unique_ptr<sync::Publisher> p, store::Digest base, sync::PublishMode mode)
      : store_(store), publisher_(std::move(p)), base_(base), mode_(mode), bound_(publisher_->bound_endpoints()) {}
  store::Store* store_;
  std::unique_ptr<sync::Publisher> publisher_;
  store::Digest base_;
  sync::PublishMode mode_;
  sync::Endpoints bound_;
};

}  // namespace ferry::ferryd
