// The receiver directory (layout: the top of sync/receiver.h): its lock, activation records,
// the current link, renames into place and pruning; and the file helpers the receiver's
// files share (sync/receiver_internal.h).
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "core/file_util.h"
#include "core/mapped_file.h"
#include "sync/receiver_internal.h"

namespace ferry::sync {

namespace fs = std::filesystem;

Result<std::optional<store::Digest>> ActiveVersion(const fs::path& dir) {
  std::error_code ec;
  const fs::path current = dir / "current";
  if (!fs::is_symlink(fs::symlink_status(current, ec))) return std::optional<store::Digest>();
  const fs::path target = fs::read_symlink(current, ec);
  if (ec || target.parent_path() != "versions") {
    return Status::Corruption(current.string() + ": not a link to versions/<id>");
  }
  auto d = store::Digest::FromHex(target.filename().string());
  if (!d.ok())
    return Status::Corruption(current.string() + ": link target " + target.string() + " is not a version id");
  return std::optional<store::Digest>(*d);
}

namespace receiver_internal {

// ---- file helpers ---------------------------------------------------------------------------

FdGuard::~FdGuard() {
  if (fd_ >= 0) ::close(fd_);
}

TempDirGuard::~TempDirGuard() {
  if (!path_.empty()) {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
}

Result<bool> HashRange(int fd, uint64_t offset, uint64_t length, store::TensorDigester& digester,
                       std::vector<std::byte>& piece, const PieceSink& sink) {
  piece.resize(kCopyPieceBytes);
  for (uint64_t done = 0; done < length;) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(piece.size(), length - done));
    const ssize_t n = ::pread(fd, piece.data(), want, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    const std::span<const std::byte> bytes(piece.data(), static_cast<size_t>(n));
    digester.Update(bytes);
    if (sink) FERRY_RETURN_IF_ERROR(sink(bytes, done));
    done += static_cast<uint64_t>(n);
  }
  return true;
}

Result<bool> ReadAndHash(int fd, uint64_t offset, const store::TensorRow& row, std::vector<std::byte>& piece,
                         const PieceSink& sink) {
  store::TensorDigester digester(row.dtype, row.shape);
  FERRY_ASSIGN_OR_RETURN(bool read, HashRange(fd, offset, row.nbytes, digester, piece, sink));
  return read && digester.Finish() == row.digest;
}

// ---- the directory ------------------------------------------------------------------------

Status LocalIO(Status s) {
  if (s.code() == StatusCode::kNotFound) return Status::IOError(s.message());
  return s;
}

bool IsTempName(std::string_view name) { return name.find(".tmp-") != std::string_view::npos; }

Result<int> LockDirectory(const fs::path& dir, const std::string& receiver_id) {
  std::error_code ec;
  for (const char* sub : {"versions", "manifests"}) {
    fs::create_directories(dir / sub, ec);
    if (ec) return Status::IOError((dir / sub).string() + ": cannot create: " + ec.message());
  }
  const fs::path lock = dir / ".lock";
  const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IOError(lock.string() + ": cannot open lock file: " + std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    if (err == EWOULDBLOCK) {
      return Status::FailedPrecondition("sync receiver " + receiver_id + ": directory " + dir.string() +
                                        " is in use by another receiver (" + lock.string() + " is locked)");
    }
    return Status::IOError(lock.string() + ": cannot lock: " + std::strerror(err));
  }
  return fd;
}

Result<ActiveState> LoadActiveState(const fs::path& dir) {
  ActiveState st;
  FERRY_ASSIGN_OR_RETURN(st.active, ActiveVersion(dir));
  if (!st.active) return st;
  // How the active version came to be, for already-active checks and delta copies.
  auto text = ReadSmallFile(dir / "manifests" / (st.active->Hex() + ".json"));
  if (!text.ok()) return st;
  auto man = DecodeManifest(*text);
  const nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (!man.ok() || !j.is_object()) return st;
  st.served = man->version;
  if (auto layout = ParseLayout(j.value("activated_layout", std::string())); layout.ok()) st.layout = *layout;
  if (j.contains("proven") && j["proven"].is_string()) {
    auto p = store::Digest::FromHex(j["proven"].get<std::string>());
    if (p.ok()) st.proven = *p;
  }
  return st;
}

Status WriteActivationRecord(const fs::path& dir, const std::string& manifest_json, const store::Digest& activated,
                             Layout layout, const std::optional<store::Digest>& proven) {
  nlohmann::json record = nlohmann::json::parse(manifest_json, nullptr, /*allow_exceptions=*/false);
  record["activated_as"] = activated.Hex();
  record["activated_ns"] =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  record["activated_layout"] = std::string(LayoutName(layout));
  if (proven) record["proven"] = proven->Hex();
  const fs::path path = dir / "manifests" / (activated.Hex() + ".json");
  return LocalIO(WriteFileAtomic(path, record.dump()));
}

Status SwitchCurrent(const fs::path& dir, const store::Digest& v) {
  const fs::path link = dir / (".current.tmp-" + std::to_string(::getpid()));
  ::unlink(link.c_str());
  const std::string target = "versions/" + v.Hex();
  if (::symlink(target.c_str(), link.c_str()) != 0) {
    return Status::IOError(link.string() + ": cannot create symlink: " + std::strerror(errno));
  }
  const fs::path current = dir / "current";
  if (::rename(link.c_str(), current.c_str()) != 0) {
    const int err = errno;
    ::unlink(link.c_str());
    return Status::IOError(current.string() + ": cannot switch the active version: " + std::strerror(err));
  }
  return LocalIO(SyncDirectory(dir));
}

Status RenameIntoPlace(const fs::path& tmp, const fs::path& final_dir) {
  std::error_code ec;
  if (::rename(tmp.c_str(), final_dir.c_str()) != 0) {
    const int err = errno;
    if (!fs::is_directory(final_dir, ec)) {
      return Status::IOError(final_dir.string() + ": cannot rename the version into place: " + std::strerror(err));
    }
    fs::remove_all(tmp, ec);
  }
  return LocalIO(SyncDirectory(final_dir.parent_path()));
}

void PruneVersions(const fs::path& dir, int keep, const store::Digest& active) {
  if (keep <= 0) return;
  struct Activated {
    int64_t at = 0;
    std::string id, served, base;
    fs::path manifest;
  };
  std::vector<Activated> all;
  std::error_code ec;
  for (fs::directory_iterator it(dir / "manifests", ec), end; !ec && it != end; it.increment(ec)) {
    const fs::path& p = it->path();
    if (p.extension() != ".json" || IsTempName(p.filename().string())) continue;
    Activated a;
    a.manifest = p;
    a.id = p.stem().string();
    auto text = ReadSmallFile(p);
    if (text.ok()) {
      const auto j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
      if (j.is_object()) {
        if (auto t = j.find("activated_ns"); t != j.end() && t->is_number_integer()) a.at = t->get<int64_t>();
        if (auto v = j.find("version"); v != j.end() && v->is_string()) a.served = v->get<std::string>();
        if (auto b = j.find("base_version"); b != j.end() && b->is_string()) a.base = b->get<std::string>();
      }
    }
    all.push_back(std::move(a));
  }
  std::sort(all.begin(), all.end(), [](const Activated& x, const Activated& y) { return x.at > y.at; });
  std::set<std::string> kept = {active.Hex()};
  for (size_t i = 0; i < all.size() && i < static_cast<size_t>(keep); ++i) {
    kept.insert(all[i].id);
    if (!all[i].served.empty()) kept.insert(all[i].served);
    if (!all[i].base.empty()) kept.insert(all[i].base);
  }
  for (const auto& a : all) {
    if (kept.count(a.id) == 0) fs::remove(a.manifest, ec);
  }
  std::vector<fs::path> doomed;
  for (fs::directory_iterator it(dir / "versions", ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!IsTempName(name) && kept.count(name) == 0) doomed.push_back(it->path());
  }
  for (const auto& p : doomed) fs::remove_all(p, ec);
}

}  // namespace receiver_internal
}  // namespace ferry::sync
