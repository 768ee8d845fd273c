#include "convert/merge_plan.h"

#include <cmath>
#include <cstring>

#include "core/text.h"
#include "kernels/lora_merge.h"

namespace ferry {
namespace {

struct Group {
  std::string a, b, bias, emb_a, emb_b, magnitude;
};

class Planner {
 public:
  Planner(const PeftConfig& config, const Checkpoint& adapter, const Checkpoint& base)
      : config_(config), adapter_(adapter), base_(base) {}

  Result<MergePlan> Run(bool tie_word_embeddings) {
    FERRY_ASSIGN_OR_RETURN(plan_.quantized, FindQuantized4bit(base_));
    plan_.quant_aux = QuantAuxKeys(plan_.quantized);
    FindTiedSource(tie_word_embeddings);
    std::map<std::string, Group> groups;
    for (const auto& key : adapter_.names()) {
      auto parsed = ParseAdapterKey(key, &config_);
      if (!parsed.ok()) return parsed.status().WithContext(adapter_.FileOf(key).string());
      FERRY_RETURN_IF_ERROR(Classify(key, *parsed, groups));
    }
    for (const auto& [module, g] : groups) FERRY_RETURN_IF_ERROR(AddModule(module, g));
    for (size_t i = 0; i < plan_.modules.size(); ++i) {
      plan_.deltas[plan_.modules[i].target].push_back(i);
      if (!plan_.modules[i].bias_target.empty()) plan_.bias_deltas[plan_.modules[i].bias_target].push_back(i);
    }
    if (plan_.tied && plan_.Changes(plan_.lm_head_key)) plan_.untie = true;
    return std::move(plan_);
  }

 private:
  std::string Where(const std::string& adapter_key) const {
    // In-memory adapters (the snapshot builder, the daemon) have no file: name the origin.
    std::string where = adapter_.FileOf(adapter_key).string();
    if (where.empty()) where = adapter_.path().empty() ? std::string("adapter") : adapter_.path().string();
    return where + ": adapter tensor " + Quote(adapter_key);
  }

  void FindTiedSource(bool tie) {
    if (!tie || base_.Contains(plan_.lm_head_key)) return;
    for (const char* suffix : {"embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight"}) {
      for (const auto& n : base_.names()) {
        if (n.ends_with(suffix)) {
          plan_.tied = true;
          plan_.tied_source = n;
          return;
        }
      }
    }
  }

  bool HasBase(const std::string& name) const {
    return base_.Contains(name) || (plan_.tied && name == plan_.lm_head_key);
  }

  // The logical (dequantized) shape of a base tensor.
  Shape BaseShape(const std::string& name) const {
    auto q = plan_.quantized.find(name);
    if (q != plan_.quantized.end()) return q->second.shape;
    const TensorInfo* info = base_.Info(plan_.SourceOf(name));
    return info ? info->shape : Shape{};
  }

  Status Classify(const std::string& key, const AdapterKey& k, std::map<std::string, Group>& groups) {
    switch (k.kind) {
      case AdapterKey::kLoraA: groups[k.module].a = key; return Status::OK();
      case AdapterKey::kLoraB: groups[k.module].b = key; return Status::OK();
      case AdapterKey::kLoraBBias: groups[k.module].bias = key; return Status::OK();
      case AdapterKey::kEmbeddingA: groups[k.module].emb_a = key; return Status::OK();
      case AdapterKey::kEmbeddingB: groups[k.module].emb_b = key; return Status::OK();
      case AdapterKey::kMagnitude: groups[k.module].magnitude = key; return Status::OK();
      case AdapterKey::kTrainableTokens: return AddTokenRows(key, k);
      case AdapterKey::kModulesToSave:
      case AdapterKey::kBaseLayer:
      case AdapterKey::kOther: return AddReplacement(key, k.module + "." + k.param);
    }
    return Status::Internal("unhandled adapter key kind");
  }

