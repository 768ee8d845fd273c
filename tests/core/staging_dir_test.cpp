// StagingDir (core/staging_dir.h): an output built under a temporary name and renamed into
// place whole, or not at all.
#include "core/staging_dir.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "tests/temp_dir.h"

namespace ferry {
namespace {

namespace fs = std::filesystem;

void WriteText(const fs::path& p, const std::string& text) { std::ofstream(p) << text; }

std::string ReadText(const fs::path& p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Names in `dir`, sorted.
std::vector<std::string> Names(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// DIR/out, an earlier output holding old.txt.
fs::path EarlierOutput(const fs::path& dir) {
  const fs::path out = dir / "out";
  fs::create_directory(out);
  WriteText(out / "old.txt", "old");
  return out;
}

TEST(StagingDir, CommitRenamesTheWholeDirectoryIntoPlace) {
  testing::ScopedTempDir tmp;
  const fs::path out = tmp.path() / "out";
  auto staging = StagingDir::Create(out, /*replace_existing=*/false);
  ASSERT_TRUE(staging.ok()) << staging.status().ToString();
  EXPECT_EQ(staging->path().parent_path(), tmp.path());
  WriteText(staging->path() / "a.txt", "a");
  EXPECT_FALSE(fs::exists(out));
  ASSERT_TRUE(staging->Commit().ok());
  EXPECT_EQ(ReadText(out / "a.txt"), "a");
  EXPECT_EQ(Names(tmp.path()), std::vector<std::string>{"out"});
  EXPECT_EQ(staging->Commit().code(), StatusCode::kFailedPrecondition);
}

TEST(StagingDir, RefusesAnExistingOutputUnlessReplacing) {
  testing::ScopedTempDir tmp;
  const fs::path out = EarlierOutput(tmp.path());
  EXPECT_EQ(StagingDir::Create(out, /*replace_existing=*/false).status().code(), StatusCode::kAlreadyExists);
  auto staging = StagingDir::Create(out, /*replace_existing=*/true);
  ASSERT_TRUE(staging.ok()) << staging.status().ToString();
  WriteText(staging->path() / "new.txt", "new");
  ASSERT_TRUE(staging->Commit().ok());
  EXPECT_EQ(Names(out), std::vector<std::string>{"new.txt"});
  EXPECT_EQ(Names(tmp.path()), std::vector<std::string>{"out"});
}

TEST(StagingDir, CommitPartKeepsOnlyThePartAndRemovesTheScratch) {
  testing::ScopedTempDir tmp;
  const fs::path out = EarlierOutput(tmp.path());
  auto staging = StagingDir::Create(out, /*replace_existing=*/true);
  ASSERT_TRUE(staging.ok()) << staging.status().ToString();
  fs::create_directories(staging->path() / "scratch");
  WriteText(staging->path() / "scratch" / "input.txt", "input");
  fs::create_directories(staging->path() / "result");
  WriteText(staging->path() / "result" / "merged.txt", "merged");
  ASSERT_TRUE(staging->CommitPart("result").ok());
  EXPECT_EQ(Names(out), std::vector<std::string>{"merged.txt"});
  EXPECT_EQ(ReadText(out / "merged.txt"), "merged");
  EXPECT_EQ(Names(tmp.path()), std::vector<std::string>{"out"});  // no scratch, no old output left
}

TEST(StagingDir, CommitPartOfAMissingPartLeavesTheOutputAsItWas) {
  testing::ScopedTempDir tmp;
  const fs::path out = EarlierOutput(tmp.path());
  {
    auto staging = StagingDir::Create(out, /*replace_existing=*/true);
    ASSERT_TRUE(staging.ok()) << staging.status().ToString();
    EXPECT_EQ(staging->CommitPart("result").code(), StatusCode::kNotFound);
    EXPECT_EQ(Names(out), std::vector<std::string>{"old.txt"});
  }
  EXPECT_EQ(Names(tmp.path()), std::vector<std::string>{"out"});  // the staging directory went with it
}

TEST(StagingDir, AnUncommittedDirectoryIsRemoved) {
  testing::ScopedTempDir tmp;
  const fs::path out = tmp.path() / "sub" / "out";
  {
    auto staging = StagingDir::Create(out, /*replace_existing=*/false);
    ASSERT_TRUE(staging.ok()) << staging.status().ToString();
    WriteText(staging->path() / "a.txt", "a");
  }
  EXPECT_TRUE(Names(tmp.path() / "sub").empty());
}

}  // namespace
}  // namespace ferry
