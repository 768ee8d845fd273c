// Subcommands of `ferry`. Each lives in its own <verb>_command.cpp and registers itself
// on the root app; the work is done by the libraries, not here.
//
// A command's callback reports failure by throwing CLI::RuntimeError(exit_code) after
// printing a message (see cli/output.h), so `ferry` exits non-zero with a clear error.
#pragma once

#include <CLI/CLI.hpp>

namespace ferry::cli {

void SetInspectCommand(CLI::App& app);
void SetDiffCommand(CLI::App& app);
void SetConvertCommand(CLI::App& app);
// The weight store (store/store.h): `store import`, `versions ...`, `verify PATH`, `audit`.
void SetStoreCommand(CLI::App& app);
void SetVersionsCommand(CLI::App& app);
void SetVerifyCommand(CLI::App& app);
void SetAuditCommand(CLI::App& app);
// Weight sync over ZeroMQ (sync/): `sync publish|receive|status`, `keys generate`.
void SetSyncCommand(CLI::App& app);
void SetKeysCommand(CLI::App& app);
// Operating ferryd (daemon/control/): `daemon start|status|pause|resume|snapshot|stop|metrics|logs`.
void SetDaemonCommand(CLI::App& app);

}  // namespace ferry::cli
