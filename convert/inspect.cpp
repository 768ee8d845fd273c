#include "convert/inspect.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "convert/merge_plan.h"
#include "core/checkpoint.h"
#include "core/mapped_file.h"
#include "core/text.h"

namespace ferry {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

constexpr size_t kMaxModelConfigBytes = 16u << 20;

std::string FormatName(CheckpointFormat f) {
  switch (f) {
    case CheckpointFormat::kSafetensorsFile: return "safetensors";
    case CheckpointFormat::kSafetensorsSharded: return "safetensors-sharded";
    case CheckpointFormat::kTorchPickle: return "torch-pickle";
  }
  return "unknown";
}

void AddTotals(TensorTotals* totals, const InspectTensor& t) {
  const uint64_t params = static_cast<uint64_t>(CheckedNumel(t.shape).ok() ? *CheckedNumel(t.shape) : 0);
  totals->count += 1;
  totals->bytes += t.bytes;
  totals->params += params;
  auto it = std::find_if(totals->by_dtype.begin(), totals->by_dtype.end(),
                         [&](const DTypeTotal& d) { return d.dtype == t.dtype; });
  if (it == totals->by_dtype.end()) it = totals->by_dtype.insert(totals->by_dtype.end(), DTypeTotal{t.dtype});
  it->count += 1;
  it->bytes += t.bytes;
  it->params += params;
}

// Fills the tensor list, totals, files and metadata; returns the opened checkpoint.
Result<Checkpoint> ReadTensors(const fs::path& weights_path, InspectReport* report) {
  FERRY_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::Open(weights_path));
  report->format = FormatName(ckpt.format());
  for (const fs::path& f : ckpt.files()) report->files.push_back(f.string());
  if (report->files.empty()) {  // tensors read into memory (a torch pickle)
    std::error_code ec;
    auto file = fs::is_directory(weights_path, ec) ? FindWeights(weights_path) : Result<fs::path>(weights_path);
    if (file.ok()) report->files.push_back(file->string());
  }
  report->metadata = ckpt.metadata();
  for (const std::string& name : ckpt.names()) {
    const TensorInfo* info = ckpt.Info(name);
    if (info == nullptr) continue;
    report->tensors.push_back({name, info->dtype, info->shape, info->nbytes()});
    AddTotals(&report->totals, report->tensors.back());
  }
  std::sort(report->totals.by_dtype.begin(), report->totals.by_dtype.end(),
            [](const DTypeTotal& a, const DTypeTotal& b) { return a.dtype < b.dtype; });
  return ckpt;
}

// ---------------------------------------------------------------------------------
// config.json of a model directory.

std::string StringField(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}

Result<ModelConfigSummary> ReadModelConfig(const fs::path& file) {
  FERRY_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(file, kMaxModelConfigBytes));
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Status::Corruption(file.string() + ": not a JSON object");
  ModelConfigSummary s;
  s.model_type = StringField(j, "model_type");
  s.dtype = StringField(j, "dtype");
  if (s.dtype.empty()) s.dtype = StringField(j, "torch_dtype");
  if (auto it = j.find("architectures"); it != j.end() && it->is_array()) {
    for (const auto& a : *it) {
      if (a.is_string()) s.architectures.push_back(a.get<std::string>());
    }
  }
  if (auto it = j.find("tie_word_embeddings"); it != j.end() && it->is_boolean())
    s.tie_word_embeddings = it->get<bool>();
  if (auto it = j.find("quantization_config"); it != j.end() && it->is_object()) {
    s.has_quantization_config = true;
    s.quant_method = StringField(*it, "quant_method");
  }
  return s;
}

// ---------------------------------------------------------------------------------
// Adapters.

struct ModuleTensors {
  const InspectTensor* a = nullptr;
  const InspectTensor* b = nullptr;
  bool embedding = false;
  bool bias = false;
  bool magnitude = false;
};

std::string ShapeText(const InspectTensor* t) { return t == nullptr ? "missing" : ShapeToString(t->shape); }

