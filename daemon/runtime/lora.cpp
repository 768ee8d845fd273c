#include "daemon/runtime/lora.h"

#include <ATen/core/grad_mode.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <set>

#include "core/checkpoint.h"
#include "core/mapped_file.h"
#include "core/safetensors.h"
#include "core/staging_dir.h"
#include "daemon/runtime/torch_util.h"

namespace ferry::runtime {
namespace {

using ojson = nlohmann::ordered_json;

constexpr const char* kPrefix = "base_model.model.";

double DropoutOf(const PeftConfig& c) {
  auto j = nlohmann::json::parse(c.raw_json, nullptr, false);
  if (j.is_object()) {
    auto it = j.find("lora_dropout");
    if (it != j.end() && it->is_number()) return it->get<double>();
  }
  return 0.0;
}

Status CheckTrainable(const PeftConfig& c) {
  FERRY_RETURN_IF_ERROR(c.CheckMergeable());
  if (c.use_dora) return Status::Unsupported(c.source + ": use_dora: DoRA adapters are not supported by the runtime");
  if (c.lora_bias) return Status::Unsupported(c.source + ": lora_bias: LoRA biases are not supported by the runtime");
  if (!c.modules_to_save.empty()) {
    return Status::Unsupported(c.source + ": modules_to_save: full-module copies are not supported by the runtime");
  }
  if (c.bias != PeftBias::kNone) {
    return Status::Unsupported(c.source + ": bias: training base biases is not supported (use \"none\")");
  }
  if (c.fan_in_fan_out) {
    return Status::InvalidArgument(c.source +
                                   ": fan_in_fan_out is true, but Llama/Mistral/Qwen2 linear weights are (out, in)");
  }
  return Status::OK();
}

// The modules of `model` the config targets, in model order.
Result<std::vector<const Linear*>> Targets(const CausalLM& model, const PeftConfig& c) {
  if (model.fused()) {
    return Status::InvalidArgument(c.source +
                                   ": the model's weights are in the fused layout (qkv_proj, gate_up_proj); "
                                   "LoRA needs the Hugging Face layout");
  }
  std::vector<const Linear*> out;
  for (const Linear* l : model.Linears()) {
    if (c.IsTargeted(l->name, 2)) out.push_back(l);
  }
  for (const char* embedding : {"model.embed_tokens"}) {
    if (c.target_modules.form != ModuleSelector::Form::kAllLinear && c.IsTargeted(embedding, 2)) {
      return Status::Unsupported(c.source + ": target_modules selects the embedding '" + std::string(embedding) +
                                 "': embedding LoRA is not supported by the runtime");
    }
  }
  if (out.empty()) {
    return Status::InvalidArgument(
        c.source +
        ": target_modules matches no linear layer of the model (layers are named "
        "like 'model.layers.0.self_attn.q_proj', 'model.layers.0.mlp.down_proj', 'lm_head')");
  }
  return out;
}

}  // namespace

std::string LoraKey(const std::string& module, char factor) {
  return std::string(kPrefix) + module + ".lora_" + factor + ".weight";
}

Status LoraAdapter::Bind(const CausalLM& model) {
  binding_.layers.assign(static_cast<size_t>(model.num_layers()), {});
  binding_.lm_head = nullptr;
  for (int i = 0; i < model.num_layers(); ++i) {
    for (Proj p : kAllProj) {
      auto it = modules_.find(model.layer_linear(i, p).name);
      if (it != modules_.end()) binding_.layers[static_cast<size_t>(i)][static_cast<size_t>(p)] = &it->second;
    }
  }
  if (auto it = modules_.find("lm_head"); it != modules_.end()) binding_.lm_head = &it->second;
  return Status::OK();
}

Result<std::unique_ptr<LoraAdapter>> LoraAdapter::Create(const CausalLM& model, const PeftConfig& config,
                                                         uint64_t seed) {
  FERRY_RETURN_IF_ERROR(CheckTrainable(config));
  FERRY_ASSIGN_OR_RETURN(std::vector<const Linear*> targets, Targets(model, config));
  std::unique_ptr<LoraAdapter> a(new LoraAdapter());
  a->config_ = config;
  const double dropout = DropoutOf(config);
  FERRY_RETURN_IF_ERROR(GuardTorch("initialising LoRA", [&]() -> Status {
    at::Generator gen = at::detail::createCPUGenerator(seed);
    const auto opts = at::TensorOptions().dtype(at::kFloat);
    for (const Linear* l : targets) {
      const int r = config.RankFor(l->name);
      if (r <= 0) return Status::InvalidArgument(config.source + ": rank of '" + l->name + "' is " + std::to_string(r));
      LoraModule m;
      // kaiming_uniform_(a=sqrt(5)): gain = sqrt(2 / (1 + 5)), bound = gain * sqrt(3 / fan_in) = 1 / sqrt(fan_in).
      const double bound = 1.0 / std::sqrt(static_cast<double>(l->in));
      m.a = at::empty({r, l->in}, opts).uniform_(-bound, bound, gen).to(model.device()).set_requires_grad(true);
      m.b = at::zeros({l->out, r}, opts.device(model.device())).set_requires_grad(true);
      m.scaling = config.ScalingFor(l->name);
      m.dropout = dropout;
      a->params_[LoraKey(l->name, 'A')] = m.a;
      a->params_[LoraKey(l->name, 'B')] = m.b;
      a->modules_[l->name] = std::move(m);
    }
    return Status::OK();
  }));
  FERRY_RETURN_IF_ERROR(a->Bind(model));
  return a;
}

Result<std::unique_ptr<LoraAdapter>> LoraAdapter::Load(const CausalLM& model, const std::filesystem::path& dir) {
  FERRY_ASSIGN_OR_RETURN(PeftConfig config, LoadPeftConfig(dir));
  FERRY_RETURN_IF_ERROR(CheckTrainable(config));
  FERRY_ASSIGN_OR_RETURN(std::vector<const Linear*> targets, Targets(model, config));
  FERRY_ASSIGN_OR_RETURN(std::filesystem::path weights_path, FindWeights(dir));
  FERRY_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::Open(weights_path));
  const std::string where = weights_path.string();
  std::unique_ptr<LoraAdapter> a(new LoraAdapter());
  a->config_ = config;
  const double dropout = DropoutOf(config);
  std::set<std::string> used;
  for (const Linear* l : targets) {
    LoraModule m;
    const int r = config.RankFor(l->name);
    for (char factor : {'A', 'B'}) {
      const std::string key = LoraKey(l->name, factor);
      const TensorInfo* info = ckpt.Info(key);
      if (!info)
        return Status::NotFound(where + ": missing tensor '" + key + "' (the config targets '" + l->name + "')");
      const Shape want = factor == 'A' ? Shape{r, l->in} : Shape{l->out, r};
      if (info->shape != want) {
        return Status::InvalidArgument(where + ": tensor '" + key + "' has shape " + ShapeToString(info->shape) +
                                       ", expected " + ShapeToString(want) + " (rank " + std::to_string(r) + ")");
      }
      if (!IsFloatingPoint(info->dtype)) {
        return Status::InvalidArgument(where + ": tensor '" + key + "' is " + std::string(DTypeName(info->dtype)));
      }
      FERRY_ASSIGN_OR_RETURN(Tensor t, ckpt.Get(key));
      FERRY_ASSIGN_OR_RETURN(at::Tensor v, ToTorch(t, at::kCPU));
      FERRY_ASSIGN_OR_RETURN(at::Tensor p, GuardTorch("loading " + key, [&] {
                               // Trainable parameters own their memory (fp32, as PEFT keeps them).
                               return v.to(at::kFloat).clone().to(model.device()).set_requires_grad(true);
                             }));
      (factor == 'A' ? m.a : m.b) = p;
      a->params_[key] = p;
      used.insert(key);
    }
    m.scaling = config.ScalingFor(l->name);
    m.dropout = dropout;
    a->modules_[l->name] = std::move(m);
  }
  for (const std::string& name : ckpt.names()) {
    if (!used.count(name)) {
      return Status::InvalidArgument(where + ": tensor '" + name +
                                     "' does not belong to a module the config targets on this model");
    }
  }
  FERRY_RETURN_IF_ERROR(a->Bind(model));
  return a;
}

