// Runs the `ferry` executable (FERRY_CLI_PATH) in tests: arguments in, exit status and
// captured stdout/stderr out. Stdin is /dev/null. Shared by every CLI test.
#pragma once

#include <string>
#include <vector>

namespace ferry::testing {

struct CliResult {
  int exit_code = -1;  // the process's exit status; -1 when it did not exit normally
  int signal = 0;      // the terminating signal, 0 when it exited
  std::string out;     // stdout
  std::string err;     // stderr
};

// Runs FERRY_CLI_PATH with `args` and waits for it. A failure to start is a test failure.
CliResult RunFerry(const std::vector<std::string>& args);

}  // namespace ferry::testing
