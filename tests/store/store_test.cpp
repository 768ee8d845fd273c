// The Store: import with deduplication, commit records, lookups, reads, verification,
// export, events, garbage collection, adapters, and the errors each one reports.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>

#include <gtest/gtest.h>

#include "core/checkpoint.h"
#include "store/internal.h"
#include "store/store.h"
#include "tests/store/test_util.h"

namespace ferry::store {
namespace {

using testing::F32;
using testing::Patterned;
using testing::TempDir;

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

std::filesystem::path ObjectPath(const std::filesystem::path& db, const Digest& d) {
  const std::string hex = d.Hex();
  return db / "objects" / hex.substr(0, 2) / hex.substr(2);
}

const TensorRow& Row(const VersionRecord& r, const std::string& name) {
  auto it = std::find_if(r.tensors.begin(), r.tensors.end(), [&](const TensorRow& t) { return t.name == name; });
  EXPECT_NE(it, r.tensors.end()) << name;
  return *it;
}

class StoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = {{"model.embed_tokens.weight", Patterned(DType::kBF16, {64, 32}, 1)},
             {"model.layers.0.self_attn.q_proj.weight", Patterned(DType::kF32, {32, 32}, 2)},
             {"model.layers.0.self_attn.k_proj.weight", Patterned(DType::kF32, {16, 32}, 3)},
             {"model.layers.0.mlp.up_proj.weight", Patterned(DType::kBF16, {48, 32}, 4)},
             {"model.norm.weight", F32({32}, std::vector<float>(32, 1.0f))}};
    aux_ = {{"config.json", "{\"model_type\": \"llama\"}"}, {"tokenizer.json", "{\"v\": 1}"}};
    testing::WriteModel(tmp_ / "base", base_, aux_);
    db_ = tmp_ / "db";
    StoreOptions so;
    so.create_if_missing = true;
    so.small_object_bytes = small_object_bytes_;
    auto s = Store::Open(db_, so);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    store_ = std::move(*s);
  }

  // The base with `changed` tensors replaced by new contents; written to tmp/<dir>.
  std::filesystem::path FineTune(const std::string& dir, const std::vector<std::string>& changed, uint32_t seed) {
    auto t = base_;
    for (const auto& name : changed) t[name] = Patterned(t[name].dtype(), t[name].shape(), seed++);
    testing::WriteModel(tmp_ / dir, t, aux_);
    return tmp_ / dir;
  }

  // Imports a one-tensor model ("w", F32 of `shape`) whose file is overwritten after "w" is
  // hashed, before its bytes are stored: kCorruption naming it, nothing committed.
  void ImportChangingTheSourceIsRefused(const Shape& shape) {
    testing::WriteModel(tmp_ / "one", {{"w", Patterned(DType::kF32, shape, 9)}});
    const auto file = tmp_ / "one" / "model.safetensors";
    auto opened = SafetensorsFile::Open(file);
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    const uint64_t data_offset = (*opened)->data_offset();
    opened->reset();
    ImportOptions o;
    bool overwritten = false;
    o.progress = [&](uint64_t done, uint64_t total) {
      if (done != total || overwritten) return;  // "w" is hashed; its bytes are not yet copied
      std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(static_cast<std::streamoff>(data_offset + 100));
      f.write("\x7f\x7f\x7f\x7f", 4);
      overwritten = true;
    };
    auto r = store_->Import(tmp_ / "one", o);
    ASSERT_TRUE(overwritten);
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption);
    EXPECT_TRUE(Contains(r.status().message(), "tensor 'w' changed while it was being stored")) << r.status().message();
  }

  ImportResult MustImport(const std::filesystem::path& p, const ImportOptions& o = {}) {
    auto r = store_->Import(p, o);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : ImportResult{};
  }

  // Every object a file: these tests look at the object files (SmallObjectTest below keeps
  // the default, under which this fixture's tensors are all small).
  uint64_t small_object_bytes_ = 0;
  TempDir tmp_;
  std::map<std::string, Tensor> base_;
  std::map<std::string, std::string> aux_;
  std::filesystem::path db_;
  std::unique_ptr<Store> store_;
};

uint64_t Sum(const std::map<std::string, Tensor>& m) {
  uint64_t s = 0;
  for (const auto& [n, t] : m) s += t.nbytes();
  return s;
}

TEST(StoreOpen, MissingStoreIsNotFoundNamingTheDirectory) {
  TempDir tmp;
  auto s = Store::Open(tmp / "nope", StoreOptions{});
  EXPECT_EQ(s.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(s.status().message(), (tmp / "nope").string())) << s.status().message();
  EXPECT_FALSE(std::filesystem::exists(tmp / "nope"));
  StoreOptions ro;
  ro.read_only = true;
  auto r = Store::Open(tmp / "nope", ro);
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
}