std::vector<at::Tensor> LoraAdapter::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& [k, v] : params_) out.push_back(v);
  return out;
}

int64_t LoraAdapter::num_parameters() const {
  int64_t n = 0;
  for (const auto& [k, v] : params_) n += v.numel();
  return n;
}

Result<std::map<std::string, Tensor>> LoraAdapter::ExportTensors() const {
  std::map<std::string, Tensor> out;
  for (const auto& [key, p] : params_) {
    FERRY_ASSIGN_OR_RETURN(at::Tensor copy, GuardTorch("exporting " + key, [&] {
                             return p.detach().to(at::kCPU, at::kFloat, /*non_blocking=*/false, /*copy=*/true);
                           }));
    FERRY_ASSIGN_OR_RETURN(out[key], ToCore(copy));
  }
  return out;
}

std::string LoraAdapter::ConfigJson(const std::string& base_model_name_or_path) const {
  // Start from the config's own text (every field PEFT wrote or the user set survives), then
  // make the fields PEFT needs to load it explicit.
  ojson j = ojson::parse(config_.raw_json, nullptr, false);
  if (!j.is_object()) j = ojson::object();
  j["peft_type"] = "LORA";
  j["task_type"] = "CAUSAL_LM";
  j["base_model_name_or_path"] = base_model_name_or_path;
  j["r"] = config_.r;
  j["lora_alpha"] = config_.lora_alpha == std::floor(config_.lora_alpha) && std::abs(config_.lora_alpha) < 1e15
                        ? ojson(static_cast<int64_t>(config_.lora_alpha))
                        : ojson(config_.lora_alpha);
  j["use_rslora"] = config_.use_rslora;
  j["lora_dropout"] = DropoutOf(config_);
  j["bias"] = "none";
  j["fan_in_fan_out"] = false;
  j["use_dora"] = false;
  j["inference_mode"] = true;
  if (!j.contains("init_lora_weights")) j["init_lora_weights"] = true;
  if (!j.contains("modules_to_save")) j["modules_to_save"] = nullptr;
  if (!j.contains("rank_pattern")) j["rank_pattern"] = ojson::object();
  if (!j.contains("alpha_pattern")) j["alpha_pattern"] = ojson::object();
  if (!j.contains("target_modules")) {
    std::vector<std::string> names;
    for (const auto& [m, mod] : modules_) names.push_back(m);
    j["target_modules"] = names;
  }
  return j.dump(2) + "\n";
}

