// `ferry sync publish|receive|status`: weight sync over ZeroMQ (sync/protocol.h).
//   publish  --db DB --bind EP [--run R] [--key PREFIX --allow FILE] [--mode merged|adapter|delta]
//            [--watch DIR --base V|DIR [--layout hf|fused] [--poll-ms N]] [--json]
//            With --watch the run's newest servable version, or else its base, is served at
//            once, so a receiver started before the first checkpoint holds the base.
//   receive  --connect EP --out DIR --id ID [--key PREFIX --server-key FILE] [--layout hf|fused]
//            [--engine vllm --engine-url URL]: makes a vLLM server adopt and prove each version
//            [--base DIR] [--once] [--timeout-ms N] [--keep-versions N] [--json]
//            Without --once it waits out a publisher that is not up, silent or unreachable
//            (kUnavailable, warned once per outage) and one with nothing (newer) published
//            (kNotFound), and exits 1 on any other error (a local write failing, say).
//   status   --db DB [--run R] [--json]   receivers, their versions, lag, last seen, lost
// EP is ipc://DIR (a private directory holding both sockets) or tcp://HOST:PORT (requests on
// PORT, announcements on PORT+1; CURVE keys required).
#include <signal.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cli/commands.h"
#include "cli/output.h"
#include "cli/store_common.h"
#include "cli/sync_engine.h"
#include "core/text.h"
#include "store/engine_report.h"
#include "sync/endpoints.h"
#include "sync/publisher.h"
#include "sync/receiver.h"
#include "sync/snapshot.h"
#include "sync/watch.h"