TEST_F(StoreTest, FirstImportStoresEveryTensorOnceWithItsRecord) {
  ImportOptions o;
  o.step = 100;
  o.metrics = {{"reward_mean", 0.25}};
  ImportResult r = MustImport(tmp_ / "base", o);
  EXPECT_FALSE(r.already_present);
  const uint64_t aux_bytes = aux_["config.json"].size() + aux_["tokenizer.json"].size();
  EXPECT_EQ(r.bytes_written, Sum(base_) + aux_bytes);
  EXPECT_EQ(r.objects_written, 7);
  const VersionRecord& v = r.record;
  EXPECT_EQ(v.run, "default");
  EXPECT_EQ(v.sequence, 1u);
  EXPECT_FALSE(v.parent.has_value());
  EXPECT_EQ(v.kind, VersionKind::kFull);
  EXPECT_EQ(v.source, VersionSource::kImport);
  EXPECT_EQ(v.step, 100);
  EXPECT_EQ(v.total_bytes, Sum(base_));
  ASSERT_EQ(v.tensors.size(), base_.size());
  EXPECT_TRUE(std::is_sorted(v.tensors.begin(), v.tensors.end(),
                             [](const TensorRow& a, const TensorRow& b) { return a.name < b.name; }));
  for (const auto& [name, t] : base_) {
    const TensorRow& row = Row(v, name);
    EXPECT_EQ(row.digest, TensorDigest(t)) << name;
    EXPECT_EQ(row.nbytes, t.nbytes());
    // Raw bytes only, no header, under objects/ab/<rest>.
    std::string on_disk = testing::ReadFileBytes(ObjectPath(db_, row.digest));
    EXPECT_EQ(on_disk, std::string(reinterpret_cast<const char*>(t.data()), t.nbytes())) << name;
  }
  EXPECT_DOUBLE_EQ(Row(v, "model.norm.weight").l2_norm, std::sqrt(32.0));
  ASSERT_EQ(v.aux.size(), 2u);
  EXPECT_EQ(v.aux[0].name, "config.json");

  // The record as read back (after reopening) equals the one returned.
  store_.reset();
  auto s = Store::Open(db_, StoreOptions{});
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  auto got = (*s)->GetVersion(v.id.Hex());
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->id, v.id);
  EXPECT_EQ(got->step, 100);
  EXPECT_EQ(got->metrics.at("reward_mean"), 0.25);
  EXPECT_EQ(got->time_ns, v.time_ns);
  ASSERT_EQ(got->tensors.size(), v.tensors.size());
  for (size_t i = 0; i < v.tensors.size(); ++i) {
    EXPECT_EQ(got->tensors[i].name, v.tensors[i].name);
    EXPECT_EQ(got->tensors[i].digest, v.tensors[i].digest);
    EXPECT_EQ(got->tensors[i].shape, v.tensors[i].shape);
    EXPECT_EQ(got->tensors[i].dtype, v.tensors[i].dtype);
    EXPECT_DOUBLE_EQ(got->tensors[i].l2_norm, v.tensors[i].l2_norm);
  }
  auto hashed = HashPath(tmp_ / "base");
  ASSERT_TRUE(hashed.ok());
  EXPECT_EQ(hashed->id, v.id);
}

TEST_F(StoreTest, SecondImportOfTheSameModelWritesNothing) {
  ImportResult first = MustImport(tmp_ / "base");
  ImportResult again = MustImport(tmp_ / "base");
  EXPECT_TRUE(again.already_present);
  EXPECT_EQ(again.bytes_written, 0u);
  EXPECT_EQ(again.objects_written, 0);
  EXPECT_EQ(again.record.id, first.record.id);
  EXPECT_EQ(again.record.sequence, 1u);
  auto all = store_->ListVersions(std::nullopt);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), 1u);
}

// A source file overwritten between hashing and copying: the copy is hashed back from the
// object file before it gets its digest's name, so nothing is stored under a wrong name and
// nothing is committed.
TEST_F(StoreTest, SourceChangedAfterHashingIsRefusedAndLeavesNoObject) {
  ImportChangingTheSourceIsRefused({64, 256});
  auto all = store_->ListVersions(std::nullopt);
  ASSERT_TRUE(all.ok());
  EXPECT_TRUE(all->empty());
  for (const auto& e : std::filesystem::recursive_directory_iterator(db_ / "objects")) {
    EXPECT_FALSE(e.is_regular_file()) << "left behind: " << e.path();
  }
}

