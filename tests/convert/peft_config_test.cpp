#include "convert/peft_config.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include "tests/temp_dir.h"

namespace ferry {
namespace {

constexpr const char* kSrc = "adapter/adapter_config.json";

PeftConfig MustParse(const std::string& json) {
  auto c = ParsePeftConfig(json, kSrc);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? std::move(c).value() : PeftConfig{};
}

// Expects `json` to be rejected with `code` and a message naming the file and `needle`.
void ExpectRejected(const std::string& json, StatusCode code, const std::string& needle) {
  auto c = ParsePeftConfig(json, kSrc);
  ASSERT_FALSE(c.ok()) << json;
  EXPECT_EQ(c.status().code(), code) << c.status().ToString();
  EXPECT_EQ(c.status().message().rfind(kSrc, 0), 0u) << c.status().message();
  EXPECT_NE(c.status().message().find(needle), std::string::npos) << c.status().message();
}

TEST(PeftConfigTest, DefaultsMatchPeft) {
  const PeftConfig c = MustParse(R"({"peft_type": "LORA"})");
  EXPECT_EQ(c.r, 8);
  EXPECT_EQ(c.lora_alpha, 8.0);
  EXPECT_FALSE(c.use_rslora);
  EXPECT_FALSE(c.use_dora);
  EXPECT_FALSE(c.fan_in_fan_out);
  EXPECT_FALSE(c.lora_bias);
  EXPECT_EQ(c.bias, PeftBias::kNone);
  EXPECT_EQ(std::get<bool>(c.init_lora_weights), true);
  EXPECT_EQ(c.target_modules.form, ModuleSelector::Form::kNone);
  EXPECT_TRUE(c.layers_to_transform.empty());
  EXPECT_EQ(c.ScalingFor("model.layers.0.self_attn.q_proj"), 1.0);
  EXPECT_EQ(c.raw_json, R"({"peft_type": "LORA"})");
  EXPECT_EQ(c.source, kSrc);
  EXPECT_TRUE(c.CheckMergeable().ok());
}

TEST(PeftConfigTest, NullFieldsKeepDefaults) {
  const PeftConfig c = MustParse(
      R"({"peft_type": "LORA", "target_modules": null, "layers_to_transform": null, "modules_to_save": null,
          "rank_pattern": null, "alora_invocation_tokens": null, "trainable_token_indices": null})");
  EXPECT_TRUE(c.target_modules.empty());
  EXPECT_TRUE(c.modules_to_save.empty());
  EXPECT_TRUE(c.alora_invocation_tokens.empty());
  EXPECT_TRUE(c.trainable_token_indices.empty());
}

TEST(PeftConfigTest, PlainScalingIsAlphaOverR) {
  const PeftConfig c = MustParse(R"({"peft_type": "LORA", "r": 16, "lora_alpha": 8})");
  EXPECT_DOUBLE_EQ(c.ScalingFor("model.layers.0.mlp.up_proj"), 0.5);
}

TEST(PeftConfigTest, RsLoraScalingIsAlphaOverSqrtR) {
  const PeftConfig c = MustParse(R"({"peft_type": "LORA", "r": 16, "lora_alpha": 8, "use_rslora": true})");
  EXPECT_DOUBLE_EQ(c.ScalingFor("model.layers.0.mlp.up_proj"), 2.0);  // 8 / sqrt(16) = 8 / 4
  const PeftConfig d = MustParse(R"({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "use_rslora": true})");
  EXPECT_DOUBLE_EQ(d.ScalingFor("x.q_proj"), 5.656854249492380195);  // 16 / 2.8284271247461903
}

TEST(PeftConfigTest, RankPatternFirstMatchInFileOrderWins) {
  const PeftConfig c = MustParse(R"({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "rank_pattern": {
      "model.layers.1.mlp.down_proj": 2,
      "q_proj": 4,
      "layers\\.[01]\\.self_attn\\.k_proj": 6,
      "k_proj": 12,
      "model.layers.0.self_attn.q_proj": 16}})");
  ASSERT_EQ(c.rank_pattern.size(), 5u);
  EXPECT_EQ(c.rank_pattern[0].key, "model.layers.1.mlp.down_proj");  // file order, not sorted
  EXPECT_EQ(c.RankFor("model.layers.1.mlp.down_proj"), 2);
  EXPECT_EQ(c.RankFor("model.layers.0.mlp.down_proj"), 8);
  // "q_proj" comes first in the file although "model.layers.0..." sorts before it.
  EXPECT_EQ(c.RankFor("model.layers.0.self_attn.q_proj"), 4);
  EXPECT_EQ(c.RankFor("model.layers.0.self_attn.k_proj"), 6);
  EXPECT_EQ(c.RankFor("model.layers.1.self_attn.k_proj"), 6);
  EXPECT_EQ(c.RankFor("model.layers.2.self_attn.k_proj"), 12);
  EXPECT_EQ(c.RankFor("model.layers.0.self_attn.xq_proj"), 8);  // suffix must follow a dot
  EXPECT_DOUBLE_EQ(c.ScalingFor("model.layers.0.self_attn.k_proj"), 16.0 / 6.0);
  EXPECT_DOUBLE_EQ(c.ScalingFor("model.layers.1.mlp.down_proj"), 8.0);
}

