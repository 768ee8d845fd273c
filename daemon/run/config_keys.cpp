// The run config's top-level keys, one row each, and the rows of [store], [publish] and
// [control]: the one place a key is spelled (RocksDB's option type maps are the model). A
// row's factory (config_rows.h) says the key's type, bounds and member; the row then drives
// the reading and its messages, the resolved JSON and the fingerprint (config_json.cpp), and
// the test that checks docs/daemon.md lists every key. [lora] and [[rewards]] have their
// tables in config_lora.cpp and config_rewards.cpp.
//
// Adding a key: a member of RunConfig (config.h) with its default, one row below in the
// place its JSON should take, and its line in docs/daemon.md. A key added after runs were
// made is Recorded(..., Record::kUnlessDefault): it counts in the fingerprint only when set
// away from its default, so those runs still resume.
#include <cmath>
#include <limits>

#include "daemon/run/config_rows.h"

namespace ferry::run {
namespace {

using OJson = nlohmann::ordered_json;

constexpr double kInf = std::numeric_limits<double>::infinity();

// logging_steps / save_steps: a whole number >= 1 or a ratio in (0, 1).
KeyInfo StepsKey(std::string_view name, double RunConfig::*m) {
  return MemberKey(name, m, [](Parse& p, const toml::node& v) -> Result<double> {
    FERRY_ASSIGN_OR_RETURN(double x, p.rd.Float(v, {.min = 0, .min_open = true, .max = 1e12}));
    if (x > 1 && x != std::floor(x)) {
      return p.rd.Error("must be a whole number when above 1 (got " + Reader::Num(x) + ")");
    }
    return x;
  });
}

// A key read into the parse state and resolved later (Resolve in config.cpp).
KeyInfo Deferred(std::string_view name, KeyInfo::Read read, KeyInfo::Value value, KeyInfo::AtDefault at_default) {
  return {name, Record::kAlways, {}, std::move(read), std::move(value), std::move(at_default)};
}

// --- [store], [publish] and [control].

// "unknown key (the [TABLE] table has 'a', 'b' and 'c')".
template <typename T>
std::function<Status(const std::string&)> UnknownIn(Parse& p, std::string_view table,
                                                    std::span<const KeyInfoT<T>> rows) {
  return [&p, table, rows](const std::string&) {
    return p.rd.Error("unknown key (the [" + std::string(table) + "] table has " + ListOf(NamesOf(rows), "'", " and ") +
                      ")");
  };
}

std::span<const KeyInfoT<StoreSettings>> StoreKeys() {
  static const auto* keys = new std::vector<KeyInfoT<StoreSettings>>{
      PathKey("path", &StoreSettings::path),
      MemberKey("run", &StoreSettings::run, [](Parse& p, const toml::node& v) -> Result<std::string> {
        FERRY_ASSIGN_OR_RETURN(std::string run, p.rd.String(v));
        if (run.empty() || run.size() > 256) return p.rd.Error("must have 1 to 256 characters");
        if (!IsPrintableUtf8(run)) return p.rd.Error("must be UTF-8 without control characters");
        return run;
      })};
  return *keys;
}

// endpoint, (mode,) key and allow, the keys of [publish] and [control].
template <typename T>
std::vector<KeyInfoT<T>> EndpointKeys(std::vector<KeyInfoT<T>> own) {
  std::vector<KeyInfoT<T>> k;
  k.push_back(MemberKey("endpoint", &T::endpoint, [](Parse& p, const toml::node& v) -> Result<std::string> {
    FERRY_ASSIGN_OR_RETURN(std::string endpoint, p.rd.String(v));
    if (!endpoint.starts_with("ipc://") && !endpoint.starts_with("tcp://")) {
      return p.rd.Error("must be \"ipc://DIR\" or \"tcp://HOST:PORT\" (got " + Reader::Show(endpoint) + ")");
    }
    return endpoint;
  }));
  k.insert(k.end(), own.begin(), own.end());
  k.push_back(PathKey("key", &T::key));
  k.push_back(PathKey("allow", &T::allow));
  return k;
}

KeyInfoT<PublishSettings> PublishModeKey() {
  return MemberKey("mode", &PublishSettings::mode, [](Parse& p, const toml::node& v) -> Result<sync::PublishMode> {
    FERRY_ASSIGN_OR_RETURN(std::string m, p.rd.String(v));
    Result<sync::PublishMode> parsed = sync::ParsePublishMode(m);
    if (!parsed.ok()) return p.rd.Error("must be \"adapter\", \"merged\" or \"delta\" (got " + Reader::Show(m) + ")");
    return *parsed;
  });
}

std::span<const KeyInfoT<PublishSettings>> PublishKeys() {
  static const auto* keys =
      new std::vector<KeyInfoT<PublishSettings>>(EndpointKeys<PublishSettings>({PublishModeKey()}));
  return *keys;
}

std::span<const KeyInfoT<ControlSettings>> ControlKeys() {
  static const auto* keys = new std::vector<KeyInfoT<ControlSettings>>(EndpointKeys<ControlSettings>({}));
  return *keys;
}

// [publish] or [control] (`table`): its rows, then CURVE's rules (sync/endpoints.h).
template <typename T>
Status ReadEndpointTable(Parse& p, const toml::node& v, std::string_view table, std::span<const KeyInfoT<T>> rows,
                         T& out) {
  const std::string t(table);
  if (!v.is_table()) return p.rd.Error("must be a table ([" + t + "]), got " + Reader::TypeName(v));
  FERRY_RETURN_IF_ERROR(ReadRows(p, *v.as_table(), table, rows, out, UnknownIn(p, table, rows)));
  if (out.key.empty() != out.allow.empty()) {
    Reader::Scope scope(p.rd, t + (out.key.empty() ? ".allow" : ".key"));
    return p.rd.Error(out.key.empty()
                          ? "needs " + t + ".key (the CURVE keypair it admits clients with)"
                          : "needs " + t + ".allow (without an allow-list any client key would be accepted)");
  }
  if (out.endpoint.starts_with("tcp://") && out.key.empty()) {
    Reader::Scope scope(p.rd, t + ".endpoint");
    return p.rd.Error("tcp:// needs CURVE: set " + t + ".key and " + t + ".allow");
  }
  return Status::OK();
}

// [distributed]: operational, like [publish] and [control].
std::span<const KeyInfoT<DistributedSettings>> DistributedKeys() {
  static const auto* keys = new std::vector<KeyInfoT<DistributedSettings>>{
      ChoiceKey("backend", &DistributedSettings::backend, {"gloo", "nccl"}),
      FloatKey("timeout", &DistributedSettings::timeout, {.min = 0, .min_open = true, .max = 7 * 24 * 3600}),
      IntKey("check_every", &DistributedSettings::check_every, 0, int64_t{1} << 40)};
  return *keys;
}

// Operational tables ([publish], [control]): left out of the resolved JSON and the
// fingerprint, so a run resumes under another endpoint or key.
template <typename T>
KeyInfo Operational(std::string_view name, T RunConfig::*m, std::span<const KeyInfoT<T>> rows) {
  return {name,
          Record::kNever,
          NamesOf(rows),
          [name, m, rows](Parse& p, RunConfig& c, const toml::node& v) {
            return ReadEndpointTable(p, v, name, rows, c.*m);
          },
          [](const RunConfig&) { return OJson(nullptr); },
          [](const RunConfig&) { return true; }};
}

// --- Keys with rules of their own.

Result<DeviceSpec> ReadDevice(Parse& p, const toml::node& v) {
  FERRY_ASSIGN_OR_RETURN(std::string s, p.rd.String(v));
  if (s == "cpu" || s == "cuda") return DeviceSpec{s == "cuda", std::nullopt};
  if (s.rfind("cuda:", 0) == 0 && s.size() > 5 && s.size() <= 9 &&
      std::all_of(s.begin() + 5, s.end(), [](char ch) { return ch >= '0' && ch <= '9'; }) &&
      std::stoi(s.substr(5)) < 128) {
    return DeviceSpec{true, std::stoi(s.substr(5))};
  }
  return p.rd.Error("must be \"cpu\", \"cuda\" or \"cuda:N\" (got " + Reader::Show(s) + ")");
}

// TRL maps True / False to "group" / "none" (GRPOConfig.__post_init__).
Result<ScaleRewards> ReadScaleRewards(Parse& p, const toml::node& v) {
  if (v.is_boolean()) return v.as_boolean()->get() ? ScaleRewards::kGroup : ScaleRewards::kNone;
  const std::string names = QuotedSpellings<ScaleRewards>();
  if (!v.is_string()) return p.rd.Error("must be " + names + ", true or false (got " + Reader::TypeName(v) + ")");
  const std::string s = v.as_string()->get();
  std::optional<ScaleRewards> e = FromName<ScaleRewards>(s);
  if (!e) return p.rd.Error("must be " + names + ", true or false (got " + Reader::Show(s) + ")");
  return *e;
}

std::vector<KeyInfo> MakeKeys() {
  using R = Reader::Range;
  std::vector<KeyInfo> k;
  // --- Ferry's own keys.
  k.push_back(PathKey("model_name_or_path", &RunConfig::model_name_or_path));
  k.push_back(PathKey("dataset", &RunConfig::dataset));
  k.push_back(PathKey("output_dir", &RunConfig::output_dir));
  k.push_back(IntKey("threads", &RunConfig::threads, 0, kMaxThreads));
  k.push_back(MemberKey("device", &RunConfig::device, ReadDevice));
  k.push_back(EnumKey("chat_template", &RunConfig::chat_template));
  k.push_back(Recorded(EnumKey("generation_dtype", &RunConfig::generation_dtype, {"float16", "half"},
                               "a vLLM dtype ferryd's generator does not run"),
                       Record::kUnlessDefault));
  KeyInfo store = Deferred(
      "store",
      [](Parse& p, RunConfig&, const toml::node& v) {
        p.store = &v;  // read once output_dir is known (its default path is under it)
        return Status::OK();
      },
      [](const RunConfig& c) { return RowsJson(StoreKeys(), c.store); },
      [](const RunConfig& c) { return c.store.run == "default"; });
  store.subkeys = NamesOf(StoreKeys());
  k.push_back(std::move(store));
  k.push_back(Operational("publish", &RunConfig::publish, PublishKeys()));
  k.push_back(Operational("control", &RunConfig::control, ControlKeys()));
  k.push_back({"distributed", Record::kNever, NamesOf(DistributedKeys()),
               [](Parse& p, RunConfig& c, const toml::node& v) -> Status {
                 if (!v.is_table()) return p.rd.Error("must be a table ([distributed]), got " + Reader::TypeName(v));
                 return ReadRows(p, *v.as_table(), "distributed", DistributedKeys(), c.distributed,
                                 UnknownIn(p, "distributed", DistributedKeys()));
               },
               [](const RunConfig&) { return OJson(nullptr); }, [](const RunConfig&) { return true; }});

  // --- TrainingArguments (as GRPOConfig overrides them).
  k.push_back(FloatKey("learning_rate", &RunConfig::learning_rate, {.min = 0, .max = 1e6}));
  k.push_back(EnumKey("lr_scheduler_type", &RunConfig::lr_scheduler_type,
                      {"cosine_with_restarts", "polynomial", "inverse_sqrt", "reduce_lr_on_plateau",
                       "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay", "greedy"},
                      "a transformers scheduler ferryd does not implement"));
  k.push_back(FloatKey("warmup_ratio", &RunConfig::warmup_ratio, {.min = 0, .max = 1}));
  k.push_back(MemberKey("warmup_steps", &RunConfig::warmup_steps, [](Parse& p, const toml::node& v) -> Result<double> {
    FERRY_ASSIGN_OR_RETURN(double x, p.rd.Float(v, {.min = 0, .max = 1e12}));
    if (x >= 1 && x != std::floor(x)) {
      return p.rd.Error("must be a whole number of steps, or a ratio below 1 (got " + Reader::Num(x) + ")");
    }
    return x;
  }));
  k.push_back(FloatKey("weight_decay", &RunConfig::weight_decay, {.min = 0, .max = 1e6}));
  k.push_back(FloatKey("adam_beta1", &RunConfig::adam_beta1, {.min = 0, .max = 1, .max_open = true}));
  k.push_back(FloatKey("adam_beta2", &RunConfig::adam_beta2, {.min = 0, .max = 1, .max_open = true}));
  k.push_back(FloatKey("adam_epsilon", &RunConfig::adam_epsilon, {.min = 0, .min_open = true, .max = 1}));
  k.push_back(FloatKey("max_grad_norm", &RunConfig::max_grad_norm, {.min = 0, .max = 1e12}));
  k.push_back(FloatKey("num_train_epochs", &RunConfig::num_train_epochs, {.min = 0, .min_open = true, .max = 1e9}));
  k.push_back(MemberKey("max_steps", &RunConfig::max_steps, [](Parse& p, const toml::node& v) -> Result<int64_t> {
    FERRY_ASSIGN_OR_RETURN(int64_t x, p.rd.Int(v, -1, int64_t{1} << 40));
    if (x == 0) return p.rd.Error("must be -1 (use num_train_epochs) or at least 1 (got 0)");
    return x;
  }));
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
      [](Parse& p, RunConfig&, const toml::node& v) {
        return Into(p.rd.Int(v, 1, kMaxGenerationBatchSize), p.generation_batch_size);
      },
      [](const RunConfig& c) { return OJson(c.generation_batch_size); },
      [](const RunConfig& c) {
        return c.generation_batch_size == c.per_device_train_batch_size * c.steps_per_generation;
      }));
  k.push_back(Deferred(
      "steps_per_generation",
      [](Parse& p, RunConfig&, const toml::node& v) {
        return Into(p.rd.Int(v, 1, kMaxBatchSize), p.steps_per_generation);
      },
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
      [](Parse& p, RunConfig&, const toml::node& v) {
        return Into(p.rd.Float(v, R{.min = 0, .max = 1e6}), p.epsilon_high);
      },
      [](const RunConfig& c) { return OJson(c.epsilon_high); },
      [](const RunConfig& c) { return c.epsilon_high == c.epsilon; }));
  k.push_back(OptFloatKey("delta", &RunConfig::delta, {.min = 1, .min_open = true, .max = 1e6}));
  k.push_back(EnumKey("importance_sampling_level", &RunConfig::importance_sampling_level));
  k.push_back(MemberKey("scale_rewards", &RunConfig::scale_rewards, ReadScaleRewards));
  k.push_back(EnumKey("loss_type", &RunConfig::loss_type, {"cispo", "sapo", "luspo", "vespo"},
                      "a TRL loss ferryd does not implement"));
  k.push_back(BoolKey("mask_truncated_completions", &RunConfig::mask_truncated_completions));
  k.push_back(BoolKey("vllm_importance_sampling_correction", &RunConfig::vllm_importance_sampling_correction));
  k.push_back(Recorded(ChoiceKey("vllm_mode", &RunConfig::vllm_mode, {"server"}), Record::kWhenSet));
  k.push_back(Recorded(MemberKey("vllm_server_base_url", &RunConfig::vllm_server_base_url,
                                 [](Parse& p, const toml::node& v) -> Result<std::string> {
                                   FERRY_ASSIGN_OR_RETURN(std::string s, p.rd.String(v, 2048));
                                   if (s.rfind("http://", 0) != 0 && s.rfind("https://", 0) != 0) {
                                     return p.rd.Error("must start with http:// or https:// (got " + Reader::Show(s) +
                                                       ")");
                                   }
                                   return s;
                                 }),
                       Record::kNever));
  k.push_back(Recorded(MemberKey("vllm_server_host", &RunConfig::vllm_server_host,
                                 [](Parse& p, const toml::node& v) { return p.rd.String(v, 255); }),
                       Record::kNever));
  k.push_back(Recorded(IntKey("vllm_server_port", &RunConfig::vllm_server_port, 1, 65535), Record::kNever));
  k.push_back(Recorded(
      FloatKey("vllm_server_timeout", &RunConfig::vllm_server_timeout, {.min = 0, .min_open = true, .max = 86400}),
      Record::kNever));
  k.push_back(
      Recorded(ChoiceKey("vllm_server_dtype", &RunConfig::vllm_server_dtype, {"float32", "bfloat16", "float16"}),
               Record::kNever));
  k.push_back(Recorded(IntKey("max_staleness", &RunConfig::max_staleness, 0, 1), Record::kWhenSet));
  k.push_back(EnumKey("vllm_importance_sampling_mode", &RunConfig::vllm_importance_sampling_mode));
  KeyInfo clip_max = OptFloatKey("vllm_importance_sampling_clip_max", &RunConfig::vllm_importance_sampling_clip_max,
                                 {.min = 0, .max = kInf, .allow_inf = true});
  clip_max.read = [](Parse& p, RunConfig& c, const toml::node& v) -> Status {
    // TOML has no null: inf stands for TRL's None (no upper bound).
    FERRY_ASSIGN_OR_RETURN(double x, p.rd.Float(v, {.min = 0, .max = kInf, .allow_inf = true}));
    c.vllm_importance_sampling_clip_max = std::isinf(x) ? std::nullopt : std::optional<double>(x);
    return Status::OK();
  };
  k.push_back(std::move(clip_max));
  k.push_back(OptFloatKey("vllm_importance_sampling_clip_min", &RunConfig::vllm_importance_sampling_clip_min,
                          {.min = 0, .max = 1e12}));
  // TRL's deprecated name of clip_max: read as it (Resolve), never written.
  k.push_back(Recorded(Deferred(
                           "vllm_importance_sampling_cap",
                           [](Parse& p, RunConfig&, const toml::node& v) {
                             return Into(p.rd.Float(v, R{.min = 0, .max = 1e12}), p.clip_cap);
                           },
                           [](const RunConfig&) { return OJson(nullptr); }, [](const RunConfig&) { return true; }),
                       Record::kNever));
  k.push_back(BoolKey("use_bias_correction_kl", &RunConfig::use_bias_correction_kl));
  k.push_back(Deferred(
      "reward_weights",
      [](Parse& p, RunConfig&, const toml::node& v) {
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
  using N = NeutralValue;
  constexpr auto Neutral = &NeutralKey<RunConfig>;
  // Written where it stood when only false was accepted: resolved JSON and fingerprints of
  // earlier runs are unchanged.
  k.push_back(BoolKey("use_vllm", &RunConfig::use_vllm));
  k.push_back(Neutral("fp16", N::Bool(false), "computes in fp32, or bf16 with bf16 = true"));
  k.push_back(Neutral("use_liger_kernel", N::Bool(false), "has no Liger kernels"));
  k.push_back(
      Neutral("disable_dropout", N::Bool(false), "does not implement disable_dropout (set lora.lora_dropout = 0)"));
  k.push_back(Neutral("cast_lm_head_to_fp32", N::Bool(false), "does not implement cast_lm_head_to_fp32"));
  k.push_back(Neutral("remove_unused_columns", N::Bool(false), "always keeps every dataset field for the rewards"));
  k.push_back(Neutral("sync_ref_model", N::Bool(false), "does not implement reference-model syncing (TR-DPO)"));
  k.push_back(Neutral("use_adaptive_entropy", N::Bool(false), "has no entropy bonus"));
  k.push_back(Neutral("entropy_coef", N::Float(0.0), "has no entropy bonus"));
  k.push_back(Neutral("top_entropy_quantile", N::Float(1.0), "does not mask tokens by entropy"));
  k.push_back(Neutral("repetition_penalty", N::Float(1.0), "samples without a repetition penalty"));
  k.push_back(Neutral("min_p", N::NoneOrFloat(0.0), "samples without min-p filtering"));
  k.push_back(Neutral("off_policy_mask_threshold", N::None(), "does not implement off-policy sequence masking"));
  k.push_back(Neutral("multi_objective_aggregation", N::String("sum_then_normalize"),
                      "aggregates rewards as TRL's default \"sum_then_normalize\" only"));

  // --- PEFT and rewards (their tables: config_lora.cpp, config_rewards.cpp).
  k.push_back({"lora",
               Record::kAlways,
               {},
               [](Parse& p, RunConfig& c, const toml::node& v) { return ReadLora(p, v, c.lora); },
               [](const RunConfig& c) { return RowsJson(LoraKeys(), c.lora); },
               [](const RunConfig& c) {
                 const auto rows = LoraKeys();
                 return std::all_of(rows.begin(), rows.end(), [&](const auto& r) { return r.at_default(c.lora); });
               }});
  k.push_back(Deferred(
      "rewards",
      [](Parse& p, RunConfig&, const toml::node& v) {
        if (!v.is_array()) return p.rd.Error("must be an array of tables ([[rewards]]), got " + Reader::TypeName(v));
        p.rewards = v.as_array();
        return Status::OK();
      },
      [](const RunConfig& c) {
        OJson rewards = OJson::array();
        for (const RewardSpec& r : c.rewards) {
          OJson j = RowsJson(RewardKeys(r.type), r);
          if (r.type == RewardType::kCommand) j["working_dir"] = r.working_dir.string();  // resolved, not a key
          rewards.push_back(std::move(j));
        }
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

Status ReadStore(Parse& p, const toml::node& v) {
  if (v.is_string()) return Into(ResolvePath(p.rd, v, p.base), p.c.store.path);
  if (!v.is_table()) return p.rd.Error("must be a table ([store]) or a path string (got " + Reader::TypeName(v) + ")");
  return ReadRows(p, *v.as_table(), "store", StoreKeys(), p.c.store, UnknownIn(p, "store", StoreKeys()));
}

}  // namespace ferry::run
