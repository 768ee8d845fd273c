// End-to-end tests of `ferry diff`: exit codes (0 equal, 3 different, 1 error), the
// table, and the JSON report.
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "tests/cli/cli_runner.h"

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/safetensors.h"
#include "core/tensor.h"

extern char** environ;

namespace ferry {
namespace {

namespace fs = std::filesystem;

struct RunResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

class DiffCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::path(::testing::TempDir()) / "ferry_diff_cli_XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  // Runs `ferry <args>` (the shared runner); a signal shows as 128 + signal number.
  RunResult Run(const std::vector<std::string>& args) {
    testing::CliResult c = testing::RunFerry(args);
    return RunResult{c.signal != 0 ? 128 + c.signal : c.exit_code, c.out, c.err};
  }

  // Writes one BF16 tensor "w" of shape [2, 3] (and an I32 "ids") to <dir>/<name>.
  fs::path WriteModel(const std::string& name, const std::vector<uint16_t>& w_bits) {
    const fs::path path = dir_ / name;
    auto w = Tensor::Empty(DType::kBF16, {2, 3});
    EXPECT_TRUE(w.ok());
    std::memcpy(w->mutable_data(), w_bits.data(), 12);
    auto ids = Tensor::Empty(DType::kI32, {2});
    EXPECT_TRUE(ids.ok());
    ids->mutable_data_as<int32_t>()[0] = 7;
    ids->mutable_data_as<int32_t>()[1] = -1;
    WriterOptions opts;
    opts.sync = false;
    auto writer = SafetensorsWriter::CreateFile(path, {{"ids", DType::kI32, {2}}, {"w", DType::kBF16, {2, 3}}}, opts);
    EXPECT_TRUE(writer.ok()) << writer.status().ToString();
    EXPECT_TRUE((*writer)->Write("ids", *ids).ok());
    EXPECT_TRUE((*writer)->Write("w", *w).ok());
    EXPECT_TRUE((*writer)->Finish().ok());
    return path;
  }

