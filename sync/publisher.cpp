// The sync publisher (sync/publisher.h): Start (options checked, sockets bound, the serving
// thread started), the thread's loop (control channel, connection events, requests, the
// periodic tick), requests dispatched by type, replies and announcements sent. Serving and
// pacing are in publisher_serve.cpp, acknowledgements and liveness in publisher_acks.cpp
// (sync/publisher_internal.h).
#include "sync/publisher.h"

#include <algorithm>
#include <cstring>
#include <random>

#include "sync/protocol.h"
#include "sync/publisher_internal.h"
#include "sync/snapshot.h"

namespace ferry::sync {
namespace {

using publisher_internal::Frame;

constexpr std::string_view kZapDomain = "ferry-sync";

std::span<const std::byte> Bytes(const zmq::message_t& m) {
  return {static_cast<const std::byte*>(m.data()), m.size()};
}

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

Publisher::Impl::Impl(store::Store* store, PublisherOptions options)
    : store_(store), options_(std::move(options)), epoch_(RandomEpoch()) {}

Status Publisher::Impl::Bind() {
  try {
    if (options_.curve) {
      FERRY_ASSIGN_OR_RETURN(zap_,
                             ZapAllowList::Bind(ctx_.handle(), options_.curve->allowed_keys, options_.on_rejected_key));
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

void Publisher::Impl::StartThread() {
  thread_ = std::thread([this] { Loop(); });
}

void Publisher::Impl::Stop() {
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

Result<uint64_t> Publisher::Impl::Publish(const store::Digest& v) {
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

void Publisher::Impl::Loop() {
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

bool Publisher::Impl::HandleControl() {
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

void Publisher::Impl::HandleRequest() {
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
    case MsgType::kEngine: return HandleEngine(rid, *msg, key, fd);
    default: return ReplyError(rid, Status::Corruption("sync request: a receiver may not send this message type"));
  }
}

void Publisher::Impl::Reply(const zmq::message_t& rid, const Message& m, std::span<const std::byte> payload) {
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

void Publisher::Impl::ReplyOwned(const zmq::message_t& rid, const Message& m, zmq::message_t payload) {
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

void Publisher::Impl::ReplyError(const zmq::message_t& rid, const Status& st) {
  Message m;
  m.type = MsgType::kError;
  m.code = static_cast<uint32_t>(st.code());
  const std::string& text = st.message();
  Reply(rid, m, {reinterpret_cast<const std::byte*>(text.data()), text.size()});
}

void Publisher::Impl::Announce() {
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
    // The beacon repeats it.
  }
}

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