TEST_F(StoreTest, FineTuneWritesOnlyTheChangedTensorsAndChainsToTheParent) {
  ImportResult v1 = MustImport(tmp_ / "base");
  const std::vector<std::string> changed = {"model.layers.0.self_attn.q_proj.weight",
                                            "model.layers.0.mlp.up_proj.weight"};
  ImportResult v2 = MustImport(FineTune("ft", changed, 50));
  EXPECT_FALSE(v2.already_present);
  EXPECT_EQ(v2.bytes_written, base_[changed[0]].nbytes() + base_[changed[1]].nbytes());  // 4096 + 3072
  EXPECT_EQ(v2.bytes_written, 4096u + 3072u);
  EXPECT_EQ(v2.objects_written, 2);
  EXPECT_EQ(v2.record.sequence, 2u);
  ASSERT_TRUE(v2.record.parent.has_value());
  EXPECT_EQ(*v2.record.parent, v1.record.id);
  EXPECT_NE(v2.record.id, v1.record.id);
  // Unchanged tensors share their objects.
  EXPECT_EQ(Row(v2.record, "model.norm.weight").digest, Row(v1.record, "model.norm.weight").digest);

  auto latest = store_->Latest("default");
  ASSERT_TRUE(latest.ok());
  ASSERT_TRUE(latest->has_value());
  EXPECT_EQ(**latest, v2.record.id);
  auto none = store_->Latest("other");
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());

  // A separate run numbers from 1; an explicit parent is kept.
  ImportOptions o;
  o.run = "exp-2";
  o.parent = v1.record.id;
  ImportResult v3 = MustImport(FineTune("ft3", {"model.norm.weight"}, 90), o);
  EXPECT_EQ(v3.record.run, "exp-2");
  EXPECT_EQ(v3.record.sequence, 1u);
  EXPECT_EQ(*v3.record.parent, v1.record.id);
  auto runs = store_->ListRuns();
  ASSERT_TRUE(runs.ok());
  EXPECT_EQ(*runs, (std::vector<std::string>{"default", "exp-2"}));
  auto in_run = store_->ListVersions(std::string("default"));
  ASSERT_TRUE(in_run.ok());
  ASSERT_EQ(in_run->size(), 2u);
  EXPECT_EQ((*in_run)[0].id, v1.record.id);
  EXPECT_EQ((*in_run)[1].id, v2.record.id);
  auto all = store_->ListVersions(std::nullopt);
  ASSERT_TRUE(all.ok());
  ASSERT_EQ(all->size(), 3u);
  EXPECT_EQ((*all)[2].id, v3.record.id);                  // oldest first
  auto empty = store_->ListVersions(std::string("exp"));  // a prefix of a run is not a run
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());
}

TEST_F(StoreTest, ImportRejectsBadRunsAndUnknownParents) {
  ImportOptions o;
  o.run = "";
  auto r = store_->Import(tmp_ / "base", o);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(r.status().message(), "run name is empty")) << r.status().message();
  o.run = std::string("a\0b", 3);
  r = store_->Import(tmp_ / "base", o);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(r.status().message(), "control character")) << r.status().message();
  o.run = "ok";
  o.parent = Digest{1, 2};
  r = store_->Import(tmp_ / "base", o);
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(r.status().message(), Digest{1, 2}.Hex())) << r.status().message();
  auto missing = store_->Import(tmp_ / "no-such-model", ImportOptions{});
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(missing.status().message(), "no-such-model")) << missing.status().message();
  auto all = store_->ListVersions(std::nullopt);
  ASSERT_TRUE(all.ok());
  EXPECT_TRUE(all->empty());
}

TEST_F(StoreTest, GetVersionByPrefix) {
  ImportResult v1 = MustImport(tmp_ / "base");
  const std::string hex = v1.record.id.Hex();
  auto by_prefix = store_->GetVersion(hex.substr(0, 8));
  ASSERT_TRUE(by_prefix.ok()) << by_prefix.status().ToString();
  EXPECT_EQ(by_prefix->id, v1.record.id);
  std::string upper = hex.substr(0, 7);
  std::transform(upper.begin(), upper.end(), upper.begin(), ::toupper);
  EXPECT_TRUE(store_->GetVersion(upper).ok());

  auto too_short = store_->GetVersion(hex.substr(0, 5));
  EXPECT_EQ(too_short.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(too_short.status().message(), "too short")) << too_short.status().message();
  auto not_hex = store_->GetVersion("zz12345");
  EXPECT_EQ(not_hex.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(not_hex.status().message(), "'zz12345'"));
  Digest other = v1.record.id;
  other.lo ^= 1;
  auto absent = store_->GetVersion(other.Hex());
  EXPECT_EQ(absent.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(absent.status().message(), other.Hex())) << absent.status().message();
  EXPECT_TRUE(Contains(absent.status().message(), db_.string())) << absent.status().message();
  std::string wrong_prefix = hex.substr(0, 6);
  wrong_prefix[5] = wrong_prefix[5] == '0' ? '1' : '0';
  auto no_match = store_->GetVersion(wrong_prefix);
  EXPECT_EQ(no_match.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(no_match.status().message(), wrong_prefix));
}

TEST_F(StoreTest, ReadTensorAndAuxReturnTheImportedBytes) {
  ImportResult v1 = MustImport(tmp_ / "base");
  for (const TensorRow& row : v1.record.tensors) {
    auto t = store_->ReadTensor(row, /*verify=*/true);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_EQ(t->dtype(), row.dtype);
    EXPECT_EQ(t->shape(), row.shape);
    const Tensor& want = base_[row.name];
    ASSERT_EQ(t->nbytes(), want.nbytes());
    EXPECT_EQ(std::memcmp(t->data(), want.data(), want.nbytes()), 0) << row.name;
  }
  auto cfg = store_->ReadAux(v1.record.aux[0]);
  ASSERT_TRUE(cfg.ok());
  EXPECT_EQ(*cfg, aux_["config.json"]);
}