void CheckPair(const std::string& module, const ModuleTensors& m, std::vector<std::string>* issues) {
  const char* a_name = m.embedding ? "lora_embedding_A" : "lora_A";
  const char* b_name = m.embedding ? "lora_embedding_B" : "lora_B";
  if (m.a == nullptr || m.b == nullptr) {
    issues->push_back("module " + Quote(module) + ": has " + (m.a ? a_name : b_name) + " but no " +
                      (m.a ? b_name : a_name));
    return;
  }
  if (m.a->shape.size() != 2 || m.b->shape.size() != 2 || m.a->shape[0] != m.b->shape[1]) {
    issues->push_back("module " + Quote(module) + ": " + a_name + " " + ShapeText(m.a) + " and " + b_name + " " +
                      ShapeText(m.b) + " do not form a rank-r pair ([r, in] and [out, r])");
  }
}

AdapterModuleRow MakeRow(const std::string& module, const ModuleTensors& m, const PeftConfig& config) {
  AdapterModuleRow row;
  row.module = module;
  row.embedding = m.embedding;
  if (m.a != nullptr && !m.a->shape.empty()) {
    row.tensor_rank = m.a->shape.front();
  } else if (m.b != nullptr && !m.b->shape.empty()) {
    row.tensor_rank = m.b->shape.back();
  }
  row.config_rank = config.RankFor(module);
  row.alpha = config.AlphaFor(module);
  row.scaling = config.ScalingFor(module);
  row.has_lora_b_bias = m.bias;
  row.has_magnitude = m.magnitude;
  row.rank_mismatch = row.tensor_rank.has_value() && *row.tensor_rank != row.config_rank;
  return row;
}

void CheckRow(const AdapterModuleRow& row, const PeftConfig& c, std::vector<std::string>* issues) {
  const std::string m = "module " + Quote(row.module) + ": ";
  if (row.rank_mismatch) {
    issues->push_back(m + "the LoRA tensors have rank " + std::to_string(*row.tensor_rank) +
                      " but the config gives rank " + std::to_string(row.config_rank) + " (r / rank_pattern)");
  }
  if (!c.target_modules.empty() && !c.IsTargeted(row.module, 2)) {
    issues->push_back(m +
                      "has LoRA tensors but the config's target_modules / exclude_modules / "
                      "layers_to_transform do not select it");
  }
  if (row.has_magnitude && !c.use_dora) issues->push_back(m + "has a DoRA magnitude vector but use_dora is false");
  if (!row.has_magnitude && c.use_dora && !row.embedding) {
    issues->push_back(m + "use_dora is true but there is no lora_magnitude_vector");
  }
  if (row.has_lora_b_bias && !c.lora_bias) issues->push_back(m + "has lora_B.bias but lora_bias is false");
}

void CheckTrainableTokens(const AdapterKey& key, const InspectTensor& t, const PeftConfig& c,
                          std::vector<std::string>* issues) {
  const std::vector<int64_t>* ids =
      c.trainable_token_indices.embedding.empty() ? nullptr : &c.trainable_token_indices.embedding;
  for (const auto& [name, list] : c.trainable_token_indices.by_module) {
    if (key.module == name ||
        (key.module.size() > name.size() &&
         key.module.compare(key.module.size() - name.size() - 1, std::string::npos, "." + name) == 0)) {
      ids = &list;
    }
  }
  if (ids == nullptr) {
    issues->push_back("tensor " + Quote(t.name) +
                      ": trainable tokens delta but trainable_token_indices does not "
                      "cover module " +
                      Quote(key.module));
  } else if (t.shape.empty() || t.shape[0] != static_cast<int64_t>(ids->size())) {
    issues->push_back("tensor " + Quote(t.name) + ": shape " + ShapeToString(t.shape) +
                      " does not have one row per "
                      "trainable token index (" +
                      std::to_string(ids->size()) + ")");
  }
}

