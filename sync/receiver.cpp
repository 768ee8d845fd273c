#include "sync/receiver.h"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <vector>

#include <zmq.hpp>

#include "core/safetensors.h"
#include "sync/protocol.h"

namespace ferry::sync {
namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

std::span<const std::byte> Bytes(const zmq::message_t& m) {
  return {static_cast<const std::byte*>(m.data()), m.size()};
}
zmq::message_t Frame(std::string_view s) { return zmq::message_t(s.data(), s.size()); }

Status FsyncDir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Status::IOError(dir.string() + ": cannot open directory to fsync: " + std::strerror(errno));
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return Status::IOError(dir.string() + ": fsync failed: " + std::strerror(errno));
  return Status::OK();
}

Status WriteNewFile(const fs::path& path, std::span<const std::byte> bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IOError(path.string() + ": cannot create: " + std::strerror(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n <= 0) {
      ::close(fd);
      return Status::IOError(path.string() + ": write failed: " + std::strerror(errno));
    }
    done += static_cast<size_t>(n);
  }
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return Status::IOError(path.string() + ": fsync failed: " + std::strerror(errno));
  return Status::OK();
}

// Removes a temporary version directory unless released.
class TempDirGuard {
 public:
  explicit TempDirGuard(fs::path p) : path_(std::move(p)) {}
  ~TempDirGuard() {
    if (!path_.empty()) {
      std::error_code ec;
      fs::remove_all(path_, ec);
    }
  }
  void Release() { path_.clear(); }

 private:
  fs::path path_;
};

}  // namespace

struct Receiver::Sockets {
  zmq::context_t ctx;
  zmq::socket_t dealer{ctx, zmq::socket_type::dealer};
  zmq::socket_t sub{ctx, zmq::socket_type::sub};
};

// One thing that arrived: an announcement or a reply. `msg.bytes` views `payload`.
struct Incoming {
  bool announce = false;
  Message msg;
  zmq::message_t header, payload;
};

namespace {

enum class Outcome { kDone, kNewer };

class Session {
 public:
  Session(const ReceiverOptions& o, zmq::socket_t& dealer, zmq::socket_t& sub, uint64_t sequence)
      : o_(o), dealer_(dealer), sub_(sub), sequence_(sequence) {}

  Status Send(const Message& m, std::span<const std::byte> payload) {
    try {
      const bool has = HasPayload(m.type);
      dealer_.send(Frame(EncodeHeader(m)), has ? zmq::send_flags::sndmore : zmq::send_flags::none);
      if (has) dealer_.send(zmq::message_t(payload.data(), payload.size()), zmq::send_flags::none);
    } catch (const zmq::error_t& e) {
      return Status::IOError("sync receiver " + o_.id + ": cannot send to " + o_.endpoints.requests + ": " + e.what());
    }
    return Status::OK();
  }
  Status SendWithId(MsgType type, const Message& base) {
    Message m = base;
    m.type = type;
    return Send(m, {reinterpret_cast<const std::byte*>(o_.id.data()), o_.id.size()});
  }

