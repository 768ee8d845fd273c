#include "daemon/runtime/model.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <limits>
#include <numbers>
#include <set>

#include "convert/bnb4.h"
#include "daemon/runtime/activation_checkpoint.h"
#include "daemon/runtime/fused_ops.h"
#include "daemon/runtime/parallel.h"
#include "daemon/runtime/torch_util.h"
#include "kernels/small_products.h"

namespace ferry::runtime {

struct CausalLM::Layer {
  at::Tensor input_norm, post_norm;
  std::array<Linear, kNumProj> proj;
  Linear qkv, gate_up;  // the fused layout
  bool fused_qkv = false;
  bool fused_gate_up = false;
  bool sliding = false;
};

struct CausalLM::Context {
  const LoraBinding* lora = nullptr;
  bool training = false;
  KvCache* cache = nullptr;
  int64_t batch = 0, tokens = 0, start = 0, keys = 0;
  at::Tensor blocked;          // bool [B, 1, 1, T, S]: key not visible to the query
  at::Tensor blocked_sliding;  // the same for sliding-window layers
  // [B, T, 1, D] in the compute dtype: cos, and sin with its first half negated, so that
  // rotate_half(x) * sin = SwapHalves(x) * sin_signed (the same products, bit for bit).
  at::Tensor cos, sin_signed;
};

namespace {

std::string ShapeText(at::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

at::Scalar Lowest(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16:
      return at::Scalar(static_cast<double>(static_cast<float>(std::numeric_limits<c10::BFloat16>::lowest())));
    case at::kHalf:
      return at::Scalar(static_cast<double>(static_cast<float>(std::numeric_limits<c10::Half>::lowest())));
    case at::kDouble: return at::Scalar(std::numeric_limits<double>::lowest());
    default: return at::Scalar(static_cast<double>(std::numeric_limits<float>::lowest()));
  }
}

// The attention's per-head products, batched over [batch, KV head]: q [.., M, D] with keys [.., N, D] gives q k^T
// [.., M, N] (kDot); p [.., M, N] with values [.., N, D] gives p v [.., M, D] (kWeighted). LibTorch 1.13's CPU bmm
// makes one BLAS call per batch item, about a microsecond each on top of the arithmetic, which is most of the cost
// when the items are tiny (short contexts: decoding, a small model's rows). Up to `small` multiply-adds per item,
// F32 on the CPU, they run as plain loops over the items instead (kernels/small_products.h), forward and backward
// (SmallProductFunction), split across threads by item. BF16 and CUDA stay on bmm, as do items above `small`,
// where BLAS's blocking pays.
enum class Product { kDot, kWeighted };

// Items [z0, z1) of `out` = the product `kind` of `a` and `b`, or, for the backward pass, the
// products it takes: every operand is a contiguous F32 [Z, rows, cols] tensor.
void SmallProducts(Product kind, const at::Tensor& a, const at::Tensor& b, at::Tensor& out, bool a_transposed = false) {
  const int64_t Z = a.size(0);
  const int64_t work = out.size(1) * out.size(2) * (kind == Product::kDot ? a.size(2) : b.size(1));
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, work));
  const float* pa = a.data_ptr<float>();
  const float* pb = b.data_ptr<float>();
  float* po = out.data_ptr<float>();
  at::parallel_for(0, Z, grain, [&](int64_t z0, int64_t z1) {
    if (kind == Product::kDot) {
      kernels::SmallDots(pa, pb, po, z0, z1, a.size(1), b.size(1), a.size(2));
    } else {
      // out[i] = sum_j a(i, j) b[j]: a [Z, I, J] or, transposed, [Z, J, I]
      const int64_t I = out.size(1), J = b.size(1);
      kernels::SmallCombine(pa, a_transposed, pb, po, z0, z1, I, J, b.size(2));
    }
  });
}

