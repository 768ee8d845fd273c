// The lora layout (convert/lora_layout.h): one global rank and scaling, the rest baked
// into lora_A exactly where a power of two carries it.
#include "convert/lora_layout.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <span>

#include <nlohmann/json.hpp>

#include "convert/engine_check.h"
#include "core/mapped_file.h"
#include "core/safetensors.h"
#include "core/tensor.h"

namespace ferry {
namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

constexpr std::string_view kPeftPrefix = "base_model.model.";

// One base module of the clean adapter and the adapter modules that land on it.
struct EngineModule {
  std::string name;  // module name as the base stores it
  bool embedding = false;
  int64_t in = 0, out = 0;
  std::vector<const LoraModule*> parts;  // several when separate adapters are fused
};

// The fp32 scaling a merge multiplies by (kernels/lora_merge.h takes a float).
float Fp32Scaling(const LoraModule& m) { return static_cast<float>(m.scaling); }

// |significand| of a nonzero finite float, in [0.5, 1): equal for values a power of two apart.
float Significand(float s) {
  int exponent = 0;
  return std::fabs(std::frexp(s, &exponent));
}

bool IsPowerOfTwoOrZero(double c) {
  if (c == 0) return true;
  int exponent = 0;
  return std::isfinite(c) && std::fabs(std::frexp(c, &exponent)) == 0.5;
}

// g of lora_layout.h: among the nonzero scalings, the largest set with one significand,
// and in it the value (by magnitude) shared by the most modules; ties go to the smaller.
// 1 when no scaling is nonzero.
float ChooseGlobalScaling(const std::vector<const LoraModule*>& parts) {
  std::map<float, int64_t> by_significand;
  std::map<float, int64_t> by_value;
  for (const LoraModule* p : parts) {
    const float s = Fp32Scaling(*p);
    if (s == 0 || !std::isfinite(s)) continue;
    ++by_significand[Significand(s)];
    ++by_value[std::fabs(s)];
  }
  if (by_significand.empty()) return 1.0f;
  float significand = 0;
  int64_t best = 0;
  for (const auto& [sig, n] : by_significand) {
    if (n > best) {
      best = n;
      significand = sig;
    }
  }
  float g = 1.0f;
  best = 0;
  for (const auto& [value, n] : by_value) {
    if (Significand(value) == significand && n > best) {
      best = n;
      g = value;
    }
  }
  return g;
}

// The ratio c = s / g moved into lora_A of `part`.
double FactorOf(const LoraModule& part, float g) {
  return static_cast<double>(Fp32Scaling(part)) / static_cast<double>(g);
}

// True when every value survives a round trip through `dtype` bit for bit.
Result<bool> ExactIn(DType dtype, std::span<const float> values) {
  if (dtype == DType::kF32 || values.empty()) return true;
  const size_t esize = static_cast<size_t>(DTypeBits(dtype) / 8);
  std::vector<std::byte> bytes(values.size() * esize);
  FERRY_RETURN_IF_ERROR(WriteFromF32(values, dtype, bytes));
  FERRY_ASSIGN_OR_RETURN(Tensor t, Tensor::Wrap(dtype, {static_cast<int64_t>(values.size())}, bytes, nullptr));
  std::vector<float> back(values.size());
  FERRY_RETURN_IF_ERROR(ReadAsF32(t, back));
  return std::memcmp(back.data(), values.data(), values.size() * sizeof(float)) == 0;
}

// lora_A of `part` times `c`, each product rounded once to fp32. `exact` is cleared when
// some product is not exactly representable in fp32 (a power-of-two `c` leaving the range).
Result<std::vector<float>> ScaledA(const Checkpoint& adapter, const LoraModule& part, double c, bool* exact) {
  FERRY_ASSIGN_OR_RETURN(std::vector<float> a, ReadTensorAsF32(adapter, part.a_key));
  for (float& x : a) {
    const double v = c * static_cast<double>(x);
    const float f = static_cast<float>(v);
    if (static_cast<double>(f) != v && !std::isnan(v)) *exact = false;
    x = f;
  }
  return a;
}

// Appends fp32 values to the writer as `dtype`.
Status AppendAs(SafetensorsWriter& w, std::span<const float> values, DType dtype) {
  if (dtype == DType::kF32) return w.Append(std::as_bytes(values));
  std::vector<std::byte> buf(values.size() * static_cast<size_t>(DTypeBits(dtype) / 8));
  FERRY_RETURN_IF_ERROR(WriteFromF32(values, dtype, buf));
  return w.Append(buf);
}

// The dtype every factor tensor of the adapter has, or F32 when they differ (or cannot be
// written from fp32).
DType AdapterDType(const Checkpoint& adapter, const std::vector<const LoraModule*>& parts) {
  std::optional<DType> common;
  for (const LoraModule* p : parts) {
    for (const std::string* key : {&p->a_key, &p->b_key}) {
      const TensorInfo* info = adapter.Info(*key);
      if (info == nullptr) return DType::kF32;
      if (common && *common != info->dtype) return DType::kF32;
      common = info->dtype;
    }
  }
  return common && CanWriteFromF32(*common) ? *common : DType::kF32;
}

// Whether every factor of the clean adapter is exact in `dtype` (see lora_layout.h).
Result<bool> FactorsExactIn(DType dtype, const Checkpoint& adapter, const std::vector<const LoraModule*>& parts,
                            float g) {
  for (const LoraModule* p : parts) {
    const double c = FactorOf(*p, g);
    if (!IsPowerOfTwoOrZero(c)) return false;
    bool exact = true;
    FERRY_ASSIGN_OR_RETURN(std::vector<float> a, ScaledA(adapter, *p, c, &exact));
    if (!exact) return false;
    FERRY_ASSIGN_OR_RETURN(bool a_exact, ExactIn(dtype, a));
    if (!a_exact) return false;
    if (adapter.Info(p->b_key)->dtype != dtype) {
      FERRY_ASSIGN_OR_RETURN(std::vector<float> b, ReadTensorAsF32(adapter, p->b_key));
      FERRY_ASSIGN_OR_RETURN(bool b_exact, ExactIn(dtype, b));
      if (!b_exact) return false;
    }
    adapter.Release(p->a_key);
    adapter.Release(p->b_key);
  }
  return true;
}

// lora_alpha as JSON: an integer when g * R is one.
ojson AlphaJson(double alpha) {
  if (alpha == std::floor(alpha) && std::fabs(alpha) < 9.0e15) return static_cast<int64_t>(alpha);
  return alpha;
}

}  // namespace

