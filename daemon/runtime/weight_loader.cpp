// Loading a CausalLM: checkpoint tensors -> the model's layout (vLLM's load_weights). Every
// tensor is read by its Hugging Face name and checked against the shape config.json gives it;
// 4-bit weights stay packed (Quant4Weight, dequantised per layer in the forward); a tied
// lm_head is the embedding; a tensor the model does not consume is an error. Dense weights are
// views of the checkpoint where device and dtype allow, else copies that a later model may
// borrow (WeightReuse).
#include <torch/version.h>

#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "convert/bnb4.h"
#include "daemon/runtime/model.h"
#include "daemon/runtime/model_internal.h"
#include "daemon/runtime/torch_util.h"

namespace ferry::runtime {
namespace {

// Takes a checkpoint's tensors into the model's layout, one module at a time, and remembers
// every name it consumed.
class WeightReader {
 public:
  // Tensors are read onto `device`, dense ones converted to `dtype`. `quant`: the checkpoint's
  // 4-bit weights by name. `copies` receives every dense tensor held as a copy of its own;
  // `lendable` (an earlier model's copies, or null) lends those `unchanged` names instead.
  WeightReader(const Checkpoint& weights, const ModelConfig& config, const at::Device& device, at::ScalarType dtype,
               std::map<std::string, QuantState4bit> quant, const std::map<std::string, at::Tensor>* lendable,
               std::function<bool(const std::string&)> unchanged, std::map<std::string, at::Tensor>* copies)
      : weights_(weights),
        config_(config),
        where_(weights.path().string()),
        device_(device),
        dtype_(dtype),
        quant_(std::move(quant)),
        lendable_(lendable),
        unchanged_(std::move(unchanged)),
        copies_(copies),
        consumed_(QuantAuxKeys(quant_)) {}

  bool Contains(const std::string& name) const { return weights_.Contains(name); }

  // The floating-point tensor `name` of exactly `shape`, in the compute dtype on the device.
  Result<at::Tensor> Dense(const std::string& name, const std::vector<int64_t>& shape) {
    const TensorInfo* info = weights_.Info(name);
    if (!info) return Status::NotFound(where_ + ": missing tensor '" + name + "'");
    if (info->shape != Shape(shape.begin(), shape.end())) {
      return Status::InvalidArgument(where_ + ": tensor '" + name + "' has shape " + ShapeToString(info->shape) +
                                     ", expected " + ShapeText(shape) + " from " + config_.source);
    }
    if (!IsFloatingPoint(info->dtype)) {
      return Status::InvalidArgument(where_ + ": tensor '" + name + "' is " + std::string(DTypeName(info->dtype)) +
                                     ", expected a floating-point dtype");
    }
    consumed_.insert(name);
    if (lendable_ != nullptr && unchanged_(name)) {
      auto lent = lendable_->find(name);
      if (lent != lendable_->end() && lent->second.scalar_type() == dtype_ && lent->second.device() == device_ &&
          lent->second.sizes() == at::IntArrayRef(shape)) {
        (*copies_)[name] = lent->second;
        return lent->second;
      }
    }
    FERRY_ASSIGN_OR_RETURN(Tensor t, weights_.Get(name));
    FERRY_ASSIGN_OR_RETURN(at::Tensor v, ToTorch(t, device_));
    bool own = !device_.is_cpu();  // ToTorch copied it to the device; on the CPU it is a view
    if (v.scalar_type() != dtype_) {
      FERRY_ASSIGN_OR_RETURN(v, GuardTorch("converting " + name, [&] { return v.to(dtype_); }));
      own = true;
    }
    if (own) (*copies_)[name] = v;
    return v;
  }

  // The linear layer `module` ("model.layers.0.self_attn.q_proj"): its weight [out, in], dense
  // or 4-bit, and its bias [out] when `bias`.
  Result<Linear> ReadLinear(const std::string& module, int64_t out, int64_t in, bool bias) {
    Linear l;
    l.name = module;
    l.in = in;
    l.out = out;
    const std::string wname = module + ".weight";
    if (auto q = quant_.find(wname); q != quant_.end()) {
      if (q->second.shape != Shape{out, in}) {
        return Status::InvalidArgument(where_ + ": 4-bit tensor '" + wname + "' has shape " +
                                       ShapeToString(q->second.shape) + ", expected " + ShapeText({out, in}));
      }
      FERRY_ASSIGN_OR_RETURN(l.quant, Quant4Weight::Load(weights_, q->second, device_));
      consumed_.insert(wname);
    } else {
      FERRY_ASSIGN_OR_RETURN(l.weight, Dense(wname, {out, in}));
    }
    if (bias) {
      FERRY_ASSIGN_OR_RETURN(l.bias, Dense(module + ".bias", {out}));
    }
    return l;
  }

