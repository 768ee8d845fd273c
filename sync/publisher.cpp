#include "sync/publisher.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include <zmq.hpp>

#include "sync/protocol.h"
#include "sync/snapshot.h"

namespace ferry::sync {
namespace {

constexpr size_t kMaxPublishedKept = 8;        // versions served (in adapter mode the pinned base among them)
constexpr size_t kMaxCachedItems = 4;          // tensors/aux files kept open for chunking
constexpr size_t kMaxOfferedKept = 2;          // offered snapshots waiting to be published (Offer)
constexpr size_t kMaxSnapshotsKept = 2;        // published versions whose offered snapshot is kept
constexpr size_t kMaxVerifiedKept = 1u << 16;  // object digests verified once, then trusted
constexpr std::string_view kZapDomain = "ferry-sync";
constexpr uint64_t kPaceBurstBytes = uint64_t{1} << 20;  // credit a capped publisher may bank

using Clock = std::chrono::steady_clock;

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::span<const std::byte> Bytes(const zmq::message_t& m) {
  return {static_cast<const std::byte*>(m.data()), m.size()};
}

zmq::message_t Frame(std::string_view s) { return zmq::message_t(s.data(), s.size()); }

void SetCommonOptions(zmq::socket_t& s, const PublisherOptions& o) {
  s.set(zmq::sockopt::maxmsgsize, kMaxFrameBytes);
  s.set(zmq::sockopt::linger, 0);
  // Per peer: a receiver keeps at most its credit of FETCHes outstanding; replies beyond
  // this are dropped (ROUTER_MANDATORY + dontwait), never queued without bound.
  s.set(zmq::sockopt::sndhwm, kSendHwm);
  if (o.heartbeat_ivl_ms > 0) {
    s.set(zmq::sockopt::heartbeat_ivl, o.heartbeat_ivl_ms);
    s.set(zmq::sockopt::heartbeat_timeout, o.heartbeat_timeout_ms);
    s.set(zmq::sockopt::heartbeat_ttl, o.heartbeat_timeout_ms);
  }
}

uint64_t RandomEpoch() {
  std::random_device rd;
  for (;;) {
    const uint64_t e = (static_cast<uint64_t>(rd()) << 32) ^ static_cast<uint64_t>(rd());
    if (e != 0) return e;
  }
}

}  // namespace

Result<std::optional<store::Digest>> NewestPublishable(store::Store& store, const std::string& run, PublishMode mode) {
  FERRY_ASSIGN_OR_RETURN(std::vector<store::VersionRecord> versions, store.ListVersions(run));
  for (auto it = versions.rbegin(); it != versions.rend(); ++it) {
    // A base is a version too: what a run serves before its first checkpoint.
    if (it->kind == store::VersionKind::kBase) return std::optional<store::Digest>(it->id);
    if (mode != PublishMode::kAdapter) {
      if (it->kind == store::VersionKind::kMerged || it->kind == store::VersionKind::kFull) {
        return std::optional<store::Digest>(it->id);
      }
      continue;
    }
    if (it->kind == store::VersionKind::kMerged && it->adapter_version) {
      return std::optional<store::Digest>(*it->adapter_version);
    }
  }
  return std::optional<store::Digest>();
}

class Publisher::Impl {
 public:
  Impl(store::Store* store, PublisherOptions options)
      : store_(store), options_(std::move(options)), epoch_(RandomEpoch()) {}