  // Waits (until `deadline`) for the next announcement or reply.
  Status Next(Clock::time_point deadline, Incoming* in) {
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) {
        return Status::IOError("sync receiver " + o_.id + ": no reply from " + o_.endpoints.requests + " within " +
                               std::to_string(o_.timeout_ms) + " ms");
      }
      zmq::pollitem_t items[] = {{dealer_.handle(), 0, ZMQ_POLLIN, 0}, {sub_.handle(), 0, ZMQ_POLLIN, 0}};
      try {
        zmq::poll(items, 2, std::chrono::milliseconds(left));
        if (items[1].revents & ZMQ_POLLIN) {
          zmq::message_t m;
          bool more = false;
          if (sub_.recv(m, zmq::recv_flags::dontwait)) {
            more = m.more();
            while (more) {  // drain a malformed multipart announcement
              zmq::message_t extra;
              if (!sub_.recv(extra, zmq::recv_flags::dontwait)) break;
              more = extra.more();
            }
            auto a = Decode(Bytes(m), nullptr);
            if (a.ok() && a->type == MsgType::kAnnounce) {
              in->announce = true;
              in->msg = *a;
              return Status::OK();
            }
          }
        }
        if (items[0].revents & ZMQ_POLLIN) {
          std::vector<zmq::message_t> parts;
          for (;;) {
            zmq::message_t p;
            if (!dealer_.recv(p, zmq::recv_flags::dontwait)) break;
            const bool more = p.more();
            if (parts.size() < 3) parts.push_back(std::move(p));
            if (!more) break;
          }
          if (parts.empty()) continue;
          if (parts.size() > 2) {
            return Status::Corruption("sync receiver " + o_.id + ": reply from " + o_.endpoints.requests +
                                      " has more than 2 frames");
          }
          in->announce = false;
          in->header = std::move(parts[0]);
          if (parts.size() == 2) in->payload = std::move(parts[1]);
          const std::span<const std::byte> payload = Bytes(in->payload);
          auto m = Decode(Bytes(in->header), parts.size() == 2 ? &payload : nullptr);
          if (!m.ok()) {
            return Status::Corruption("sync receiver " + o_.id + ": from " + o_.endpoints.requests + ": " +
                                      m.status().message());
          }
          in->msg = std::move(*m);
          return Status::OK();
        }
      } catch (const zmq::error_t& e) {
        return Status::IOError("sync receiver " + o_.id + ": " + o_.endpoints.requests + ": " + e.what());
      }
    }
  }

  Status PublisherError(const Message& m) const {
    const uint32_t c = (m.code > 0 && m.code <= static_cast<uint32_t>(StatusCode::kInternal)) ? m.code
                                                                               : static_cast<uint32_t>(StatusCode::kInternal);
    return Status(static_cast<StatusCode>(c), "publisher " + o_.endpoints.requests + ": " + m.payload);
  }

  Clock::time_point Deadline() const { return Clock::now() + std::chrono::milliseconds(o_.timeout_ms); }

  // Sends HELLO and waits for the MANIFEST.
  Result<Manifest> Hello() {
    FERRY_RETURN_IF_ERROR(SendWithId(MsgType::kHello, {}));
    const auto deadline = Deadline();
    for (;;) {
      Incoming in;
      FERRY_RETURN_IF_ERROR(Next(deadline, &in));
      if (in.announce) continue;  // we are asking for the latest anyway
      if (in.msg.type == MsgType::kError) return PublisherError(in.msg);
      if (in.msg.type != MsgType::kManifest) continue;  // stale reply to an abandoned request
      auto m = DecodeManifest(in.msg.payload);
      if (!m.ok()) return Status::Corruption("from " + o_.endpoints.requests + ": " + m.status().message());
      if (m->sequence != in.msg.sequence) {
        return Status::Corruption("sync MANIFEST from " + o_.endpoints.requests + ": header and JSON sequence differ");
      }
      if (m->tensors.empty()) return Status::Corruption("sync MANIFEST from " + o_.endpoints.requests + ": no tensors");
      return *m;
    }
  }

  // Fetches one item into `out` (sized by the caller) with at most `credit` FETCHes in flight.
  Result<Outcome> Fetch(const Manifest& man, ItemKind kind, uint32_t index, std::span<std::byte> out) {
    const uint64_t size = out.size();
    uint64_t next = 0, received = 0;
    uint32_t in_flight = 0;
    auto deadline = Deadline();
    while (received < size) {
      while (in_flight < o_.credit && next < size) {
        Message f;
        f.type = MsgType::kFetch;
        f.version = man.version;
        f.kind = kind;
        f.index = index;
        f.offset = next;
        f.length = static_cast<uint32_t>(std::min<uint64_t>(o_.chunk_bytes, size - next));
        FERRY_RETURN_IF_ERROR(Send(f, {}));
        next += f.length;
        ++in_flight;
      }
      Incoming in;
      FERRY_RETURN_IF_ERROR(Next(deadline, &in));
      if (in.announce) {
        if (in.msg.sequence > man.sequence) return Outcome::kNewer;
        continue;
      }
      if (in.msg.type == MsgType::kError) return PublisherError(in.msg);
      if (in.msg.type != MsgType::kChunk || !(in.msg.version == man.version) || in.msg.kind != kind ||
          in.msg.index != index || in.msg.offset != received) {
        continue;  // stale
      }
      const uint64_t expect = std::min<uint64_t>(o_.chunk_bytes, size - received);
      const auto bytes = Bytes(in.payload);
      if (bytes.size() != expect) {
        return Status::Corruption("sync CHUNK from " + o_.endpoints.requests + ": " + std::to_string(bytes.size()) +
                                  " bytes at offset " + std::to_string(received) + ", expected " + std::to_string(expect));
      }
      std::memcpy(out.data() + received, bytes.data(), bytes.size());
      received += bytes.size();
      bytes_received_ += bytes.size();
      --in_flight;
      deadline = Deadline();
      if (o_.on_chunk_for_testing) o_.on_chunk_for_testing(in.msg.offset);
      if (in.msg.sequence > man.sequence) return Outcome::kNewer;
    }
    return Outcome::kDone;
  }

  // Receives `man` into DIR/versions/<id> (verified). Returns kNewer when abandoned.
  Result<Outcome> Receive(const Manifest& man, int* refetches) {
    const fs::path versions = o_.dir / "versions";
    const fs::path final_dir = versions / man.version.Hex();
    std::error_code ec;
    if (fs::is_directory(final_dir, ec)) return Outcome::kDone;  // verified by an earlier sync
    std::string tmpl = (versions / (man.version.Hex() + ".tmp-XXXXXX")).string();
    if (::mkdtemp(tmpl.data()) == nullptr) {
      return Status::IOError(tmpl + ": cannot create temporary version directory: " + std::strerror(errno));
    }
    const fs::path tmp = tmpl;
    TempDirGuard guard(tmp);
    std::vector<TensorSpec> specs;
    for (const auto& t : man.tensors) specs.push_back({t.name, t.dtype, t.shape});
    FERRY_ASSIGN_OR_RETURN(auto writer, SafetensorsWriter::CreateFile(tmp / "model.safetensors", specs));
    std::vector<std::byte> buf;
    for (uint32_t i = 0; i < man.tensors.size(); ++i) {
      const auto& row = man.tensors[i];
      buf.resize(row.nbytes);
      for (int attempt = 0;; ++attempt) {
        if (row.nbytes > 0) {
          FERRY_ASSIGN_OR_RETURN(Outcome oc, Fetch(man, ItemKind::kTensor, i, buf));
          if (oc == Outcome::kNewer) return oc;
        }
        if (store::TensorDigest(row.dtype, row.shape, buf) == row.digest) break;
        if (attempt >= o_.max_retries) {
          return Status::Corruption("sync: tensor " + row.name + " of version " + man.version.Hex() +
                                    " still fails its digest after " + std::to_string(o_.max_retries) + " refetches");
        }
        ++*refetches;
      }
      FERRY_RETURN_IF_ERROR(writer->Append(buf));
    }
    FERRY_RETURN_IF_ERROR(writer->Finish());
    for (uint32_t i = 0; i < man.aux.size(); ++i) {
      buf.resize(man.aux[i].size);
      if (!buf.empty()) {
        FERRY_ASSIGN_OR_RETURN(Outcome oc, Fetch(man, ItemKind::kAux, i, buf));
        if (oc == Outcome::kNewer) return oc;
      }
      FERRY_RETURN_IF_ERROR(WriteNewFile(tmp / man.aux[i].name, buf));
    }
    FERRY_ASSIGN_OR_RETURN(store::VersionRecord rec, store::HashPath(tmp));
    if (!(rec.id == man.version)) {
      return Status::Corruption("sync: received files of version " + man.version.Hex() + " hash to " + rec.id.Hex() +
                                " (an aux file or the manifest is corrupt)");
    }
    FERRY_RETURN_IF_ERROR(FsyncDir(tmp));
    if (::rename(tmp.c_str(), final_dir.c_str()) != 0) {
      if (!fs::is_directory(final_dir, ec)) {
        return Status::IOError(final_dir.string() + ": cannot rename the received version into place: " +
                               std::strerror(errno));
      }
    } else {
      guard.Release();
    }
    FERRY_RETURN_IF_ERROR(FsyncDir(versions));
    return Outcome::kDone;
  }

  Status Activate(const store::Digest& v) {
    const fs::path link = o_.dir / (".current.tmp-" + std::to_string(::getpid()));
    ::unlink(link.c_str());
    const std::string target = "versions/" + v.Hex();
    if (::symlink(target.c_str(), link.c_str()) != 0) {
      return Status::IOError(link.string() + ": cannot create symlink: " + std::strerror(errno));
    }
    const fs::path current = o_.dir / "current";
    if (::rename(link.c_str(), current.c_str()) != 0) {
      const int err = errno;
      ::unlink(link.c_str());
      return Status::IOError(current.string() + ": cannot switch the active version: " + std::strerror(err));
    }
    return FsyncDir(o_.dir);
  }

  Status Ack(const store::Digest& v, const store::Digest& computed) {
    Message m;
    m.version = v;
    m.computed = computed;
    FERRY_RETURN_IF_ERROR(SendWithId(MsgType::kAck, m));
    const auto deadline = Deadline();
    for (;;) {
      Incoming in;
      FERRY_RETURN_IF_ERROR(Next(deadline, &in));
      if (in.announce) continue;
      if (in.msg.type == MsgType::kError) return PublisherError(in.msg);
      if (in.msg.type == MsgType::kAcked && in.msg.version == v) return Status::OK();
    }
  }

  uint64_t bytes_received() const { return bytes_received_; }

 private:
  const ReceiverOptions& o_;
  zmq::socket_t& dealer_;
  zmq::socket_t& sub_;
  uint64_t sequence_;
  uint64_t bytes_received_ = 0;
};

}  // namespace

