// The [lora] table of the run config, one row per PEFT LoraConfig key (peft 0.21.2,
// peft/tuners/lora/config.py; the matching rules themselves are convert/peft_config.h's), and
// PEFT's rules across its keys. Adding a key: a member of LoraSettings (config.h), one row
// below in the place its JSON (and adapter_config.json) should take, its line in
// docs/daemon.md.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <utility>

#include "daemon/run/config_rows.h"

namespace ferry::run {
namespace {

using OJson = nlohmann::ordered_json;
using Row = KeyInfoT<LoraSettings>;

bool IsAllLinear(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s == "all-linear";
}

// target_modules / exclude_modules: a list of module names, a regex (full match) or "all-linear".
Result<ModuleSelector> ParseSelector(Reader& rd, const toml::node& v, bool allow_all_linear) {
  ModuleSelector sel;
  if (v.is_string()) {
    FERRY_ASSIGN_OR_RETURN(std::string s, rd.String(v, kMaxRegexLength));
    if (s.empty()) return rd.Error("must not be an empty string");
    if (allow_all_linear && IsAllLinear(s)) {
      sel.form = ModuleSelector::Form::kAllLinear;
      sel.pattern = s;
      return sel;
    }
    if (auto groups = CheckRegex(s); !groups.ok()) return rd.Error(groups.status().message());
    sel.form = ModuleSelector::Form::kRegex;
    sel.pattern = s;
    return sel;
  }
  if (!v.is_array())
    return rd.Error("must be a list of module names or a regex string (got " + Reader::TypeName(v) + ")");
  FERRY_ASSIGN_OR_RETURN(sel.names, rd.StringList(v, kMaxConfigListEntries, 1024));
  if (sel.names.empty()) return rd.Error("must not be an empty list");
  for (size_t i = 0; i < sel.names.size(); ++i) {
    if (sel.names[i].empty()) return rd.Error("[" + std::to_string(i) + "] must not be empty");
  }
  sel.form = ModuleSelector::Form::kList;
  return sel;
}

// rank_pattern / alpha_pattern keys in file order (toml++ tables are sorted by key).
std::vector<std::pair<std::string, const toml::node*>> InFileOrder(const toml::table& t) {
  struct Item {
    toml::source_position at;
    std::string key;
    const toml::node* v;
  };
  std::vector<Item> items;
  for (auto&& [k, v] : t) items.push_back({k.source().begin, std::string(k.str()), &v});
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.at.line != b.at.line ? a.at.line < b.at.line : a.at.column < b.at.column;
  });
  std::vector<std::pair<std::string, const toml::node*>> out;
  for (auto& it : items) out.emplace_back(std::move(it.key), it.v);
  return out;
}

Status CheckPatternKey(Reader& rd, const std::string& key) {
  if (key.empty()) return rd.Error("keys must not be empty");
  // PEFT matches re.match(rf"(.*\.)?({key})$", module) (convert/peft_config.h).
  if (auto groups = CheckRegex("(.*\\.)?(" + key + ")$"); !groups.ok()) {
    return rd.Error("key " + Reader::Show(key) + ": " + groups.status().message());
  }
  return Status::OK();
}

// lora_alpha is an int in PEFT's LoraConfig: written as one when it is whole.
OJson AlphaJson(double a) {
  if (a == std::floor(a) && std::fabs(a) < 1e15) return static_cast<int64_t>(a);
  return a;
}

Row SelectorKey(std::string_view name, ModuleSelector LoraSettings::*m, bool allow_all_linear) {
  return {name,
          Record::kAlways,
          {},
          [m, allow_all_linear](Parse& p, LoraSettings& l, const toml::node& v) {
            return Into(ParseSelector(p.rd, v, allow_all_linear), l.*m);
          },
          [m](const LoraSettings& l) -> OJson {
            const ModuleSelector& s = l.*m;
            switch (s.form) {
              case ModuleSelector::Form::kNone: return nullptr;
              case ModuleSelector::Form::kList: return s.names;
              case ModuleSelector::Form::kRegex:
              case ModuleSelector::Form::kAllLinear: return s.pattern;
            }
            return nullptr;
          },
          [m](const LoraSettings& l) { return (l.*m).empty(); }};
}