// kDot: c = a b^T; kWeighted: c = a b, for [Z, .., ..] F32 CPU tensors, with its backward:
// kDot: da = dc b, db = dc^T a; kWeighted: da = dc b^T, db = a^T dc.
class SmallProductFunction : public torch::autograd::Function<SmallProductFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& a_in,
                                                const at::Tensor& b_in, int64_t kind) {
    const at::Tensor a = a_in.contiguous(), b = b_in.contiguous();
    const int64_t Z = a.size(0), M = a.size(1);
    const int64_t N = kind == static_cast<int64_t>(Product::kDot) ? b.size(1) : b.size(2);
    at::Tensor out = at::empty({Z, M, N}, a.options());
    SmallProducts(static_cast<Product>(kind), a, b, out);
    ctx->save_for_backward({a, b});
    ctx->saved_data["kind"] = kind;
    return {out};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& a = saved[0];
    const at::Tensor& b = saved[1];
    const at::Tensor g = grads[0].contiguous();
    at::Tensor da, db;
    if (static_cast<Product>(ctx->saved_data["kind"].toInt()) == Product::kDot) {
      // a [Z, M, D], b [Z, N, D], g [Z, M, N]
      if (ctx->needs_input_grad(0)) {
        da = at::empty_like(a);
        SmallProducts(Product::kWeighted, g, b, da);  // da[m] = sum_n g[m, n] b[n]
      }
      if (ctx->needs_input_grad(1)) {
        db = at::empty_like(b);
        SmallProducts(Product::kWeighted, g, a, db, /*a_transposed=*/true);  // db[n] = sum_m g[m, n] a[m]
      }
    } else {
      // a [Z, M, N], b [Z, N, D], g [Z, M, D]
      if (ctx->needs_input_grad(0)) {
        da = at::empty_like(a);
        SmallProducts(Product::kDot, g, b, da);  // da[m, n] = g[m] . b[n]
      }
      if (ctx->needs_input_grad(1)) {
        db = at::empty_like(b);
        SmallProducts(Product::kWeighted, a, g, db, /*a_transposed=*/true);  // db[n] = sum_m a[m, n] g[m]
      }
    }
    return {da, db, at::Tensor()};
  }
};

// The products through bmm. On the CPU without autograd (generation), the items are split across
// the intra-op threads, one bmm per thread: LibTorch 1.13's CPU bmm calls the BLAS for one item after
// another on one thread, and the other cores waited through every decoding step's attention (7% of a
// batch-16 step). Each item is still one BLAS call of the same shape, so the result is the same.
at::Tensor BlasHeadProduct(Product kind, const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor bt = kind == Product::kDot ? b.transpose(-1, -2) : b;
  const int64_t Z = a.numel() / (a.size(-2) * a.size(-1));
  if (!a.device().is_cpu() || at::GradMode::is_enabled() || Z < 2 || at::get_num_threads() < 2 ||
      a.sizes().slice(0, a.dim() - 2) != bt.sizes().slice(0, bt.dim() - 2)) {
    return at::matmul(a, bt);
  }
  const at::Tensor a3 = a.reshape({Z, a.size(-2), a.size(-1)});
  const at::Tensor b3 = bt.reshape({Z, bt.size(-2), bt.size(-1)});
  at::Tensor out = at::empty({Z, a.size(-2), bt.size(-1)}, a.options());
  at::parallel_for(0, Z, 1, [&](int64_t z0, int64_t z1) {
    at::Tensor part = out.narrow(0, z0, z1 - z0);
    at::bmm_out(part, a3.narrow(0, z0, z1 - z0), b3.narrow(0, z0, z1 - z0));
  });
  std::vector<int64_t> shape(a.sizes().begin(), a.sizes().end());
  shape.back() = bt.size(-1);
  return out.view(shape);
}

at::Tensor HeadProduct(Product kind, const at::Tensor& a, const at::Tensor& b, int64_t small) {
  const int64_t M = a.size(-2), N = b.size(-2), D = kind == Product::kDot ? a.size(-1) : b.size(-1);
  if (!a.device().is_cpu() || a.scalar_type() != at::kFloat || b.scalar_type() != at::kFloat || M * N * D > small) {
    return BlasHeadProduct(kind, a, b);
  }
  const int64_t Z = a.numel() / (a.size(-2) * a.size(-1));
  at::Tensor out = SmallProductFunction::apply(a.reshape({Z, a.size(-2), a.size(-1)}),
                                               b.reshape({Z, b.size(-2), b.size(-1)}), static_cast<int64_t>(kind))[0];
  std::vector<int64_t> shape(a.sizes().begin(), a.sizes().end());
  shape.back() = kind == Product::kDot ? N : D;
  return out.view(shape);
}

}  // namespace