// Sorts one tensor into `modules` / `summary`; returns false for tensors that are neither
// LoRA nor saved modules.
bool ClassifyTensor(const AdapterKey& key, const InspectTensor& t, AdapterSummary* summary,
                    std::map<std::string, ModuleTensors>* modules, std::vector<std::string>* issues) {
  ModuleTensors& m = (*modules)[key.module];
  switch (key.kind) {
    case AdapterKey::kLoraA: m.a = &t; return true;
    case AdapterKey::kLoraB: m.b = &t; return true;
    case AdapterKey::kEmbeddingA:
      m.a = &t;
      m.embedding = true;
      return true;
    case AdapterKey::kEmbeddingB:
      m.b = &t;
      m.embedding = true;
      return true;
    case AdapterKey::kLoraBBias: m.bias = true; return true;
    case AdapterKey::kMagnitude: m.magnitude = true; return true;
    case AdapterKey::kModulesToSave: summary->saved_full_modules.push_back(t.name); return true;
    case AdapterKey::kTrainableTokens: CheckTrainableTokens(key, t, summary->config, issues); return true;
    case AdapterKey::kBaseLayer: return true;
    case AdapterKey::kOther: return key.param == "bias" && summary->config.bias != PeftBias::kNone;
  }
  return false;
}

void AnalyzeLora(const InspectReport& report, AdapterSummary* summary, std::vector<std::string>* issues) {
  std::map<std::string, ModuleTensors> modules;
  for (const InspectTensor& t : report.tensors) {
    auto key = ParseAdapterKey(t.name, &summary->config);
    if (!key.ok()) {
      issues->push_back(key.status().message());
    } else if (!ClassifyTensor(*key, t, summary, &modules, issues)) {
      issues->push_back("tensor " + Quote(t.name) + ": not a LoRA tensor, and module " + Quote(key->module) +
                        " is not in modules_to_save");
    }
  }
  for (const auto& [name, m] : modules) {
    if (m.a == nullptr && m.b == nullptr) continue;
    CheckPair(name, m, issues);
    summary->modules.push_back(MakeRow(name, m, summary->config));
    CheckRow(summary->modules.back(), summary->config, issues);
  }
  for (const std::string& wanted : summary->config.modules_to_save) {
    const bool found =
        std::any_of(summary->saved_full_modules.begin(), summary->saved_full_modules.end(), [&](const std::string& n) {
          auto k = ParseAdapterKey(n, &summary->config);
          return k.ok() && (k->module == wanted || k->module.ends_with("." + wanted));
        });
    if (!found) issues->push_back("modules_to_save names " + Quote(wanted) + " but the adapter has no tensor for it");
  }
}

// ---------------------------------------------------------------------------------
// The merge plan onto a base (--base).

std::string ReplacementWhy(const std::string& key, const PeftConfig& config) {
  auto k = ParseAdapterKey(key, &config);
  if (!k.ok()) return "saved tensor";
  if (k->kind == AdapterKey::kModulesToSave) return "modules_to_save";
  if (k->kind == AdapterKey::kBaseLayer) return "base_layer";
  return "saved tensor";
}

PlanTarget MakeTarget(const LoraModule& m, const MergePlan& plan, const Checkpoint& base) {
  PlanTarget t;
  t.tensor = m.target;
  const std::string source = plan.SourceOf(m.target);
  if (source != m.target) t.source = source;
  if (auto q = plan.quantized.find(m.target); q != plan.quantized.end()) {
    t.shape = q->second.shape;
    t.dtype = q->second.dtype;
    t.quantization = q->second.quant_type;
  } else if (const TensorInfo* info = base.Info(source); info != nullptr) {
    t.shape = info->shape;
    t.dtype = info->dtype;
  }
  const int64_t rows = t.shape.empty() ? 0 : t.shape.front();
  const bool row_slice = m.kind == LoraModule::Kind::kLinear && !m.fan_in_fan_out;
  t.row_begin = row_slice ? m.row_offset : 0;
  t.row_end = row_slice ? m.row_offset + m.out : rows;
  t.partial = t.row_begin != 0 || t.row_end != rows;
  if (!m.fused_module.empty()) {
    const auto dot = m.module.rfind('.');
    t.part = dot == std::string::npos ? m.module : m.module.substr(dot + 1);
    t.b_row_begin = m.b_row_begin;
    t.b_row_end = m.b_row_begin + m.out;
  }
  return t;
}