  fs::path dir_;
  // 1, 2, -3, 0.25, 0, 1 in BF16.
  const std::vector<uint16_t> base_ = {0x3f80, 0x4000, 0xc040, 0x3e80, 0x0000, 0x3f80};
};

TEST_F(DiffCliTest, EqualFilesExitZero) {
  const fs::path a = WriteModel("a.safetensors", base_);
  const fs::path b = WriteModel("b.safetensors", base_);
  RunResult r = Run({"diff", a.string(), b.string()});
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("2 tensors: 2 equal"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("EQUAL within tolerance"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("DIFFERENT"), std::string::npos) << r.out;
}

TEST_F(DiffCliTest, DirectoryAndFileOfTheSameModelAreEqual) {
  const fs::path a = WriteModel("a.safetensors", base_);
  fs::create_directory(dir_ / "model_dir");
  const fs::path b = WriteModel("model_dir/model.safetensors", base_);
  RunResult r = Run({"diff", a.string(), (dir_ / "model_dir").string()});
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find(b.parent_path().string()), std::string::npos) << r.out;
}

TEST_F(DiffCliTest, OneUlpDifferenceExitsThreeUnlessToleratedAndJsonDescribesIt) {
  std::vector<uint16_t> changed = base_;
  changed[5] = 0x3f81;  // one BF16 ulp above 1.0, at [1, 2]
  const fs::path a = WriteModel("a.safetensors", base_);
  const fs::path b = WriteModel("b.safetensors", changed);

  RunResult plain = Run({"diff", a.string(), b.string()});
  EXPECT_EQ(plain.exit_code, 3) << plain.out << plain.err;
  EXPECT_NE(plain.out.find("DIFFERENT"), std::string::npos) << plain.out;
  EXPECT_NE(plain.out.find("w "), std::string::npos) << plain.out;      // the differing tensor is listed
  EXPECT_EQ(plain.out.find("\nids "), std::string::npos) << plain.out;  // equal ones are not, by default
  EXPECT_NE(plain.out.find("at [1, 2]"), std::string::npos) << plain.out;
  EXPECT_TRUE(plain.err.empty()) << plain.err;  // a difference is not an error

  RunResult all = Run({"diff", a.string(), b.string(), "--show", "all"});
  EXPECT_EQ(all.exit_code, 3);
  EXPECT_NE(all.out.find("\nids "), std::string::npos) << all.out;

  RunResult tolerated = Run({"diff", a.string(), b.string(), "--max-ulp", "1"});
  EXPECT_EQ(tolerated.exit_code, 0) << tolerated.out << tolerated.err;
  EXPECT_NE(tolerated.out.find("1 within tolerance"), std::string::npos) << tolerated.out;

  RunResult by_atol = Run({"diff", a.string(), b.string(), "--atol", "0.0078125"});
  EXPECT_EQ(by_atol.exit_code, 0) << by_atol.out;

  RunResult js = Run({"diff", a.string(), b.string(), "--json"});
  EXPECT_EQ(js.exit_code, 3) << js.err;
  nlohmann::json j = nlohmann::json::parse(js.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << js.out;
  EXPECT_EQ(j["equal"], false);
  EXPECT_EQ(j["a"], a.string());
  EXPECT_EQ(j["counts"]["tensors"], 2);
  EXPECT_EQ(j["counts"]["equal"], 1);
  EXPECT_EQ(j["counts"]["different"], 1);
  ASSERT_EQ(j["tensors"].size(), 2u);  // JSON lists every tensor
  const auto& w = j["tensors"][1];
  EXPECT_EQ(w["name"], "w");
  EXPECT_EQ(w["status"], "different");
  EXPECT_EQ(w["dtype_a"], "BF16");
  EXPECT_EQ(w["shape_a"], nlohmann::json::array({2, 3}));
  EXPECT_EQ(w["max_ulp_diff"], 1);
  EXPECT_EQ(w["max_abs_diff"], 0.0078125);
  EXPECT_EQ(w["max_diff_index"], 5);
  EXPECT_EQ(w["max_diff_position"], nlohmann::json::array({1, 2}));
  EXPECT_EQ(w["mismatched"], 1);
  // ||b - a|| / ||a|| = 2^-7 / sqrt(1 + 4 + 9 + 1/16 + 0 + 1).
  EXPECT_NEAR(w["rel_norm"].get<double>(), 0.0078125 / std::sqrt(15.0625), 1e-12);
  EXPECT_EQ(j["tensors"][0]["status"], "equal");
  EXPECT_EQ(j["tensors"][0]["compared"], "exact");

  RunResult js_ok = Run({"diff", a.string(), b.string(), "--json", "--max-ulp", "1"});
  EXPECT_EQ(js_ok.exit_code, 0);
  nlohmann::json j2 = nlohmann::json::parse(js_ok.out, nullptr, false);
  ASSERT_FALSE(j2.is_discarded()) << js_ok.out;
  EXPECT_EQ(j2["equal"], true);
  EXPECT_EQ(j2["options"]["max_ulp"], 1);
  EXPECT_EQ(j2["tensors"][1]["status"], "within_tolerance");
}

TEST_F(DiffCliTest, NonFiniteNumbersAreStringsInJson) {
  const fs::path a = WriteModel("a.safetensors", {0, 0, 0, 0, 0, 0});
  const fs::path b = WriteModel("b.safetensors", {0, 0, 0, 0, 0, 0x7f80});  // +inf
  RunResult js = Run({"diff", a.string(), b.string(), "--json"});
  EXPECT_EQ(js.exit_code, 3);
  nlohmann::json j = nlohmann::json::parse(js.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << js.out;
  EXPECT_EQ(j["tensors"][1]["max_abs_diff"], "inf");
  EXPECT_EQ(j["tensors"][1]["inf_mismatches"], 1);
  EXPECT_EQ(j["tensors"][1]["b_at_max"], "inf");
}

TEST_F(DiffCliTest, MissingFileIsAnErrorNamingIt) {
  const fs::path a = WriteModel("a.safetensors", base_);
  const fs::path missing = dir_ / "nope.safetensors";
  RunResult r = Run({"diff", a.string(), missing.string()});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find(missing.string()), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("ferry: error:"), std::string::npos) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
}

TEST_F(DiffCliTest, CorruptFileIsAnErrorNamingIt) {
  const fs::path a = WriteModel("a.safetensors", base_);
  const fs::path bad = dir_ / "bad.safetensors";
  std::ofstream(bad) << "this is not a safetensors file";
  RunResult r = Run({"diff", bad.string(), a.string()});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find(bad.string()), std::string::npos) << r.err;
}

TEST_F(DiffCliTest, BadArgumentsAreErrors) {
  const fs::path a = WriteModel("a.safetensors", base_);
  RunResult show = Run({"diff", a.string(), a.string(), "--show", "some"});
  EXPECT_EQ(show.exit_code, 1);
  EXPECT_NE(show.err.find("--show"), std::string::npos) << show.err;
  RunResult one = Run({"diff", a.string()});
  EXPECT_EQ(one.exit_code, 1);
  EXPECT_NE(one.err.find("two checkpoints"), std::string::npos) << one.err;
  RunResult atol = Run({"diff", a.string(), a.string(), "--atol", "-1"});
  EXPECT_EQ(atol.exit_code, 1);
  EXPECT_NE(atol.err.find("atol"), std::string::npos) << atol.err;
}

TEST_F(DiffCliTest, HelpDocumentsExitStatus) {
  RunResult r = Run({"diff", "--help"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("Exit status: 0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("3 when they differ"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace ferry