TEST_F(StoreTest, FlippedByteIsReportedForExactlyThatTensorAndVersion) {
  ImportResult v1 = MustImport(tmp_ / "base");
  const std::string victim = "model.layers.0.self_attn.k_proj.weight";
  ImportResult v2 = MustImport(FineTune("ft", {victim}, 70));
  auto clean = store_->Verify(std::nullopt);
  ASSERT_TRUE(clean.ok());
  ASSERT_EQ(clean->size(), 2u);
  for (const auto& rep : *clean) EXPECT_TRUE(rep.ok());

  const TensorRow& row = Row(v2.record, victim);
  const auto obj = ObjectPath(db_, row.digest);
  {
    std::fstream f(obj, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(1000);
    char c;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x10);
    f.seekp(1000);
    f.write(&c, 1);
  }
  auto reports = store_->Verify(std::nullopt);
  ASSERT_TRUE(reports.ok());
  ASSERT_EQ(reports->size(), 2u);
  for (const auto& rep : *reports) {
    if (rep.version == v1.record.id) {
      EXPECT_TRUE(rep.ok()) << "v1 does not hold the flipped object";
    } else {
      EXPECT_EQ(rep.version, v2.record.id);
      EXPECT_EQ(rep.corrupted, std::vector<std::string>{victim});
      EXPECT_TRUE(rep.missing.empty());
    }
  }
  auto one = store_->Verify(v2.record.id);
  ASSERT_TRUE(one.ok());
  ASSERT_EQ(one->size(), 1u);
  EXPECT_EQ((*one)[0].corrupted, std::vector<std::string>{victim});

  auto t = store_->ReadTensor(row, /*verify=*/true);
  EXPECT_EQ(t.status().code(), StatusCode::kCorruption);
  EXPECT_TRUE(Contains(t.status().message(), "'" + victim + "'")) << t.status().message();
  EXPECT_TRUE(Contains(t.status().message(), v2.record.id.Hex())) << t.status().message();
  EXPECT_TRUE(Contains(t.status().message(), obj.string())) << t.status().message();
  EXPECT_TRUE(store_->ReadTensor(row, /*verify=*/false).ok());  // unverified reads trust the file

  // Export checks digests as it copies: nothing appears at out.
  Status e = store_->Export(v2.record.id, tmp_ / "out", false);
  EXPECT_EQ(e.code(), StatusCode::kCorruption);
  EXPECT_TRUE(Contains(e.message(), "'" + victim + "'")) << e.message();
  EXPECT_FALSE(std::filesystem::exists(tmp_ / "out"));
  for (const auto& entry : std::filesystem::directory_iterator(tmp_.path())) {
    EXPECT_EQ(entry.path().filename().string().find(".out.tmp"), std::string::npos) << entry.path();
  }

  std::filesystem::remove(ObjectPath(db_, Row(v1.record, "model.norm.weight").digest));
  auto gone = store_->Verify(v1.record.id);
  ASSERT_TRUE(gone.ok());
  EXPECT_EQ((*gone)[0].missing, std::vector<std::string>{"model.norm.weight"});
  EXPECT_TRUE((*gone)[0].corrupted.empty());
  auto read_gone = store_->ReadTensor(Row(v1.record, "model.norm.weight"), false);
  EXPECT_EQ(read_gone.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(read_gone.status().message(), "'model.norm.weight'")) << read_gone.status().message();

  // Re-importing heals a missing object.
  ImportResult heal = MustImport(tmp_ / "base");
  EXPECT_TRUE(heal.already_present);
  EXPECT_EQ(heal.bytes_written, 128u);
  auto healed = store_->Verify(v1.record.id);
  ASSERT_TRUE(healed.ok());
  EXPECT_TRUE((*healed)[0].ok());
}

TEST_F(StoreTest, VerifyReportsCorruptedAuxFilesByName) {
  ImportResult v1 = MustImport(tmp_ / "base");
  const auto& a = v1.record.aux[1];  // tokenizer.json
  const std::string hex = a.digest.Hex();
  std::ofstream(db_ / "aux" / hex.substr(0, 2) / hex.substr(2), std::ios::binary) << "{\"v\": 2}";
  auto rep = store_->Verify(v1.record.id);
  ASSERT_TRUE(rep.ok());
  EXPECT_EQ((*rep)[0].corrupted, std::vector<std::string>{"tokenizer.json"});
  auto read = store_->ReadAux(a);
  EXPECT_EQ(read.status().code(), StatusCode::kCorruption);
  EXPECT_TRUE(Contains(read.status().message(), "'tokenizer.json'")) << read.status().message();
}

