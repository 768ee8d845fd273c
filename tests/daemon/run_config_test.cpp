#include "daemon/run/config.h"

#include <cmath>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "daemon/run/config_internal.h"
#include "tests/daemon/run_test_util.h"

namespace ferry::run {
namespace {

using ::ferry::run::testing::ExpectError;
using ::ferry::run::testing::Fixture;
using ::ferry::run::testing::TempDir;
using ::ferry::run::testing::WriteFile;
using Json = nlohmann::json;

constexpr const char* kSrc = "/cfg/run.toml";
constexpr const char* kTop = "model_name_or_path = \"model\"\ndataset = \"train.jsonl\"\n";
constexpr const char* kReward = "[[rewards]]\ntype = \"length\"\ntarget = 8\n";

// A config with the required keys, `top` (top-level keys) and `tables` after one reward.
std::string Cfg(const std::string& top = "", const std::string& tables = "") {
  return std::string(kTop) + top + "\n" + kReward + tables;
}

RunConfig MustParse(const std::string& text) {
  auto c = ParseRunConfig(text, kSrc);
  EXPECT_TRUE(c.ok()) << c.status().ToString() << "\n" << text;
  return c.ok() ? std::move(c).value() : RunConfig{};
}

Status ParseError(const std::string& text) {
  auto c = ParseRunConfig(text, kSrc);
  EXPECT_FALSE(c.ok()) << text;
  return c.status();
}

// `FILE: key 'KEY': ...` with `code`, containing `needle`.
void ExpectKeyError(const std::string& text, StatusCode code, const std::string& key, const std::string& needle = "") {
  ExpectError(ParseError(text), code, std::string(kSrc) + ": key '" + key + "': ", needle);
}

// ---------------------------------------------------------------------------------------
// Defaults.

// Every default against TRL 1.16.0 / transformers 5.23.0 / PEFT 0.21.2, read from their
// sources (line numbers of the field declarations):
//   trl/trainer/grpo_config.py, trl/trainer/base_config.py, transformers/training_args.py,
//   peft/tuners/lora/config.py, peft/utils/constants.py.
TEST(RunConfigTest, DefaultsAreTrls) {
  const RunConfig c = MustParse(Cfg());
  // --- GRPOConfig (grpo_config.py)
  EXPECT_EQ(c.learning_rate, 1e-6);                                     // l.423 (overrides TrainingArguments' 5e-5)
  EXPECT_EQ(c.num_generations, 8);                                      // l.480
  EXPECT_EQ(c.max_completion_length, 512);                              // l.494
  EXPECT_TRUE(c.shuffle_dataset);                                       // l.507
  EXPECT_EQ(c.temperature, 1.0);                                        // l.532
  EXPECT_EQ(c.top_p, 1.0);                                              // l.536
  EXPECT_EQ(c.top_k, 0);                                                // l.543
  EXPECT_EQ(c.beta, 0.0);                                               // l.681
  EXPECT_EQ(c.num_iterations, 1);                                       // l.689
  EXPECT_EQ(c.epsilon, 0.2);                                            // l.693
  EXPECT_FALSE(c.delta.has_value());                                    // l.697 (None)
  EXPECT_EQ(c.epsilon_high, 0.2);                                       // l.705 (None = epsilon)
  EXPECT_EQ(NameOf(c.importance_sampling_level), "token");              // l.760
  EXPECT_EQ(NameOf(c.scale_rewards), "group");                          // l.789
  EXPECT_EQ(NameOf(c.loss_type), "dapo");                               // l.801
  EXPECT_FALSE(c.mask_truncated_completions);                           // l.836
  EXPECT_TRUE(c.vllm_importance_sampling_correction);                   // l.925
  EXPECT_EQ(NameOf(c.vllm_importance_sampling_mode), "sequence_mask");  // l.934
  EXPECT_EQ(c.vllm_importance_sampling_clip_max, std::optional<double>(3.0));  // l.947
  EXPECT_FALSE(c.vllm_importance_sampling_clip_min.has_value());               // l.955 (None)
  EXPECT_TRUE(c.use_bias_correction_kl);                                       // l.972 (True since 1.16)
  EXPECT_FALSE(c.max_prompt_length.has_value());  // not a GRPOConfig field in 1.16 (Ferry's, off)
  // l.521 / l.528 (None / None), resolved in __post_init__ l.1098: steps_per_generation =
  // gradient_accumulation_steps, generation_batch_size = per_device_train_batch_size * that.
  EXPECT_EQ(c.steps_per_generation, 1);
  EXPECT_EQ(c.generation_batch_size, 8);
  // --- base_config.py (TRL's overrides of TrainingArguments)
  EXPECT_EQ(c.logging_steps, 10);         // l.55
  EXPECT_TRUE(c.gradient_checkpointing);  // l.62
  EXPECT_TRUE(c.bf16);                    // l.68, resolved at l.108: not fp16
  // --- TrainingArguments (training_args.py)
  EXPECT_EQ(c.output_dir, std::filesystem::path("/cfg/trainer_output"));  // l.771, "trainer_output" at l.1518
  EXPECT_EQ(c.per_device_train_batch_size, 8);                            // l.777
  EXPECT_EQ(c.num_train_epochs, 3.0);                                     // l.778
  EXPECT_EQ(c.max_steps, -1);                                             // l.779
  EXPECT_EQ(NameOf(c.lr_scheduler_type), "linear");                       // l.788
  EXPECT_EQ(c.warmup_steps, 0);                                           // l.798
  EXPECT_EQ(c.warmup_ratio, 0.0);                // transformers 4.x; removed in 5 (warmup_steps < 1 is a ratio)
  EXPECT_EQ(c.weight_decay, 0.0);                // l.822
  EXPECT_EQ(c.adam_beta1, 0.9);                  // l.828
  EXPECT_EQ(c.adam_beta2, 0.999);                // l.834
  EXPECT_EQ(c.adam_epsilon, 1e-8);               // l.840
  EXPECT_EQ(c.gradient_accumulation_steps, 1);   // l.849
  EXPECT_EQ(c.max_grad_norm, 1.0);               // l.866
  EXPECT_EQ(c.save_steps, 500);                  // l.1183
  EXPECT_FALSE(c.save_total_limit.has_value());  // l.1201 (None)
  EXPECT_EQ(c.seed, 42);                         // l.1293
  // --- PEFT LoraConfig (lora/config.py)
  EXPECT_EQ(c.lora.r, 8);                           // l.632
  EXPECT_EQ(c.lora.lora_alpha, 8);                  // l.652
  EXPECT_EQ(c.lora.lora_dropout, 0.0);              // l.653
  EXPECT_EQ(c.lora.bias, "none");                   // l.658
  EXPECT_FALSE(c.lora.use_rslora);                  // l.661
  EXPECT_TRUE(c.lora.exclude_modules.empty());      // l.648
  EXPECT_TRUE(c.lora.layers_to_transform.empty());  // l.722
  EXPECT_TRUE(c.lora.layers_pattern.empty());       // l.729
  EXPECT_TRUE(c.lora.rank_pattern.empty());         // l.737
  EXPECT_TRUE(c.lora.alpha_pattern.empty());        // l.746
  // target_modules None (l.633) -> constants.py l.85 / l.95 / l.103 for llama / mistral / qwen2.
  EXPECT_EQ(c.lora.target_modules.form, ModuleSelector::Form::kList);
  EXPECT_EQ(c.lora.target_modules.names, (std::vector<std::string>{"q_proj", "v_proj"}));
  // --- Ferry's own
  EXPECT_EQ(c.threads, 0);
  EXPECT_GE(ResolvedThreads(c), 1);
  EXPECT_EQ(c.device.Name(), "cpu");
  EXPECT_EQ(c.chat_template, ChatTemplate::kAuto);
  EXPECT_EQ(c.generation_dtype, GenerationDtype::kAuto);
  EXPECT_EQ(c.store.path, std::filesystem::path("/cfg/trainer_output/store"));
  EXPECT_EQ(c.store.run, "default");
  ASSERT_EQ(c.rewards.size(), 1u);
  EXPECT_EQ(c.rewards[0].name, "length");
  EXPECT_EQ(c.rewards[0].weight, 1.0);
}

// The same defaults against what the real GRPOConfig() and LoraConfig() hold
// (fixtures/run/trl_defaults.json, written by fixtures/run/generate.py).
TEST(RunConfigTest, DefaultsEqualTheRealGrpoConfig) {
  const Json fx = Fixture("trl_defaults.json");
  ASSERT_EQ(fx["versions"]["trl"], "1.16.0");
  const Json ours = Json::parse(MustParse(Cfg()).ToJson());
  for (auto it = fx["grpo_config"].begin(); it != fx["grpo_config"].end(); ++it) {
    const std::string& key = it.key();
    SCOPED_TRACE(key);
    ASSERT_TRUE(ours.contains(key)) << "ToJson lacks " << key;
    if (key == "output_dir") {
      EXPECT_EQ(ours[key], "/cfg/" + it->get<std::string>());  // relative to the config file
    } else if (key == "epsilon_high") {
      EXPECT_TRUE(it->is_null());
      EXPECT_EQ(ours[key], fx["grpo_config"]["epsilon"]);  // None means epsilon (grpo_trainer)
    } else if (key == "reward_weights") {
      EXPECT_TRUE(it->is_null());
      EXPECT_EQ(ours[key], Json::array({1.0}));  // None means 1.0 per reward
    } else if (it->is_number()) {
      EXPECT_DOUBLE_EQ(ours[key].get<double>(), it->get<double>());
    } else {
      EXPECT_EQ(ours[key], *it);
    }
  }
  const Json& lora = fx["lora_config"];
  for (const char* key : {"r", "lora_alpha", "lora_dropout", "use_rslora", "bias", "exclude_modules",
                          "layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern"}) {
    SCOPED_TRACE(key);
    EXPECT_EQ(ours["lora"][key], lora[key]);
  }
  EXPECT_TRUE(lora["target_modules"].is_null());
  for (const char* arch : {"llama", "mistral", "qwen2"}) {
    EXPECT_EQ(ours["lora"]["target_modules"], fx["default_target_modules"][arch]) << arch;
  }
}

// ---------------------------------------------------------------------------------------
// Paths.

TEST(RunConfigTest, RelativePathsAreResolvedAgainstTheConfigFile) {
  auto c = ParseRunConfig(
      "model_name_or_path = \"../models/tiny\"\n"
      "dataset = \"data/./train.jsonl\"\n"
      "output_dir = \"/abs/out\"\n"
      "[store]\npath = \"st\"\nrun = \"exp-1\"\n"
      "[[rewards]]\ntype = \"command\"\ncommand = [\"./bin/score.sh\", \"x.py\"]\nstderr_file = \"log/r.txt\"\n"
      "[[rewards]]\nname = \"c2\"\ntype = \"command\"\ncommand = [\"python3\", \"-u\", \"r.py\"]\n",
      "/home/u/exp/run.toml");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->source, std::filesystem::path("/home/u/exp/run.toml"));
  EXPECT_EQ(c->model_name_or_path, std::filesystem::path("/home/u/models/tiny"));
  EXPECT_EQ(c->dataset, std::filesystem::path("/home/u/exp/data/train.jsonl"));
  EXPECT_EQ(c->output_dir, std::filesystem::path("/abs/out"));
  EXPECT_EQ(c->store.path, std::filesystem::path("/home/u/exp/st"));
  EXPECT_EQ(c->store.run, "exp-1");
  EXPECT_EQ(c->rewards[0].command, (std::vector<std::string>{"/home/u/exp/bin/score.sh", "x.py"}));
  EXPECT_EQ(c->rewards[0].working_dir, std::filesystem::path("/home/u/exp"));
  EXPECT_EQ(c->rewards[0].stderr_file, std::filesystem::path("/home/u/exp/log/r.txt"));
  // A bare program name is looked up in PATH; arguments are left as written.
  EXPECT_EQ(c->rewards[1].command, (std::vector<std::string>{"python3", "-u", "r.py"}));
}

TEST(RunConfigTest, StoreDefaultsUnderOutputDirAndAcceptsAPathString) {
  EXPECT_EQ(MustParse(Cfg("output_dir = \"runs/a\"")).store.path, std::filesystem::path("/cfg/runs/a/store"));
  EXPECT_EQ(MustParse(Cfg("store = \"/var/ferry\"")).store.path, std::filesystem::path("/var/ferry"));
  ExpectKeyError(Cfg("", "[store]\npaht = \"x\"\n"), StatusCode::kInvalidArgument, "store.paht", "unknown key");
  ExpectKeyError(Cfg("", "[store]\nrun = \"a\\u0001b\"\n"), StatusCode::kInvalidArgument, "store.run", "control");
}

TEST(RunConfigTest, PublishAndControlTables) {
  const RunConfig d = MustParse(Cfg());
  EXPECT_EQ(d.publish.endpoint, "");
  EXPECT_EQ(d.publish.mode, sync::PublishMode::kAdapter);
  EXPECT_TRUE(d.publish.key.empty());
  EXPECT_EQ(d.control.endpoint, "");
  const RunConfig c = MustParse(Cfg("",
                                    "[publish]\nendpoint = \"tcp://10.0.0.1:5555\"\nmode = \"adapter\"\n"
                                    "key = \"keys/ferryd\"\nallow = \"keys/allowed\"\n"
                                    "[control]\nendpoint = \"tcp://0.0.0.0:7000\"\nkey = \"/k/c\"\n"
                                    "allow = \"/k/a\"\n"));
  EXPECT_EQ(c.publish.endpoint, "tcp://10.0.0.1:5555");
  EXPECT_EQ(c.publish.key, std::filesystem::path("/cfg/keys/ferryd"));
  EXPECT_EQ(c.publish.allow, std::filesystem::path("/cfg/keys/allowed"));
  EXPECT_EQ(c.control.endpoint, "tcp://0.0.0.0:7000");
  EXPECT_EQ(c.control.key, std::filesystem::path("/k/c"));
  EXPECT_EQ(c.control.allow, std::filesystem::path("/k/a"));
  EXPECT_EQ(MustParse(Cfg("", "[publish]\nendpoint = \"ipc:///run/p\"\n")).publish.endpoint, "ipc:///run/p");
  // Operational: a run resumes under another endpoint.
  EXPECT_EQ(c.Fingerprint(), d.Fingerprint());

  // Merged and delta mode are served from the trainer's in-memory snapshots (ferryd/remote.h).
  EXPECT_EQ(MustParse(Cfg("", "[publish]\nmode = \"merged\"\n")).publish.mode, sync::PublishMode::kMerged);
  EXPECT_EQ(MustParse(Cfg("", "[publish]\nmode = \"delta\"\n")).publish.mode, sync::PublishMode::kDelta);
  ExpectKeyError(Cfg("", "[publish]\nmode = \"full\"\n"), StatusCode::kInvalidArgument, "publish.mode",
                 "must be \"adapter\"");
  ExpectKeyError(Cfg("", "[publish]\nendpoint = \"tcp://h:1\"\n"), StatusCode::kInvalidArgument, "publish.endpoint",
                 "tcp:// needs CURVE");
  ExpectKeyError(Cfg("", "[publish]\nendpoint = \"udp://h:1\"\n"), StatusCode::kInvalidArgument, "publish.endpoint",
                 "udp://h:1");
  ExpectKeyError(Cfg("", "[publish]\nkey = \"k\"\n"), StatusCode::kInvalidArgument, "publish.key",
                 "needs publish.allow");
  ExpectKeyError(Cfg("", "[control]\nallow = \"a\"\n"), StatusCode::kInvalidArgument, "control.allow",
                 "needs control.key");
  ExpectKeyError(Cfg("", "[control]\nendpoint = \"tcp://h:1\"\n"), StatusCode::kInvalidArgument, "control.endpoint",
                 "tcp:// needs CURVE");
  ExpectKeyError(Cfg("", "[control]\nmode = \"adapter\"\n"), StatusCode::kInvalidArgument, "control.mode",
                 "unknown key");
  ExpectKeyError(Cfg("publish = \"ipc:///x\""), StatusCode::kInvalidArgument, "publish", "must be a table");
}

TEST(RunConfigTest, HomeRelativePathsAreRefused) {
  ExpectKeyError("model_name_or_path = \"~/m\"\ndataset = \"d\"\n" + std::string(kReward), StatusCode::kInvalidArgument,
                 "model_name_or_path", "'~' is not expanded");
}

TEST(RunConfigTest, RequiredKeys) {
  ExpectKeyError(std::string("dataset = \"d\"\n") + kReward, StatusCode::kInvalidArgument, "model_name_or_path",
                 "is required");
  ExpectKeyError(std::string("model_name_or_path = \"m\"\n") + kReward, StatusCode::kInvalidArgument, "dataset",
                 "is required");
  ExpectKeyError(kTop, StatusCode::kInvalidArgument, "rewards", "at least one [[rewards]]");
}

// ---------------------------------------------------------------------------------------
// Unknown keys, types, values.

TEST(RunConfigTest, UnknownKeysAreErrorsNamingKeyAndFile) {
  const Status s = ParseError(Cfg("learnig_rate = 0.1"));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "/cfg/run.toml: key 'learnig_rate': unknown key (did you mean 'learning_rate'?)");
  ExpectKeyError(Cfg("colour = 1"), StatusCode::kInvalidArgument, "colour", "unknown key");
  // PEFT names belong in [lora].
  ExpectKeyError(Cfg("r = 16"), StatusCode::kInvalidArgument, "r", "go in the [lora] table");
  ExpectKeyError(Cfg("", "[lora]\nrank = 4\n"), StatusCode::kInvalidArgument, "lora.rank", "unknown key in [lora]");
  ExpectKeyError(Cfg("", "[[rewards]]\ntype = \"regex\"\npattern = \"x\"\nfield = \"a\"\n"),
                 StatusCode::kInvalidArgument, "rewards[1].field", "is not a key of type \"regex\"");
  // A GRPOConfig field ferryd does not implement is named as such.
  ExpectKeyError(Cfg("vllm_group_port = 51216"), StatusCode::kUnsupported, "vllm_group_port",
                 "ferryd does not implement");
  ExpectKeyError(Cfg("vllm_mode = \"colocate\""), StatusCode::kInvalidArgument, "vllm_mode", "must be \"server\"");
  ExpectKeyError(Cfg("use_cpu = true"), StatusCode::kUnsupported, "use_cpu", "device = \"cpu\"");
  ExpectKeyError(Cfg("run_name = \"a\""), StatusCode::kUnsupported, "run_name", "[store] run");
}

