// ferry: one command for converting, storing, syncing and auditing LLM weights.
#include <CLI/CLI.hpp>

#include "cli/commands.h"
#ifdef FERRY_HAVE_TORCH
#include "core/torch/legacy_bin.h"
#endif

int main(int argc, char** argv) {
#ifdef FERRY_HAVE_TORCH
  ferry::torchio::InstallLegacyLoader();
#endif
  CLI::App app{"ferry: correct, auditable weight conversion and sync for LLM RL jobs"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "ferry 0.1.0");
  ferry::cli::SetInspectCommand(app);
  ferry::cli::SetDiffCommand(app);
  ferry::cli::SetConvertCommand(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return 0;
}
