#include "convert/inspect.h"

#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/safetensors.h"
#include "tests/temp_dir.h"

namespace ferry {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A fresh temporary directory, removed with the fixture.
class InspectTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tmp_ = std::make_unique<ferry::testing::ScopedTempDir>("ferry_inspect_");
    dir_ = tmp_->path();
  }
  void TearDown() override { tmp_.reset(); }
  std::unique_ptr<ferry::testing::ScopedTempDir> tmp_;

  static void WriteText(const fs::path& path, const std::string& text) { std::ofstream(path) << text; }

  // Writes zero-filled tensors with `specs` to `path` (or into directory `path` with shards).
  static void WriteTensors(const fs::path& path, const std::vector<TensorSpec>& specs, uint64_t max_shard_bytes = 0) {
    WriterOptions options;
    options.sync = false;
    options.max_shard_bytes = max_shard_bytes;
    auto writer = max_shard_bytes == 0 ? SafetensorsWriter::CreateFile(path, specs, options)
                                       : SafetensorsWriter::CreateInDirectory(path, specs, options);
    ASSERT_TRUE(writer.ok()) << writer.status().ToString();
    for (const TensorSpec& s : specs) {
      auto t = Tensor::Empty(s.dtype, s.shape);
      ASSERT_TRUE(t.ok());
      ASSERT_TRUE((*writer)->Write(s.name, *t).ok());
    }
    ASSERT_TRUE((*writer)->Finish().ok());
  }

  // An adapter: q_proj rank 4 (rank_pattern), v_proj rank 8 with alpha 32 (alpha_pattern),
  // k_proj written with rank 6 although the config says 8.
  void WriteAdapter(const fs::path& dir, const std::string& extra_config = "") {
    fs::create_directories(dir);
    WriteText(dir / "adapter_config.json", R"({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
        "target_modules": ["q_proj", "v_proj", "k_proj"], "rank_pattern": {"q_proj": 4},
        "alpha_pattern": {"v_proj": 32}, "modules_to_save": ["lm_head"])" +
                                               extra_config + "}");
    const std::string p = "base_model.model.model.layers.0.self_attn.";
    WriteTensors(dir / "adapter_model.safetensors", {{"base_model.model.lm_head.weight", DType::kF32, {32, 16}},
                                                     {p + "k_proj.lora_A.weight", DType::kF32, {6, 16}},
                                                     {p + "k_proj.lora_B.weight", DType::kF32, {8, 6}},
                                                     {p + "q_proj.lora_A.weight", DType::kF32, {4, 16}},
                                                     {p + "q_proj.lora_B.weight", DType::kF32, {16, 4}},
                                                     {p + "v_proj.lora_A.weight", DType::kBF16, {8, 16}},
                                                     {p + "v_proj.lora_B.weight", DType::kBF16, {8, 8}}});
  }

  fs::path dir_;
};

bool HasIssue(const InspectReport& r, const std::string& needle) {
  for (const auto& i : r.issues) {
    if (i.find(needle) != std::string::npos) return true;
  }
  return false;
}

TEST_F(InspectTest, SafetensorsFileTotals) {
  const fs::path file = dir_ / "w.safetensors";
  WriteTensors(file, {{"c", DType::kF16, {2, 2}}, {"a", DType::kF32, {2, 3}}, {"b", DType::kBF16, {4}}});
  auto r = Inspect(file);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->kind, InspectReport::Kind::kFile);
  EXPECT_EQ(r->format, "safetensors");
  ASSERT_EQ(r->files.size(), 1u);
  EXPECT_EQ(r->files[0], file.string());
  ASSERT_EQ(r->tensors.size(), 3u);
  EXPECT_EQ(r->tensors[0].name, "a");
  EXPECT_EQ(r->tensors[0].shape, (Shape{2, 3}));
  EXPECT_EQ(r->tensors[0].bytes, 24u);
  EXPECT_EQ(r->tensors[1].name, "b");
  EXPECT_EQ(r->tensors[1].dtype, DType::kBF16);
  EXPECT_EQ(r->totals.count, 3u);
  EXPECT_EQ(r->totals.bytes, 24u + 8u + 8u);
  EXPECT_EQ(r->totals.params, 6u + 4u + 4u);
  ASSERT_EQ(r->totals.by_dtype.size(), 3u);
  for (const DTypeTotal& d : r->totals.by_dtype) {
    EXPECT_EQ(d.count, 1u);
    EXPECT_EQ(d.bytes, d.dtype == DType::kF32 ? 24u : 8u);
    EXPECT_EQ(d.params, d.dtype == DType::kF32 ? 6u : 4u);
  }
  EXPECT_EQ(r->metadata.at("format"), "pt");
  EXPECT_TRUE(r->issues.empty());
}

