// Crash test: SIGKILL a writer (tests/store/crash_helper.cpp) at random moments, over and
// over, then check that every version it reported committed is present and verifies, and
// that nothing partial is visible. FERRY_CRASH_ITERATIONS sets the number of kills
// (default 200); FERRY_CRASH_SEED the seed (default 20240611).
#include <chrono>
#include <cstdlib>
#include <map>
#include <random>
#include <set>
#include <thread>

#include <gtest/gtest.h>

#include "store/store.h"
#include "tests/store/test_util.h"

namespace ferry::store {
namespace {

using testing::TempDir;

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::strtoll(v, nullptr, 10) : fallback;
}

TEST(StoreCrash, KilledWritersLoseNothingAcknowledgedAndLeaveNothingPartial) {
  const int64_t iterations = EnvInt("FERRY_CRASH_ITERATIONS", 200);
  std::mt19937 rng(static_cast<uint32_t>(EnvInt("FERRY_CRASH_SEED", 20240611)));
  TempDir tmp;
  const auto db = tmp / "db";
  const auto err = tmp / "stderr.txt";
  const auto start = std::chrono::steady_clock::now();

  std::vector<std::string> acknowledged;
  int64_t kills = 0, early_kills = 0;
  for (int64_t i = 0; i < iterations; ++i) {
    testing::Child child({FERRY_CRASH_HELPER, db.string()}, err);
    std::string line;
    // One kill in eight lands while the store is being opened (recovery included).
    const bool early = rng() % 8 == 0;
    if (!early) {
      ASSERT_TRUE(child.ReadLine(line, 60000)) << "helper did not start: " << testing::ReadFileBytes(err);
      ASSERT_EQ(line, "ready");
    }
    // A random moment: usually mid-import, sometimes between imports.
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % (early ? 20000 : 120000)));
    child.Kill();
    int status = child.Wait();
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
        << "helper exited on its own (status " << status << "): " << testing::ReadFileBytes(err);
    ++kills;
    early_kills += early;
    for (const std::string& l : child.DrainLines()) {
      if (l != "ready") acknowledged.push_back(l);
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  auto opened = Store::Open(db, StoreOptions{});
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  Store& store = **opened;
  auto all = store.ListVersions(std::nullopt);
  ASSERT_TRUE(all.ok()) << all.status().ToString();

  // Every acknowledged id is present.
  std::set<std::string> present;
  for (const auto& r : *all) present.insert(r.id.Hex());
  for (const auto& id : acknowledged) EXPECT_TRUE(present.count(id)) << "acknowledged version " << id << " is lost";

  // Every visible version is whole and verifies; sequences are contiguous per run and each
  // version's parent is its predecessor in the run.
  std::map<std::string, std::vector<const VersionRecord*>> runs;
  for (const auto& r : *all) {
    EXPECT_EQ(r.tensors.size(), 9u) << r.id.Hex();
    EXPECT_EQ(r.aux.size(), 1u) << r.id.Hex();
    runs[r.run].push_back(&r);
  }
  for (auto& [run, list] : runs) {
    std::sort(list.begin(), list.end(), [](auto* a, auto* b) { return a->sequence < b->sequence; });
    for (size_t i = 0; i < list.size(); ++i) {
      EXPECT_EQ(list[i]->sequence, i + 1) << "run " << run;
      if (i == 0) {
        EXPECT_FALSE(list[i]->parent.has_value());
      } else {
        EXPECT_EQ(list[i]->parent, list[i - 1]->id) << "run " << run << " sequence " << i + 1;
      }
    }
    auto latest = store.Latest(run);
    ASSERT_TRUE(latest.ok() && latest->has_value());
    EXPECT_EQ(**latest, list.back()->id);
  }
  auto reports = store.Verify(std::nullopt);
  ASSERT_TRUE(reports.ok()) << reports.status().ToString();
  ASSERT_EQ(reports->size(), all->size());
  for (const auto& rep : *reports) {
    EXPECT_TRUE(rep.ok()) << rep.version.Hex() << ": " << rep.missing.size() << " missing, " << rep.corrupted.size()
                          << " corrupted";
  }
  // The helper's steps are deterministic: versions are 1..N in creation order.
  std::set<int64_t> steps;
  for (const auto& r : *all) steps.insert(r.step.value_or(-1));
  EXPECT_EQ(static_cast<int64_t>(steps.size()), static_cast<int64_t>(all->size()));
  EXPECT_EQ(*steps.begin(), 1);
  EXPECT_EQ(*steps.rbegin(), static_cast<int64_t>(all->size()));

  // Orphans left by the kills go with gc; nothing visible is removed by a generous keep.
  auto removed = store.GarbageCollect(1'000'000);
  ASSERT_TRUE(removed.ok()) << removed.status().ToString();
  EXPECT_EQ(*removed, 0);
  auto after = store.Verify(std::nullopt);
  ASSERT_TRUE(after.ok());
  for (const auto& rep : *after) EXPECT_TRUE(rep.ok()) << rep.version.Hex();

  std::printf("crash test: %lld kills (%lld during open), %zu versions committed, %zu acknowledged, %.1f s\n",
              static_cast<long long>(kills), static_cast<long long>(early_kills), all->size(), acknowledged.size(),
              seconds);
  EXPECT_GT(acknowledged.size(), static_cast<size_t>(iterations / 4)) << "the kills left too little progress to test";
}

}  // namespace
}  // namespace ferry::store
