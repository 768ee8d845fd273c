// The [lora] table of the run config: PEFT LoraConfig names and rules (peft 0.21.2,
// peft/tuners/lora/config.py; the matching rules themselves are convert/peft_config.h's).
#include <algorithm>
#include <cctype>
#include <utility>

#include "daemon/run/config_internal.h"

namespace ferry::run {
namespace {

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

}  // namespace

Status ParseLora(Reader& rd, const toml::node& v, LoraSettings& out) {
  if (!v.is_table()) return rd.Error("must be a table ([lora]), got " + Reader::TypeName(v));
  bool have_layers = false, have_pattern = false;
  for (auto&& [k, val] : *v.as_table()) {
    const std::string key(k.str());
    Reader::Scope scope(rd, "lora." + key);
    if (key == "r") {
      FERRY_ASSIGN_OR_RETURN(int64_t r, rd.Int(val, 1, kMaxLoraRank));
      out.r = static_cast<int>(r);
    } else if (key == "lora_alpha") {
      FERRY_ASSIGN_OR_RETURN(out.lora_alpha, rd.Float(val, {.min = 0, .min_open = true, .max = 1e9}));
    } else if (key == "lora_dropout") {
      FERRY_ASSIGN_OR_RETURN(out.lora_dropout, rd.Float(val, {.min = 0, .max = 1, .max_open = true}));
    } else if (key == "target_modules") {
      FERRY_ASSIGN_OR_RETURN(out.target_modules, ParseSelector(rd, val, /*allow_all_linear=*/true));
    } else if (key == "exclude_modules") {
      FERRY_ASSIGN_OR_RETURN(out.exclude_modules, ParseSelector(rd, val, /*allow_all_linear=*/false));
    } else if (key == "use_rslora") {
      FERRY_ASSIGN_OR_RETURN(out.use_rslora, rd.Bool(val));
    } else if (key == "rank_pattern" || key == "alpha_pattern") {
      if (!val.is_table()) return rd.Error("must be a table of pattern = value (got " + Reader::TypeName(val) + ")");
      const auto items = InFileOrder(*val.as_table());
      if (items.size() > kMaxConfigPatternEntries) return rd.Error("has too many keys");
      for (const auto& [pk, pv] : items) {
        FERRY_RETURN_IF_ERROR(CheckPatternKey(rd, pk));
        Reader::Scope item(rd, "lora." + key + "." + pk);
        if (pv->is_table()) {
          return rd.Error(
              "must be a number, not a table: quote pattern keys that contain dots "
              "(\"model.layers.0.self_attn.q_proj\" = 16)");
        }
        if (key == "rank_pattern") {
          FERRY_ASSIGN_OR_RETURN(int64_t r, rd.Int(*pv, 1, kMaxLoraRank));
          out.rank_pattern.push_back({pk, static_cast<int>(r)});
        } else {
          FERRY_ASSIGN_OR_RETURN(double a, rd.Float(*pv, {.min = 0, .min_open = true, .max = 1e9}));
          out.alpha_pattern.push_back({pk, a});
        }
      }
    } else if (key == "layers_to_transform") {
      have_layers = true;
      if (val.is_integer()) {
        FERRY_ASSIGN_OR_RETURN(int64_t layer, rd.Int(val, 0, int64_t{1} << 31));
        out.layers_to_transform = {layer};
        out.layers_to_transform_is_int = true;
      } else if (val.is_array()) {
        const toml::array& a = *val.as_array();
        if (a.empty()) return rd.Error("must not be an empty list");
        if (a.size() > kMaxConfigListEntries) return rd.Error("has too many entries");
        for (size_t i = 0; i < a.size(); ++i) {
          Reader::Scope item(rd, "lora.layers_to_transform[" + std::to_string(i) + "]");
          FERRY_ASSIGN_OR_RETURN(int64_t layer, rd.Int(a[i], 0, int64_t{1} << 31));
          out.layers_to_transform.push_back(layer);
        }
        out.layers_to_transform_is_int = false;
      } else {
        return rd.Error("must be a layer index or a list of them (got " + Reader::TypeName(val) + ")");
      }
    } else if (key == "layers_pattern") {
      have_pattern = true;
      if (val.is_string()) {
        FERRY_ASSIGN_OR_RETURN(std::string s, rd.String(val, 1024));
        if (s.empty()) return rd.Error("must not be empty");
        out.layers_pattern = {s};
      } else {
        FERRY_ASSIGN_OR_RETURN(out.layers_pattern, rd.StringList(val, 1024, 1024));
        if (out.layers_pattern.empty()) return rd.Error("must not be an empty list");
      }
    } else if (key == "bias") {
      FERRY_ASSIGN_OR_RETURN(std::string s, rd.String(val));
      if (s == "all" || s == "lora_only") {
        return rd.Unsupported("\"" + s + "\" trains base-layer biases; ferryd trains LoRA factors only (\"none\")");
      }
      if (s != "none") return rd.Error("must be \"none\", \"all\" or \"lora_only\" (got " + Reader::Show(s) + ")");
      out.bias = s;
    } else if (key == "use_dora" || key == "fan_in_fan_out" || key == "lora_bias" || key == "use_qalora") {
      FERRY_RETURN_IF_ERROR(rd.Neutral(val, NeutralValue::Bool(false), "implements plain LoRA only"));
    } else if (key == "init_lora_weights") {
      FERRY_RETURN_IF_ERROR(rd.Neutral(val, NeutralValue::Bool(true),
                                       "initialises LoRA as PEFT's default (A Kaiming-uniform, B zero) only"));
    } else if (key == "task_type") {
      FERRY_RETURN_IF_ERROR(rd.Neutral(val, NeutralValue::String("CAUSAL_LM"), "trains causal language models"));
    } else if (key == "modules_to_save" || key == "trainable_token_indices" || key == "layer_replication" ||
               key == "target_parameters" || key == "alora_invocation_tokens") {
      return rd.Unsupported("a PEFT feature ferryd does not implement (it trains LoRA factors only); remove it");
    } else {
      return rd.Error(
          "unknown key in [lora] (PEFT LoraConfig names: r, lora_alpha, lora_dropout, target_modules, "
          "exclude_modules, use_rslora, rank_pattern, alpha_pattern, layers_to_transform, "
          "layers_pattern, bias)");
    }
  }
  // PEFT's LoraConfig.__post_init__ rules.
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