  Status AddReplacement(const std::string& key, const std::string& target) {
    if (!HasBase(target)) {
      return Status::NotFound(Where(key) + " replaces base tensor " + Quote(target) + ", which " +
                              base_.path().string() + " does not have");
    }
    FERRY_ASSIGN_OR_RETURN(Tensor t, adapter_.Get(key));
    const Shape want = BaseShape(target);
    if (t.shape() != want) {
      return Status::InvalidArgument(Where(key) + " has shape " + ShapeToString(t.shape()) + " but base tensor " +
                                     Quote(target) + " has shape " + ShapeToString(want));
    }
    if (!CanReadAsF32(t.dtype()) && plan_.quantized.count(target) == 0 && base_.Info(plan_.SourceOf(target)) &&
        base_.Info(plan_.SourceOf(target))->dtype != t.dtype()) {
      return Status::InvalidArgument(Where(key) + " is " + std::string(DTypeName(t.dtype())) +
                                     " and cannot replace base tensor " + Quote(target));
    }
    if (!plan_.replacements.emplace(target, key).second) {
      return Status::InvalidArgument(Where(key) + " and " + Quote(plan_.replacements[target]) + " both replace " +
                                     Quote(target));
    }
    return Status::OK();
  }

  Status AddTokenRows(const std::string& key, const AdapterKey& k) {
    const std::string target = k.module + ".weight";
    if (!HasBase(target)) {
      return Status::NotFound(Where(key) + " changes rows of base tensor " + Quote(target) + ", which " +
                              base_.path().string() + " does not have");
    }
    std::vector<int64_t> rows;
    const auto& tti = config_.trainable_token_indices;
    if (!tti.by_module.empty()) {
      for (const auto& [name, idx] : tti.by_module) {
        if (k.module == name || k.module.ends_with("." + name)) rows = idx;
      }
    } else {
      rows = tti.embedding;
    }
    if (rows.empty()) {
      return Status::InvalidArgument(
          Where(key) + ": adapter_config.json field 'trainable_token_indices' names no rows for " + Quote(k.module));
    }
    FERRY_ASSIGN_OR_RETURN(Tensor t, adapter_.Get(key));
    const Shape w = BaseShape(target);
    if (t.shape().size() != 2 || w.size() != 2 || t.shape()[0] != static_cast<int64_t>(rows.size()) ||
        t.shape()[1] != w[1]) {
      return Status::InvalidArgument(Where(key) + " has shape " + ShapeToString(t.shape()) + " but " +
                                     std::to_string(rows.size()) + " token rows of " + Quote(target) + " " +
                                     ShapeToString(w) + " were expected");
    }
    for (int64_t r : rows) {
      if (r < 0 || r >= w[0]) {
        return Status::InvalidArgument(Where(key) + ": token index " + std::to_string(r) + " is outside " +
                                       Quote(target) + " (" + std::to_string(w[0]) + " rows)");
      }
    }
    plan_.token_rows[target] = {key, rows};
    return Status::OK();
  }

  // Finds where module M's delta lands: "M.weight", or a row range of a fused tensor.
  bool ResolveTarget(const std::string& module, int64_t delta_out, LoraModule& m) const {
    if (HasBase(module + ".weight")) {
      m.target = module + ".weight";
      return true;
    }
    const auto dot = module.rfind('.');
    if (dot == std::string::npos) return false;
    const std::string parent = module.substr(0, dot + 1);
    const std::string leaf = module.substr(dot + 1);
    auto fused_rows = [&](const std::string& fused) -> int64_t {
      Shape s = BaseShape(fused);
      return s.size() == 2 ? s[0] : -1;
    };
    if (leaf == "q_proj" || leaf == "k_proj" || leaf == "v_proj") {
      const std::string fused = parent + "qkv_proj.weight";
      if (!base_.Contains(fused)) return false;
      // Phi-3 convention: q has hidden_size rows (= the fused tensor's input dim), k and v split the rest.
      const Shape s = BaseShape(fused);
      const int64_t q_rows = s[1];
      const int64_t kv_rows = (s[0] - q_rows) / 2;
      m.target = fused;
      m.row_offset = leaf == "q_proj" ? 0 : leaf == "k_proj" ? q_rows : q_rows + kv_rows;
      const int64_t rows = leaf == "q_proj" ? q_rows : kv_rows;
      return rows == delta_out && fused_rows(fused) > 0;
    }
    if (leaf == "gate_proj" || leaf == "up_proj") {
      const std::string fused = parent + "gate_up_proj.weight";
      if (!base_.Contains(fused)) return false;
      const int64_t half = fused_rows(fused) / 2;
      m.target = fused;
      m.row_offset = leaf == "gate_proj" ? 0 : half;
      return half == delta_out;
    }
    return false;
  }

