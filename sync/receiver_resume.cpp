// Partial transfers (sync/receiver_internal.h): what a killed receiver or a failed transfer
// left in DIR/versions is kept as versions/<id>.partial, and the next transfer of the same
// version takes it over, keeping what it can verify.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <map>

#include "sync/receiver_internal.h"

namespace ferry::sync::receiver_internal {
namespace {

namespace fs = std::filesystem;

// "<32 hex>.tmp-XXXXXX": a transfer's temporary directory (not a ".prepare.tmp-" one).
// Returns the version hex, or "" for any other name.
std::string TransferTempVersion(const std::string& name) {
  if (name.size() != 32 + 11 || name.compare(32, 5, ".tmp-") != 0) return "";
  const std::string hex = name.substr(0, 32);
  return store::Digest::FromHex(hex).ok() ? hex : "";
}

}  // namespace

void RemoveStaleTemporaries(const fs::path& dir) {
  for (const fs::path& sub : {dir / "versions", dir / "manifests", dir}) {
    std::error_code ec;
    std::vector<fs::path> stale;
    std::map<std::string, std::pair<fs::file_time_type, fs::path>> newest;  // version hex -> partial
    for (fs::directory_iterator it(sub, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (!IsTempName(name)) continue;
      const std::string hex = sub == dir / "versions" ? TransferTempVersion(name) : "";
      std::error_code fec;
      if (!hex.empty() && fs::is_regular_file(it->path() / "model.safetensors", fec)) {
        const auto t = fs::last_write_time(it->path() / "model.safetensors", fec);
        auto [n, inserted] = newest.try_emplace(hex, t, it->path());
        if (inserted) continue;
        if (!fec && t > n->second.first) {
          stale.push_back(n->second.second);
          n->second = {t, it->path()};
          continue;
        }
      }
      stale.push_back(it->path());
    }
    for (const auto& p : stale) fs::remove_all(p, ec);
    for (const auto& [hex, partial] : newest) {
      const fs::path to = sub / (hex + std::string(kPartialSuffix));
      fs::remove_all(to, ec);
      if (::rename(partial.second.c_str(), to.c_str()) != 0) fs::remove_all(partial.second, ec);
    }
  }
}

bool KeepPartial(const fs::path& versions, const store::Digest& version, const fs::path& tmp) {
  const fs::path partial = versions / (version.Hex() + std::string(kPartialSuffix));
  std::error_code ec;
  fs::remove_all(partial, ec);
  return fs::is_regular_file(tmp / "model.safetensors", ec) && ::rename(tmp.c_str(), partial.c_str()) == 0;
}

bool TakeOverPartial(const fs::path& versions, const store::Digest& version, const std::string& header, uint64_t total,
                     const fs::path& tmp) {
  const std::string mine = version.Hex() + std::string(kPartialSuffix);
  std::error_code ec;
  std::vector<fs::path> others;
  bool found = false;
  for (fs::directory_iterator it(versions, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name == mine) {
      found = true;
    } else if (name.size() == 32 + kPartialSuffix.size() && name.ends_with(kPartialSuffix)) {
      others.push_back(it->path());
    }
  }
  for (const auto& p : others) fs::remove_all(p, ec);
  if (!found) return false;
  const fs::path partial = versions / mine;
  bool usable = false;
  {
    FdGuard in(::open((partial / "model.safetensors").c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
    struct stat st;
    if (in.get() >= 0 && ::fstat(in.get(), &st) == 0 && S_ISREG(st.st_mode) &&
        static_cast<uint64_t>(st.st_size) == total) {
      std::string head(header.size(), '\0');
      usable = ::pread(in.get(), head.data(), head.size(), 0) == static_cast<ssize_t>(head.size()) && head == header;
    }
  }
  if (usable) {
    for (fs::directory_iterator it(partial, ec), end; !ec && it != end; it.increment(ec)) {
      if (it->path().filename() != "model.safetensors") fs::remove_all(it->path(), ec);
    }
    usable = !ec && ::rmdir(tmp.c_str()) == 0 && ::rename(partial.c_str(), tmp.c_str()) == 0;
    if (!usable) fs::create_directory(tmp, ec);  // keep `tmp` for a fresh transfer
  }
  if (!usable) fs::remove_all(partial, ec);
  return usable;
}

// Chunks arrive in order and each is written whole at its place, so every byte before the
// first hole (SEEK_HOLE) was written; the hole's offset is rounded up to the file system's
// block, so it is rounded down to a chunk boundary here, which is exact when chunks are at
// least a block (smaller chunks: only complete tensors are kept). 0 without hole support.
uint64_t HeldPrefix(int fd, const store::TensorRow& row, uint64_t offset, uint64_t chunk_bytes,
                    std::vector<std::byte>& piece) {
  const off_t hole = ::lseek(fd, static_cast<off_t>(offset), SEEK_HOLE);
  if (hole < 0 || static_cast<uint64_t>(hole) >= offset + row.nbytes) {
    Result<bool> same = ReadAndHash(fd, offset, row, piece, {});
    return same.ok() && *same ? row.nbytes : 0;
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || st.st_blksize <= 0 || chunk_bytes < static_cast<uint64_t>(st.st_blksize)) return 0;
  const uint64_t written = static_cast<uint64_t>(hole) - offset;
  return written - written % chunk_bytes;
}

}  // namespace ferry::sync::receiver_internal
