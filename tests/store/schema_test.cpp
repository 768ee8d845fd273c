// The store's schema row: a store written before small objects (schema "1") is read as it
// is and relabelled "2" only when opened for writing; a schema this Ferry does not know is
// refused. The row is set with RocksDB directly, as an older or newer Ferry would leave it.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include <rocksdb/db.h>

#include "core/checkpoint.h"
#include "store/store.h"
#include "tests/store/test_util.h"

namespace ferry::store {
namespace {

namespace fs = std::filesystem;
using testing::Patterned;
using testing::TempDir;

// Opens the store's RocksDB with every column family (the store must be closed).
std::unique_ptr<rocksdb::DB> OpenRaw(const fs::path& db, std::vector<rocksdb::ColumnFamilyHandle*>* handles) {
  const std::string path = (db / "rocksdb").string();
  std::vector<std::string> names;
  rocksdb::Status s = rocksdb::DB::ListColumnFamilies(rocksdb::DBOptions(), path, &names);
  EXPECT_TRUE(s.ok()) << s.ToString();
  std::vector<rocksdb::ColumnFamilyDescriptor> cfs;
  for (const auto& n : names) cfs.emplace_back(n, rocksdb::ColumnFamilyOptions());
  rocksdb::DB* raw = nullptr;
  s = rocksdb::DB::Open(rocksdb::DBOptions(), path, cfs, handles, &raw);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return std::unique_ptr<rocksdb::DB>(raw);
}

void CloseRaw(std::unique_ptr<rocksdb::DB> db, std::vector<rocksdb::ColumnFamilyHandle*>& handles) {
  for (auto* h : handles) EXPECT_TRUE(db->DestroyColumnFamilyHandle(h).ok());
  EXPECT_TRUE(db->Close().ok());
}

void SetSchema(const fs::path& db, const std::string& schema) {
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  auto raw = OpenRaw(db, &handles);
  ASSERT_NE(raw, nullptr);
  rocksdb::WriteOptions wo;
  wo.sync = true;
  EXPECT_TRUE(raw->Put(wo, "schema", schema).ok());
  CloseRaw(std::move(raw), handles);
}

std::string Schema(const fs::path& db) {
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  auto raw = OpenRaw(db, &handles);
  if (raw == nullptr) return "";
  std::string value;
  EXPECT_TRUE(raw->Get(rocksdb::ReadOptions(), "schema", &value).ok());
  CloseRaw(std::move(raw), handles);
  return value;
}

Checkpoint Version(uint32_t seed) {
  return Checkpoint::FromTensors("v" + std::to_string(seed), {{"w.weight", Patterned(DType::kF32, {16, 16}, seed)},
                                                              {"b.bias", Patterned(DType::kF32, {16}, seed + 1)}});
}

void ExpectVerifies(Store& st) {
  auto reports = st.Verify(std::nullopt);
  ASSERT_TRUE(reports.ok()) << reports.status().ToString();
  for (const auto& r : *reports) EXPECT_TRUE(r.ok()) << r.version.Hex();
}

TEST(StoreSchemaTest, SchemaOneIsReadAsItIsAndRelabelledWhenOpenedForWriting) {
  TempDir tmp;
  const fs::path db = tmp.path() / "db";
  Digest old_id;
  {
    // What a schema-"1" Ferry wrote: every object a file.
    StoreOptions so;
    so.create_if_missing = true;
    so.small_object_bytes = 0;
    auto st = Store::Open(db, so);
    ASSERT_TRUE(st.ok()) << st.status().ToString();
    auto r = (*st)->ImportCheckpoint(Version(1), {}, ImportOptions{});
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    old_id = r->record.id;
  }
  SetSchema(db, "1");
  ASSERT_EQ(Schema(db), "1");
  {
    StoreOptions ro;
    ro.read_only = true;
    auto st = Store::Open(db, ro);
    ASSERT_TRUE(st.ok()) << st.status().ToString();
    auto v = (*st)->GetVersion(old_id.Hex());
    ASSERT_TRUE(v.ok()) << v.status().ToString();
    ExpectVerifies(**st);
  }
  EXPECT_EQ(Schema(db), "1") << "a reader must not relabel the store";
  Digest new_id;
  {
    auto st = Store::Open(db, StoreOptions{});  // small objects on: they need schema 2
    ASSERT_TRUE(st.ok()) << st.status().ToString();
    auto r = (*st)->ImportCheckpoint(Version(2), {}, ImportOptions{});
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    new_id = r->record.id;
  }
  EXPECT_EQ(Schema(db), "2");
  StoreOptions ro;
  ro.read_only = true;
  auto st = Store::Open(db, ro);
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  for (const Digest& id : {old_id, new_id}) {
    auto v = (*st)->GetVersion(id.Hex());
    ASSERT_TRUE(v.ok()) << v.status().ToString();
    for (const auto& row : v->tensors) {
      auto t = (*st)->ReadTensor(row, /*verify=*/true);
      EXPECT_TRUE(t.ok()) << row.name << ": " << t.status().ToString();
    }
  }
  ExpectVerifies(**st);
}

TEST(StoreSchemaTest, UnknownSchemaIsUnsupportedNamingItAndTheStore) {
  TempDir tmp;
  const fs::path db = tmp.path() / "db";
  {
    StoreOptions so;
    so.create_if_missing = true;
    ASSERT_TRUE(Store::Open(db, so).ok());
  }
  SetSchema(db, "3");
  for (bool read_only : {false, true}) {
    StoreOptions o;
    o.read_only = read_only;
    auto st = Store::Open(db, o);
    ASSERT_FALSE(st.ok()) << "read_only=" << read_only;
    EXPECT_EQ(st.status().code(), StatusCode::kUnsupported) << st.status().ToString();
    EXPECT_NE(st.status().message().find("schema version 3"), std::string::npos) << st.status().ToString();
    EXPECT_NE(st.status().message().find(db.string()), std::string::npos) << st.status().ToString();
  }
  EXPECT_EQ(Schema(db), "3") << "a refused store is left as it is";
}

// An event record that does not decode (a disk fault, a hand edit) is an error naming the
// record by its key, the time and counter it was added under, and the store.
TEST(StoreSchemaTest, AnEventRecordThatDoesNotDecodeIsNamedByItsKey) {
  TempDir tmp;
  const fs::path db = tmp.path() / "db";
  {
    StoreOptions so;
    so.create_if_missing = true;
    auto st = Store::Open(db, so);
    ASSERT_TRUE(st.ok());
    Event e;
    e.type = Event::Type::kPublished;
    e.time_ns = 1000;
    ASSERT_TRUE((*st)->AddEvent(e).ok());
  }
  {
    std::vector<rocksdb::ColumnFamilyHandle*> handles;
    auto raw = OpenRaw(db, &handles);
    ASSERT_NE(raw, nullptr);
    rocksdb::ColumnFamilyHandle* events = nullptr;
    for (auto* h : handles) {
      if (h->GetName() == "events") events = h;
    }
    ASSERT_NE(events, nullptr);
    std::string key;  // time 1234 ns, counter 7: 8 bytes each, big-endian
    for (uint64_t v : {uint64_t{1234}, uint64_t{7}}) {
      for (int i = 7; i >= 0; --i) key.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
    }
    EXPECT_TRUE(raw->Put(rocksdb::WriteOptions(), events, key, "{not json").ok());
    CloseRaw(std::move(raw), handles);
  }
  auto st = Store::Open(db, {});
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  auto listed = (*st)->ListEvents(std::nullopt);
  ASSERT_FALSE(listed.ok());
  EXPECT_EQ(listed.status().code(), StatusCode::kCorruption);
  EXPECT_NE(listed.status().message().find("the event record with key (time 1234 ns, counter 7): "), std::string::npos)
      << listed.status().ToString();
  EXPECT_NE(listed.status().message().find(db.string()), std::string::npos) << listed.status().ToString();
}

}  // namespace
}  // namespace ferry::store