TEST(PeftConfigTest, PatternOrderReversedGivesOtherWinner) {
  const PeftConfig c = MustParse(R"({"peft_type": "LORA", "rank_pattern": {
      "model.layers.0.self_attn.q_proj": 16, "q_proj": 4}})");
  EXPECT_EQ(c.RankFor("model.layers.0.self_attn.q_proj"), 16);
  EXPECT_EQ(c.RankFor("model.layers.1.self_attn.q_proj"), 4);
}

TEST(PeftConfigTest, RepeatedKeysKeepFirstPositionAndLastValue) {
  // Python's json.loads: a repeated key keeps its first position and takes the last value.
  const PeftConfig c = MustParse(R"({"peft_type": "LORA", "rank_pattern": {
      "q_proj": 4, "model.layers.0.self_attn.q_proj": 16, "q_proj": 5},
      "alpha_pattern": {"k_proj": 2}, "alpha_pattern": {"q_proj": 3},
      "trainable_token_indices": {"rank_pattern": [1]}})");
  ASSERT_EQ(c.rank_pattern.size(), 2u);
  EXPECT_EQ(c.rank_pattern[0].key, "q_proj");
  EXPECT_EQ(c.RankFor("model.layers.0.self_attn.q_proj"), 5);
  ASSERT_EQ(c.alpha_pattern.size(), 1u);
  EXPECT_EQ(c.AlphaFor("model.layers.0.self_attn.k_proj"), 8.0);
  EXPECT_EQ(c.AlphaFor("model.layers.0.self_attn.q_proj"), 3.0);
}

TEST(PeftConfigTest, PatternKeyAnchorsAtStartAndEnd) {
  const PeftConfig c = MustParse(R"({"peft_type": "LORA", "rank_pattern": {"proj": 2, "self_attn": 3, "a)|(b": 5}})");
  EXPECT_EQ(c.RankFor("model.layers.0.self_attn.q_proj"), 8);  // "proj" is not a whole segment
  EXPECT_EQ(c.RankFor("model.layers.0.self_attn"), 3);
  EXPECT_EQ(c.RankFor("model.proj"), 2);
  // re.match(r"(.*\.)?(a)|(b)$", M): the first branch is anchored at the start only.
  EXPECT_EQ(c.RankFor("x.a.suffix"), 5);
  EXPECT_EQ(c.RankFor("b"), 5);
  EXPECT_EQ(c.RankFor("bc"), 8);
}

TEST(PeftConfigTest, AlphaPatternFirstMatchInFileOrderWins) {
  const PeftConfig c = MustParse(R"({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "alpha_pattern": {
      "v_proj": 32, "model.layers.0.self_attn.v_proj": 4, "model.layers.0.self_attn.o_proj": 2.5}})");
  EXPECT_EQ(c.AlphaFor("model.layers.0.self_attn.v_proj"), 32.0);
  EXPECT_EQ(c.AlphaFor("model.layers.0.self_attn.o_proj"), 2.5);
  EXPECT_EQ(c.AlphaFor("model.layers.1.self_attn.o_proj"), 16.0);
  EXPECT_DOUBLE_EQ(c.ScalingFor("model.layers.0.self_attn.o_proj"), 2.5 / 8.0);
}