// rank_pattern / alpha_pattern: a table of pattern = value, kept in file order.
template <typename Entry>
Row PatternKey(std::string_view name, std::vector<Entry> LoraSettings::*m,
               std::function<Result<Entry>(Reader&, const std::string&, const toml::node&)> entry,
               std::function<OJson(const Entry&)> json) {
  return {name,
          Record::kAlways,
          {},
          [name, m, entry](Parse& p, LoraSettings& l, const toml::node& v) -> Status {
            if (!v.is_table()) {
              return p.rd.Error("must be a table of pattern = value (got " + Reader::TypeName(v) + ")");
            }
            const auto items = InFileOrder(*v.as_table());
            if (items.size() > kMaxConfigPatternEntries) return p.rd.Error("has too many keys");
            for (const auto& [pk, pv] : items) {
              FERRY_RETURN_IF_ERROR(CheckPatternKey(p.rd, pk));
              Reader::Scope item(p.rd, "lora." + std::string(name) + "." + pk);
              if (pv->is_table()) {
                return p.rd.Error(
                    "must be a number, not a table: quote pattern keys that contain dots "
                    "(\"model.layers.0.self_attn.q_proj\" = 16)");
              }
              FERRY_ASSIGN_OR_RETURN(Entry e, entry(p.rd, pk, *pv));
              (l.*m).push_back(std::move(e));
            }
            return Status::OK();
          },
          [m, json](const LoraSettings& l) {
            OJson j = OJson::object();
            for (const Entry& e : l.*m) j[e.key] = json(e);
            return j;
          },
          [m](const LoraSettings& l) { return (l.*m).empty(); }};
}

Result<std::vector<int64_t>> ReadLayers(Parse& p, const toml::node& v) {
  if (v.is_integer()) {
    FERRY_ASSIGN_OR_RETURN(int64_t layer, p.rd.Int(v, 0, int64_t{1} << 31));
    return std::vector<int64_t>{layer};
  }
  if (!v.is_array()) {
    return p.rd.Error("must be a layer index or a list of them (got " + Reader::TypeName(v) + ")");
  }
  const toml::array& a = *v.as_array();
  if (a.empty()) return p.rd.Error("must not be an empty list");
  if (a.size() > kMaxConfigListEntries) return p.rd.Error("has too many entries");
  std::vector<int64_t> layers;
  for (size_t i = 0; i < a.size(); ++i) {
    Reader::Scope item(p.rd, "lora.layers_to_transform[" + std::to_string(i) + "]");
    FERRY_ASSIGN_OR_RETURN(int64_t layer, p.rd.Int(a[i], 0, int64_t{1} << 31));
    layers.push_back(layer);
  }
  return layers;
}

Result<std::vector<std::string>> ReadLayersPattern(Parse& p, const toml::node& v) {
  if (v.is_string()) {
    FERRY_ASSIGN_OR_RETURN(std::string s, p.rd.String(v, 1024));
    if (s.empty()) return p.rd.Error("must not be empty");
    return std::vector<std::string>{s};
  }
  FERRY_ASSIGN_OR_RETURN(std::vector<std::string> names, p.rd.StringList(v, 1024, 1024));
  if (names.empty()) return p.rd.Error("must not be an empty list");
  return names;
}

Result<std::string> ReadBias(Parse& p, const toml::node& v) {
  FERRY_ASSIGN_OR_RETURN(std::string s, p.rd.String(v));
  if (s == "all" || s == "lora_only") {
    return p.rd.Unsupported("\"" + s + "\" trains base-layer biases; ferryd trains LoRA factors only (\"none\")");
  }
  if (s != "none") return p.rd.Error("must be \"none\", \"all\" or \"lora_only\" (got " + Reader::Show(s) + ")");
  return s;
}

