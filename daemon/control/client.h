// ControlClient: asks a running ferryd over its control socket (protocol: daemon/control/protocol.h).
#pragma once

#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "daemon/control/protocol.h"
#include "sync/endpoints.h"

namespace ferry::control {

struct ControlClientOptions {
  // The run directory: the default endpoint's directory, and named in errors.
  std::filesystem::path run_dir;
  // Where ferryd listens. Default: "" = ipc://DIR/.ferryd/control (endpoint.h).
  std::string endpoint;
  // CURVE client keypair plus the server's public key; needed for tcp://. Default: none.
  std::optional<sync::CurveOptions> curve;
};

// One connection to a ferryd's control socket. Never hangs: every call has a timeout.
// Thread-compatible.
class ControlClient {
 public:
  // Checks the endpoint and keys (sync/endpoints.h policy: kFailedPrecondition for tcp://
  // without CURVE) and connects. With the default endpoint: kUnavailable "no ferryd is
  // running for DIR" when the socket file is absent, and sync::MakePrivateDirectory's
  // kFailedPrecondition when DIR/.ferryd belongs to another user.
  [[nodiscard]] static Result<std::unique_ptr<ControlClient>> Connect(const ControlClientOptions& options);
  ~ControlClient();
  ControlClient(const ControlClient&) = delete;
  ControlClient& operator=(const ControlClient&) = delete;

  // Sends `command` and waits up to `timeout` for its reply: the reply's fields (an object
  // without v, id, ok). An error reply becomes its Status (code and message as sent, with
  // "ferryd: " in front). kUnavailable "no ferryd is running for DIR (...)" (or, for an
  // explicit endpoint, "no ferryd answered on EP ...") when nothing answers in time; the
  // unanswered request is then dropped, never delivered later. kCorruption when the reply
  // is malformed.
  [[nodiscard]] Result<nlohmann::json> Call(ControlCommand command, std::chrono::milliseconds timeout);

  // The endpoint connected to.
  [[nodiscard]] const std::string& endpoint() const;

 private:
  struct Impl;
  explicit ControlClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry::control