std::string_view ProjName(Proj p) {
  switch (p) {
    case Proj::kQ: return "self_attn.q_proj";
    case Proj::kK: return "self_attn.k_proj";
    case Proj::kV: return "self_attn.v_proj";
    case Proj::kO: return "self_attn.o_proj";
    case Proj::kGate: return "mlp.gate_proj";
    case Proj::kUp: return "mlp.up_proj";
    case Proj::kDown: return "mlp.down_proj";
  }
  return "?";
}

at::Tensor RopeInverseFrequencies(const ModelConfig& config) {
  const int64_t dim = config.head_dim;
  // transformers: 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), in fp32.
  at::Tensor exponent = at::arange(0, dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(dim);
  at::Tensor inv_freq = 1.0 / at::pow(at::Scalar(config.rope.theta), exponent);
  if (config.rope.type != RopeConfig::Type::kLlama3) return inv_freq;
  // transformers' _compute_llama3_parameters, in the same fp32 operations.
  const RopeConfig& r = config.rope;
  const double old_context_len = static_cast<double>(r.original_max_position_embeddings);
  const double low_freq_wavelen = old_context_len / r.low_freq_factor;
  const double high_freq_wavelen = old_context_len / r.high_freq_factor;
  at::Tensor wavelen = 2 * std::numbers::pi / inv_freq;
  at::Tensor inv_freq_llama = at::where(wavelen > low_freq_wavelen, inv_freq / r.factor, inv_freq);
  at::Tensor smooth_factor = (old_context_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
  at::Tensor smoothed = (1 - smooth_factor) * inv_freq_llama / r.factor + smooth_factor * inv_freq_llama;
  at::Tensor is_medium = (wavelen >= high_freq_wavelen).logical_and(wavelen <= low_freq_wavelen);
  return at::where(is_medium, smoothed, inv_freq_llama);
}

// ---- KvCache ---------------------------------------------------------------------------

KvCache::KvCache(const ModelConfig& config, int64_t batch, int64_t capacity, at::ScalarType dtype,
                 const at::Device& device)
    : batch_(batch), capacity_(capacity) {
  const auto opts = at::TensorOptions().dtype(dtype).device(device);
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    keys_.push_back(at::zeros({batch, config.num_key_value_heads, capacity, config.head_dim}, opts));
    values_.push_back(at::zeros({batch, config.num_key_value_heads, capacity, config.head_dim}, opts));
  }
  valid_ = at::zeros({batch, capacity}, at::TensorOptions().dtype(at::kBool).device(device));
}

void KvCache::Append(const at::Tensor& valid) {
  const int64_t t = valid.size(1);
  TORCH_CHECK(length_ + t <= capacity_, "KV cache full: ", length_, " + ", t, " > ", capacity_);
  valid_.narrow(1, length_, t).copy_(valid);
  length_ += t;
}

void KvCache::Clear() {
  length_ = 0;
  valid_.zero_();
}

KvCache KvCache::Select(const at::Tensor& rows) const {
  KvCache out;
  out.batch_ = rows.size(0);
  out.capacity_ = capacity_;
  out.length_ = length_;
  for (size_t i = 0; i < keys_.size(); ++i) {
    out.keys_.push_back(at::zeros({out.batch_, keys_[i].size(1), capacity_, keys_[i].size(3)}, keys_[i].options()));
    out.values_.push_back(at::zeros_like(out.keys_.back()));
    out.keys_[i].narrow(2, 0, length_).copy_(keys_[i].index_select(0, rows).narrow(2, 0, length_));
    out.values_[i].narrow(2, 0, length_).copy_(values_[i].index_select(0, rows).narrow(2, 0, length_));
  }
  out.valid_ = valid_.index_select(0, rows).clone();
  return out;
}

int64_t KvCache::bytes() const {
  int64_t b = valid_.defined() ? valid_.nbytes() : 0;
  for (size_t i = 0; i < keys_.size(); ++i) b += keys_[i].nbytes() + values_[i].nbytes();
  return b;
}

// ---- loading ------------------------------------------------------------------------------

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
  attention_chunk_ = std::max<int64_t>(1, options.attention_chunk);
  small_attention_product_ = std::max<int64_t>(0, options.small_attention_product);
  skinny_linear_rows_ = std::max<int64_t>(0, options.skinny_linear_rows);
  weights_ = weights;
  const std::string where = weights.path().string();
  std::map<std::string, QuantState4bit> quant;
  FERRY_ASSIGN_OR_RETURN(quant, FindQuantized4bit(weights));
  if (!quant.empty() && !config.quantization) {
    return Status::InvalidArgument(where + ": holds bitsandbytes 4-bit weights but " + config.source +
                                   " has no quantization_config");
  }
  std::set<std::string> consumed = QuantAuxKeys(quant);

  const int64_t H = config.hidden_size;
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

  auto dense = [&](const std::string& name, std::vector<int64_t> shape) -> Result<at::Tensor> {
    const TensorInfo* info = weights.Info(name);
    if (!info) return Status::NotFound(where + ": missing tensor '" + name + "'");
    if (info->shape != Shape(shape.begin(), shape.end())) {
      return Status::InvalidArgument(where + ": tensor '" + name + "' has shape " + ShapeToString(info->shape) +
                                     ", expected " + ShapeText(shape) + " from " + config.source);
    }
    if (!IsFloatingPoint(info->dtype)) {
      return Status::InvalidArgument(where + ": tensor '" + name + "' is " + std::string(DTypeName(info->dtype)) +
                                     ", expected a floating-point dtype");
    }
    consumed.insert(name);
    if (reuse != nullptr && reuse->model != nullptr && reuse->unchanged && reuse->unchanged(name)) {
      auto lent = reuse->model->copies_.find(name);
      if (lent != reuse->model->copies_.end() && lent->second.scalar_type() == dtype_ &&
          lent->second.device() == device_ && lent->second.sizes() == at::IntArrayRef(shape)) {
        copies_[name] = lent->second;
        return lent->second;
      }
    }
    FERRY_ASSIGN_OR_RETURN(Tensor t, weights.Get(name));
    FERRY_ASSIGN_OR_RETURN(at::Tensor v, ToTorch(t, device_));
    bool own = !device_.is_cpu();  // ToTorch copied it to the device; on the CPU it is a view
    if (v.scalar_type() != dtype_) {
      FERRY_ASSIGN_OR_RETURN(v, GuardTorch("converting " + name, [&] { return v.to(dtype_); }));
      own = true;
    }
    if (own) copies_[name] = v;
    return v;
  };
  auto linear = [&](const std::string& module, int64_t out, int64_t in, bool bias) -> Result<Linear> {
    Linear l;
    l.name = module;
    l.in = in;
    l.out = out;
    const std::string wname = module + ".weight";
    if (auto q = quant.find(wname); q != quant.end()) {
      if (q->second.shape != Shape{out, in}) {
        return Status::InvalidArgument(where + ": 4-bit tensor '" + wname + "' has shape " +
                                       ShapeToString(q->second.shape) + ", expected " + ShapeText({out, in}));
      }
      FERRY_ASSIGN_OR_RETURN(l.quant, Quant4Weight::Load(weights, q->second, device_));
      consumed.insert(wname);
    } else {
      FERRY_ASSIGN_OR_RETURN(l.weight, dense(wname, {out, in}));
    }
    if (bias) {
      FERRY_ASSIGN_OR_RETURN(l.bias, dense(module + ".bias", {out}));
    }
    return l;
  };

  FERRY_ASSIGN_OR_RETURN(embed_, dense(embed_name, {config.vocab_size, H}));
  FERRY_ASSIGN_OR_RETURN(norm_, dense("model.norm.weight", {H}));
  const int64_t qs = config.q_size(), kvs = config.kv_size(), I = config.intermediate_size;
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    auto layer = std::make_unique<Layer>();
    const std::string p = "model.layers." + std::to_string(i) + ".";
    FERRY_ASSIGN_OR_RETURN(layer->input_norm, dense(p + "input_layernorm.weight", {H}));
    FERRY_ASSIGN_OR_RETURN(layer->post_norm, dense(p + "post_attention_layernorm.weight", {H}));
    layer->fused_qkv = weights.Contains(p + "self_attn.qkv_proj.weight");
    layer->fused_gate_up = weights.Contains(p + "mlp.gate_up_proj.weight");
    if (layer->fused_qkv) {
      FERRY_ASSIGN_OR_RETURN(layer->qkv, linear(p + "self_attn.qkv_proj", qs + 2 * kvs, H, config.qkv_bias));
    } else {
      FERRY_ASSIGN_OR_RETURN(layer->proj[0], linear(p + "self_attn.q_proj", qs, H, config.qkv_bias));
      FERRY_ASSIGN_OR_RETURN(layer->proj[1], linear(p + "self_attn.k_proj", kvs, H, config.qkv_bias));
      FERRY_ASSIGN_OR_RETURN(layer->proj[2], linear(p + "self_attn.v_proj", kvs, H, config.qkv_bias));
    }
    FERRY_ASSIGN_OR_RETURN(layer->proj[3], linear(p + "self_attn.o_proj", H, qs, config.o_bias));
    if (layer->fused_gate_up) {
      FERRY_ASSIGN_OR_RETURN(layer->gate_up, linear(p + "mlp.gate_up_proj", 2 * I, H, config.mlp_bias));
    } else {
      FERRY_ASSIGN_OR_RETURN(layer->proj[4], linear(p + "mlp.gate_proj", I, H, config.mlp_bias));
      FERRY_ASSIGN_OR_RETURN(layer->proj[5], linear(p + "mlp.up_proj", I, H, config.mlp_bias));
    }
    FERRY_ASSIGN_OR_RETURN(layer->proj[6], linear(p + "mlp.down_proj", H, I, config.mlp_bias));
    layer->sliding = !config.sliding_layers.empty() && config.sliding_layers[static_cast<size_t>(i)];
    fused_ = fused_ || layer->fused_qkv || layer->fused_gate_up;
    // Old checkpoints carry the rotary buffer; it is recomputed, never read.
    consumed.insert(p + "self_attn.rotary_emb.inv_freq");
    layers_.push_back(std::move(layer));
  }
  lm_head_.name = "lm_head";
  lm_head_.in = H;
  lm_head_.out = config.vocab_size;
  if (config.tie_word_embeddings) {
    lm_head_.weight = embed_;
    consumed.insert("lm_head.weight");  // some tied checkpoints store a copy; the embedding is used
  } else {
    FERRY_ASSIGN_OR_RETURN(lm_head_, linear("lm_head", config.vocab_size, H, false));
  }
  for (const std::string& name : weights.names()) {
    if (!consumed.count(name)) {
      return Status::InvalidArgument(where + ": unexpected tensor '" + name + "' (not part of a " +
                                     std::string(ArchitectureName(config.arch)) + " with this " + config.source + ")");
    }
  }
  FERRY_ASSIGN_OR_RETURN(inv_freq_, GuardTorch("rope", [&] { return RopeInverseFrequencies(config).to(device_); }));
  return Status::OK();
}

