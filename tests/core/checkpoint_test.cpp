// Checkpoint::Open over every layout it accepts: a file, a directory with one of the
// well-known names, a lone *.safetensors, a sharded index; and what it refuses.
#include "core/checkpoint.h"

#include <gtest/gtest.h>

#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include "tests/temp_dir.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/safetensors.h"

namespace ferry {
namespace {

namespace fs = std::filesystem;

// Each test gets its own directory, removed afterwards.
class TempDir : public testing::ScopedTempDir {
 public:
  TempDir() : ScopedTempDir("ferry_ck_") {}
};

Tensor Filled(DType dtype, Shape shape, uint8_t seed) {
  Tensor t = Tensor::Empty(dtype, std::move(shape)).value();
  for (size_t i = 0; i < t.nbytes(); ++i) t.mutable_data()[i] = static_cast<std::byte>(seed + i);
  return t;
}

std::string Bytes(const Tensor& t) { return std::string(reinterpret_cast<const char*>(t.data()), t.nbytes()); }

// Writes {name: tensor} to `path` as one safetensors file.
void WriteFile(const fs::path& path, const std::vector<std::pair<std::string, Tensor>>& ts) {
  std::vector<TensorSpec> specs;
  for (const auto& [n, t] : ts) specs.push_back({n, t.dtype(), t.shape()});
  auto w = SafetensorsWriter::CreateFile(path, specs);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  for (const auto& [n, t] : ts) ASSERT_TRUE((*w)->Write(n, t).ok());
  ASSERT_TRUE((*w)->Finish().ok());
}

void WriteText(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

const std::vector<std::pair<std::string, Tensor>>& Sample() {
  static const auto* ts =
      new std::vector<std::pair<std::string, Tensor>>{{"model.layers.1.mlp.weight", Filled(DType::kBF16, {2, 3}, 10)},
                                                      {"model.embed_tokens.weight", Filled(DType::kF32, {4, 2}, 20)},
                                                      {"lm_head.weight", Filled(DType::kF16, {1}, 30)}};
  return *ts;
}

void ExpectSample(const Checkpoint& ck) {
  EXPECT_EQ(ck.names(),
            (std::vector<std::string>{"lm_head.weight", "model.embed_tokens.weight", "model.layers.1.mlp.weight"}));
  EXPECT_EQ(ck.size(), 3u);
  for (const auto& [n, t] : Sample()) {
    ASSERT_TRUE(ck.Contains(n));
    auto got = ck.Get(n);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(Bytes(*got), Bytes(t)) << n;
    const TensorInfo* info = ck.Info(n);
    ASSERT_NE(info, nullptr);
    EXPECT_EQ(info->dtype, t.dtype());
    EXPECT_EQ(info->shape, t.shape());
  }
  EXPECT_EQ(ck.total_bytes(), 12u + 32u + 2u);
}

TEST(Checkpoint, OpensASingleFile) {
  TempDir dir;
  const fs::path path = dir.path() / "weights.safetensors";
  WriteFile(path, Sample());
  auto ck = Checkpoint::Open(path);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_EQ(ck->format(), CheckpointFormat::kSafetensorsFile);
  EXPECT_EQ(ck->path(), path);
  EXPECT_EQ(ck->files(), std::vector<fs::path>{path});
  EXPECT_EQ(ck->FileOf("lm_head.weight"), path);
  EXPECT_EQ(ck->FileOf("absent"), fs::path());
  EXPECT_EQ(ck->metadata().at("format"), "pt");
  ExpectSample(*ck);
}

TEST(Checkpoint, MissingTensorIsNotFoundNamingCheckpointAndTensor) {
  TempDir dir;
  const fs::path path = dir.path() / "model.safetensors";
  WriteFile(path, Sample());
  auto ck = Checkpoint::Open(path);
  ASSERT_TRUE(ck.ok());
  auto missing = ck->Get("model.norm.weight");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find(path.string()), std::string::npos);
  EXPECT_NE(missing.status().message().find("'model.norm.weight'"), std::string::npos);
  EXPECT_EQ(ck->Info("model.norm.weight"), nullptr);
  EXPECT_FALSE(ck->Contains("model.norm.weight"));
}

TEST(Checkpoint, TensorsOutliveTheCheckpoint) {
  TempDir dir;
  const fs::path path = dir.path() / "model.safetensors";
  WriteFile(path, Sample());
  Tensor kept;
  {
    auto ck = Checkpoint::Open(path);
    ASSERT_TRUE(ck.ok());
    kept = ck->Get("model.embed_tokens.weight").value();
  }
  EXPECT_EQ(Bytes(kept), Bytes(Sample()[1].second));  // the mapping is still alive
}

TEST(Checkpoint, DirectoryWithWellKnownNames) {
  for (const char* name : {"model.safetensors", "adapter_model.safetensors", "consolidated.safetensors"}) {
    TempDir dir;
    WriteFile(dir.path() / name, Sample());
    WriteText(dir.path() / "config.json", "{}");
    WriteText(dir.path() / ".hidden.safetensors", "not even a safetensors file");
    WriteText(dir.path() / ".model.safetensors.tmp-77-3", "crashed writer leftovers");
    auto ck = Checkpoint::Open(dir.path());
    ASSERT_TRUE(ck.ok()) << name << ": " << ck.status().ToString();
    EXPECT_EQ(ck->path(), dir.path());
    EXPECT_EQ(ck->files(), std::vector<fs::path>{dir.path() / name});
    ExpectSample(*ck);
    auto found = FindWeights(dir.path());
    ASSERT_TRUE(found.ok());
    EXPECT_EQ(*found, dir.path() / name);
  }
}

TEST(Checkpoint, WellKnownNamesTakePriorityOverOthers) {
  TempDir dir;
  WriteFile(dir.path() / "adapter_model.safetensors", Sample());
  WriteText(dir.path() / "zzz.safetensors", "garbage that must not be read");
  auto found = FindWeights(dir.path());
  ASSERT_TRUE(found.ok());
  EXPECT_EQ(*found, dir.path() / "adapter_model.safetensors");
  auto ck = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  ExpectSample(*ck);
}

TEST(Checkpoint, ShardedDirectoryWithAnotherBasename) {
  TempDir dir;
  std::vector<TensorSpec> specs;
  for (const auto& [n, t] : Sample()) specs.push_back({n, t.dtype(), t.shape()});
  WriterOptions o;
  o.max_shard_bytes = 16;
  o.basename = "pytorch";
  auto w = SafetensorsWriter::CreateInDirectory(dir.path(), specs, o);
  ASSERT_TRUE(w.ok());
  for (const auto& [n, t] : Sample()) ASSERT_TRUE((*w)->Write(n, t).ok());
  ASSERT_TRUE((*w)->Finish().ok());
  auto found = FindWeights(dir.path());
  ASSERT_TRUE(found.ok()) << found.status().ToString();
  EXPECT_EQ(*found, dir.path() / "pytorch.safetensors.index.json");
  auto ck = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_EQ(ck->format(), CheckpointFormat::kSafetensorsSharded);
  EXPECT_EQ(ck->files().size(), 3u);
  EXPECT_EQ(ck->FileOf("lm_head.weight"), dir.path() / "pytorch-00003-of-00003.safetensors");
  ExpectSample(*ck);
}

TEST(Checkpoint, IndexMayListTensorsInAnyOrderAndExtraKeys) {
  TempDir dir;
  WriteFile(dir.path() / "part-a.safetensors", {Sample()[0]});
  WriteFile(dir.path() / "part-b.safetensors", {Sample()[1], Sample()[2]});
  WriteText(dir.path() / "model.safetensors.index.json",
            R"({"weight_map": {"lm_head.weight": "part-b.safetensors",
                "model.layers.1.mlp.weight": "part-a.safetensors",
                "model.embed_tokens.weight": "part-b.safetensors"},
                "metadata": {"total_size": 46, "format": "pt"}, "other": [1, 2]})");
  auto ck = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  ExpectSample(*ck);
  EXPECT_EQ(ck->FileOf("model.layers.1.mlp.weight"), dir.path() / "part-a.safetensors");
}

