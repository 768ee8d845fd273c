// Derived versions (store.h, "Derived versions"): a merged version recorded by its digests
// only, on the PEFT fixture llama_lora_all_linear_f32: no tensor object written, rebuilt by
// Materialize with the same id, refused by reads and exports, verified through its base and
// adapter, kept alive with them by gc, turned into a stored version by a full import.
#include <algorithm>
#include <filesystem>

#include <gtest/gtest.h>

#include "convert/converter.h"
#include "core/checkpoint.h"
#include "store/audit.h"
#include "store/internal.h"
#include "store/materialize.h"
#include "store/store.h"
#include "tests/store/test_util.h"

namespace ferry::store {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

const fs::path kCase = fs::path(FERRY_FIXTURES_DIR) / "cases" / "llama_lora_all_linear_f32";

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// Files under `dir`, recursively (0 when it does not exist).
int64_t CountFiles(const fs::path& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) return 0;
  int64_t n = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir)) n += e.is_regular_file() ? 1 : 0;
  return n;
}

// The merged version the converter makes of (base dir, adapter dir), as rows and aux files:
// what a daemon that built the same merge in memory records.
struct Merge {
  std::vector<TensorRow> rows;
  AuxFiles aux;
  Digest id;
};

class DerivedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    db_ = tmp_ / "db";
    StoreOptions so;
    so.create_if_missing = true;
    so.sync_objects = false;
    auto s = Store::Open(db_, so);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    store_ = std::move(*s);
    ImportOptions b;
    b.run = "rl";
    b.kind = VersionKind::kBase;
    auto base = store_->Import(kCase / "base", b);
    ASSERT_TRUE(base.ok()) << base.status().ToString();
    base_ = base->record.id;
    adapter_ = ImportAdapter(kCase / "adapter", 1);
  }

  Digest ImportAdapter(const fs::path& dir, int64_t step) {
    ImportOptions a;
    a.run = "rl";
    a.base_version = base_;
    a.step = step;
    auto r = store_->Import(dir, a);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? r->record.id : Digest{};
  }

  // A copy of the fixture's adapter with every lora_B scaled by `factor`, at tmp/<name>.
  fs::path ScaledAdapter(const std::string& name, float factor) {
    Checkpoint a = Checkpoint::Open(kCase / "adapter").value();
    std::map<std::string, Tensor> tensors;
    for (const auto& n : a.names()) {
      Tensor src = a.Get(n).value();
      Tensor t = Tensor::Empty(src.dtype(), src.shape()).value();
      std::memcpy(t.mutable_data(), src.data(), src.nbytes());
      if (Contains(n, "lora_B")) {
        for (int64_t i = 0; i < t.numel(); ++i) t.mutable_data_as<float>()[i] *= factor;
      }
      tensors.emplace(n, t);
    }
    testing::WriteModel(tmp_ / name, tensors,
                        {{"adapter_config.json", testing::ReadFileBytes(kCase / "adapter" / "adapter_config.json")}},
                        "adapter_model.safetensors");
    return tmp_ / name;
  }

  Merge ConverterMerge(const fs::path& adapter_dir) {
    const fs::path out = tmp_ / ("merge-" + std::to_string(merges_++));
    ConvertOptions c;
    c.base = kCase / "base";
    c.adapter = adapter_dir;
    c.out = out;
    c.threads = 2;
    c.sync = false;
    auto conv = Convert(c);
    EXPECT_TRUE(conv.ok()) << conv.status().ToString();
    Merge m;
    auto rec = HashPath(out);
    EXPECT_TRUE(rec.ok()) << rec.status().ToString();
    if (!rec.ok()) return m;
    m.rows = rec->tensors;
    m.id = rec->id;
    m.aux = CollectAuxFiles(out).value();
    fs::remove_all(out);
    return m;
  }

  ImportOptions DerivedOptions(const Digest& adapter, int64_t step) {
    ImportOptions o;
    o.run = "rl";
    o.kind = VersionKind::kMerged;
    o.source = VersionSource::kDaemon;
    o.base_version = base_;
    o.adapter_version = adapter;
    o.step = step;
    return o;
  }

  ImportResult MustRecord(const Merge& m, const ImportOptions& o) {
    auto r = store_->RecordDerived(m.rows, m.aux, o);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : ImportResult{};
  }

  TempDir tmp_;
  fs::path db_;
  std::unique_ptr<Store> store_;
  Digest base_, adapter_;
  int merges_ = 0;
};