std::vector<const Linear*> CausalLM::Linears() const {
  std::vector<const Linear*> out;
  for (const auto& l : layers_) {
    for (const Linear& p : l->proj) {
      if (!p.name.empty()) out.push_back(&p);
    }
  }
  out.push_back(&lm_head_);
  return out;
}

const Linear& CausalLM::layer_linear(int layer, Proj p) const {
  return layers_.at(static_cast<size_t>(layer))->proj[static_cast<size_t>(p)];
}

int64_t CausalLM::weight_bytes() const {
  int64_t b = embed_.nbytes() + norm_.nbytes();
  auto add = [&](const Linear& l) {
    if (l.name.empty()) return;
    b += l.quant ? l.quant->bytes() : l.weight.nbytes();
    if (l.bias.defined()) b += l.bias.nbytes();
  };
  for (const auto& l : layers_) {
    b += l->input_norm.nbytes() + l->post_norm.nbytes();
    for (const Linear& p : l->proj) add(p);
    add(l->qkv);
    add(l->gate_up);
  }
  if (!config_.tie_word_embeddings) add(lm_head_);
  return b;
}

std::vector<at::Tensor> CausalLM::tensors() const {
  std::vector<at::Tensor> out = {embed_, norm_, inv_freq_};
  auto add = [&](const Linear& l) {
    if (l.name.empty()) return;
    if (l.quant) {
      for (const at::Tensor& t : l.quant->tensors()) out.push_back(t);
    } else {
      out.push_back(l.weight);
    }
    if (l.bias.defined()) out.push_back(l.bias);
  };
  for (const auto& l : layers_) {
    out.push_back(l->input_norm);
    out.push_back(l->post_norm);
    for (const Linear& p : l->proj) add(p);
    add(l->qkv);
    add(l->gate_up);
  }
  if (!config_.tie_word_embeddings) add(lm_head_);
  return out;
}

