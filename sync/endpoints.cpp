// Endpoint policy and socket security (sync/endpoints.h).
#include "sync/endpoints.h"

#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <charconv>
#include <set>
#include <zmq.hpp>

#include "sync/keys.h"

namespace ferry::sync {
namespace {

namespace fs = std::filesystem;

// sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
constexpr size_t kMaxUnixPathBytes = 107;

// Refused client keys a ZapAllowList remembers having reported.
constexpr size_t kMaxReportedKeys = 4096;

zmq::message_t Frame(std::string_view s) { return zmq::message_t(s.data(), s.size()); }

Status CheckKey(std::string_view key, std::string_view field) {
  if (IsZ85Key(key)) return Status::OK();
  return Status::InvalidArgument("CURVE " + std::string(field) + ": not a 40-character Z85 key");
}

Status SetCurveOption(void* socket, int option, const std::string& value, std::string_view what) {
  if (zmq_setsockopt(socket, option, value.data(), value.size()) != 0) {
    return Status::InvalidArgument("CURVE " + std::string(what) + ": " + zmq_strerror(zmq_errno()));
  }
  return Status::OK();
}

// `s` with `name` in front (nothing when `name` is empty).
Status Named(const Status& s, const std::string& name) { return name.empty() ? s : s.WithContext(name); }

// Reads the keypair PREFIX.key (secret) and PREFIX.pub into `c`; errors named `name`.
Status ReadKeyPair(const fs::path& prefix, const std::string& name, CurveOptions& c) {
  if (prefix.empty()) return Status::InvalidArgument("CURVE: no keypair prefix given");
  auto secret = ReadSecretKey(prefix.string() + ".key");
  if (!secret.ok()) return Named(secret.status(), name);
  auto pub = ReadPublicKey(prefix.string() + ".pub");
  if (!pub.ok()) return Named(pub.status(), name);
  c.secret_key = std::move(*secret);
  c.public_key = std::move(*pub);
  return Status::OK();
}

}  // namespace

Status MakePrivateDirectory(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::IOError(dir.string() + ": cannot create endpoint directory: " + ec.message());
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) return Status::IOError(dir.string() + ": cannot stat endpoint directory");
  if (st.st_uid != ::geteuid()) {
    return Status::FailedPrecondition(dir.string() + ": endpoint directory is owned by another user");
  }
  if ((st.st_mode & 0777) != 0700 && ::chmod(dir.c_str(), 0700) != 0) {
    return Status::IOError(dir.string() + ": cannot make endpoint directory private (mode 0700)");
  }
  return Status::OK();
}

Result<std::string> PrivateIpcEndpoint(const fs::path& dir, std::string_view name) {
  if (name.empty() || name.find('/') != std::string_view::npos || name == "." || name == "..") {
    return Status::InvalidArgument("ipc socket name \"" + std::string(name) + "\" is not a plain file name");
  }
  FERRY_RETURN_IF_ERROR(MakePrivateDirectory(dir));
  const std::string path = (fs::absolute(dir) / name).string();
  if (path.size() > kMaxUnixPathBytes) {
    return Status::InvalidArgument(dir.string() + ": path too long for an ipc:// socket (107-byte limit)");
  }
  return "ipc://" + path;
}

Result<Endpoints> PrivateIpcEndpoints(const fs::path& dir) {
  Endpoints e;
  FERRY_ASSIGN_OR_RETURN(e.requests, PrivateIpcEndpoint(dir, "requests"));
  FERRY_ASSIGN_OR_RETURN(e.updates, PrivateIpcEndpoint(dir, "updates"));
  return e;
}