  Status Bind() {
    try {
      if (options_.curve) {
        FERRY_ASSIGN_OR_RETURN(
            zap_, ZapAllowList::Bind(ctx_.handle(), options_.curve->allowed_keys, options_.on_rejected_key));
      }
      control_ = zmq::socket_t(ctx_, zmq::socket_type::pair);
      control_.bind("inproc://ferry-publisher-control");
      caller_ = zmq::socket_t(ctx_, zmq::socket_type::pair);
      caller_.connect("inproc://ferry-publisher-control");
      router_ = zmq::socket_t(ctx_, zmq::socket_type::router);
      SetCommonOptions(router_, options_);
      if (options_.curve) FERRY_RETURN_IF_ERROR(SecureServerSocket(router_.handle(), *options_.curve, kZapDomain));
      router_.set(zmq::sockopt::router_mandatory, true);
      if (zmq_socket_monitor(router_.handle(), "inproc://ferry-publisher-monitor",
                             ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED) != 0) {
        return Status::IOError("sync publisher: cannot monitor " + options_.endpoints.requests + ": " +
                               zmq_strerror(zmq_errno()));
      }
      monitor_ = zmq::socket_t(ctx_, zmq::socket_type::pair);
      monitor_.set(zmq::sockopt::linger, 0);
      monitor_.connect("inproc://ferry-publisher-monitor");
      router_.bind(options_.endpoints.requests);
      pub_ = zmq::socket_t(ctx_, zmq::socket_type::pub);
      SetCommonOptions(pub_, options_);
      if (options_.curve) FERRY_RETURN_IF_ERROR(SecureServerSocket(pub_.handle(), *options_.curve, kZapDomain));
      pub_.bind(options_.endpoints.updates);
      bound_ = {router_.get(zmq::sockopt::last_endpoint), pub_.get(zmq::sockopt::last_endpoint)};
    } catch (const zmq::error_t& e) {
      return Status::IOError("sync publisher: cannot bind " + options_.endpoints.requests + " / " +
                             options_.endpoints.updates + ": " + e.what());
    }
    return Status::OK();
  }

  void StartThread() {
    thread_ = std::thread([this] { Loop(); });
  }