  // Marks `name` consumed without reading it (a tensor the model recomputes or shares).
  void Skip(const std::string& name) { consumed_.insert(name); }

  // kInvalidArgument naming the first tensor of the checkpoint nothing consumed.
  Status CheckAllConsumed() const {
    for (const std::string& name : weights_.names()) {
      if (!consumed_.count(name)) {
        return Status::InvalidArgument(where_ + ": unexpected tensor '" + name + "' (not part of a " +
                                       std::string(ArchitectureName(config_.arch)) + " with this " + config_.source +
                                       ")");
      }
    }
    return Status::OK();
  }

 private:
  const Checkpoint& weights_;
  const ModelConfig& config_;
  const std::string where_;
  const at::Device device_;
  const at::ScalarType dtype_;
  const std::map<std::string, QuantState4bit> quant_;
  const std::map<std::string, at::Tensor>* lendable_;
  const std::function<bool(const std::string&)> unchanged_;
  std::map<std::string, at::Tensor>* copies_;
  std::set<std::string> consumed_;
};

// Decoder layer `i`: its norms, then q, k, v (or the stacked qkv_proj), o, gate, up (or the
// stacked gate_up_proj), down, in this order.
Result<std::unique_ptr<CausalLM::Layer>> ReadLayer(WeightReader& read, const ModelConfig& config, int64_t i) {
  const int64_t H = config.hidden_size, I = config.intermediate_size;
  const int64_t qs = config.q_size(), kvs = config.kv_size();
  auto layer = std::make_unique<CausalLM::Layer>();
  const std::string p = "model.layers." + std::to_string(i) + ".";
  auto proj = [&](Proj which, int64_t out, int64_t in, bool bias) -> Status {
    FERRY_ASSIGN_OR_RETURN(layer->linear(which), read.ReadLinear(p + std::string(ProjName(which)), out, in, bias));
    return Status::OK();
  };
  FERRY_ASSIGN_OR_RETURN(layer->input_norm, read.Dense(p + "input_layernorm.weight", {H}));
  FERRY_ASSIGN_OR_RETURN(layer->post_norm, read.Dense(p + "post_attention_layernorm.weight", {H}));
  layer->fused_qkv = read.Contains(p + "self_attn.qkv_proj.weight");
  layer->fused_gate_up = read.Contains(p + "mlp.gate_up_proj.weight");
  if (layer->fused_qkv) {
    FERRY_ASSIGN_OR_RETURN(layer->qkv, read.ReadLinear(p + "self_attn.qkv_proj", qs + 2 * kvs, H, config.qkv_bias));
  } else {
    FERRY_RETURN_IF_ERROR(proj(Proj::kQ, qs, H, config.qkv_bias));
    FERRY_RETURN_IF_ERROR(proj(Proj::kK, kvs, H, config.qkv_bias));
    FERRY_RETURN_IF_ERROR(proj(Proj::kV, kvs, H, config.qkv_bias));
  }
  FERRY_RETURN_IF_ERROR(proj(Proj::kO, H, qs, config.o_bias));
  if (layer->fused_gate_up) {
    FERRY_ASSIGN_OR_RETURN(layer->gate_up, read.ReadLinear(p + "mlp.gate_up_proj", 2 * I, H, config.mlp_bias));
  } else {
    FERRY_RETURN_IF_ERROR(proj(Proj::kGate, I, H, config.mlp_bias));
    FERRY_RETURN_IF_ERROR(proj(Proj::kUp, I, H, config.mlp_bias));
  }
  FERRY_RETURN_IF_ERROR(proj(Proj::kDown, H, I, config.mlp_bias));
  layer->sliding = !config.sliding_layers.empty() && config.sliding_layers[static_cast<size_t>(i)];
  // Old checkpoints carry the rotary buffer; it is recomputed, never read.
  read.Skip(p + "self_attn.rotary_emb.inv_freq");
  return layer;
}

}  // namespace

CausalLM::~CausalLM() = default;

Result<std::unique_ptr<CausalLM>> CausalLM::Load(const std::filesystem::path& dir, const ModelOptions& options) {
  FERRY_ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(dir));
  FERRY_ASSIGN_OR_RETURN(std::filesystem::path weights_path, FindWeights(dir));
  FERRY_ASSIGN_OR_RETURN(Checkpoint weights, Checkpoint::Open(weights_path));
  return FromCheckpoint(config, weights, options);
}