// ---- forward -------------------------------------------------------------------------------

at::Tensor CausalLM::Apply(const Linear& l, const at::Tensor& x, const LoraModule* lora, bool training) const {
  // A few rows take the few-row kernel (kernels/skinny_gemm.h) for the frozen base product,
  // with or without an adapter and autograd: the adapter's delta is then added below, so the
  // base product rounds the same whether an adapter is bound or not (a fresh adapter, B = 0,
  // leaves the output bit for bit the base model's, as the reference policy needs).
  at::Tensor y;
  if (!l.quant) y = SkinnyLinearOrUndefined(x, l.weight, l.bias, skinny_linear_rows_);
  if (!y.defined() && lora && !l.quant && !(training && lora->dropout > 0) &&
      x.scalar_type() == l.weight.scalar_type() && lora->a.scalar_type() == x.scalar_type() &&
      lora->b.scalar_type() == x.scalar_type() && (!l.bias.defined() || l.bias.scalar_type() == x.scalar_type())) {
    return LoraLinear(x, l.weight, l.bias, lora->a, lora->b, lora->scaling);
  }
  if (!y.defined() && l.quant) {
    // bitsandbytes Linear4bit: input and bias in the compute dtype, the weight dequantised to
    // it, the product cast back to the input's dtype.
    at::ScalarType compute = at::kFloat;
    if (config_.quantization) compute = TorchDType(config_.quantization->compute_dtype).value();
    at::Tensor w = l.quant->Dequantize(compute);
    y = at::linear(x.to(compute), w, l.bias.defined() ? l.bias.to(compute) : at::Tensor()).to(x.scalar_type());
  } else if (!y.defined()) {
    y = at::linear(x, l.weight, l.bias);
  }
  if (lora) {
    // PEFT: result = result + lora_B(lora_A(dropout(x))) * scaling, with x cast to the
    // adapter's dtype and the sum cast back to the base output's dtype.
    at::Tensor xa = x.scalar_type() == lora->a.scalar_type() ? x : x.to(lora->a.scalar_type());
    if (training && lora->dropout > 0) xa = at::dropout(xa, lora->dropout, /*train=*/true);
    at::Tensor delta = at::linear(at::linear(xa, lora->a), lora->b);
    // y + delta * scaling as one add (alpha = scaling): one op and one backward node fewer.
    y = at::add(y, delta, lora->scaling).to(y.scalar_type());
  }
  return y;
}