void FillPlan(const MergePlan& plan, const PeftConfig& config, const Checkpoint& adapter, const Checkpoint& base,
              AdapterPlanReport* out) {
  std::map<std::string, PlanModuleRow> rows;
  for (const LoraModule& m : plan.modules) {
    const std::string name = m.fused_module.empty() ? m.module : m.fused_module;
    PlanModuleRow& row = rows[name];
    row.module = name;
    row.embedding = m.kind == LoraModule::Kind::kEmbedding;
    row.rank = m.rank;
    row.scaling = m.scaling;
    row.dora = !m.magnitude_key.empty();
    row.lora_bias = !m.bias_key.empty();
    row.fan_in_fan_out = m.fan_in_fan_out;
    row.bias_target = m.bias_target;
    row.targets.push_back(MakeTarget(m, plan, base));
    if (!row.targets.back().quantization.empty()) ++out->quantized_targets;
  }
  for (auto& [name, row] : rows) out->modules.push_back(std::move(row));
  for (const auto& [target, key] : plan.replacements) {
    PlanReplacementRow r;
    r.base_tensor = target;
    r.adapter_key = key;
    r.why = ReplacementWhy(key, config);
    if (const TensorInfo* info = adapter.Info(key); info != nullptr) {
      r.shape = info->shape;
      r.dtype = info->dtype;
    }
    r.equals_base = ReplacementEqualsBase(base, adapter, plan, target);
    out->replacements.push_back(std::move(r));
  }
  for (const auto& [target, rows_of] : plan.token_rows)
    out->token_rows.push_back({target, rows_of.first, rows_of.second});
  out->tied = plan.tied;
  out->tied_source = plan.tied_source;
  out->untie = plan.untie;
  out->lm_head = plan.lm_head_key;
  out->warnings = plan.warnings;
}

void SortFindings(std::vector<EngineFinding>* findings) {
  std::stable_sort(findings->begin(), findings->end(), [](const EngineFinding& a, const EngineFinding& b) {
    return static_cast<int>(a.severity) < static_cast<int>(b.severity);
  });
}

// Resolves the adapter onto options.base: fills report->plan and the engine findings.
Status InspectAgainstBase(const fs::path& base_path, const Checkpoint& adapter, InspectReport* report) {
  std::error_code ec;
  if (!fs::exists(base_path, ec)) return Status::NotFound(base_path.string() + ": base model does not exist");
  const PeftConfig& config = report->adapter->config;
  AdapterPlanReport plan_report;
  plan_report.base = base_path;
  const fs::path base_dir = fs::is_directory(base_path, ec) ? base_path : base_path.parent_path();
  if (fs::is_regular_file(base_dir / "config.json", ec)) {
    FERRY_ASSIGN_OR_RETURN(plan_report.base_config, ReadModelConfig(base_dir / "config.json"));
    plan_report.tie_word_embeddings = plan_report.base_config->tie_word_embeddings.value_or(false);
  }
  FERRY_ASSIGN_OR_RETURN(Checkpoint base, Checkpoint::Open(base_path));
  Result<MergePlan> plan =
      config.peft_type == "LORA"
          ? PlanMerge(config, adapter, base, plan_report.tie_word_embeddings)
          : Result<MergePlan>(Status::Unsupported(config.source + ": peft_type " + Quote(config.peft_type) +
                                                  " is not LORA: no merge plan onto " + base_path.string()));
  if (!plan.ok()) {
    plan_report.error = plan.status();
    report->issues.push_back(plan.status().message());
  } else {
    FillPlan(*plan, config, adapter, base, &plan_report);
    if (report->engine.has_value()) {
      EngineReport& engine = *report->engine;
      engine.findings = CheckAdapterForEngine(config, adapter, base, *plan);
      SortFindings(&engine.findings);
      engine.with_base = true;
      const std::vector<LoraLayoutRefusal> refusals = FindLoraLayoutRefusals(config, base, adapter, *plan);
      engine.lora_layout_possible = refusals.empty();
      if (!refusals.empty()) engine.lora_layout_refusal = refusals.front().message;
      engine.lora_layout_rank = LoraLayoutRank(*plan);
    }
  }
  report->plan = std::move(plan_report);
  return Status::OK();
}