Result<std::unique_ptr<CausalLM>> CausalLM::FromCheckpoint(const ModelConfig& config, const Checkpoint& weights,
                                                           const ModelOptions& options,
                                                           std::shared_ptr<const void> keep_alive,
                                                           const WeightReuse* reuse) {
  std::unique_ptr<CausalLM> m(new CausalLM());
  m->keep_alive_ = std::move(keep_alive);
  FERRY_RETURN_IF_ERROR(m->Init(config, weights, options, reuse));
  return m;
}

Status CausalLM::Init(const ModelConfig& config, const Checkpoint& weights, const ModelOptions& options,
                      const WeightReuse* reuse) {
  config_ = config;
  device_ = options.device;
  if (options.attention_kernel == AttentionKernel::kFused && !FusedAttentionAvailable()) {
    return Status::Unsupported(
        "attention kernel \"fused\" needs at::scaled_dot_product_attention (PyTorch >= 2.5); "
        "this LibTorch is " TORCH_VERSION);
  }
  attention_.kernel = ResolveAttentionKernel(options.attention_kernel, options.device);
  attention_.query_chunk = std::max<int64_t>(1, options.attention_chunk);
  attention_.small_product = std::max<int64_t>(0, options.small_attention_product);
  skinny_linear_rows_ = std::max<int64_t>(0, options.skinny_linear_rows);
  weights_ = weights;
  const std::string where = weights.path().string();
  std::map<std::string, QuantState4bit> quant;
  FERRY_ASSIGN_OR_RETURN(quant, FindQuantized4bit(weights));
  if (!quant.empty() && !config.quantization) {
    return Status::InvalidArgument(where + ": holds bitsandbytes 4-bit weights but " + config.source +
                                   " has no quantization_config");
  }

  // The compute dtype: the embedding's unless the options name one.
  const std::string embed_name = "model.embed_tokens.weight";
  const TensorInfo* embed_info = weights.Info(embed_name);
  if (!embed_info) return Status::NotFound(where + ": missing tensor '" + embed_name + "'");
  if (options.dtype) {
    dtype_ = *options.dtype;
  } else {
    FERRY_ASSIGN_OR_RETURN(dtype_, TorchDType(embed_info->dtype));
  }
  if (dtype_ != at::kFloat && dtype_ != at::kBFloat16 && dtype_ != at::kHalf) {
    return Status::Unsupported(where + ": '" + embed_name + "' is " + std::string(DTypeName(embed_info->dtype)) +
                               ": the runtime computes in F32, BF16 or F16");
  }
  if (dtype_ == at::kHalf && options.device.is_cpu()) {
    // LibTorch's CPU kernels have no F16 matmul: refuse here instead of failing in the forward.
    return Status::Unsupported(where +
                               ": F16 compute on the CPU is not available (LibTorch has no CPU F16 matmul); "
                               "load with ModelOptions::dtype float32 or bfloat16, or on a GPU");
  }

  const bool lend = reuse != nullptr && reuse->model != nullptr && reuse->unchanged;
  WeightReader read(weights, config, device_, dtype_, std::move(quant), lend ? &reuse->model->copies_ : nullptr,
                    lend ? reuse->unchanged : nullptr, &copies_);
  const int64_t H = config.hidden_size;
  FERRY_ASSIGN_OR_RETURN(embed_, read.Dense(embed_name, {config.vocab_size, H}));
  FERRY_ASSIGN_OR_RETURN(norm_, read.Dense("model.norm.weight", {H}));
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Layer> layer, ReadLayer(read, config, i));
    fused_ = fused_ || layer->fused_qkv || layer->fused_gate_up;
    layers_.push_back(std::move(layer));
  }
  lm_head_.name = "lm_head";
  lm_head_.in = H;
  lm_head_.out = config.vocab_size;
  if (config.tie_word_embeddings) {
    lm_head_.weight = embed_;
    read.Skip("lm_head.weight");  // some tied checkpoints store a copy; the embedding is used
  } else {
    FERRY_ASSIGN_OR_RETURN(lm_head_, read.ReadLinear("lm_head", config.vocab_size, H, false));
  }
  FERRY_RETURN_IF_ERROR(read.CheckAllConsumed());
  FERRY_ASSIGN_OR_RETURN(inv_freq_, GuardTorch("rope", [&] { return RopeInverseFrequencies(config).to(device_); }));
  return Status::OK();
}

}  // namespace ferry::runtime
