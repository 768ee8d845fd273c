// The run config's top-level keys, one row each: the one place a key is spelled (RocksDB's
// option type maps are the model). A row's factory says the key's type, bounds and member;
// the row then drives the reading and its messages (config.cpp), the resolved JSON and the
// fingerprint (config_json.cpp), and the test that checks docs/daemon.md lists every key.
//
// Adding a key: a member of RunConfig (config.h) with its default, one row below in the
// place its JSON should take, and its line in docs/daemon.md. A key added after runs were
// made is UnlessDefault(...): it counts in the fingerprint only when set away from its
// default, so those runs still resume.
#include <cmath>
#include <limits>

#include "daemon/run/config_internal.h"

namespace ferry::run {
namespace {

namespace fs = std::filesystem;
using OJson = nlohmann::ordered_json;

constexpr double kInf = std::numeric_limits<double>::infinity();

template <typename T>
using Member = T RunConfig::*;

const RunConfig& Defaults() {
  static const RunConfig* d = new RunConfig();
  return *d;
}

template <typename T, typename U>
Status Into(Result<T> r, U& out) {
  if (!r.ok()) return r.status();
  out = std::move(r).value();
  return Status::OK();
}

template <typename T>
KeyInfo::AtDefault SameAsDefault(Member<T> m) {
  return [m](const RunConfig& c) { return c.*m == Defaults().*m; };
}

template <typename T>
OJson Opt(const std::optional<T>& v) {
  return v ? OJson(*v) : OJson(nullptr);
}

// --- Row factories, one per kind of value.

KeyInfo FloatKey(std::string_view name, Member<double> m, Reader::Range range) {
  return {name,
          KeyInfo::Record::kAlways,
          {},
          [m, range](Parse& p, const toml::node& v) { return Into(p.rd.Float(v, range), p.c.*m); },
          [m](const RunConfig& c) { return OJson(c.*m); },
          SameAsDefault(m)};
}

KeyInfo IntKey(std::string_view name, Member<int64_t> m, int64_t min, int64_t max) {
  return {name,
          KeyInfo::Record::kAlways,
          {},
          [m, min, max](Parse& p, const toml::node& v) { return Into(p.rd.Int(v, min, max), p.c.*m); },
          [m](const RunConfig& c) { return OJson(c.*m); },
          SameAsDefault(m)};
}

KeyInfo BoolKey(std::string_view name, Member<bool> m) {
  return {name,
          KeyInfo::Record::kAlways,
          {},
          [m](Parse& p, const toml::node& v) { return Into(p.rd.Bool(v), p.c.*m); },
          [m](const RunConfig& c) { return OJson(c.*m); },
          SameAsDefault(m)};
}

KeyInfo OptIntKey(std::string_view name, Member<std::optional<int64_t>> m, int64_t min, int64_t max) {
  return {name,
          KeyInfo::Record::kAlways,
          {},
          [m, min, max](Parse& p, const toml::node& v) -> Status {
            FERRY_ASSIGN_OR_RETURN(int64_t x, p.rd.Int(v, min, max));
            p.c.*m = x;
            return Status::OK();
          },
          [m](const RunConfig& c) { return Opt(c.*m); },
          SameAsDefault(m)};
}

KeyInfo OptFloatKey(std::string_view name, Member<std::optional<double>> m, Reader::Range range) {
  return {name,
          KeyInfo::Record::kAlways,
          {},
          [m, range](Parse& p, const toml::node& v) -> Status {
            FERRY_ASSIGN_OR_RETURN(double x, p.rd.Float(v, range));
            p.c.*m = x;
            return Status::OK();
          },
          [m](const RunConfig& c) { return Opt(c.*m); },
          SameAsDefault(m)};
}

// A path, resolved against the config file's directory.
KeyInfo PathKey(std::string_view name, Member<fs::path> m) {
  return {name,
          KeyInfo::Record::kAlways,
          {},
          [m](Parse& p, const toml::node& v) { return Into(ResolvePath(p.rd, v, p.base), p.c.*m); },
          [m](const RunConfig& c) { return OJson(((c.*m).string())); },
          SameAsDefault(m)};
}

// One of E's spellings (config.h). `refused` are spellings of features ferryd does not
// implement: kUnsupported "\"x\" is <refused_what> (it has ...)".
template <typename E>
KeyInfo EnumKey(std::string_view name, Member<E> m, std::vector<std::string_view> refused = {},
                std::string_view refused_what = "") {
  return {name,
          KeyInfo::Record::kAlways,
          {},
          [m, refused, refused_what](Parse& p, const toml::node& v) -> Status {
            FERRY_ASSIGN_OR_RETURN(std::string s, p.rd.String(v));
            if (std::optional<E> e = FromName<E>(s)) {
              p.c.*m = *e;
              return Status::OK();
            }
            const std::string names = QuotedSpellings<E>();
            if (std::find(refused.begin(), refused.end(), s) != refused.end()) {
              return p.rd.Unsupported("\"" + s + "\" is " + std::string(refused_what) + " (it has " + names + ")");
            }
            return p.rd.Error("must be " + names + " (got " + Reader::Show(s) + ")");
          },
          [m](const RunConfig& c) { return OJson(std::string(NameOf(c.*m))); },
          SameAsDefault(m)};
}

// logging_steps / save_steps: a whole number >= 1 or a ratio in (0, 1).
KeyInfo StepsKey(std::string_view name, Member<double> m) {
  return {name,
          KeyInfo::Record::kAlways,
          {},
          [m](Parse& p, const toml::node& v) -> Status {
            FERRY_ASSIGN_OR_RETURN(double x, p.rd.Float(v, {.min = 0, .min_open = true, .max = 1e12}));
            if (x > 1 && x != std::floor(x)) {
              return p.rd.Error("must be a whole number when above 1 (got " + Reader::Num(x) + ")");
            }
            p.c.*m = x;
            return Status::OK();
          },
          [m](const RunConfig& c) { return OJson(c.*m); },
          SameAsDefault(m)};
}

OJson NeutralJson(const NeutralValue& n) {
  switch (n.kind) {
    case NeutralValue::Kind::kBool: return n.b;
    case NeutralValue::Kind::kFloat: return n.f;
    case NeutralValue::Kind::kString: return std::string(n.s);
    case NeutralValue::Kind::kNone:
    case NeutralValue::Kind::kNoneOrFloat: return nullptr;
  }
  return nullptr;
}

// A TRL key accepted only at the value that turns its feature off; `why` completes
// "ferryd ...". Its resolved value is always that one.
KeyInfo NeutralKey(std::string_view name, NeutralValue neutral, std::string_view why) {
  return {name,
          KeyInfo::Record::kAlways,
          {},
          [neutral, why](Parse& p, const toml::node& v) { return p.rd.Neutral(v, neutral, why); },
          [neutral](const RunConfig&) { return NeutralJson(neutral); },
          [](const RunConfig&) { return true; }};
}

// A key read into the parse state and resolved later (Resolve in config.cpp).
KeyInfo Deferred(std::string_view name, KeyInfo::Read read, KeyInfo::Value value, KeyInfo::AtDefault at_default) {
  return {name, KeyInfo::Record::kAlways, {}, std::move(read), std::move(value), std::move(at_default)};
}

KeyInfo UnlessDefault(KeyInfo k) {
  k.record = KeyInfo::Record::kUnlessDefault;
  return k;
}

// Operational keys ([publish], [control]): left out of the resolved JSON and the
// fingerprint, so a run resumes under another endpoint or key.
KeyInfo Operational(std::string_view name, std::vector<std::string_view> subkeys, KeyInfo::Read read) {
  return {name,
          KeyInfo::Record::kNever,
          std::move(subkeys),
          std::move(read),
          [](const RunConfig&) { return OJson(nullptr); },
          [](const RunConfig&) { return true; }};
}

Status ReadDevice(Parse& p, const toml::node& v) {
  FERRY_ASSIGN_OR_RETURN(std::string s, p.rd.String(v));
  if (s == "cpu" || s == "cuda") {
    p.c.device = DeviceSpec{s == "cuda", std::nullopt};
    return Status::OK();
  }
  if (s.rfind("cuda:", 0) == 0 && s.size() > 5 && s.size() <= 9 &&
      std::all_of(s.begin() + 5, s.end(), [](char ch) { return ch >= '0' && ch <= '9'; }) &&
      std::stoi(s.substr(5)) < 128) {
    p.c.device = DeviceSpec{true, std::stoi(s.substr(5))};
    return Status::OK();
  }
  return p.rd.Error("must be \"cpu\", \"cuda\" or \"cuda:N\" (got " + Reader::Show(s) + ")");
}

// TRL maps True / False to "group" / "none" (GRPOConfig.__post_init__).
Status ReadScaleRewards(Parse& p, const toml::node& v) {
  if (v.is_boolean()) {
    p.c.scale_rewards = v.as_boolean()->get() ? ScaleRewards::kGroup : ScaleRewards::kNone;
    return Status::OK();
  }
  const std::string names = QuotedSpellings<ScaleRewards>();
  if (!v.is_string()) return p.rd.Error("must be " + names + ", true or false (got " + Reader::TypeName(v) + ")");
  const std::string s = v.as_string()->get();
  std::optional<ScaleRewards> e = FromName<ScaleRewards>(s);
  if (!e) return p.rd.Error("must be " + names + ", true or false (got " + Reader::Show(s) + ")");
  p.c.scale_rewards = *e;
  return Status::OK();
}

std::vector<KeyInfo> MakeKeys() {
  using R = Reader::Range;
  std::vector<KeyInfo> k;
  // --- Ferry's own keys.
  k.push_back(PathKey("model_name_or_path", &RunConfig::model_name_or_path));
  k.push_back(PathKey("dataset", &RunConfig::dataset));
  KeyInfo output_dir = PathKey("output_dir", &RunConfig::output_dir);
  output_dir.read = [read = output_dir.read](Parse& p, const toml::node& v) {
    p.have_output_dir = true;
    return read(p, v);
  };
  k.push_back(std::move(output_dir));
  k.push_back(IntKey("threads", &RunConfig::threads, 0, kMaxThreads));
  k.push_back({"device",
               KeyInfo::Record::kAlways,
               {},
               ReadDevice,
               [](const RunConfig& c) { return OJson(c.device.Name()); },
               SameAsDefault(&RunConfig::device)});
  k.push_back(EnumKey("chat_template", &RunConfig::chat_template));
  k.push_back(UnlessDefault(EnumKey("generation_dtype", &RunConfig::generation_dtype, {"float16", "half"},
                                    "a vLLM dtype ferryd's generator does not run")));
  KeyInfo store = Deferred(
      "store",
      [](Parse& p, const toml::node& v) {
        p.store = &v;  // read once output_dir is known (its default path is under it)
        return Status::OK();
      },
      [](const RunConfig& c) {
        return OJson{{"path", c.store.path.string()}, {"run", c.store.run}};
      },
      [](const RunConfig& c) { return c.store.run == "default"; });
  store.subkeys = {"path", "run"};
  k.push_back(std::move(store));
  k.push_back(Operational("publish", {"endpoint", "mode", "key", "allow"}, [](Parse& p, const toml::node& v) {
    PublishSettings& ps = p.c.publish;
    return ReadEndpointTable(p, v, "publish", ps.endpoint, ps.key, ps.allow, &ps.mode);
  }));
  k.push_back(Operational("control", {"endpoint", "key", "allow"}, [](Parse& p, const toml::node& v) {
    ControlSettings& cs = p.c.control;
    return ReadEndpointTable(p, v, "control", cs.endpoint, cs.key, cs.allow, nullptr);
  }));

  // --- TrainingArguments (as GRPOConfig overrides them).
  k.push_back(FloatKey("learning_rate", &RunConfig::learning_rate, {.min = 0, .max = 1e6}));
  k.push_back(EnumKey("lr_scheduler_type", &RunConfig::lr_scheduler_type,
                      {"cosine_with_restarts", "polynomial", "inverse_sqrt", "reduce_lr_on_plateau",
                       "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay", "greedy"},
                      "a transformers scheduler ferryd does not implement"));
  k.push_back(FloatKey("warmup_ratio", &RunConfig::warmup_ratio, {.min = 0, .max = 1}));
  KeyInfo warmup_steps = FloatKey("warmup_steps", &RunConfig::warmup_steps, {.min = 0, .max = 1e12});
  warmup_steps.read = [](Parse& p, const toml::node& v) -> Status {
    FERRY_ASSIGN_OR_RETURN(double x, p.rd.Float(v, {.min = 0, .max = 1e12}));
    if (x >= 1 && x != std::floor(x)) {
      return p.rd.Error("must be a whole number of steps, or a ratio below 1 (got " + Reader::Num(x) + ")");
    }
    p.c.warmup_steps = x;
    return Status::OK();
  };
  k.push_back(std::move(warmup_steps));
  k.push_back(FloatKey("weight_decay", &RunConfig::weight_decay, {.min = 0, .max = 1e6}));
  k.push_back(FloatKey("adam_beta1", &RunConfig::adam_beta1, {.min = 0, .max = 1, .max_open = true}));
  k.push_back(FloatKey("adam_beta2", &RunConfig::adam_beta2, {.min = 0, .max = 1, .max_open = true}));
  k.push_back(FloatKey("adam_epsilon", &RunConfig::adam_epsilon, {.min = 0, .min_open = true, .max = 1}));
  k.push_back(FloatKey("max_grad_norm", &RunConfig::max_grad_norm, {.min = 0, .max = 1e12}));
  k.push_back(FloatKey("num_train_epochs", &RunConfig::num_train_epochs, {.min = 0, .min_open = true, .max = 1e9}));
  KeyInfo max_steps = IntKey("max_steps", &RunConfig::max_steps, -1, int64_t{1} << 40);
  max_steps.read = [](Parse& p, const toml::node& v) -> Status {
    FERRY_ASSIGN_OR_RETURN(int64_t x, p.rd.Int(v, -1, int64_t{1} << 40));
    if (x == 0) return p.rd.Error("must be -1 (use num_train_epochs) or at least 1 (got 0)");
    p.c.max_steps = x;
    return Status::OK();
  };
  k.push_back(std::move(max_steps));
  k.push_back(StepsKey("logging_steps", &RunConfig::logging_steps));
  k.push_back(StepsKey("save_steps", &RunConfig::save_steps));
  k.push_back(OptIntKey("save_total_limit", &RunConfig::save_total_limit, 1, int64_t{1} << 40));
  k.push_back(IntKey("seed", &RunConfig::seed, 0, std::numeric_limits<int64_t>::max()));
  k.push_back(BoolKey("shuffle_dataset", &RunConfig::shuffle_dataset));
  k.push_back(IntKey("per_device_train_batch_size", &RunConfig::per_device_train_batch_size, 1, kMaxBatchSize));
  k.push_back(IntKey("gradient_accumulation_steps", &RunConfig::gradient_accumulation_steps, 1, kMaxBatchSize));
  k.push_back(BoolKey("bf16", &RunConfig::bf16));
  k.push_back(BoolKey("gradient_checkpointing", &RunConfig::gradient_checkpointing));

  // --- GRPOConfig.
  k.push_back(IntKey("num_generations", &RunConfig::num_generations, 1, kMaxNumGenerations));
  k.push_back(OptIntKey("max_prompt_length", &RunConfig::max_prompt_length, 1, kMaxSequenceTokens));
  k.push_back(IntKey("max_completion_length", &RunConfig::max_completion_length, 1, kMaxSequenceTokens));
  k.push_back(Deferred(
      "generation_batch_size",
      [](Parse& p, const toml::node& v) {
        return Into(p.rd.Int(v, 1, kMaxGenerationBatchSize), p.generation_batch_size);
      },
      [](const RunConfig& c) { return OJson(c.generation_batch_size); },
      [](const RunConfig& c) {
        return c.generation_batch_size == c.per_device_train_batch_size * c.steps_per_generation;
      }));
  k.push_back(Deferred(
      "steps_per_generation",
      [](Parse& p, const toml::node& v) { return Into(p.rd.Int(v, 1, kMaxBatchSize), p.steps_per_generation); },
      [](const RunConfig& c) { return OJson(c.steps_per_generation); },
      [](const RunConfig& c) { return c.steps_per_generation == c.gradient_accumulation_steps; }));
  k.push_back(FloatKey("temperature", &RunConfig::temperature, {.min = 0, .min_open = true, .max = 1e4}));
  k.push_back(FloatKey("top_p", &RunConfig::top_p, {.min = 0, .min_open = true, .max = 1}));
  k.push_back(IntKey("top_k", &RunConfig::top_k, 0, int64_t{1} << 31));
  k.push_back(FloatKey("beta", &RunConfig::beta, {.min = 0, .max = 1e6}));
  k.push_back(IntKey("num_iterations", &RunConfig::num_iterations, 1, 1 << 16));
  k.push_back(FloatKey("epsilon", &RunConfig::epsilon, {.min = 0, .max = 1}));
  k.push_back(Deferred(
      "epsilon_high",
      [](Parse& p, const toml::node& v) { return Into(p.rd.Float(v, R{.min = 0, .max = 1e6}), p.epsilon_high); },
      [](const RunConfig& c) { return OJson(c.epsilon_high); },
      [](const RunConfig& c) { return c.epsilon_high == c.epsilon; }));
  k.push_back(OptFloatKey("delta", &RunConfig::delta, {.min = 1, .min_open = true, .max = 1e6}));
  k.push_back(EnumKey("importance_sampling_level", &RunConfig::importance_sampling_level));
  k.push_back({"scale_rewards",
               KeyInfo::Record::kAlways,
               {},
               ReadScaleRewards,
               [](const RunConfig& c) { return OJson(std::string(NameOf(c.scale_rewards))); },
               SameAsDefault(&RunConfig::scale_rewards)});
  k.push_back(EnumKey("loss_type", &RunConfig::loss_type, {"cispo", "sapo", "luspo", "vespo"},
                      "a TRL loss ferryd does not implement"));
  k.push_back(BoolKey("mask_truncated_completions", &RunConfig::mask_truncated_completions));
  k.push_back(BoolKey("vllm_importance_sampling_correction", &RunConfig::vllm_importance_sampling_correction));
  k.push_back(EnumKey("vllm_importance_sampling_mode", &RunConfig::vllm_importance_sampling_mode));
  KeyInfo clip_max = OptFloatKey("vllm_importance_sampling_clip_max", &RunConfig::vllm_importance_sampling_clip_max,
                                 {.min = 0, .max = kInf, .allow_inf = true});
  clip_max.read = [](Parse& p, const toml::node& v) -> Status {
    // TOML has no null: inf stands for TRL's None (no upper bound).
    FERRY_ASSIGN_OR_RETURN(double x, p.rd.Float(v, {.min = 0, .max = kInf, .allow_inf = true}));
    p.c.vllm_importance_sampling_clip_max = std::isinf(x) ? std::nullopt : std::optional<double>(x);
    return Status::OK();
  };
  k.push_back(std::move(clip_max));
  k.push_back(OptFloatKey("vllm_importance_sampling_clip_min", &RunConfig::vllm_importance_sampling_clip_min,
                          {.min = 0, .max = 1e12}));
  // TRL's deprecated name of clip_max: read as it (Resolve), never written.
  KeyInfo cap = Deferred(
      "vllm_importance_sampling_cap",
      [](Parse& p, const toml::node& v) { return Into(p.rd.Float(v, R{.min = 0, .max = 1e12}), p.clip_cap); },
      [](const RunConfig&) { return OJson(nullptr); }, [](const RunConfig&) { return true; });
  cap.record = KeyInfo::Record::kNever;
  k.push_back(std::move(cap));
  k.push_back(BoolKey("use_bias_correction_kl", &RunConfig::use_bias_correction_kl));
  k.push_back(Deferred(
      "reward_weights",
      [](Parse& p, const toml::node& v) {
        return Into(p.rd.FloatList(v, {.min = -1e12, .max = 1e12}, kMaxRewards), p.reward_weights);
      },
      [](const RunConfig& c) {
        OJson weights = OJson::array();
        for (const RewardSpec& r : c.rewards) weights.push_back(r.weight);
        return weights;
      },
      [](const RunConfig& c) {
        return std::all_of(c.rewards.begin(), c.rewards.end(), [](const RewardSpec& r) { return r.weight == 1.0; });
      }));

  // --- TRL keys accepted only at the value that turns their feature off.
  k.push_back(NeutralKey("use_vllm", NeutralValue::Bool(false), "generates with its own co-located generator"));
  k.push_back(NeutralKey("fp16", NeutralValue::Bool(false), "computes in fp32, or bf16 with bf16 = true"));
  k.push_back(NeutralKey("use_liger_kernel", NeutralValue::Bool(false), "has no Liger kernels"));
  k.push_back(NeutralKey("disable_dropout", NeutralValue::Bool(false),
                         "does not implement disable_dropout (set lora.lora_dropout = 0)"));
  k.push_back(NeutralKey("cast_lm_head_to_fp32", NeutralValue::Bool(false), "does not implement cast_lm_head_to_fp32"));
  k.push_back(NeutralKey("remove_unused_columns", NeutralValue::Bool(false),
                         "always keeps every dataset field for the rewards"));
  k.push_back(
      NeutralKey("sync_ref_model", NeutralValue::Bool(false), "does not implement reference-model syncing (TR-DPO)"));
  k.push_back(NeutralKey("use_adaptive_entropy", NeutralValue::Bool(false), "has no entropy bonus"));
  k.push_back(NeutralKey("entropy_coef", NeutralValue::Float(0.0), "has no entropy bonus"));
  k.push_back(NeutralKey("top_entropy_quantile", NeutralValue::Float(1.0), "does not mask tokens by entropy"));
  k.push_back(NeutralKey("repetition_penalty", NeutralValue::Float(1.0), "samples without a repetition penalty"));
  k.push_back(NeutralKey("min_p", NeutralValue::NoneOrFloat(0.0), "samples without min-p filtering"));
  k.push_back(
      NeutralKey("off_policy_mask_threshold", NeutralValue::None(), "does not implement off-policy sequence masking"));
  k.push_back(NeutralKey("multi_objective_aggregation", NeutralValue::String("sum_then_normalize"),
                         "aggregates rewards as TRL's default \"sum_then_normalize\" only"));

  // --- PEFT and rewards (their own readers: config_lora.cpp, config_rewards.cpp).
  KeyInfo lora = Deferred(
      "lora", [](Parse& p, const toml::node& v) { return ParseLora(p.rd, v, p.c.lora); },
      [](const RunConfig& c) { return LoraJson(c.lora); }, [](const RunConfig&) { return false; });
  k.push_back(std::move(lora));
  k.push_back(Deferred(
      "rewards",
      [](Parse& p, const toml::node& v) {
        if (!v.is_array()) return p.rd.Error("must be an array of tables ([[rewards]]), got " + Reader::TypeName(v));
        p.rewards = v.as_array();
        return Status::OK();
      },
      [](const RunConfig& c) {
        OJson rewards = OJson::array();
        for (const RewardSpec& r : c.rewards) rewards.push_back(RewardJson(r));
        return rewards;
      },
      [](const RunConfig&) { return false; }));
  return k;
}

}  // namespace

std::string DeviceSpec::Name() const {
  if (!cuda) return "cpu";
  return index ? "cuda:" + std::to_string(*index) : "cuda";
}

std::span<const KeyInfo> TopLevelKeys() {
  static const std::vector<KeyInfo>* keys = new std::vector<KeyInfo>(MakeKeys());
  return *keys;
}

}  // namespace ferry::run