TEST(Checkpoint, LegacyPickleNeedsALoader) {
  TempDir dir;
  WriteText(dir.path() / "adapter_model.bin", "PK\x03\x04 pretend zip");
  SetLegacyLoader({});
  auto none = Checkpoint::Open(dir.path());
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(none.status().message().find((dir.path() / "adapter_model.bin").string()), std::string::npos);

  fs::path asked;
  SetLegacyLoader([&](const fs::path& p) -> Result<std::map<std::string, Tensor>> {
    asked = p;
    std::map<std::string, Tensor> m;
    for (const auto& [n, t] : Sample()) m[n] = t;
    return m;
  });
  auto ck = Checkpoint::Open(dir.path());
  SetLegacyLoader({});
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_EQ(asked, dir.path() / "adapter_model.bin");
  EXPECT_EQ(ck->format(), CheckpointFormat::kTorchPickle);
  EXPECT_TRUE(ck->files().empty());
  EXPECT_TRUE(ck->metadata().empty());
  EXPECT_EQ(ck->FileOf("lm_head.weight"), fs::path());
  ExpectSample(*ck);

  // A loader error passes through unchanged.
  SetLegacyLoader([](const fs::path& p) -> Result<std::map<std::string, Tensor>> {
    return Status::Corruption(p.string() + ": bad pickle");
  });
  auto bad = Checkpoint::Open(dir.path() / "adapter_model.bin");
  SetLegacyLoader({});
  EXPECT_EQ(bad.status().code(), StatusCode::kCorruption);
  EXPECT_NE(bad.status().message().find("adapter_model.bin: bad pickle"), std::string::npos);
}

TEST(Checkpoint, FromTensors) {
  std::map<std::string, Tensor> m;
  for (const auto& [n, t] : Sample()) m[n] = t;
  Checkpoint ck = Checkpoint::FromTensors("memory://x", m);
  EXPECT_EQ(ck.path(), fs::path("memory://x"));
  ExpectSample(ck);
  auto missing = ck.Get("nope");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("memory://x"), std::string::npos);
}

