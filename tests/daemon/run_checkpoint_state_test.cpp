// daemon/run/checkpoint_state.h: trainer_state.json read strictly and written back equal, a
// checkpoint file checked against its record (naming the tensor, or the header), an adapter
// checked against the store's version record, and optimizer.safetensors read strictly.
#include "daemon/run/checkpoint_state.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "tests/temp_dir.h"

namespace ferry::run {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

TrainerState SampleState() {
  TrainerState st;
  st.global_step = 12;
  st.micro_step = 24;
  st.num_tokens = 4096.5;
  st.dataset_epoch = 1;
  st.dataset_index = 7;
  st.dataset_digest = "0123456789abcdef0123456789abcdef";
  st.config_fingerprint = "fedcba9876543210fedcba9876543210";
  st.pending_metrics = {{"reward", {0.5, std::nan("")}}, {"loss", {0.25, 0.125}}};
  st.last_logged = 10;
  st.generator_version = "00112233445566778899aabbccddeeff";
  st.torch_rng_state = "00ff10";
  st.rollout = RolloutState{17, {{"reward", 0.75}, {"frac", std::nan("")}}, {{0, 3}, {1, 2}}};
  CheckpointFile f;
  f.size = 1234;
  f.digest = store::AuxDigest("x");
  f.tensors["a"] = store::AuxDigest("a");
  st.files["optimizer.safetensors"] = f;
  st.files["adapter_config.json"] = CheckpointFile{10, store::AuxDigest("y"), {}};
  return st;
}

TEST(CheckpointStateTest, TrainerStateReadsBackWhatWasWrittenNaNIncluded) {
  const TrainerState st = SampleState();
  auto back = ParseTrainerState(TrainerStateJson(st), "t.json");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->global_step, 12);
  EXPECT_EQ(back->micro_step, 24);
  EXPECT_EQ(back->num_tokens, 4096.5);
  EXPECT_EQ(back->dataset_index, 7u);
  EXPECT_EQ(back->pending_metrics.at("reward")[0], 0.5);
  EXPECT_TRUE(std::isnan(back->pending_metrics.at("reward")[1]));
  ASSERT_TRUE(back->rollout.has_value());
  EXPECT_EQ(back->rollout->rows, (std::vector<std::vector<int64_t>>{{0, 3}, {1, 2}}));
  EXPECT_TRUE(std::isnan(back->rollout->metrics.at("frac")));
  EXPECT_EQ(back->files.at("optimizer.safetensors").size, 1234u);
  EXPECT_EQ(back->files.at("optimizer.safetensors").tensors.at("a"), store::AuxDigest("a"));
  EXPECT_TRUE(back->files.at("adapter_config.json").tensors.empty());
}

