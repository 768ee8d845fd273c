#include "convert/engine_check.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <set>

#include "core/text.h"

namespace ferry {
namespace {

using Severity = EngineFinding::Severity;
using Subject = EngineFinding::Subject;

constexpr const char* kMergeHf = "merge it instead (the hf layout)";
constexpr int64_t kEngineMaxLoraRanks[] = {1, 8, 16, 32, 64, 128, 256, 320, 512};

std::string LeafOf(const std::string& name) {
  const auto dot = name.rfind('.');
  return dot == std::string::npos ? name : name.substr(dot + 1);
}

std::string StripWeight(const std::string& tensor) {
  constexpr std::string_view kWeight = ".weight";
  return tensor.ends_with(kWeight) ? tensor.substr(0, tensor.size() - kWeight.size()) : tensor;
}

// "1 tensor" / "14 tensors".
std::string Count(size_t n, const char* noun) { return std::to_string(n) + " " + noun + (n == 1 ? "" : "s"); }

// The adapter tensor keys of one rejected kind, in name order.
struct KeyGroup {
  std::vector<std::string> keys;
};

enum class KeyCategory { kMagnitude, kLoraBBias, kModulesToSave, kTrainableTokens, kBaseLayer, kOther, kNamed };

std::optional<KeyCategory> CategoryOf(const AdapterKey& k) {
  if (EngineLoadsKey(k)) return std::nullopt;
  switch (k.kind) {
    case AdapterKey::kMagnitude: return KeyCategory::kMagnitude;
    case AdapterKey::kLoraBBias: return KeyCategory::kLoraBBias;
    case AdapterKey::kModulesToSave: return KeyCategory::kModulesToSave;
    case AdapterKey::kTrainableTokens: return KeyCategory::kTrainableTokens;
    case AdapterKey::kBaseLayer: return KeyCategory::kBaseLayer;
    case AdapterKey::kOther: return KeyCategory::kOther;
    case AdapterKey::kLoraA:
    case AdapterKey::kLoraB:
    case AdapterKey::kEmbeddingA:
    case AdapterKey::kEmbeddingB: return KeyCategory::kNamed;
  }
  return KeyCategory::kOther;
}

class Checker {
 public:
  Checker(const PeftConfig& config, const Checkpoint& adapter, const Checkpoint* base, const MergePlan* plan)
      : config_(config), adapter_(adapter), base_(base), plan_(plan) {}

  std::vector<EngineFinding> Run() {
    if (config_.peft_type != "LORA") {
      Add(Severity::kReject, Subject::kField, "peft_type",
          "peft_type is " + Quote(config_.peft_type) +
              ": engines hot-load LoRA adapters only; merge it with PEFT and "
              "convert the merged model");
      return std::move(findings_);
    }
    ScanKeys();
    CheckConfigFields();
    CheckKeys();
    CheckPatterns();
    CheckRslora();
    CheckRank();
    if (plan_ != nullptr) CheckFusion();
    return std::move(findings_);
  }

 private:
  void Add(Severity severity, Subject kind, std::string subject, std::string message,
           std::optional<Layout> fix = std::nullopt) {
    findings_.push_back({severity, kind, std::move(subject), std::move(message), fix});
  }

  // The layout a copy fix names: lora when the copies equal the base, hf when one differs,
  // none without a base to tell.
  std::optional<Layout> CopyFixLayout(const std::vector<std::string>& keys) const {
    if (plan_ == nullptr) return std::nullopt;
    return FirstDifferentCopy(keys).empty() ? Layout::kLora : Layout::kHf;
  }

  void ScanKeys() {
    for (const std::string& key : adapter_.names()) {
      auto k = ParseAdapterKey(key, &config_);
      if (!k.ok()) continue;  // reported by the inspection itself
      if (auto c = CategoryOf(*k)) groups_[*c].keys.push_back(key);
      if (k->kind == AdapterKey::kLoraA || k->kind == AdapterKey::kEmbeddingA) {
        const TensorInfo* info = adapter_.Info(key);
        const int64_t rank = info != nullptr && !info->shape.empty() ? info->shape.front() : 0;
        modules_.emplace_back(k->module, rank);
      }
    }
  }

