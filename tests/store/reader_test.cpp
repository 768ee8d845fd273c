// Readers open the store as a RocksDB secondary while a writer holds it: a writer in
// another process (tests/store/crash_helper.cpp, stepped through stdin) and a second Store
// object in this process.
#include <gtest/gtest.h>

#include "store/store.h"
#include "tests/store/test_util.h"

namespace ferry::store {
namespace {

using testing::TempDir;

TEST(StoreReader, SeesEveryVersionAWriterProcessCommittedWhileItHoldsTheStore) {
  TempDir tmp;
  const auto db = tmp / "db";
  testing::Child writer({FERRY_CRASH_HELPER, db.string(), "--count", "4", "--step"}, tmp / "stderr.txt");
  std::string line;
  ASSERT_TRUE(writer.ReadLine(line, 30000)) << testing::ReadFileBytes(tmp / "stderr.txt");
  ASSERT_EQ(line, "ready");

  StoreOptions ro;
  ro.read_only = true;
  std::unique_ptr<Store> reader;
  std::vector<std::string> committed;
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(writer.ReadLine(line, 30000)) << testing::ReadFileBytes(tmp / "stderr.txt");
    committed.push_back(line);
    if (!reader) {  // opened while the writer holds the store
      auto r = Store::Open(db, ro);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      reader = std::move(*r);
      // A writable open is refused while the writer runs.
      auto w = Store::Open(db, StoreOptions{});
      EXPECT_EQ(w.status().code(), StatusCode::kFailedPrecondition);
      EXPECT_TRUE(w.status().message().find(db.string()) != std::string::npos) << w.status().message();
    } else {
      ASSERT_TRUE(reader->Refresh().ok());
    }
    auto list = reader->ListVersions(std::nullopt);
    ASSERT_TRUE(list.ok()) << list.status().ToString();
    ASSERT_EQ(list->size(), committed.size());
    for (size_t j = 0; j < committed.size(); ++j) EXPECT_EQ((*list)[j].id.Hex(), committed[j]);
    auto got = reader->GetVersion(committed.back());
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(got->tensors.size(), 9u);
    auto rep = reader->Verify(got->id);
    ASSERT_TRUE(rep.ok());
    EXPECT_TRUE((*rep)[0].ok());
    writer.WriteLine("next");
  }
  int status = writer.Wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << testing::ReadFileBytes(tmp / "stderr.txt");
  auto runs = reader->ListRuns();
  ASSERT_TRUE(runs.ok());
  EXPECT_EQ(*runs, (std::vector<std::string>{"a", "b"}));
}

TEST(StoreReader, SecondaryInTheSameProcessCatchesUpOnRefresh) {
  TempDir tmp;
  TempDir model;
  testing::WriteModel(model / "m1", {{"w", testing::F32({2}, {1, 2})}});
  testing::WriteModel(model / "m2", {{"w", testing::F32({2}, {1, 3})}});
  StoreOptions rw;
  rw.create_if_missing = true;
  auto writer = Store::Open(tmp / "db", rw);
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  auto v1 = (*writer)->Import(model / "m1", ImportOptions{});
  ASSERT_TRUE(v1.ok());

  StoreOptions ro;
  ro.read_only = true;
  auto reader = Store::Open(tmp / "db", ro);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  auto before = (*reader)->Latest("default");
  ASSERT_TRUE(before.ok() && before->has_value());
  EXPECT_EQ(**before, v1->record.id);

  auto v2 = (*writer)->Import(model / "m2", ImportOptions{});
  ASSERT_TRUE(v2.ok());
  auto stale = (*reader)->ListVersions(std::nullopt);
  ASSERT_TRUE(stale.ok());
  EXPECT_EQ(stale->size(), 1u);  // a secondary sees new commits after Refresh
  ASSERT_TRUE((*reader)->Refresh().ok());
  auto fresh = (*reader)->ListVersions(std::string("default"));
  ASSERT_TRUE(fresh.ok());
  ASSERT_EQ(fresh->size(), 2u);
  EXPECT_EQ((*fresh)[1].id, v2->record.id);
  EXPECT_EQ((*fresh)[1].parent, v1->record.id);
  auto t = (*reader)->ReadTensor((*fresh)[1].tensors[0], true);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->data_as<float>()[1], 3.0f);
}

}  // namespace
}  // namespace ferry::store
