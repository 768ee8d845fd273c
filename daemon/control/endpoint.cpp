// A run directory's default control endpoint (daemon/control/endpoint.h).
#include "daemon/control/endpoint.h"

#include <string_view>

#include "sync/endpoints.h"

namespace ferry::control {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kSocketDir = ".ferryd";
constexpr std::string_view kSocketName = "control";

}  // namespace

Result<std::string> ControlEndpoint(const fs::path& run_dir) {
  return sync::PrivateIpcEndpoint(run_dir / kSocketDir, kSocketName);
}

fs::path ControlSocketPath(const fs::path& run_dir) { return run_dir / kSocketDir / kSocketName; }

}  // namespace ferry::control