  Status AddModule(const std::string& module, const Group& g) {
    LoraModule m;
    m.module = module;
    const bool linear = !g.a.empty() || !g.b.empty();
    const bool embedding = !g.emb_a.empty() || !g.emb_b.empty();
    const std::string any = !g.a.empty()       ? g.a
                            : !g.b.empty()     ? g.b
                            : !g.emb_a.empty() ? g.emb_a
                            : !g.emb_b.empty() ? g.emb_b
                            : !g.bias.empty()  ? g.bias
                                               : g.magnitude;
    if (linear && embedding)
      return Status::InvalidArgument(Where(any) + ": module has both linear and embedding LoRA tensors");
    if (!linear && !embedding) {
      return Status::InvalidArgument(Where(any) + ": LoRA tensor without lora_A / lora_B for module " + Quote(module));
    }
    m.kind = linear ? LoraModule::Kind::kLinear : LoraModule::Kind::kEmbedding;
    m.a_key = linear ? g.a : g.emb_a;
    m.b_key = linear ? g.b : g.emb_b;
    if (m.a_key.empty() || m.b_key.empty()) {
      const std::string have = m.a_key.empty() ? m.b_key : m.a_key;
      return Status::InvalidArgument(Where(have) + " has no matching " + (m.a_key.empty() ? "lora_A" : "lora_B") +
                                     " tensor for module " + Quote(module));
    }
    const TensorInfo* a = adapter_.Info(m.a_key);
    const TensorInfo* b = adapter_.Info(m.b_key);
    if (a->shape.size() != 2 || b->shape.size() != 2) {
      return Status::InvalidArgument(Where(m.a_key) + " " + ShapeToString(a->shape) + " and " + Quote(m.b_key) + " " +
                                     ShapeToString(b->shape) + " must both be 2-D");
    }
    if (!CanReadAsF32(a->dtype) || !CanReadAsF32(b->dtype)) {
      return Status::Unsupported(Where(m.a_key) + ": LoRA tensors must be floating point");
    }
    m.rank = a->shape[0];
    if (b->shape[1] != m.rank) {
      return Status::InvalidArgument(Where(m.a_key) + " has rank " + std::to_string(m.rank) + " but " + Quote(m.b_key) +
                                     " has rank " + std::to_string(b->shape[1]) + " (shapes " +
                                     ShapeToString(a->shape) + " and " + ShapeToString(b->shape) + ")");
    }
    const int cfg_rank = config_.RankFor(module);
    if (cfg_rank != m.rank) {
      return Status::InvalidArgument(Where(m.a_key) + " has rank " + std::to_string(m.rank) + " but " + config_.source +
                                     " gives module " + Quote(module) + " rank " + std::to_string(cfg_rank));
    }
    m.in = a->shape[1];
    m.out = b->shape[0];
    m.scaling = config_.ScalingFor(module);
    if (!std::isfinite(m.scaling))
      return Status::InvalidArgument(config_.source + ": scaling of " + Quote(module) + " is not finite");

    if (!HasBase(module + ".weight") && m.kind == LoraModule::Kind::kLinear && g.magnitude.empty() && g.bias.empty()) {
      // A fused adapter module onto separate base tensors: split B by rows.
      const auto dot = module.rfind('.');
      const std::string parent = dot == std::string::npos ? "" : module.substr(0, dot + 1);
      const std::string leaf = dot == std::string::npos ? module : module.substr(dot + 1);
      std::vector<std::string> parts;
      if (leaf == "qkv_proj") parts = {"q_proj", "k_proj", "v_proj"};
      if (leaf == "gate_up_proj") parts = {"gate_proj", "up_proj"};
      bool all = !parts.empty();
      for (const auto& p : parts) all = all && base_.Contains(parent + p + ".weight");
      if (all) {
        int64_t row = 0;
        for (const auto& p : parts) {
          const Shape w = BaseShape(parent + p + ".weight");
          LoraModule part = m;
          part.target = parent + p + ".weight";
          part.fused_module = module;
          part.module = parent + p;
          part.b_row_begin = row;
          part.out = w.size() == 2 ? w[0] : -1;
          if (w.size() != 2 || w[1] != m.in) {
            return Status::InvalidArgument(Where(m.a_key) + ": base tensor " + Quote(part.target) + " " +
                                           ShapeToString(w) + " does not take input dimension " + std::to_string(m.in));
          }
          row += part.out;
          plan_.modules.push_back(std::move(part));
        }
        if (row != m.out) {
          plan_.modules.resize(plan_.modules.size() - parts.size());
          return Status::InvalidArgument(Where(m.b_key) + " has " + std::to_string(m.out) +
                                         " rows but the base tensors " + "it splits onto have " + std::to_string(row));
        }
        return Status::OK();
      }
    }
    if (!ResolveTarget(module, m.out, m)) {
      return Status::NotFound(Where(m.a_key) + ": base " + base_.path().string() + " has no tensor " +
                              Quote(module + ".weight") + " (nor a fused tensor with a matching row range)");
    }
    const Shape w = BaseShape(m.target);
    if (w.size() != 2) {
      return Status::InvalidArgument(Where(m.a_key) + ": base tensor " + Quote(m.target) + " has shape " +
                                     ShapeToString(w) + ", not a 2-D weight");
    }
    if (m.kind == LoraModule::Kind::kEmbedding) {
      // lora_embedding_A [r, vocab], lora_embedding_B [dim, r], weight [vocab, dim].
      if (w[0] != m.in || w[1] != m.out) {
        return Status::InvalidArgument(Where(m.a_key) + ": delta (B @ A)^T is [" + std::to_string(m.in) + ", " +
                                       std::to_string(m.out) + "] but base tensor " + Quote(m.target) + " is " +
                                       ShapeToString(w));
      }
    } else if (m.row_offset > 0 || w[0] != m.out || w[1] != m.in) {
      const bool fits = m.row_offset + m.out <= w[0] && w[1] == m.in;
      const bool transposed = m.row_offset == 0 && w[0] == m.in && w[1] == m.out;
      if (transposed && !fits) {
        m.fan_in_fan_out = true;  // PEFT forces fan_in_fan_out for Conv1D-style [in, out] weights
        if (!config_.fan_in_fan_out) {
          plan_.warnings.push_back("module " + module +
                                   ": base weight is stored [in, out] (Conv1D); merged with fan_in_fan_out");
        }
      } else if (!fits) {
        return Status::InvalidArgument(Where(m.a_key) + ": delta B @ A is [" + std::to_string(m.out) + ", " +
                                       std::to_string(m.in) + "] but base tensor " + Quote(m.target) + " is " +
                                       ShapeToString(w));
      }
    } else if (config_.fan_in_fan_out && w[0] == w[1]) {
      m.fan_in_fan_out = true;  // square: only the config can tell
    }
    if (!g.magnitude.empty() || config_.use_dora) {
      if (g.magnitude.empty())
        return Status::InvalidArgument(Where(m.a_key) + ": use_dora is set but module " + Quote(module) +
                                       " has no lora_magnitude_vector");
      if (!config_.use_dora)
        return Status::InvalidArgument(Where(g.magnitude) + ": DoRA magnitude present but use_dora is false in " +
                                       config_.source);
      if (m.kind != LoraModule::Kind::kLinear || m.row_offset != 0) {
        return Status::Unsupported(Where(g.magnitude) + ": DoRA is supported on unfused linear layers only");
      }
      const TensorInfo* mag = adapter_.Info(g.magnitude);
      if (mag->shape != Shape{m.out}) {
        return Status::InvalidArgument(Where(g.magnitude) + " has shape " + ShapeToString(mag->shape) + ", expected [" +
                                       std::to_string(m.out) + "]");
      }
      m.magnitude_key = g.magnitude;
    }
    if (!g.bias.empty()) {
      m.bias_key = g.bias;
      m.bias_target = module + ".bias";
      if (!base_.Contains(m.bias_target)) {
        return Status::Unsupported(Where(g.bias) + ": lora_bias needs base tensor " + Quote(m.bias_target) +
                                   ", which the base does not have (PEFT cannot merge it either)");
      }
      const TensorInfo* bi = adapter_.Info(g.bias);
      if (bi->shape != Shape{m.out} || base_.Info(m.bias_target)->shape != Shape{m.out}) {
        return Status::InvalidArgument(Where(g.bias) + " has shape " + ShapeToString(bi->shape) + "; base " +
                                       Quote(m.bias_target) + " has " +
                                       ShapeToString(base_.Info(m.bias_target)->shape));
      }
    }
    plan_.modules.push_back(std::move(m));
    return Status::OK();
  }

