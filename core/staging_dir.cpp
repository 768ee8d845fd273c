#include "core/staging_dir.h"

#include <cerrno>
#include <cstdio>

#include "core/mapped_file.h"

namespace ferry {

namespace fs = std::filesystem;

Result<StagingDir> StagingDir::Create(const fs::path& final_path, bool replace_existing) {
  std::error_code ec;
  if (fs::exists(fs::symlink_status(final_path, ec)) && !replace_existing) {
    return Status::AlreadyExists(final_path.string() + ": output already exists (replacing it needs the force option)");
  }
  const fs::path parent = final_path.parent_path().empty() ? fs::path(".") : final_path.parent_path();
  fs::create_directories(parent, ec);
  if (!fs::is_directory(parent, ec))
    return Status::IOError(parent.string() + ": cannot create the output's parent directory");
  StagingDir s;
  s.final_ = final_path;
  s.tmp_ = TempNameFor(final_path);
  if (!fs::create_directory(s.tmp_, ec)) return Status::IOError(s.tmp_.string() + ": " + ec.message());
  s.active_ = true;
  return s;
}

StagingDir::StagingDir(StagingDir&& other) noexcept
    : final_(std::move(other.final_)), tmp_(std::move(other.tmp_)), active_(other.active_) {
  other.active_ = false;
}

StagingDir::~StagingDir() {
  if (!active_) return;
  std::error_code ec;
  fs::remove_all(tmp_, ec);
}

Status StagingDir::Commit() { return CommitFrom(tmp_); }

Status StagingDir::CommitPart(const fs::path& part) { return CommitFrom(tmp_ / part); }

Status StagingDir::CommitFrom(const fs::path& dir) {
  if (!active_) return Status::FailedPrecondition(tmp_.string() + ": staging directory already committed");
  FERRY_RETURN_IF_ERROR(SyncDirectory(dir));
  std::error_code ec;
  fs::path old;
  if (fs::exists(fs::symlink_status(final_, ec))) {
    old = TempNameFor(final_).string() + ".old";
    if (::rename(final_.c_str(), old.c_str()) != 0) return ErrnoStatus(final_.string(), errno);
  }
  if (::rename(dir.c_str(), final_.c_str()) != 0) {
    Status s = ErrnoStatus(final_.string(), errno);
    if (!old.empty()) (void)::rename(old.c_str(), final_.c_str());
    return s;
  }
  active_ = false;
  if (dir != tmp_) fs::remove_all(tmp_, ec);  // the scratch beside the part
  if (!old.empty()) fs::remove_all(old, ec);
  return SyncDirectory(final_.parent_path().empty() ? fs::path(".") : final_.parent_path());
}

}  // namespace ferry