TEST(RunConfigTest, BadTypesNameTheKey) {
  ExpectKeyError(Cfg("learning_rate = \"fast\""), StatusCode::kInvalidArgument, "learning_rate",
                 "must be a number (got a string)");
  ExpectKeyError(Cfg("num_generations = 8.0"), StatusCode::kInvalidArgument, "num_generations",
                 "must be an integer (got 8)");
  ExpectKeyError(Cfg("bf16 = 1"), StatusCode::kInvalidArgument, "bf16", "must be true or false (got an integer)");
  ExpectKeyError(Cfg("loss_type = 3"), StatusCode::kInvalidArgument, "loss_type", "must be a string");
  ExpectKeyError(Cfg("reward_weights = [1.0, \"x\"]"), StatusCode::kInvalidArgument, "reward_weights[1]",
                 "must be a number");
  ExpectKeyError(Cfg("seed = 2024-01-01"), StatusCode::kInvalidArgument, "seed", "got a date");
  ExpectKeyError(Cfg("", "[lora]\nr = \"8\"\n"), StatusCode::kInvalidArgument, "lora.r", "must be an integer");
  ExpectKeyError(Cfg("", "[lora]\ntarget_modules = [\"q_proj\", 3]\n"), StatusCode::kInvalidArgument,
                 "lora.target_modules", "[1] must be a string");
  ExpectKeyError(std::string(kTop) + "rewards = 3\n", StatusCode::kInvalidArgument, "rewards",
                 "must be an array of tables");
  ExpectKeyError(Cfg("learning_rate = nan"), StatusCode::kInvalidArgument, "learning_rate", "got nan");
}

