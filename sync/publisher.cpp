#include "sync/publisher.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <zmq.hpp>

#include "sync/protocol.h"

namespace ferry::sync {
namespace {

constexpr size_t kMaxPublishedKept = 8;  // versions still served after a newer one is published
constexpr size_t kMaxCachedItems = 4;    // tensors/aux files kept open for chunking

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::span<const std::byte> Bytes(const zmq::message_t& m) {
  return {static_cast<const std::byte*>(m.data()), m.size()};
}

zmq::message_t Frame(std::string_view s) { return zmq::message_t(s.data(), s.size()); }

void SetCommonOptions(zmq::socket_t& s, const PublisherOptions& o) {
  s.set(zmq::sockopt::maxmsgsize, kMaxFrameBytes);
  s.set(zmq::sockopt::linger, 0);
  if (o.heartbeat_ivl_ms > 0) {
    s.set(zmq::sockopt::heartbeat_ivl, o.heartbeat_ivl_ms);
    s.set(zmq::sockopt::heartbeat_timeout, o.heartbeat_timeout_ms);
    s.set(zmq::sockopt::heartbeat_ttl, o.heartbeat_timeout_ms);
  }
  if (o.curve) {
    s.set(zmq::sockopt::curve_server, true);
    s.set(zmq::sockopt::curve_secretkey, o.curve->secret_key);
    s.set(zmq::sockopt::zap_domain, "ferry-sync");
  }
}

}  // namespace

Result<Endpoints> PrivateIpcEndpoints(const std::filesystem::path& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::IOError(dir.string() + ": cannot create endpoint directory: " + ec.message());
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) return Status::IOError(dir.string() + ": cannot stat endpoint directory");
  if (st.st_uid != ::geteuid()) {
    return Status::FailedPrecondition(dir.string() + ": endpoint directory is owned by another user");
  }
  if ((st.st_mode & 0777) != 0700 && ::chmod(dir.c_str(), 0700) != 0) {
    return Status::IOError(dir.string() + ": cannot make endpoint directory private (mode 0700)");
  }
  const std::string base = std::filesystem::absolute(dir).string();
  if (base.size() + sizeof("/requests") > 107) {
    return Status::InvalidArgument(dir.string() + ": path too long for an ipc:// socket (107-byte limit)");
  }
  return Endpoints{"ipc://" + base + "/requests", "ipc://" + base + "/updates"};
}

Status CheckEndpoints(const Endpoints& e, bool curve) {
  for (const std::string* ep : {&e.requests, &e.updates}) {
    if (ep->rfind("ipc://", 0) == 0 || ep->rfind("inproc://", 0) == 0) continue;
    if (ep->rfind("tcp://", 0) == 0) {
      if (!curve) {
        return Status::FailedPrecondition("endpoint " + *ep +
                                          ": tcp:// needs CURVE keys (--key, --allow / --server-key); use ipc:// locally");
      }
      continue;
    }
    return Status::InvalidArgument("endpoint " + *ep + ": only ipc://, tcp:// (with CURVE) and inproc:// are supported");
  }
  return Status::OK();
}

class Publisher::Impl {
 public:
  Impl(store::Store* store, PublisherOptions options) : store_(store), options_(std::move(options)) {}

