// `ferry sync publish|receive|status`: weight sync over ZeroMQ (sync/protocol.h).
//   publish  --db DB [--run R] (--socket-dir DIR | --requests EP --updates EP --key PREFIX --allow FILE)
//   receive  --dir DIR --id ID (--socket-dir DIR | --requests EP --updates EP --key PREFIX --server-key FILE) [--once]
//   status   --db DB [--run R] [--json]   receivers that acknowledged versions, and their lag
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <map>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "cli/output.h"
#include "cli/store_common.h"
#include "sync/keys.h"
#include "sync/publisher.h"
#include "sync/receiver.h"

namespace ferry::cli {
namespace {

using Json = nlohmann::ordered_json;

struct EndpointFlags {
  std::string socket_dir, requests, updates, key, allow, server_key;
};

void AddEndpointFlags(CLI::App* c, EndpointFlags& f, bool publisher) {
  c->add_option("--socket-dir", f.socket_dir, "Private directory (mode 0700) for the ipc:// sockets");
  c->add_option("--requests", f.requests, "Request endpoint (tcp:// needs CURVE keys)");
  c->add_option("--updates", f.updates, "Announcement endpoint (tcp:// needs CURVE keys)");
  c->add_option("--key", f.key, "CURVE keypair prefix (PREFIX.key / PREFIX.pub, from `ferry keys generate`)");
  if (publisher) {
    c->add_option("--allow", f.allow, "File of receiver public keys allowed to connect (one per line)");
  } else {
    c->add_option("--server-key", f.server_key, "The publisher's public key file (PREFIX.pub)");
  }
}

sync::Endpoints EndpointsOrFail(const EndpointFlags& f) {
  if (!f.socket_dir.empty()) {
    if (!f.requests.empty() || !f.updates.empty()) Fail("--socket-dir and --requests/--updates are exclusive");
    auto e = sync::PrivateIpcEndpoints(f.socket_dir);
    if (!e.ok()) Fail(e.status());
    return *e;
  }
  if (f.requests.empty() || f.updates.empty()) Fail("give --socket-dir, or both --requests and --updates");
  return {f.requests, f.updates};
}

std::optional<sync::CurveOptions> CurveOrFail(const EndpointFlags& f, bool publisher) {
  if (f.key.empty()) {
    if (!f.allow.empty() || !f.server_key.empty()) Fail("--allow / --server-key need --key");
    return std::nullopt;
  }
  sync::CurveOptions c;
  auto sec = sync::ReadSecretKey(f.key + ".key");
  if (!sec.ok()) Fail(sec.status());
  auto pub = sync::ReadPublicKey(f.key + ".pub");
  if (!pub.ok()) Fail(pub.status());
  c.secret_key = *sec;
  c.public_key = *pub;
  if (publisher) {
    if (f.allow.empty()) Fail("--key needs --allow FILE (without an allow-list any client key would be accepted)");
    auto keys = sync::ReadAllowList(f.allow);
    if (!keys.ok()) Fail(keys.status());
    c.allowed_keys = *keys;
  } else {
    if (f.server_key.empty()) Fail("--key needs --server-key FILE");
    auto sk = sync::ReadPublicKey(f.server_key);
    if (!sk.ok()) Fail(sk.status());
    c.server_public_key = *sk;
  }
  return c;
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

bool StopRequested(const sigset_t& set) {
  timespec zero{0, 0};
  return sigtimedwait(&set, nullptr, &zero) > 0;
}

void PrintSync(const sync::SyncResult& r, const std::string& id) {
  Json j;
  j["receiver"] = id;
  j["version"] = r.version.Hex();
  j["sequence"] = r.sequence;
  j["bytes_received"] = r.bytes_received;
  j["refetches"] = r.refetches;
  j["skipped"] = r.skipped;
  j["already_active"] = r.already_active;
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);
}

}  // namespace

void SetSyncCommand(CLI::App& app) {
  auto* sync_cmd = app.add_subcommand("sync", "Serve or receive weight versions over ZeroMQ");
  sync_cmd->require_subcommand(1);

  struct PublishFlags {
    std::string db, run = "default";
    EndpointFlags ep;
  };
  auto pf = std::make_shared<PublishFlags>();
  auto* publish = sync_cmd->add_subcommand("publish", "Serve the latest version of a run until SIGINT/SIGTERM");
  publish->add_option("--db", pf->db, "Store directory (opened for writing: acks are recorded)")->required();
  publish->add_option("--run", pf->run, "Run whose latest version is served (followed as it changes)");
  AddEndpointFlags(publish, pf->ep, /*publisher=*/true);
  publish->callback([pf] {
    sync::PublisherOptions o;
    o.endpoints = EndpointsOrFail(pf->ep);
    o.curve = CurveOrFail(pf->ep, true);
    o.follow_run = pf->run;
    auto store = OpenStoreOrFail(pf->db, /*writable=*/true);
    const sigset_t set = BlockStopSignals();
    auto p = sync::Publisher::Start(store.get(), o);
    if (!p.ok()) Fail(p.status());
    const auto bound = (*p)->bound_endpoints();
    std::fprintf(stderr, "ferry: publishing run %s on %s (announcements on %s)\n", pf->run.c_str(),
                 bound.requests.c_str(), bound.updates.c_str());
    int sig = 0;
    sigwait(&set, &sig);
  });

  struct ReceiveFlags {
    std::string dir, id;
    EndpointFlags ep;
    bool once = false;
    int timeout_ms = 10000;
  };
  auto rf = std::make_shared<ReceiveFlags>();
  auto* receive = sync_cmd->add_subcommand("receive", "Fetch, verify and activate the publisher's latest version");
  receive->add_option("--dir", rf->dir, "Receiver directory (DIR/current is the active version)")->required();
  receive->add_option("--id", rf->id, "Receiver id recorded by the publisher ([A-Za-z0-9._-]{1,64})")->required();
  receive->add_option("--timeout-ms", rf->timeout_ms, "Longest wait for a reply");
  receive->add_flag("--once", rf->once, "Sync the latest version and exit (default: keep following)");
  AddEndpointFlags(receive, rf->ep, /*publisher=*/false);
  receive->callback([rf] {
    sync::ReceiverOptions o;
    o.id = rf->id;
    o.dir = rf->dir;
    o.timeout_ms = rf->timeout_ms;
    o.endpoints = EndpointsOrFail(rf->ep);
    o.curve = CurveOrFail(rf->ep, false);
    const sigset_t set = BlockStopSignals();
    auto r = sync::Receiver::Connect(o);
    if (!r.ok()) Fail(r.status());
    auto s = (*r)->SyncLatest();
    if (!s.ok()) Fail(s.status());
    PrintSync(*s, rf->id);
    while (!rf->once && !StopRequested(set)) {
      auto n = (*r)->WaitForNewer(500);
      if (!n.ok()) {
        if (n.status().code() == StatusCode::kNotFound) continue;  // nothing new yet
        Fail(n.status());
      }
      PrintSync(*n, rf->id);
    }
  });

  struct StatusFlags {
    std::string db, run = "default";
    bool json = false;
  };
  auto sf = std::make_shared<StatusFlags>();
  auto* status = sync_cmd->add_subcommand("status", "Receivers that acknowledged versions of a run, and their lag");
  status->add_option("--db", sf->db, "Store directory")->required();
  status->add_option("--run", sf->run, "Run to compare against");
  status->add_flag("--json", sf->json, "Machine-readable output");
  status->callback([sf] {
    auto store = OpenStoreOrFail(sf->db, /*writable=*/false);
    auto versions = store->ListVersions(sf->run);
    if (!versions.ok()) Fail(versions.status());
    std::map<store::Digest, uint64_t> seq_of;
    uint64_t latest = 0;
    for (const auto& v : *versions) {
      seq_of[v.id] = v.sequence;
      latest = std::max(latest, v.sequence);
    }
    auto events = store->ListEvents(std::nullopt);
    if (!events.ok()) Fail(events.status());
    std::map<std::string, store::Event> last;  // newest ack per receiver (events are in time order)
    for (const auto& e : *events) {
      if (e.type == store::Event::Type::kAcknowledged) last[e.receiver] = e;
    }
    Json rows = Json::array();
    for (const auto& [id, e] : last) {
      Json j;
      j["receiver"] = id;
      j["version"] = e.version.Hex();
      j["time"] = FormatTime(e.time_ns);
      j["verified"] = e.computed && *e.computed == e.version;
      auto it = seq_of.find(e.version);
      if (it != seq_of.end()) {
        j["lag"] = latest - it->second;
      } else {
        j["lag"] = nullptr;  // not a version of this run (or collected)
      }
      rows.push_back(j);
    }
    if (sf->json) {
      std::printf("%s\n", rows.dump(2).c_str());
      return;
    }
    std::printf("%-24s %-12s %-8s %-5s %s\n", "RECEIVER", "VERSION", "VERIFIED", "LAG", "ACKED");
    for (const auto& j : rows) {
      const std::string lag = j["lag"].is_null() ? "-" : std::to_string(j["lag"].get<uint64_t>());
      std::printf("%-24s %-12s %-8s %-5s %s\n", j["receiver"].get<std::string>().c_str(),
                  j["version"].get<std::string>().substr(0, 12).c_str(), j["verified"].get<bool>() ? "yes" : "NO",
                  lag.c_str(), j["time"].get<std::string>().c_str());
    }
  });
}

}  // namespace ferry::cli
