#include "convert/peft_config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <map>
#include <set>

#include <re2/re2.h>
#include <nlohmann/json.hpp>

#include "core/mapped_file.h"

namespace ferry {

struct CompiledRegex {
  std::string source;  // the pattern as written in the config
  std::unique_ptr<RE2> re;
};

struct CompiledPeftPatterns {
  std::vector<CompiledRegex> rank;
  std::vector<CompiledRegex> alpha;
  CompiledRegex target;
  CompiledRegex exclude;
};

namespace {

// Objects are std::map based (logarithmic inserts, whatever the input); the file order of
// rank_pattern / alpha_pattern keys is recorded while parsing (see ParseBoundedJson).
using Json = nlohmann::json;

// Keys of the top-level objects whose order matters, in file order as parsed.
struct ParsedJson {
  Json root;
  std::map<std::string, std::vector<std::string>, std::less<>> key_order;
};

bool KeepsOrder(std::string_view field) { return field == "rank_pattern" || field == "alpha_pattern"; }

constexpr int64_t kRe2MaxMem = int64_t{1} << 20;
constexpr size_t kMaxDescribedChars = 80;
constexpr size_t kMaxKeyLength = 4096;
constexpr std::string_view kKeyPrefix = "base_model.model.";

// ---------------------------------------------------------------------------------
// Strings and regexes.

bool EndsWithSegment(std::string_view name, std::string_view suffix) {
  return name.size() > suffix.size() && name.substr(name.size() - suffix.size()) == suffix &&
         name[name.size() - suffix.size() - 1] == '.';
}

bool IsDigits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::vector<std::string_view> SplitDots(std::string_view s) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (true) {
    const size_t dot = s.find('.', start);
    parts.push_back(s.substr(start, dot == std::string_view::npos ? std::string_view::npos : dot - start));
    if (dot == std::string_view::npos) return parts;
    start = dot + 1;
  }
}

std::string JoinDots(const std::vector<std::string_view>& parts, size_t begin, size_t end) {
  std::string out;
  for (size_t i = begin; i < end; ++i) {
    if (i > begin) out += '.';
    out += parts[i];
  }
  return out;
}

RE2::Options Re2Options() {
  RE2::Options options;
  options.set_log_errors(false);
  options.set_max_mem(kRe2MaxMem);
  return options;
}

// The regex PEFT builds from a rank_pattern / alpha_pattern key.
std::string WrapPatternKey(std::string_view key) { return "(.*\\.)?(" + std::string(key) + ")$"; }

// re.match: anchored at the start only.
bool MatchAtStart(const RE2& re, std::string_view text) {
  return re.Match(text, 0, text.size(), RE2::ANCHOR_START, nullptr, 0);
}

bool PatternKeyMatches(const std::vector<CompiledRegex>* cache, size_t i, const std::string& key,
                       std::string_view module) {
  if (cache != nullptr && i < cache->size() && (*cache)[i].source == key && (*cache)[i].re) {
    return MatchAtStart(*(*cache)[i].re, module);
  }
  const RE2 re(WrapPatternKey(key), Re2Options());
  return re.ok() && MatchAtStart(re, module);
}

bool RegexFullMatches(const CompiledRegex* cache, const std::string& pattern, std::string_view module) {
  if (cache != nullptr && cache->source == pattern && cache->re) return RE2::FullMatch(module, *cache->re);
  const RE2 re(pattern, Re2Options());
  return re.ok() && RE2::FullMatch(module, re);
}

bool BackreferenceError(const RE2& re) {
  const std::string& arg = re.error_arg();
  return arg.size() >= 2 && arg[0] == '\\' && arg[1] >= '0' && arg[1] <= '9';
}

// Compiles `regex` (built from `pattern`, as written in `field`), or says why not.
Result<std::unique_ptr<RE2>> CompileConfigRegex(std::string_view src, std::string_view field,
                                                const std::string& pattern, const std::string& regex) {
  const std::string where = std::string(src) + ": field '" + std::string(field) + "' pattern \"" + pattern + "\"";
  if (pattern.size() > kMaxConfigPatternLength) {
    return Status::Unsupported(std::string(src) + ": field '" + std::string(field) + "' has a pattern of " +
                               std::to_string(pattern.size()) + " chars; the limit is " +
                               std::to_string(kMaxConfigPatternLength));
  }
  auto re = std::make_unique<RE2>(regex, Re2Options());
  if (re->ok()) return re;
  const RE2::ErrorCode code = re->error_code();
  if (code == RE2::ErrorBadPerlOp || (code == RE2::ErrorBadEscape && BackreferenceError(*re))) {
    return Status::Unsupported(
        where + " uses a Python regex feature RE2 cannot run (lookaround or backreference): " + re->error());
  }
  if (code == RE2::ErrorPatternTooLarge || code == RE2::ErrorRepeatSize) {
    return Status::Unsupported(where + " is too large for Ferry's regex engine: " + re->error());
  }
  return Status::Corruption(where + " is not a valid regular expression: " + re->error());
}

// ---------------------------------------------------------------------------------
// JSON access. Every value is type-checked before use; containers are never copied or
// dumped, so hostile nesting cannot recurse.

std::string Describe(const Json& v) {
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  std::string text = v.dump();
  if (text.size() > kMaxDescribedChars) {
    size_t cut = kMaxDescribedChars;
    while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
    text = text.substr(0, cut) + "...";
  }
  return text;
}

Status FieldError(std::string_view src, std::string_view field, std::string_view must, const Json& got) {
  return Status::Corruption(std::string(src) + ": field '" + std::string(field) + "' must be " + std::string(must) +
                            ", got " + Describe(got));
}

Status TooMany(std::string_view src, std::string_view field, size_t n, size_t limit) {
  return Status::Unsupported(std::string(src) + ": field '" + std::string(field) + "' has " + std::to_string(n) +
                             " entries; the limit is " + std::to_string(limit));
}

std::optional<int64_t> AsInt64(const Json& v) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  return std::nullopt;
}