  Status Bind() {
    try {
      if (options_.curve) {
        for (const auto& k : options_.curve->allowed_keys) {
          std::array<uint8_t, 32> bin{};
          if (k.size() != 40 || zmq_z85_decode(bin.data(), k.c_str()) == nullptr) {
            return Status::InvalidArgument("allow-list key " + k.substr(0, 40) + ": not a Z85 public key");
          }
          allowed_.insert(std::string(reinterpret_cast<const char*>(bin.data()), bin.size()));
        }
        zap_ = zmq::socket_t(ctx_, zmq::socket_type::rep);
        zap_.set(zmq::sockopt::linger, 0);
        zap_.bind("inproc://zeromq.zap.01");
      }
      control_ = zmq::socket_t(ctx_, zmq::socket_type::pair);
      control_.bind("inproc://ferry-publisher-control");
      caller_ = zmq::socket_t(ctx_, zmq::socket_type::pair);
      caller_.connect("inproc://ferry-publisher-control");
      router_ = zmq::socket_t(ctx_, zmq::socket_type::router);
      SetCommonOptions(router_, options_);
      router_.set(zmq::sockopt::router_mandatory, true);
      router_.bind(options_.endpoints.requests);
      pub_ = zmq::socket_t(ctx_, zmq::socket_type::pub);
      SetCommonOptions(pub_, options_);
      pub_.bind(options_.endpoints.updates);
      bound_ = {router_.get(zmq::sockopt::last_endpoint), pub_.get(zmq::sockopt::last_endpoint)};
    } catch (const zmq::error_t& e) {
      return Status::IOError("sync publisher: cannot bind " + options_.endpoints.requests + " / " +
                             options_.endpoints.updates + ": " + e.what());
    }
    return Status::OK();
  }

