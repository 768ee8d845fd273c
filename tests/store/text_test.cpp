// Text that goes into the store's JSON records (the UTF-8 check and escaping themselves are
// tested in tests/core/text_test.cpp): the names import refuses before anything is stored (an auxiliary-looking file
// whose name is not UTF-8 or holds a control character, a tensor, run, layout or metric name that is not UTF-8, an
// adapter_config.json that is not UTF-8), a non-ASCII UTF-8 aux name that is recorded and round-trips, and event text
// that never fails to encode (the audit's JSON of such text: tests/cli/audit_text_test.cpp).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "core/checkpoint.h"
#include "store/internal.h"
#include "store/store.h"
#include "tests/store/test_util.h"

namespace ferry::store {
namespace {

namespace fs = std::filesystem;
using internal::EscapeForMessage;
using testing::F32;
using testing::Patterned;
using testing::TempDir;

class StoreTextTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tensors_ = {{"model.embed_tokens.weight", Patterned(DType::kBF16, {16, 8}, 1)},
                {"model.norm.weight", F32({8}, std::vector<float>(8, 1.0f))}};
    StoreOptions so;
    so.create_if_missing = true;
    auto s = Store::Open(tmp_ / "db", so);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    store_ = std::move(*s);
  }

  // A model directory tmp/<name> with config.json and one more aux file `extra`.
  fs::path Model(const std::string& name, const std::string& extra) {
    const fs::path dir = tmp_ / name;
    testing::WriteModel(dir, tensors_, {{"config.json", "{\"model_type\": \"llama\"}"}, {extra, "extra contents"}});
    return dir;
  }

  // Regular files under db/objects and db/aux (what an import wrote before committing).
  size_t StoredObjectFiles() {
    size_t n = 0;
    std::error_code ec;
    for (const char* sub : {"objects", "aux"}) {
      if (!fs::exists(tmp_ / "db" / sub, ec)) continue;
      for (auto it = fs::recursive_directory_iterator(tmp_ / "db" / sub, ec); it != fs::recursive_directory_iterator();
           it.increment(ec)) {
        if (it->is_regular_file(ec)) ++n;
      }
    }
    return n;
  }

  // Nothing was recorded: no version, no run, no latest pointer, no object file.
  void ExpectNothingRecorded() {
    auto versions = store_->ListVersions(std::nullopt);
    ASSERT_TRUE(versions.ok()) << versions.status().ToString();
    EXPECT_TRUE(versions->empty());
    auto runs = store_->ListRuns();
    ASSERT_TRUE(runs.ok()) << runs.status().ToString();
    EXPECT_TRUE(runs->empty());
    auto latest = store_->Latest("default");
    ASSERT_TRUE(latest.ok()) << latest.status().ToString();
    EXPECT_FALSE(latest->has_value());
    EXPECT_EQ(StoredObjectFiles(), 0u);
  }

  TempDir tmp_;
  std::map<std::string, Tensor> tensors_;
  std::unique_ptr<Store> store_;
};

TEST_F(StoreTextTest, AuxNameThatIsNotUtf8RefusesTheImportNamingTheDirectory) {
  const fs::path dir = Model("m", "vocab.\xff");
  auto r = store_->Import(dir, ImportOptions{});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), dir.string() + ": auxiliary file name 'vocab.\\xff' is not valid UTF-8");
  ExpectNothingRecorded();

  // ferry verify PATH (HashPath) refuses the same directory the same way.
  auto hashed = HashPath(dir);
  EXPECT_EQ(hashed.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(hashed.status().message(), r.status().message());
  auto collected = CollectAuxFiles(dir);
  EXPECT_EQ(collected.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(collected.status().message(), r.status().message());
}

TEST_F(StoreTextTest, IllFormedUtf8OfEveryKindInAnAuxNameIsRefused) {
  int k = 0;
  for (const std::string bad : {"vocab.\xc0\xaf", "vocab.\xed\xa0\x80", "vocab.\xf4\x90\x80\x80", "vocab.x\xe6\x97",
                                "tokenizer\x80.json", "chat_template.\xfe"}) {
    const fs::path dir = Model("m" + std::to_string(k++), bad);
    auto r = store_->Import(dir, ImportOptions{});
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << EscapeForMessage(bad);
    EXPECT_EQ(r.status().message(),
              dir.string() + ": auxiliary file name '" + EscapeForMessage(bad) + "' is not valid UTF-8");
  }
  ExpectNothingRecorded();
}

TEST_F(StoreTextTest, AuxNameWithAControlCharacterRefusesTheImport) {
  const fs::path dir = Model("m", "vocab.\x01.txt");
  auto r = store_->Import(dir, ImportOptions{});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(),
            dir.string() + ": auxiliary file name 'vocab.\\x01.txt' contains a control character");
  ExpectNothingRecorded();

  const fs::path del = Model("m2", "chat_template.\x7f");
  r = store_->Import(del, ImportOptions{});
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(),
            del.string() + ": auxiliary file name 'chat_template.\\x7f' contains a control character");
  ExpectNothingRecorded();
}

TEST_F(StoreTextTest, FilesThatAreNotAuxFilesAreIgnoredWhateverTheirName) {
  const fs::path dir = Model("m", "notes-\xff.txt");  // not on the aux list: never recorded
  std::ofstream(dir / "ctl\x01") << "x";
  auto r = store_->Import(dir, ImportOptions{});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->record.aux.size(), 1u);
  EXPECT_EQ(r->record.aux[0].name, "config.json");
}

