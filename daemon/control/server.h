// ControlServer: the control socket ferryd embeds (protocol: daemon/control/protocol.h).
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "daemon/control/endpoint.h"
#include "daemon/control/protocol.h"
#include "sync/endpoints.h"

namespace ferry::control {

// Answers one parsed request: the command's reply fields (a JSON object, without v, id, ok,
// error), or a Status that becomes an error reply carrying its code and message.
using ControlHandler = std::function<Result<nlohmann::json>(const ControlRequest&)>;

struct ControlServerOptions {
  // The run directory. With the default endpoint, the socket is DIR/.ferryd/control.
  std::filesystem::path run_dir;
  // Where to bind. Default: "" = ControlEndpoint(run_dir) (ipc://, private directory).
  // tcp://HOST:PORT needs `curve`; inproc:// is for tests.
  std::string endpoint;
  // CURVE server keypair and the allow-list of client public keys (sync/endpoints.h); needed
  // for tcp://, also usable with ipc://. Default: none.
  std::optional<sync::CurveOptions> curve;
  // With `curve`: hears of each client key the allow-list refuses, once per key, on the ZAP
  // handler's thread; must not block (ferryd prints it). Default: none.
  sync::RejectedKeyFn on_rejected_key;
};

// A ROUTER socket served by its own thread. Every message gets exactly one reply: the
// handler's, or an error reply for a refused request (protocol.h); a handler that throws
// gets an "internal" error reply. Bad messages from one client never stop the server.
// Thread-safe: Start, Stop and the destructor may be called from any thread (not
// concurrently with each other on one object).
class ControlServer {
 public:
  // Checks the options (the endpoint policy of sync/endpoints.h: kFailedPrecondition for
  // tcp:// without CURVE, kInvalidArgument for CURVE keys that are not Z85 or another
  // scheme), binds, and starts the thread, which calls `handler` for each valid request, one
  // at a time, on that thread. kIOError naming the endpoint when it cannot be bound.
  // REQUIRES: the caller holds the run directory's RunLock (a bind on an ipc:// path
  // replaces the socket file found there).
  [[nodiscard]] static Result<std::unique_ptr<ControlServer>> Start(const ControlServerOptions& options,
                                                                    ControlHandler handler);
  // Stops the thread (a request being handled finishes first), closes the socket and
  // removes the ipc:// socket file. Idempotent; the destructor calls it.
  void Stop();
  ~ControlServer();
  ControlServer(const ControlServer&) = delete;
  ControlServer& operator=(const ControlServer&) = delete;

  // The endpoint bound (tcp://HOST:0 shows the port chosen).
  [[nodiscard]] const std::string& endpoint() const;

 private:
  struct Impl;
  explicit ControlServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry::control
