#include "convert/inspect.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "core/checkpoint.h"
#include "core/mapped_file.h"

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

std::string Quote(std::string_view s) { return "'" + std::string(s) + "'"; }

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

Status ReadTensors(const fs::path& weights_path, InspectReport* report) {
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
  return Status::OK();
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
  if (auto it = j.find("tie_word_embeddings"); it != j.end() && it->is_boolean()) s.tie_word_embeddings = it->get<bool>();
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
    issues->push_back(m + "has LoRA tensors but the config's target_modules / exclude_modules / "
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
  const std::vector<int64_t>* ids = c.trainable_token_indices.embedding.empty() ? nullptr
                                                                                 : &c.trainable_token_indices.embedding;
  for (const auto& [name, list] : c.trainable_token_indices.by_module) {
    if (key.module == name || (key.module.size() > name.size() &&
                               key.module.compare(key.module.size() - name.size() - 1, std::string::npos,
                                                  "." + name) == 0)) {
      ids = &list;
    }
  }
  if (ids == nullptr) {
    issues->push_back("tensor " + Quote(t.name) + ": trainable tokens delta but trainable_token_indices does not "
                      "cover module " + Quote(key.module));
  } else if (t.shape.empty() || t.shape[0] != static_cast<int64_t>(ids->size())) {
    issues->push_back("tensor " + Quote(t.name) + ": shape " + ShapeToString(t.shape) + " does not have one row per "
                      "trainable token index (" + std::to_string(ids->size()) + ")");
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
    case AdapterKey::kEmbeddingA: m.a = &t; m.embedding = true; return true;
    case AdapterKey::kEmbeddingB: m.b = &t; m.embedding = true; return true;
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
    const bool found = std::any_of(summary->saved_full_modules.begin(), summary->saved_full_modules.end(),
                                   [&](const std::string& n) {
                                     auto k = ParseAdapterKey(n, &summary->config);
                                     return k.ok() && (k->module == wanted || k->module.ends_with("." + wanted));
                                   });
    if (!found) issues->push_back("modules_to_save names " + Quote(wanted) + " but the adapter has no tensor for it");
  }
}

Status InspectAdapter(const fs::path& dir, InspectReport* report) {
  FERRY_ASSIGN_OR_RETURN(PeftConfig config, LoadPeftConfig(dir));
  FERRY_RETURN_IF_ERROR(ReadTensors(dir, report));
  report->files.push_back((dir / "adapter_config.json").string());
  AdapterSummary summary;
  summary.config = std::move(config);
  summary.mergeable = summary.config.CheckMergeable();
  if (!summary.mergeable.ok()) report->issues.push_back(summary.mergeable.message());
  if (summary.config.peft_type == "LORA") AnalyzeLora(*report, &summary, &report->issues);
  report->adapter = std::move(summary);
  return Status::OK();
}

Status InspectModelDir(const fs::path& dir, InspectReport* report) {
  FERRY_RETURN_IF_ERROR(ReadTensors(dir, report));
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
  Json j = {{"peft_type", c.peft_type}, {"base_model_name_or_path", c.base_model_name_or_path},
            {"r", c.r}, {"lora_alpha", c.lora_alpha}, {"use_rslora", c.use_rslora}, {"use_dora", c.use_dora},
            {"fan_in_fan_out", c.fan_in_fan_out}, {"bias", PeftBiasName(c.bias)}, {"lora_bias", c.lora_bias}};
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

}  // namespace

std::string_view InspectKindName(InspectReport::Kind kind) {
  switch (kind) {
    case InspectReport::Kind::kFile: return "file";
    case InspectReport::Kind::kModelDirectory: return "model";
    case InspectReport::Kind::kAdapterDirectory: return "adapter";
  }
  return "file";
}

Result<InspectReport> Inspect(const fs::path& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return Status::NotFound(path.string() + ": no such file or directory");
  InspectReport report;
  report.path = path;
  const bool is_dir = fs::is_directory(path, ec);
  const fs::path dir = is_dir ? path : (path.has_parent_path() ? path.parent_path() : fs::path("."));
  const bool adapter_config_given = !is_dir && path.filename() == "adapter_config.json";
  if (adapter_config_given || (is_dir && fs::is_regular_file(path / "adapter_config.json", ec))) {
    report.kind = InspectReport::Kind::kAdapterDirectory;
    FERRY_RETURN_IF_ERROR(InspectAdapter(dir, &report));
  } else if (is_dir) {
    report.kind = InspectReport::Kind::kModelDirectory;
    FERRY_RETURN_IF_ERROR(InspectModelDir(path, &report));
  } else {
    FERRY_RETURN_IF_ERROR(ReadTensors(path, &report));
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
  j["issues"] = report.issues;
  return j.dump(options.indent, ' ', /*ensure_ascii=*/false, nlohmann::json::error_handler_t::replace);
}

}  // namespace ferry