Status LoraAdapter::WriteFiles(const std::filesystem::path& dir, const std::string& base_model_name_or_path,
                               bool sync) const {
  FERRY_ASSIGN_OR_RETURN(auto tensors, ExportTensors());
  std::vector<TensorSpec> specs;
  for (const auto& [name, t] : tensors) specs.push_back({name, t.dtype(), t.shape()});
  WriterOptions wo;
  wo.sync = sync;
  FERRY_ASSIGN_OR_RETURN(auto writer, SafetensorsWriter::CreateFile(dir / "adapter_model.safetensors", specs, wo));
  for (const auto& [name, t] : tensors) FERRY_RETURN_IF_ERROR(writer->Write(name, t));
  FERRY_RETURN_IF_ERROR(writer->Finish());
  return WriteFileAtomic(dir / "adapter_config.json", ConfigJson(base_model_name_or_path), sync);
}

Status LoraAdapter::Save(const std::filesystem::path& dir, const std::string& base_model_name_or_path,
                         bool force) const {
  FERRY_ASSIGN_OR_RETURN(StagingDir staging, StagingDir::Create(dir, force));
  FERRY_RETURN_IF_ERROR(WriteFiles(staging.path(), base_model_name_or_path));
  return staging.Commit();
}

Status LoraAdapter::LoadInto(const CausalLM& model, const std::filesystem::path& dir) {
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<LoraAdapter> other, Load(model, dir));
  if (other->params_.size() != params_.size()) {
    return Status::InvalidArgument(dir.string() + ": the adapter has " + std::to_string(other->params_.size()) +
                                   " tensors, this run's has " + std::to_string(params_.size()));
  }
  for (const auto& [key, p] : params_) {
    auto it = other->params_.find(key);
    if (it == other->params_.end() || !it->second.sizes().equals(p.sizes())) {
      return Status::InvalidArgument(dir.string() + ": tensor '" + key +
                                     "' is missing or has another shape than this run's");
    }
  }
  return GuardTorch("loading " + dir.string(), [&]() -> Status {
    at::NoGradGuard no_grad;
    for (auto& [key, p] : params_) const_cast<at::Tensor&>(p).copy_(other->params_.at(key));
    return Status::OK();
  });
}

}  // namespace ferry::runtime