  // The replaced base tensor of adapter tensor `key` in the plan, or "".
  std::string ReplacedTarget(const std::string& key) const {
    if (plan_ == nullptr) return "";
    for (const auto& [target, k] : plan_->replacements) {
      if (k == key) return target;
    }
    return "";
  }

  // For saved full tensors: "" when every one equals its base tensor (or there is no base),
  // else the first that differs, as "'key' differs from base tensor 'T'".
  std::string FirstDifferentCopy(const std::vector<std::string>& keys) const {
    for (const std::string& key : keys) {
      const std::string target = ReplacedTarget(key);
      if (target.empty() || !ReplacementEqualsBase(*base_, adapter_, *plan_, target)) {
        return Quote(key) +
               (target.empty() ? " replaces no base tensor" : " differs from base tensor " + Quote(target));
      }
    }
    return "";
  }

  std::string CopyFix(const std::vector<std::string>& keys) const {
    if (plan_ == nullptr) {
      return "the lora layout drops saved copies that equal the base (inspecting with the base checks that); "
             "otherwise " +
             std::string(kMergeHf);
    }
    const std::string differs = FirstDifferentCopy(keys);
    if (differs.empty()) {
      return std::string(keys.size() == 1 ? "it equals the base tensor" : "they equal the base tensors") +
             ", so the lora layout drops " + (keys.size() == 1 ? "it" : "them");
    }
    return differs + ", so " + kMergeHf;
  }

  void CheckConfigFields() {
    if (config_.use_dora) {
      Add(Severity::kReject, Subject::kField, "use_dora",
          "use_dora is true: vLLM \"does not yet support DoRA\" and refuses the adapter; " + std::string(kMergeHf),
          Layout::kHf);
    }
    if (!config_.modules_to_save.empty()) {
      std::vector<std::string> saved;
      if (auto it = groups_.find(KeyCategory::kModulesToSave); it != groups_.end()) saved = it->second.keys;
      const std::string fix = saved.empty() ? "the adapter holds no saved copies, so the lora layout "
                                              "(which writes modules_to_save null) fixes it"
                                            : CopyFix(saved);
      Add(Severity::kReject, Subject::kField, "modules_to_save",
          "modules_to_save is [" + Join(config_.modules_to_save) +
              "]: vLLM \"only supports modules_to_save being "
              "None\" and refuses the adapter; " +
              fix,
          saved.empty() ? std::optional<Layout>(Layout::kLora) : CopyFixLayout(saved));
    }
  }

  static std::string Join(const std::vector<std::string>& v) {
    std::string out;
    for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + v[i];
    return out;
  }

  void CheckKeys() {
    for (const auto& [category, group] : groups_) {
      const std::string what =
          Count(group.keys.size(), "tensor") + " " +
          (group.keys.size() > 1 ? "like " + Quote(group.keys.front()) : Quote(group.keys.front()));
      std::string message;
      std::optional<Layout> fix = Layout::kHf;
      switch (category) {
        case KeyCategory::kMagnitude:
          message = what + ": DoRA magnitude vectors (lora_magnitude_vector); vLLM \"does not yet support DoRA\"; " +
                    kMergeHf;
          break;
        case KeyCategory::kLoraBBias:
          message = what + ": lora_B biases (lora_bias); vLLM loads only lora_A / lora_B weights; " + kMergeHf;
          break;
        case KeyCategory::kModulesToSave:
          message = what + ": full tensors of modules_to_save; vLLM \"only supports modules_to_save being None\"; " +
                    CopyFix(group.keys);
          fix = CopyFixLayout(group.keys);
          break;
        case KeyCategory::kTrainableTokens:
          message = what + ": trainable token rows (trainable_tokens_delta), which vLLM cannot load; " + kMergeHf;
          break;
        case KeyCategory::kBaseLayer:
          message = what + ": saved base-layer copies (.base_layer.); vLLM loads only lora_A / lora_B; " +
                    CopyFix(group.keys);
          fix = CopyFixLayout(group.keys);
          break;
        case KeyCategory::kOther:
          message = what + ": full tensors (e.g. biases saved with bias=\"all\"); vLLM loads only lora_A / lora_B; " +
                    CopyFix(group.keys);
          fix = CopyFixLayout(group.keys);
          break;
        case KeyCategory::kNamed:
          message = what +
                    ": the key carries an adapter name; vLLM expects \".lora_A.weight\" right after the module "
                    "name; the lora layout writes clean names";
          fix = Layout::kLora;
          break;
      }
      Add(Severity::kReject, Subject::kKey, group.keys.front(), std::move(message), fix);
    }
  }