TEST_F(StoreTest, ExportWritesALoadableDirectoryAtomically) {
  ImportResult v1 = MustImport(tmp_ / "base");
  const auto out = tmp_ / "exported";
  ASSERT_TRUE(store_->Export(v1.record.id, out, false).ok());
  auto ckpt = Checkpoint::Open(out);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  EXPECT_TRUE(std::filesystem::exists(out / "model.safetensors"));
  ASSERT_EQ(ckpt->names().size(), base_.size());
  for (const auto& [name, t] : base_) {
    auto got = ckpt->Get(name);
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(got->dtype(), t.dtype());
    EXPECT_EQ(got->shape(), t.shape());
    EXPECT_EQ(std::memcmp(got->data(), t.data(), t.nbytes()), 0) << name;
  }
  for (const auto& [name, contents] : aux_) EXPECT_EQ(testing::ReadFileBytes(out / name), contents) << name;
  // The export hashes to the same version id.
  auto again = HashPath(out);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->id, v1.record.id);

  Status exists = store_->Export(v1.record.id, out, false);
  EXPECT_EQ(exists.code(), StatusCode::kAlreadyExists);
  EXPECT_TRUE(Contains(exists.message(), out.string())) << exists.message();
  std::ofstream(out / "stale.txt") << "x";
  ASSERT_TRUE(store_->Export(v1.record.id, out, true).ok());
  EXPECT_FALSE(std::filesystem::exists(out / "stale.txt"));
  EXPECT_TRUE(std::filesystem::exists(out / "model.safetensors"));

  Status unknown = store_->Export(Digest{3, 4}, tmp_ / "x", false);
  EXPECT_EQ(unknown.code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(unknown.message(), Digest{3, 4}.Hex()));
  // Missing parent directories are created (as every Ferry command that writes a directory does).
  Status nested = store_->Export(v1.record.id, tmp_ / "no" / "such" / "dir", false);
  EXPECT_TRUE(nested.ok()) << nested.ToString();
  EXPECT_TRUE(std::filesystem::exists(tmp_ / "no" / "such" / "dir" / "model.safetensors"));
  // A parent that is a file cannot be created: kIOError naming it.
  std::ofstream(tmp_ / "plainfile") << "x";
  Status blocked = store_->Export(v1.record.id, tmp_ / "plainfile" / "dir", false);
  EXPECT_EQ(blocked.code(), StatusCode::kIOError);
  EXPECT_TRUE(Contains(blocked.message(), (tmp_ / "plainfile").string())) << blocked.message();
}

TEST_F(StoreTest, AdapterDirectoriesBecomeAdapterVersions) {
  const std::string cfg = "{\"peft_type\": \"LORA\", \"r\": 4}";
  testing::WriteModel(tmp_ / "adapter",
                      {{"base_model.model.q_proj.lora_A.weight", Patterned(DType::kF32, {4, 32}, 9)},
                       {"base_model.model.q_proj.lora_B.weight", Patterned(DType::kF32, {32, 4}, 10)}},
                      {{"adapter_config.json", cfg}}, "adapter_model.safetensors");
  ImportResult base = MustImport(tmp_ / "base");
  ImportOptions o;
  o.run = "adapters";
  o.base_version = base.record.id;
  ImportResult a = MustImport(tmp_ / "adapter", o);
  EXPECT_EQ(a.record.kind, VersionKind::kAdapter);
  EXPECT_EQ(a.record.adapter_config, cfg);
  EXPECT_EQ(a.record.base_version, base.record.id);
  auto hashed = HashPath(tmp_ / "adapter");
  ASSERT_TRUE(hashed.ok());
  EXPECT_EQ(hashed->kind, VersionKind::kAdapter);
  EXPECT_EQ(hashed->id, a.record.id);
  ASSERT_TRUE(store_->Export(a.record.id, tmp_ / "adapter-out", false).ok());
  EXPECT_TRUE(std::filesystem::exists(tmp_ / "adapter-out" / "adapter_model.safetensors"));
  EXPECT_EQ(testing::ReadFileBytes(tmp_ / "adapter-out" / "adapter_config.json"), cfg);
}

// An adapter directory recorded as a model (or a model recorded as an adapter) would later
// be merged onto, or merged, as the wrong thing: refused, naming the path, nothing stored.
TEST_F(StoreTest, ImportRefusesAKindThatContradictsTheDirectory) {
  testing::WriteModel(tmp_ / "adapter", {{"base_model.model.q_proj.lora_A.weight", Patterned(DType::kF32, {4, 32}, 9)}},
                      {{"adapter_config.json", "{\"peft_type\": \"LORA\", \"r\": 4}"}}, "adapter_model.safetensors");
  for (VersionKind k : {VersionKind::kBase, VersionKind::kMerged}) {
    ImportOptions o;
    o.kind = k;
    auto r = store_->Import(tmp_ / "adapter", o);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find((tmp_ / "adapter").string() + " is a PEFT adapter"), std::string::npos)
        << r.status().ToString();
    EXPECT_NE(r.status().message().find("kind " + std::string(KindName(k))), std::string::npos)
        << r.status().ToString();
  }
  ImportOptions o;
  o.kind = VersionKind::kAdapter;
  auto r = store_->Import(tmp_ / "base", o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("is not a PEFT adapter"), std::string::npos) << r.status().ToString();
  auto versions = store_->ListVersions(std::nullopt);
  ASSERT_TRUE(versions.ok());
  EXPECT_TRUE(versions->empty());
}