at::Tensor CausalLM::Attention(const Layer& L, int index, const at::Tensor& x, const Context& c) const {
  const int64_t B = c.batch, T = c.tokens, S = c.keys;
  const int64_t nH = config_.num_attention_heads, nKV = config_.num_key_value_heads, D = config_.head_dim;
  const int64_t G = nH / nKV;
  const auto* lora = c.lora ? &c.lora->layers[static_cast<size_t>(index)] : nullptr;
  auto mod = [&](Proj p) { return lora ? (*lora)[static_cast<size_t>(p)] : nullptr; };
  at::Tensor q, k, v;
  if (L.fused_qkv) {
    at::Tensor qkv = Apply(L.qkv, x, nullptr, c.training);
    q = qkv.narrow(-1, 0, nH * D);
    k = qkv.narrow(-1, nH * D, nKV * D);
    v = qkv.narrow(-1, (nH + nKV) * D, nKV * D);
  } else {
    q = Apply(L.proj[0], x, mod(Proj::kQ), c.training);
    k = Apply(L.proj[1], x, mod(Proj::kK), c.training);
    v = Apply(L.proj[2], x, mod(Proj::kV), c.training);
  }
  q = q.reshape({B, T, nH, D});
  k = k.reshape({B, T, nKV, D});
  v = v.reshape({B, T, nKV, D});
  q = Rotary(q, c.cos, c.sin_signed);
  k = Rotary(k, c.cos, c.sin_signed);
  k = k.transpose(1, 2);  // [B, nKV, T, D]
  v = v.transpose(1, 2);
  at::Tensor keys, values;
  if (c.cache) {
    at::Tensor& kc = c.cache->key(index);
    at::Tensor& vc = c.cache->value(index);
    kc.narrow(2, c.start, T).copy_(k);
    vc.narrow(2, c.start, T).copy_(v);
    keys = kc.narrow(2, 0, S);
    values = vc.narrow(2, 0, S);
    if (at::GradMode::is_enabled()) {
      // The products keep their operands for the backward, and a later forward on this cache
      // writes into it: they get a copy, not a view of the cache.
      keys = keys.clone();
      values = values.clone();
    }
  } else {
    keys = k;
    values = v;
  }
  const at::Tensor& blocked = L.sliding ? c.blocked_sliding : c.blocked;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  at::Tensor qg = q.view({B, T, nKV, G, D}).permute({0, 2, 3, 1, 4});  // [B, nKV, G, T, D]
  const at::Scalar lowest = Lowest(q.scalar_type());
  std::vector<at::Tensor> outs;
  for (int64_t t0 = 0; t0 < T; t0 += attention_chunk_) {
    const int64_t tc = std::min(attention_chunk_, T - t0);
    at::Tensor qc = (tc == T ? qg : qg.narrow(3, t0, tc)).reshape({B, nKV, G * tc, D});
    at::Tensor scores = HeadProduct(Product::kDot, qc, keys, small_attention_product_) * scale;
    scores = scores.view({B, nKV, G, tc, S}).masked_fill(tc == T ? blocked : blocked.narrow(3, t0, tc), lowest);
    at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
    outs.push_back(HeadProduct(Product::kWeighted, probs.view({B, nKV, G * tc, S}), values, small_attention_product_)
                       .view({B, nKV, G, tc, D}));
  }
  at::Tensor out = outs.size() == 1 ? outs[0] : at::cat(outs, 3);
  out = out.permute({0, 3, 1, 2, 4}).reshape({B, T, nH * D});
  return Apply(L.proj[3], out, mod(Proj::kO), c.training);
}