TEST_F(DerivedTest, RecordWritesNoTensorObjectAndMaterializeRebuildsTheSameId) {
  const Merge m = ConverterMerge(kCase / "adapter");
  const int64_t objects_before = CountFiles(db_ / "objects");
  ImportResult r = MustRecord(m, DerivedOptions(adapter_, 1));
  EXPECT_EQ(CountFiles(db_ / "objects"), objects_before);
  EXPECT_FALSE(r.already_present);
  EXPECT_EQ(r.record.id, m.id);  // the id a full import of the same bytes would get
  EXPECT_TRUE(r.record.derived);
  EXPECT_EQ(r.record.kind, VersionKind::kMerged);
  EXPECT_EQ(r.record.sequence, 3u);
  EXPECT_EQ(r.record.total_bytes, Checkpoint::Open(kCase / "base").value().total_bytes());
  // Only auxiliary files the base does not hold are new (config.json as the converter writes it).
  const VersionRecord base = store_->GetVersion(base_.Hex()).value();
  uint64_t new_aux_bytes = 0;
  int64_t new_aux = 0;
  for (const auto& [name, contents] : m.aux) {
    const Digest d = AuxDigest(contents);
    if (std::none_of(base.aux.begin(), base.aux.end(), [&](const AuxFile& a) { return a.digest == d; })) {
      new_aux_bytes += contents.size();
      ++new_aux;
    }
  }
  EXPECT_EQ(r.bytes_written, new_aux_bytes);
  EXPECT_EQ(r.objects_written, new_aux);

  auto got = store_->GetVersion(m.id.Hex());
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(got->derived);
  EXPECT_EQ(got->base_version, base_);
  EXPECT_EQ(got->adapter_version, adapter_);
  EXPECT_EQ(got->tensors.size(), m.rows.size());

  // A second step with the same aux files adds no byte at all.
  const fs::path a2 = ScaledAdapter("adapter2", 2.0f);
  const Digest adapter2 = ImportAdapter(a2, 2);
  const Merge m2 = ConverterMerge(a2);
  ImportResult r2 = MustRecord(m2, DerivedOptions(adapter2, 2));
  EXPECT_EQ(r2.bytes_written, 0u);
  EXPECT_EQ(r2.objects_written, 0);

  // Recording it again is already_present.
  ImportResult again = MustRecord(m, DerivedOptions(adapter_, 1));
  EXPECT_TRUE(again.already_present);
  EXPECT_EQ(again.record.sequence, 3u);

  const fs::path out = tmp_ / "out";
  auto mat = Materialize(*store_, m.id, out, {});
  ASSERT_TRUE(mat.ok()) << mat.status().ToString();
  EXPECT_TRUE(mat->merged);
  EXPECT_EQ(mat->checked_against, m.id);
  auto rebuilt = HashPath(out);
  ASSERT_TRUE(rebuilt.ok()) << rebuilt.status().ToString();
  EXPECT_EQ(rebuilt->id, m.id);
  auto rebuilt2 = Materialize(*store_, m2.id, tmp_ / "out2", {});
  ASSERT_TRUE(rebuilt2.ok()) << rebuilt2.status().ToString();
  EXPECT_EQ(HashPath(tmp_ / "out2").value().id, m2.id);
}

TEST_F(DerivedTest, RecordRefusesWhatCannotBeDerived) {
  const Merge m = ConverterMerge(kCase / "adapter");
  auto expect = [&](const ImportOptions& o, StatusCode code, const std::string& needle,
                    const std::vector<TensorRow>* rows = nullptr) {
    auto r = store_->RecordDerived(rows ? *rows : m.rows, m.aux, o);
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_EQ(r.status().code(), code) << r.status().ToString();
    EXPECT_TRUE(Contains(r.status().message(), needle)) << r.status().ToString();
  };
  ImportOptions o = DerivedOptions(adapter_, 1);
  o.kind = VersionKind::kFull;
  expect(o, StatusCode::kInvalidArgument, "kind must be merged, not full");
  o = DerivedOptions(adapter_, 1);
  o.base_version.reset();
  expect(o, StatusCode::kInvalidArgument, "no base_version");
  o = DerivedOptions(adapter_, 1);
  o.adapter_version.reset();
  expect(o, StatusCode::kInvalidArgument, "no adapter_version");
  const Digest absent{0x1234, 0x5678};
  o = DerivedOptions(adapter_, 1);
  o.base_version = absent;
  expect(o, StatusCode::kNotFound, "base version " + absent.Hex() + " is not in the store");
  o = DerivedOptions(absent, 1);
  expect(o, StatusCode::kNotFound, "adapter version " + absent.Hex() + " is not in the store");
  o = DerivedOptions(base_, 1);  // the base as the adapter
  expect(o, StatusCode::kInvalidArgument, "adapter version " + base_.Hex() + " is of kind base, not adapter");
  o = DerivedOptions(adapter_, 1);
  o.layout = Layout::kLora;
  expect(o, StatusCode::kInvalidArgument, "layout 'lora'");
  std::vector<TensorRow> rows = m.rows;
  rows[0].nbytes += 4;
  expect(DerivedOptions(adapter_, 1), StatusCode::kInvalidArgument, "tensor '" + rows[0].name + "' has nbytes", &rows);
  rows = m.rows;
  rows.push_back(rows[1]);
  expect(DerivedOptions(adapter_, 1), StatusCode::kInvalidArgument, "tensor '" + rows[1].name + "' is given twice",
         &rows);
  // Nothing was committed.
  EXPECT_EQ(store_->ListVersions(std::nullopt).value().size(), 2u);
}