// The value of `field`, or nullptr when absent or null.
const Json* Find(const Json& obj, std::string_view field) {
  auto it = obj.find(std::string(field));
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

Status LimitError(std::string_view src, bool too_deep) {
  if (too_deep) {
    return Status::Unsupported(std::string(src) + ": JSON nested deeper than " + std::to_string(kMaxConfigJsonDepth));
  }
  return Status::Unsupported(std::string(src) + ": a JSON object has more than " +
                             std::to_string(kMaxConfigObjectKeys) + " keys");
}

Result<ParsedJson> ParseBoundedJson(std::string_view text, std::string_view src) {
  if (text.size() > kMaxAdapterConfigBytes) {
    return Status::Unsupported(std::string(src) + ": " + std::to_string(text.size()) +
                               " bytes; an adapter config may be at most " + std::to_string(kMaxAdapterConfigBytes));
  }
  ParsedJson parsed;
  bool too_deep = false;
  bool too_many_keys = false;
  std::vector<size_t> keys(kMaxConfigJsonDepth + 2, 0);
  std::vector<std::string>* order = nullptr;  // the ordered object being parsed, if any
  Json::parser_callback_t limit = [&](int depth, Json::parse_event_t event, Json& value) {
    const auto d = static_cast<size_t>(depth);
    if (d > kMaxConfigJsonDepth) {
      too_deep = true;
      return false;
    }
    if (event == Json::parse_event_t::object_start) keys[d + 1] = 0;
    if (event != Json::parse_event_t::key) return true;
    if (++keys[d] > kMaxConfigObjectKeys) {
      too_many_keys = true;
      return false;
    }
    const std::string& key = value.get_ref<const std::string&>();
    if (d == 1) {
      order = KeepsOrder(key) ? &parsed.key_order[key] : nullptr;
      if (order != nullptr) order->clear();  // a repeated key replaces the earlier value
    } else if (d == 2 && order != nullptr) {
      order->push_back(key);
    }
    return true;
  };
  try {
    parsed.root = Json::parse(text.begin(), text.end(), limit, /*allow_exceptions=*/true);
  } catch (const nlohmann::json::exception& e) {
    if (too_deep || too_many_keys) return LimitError(src, too_deep);
    std::string what = e.what();
    if (const size_t close = what.find("] "); what.rfind("[json.exception", 0) == 0 && close != std::string::npos) {
      what = what.substr(close + 2);
    }
    return Status::Corruption(std::string(src) + ": not valid JSON: " + what);
  }
  if (too_deep || too_many_keys) return LimitError(src, too_deep);
  const Json& j = parsed.root;
  if (j.is_discarded()) return Status::Corruption(std::string(src) + ": not valid JSON");
  if (!j.is_object()) return Status::Corruption(std::string(src) + ": not a JSON object (got " + Describe(j) + ")");
  return parsed;
}

// Field readers: absent or null leaves *out unchanged.

Status ReadString(const Json& obj, std::string_view src, std::string_view field, std::string* out) {
  const Json* v = Find(obj, field);
  if (v == nullptr) return Status::OK();
  if (!v->is_string()) return FieldError(src, field, "a string", *v);
  *out = v->get<std::string>();
  return Status::OK();
}

Status ReadBool(const Json& obj, std::string_view src, std::string_view field, bool* out) {
  const Json* v = Find(obj, field);
  if (v == nullptr) return Status::OK();
  if (!v->is_boolean()) return FieldError(src, field, "true or false", *v);
  *out = v->get<bool>();
  return Status::OK();
}

Result<int> CheckRank(const Json& v, std::string_view src, std::string_view field) {
  const std::optional<int64_t> r = AsInt64(v);
  if (!r.has_value() || *r <= 0) {
    if (!r.has_value() && v.is_number_unsigned()) {
      return Status::Unsupported(std::string(src) + ": field '" + std::string(field) + "' is " + Describe(v) +
                                 "; the largest rank Ferry accepts is " + std::to_string(kMaxLoraRank));
    }
    return FieldError(src, field, "a positive integer", v);
  }
  if (*r > kMaxLoraRank) {
    return Status::Unsupported(std::string(src) + ": field '" + std::string(field) + "' is " + std::to_string(*r) +
                               "; the largest rank Ferry accepts is " + std::to_string(kMaxLoraRank));
  }
  return static_cast<int>(*r);
}

Result<double> CheckAlpha(const Json& v, std::string_view src, std::string_view field) {
  if (!v.is_number() || !std::isfinite(v.get<double>())) return FieldError(src, field, "a finite number", v);
  return v.get<double>();
}

Status ReadStringList(const Json& v, std::string_view src, std::string_view field, std::vector<std::string>* out) {
  if (!v.is_array()) return FieldError(src, field, "a list of strings", v);
  if (v.size() > kMaxConfigListEntries) return TooMany(src, field, v.size(), kMaxConfigListEntries);
  out->clear();
  for (const Json& e : v) {
    if (!e.is_string()) return FieldError(src, field, "a list of strings", e);
    out->push_back(e.get<std::string>());
  }
  return Status::OK();
}

Status ReadIntList(const Json& v, std::string_view src, std::string_view field, int64_t max_value,
                   std::vector<int64_t>* out) {
  const std::string must = "a list of integers in [0, " + std::to_string(max_value) + "]";
  if (!v.is_array()) return FieldError(src, field, must, v);
  if (v.size() > kMaxConfigListEntries) return TooMany(src, field, v.size(), kMaxConfigListEntries);
  out->clear();
  for (const Json& e : v) {
    const std::optional<int64_t> i = AsInt64(e);
    if (!i.has_value() || *i < 0 || *i > max_value) return FieldError(src, field, must, e);
    out->push_back(*i);
  }
  return Status::OK();
}

Status ReadSelector(const Json& obj, std::string_view src, std::string_view field, ModuleSelector* out) {
  const Json* v = Find(obj, field);
  if (v == nullptr) return Status::OK();
  if (v->is_string()) {
    out->pattern = v->get<std::string>();
    out->form = Lower(out->pattern) == "all-linear" && field == "target_modules" ? ModuleSelector::Form::kAllLinear
                                                                                 : ModuleSelector::Form::kRegex;
    return Status::OK();
  }
  if (!v->is_array()) return FieldError(src, field, "a list of module names or a regex string", *v);
  out->form = ModuleSelector::Form::kList;
  return ReadStringList(*v, src, field, &out->names);
}

// Reads an object of pattern: value in the file order given by `order`.
template <typename Entry, typename Check>
Status ReadPattern(const ParsedJson& parsed, std::string_view src, std::string_view field, std::vector<Entry>* out,
                   Check check) {
  const Json* v = Find(parsed.root, field);
  if (v == nullptr) return Status::OK();
  if (!v->is_object()) return FieldError(src, field, "an object of pattern: value", *v);
  if (v->size() > kMaxConfigPatternEntries) return TooMany(src, field, v->size(), kMaxConfigPatternEntries);
  const auto order = parsed.key_order.find(field);
  if (order == parsed.key_order.end())
    return Status::Internal(std::string(src) + ": lost the key order of " + std::string(field));
  std::set<std::string_view> seen;
  for (const std::string& key : order->second) {
    if (!seen.insert(key).second) continue;  // a repeated key keeps its first position, as in Python
    const auto it = v->find(key);
    if (it == v->end()) continue;
    const std::string entry_field = std::string(field) + "[\"" + key + "\"]";
    FERRY_ASSIGN_OR_RETURN(auto value, check(*it, src, entry_field));
    out->push_back({key, value});
  }
  if (out->size() != v->size()) return Status::Internal(std::string(src) + ": lost keys of " + std::string(field));
  return Status::OK();
}

Status ReadInitLoraWeights(const Json& obj, std::string_view src, PeftConfig* c) {
  const Json* v = Find(obj, "init_lora_weights");
  if (v == nullptr) return Status::OK();
  if (v->is_boolean()) {
    c->init_lora_weights = v->get<bool>();
  } else if (v->is_string()) {
    c->init_lora_weights = v->get<std::string>();
  } else {
    return FieldError(src, "init_lora_weights", "true, false or a method name", *v);
  }
  return Status::OK();
}

Status ReadLayers(const Json& obj, std::string_view src, PeftConfig* c) {
  if (const Json* v = Find(obj, "layers_to_transform")) {
    if (const std::optional<int64_t> i = AsInt64(*v)) {
      if (*i < 0) return FieldError(src, "layers_to_transform", "a non-negative integer or a list of them", *v);
      c->layers_to_transform = {*i};
      c->layers_to_transform_is_int = true;
    } else {
      FERRY_RETURN_IF_ERROR(
          ReadIntList(*v, src, "layers_to_transform", std::numeric_limits<int64_t>::max(), &c->layers_to_transform));
    }
  }
  if (const Json* v = Find(obj, "layers_pattern")) {
    if (v->is_string()) {
      c->layers_pattern = {v->get<std::string>()};
    } else {
      FERRY_RETURN_IF_ERROR(ReadStringList(*v, src, "layers_pattern", &c->layers_pattern));
    }
  }
  if (!c->layers_to_transform.empty() && c->target_modules.form == ModuleSelector::Form::kRegex) {
    return Status::Corruption(std::string(src) +
                              ": field 'layers_to_transform' cannot be used when 'target_modules' is a regex string "
                              "(PEFT refuses this config too)");
  }
  return Status::OK();
}

Status ReadTrainableTokens(const Json& obj, std::string_view src, PeftConfig* c) {
  const Json* v = Find(obj, "trainable_token_indices");
  if (v == nullptr) return Status::OK();
  if (v->is_array())
    return ReadIntList(*v, src, "trainable_token_indices", kMaxTokenId, &c->trainable_token_indices.embedding);
  if (!v->is_object()) return FieldError(src, "trainable_token_indices", "a list of token ids or an object", *v);
  for (auto it = v->begin(); it != v->end(); ++it) {
    std::vector<int64_t> ids;
    FERRY_RETURN_IF_ERROR(
        ReadIntList(it.value(), src, "trainable_token_indices[\"" + it.key() + "\"]", kMaxTokenId, &ids));
    c->trainable_token_indices.by_module.emplace_back(it.key(), std::move(ids));
  }
  return Status::OK();
}

Status ReadBias(const Json& obj, std::string_view src, PeftConfig* c) {
  const Json* v = Find(obj, "bias");
  if (v == nullptr) return Status::OK();
  const std::string s = v->is_string() ? v->get<std::string>() : std::string();
  if (s == "none") {
    c->bias = PeftBias::kNone;
  } else if (s == "all") {
    c->bias = PeftBias::kAll;
  } else if (s == "lora_only") {
    c->bias = PeftBias::kLoraOnly;
  } else {
    return FieldError(src, "bias", "\"none\", \"all\" or \"lora_only\"", *v);
  }
  return Status::OK();
}

Status ReadScalars(const Json& obj, std::string_view src, PeftConfig* c) {
  FERRY_RETURN_IF_ERROR(ReadString(obj, src, "peft_type", &c->peft_type));
  FERRY_RETURN_IF_ERROR(ReadString(obj, src, "task_type", &c->task_type));
  FERRY_RETURN_IF_ERROR(ReadString(obj, src, "base_model_name_or_path", &c->base_model_name_or_path));
  FERRY_RETURN_IF_ERROR(
      ReadString(obj, src, "path_initial_model_for_weight_conversion", &c->path_initial_model_for_weight_conversion));
  if (const Json* v = Find(obj, "r")) {
    FERRY_ASSIGN_OR_RETURN(c->r, CheckRank(*v, src, "r"));
  }
  if (const Json* v = Find(obj, "lora_alpha")) {
    FERRY_ASSIGN_OR_RETURN(c->lora_alpha, CheckAlpha(*v, src, "lora_alpha"));
  }
  FERRY_RETURN_IF_ERROR(ReadBool(obj, src, "use_rslora", &c->use_rslora));
  FERRY_RETURN_IF_ERROR(ReadBool(obj, src, "use_dora", &c->use_dora));
  FERRY_RETURN_IF_ERROR(ReadBool(obj, src, "use_qalora", &c->use_qalora));
  FERRY_RETURN_IF_ERROR(ReadBool(obj, src, "fan_in_fan_out", &c->fan_in_fan_out));
  FERRY_RETURN_IF_ERROR(ReadBool(obj, src, "lora_bias", &c->lora_bias));
  FERRY_RETURN_IF_ERROR(ReadBias(obj, src, c));
  return ReadInitLoraWeights(obj, src, c);
}

Status ReadModuleFields(const ParsedJson& parsed, std::string_view src, PeftConfig* c) {
  const Json& obj = parsed.root;
  FERRY_RETURN_IF_ERROR(ReadSelector(obj, src, "target_modules", &c->target_modules));
  FERRY_RETURN_IF_ERROR(ReadSelector(obj, src, "exclude_modules", &c->exclude_modules));
  if (const Json* v = Find(obj, "modules_to_save")) {
    FERRY_RETURN_IF_ERROR(ReadStringList(*v, src, "modules_to_save", &c->modules_to_save));
  }
  if (const Json* v = Find(obj, "target_parameters")) {
    FERRY_RETURN_IF_ERROR(ReadStringList(*v, src, "target_parameters", &c->target_parameters));
  }
  if (const Json* v = Find(obj, "alora_invocation_tokens")) {
    FERRY_RETURN_IF_ERROR(ReadIntList(*v, src, "alora_invocation_tokens", kMaxTokenId, &c->alora_invocation_tokens));
  }
  c->has_layer_replication = Find(obj, "layer_replication") != nullptr;
  FERRY_RETURN_IF_ERROR(ReadPattern(parsed, src, "rank_pattern", &c->rank_pattern, CheckRank));
  FERRY_RETURN_IF_ERROR(ReadPattern(parsed, src, "alpha_pattern", &c->alpha_pattern, CheckAlpha));
  FERRY_RETURN_IF_ERROR(ReadLayers(obj, src, c));
  return ReadTrainableTokens(obj, src, c);
}

template <typename Entry>
Result<std::vector<CompiledRegex>> CompilePatternKeys(std::string_view src, std::string_view field,
                                                      const std::vector<Entry>& entries) {
  std::vector<CompiledRegex> out;
  out.reserve(entries.size());
  for (const Entry& e : entries) {
    FERRY_ASSIGN_OR_RETURN(auto re, CompileConfigRegex(src, field, e.key, WrapPatternKey(e.key)));
    out.push_back({e.key, std::move(re)});
  }
  return out;
}

Result<CompiledRegex> CompileSelector(std::string_view src, std::string_view field, const ModuleSelector& s) {
  if (s.form != ModuleSelector::Form::kRegex) return CompiledRegex{};
  FERRY_ASSIGN_OR_RETURN(auto re, CompileConfigRegex(src, field, s.pattern, s.pattern));
  return CompiledRegex{s.pattern, std::move(re)};
}

Result<std::shared_ptr<const CompiledPeftPatterns>> CompileAll(const PeftConfig& c) {
  auto compiled = std::make_shared<CompiledPeftPatterns>();
  FERRY_ASSIGN_OR_RETURN(compiled->rank, CompilePatternKeys(c.source, "rank_pattern", c.rank_pattern));
  FERRY_ASSIGN_OR_RETURN(compiled->alpha, CompilePatternKeys(c.source, "alpha_pattern", c.alpha_pattern));
  FERRY_ASSIGN_OR_RETURN(compiled->target, CompileSelector(c.source, "target_modules", c.target_modules));
  FERRY_ASSIGN_OR_RETURN(compiled->exclude, CompileSelector(c.source, "exclude_modules", c.exclude_modules));
  return std::shared_ptr<const CompiledPeftPatterns>(std::move(compiled));
}

bool ListSelects(const std::vector<std::string>& names, std::string_view module) {
  return std::any_of(names.begin(), names.end(),
                     [&](const std::string& n) { return module == n || EndsWithSegment(module, n); });
}

bool IsOutputOrEmbedding(std::string_view module) {
  static constexpr std::string_view kNames[] = {
      "lm_head",         "embed_out",           "embed_tokens",          "wte",           "wpe",
      "word_embeddings", "position_embeddings", "token_type_embeddings", "tok_embeddings"};
  const size_t dot = module.rfind('.');
  const std::string_view last = dot == std::string_view::npos ? module : module.substr(dot + 1);
  return std::find(std::begin(kNames), std::end(kNames), last) != std::end(kNames);
}

// ---------------------------------------------------------------------------------
// Refusals.

Status RefuseInit(const PeftConfig& c, std::string_view method) {
  const std::string head = c.source + ": init_lora_weights is \"" + std::get<std::string>(c.init_lora_weights) + "\": ";
  const std::string convert =
      "; re-save the adapter with save_pretrained(..., path_initial_model_for_weight_conversion=<the initial "
      "adapter>) to convert it into a plain LoRA of the original base";
  if (method == "pissa") {
    return Status::Unsupported(head +
                               "PiSSA training replaced the base weights with a residual (W minus its principal "
                               "components), so this adapter does not merge into the original base" +
                               convert);
  }
  if (method == "olora") {
    return Status::Unsupported(head +
                               "OLoRA training replaced the base weights with a residual (W minus its QR "
                               "component), so this adapter does not merge into the original base" +
                               convert);
  }
  if (method == "corda") {
    return Status::Unsupported(head +
                               "CorDA training replaced the base weights with a residual (W minus its "
                               "context-oriented components), so this adapter does not merge into the original base" +
                               convert);
  }
  return Status::Unsupported(head +
                             "LoftQ replaced the base weights with a quantized residual, so this adapter "
                             "does not merge into the original base; merge it with PEFT into the LoftQ-initialised "
                             "base it was trained on");
}

}  // namespace