TEST_F(StoreTextTest, NonAsciiUtf8AuxNameIsRecordedAndRoundTrips) {
  const std::string name = "vocab.\xe6\x97\xa5\xe6\x9c\xac.txt";  // vocab.日本.txt
  const fs::path dir = Model("m", name);
  auto r = store_->Import(dir, ImportOptions{});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->record.aux.size(), 2u);
  EXPECT_EQ(r->record.aux[1].name, name);
  auto hashed = HashPath(dir);
  ASSERT_TRUE(hashed.ok()) << hashed.status().ToString();
  EXPECT_EQ(hashed->id, r->record.id);

  // Read back after reopening: the same name, the same bytes, exported under that name.
  store_.reset();
  auto s = Store::Open(tmp_ / "db", StoreOptions{});
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  store_ = std::move(*s);
  auto got = store_->GetVersion(r->record.id.Hex());
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(got->aux.size(), 2u);
  EXPECT_EQ(got->aux[1].name, name);
  auto contents = store_->ReadAux(got->aux[1]);
  ASSERT_TRUE(contents.ok()) << contents.status().ToString();
  EXPECT_EQ(*contents, "extra contents");
  ASSERT_TRUE(store_->Export(got->id, tmp_ / "out", /*force=*/false).ok());
  EXPECT_EQ(testing::ReadFileBytes(tmp_ / "out" / name), "extra contents");
  auto again = HashPath(tmp_ / "out");
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->id, r->record.id);
}

TEST_F(StoreTextTest, ImportCheckpointRefusesBadNamesBeforeStoringAnything) {
  Checkpoint ckpt = Checkpoint::FromTensors("mem", tensors_);
  auto r = store_->ImportCheckpoint(ckpt, {{"vocab.\xff", "v"}}, ImportOptions{});
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "auxiliary file name 'vocab.\\xff' is not valid UTF-8");
  r = store_->ImportCheckpoint(ckpt, {{"config\n.json", "{}"}}, ImportOptions{});
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "auxiliary file name 'config\\x0a.json' contains a control character");
  r = store_->ImportCheckpoint(ckpt, {{"../config.json", "{}"}}, ImportOptions{});
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "auxiliary file name '../config.json' is not a plain file name");

  auto bad_tensor = tensors_;
  bad_tensor["layer.\xc0\xaf.weight"] = F32({2}, {1.0f, 2.0f});
  r = store_->ImportCheckpoint(Checkpoint::FromTensors("mem", bad_tensor), {}, ImportOptions{});
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "tensor name 'layer.\\xc0\\xaf.weight' is not valid UTF-8");
  ExpectNothingRecorded();
}

TEST_F(StoreTextTest, RunAndMetricNamesMustBeUtf8) {  // (a layout is an enum: convert/layout.h)
  const fs::path dir = Model("m", "vocab.txt");
  const std::string where = "store " + (tmp_ / "db").string() + ": ";
  ImportOptions o;
  o.run = "rl-\xff";
  auto r = store_->Import(dir, o);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), where + "run name 'rl-\\xff' is not valid UTF-8");
  o = ImportOptions{};
  o.metrics = {{"reward\xfe", 1.0}};
  r = store_->Import(dir, o);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), where + "metric name 'reward\\xfe' is not valid UTF-8");
  ExpectNothingRecorded();

  o = ImportOptions{};
  o.run = "r\xc3\xa9sum\xc3\xa9";   // résumé
  o.metrics = {{"\xce\xbb", 0.5}};  // λ
  r = store_->Import(dir, o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  auto got = store_->GetVersion(r->record.id.Hex());
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->run, o.run);
  EXPECT_EQ(got->metrics.at("\xce\xbb"), 0.5);
}

TEST_F(StoreTextTest, AdapterConfigThatIsNotUtf8IsCorruption) {
  const fs::path dir = tmp_ / "adapter";
  testing::WriteModel(dir,
                      {{"base_model.model.layers.0.q_proj.lora_A.weight", F32({2, 4}, std::vector<float>(8, 0.5f))},
                       {"base_model.model.layers.0.q_proj.lora_B.weight", F32({4, 2}, std::vector<float>(8, 0.25f))}},
                      {{"adapter_config.json", "{\"r\": 2, \"note\": \"\xff\"}"}}, "adapter_model.safetensors");
  auto r = store_->Import(dir, ImportOptions{});
  EXPECT_EQ(r.status().code(), StatusCode::kCorruption);
  EXPECT_EQ(r.status().message(),
            "store " + (tmp_ / "db").string() + ": auxiliary file 'adapter_config.json' is not valid UTF-8 (byte 18)");
  ExpectNothingRecorded();
}

TEST_F(StoreTextTest, EventTextThatIsNotUtf8IsStoredWithReplacementCharacters) {
  auto v = store_->Import(Model("m", "vocab.txt"), ImportOptions{});
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  Event e{Event::Type::kAnomaly, 1000, "recv-\xff", v->record.id, std::nullopt, "lost \xc0\xaf at vocab.\xff"};
  ASSERT_TRUE(store_->AddEvent(e).ok());
  auto events = store_->ListEvents(v->record.id);
  ASSERT_TRUE(events.ok()) << events.status().ToString();
  ASSERT_EQ(events->size(), 1u);
  EXPECT_EQ((*events)[0].receiver, "recv-\xef\xbf\xbd");
  EXPECT_EQ((*events)[0].detail, "lost \xef\xbf\xbd\xef\xbf\xbd at vocab.\xef\xbf\xbd");
}

}  // namespace
}  // namespace ferry::store