TEST_F(DerivedTest, ReadsAndExportsAreRefusedUnlessTheObjectsArePresent) {
  const Merge m = ConverterMerge(kCase / "adapter");
  ImportResult r = MustRecord(m, DerivedOptions(adapter_, 1));
  const std::string want = "version " + m.id.Hex() + " is derived from base " + base_.Hex() + " + adapter " +
                           adapter_.Hex() + "; materialize it";
  const VersionRecord base = store_->GetVersion(base_.Hex()).value();
  int refused = 0, read = 0;
  for (const TensorRow& row : r.record.tensors) {
    const bool in_base = std::any_of(base.tensors.begin(), base.tensors.end(),
                                     [&](const TensorRow& b) { return b.digest == row.digest; });
    auto t = store_->ReadTensor(row, true);
    if (in_base) {  // an unchanged tensor (norms, embeddings): its object is the base's
      EXPECT_TRUE(t.ok()) << row.name << ": " << t.status().ToString();
      ++read;
    } else {
      ASSERT_FALSE(t.ok()) << row.name;
      EXPECT_EQ(t.status().code(), StatusCode::kFailedPrecondition) << t.status().ToString();
      EXPECT_TRUE(Contains(t.status().message(), "tensor '" + row.name + "': " + want)) << t.status().ToString();
      ++refused;
    }
  }
  EXPECT_EQ(refused, 14);  // the 14 projections the adapter changes
  EXPECT_EQ(read, 7);
  auto e = store_->Export(m.id, tmp_ / "exported", false);
  EXPECT_EQ(e.code(), StatusCode::kFailedPrecondition) << e.ToString();
  EXPECT_TRUE(Contains(e.message(), want)) << e.ToString();
  EXPECT_FALSE(fs::exists(tmp_ / "exported"));
  EXPECT_TRUE(Contains(e.message(), "materialize it"));
  EXPECT_FALSE(Contains(e.message(), "--")) << "no CLI flag in a library error: " << e.ToString();
}

TEST_F(DerivedTest, VerifyReportsDerivedVersionsThroughTheirBaseAndAdapter) {
  const Merge m = ConverterMerge(kCase / "adapter");
  MustRecord(m, DerivedOptions(adapter_, 1));
  auto all = store_->Verify(std::nullopt);
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  ASSERT_EQ(all->size(), 3u);
  for (const auto& rep : *all) {
    EXPECT_TRUE(rep.ok()) << rep.version.Hex();
    EXPECT_EQ(rep.derived, rep.version == m.id);
    EXPECT_TRUE(rep.missing.empty());  // a derived version's tensors have no objects: not "missing"
  }
  // A damaged adapter object: the adapter is corrupted, and the derived version names it.
  const VersionRecord adapter = store_->GetVersion(adapter_.Hex()).value();
  const TensorRow* victim = nullptr;
  for (const auto& t : adapter.tensors) {
    if (Contains(t.name, "layers.1.mlp.down_proj.lora_B")) victim = &t;
  }
  ASSERT_NE(victim, nullptr);
  ASSERT_TRUE(internal::DamageObjectForTesting(*store_, victim->digest, 8).ok());
  auto one = store_->Verify(m.id);  // alone: its dependencies are loaded and checked
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  ASSERT_EQ(one->size(), 1u);
  EXPECT_FALSE((*one)[0].ok());
  EXPECT_TRUE((*one)[0].derived);
  ASSERT_EQ((*one)[0].dependencies.size(), 1u);
  EXPECT_EQ((*one)[0].dependencies[0], "adapter version " + adapter_.Hex() + ": '" + victim->name + "' is corrupted");
  EXPECT_TRUE((*one)[0].corrupted.empty());
  all = store_->Verify(std::nullopt);
  ASSERT_TRUE(all.ok());
  for (const auto& rep : *all) {
    if (rep.version == base_) {
      EXPECT_TRUE(rep.ok());
    } else if (rep.version == adapter_) {
      EXPECT_EQ(rep.corrupted, std::vector<std::string>{victim->name});
    } else {
      EXPECT_EQ(rep.version, m.id);
      EXPECT_EQ(rep.dependencies.size(), 1u);
    }
  }
}

