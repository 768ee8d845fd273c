// ferryd: the GRPO daemon and its model runtime. `ferryd generate` samples from a model (and
// adapter); `ferryd train` runs GRPO; `ferryd probe` computes the reference prompt
// log-probabilities a vLLM server's are checked against. Operated by people through `ferry daemon ...`.
#include <torch/version.h>
#include <CLI/CLI.hpp>

#include <cstdio>

#include "daemon/ferryd/commands.h"
#include "daemon/runtime/torch_util.h"

namespace ferry::ferryd {

void Fail(const Status& status, int exit_code) {
  std::fprintf(stderr, "ferryd: error: %s\n", status.message().c_str());
  throw CLI::RuntimeError(exit_code);
}

int SetUpTorch(int threads) {
  const int used = runtime::SetTorchThreads(threads);
  runtime::KeepFreedTensorMemory();
  const runtime::BlasInfo blas = runtime::LoadedBlas();
  if (blas.reference) {
    std::fprintf(
        stderr, "ferryd: warning: LibTorch runs on the reference BLAS (%s), ~15x slower; install libopenblas0-openmp\n",
        blas.library.c_str());
  }
  return used;
}

}  // namespace ferry::ferryd

int main(int argc, char** argv) {
  CLI::App app{"ferryd: GRPO with a co-located generator that provably runs the trainer's weights"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "ferryd 0.1.0 (LibTorch " TORCH_VERSION ")");
  ferry::ferryd::SetGenerateCommand(app);
  ferry::ferryd::SetTrainCommand(app);
  ferry::ferryd::SetProbeCommand(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::RuntimeError& e) {
    return e.get_exit_code();
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 1;
  }
  return 0;
}
