// CURVE keypairs for authenticated, encrypted sync over tcp://.
//
// Key files hold one Z85-encoded key (40 characters) and a newline:
//   PREFIX.key      the secret key, created with mode 0600 (refused on load when group- or
//                   world-readable)
//   PREFIX.pub      the public key, mode 0644
// An allow-list file holds one Z85 public key per line; blank lines and lines starting
// with '#' are ignored.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "core/status.h"

namespace ferry::sync {

struct CurveKeyPair {
  std::string public_key;  // 40 Z85 characters
  std::string secret_key;  // 40 Z85 characters
};

// A fresh keypair (zmq_curve_keypair). kUnsupported when libzmq lacks CURVE.
[[nodiscard]] Result<CurveKeyPair> GenerateKeyPair();
// Writes PREFIX.key (0600) and PREFIX.pub; kAlreadyExists naming the file unless `force`.
[[nodiscard]] Status WriteKeyPair(const std::filesystem::path& prefix, const CurveKeyPair& keys, bool force);
// Reads a public key file (kCorruption naming the file when it is not one Z85 key).
[[nodiscard]] Result<std::string> ReadPublicKey(const std::filesystem::path& path);
// Reads a secret key file; kFailedPrecondition naming it when readable by group/others.
[[nodiscard]] Result<std::string> ReadSecretKey(const std::filesystem::path& path);
// Reads an allow-list (one Z85 public key per line); kCorruption naming file and line.
[[nodiscard]] Result<std::vector<std::string>> ReadAllowList(const std::filesystem::path& path);
// Whether `key` is 40 characters of the Z85 alphabet.
bool IsZ85Key(std::string_view key);

}  // namespace ferry::sync