std::string_view PeftBiasName(PeftBias bias) {
  switch (bias) {
    case PeftBias::kNone: return "none";
    case PeftBias::kAll: return "all";
    case PeftBias::kLoraOnly: return "lora_only";
  }
  return "none";
}

Result<PeftConfig> ParsePeftConfig(std::string_view json_text, std::string_view source_name) {
  FERRY_ASSIGN_OR_RETURN(const ParsedJson parsed, ParseBoundedJson(json_text, source_name));
  PeftConfig c;
  c.source = std::string(source_name);
  FERRY_RETURN_IF_ERROR(ReadScalars(parsed.root, source_name, &c));
  FERRY_RETURN_IF_ERROR(ReadModuleFields(parsed, source_name, &c));
  FERRY_ASSIGN_OR_RETURN(c.compiled, CompileAll(c));
  c.raw_json = std::string(json_text);
  return c;
}

Result<PeftConfig> LoadPeftConfig(const std::filesystem::path& adapter_dir_or_file) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path file = adapter_dir_or_file;
  if (fs::is_directory(file, ec)) file /= "adapter_config.json";
  if (!fs::exists(file, ec)) {
    return Status::NotFound(file.string() + ": no such file (a PEFT adapter directory holds adapter_config.json)");
  }
  FERRY_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(file, kMaxAdapterConfigBytes));
  return ParsePeftConfig(text, file.string());
}