TEST_F(StoreTest, EventsAreListedPerVersionInOrder) {
  ImportResult v1 = MustImport(tmp_ / "base");
  ImportResult v2 = MustImport(FineTune("ft", {"model.norm.weight"}, 5));
  Event e1{Event::Type::kPublished, 1000, "", v1.record.id, std::nullopt, "tcp://a:1"};
  Event e2{Event::Type::kAcknowledged, 2000, "gen-0", v1.record.id, v1.record.id, ""};
  Event e3{Event::Type::kAnomaly, 1500, "gen-1", v2.record.id, Digest{5, 6}, "digest mismatch"};
  Event e4{Event::Type::kActivated, 2000, "gen-0", v1.record.id, std::nullopt, "same time as e2"};
  for (const Event& e : {e1, e2, e3, e4}) ASSERT_TRUE(store_->AddEvent(e).ok());
  auto for_v1 = store_->ListEvents(v1.record.id);
  ASSERT_TRUE(for_v1.ok());
  ASSERT_EQ(for_v1->size(), 3u);
  EXPECT_EQ((*for_v1)[0].type, Event::Type::kPublished);
  EXPECT_EQ((*for_v1)[0].detail, "tcp://a:1");
  EXPECT_EQ((*for_v1)[1].type, Event::Type::kAcknowledged);
  EXPECT_EQ((*for_v1)[1].receiver, "gen-0");
  EXPECT_EQ((*for_v1)[1].computed, v1.record.id);
  EXPECT_EQ((*for_v1)[2].type, Event::Type::kActivated);  // same time: insertion order
  auto all = store_->ListEvents(std::nullopt);
  ASSERT_TRUE(all.ok());
  ASSERT_EQ(all->size(), 4u);
  EXPECT_EQ((*all)[1].type, Event::Type::kAnomaly);  // ordered by time
  EXPECT_EQ((*all)[1].computed, (Digest{5, 6}));

  Event now{Event::Type::kPublished, 0, "", v2.record.id, std::nullopt, ""};
  ASSERT_TRUE(store_->AddEvent(now).ok());
  auto for_v2 = store_->ListEvents(v2.record.id);
  ASSERT_TRUE(for_v2.ok());
  ASSERT_EQ(for_v2->size(), 2u);
  EXPECT_GT((*for_v2)[1].time_ns, 1'600'000'000'000'000'000);  // "now" was filled in
  Event bad{Event::Type::kPublished, -5, "", v2.record.id, std::nullopt, ""};
  Status s = store_->AddEvent(bad);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), "-5"));

  // Events survive a reopen and keep their order with new ones.
  store_.reset();
  auto reopened = Store::Open(db_, StoreOptions{});
  ASSERT_TRUE(reopened.ok());
  ASSERT_TRUE((*reopened)->AddEvent(Event{Event::Type::kAnomaly, 2000, "x", v1.record.id, std::nullopt, "last"}).ok());
  auto after = (*reopened)->ListEvents(v1.record.id);
  ASSERT_TRUE(after.ok());
  ASSERT_EQ(after->size(), 4u);
  EXPECT_EQ((*after)[3].detail, "last");
}

TEST_F(StoreTest, GarbageCollectKeepsNewestAndReferencedVersionsAndRemovesTheirObjects) {
  std::vector<ImportResult> v;
  v.push_back(MustImport(tmp_ / "base"));
  for (int i = 1; i <= 4; ++i) {
    v.push_back(MustImport(FineTune("ft" + std::to_string(i), {"model.layers.0.self_attn.q_proj.weight"}, 100 * i)));
  }
  // Another run whose only version names v[0] (the base) as its base.
  ImportOptions o;
  o.run = "other";
  o.base_version = v[0].record.id;
  ImportResult other = MustImport(FineTune("other", {"model.norm.weight"}, 999), o);
  // An orphan object (as a crash between write and commit leaves) and a stray temp file.
  Digest orphan{0xabcdef, 0x1234};
  const auto orphan_path = ObjectPath(db_, orphan);
  std::filesystem::create_directories(orphan_path.parent_path());
  std::ofstream(orphan_path) << "orphan";
  std::ofstream(orphan_path.parent_path() / ".xyz.tmp-1-2") << "temp";

  auto bad = store_->GarbageCollect(0);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(bad.status().message(), "keep"));

  auto removed = store_->GarbageCollect(2);
  ASSERT_TRUE(removed.ok()) << removed.status().ToString();
  // Kept: v4, v3 (newest two), v0 (other's base), other. Removed: v1, v2 (parents keep nothing).
  EXPECT_EQ(*removed, 2);
  auto all = store_->ListVersions(std::nullopt);
  ASSERT_TRUE(all.ok());
  std::set<Digest> ids;
  for (const auto& r : *all) ids.insert(r.id);
  EXPECT_EQ(ids, (std::set<Digest>{v[0].record.id, v[3].record.id, v[4].record.id, other.record.id}));
  const Digest v1_q = Row(v[1].record, "model.layers.0.self_attn.q_proj.weight").digest;
  EXPECT_FALSE(std::filesystem::exists(ObjectPath(db_, v1_q)));
  EXPECT_FALSE(std::filesystem::exists(orphan_path));
  EXPECT_FALSE(std::filesystem::exists(orphan_path.parent_path() / ".xyz.tmp-1-2"));
  EXPECT_EQ(store_->GetVersion(v[1].record.id.Hex()).status().code(), StatusCode::kNotFound);
  auto reports = store_->Verify(std::nullopt);
  ASSERT_TRUE(reports.ok());
  for (const auto& rep : *reports) EXPECT_TRUE(rep.ok()) << rep.version.Hex();
  auto run = store_->ListVersions(std::string("default"));
  ASSERT_TRUE(run.ok());
  ASSERT_EQ(run->size(), 3u);
  EXPECT_EQ((*run)[0].sequence, 1u);

  // Importing v1's weights again writes its object again (its row was collected).
  ImportResult back = MustImport(tmp_ / "ft1");
  EXPECT_FALSE(back.already_present);
  EXPECT_EQ(back.bytes_written, 4096u);
  EXPECT_EQ(back.record.sequence, 6u);  // after v4 (sequence 5)
}

