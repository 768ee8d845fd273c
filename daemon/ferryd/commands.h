// ferryd's subcommands, one file each (as cli/). Each Set*Command adds its subcommand to the
// app; the work lives in the daemon libraries.
#pragma once

#include <CLI/CLI.hpp>

#include <string_view>

#include "core/status.h"

namespace ferry::ferryd {

void SetGenerateCommand(CLI::App& app);
void SetTrainCommand(CLI::App& app);
void SetProbeCommand(CLI::App& app);

// Prints "ferryd: error: <message>" to stderr and throws CLI::RuntimeError(exit_code).
[[noreturn]] void Fail(const Status& status, int exit_code = 1);

// LibTorch set up for a one-process command (`generate`, `probe`): `threads` compute threads
// (0: one per core), freed tensor memory kept for reuse, and a warning on stderr when LibTorch
// runs on the reference BLAS. Returns the thread count in use.
int SetUpTorch(int threads);

}  // namespace ferry::ferryd