TEST(RunConfigTest, BadValuesNameTheKey) {
  ExpectKeyError(Cfg("learning_rate = -1e-5"), StatusCode::kInvalidArgument, "learning_rate", "must be [0, 1e+06]");
  ExpectKeyError(Cfg("temperature = 0"), StatusCode::kInvalidArgument, "temperature", "must be (0, 10000]");
  ExpectKeyError(Cfg("top_p = 0.0"), StatusCode::kInvalidArgument, "top_p", "(0, 1]");
  ExpectKeyError(Cfg("top_p = 1.5"), StatusCode::kInvalidArgument, "top_p", "(0, 1]");
  ExpectKeyError(Cfg("top_k = -1"), StatusCode::kInvalidArgument, "top_k", "got -1");
  ExpectKeyError(Cfg("epsilon = 1.5"), StatusCode::kInvalidArgument, "epsilon", "[0, 1]");
  ExpectKeyError(Cfg("epsilon_high = -0.1"), StatusCode::kInvalidArgument, "epsilon_high");
  ExpectKeyError(Cfg("delta = 1.0"), StatusCode::kInvalidArgument, "delta", "must be (1, 1e+06] (got 1)");
  ExpectKeyError(Cfg("beta = -0.01"), StatusCode::kInvalidArgument, "beta");
  ExpectKeyError(Cfg("adam_beta2 = 1.0"), StatusCode::kInvalidArgument, "adam_beta2", "[0, 1)");
  ExpectKeyError(Cfg("max_steps = 0"), StatusCode::kInvalidArgument, "max_steps", "got 0");
  ExpectKeyError(Cfg("num_iterations = 0"), StatusCode::kInvalidArgument, "num_iterations");
  ExpectKeyError(Cfg("per_device_train_batch_size = 0"), StatusCode::kInvalidArgument, "per_device_train_batch_size");
  ExpectKeyError(Cfg("per_device_train_batch_size = 2000000"), StatusCode::kInvalidArgument,
                 "per_device_train_batch_size", "got 2000000");
  ExpectKeyError(Cfg("logging_steps = 2.5"), StatusCode::kInvalidArgument, "logging_steps", "whole number");
  EXPECT_EQ(MustParse(Cfg("logging_steps = 0.1")).logging_steps, 0.1);  // a ratio, as TrainingArguments
  ExpectKeyError(Cfg("warmup_steps = 1.5"), StatusCode::kInvalidArgument, "warmup_steps", "whole number");
  ExpectKeyError(Cfg("save_total_limit = 0"), StatusCode::kInvalidArgument, "save_total_limit");
  ExpectKeyError(Cfg("threads = 5000"), StatusCode::kInvalidArgument, "threads");
  ExpectKeyError(Cfg("device = \"gpu\""), StatusCode::kInvalidArgument, "device", "\"cpu\", \"cuda\" or \"cuda:N\"");
  ExpectKeyError(Cfg("chat_template = \"jinja\""), StatusCode::kInvalidArgument, "chat_template");
  ExpectKeyError(Cfg("importance_sampling_level = \"sentence\""), StatusCode::kInvalidArgument,
                 "importance_sampling_level");
  ExpectKeyError(Cfg("vllm_importance_sampling_mode = \"token\""), StatusCode::kInvalidArgument,
                 "vllm_importance_sampling_mode");
  ExpectKeyError(Cfg("lr_scheduler_type = \"cosine_hard\""), StatusCode::kInvalidArgument, "lr_scheduler_type");
  ExpectKeyError(Cfg("lr_scheduler_type = \"polynomial\""), StatusCode::kUnsupported, "lr_scheduler_type",
                 "ferryd does not implement");
}

