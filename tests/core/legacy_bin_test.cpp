// The LibTorch pickle reader (plugin libferry_torchio.so, loaded on demand by Checkpoint)
// against the same adapter saved as safetensors by PEFT (fixtures/cases/legacy_bin_f32).
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/checkpoint.h"
#include "tests/temp_dir.h"

namespace ferry {
namespace {

const std::filesystem::path kCase = std::filesystem::path(FERRY_FIXTURES_DIR) / "cases" / "legacy_bin_f32";

class LegacyBin : public ::testing::Test {
 protected:
  void SetUp() override { ::setenv("FERRY_TORCHIO", FERRY_TORCHIO_PATH, 1); }
};

TEST_F(LegacyBin, MatchesSafetensorsCopyBitForBit) {
  auto bin = Checkpoint::Open(kCase / "adapter");
  ASSERT_TRUE(bin.ok()) << bin.status().ToString();
  EXPECT_EQ(bin->format(), CheckpointFormat::kTorchPickle);
  auto st = Checkpoint::Open(kCase / "adapter_safetensors");
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  ASSERT_EQ(bin->names(), st->names());
  ASSERT_GT(bin->size(), 0u);
  for (const auto& name : st->names()) {
    auto a = bin->Get(name);
    auto b = st->Get(name);
    ASSERT_TRUE(a.ok() && b.ok()) << name;
    EXPECT_EQ(a->dtype(), b->dtype()) << name;
    EXPECT_EQ(a->shape(), b->shape()) << name;
    ASSERT_EQ(a->nbytes(), b->nbytes()) << name;
    EXPECT_EQ(std::memcmp(a->data(), b->data(), a->nbytes()), 0) << name;
  }
}

TEST_F(LegacyBin, GarbageIsCorruptionNamingTheFile) {
  ferry::testing::ScopedTempDir tmp("ferry_legacy_garbage_");
  const std::filesystem::path dir = tmp.path();
  { std::ofstream(dir / "adapter_model.bin") << "this is not a zip file"; }
  auto c = Checkpoint::Open(dir);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kCorruption);
  EXPECT_NE(c.status().message().find((dir / "adapter_model.bin").string()), std::string::npos) << c.status().message();
}

// In a freshly executed child process: the loader is process-wide state, and a forked child
// would inherit the plugin the other tests loaded.
TEST_F(LegacyBin, DisabledLoaderIsUnsupportedNamingTheFile) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        SetLegacyLoader(nullptr);
        auto c = Checkpoint::Open(kCase / "adapter");
        const bool ok = !c.ok() && c.status().code() == StatusCode::kUnsupported &&
                        c.status().message().find("adapter_model.bin") != std::string::npos;
        std::exit(ok ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST_F(LegacyBin, MissingPluginSaysWhatWasTried) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        ::setenv("FERRY_TORCHIO", "/nonexistent/libferry_torchio.so", 1);
        auto c = Checkpoint::Open(kCase / "adapter");
        // The test binary's own directory has no plugin, and the system path neither.
        const std::string m = c.ok() ? "" : c.status().message();
        const bool ok = !c.ok() && c.status().code() == StatusCode::kUnsupported &&
                        m.find("/nonexistent/libferry_torchio.so") != std::string::npos &&
                        m.find("FERRY_TORCHIO") != std::string::npos;
        std::exit(ok ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace ferry
