// `ferry inspect ADAPTER --base DIR` end to end: the JSON sections, the tables, and the exit
// status when the adapter does not fit the base or --base is misused.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/cli/cli_runner.h"

namespace ferry {
namespace {

namespace fs = std::filesystem;
using testing::RunFerry;
const fs::path kCases = fs::path(FERRY_FIXTURES_DIR) / "cases";

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

TEST(InspectBaseCli, JsonHasPlanAndEngineSections) {
  const fs::path c = kCases / "llama_lora_all_linear_f32";
  auto r = RunFerry({"inspect", (c / "adapter").string(), "--base", (c / "base").string(), "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  ASSERT_TRUE(j.contains("plan"));
  ASSERT_TRUE(j.contains("engine"));
  EXPECT_EQ(j["plan"]["base"], (c / "base").string());
  EXPECT_TRUE(j["plan"]["error"].is_null());
  ASSERT_EQ(j["plan"]["modules"].size(), 14u);
  const auto& down = j["plan"]["modules"][0];
  EXPECT_EQ(down["module"], "model.layers.0.mlp.down_proj");
  EXPECT_EQ(down["targets"][0]["tensor"], "model.layers.0.mlp.down_proj.weight");
  EXPECT_EQ(down["targets"][0]["shape"], nlohmann::json::array({64, 128}));
  EXPECT_EQ(j["engine"]["with_base"], true);
  EXPECT_EQ(j["engine"]["counts"]["reject"], 0);
  EXPECT_EQ(j["engine"]["lora_layout"]["possible"], true);
  // The existing report is still there.
  EXPECT_EQ(j["kind"], "adapter");
  EXPECT_EQ(j["adapter"]["modules"].size(), 14u);

  // Without --base: the engine section, no plan.
  auto plain = RunFerry({"inspect", (c / "adapter").string(), "--json"});
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  const auto p = nlohmann::json::parse(plain.out);
  EXPECT_FALSE(p.contains("plan"));
  EXPECT_EQ(p["engine"]["with_base"], false);
}

TEST(InspectBaseCli, TablesShowTargetsAndFindings) {
  const fs::path c = kCases / "llama_nf4";
  auto r = RunFerry({"inspect", (c / "adapter").string(), "--base", (c / "base").string(), "--no-tensors"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(Contains(r.out, "plan onto base " + (c / "base").string())) << r.out;
  EXPECT_TRUE(Contains(r.out, "model.layers.0.self_attn.q_proj.weight [72, 72] BF16 (4-bit NF4, dequantized)"))
      << r.out;
  EXPECT_TRUE(Contains(r.out, "engine (vLLM):")) << r.out;

  const fs::path d = kCases / "mistral_dora_f32";
  auto dora = RunFerry({"inspect", (d / "adapter").string(), "--no-tensors"});
  ASSERT_EQ(dora.exit_code, 0) << dora.err;
  EXPECT_TRUE(Contains(dora.out, "reject    field use_dora")) << dora.out;
  // The library says what fixes it (fix_layout); the CLI names the command and flag.
  EXPECT_TRUE(Contains(dora.out, "merge it instead (the hf layout) [fix: `ferry convert --layout hf`]")) << dora.out;
  auto dora_json = RunFerry({"inspect", (d / "adapter").string(), "--no-tensors", "--json"});
  ASSERT_EQ(dora_json.exit_code, 0) << dora_json.err;
  bool fix_hf = false;
  const auto dora_j = nlohmann::json::parse(dora_json.out);  // kept alive: the loop views into it
  for (const auto& f : dora_j["engine"]["findings"]) {
    fix_hf = fix_hf || (f["field"] == "use_dora" && f["fix_layout"] == "hf");
  }
  EXPECT_TRUE(fix_hf) << dora_json.out;

  const fs::path q = kCases / "qwen2_patterns_f16";
  auto patterns = RunFerry({"inspect", (q / "adapter").string(), "--no-tensors"});
  ASSERT_EQ(patterns.exit_code, 0) << patterns.err;
  EXPECT_TRUE(Contains(patterns.out, "bakes each module's scaling into lora_A [fix: `ferry convert --layout lora`]"))
      << patterns.out;
}

TEST(InspectBaseCli, AdapterForAnotherModelExitsOneNamingBothTensors) {
  auto r = RunFerry({"inspect", (kCases / "gpt2_conv1d_f32" / "adapter").string(), "--base",
                     (kCases / "llama_lora_all_linear_f32" / "base").string(), "--json"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.signal, 0);
  EXPECT_TRUE(Contains(r.err, "ferry: error: ")) << r.err;
  EXPECT_TRUE(Contains(r.err, "'base_model.model.transformer.h.0.attn.c_attn.lora_A.weight'")) << r.err;
  EXPECT_TRUE(Contains(r.err, "'transformer.h.0.attn.c_attn.weight'")) << r.err;
  // The report is still printed, with the error in it.
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_TRUE(Contains(j["plan"]["error"].get<std::string>(), "'transformer.h.0.attn.c_attn.weight'"));
  EXPECT_EQ(j["issues"].size(), 1u);
}

TEST(InspectBaseCli, BaseOnANonAdapterPathExitsOneNamingTheBase) {
  const fs::path base = kCases / "llama_lora_all_linear_f32" / "base";
  auto r = RunFerry({"inspect", base.string(), "--base", base.string()});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(Contains(r.err, "a base model (" + base.string() + ") applies only to a PEFT adapter")) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;

  auto file = RunFerry({"inspect", (base / "model.safetensors").string(), "--base", base.string()});
  EXPECT_EQ(file.exit_code, 1);
  EXPECT_TRUE(Contains(file.err, "applies only to a PEFT adapter")) << file.err;
  EXPECT_TRUE(Contains(file.err, "tensor file")) << file.err;
}

}  // namespace
}  // namespace ferry