TEST_F(StoreTest, ReadOnlyStoresRefuseWritesAndSecondWritersAreRefused) {
  ImportResult v1 = MustImport(tmp_ / "base");
  auto second = Store::Open(db_, StoreOptions{});
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(second.status().message(), db_.string())) << second.status().message();

  StoreOptions ro;
  ro.read_only = true;
  auto reader = Store::Open(db_, ro);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  auto imp = (*reader)->Import(tmp_ / "base", ImportOptions{});
  EXPECT_EQ(imp.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(imp.status().message(), "read-only")) << imp.status().message();
  EXPECT_EQ((*reader)->GarbageCollect(1).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ((*reader)->AddEvent(Event{}).code(), StatusCode::kFailedPrecondition);
  auto got = (*reader)->GetVersion(v1.record.id.Hex());
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->tensors.size(), base_.size());
  auto rep = (*reader)->Verify(std::nullopt);
  ASSERT_TRUE(rep.ok());
  EXPECT_TRUE((*rep)[0].ok());
}

// ---- Small objects: tensors of at most small_object_bytes kept in their "objects" rows ----

class SmallObjectTest : public StoreTest {
 protected:
  SmallObjectTest() { small_object_bytes_ = StoreOptions{}.small_object_bytes; }

  // Regular files under DB/objects.
  int64_t ObjectFiles() {
    int64_t n = 0;
    for (const auto& e : std::filesystem::recursive_directory_iterator(db_ / "objects")) n += e.is_regular_file();
    return n;
  }

  std::string Bytes(const Tensor& t) { return std::string(reinterpret_cast<const char*>(t.data()), t.nbytes()); }
};

// The "objects" row forms: u64le(size) alone (a file), u64le(size) || the bytes; anything else
// (short, a size that is not the tensor's, bytes of another length) is kCorruption saying so.
TEST(SmallObjectRow, ParsesBothFormsAndRefusesAnythingElse) {
  const std::string bytes = "abcdef";
  const std::string small = internal::SmallObjectRow(std::as_bytes(std::span<const char>(bytes.data(), bytes.size())));
  EXPECT_EQ(internal::SmallObjectBytes(small, 6).value(), bytes);
  EXPECT_EQ(internal::SmallObjectBytes(internal::FileObjectRow(6), 6).value(), "");
  for (const std::string& bad :
       {std::string("1234567"), internal::FileObjectRow(5), small + "x", small.substr(0, 10)}) {
    auto r = internal::SmallObjectBytes(bad, 6);
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << bad.size();
    EXPECT_TRUE(Contains(r.status().message(),
                         "its \"objects\" row has " + std::to_string(bad.size()) + " bytes for a tensor of 6"))
        << r.status().message();
  }
}

TEST_F(SmallObjectTest, SmallTensorsAreStoredInTheirRowsAndReadBackExactly) {
  ASSERT_LE(base_["model.embed_tokens.weight"].nbytes(), StoreOptions{}.small_object_bytes);
  ImportResult r = MustImport(tmp_ / "base");
  const uint64_t aux_bytes = aux_["config.json"].size() + aux_["tokenizer.json"].size();
  EXPECT_EQ(r.bytes_written, Sum(base_) + aux_bytes);
  EXPECT_EQ(r.objects_written, 7);
  EXPECT_EQ(ObjectFiles(), 0) << "every tensor here is small";
  for (const auto& [name, t] : base_) {
    auto got = store_->ReadTensor(Row(r.record, name), true);
    ASSERT_TRUE(got.ok()) << name << ": " << got.status().ToString();
    EXPECT_EQ(Bytes(*got), Bytes(t)) << name;
  }
  auto reports = store_->Verify(std::nullopt);
  ASSERT_TRUE(reports.ok()) << reports.status().ToString();
  ASSERT_EQ(reports->size(), 1u);
  EXPECT_TRUE((*reports)[0].ok());
  ASSERT_TRUE(store_->Export(r.record.id, tmp_ / "exported", false).ok());
  EXPECT_EQ(HashPath(tmp_ / "exported").value().id, r.record.id);
  // A reader (RocksDB secondary) finds them too.
  StoreOptions ro;
  ro.read_only = true;
  auto reader = Store::Open(db_, ro);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  auto norm = (*reader)->ReadTensor(Row(r.record, "model.norm.weight"), true);
  ASSERT_TRUE(norm.ok()) << norm.status().ToString();
  EXPECT_EQ(Bytes(*norm), Bytes(base_["model.norm.weight"]));
}

TEST_F(SmallObjectTest, TensorsAboveTheLimitAreFiles) {
  store_.reset();
  StoreOptions so;
  so.small_object_bytes = 2048;  // k_proj (2048 bytes) and norm (128) are small; the rest files
  auto s = Store::Open(db_, so);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  store_ = std::move(*s);
  ImportResult r = MustImport(tmp_ / "base");
  for (const auto& [name, t] : base_) {
    EXPECT_EQ(std::filesystem::exists(ObjectPath(db_, Row(r.record, name).digest)), t.nbytes() > 2048) << name;
    auto got = store_->ReadTensor(Row(r.record, name), true);
    ASSERT_TRUE(got.ok()) << name << ": " << got.status().ToString();
    EXPECT_EQ(Bytes(*got), Bytes(t)) << name;
  }
  EXPECT_EQ(ObjectFiles(), 3);
}

