// ferry: one command for converting, storing, syncing and auditing LLM weights.
#include <CLI/CLI.hpp>

#include "cli/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"ferry: correct, auditable weight conversion and sync for LLM RL jobs"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "ferry 0.1.0");
  ferry::cli::SetInspectCommand(app);
  ferry::cli::SetDiffCommand(app);
  ferry::cli::SetConvertCommand(app);
  ferry::cli::SetStoreCommand(app);
  ferry::cli::SetVersionsCommand(app);
  ferry::cli::SetVerifyCommand(app);
  ferry::cli::SetAuditCommand(app);
  ferry::cli::SetSyncCommand(app);
  ferry::cli::SetKeysCommand(app);
  ferry::cli::SetDaemonCommand(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::RuntimeError& e) {
    return e.get_exit_code();  // raised by a command after printing its own message
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);  // prints help / version / the usage error
    // --help and --version succeed; every usage error is exit code 1, like any bad input.
    return code == 0 ? 0 : 1;
  }
  return 0;
}