TEST_F(InspectTest, ShardedModelDirectoryWithConfig) {
  WriteTensors(dir_,
               {{"model.embed_tokens.weight", DType::kBF16, {64, 8}},
                {"model.norm.weight", DType::kBF16, {8}},
                {"lm_head.weight", DType::kBF16, {64, 8}}},
               /*max_shard_bytes=*/1024);
  WriteText(dir_ / "config.json", R"({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
      "torch_dtype": "bfloat16", "tie_word_embeddings": true,
      "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": true}})");
  auto r = Inspect(dir_);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->kind, InspectReport::Kind::kModelDirectory);
  EXPECT_EQ(r->format, "safetensors-sharded");
  EXPECT_EQ(r->totals.count, 3u);
  EXPECT_EQ(r->totals.bytes, (512u + 8u + 512u) * 2u);
  EXPECT_EQ(r->totals.params, 512u + 8u + 512u);
  size_t shards = 0;
  for (const auto& e : fs::directory_iterator(dir_)) shards += e.path().extension() == ".safetensors";
  EXPECT_GE(shards, 2u);
  ASSERT_EQ(r->files.size(), shards + 1);  // the shards, then config.json
  EXPECT_EQ(r->files.back(), (dir_ / "config.json").string());
  ASSERT_TRUE(r->model_config.has_value());
  EXPECT_EQ(r->model_config->model_type, "llama");
  EXPECT_EQ(r->model_config->architectures, std::vector<std::string>{"LlamaForCausalLM"});
  EXPECT_EQ(r->model_config->dtype, "bfloat16");
  EXPECT_EQ(r->model_config->tie_word_embeddings, true);
  EXPECT_TRUE(r->model_config->has_quantization_config);
  EXPECT_EQ(r->model_config->quant_method, "bitsandbytes");
}

TEST_F(InspectTest, AdapterPerModuleRankAlphaScaling) {
  WriteAdapter(dir_);
  auto r = Inspect(dir_);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->kind, InspectReport::Kind::kAdapterDirectory);
  ASSERT_TRUE(r->adapter.has_value());
  const AdapterSummary& a = *r->adapter;
  EXPECT_TRUE(a.mergeable.ok());
  EXPECT_EQ(a.saved_full_modules, std::vector<std::string>{"base_model.model.lm_head.weight"});
  ASSERT_EQ(a.modules.size(), 3u);
  const AdapterModuleRow& k = a.modules[0];
  const AdapterModuleRow& q = a.modules[1];
  const AdapterModuleRow& v = a.modules[2];
  EXPECT_EQ(k.module, "model.layers.0.self_attn.k_proj");
  EXPECT_EQ(k.tensor_rank, 6);
  EXPECT_EQ(k.config_rank, 8);
  EXPECT_TRUE(k.rank_mismatch);
  EXPECT_DOUBLE_EQ(k.scaling, 2.0);  // 16 / 8
  EXPECT_EQ(q.tensor_rank, 4);
  EXPECT_EQ(q.config_rank, 4);
  EXPECT_FALSE(q.rank_mismatch);
  EXPECT_DOUBLE_EQ(q.scaling, 4.0);  // 16 / 4
  EXPECT_EQ(v.alpha, 32.0);
  EXPECT_DOUBLE_EQ(v.scaling, 4.0);  // 32 / 8
  ASSERT_EQ(r->issues.size(), 1u) << r->issues[0];
  EXPECT_NE(r->issues[0].find("'model.layers.0.self_attn.k_proj': the LoRA tensors have rank 6 but the config gives "
                              "rank 8"),
            std::string::npos)
      << r->issues[0];
  EXPECT_EQ(r->totals.count, 7u);
  EXPECT_EQ(r->totals.by_dtype.size(), 2u);
  ASSERT_EQ(r->files.size(), 2u);
  EXPECT_EQ(r->files[1], (dir_ / "adapter_config.json").string());
}

TEST_F(InspectTest, AdapterConfigFileAsPath) {
  WriteAdapter(dir_);
  auto r = Inspect(dir_ / "adapter_config.json");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->kind, InspectReport::Kind::kAdapterDirectory);
  EXPECT_EQ(r->adapter->modules.size(), 3u);
}