TEST_F(SmallObjectTest, LimitAboveOneMiBIsRefused) {
  StoreOptions so;
  so.small_object_bytes = (uint64_t{1} << 20) + 1;
  auto s = Store::Open(tmp_ / "other", so);
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s.status().message(), "small_object_bytes 1048577 is above the limit of 1048576"))
      << s.status().message();
}

TEST_F(SmallObjectTest, DamagedSmallObjectIsReportedForExactlyThatTensor) {
  ImportResult r = MustImport(tmp_ / "base");
  // A copy: GCC 13 takes a reference here for one to the temporary name (-Wdangling-reference).
  const TensorRow victim = Row(r.record, "model.layers.0.mlp.up_proj.weight");
  ASSERT_TRUE(internal::DamageObjectForTesting(*store_, victim.digest, 10).ok());
  auto reports = store_->Verify(std::nullopt);
  ASSERT_TRUE(reports.ok()) << reports.status().ToString();
  ASSERT_EQ(reports->size(), 1u);
  EXPECT_EQ((*reports)[0].corrupted, std::vector<std::string>{victim.name});
  EXPECT_TRUE((*reports)[0].missing.empty());
  auto read = store_->ReadTensor(victim, true);
  EXPECT_EQ(read.status().code(), StatusCode::kCorruption);
  EXPECT_TRUE(Contains(read.status().message(), "tensor '" + victim.name + "'")) << read.status().message();
  EXPECT_TRUE(Contains(read.status().message(), "is corrupted")) << read.status().message();
  auto exported = store_->Export(r.record.id, tmp_ / "exported", false);
  EXPECT_EQ(exported.code(), StatusCode::kCorruption);
  EXPECT_TRUE(Contains(exported.message(), "tensor '" + victim.name + "' is corrupted")) << exported.message();
  EXPECT_FALSE(std::filesystem::exists(tmp_ / "exported"));
}

TEST_F(SmallObjectTest, SourceChangedAfterHashingIsRefused) {
  ImportChangingTheSourceIsRefused({16, 256});  // 16 KiB: a small object, copied from the mapping
  EXPECT_TRUE(store_->ListVersions(std::nullopt).value().empty());
}

TEST_F(SmallObjectTest, ObjectFilesOfAnEarlierStoreAreKeptAndReadAlongsideSmallOnes) {
  // Written with every object a file (as before small objects existed) ...
  store_.reset();
  StoreOptions files;
  files.small_object_bytes = 0;
  auto s = Store::Open(db_, files);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ImportResult v1 = (*s)->Import(tmp_ / "base", {}).value();
  s->reset();
  ASSERT_EQ(ObjectFiles(), 5);
  // ... then a fine-tune under the default: only the changed tensor is written, as a small
  // object; the unchanged ones stay files and are not rewritten.
  s = Store::Open(db_, StoreOptions{});
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  store_ = std::move(*s);
  const std::string q = "model.layers.0.self_attn.q_proj.weight";
  ImportResult v2 = MustImport(FineTune("ft", {q}, 77));
  EXPECT_EQ(v2.bytes_written, base_[q].nbytes());
  EXPECT_EQ(v2.objects_written, 1);
  EXPECT_EQ(ObjectFiles(), 5);
  EXPECT_FALSE(std::filesystem::exists(ObjectPath(db_, Row(v2.record, q).digest)));
  for (const VersionRecord* v : {&v1.record, &v2.record}) {
    for (const TensorRow& row : v->tensors) EXPECT_TRUE(store_->ReadTensor(row, true).ok()) << row.name;
  }
  auto reports = store_->Verify(std::nullopt);
  ASSERT_TRUE(reports.ok());
  for (const auto& rep : *reports) EXPECT_TRUE(rep.ok()) << rep.version.Hex();
}

TEST_F(SmallObjectTest, GarbageCollectDropsTheSmallObjectsNoKeptVersionUses) {
  const std::string q = "model.layers.0.self_attn.q_proj.weight";
  ImportResult v1 = MustImport(tmp_ / "base");
  ImportResult v2 = MustImport(FineTune("ft", {q}, 77));
  auto removed = store_->GarbageCollect(1);
  ASSERT_TRUE(removed.ok()) << removed.status().ToString();
  EXPECT_EQ(*removed, 1);
  EXPECT_EQ(store_->ReadTensor(Row(v1.record, q), true).status().code(), StatusCode::kNotFound);
  for (const TensorRow& row : v2.record.tensors) EXPECT_TRUE(store_->ReadTensor(row, true).ok()) << row.name;
  // Importing v1's weights again writes its q_proj again (its row was collected), and only it.
  ImportResult back = MustImport(tmp_ / "base");
  EXPECT_FALSE(back.already_present);
  EXPECT_EQ(back.bytes_written, base_[q].nbytes());
}

}  // namespace
}  // namespace ferry::store
