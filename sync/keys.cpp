#include "sync/keys.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include <zmq.h>

#include "core/mapped_file.h"

namespace ferry::sync {
namespace {

constexpr std::string_view kZ85Alphabet =
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#";

std::string Trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ' || s.back() == '\t')) s.pop_back();
  size_t i = 0;
  while (i < s.size() && (s[i] == ' ' || s[i] == '\t')) ++i;
  return s.substr(i);
}

Status WriteWithMode(const std::filesystem::path& path, const std::string& text, mode_t mode, bool force) {
  const int flags = O_WRONLY | O_CREAT | O_CLOEXEC | (force ? O_TRUNC : O_EXCL);
  const int fd = ::open(path.c_str(), flags, mode);
  if (fd < 0) {
    if (errno == EEXIST)
      return Status::AlreadyExists(path.string() + ": key file exists (replacing it needs the force option)");
    return Status::IOError(path.string() + ": cannot create key file: " + std::strerror(errno));
  }
  Status st;
  if (::fchmod(fd, mode) != 0 || ::write(fd, text.data(), text.size()) != static_cast<ssize_t>(text.size()) ||
      ::fsync(fd) != 0) {
    st = Status::IOError(path.string() + ": cannot write key file: " + std::strerror(errno));
  }
  ::close(fd);
  return st;
}

Result<std::string> ReadKeyFile(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) return Status::NotFound(path.string() + ": cannot open key file");
  std::stringstream ss;
  ss << in.rdbuf();
  std::string key = Trim(ss.str());
  if (!IsZ85Key(key)) return Status::Corruption(path.string() + ": not a 40-character Z85 CURVE key");
  return key;
}

}  // namespace

bool IsZ85Key(std::string_view key) {
  if (key.size() != 40) return false;
  for (char c : key) {
    if (kZ85Alphabet.find(c) == std::string_view::npos) return false;
  }
  return true;
}

Result<CurveKeyPair> GenerateKeyPair() {
  if (!zmq_has("curve")) return Status::Unsupported("libzmq was built without CURVE support");
  char pub[41] = {};
  char sec[41] = {};
  if (zmq_curve_keypair(pub, sec) != 0) {
    return Status::Internal(std::string("zmq_curve_keypair failed: ") + zmq_strerror(zmq_errno()));
  }
  return CurveKeyPair{pub, sec};
}

Status WriteKeyPair(const std::filesystem::path& prefix, const CurveKeyPair& keys, bool force) {
  if (!IsZ85Key(keys.public_key) || !IsZ85Key(keys.secret_key)) return Status::InvalidArgument("keypair is not Z85");
  const std::filesystem::path sec = prefix.string() + ".key";
  const std::filesystem::path pub = prefix.string() + ".pub";
  FERRY_RETURN_IF_ERROR(WriteWithMode(sec, keys.secret_key + "\n", 0600, force));
  return WriteWithMode(pub, keys.public_key + "\n", 0644, force);
}

Result<std::string> ReadPublicKey(const std::filesystem::path& path) { return ReadKeyFile(path); }

Result<std::string> ReadSecretKey(const std::filesystem::path& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return Status::NotFound(path.string() + ": cannot open secret key file");
  if ((st.st_mode & 077) != 0) {
    return Status::FailedPrecondition(path.string() + ": secret key file is readable by group or others (chmod 600)");
  }
  return ReadKeyFile(path);
}

Result<std::vector<std::string>> ReadAllowList(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) return Status::NotFound(path.string() + ": cannot open allow-list");
  std::vector<std::string> keys;
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    line = Trim(line);
    if (line.empty() || line[0] == '#') continue;
    if (!IsZ85Key(line)) {
      return Status::Corruption(path.string() + ":" + std::to_string(lineno) + ": not a 40-character Z85 public key");
    }
    keys.push_back(line);
  }
  return keys;
}

}  // namespace ferry::sync