int PeftConfig::RankFor(std::string_view module) const {
  const auto* cache = compiled ? &compiled->rank : nullptr;
  for (size_t i = 0; i < rank_pattern.size(); ++i) {
    if (PatternKeyMatches(cache, i, rank_pattern[i].key, module)) return rank_pattern[i].rank;
  }
  return r;
}

double PeftConfig::AlphaFor(std::string_view module) const {
  const auto* cache = compiled ? &compiled->alpha : nullptr;
  for (size_t i = 0; i < alpha_pattern.size(); ++i) {
    if (PatternKeyMatches(cache, i, alpha_pattern[i].key, module)) return alpha_pattern[i].alpha;
  }
  return lora_alpha;
}

double PeftConfig::ScalingFor(std::string_view module) const {
  const double rank = static_cast<double>(RankFor(module));
  return AlphaFor(module) / (use_rslora ? std::sqrt(rank) : rank);
}

bool PeftConfig::IsExcluded(std::string_view module) const {
  switch (exclude_modules.form) {
    case ModuleSelector::Form::kList: return ListSelects(exclude_modules.names, module);
    case ModuleSelector::Form::kRegex:
      return RegexFullMatches(compiled ? &compiled->exclude : nullptr, exclude_modules.pattern, module);
    case ModuleSelector::Form::kNone:
    case ModuleSelector::Form::kAllLinear: return false;
  }
  return false;
}