  double GlobalScaling() const {
    return config_.use_rslora ? config_.lora_alpha / std::sqrt(static_cast<double>(config_.r))
                              : config_.lora_alpha / static_cast<double>(config_.r);
  }

  static bool Differs(double a, double b) { return std::fabs(a - b) > 1e-9 * std::max(std::fabs(a), std::fabs(b)); }

  void CheckPatterns() {
    struct Field {
      const char* name;
      bool present;
      bool (*own)(const PeftConfig&, const std::string&);
    };
    const Field fields[] = {
        {"rank_pattern", !config_.rank_pattern.empty(),
         [](const PeftConfig& c, const std::string& m) { return c.RankFor(m) != c.r; }},
        {"alpha_pattern", !config_.alpha_pattern.empty(),
         [](const PeftConfig& c, const std::string& m) { return Differs(c.AlphaFor(m), c.lora_alpha); }},
    };
    const double global = GlobalScaling();
    for (const Field& f : fields) {
      if (!f.present) continue;
      size_t own = 0, wrong = 0;
      std::string example;
      for (const auto& [module, rank] : modules_) {
        if (!f.own(config_, module)) continue;
        ++own;
        const double s = config_.ScalingFor(module);
        if (!Differs(s, global)) continue;
        if (wrong++ == 0)
          example = Quote(module) + " is scaled " + FormatNumber(s, 6) + ", vLLM would use " + FormatNumber(global, 6);
      }
      if (wrong > 0) {
        Add(Severity::kWrong, Subject::kField, f.name,
            std::string(f.name) +
                " is set: vLLM applies one global scaling (lora_alpha / r); modules with their own "
                "rank/alpha would be scaled wrongly (" +
                Count(wrong, "module") + ", e.g. " + example +
                "); the lora layout bakes each module's scaling into lora_A",
            Layout::kLora);
      } else {
        Add(Severity::kNote, Subject::kField, f.name,
            std::string(f.name) + " is set but " +
                (own == 0 ? std::string("selects none of the adapter's modules")
                          : "leaves every module at the global scaling lora_alpha / r") +
                "; vLLM, which ignores it, serves the adapter correctly");
      }
    }
  }

  void CheckRslora() {
    if (!config_.use_rslora) return;
    const double r = static_cast<double>(config_.r);
    Add(Severity::kNote, Subject::kField, "use_rslora",
        "use_rslora is true (scaling lora_alpha / sqrt(r) = " + FormatNumber(config_.lora_alpha / std::sqrt(r), 6) +
            "): older vLLM versions ignore use_rslora and apply lora_alpha / r = " +
            FormatNumber(config_.lora_alpha / r, 6) +
            "; the lora layout bakes the scaling into lora_A so every version agrees",
        Layout::kLora);
  }