TEST_F(DerivedTest, TamperedAdapterFailsMaterializeNamingBothIdsAndLeavesNothing) {
  const Merge m = ConverterMerge(kCase / "adapter");
  MustRecord(m, DerivedOptions(adapter_, 1));
  const VersionRecord adapter = store_->GetVersion(adapter_.Hex()).value();
  ASSERT_TRUE(internal::DamageObjectForTesting(*store_, adapter.tensors.back().digest, 4).ok());
  const fs::path out = tmp_ / "out";
  auto mat = Materialize(*store_, m.id, out, {});
  ASSERT_FALSE(mat.ok());
  EXPECT_EQ(mat.status().code(), StatusCode::kCorruption) << mat.status().ToString();
  EXPECT_TRUE(Contains(mat.status().message(), m.id.Hex())) << mat.status().ToString();
  EXPECT_TRUE(Contains(mat.status().message(), adapter_.Hex())) << mat.status().ToString();
  EXPECT_FALSE(fs::exists(out));
  for (const auto& e : fs::directory_iterator(tmp_.path())) {
    EXPECT_TRUE(e.path().filename() == "db") << "left behind: " << e.path();
  }
}

// Rows that are not the merge of its base and adapter (here: the merge of another adapter)
// are caught when the version is rebuilt: both ids named, nothing at `out`.
TEST_F(DerivedTest, MaterializeRefusesAMergeWhoseIdDiffers) {
  const fs::path a2 = ScaledAdapter("adapter2", 3.0f);
  const Merge other = ConverterMerge(a2);
  MustRecord(other, DerivedOptions(adapter_, 1));  // claims adapter_, holds adapter2's merge
  const fs::path out = tmp_ / "out";
  auto mat = Materialize(*store_, other.id, out, {});
  ASSERT_FALSE(mat.ok());
  EXPECT_EQ(mat.status().code(), StatusCode::kCorruption) << mat.status().ToString();
  const Merge real = ConverterMerge(kCase / "adapter");
  EXPECT_TRUE(Contains(mat.status().message(), "has id " + real.id.Hex() + ", not " + other.id.Hex()))
      << mat.status().ToString();
  EXPECT_TRUE(Contains(mat.status().message(), "14 tensors differ")) << mat.status().ToString();
  EXPECT_FALSE(fs::exists(out));
}