namespace ferry::cli {
namespace {

using Json = nlohmann::ordered_json;

constexpr const char* kEndpointHelp =
    "ipc://DIR (a private directory, created or forced to mode 0700, holding both sockets) or "
    "tcp://HOST:PORT (requests on PORT, announcements on PORT+1; needs CURVE keys)";

// The socket pair an ENDPOINT flag names (sync::ParseSyncEndpoint); fails naming the flag.
sync::Endpoints ParseEndpointOrFail(const std::string& flag, const std::string& value) {
  auto e = sync::ParseSyncEndpoint(value);
  if (!e.ok()) Fail(Status(e.status().code(), flag + " " + e.status().message()));
  return *e;
}

struct KeyFlags {
  std::string key, allow, server_key;
};

void AddKeyFlags(CLI::App* c, KeyFlags& f, bool publisher) {
  c->add_option("--key", f.key,
                "CURVE keypair prefix (PREFIX.key / PREFIX.pub, from `ferry keys generate`); needed for tcp://");
  if (publisher) {
    c->add_option("--allow", f.allow,
                  "File of receiver public keys allowed to connect (one per line); needed with --key");
  } else {
    c->add_option("--server-key", f.server_key, "The publisher's public key file (PREFIX.pub); needed with --key");
  }
}

std::optional<sync::CurveOptions> CurveOrFail(const KeyFlags& f, bool publisher) {
  if (f.key.empty()) {
    if (!f.allow.empty()) Fail("--allow needs --key");
    if (!f.server_key.empty()) Fail("--server-key needs --key");
    return std::nullopt;
  }
  if (publisher) {
    if (f.allow.empty()) Fail("--key needs --allow FILE (without an allow-list any client key would be accepted)");
    auto c = sync::LoadServerCurve(f.key, f.allow);
    if (!c.ok()) Fail(c.status());
    return *c;
  }
  if (f.server_key.empty()) Fail("--key needs --server-key FILE");
  auto c = sync::LoadClientCurve(f.key, f.server_key);
  if (!c.ok()) Fail(c.status());
  return *c;
}

// Fails naming the flag unless both endpoints are usable with/without CURVE.
// `curve_flags`: the flags that give this side its CURVE keys, named when tcp:// lacks them.
void CheckEndpointsOrFail(const std::string& flag, const std::string& value, const sync::Endpoints& e, bool curve,
                          std::string_view curve_flags) {
  Status s = sync::CheckEndpoints(e, curve);
  if (!s.ok()) FailWithHint(s.WithContext(flag + " " + value), StatusCode::kFailedPrecondition, curve_flags);
}

Layout ParseLayoutOrFail(const std::string& layout) {
  if (layout == "hf") return Layout::kHf;
  if (layout == "fused") return Layout::kFused;
  Fail("--layout '" + layout + "' is not one of hf, fused");
}

// Blocks SIGINT/SIGTERM in every thread (call before starting any) and returns the set.
sigset_t BlockStopSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  return set;
}

// Waits up to `timeout_ms` for SIGINT/SIGTERM; true when one arrived.
bool WaitForStop(const sigset_t& set, int timeout_ms) {
  timespec ts{timeout_ms / 1000, static_cast<long>(timeout_ms % 1000) * 1000000L};
  return sigtimedwait(&set, nullptr, &ts) > 0;
}

void PrintSync(const sync::SyncResult& r, const std::string& id, bool json) {
  if (json) {
    Json j;
    j["receiver"] = id;
    j["version"] = r.version.Hex();
    j["active"] = r.active.Hex();
    j["proven"] = r.proven ? Json(r.proven->Hex()) : Json(nullptr);
    j["sequence"] = r.sequence;
    j["bytes_received"] = r.bytes_received;
    j["bytes_reused"] = r.bytes_reused;
    j["bytes_resumed"] = r.bytes_resumed;
    j["refetches"] = r.refetches;
    j["skipped"] = r.skipped;
    j["already_active"] = r.already_active;
    std::printf("%s\n", JsonText(j).c_str());
  } else {
    std::printf("%s %s (served %s, sequence %llu, %s received, %s reused%s)\n",
                r.already_active ? "already active" : "activated", r.active.Hex().c_str(), ShortId(r.version).c_str(),
                static_cast<unsigned long long>(r.sequence), HumanBytes(r.bytes_received).c_str(),
                HumanBytes(r.bytes_reused).c_str(),
                r.bytes_resumed > 0 ? (", " + HumanBytes(r.bytes_resumed) + " resumed").c_str() : "");
  }
  std::fflush(stdout);
}

struct PublishFlags {
  std::string db, run = "default", bind, mode = "merged", watch, base, layout = "hf";
  KeyFlags keys;
  int poll_ms = 1000;
  bool json = false;
};

// Publishes what the watcher handled; a broken checkpoint is reported on stderr and skipped.
void PublishWatched(sync::Publisher& p, const sync::WatchedCheckpoint& c, sync::PublishMode mode, bool json) {
  const std::string step = c.step ? std::to_string(*c.step) : "-";
  if (!c.error.ok()) {
    std::fprintf(stderr, "ferry: warning: skipped: %s\n", c.error.message().c_str());
    return;
  }
  if (mode == sync::PublishMode::kAdapter && !c.adapter) {
    std::fprintf(stderr,
                 "ferry: warning: skipped: checkpoint %s is a full model; --mode adapter publishes adapters only\n",
                 c.dir.c_str());
    return;
  }
  const store::Digest publish = mode == sync::PublishMode::kAdapter ? *c.adapter_version : *c.version;
  auto seq = p.Publish(publish);
  if (!seq.ok()) {
    std::fprintf(stderr, "ferry: warning: skipped: checkpoint %s: %s\n", c.dir.c_str(), seq.status().message().c_str());
    return;
  }
  if (json) {
    Json j;
    j["dir"] = c.dir.string();
    j["step"] = c.step ? Json(*c.step) : Json(nullptr);
    j["published"] = publish.Hex();
    j["version"] = c.version->Hex();
    j["adapter"] = c.adapter_version ? Json(c.adapter_version->Hex()) : Json(nullptr);
    j["sequence"] = *seq;
    std::printf("%s\n", JsonText(j).c_str());
  } else {
    std::printf("published %s (checkpoint %s, step %s, %s %s, sequence %llu)\n", publish.Hex().c_str(), c.dir.c_str(),
                step.c_str(), c.adapter ? "merged" : "full", c.version->Hex().c_str(),
                static_cast<unsigned long long>(*seq));
  }
  std::fflush(stdout);
}

void RunPublish(const PublishFlags& f) {
  const bool watching = !f.watch.empty();
  if (watching && f.base.empty()) Fail("--watch needs --base V|DIR (the base version id or base model directory)");
  if (!watching && !f.base.empty()) Fail("--base is only used with --watch");
  if (!watching && f.layout != "hf") Fail("--layout is only used with --watch");
  auto mode = sync::ParsePublishMode(f.mode);
  if (!mode.ok()) Fail(mode.status().WithContext("--mode"));
  const Layout layout = ParseLayoutOrFail(f.layout);
  if (*mode == sync::PublishMode::kAdapter && layout != Layout::kHf) {
    Fail("--mode adapter needs --layout hf (receivers choose their layout with `sync receive --layout`)");
  }
  if (f.poll_ms <= 0) Fail("--poll-ms must be positive");

  sync::PublisherOptions o;
  o.endpoints = ParseEndpointOrFail("--bind", f.bind);
  o.curve = CurveOrFail(f.keys, true);
  CheckEndpointsOrFail("--bind", f.bind, o.endpoints, o.curve.has_value(), "give --key and --allow");
  o.mode = *mode;
  if (o.curve) {
    // A refused receiver only sees silence: say here which key was turned away (once per key).
    o.on_rejected_key = [allow = f.keys.allow](const std::string& key) {
      std::fprintf(stderr, "ferry: warning: refused a receiver with CURVE public key %s: not in --allow %s\n",
                   key.c_str(), allow.c_str());
    };
  }

  auto owned = OpenStoreOrFail(f.db, /*writable=*/true, /*create=*/watching);
  store::Store& store = *owned;  // the watcher imports while the publisher serves: Store is thread-safe
  std::unique_ptr<sync::CheckpointWatcher> watcher;
  if (watching) {
    sync::WatchOptions w;
    w.dir = f.watch;
    w.base = f.base;
    w.run = f.run;
    w.layout = layout;
    auto created = sync::CheckpointWatcher::Create(&store, w);
    if (!created.ok()) Fail(created.status());
    watcher = std::move(*created);
  }
  const sigset_t set = BlockStopSignals();
  auto p = sync::Publisher::Start(&store, o);
  if (!p.ok()) Fail(p.status());
  const auto bound = (*p)->bound_endpoints();
  std::fprintf(stderr, "ferry: publishing run %s (%s mode) on %s (announcements on %s)%s%s\n", f.run.c_str(),
               std::string(sync::PublishModeName(*mode)).c_str(), bound.requests.c_str(), bound.updates.c_str(),
               watching ? ", watching " : "", watching ? f.watch.c_str() : "");
  auto newest = sync::NewestPublishable(store, f.run, *mode);
  if (!newest.ok()) Fail(newest.status());
  if (!watching) {
    // This process holds the store (one writer), so nothing new can be recorded while it
    // serves: it serves the newest publishable version; new versions come through --watch.
    if (!newest->has_value()) {
      Fail("run " + f.run + " of " + f.db + " has no version to publish in " + f.mode +
           " mode (needs a merged, full or base version; adapter mode: an adapter whose merged version is "
           "recorded, or a base)");
    }
    auto seq = (*p)->Publish(**newest);
    if (!seq.ok()) Fail(seq.status());
    std::fprintf(stderr, "ferry: serving %s (sequence %llu)\n", newest->value().Hex().c_str(),
                 static_cast<unsigned long long>(*seq));
    int sig = 0;
    sigwait(&set, &sig);
    return;
  }
  // The run's newest servable version, or its base: a receiver started before the first
  // checkpoint holds the base weights (NewestPublishable finds a base recorded in the run;
  // one stored under another run is served from there).
  const store::Digest first = newest->has_value() ? **newest : watcher->base_version();
  if (auto seq = (*p)->Publish(first); seq.ok()) {
    std::fprintf(stderr, "ferry: serving %s (sequence %llu)\n", first.Hex().c_str(),
                 static_cast<unsigned long long>(*seq));
  } else {
    std::fprintf(stderr, "ferry: warning: %s\n", seq.status().message().c_str());
  }
  do {
    auto handled = watcher->Poll();
    if (!handled.ok()) Fail(handled.status());
    for (const auto& c : *handled) PublishWatched(**p, c, *mode, f.json);
  } while (!WaitForStop(set, f.poll_ms));
}

struct ReceiveFlags {
  std::string connect, out, id, layout = "hf", base;
  KeyFlags keys;
  bool once = false, json = false;
  int timeout_ms = 10000;
  int keep_versions = 2;
  EngineFlags engine;
};

// Errors `receive` waits out when following: the publisher not answering or unreachable
// (kUnavailable) and nothing (newer) published yet (kNotFound). Anything else (a local
// write, fsync or rename failing, a version that stays corrupt, a precondition) ends it.
bool IsTransient(const Status& s) { return s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kNotFound; }

// With CURVE, a publisher silent since Connect may be refusing this receiver's key (the
// library's message then names the key): add which file holds it.
Status WithKeyFileHint(const Status& s, const ReceiveFlags& f, const sync::Receiver& receiver) {
  if (s.code() != StatusCode::kUnavailable || f.keys.key.empty() || receiver.heard_from_publisher()) return s;
  return Status(s.code(), s.message() + "; this receiver's public key is " + f.keys.key +
                              ".pub: the publisher's --allow file must list it");
}

[[noreturn]] void FailReceive(const Status& s, const ReceiveFlags& f, const sync::Receiver& receiver) {
  // Adapter mode without a local base, and the publisher does not serve the base the adapters
  // apply to (kFailedPrecondition).
  if (f.base.empty() && s.code() == StatusCode::kFailedPrecondition &&
      receiver.served_mode() == sync::PublishMode::kAdapter) {
    Fail(s.WithContext("the publisher serves adapters: give --base DIR (the local base model)"));
  }
  Fail(WithKeyFileHint(s, f, receiver));
}

void RunReceive(const ReceiveFlags& f) {
  sync::ReceiverOptions o;
  o.id = f.id;
  o.dir = f.out;
  o.timeout_ms = f.timeout_ms;
  o.keep_versions = f.keep_versions;
  o.layout = ParseLayoutOrFail(f.layout);
  if (!f.base.empty()) o.base_dir = f.base;
  o.endpoints = ParseEndpointOrFail("--connect", f.connect);
  o.curve = CurveOrFail(f.keys, false);
  CheckEndpointsOrFail("--connect", f.connect, o.endpoints, o.curve.has_value(), "give --key and --server-key");
  auto engine = EngineDriver::CreateOrFail(f.engine, f.out, f.id, f.json);
  if (engine && o.layout != Layout::kHf)
    Fail("--engine needs --layout hf (the engine and its reference read hf names)");
  const sigset_t set = BlockStopSignals();
  auto r = sync::Receiver::Connect(o);
  if (!r.ok()) Fail(r.status());
  bool publisher_lost = false;  // warned once per outage, not on every poll
  // A failed sync while following: kUnavailable is warned once per outage, kNotFound waited
  // out quietly; anything else ends `receive`.
  auto on_error = [&](const Status& st) {
    if (!IsTransient(st)) FailReceive(st, f, **r);
    if (st.code() == StatusCode::kUnavailable) {
      if (!publisher_lost) std::fprintf(stderr, "ferry: warning: %s\n", WithKeyFileHint(st, f, **r).message().c_str());
      publisher_lost = true;
      return;
    }
    if (publisher_lost) std::fprintf(stderr, "ferry: publisher %s is answering again\n", f.connect.c_str());
    publisher_lost = false;  // kNotFound: the publisher is alive, nothing (newer) yet
  };
  auto s = (*r)->SyncLatest();
  if (s.ok()) {
    PrintSync(*s, f.id, f.json);
    if (engine) engine->OnSynced(*s, **r);
  } else {
    if (f.once) FailReceive(s.status(), f, **r);
    on_error(s.status());
    if (s.status().code() == StatusCode::kNotFound) {
      std::fprintf(stderr, "ferry: waiting for a version to be published: %s\n", s.status().message().c_str());
    }
  }
  // WaitForNewer also syncs the first version announced when none is active yet.
  while (!f.once && !WaitForStop(set, 0)) {
    auto n = (*r)->WaitForNewer(500);
    if (!n.ok()) {
      on_error(n.status());
      if (engine) engine->Poll(**r);
      continue;
    }
    if (publisher_lost) std::fprintf(stderr, "ferry: publisher %s is answering again\n", f.connect.c_str());
    publisher_lost = false;
    PrintSync(*n, f.id, f.json);
    if (engine) engine->OnSynced(*n, **r);
  }
  // --once: the engine's first adoption, retried until proven or stopped.
  while (f.once && engine && !engine->caught_up() && !WaitForStop(set, 500)) engine->Poll(**r);
}

struct StatusFlags {
  std::string db, run = "default";
  bool json = false;
};

void RunStatus(const StatusFlags& f) {
  auto store = OpenStoreOrFail(f.db, /*writable=*/false);
  auto versions = store->ListVersions(f.run);
  if (!versions.ok()) Fail(versions.status());
  // Lag counts the servable versions (merged or full) of the run newer than the acknowledged
  // one; base and adapter versions a watcher records along the way do not count.
  std::map<store::Digest, uint64_t> seq_of;
  std::vector<uint64_t> servable;  // sequences, ascending
  for (const auto& v : *versions) {
    seq_of[v.id] = v.sequence;
    if (v.kind == store::VersionKind::kMerged || v.kind == store::VersionKind::kFull) servable.push_back(v.sequence);
  }
  std::sort(servable.begin(), servable.end());
  auto lag_of = [&](uint64_t seq) -> uint64_t {
    return static_cast<uint64_t>(servable.end() - std::upper_bound(servable.begin(), servable.end(), seq));
  };
  auto events = store->ListEvents(std::nullopt);
  if (!events.ok()) Fail(events.status());
  struct Row {
    std::optional<store::Event> ack;       // newest acknowledgement
    int64_t last_seen_ns = 0;              // newest event naming the receiver
    std::optional<std::string> lost;       // set while the newest event is a "lost" anomaly
    std::optional<store::Event> engine;    // newest engine proof (kEngine)
    std::optional<store::Event> mismatch;  // newest engine mismatch, when newer than the proof
  };
  std::map<std::string, Row> rows;  // events are in time order
  for (const auto& e : *events) {
    if (e.receiver.empty()) continue;
    Row& r = rows[e.receiver];
    const bool lost = e.type == store::Event::Type::kAnomaly && e.anomaly == store::Event::Anomaly::kReceiverLost;
    if (e.type == store::Event::Type::kAcknowledged) r.ack = e;
    if (e.type == store::Event::Type::kEngine) {
      r.engine = e;
      r.mismatch.reset();
    }
    if (e.type == store::Event::Type::kAnomaly && e.anomaly == store::Event::Anomaly::kEngineMismatch) r.mismatch = e;
    if (!lost) r.last_seen_ns = std::max(r.last_seen_ns, e.time_ns);
    if (lost) {
      r.lost = e.detail;
    } else {
      r.lost.reset();
    }
  }
  Json out = Json::array();
  for (const auto& [id, r] : rows) {
    Json j;
    j["receiver"] = id;
    j["version"] = r.ack ? Json(r.ack->version.Hex()) : Json(nullptr);
    j["verified"] = r.ack && r.ack->computed && *r.ack->computed == r.ack->version;
    auto it = r.ack ? seq_of.find(r.ack->version) : seq_of.end();
    j["lag"] = it != seq_of.end() ? Json(lag_of(it->second)) : Json(nullptr);  // null: not of this run
    j["time"] = r.ack ? Json(FormatTime(r.ack->time_ns)) : Json(nullptr);
    j["last_seen"] = r.last_seen_ns > 0 ? Json(FormatTime(r.last_seen_ns)) : Json(nullptr);
    j["lost"] = r.lost.has_value();
    if (r.lost) j["lost_detail"] = *r.lost;
    // The engine the receiver drives: what it was last proven to serve, and a mismatch since.
    // A record that is not a valid report is shown as such ("invalid"), never as a proof.
    auto engine_json = [](const store::Event& e) {
      Result<store::EngineReport> report = store::ParseEngineReport(e.detail, e.type == store::Event::Type::kEngine);
      Json d =
          report.ok() ? Json::parse(store::EngineReportJson(*report)) : Json{{"invalid", report.status().message()}};
      d["version"] = e.version.Hex();
      d["time"] = FormatTime(e.time_ns);
      return d;
    };
    if (r.engine) j["engine"] = engine_json(*r.engine);
    if (r.mismatch) j["engine_mismatch"] = engine_json(*r.mismatch);
    out.push_back(j);
  }
  if (f.json) {
    std::printf("%s\n", JsonText(out, 2).c_str());
    return;
  }
  std::printf("%-24s %-12s %-8s %-5s %-20s %-20s %s\n", "RECEIVER", "VERSION", "VERIFIED", "LAG", "ACKED", "LAST SEEN",
              "STATE");
  for (const auto& j : out) {
    auto text = [](const Json& v) { return v.is_null() ? std::string("-") : v.get<std::string>(); };
    const std::string lag = j["lag"].is_null() ? "-" : std::to_string(j["lag"].get<uint64_t>());
    const std::string version = j["version"].is_null() ? "-" : j["version"].get<std::string>().substr(0, 12);
    std::printf("%-24s %-12s %-8s %-5s %-20s %-20s %s\n", j["receiver"].get<std::string>().c_str(), version.c_str(),
                j["version"].is_null() ? "-" : (j["verified"].get<bool>() ? "yes" : "NO"), lag.c_str(),
                text(j["time"]).c_str(), text(j["last_seen"]).c_str(), j["lost"].get<bool>() ? "LOST" : "ok");
    auto figure = [](const Json& v) {
      return v.is_number() ? FormatNumber(v.get<double>(), 3) : std::string("not finite");
    };
    if (j.contains("engine")) {
      const Json& e = j["engine"];
      if (e.contains("invalid")) {
        std::printf("  engine record for %s, %s, is invalid: %s\n",
                    e["version"].get<std::string>().substr(0, 12).c_str(), e["time"].get<std::string>().c_str(),
                    e["invalid"].get<std::string>().c_str());
      } else {
        std::printf("  engine %s %s serves %s as %s, proven %s (largest difference %s)\n",
                    e["engine"].get<std::string>().c_str(), e["url"].get<std::string>().c_str(),
                    e["version"].get<std::string>().substr(0, 12).c_str(), e["model"].get<std::string>().c_str(),
                    e["time"].get<std::string>().c_str(), figure(e["max_diff"]).c_str());
      }
    }
    if (j.contains("engine_mismatch")) {
      const Json& e = j["engine_mismatch"];
      std::printf("  engine MISMATCH %s: did not answer as %s (%s)\n", e["time"].get<std::string>().c_str(),
                  e["version"].get<std::string>().substr(0, 12).c_str(),
                  e.contains("invalid") ? ("invalid record: " + e["invalid"].get<std::string>()).c_str()
                                        : e["why"].get<std::string>().c_str());
    }
  }
}

}  // namespace