  void CheckRank() {
    int64_t max_rank = 0;
    std::string where;
    for (const auto& [module, rank] : modules_) {
      if (rank > max_rank) {
        max_rank = rank;
        where = module;
      }
    }
    if (max_rank == 0) return;
    const int64_t after = plan_ != nullptr ? LoraLayoutRank(*plan_) : max_rank;
    const int64_t needed = std::max(max_rank, after);
    std::string message = "largest rank " + std::to_string(max_rank) + " (" + Quote(where) +
                          "): vLLM's max_lora_rank must be at least " + std::to_string(max_rank);
    if (after != max_rank) {
      message += "; in the lora layout the rank is " + std::to_string(after) +
                 " (adapters fused to match the base stack their ranks)";
    }
    if (needed > kEngineLargestMaxLoraRank) {
      Add(Severity::kReject, Subject::kModule, where,
          message + "; vLLM accepts a max_lora_rank of at most " + std::to_string(kEngineLargestMaxLoraRank) +
              " and refuses it; " + kMergeHf,
          Layout::kHf);
      return;
    }
    int64_t setting = kEngineLargestMaxLoraRank;
    for (int64_t v : kEngineMaxLoraRanks) {
      if (v >= needed) {
        setting = v;
        break;
      }
    }
    message += needed <= kEngineDefaultMaxLoraRank
                   ? "; the default (" + std::to_string(kEngineDefaultMaxLoraRank) + ") is enough"
                   : "; start vLLM with a max_lora_rank of " + std::to_string(setting) + " or more (default " +
                         std::to_string(kEngineDefaultMaxLoraRank) + ")";
    Add(Severity::kNote, Subject::kModule, where, std::move(message));
    if (needed > kEngineDefaultMaxLoraRank) findings_.back().engine_max_lora_rank = setting;
  }

  // Names as a list: "'q_proj', 'k_proj'".
  static std::string QuoteAll(const std::vector<std::string>& names) {
    std::string out;
    for (size_t i = 0; i < names.size(); ++i) out += (i ? ", " : "") + Quote(names[i]);
    return out;
  }

  static void AddUnique(std::vector<std::string>* v, const std::string& s) {
    if (std::find(v->begin(), v->end(), s) == v->end()) v->push_back(s);
  }

  void CheckFusion() {
    struct Group {
      std::vector<std::string> leaves;  // the other side's leaves, in plan order
      std::vector<const LoraModule*> mods;
    };
    std::map<std::string, Group> fused;  // base's fused leaf -> separate adapter modules landing on it
    std::map<std::string, Group> split;  // adapter's fused leaf -> base tensors it is split onto
    for (const LoraModule& m : plan_->modules) {
      if (!m.fused_module.empty()) {
        Group& g = split[LeafOf(m.fused_module)];
        AddUnique(&g.leaves, LeafOf(m.module));
        g.mods.push_back(&m);
      } else if (m.kind == LoraModule::Kind::kLinear && LeafOf(StripWeight(m.target)) != LeafOf(m.module) &&
                 !(plan_->tied && m.target == plan_->lm_head_key)) {
        Group& g = fused[LeafOf(StripWeight(m.target))];
        AddUnique(&g.leaves, LeafOf(m.module));
        g.mods.push_back(&m);
      }
    }
    for (const auto& [leaf, g] : fused) {
      const LoraModule& m = *g.mods.front();
      Add(Severity::kNote, Subject::kModule, m.module,
          Count(g.mods.size(), "adapter module") + " named " + QuoteAll(g.leaves) + " land on the base's fused " +
              Quote(leaf) + " tensors (e.g. " + Quote(m.module) + " -> rows [" + std::to_string(m.row_offset) + ", " +
              std::to_string(m.row_offset + m.out) + ") of " + Quote(m.target) +
              "): an engine serving this base matches adapter modules against the base's module names and refuses "
              "or ignores " +
              QuoteAll(g.leaves) +
              "; the lora layout matches names to the base "
              "(fuses them into " +
              Quote(leaf) + ")",
          Layout::kLora);
    }
    for (const auto& [leaf, g] : split) {
      const LoraModule& m = *g.mods.front();
      std::set<std::string> adapters;
      for (const LoraModule* p : g.mods) adapters.insert(p->fused_module);
      Add(Severity::kNote, Subject::kModule, m.fused_module,
          Count(adapters.size(), "fused adapter module") + " named " + Quote(leaf) + " onto a base that stores " +
              QuoteAll(g.leaves) + " separately (e.g. " + Quote(m.fused_module) + " lora_B rows [" +
              std::to_string(m.b_row_begin) + ", " + std::to_string(m.b_row_begin + m.out) + ") -> " + Quote(m.target) +
              "): an engine serving this base matches adapter modules against the base's module names; "
              "the lora layout matches names to the base (splits it: lora_A copied, lora_B split by "
              "rows)",
          Layout::kLora);
    }
  }