TEST(PeftConfigTest, LookupsWorkWithoutCompiledCache) {
  PeftConfig c = MustParse(R"({"peft_type": "LORA", "rank_pattern": {"q_proj": 4}, "target_modules": ".*\\.v_proj"})");
  c.compiled.reset();
  c.rank_pattern.push_back({"k_proj", 2});
  EXPECT_EQ(c.RankFor("m.q_proj"), 4);
  EXPECT_EQ(c.RankFor("m.k_proj"), 2);
  EXPECT_TRUE(c.IsTargeted("model.layers.0.v_proj"));
}

TEST(PeftConfigTest, TargetListUsesSuffixSemantics) {
  const PeftConfig c = MustParse(R"({"peft_type": "LORA", "target_modules": ["q_proj", "mlp.down_proj"]})");
  EXPECT_EQ(c.target_modules.form, ModuleSelector::Form::kList);
  EXPECT_TRUE(c.IsTargeted("model.layers.0.self_attn.q_proj"));
  EXPECT_TRUE(c.IsTargeted("q_proj"));
  EXPECT_FALSE(c.IsTargeted("model.layers.0.self_attn.xq_proj"));
  EXPECT_TRUE(c.IsTargeted("model.layers.3.mlp.down_proj"));
  EXPECT_FALSE(c.IsTargeted("model.layers.3.xmlp.down_proj"));
  EXPECT_FALSE(c.IsTargeted("model.layers.0.self_attn.k_proj"));
}