// Each edit of a valid file and the field its error must name.
TEST(CheckpointStateTest, TrainerStateRefusesWhatIsNotAsDescribedNamingTheField) {
  const json good = json::parse(TrainerStateJson(SampleState()));
  struct Case {
    std::string field;  // what the message names
    std::function<void(json&)> edit;
  };
  const std::vector<Case> cases = {
      {"global_step", [](json& j) { j.erase("global_step"); }},
      {"global_step", [](json& j) { j["global_step"] = -1; }},
      {"global_step", [](json& j) { j["global_step"] = "12"; }},
      {"last_logged", [](json& j) { j["last_logged"] = 13; }},
      {"num_tokens", [](json& j) { j["num_tokens"] = -5; }},
      {"dataset.index", [](json& j) { j["dataset"]["index"] = 1.5; }},
      {"generator_version", [](json& j) { j["generator_version"] = "00112233"; }},
      {"generator_version", [](json& j) { j["generator_version"] = "00112233445566778899AABBCCDDEEFF"; }},
      {"torch_rng_state", [](json& j) { j["torch_rng_state"] = "abc"; }},
      {"pending_metrics.reward",
       [](json& j) {
         j["pending_metrics"]["reward"] = {1, 2, 3};
       }},
      {"pending_metrics.loss",
       [](json& j) {
         j["pending_metrics"]["loss"] = {"high", 1};
       }},
      {"rollout.rows",
       [](json& j) {
         j["rollout"]["rows"] = {{0, -1}};
       }},
      {"files", [](json& j) { j["files"]["../evil"] = j["files"]["adapter_config.json"]; }},
      {"files", [](json& j) { j["files"]["trainer_state.json"] = j["files"]["adapter_config.json"]; }},
      {"files.adapter_config.json.digest", [](json& j) { j["files"]["adapter_config.json"]["digest"] = "zz"; }},
      {"files.optimizer.safetensors.tensors.a",
       [](json& j) { j["files"]["optimizer.safetensors"]["tensors"]["a"] = 1; }},
  };
  for (const Case& c : cases) {
    json j = good;
    c.edit(j);
    auto st = ParseTrainerState(j.dump(), "/r/checkpoint-12/trainer_state.json");
    ASSERT_FALSE(st.ok()) << c.field << ": " << j.dump();
    EXPECT_EQ(st.status().code(), StatusCode::kCorruption);
    EXPECT_NE(st.status().message().find("/r/checkpoint-12/trainer_state.json: field '" + c.field + "'"),
              std::string::npos)
        << st.status().message();
  }
  auto junk = ParseTrainerState("{\"global_step\": 1", "t.json");
  ASSERT_FALSE(junk.ok());
  EXPECT_EQ(junk.status().message(), "t.json: not a JSON object");
}

// A file of two F32 tensors ([2, 2], and [2, 2] or [4]) written with metadata.
void WriteTwoTensors(const fs::path& file, float a0, std::map<std::string, std::string> meta = {},
                     bool same_shape = true) {
  std::vector<float> a = {a0, 2, 3, 4}, b = {5, 6, 7, 8};
  const Shape b_shape = same_shape ? Shape{2, 2} : Shape{4};
  auto ta = Tensor::Wrap(DType::kF32, {2, 2}, std::as_bytes(std::span<const float>(a)), nullptr);
  auto tb = Tensor::Wrap(DType::kF32, b_shape, std::as_bytes(std::span<const float>(b)), nullptr);
  ASSERT_TRUE(ta.ok() && tb.ok());
  WriterOptions o;
  o.metadata = std::move(meta);
  auto w = SafetensorsWriter::CreateFile(
      file, {{"exp_avg.k", DType::kF32, {2, 2}}, {"exp_avg_sq.k", DType::kF32, b_shape}}, o);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  ASSERT_TRUE((*w)->Write("exp_avg.k", *ta).ok());
  ASSERT_TRUE((*w)->Write("exp_avg_sq.k", *tb).ok());
  ASSERT_TRUE((*w)->Finish().ok());
}

TEST(CheckpointStateTest, CheckedFileNamesTheTensorThatChangedOrItsHeader) {
  testing::ScopedTempDir tmp;
  WriteTwoTensors(tmp.path() / "optimizer.safetensors", 1, {{"step.k", "3"}});
  auto rec = RecordCheckpointFile(tmp.path(), "optimizer.safetensors");
  ASSERT_TRUE(rec.ok()) << rec.status().ToString();
  EXPECT_EQ(rec->tensors.size(), 2u);
  EXPECT_TRUE(CheckCheckpointFile(tmp.path(), "optimizer.safetensors", *rec).ok());

  WriteTwoTensors(tmp.path() / "optimizer.safetensors", 1.0000001f, {{"step.k", "3"}});
  Status s = CheckCheckpointFile(tmp.path(), "optimizer.safetensors", *rec);
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find((tmp.path() / "optimizer.safetensors").string() +
                             ": tensor 'exp_avg.k' differs from what was written"),
            std::string::npos)
      << s.message();

  WriteTwoTensors(tmp.path() / "optimizer.safetensors", 1, {{"step.k", "4"}});
  s = CheckCheckpointFile(tmp.path(), "optimizer.safetensors", *rec);
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find("optimizer.safetensors: its header differs from what was written (every tensor matches)"),
            std::string::npos)
      << s.message();

  {
    std::ofstream garbage(tmp.path() / "optimizer.safetensors", std::ios::binary | std::ios::trunc);
    garbage << "not a safetensors file";
  }
  s = CheckCheckpointFile(tmp.path(), "optimizer.safetensors", *rec);
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find((tmp.path() / "optimizer.safetensors").string() + ": is 22 bytes, " +
                             std::to_string(rec->size) + " were written, and its header no longer reads: "),
            std::string::npos)
      << s.message();

  fs::remove(tmp.path() / "optimizer.safetensors");
  s = CheckCheckpointFile(tmp.path(), "optimizer.safetensors", *rec);
  EXPECT_NE(s.message().find("optimizer.safetensors: missing"), std::string::npos) << s.message();
}

