// Acknowledgements and liveness of the sync publisher (sync/publisher_internal.h): receivers
// tracked by id (at most kMaxReceivers; an id bound to the first CURVE key it came with),
// their connections followed through the ROUTER's socket monitor, each ACK recorded as a
// kAcknowledged store event (in adapter mode about the merged version the receiver proved),
// the periodic tick (the ANNOUNCE beacon receivers take for the publisher's heartbeat) and
// receivers declared lost (one kAnomaly event each).
#include <algorithm>
#include <cstring>

#include <nlohmann/json.hpp>

#include "store/engine_report.h"
#include "sync/publisher_internal.h"

namespace ferry::sync {
namespace {

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

std::vector<ReceiverInfo> Publisher::Impl::Receivers() const {
  std::lock_guard lock(info_mu_);
  std::vector<ReceiverInfo> out;
  for (const auto& [id, peer] : peers_) out.push_back(peer.info);
  return out;
}

void Publisher::Impl::Tick() {
  Announce();
  CheckLiveness();
}

void Publisher::Impl::CheckLiveness() {
  const auto now = Clock::now();
  std::vector<store::Event> lost;
  {
    std::lock_guard lock(info_mu_);
    for (auto& [id, peer] : peers_) {
      if (!peer.info.alive || !peer.fds.empty()) continue;
      const int64_t quiet = std::chrono::duration_cast<std::chrono::milliseconds>(now - peer.last_sign).count();
      if (quiet < options_.heartbeat_timeout_ms) continue;
      store::Event e;
      e.type = store::Event::Type::kAnomaly;
      e.anomaly = store::Event::Anomaly::kReceiverLost;
      e.receiver = id;
      if (peer.info.acknowledged) {
        e.version = *peer.info.acknowledged;
      } else if (!published_.empty()) {
        e.version = published_.back().record.id;
      }
      e.detail = "receiver " + id + " lost: no traffic for " + std::to_string(quiet) + " ms (on " +
                 options_.endpoints.requests + ")";
      lost.push_back(std::move(e));
    }
  }
  for (const auto& e : lost) {
    (void)store_->AddEvent(e);  // history only; serving does not depend on it
    std::lock_guard lock(info_mu_);
    // After the event, so a caller seeing !alive finds it.
    if (auto it = peers_.find(e.receiver); it != peers_.end()) it->second.info.alive = false;
  }
}

void Publisher::Impl::HandleMonitor() {
  for (;;) {
    zmq::message_t ev;
    if (!monitor_.recv(ev, zmq::recv_flags::dontwait)) return;
    bool more = ev.more();
    while (more) {  // the endpoint frame
      zmq::message_t extra;
      if (!monitor_.recv(extra, zmq::recv_flags::dontwait)) break;
      more = extra.more();
    }
    if (ev.size() < 6) continue;
    uint16_t event = 0;
    uint32_t value = 0;
    std::memcpy(&event, ev.data(), 2);
    std::memcpy(&value, static_cast<const char*>(ev.data()) + 2, 4);
    if (event != ZMQ_EVENT_DISCONNECTED) continue;
    const int fd = static_cast<int>(value);
    auto it = fd_owner_.find(fd);
    if (it == fd_owner_.end()) continue;
    std::lock_guard lock(info_mu_);
    auto& peer = peers_[it->second];
    peer.fds.erase(fd);
    peer.last_sign = Clock::now();
    fd_owner_.erase(it);
  }
}

// The routing id "<id>/<suffix>" (set by Receiver), else the id last seen on the same
// connection.
std::string Publisher::Impl::SenderId(const zmq::message_t& rid, int fd) const {
  const std::string r = rid.to_string();
  const size_t slash = r.find('/');
  if (slash != std::string::npos && IsValidReceiverId(std::string_view(r).substr(0, slash))) return r.substr(0, slash);
  auto it = fd_owner_.find(fd);
  return it == fd_owner_.end() ? std::string() : it->second;
}

// `key` is the CURVE public key ("" without CURVE). kFailedPrecondition when `id` is new and
// kMaxReceivers ids are tracked already, none of them lost (one lost id is forgotten to
// make room: its history is in the store's events), or when `id` is bound to another key:
// an id belongs to the first key it came with, so one listed receiver cannot act (fetch,
// acknowledge) as another.
Status Publisher::Impl::Touch(const std::string& id, int fd, const std::string& key) {
  if (id.empty()) return Status::OK();
  std::lock_guard lock(info_mu_);
  auto found = peers_.find(id);
  if (found == peers_.end()) {
    if (peers_.size() >= kMaxReceivers) {
      auto lost = std::find_if(peers_.begin(), peers_.end(),
                               [](const auto& kv) { return !kv.second.info.alive && kv.second.fds.empty(); });
      if (lost == peers_.end()) {
        return Status::FailedPrecondition("sync: receiver " + id + " refused: this publisher tracks " +
                                          std::to_string(kMaxReceivers) + " receivers, none of them lost");
      }
      peers_.erase(lost);
    }
    found = peers_.emplace(id, Peer{}).first;
    found->second.key = key;
  } else if (found->second.key != key) {
    return Status::FailedPrecondition("sync: receiver id " + id + " is bound to another " +
                                      (key.empty() ? std::string("(CURVE) client") : "public key than " + key));
  }
  auto& peer = found->second;
  peer.info.id = id;
  peer.info.last_seen_ns = NowNs();
  peer.info.alive = true;
  peer.last_sign = Clock::now();
  if (fd >= 0) {
    auto [it, inserted] = fd_owner_.try_emplace(fd, id);
    if (!inserted && it->second != id) {
      peers_[it->second].fds.erase(fd);
      it->second = id;
    }
    peer.fds.insert(fd);
  }
  return Status::OK();
}

void Publisher::Impl::HandleAck(const zmq::message_t& rid, const Message& m, const std::string& key) {
  const Published* p = Find(m.version);
  // Only versions this store holds are recorded (a version published before a restart
  // of this publisher is; a made-up one is not).
  if (p == nullptr && !store_->GetVersion(m.version.Hex()).ok()) {
    return ReplyError(rid, Status::NotFound("sync ACK from " + m.payload + ": version " + m.version.Hex() +
                                            " is not in this publisher's store"));
  }
  store::Event e;
  e.type = store::Event::Type::kAcknowledged;
  e.receiver = m.payload;
  e.version = m.version;
  e.computed = m.computed;
  e.detail = m.computed == m.version ? "receiver verified the manifest digest"
                                     : "MISMATCH: receiver computed " + m.computed.Hex();
  if (p != nullptr && p->merged_version) {
    // Adapter mode: the receiver runs the merged weights; record what it proved about them.
    e.version = *p->merged_version;
    e.computed = m.proven.value_or(m.computed);
    const std::string adapter = "adapter " + m.version.Hex();
    if (!m.proven) {
      e.detail = "MISMATCH: " + adapter + " acknowledged without a proven merged id";
    } else if (!(m.computed == m.version)) {
      e.detail = "MISMATCH: " + adapter + " received as " + m.computed.Hex();
    } else if (!(*m.proven == *p->merged_version)) {
      e.detail = "MISMATCH: " + adapter + " merged by the receiver into " + m.proven->Hex();
    } else {
      e.detail = adapter + " merged by the receiver; merged manifest digest verified";
    }
  }
  if (!key.empty()) e.detail += " (CURVE key " + key + ")";
  Status st = store_->AddEvent(e);
  if (!st.ok()) return ReplyError(rid, st);
  {
    std::lock_guard lock(info_mu_);
    if (auto it = peers_.find(m.payload); it != peers_.end()) {  // tracked by Touch
      it->second.info.acknowledged = e.version;
      it->second.info.acknowledged_sequence = p ? p->sequence : 0;
      it->second.info.acknowledged_ns = NowNs();
    }
  }
  Message r;
  r.type = MsgType::kAcked;
  r.version = m.version;
  Reply(rid, r, {});
}

void Publisher::Impl::HandleEngine(const zmq::message_t& rid, const Message& m, const std::string& key, int fd) {
  // The report, as hostile as any message: an object of known fields and types.
  const auto j = nlohmann::json::parse(m.payload, nullptr, false);
  auto bad = [&](const std::string& what) { ReplyError(rid, Status::Corruption("sync ENGINE: " + what)); };
  if (!j.is_object()) return bad("the report is not a JSON object");
  if (!j.contains("receiver") || !j["receiver"].is_string()) return bad("field 'receiver' is not a string");
  Result<store::EngineReport> report = store::ParseEngineReport(m.payload, std::nullopt);
  if (!report.ok()) return bad(report.status().message());
  const std::string receiver = j["receiver"].get<std::string>();
  if (!IsValidReceiverId(receiver)) return bad("field 'receiver' is not [A-Za-z0-9._-]{1,64}");
  if (Status known = Touch(receiver, fd, key); !known.ok()) return ReplyError(rid, known);
  if (!store_->GetVersion(m.version.Hex()).ok()) {
    return ReplyError(rid, Status::NotFound("sync ENGINE from " + receiver + ": version " + m.version.Hex() +
                                            " is not in this publisher's store"));
  }
  store::Event e;
  e.type = report->proven ? store::Event::Type::kEngine : store::Event::Type::kAnomaly;
  if (!report->proven) e.anomaly = store::Event::Anomaly::kEngineMismatch;
  e.receiver = receiver;
  e.version = m.version;
  // The known fields only, never the report as sent (a copy or dump of hostile nesting recurses).
  report->curve_key = key;
  e.detail = store::EngineReportJson(*report);
  Status st = store_->AddEvent(e);
  if (!st.ok()) return ReplyError(rid, st);
  Message r;
  r.type = MsgType::kAcked;
  r.version = m.version;
  Reply(rid, r, {});
}

}  // namespace ferry::sync