Result<std::optional<store::Digest>> ActiveVersion(const fs::path& dir) {
  std::error_code ec;
  const fs::path current = dir / "current";
  if (!fs::is_symlink(fs::symlink_status(current, ec))) return std::optional<store::Digest>();
  const fs::path target = fs::read_symlink(current, ec);
  if (ec || target.parent_path() != "versions") {
    return Status::Corruption(current.string() + ": not a link to versions/<id>");
  }
  auto d = store::Digest::FromHex(target.filename().string());
  if (!d.ok()) return Status::Corruption(current.string() + ": link target " + target.string() + " is not a version id");
  return std::optional<store::Digest>(*d);
}

Receiver::Receiver(ReceiverOptions options) : options_(std::move(options)) {}
Receiver::~Receiver() = default;

Result<std::unique_ptr<Receiver>> Receiver::Connect(ReceiverOptions o) {
  if (!IsValidReceiverId(o.id)) return Status::InvalidArgument("sync receiver: id \"" + o.id + "\" is not [A-Za-z0-9._-]{1,64}");
  if (o.chunk_bytes == 0 || o.chunk_bytes > kMaxChunkBytes) {
    return Status::InvalidArgument("sync receiver: chunk_bytes must be 1.." + std::to_string(kMaxChunkBytes));
  }
  if (o.credit == 0 || o.credit > 1024) return Status::InvalidArgument("sync receiver: credit must be 1..1024");
  if (o.timeout_ms <= 0) return Status::InvalidArgument("sync receiver: timeout_ms must be positive");
  if (o.max_retries < 0) return Status::InvalidArgument("sync receiver: max_retries must be >= 0");
  FERRY_RETURN_IF_ERROR(CheckEndpoints(o.endpoints, o.curve.has_value()));
  std::error_code ec;
  fs::create_directories(o.dir / "versions", ec);
  if (ec) return Status::IOError((o.dir / "versions").string() + ": cannot create: " + ec.message());
  FERRY_ASSIGN_OR_RETURN(auto active, ActiveVersion(o.dir));
  std::unique_ptr<Receiver> r(new Receiver(std::move(o)));
  r->active_ = active;
  r->sockets_ = std::make_unique<Sockets>();
  const ReceiverOptions& opt = r->options_;
  try {
    for (zmq::socket_t* s : {&r->sockets_->dealer, &r->sockets_->sub}) {
      s->set(zmq::sockopt::maxmsgsize, kMaxFrameBytes);
      s->set(zmq::sockopt::linger, 0);
      if (opt.heartbeat_ivl_ms > 0) {
        s->set(zmq::sockopt::heartbeat_ivl, opt.heartbeat_ivl_ms);
        s->set(zmq::sockopt::heartbeat_timeout, opt.heartbeat_ivl_ms * 5);
      }
      if (opt.curve) {
        s->set(zmq::sockopt::curve_serverkey, opt.curve->server_public_key);
        s->set(zmq::sockopt::curve_publickey, opt.curve->public_key);
        s->set(zmq::sockopt::curve_secretkey, opt.curve->secret_key);
      }
    }
    std::string topic(kMagic);
    topic.push_back(static_cast<char>(MsgType::kAnnounce));
    r->sockets_->sub.set(zmq::sockopt::subscribe, topic);
    r->sockets_->sub.connect(opt.endpoints.updates);  // subscribe first (clone pattern)
    r->sockets_->dealer.connect(opt.endpoints.requests);
  } catch (const zmq::error_t& e) {
    return Status::InvalidArgument("sync receiver " + opt.id + ": cannot connect to " + opt.endpoints.requests + " / " +
                                   opt.endpoints.updates + ": " + e.what());
  }
  return r;
}