at::Tensor CausalLM::Mlp(const Layer& L, int index, const at::Tensor& x, const Context& c) const {
  const auto* lora = c.lora ? &c.lora->layers[static_cast<size_t>(index)] : nullptr;
  auto mod = [&](Proj p) { return lora ? (*lora)[static_cast<size_t>(p)] : nullptr; };
  at::Tensor gate, up;
  if (L.fused_gate_up) {
    at::Tensor gu = Apply(L.gate_up, x, nullptr, c.training);
    const int64_t I = config_.intermediate_size;
    gate = gu.narrow(-1, 0, I);
    up = gu.narrow(-1, I, I);
  } else {
    gate = Apply(L.proj[4], x, mod(Proj::kGate), c.training);
    up = Apply(L.proj[5], x, mod(Proj::kUp), c.training);
  }
  if (at::GradMode::is_enabled()) return Apply(L.proj[6], at::silu(gate) * up, mod(Proj::kDown), c.training);
  // Without autograd (generation, reference log-probabilities) the product is formed in gate's
  // buffer and up is dropped before down_proj: the same values, two [tokens, intermediate]
  // temporaries fewer at the peak of a prefill (the largest transient of a 4-bit base's forward).
  at::Tensor act = at::silu_(gate).mul_(up);
  gate.reset();
  up.reset();
  return Apply(L.proj[6], act, mod(Proj::kDown), c.training);
}

at::Tensor CausalLM::LayerForward(const Layer& L, int index, const at::Tensor& x, const Context& c) const {
  at::Tensor h = x + Attention(L, index, RmsNorm(x, L.input_norm, config_.rms_norm_eps), c);
  return h + Mlp(L, index, RmsNorm(h, L.post_norm, config_.rms_norm_eps), c);
}