Status InspectAdapter(const fs::path& dir, const InspectOptions& options, InspectReport* report) {
  FERRY_ASSIGN_OR_RETURN(PeftConfig config, LoadPeftConfig(dir));
  FERRY_ASSIGN_OR_RETURN(Checkpoint adapter, ReadTensors(dir, report));
  report->files.push_back((dir / "adapter_config.json").string());
  AdapterSummary summary;
  summary.config = std::move(config);
  summary.mergeable = summary.config.CheckMergeable();
  if (!summary.mergeable.ok()) report->issues.push_back(summary.mergeable.message());
  if (summary.config.peft_type == "LORA") AnalyzeLora(*report, &summary, &report->issues);
  report->adapter = std::move(summary);
  EngineReport engine;
  engine.findings = CheckAdapterForEngine(report->adapter->config, adapter);
  SortFindings(&engine.findings);
  report->engine = std::move(engine);
  if (!options.base.empty()) FERRY_RETURN_IF_ERROR(InspectAgainstBase(options.base, adapter, report));
  return Status::OK();
}

Status InspectModelDir(const fs::path& dir, InspectReport* report) {
  FERRY_RETURN_IF_ERROR(ReadTensors(dir, report).status());
  std::error_code ec;
  if (fs::is_regular_file(dir / "config.json", ec)) {
    FERRY_ASSIGN_OR_RETURN(report->model_config, ReadModelConfig(dir / "config.json"));
    report->files.push_back((dir / "config.json").string());
  }
  return Status::OK();
}

// ---------------------------------------------------------------------------------
// JSON.

Json TotalsJson(const TensorTotals& t) {
  Json by = Json::object();
  for (const DTypeTotal& d : t.by_dtype) {
    by[std::string(DTypeName(d.dtype))] = {{"count", d.count}, {"bytes", d.bytes}, {"params", d.params}};
  }
  return {{"count", t.count}, {"bytes", t.bytes}, {"params", t.params}, {"by_dtype", std::move(by)}};
}

Json TensorsJson(const std::vector<InspectTensor>& tensors, size_t limit) {
  Json out = Json::array();
  for (size_t i = 0; i < tensors.size() && (limit == 0 || i < limit); ++i) {
    const InspectTensor& t = tensors[i];
    out.push_back({{"name", t.name}, {"dtype", DTypeName(t.dtype)}, {"shape", t.shape}, {"bytes", t.bytes}});
  }
  return out;
}

Json ModelConfigJson(const ModelConfigSummary& s) {
  Json j = {{"model_type", s.model_type}, {"architectures", s.architectures}, {"dtype", s.dtype}};
  j["tie_word_embeddings"] = s.tie_word_embeddings.has_value() ? Json(*s.tie_word_embeddings) : Json(nullptr);
  j["quantization_config"] = s.has_quantization_config;
  j["quant_method"] = s.quant_method;
  return j;
}

Json SelectorJson(const ModuleSelector& s) {
  switch (s.form) {
    case ModuleSelector::Form::kNone: return nullptr;
    case ModuleSelector::Form::kList: return s.names;
    case ModuleSelector::Form::kRegex:
    case ModuleSelector::Form::kAllLinear: return s.pattern;
  }
  return nullptr;
}

Json ModuleRowJson(const AdapterModuleRow& r) {
  return {{"module", r.module},
          {"kind", r.embedding ? "embedding" : "linear"},
          {"tensor_rank", r.tensor_rank.has_value() ? Json(*r.tensor_rank) : Json(nullptr)},
          {"config_rank", r.config_rank},
          {"rank_mismatch", r.rank_mismatch},
          {"alpha", r.alpha},
          {"scaling", r.scaling},
          {"lora_bias", r.has_lora_b_bias},
          {"dora_magnitude", r.has_magnitude}};
}