TEST(RunConfigTest, GenerationDtypeAsVllmNamesIt) {
  EXPECT_EQ(MustParse(Cfg("generation_dtype = \"auto\"")).generation_dtype, GenerationDtype::kAuto);
  EXPECT_EQ(MustParse(Cfg("generation_dtype = \"float32\"")).generation_dtype, GenerationDtype::kFloat32);
  EXPECT_EQ(MustParse(Cfg("generation_dtype = \"bfloat16\"")).generation_dtype, GenerationDtype::kBFloat16);
  ExpectKeyError(Cfg("generation_dtype = \"float16\""), StatusCode::kUnsupported, "generation_dtype", "does not run");
  ExpectKeyError(Cfg("generation_dtype = \"fp32\""), StatusCode::kInvalidArgument, "generation_dtype",
                 "\"auto\", \"float32\" or \"bfloat16\" (got \"fp32\")");
  ExpectKeyError(Cfg("generation_dtype = 16"), StatusCode::kInvalidArgument, "generation_dtype");
  EXPECT_EQ(Json::parse(MustParse(Cfg("generation_dtype = \"bfloat16\"")).ToJson()).at("generation_dtype"), "bfloat16");
}

TEST(RunConfigTest, DeviceNames) {
  EXPECT_EQ(MustParse(Cfg("device = \"cuda\"")).device.Name(), "cuda");
  EXPECT_EQ(MustParse(Cfg("device = \"cuda:01\"")).device.Name(), "cuda:1");
  ExpectKeyError(Cfg("device = \"cuda:\""), StatusCode::kInvalidArgument, "device");
  ExpectKeyError(Cfg("device = \"cuda:1x\""), StatusCode::kInvalidArgument, "device");
}

TEST(RunConfigTest, LossTypesAsTrlNamesThemAndFerryImplements) {
  for (const char* t : {"grpo", "bnpo", "dr_grpo", "dapo"}) {
    EXPECT_EQ(NameOf(MustParse(Cfg(std::string("loss_type = \"") + t + "\"")).loss_type), t);
  }
  for (const char* t : {"cispo", "sapo", "luspo", "vespo"}) {
    ExpectKeyError(Cfg(std::string("loss_type = \"") + t + "\""), StatusCode::kUnsupported, "loss_type",
                   "a TRL loss ferryd does not implement");
  }
  ExpectKeyError(Cfg("loss_type = \"ppo\""), StatusCode::kInvalidArgument, "loss_type",
                 "must be \"grpo\", \"bnpo\", \"dr_grpo\" or \"dapo\" (got \"ppo\")");
}

TEST(RunConfigTest, ScaleRewardsTakesTrlsBooleanAliases) {
  EXPECT_EQ(NameOf(MustParse(Cfg("scale_rewards = true")).scale_rewards), "group");
  EXPECT_EQ(NameOf(MustParse(Cfg("scale_rewards = false")).scale_rewards), "none");
  EXPECT_EQ(NameOf(MustParse(Cfg("scale_rewards = \"batch\"")).scale_rewards), "batch");
  ExpectKeyError(Cfg("scale_rewards = \"std\""), StatusCode::kInvalidArgument, "scale_rewards");
  // Equivalent spellings resolve to the same config.
  EXPECT_EQ(MustParse(Cfg("scale_rewards = true")).Fingerprint(), MustParse(Cfg()).Fingerprint());
}

// ---------------------------------------------------------------------------------------
// TRL's batch rules (GRPOConfig.__post_init__).

TEST(RunConfigTest, BatchSizesResolveAsTrl) {
  RunConfig c = MustParse(Cfg("per_device_train_batch_size = 4\ngradient_accumulation_steps = 2\nnum_generations = 4"));
  EXPECT_EQ(c.steps_per_generation, 2);
  EXPECT_EQ(c.generation_batch_size, 8);
  EXPECT_EQ(c.prompts_per_generation(), 2);
  c = MustParse(Cfg("per_device_train_batch_size = 4\ngeneration_batch_size = 16\nnum_generations = 8"));
  EXPECT_EQ(c.steps_per_generation, 4);
  EXPECT_EQ(c.generation_batch_size, 16);
  c = MustParse(Cfg("per_device_train_batch_size = 4\nsteps_per_generation = 3\nnum_generations = 6"));
  EXPECT_EQ(c.generation_batch_size, 12);
  EXPECT_EQ(c.prompts_per_generation(), 2);
}

TEST(RunConfigTest, BatchRulesAreTrls) {
  ExpectKeyError(Cfg("num_generations = 1"), StatusCode::kInvalidArgument, "num_generations", "at least 2");
  ExpectKeyError(Cfg("generation_batch_size = 16\nsteps_per_generation = 2"), StatusCode::kInvalidArgument,
                 "generation_batch_size", "cannot both be set");
  ExpectKeyError(Cfg("generation_batch_size = 12"), StatusCode::kInvalidArgument, "generation_batch_size",
                 "must be divisible by per_device_train_batch_size (8)");
  ExpectKeyError(Cfg("num_generations = 3"), StatusCode::kInvalidArgument, "num_generations",
                 "generation_batch_size (8 = per_device_train_batch_size * steps_per_generation) must be divisible "
                 "by num_generations (3)");
  ExpectKeyError(Cfg("generation_batch_size = 24\nnum_generations = 16"), StatusCode::kInvalidArgument,
                 "generation_batch_size", "must be divisible by num_generations (16)");
}

TEST(RunConfigTest, EpsilonHighDefaultsToEpsilon) {
  EXPECT_EQ(MustParse(Cfg("epsilon = 0.1")).epsilon_high, 0.1);
  const RunConfig c = MustParse(Cfg("epsilon = 0.1\nepsilon_high = 0.28"));
  EXPECT_EQ(c.epsilon, 0.1);
  EXPECT_EQ(c.epsilon_high, 0.28);
}

TEST(RunConfigTest, ImportanceSamplingBounds) {
  EXPECT_FALSE(MustParse(Cfg("vllm_importance_sampling_clip_max = inf")).vllm_importance_sampling_clip_max);
  ExpectKeyError(Cfg("vllm_importance_sampling_clip_min = 3.0"), StatusCode::kInvalidArgument,
                 "vllm_importance_sampling_clip_min", "must be less than vllm_importance_sampling_clip_max (3)");
  ExpectKeyError(Cfg("vllm_importance_sampling_clip_max = inf\nvllm_importance_sampling_mode = \"token_truncate\""),
                 StatusCode::kInvalidArgument, "vllm_importance_sampling_mode",
                 "needs vllm_importance_sampling_clip_min");
  // Masking without bounds is allowed, as in TRL; and with the correction off nothing is checked.
  MustParse(Cfg("vllm_importance_sampling_clip_max = inf\nvllm_importance_sampling_mode = \"token_mask\""));
  MustParse(
      Cfg("vllm_importance_sampling_clip_max = inf\nvllm_importance_sampling_mode = \"sequence_truncate\"\n"
          "vllm_importance_sampling_correction = false"));
  // The deprecated cap is read as clip_max, with a warning; both set is an error.
  const RunConfig c = MustParse(Cfg("vllm_importance_sampling_cap = 2.5"));
  EXPECT_EQ(c.vllm_importance_sampling_clip_max, std::optional<double>(2.5));
  ASSERT_FALSE(c.warnings.empty());
  EXPECT_NE(c.warnings[0].find("key 'vllm_importance_sampling_cap': is deprecated"), std::string::npos)
      << c.warnings[0];
  ExpectKeyError(Cfg("vllm_importance_sampling_cap = 2.5\nvllm_importance_sampling_clip_max = 2.0"),
                 StatusCode::kInvalidArgument, "vllm_importance_sampling_cap", "deprecated name");
}