TEST(Checkpoint, ShardPathNamesAreConfinedToTheDirectory) {
  // A shard name that climbs out must be refused before anything is opened, even when
  // the target exists and is a valid checkpoint.
  TempDir dir;
  fs::create_directories(dir.path() / "inner");
  WriteFile(dir.path() / "outside.safetensors", {Sample()[0]});
  WriteText(dir.path() / "inner" / "model.safetensors.index.json",
            R"({"weight_map": {"model.layers.1.mlp.weight": "../outside.safetensors"}})");
  auto ck = Checkpoint::Open(dir.path() / "inner");
  ASSERT_FALSE(ck.ok());
  EXPECT_EQ(ck.status().code(), StatusCode::kCorruption);
  EXPECT_NE(ck.status().message().find("../outside.safetensors"), std::string::npos);
  EXPECT_NE(ck.status().message().find((dir.path() / "inner" / "model.safetensors.index.json").string()),
            std::string::npos);
}

// A FIFO named like weights must be refused at once, not block waiting for a writer.
// Run in a child with an alarm so that a regression fails instead of hanging the suite.
TEST(Checkpoint, FifoIsRefusedWithoutBlocking) {
  TempDir dir;
  for (const char* name : {"model.safetensors", "model.safetensors.index.json"}) {
    const fs::path fifo = dir.path() / name;
    ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::alarm(10);
      auto ck = Checkpoint::Open(fifo);
      const bool named = !ck.ok() && ck.status().message().find(fifo.string()) != std::string::npos;
      ::_exit(!ck.ok() && ck.status().code() == StatusCode::kInvalidArgument && named ? 0 : 1);
    }
    int wstatus = 0;
    ASSERT_EQ(::waitpid(pid, &wstatus, 0), pid);
    EXPECT_TRUE(WIFEXITED(wstatus)) << name << ": killed by signal " << WTERMSIG(wstatus) << " (blocked?)";
    EXPECT_EQ(WEXITSTATUS(wstatus), 0) << name << ": not refused with a named kInvalidArgument";
    fs::remove(fifo);
  }
}

TEST(Checkpoint, MissingPathAndEmptyDirectory) {
  TempDir dir;
  auto missing = Checkpoint::Open(dir.path() / "nope");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find((dir.path() / "nope").string()), std::string::npos);
  auto empty = Checkpoint::Open(dir.path());
  EXPECT_EQ(empty.status().code(), StatusCode::kNotFound);
  auto find = FindWeights(dir.path());
  EXPECT_EQ(find.status().code(), StatusCode::kNotFound);
  EXPECT_NE(find.status().message().find(dir.path().string()), std::string::npos);
}

// A producer-backed checkpoint announces its tensors without making them, makes each one
// afresh on every Get (nothing cached), and refuses a tensor that breaks its announcement.
TEST(Checkpoint, FromProducerMakesTensorsOnDemand) {
  std::map<std::string, int> calls;
  auto produce = [&](const std::string& name) -> Result<Tensor> {
    ++calls[name];
    if (name == "liar") return Tensor::Empty(DType::kF16, {2});
    FERRY_ASSIGN_OR_RETURN(Tensor t, Tensor::Empty(DType::kF32, {2, 3}));
    for (int i = 0; i < 6; ++i) t.mutable_data_as<float>()[i] = static_cast<float>(calls[name] * 10 + i);
    return t;
  };
  std::vector<TensorInfo> infos = {
      {"z", DType::kF32, {2, 3}, 0, 0}, {"a", DType::kF32, {2, 3}, 0, 0}, {"liar", DType::kF32, {2}, 0, 0}};
  Checkpoint c = Checkpoint::FromProducer("<made>", infos, produce);
  EXPECT_EQ(c.names(), (std::vector<std::string>{"a", "liar", "z"}));
  EXPECT_EQ(c.total_bytes(), 24u + 24u + 8u);
  ASSERT_NE(c.Info("a"), nullptr);
  EXPECT_EQ(c.Info("a")->nbytes(), 24u);
  EXPECT_TRUE(calls.empty());  // announcing makes nothing

  Tensor first = c.Get("a").value();
  Tensor second = c.Get("a").value();
  EXPECT_EQ(calls["a"], 2);
  EXPECT_NE(first.data(), second.data());
  EXPECT_EQ(first.data_as<float>()[5], 15.0f);
  EXPECT_EQ(second.data_as<float>()[5], 25.0f);
  EXPECT_EQ(c.RangeOf("a").fd, -1);
  c.Release("a");  // no-op

  auto bad = c.Get("liar");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInternal);
  EXPECT_NE(bad.status().message().find("'liar'"), std::string::npos) << bad.status().ToString();
  EXPECT_NE(bad.status().message().find("announced as F32 [2]"), std::string::npos) << bad.status().ToString();

  auto missing = c.Get("nope");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("<made>"), std::string::npos);

  Checkpoint copy = c;  // copies share the producer
  (void)copy.Get("z").value();
  EXPECT_EQ(calls["z"], 1);
}

}  // namespace
}  // namespace ferry