TEST(CheckpointStateTest, AdapterIsCheckedAgainstTheStoresVersionRecord) {
  testing::ScopedTempDir tmp;
  const fs::path file = tmp.path() / "adapter_model.safetensors";
  WriteTwoTensors(file, 1);
  auto ckpt = Checkpoint::Open(file);
  ASSERT_TRUE(ckpt.ok());
  store::VersionRecord v;
  v.id = store::AuxDigest("version");
  for (const std::string& name : ckpt->names()) {
    auto t = ckpt->Get(name);
    ASSERT_TRUE(t.ok());
    store::TensorRow row;
    row.name = name;
    row.digest = store::TensorDigest(*t);
    v.tensors.push_back(row);
  }
  EXPECT_TRUE(CheckAgainstVersion(*ckpt, v).ok());

  store::VersionRecord other = v;
  other.tensors[1].digest = store::AuxDigest("else");
  Status s = CheckAgainstVersion(*ckpt, other);
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find(file.string() + ": tensor 'exp_avg_sq.k' differs from the store's record of version " +
                             v.id.Hex()),
            std::string::npos)
      << s.message();

  store::VersionRecord more = v;
  store::TensorRow z;
  z.name = "z";
  more.tensors.push_back(z);
  s = CheckAgainstVersion(*ckpt, more);
  EXPECT_NE(s.message().find("tensor 'z' of version " + v.id.Hex() + " is missing"), std::string::npos) << s.message();
}

TEST(CheckpointStateTest, OptimizerStateIsReadStrictly) {
  testing::ScopedTempDir tmp;
  const fs::path file = tmp.path() / "optimizer.safetensors";
  auto read = [&](std::map<std::string, std::string> meta, bool same_shape = true) {
    WriteTwoTensors(file, 1, std::move(meta), same_shape);
    auto ckpt = Checkpoint::Open(file);
    EXPECT_TRUE(ckpt.ok());
    return ReadOptimizerState(*ckpt);
  };
  auto good = read({{"step.k", "3"}});
  ASSERT_TRUE(good.ok()) << good.status().ToString();
  EXPECT_EQ(good->at("k").step, 3);
  EXPECT_EQ(good->at("k").exp_avg_sq.shape(), (Shape{2, 2}));
  auto shapes = read({{"step.k", "3"}}, /*same_shape=*/false);
  ASSERT_FALSE(shapes.ok());
  EXPECT_NE(shapes.status().message().find("exp_avg and exp_avg_sq of 'k' have different shapes"), std::string::npos)
      << shapes.status().message();
  for (const char* bad : {"0", "-1", "3x", "", "99999999999999999999"}) {
    auto r = read({{"step.k", bad}});
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find(file.string() + ": metadata 'step.k' is not a step count"), std::string::npos)
        << r.status().message();
  }
  auto orphan = read({});
  ASSERT_FALSE(orphan.ok());
  EXPECT_NE(orphan.status().message().find("tensor 'exp_avg.k' is not the state of an adapter tensor"),
            std::string::npos)
      << orphan.status().message();
  auto missing = read({{"step.k", "2"}, {"step.q", "2"}});
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("tensor 'exp_avg.q' is missing"), std::string::npos)
      << missing.status().message();
}

}  // namespace
}  // namespace ferry::run
