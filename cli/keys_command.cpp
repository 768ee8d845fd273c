// `ferry keys generate --out PREFIX [--force]`: a CURVE keypair for `ferry sync` over tcp://
// (PREFIX.key, mode 0600, and PREFIX.pub; see sync/keys.h).
#include <cstdio>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "cli/output.h"
#include "sync/keys.h"

namespace ferry::cli {

void SetKeysCommand(CLI::App& app) {
  auto* keys = app.add_subcommand("keys", "CURVE keypairs for authenticated, encrypted sync");
  keys->require_subcommand(1);
  struct Flags {
    std::string out;
    bool force = false;
  };
  auto flags = std::make_shared<Flags>();
  auto* gen = keys->add_subcommand("generate", "Write PREFIX.key (secret, mode 0600) and PREFIX.pub");
  gen->add_option("--out", flags->out, "Path prefix of the key files")->required();
  gen->add_flag("--force", flags->force, "Replace existing key files");
  gen->callback([flags] {
    auto kp = sync::GenerateKeyPair();
    if (!kp.ok()) Fail(kp.status());
    Status st = sync::WriteKeyPair(flags->out, *kp, flags->force);
    if (!st.ok()) FailWithHint(st, StatusCode::kAlreadyExists, "pass --force to replace it");
    std::printf("%s\n", kp->public_key.c_str());
  });
}

}  // namespace ferry::cli