Json AdapterJson(const AdapterSummary& a) {
  const PeftConfig& c = a.config;
  Json j = {{"peft_type", c.peft_type},
            {"base_model_name_or_path", c.base_model_name_or_path},
            {"r", c.r},
            {"lora_alpha", c.lora_alpha},
            {"use_rslora", c.use_rslora},
            {"use_dora", c.use_dora},
            {"fan_in_fan_out", c.fan_in_fan_out},
            {"bias", PeftBiasName(c.bias)},
            {"lora_bias", c.lora_bias}};
  j["target_modules"] = SelectorJson(c.target_modules);
  j["exclude_modules"] = SelectorJson(c.exclude_modules);
  j["modules_to_save"] = c.modules_to_save;
  j["saved_full_modules"] = a.saved_full_modules;
  j["mergeable"] = a.mergeable.ok();
  j["refusal"] = a.mergeable.ok() ? Json(nullptr) : Json(a.mergeable.message());
  Json rows = Json::array();
  for (const AdapterModuleRow& r : a.modules) rows.push_back(ModuleRowJson(r));
  j["modules"] = std::move(rows);
  return j;
}

Json EngineJson(const EngineReport& e) {
  Json findings = Json::array();
  Json counts = {{"reject", 0}, {"wrong", 0}, {"note", 0}};
  for (const EngineFinding& f : e.findings) {
    const std::string severity(EngineSeverityName(f.severity));
    counts[severity] = counts[severity].get<int>() + 1;
    Json j = {{"severity", severity}};
    for (EngineFinding::Subject kind :
         {EngineFinding::Subject::kKey, EngineFinding::Subject::kField, EngineFinding::Subject::kModule}) {
      j[std::string(EngineSubjectName(kind))] = f.subject_kind == kind ? Json(f.subject) : Json(nullptr);
    }
    j["message"] = f.message;
    j["fix_layout"] = f.fix_layout ? Json(std::string(LayoutName(*f.fix_layout))) : Json(nullptr);
    j["engine_max_lora_rank"] = f.engine_max_lora_rank > 0 ? Json(f.engine_max_lora_rank) : Json(nullptr);
    findings.push_back(std::move(j));
  }
  Json j = {{"findings", std::move(findings)}, {"counts", std::move(counts)}, {"with_base", e.with_base}};
  if (e.lora_layout_possible.has_value()) {
    j["lora_layout"] = {{"possible", *e.lora_layout_possible},
                        {"refusal", *e.lora_layout_possible ? Json(nullptr) : Json(e.lora_layout_refusal)},
                        {"rank", e.lora_layout_rank}};
  }
  return j;
}

Json PlanTargetJson(const PlanTarget& t) {
  Json j = {{"tensor", t.tensor},
            {"source", t.source.empty() ? Json(nullptr) : Json(t.source)},
            {"shape", t.shape},
            {"dtype", DTypeName(t.dtype)},
            {"quantization", t.quantization.empty() ? Json(nullptr) : Json(t.quantization)},
            {"rows", {t.row_begin, t.row_end}},
            {"partial", t.partial}};
  j["part"] = t.part.empty() ? Json(nullptr) : Json(t.part);
  j["lora_b_rows"] = t.part.empty() ? Json(nullptr) : Json({t.b_row_begin, t.b_row_end});
  return j;
}