void SetSyncCommand(CLI::App& app) {
  auto* sync_cmd = app.add_subcommand("sync", "Serve or receive weight versions over ZeroMQ");
  sync_cmd->require_subcommand(1);

  auto pf = std::make_shared<PublishFlags>();
  auto* publish = sync_cmd->add_subcommand(
      "publish",
      "Serve the latest version of a run (or, with --watch, each new trainer checkpoint) until SIGINT/SIGTERM");
  publish
      ->add_option(
          "--db", pf->db,
          "Store directory (opened for writing: acks and watched checkpoints are recorded; created with --watch)")
      ->required();
  publish->add_option("--bind", pf->bind, std::string("Endpoint to serve on: ") + kEndpointHelp)->required();
  publish->add_option("--run", pf->run, "Run whose versions are served and recorded (default: default)");
  publish->add_option("--mode", pf->mode,
                      "merged (every tensor), adapter (the LoRA adapter; receivers merge onto their --base) or delta "
                      "(only tensors the receiver lacks) (default: merged)");
  publish->add_option("--watch", pf->watch,
                      "Trainer output directory: each new checkpoint subdirectory (PEFT adapter or full model) is "
                      "imported, merged onto --base when an adapter, and published (default: serve the run's newest "
                      "publishable version)");
  publish->add_option("--base", pf->base,
                      "With --watch: the base version id, or a base model directory (imported when new)");
  publish->add_option("--layout", pf->layout,
                      "With --watch: layout of the merged versions recorded, hf | fused (default: hf)");
  publish->add_option("--poll-ms", pf->poll_ms,
                      "With --watch: milliseconds between scans; a checkpoint is imported once "
                      "unchanged across two scans (default: 1000)");
  publish->add_flag("--json", pf->json, "Print one JSON line per published checkpoint");
  AddKeyFlags(publish, pf->keys, /*publisher=*/true);
  publish->callback([pf] { RunPublish(*pf); });

  auto rf = std::make_shared<ReceiveFlags>();
  auto* receive = sync_cmd->add_subcommand(
      "receive", "Keep DIR/current pointing at the publisher's newest fully verified version (switched atomically)");
  receive->add_option("--connect", rf->connect, std::string("Publisher endpoint: ") + kEndpointHelp)->required();
  receive->add_option("--out,--dir", rf->out, "Receiver directory (DIR/current is the active version)")->required();
  receive->add_option("--id", rf->id, "Receiver id recorded by the publisher ([A-Za-z0-9._-]{1,64})")->required();
  receive->add_option("--layout", rf->layout, "Layout activated in DIR/current, hf | fused (default: hf)");
  receive->add_option("--base", rf->base,
                      "Local base model directory: adapters (publisher --mode adapter) are merged onto it unless "
                      "this receiver received the publisher's base; a served base copies the tensors it holds "
                      "instead of fetching them");
  receive->add_option("--timeout-ms", rf->timeout_ms, "Longest wait for a reply from the publisher (default: 10000)");
  receive->add_option("--keep-versions", rf->keep_versions,
                      "Versions kept in DIR/versions: the newest N activated (default: 2; 0 keeps all)");
  receive->add_flag("--once", rf->once, "Sync the latest version and exit (default: keep following)");
  receive->add_flag("--json", rf->json, "Print one JSON line per activated version");
  AddKeyFlags(receive, rf->keys, /*publisher=*/false);
  AddEngineFlags(receive, rf->engine);
  receive->callback([rf] { RunReceive(*rf); });

  auto sf = std::make_shared<StatusFlags>();
  auto* status = sync_cmd->add_subcommand(
      "status", "Receivers: newest acknowledged version, digest match, lag behind the run, last seen, lost");
  status->add_option("--db", sf->db, "Store directory")->required();
  status->add_option("--run", sf->run, "Run to measure lag against (default: default)");
  status->add_flag("--json", sf->json, "Machine-readable output");
  status->callback([sf] { RunStatus(*sf); });
}

}  // namespace ferry::cli