  const PeftConfig& config_;
  const Checkpoint& adapter_;
  const Checkpoint& base_;
  MergePlan plan_;
};

}  // namespace

const LoraModule* MergePlan::FusableDelta(const std::string& name, DType base_dtype, const Shape& base_shape) const {
  auto d = deltas.find(name);
  if (d == deltas.end() || d->second.size() != 1) return nullptr;
  if (bias_deltas.count(name) || replacements.count(name) || token_rows.count(name) || quantized.count(name)) {
    return nullptr;
  }
  const LoraModule& m = modules[d->second.front()];
  if (m.kind != LoraModule::Kind::kLinear || m.fan_in_fan_out || !m.magnitude_key.empty() || m.row_offset != 0 ||
      m.b_row_begin != 0 || (base_dtype != DType::kBF16 && base_dtype != DType::kF16) ||
      base_shape != Shape{m.out, m.in}) {
    return nullptr;
  }
  return &m;
}

Result<std::vector<float>> ReadTensorAsF32(const Checkpoint& c, const std::string& key) {
  FERRY_ASSIGN_OR_RETURN(Tensor t, c.Get(key));
  std::vector<float> v(static_cast<size_t>(t.numel()));
  Status s = ReadAsF32(t, v);
  if (!s.ok()) {
    const std::string where = c.FileOf(key).empty() ? c.path().string() : c.FileOf(key).string();
    return s.WithContext(where + ": tensor " + Quote(key));
  }
  return v;
}

namespace {

Status ApplyDelta(const LoraModule& m, const Checkpoint& adapter, std::vector<float>& w, int threads) {
  FERRY_ASSIGN_OR_RETURN(std::vector<float> a, ReadTensorAsF32(adapter, m.a_key));
  FERRY_ASSIGN_OR_RETURN(std::vector<float> b, ReadTensorAsF32(adapter, m.b_key));
  const float s = static_cast<float>(m.scaling);
  const float* bp = b.data() + m.b_row_begin * m.rank;
  if (m.kind == LoraModule::Kind::kEmbedding) {
    kernels::LoraEmbeddingDeltaAccumulate(a.data(), bp, m.in, m.out, m.rank, s, w.data(), threads);
  } else if (m.fan_in_fan_out) {
    kernels::LoraDeltaAccumulateFanInFanOut(a.data(), bp, m.out, m.in, m.rank, s, w.data(), threads);
  } else {
    kernels::LoraDeltaAccumulate(a.data(), bp, m.out, m.in, m.rank, s, w.data() + m.row_offset * m.in, threads);
  }
  if (!m.magnitude_key.empty()) {
    FERRY_ASSIGN_OR_RETURN(std::vector<float> mag, ReadTensorAsF32(adapter, m.magnitude_key));
    kernels::DoraApply(w.data(), mag.data(), m.out, m.in, m.fan_in_fan_out);
  }
  return Status::OK();
}

}  // namespace

Status ApplyPlanEdits(const MergePlan& plan, const Checkpoint& adapter, const std::string& name, const Shape& shape,
                      std::vector<float>& w, int threads) {
  if (auto t = plan.token_rows.find(name); t != plan.token_rows.end()) {
    FERRY_ASSIGN_OR_RETURN(std::vector<float> rows, ReadTensorAsF32(adapter, t->second.first));
    const size_t dim = static_cast<size_t>(shape[1]);
    for (size_t i = 0; i < t->second.second.size(); ++i) {
      std::memcpy(&w[static_cast<size_t>(t->second.second[i]) * dim], &rows[i * dim], dim * sizeof(float));
    }
  }
  if (auto d = plan.deltas.find(name); d != plan.deltas.end()) {
    for (size_t idx : d->second) FERRY_RETURN_IF_ERROR(ApplyDelta(plan.modules[idx], adapter, w, threads));
  }
  if (auto b = plan.bias_deltas.find(name); b != plan.bias_deltas.end()) {
    for (size_t idx : b->second) {
      const LoraModule& m = plan.modules[idx];
      FERRY_ASSIGN_OR_RETURN(std::vector<float> bias, ReadTensorAsF32(adapter, m.bias_key));
      const float s = static_cast<float>(m.scaling);
      for (size_t i = 0; i < bias.size(); ++i) w[i] += s * bias[i];
    }
  }
  return Status::OK();
}

Result<std::vector<float>> MergedF32(const MergePlan& plan, const Checkpoint& base, const Checkpoint& adapter,
                                     const std::string& name, const Shape& shape, int threads) {
  std::vector<float> w;
  if (auto r = plan.replacements.find(name); r != plan.replacements.end()) {
    FERRY_ASSIGN_OR_RETURN(w, ReadTensorAsF32(adapter, r->second));
  } else if (auto q = plan.quantized.find(name); q != plan.quantized.end()) {
    FERRY_ASSIGN_OR_RETURN(w, Dequantize4bitAsLoaded(base, q->second));
  } else {
    FERRY_ASSIGN_OR_RETURN(w, ReadTensorAsF32(base, plan.SourceOf(name)));
  }
  FERRY_RETURN_IF_ERROR(ApplyPlanEdits(plan, adapter, name, shape, w, threads));
  return w;
}

Status MergeFusable16(const Tensor& base, const Checkpoint& adapter, const LoraModule& m, std::span<uint16_t> out,
                      int threads) {
  const bool bf16 = base.dtype() == DType::kBF16;
  if ((!bf16 && base.dtype() != DType::kF16) || base.shape() != Shape{m.out, m.in} ||
      out.size() != static_cast<size_t>(m.out * m.in)) {
    return Status::InvalidArgument("MergeFusable16: " + m.target + " is not a 16-bit [" + std::to_string(m.out) + ", " +
                                   std::to_string(m.in) + "] weight with an output of its size");
  }
  FERRY_ASSIGN_OR_RETURN(std::vector<float> a, ReadTensorAsF32(adapter, m.a_key));
  FERRY_ASSIGN_OR_RETURN(std::vector<float> b, ReadTensorAsF32(adapter, m.b_key));
  kernels::LoraMergeRows16(base.data_as<uint16_t>(), bf16 ? kernels::Float16Kind::kBF16 : kernels::Float16Kind::kF16,
                           a.data(), b.data(), m.out, m.in, m.rank, static_cast<float>(m.scaling), out.data(), threads);
  return Status::OK();
}

bool MergePlan::Changes(const std::string& name) const {
  return deltas.count(name) || bias_deltas.count(name) || replacements.count(name) || token_rows.count(name);
}

std::string MergePlan::SourceOf(const std::string& name) const {
  return tied && name == lm_head_key ? tied_source : name;
}

Result<MergePlan> PlanMerge(const PeftConfig& config, const Checkpoint& adapter, const Checkpoint& base,
                            bool tie_word_embeddings) {
  return Planner(config, adapter, base).Run(tie_word_embeddings);
}

}  // namespace ferry