Result<SyncResult> Receiver::SyncLatest() {
  Session s(options_, sockets_->dealer, sockets_->sub, sequence_);
  SyncResult result;
  for (int round = 0; round < 64; ++round) {
    FERRY_ASSIGN_OR_RETURN(Manifest man, s.Hello());
    result.version = man.version;
    result.sequence = man.sequence;
    if (active_ && *active_ == man.version) {
      result.already_active = true;
    } else {
      FERRY_ASSIGN_OR_RETURN(Outcome oc, s.Receive(man, &result.refetches));
      if (oc == Outcome::kNewer) {
        ++result.skipped;
        continue;
      }
      FERRY_RETURN_IF_ERROR(s.Activate(man.version));
      active_ = man.version;
    }
    sequence_ = man.sequence;
    result.computed = man.version;  // Receive() checked HashPath(files) == version
    result.bytes_received = s.bytes_received();
    FERRY_RETURN_IF_ERROR(s.Ack(man.version, result.computed));
    return result;
  }
  return Status::IOError("sync receiver " + options_.id + ": versions kept changing mid-transfer (64 skips)");
}

Result<SyncResult> Receiver::WaitForNewer(int timeout_ms) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return Status::NotFound("sync receiver " + options_.id + ": no newer version announced within " +
                                           std::to_string(timeout_ms) + " ms");
    zmq::pollitem_t item = {sockets_->sub.handle(), 0, ZMQ_POLLIN, 0};
    try {
      zmq::poll(&item, 1, std::chrono::milliseconds(left));
      if (!(item.revents & ZMQ_POLLIN)) continue;
      zmq::message_t m;
      if (!sockets_->sub.recv(m, zmq::recv_flags::dontwait)) continue;
      auto a = Decode(Bytes(m), nullptr);
      if (a.ok() && a->type == MsgType::kAnnounce && a->sequence > sequence_) return SyncLatest();
    } catch (const zmq::error_t& e) {
      return Status::IOError("sync receiver " + options_.id + ": " + options_.endpoints.updates + ": " + e.what());
    }
  }
}

}  // namespace ferry::sync
