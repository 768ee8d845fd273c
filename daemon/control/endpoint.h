// Where a run directory's ferryd listens by default: the address both sides of the control
// socket (server.h, client.h) derive from DIR. The socket lives in a private directory
// (sync/endpoints.h: mode 0700, refused when another user owns it):
//   DIR/.ferryd/control    ipc://<absolute DIR>/.ferryd/control
#pragma once

#include <filesystem>
#include <string>

#include "core/status.h"

namespace ferry::control {

// The default control endpoint of a run directory: ipc://DIR/.ferryd/control, after making
// DIR/.ferryd private (sync::PrivateIpcEndpoint's errors: kFailedPrecondition when another
// user owns it, kInvalidArgument when the path is too long for a Unix socket).
[[nodiscard]] Result<std::string> ControlEndpoint(const std::filesystem::path& run_dir);
// DIR/.ferryd/control: the socket file of the default endpoint (its presence is no proof
// that a ferryd runs: use RunLock::Holder).
[[nodiscard]] std::filesystem::path ControlSocketPath(const std::filesystem::path& run_dir);

}  // namespace ferry::control