  const PeftConfig& config_;
  const Checkpoint& adapter_;
  const Checkpoint* base_;
  const MergePlan* plan_;
  std::map<KeyCategory, KeyGroup> groups_;
  std::vector<std::pair<std::string, int64_t>> modules_;  // LoRA modules with their tensor rank
  std::vector<EngineFinding> findings_;
};

}  // namespace

std::string_view EngineSeverityName(EngineFinding::Severity severity) {
  switch (severity) {
    case Severity::kReject: return "reject";
    case Severity::kWrong: return "wrong";
    case Severity::kNote: return "note";
  }
  return "note";
}

std::string_view EngineSubjectName(EngineFinding::Subject subject) {
  switch (subject) {
    case Subject::kKey: return "key";
    case Subject::kField: return "field";
    case Subject::kModule: return "module";
  }
  return "field";
}

bool EngineLoadsKey(const AdapterKey& key) {
  switch (key.kind) {
    case AdapterKey::kLoraA:
    case AdapterKey::kLoraB:
    case AdapterKey::kEmbeddingA:
    case AdapterKey::kEmbeddingB: return key.adapter_name.empty();
    default: return false;
  }
}

bool ReplacementEqualsBase(const Checkpoint& base, const Checkpoint& adapter, const MergePlan& plan,
                           const std::string& target) {
  auto r = plan.replacements.find(target);
  if (r == plan.replacements.end() || plan.quantized.count(target) != 0) return false;
  auto a = adapter.Get(r->second);
  auto b = base.Get(plan.SourceOf(target));
  return a.ok() && b.ok() && a->dtype() == b->dtype() && a->nbytes() == b->nbytes() &&
         std::memcmp(a->data(), b->data(), a->nbytes()) == 0;
}

std::vector<LoraLayoutRefusal> FindLoraLayoutRefusals(const PeftConfig& cfg, const Checkpoint& base,
                                                      const Checkpoint& adapter, const MergePlan& plan) {
  std::vector<LoraLayoutRefusal> out;
  if (cfg.use_dora) {
    out.push_back({Subject::kField, "use_dora",
                   cfg.source + ": use_dora is set: inference engines (vLLM: \"does not yet support DoRA\") "
                                "cannot hot-load DoRA adapters."});
  }
  for (const auto& [target, key] : plan.replacements) {
    if (ReplacementEqualsBase(base, adapter, plan, target)) continue;  // an untouched saved copy is harmless
    out.push_back({Subject::kKey, key,
                   adapter.FileOf(key).string() + ": tensor " + Quote(key) + " replaces base tensor " + Quote(target) +
                       " (modules_to_save or a saved full tensor): engines load only lora_A/lora_B (vLLM: "
                       "\"only supports modules_to_save being None\")."});
  }
  for (const auto& [target, rows] : plan.token_rows) {
    out.push_back({Subject::kKey, rows.first,
                   adapter.FileOf(rows.first).string() + ": tensor " + Quote(rows.first) +
                       " holds trainable token rows, which engines cannot hot-load."});
  }
  for (const LoraModule& m : plan.modules) {
    if (m.bias_key.empty()) continue;
    out.push_back({Subject::kKey, m.bias_key,
                   adapter.FileOf(m.bias_key).string() + ": tensor " + Quote(m.bias_key) +
                       " is a lora_B bias (lora_bias), which engines do not load."});
  }
  return out;
}

int64_t LoraLayoutRank(const MergePlan& plan) {
  std::map<std::string, int64_t> by_target;
  for (const LoraModule& m : plan.modules) by_target[m.target] += m.rank;
  int64_t rank = 0;
  for (const auto& [target, r] : by_target) rank = std::max(rank, r);
  return rank;
}

std::vector<EngineFinding> CheckAdapterForEngine(const PeftConfig& config, const Checkpoint& adapter) {
  return Checker(config, adapter, nullptr, nullptr).Run();
}

std::vector<EngineFinding> CheckAdapterForEngine(const PeftConfig& config, const Checkpoint& adapter,
                                                 const Checkpoint& base, const MergePlan& plan) {
  return Checker(config, adapter, &base, &plan).Run();
}

}  // namespace ferry