Result<at::Tensor> CausalLM::Hidden(const ForwardArgs& a) const {
  const at::Tensor& ids = a.input_ids;
  if (!ids.defined() || ids.dim() != 2 || ids.scalar_type() != at::kLong || ids.size(1) < 1) {
    return Status::InvalidArgument("forward: input_ids must be a long tensor [batch, tokens] with tokens >= 1");
  }
  const int64_t B = ids.size(0), T = ids.size(1);
  if (!a.positions.defined() || a.positions.sizes() != ids.sizes()) {
    return Status::InvalidArgument("forward: positions must have input_ids' shape " + ShapeText(ids.sizes()));
  }
  if (a.attention_mask.defined() && a.attention_mask.sizes() != ids.sizes()) {
    return Status::InvalidArgument("forward: attention_mask must have input_ids' shape " + ShapeText(ids.sizes()));
  }
  if (a.lora && (fused_ || a.lora->layers.size() != layers_.size())) {
    return Status::InvalidArgument("forward: the LoRA binding does not fit this model");
  }
  if (a.checkpoint_layers && a.cache) {
    return Status::InvalidArgument("forward: activation checkpointing is for training forwards, not KV-cache decoding");
  }
  int64_t start = 0;
  if (a.cache) {
    if (a.cache->batch() != B) {
      return Status::InvalidArgument("forward: KV cache holds " + std::to_string(a.cache->batch()) + " rows, input " +
                                     std::to_string(B));
    }
    start = a.cache->length();
    if (start + T > a.cache->capacity()) {
      return Status::InvalidArgument("forward: KV cache full (" + std::to_string(start) + " + " + std::to_string(T) +
                                     " tokens > capacity " + std::to_string(a.cache->capacity()) + ")");
    }
  }
  return GuardTorch("forward", [&]() -> Result<at::Tensor> {
    at::Tensor ids_d = ids.to(device_);
    const int64_t lo = ids_d.min().item<int64_t>(), hi = ids_d.max().item<int64_t>();
    if (lo < 0 || hi >= config_.vocab_size) {
      return Status::InvalidArgument("forward: token id " + std::to_string(lo < 0 ? lo : hi) +
                                     " is outside the vocabulary [0, " + std::to_string(config_.vocab_size) + ")");
    }
    Context c;
    c.lora = a.lora;
    c.training = a.training;
    c.cache = a.cache;
    c.batch = B;
    c.tokens = T;
    c.start = start;
    c.keys = start + T;
    const auto bool_opts = at::TensorOptions().dtype(at::kBool).device(device_);
    at::Tensor valid_new = a.attention_mask.defined() ? a.attention_mask.to(bool_opts) : at::ones({B, T}, bool_opts);
    at::Tensor valid;
    if (a.cache) {
      a.cache->Append(valid_new);
      valid = a.cache->valid().narrow(1, 0, c.keys);
    } else {
      valid = valid_new;
    }
    const auto long_opts = at::TensorOptions().dtype(at::kLong).device(device_);
    at::Tensor key_slot = at::arange(c.keys, long_opts).view({1, c.keys});
    at::Tensor query_slot = at::arange(start, start + T, long_opts).view({T, 1});
    at::Tensor allowed = key_slot.le(query_slot).unsqueeze(0).logical_and(valid.unsqueeze(1));  // [B, T, S]
    c.blocked = allowed.logical_not().view({B, 1, 1, T, c.keys});
    if (config_.sliding_window > 0) {
      at::Tensor in_window = (query_slot - key_slot).lt(config_.sliding_window).unsqueeze(0);
      c.blocked_sliding = allowed.logical_and(in_window).logical_not().view({B, 1, 1, T, c.keys});
    }
    at::Tensor angles = a.positions.to(device_).to(at::kFloat).unsqueeze(-1) * inv_freq_.view({1, 1, -1});
    at::Tensor emb = at::cat({angles, angles}, -1);  // [B, T, D]
    c.cos = emb.cos().to(dtype_).unsqueeze(2);
    // The sine's values exactly as emb.sin() gives them (a vectorised kernel and its scalar
    // tail may round differently), the first half negated.
    const int64_t half = emb.size(-1) / 2;
    at::Tensor sin = emb.sin();
    c.sin_signed = at::cat({sin.narrow(-1, 0, half).neg(), sin.narrow(-1, half, half)}, -1).to(dtype_).unsqueeze(2);

    at::Tensor x = at::embedding(embed_, ids_d);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = *layers_[i];
      const int index = static_cast<int>(i);
      if (!a.checkpoint_layers) {
        x = LayerForward(layer, index, x, c);
        continue;
      }
      std::vector<at::Tensor> params;
      if (c.lora) {
        for (const LoraModule* m : c.lora->layers[i]) {
          if (m) {
            params.push_back(m->a);
            params.push_back(m->b);
          }
        }
      }
      // The context's tensors are captured by value: the backward pass may run after Hidden returns.
      x = Checkpointed([this, &layer, index, c](const at::Tensor& in) { return LayerForward(layer, index, in, c); }, x,
                       params);
    }
    return RmsNorm(x, norm_, config_.rms_norm_eps);
  });
}

at::Tensor CausalLM::Logits(const at::Tensor& hidden, const LoraBinding* lora, bool training) const {
  return Apply(lm_head_, hidden, lora ? lora->lm_head : nullptr, training);
}

Result<at::Tensor> CausalLM::Forward(const ForwardArgs& args) const {
  FERRY_ASSIGN_OR_RETURN(at::Tensor hidden, Hidden(args));
  return GuardTorch("lm_head", [&] { return Logits(hidden, args.lora, args.training); });
}

}  // namespace ferry::runtime