TEST_F(DerivedTest, GarbageCollectKeepsTheBaseAndAdapterOfKeptDerivedVersions) {
  const Merge m1 = ConverterMerge(kCase / "adapter");
  MustRecord(m1, DerivedOptions(adapter_, 1));
  const fs::path a2dir = ScaledAdapter("adapter2", 2.0f);
  const Digest adapter2 = ImportAdapter(a2dir, 2);
  const Merge m2 = ConverterMerge(a2dir);
  MustRecord(m2, DerivedOptions(adapter2, 2));
  // rl: base 1, adapter 2, m1 3, adapter2 4, m2 5. Keep the newest: m2, and what it needs.
  auto removed = store_->GarbageCollect(1);
  ASSERT_TRUE(removed.ok()) << removed.status().ToString();
  EXPECT_EQ(*removed, 2);  // adapter 1 and m1
  EXPECT_EQ(store_->GetVersion(adapter_.Hex()).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(store_->GetVersion(m1.id.Hex()).status().code(), StatusCode::kNotFound);
  for (const Digest& kept : {base_, adapter2, m2.id}) EXPECT_TRUE(store_->GetVersion(kept.Hex()).ok()) << kept.Hex();
  auto verify = store_->Verify(std::nullopt);
  ASSERT_TRUE(verify.ok());
  for (const auto& rep : *verify) EXPECT_TRUE(rep.ok()) << rep.version.Hex();
  auto mat = Materialize(*store_, m2.id, tmp_ / "out", {});
  ASSERT_TRUE(mat.ok()) << mat.status().ToString();
  EXPECT_EQ(HashPath(tmp_ / "out").value().id, m2.id);
}

TEST_F(DerivedTest, ImportingTheFullBytesTurnsADerivedVersionIntoAStoredOne) {
  const Merge m = ConverterMerge(kCase / "adapter");
  ImportResult r = MustRecord(m, DerivedOptions(adapter_, 1));
  ASSERT_TRUE(Materialize(*store_, m.id, tmp_ / "out", {}).ok());
  ImportOptions o;
  o.run = "elsewhere";
  o.kind = VersionKind::kMerged;
  auto full = store_->Import(tmp_ / "out", o);
  ASSERT_TRUE(full.ok()) << full.status().ToString();
  EXPECT_TRUE(full->already_present);
  EXPECT_TRUE(full->was_derived);
  EXPECT_GT(full->bytes_written, 0u);
  EXPECT_FALSE(full->record.derived);
  EXPECT_EQ(full->record.run, "rl");  // the record is kept
  EXPECT_EQ(full->record.sequence, r.record.sequence);
  const VersionRecord now = store_->GetVersion(m.id.Hex()).value();
  EXPECT_FALSE(now.derived);
  EXPECT_EQ(now.step, 1);
  for (const TensorRow& row : now.tensors) {
    auto t = store_->ReadTensor(row, true);
    EXPECT_TRUE(t.ok()) << row.name << ": " << t.status().ToString();
  }
  ASSERT_TRUE(store_->Export(m.id, tmp_ / "exported", false).ok());
  EXPECT_EQ(HashPath(tmp_ / "exported").value().id, m.id);
  auto verify = store_->Verify(m.id);
  ASSERT_TRUE(verify.ok());
  EXPECT_TRUE((*verify)[0].ok());
  EXPECT_FALSE((*verify)[0].derived);
  // Recording it as derived again changes nothing: it stays stored.
  ImportResult again = MustRecord(m, DerivedOptions(adapter_, 1));
  EXPECT_TRUE(again.already_present);
  EXPECT_FALSE(again.record.derived);
}

// The adapter version's materialisation is checked against a derived merged version of the
// same base and adapter, by digest.
TEST_F(DerivedTest, MaterializingTheAdapterChecksItAgainstTheDerivedMerge) {
  const Merge m = ConverterMerge(kCase / "adapter");
  MustRecord(m, DerivedOptions(adapter_, 1));
  auto mat = Materialize(*store_, adapter_, tmp_ / "out", {});
  ASSERT_TRUE(mat.ok()) << mat.status().ToString();
  EXPECT_EQ(mat->checked_against, m.id);
  EXPECT_EQ(mat->tensors_identical, static_cast<int64_t>(m.rows.size()));
}

TEST_F(DerivedTest, TheAuditRunsOverDerivedVersions) {
  const Merge m = ConverterMerge(kCase / "adapter");
  MustRecord(m, DerivedOptions(adapter_, 1));
  auto report = RunAudit(*store_, {});
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  ASSERT_EQ(report->timeline.size(), 3u);
  EXPECT_EQ(report->timeline[2].version.id, m.id);
  EXPECT_TRUE(report->timeline[2].version.derived);
  for (const auto& a : report->anomalies) EXPECT_NE(a.kind, AnomalyKind::kMergedEqualsBase) << a.message;
}

TEST(DerivedCodecTest, RecordsWithoutTheFieldAreNotDerived) {
  VersionRecord r;
  r.id = Digest{1, 2};
  r.kind = VersionKind::kMerged;
  r.derived = true;
  const std::string text = internal::EncodeVersion(r).value();
  EXPECT_TRUE(Contains(text, "\"derived\":true")) << text;
  EXPECT_TRUE(internal::DecodeVersion(text).value().derived);
  r.derived = false;
  const std::string stored = internal::EncodeVersion(r).value();
  EXPECT_FALSE(Contains(stored, "derived")) << "records read by older readers stay as they were: " << stored;
  EXPECT_FALSE(internal::DecodeVersion(stored).value().derived);
  std::string bad = text;
  bad.replace(bad.find("\"derived\":true"), 14, "\"derived\":\"yes\"");
  auto d = internal::DecodeVersion(bad);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kCorruption);
  EXPECT_TRUE(Contains(d.status().message(), "field 'derived'")) << d.status().ToString();
}

}  // namespace
}  // namespace ferry::store