TEST(RunConfigTest, WarmupEncodings) {
  ExpectKeyError(Cfg("warmup_ratio = 0.1\nwarmup_steps = 5"), StatusCode::kInvalidArgument, "warmup_ratio", "both set");
  EXPECT_EQ(WarmupSteps(MustParse(Cfg("warmup_steps = 5")), 100), 5);
  EXPECT_EQ(WarmupSteps(MustParse(Cfg("warmup_steps = 0.1")), 95), 10);  // ceil(9.5)
  EXPECT_EQ(WarmupSteps(MustParse(Cfg("warmup_ratio = 0.25")), 10), 3);  // ceil(2.5)
  EXPECT_EQ(WarmupSteps(MustParse(Cfg()), 10), 0);
}

// Optimizer steps of whole runs, against TRL's own count (fixtures/run/total_steps.json).
TEST(RunConfigTest, TotalStepsEqualTrls) {
  const Json fx = Fixture("total_steps.json");
  ASSERT_GE(fx["cases"].size(), 6u);
  for (const Json& k : fx["cases"]) {
    std::string top = "per_device_train_batch_size = " + std::to_string(k["per_device_train_batch_size"].get<int>()) +
                      "\ngradient_accumulation_steps = " + std::to_string(k["gradient_accumulation_steps"].get<int>()) +
                      "\nnum_generations = " + std::to_string(k["num_generations"].get<int>()) +
                      "\nnum_iterations = " + std::to_string(k["num_iterations"].get<int>()) +
                      "\nnum_train_epochs = " + std::to_string(k["num_train_epochs"].get<double>()) +
                      "\nmax_steps = " + std::to_string(k["max_steps"].get<int>()) + "\n";
    if (!k["steps_per_generation"].is_null()) {
      top += "steps_per_generation = " + std::to_string(k["steps_per_generation"].get<int>()) + "\n";
    }
    if (!k["generation_batch_size"].is_null()) {
      top += "generation_batch_size = " + std::to_string(k["generation_batch_size"].get<int>()) + "\n";
    }
    SCOPED_TRACE(k.dump());
    const RunConfig c = MustParse(Cfg(top));
    auto steps = TotalSteps(c, k["dataset_size"].get<uint64_t>());
    ASSERT_TRUE(steps.ok()) << steps.status().ToString();
    EXPECT_EQ(*steps, k["total_steps"].get<int64_t>());
  }
}

TEST(RunConfigTest, TotalStepsNeedMaxStepsBelowOneGeneration) {
  const RunConfig c = MustParse(Cfg("per_device_train_batch_size = 8\nnum_generations = 2"));  // 4 prompts
  ExpectError(TotalSteps(c, 3).status(), StatusCode::kInvalidArgument,
              "/cfg/run.toml: key 'max_steps': ", "3 prompts, fewer than one generation (4");
  EXPECT_EQ(*TotalSteps(c, 4), 3);  // 1 generation per epoch, 3 epochs
}

// ---------------------------------------------------------------------------------------
// TRL keys accepted at their neutral values only.

TEST(RunConfigTest, NeutralTrlKeys) {
  MustParse(Cfg("use_vllm = false\nrepetition_penalty = 1.0\nmin_p = 0.0\nfp16 = false\ntop_entropy_quantile = 1"));
  // use_vllm was one of these until ferryd could generate with a vLLM server.
  auto vllm = MustParse(Cfg("use_vllm = true\nvllm_server_port = 8123\nmax_staleness = 1"));
  EXPECT_TRUE(vllm.use_vllm);
  EXPECT_EQ(vllm.VllmServerUrl(), "http://0.0.0.0:8123");
  EXPECT_NE(vllm.ToJson().find("\"max_staleness\": 1"), std::string::npos);
  EXPECT_NE(vllm.Fingerprint(), MustParse(Cfg("use_vllm = true\nvllm_server_port = 8123")).Fingerprint());
  // The server's address is operational: a run resumes against a server moved elsewhere.
  EXPECT_EQ(MustParse(Cfg("use_vllm = true\nvllm_server_base_url = \"http://10.0.0.2:9000\"")).Fingerprint(),
            MustParse(Cfg("use_vllm = true")).Fingerprint());
  ExpectKeyError(Cfg("vllm_server_base_url = \"10.0.0.2:9000\""), StatusCode::kInvalidArgument, "vllm_server_base_url",
                 "must start with http://");
  // The server's dtype sets the probe's tolerance only: operational, not in the fingerprint.
  EXPECT_EQ(MustParse(Cfg("use_vllm = true\nvllm_server_dtype = \"bfloat16\"")).vllm_server_dtype, "bfloat16");
  EXPECT_EQ(MustParse(Cfg("use_vllm = true\nvllm_server_dtype = \"bfloat16\"")).Fingerprint(),
            MustParse(Cfg("use_vllm = true")).Fingerprint());
  ExpectKeyError(Cfg("vllm_server_dtype = \"int8\""), StatusCode::kInvalidArgument, "vllm_server_dtype");
  ExpectKeyError(Cfg("repetition_penalty = 1.1"), StatusCode::kUnsupported, "repetition_penalty",
                 "only 1 is accepted (got 1.1)");
  ExpectKeyError(Cfg("min_p = 0.05"), StatusCode::kUnsupported, "min_p", "only 0 is accepted");
  ExpectKeyError(Cfg("off_policy_mask_threshold = 0.5"), StatusCode::kUnsupported, "off_policy_mask_threshold",
                 "cannot be set");
  ExpectKeyError(Cfg("multi_objective_aggregation = \"normalize_then_sum\""), StatusCode::kUnsupported,
                 "multi_objective_aggregation");
  ExpectKeyError(Cfg("fp16 = true"), StatusCode::kUnsupported, "fp16");
}

// ---------------------------------------------------------------------------------------
// Warnings.

TEST(RunConfigTest, WarnsAboutBf16OnCpu) {
  RunConfig c = MustParse(Cfg());
  ASSERT_EQ(c.warnings.size(), 1u);
  EXPECT_EQ(c.warnings[0].rfind("/cfg/run.toml: key 'bf16': is true (TRL's default) on device \"cpu\"", 0), 0u)
      << c.warnings[0];
  EXPECT_TRUE(MustParse(Cfg("bf16 = false")).warnings.empty());
  EXPECT_TRUE(MustParse(Cfg("device = \"cuda\"")).warnings.empty());
}

TEST(RunConfigTest, WarnsAsTrlDoes) {
  RunConfig c = MustParse(Cfg("bf16 = false\nimportance_sampling_level = \"sequence\""));
  ASSERT_EQ(c.warnings.size(), 1u);
  EXPECT_NE(c.warnings[0].find("key 'importance_sampling_level'"), std::string::npos) << c.warnings[0];
  EXPECT_TRUE(
      MustParse(Cfg("bf16 = false\nimportance_sampling_level = \"sequence\"\nloss_type = \"grpo\"")).warnings.empty());
  c = MustParse(Cfg("bf16 = false\ndelta = 1.1"));
  ASSERT_EQ(c.warnings.size(), 1u);
  EXPECT_NE(c.warnings[0].find("key 'delta': 1.1 is not above 1 + epsilon_high (1.2)"), std::string::npos)
      << c.warnings[0];
  c = MustParse(Cfg("bf16 = false\nuse_bias_correction_kl = false"));
  ASSERT_EQ(c.warnings.size(), 1u);
  EXPECT_NE(c.warnings[0].find("key 'use_bias_correction_kl': has no effect with beta = 0"), std::string::npos);
  EXPECT_TRUE(MustParse(Cfg("bf16 = false\nuse_bias_correction_kl = false\nbeta = 0.04")).warnings.empty());
}

// ---------------------------------------------------------------------------------------
// TOML syntax.

TEST(RunConfigTest, SyntaxErrorsNameLineAndColumn) {
  const Status s = ParseError("model_name_or_path = \"m\"\ndataset = \n");
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_EQ(s.message().rfind("/cfg/run.toml:2:", 0), 0u) << s.message();
  EXPECT_NE(s.message().find("TOML syntax error"), std::string::npos);
  EXPECT_EQ(ParseError(Cfg("seed = 1\nseed = 2")).code(), StatusCode::kCorruption);  // a repeated key
  EXPECT_EQ(ParseError(std::string("\xff = 1\n")).code(), StatusCode::kCorruption);  // not UTF-8
}

