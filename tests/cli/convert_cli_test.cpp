// `ferry convert` end to end: exit codes, --json, --help, errors, and the legacy .bin adapter
// (read through the LibTorch loader the binary installs).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/checkpoint.h"
#include "tests/cli/cli_runner.h"

namespace ferry {
namespace {

namespace fs = std::filesystem;
using testing::RunFerry;
const fs::path kCases = fs::path(FERRY_FIXTURES_DIR) / "cases";

class ConvertCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("ferry_convert_cli_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(ConvertCli, JsonSummaryAndExitZero) {
  const fs::path c = kCases / "llama_tied_lmhead_lora_f32";
  auto r = RunFerry({"convert", "--base", (c / "base").string(), "--adapter", (c / "adapter").string(), "--out",
                     (dir_ / "out").string(), "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["layout"], "hf");
  EXPECT_EQ(j["untied_lm_head"], true);
  EXPECT_EQ(j["out"], (dir_ / "out").string());
  EXPECT_GT(j["lora_modules"].get<int>(), 0);
  EXPECT_TRUE(fs::exists(dir_ / "out" / "model.safetensors"));
  auto cfg = nlohmann::json::parse(std::ifstream(dir_ / "out" / "config.json"));
  EXPECT_EQ(cfg["tie_word_embeddings"], false);
}

TEST_F(ConvertCli, ErrorsExitOneNameTheFileAndLeaveNothing) {
  const fs::path c = kCases / "refuse_pissa";
  auto r = RunFerry({"convert", "--base", (kCases / "llama_lora_all_linear_f32" / "base").string(), "--adapter",
                     (c / "adapter").string(), "--out", (dir_ / "out").string()});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.signal, 0);
  EXPECT_NE(r.err.find("ferry: error: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find((c / "adapter" / "adapter_config.json").string()), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("pissa"), std::string::npos) << r.err;
  EXPECT_TRUE(fs::is_empty(dir_));

  auto missing = RunFerry({"convert", "--base", (dir_ / "nope").string(), "--adapter", (c / "adapter").string(),
                           "--out", (dir_ / "out").string()});
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.err.find((dir_ / "nope").string()), std::string::npos) << missing.err;

  auto layout = RunFerry({"convert", "--base", "x", "--adapter", "y", "--out", "z", "--layout", "gguf"});
  EXPECT_EQ(layout.exit_code, 1);
  EXPECT_NE(layout.err.find("unknown layout 'gguf'"), std::string::npos) << layout.err;

  auto shard = RunFerry({"convert", "--base", "x", "--adapter", "y", "--out", "z", "--max-shard-size", "5 parsecs"});
  EXPECT_EQ(shard.exit_code, 1);
  EXPECT_NE(shard.err.find("--max-shard-size"), std::string::npos) << shard.err;
}

// The library names the option that fixes a refusal (ConvertRemedy); the CLI names the flag.
TEST_F(ConvertCli, RefusalsNameTheFlagThatFixesThem) {
  const fs::path d = kCases / "mistral_dora_f32";
  auto dora = RunFerry({"convert", "--base", (d / "base").string(), "--adapter", (d / "adapter").string(), "--out",
                        (dir_ / "lora").string(), "--layout", "lora"});
  EXPECT_EQ(dora.exit_code, 1);
  EXPECT_NE(dora.err.find("convert to the hf or fused layout instead; use --layout hf (or --layout fused)"),
            std::string::npos)
      << dora.err;
  EXPECT_TRUE(fs::is_empty(dir_));

  // A refusal of every layout (peft_type) gets no layout advice.
  const fs::path ia3 = kCases / "refuse_ia3";
  auto other = RunFerry({"convert", "--base", (kCases / "llama_lora_all_linear_f32" / "base").string(), "--adapter",
                         (ia3 / "adapter").string(), "--out", (dir_ / "lora").string(), "--layout", "lora"});
  EXPECT_EQ(other.exit_code, 1);
  EXPECT_EQ(other.err.find("--layout"), std::string::npos) << other.err;

  fs::create_directories(dir_ / "taken");
  auto taken = RunFerry({"convert", "--base", (d / "base").string(), "--adapter", (d / "adapter").string(), "--out",
                         (dir_ / "taken").string()});
  EXPECT_EQ(taken.exit_code, 1);
  EXPECT_NE(taken.err.find("output already exists (replacing it needs the force option); pass --force to replace it"),
            std::string::npos)
      << taken.err;
}

std::string FileBytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// --no-fsync only skips durability: the same files, byte for byte, renamed into place whole.
TEST_F(ConvertCli, NoFsyncWritesTheSameFiles) {
  const fs::path c = kCases / "llama_lora_all_linear_f32";
  for (const char* layout : {"hf", "lora"}) {
    const fs::path synced = dir_ / (std::string(layout) + "_synced"), fast = dir_ / (std::string(layout) + "_fast");
    auto a = RunFerry({"convert", "--base", (c / "base").string(), "--adapter", (c / "adapter").string(), "--out",
                       synced.string(), "--layout", layout});
    auto b = RunFerry({"convert", "--base", (c / "base").string(), "--adapter", (c / "adapter").string(), "--out",
                       fast.string(), "--layout", layout, "--no-fsync"});
    ASSERT_EQ(a.exit_code, 0) << a.err;
    ASSERT_EQ(b.exit_code, 0) << b.err;
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(synced)) names.push_back(e.path().filename().string());
    std::vector<std::string> fast_names;
    for (const auto& e : fs::directory_iterator(fast)) fast_names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    std::sort(fast_names.begin(), fast_names.end());
    EXPECT_EQ(names, fast_names) << layout;
    ASSERT_FALSE(names.empty());
    for (const auto& n : names) EXPECT_EQ(FileBytes(synced / n), FileBytes(fast / n)) << layout << " " << n;
    // Nothing staged is left beside the outputs.
    for (const auto& e : fs::directory_iterator(dir_)) {
      EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
    }
  }
}

TEST_F(ConvertCli, HelpListsLayoutsAndFlags) {
  auto r = RunFerry({"convert", "--help"});
  EXPECT_EQ(r.exit_code, 0);
  for (const char* s : {"--base", "--adapter", "--out", "--layout", "--dtype", "--max-shard-size", "--force", "--json",
                        "--no-fsync", "fused", "lora"}) {
    EXPECT_NE(r.out.find(s), std::string::npos) << s;
  }
}

TEST_F(ConvertCli, LegacyBinAdapterMergesLikeItsSafetensorsTwin) {
  const fs::path c = kCases / "legacy_bin_f32";
  ASSERT_TRUE(fs::exists(c / "adapter" / "adapter_model.bin"));
  auto r = RunFerry({"convert", "--base", (c / "base").string(), "--adapter", (c / "adapter").string(), "--out",
                     (dir_ / "from_bin").string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto ref = Checkpoint::Open(c / "merged").value();
  auto got = Checkpoint::Open(dir_ / "from_bin").value();
  ASSERT_EQ(ref.names(), got.names());
  for (const auto& n : ref.names()) {
    auto a = ref.Get(n).value();
    auto b = got.Get(n).value();
    std::vector<float> va(static_cast<size_t>(a.numel())), vb(va.size());
    ASSERT_TRUE(ReadAsF32(a, va).ok() && ReadAsF32(b, vb).ok());
    float scale = 0;
    for (float x : va) scale = std::max(scale, std::fabs(x));
    for (size_t i = 0; i < va.size(); ++i) ASSERT_LE(std::fabs(va[i] - vb[i]), 1e-5f * scale) << n;
  }
}

}  // namespace
}  // namespace ferry