Result<LoraLayoutSummary> WriteLoraLayout(const PeftConfig& cfg, const Checkpoint& base, const Checkpoint& adapter,
                                          const MergePlan& plan, const LoraLayoutOptions& opt, const fs::path& dir) {
  const std::vector<LoraLayoutRefusal> refusals = FindLoraLayoutRefusals(cfg, base, adapter, plan);
  if (!refusals.empty()) {
    return Status::Unsupported(refusals.front().message +
                               " Only merging applies it: convert to the hf or fused layout instead.");
  }
  std::map<std::string, EngineModule> mods;
  std::vector<const LoraModule*> parts;
  for (const auto& m : plan.modules) {
    const std::string name = m.target.substr(0, m.target.size() - std::string(".weight").size());
    EngineModule& e = mods[name];
    e.name = name;
    e.embedding = m.kind == LoraModule::Kind::kEmbedding;
    const TensorInfo* w = plan.quantized.count(m.target) ? nullptr : base.Info(plan.SourceOf(m.target));
    const Shape ws = w ? w->shape : plan.quantized.at(m.target).shape;
    e.in = m.in;
    e.out = e.embedding ? m.out : (m.fan_in_fan_out ? ws[1] : ws[0]);
    e.parts.push_back(&m);
    parts.push_back(&m);
  }
  int64_t rank = 0;
  for (const auto& [n, e] : mods) {
    int64_t r = 0;
    for (const auto* p : e.parts) r += p->rank;
    rank = std::max(rank, r);
  }

  LoraLayoutSummary s;
  const float g = ChooseGlobalScaling(parts);
  for (const LoraModule* p : parts) {
    if (!IsPowerOfTwoOrZero(FactorOf(*p, g))) ++s.inexact_modules;
  }
  const DType natural = AdapterDType(adapter, parts);
  DType out_dtype = natural;
  if (opt.dtype) out_dtype = CanWriteFromF32(*opt.dtype) ? *opt.dtype : DType::kF32;
  FERRY_ASSIGN_OR_RETURN(bool exact, FactorsExactIn(out_dtype, adapter, parts, g));
  if (!exact && out_dtype != DType::kF32) {
    if (opt.dtype) {
      s.warnings.push_back("lora factors written in " + std::string(DTypeName(out_dtype)) +
                           " as requested are rounded: a module's scaling is not a power of two apart from the "
                           "global scaling (or a factor leaves the dtype's range), so the clean adapter's merge "
                           "differs from the original's; without an explicit output dtype they would be F32");
    } else {
      out_dtype = DType::kF32;
    }
  }
  s.factor_dtype = out_dtype;

  std::vector<TensorSpec> specs;
  for (const auto& [n, e] : mods) {
    const std::string a = e.embedding ? ".lora_embedding_A" : ".lora_A.weight";
    const std::string b = e.embedding ? ".lora_embedding_B" : ".lora_B.weight";
    specs.push_back({std::string(kPeftPrefix) + n + a, out_dtype, {rank, e.in}});
    specs.push_back({std::string(kPeftPrefix) + n + b, out_dtype, {e.out, rank}});
  }
  WriterOptions wopt;
  wopt.basename = "adapter_model";
  wopt.sync = opt.sync;
  FERRY_ASSIGN_OR_RETURN(auto writer, SafetensorsWriter::CreateInDirectory(dir, specs, wopt));
  std::set<std::string> leaves;
  for (const auto& [n, e] : mods) {
    leaves.insert(n.substr(n.rfind('.') + 1));
    // A' = [c_1 A_1; c_2 A_2; ...; 0], B' = block placement of B_i rows/cols, zero elsewhere.
    std::vector<float> a_out(static_cast<size_t>(rank * e.in), 0.0f);
    std::vector<float> b_out(static_cast<size_t>(e.out * rank), 0.0f);
    int64_t col = 0;
    for (const LoraModule* p : e.parts) {
      bool unused = true;
      FERRY_ASSIGN_OR_RETURN(std::vector<float> a, ScaledA(adapter, *p, FactorOf(*p, g), &unused));
      FERRY_ASSIGN_OR_RETURN(std::vector<float> b, ReadTensorAsF32(adapter, p->b_key));
      std::copy(a.begin(), a.end(), a_out.begin() + static_cast<std::ptrdiff_t>(col * e.in));
      for (int64_t o = 0; o < p->out; ++o) {
        for (int64_t k = 0; k < p->rank; ++k) {
          b_out[static_cast<size_t>((p->row_offset + o) * rank + col + k)] =
              b[static_cast<size_t>((p->b_row_begin + o) * p->rank + k)];
        }
      }
      adapter.Release(p->a_key);
      adapter.Release(p->b_key);
      col += p->rank;
    }
    FERRY_RETURN_IF_ERROR(AppendAs(*writer, a_out, out_dtype));
    FERRY_RETURN_IF_ERROR(AppendAs(*writer, b_out, out_dtype));
  }
  FERRY_RETURN_IF_ERROR(writer->Finish());

  // A clean config: one global rank and scaling g (lora_alpha / r), no patterns, no extras.
  const double alpha = static_cast<double>(g) * static_cast<double>(rank);
  ojson j = ojson::parse(cfg.raw_json, nullptr, false);
  if (!j.is_object()) j = ojson::object();
  j["peft_type"] = "LORA";
  j["r"] = rank;
  j["lora_alpha"] = AlphaJson(alpha);
  j["use_rslora"] = false;
  j["use_dora"] = false;
  j["rank_pattern"] = ojson::object();
  j["alpha_pattern"] = ojson::object();
  j["target_modules"] = std::vector<std::string>(leaves.begin(), leaves.end());
  j["modules_to_save"] = nullptr;
  j["lora_bias"] = false;
  j["bias"] = "none";
  j["trainable_token_indices"] = nullptr;
  j["exclude_modules"] = nullptr;
  j["layers_to_transform"] = nullptr;
  j["layers_pattern"] = nullptr;
  j["init_lora_weights"] = true;
  FERRY_RETURN_IF_ERROR(WriteFileAtomic(dir / "adapter_config.json", j.dump(2) + "\n", opt.sync));

  for (const auto& p : writer->OutputPaths()) s.files.push_back(p.filename().string());
  s.files.push_back("adapter_config.json");
  s.tensors_written = static_cast<int64_t>(specs.size());
  s.modules = static_cast<int64_t>(mods.size());
  s.global_rank = rank;
  s.global_alpha = alpha;
  s.global_scaling = g;
  s.bytes_written = writer->bytes_written();
  return s;
}

}  // namespace ferry