TEST_F(InspectTest, AdapterIssuesAndRefusal) {
  fs::create_directories(dir_);
  WriteText(dir_ / "adapter_config.json",
            R"({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"], "init_lora_weights": "olora",
                "modules_to_save": ["score"]})");
  const std::string p = "base_model.model.model.layers.0.";
  WriteTensors(dir_ / "adapter_model.safetensors", {{p + "self_attn.q_proj.lora_A.weight", DType::kF32, {4, 8}},
                                                    {p + "self_attn.q_proj.lora_B.weight", DType::kF32, {8, 3}},
                                                    {p + "self_attn.q_proj.lora_B.bias", DType::kF32, {8}},
                                                    {p + "mlp.up_proj.lora_A.weight", DType::kF32, {4, 8}},
                                                    {p + "mlp.up_proj.lora_B.weight", DType::kF32, {8, 4}},
                                                    {p + "self_attn.o_proj.lora_A.weight", DType::kF32, {4, 8}},
                                                    {p + "input_layernorm.weight", DType::kF32, {8}},
                                                    {p + "self_attn.v_proj.lora_A.x.y.weight", DType::kF32, {4, 8}}});
  auto r = Inspect(dir_);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->adapter->mergeable.code(), StatusCode::kUnsupported);
  EXPECT_TRUE(HasIssue(*r, "init_lora_weights is \"olora\"")) << ::testing::PrintToString(r->issues);
  EXPECT_TRUE(HasIssue(*r, "'model.layers.0.self_attn.q_proj': lora_A [4, 8] and lora_B [8, 3] do not form"));
  EXPECT_TRUE(HasIssue(*r, "'model.layers.0.self_attn.q_proj': has lora_B.bias but lora_bias is false"));
  EXPECT_TRUE(HasIssue(*r, "'model.layers.0.mlp.up_proj': has LoRA tensors but the config's target_modules"));
  EXPECT_TRUE(HasIssue(*r, "'model.layers.0.self_attn.o_proj': has lora_A but no lora_B"));
  EXPECT_TRUE(HasIssue(*r, "tensor 'base_model.model.model.layers.0.input_layernorm.weight': not a LoRA tensor"));
  EXPECT_TRUE(HasIssue(*r, "tensor 'base_model.model.model.layers.0.self_attn.v_proj.lora_A.x.y.weight': 'lora_A'"));
  EXPECT_TRUE(HasIssue(*r, "modules_to_save names 'score' but the adapter has no tensor for it"));
  EXPECT_TRUE(HasIssue(*r, "'model.layers.0.self_attn.o_proj': has LoRA tensors but the config's target_modules"));
  EXPECT_EQ(r->issues.size(), 9u) << ::testing::PrintToString(r->issues);
}

TEST_F(InspectTest, ErrorsNameTheFile) {
  auto missing = Inspect(dir_ / "nope");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find((dir_ / "nope").string()), std::string::npos);

  WriteAdapter(dir_);
  WriteText(dir_ / "adapter_config.json", R"({"peft_type": "LORA", "r": "eight"})");
  auto bad = Inspect(dir_);
  EXPECT_EQ(bad.status().code(), StatusCode::kCorruption);
  EXPECT_EQ(bad.status().message(),
            (dir_ / "adapter_config.json").string() + ": field 'r' must be a positive integer, got \"eight\"");

  const fs::path junk = dir_ / "junk.safetensors";
  WriteText(junk, "not a safetensors file");
  auto j = Inspect(junk);
  EXPECT_EQ(j.status().code(), StatusCode::kCorruption) << j.status().ToString();
  EXPECT_NE(j.status().message().find(junk.string()), std::string::npos);
}