// ---------------------------------------------------------------------------------------
// Rewards.

TEST(RunConfigTest, RewardTablesAndWeights) {
  const RunConfig c =
      MustParse(std::string(kTop) +
                "[[rewards]]\nname = \"digits\"\ntype = \"digit_match\"\nfield = \"answer\"\nweight = 2.0\n"
                "[[rewards]]\ntype = \"answer_match\"\nfield = \"answer\"\npattern = \"#### (\\\\S+)\"\n"
                "[[rewards]]\ntype = \"regex\"\npattern = \"^\\\\d+$\"\nmatch = \"search\"\n");
  ASSERT_EQ(c.rewards.size(), 3u);
  EXPECT_EQ(c.rewards[0].name, "digits");
  EXPECT_EQ(c.rewards[0].type, RewardType::kDigitMatch);
  EXPECT_EQ(c.rewards[0].weight, 2.0);
  EXPECT_EQ(c.rewards[0].pattern, std::optional<std::string>(std::string(kDefaultAnswerPattern)));
  EXPECT_EQ(c.rewards[0].group, 0);  // the default pattern has no groups
  EXPECT_EQ(c.rewards[0].align, "left");
  EXPECT_EQ(c.rewards[1].name, "answer_match");
  EXPECT_EQ(c.rewards[1].pattern, std::optional<std::string>("#### (\\S+)"));
  EXPECT_EQ(c.rewards[1].group, 1);
  EXPECT_EQ(c.rewards[1].normalize, "auto");
  EXPECT_EQ(c.rewards[2].match, "search");
  const Json j = Json::parse(c.ToJson());
  EXPECT_EQ(j["reward_weights"], Json::array({2.0, 1.0, 1.0}));
}

TEST(RunConfigTest, RewardWeightsListMustMatchTheRewards) {
  const std::string two = std::string(kReward) + "[[rewards]]\nname = \"l2\"\ntype = \"length\"\ntarget = 4\n";
  RunConfig c = MustParse(std::string(kTop) + "reward_weights = [0.5, 2]\n" + two);
  EXPECT_EQ(c.rewards[0].weight, 0.5);
  EXPECT_EQ(c.rewards[1].weight, 2.0);
  ExpectKeyError(std::string(kTop) + "reward_weights = [1.0]\n" + two, StatusCode::kInvalidArgument, "reward_weights",
                 "has 1 weights for 2 rewards");
  ExpectKeyError(std::string(kTop) + "reward_weights = [1.0, 2.0]\n" + two + "weight = 3.0\n",
                 StatusCode::kInvalidArgument, "reward_weights", "[1] = 2 disagrees with rewards[1].weight = 3");
  c = MustParse(std::string(kTop) + "reward_weights = [1.0, 3.0]\n" + two + "weight = 3.0\n");  // agreeing
  EXPECT_EQ(c.rewards[1].weight, 3.0);
}

TEST(RunConfigTest, BadRewardTables) {
  const std::string top = kTop;
  ExpectKeyError(top + "[[rewards]]\nfield = \"a\"\n", StatusCode::kInvalidArgument, "rewards[0].type", "is required");
  ExpectKeyError(top + "[[rewards]]\ntype = \"exact\"\n", StatusCode::kInvalidArgument, "rewards[0].type",
                 "(got \"exact\")");
  ExpectKeyError(top + "[[rewards]]\ntype = \"answer_match\"\n", StatusCode::kInvalidArgument, "rewards[0].field",
                 "is required for type \"answer_match\"");
  ExpectKeyError(top + "[[rewards]]\ntype = \"regex\"\n", StatusCode::kInvalidArgument, "rewards[0].pattern",
                 "is required");
  ExpectKeyError(top + "[[rewards]]\ntype = \"length\"\n", StatusCode::kInvalidArgument, "rewards[0].target",
                 "is required");
  ExpectKeyError(top + "[[rewards]]\ntype = \"length\"\ntarget = 0\n", StatusCode::kInvalidArgument,
                 "rewards[0].target");
  ExpectKeyError(top + "[[rewards]]\ntype = \"command\"\ncommand = \"python3 r.py\"\n", StatusCode::kInvalidArgument,
                 "rewards[0].command", "no shell");
  ExpectKeyError(top + "[[rewards]]\ntype = \"command\"\ncommand = []\n", StatusCode::kInvalidArgument,
                 "rewards[0].command", "must name a program");
  ExpectKeyError(top + "[[rewards]]\ntype = \"command\"\ncommand = [\"x\"]\ntimeout_seconds = 0\n",
                 StatusCode::kInvalidArgument, "rewards[0].timeout_seconds");
  ExpectKeyError(top + "[[rewards]]\ntype = \"regex\"\npattern = \"(?=x)\"\n", StatusCode::kInvalidArgument,
                 "rewards[0].pattern", "RE2 has no lookaround");
  ExpectKeyError(top + "[[rewards]]\ntype = \"regex\"\npattern = \"(\"\n", StatusCode::kInvalidArgument,
                 "rewards[0].pattern", "not a valid RE2 regular expression");
  ExpectKeyError(top + "[[rewards]]\ntype = \"answer_match\"\nfield = \"a\"\ngroup = 1\n", StatusCode::kInvalidArgument,
                 "rewards[0].group", "set pattern to use a group");
  ExpectKeyError(top + "[[rewards]]\ntype = \"answer_match\"\nfield = \"a\"\npattern = \"(a)(b)\"\ngroup = 3\n",
                 StatusCode::kInvalidArgument, "rewards[0].group", "3 but the pattern has 2 capture group(s)");
  ExpectKeyError(top + "[[rewards]]\nname = \"a b\"\ntype = \"length\"\ntarget = 1\n", StatusCode::kInvalidArgument,
                 "rewards[0].name");
  ExpectKeyError(top + kReward + kReward, StatusCode::kInvalidArgument, "rewards[1].name",
                 "\"length\" is also the name of rewards[0]");
  ExpectKeyError(top + "[[rewards]]\ntype = \"digit_match\"\nfield = \"a\"\nalign = \"center\"\n",
                 StatusCode::kInvalidArgument, "rewards[0].align");
  ExpectKeyError(top + "[rewards]\ntype = \"length\"\n", StatusCode::kInvalidArgument, "rewards",
                 "must be an array of tables");
}

// ---------------------------------------------------------------------------------------
// LoRA.

