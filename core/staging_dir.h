// StagingDir: build an output directory under a hidden temporary name beside its final
// path, then rename it into place in one step, so a failed or interrupted writer never
// leaves anything that looks whole at the final path.
#pragma once

#include <filesystem>

#include "core/status.h"

namespace ferry {

class StagingDir {
 public:
  // Creates "<parent>/.<name>.tmp-<pid>-<n>" beside `final_path` (creating missing parents).
  // kAlreadyExists naming the path when `final_path` exists and !replace_existing.
  static Result<StagingDir> Create(const std::filesystem::path& final_path, bool replace_existing);

  StagingDir(StagingDir&& other) noexcept;
  StagingDir& operator=(StagingDir&&) = delete;
  StagingDir(const StagingDir&) = delete;
  // Removes the staging directory unless Commit() succeeded.
  ~StagingDir();

  const std::filesystem::path& path() const { return tmp_; }

  // Renames the staging directory to the final path. An existing directory there (only
  // when replace_existing) is moved aside first and deleted after the rename; on failure
  // it is put back. Syncs the parent directory.
  Status Commit();

  // As Commit(), for a staging directory that also holds scratch files beside the output:
  // what becomes the final path is its subdirectory `part` (a relative path), and the rest
  // of the staging directory is removed once `part` is in place.
  Status CommitPart(const std::filesystem::path& part);

 private:
  StagingDir() = default;
  // Commit() and CommitPart(): renames `dir`, the staging directory or a part of it.
  Status CommitFrom(const std::filesystem::path& dir);
  std::filesystem::path final_;
  std::filesystem::path tmp_;
  bool active_ = false;
};

}  // namespace ferry
