// LoRA adapters on a CausalLM with PEFT's semantics, saved and loaded in PEFT's format.
//
// Semantics (peft/tuners/lora): a targeted linear layer y = W x + b becomes
//   y = W x + b + scaling * B (A dropout(x)),  scaling = lora_alpha / r (rsLoRA: / sqrt(r)),
// with r and alpha per module from rank_pattern / alpha_pattern. Targets: target_modules as a
// list of names (a module matches when its name equals an entry or ends with "." + entry), a
// regex (full match), or "all-linear" (every linear layer but the output layer), minus
// exclude_modules, restricted by layers_to_transform: the rules of convert/peft_config.h, the
// same code the converter resolves adapters with. Initialisation as PEFT's default
// (init_lora_weights = true): A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming_uniform_ with a =
// sqrt(5)), B = 0, so a fresh adapter leaves the model unchanged. Parameters are fp32.
//
// File format (what PeftModel.save_pretrained writes): DIR/adapter_model.safetensors with keys
// "base_model.model.<module>.lora_A.weight" [r, in] and ".lora_B.weight" [out, r], and
// DIR/adapter_config.json (peft_type LORA, task_type CAUSAL_LM, r, lora_alpha, target_modules,
// ...). There is no module tree: names like ".base_layer" or ".default" never exist here.
#pragma once

#include <ATen/ATen.h>

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "convert/peft_config.h"
#include "core/status.h"
#include "core/tensor.h"
#include "daemon/runtime/model.h"

namespace ferry::runtime {

class LoraAdapter {
 public:
  // A fresh adapter for `model` as PEFT's get_peft_model makes it, A drawn from a generator
  // seeded with `seed`. Errors: kInvalidArgument naming the config when no module matches
  // target_modules, when a target is an embedding or the model's weights are fused, or the
  // config is not a mergeable LoRA (PeftConfig::CheckMergeable); DoRA, lora_bias and
  // modules_to_save are kUnsupported.
  static Result<std::unique_ptr<LoraAdapter>> Create(const CausalLM& model, const PeftConfig& config, uint64_t seed);

  // Loads a PEFT adapter directory for `model` (either adapter_model.safetensors or the
  // legacy .bin). Errors name the file and tensor: a key for a module the config does not
  // target or the model lacks, shapes that do not fit, ranks that contradict the config, a
  // targeted module without its tensors.
  static Result<std::unique_ptr<LoraAdapter>> Load(const CausalLM& model, const std::filesystem::path& dir);

  LoraAdapter(const LoraAdapter&) = delete;
  LoraAdapter& operator=(const LoraAdapter&) = delete;

  // Writes `dir` (must not exist, or is replaced when `force`) with adapter_model.safetensors
  // and adapter_config.json, atomically: everything is written to a hidden temporary
  // directory beside it, fsynced and renamed. `base_model_name_or_path` goes into the config.
  Status Save(const std::filesystem::path& dir, const std::string& base_model_name_or_path, bool force = false) const;
  // The two files of Save written into the existing directory `dir` (no staging: for callers
  // that stage a bigger directory themselves, e.g. a training checkpoint). `sync` false skips
  // the fsyncs (a transient copy, e.g. the adapter a vLLM server loads once). Default: true
  Status WriteFiles(const std::filesystem::path& dir, const std::string& base_model_name_or_path,
                    bool sync = true) const;
  // Overwrites the parameters with an adapter directory's (as Load reads it), keeping the
  // tensors (an optimizer holding them stays valid). Errors as Load, and kInvalidArgument
  // when the directory's modules or ranks differ from this adapter's.
  Status LoadInto(const CausalLM& model, const std::filesystem::path& dir);

  // The binding a forward uses.
  const LoraBinding& binding() const { return binding_; }
  const PeftConfig& config() const { return config_; }
  // adapter_config.json as Save writes it.
  std::string ConfigJson(const std::string& base_model_name_or_path) const;

  // Trainable parameters in file-key order, with their PEFT file keys.
  std::vector<at::Tensor> parameters() const;
  const std::map<std::string, at::Tensor>& named_parameters() const { return params_; }

  // The parameters as ferry::Tensor views of fresh fp32 CPU copies (adapter tensors for a sync
  // snapshot). Copies: the trainer may go on changing its parameters.
  Result<std::map<std::string, Tensor>> ExportTensors() const;

  // Number of adapted modules and trainable elements.
  size_t num_modules() const { return modules_.size(); }
  int64_t num_parameters() const;

 private:
  LoraAdapter() = default;
  Status Bind(const CausalLM& model);

  PeftConfig config_;
  std::map<std::string, LoraModule> modules_;  // by module name ("model.layers.0.self_attn.q_proj")
  std::map<std::string, at::Tensor> params_;   // by file key
  LoraBinding binding_;
};

// The file key of a module's LoRA factor: "base_model.model.<module>.lora_A.weight".
std::string LoraKey(const std::string& module, char factor /* 'A' or 'B' */);

}  // namespace ferry::runtime