TEST(RunConfigTest, LoraTableBecomesAPeftConfig) {
  const RunConfig c = MustParse(Cfg("",
                                    "[lora]\nr = 16\nlora_alpha = 32\nlora_dropout = 0.05\nuse_rslora = true\n"
                                    "target_modules = [\"q_proj\", \"k_proj\", \"v_proj\", \"o_proj\"]\n"
                                    "rank_pattern = { \"v_proj\" = 4, \"model.layers.0.self_attn.q_proj\" = 2, "
                                    "\"q_proj\" = 8 }\n"
                                    "alpha_pattern = { \"q_proj\" = 12.5 }\n"
                                    "layers_to_transform = [0, 1]\n"));
  EXPECT_EQ(c.lora.r, 16);
  ASSERT_EQ(c.lora.rank_pattern.size(), 3u);
  // File order, not toml++'s sorted order: the first matching key wins in PEFT.
  EXPECT_EQ(c.lora.rank_pattern[0].key, "v_proj");
  EXPECT_EQ(c.lora.rank_pattern[1].key, "model.layers.0.self_attn.q_proj");
  EXPECT_EQ(c.lora.rank_pattern[2].key, "q_proj");
  auto peft = LoraPeftConfig(c);
  ASSERT_TRUE(peft.ok()) << peft.status().ToString();
  EXPECT_EQ(peft->peft_type, "LORA");
  EXPECT_EQ(peft->task_type, "CAUSAL_LM");
  EXPECT_EQ(peft->base_model_name_or_path, "/cfg/model");
  EXPECT_EQ(peft->r, 16);
  EXPECT_EQ(peft->lora_alpha, 32);
  EXPECT_TRUE(peft->use_rslora);
  EXPECT_EQ(peft->RankFor("model.layers.0.self_attn.q_proj"), 2);
  EXPECT_EQ(peft->RankFor("model.layers.1.self_attn.q_proj"), 8);
  EXPECT_EQ(peft->RankFor("model.layers.1.self_attn.k_proj"), 16);
  EXPECT_DOUBLE_EQ(peft->ScalingFor("model.layers.1.self_attn.q_proj"), 12.5 / std::sqrt(8.0));
  EXPECT_TRUE(peft->IsTargeted("model.layers.1.self_attn.o_proj"));
  EXPECT_FALSE(peft->IsTargeted("model.layers.2.self_attn.o_proj"));  // layers_to_transform
  EXPECT_FALSE(peft->IsTargeted("model.layers.0.mlp.up_proj"));
  EXPECT_TRUE(peft->CheckMergeable().ok());
  EXPECT_NE(peft->raw_json.find("\"lora_dropout\": 0.05"), std::string::npos) << peft->raw_json;

  auto regex = LoraPeftConfig(MustParse(Cfg("", "[lora]\ntarget_modules = \".*\\\\.(q|v)_proj\"\n")));
  ASSERT_TRUE(regex.ok()) << regex.status().ToString();
  EXPECT_EQ(regex->target_modules.form, ModuleSelector::Form::kRegex);
  EXPECT_TRUE(regex->IsTargeted("model.layers.3.self_attn.v_proj"));
  auto all = LoraPeftConfig(MustParse(Cfg("", "[lora]\ntarget_modules = \"all-linear\"\nlayers_to_transform = 1\n")));
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  EXPECT_EQ(all->target_modules.form, ModuleSelector::Form::kAllLinear);
  EXPECT_TRUE(all->IsTargeted("model.layers.1.mlp.down_proj"));
  EXPECT_FALSE(all->IsTargeted("model.layers.0.mlp.down_proj"));
}

TEST(RunConfigTest, LoraRulesArePefts) {
  ExpectKeyError(Cfg("", "[lora]\nr = 0\n"), StatusCode::kInvalidArgument, "lora.r");
  ExpectKeyError(Cfg("", "[lora]\nlora_alpha = 0\n"), StatusCode::kInvalidArgument, "lora.lora_alpha");
  ExpectKeyError(Cfg("", "[lora]\nlora_dropout = 1.0\n"), StatusCode::kInvalidArgument, "lora.lora_dropout", "[0, 1)");
  ExpectKeyError(Cfg("", "[lora]\ntarget_modules = []\n"), StatusCode::kInvalidArgument, "lora.target_modules",
                 "empty list");
  ExpectKeyError(Cfg("", "[lora]\ntarget_modules = \"(?!x)\"\n"), StatusCode::kInvalidArgument, "lora.target_modules",
                 "RE2");
  ExpectKeyError(Cfg("", "[lora]\ntarget_modules = \".*q_proj\"\nlayers_to_transform = [0]\n"),
                 StatusCode::kInvalidArgument, "lora.layers_to_transform", "target_modules is a regex");
  ExpectKeyError(Cfg("", "[lora]\nlayers_pattern = \"layers\"\n"), StatusCode::kInvalidArgument, "lora.layers_pattern",
                 "needs layers_to_transform");
  ExpectKeyError(Cfg("", "[lora]\nbias = \"all\"\n"), StatusCode::kUnsupported, "lora.bias", "LoRA factors only");
  ExpectKeyError(Cfg("", "[lora]\nuse_dora = true\n"), StatusCode::kUnsupported, "lora.use_dora");
  ExpectKeyError(Cfg("", "[lora]\nmodules_to_save = [\"lm_head\"]\n"), StatusCode::kUnsupported,
                 "lora.modules_to_save");
  // An unquoted dotted key makes a nested table in TOML.
  ExpectKeyError(Cfg("", "[lora]\nrank_pattern = { model.q_proj = 4 }\n"), StatusCode::kInvalidArgument,
                 "lora.rank_pattern.model", "quote pattern keys");
  ExpectKeyError(Cfg("", "[lora]\nrank_pattern = { \"q_proj\" = 0 }\n"), StatusCode::kInvalidArgument,
                 "lora.rank_pattern.q_proj");
}

// ---------------------------------------------------------------------------------------
// ToJson and Fingerprint.

