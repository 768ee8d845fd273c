// Assertions shared by the sync tests.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "store/store.h"
#include "sync/receiver.h"

namespace ferry::sync {

// Checks that DIR/current points at versions/<v>, that the files it holds hash to `v`
// (store::HashPath, independent of the receiver's own bookkeeping) and that no temporary
// version directory (".tmp-") is left in DIR/versions. `record`, when given, receives the
// hashed record (for further checks by the caller).
inline void ExpectActiveVersion(const std::filesystem::path& dir, const store::Digest& v,
                                store::VersionRecord* record = nullptr) {
  auto active = ActiveVersion(dir);
  ASSERT_TRUE(active.ok()) << active.status().message();
  ASSERT_TRUE(active->has_value()) << dir << ": no current version";
  EXPECT_EQ(**active, v);
  auto rec = store::HashPath(dir / "current");
  ASSERT_TRUE(rec.ok()) << rec.status().message();
  EXPECT_EQ(rec->id, v);
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir / "versions", ec), end; !ec && it != end; it.increment(ec)) {
    EXPECT_EQ(it->path().filename().string().find(".tmp-"), std::string::npos) << "left behind: " << it->path();
  }
  if (record != nullptr) *record = std::move(*rec);
}

}  // namespace ferry::sync