bool PeftConfig::IsModuleToSave(std::string_view module) const { return ListSelects(modules_to_save, module); }

std::optional<int64_t> PeftConfig::LayerIndexOf(std::string_view module) const {
  static const std::vector<std::string> kDefaultNames = {"layers", "h", "blocks", "layer"};
  const std::vector<std::string>& names = layers_pattern.empty() ? kDefaultNames : layers_pattern;
  const std::vector<std::string_view> parts = SplitDots(module);
  for (size_t i = 1; i + 1 < parts.size(); ++i) {
    if (!IsDigits(parts[i]) || parts[i].size() > 18) continue;
    if (std::find(names.begin(), names.end(), parts[i - 1]) == names.end()) continue;
    return std::stoll(std::string(parts[i]));
  }
  return std::nullopt;
}

bool PeftConfig::IsTargeted(std::string_view module, std::optional<size_t> weight_ndim) const {
  if (IsExcluded(module)) return false;
  bool found = false;
  switch (target_modules.form) {
    case ModuleSelector::Form::kNone: return false;
    case ModuleSelector::Form::kRegex:
      return RegexFullMatches(compiled ? &compiled->target : nullptr, target_modules.pattern, module);
    case ModuleSelector::Form::kList:
      if (std::find(target_modules.names.begin(), target_modules.names.end(), module) != target_modules.names.end()) {
        return true;
      }
      found = ListSelects(target_modules.names, module);
      break;
    case ModuleSelector::Form::kAllLinear:
      found = !IsOutputOrEmbedding(module) && (!weight_ndim.has_value() || *weight_ndim == 2);
      break;
  }
  if (!found || layers_to_transform.empty()) return found;
  const std::optional<int64_t> layer = LayerIndexOf(module);
  return layer.has_value() &&
         std::find(layers_to_transform.begin(), layers_to_transform.end(), *layer) != layers_to_transform.end();
}