TEST(RunConfigTest, ToJsonHasEveryKey) {
  const Json j = Json::parse(MustParse(Cfg()).ToJson());
  for (const char* key : {"model_name_or_path",
                          "dataset",
                          "output_dir",
                          "threads",
                          "device",
                          "chat_template",
                          "generation_dtype",
                          "store",
                          "learning_rate",
                          "lr_scheduler_type",
                          "warmup_ratio",
                          "warmup_steps",
                          "weight_decay",
                          "adam_beta1",
                          "adam_beta2",
                          "adam_epsilon",
                          "max_grad_norm",
                          "num_train_epochs",
                          "max_steps",
                          "logging_steps",
                          "save_steps",
                          "save_total_limit",
                          "seed",
                          "shuffle_dataset",
                          "per_device_train_batch_size",
                          "gradient_accumulation_steps",
                          "bf16",
                          "gradient_checkpointing",
                          "num_generations",
                          "max_prompt_length",
                          "max_completion_length",
                          "generation_batch_size",
                          "steps_per_generation",
                          "temperature",
                          "top_p",
                          "top_k",
                          "beta",
                          "num_iterations",
                          "epsilon",
                          "epsilon_high",
                          "delta",
                          "importance_sampling_level",
                          "scale_rewards",
                          "loss_type",
                          "mask_truncated_completions",
                          "vllm_importance_sampling_correction",
                          "vllm_importance_sampling_mode",
                          "vllm_importance_sampling_clip_max",
                          "vllm_importance_sampling_clip_min",
                          "use_bias_correction_kl",
                          "reward_weights",
                          "min_p",
                          "repetition_penalty",
                          "use_vllm",
                          "lora",
                          "rewards"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j["model_name_or_path"], "/cfg/model");
  EXPECT_TRUE(j["max_prompt_length"].is_null());
  EXPECT_TRUE(j["save_total_limit"].is_null());
  EXPECT_EQ(j["rewards"][0], Json::parse(R"({"name": "length", "type": "length", "weight": 1.0, "target": 8})"));
}

TEST(RunConfigTest, FingerprintIsStableAndSeesEveryChange) {
  const std::string fp = MustParse(Cfg()).Fingerprint();
  ASSERT_EQ(fp.size(), 32u);
  EXPECT_EQ(fp.find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_EQ(MustParse(Cfg()).Fingerprint(), fp);
  // Defaults written out, in another order, give the same resolved config.
  EXPECT_EQ(
      MustParse(Cfg("seed = 42\nlearning_rate = 1e-6\nepsilon_high = 0.2\nsteps_per_generation = 1")).Fingerprint(),
      fp);
  for (const char* change : {"seed = 43", "learning_rate = 2e-6", "top_k = 5", "output_dir = \"x\"",
                             "max_prompt_length = 64", "bf16 = false", "generation_dtype = \"bfloat16\""}) {
    EXPECT_NE(MustParse(Cfg(change)).Fingerprint(), fp) << change;
  }
  EXPECT_NE(MustParse(Cfg("", "[lora]\nr = 4\n")).Fingerprint(), fp);
  // generation_dtype's default written out (the fingerprint leaves it out: runs made before the key still resume).
  EXPECT_EQ(MustParse(Cfg("generation_dtype = \"auto\"")).Fingerprint(), fp);
  auto moved = ParseRunConfig(Cfg(), "/elsewhere/run.toml");
  ASSERT_TRUE(moved.ok());
  EXPECT_NE(moved->Fingerprint(), fp);  // paths are part of the resolved config
}

// ---------------------------------------------------------------------------------------
// Loading from disk.

TEST(RunConfigTest, LoadChecksTheFiles) {
  TempDir dir;
  ExpectError(LoadRunConfig(dir / "none.toml").status(), StatusCode::kNotFound, (dir / "none.toml").string());
  WriteFile(dir / "run.toml", Cfg());
  const std::string src = (dir / "run.toml").string();
  ExpectError(LoadRunConfig(dir / "run.toml").status(), StatusCode::kNotFound,
              src + ": key 'model_name_or_path': " + (dir / "model").string() + " is not a directory");
  std::filesystem::create_directories(dir / "model");
  ExpectError(LoadRunConfig(dir / "run.toml").status(), StatusCode::kNotFound,
              src + ": key 'dataset': " + (dir / "train.jsonl").string() + " is not a regular file");
  WriteFile(dir / "train.jsonl", "{\"prompt\": \"1+1=\"}\n");
  auto c = LoadRunConfig(dir / "run.toml");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->dataset, dir / "train.jsonl");
  EXPECT_EQ(c->source, dir / "run.toml");
  WriteFile(dir / "big.toml", std::string(kMaxConfigFileBytes + 1, '#'));
  ExpectError(LoadRunConfig(dir / "big.toml").status(), StatusCode::kInvalidArgument, (dir / "big.toml").string());
}

// ---------------------------------------------------------------------------------------
// The key table (config_keys.cpp): earlier runs' fingerprints, the docs.

std::string ReadAll(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  EXPECT_TRUE(in.good()) << p;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// fixtures/run_config/: configs and what the reader made of them before it became one table
// (README there). A checkpoint holds its run's fingerprint: a different one would stop every
// earlier run from resuming.
TEST(RunConfigTest, ResolvedJsonAndFingerprintAreThoseOfEarlierRuns) {
  const std::filesystem::path dir = std::filesystem::path(FERRY_FIXTURES_DIR) / "run_config";
  std::istringstream golden(ReadAll(dir / "fingerprints.txt"));
  int checked = 0;
  for (std::string file, fingerprint; golden >> file >> fingerprint; ++checked) {
    SCOPED_TRACE(file);
    auto c = ParseRunConfig(ReadAll(dir / file), "/golden/run.toml");
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->Fingerprint(), fingerprint);
    const std::string stem = file.substr(0, file.size() - std::string(".toml").size());
    EXPECT_EQ(c->ToJson(), ReadAll(dir / (stem + ".resolved.json")));
  }
  EXPECT_EQ(checked, 3);
}

// The `code` names of each cell of a Markdown table row ("| `a`, `b` | all | ... |").
std::vector<std::vector<std::string>> CellNames(const std::string& row) {
  static const std::regex kCode("`([^`]+)`");
  std::vector<std::vector<std::string>> cells;
  std::istringstream in(row.substr(1));
  for (std::string cell; std::getline(in, cell, '|');) {
    cells.emplace_back();
    for (std::sregex_iterator it(cell.begin(), cell.end(), kCode), e; it != e; ++it) cells.back().push_back((*it)[1]);
  }
  return cells;
}

// The rows of the table after the line of `doc` that starts with `intro` (its header row and
// |---| line left out), as CellNames.
std::vector<std::vector<std::vector<std::string>>> DocTable(const std::string& doc, const std::string& intro) {
  const size_t at = doc.find("\n" + intro);
  EXPECT_NE(at, std::string::npos) << intro;
  std::istringstream lines(doc.substr(at == std::string::npos ? doc.size() : at + 1));
  std::vector<std::vector<std::vector<std::string>>> rows;
  std::string line;
  std::getline(lines, line);                                      // the intro
  while (std::getline(lines, line) && line.rfind('|', 0) != 0) {  // up to the header row
  }
  std::getline(lines, line);  // |---|
  while (std::getline(lines, line) && line.rfind("| ", 0) == 0) rows.push_back(CellNames(line));
  return rows;
}

void ExpectSameKeys(const std::set<std::string>& table, const std::set<std::string>& documented) {
  for (const std::string& k : table) EXPECT_TRUE(documented.count(k)) << k << " is not documented in docs/daemon.md";
  for (const std::string& k : documented) EXPECT_TRUE(table.count(k)) << k << " is documented but not a key";
}

// Every key of the tables (top level with [store], [publish] and [control]; [lora]; each
// reward type) is in docs/daemon.md's key tables ("### Keys", "`[lora]`", "`[[rewards]]`
// keys"), and every key there is in its table: a key added is one row plus its line in the docs.
TEST(RunConfigTest, EveryKeyIsDocumented) {
  const std::string doc = ReadAll(std::filesystem::path(FERRY_FIXTURES_DIR) / ".." / "docs" / "daemon.md");

  std::set<std::string> table;
  for (const KeyInfo& k : TopLevelKeys()) {
    if (k.subkeys.empty()) {
      table.insert(std::string(k.name));
    } else {
      for (std::string_view sub : k.subkeys) table.insert(std::string(k.name) + "." + std::string(sub));
    }
  }
  const size_t begin = doc.find("\n### Keys\n");
  const size_t end = doc.find("\n### ", begin + 1);
  ASSERT_NE(begin, std::string::npos);
  std::istringstream lines(doc.substr(begin, end - begin));
  std::set<std::string> documented;
  bool lora_rows = false;  // the rows of the [lora] table are its own keys, not top-level ones
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] != '|') {
      if (!line.empty()) lora_rows = line.rfind("`[lora]`", 0) == 0;
      if (lora_rows) documented.insert("lora");
      continue;
    }
    if (lora_rows || line.rfind("| ", 0) != 0) continue;  // [lora]'s rows, a |---| line
    const std::vector<std::string> names = CellNames(line).front();
    if (names.empty()) continue;  // the header row
    if (names.size() == 2 && names[0].front() == '[' && names[0].rfind("[[", 0) != 0) {
      documented.insert(names[0].substr(1, names[0].size() - 2) + "." + names[1]);  // `[store]` `path`
    } else {
      for (std::string n : names) {
        if (n.rfind("[[", 0) == 0) n = n.substr(2, n.size() - 4);  // `[[rewards]]`
        documented.insert(n);
      }
    }
  }
  ExpectSameKeys(table, documented);
  EXPECT_GT(table.size(), 60u);

  std::set<std::string> lora, lora_documented;
  for (const auto& k : LoraKeys()) lora.insert(std::string(k.name));
  for (const auto& row : DocTable(doc, "`[lora]` (PEFT LoraConfig)"))
    lora_documented.insert(row[0].begin(), row[0].end());
  ExpectSameKeys(lora, lora_documented);
  EXPECT_GT(lora.size(), 10u);

  // "type.key"; a row whose types cell names no type ("all") is every type's.
  const RewardType kTypes[] = {RewardType::kAnswerMatch, RewardType::kDigitMatch, RewardType::kRegex,
                               RewardType::kLength, RewardType::kCommand};
  std::set<std::string> rewards, rewards_documented;
  for (RewardType t : kTypes) {
    for (const auto& k : RewardKeys(t)) rewards.insert(std::string(RewardTypeName(t)) + "." + std::string(k.name));
  }
  for (const auto& row : DocTable(doc, "`[[rewards]]` keys")) {
    ASSERT_GE(row.size(), 2u);
    std::vector<std::string> types = row[1];
    if (types.empty()) {
      for (RewardType t : kTypes) types.emplace_back(RewardTypeName(t));
    }
    for (const std::string& t : types) {
      for (const std::string& k : row[0]) rewards_documented.insert(t + "." + k);
    }
  }
  ExpectSameKeys(rewards, rewards_documented);
  EXPECT_GT(rewards.size(), 20u);
}

// The rows' defaults are RunConfig's: a config that sets nothing is at every row's default.
TEST(RunConfigTest, EveryRowIsAtItsDefaultWhenNothingIsSet) {
  const RunConfig c = MustParse(Cfg());
  for (const KeyInfo& k : TopLevelKeys()) {
    if (k.name == "rewards" || k.name == "model_name_or_path" || k.name == "dataset" || k.name == "output_dir") {
      continue;  // required, or holding what Cfg() sets
    }
    EXPECT_TRUE(k.at_default(c)) << k.name;
  }
}

}  // namespace
}  // namespace ferry::run