std::vector<Row> MakeKeys() {
  std::vector<Row> k;
  k.push_back(IntKey("r", &LoraSettings::r, 1, kMaxLoraRank));
  Row alpha = FloatKey("lora_alpha", &LoraSettings::lora_alpha, {.min = 0, .min_open = true, .max = 1e9});
  alpha.value = [](const LoraSettings& l) { return AlphaJson(l.lora_alpha); };
  k.push_back(std::move(alpha));
  k.push_back(FloatKey("lora_dropout", &LoraSettings::lora_dropout, {.min = 0, .max = 1, .max_open = true}));
  Row target = SelectorKey("target_modules", &LoraSettings::target_modules, /*allow_all_linear=*/true);
  target.at_default = [](const LoraSettings& l) {  // Resolve sets PEFT's default
    return l.target_modules.form == ModuleSelector::Form::kList &&
           l.target_modules.names == std::vector<std::string>{"q_proj", "v_proj"};
  };
  k.push_back(std::move(target));
  k.push_back(SelectorKey("exclude_modules", &LoraSettings::exclude_modules, /*allow_all_linear=*/false));
  k.push_back(BoolKey("use_rslora", &LoraSettings::use_rslora));
  k.push_back(PatternKey<RankPatternEntry>(
      "rank_pattern", &LoraSettings::rank_pattern,
      [](Reader& rd, const std::string& key, const toml::node& v) -> Result<RankPatternEntry> {
        FERRY_ASSIGN_OR_RETURN(int64_t r, rd.Int(v, 1, kMaxLoraRank));
        return RankPatternEntry{key, static_cast<int>(r)};
      },
      [](const RankPatternEntry& e) { return OJson(e.rank); }));
  k.push_back(PatternKey<AlphaPatternEntry>(
      "alpha_pattern", &LoraSettings::alpha_pattern,
      [](Reader& rd, const std::string& key, const toml::node& v) -> Result<AlphaPatternEntry> {
        FERRY_ASSIGN_OR_RETURN(double a, rd.Float(v, {.min = 0, .min_open = true, .max = 1e9}));
        return AlphaPatternEntry{key, a};
      },
      [](const AlphaPatternEntry& e) { return AlphaJson(e.alpha); }));
  Row layers = MemberKey("layers_to_transform", &LoraSettings::layers_to_transform, ReadLayers);
  layers.read = [read = layers.read](Parse& p, LoraSettings& l, const toml::node& v) {
    l.layers_to_transform_is_int = v.is_integer();
    return read(p, l, v);
  };
  layers.value = [](const LoraSettings& l) -> OJson {
    if (l.layers_to_transform.empty()) return nullptr;
    if (l.layers_to_transform_is_int) return l.layers_to_transform[0];
    return l.layers_to_transform;
  };
  k.push_back(std::move(layers));
  Row pattern = MemberKey("layers_pattern", &LoraSettings::layers_pattern, ReadLayersPattern);
  pattern.value = [](const LoraSettings& l) {
    return l.layers_pattern.empty() ? OJson(nullptr) : OJson(l.layers_pattern);
  };
  k.push_back(std::move(pattern));
  k.push_back(MemberKey("bias", &LoraSettings::bias, ReadBias));

  // PEFT keys accepted only at the value that turns their feature off (adapter_config.json
  // states them as LoraPeftConfig writes them, not from here).
  const auto Neutral = [](std::string_view name, NeutralValue neutral, std::string_view why) {
    return Recorded(NeutralKey<LoraSettings>(name, neutral, why), Record::kNever);
  };
  for (std::string_view name : {"use_dora", "fan_in_fan_out", "lora_bias", "use_qalora"}) {
    k.push_back(Neutral(name, NeutralValue::Bool(false), "implements plain LoRA only"));
  }
  k.push_back(Neutral("init_lora_weights", NeutralValue::Bool(true),
                      "initialises LoRA as PEFT's default (A Kaiming-uniform, B zero) only"));
  k.push_back(Neutral("task_type", NeutralValue::String("CAUSAL_LM"), "trains causal language models"));
  return k;
}

// PEFT features refused by name rather than as unknown keys.
constexpr std::string_view kPeftUnimplemented[] = {"modules_to_save", "trainable_token_indices", "layer_replication",
                                                   "target_parameters", "alora_invocation_tokens"};

}  // namespace

std::span<const KeyInfoT<LoraSettings>> LoraKeys() {
  static const std::vector<Row>* keys = new std::vector<Row>(MakeKeys());
  return *keys;
}

Status ReadLora(Parse& p, const toml::node& v, LoraSettings& out) {
  Reader& rd = p.rd;
  if (!v.is_table()) return rd.Error("must be a table ([lora]), got " + Reader::TypeName(v));
  const toml::table& t = *v.as_table();
  FERRY_RETURN_IF_ERROR(ReadRows(p, t, "lora", LoraKeys(), out, [&rd](const std::string& key) {
    if (std::find(std::begin(kPeftUnimplemented), std::end(kPeftUnimplemented), key) != std::end(kPeftUnimplemented)) {
      return rd.Unsupported("a PEFT feature ferryd does not implement (it trains LoRA factors only); remove it");
    }
    std::vector<std::string_view> names;
    for (const Row& k : LoraKeys()) {
      if (k.record != Record::kNever) names.push_back(k.name);
    }
    return rd.Error("unknown key in [lora] (PEFT LoraConfig names: " + ListOf(names, "", ", ") + ")");
  }));
  // PEFT's LoraConfig.__post_init__ rules.
  const bool have_layers = t.contains("layers_to_transform"), have_pattern = t.contains("layers_pattern");
  if (out.target_modules.form == ModuleSelector::Form::kRegex && (have_layers || have_pattern)) {
    Reader::Scope scope(rd, have_layers ? "lora.layers_to_transform" : "lora.layers_pattern");
    return rd.Error("cannot be used when target_modules is a regex string (PEFT's rule)");
  }
  if (have_pattern && !have_layers) {
    Reader::Scope scope(rd, "lora.layers_pattern");
    return rd.Error("needs layers_to_transform (PEFT's rule)");
  }
  return Status::OK();
}

}  // namespace ferry::run