Status PeftConfig::CheckMergeable() const {
  if (peft_type.empty()) {
    return Status::Unsupported(source +
                               ": field 'peft_type' is missing; Ferry merges LoRA adapters only "
                               "(peft_type \"LORA\"); re-save the adapter with PEFT");
  }
  if (peft_type != "LORA") {
    return Status::Unsupported(source + ": peft_type is \"" + peft_type +
                               "\", not \"LORA\": Ferry merges LoRA "
                               "adapters only; merge this adapter with PEFT (merge_and_unload) and convert the merged "
                               "model instead");
  }
  if (const auto* init = std::get_if<std::string>(&init_lora_weights);
      init != nullptr && path_initial_model_for_weight_conversion.empty()) {
    const std::string method = Lower(*init);
    for (std::string_view m : {"pissa", "olora", "corda", "loftq"}) {
      if (method.rfind(m, 0) == 0) return RefuseInit(*this, m);
    }
  }
  if (!alora_invocation_tokens.empty()) {
    return Status::Unsupported(source +
                               ": alora_invocation_tokens is set: an activated LoRA (aLoRA) applies only "
                               "after its invocation tokens and cannot be merged into the weights; serve it as an "
                               "adapter with an engine that supports aLoRA");
  }
  if (!target_parameters.empty()) {
    return Status::Unsupported(source +
                               ": target_parameters is set: LoRA on raw parameters (such as MoE expert "
                               "tensors) is not supported by Ferry; merge it with PEFT (merge_and_unload) instead");
  }
  if (has_layer_replication) {
    return Status::Unsupported(source +
                               ": layer_replication is set: the adapted model has layers its base lacks; "
                               "merge it with PEFT (merge_and_unload) instead");
  }
  if (use_qalora) {
    return Status::Unsupported(source +
                               ": use_qalora is true: QA-LoRA pools the input before lora_A and does not "
                               "merge like LoRA; merge it with PEFT (merge_and_unload) instead");
  }
  return Status::OK();
}