Result<Endpoints> ParseSyncEndpoint(std::string_view value) {
  constexpr std::string_view kIpc = "ipc://", kTcp = "tcp://";
  const std::string shown(value);
  if (value.starts_with(kIpc)) {
    const std::string dir(value.substr(kIpc.size()));
    if (dir.empty()) return Status::InvalidArgument(shown + ": ipc:// needs a directory (ipc://DIR)");
    auto e = PrivateIpcEndpoints(dir);
    if (!e.ok()) return e.status().WithContext(shown);
    return *e;
  }
  if (value.starts_with(kTcp)) {
    const std::string_view hostport = value.substr(kTcp.size());
    const size_t colon = hostport.rfind(':');
    if (colon == std::string_view::npos || colon == 0) {
      return Status::InvalidArgument(shown + ": expected tcp://HOST:PORT");
    }
    const std::string_view host = hostport.substr(0, colon), port_text = hostport.substr(colon + 1);
    unsigned port = 0;
    auto [ptr, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
    if (ec != std::errc() || ptr != port_text.data() + port_text.size() || port == 0 || port > 65534) {
      return Status::InvalidArgument(shown + ": PORT must be 1..65534 (announcements use PORT+1)");
    }
    const std::string prefix = "tcp://" + std::string(host) + ":";
    return Endpoints{prefix + std::to_string(port), prefix + std::to_string(port + 1)};
  }
  return Status::InvalidArgument(shown + ": unsupported endpoint (expected ipc://DIR or tcp://HOST:PORT)");
}

Status CheckEndpoint(std::string_view ep, bool curve) {
  if (ep.starts_with("ipc://") || ep.starts_with("inproc://")) return Status::OK();
  if (ep.starts_with("tcp://")) {
    if (curve) return Status::OK();
    return Status::FailedPrecondition("endpoint " + std::string(ep) +
                                      ": tcp:// needs CURVE keys (the options' curve); use ipc:// locally");
  }
  return Status::InvalidArgument("endpoint " + std::string(ep) +
                                 ": only ipc://, tcp:// (with CURVE) and inproc:// are supported");
}

Status CheckEndpoints(const Endpoints& e, bool curve) {
  FERRY_RETURN_IF_ERROR(CheckEndpoint(e.requests, curve));
  return CheckEndpoint(e.updates, curve);
}

Status CheckCurve(const CurveOptions& c, CurveRole role) {
  FERRY_RETURN_IF_ERROR(CheckKey(c.public_key, "public_key"));
  FERRY_RETURN_IF_ERROR(CheckKey(c.secret_key, "secret_key"));
  if (role == CurveRole::kClient) return CheckKey(c.server_public_key, "server_public_key");
  for (const std::string& k : c.allowed_keys) {
    if (!IsZ85Key(k)) return Status::InvalidArgument("allow-list key " + k.substr(0, 40) + ": not a Z85 public key");
  }
  return Status::OK();
}

Result<CurveOptions> LoadServerCurve(const fs::path& key_prefix, const fs::path& allow_file,
                                     const CurveFileNames& names) {
  if (allow_file.empty()) {
    return Status::InvalidArgument("a CURVE server needs an allow-list (without one any client key would be accepted)");
  }
  CurveOptions c;
  FERRY_RETURN_IF_ERROR(ReadKeyPair(key_prefix, names.key, c));
  auto allowed = ReadAllowList(allow_file);
  if (!allowed.ok()) return Named(allowed.status(), names.peer);
  c.allowed_keys = std::move(*allowed);
  FERRY_RETURN_IF_ERROR(CheckCurve(c, CurveRole::kServer));
  return c;
}

Result<CurveOptions> LoadClientCurve(const fs::path& key_prefix, const fs::path& server_key_file,
                                     const CurveFileNames& names) {
  if (server_key_file.empty()) return Status::InvalidArgument("a CURVE client needs the server's public key file");
  CurveOptions c;
  FERRY_RETURN_IF_ERROR(ReadKeyPair(key_prefix, names.key, c));
  auto server = ReadPublicKey(server_key_file);
  if (!server.ok()) return Named(server.status(), names.peer);
  c.server_public_key = std::move(*server);
  FERRY_RETURN_IF_ERROR(CheckCurve(c, CurveRole::kClient));
  return c;
}

Status SecureServerSocket(void* socket, const CurveOptions& curve, std::string_view zap_domain) {
  const int on = 1;
  if (zmq_setsockopt(socket, ZMQ_CURVE_SERVER, &on, sizeof(on)) != 0) {
    return Status::InvalidArgument(std::string("CURVE server: ") + zmq_strerror(zmq_errno()));
  }
  FERRY_RETURN_IF_ERROR(SetCurveOption(socket, ZMQ_CURVE_SECRETKEY, curve.secret_key, "secret_key"));
  return SetCurveOption(socket, ZMQ_ZAP_DOMAIN, std::string(zap_domain), "ZAP domain");
}

Status SecureClientSocket(void* socket, const CurveOptions& curve) {
  FERRY_RETURN_IF_ERROR(SetCurveOption(socket, ZMQ_CURVE_SERVERKEY, curve.server_public_key, "server_public_key"));
  FERRY_RETURN_IF_ERROR(SetCurveOption(socket, ZMQ_CURVE_PUBLICKEY, curve.public_key, "public_key"));
  return SetCurveOption(socket, ZMQ_CURVE_SECRETKEY, curve.secret_key, "secret_key");
}

struct ZapAllowList::Impl {
  void* handle = nullptr;         // a libzmq REP socket (zmq_socket), closed with the Impl
  std::set<std::string> allowed;  // binary 32-byte public keys
  RejectedKeyFn on_rejected;
  std::set<std::string> reported;  // binary keys already passed to on_rejected
  ~Impl() {
    if (handle != nullptr) zmq_close(handle);
  }
};

ZapAllowList::ZapAllowList(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ZapAllowList::~ZapAllowList() = default;

Result<std::unique_ptr<ZapAllowList>> ZapAllowList::Bind(void* context, const std::vector<std::string>& allowed_keys,
                                                         RejectedKeyFn on_rejected) {
  auto impl = std::make_unique<Impl>();
  impl->on_rejected = std::move(on_rejected);
  for (const auto& k : allowed_keys) {
    std::array<uint8_t, 32> bin{};
    if (k.size() != 40 || zmq_z85_decode(bin.data(), k.c_str()) == nullptr) {
      return Status::InvalidArgument("allow-list key " + k.substr(0, 40) + ": not a Z85 public key");
    }
    impl->allowed.insert(std::string(reinterpret_cast<const char*>(bin.data()), bin.size()));
  }
  impl->handle = zmq_socket(context, ZMQ_REP);
  const int linger = 0;
  if (impl->handle == nullptr || zmq_setsockopt(impl->handle, ZMQ_LINGER, &linger, sizeof(linger)) != 0 ||
      zmq_bind(impl->handle, "inproc://zeromq.zap.01") != 0) {
    return Status::IOError(std::string("ZAP handler: cannot bind inproc://zeromq.zap.01: ") +
                           zmq_strerror(zmq_errno()));
  }
  return std::unique_ptr<ZapAllowList>(new ZapAllowList(std::move(impl)));
}

void* ZapAllowList::socket() const { return impl_->handle; }

void ZapAllowList::HandlePending() {
  zmq::socket_ref zap(zmq::from_handle, impl_->handle);
  for (;;) {
    std::vector<zmq::message_t> parts;
    try {
      for (;;) {
        zmq::message_t p;
        if (!zap.recv(p, zmq::recv_flags::dontwait)) break;
        const bool more = p.more();
        parts.push_back(std::move(p));
        if (!more) break;
      }
    } catch (const zmq::error_t&) {
      return;
    }
    if (parts.empty()) return;
    // Frames: version, request id, domain, address, identity, mechanism, credentials...
    if (parts.size() < 6) continue;  // not a ZAP request; REP requires a reply only to well-formed ones
    const bool curve = parts[5].to_string() == "CURVE" && parts.size() >= 7 && parts[6].size() == 32;
    bool ok = curve && impl_->allowed.count(parts[6].to_string()) > 0;
    // User-Id: the client's key in Z85, readable from every message of the connection.
    char z85[41] = {};
    const bool encoded = curve && zmq_z85_encode(z85, static_cast<const uint8_t*>(parts[6].data()), 32) != nullptr;
    if (!encoded) ok = false;
    if (!ok && encoded && impl_->on_rejected) {
      // Bounded: a flood of distinct keys is forgotten (and may be reported again) past this.
      if (impl_->reported.size() >= kMaxReportedKeys) impl_->reported.clear();
      if (impl_->reported.insert(parts[6].to_string()).second) impl_->on_rejected(z85);
    }
    const std::array<std::string, 6> reply = {
        "1.0", parts[1].to_string(), ok ? "200" : "400", ok ? "OK" : "public key not in the allow-list", ok ? z85 : "",
        ""};
    try {
      for (size_t i = 0; i < reply.size(); ++i) {
        zap.send(Frame(reply[i]), i + 1 < reply.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
      }
    } catch (const zmq::error_t&) {
      return;
    }
  }
}

}  // namespace ferry::sync