  void Stop() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard lock(call_mu_);
      try {
        caller_.send(Frame("S"), zmq::send_flags::none);
      } catch (const zmq::error_t&) {
      }
    }
    thread_.join();
  }

  Result<uint64_t> Publish(const store::Digest& v) {
    std::lock_guard lock(call_mu_);
    std::string req = "P";
    req.append(reinterpret_cast<const char*>(&v.hi), 8);
    req.append(reinterpret_cast<const char*>(&v.lo), 8);
    zmq::message_t reply;
    try {
      caller_.send(Frame(req), zmq::send_flags::none);
      if (!caller_.recv(reply, zmq::recv_flags::none))
        return Status::Internal("sync publisher: no reply from its thread");
    } catch (const zmq::error_t& e) {
      return Status::Internal(std::string("sync publisher: control socket: ") + e.what());
    }
    const std::string r = reply.to_string();
    if (r.size() == 9 && r[0] == 'O') {
      uint64_t seq = 0;
      std::memcpy(&seq, r.data() + 1, 8);
      return seq;
    }
    if (r.size() >= 5 && r[0] == 'E') {
      uint32_t code = 0;
      std::memcpy(&code, r.data() + 1, 4);
      return Status(static_cast<StatusCode>(code), r.substr(5));
    }
    return Status::Internal("sync publisher: bad reply from its thread");
  }

  std::vector<ReceiverInfo> Receivers() const {
    std::lock_guard lock(info_mu_);
    std::vector<ReceiverInfo> out;
    for (const auto& [id, peer] : peers_) out.push_back(peer.info);
    return out;
  }
  uint64_t latest_sequence() const { return sequence_.load(); }
  uint64_t epoch() const { return epoch_; }
  const Endpoints& bound() const { return bound_; }
  void Corrupt(int n) { corrupt_.store(n); }

  void Offer(const store::Digest& version, std::shared_ptr<const Snapshot> snapshot) {
    std::lock_guard lock(offer_mu_);
    std::erase_if(offered_, [&](const auto& o) { return o.first == version; });
    offered_.emplace_back(version, std::move(snapshot));
    while (offered_.size() > kMaxOfferedKept) offered_.erase(offered_.begin());
  }

  // PublisherOptions::publish_first, before the serving thread starts.
  Status PublishFirst() {
    if (options_.offer_first) Offer(options_.offer_first->manifest_id(), options_.offer_first);
    if (!options_.publish_first) return Status::OK();
    return DoPublish(*options_.publish_first).status();
  }

 private:
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

  int TickMs() const { return options_.heartbeat_ivl_ms > 0 ? options_.heartbeat_ivl_ms : 1000; }

  void Loop() {
    auto next_follow = Clock::now();
    auto next_tick = Clock::now();
    for (;;) {
      std::vector<zmq::pollitem_t> items = {{control_.handle(), 0, ZMQ_POLLIN, 0},
                                            {router_.handle(), 0, ZMQ_POLLIN, 0},
                                            {monitor_.handle(), 0, ZMQ_POLLIN, 0}};
      if (zap_) items.push_back({zap_->socket(), 0, ZMQ_POLLIN, 0});
      auto now = Clock::now();
      if (options_.follow_run && now >= next_follow) {
        Follow();
        next_follow = now + std::chrono::milliseconds(options_.follow_interval_ms);
      }
      if (now >= next_tick) {
        Tick();
        next_tick = now + std::chrono::milliseconds(TickMs());
      }
      auto wake = next_tick;
      if (options_.follow_run) wake = std::min(wake, next_follow);
      const auto timeout =
          std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::milliseconds>(wake - Clock::now()).count());
      try {
        zmq::poll(items.data(), items.size(), std::chrono::milliseconds(timeout));
        if (items.size() > 3 && (items[3].revents & ZMQ_POLLIN)) zap_->HandlePending();
        if (items[0].revents & ZMQ_POLLIN) {
          if (!HandleControl()) return;
        }
        // Connection events first, so a close is seen before messages of a later connection.
        if (items[2].revents & ZMQ_POLLIN) HandleMonitor();
        if (items[1].revents & ZMQ_POLLIN) {
          HandleMonitor();
          HandleRequest();
        }
      } catch (const zmq::error_t& e) {
        if (e.num() == ETERM) return;
        // Any other socket error concerns one peer; keep serving the others.
      }
    }
  }

  void Follow() {
    // The run's latest record first (cheap): only a change there can change what to publish.
    auto latest = store_->Latest(*options_.follow_run);
    if (!latest.ok() || !latest->has_value() || **latest == follow_latest_) return;
    follow_latest_ = **latest;
    auto newest = NewestPublishable(*store_, *options_.follow_run, options_.mode);
    if (!newest.ok() || !newest->has_value() || **newest == follow_tried_) return;
    if (!published_.empty() && published_.back().record.id == **newest) return;
    follow_tried_ = **newest;  // once: a version that fails to publish fails again
    (void)DoPublish(**newest);
  }

  // Periodic work: the ANNOUNCE beacon and the receiver liveness check.
  void Tick() {
    Message a;
    a.type = MsgType::kAnnounce;
    a.epoch = epoch_;
    if (!published_.empty()) {
      a.sequence = published_.back().sequence;
      a.version = published_.back().record.id;
    }
    try {
      pub_.send(Frame(EncodeHeader(a)), zmq::send_flags::dontwait);
    } catch (const zmq::error_t&) {
    }
    CheckLiveness();
  }

  void CheckLiveness() {
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

  void HandleMonitor() {
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

  bool HandleControl() {
    zmq::message_t m;
    if (!control_.recv(m, zmq::recv_flags::dontwait)) return true;
    const std::string s = m.to_string();
    if (s == "S") return false;
    store::Digest v;
    std::memcpy(&v.hi, s.data() + 1, 8);
    std::memcpy(&v.lo, s.data() + 9, 8);
    auto seq = DoPublish(v);
    std::string reply;
    if (seq.ok()) {
      reply = "O";
      reply.append(reinterpret_cast<const char*>(&*seq), 8);
    } else {
      reply = "E";
      const auto code = static_cast<uint32_t>(seq.status().code());
      reply.append(reinterpret_cast<const char*>(&code), 4);
      reply += seq.status().message();
    }
    control_.send(Frame(reply), zmq::send_flags::none);
    return true;
  }

  // Whether version `v` is among those served.
  bool Served(const store::Digest& v) const {
    return std::any_of(published_.begin(), published_.end(), [&](const Published& p) { return p.record.id == v; });
  }

  // Gives `p` its record, sequence and manifest (merged_version and base_itself already set).
  void Seal(Published& p, store::VersionRecord rec, uint64_t seq) const {
    Manifest man = ManifestFor(rec);
    man.sequence = seq;
    man.epoch = epoch_;
    man.mode = options_.mode;
    man.merged_version = p.merged_version;
    if (p.base_itself) man.base_version = rec.id;
    p.manifest_json = std::make_shared<const std::string>(EncodeManifest(man));
    p.record = std::move(rec);
    p.sequence = seq;
  }

  // Adapter mode: the stored merged (hf) version of adapter `rec` onto its base.
  Result<store::Digest> FindMerged(const store::VersionRecord& rec) {
    FERRY_ASSIGN_OR_RETURN(std::vector<store::VersionRecord> all, store_->ListVersions(std::nullopt));
    for (auto it = all.rbegin(); it != all.rend(); ++it) {
      if (it->kind == store::VersionKind::kMerged && it->layout == Layout::kHf && it->adapter_version == rec.id &&
          it->base_version == rec.base_version) {
        return it->id;
      }
    }
    return Status::FailedPrecondition("version " + rec.id.Hex() +
                                      ": adapter mode needs a stored merged version of it " +
                                      "(kind merged, layout hf, adapter_version " + rec.id.Hex() + ", base_version " +
                                      rec.base_version->Hex() + "); record the merged version first");
  }

  Result<uint64_t> DoPublish(const store::Digest& v) {
    FERRY_ASSIGN_OR_RETURN(store::VersionRecord rec, store_->GetVersion(v.Hex()));
    if (rec.tensors.empty()) return Status::FailedPrecondition("version " + v.Hex() + " has no tensors to sync");
    const bool is_adapter = rec.kind == store::VersionKind::kAdapter;
    Published p;
    if (options_.mode == PublishMode::kAdapter && !is_adapter) {
      // The base the adapters apply to, served whole (receivers that hold it copy it locally).
      if (rec.kind == store::VersionKind::kMerged) {
        return Status::FailedPrecondition("version " + v.Hex() +
                                          " is of kind merged: adapter mode publishes adapter "
                                          "versions (and the base, kind base or full); publish its adapter");
      }
      p.base_itself = true;
    } else if (options_.mode == PublishMode::kAdapter) {
      if (!rec.base_version) {
        return Status::FailedPrecondition("version " + v.Hex() +
                                          ": adapter has no base_version recorded; adapter mode "
                                          "needs the base the receivers keep");
      }
      FERRY_ASSIGN_OR_RETURN(p.merged_version, FindMerged(rec));
    } else if (is_adapter) {
      return Status::FailedPrecondition("version " + v.Hex() +
                                        " is an adapter: publish it in adapter mode, or publish "
                                        "its merged version in " +
                                        std::string(PublishModeName(options_.mode)) + " mode");
    }
    if (options_.mode != PublishMode::kAdapter && rec.derived) {
      p.snapshot = TakeOffered(v);
      if (!p.snapshot) {
        return Status::FailedPrecondition("version " + v.Hex() +
                                          " is derived (recorded by its digests only) and no snapshot of it was "
                                          "offered (Publisher::Offer): its merged tensors have no bytes to serve");
      }
    }
    const uint64_t seq = sequence_.load() + 1;
    if (options_.mode == PublishMode::kAdapter && is_adapter && !Served(*rec.base_version)) {
      // The base this adapter applies to, never published here (a run followed from its
      // adapters on): served too, unannounced, for receivers without a base of their own to
      // fetch (a HELLO naming it). Left out when the store cannot serve it; such a receiver
      // is then told it needs a local base.
      auto base = store_->GetVersion(rec.base_version->Hex());
      if (base.ok() && !base->tensors.empty() && !base->derived &&
          (base->kind == store::VersionKind::kBase || base->kind == store::VersionKind::kFull)) {
        Published b;
        b.base_itself = true;
        Seal(b, std::move(*base), seq);
        published_.push_back(std::move(b));
      }
    }
    Seal(p, std::move(rec), seq);
    published_.push_back(std::move(p));
    while (published_.size() > kMaxPublishedKept) {
      // The oldest goes, but in adapter mode not the base the newest adapter applies to: a
      // receiver joining without a base fetches it (HELLO naming it) to merge onto.
      const Published& newest = published_.back();
      const std::optional<store::Digest> base = newest.base_itself ? newest.record.id : newest.record.base_version;
      auto victim = published_.begin();
      if (options_.mode == PublishMode::kAdapter && base && victim->base_itself && victim->record.id == *base) ++victim;
      published_.erase(victim);
    }
    size_t snapshots = 0;
    for (auto it = published_.rbegin(); it != published_.rend(); ++it) {
      if (it->snapshot && ++snapshots > kMaxSnapshotsKept) it->snapshot.reset();
    }
    cache_.clear();
    sequence_.store(seq);
    store::Event e;
    e.type = store::Event::Type::kPublished;
    e.version = v;
    e.detail = "sync sequence " + std::to_string(seq) + " epoch " + std::to_string(epoch_) + " mode " +
               std::string(PublishModeName(options_.mode)) + " on " + options_.endpoints.requests;
    (void)store_->AddEvent(e);  // history only; serving does not depend on it
    Message a;
    a.type = MsgType::kAnnounce;
    a.sequence = seq;
    a.version = v;
    a.epoch = epoch_;
    try {
      pub_.send(Frame(EncodeHeader(a)), zmq::send_flags::dontwait);
    } catch (const zmq::error_t&) {
      // The beacon repeats it.
    }
    return seq;
  }

  void Reply(const zmq::message_t& rid, const Message& m, std::span<const std::byte> payload) {
    try {
      zmq::message_t id;
      id.copy(const_cast<zmq::message_t&>(rid));
      router_.send(id, zmq::send_flags::sndmore | zmq::send_flags::dontwait);
      const bool has = HasPayload(m.type);
      router_.send(Frame(EncodeHeader(m)), has ? zmq::send_flags::sndmore : zmq::send_flags::dontwait);
      if (has) router_.send(zmq::message_t(payload.data(), payload.size()), zmq::send_flags::dontwait);
    } catch (const zmq::error_t&) {
      // The peer went away (EHOSTUNREACH) or its queue is full: drop, it will time out and retry.
    }
  }

  // As Reply, with a payload frame that is sent as is (no copy).
  void ReplyOwned(const zmq::message_t& rid, const Message& m, zmq::message_t payload) {
    try {
      zmq::message_t id;
      id.copy(const_cast<zmq::message_t&>(rid));
      router_.send(id, zmq::send_flags::sndmore | zmq::send_flags::dontwait);
      router_.send(Frame(EncodeHeader(m)), zmq::send_flags::sndmore);
      router_.send(payload, zmq::send_flags::dontwait);
    } catch (const zmq::error_t&) {
      // As in Reply: dropped; the receiver times out and fetches again.
    }
  }

  void ReplyError(const zmq::message_t& rid, const Status& st) {
    Message m;
    m.type = MsgType::kError;
    m.code = static_cast<uint32_t>(st.code());
    const std::string& text = st.message();
    Reply(rid, m, {reinterpret_cast<const std::byte*>(text.data()), text.size()});
  }

  void HandleRequest() {
    std::vector<zmq::message_t> parts;
    for (;;) {
      zmq::message_t p;
      if (!router_.recv(p, zmq::recv_flags::dontwait)) break;
      const bool more = p.more();
      if (parts.size() < 4) parts.push_back(std::move(p));
      if (!more) break;
    }
    if (parts.size() < 2) return;  // nothing routable
    const zmq::message_t& rid = parts[0];
    if (parts.size() > 3) return ReplyError(rid, Status::Corruption("sync request: more than 2 frames"));
    const std::span<const std::byte> payload = parts.size() == 3 ? Bytes(parts[2]) : std::span<const std::byte>();
    auto msg = Decode(Bytes(parts[1]), parts.size() == 3 ? &payload : nullptr);
    if (!msg.ok()) return ReplyError(rid, msg.status());
    const int fd = parts[1].get(ZMQ_SRCFD);
    // Over CURVE, the client's public key (Z85) the ZAP handler put in the User-Id.
    const char* user = zmq_msg_gets(parts[1].handle(), "User-Id");
    const std::string key = options_.curve && user != nullptr ? user : "";
    Status known;
    switch (msg->type) {
      case MsgType::kHello:
        if (known = Touch(msg->payload, fd, key); !known.ok()) return ReplyError(rid, known);
        return HandleHello(rid, msg->wanted);
      case MsgType::kFetch:
        if (known = Touch(SenderId(rid, fd), fd, key); !known.ok()) return ReplyError(rid, known);
        return HandleFetch(rid, *msg);
      case MsgType::kAck:
        if (known = Touch(msg->payload, fd, key); !known.ok()) return ReplyError(rid, known);
        return HandleAck(rid, *msg, key);
      default: return ReplyError(rid, Status::Corruption("sync request: a receiver may not send this message type"));
    }
  }

  // The receiver id behind a message without one: its routing id "<id>/<suffix>" (set by
  // Receiver), else the id last seen on the same connection; "" when unknown.
  std::string SenderId(const zmq::message_t& rid, int fd) const {
    const std::string r = rid.to_string();
    const size_t slash = r.find('/');
    if (slash != std::string::npos && IsValidReceiverId(std::string_view(r).substr(0, slash)))
      return r.substr(0, slash);
    auto it = fd_owner_.find(fd);
    return it == fd_owner_.end() ? std::string() : it->second;
  }

  // Records a message from receiver `id` over connection `fd`, authenticated with the CURVE
  // public key `key` ("" without CURVE). kFailedPrecondition when `id` is new and
  // kMaxReceivers ids are tracked already, none of them lost (one lost id is forgotten to
  // make room: its history is in the store's events), or when `id` is bound to another key:
  // an id belongs to the first key it came with, so one listed receiver cannot act (fetch,
  // acknowledge) as another.
  Status Touch(const std::string& id, int fd, const std::string& key) {
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

  // The latest version's manifest, or `wanted`'s while it is still served.
  void HandleHello(const zmq::message_t& rid, const std::optional<store::Digest>& wanted) {
    if (published_.empty()) return ReplyError(rid, Status::NotFound("sync HELLO: nothing published yet"));
    auto it = published_.rbegin();
    if (wanted) {
      it = std::find_if(published_.rbegin(), published_.rend(),
                        [&](const Published& p) { return p.record.id == *wanted; });
      if (it == published_.rend()) {
        return ReplyError(rid, Status::NotFound("sync HELLO: version " + wanted->Hex() + " is not served"));
      }
    }
    const Published& p = *it;
    Message r;
    r.type = MsgType::kManifest;
    r.sequence = p.sequence;
    r.epoch = epoch_;
    ReplyOwned(rid, r, Shared(p.manifest_json));
  }

  // A message that sends `text` without copying it, keeping it alive until ZeroMQ is done:
  // replies queued for a peer (up to kSendHwm) share the publisher's buffers, so a peer
  // that asks and never reads costs references, not copies.
  static zmq::message_t Shared(std::shared_ptr<const std::string> text) {
    auto* keep = new std::shared_ptr<const std::string>(std::move(text));
    return zmq::message_t(
        const_cast<char*>((*keep)->data()), (*keep)->size(),
        [](void*, void* hint) { delete static_cast<std::shared_ptr<const std::string>*>(hint); }, keep);
  }

  // The offered snapshot of `v` (removed from the offers), or null.
  std::shared_ptr<const Snapshot> TakeOffered(const store::Digest& v) {
    std::lock_guard lock(offer_mu_);
    for (auto it = offered_.begin(); it != offered_.end(); ++it) {
      if (it->first == v) {
        std::shared_ptr<const Snapshot> s = std::move(it->second);
        offered_.erase(it);
        return s;
      }
    }
    return nullptr;
  }

  // Tensor `index` of a derived version from its offered snapshot, checked against its row
  // the first time it is served.
  Result<Tensor> FromSnapshot(Published& p, uint32_t index) {
    const store::TensorRow& row = p.record.tensors[index];
    const std::string what = "sync: tensor '" + row.name + "' of version " + p.record.id.Hex();
    if (!p.snapshot) {
      return Status::NotFound(what +
                              " is no longer served (its bytes were held in memory until newer versions "
                              "replaced it); take the latest version");
    }
    auto t = p.snapshot->checkpoint().Get(row.name);
    if (!t.ok()) return Status::Corruption(what + ": not in the snapshot offered for it");
    if (p.snapshot_verified.count(index) == 0) {
      if (t->dtype() != row.dtype || t->shape() != row.shape) {
        return Status::Corruption(what +
                                  ": the offered snapshot's tensor has another dtype or shape than "
                                  "the store records; not served");
      }
      const store::Digest d = store::TensorDigest(*t);
      if (d != row.digest) {
        return Status::Corruption(what + ": the offered bytes hash to " + d.Hex() + " but the store records " +
                                  row.digest.Hex() + "; not served");
      }
      p.snapshot_verified.insert(index);
    }
    return std::move(*t);
  }

  Published* Find(const store::Digest& v) {
    for (auto& p : published_) {
      if (p.record.id == v) return &p;
    }
    return nullptr;
  }

  // The cached item (valid until the cache changes: use it at once). Tensors are mapped
  // store objects; each object is verified against its digest the first time it is loaded.
  // A derived version's rows whose object the store lacks come from its offered snapshot.
  Result<const Tensor*> Item(Published& p, ItemKind kind, uint32_t index) {
    const auto key = std::make_tuple(p.record.id, kind, index);
    if (auto it = cache_.find(key); it != cache_.end()) return &it->second;
    if (cache_.size() >= kMaxCachedItems) cache_.clear();
    if (kind == ItemKind::kTensor) {
      if (index >= p.record.tensors.size()) {
        return Status::InvalidArgument("sync FETCH: tensor index " + std::to_string(index) + " out of range");
      }
      const store::TensorRow& row = p.record.tensors[index];
      const bool verify = verified_.count(row.digest) == 0;
      Result<Tensor> read = store_->ReadTensor(row, verify);
      if (!read.ok() && read.status().code() == StatusCode::kFailedPrecondition && p.record.derived) {
        FERRY_ASSIGN_OR_RETURN(Tensor t, FromSnapshot(p, index));
        auto& slot = cache_[key];
        slot = std::move(t);
        return &slot;
      }
      FERRY_ASSIGN_OR_RETURN(Tensor t, std::move(read));
      if (verify) {
        if (verified_.size() >= kMaxVerifiedKept) verified_.clear();
        verified_.insert(row.digest);
      }
      auto& slot = cache_[key];
      slot = std::move(t);
      return &slot;
    }
    if (index >= p.record.aux.size()) {
      return Status::InvalidArgument("sync FETCH: aux index " + std::to_string(index) + " out of range");
    }
    FERRY_ASSIGN_OR_RETURN(std::string read, store_->ReadAux(p.record.aux[index]));
    auto text = std::make_shared<const std::string>(std::move(read));
    // The tensor owns the text: a copy of it keeps the bytes alive (see HandleFetch).
    FERRY_ASSIGN_OR_RETURN(Tensor t,
                           Tensor::Wrap(DType::kU8, {static_cast<int64_t>(text->size())},
                                        {reinterpret_cast<const std::byte*>(text->data()), text->size()}, text));
    auto& slot = cache_[key];
    slot = std::move(t);
    return &slot;
  }

  void HandleFetch(const zmq::message_t& rid, const Message& m) {
    Published* p = Find(m.version);
    if (p == nullptr) {
      return ReplyError(rid, Status::NotFound("sync FETCH: version " + m.version.Hex() + " is not published here"));
    }
    auto found = Item(*p, m.kind, m.index);
    if (!found.ok()) return ReplyError(rid, found.status());
    const Tensor& tensor = **found;
    const std::span<const std::byte> item = tensor.bytes();
    if (m.offset >= item.size()) {
      return ReplyError(rid, Status::InvalidArgument("sync FETCH: offset " + std::to_string(m.offset) +
                                                     " beyond the item's " + std::to_string(item.size()) + " bytes"));
    }
    const size_t n = std::min<uint64_t>(m.length, item.size() - m.offset);
    Pace(n);
    Message r;
    r.type = MsgType::kChunk;
    r.version = m.version;
    r.kind = m.kind;
    r.index = m.index;
    r.offset = m.offset;
    r.sequence = sequence_.load();
    r.epoch = epoch_;
    std::span<const std::byte> bytes = item.subspan(m.offset, n);
    std::vector<std::byte> flipped;
    if (corrupt_.load() > 0) {
      corrupt_.fetch_sub(1);
      flipped.assign(bytes.begin(), bytes.end());
      flipped[0] ^= std::byte{0x01};
      bytes = flipped;
    } else {
      // Zero-copy: ZeroMQ sends straight from the mapped store object (a tensor) or the
      // shared text (an aux file). A heap copy of the Tensor keeps the mapping or text alive
      // until ZeroMQ releases the message (the cache may drop its own reference sooner).
      auto* keep = new Tensor(tensor);
      zmq::message_t payload(
          const_cast<std::byte*>(bytes.data()), bytes.size(),
          [](void*, void* hint) { delete static_cast<Tensor*>(hint); }, keep);
      return ReplyOwned(rid, r, std::move(payload));
    }
    Reply(rid, r, bytes);
  }

  // Rate cap (PublisherOptions::max_send_bytes_per_sec): a token bucket holding at most
  // kPaceBurstBytes of credit; sending `n` bytes waits until they are covered.
  void Pace(size_t n) {
    if (options_.max_send_bytes_per_sec == 0) return;
    const double rate = static_cast<double>(options_.max_send_bytes_per_sec);
    const auto now = Clock::now();
    if (pace_last_ == Clock::time_point()) pace_last_ = now;
    pace_tokens_ = std::min(static_cast<double>(kPaceBurstBytes),
                            pace_tokens_ + rate * std::chrono::duration<double>(now - pace_last_).count());
    pace_last_ = now;
    pace_tokens_ -= static_cast<double>(n);
    if (pace_tokens_ < 0) {
      std::this_thread::sleep_for(std::chrono::duration<double>(-pace_tokens_ / rate));
      pace_tokens_ = 0;
      pace_last_ = Clock::now();
    }
  }

  void HandleAck(const zmq::message_t& rid, const Message& m, const std::string& key) {
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

  store::Store* store_;
  PublisherOptions options_;
  const uint64_t epoch_;
  zmq::context_t ctx_;
  std::unique_ptr<ZapAllowList> zap_;  // with CURVE; declared after ctx_ (closed before it)
  zmq::socket_t router_, pub_, control_, caller_, monitor_;
  Endpoints bound_;
  std::thread thread_;
  std::mutex call_mu_;
  std::vector<Published> published_;                                       // thread only
  std::map<std::tuple<store::Digest, ItemKind, uint32_t>, Tensor> cache_;  // thread only
  std::set<store::Digest> verified_;     // store objects already checked against their digest; thread only
  std::map<int, std::string> fd_owner_;  // thread only: connection descriptor -> receiver id
  std::mutex offer_mu_;
  std::vector<std::pair<store::Digest, std::shared_ptr<const Snapshot>>> offered_;  // guarded by offer_mu_
  store::Digest follow_latest_;  // thread only: the run's latest record Follow() saw
  store::Digest follow_tried_;   // thread only: the newest version Follow() tried
  double pace_tokens_ = 0;       // thread only: Pace()'s bucket, in bytes
  Clock::time_point pace_last_;  // thread only: when the bucket was last filled
  std::atomic<uint64_t> sequence_{0};
  std::atomic<int> corrupt_{0};
  mutable std::mutex info_mu_;
  std::map<std::string, Peer> peers_;  // guarded by info_mu_
};

Result<std::unique_ptr<Publisher>> Publisher::Start(store::Store* store, PublisherOptions options) {
  FERRY_RETURN_IF_ERROR(CheckEndpoints(options.endpoints, options.curve.has_value()));
  if (options.curve) {
    if (Status s = CheckCurve(*options.curve, CurveRole::kServer); !s.ok()) return s.WithContext("sync publisher");
  }
  if (options.max_send_bytes_per_sec < 0) {
    return Status::InvalidArgument("sync publisher: max_send_bytes_per_sec must be >= 0");
  }
  if (options.heartbeat_ivl_ms < 0 || options.heartbeat_timeout_ms <= 0) {
    return Status::InvalidArgument("sync publisher: heartbeat_ivl_ms must be >= 0 and heartbeat_timeout_ms > 0");
  }
  auto impl = std::make_unique<Impl>(store, std::move(options));
  FERRY_RETURN_IF_ERROR(impl->Bind());
  FERRY_RETURN_IF_ERROR(impl->PublishFirst());
  impl->StartThread();
  return std::unique_ptr<Publisher>(new Publisher(std::move(impl)));
}

Publisher::Publisher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Publisher::~Publisher() { impl_->Stop(); }
Result<uint64_t> Publisher::Publish(const store::Digest& version) { return impl_->Publish(version); }
std::vector<ReceiverInfo> Publisher::Receivers() const { return impl_->Receivers(); }
Endpoints Publisher::bound_endpoints() const { return impl_->bound(); }
uint64_t Publisher::latest_sequence() const { return impl_->latest_sequence(); }
uint64_t Publisher::epoch() const { return impl_->epoch(); }
void Publisher::Offer(const store::Digest& version, std::shared_ptr<const Snapshot> snapshot) {
  impl_->Offer(version, std::move(snapshot));
}
void Publisher::CorruptNextChunksForTesting(int n) { impl_->Corrupt(n); }

}  // namespace ferry::sync