// ---------------------------------------------------------------------------------
// Adapter keys.

std::string_view AdapterKeyKindName(AdapterKey::Kind kind) {
  switch (kind) {
    case AdapterKey::kLoraA: return "lora_A";
    case AdapterKey::kLoraB: return "lora_B";
    case AdapterKey::kLoraBBias: return "lora_B.bias";
    case AdapterKey::kEmbeddingA: return "lora_embedding_A";
    case AdapterKey::kEmbeddingB: return "lora_embedding_B";
    case AdapterKey::kMagnitude: return "lora_magnitude_vector";
    case AdapterKey::kModulesToSave: return "modules_to_save";
    case AdapterKey::kTrainableTokens: return "trainable_tokens_delta";
    case AdapterKey::kBaseLayer: return "base_layer";
    case AdapterKey::kOther: return "other";
  }
  return "other";
}

namespace {

constexpr std::string_view kMarkers[] = {
    "lora_A",          "lora_B",        "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector",
    "modules_to_save", "token_adapter", "base_layer"};

bool IsMarker(std::string_view s) {
  return std::find(std::begin(kMarkers), std::end(kMarkers), s) != std::end(kMarkers);
}

// Fills kind / adapter_name / param from the segments after the marker; false when the
// form is not one PEFT writes.
bool ClassifyMarker(std::string_view marker, const std::vector<std::string_view>& rest, AdapterKey* k) {
  const size_t n = rest.size();
  const auto last_is = [&](std::string_view s) { return n > 0 && rest[n - 1] == s; };
  if (marker == "lora_A" || marker == "lora_B") {
    if (n < 1 || n > 2) return false;
    if (n == 2) k->adapter_name = std::string(rest[0]);
    if (last_is("weight")) {
      k->kind = marker == "lora_A" ? AdapterKey::kLoraA : AdapterKey::kLoraB;
      return true;
    }
    k->kind = AdapterKey::kLoraBBias;
    return marker == "lora_B" && last_is("bias");
  }
  if (marker == "lora_embedding_A" || marker == "lora_embedding_B") {
    if (n > 1) return false;
    if (n == 1) k->adapter_name = std::string(rest[0]);
    k->kind = marker == "lora_embedding_A" ? AdapterKey::kEmbeddingA : AdapterKey::kEmbeddingB;
    return true;
  }
  if (marker == "lora_magnitude_vector") {
    const size_t named = last_is("weight") ? n - 1 : n;
    if (named > 1) return false;
    if (named == 1) k->adapter_name = std::string(rest[0]);
    k->kind = AdapterKey::kMagnitude;
    return true;
  }
  if (marker == "token_adapter") {
    if (n < 1 || n > 2 || rest[0] != "trainable_tokens_delta") return false;
    if (n == 2) k->adapter_name = std::string(rest[1]);
    k->kind = AdapterKey::kTrainableTokens;
    return true;
  }
  if (marker == "modules_to_save") {
    if (n < 2) return false;
    k->adapter_name = std::string(rest[0]);
    for (size_t i = 1; i + 1 < n; ++i) k->module += "." + std::string(rest[i]);
    k->param = std::string(rest[n - 1]);
    k->kind = AdapterKey::kModulesToSave;
    return true;
  }
  if (n < 1) return false;  // base_layer
  for (size_t i = 0; i + 1 < n; ++i) k->module += "." + std::string(rest[i]);
  k->param = std::string(rest[n - 1]);
  k->kind = AdapterKey::kBaseLayer;
  return true;
}

}  // namespace