TEST_F(InspectTest, JsonReport) {
  WriteAdapter(dir_);
  auto r = Inspect(dir_);
  ASSERT_TRUE(r.ok());
  const json j = json::parse(ReportToJson(*r));
  EXPECT_EQ(j["kind"], "adapter");
  EXPECT_EQ(j["format"], "safetensors");
  EXPECT_EQ(j["totals"]["count"], 7);
  EXPECT_EQ(j["totals"]["bytes"], 32 * 16 * 4 + (6 * 16 + 8 * 6 + 4 * 16 + 16 * 4) * 4 + (8 * 16 + 8 * 8) * 2);
  EXPECT_EQ(j["totals"]["by_dtype"]["BF16"]["params"], 8 * 16 + 8 * 8);
  EXPECT_EQ(j["tensors"].size(), 7u);
  EXPECT_EQ(j["tensors"][0]["name"], "base_model.model.lm_head.weight");
  EXPECT_EQ(j["tensors"][0]["shape"], json::array({32, 16}));
  EXPECT_EQ(j["tensors_truncated"], false);
  const json& a = j["adapter"];
  EXPECT_EQ(a["peft_type"], "LORA");
  EXPECT_EQ(a["r"], 8);
  EXPECT_EQ(a["lora_alpha"], 16.0);
  EXPECT_EQ(a["target_modules"], json::array({"q_proj", "v_proj", "k_proj"}));
  EXPECT_EQ(a["mergeable"], true);
  EXPECT_TRUE(a["refusal"].is_null());
  ASSERT_EQ(a["modules"].size(), 3u);
  EXPECT_EQ(a["modules"][0]["rank_mismatch"], true);
  EXPECT_EQ(a["modules"][1]["scaling"], 4.0);
  EXPECT_EQ(j["issues"].size(), 1u);

  ReportJsonOptions limited;
  limited.tensor_limit = 2;
  const json k = json::parse(ReportToJson(*r, limited));
  EXPECT_EQ(k["tensors"].size(), 2u);
  EXPECT_EQ(k["tensors_truncated"], true);
  EXPECT_EQ(k["totals"]["count"], 7);
  ReportJsonOptions none;
  none.include_tensors = false;
  EXPECT_FALSE(json::parse(ReportToJson(*r, none)).contains("tensors"));
}

// ---------------------------------------------------------------------------------
// The PEFT-generated fixtures.

TEST(InspectFixturesTest, ConfigRanksMatchTensorsAndRefusalsAreDetected) {
  const fs::path root = FERRY_FIXTURES_DIR;
  std::ifstream in(root / "cases.json");
  ASSERT_TRUE(in) << (root / "cases.json");
  const json cases = json::parse(in);
  size_t merge_cases = 0;
  for (const json& c : cases) {
    const std::string name = c["name"];
    fs::path adapter = root / "cases" / name / c.value("adapter", "adapter");
    if (!fs::exists(adapter / "adapter_model.safetensors")) adapter = root / "cases" / name / "adapter_safetensors";
    SCOPED_TRACE(name);
    if (c["expect"] == "merge") {
      ++merge_cases;
      auto r = Inspect(adapter);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      ASSERT_TRUE(r->adapter.has_value());
      EXPECT_TRUE(r->adapter->mergeable.ok()) << r->adapter->mergeable.ToString();
      EXPECT_FALSE(r->adapter->modules.empty());
      for (const AdapterModuleRow& m : r->adapter->modules) {
        EXPECT_EQ(m.tensor_rank, m.config_rank) << m.module;
        EXPECT_TRUE(r->adapter->config.IsTargeted(m.module, 2)) << m.module;
      }
      EXPECT_TRUE(r->issues.empty()) << ::testing::PrintToString(r->issues);
    } else if (name != "refuse_lora_bias_no_base_bias") {  // that one needs the base to decide
      auto config = LoadPeftConfig(adapter);
      ASSERT_TRUE(config.ok()) << config.status().ToString();
      const Status s = config->CheckMergeable();
      EXPECT_EQ(s.code(), StatusCode::kUnsupported) << s.ToString();
      EXPECT_NE(s.message().find((adapter / "adapter_config.json").string()), std::string::npos) << s.message();
    }
  }
  EXPECT_GE(merge_cases, 20u);
}