TEST(PeftConfigTest, TargetRegexMustMatchWholeName) {
  const PeftConfig c = MustParse(
      R"js({"peft_type": "LORA", "target_modules": ".*\\.layers\\.\\d+\\.(self_attn\\.(k|o)_proj|mlp\\.up_proj)"})js");
  EXPECT_EQ(c.target_modules.form, ModuleSelector::Form::kRegex);
  EXPECT_TRUE(c.IsTargeted("model.layers.0.self_attn.k_proj"));
  EXPECT_TRUE(c.IsTargeted("model.layers.12.mlp.up_proj"));
  EXPECT_FALSE(c.IsTargeted("model.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(c.IsTargeted("model.layers.0.self_attn.k_proj.extra"));  // fullmatch, not search
  const PeftConfig d = MustParse(R"({"peft_type": "LORA", "target_modules": "q_proj"})");
  EXPECT_TRUE(d.IsTargeted("q_proj"));
  EXPECT_FALSE(d.IsTargeted("model.layers.0.self_attn.q_proj"));  // a string is a regex, not a suffix
}

TEST(PeftConfigTest, AllLinearSkipsOutputEmbeddingsAndNon2D) {
  const PeftConfig c = MustParse(R"({"peft_type": "LORA", "target_modules": "ALL-LINEAR"})");
  EXPECT_EQ(c.target_modules.form, ModuleSelector::Form::kAllLinear);
  EXPECT_TRUE(c.IsTargeted("model.layers.0.self_attn.q_proj", 2));
  EXPECT_TRUE(c.IsTargeted("transformer.h.0.attn.c_attn"));
  EXPECT_FALSE(c.IsTargeted("lm_head", 2));
  EXPECT_FALSE(c.IsTargeted("model.embed_tokens", 2));
  EXPECT_FALSE(c.IsTargeted("transformer.wte"));
  EXPECT_FALSE(c.IsTargeted("model.layers.0.input_layernorm", 1));
}

TEST(PeftConfigTest, ExcludeModulesListAndRegex) {
  const PeftConfig c = MustParse(
      R"({"peft_type": "LORA", "target_modules": ["q_proj", "up_proj"], "exclude_modules": ["model.layers.0.mlp.up_proj"]})");
  EXPECT_TRUE(c.IsExcluded("model.layers.0.mlp.up_proj"));
  EXPECT_FALSE(c.IsTargeted("model.layers.0.mlp.up_proj"));
  EXPECT_TRUE(c.IsTargeted("model.layers.1.mlp.up_proj"));
  const PeftConfig d =
      MustParse(R"({"peft_type": "LORA", "target_modules": "all-linear", "exclude_modules": ".*\\.layers\\.1\\..*"})");
  EXPECT_FALSE(d.IsTargeted("model.layers.1.self_attn.q_proj"));
  EXPECT_TRUE(d.IsTargeted("model.layers.0.self_attn.q_proj"));
  EXPECT_TRUE(d.IsTargeted("model.layers.11.self_attn.q_proj"));
}

TEST(PeftConfigTest, LayersToTransformList) {
  const PeftConfig c = MustParse(
      R"({"peft_type": "LORA", "target_modules": ["q_proj", "model.layers.0.self_attn.v_proj"],
          "layers_to_transform": [1, 3], "layers_pattern": "layers"})");
  EXPECT_EQ(c.LayerIndexOf("model.layers.3.self_attn.q_proj"), 3);
  EXPECT_TRUE(c.IsTargeted("model.layers.1.self_attn.q_proj"));
  EXPECT_TRUE(c.IsTargeted("model.layers.3.self_attn.q_proj"));
  EXPECT_FALSE(c.IsTargeted("model.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(c.IsTargeted("model.layers.13.self_attn.q_proj"));
  EXPECT_FALSE(c.IsTargeted("lm_head.q_proj"));                  // no layer index
  EXPECT_TRUE(c.IsTargeted("model.layers.0.self_attn.v_proj"));  // exact list entry: PEFT does not filter
}

TEST(PeftConfigTest, LayersToTransformIntAndDefaultNames) {
  const PeftConfig c = MustParse(R"({"peft_type": "LORA", "target_modules": ["c_attn"], "layers_to_transform": 2})");
  EXPECT_TRUE(c.layers_to_transform_is_int);
  EXPECT_EQ(c.LayerIndexOf("transformer.h.2.attn.c_attn"), 2);
  EXPECT_EQ(c.LayerIndexOf("model.layers.7.experts.3.w1"), 7);        // the first index
  EXPECT_EQ(c.LayerIndexOf("model.decoder.5.q_proj"), std::nullopt);  // "decoder" is not a layer name
  EXPECT_EQ(c.LayerIndexOf("model.layers.5"), std::nullopt);          // the index may not be last
  EXPECT_TRUE(c.IsTargeted("transformer.h.2.attn.c_attn"));
  EXPECT_FALSE(c.IsTargeted("transformer.h.1.attn.c_attn"));
  const PeftConfig d = MustParse(
      R"({"peft_type": "LORA", "target_modules": ["q"], "layers_to_transform": [0], "layers_pattern": ["block"]})");
  EXPECT_EQ(d.LayerIndexOf("encoder.block.4.layer.0.SelfAttention.q"), 4);
  EXPECT_FALSE(d.IsTargeted("encoder.block.4.layer.0.SelfAttention.q"));
  EXPECT_TRUE(d.IsTargeted("encoder.block.0.layer.1.SelfAttention.q"));
}

TEST(PeftConfigTest, ModulesToSaveAndOtherFields) {
  const PeftConfig c = MustParse(
      R"({"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "meta/llama", "bias": "lora_only",
          "lora_bias": true, "fan_in_fan_out": true, "use_dora": true, "modules_to_save": ["lm_head", "score"],
          "trainable_token_indices": {"embed_tokens": [1, 2], "lm_head": [3]},
          "init_lora_weights": "gaussian"})");
  EXPECT_EQ(c.task_type, "CAUSAL_LM");
  EXPECT_EQ(c.base_model_name_or_path, "meta/llama");
  EXPECT_EQ(c.bias, PeftBias::kLoraOnly);
  EXPECT_TRUE(c.lora_bias && c.fan_in_fan_out && c.use_dora);
  EXPECT_TRUE(c.IsModuleToSave("lm_head"));
  EXPECT_TRUE(c.IsModuleToSave("model.score"));
  EXPECT_FALSE(c.IsModuleToSave("model.xscore"));
  ASSERT_EQ(c.trainable_token_indices.by_module.size(), 2u);
  EXPECT_EQ(c.trainable_token_indices.by_module[0].first, "embed_tokens");
  EXPECT_EQ(c.trainable_token_indices.by_module[0].second, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(std::get<std::string>(c.init_lora_weights), "gaussian");
  EXPECT_TRUE(c.CheckMergeable().ok());
}

// ---------------------------------------------------------------------------------
// Refusals.

void ExpectRefused(const std::string& json, const std::vector<std::string>& needles) {
  const PeftConfig c = MustParse(json);
  const Status s = c.CheckMergeable();
  EXPECT_EQ(s.code(), StatusCode::kUnsupported) << s.ToString();
  EXPECT_EQ(s.message().rfind(kSrc, 0), 0u) << s.message();
  for (const auto& n : needles) EXPECT_NE(s.message().find(n), std::string::npos) << n << " in " << s.message();
}

TEST(PeftConfigRefusalTest, PissaWithoutConversion) {
  ExpectRefused(R"({"peft_type": "LORA", "init_lora_weights": "pissa"})",
                {"init_lora_weights", "PiSSA", "path_initial_model_for_weight_conversion"});
  ExpectRefused(R"({"peft_type": "LORA", "init_lora_weights": "pissa_niter_16"})", {"pissa_niter_16", "PiSSA"});
  ExpectRefused(R"({"peft_type": "LORA", "init_lora_weights": "PiSSA"})", {"PiSSA"});
}

TEST(PeftConfigRefusalTest, PissaWithConversionPathIsMergeable) {
  const PeftConfig c = MustParse(
      R"({"peft_type": "LORA", "init_lora_weights": "pissa", "path_initial_model_for_weight_conversion": "init"})");
  EXPECT_EQ(c.path_initial_model_for_weight_conversion, "init");
  EXPECT_TRUE(c.CheckMergeable().ok());
}

TEST(PeftConfigRefusalTest, OloraCordaLoftq) {
  ExpectRefused(R"({"peft_type": "LORA", "init_lora_weights": "olora"})",
                {"OLoRA", "path_initial_model_for_weight_conversion"});
  ExpectRefused(R"({"peft_type": "LORA", "init_lora_weights": "corda"})",
                {"CorDA", "path_initial_model_for_weight_conversion"});
  ExpectRefused(R"({"peft_type": "LORA", "init_lora_weights": "loftq"})", {"LoftQ", "LoftQ-initialised base"});
}

TEST(PeftConfigRefusalTest, ActivatedLora) {
  ExpectRefused(R"({"peft_type": "LORA", "alora_invocation_tokens": [7, 8, 9]})",
                {"alora_invocation_tokens", "cannot be merged", "aLoRA"});
  const PeftConfig c = MustParse(R"({"peft_type": "LORA", "alora_invocation_tokens": []})");
  EXPECT_TRUE(c.CheckMergeable().ok());
}

TEST(PeftConfigRefusalTest, NonLoraPeftTypes) {
  ExpectRefused(R"({"peft_type": "IA3", "target_modules": ["k_proj"]})", {"\"IA3\"", "LORA", "merge_and_unload"});
  ExpectRefused(R"({"peft_type": "LOHA", "r": 4})", {"\"LOHA\""});
  ExpectRefused(R"({"r": 4})", {"'peft_type' is missing"});
}

TEST(PeftConfigRefusalTest, OtherUnmergeableFeatures) {
  ExpectRefused(R"({"peft_type": "LORA", "target_parameters": ["experts.w1"]})", {"target_parameters"});
  ExpectRefused(R"({"peft_type": "LORA", "layer_replication": [[0, 2]]})", {"layer_replication"});
  ExpectRefused(R"({"peft_type": "LORA", "use_qalora": true})", {"use_qalora"});
}

// ---------------------------------------------------------------------------------
// Malformed configs.

TEST(PeftConfigMalformedTest, NotJsonOrNotObject) {
  ExpectRejected("{", StatusCode::kCorruption, "not valid JSON: parse error at line 1, column 2");
  ExpectRejected("", StatusCode::kCorruption, "not valid JSON");
  ExpectRejected("[1, 2]", StatusCode::kCorruption, "not a JSON object");
  ExpectRejected("\"LORA\"", StatusCode::kCorruption, "not a JSON object");
  ExpectRejected("{\"peft_type\": \"\xff\"}", StatusCode::kCorruption, "not valid JSON");
  ExpectRejected("{\"r\": NaN}", StatusCode::kCorruption, "not valid JSON");
}

TEST(PeftConfigMalformedTest, RankMustBePositiveInteger) {
  auto c = ParsePeftConfig(R"({"r": "eight"})", kSrc);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kCorruption);
  EXPECT_EQ(c.status().message(), "adapter/adapter_config.json: field 'r' must be a positive integer, got \"eight\"");
  ExpectRejected(R"({"r": -1})", StatusCode::kCorruption, "field 'r' must be a positive integer, got -1");
  ExpectRejected(R"({"r": 0})", StatusCode::kCorruption, "field 'r' must be a positive integer, got 0");
  ExpectRejected(R"({"r": 8.5})", StatusCode::kCorruption, "field 'r' must be a positive integer, got 8.5");
  ExpectRejected(R"({"r": true})", StatusCode::kCorruption, "field 'r' must be a positive integer, got true");
  ExpectRejected(R"({"r": [8]})", StatusCode::kCorruption, "field 'r' must be a positive integer, got an array");
  ExpectRejected(R"({"r": 65537})", StatusCode::kUnsupported, "field 'r' is 65537");
  ExpectRejected(R"({"r": 18446744073709551615})", StatusCode::kUnsupported, "field 'r'");
  ExpectRejected(R"({"rank_pattern": {"q_proj": 0}})", StatusCode::kCorruption, "field 'rank_pattern[\"q_proj\"]'");
}

TEST(PeftConfigMalformedTest, AlphaMustBeFinite) {
  ExpectRejected(R"({"lora_alpha": "16"})", StatusCode::kCorruption, "field 'lora_alpha' must be a finite number");
  ExpectRejected(R"({"lora_alpha": 1e999})", StatusCode::kCorruption, "not valid JSON: number overflow");
  ExpectRejected(R"({"lora_alpha": [16]})", StatusCode::kCorruption,
                 "field 'lora_alpha' must be a finite number, got an array");
  ExpectRejected(R"({"alpha_pattern": {"v_proj": null}})", StatusCode::kCorruption, "alpha_pattern[\"v_proj\"]");
}

TEST(PeftConfigMalformedTest, WrongTypesNameTheField) {
  ExpectRejected(R"({"use_rslora": "yes"})", StatusCode::kCorruption, "field 'use_rslora' must be true or false");
  ExpectRejected(R"({"bias": "some"})", StatusCode::kCorruption, "field 'bias'");
  ExpectRejected(R"({"target_modules": ["q_proj", 3]})", StatusCode::kCorruption, "field 'target_modules'");
  ExpectRejected(R"({"target_modules": {"q": 1}})", StatusCode::kCorruption, "field 'target_modules'");
  ExpectRejected(R"({"modules_to_save": "lm_head"})", StatusCode::kCorruption, "field 'modules_to_save'");
  ExpectRejected(R"({"layers_to_transform": [0, -1]})", StatusCode::kCorruption, "field 'layers_to_transform'");
  ExpectRejected(R"({"init_lora_weights": 3})", StatusCode::kCorruption, "field 'init_lora_weights'");
  ExpectRejected(R"({"peft_type": 1})", StatusCode::kCorruption, "field 'peft_type' must be a string");
  ExpectRejected(R"({"trainable_token_indices": {"embed_tokens": [-3]}})", StatusCode::kCorruption,
                 "trainable_token_indices[\"embed_tokens\"]");
  ExpectRejected(R"({"alora_invocation_tokens": [1, "x"]})", StatusCode::kCorruption, "alora_invocation_tokens");
  ExpectRejected(R"({"rank_pattern": [1]})", StatusCode::kCorruption, "field 'rank_pattern'");
  ExpectRejected(R"({"target_modules": ".*q_proj", "layers_to_transform": [0]})", StatusCode::kCorruption,
                 "'layers_to_transform' cannot be used");
}

TEST(PeftConfigMalformedTest, BadRegexNamesFieldAndPattern) {
  ExpectRejected(R"({"target_modules": "(q_proj"})", StatusCode::kCorruption,
                 "field 'target_modules' pattern \"(q_proj\" is not a valid regular expression");
  ExpectRejected(R"({"exclude_modules": "[a-"})", StatusCode::kCorruption, "field 'exclude_modules' pattern \"[a-\"");
  ExpectRejected(R"({"rank_pattern": {"q_proj(": 4}})", StatusCode::kCorruption,
                 "field 'rank_pattern' pattern \"q_proj(\"");
}

TEST(PeftConfigMalformedTest, PythonOnlyRegexIsUnsupported) {
  ExpectRejected(R"({"target_modules": "^(?!.*lm_head).*proj$"})", StatusCode::kUnsupported,
                 "field 'target_modules' pattern \"^(?!.*lm_head).*proj$\" uses a Python regex feature");
  ExpectRejected(R"({"alpha_pattern": {"(?<=self_attn\\.)q_proj": 4}})", StatusCode::kUnsupported,
                 "field 'alpha_pattern' pattern");
  ExpectRejected(R"({"rank_pattern": {"(q)_\\1": 4}})", StatusCode::kUnsupported, "lookaround or backreference");
}

TEST(PeftConfigMalformedTest, LimitsAreEnforced) {
  const std::string long_pattern(kMaxConfigPatternLength + 1, 'a');
  ExpectRejected(R"({"target_modules": ")" + long_pattern + "\"}", StatusCode::kUnsupported,
                 "field 'target_modules' has a pattern of 4097 chars");
  std::string deep = std::string(200, '[') + std::string(200, ']');
  ExpectRejected(R"({"target_modules": )" + deep + "}", StatusCode::kUnsupported, "nested deeper than");
  std::string many = R"({"rank_pattern": {)";
  for (size_t i = 0; i <= kMaxConfigObjectKeys; ++i) many += (i ? ",\"k" : "\"k") + std::to_string(i) + "\": 1";
  many += "}}";
  ExpectRejected(many, StatusCode::kUnsupported, "more than 16384 keys");
  ExpectRejected(std::string(kMaxAdapterConfigBytes + 1, ' '), StatusCode::kUnsupported, "at most");
}

TEST(PeftConfigLoadTest, LoadsFromDirectoryAndNamesMissingFile) {
  namespace fs = std::filesystem;
  ferry::testing::ScopedTempDir tmp("ferry_peft_config_load_");
  const fs::path dir = tmp.path();
  auto missing = LoadPeftConfig(dir);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find((dir / "adapter_config.json").string()), std::string::npos);
  std::ofstream(dir / "adapter_config.json") << R"({"peft_type": "LORA", "r": "eight"})";
  auto bad = LoadPeftConfig(dir);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(),
            (dir / "adapter_config.json").string() + ": field 'r' must be a positive integer, got \"eight\"");
  std::ofstream(dir / "adapter_config.json") << R"({"peft_type": "LORA", "r": 4})";
  auto good = LoadPeftConfig(dir / "adapter_config.json");
  ASSERT_TRUE(good.ok()) << good.status().ToString();
  EXPECT_EQ(good->r, 4);
}

// ---------------------------------------------------------------------------------
// Adapter keys.

struct KeyCase {
  const char* key;
  const char* module;
  AdapterKey::Kind kind;
  const char* adapter_name;
  const char* param;
};

TEST(AdapterKeyTest, AllForms) {
  const KeyCase cases[] = {
      {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", "model.layers.0.self_attn.q_proj",
       AdapterKey::kLoraA, "", ""},
      {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", "model.layers.0.self_attn.q_proj",
       AdapterKey::kLoraA, "default", ""},
      {"base_model.model.model.layers.0.mlp.down_proj.lora_B.weight", "model.layers.0.mlp.down_proj",
       AdapterKey::kLoraB, "", ""},
      {"base_model.model.model.layers.0.mlp.down_proj.lora_B.bias", "model.layers.0.mlp.down_proj",
       AdapterKey::kLoraBBias, "", ""},
      {"base_model.model.model.layers.0.mlp.down_proj.lora_B.default.bias", "model.layers.0.mlp.down_proj",
       AdapterKey::kLoraBBias, "default", ""},
      {"base_model.model.model.embed_tokens.lora_embedding_A", "model.embed_tokens", AdapterKey::kEmbeddingA, "", ""},
      {"base_model.model.model.embed_tokens.lora_embedding_A.default", "model.embed_tokens", AdapterKey::kEmbeddingA,
       "default", ""},
      {"base_model.model.model.embed_tokens.lora_embedding_B", "model.embed_tokens", AdapterKey::kEmbeddingB, "", ""},
      {"base_model.model.model.layers.1.self_attn.v_proj.lora_magnitude_vector", "model.layers.1.self_attn.v_proj",
       AdapterKey::kMagnitude, "", ""},
      {"base_model.model.model.layers.1.self_attn.v_proj.lora_magnitude_vector.weight",
       "model.layers.1.self_attn.v_proj", AdapterKey::kMagnitude, "", ""},
      {"base_model.model.model.layers.1.self_attn.v_proj.lora_magnitude_vector.default.weight",
       "model.layers.1.self_attn.v_proj", AdapterKey::kMagnitude, "default", ""},
      {"base_model.model.lm_head.modules_to_save.default.weight", "lm_head", AdapterKey::kModulesToSave, "default",
       "weight"},
      {"base_model.model.score.modules_to_save.default.dense.bias", "score.dense", AdapterKey::kModulesToSave,
       "default", "bias"},
      {"base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta", "model.embed_tokens",
       AdapterKey::kTrainableTokens, "", ""},
      {"base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta.default", "model.embed_tokens",
       AdapterKey::kTrainableTokens, "default", ""},
      {"base_model.model.model.embed_tokens.base_layer.weight", "model.embed_tokens", AdapterKey::kBaseLayer, "",
       "weight"},
      {"base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias", "model.layers.0.self_attn.q_proj",
       AdapterKey::kBaseLayer, "", "bias"},
      {"base_model.model.lm_head.weight", "lm_head", AdapterKey::kOther, "", "weight"},
      {"base_model.model.model.layers.0.mlp.down_proj.ia3_l", "model.layers.0.mlp.down_proj", AdapterKey::kOther, "",
       "ia3_l"},
      {"model.layers.0.self_attn.q_proj.lora_A.weight", "model.layers.0.self_attn.q_proj", AdapterKey::kLoraA, "", ""},
  };
  for (const KeyCase& c : cases) {
    auto k = ParseAdapterKey(c.key);
    ASSERT_TRUE(k.ok()) << c.key << ": " << k.status().ToString();
    EXPECT_EQ(k->module, c.module) << c.key;
    EXPECT_EQ(k->kind, c.kind) << c.key;
    EXPECT_EQ(k->adapter_name, c.adapter_name) << c.key;
    EXPECT_EQ(k->param, c.param) << c.key;
    EXPECT_EQ(k->had_prefix, std::string(c.key).rfind("base_model.model.", 0) == 0) << c.key;
  }
}

TEST(AdapterKeyTest, FullTensorOfModulesToSaveWithConfig) {
  const PeftConfig c = MustParse(R"({"peft_type": "LORA", "modules_to_save": ["lm_head", "embed_tokens"]})");
  auto lm = ParseAdapterKey("base_model.model.lm_head.weight", &c);
  ASSERT_TRUE(lm.ok());
  EXPECT_EQ(lm->kind, AdapterKey::kModulesToSave);
  EXPECT_EQ(lm->module, "lm_head");
  EXPECT_EQ(lm->param, "weight");
  auto emb = ParseAdapterKey("base_model.model.model.embed_tokens.weight", &c);
  ASSERT_TRUE(emb.ok());
  EXPECT_EQ(emb->kind, AdapterKey::kModulesToSave);
  auto other = ParseAdapterKey("base_model.model.model.norm.weight", &c);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(other->kind, AdapterKey::kOther);
}

TEST(AdapterKeyTest, MalformedKeysNameTheTensor) {
  const char* bad[] = {
      "",
      "base_model.model.lora_A.weight",
      "model..q_proj.lora_A.weight",
      "q_proj.lora_A.default.extra.weight",
      "q_proj.lora_A.bias",
      "q_proj.lora_A",
      "q_proj.lora_embedding_A.default.weight",
      "q_proj.lora_magnitude_vector.a.b",
      "embed.token_adapter.trainable_tokens_original",
      "lm_head.modules_to_save.default",
      "q_proj.base_layer",
  };
  for (const char* key : bad) {
    auto k = ParseAdapterKey(key);
    ASSERT_FALSE(k.ok()) << key;
    EXPECT_EQ(k.status().code(), StatusCode::kCorruption) << key;
    EXPECT_NE(k.status().message().find("tensor '" + std::string(key) + "'"), std::string::npos)
        << k.status().message();
  }
  auto huge = ParseAdapterKey(std::string(5000, 'a'));
  EXPECT_EQ(huge.status().code(), StatusCode::kCorruption);
}

}  // namespace
}  // namespace ferry