Result<AdapterKey> ParseAdapterKey(std::string_view key, const PeftConfig* config) {
  const std::string quoted = "tensor '" + std::string(key.substr(0, std::min(key.size(), kMaxKeyLength))) + "'";
  if (key.empty() || key.size() > kMaxKeyLength) {
    return Status::Corruption(quoted + ": a tensor name must have 1 to " + std::to_string(kMaxKeyLength) + " chars");
  }
  AdapterKey k;
  if (key.substr(0, kKeyPrefix.size()) == kKeyPrefix) {
    k.had_prefix = true;
    key.remove_prefix(kKeyPrefix.size());
  }
  const std::vector<std::string_view> parts = SplitDots(key);
  if (std::any_of(parts.begin(), parts.end(), [](std::string_view p) { return p.empty(); })) {
    return Status::Corruption(quoted + ": empty segment in the name");
  }
  const auto marker = std::find_if(parts.begin(), parts.end(), IsMarker);
  if (marker == parts.end()) {
    k.module = JoinDots(parts, 0, parts.size() - 1);
    k.param = std::string(parts.back());
    k.kind = config != nullptr && config->IsModuleToSave(k.module) ? AdapterKey::kModulesToSave : AdapterKey::kOther;
    return k;
  }
  const auto m = static_cast<size_t>(marker - parts.begin());
  if (m == 0) return Status::Corruption(quoted + ": no module name before '" + std::string(*marker) + "'");
  k.module = JoinDots(parts, 0, m);
  const std::vector<std::string_view> rest(marker + 1, parts.end());
  if (!ClassifyMarker(*marker, rest, &k)) {
    return Status::Corruption(quoted + ": '" + std::string(*marker) + "' in a form PEFT does not write");
  }
  return k;
}

}  // namespace ferry