TEST(InspectFixturesTest, PatternFixtureScaling) {
  auto r = Inspect(fs::path(FERRY_FIXTURES_DIR) / "cases/qwen2_patterns_f16/adapter");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const PeftConfig& c = r->adapter->config;
  // rank_pattern {'q_proj':4, 'layers.1.mlp.down_proj':2, 'layers\.0\.mlp\.(gate|up)_proj':6},
  // alpha_pattern {'v_proj':32, 'model.layers.0.self_attn.o_proj':4}, r=8, alpha=16.
  EXPECT_DOUBLE_EQ(c.ScalingFor("model.layers.0.self_attn.q_proj"), 16.0 / 4);
  EXPECT_DOUBLE_EQ(c.ScalingFor("model.layers.1.mlp.down_proj"), 16.0 / 2);
  EXPECT_DOUBLE_EQ(c.ScalingFor("model.layers.0.mlp.down_proj"), 16.0 / 8);
  EXPECT_DOUBLE_EQ(c.ScalingFor("model.layers.0.mlp.gate_proj"), 16.0 / 6);
  EXPECT_DOUBLE_EQ(c.ScalingFor("model.layers.1.mlp.gate_proj"), 16.0 / 8);
  EXPECT_DOUBLE_EQ(c.ScalingFor("model.layers.1.self_attn.v_proj"), 32.0 / 8);
  EXPECT_DOUBLE_EQ(c.ScalingFor("model.layers.0.self_attn.o_proj"), 4.0 / 8);
  EXPECT_DOUBLE_EQ(c.ScalingFor("model.layers.1.self_attn.o_proj"), 16.0 / 8);
}

// ---------------------------------------------------------------------------------
// The CLI.

#ifdef FERRY_CLI_PATH

struct CliResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

std::string ShellQuote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

CliResult RunCli(const std::vector<std::string>& args, const fs::path& err_file) {
  std::string cmd = ShellQuote(FERRY_CLI_PATH);
  for (const auto& a : args) cmd += " " + ShellQuote(a);
  cmd += " 2>" + ShellQuote(err_file.string());
  CliResult r;
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) r.out.append(buf, n);
  const int status = ::pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream e(err_file);
  r.err.assign(std::istreambuf_iterator<char>(e), std::istreambuf_iterator<char>());
  return r;
}

TEST_F(InspectTest, CliJson) {
  const fs::path adapter = dir_ / "adapter";
  WriteAdapter(adapter);
  const CliResult r = RunCli({"inspect", adapter.string(), "--json"}, dir_ / "stderr");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["kind"], "adapter");
  EXPECT_EQ(j["totals"]["count"], 7);
  EXPECT_EQ(j["tensors"].size(), 7u);
  ASSERT_EQ(j["adapter"]["modules"].size(), 3u);
  EXPECT_EQ(j["adapter"]["modules"][0]["module"], "model.layers.0.self_attn.k_proj");
  EXPECT_EQ(j["adapter"]["modules"][0]["tensor_rank"], 6);
  EXPECT_EQ(j["adapter"]["modules"][0]["config_rank"], 8);
  EXPECT_EQ(j["adapter"]["modules"][2]["alpha"], 32.0);
  EXPECT_EQ(j["adapter"]["modules"][2]["scaling"], 4.0);

  const CliResult limited = RunCli({"inspect", adapter.string(), "--json", "--limit", "1"}, dir_ / "stderr");
  ASSERT_EQ(limited.exit_code, 0) << limited.err;
  EXPECT_EQ(json::parse(limited.out)["tensors"].size(), 1u);
  const CliResult none = RunCli({"inspect", adapter.string(), "--json", "--no-tensors"}, dir_ / "stderr");
  ASSERT_EQ(none.exit_code, 0) << none.err;
  EXPECT_FALSE(json::parse(none.out).contains("tensors"));
}

TEST_F(InspectTest, CliTable) {
  const fs::path adapter = dir_ / "adapter";
  WriteAdapter(adapter);
  const CliResult r = RunCli({"inspect", adapter.string()}, dir_ / "stderr");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("MODULE"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("RANK MISMATCH"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("model.layers.0.self_attn.v_proj.lora_B.weight"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("issues:   1"), std::string::npos) << r.out;
}

TEST_F(InspectTest, CliErrorsExitOneAndNameTheFile) {
  const fs::path missing = dir_ / "missing";
  const CliResult r = RunCli({"inspect", missing.string(), "--json"}, dir_ / "stderr");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(r.out.empty()) << r.out;
  EXPECT_NE(r.err.find("ferry: error: " + missing.string()), std::string::npos) << r.err;

  const fs::path adapter = dir_ / "adapter";
  WriteAdapter(adapter);
  WriteText(adapter / "adapter_config.json", R"({"peft_type": "LORA", "r": -1})");
  const CliResult bad = RunCli({"inspect", adapter.string()}, dir_ / "stderr");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find((adapter / "adapter_config.json").string() + ": field 'r' must be a positive integer, got -1"),
            std::string::npos)
      << bad.err;
}

#endif  // FERRY_CLI_PATH

}  // namespace
}  // namespace ferry