Json PlanJson(const AdapterPlanReport& p) {
  Json j = {{"base", p.base.string()},
            {"tie_word_embeddings", p.tie_word_embeddings},
            {"error", p.error.ok() ? Json(nullptr) : Json(p.error.message())}};
  if (p.base_config.has_value()) j["base_config"] = ModelConfigJson(*p.base_config);
  Json modules = Json::array();
  for (const PlanModuleRow& m : p.modules) {
    Json targets = Json::array();
    for (const PlanTarget& t : m.targets) targets.push_back(PlanTargetJson(t));
    modules.push_back({{"module", m.module},
                       {"kind", m.embedding ? "embedding" : "linear"},
                       {"rank", m.rank},
                       {"scaling", m.scaling},
                       {"dora", m.dora},
                       {"lora_bias", m.lora_bias},
                       {"fan_in_fan_out", m.fan_in_fan_out},
                       {"bias_target", m.bias_target.empty() ? Json(nullptr) : Json(m.bias_target)},
                       {"targets", std::move(targets)}});
  }
  j["modules"] = std::move(modules);
  Json replacements = Json::array();
  for (const PlanReplacementRow& r : p.replacements) {
    replacements.push_back({{"base_tensor", r.base_tensor},
                            {"adapter_key", r.adapter_key},
                            {"why", r.why},
                            {"shape", r.shape},
                            {"dtype", DTypeName(r.dtype)},
                            {"equals_base", r.equals_base}});
  }
  j["replacements"] = std::move(replacements);
  Json tokens = Json::array();
  for (const PlanTokenRows& t : p.token_rows) {
    tokens.push_back({{"base_tensor", t.base_tensor}, {"adapter_key", t.adapter_key}, {"rows", t.rows}});
  }
  j["token_rows"] = std::move(tokens);
  j["tied"] = p.tied;
  j["tied_source"] = p.tied_source.empty() ? Json(nullptr) : Json(p.tied_source);
  j["untie"] = p.untie;
  j["quantized_targets"] = p.quantized_targets;
  j["warnings"] = p.warnings;
  return j;
}

}  // namespace

std::string_view InspectKindName(InspectReport::Kind kind) {
  switch (kind) {
    case InspectReport::Kind::kFile: return "file";
    case InspectReport::Kind::kModelDirectory: return "model";
    case InspectReport::Kind::kAdapterDirectory: return "adapter";
  }
  return "file";
}

Result<InspectReport> Inspect(const fs::path& path) { return Inspect(path, InspectOptions{}); }

Result<InspectReport> Inspect(const fs::path& path, const InspectOptions& options) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return Status::NotFound(path.string() + ": no such file or directory");
  InspectReport report;
  report.path = path;
  const bool is_dir = fs::is_directory(path, ec);
  const fs::path dir = is_dir ? path : (path.has_parent_path() ? path.parent_path() : fs::path("."));
  const bool adapter_config_given = !is_dir && path.filename() == "adapter_config.json";
  if (adapter_config_given || (is_dir && fs::is_regular_file(path / "adapter_config.json", ec))) {
    report.kind = InspectReport::Kind::kAdapterDirectory;
    FERRY_RETURN_IF_ERROR(InspectAdapter(dir, options, &report));
    return report;
  }
  if (!options.base.empty()) {
    return Status::InvalidArgument(path.string() + ": a base model (" + options.base.string() +
                                   ") applies only to a PEFT adapter (a directory with adapter_config.json), and this "
                                   "is a " +
                                   (is_dir ? "model directory" : "tensor file"));
  }
  if (is_dir) {
    report.kind = InspectReport::Kind::kModelDirectory;
    FERRY_RETURN_IF_ERROR(InspectModelDir(path, &report));
  } else {
    FERRY_RETURN_IF_ERROR(ReadTensors(path, &report).status());
  }
  return report;
}

std::string ReportToJson(const InspectReport& report, const ReportJsonOptions& options) {
  Json j = {{"path", report.path.string()}, {"kind", InspectKindName(report.kind)}, {"format", report.format}};
  j["files"] = report.files;
  j["metadata"] = report.metadata;
  j["totals"] = TotalsJson(report.totals);
  if (options.include_tensors) {
    j["tensors"] = TensorsJson(report.tensors, options.tensor_limit);
    j["tensors_truncated"] = options.tensor_limit != 0 && report.tensors.size() > options.tensor_limit;
  }
  if (report.model_config.has_value()) j["config"] = ModelConfigJson(*report.model_config);
  if (report.adapter.has_value()) j["adapter"] = AdapterJson(*report.adapter);
  if (report.engine.has_value()) j["engine"] = EngineJson(*report.engine);
  if (report.plan.has_value()) j["plan"] = PlanJson(*report.plan);
  j["issues"] = report.issues;
  return j.dump(options.indent, ' ', /*ensure_ascii=*/false, nlohmann::json::error_handler_t::replace);
}

}  // namespace ferry
