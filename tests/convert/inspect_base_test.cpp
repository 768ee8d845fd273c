// `Inspect(adapter, {.base = ...})`: the merge plan onto a base (which base tensors each
// adapter module touches) and the engine (vLLM) findings, on the PEFT-generated fixtures
// (fixtures/cases.json) and on small hand-built adapters.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "convert/engine_check.h"
#include "convert/inspect.h"
#include "core/safetensors.h"
#include "tests/temp_dir.h"

namespace ferry {
namespace {

namespace fs = std::filesystem;
using Severity = EngineFinding::Severity;
using Subject = EngineFinding::Subject;

const fs::path kCases = fs::path(FERRY_FIXTURES_DIR) / "cases";

// Inspects case `name`'s adapter, with its own base unless `base_case` names another case.
InspectReport InspectCase(const std::string& name, bool with_base = true, const std::string& base_case = "") {
  InspectOptions options;
  if (with_base) options.base = kCases / (base_case.empty() ? name : base_case) / "base";
  auto r = Inspect(kCases / name / "adapter", options);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? std::move(*r) : InspectReport{};
}

// The findings with this severity and subject.
std::vector<EngineFinding> Findings(const InspectReport& r, Severity severity, Subject kind,
                                    const std::string& subject) {
  std::vector<EngineFinding> out;
  if (!r.engine.has_value()) return out;
  for (const EngineFinding& f : r.engine->findings) {
    if (f.severity == severity && f.subject_kind == kind && f.subject == subject) out.push_back(f);
  }
  return out;
}

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

const PlanModuleRow* FindModule(const AdapterPlanReport& p, const std::string& module) {
  for (const PlanModuleRow& m : p.modules) {
    if (m.module == module) return &m;
  }
  return nullptr;
}

std::string Leaf(const std::string& module) { return module.substr(module.rfind('.') + 1); }

// The small Llama of the fixtures: hidden 64, 2 layers, q 64 rows, k/v 32, intermediate 128.
const std::map<std::string, Shape> kLlamaShapes = {
    {"q_proj", {64, 64}},     {"k_proj", {32, 64}},   {"v_proj", {32, 64}},    {"o_proj", {64, 64}},
    {"gate_proj", {128, 64}}, {"up_proj", {128, 64}}, {"down_proj", {64, 128}}};

TEST(InspectBase, AllLinearLlamaTargetsEachModulesWeight) {
  const InspectReport r = InspectCase("llama_lora_all_linear_f32");
  ASSERT_TRUE(r.plan.has_value());
  const AdapterPlanReport& p = *r.plan;
  ASSERT_TRUE(p.error.ok()) << p.error.ToString();
  EXPECT_FALSE(p.tie_word_embeddings);
  ASSERT_EQ(p.modules.size(), 14u);
  for (const PlanModuleRow& m : p.modules) {
    ASSERT_EQ(m.targets.size(), 1u) << m.module;
    const PlanTarget& t = m.targets[0];
    EXPECT_EQ(t.tensor, m.module + ".weight");
    EXPECT_EQ(t.shape, kLlamaShapes.at(Leaf(m.module))) << m.module;
    EXPECT_EQ(t.dtype, DType::kF32);
    EXPECT_FALSE(t.partial) << m.module;
    EXPECT_EQ(t.row_begin, 0);
    EXPECT_EQ(t.row_end, t.shape[0]);
    EXPECT_TRUE(t.quantization.empty());
    EXPECT_TRUE(t.source.empty());
    EXPECT_FALSE(m.embedding);
    EXPECT_EQ(m.rank, 8);
    EXPECT_DOUBLE_EQ(m.scaling, 16.0 / 8.0);
    EXPECT_FALSE(m.dora || m.lora_bias || m.fan_in_fan_out);
  }
  EXPECT_TRUE(p.replacements.empty());
  EXPECT_TRUE(p.token_rows.empty());
  EXPECT_FALSE(p.untie);
  EXPECT_EQ(p.quantized_targets, 0u);
  EXPECT_TRUE(r.issues.empty());

  // A clean adapter: no rejections, only the rank note.
  ASSERT_TRUE(r.engine.has_value());
  EXPECT_TRUE(r.engine->with_base);
  ASSERT_EQ(r.engine->findings.size(), 1u);
  const EngineFinding& rank = r.engine->findings[0];
  EXPECT_EQ(rank.severity, Severity::kNote);
  EXPECT_TRUE(Contains(rank.message, "largest rank 8")) << rank.message;
  EXPECT_TRUE(Contains(rank.message, "vLLM's max_lora_rank must be at least 8")) << rank.message;
  EXPECT_EQ(rank.engine_max_lora_rank, 0) << "the default 16 is enough";
  EXPECT_EQ(r.engine->lora_layout_possible, true);
  EXPECT_EQ(r.engine->lora_layout_rank, 8);
}

TEST(InspectBase, Phi3FusedAdapterOntoFusedBase) {
  const InspectReport r = InspectCase("phi3_lora_f32");
  ASSERT_TRUE(r.plan.has_value());
  ASSERT_TRUE(r.plan->error.ok()) << r.plan->error.ToString();
  ASSERT_EQ(r.plan->modules.size(), 8u);
  for (int layer = 0; layer < 2; ++layer) {
    const std::string l = "model.layers." + std::to_string(layer) + ".";
    const PlanModuleRow* qkv = FindModule(*r.plan, l + "self_attn.qkv_proj");
    ASSERT_NE(qkv, nullptr);
    ASSERT_EQ(qkv->targets.size(), 1u);
    EXPECT_EQ(qkv->targets[0].tensor, l + "self_attn.qkv_proj.weight");
    EXPECT_EQ(qkv->targets[0].shape, (Shape{64 + 32 + 32, 64}));
    EXPECT_FALSE(qkv->targets[0].partial);
    const PlanModuleRow* gate_up = FindModule(*r.plan, l + "mlp.gate_up_proj");
    ASSERT_NE(gate_up, nullptr);
    EXPECT_EQ(gate_up->targets[0].tensor, l + "mlp.gate_up_proj.weight");
    EXPECT_EQ(gate_up->targets[0].shape, (Shape{2 * 128, 64}));
  }
  // Names match the base: no fusion notes.
  for (const EngineFinding& f : r.engine->findings) EXPECT_FALSE(Contains(f.message, "fused")) << f.message;
}

TEST(InspectBase, SeparateAdaptersOntoFusedBaseLandOnRowRanges) {
  // The Llama adapter (q/k/v, gate/up separate) onto the Phi-3 base (qkv_proj, gate_up_proj).
  const InspectReport r = InspectCase("llama_lora_all_linear_f32", true, "phi3_lora_f32");
  ASSERT_TRUE(r.plan.has_value());
  ASSERT_TRUE(r.plan->error.ok()) << r.plan->error.ToString();
  ASSERT_EQ(r.plan->modules.size(), 14u);
  const std::string l = "model.layers.1.";
  struct Want {
    std::string module, tensor;
    int64_t begin, end;
  };
  for (const Want& w : std::vector<Want>{{"self_attn.q_proj", "self_attn.qkv_proj.weight", 0, 64},
                                         {"self_attn.k_proj", "self_attn.qkv_proj.weight", 64, 96},
                                         {"self_attn.v_proj", "self_attn.qkv_proj.weight", 96, 128},
                                         {"mlp.gate_proj", "mlp.gate_up_proj.weight", 0, 128},
                                         {"mlp.up_proj", "mlp.gate_up_proj.weight", 128, 256}}) {
    const PlanModuleRow* m = FindModule(*r.plan, l + w.module);
    ASSERT_NE(m, nullptr) << w.module;
    ASSERT_EQ(m->targets.size(), 1u);
    EXPECT_EQ(m->targets[0].tensor, l + w.tensor);
    EXPECT_TRUE(m->targets[0].partial);
    EXPECT_EQ(m->targets[0].row_begin, w.begin) << w.module;
    EXPECT_EQ(m->targets[0].row_end, w.end) << w.module;
  }
  // Notes naming the fix, and q+k+v stacked into rank 24 by --layout lora.
  auto qkv = Findings(r, Severity::kNote, Subject::kModule, "model.layers.0.self_attn.k_proj");
  ASSERT_EQ(qkv.size(), 1u);
  EXPECT_TRUE(Contains(qkv[0].message, "6 adapter modules named 'k_proj', 'q_proj', 'v_proj'")) << qkv[0].message;
  EXPECT_TRUE(Contains(qkv[0].message, "'qkv_proj'")) << qkv[0].message;
  EXPECT_TRUE(Contains(qkv[0].message, "the lora layout matches names to the base")) << qkv[0].message;
  EXPECT_EQ(qkv[0].fix_layout, Layout::kLora);
  auto gate_up = Findings(r, Severity::kNote, Subject::kModule, "model.layers.0.mlp.gate_proj");
  ASSERT_EQ(gate_up.size(), 1u);
  EXPECT_TRUE(Contains(gate_up[0].message, "'gate_up_proj'")) << gate_up[0].message;
  EXPECT_EQ(r.engine->lora_layout_rank, 3 * 8);
  auto rank = Findings(r, Severity::kNote, Subject::kModule, "model.layers.0.mlp.down_proj");
  ASSERT_EQ(rank.size(), 1u);
  EXPECT_TRUE(Contains(rank[0].message, "the rank is 24")) << rank[0].message;
  EXPECT_TRUE(Contains(rank[0].message, "start vLLM with a max_lora_rank of 32 or more")) << rank[0].message;
  EXPECT_EQ(rank[0].engine_max_lora_rank, 32);
}

TEST(InspectBase, FusedAdapterOntoSeparateBaseIsSplit) {
  // The Phi-3 adapter (qkv_proj [128 rows] = q 64 + k 32 + v 32) onto the Llama base.
  const InspectReport r = InspectCase("phi3_lora_f32", true, "llama_lora_all_linear_f32");
  ASSERT_TRUE(r.plan.has_value());
  ASSERT_TRUE(r.plan->error.ok()) << r.plan->error.ToString();
  const std::string l = "model.layers.0.self_attn.";
  const PlanModuleRow* qkv = FindModule(*r.plan, l + "qkv_proj");
  ASSERT_NE(qkv, nullptr);
  ASSERT_EQ(qkv->targets.size(), 3u);
  const std::vector<std::tuple<std::string, int64_t, int64_t>> parts = {
      {"q_proj", 0, 64}, {"k_proj", 64, 96}, {"v_proj", 96, 128}};
  for (size_t i = 0; i < parts.size(); ++i) {
    const auto& [part, begin, end] = parts[i];
    EXPECT_EQ(qkv->targets[i].tensor, l + part + ".weight");
    EXPECT_EQ(qkv->targets[i].part, part);
    EXPECT_EQ(qkv->targets[i].b_row_begin, begin);
    EXPECT_EQ(qkv->targets[i].b_row_end, end);
    EXPECT_EQ(qkv->targets[i].shape, kLlamaShapes.at(part));
  }
  auto split = Findings(r, Severity::kNote, Subject::kModule, l + "qkv_proj");
  ASSERT_EQ(split.size(), 1u);
  EXPECT_TRUE(Contains(split[0].message, "stores 'q_proj', 'k_proj', 'v_proj' separately")) << split[0].message;
  EXPECT_TRUE(Contains(split[0].message, "the lora layout matches names to the base")) << split[0].message;
  EXPECT_EQ(split[0].fix_layout, Layout::kLora);
}

TEST(InspectBase, PatternsAreScaledWronglyByTheEngine) {
  // r=8 alpha=16 (global scaling 2). rank_pattern: q_proj 4 (scaling 4, 2 layers),
  // layers.1.mlp.down_proj 2 (8), layer 0 gate/up 6 (2.667): 5 modules. alpha_pattern:
  // v_proj 32 (4, 2 layers), layer 0 o_proj 4 (0.5): 3 modules.
  for (bool with_base : {false, true}) {
    const InspectReport r = InspectCase("qwen2_patterns_f16", with_base);
    auto rank = Findings(r, Severity::kWrong, Subject::kField, "rank_pattern");
    ASSERT_EQ(rank.size(), 1u);
    EXPECT_TRUE(Contains(rank[0].message, "rank_pattern")) << rank[0].message;
    EXPECT_TRUE(Contains(rank[0].message, "vLLM applies one global scaling (lora_alpha / r)")) << rank[0].message;
    EXPECT_TRUE(Contains(rank[0].message, "(5 modules")) << rank[0].message;
    EXPECT_TRUE(Contains(rank[0].message, "the lora layout bakes each module's scaling into lora_A"))
        << rank[0].message;
    EXPECT_EQ(rank[0].fix_layout, Layout::kLora);
    auto alpha = Findings(r, Severity::kWrong, Subject::kField, "alpha_pattern");
    ASSERT_EQ(alpha.size(), 1u);
    EXPECT_TRUE(Contains(alpha[0].message, "(3 modules")) << alpha[0].message;
    EXPECT_EQ(r.engine->with_base, with_base);
  }
}

TEST(InspectBase, DoraIsRejected) {
  const InspectReport r = InspectCase("mistral_dora_f32");
  auto field = Findings(r, Severity::kReject, Subject::kField, "use_dora");
  ASSERT_EQ(field.size(), 1u);
  EXPECT_TRUE(Contains(field[0].message, "does not yet support DoRA")) << field[0].message;
  EXPECT_TRUE(Contains(field[0].message, "merge it instead (the hf layout)")) << field[0].message;
  EXPECT_EQ(field[0].fix_layout, Layout::kHf);
  auto keys = Findings(r, Severity::kReject, Subject::kKey,
                       "base_model.model.model.layers.0.mlp.down_proj.lora_magnitude_vector");
  ASSERT_EQ(keys.size(), 1u);
  EXPECT_TRUE(Contains(keys[0].message, "14 tensors")) << keys[0].message;
  EXPECT_TRUE(Contains(keys[0].message, "DoRA")) << keys[0].message;
  // Rejections come first.
  EXPECT_EQ(r.engine->findings.front().severity, Severity::kReject);
  ASSERT_TRUE(r.plan.has_value());
  ASSERT_EQ(r.plan->modules.size(), 14u);
  for (const PlanModuleRow& m : r.plan->modules) EXPECT_TRUE(m.dora) << m.module;
  EXPECT_EQ(r.engine->lora_layout_possible, false);
  EXPECT_TRUE(Contains(r.engine->lora_layout_refusal, "use_dora")) << r.engine->lora_layout_refusal;
  EXPECT_TRUE(Contains(r.engine->lora_layout_refusal, (kCases / "mistral_dora_f32" / "adapter").string()));
}

TEST(InspectBase, ModulesToSaveIsRejectedAndReplacesBaseTensors) {
  const InspectReport r = InspectCase("llama_modules_to_save_f32");
  auto field = Findings(r, Severity::kReject, Subject::kField, "modules_to_save");
  ASSERT_EQ(field.size(), 1u);
  EXPECT_TRUE(Contains(field[0].message, "only supports modules_to_save being None")) << field[0].message;
  // The saved tensors are randomised: only merging helps.
  EXPECT_TRUE(Contains(field[0].message, "differs from base tensor 'lm_head.weight'")) << field[0].message;
  EXPECT_TRUE(Contains(field[0].message, "merge it instead (the hf layout)")) << field[0].message;
  EXPECT_EQ(field[0].fix_layout, Layout::kHf);
  auto keys = Findings(r, Severity::kReject, Subject::kKey, "base_model.model.lm_head.weight");
  ASSERT_EQ(keys.size(), 1u);
  EXPECT_TRUE(Contains(keys[0].message, "2 tensors")) << keys[0].message;
  ASSERT_TRUE(r.plan.has_value());
  ASSERT_EQ(r.plan->replacements.size(), 2u);
  EXPECT_EQ(r.plan->replacements[0].base_tensor, "lm_head.weight");
  EXPECT_EQ(r.plan->replacements[0].adapter_key, "base_model.model.lm_head.weight");
  EXPECT_EQ(r.plan->replacements[1].base_tensor, "model.embed_tokens.weight");
  EXPECT_EQ(r.plan->replacements[1].adapter_key, "base_model.model.model.embed_tokens.weight");
  for (const PlanReplacementRow& x : r.plan->replacements) {
    EXPECT_EQ(x.why, "modules_to_save");
    EXPECT_EQ(x.shape, (Shape{128, 64}));
    EXPECT_FALSE(x.equals_base);
  }
  EXPECT_EQ(r.plan->modules.size(), 4u);
  EXPECT_EQ(r.engine->lora_layout_possible, false);

  // Without a base the finding still rejects, and cannot tell whether the copies are harmless.
  const InspectReport no_base = InspectCase("llama_modules_to_save_f32", false);
  EXPECT_FALSE(no_base.plan.has_value());
  auto plain = Findings(no_base, Severity::kReject, Subject::kField, "modules_to_save");
  ASSERT_EQ(plain.size(), 1u);
  EXPECT_TRUE(Contains(plain[0].message, "inspecting with the base checks that")) << plain[0].message;
  EXPECT_FALSE(plain[0].fix_layout.has_value()) << "without the base the fix cannot be told";
}

TEST(InspectBase, TiedLmHeadIsUntied) {
  const InspectReport r = InspectCase("llama_tied_lmhead_lora_f32");
  ASSERT_TRUE(r.plan.has_value());
  const AdapterPlanReport& p = *r.plan;
  ASSERT_TRUE(p.error.ok()) << p.error.ToString();
  EXPECT_TRUE(p.tie_word_embeddings);
  EXPECT_TRUE(p.tied);
  EXPECT_TRUE(p.untie);
  EXPECT_EQ(p.tied_source, "model.embed_tokens.weight");
  EXPECT_EQ(p.lm_head, "lm_head.weight");
  const PlanModuleRow* lm = FindModule(p, "lm_head");
  ASSERT_NE(lm, nullptr);
  ASSERT_EQ(lm->targets.size(), 1u);
  EXPECT_EQ(lm->targets[0].tensor, "lm_head.weight");
  EXPECT_EQ(lm->targets[0].source, "model.embed_tokens.weight");
  EXPECT_EQ(lm->targets[0].shape, (Shape{128, 64}));
  // The saved lm_head.base_layer copy equals the embedding: harmless, dropped by --layout lora.
  ASSERT_EQ(p.replacements.size(), 1u);
  EXPECT_EQ(p.replacements[0].base_tensor, "lm_head.weight");
  EXPECT_EQ(p.replacements[0].adapter_key, "base_model.model.lm_head.base_layer.weight");
  EXPECT_EQ(p.replacements[0].why, "base_layer");
  EXPECT_TRUE(p.replacements[0].equals_base);
  auto copy = Findings(r, Severity::kReject, Subject::kKey, "base_model.model.lm_head.base_layer.weight");
  ASSERT_EQ(copy.size(), 1u);
  EXPECT_TRUE(Contains(copy[0].message, "equals the base tensor, so the lora layout drops it")) << copy[0].message;
  EXPECT_EQ(copy[0].fix_layout, Layout::kLora);
  EXPECT_EQ(r.engine->lora_layout_possible, true);

  // The JSON says so too.
  const auto j = nlohmann::json::parse(ReportToJson(r));
  EXPECT_EQ(j["plan"]["untie"], true);
  EXPECT_EQ(j["plan"]["tied_source"], "model.embed_tokens.weight");
}

TEST(InspectBase, Nf4TargetsAreFlaggedQuantized) {
  const InspectReport r = InspectCase("llama_nf4");
  ASSERT_TRUE(r.plan.has_value());
  ASSERT_TRUE(r.plan->error.ok()) << r.plan->error.ToString();
  ASSERT_EQ(r.plan->modules.size(), 14u);
  EXPECT_EQ(r.plan->quantized_targets, 14u);
  // hidden 72, k/v 36, intermediate 392 (the U8 storage is [n/2, 1]; the logical shape is reported).
  const std::map<std::string, Shape> shapes = {
      {"q_proj", {72, 72}},     {"k_proj", {36, 72}},   {"v_proj", {36, 72}},    {"o_proj", {72, 72}},
      {"gate_proj", {392, 72}}, {"up_proj", {392, 72}}, {"down_proj", {72, 392}}};
  for (const PlanModuleRow& m : r.plan->modules) {
    ASSERT_EQ(m.targets.size(), 1u);
    EXPECT_EQ(m.targets[0].quantization, "nf4") << m.module;
    EXPECT_EQ(m.targets[0].dtype, DType::kBF16) << m.module;
    EXPECT_EQ(m.targets[0].shape, shapes.at(Leaf(m.module))) << m.module;
  }
  const auto j = nlohmann::json::parse(ReportToJson(r));
  EXPECT_EQ(j["plan"]["modules"][0]["targets"][0]["quantization"], "nf4");
  EXPECT_EQ(j["plan"]["quantized_targets"], 14);
}

TEST(InspectBase, WrongBaseIsAnIssueNamingBothTensors) {
  const InspectReport r = InspectCase("gpt2_conv1d_f32", true, "llama_lora_all_linear_f32");
  ASSERT_TRUE(r.plan.has_value());
  const Status& e = r.plan->error;
  EXPECT_EQ(e.code(), StatusCode::kNotFound) << e.ToString();
  EXPECT_TRUE(Contains(e.message(), "'base_model.model.transformer.h.0.attn.c_attn.lora_A.weight'")) << e.message();
  EXPECT_TRUE(Contains(e.message(), "'transformer.h.0.attn.c_attn.weight'")) << e.message();
  EXPECT_TRUE(Contains(e.message(), (kCases / "llama_lora_all_linear_f32" / "base").string())) << e.message();
  EXPECT_TRUE(r.plan->modules.empty());
  ASSERT_EQ(r.issues.size(), 1u);
  EXPECT_EQ(r.issues[0], e.message());
  // The findings fall back to the adapter alone.
  EXPECT_FALSE(r.engine->with_base);
  EXPECT_FALSE(r.engine->lora_layout_possible.has_value());
  const auto j = nlohmann::json::parse(ReportToJson(r));
  EXPECT_EQ(j["plan"]["error"], e.message());
}

TEST(InspectBase, LoraBiasAndTrainableTokensAreRejected) {
  const InspectReport bias = InspectCase("llama_lora_bias_f32");
  auto b =
      Findings(bias, Severity::kReject, Subject::kKey, "base_model.model.model.layers.0.mlp.down_proj.lora_B.bias");
  ASSERT_EQ(b.size(), 1u);
  EXPECT_TRUE(Contains(b[0].message, "14 tensors")) << b[0].message;
  ASSERT_TRUE(bias.plan.has_value());
  const PlanModuleRow* down = FindModule(*bias.plan, "model.layers.0.mlp.down_proj");
  ASSERT_NE(down, nullptr);
  EXPECT_TRUE(down->lora_bias);
  EXPECT_EQ(down->bias_target, "model.layers.0.mlp.down_proj.bias");
  EXPECT_EQ(bias.engine->lora_layout_possible, false);
  EXPECT_TRUE(Contains(bias.engine->lora_layout_refusal, "lora_B bias")) << bias.engine->lora_layout_refusal;

  const InspectReport tokens = InspectCase("llama_trainable_tokens_f32");
  const std::string key = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta";
  ASSERT_EQ(Findings(tokens, Severity::kReject, Subject::kKey, key).size(), 1u);
  ASSERT_TRUE(tokens.plan.has_value());
  ASSERT_EQ(tokens.plan->token_rows.size(), 1u);
  EXPECT_EQ(tokens.plan->token_rows[0].base_tensor, "model.embed_tokens.weight");
  EXPECT_EQ(tokens.plan->token_rows[0].rows, (std::vector<int64_t>{0, 5, 17, 100}));
}

TEST(InspectBase, RsloraIsANote) {
  const InspectReport r = InspectCase("llama_rslora_bf16", false);
  auto f = Findings(r, Severity::kNote, Subject::kField, "use_rslora");
  ASSERT_EQ(f.size(), 1u);
  EXPECT_TRUE(Contains(f[0].message, "older vLLM versions ignore use_rslora")) << f[0].message;
  // 16 / sqrt(8) and 16 / 8.
  EXPECT_TRUE(Contains(f[0].message, "5.65685")) << f[0].message;
  EXPECT_TRUE(Contains(f[0].message, "lora_alpha / r = 2")) << f[0].message;
}

TEST(InspectBase, BaseOnANonAdapterNamesTheBase) {
  InspectOptions options;
  options.base = kCases / "llama_lora_all_linear_f32" / "base";
  auto r = Inspect(kCases / "llama_lora_all_linear_f32" / "base", options);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(
      Contains(r.status().message(), "a base model (" + options.base.string() + ") applies only to a PEFT adapter"))
      << r.status().message();
  EXPECT_TRUE(Contains(r.status().message(), "model directory")) << r.status().message();

  options.base = kCases / "no_such_base";
  auto missing = Inspect(kCases / "llama_lora_all_linear_f32" / "adapter", options);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(missing.status().message(), (kCases / "no_such_base").string())) << missing.status().message();
}

TEST(InspectBase, JsonHasPlanAndEngineSections) {
  const InspectReport r = InspectCase("qwen2_patterns_f16");
  const auto j = nlohmann::json::parse(ReportToJson(r));
  ASSERT_TRUE(j.contains("plan"));
  ASSERT_TRUE(j.contains("engine"));
  EXPECT_EQ(j["plan"]["modules"].size(), 14u);
  EXPECT_TRUE(j["plan"]["error"].is_null());
  const auto& q = j["plan"]["modules"][5];  // layer 0: down, gate, up, k, o, q, v
  EXPECT_EQ(q["module"], "model.layers.0.self_attn.q_proj");
  EXPECT_EQ(q["rank"], 4);
  EXPECT_DOUBLE_EQ(q["scaling"].get<double>(), 16.0 / 4.0);
  EXPECT_EQ(q["targets"][0]["tensor"], "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(q["targets"][0]["shape"], nlohmann::json::array({64, 64}));
  EXPECT_EQ(q["targets"][0]["dtype"], "F16");
  EXPECT_EQ(j["engine"]["counts"]["wrong"], 2);
  EXPECT_EQ(j["engine"]["counts"]["reject"], 0);
  const auto& first = j["engine"]["findings"][0];
  EXPECT_EQ(first["severity"], "wrong");
  EXPECT_EQ(first["field"], "rank_pattern");
  EXPECT_TRUE(first["key"].is_null());
  EXPECT_EQ(j["engine"]["lora_layout"]["possible"], true);
  EXPECT_EQ(j["engine"]["lora_layout"]["rank"], 8);
}

// Hand-built adapters for the limits.
class EngineLimits : public ::testing::Test {
 protected:
  void SetUp() override {
    tmp_ = std::make_unique<ferry::testing::ScopedTempDir>("ferry_inspect_base_");
    dir_ = tmp_->path();
  }
  void TearDown() override { tmp_.reset(); }
  std::unique_ptr<ferry::testing::ScopedTempDir> tmp_;

  // An adapter with one module "model.layers.0.self_attn.q_proj" of rank `rank` (in 16,
  // out 16) whose LoRA keys carry `infix` (e.g. ".default").
  void WriteAdapter(int rank, const std::string& infix = "") {
    std::ofstream(dir_ / "adapter_config.json") << R"({"peft_type": "LORA", "r": )" << rank << R"(, "lora_alpha": )"
                                                << rank << R"(, "target_modules": ["q_proj"]})";
    const std::string p = "base_model.model.model.layers.0.self_attn.q_proj.";
    const std::vector<TensorSpec> specs = {{p + "lora_A" + infix + ".weight", DType::kF32, {rank, 16}},
                                           {p + "lora_B" + infix + ".weight", DType::kF32, {16, rank}}};
    WriterOptions options;
    options.sync = false;
    auto writer = SafetensorsWriter::CreateFile(dir_ / "adapter_model.safetensors", specs, options);
    ASSERT_TRUE(writer.ok()) << writer.status().ToString();
    for (const TensorSpec& s : specs) {
      auto t = Tensor::Empty(s.dtype, s.shape);
      ASSERT_TRUE(t.ok());
      ASSERT_TRUE((*writer)->Write(s.name, *t).ok());
    }
    ASSERT_TRUE((*writer)->Finish().ok());
  }

  fs::path dir_;
};

TEST_F(EngineLimits, RankAboveTheDefaultNamesTheSetting) {
  WriteAdapter(24);
  auto r = Inspect(dir_);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  auto f = Findings(*r, Severity::kNote, Subject::kModule, "model.layers.0.self_attn.q_proj");
  ASSERT_EQ(f.size(), 1u);
  EXPECT_TRUE(Contains(f[0].message, "largest rank 24")) << f[0].message;
  EXPECT_TRUE(Contains(f[0].message, "vLLM's max_lora_rank must be at least 24")) << f[0].message;
  EXPECT_TRUE(Contains(f[0].message, "start vLLM with a max_lora_rank of 32 or more (default 16)")) << f[0].message;
  EXPECT_EQ(f[0].engine_max_lora_rank, 32);
}

TEST_F(EngineLimits, RankAboveTheLargestSettingIsRejected) {
  WriteAdapter(600);
  auto r = Inspect(dir_);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  auto f = Findings(*r, Severity::kReject, Subject::kModule, "model.layers.0.self_attn.q_proj");
  ASSERT_EQ(f.size(), 1u);
  EXPECT_TRUE(Contains(f[0].message, "largest rank 600")) << f[0].message;
  EXPECT_TRUE(Contains(f[0].message, "vLLM accepts a max_lora_rank of at most 512")) << f[0].message;
  EXPECT_EQ(f[0].fix_layout, Layout::kHf);
}

TEST_F(EngineLimits, KeysWithAnAdapterNameAreRejected) {
  WriteAdapter(8, ".default");
  auto r = Inspect(dir_);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  auto f = Findings(*r, Severity::kReject, Subject::kKey,
                    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight");
  ASSERT_EQ(f.size(), 1u);
  EXPECT_TRUE(Contains(f[0].message, "2 tensors")) << f[0].message;
  EXPECT_TRUE(Contains(f[0].message, "adapter name")) << f[0].message;
  EXPECT_TRUE(Contains(f[0].message, "the lora layout writes clean names")) << f[0].message;
  EXPECT_EQ(f[0].fix_layout, Layout::kLora);
}

TEST_F(EngineLimits, NonLoraAdapterIsRejectedByPeftType) {
  const InspectReport r = InspectCase("refuse_ia3", false);
  ASSERT_TRUE(r.engine.has_value());
  ASSERT_EQ(r.engine->findings.size(), 1u);
  EXPECT_EQ(r.engine->findings[0].severity, Severity::kReject);
  EXPECT_EQ(r.engine->findings[0].subject, "peft_type");
  EXPECT_TRUE(Contains(r.engine->findings[0].message, "'IA3'")) << r.engine->findings[0].message;
}

}  // namespace
}  // namespace ferry
