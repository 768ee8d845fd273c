// Endpoints and socket security shared by Ferry's ZeroMQ servers and clients: the sync
// publisher (server) and receiver (client) now, a daemon's control socket later.
//
// Policy (defined here, once):
//   ipc://     a Unix socket inside a PRIVATE directory: created when missing, forced to mode
//              0700, refused when another user owns it; only this user can connect.
//   inproc://  process-local; always allowed.
//   tcp://     only with CURVE: the server holds a keypair and admits only the client public
//              keys of an allow-list, checked by a ZAP handler on the server's ZeroMQ context
//              (without one, CURVE would accept any client key); the client holds its own
//              keypair and pins the server's public key. The ZAP handler sets each
//              connection's User-Id to the client's key (Z85), so the server can tell which
//              key sent a message (zmq_msg_gets(msg, "User-Id")).
//   Anything else is refused.
// Keys are Z85 text, 40 characters (sync/keys.h reads and writes key files; LoadServerCurve and
// LoadClientCurve below read a side's keys from them).
//
// The socket helpers take libzmq handles as void* (zmq::socket_t::handle(),
// zmq::context_t::handle()), so this header needs no ZeroMQ header.
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace ferry::sync {

// The two sockets of a sync publisher: where it binds and receivers connect.
struct Endpoints {
  std::string requests;  // ROUTER/DEALER, e.g. "ipc:///run/x/requests" or "tcp://10.0.0.1:5555"
  std::string updates;   // PUB/SUB announcements, e.g. "ipc:///run/x/updates" or "tcp://10.0.0.1:5556"
};

// CURVE settings of one side. Server: its own keypair plus the allow-list of client public
// keys. Client: its own keypair plus the server's public key. All keys are Z85 text.
struct CurveOptions {
  std::string public_key;
  std::string secret_key;
  std::string server_public_key;          // client only
  std::vector<std::string> allowed_keys;  // server only: clients allowed to connect
};

enum class CurveRole { kServer, kClient };

// Creates `dir` (and missing parents) or checks it, and makes it private: mode 0700, owned
// by this user. kFailedPrecondition naming the directory when another user owns it;
// kIOError naming it when it cannot be created, inspected or chmod-ed.
[[nodiscard]] Status MakePrivateDirectory(const std::filesystem::path& dir);

// "ipc://<absolute dir>/<name>" after MakePrivateDirectory(dir). `name` must be a plain
// file name (kInvalidArgument otherwise); kInvalidArgument naming the directory when the
// socket path would exceed the 107-byte limit of a Unix socket address.
[[nodiscard]] Result<std::string> PrivateIpcEndpoint(const std::filesystem::path& dir, std::string_view name);

// The sync pair inside a private directory: ipc://DIR/requests and ipc://DIR/updates
// (PrivateIpcEndpoint's errors).
[[nodiscard]] Result<Endpoints> PrivateIpcEndpoints(const std::filesystem::path& dir);

// The sync pair one publisher address names (what `ferry sync publish --bind`, `ferry sync
// receive --connect` and ferryd's [publish] endpoint take):
//   ipc://DIR          PrivateIpcEndpoints(DIR) (DIR made private first; its errors)
//   tcp://HOST:PORT    requests on PORT, announcements on PORT+1 (PORT 1..65534)
// kInvalidArgument starting with `value` ("VALUE: ...") for anything else (no directory, no
// port, another scheme).
[[nodiscard]] Result<Endpoints> ParseSyncEndpoint(std::string_view value);

// Checks one endpoint's scheme against the policy above: ipc:// and inproc:// are always
// allowed; tcp:// only when `curve` (kFailedPrecondition naming the endpoint otherwise);
// any other scheme is kInvalidArgument naming it.
[[nodiscard]] Status CheckEndpoint(std::string_view endpoint, bool curve);
// CheckEndpoint for both endpoints of `e`.
[[nodiscard]] Status CheckEndpoints(const Endpoints& e, bool curve);

// Checks that `curve` holds what `role` needs, every key 40 Z85 characters: a keypair, plus
// (client) the server's public key or (server) the allow-list's keys (an empty allow-list
// admits nobody). kInvalidArgument naming the field (and, for the allow-list, the key's
// first characters) otherwise.
[[nodiscard]] Status CheckCurve(const CurveOptions& curve, CurveRole role);

// What a caller calls the files LoadServerCurve and LoadClientCurve read (a config key such
// as "publish.key", a flag such as "--key"): put in front of an error about that file, whose
// message names the file itself. Empty: nothing in front.
struct CurveFileNames {
  std::string key;   // the keypair prefix
  std::string peer;  // server: the allow-list file; client: the server's public key file
};

// The CURVE settings of a server, read from its key files (sync/keys.h formats): the keypair
// PREFIX.key (secret) and PREFIX.pub, and the allow-list of client public keys in
// `allow_file`. The result passes CheckCurve(kServer). sync/keys.h's errors, each naming its
// file (kFailedPrecondition for a secret key others can read, kCorruption for a file that is
// not a key or an allow-list line that is not one), with the name from `names` in front;
// kInvalidArgument when `key_prefix` or `allow_file` is empty (without an allow-list any
// client key would be accepted).
[[nodiscard]] Result<CurveOptions> LoadServerCurve(const std::filesystem::path& key_prefix,
                                                   const std::filesystem::path& allow_file,
                                                   const CurveFileNames& names = {});
// The CURVE settings of a client: its keypair PREFIX.key and PREFIX.pub and the server's
// public key in `server_key_file`, which it pins. The result passes CheckCurve(kClient).
// Errors as LoadServerCurve's.
[[nodiscard]] Result<CurveOptions> LoadClientCurve(const std::filesystem::path& key_prefix,
                                                   const std::filesystem::path& server_key_file,
                                                   const CurveFileNames& names = {});

// Makes the libzmq socket `socket` a CURVE server with `curve`'s keypair, its handshakes
// decided by the ZAP handler of its context (ZapAllowList) under `zap_domain`. Call before
// bind. kInvalidArgument when libzmq refuses an option (e.g. a malformed key).
[[nodiscard]] Status SecureServerSocket(void* socket, const CurveOptions& curve, std::string_view zap_domain);

// Makes the libzmq socket `socket` a CURVE client with `curve`'s keypair, pinning
// curve.server_public_key. Call before connect. kInvalidArgument when libzmq refuses an
// option.
[[nodiscard]] Status SecureClientSocket(void* socket, const CurveOptions& curve);

// Called with the public key (Z85) of a CURVE client the allow-list refused, once per key:
// a refused client retries its handshake every reconnect interval, and only the first
// refusal of each key is reported. Runs on the thread that calls HandlePending().
using RejectedKeyFn = std::function<void(const std::string& public_key_z85)>;

// The ZAP handler (RFC 27) of one ZeroMQ context, admitting only listed CURVE client keys.
// It answers on the owner's thread: the owner polls socket() for input with its other
// sockets and calls HandlePending() when it is readable (a handshake waits until then).
// Thread-compatible.
class ZapAllowList {
 public:
  // Binds inproc://zeromq.zap.01 on the libzmq context `context`: from then on every CURVE
  // (and ZAP-enabled) handshake on a server socket of that context is decided here.
  // `on_rejected` (may be empty) hears of each refused client key once (RejectedKeyFn), so a
  // server can say which key it turned away while that client only sees no reply.
  // kInvalidArgument naming a key that is not Z85; kIOError when the address cannot be
  // bound (one handler per context).
  [[nodiscard]] static Result<std::unique_ptr<ZapAllowList>> Bind(void* context,
                                                                  const std::vector<std::string>& allowed_keys,
                                                                  RejectedKeyFn on_rejected = nullptr);
  ~ZapAllowList();
  ZapAllowList(const ZapAllowList&) = delete;
  ZapAllowList& operator=(const ZapAllowList&) = delete;

  // The handler's socket (a libzmq handle), to poll for ZMQ_POLLIN.
  void* socket() const;
  // Answers every pending ZAP request without blocking: status 200 with User-Id = the
  // client's public key in Z85 when the mechanism is CURVE and the key is listed, 400
  // otherwise (a CURVE key refused for the first time is passed to `on_rejected`).
  // Malformed requests are dropped.
  void HandlePending();

 private:
  struct Impl;
  explicit ZapAllowList(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry::sync