  void StartThread() { thread_ = std::thread([this] { Loop(); }); }

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
      if (!caller_.recv(reply, zmq::recv_flags::none)) return Status::Internal("sync publisher: no reply from its thread");
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
    for (const auto& [id, info] : receivers_) out.push_back(info);
    return out;
  }
  uint64_t latest_sequence() const { return sequence_.load(); }
  const Endpoints& bound() const { return bound_; }
  void Corrupt(int n) { corrupt_.fetch_add(n); }

 private:
  struct Published {
    store::VersionRecord record;
    uint64_t sequence = 0;
  };

  void Loop() {
    auto next_follow = std::chrono::steady_clock::now();
    for (;;) {
      std::vector<zmq::pollitem_t> items = {{control_.handle(), 0, ZMQ_POLLIN, 0}, {router_.handle(), 0, ZMQ_POLLIN, 0}};
      if (zap_) items.push_back({zap_.handle(), 0, ZMQ_POLLIN, 0});
      int timeout = -1;
      if (options_.follow_run) {
        const auto now = std::chrono::steady_clock::now();
        if (now >= next_follow) {
          Follow();
          next_follow = now + std::chrono::milliseconds(options_.follow_interval_ms);
        }
        timeout = static_cast<int>(
            std::chrono::duration_cast<std::chrono::milliseconds>(next_follow - std::chrono::steady_clock::now()).count());
        if (timeout < 0) timeout = 0;
      }
      try {
        zmq::poll(items.data(), items.size(), std::chrono::milliseconds(timeout));
        if (items.size() > 2 && (items[2].revents & ZMQ_POLLIN)) HandleZap();
        if (items[0].revents & ZMQ_POLLIN) {
          if (!HandleControl()) return;
        }
        if (items[1].revents & ZMQ_POLLIN) HandleRequest();
      } catch (const zmq::error_t& e) {
        if (e.num() == ETERM) return;
        // Any other socket error concerns one peer; keep serving the others.
      }
    }
  }

  void Follow() {
    auto latest = store_->Latest(*options_.follow_run);
    if (!latest.ok() || !latest->has_value()) return;
    if (!published_.empty() && published_.back().record.id == **latest) return;
    (void)DoPublish(**latest);
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

  Result<uint64_t> DoPublish(const store::Digest& v) {
    FERRY_ASSIGN_OR_RETURN(store::VersionRecord rec, store_->GetVersion(v.Hex()));
    if (rec.tensors.empty()) return Status::FailedPrecondition("version " + v.Hex() + " has no tensors to sync");
    const uint64_t seq = sequence_.load() + 1;
    published_.push_back({std::move(rec), seq});
    if (published_.size() > kMaxPublishedKept) published_.erase(published_.begin());
    sequence_.store(seq);
    store::Event e;
    e.type = store::Event::Type::kPublished;
    e.version = v;
    e.detail = "sync sequence " + std::to_string(seq) + " on " + options_.endpoints.requests;
    (void)store_->AddEvent(e);  // history only; serving does not depend on it
    Message a;
    a.type = MsgType::kAnnounce;
    a.sequence = seq;
    a.version = v;
    pub_.send(Frame(EncodeHeader(a)), zmq::send_flags::dontwait);
    return seq;
  }

  void HandleZap() {
    std::vector<zmq::message_t> parts;
    for (;;) {
      zmq::message_t p;
      if (!zap_.recv(p, zmq::recv_flags::dontwait)) break;
      const bool more = p.more();
      parts.push_back(std::move(p));
      if (!more) break;
    }
    if (parts.size() < 6) return;  // not a ZAP request; REP requires a reply only to well-formed ones
    bool ok = parts[5].to_string() == "CURVE" && parts.size() >= 7 && parts[6].size() == 32 &&
              allowed_.count(parts[6].to_string()) > 0;
    const std::array<std::string, 6> reply = {"1.0", parts[1].to_string(), ok ? "200" : "400",
                                              ok ? "OK" : "public key not in the allow-list", "", ""};
    for (size_t i = 0; i < reply.size(); ++i) {
      zap_.send(Frame(reply[i]), i + 1 < reply.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
    }
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
    switch (msg->type) {
      case MsgType::kHello: return HandleHello(rid, *msg);
      case MsgType::kFetch: return HandleFetch(rid, *msg);
      case MsgType::kAck: return HandleAck(rid, *msg);
      default: return ReplyError(rid, Status::Corruption("sync request: a receiver may not send this message type"));
    }
  }

  void Touch(const std::string& id) {
    std::lock_guard lock(info_mu_);
    auto& info = receivers_[id];
    info.id = id;
    info.last_seen_ns = NowNs();
  }

  void HandleHello(const zmq::message_t& rid, const Message& m) {
    Touch(m.payload);
    if (published_.empty()) return ReplyError(rid, Status::NotFound("sync HELLO: nothing published yet"));
    const Published& p = published_.back();
    Message r;
    r.type = MsgType::kManifest;
    r.sequence = p.sequence;
    const std::string json = EncodeManifest(p.record, p.sequence);
    Reply(rid, r, {reinterpret_cast<const std::byte*>(json.data()), json.size()});
  }

  const Published* Find(const store::Digest& v) const {
    for (const auto& p : published_) {
      if (p.record.id == v) return &p;
    }
    return nullptr;
  }

  Result<std::span<const std::byte>> Item(const Published& p, ItemKind kind, uint32_t index) {
    const auto key = std::make_tuple(p.record.id, kind, index);
    if (auto it = cache_.find(key); it != cache_.end()) return std::span<const std::byte>(it->second.first.bytes());
    if (cache_.size() >= kMaxCachedItems) cache_.clear();
    if (kind == ItemKind::kTensor) {
      if (index >= p.record.tensors.size()) {
        return Status::InvalidArgument("sync FETCH: tensor index " + std::to_string(index) + " out of range");
      }
      FERRY_ASSIGN_OR_RETURN(Tensor t, store_->ReadTensor(p.record.tensors[index], /*verify=*/true));
      auto& slot = cache_[key];
      slot.first = std::move(t);
      return std::span<const std::byte>(slot.first.bytes());
    }
    if (index >= p.record.aux.size()) {
      return Status::InvalidArgument("sync FETCH: aux index " + std::to_string(index) + " out of range");
    }
    FERRY_ASSIGN_OR_RETURN(std::string text, store_->ReadAux(p.record.aux[index]));
    auto& slot = cache_[key];
    slot.second = std::move(text);
    FERRY_ASSIGN_OR_RETURN(slot.first, Tensor::Wrap(DType::kU8, {static_cast<int64_t>(slot.second.size())},
                                                    {reinterpret_cast<const std::byte*>(slot.second.data()),
                                                     slot.second.size()}, nullptr));
    return std::span<const std::byte>(slot.first.bytes());
  }

  void HandleFetch(const zmq::message_t& rid, const Message& m) {
    const Published* p = Find(m.version);
    if (p == nullptr) {
      return ReplyError(rid, Status::NotFound("sync FETCH: version " + m.version.Hex() + " is not published here"));
    }
    auto item = Item(*p, m.kind, m.index);
    if (!item.ok()) return ReplyError(rid, item.status());
    if (m.offset >= item->size()) {
      return ReplyError(rid, Status::InvalidArgument("sync FETCH: offset " + std::to_string(m.offset) +
                                                     " beyond the item's " + std::to_string(item->size()) + " bytes"));
    }
    const size_t n = std::min<uint64_t>(m.length, item->size() - m.offset);
    Message r;
    r.type = MsgType::kChunk;
    r.version = m.version;
    r.kind = m.kind;
    r.index = m.index;
    r.offset = m.offset;
    r.sequence = sequence_.load();
    std::span<const std::byte> bytes = item->subspan(m.offset, n);
    std::vector<std::byte> flipped;
    if (corrupt_.load() > 0) {
      corrupt_.fetch_sub(1);
      flipped.assign(bytes.begin(), bytes.end());
      flipped[0] ^= std::byte{0x01};
      bytes = flipped;
    }
    Reply(rid, r, bytes);
  }

  void HandleAck(const zmq::message_t& rid, const Message& m) {
    Touch(m.payload);
    const Published* p = Find(m.version);
    store::Event e;
    e.type = store::Event::Type::kAcknowledged;
    e.receiver = m.payload;
    e.version = m.version;
    e.computed = m.computed;
    e.detail = m.computed == m.version ? "receiver verified the manifest digest"
                                       : "MISMATCH: receiver computed " + m.computed.Hex();
    Status st = store_->AddEvent(e);
    if (!st.ok()) return ReplyError(rid, st);
    {
      std::lock_guard lock(info_mu_);
      auto& info = receivers_[m.payload];
      info.acknowledged = m.version;
      info.acknowledged_sequence = p ? p->sequence : 0;
    }
    Message r;
    r.type = MsgType::kAcked;
    r.version = m.version;
    Reply(rid, r, {});
  }

  store::Store* store_;
  PublisherOptions options_;
  zmq::context_t ctx_;
  zmq::socket_t router_, pub_, zap_, control_, caller_;
  Endpoints bound_;
  std::set<std::string> allowed_;  // binary 32-byte public keys
  std::thread thread_;
  std::mutex call_mu_;
  std::vector<Published> published_;  // thread only
  std::map<std::tuple<store::Digest, ItemKind, uint32_t>, std::pair<Tensor, std::string>> cache_;  // thread only
  std::atomic<uint64_t> sequence_{0};
  std::atomic<int> corrupt_{0};
  mutable std::mutex info_mu_;
  std::map<std::string, ReceiverInfo> receivers_;
};

Result<std::unique_ptr<Publisher>> Publisher::Start(store::Store* store, PublisherOptions options) {
  FERRY_RETURN_IF_ERROR(CheckEndpoints(options.endpoints, options.curve.has_value()));
  if (options.curve && (options.curve->secret_key.size() != 40 || options.curve->public_key.size() != 40)) {
    return Status::InvalidArgument("sync publisher: CURVE keypair must be two 40-character Z85 keys");
  }
  auto impl = std::make_unique<Impl>(store, std::move(options));
  FERRY_RETURN_IF_ERROR(impl->Bind());
  impl->StartThread();
  return std::unique_ptr<Publisher>(new Publisher(std::move(impl)));
}

Publisher::Publisher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Publisher::~Publisher() { impl_->Stop(); }
Result<uint64_t> Publisher::Publish(const store::Digest& version) { return impl_->Publish(version); }
std::vector<ReceiverInfo> Publisher::Receivers() const { return impl_->Receivers(); }
Endpoints Publisher::bound_endpoints() const { return impl_->bound(); }
uint64_t Publisher::latest_sequence() const { return impl_->latest_sequence(); }
void Publisher::CorruptNextChunksForTesting(int n) { impl_->Corrupt(n); }

}  // namespace ferry::sync
