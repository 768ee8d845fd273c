// CausalLM's forward (model.h), read top-down as vLLM's llama.py reads: the linear layer (dense
// or 4-bit, with its LoRA delta), the attention block (q/k/v, RoPE, the KV cache, the attention
// backend, o), the MLP, the decoder layer, the model (embedding, masks, RoPE angles, the layers,
// the final norm) and the lm_head. Loading is weight_loader.cpp's, the attention arithmetic
// attention.cpp's, the cache kv_cache.cpp's.
#include "daemon/runtime/model.h"

#include <ATen/core/grad_mode.h>

#include <cmath>
#include <numbers>

#include "daemon/runtime/activation_checkpoint.h"
#include "daemon/runtime/attention.h"
#include "daemon/runtime/fused_ops.h"
#include "daemon/runtime/model_internal.h"
#include "daemon/runtime/torch_util.h"

namespace ferry::runtime {

// One forward's state, shared by its layers.
struct CausalLM::Context {
  const LoraBinding* lora = nullptr;
  bool training = false;
  KvCache* cache = nullptr;
  int64_t batch = 0, tokens = 0, start = 0, keys = 0;
  at::Tensor slots;  // long [T] on the device: ForwardArgs::cache_slots (keys = the whole capacity)
  // [B, 1, 1, T, S]: which keys each query may not see, as the attention kernel reads it
  // (AttentionMaskFor: bool, or additive for the fused kernel), made once for every layer.
  at::Tensor blocked;
  at::Tensor blocked_sliding;  // the same for sliding-window layers
  // [B, T, 1, D] in the compute dtype: cos, and sin with its first half negated, so that
  // rotate_half(x) * sin = SwapHalves(x) * sin_signed (the same products, bit for bit).
  at::Tensor cos, sin_signed;
};

namespace {

// The LoRA module `lora` binds to projection `p` of layer `index`, or null.
const LoraModule* LoraFor(const LoraBinding* lora, int index, Proj p) {
  return lora ? lora->layers[static_cast<size_t>(index)][static_cast<size_t>(p)] : nullptr;
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

// ---- the weights held ----------------------------------------------------------------------

std::vector<const Linear*> CausalLM::Linears() const {
  std::vector<const Linear*> out;
  for (const auto& l : layers_) {
    for (Proj p : kAllProj) {
      if (!l->linear(p).name.empty()) out.push_back(&l->linear(p));
    }
  }
  out.push_back(&lm_head_);
  return out;
}

const Linear& CausalLM::layer_linear(int layer, Proj p) const {
  return layers_.at(static_cast<size_t>(layer))->linear(p);
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
    for (Proj p : kAllProj) add(l->linear(p));
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
    for (Proj p : kAllProj) add(l->linear(p));
    add(l->qkv);
    add(l->gate_up);
  }
  if (!config_.tie_word_embeddings) add(lm_head_);
  return out;
}

// ---- forward -------------------------------------------------------------------------------

// A linear layer (vLLM's layers/linear.py): dense, or 4-bit dequantised for the call, plus the
// LoRA delta when an adapter module is bound to it.
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

// self_attn (vLLM's LlamaAttention): q, k, v (apart or stacked), RoPE, the KV cache, the
// attention backend, o_proj.
at::Tensor CausalLM::Attention(const Layer& L, int index, const at::Tensor& x, const Context& c) const {
  const int64_t B = c.batch, T = c.tokens, S = c.keys;
  const int64_t nH = config_.num_attention_heads, nKV = config_.num_key_value_heads, D = config_.head_dim;
  auto mod = [&](Proj p) { return LoraFor(c.lora, index, p); };
  at::Tensor q, k, v;
  if (L.fused_qkv) {
    at::Tensor qkv = Apply(L.qkv, x, nullptr, c.training);
    q = qkv.narrow(-1, 0, nH * D);
    k = qkv.narrow(-1, nH * D, nKV * D);
    v = qkv.narrow(-1, (nH + nKV) * D, nKV * D);
  } else {
    q = Apply(L.linear(Proj::kQ), x, mod(Proj::kQ), c.training);
    k = Apply(L.linear(Proj::kK), x, mod(Proj::kK), c.training);
    v = Apply(L.linear(Proj::kV), x, mod(Proj::kV), c.training);
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
    if (c.slots.defined()) {
      kc.index_copy_(2, c.slots, k);
      vc.index_copy_(2, c.slots, v);
    } else {
      kc.narrow(2, c.start, T).copy_(k);
      vc.narrow(2, c.start, T).copy_(v);
    }
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
  const at::Tensor out = ScaledDotProductAttention(q, keys, values, blocked, attention_);
  return Apply(L.linear(Proj::kO), out, mod(Proj::kO), c.training);
}

// mlp (LlamaMLP): down_proj(silu(gate_proj(x)) * up_proj(x)).
at::Tensor CausalLM::Mlp(const Layer& L, int index, const at::Tensor& x, const Context& c) const {
  auto mod = [&](Proj p) { return LoraFor(c.lora, index, p); };
  at::Tensor gate, up;
  if (L.fused_gate_up) {
    at::Tensor gu = Apply(L.gate_up, x, nullptr, c.training);
    const int64_t I = config_.intermediate_size;
    gate = gu.narrow(-1, 0, I);
    up = gu.narrow(-1, I, I);
  } else {
    gate = Apply(L.linear(Proj::kGate), x, mod(Proj::kGate), c.training);
    up = Apply(L.linear(Proj::kUp), x, mod(Proj::kUp), c.training);
  }
  const Linear& down = L.linear(Proj::kDown);
  if (at::GradMode::is_enabled()) return Apply(down, at::silu(gate) * up, mod(Proj::kDown), c.training);
  // Without autograd (generation, reference log-probabilities) the product is formed in gate's
  // buffer and up is dropped before down_proj: the same values, two [tokens, intermediate]
  // temporaries fewer at the peak of a prefill (the largest transient of a 4-bit base's forward).
  at::Tensor act = at::silu_(gate).mul_(up);
  gate.reset();
  up.reset();
  return Apply(down, act, mod(Proj::kDown), c.training);
}

// One decoder layer (LlamaDecoderLayer): pre-norm attention, then pre-norm MLP, each added to
// the residual stream.
at::Tensor CausalLM::LayerForward(const Layer& L, int index, const at::Tensor& x, const Context& c) const {
  at::Tensor h = x + Attention(L, index, RmsNorm(x, L.input_norm, config_.rms_norm_eps), c);
  return h + Mlp(L, index, RmsNorm(h, L.post_norm, config_.rms_norm_eps), c);
}

// The model (LlamaModel): checks, the masks and RoPE angles of this forward, the embedding, the
// layers (each recomputed in the backward pass when checkpointed), the final norm.
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
    if (a.cache_slots.defined()) {
      if (a.cache_slots.dim() != 1 || a.cache_slots.size(0) != T || a.cache_slots.scalar_type() != at::kLong ||
          a.cache_slots.device() != device_) {
        return Status::InvalidArgument("forward: cache_slots must be a long tensor [" + std::to_string(T) + "] on " +
                                       device_.str());
      }
      if (at::GradMode::is_enabled()) {
        return Status::InvalidArgument("forward: cache_slots is for decoding without autograd");
      }
    }
    if (start + T > a.cache->capacity()) {
      return Status::InvalidArgument("forward: KV cache full (" + std::to_string(start) + " + " + std::to_string(T) +
                                     " tokens > capacity " + std::to_string(a.cache->capacity()) + ")");
    }
  }
  return GuardTorch("forward", [&]() -> Result<at::Tensor> {
    at::Tensor ids_d = ids.to(device_);
    if (!a.ids_in_vocab) {
      const int64_t lo = ids_d.min().item<int64_t>(), hi = ids_d.max().item<int64_t>();
      if (lo < 0 || hi >= config_.vocab_size) {
        return Status::InvalidArgument("forward: token id " + std::to_string(lo < 0 ? lo : hi) +
                                       " is outside the vocabulary [0, " + std::to_string(config_.vocab_size) + ")");
      }
    }
    Context c;
    c.lora = a.lora;
    c.training = a.training;
    c.cache = a.cache;
    c.batch = B;
    c.tokens = T;
    c.start = start;
    c.keys = start + T;
    if (a.cache && a.cache_slots.defined()) {
      c.slots = a.cache_slots;
      c.keys = a.cache->capacity();
    }
    const auto bool_opts = at::TensorOptions().dtype(at::kBool).device(device_);
    at::Tensor valid_new = a.attention_mask.defined() ? a.attention_mask.to(bool_opts) : at::ones({B, T}, bool_opts);
    at::Tensor valid;
    if (a.cache) {
      if (c.slots.defined()) {
        a.cache->AppendAt(c.slots, valid_new);
      } else {
        a.cache->Append(valid_new);
      }
      valid = a.cache->valid().narrow(1, 0, c.keys);
    } else {
      valid = valid_new;
    }
    const auto long_opts = at::TensorOptions().dtype(at::kLong).device(device_);
    at::Tensor key_slot = at::arange(c.keys, long_opts).view({1, c.keys});
    at::Tensor query_slot =
        c.slots.defined() ? c.slots.view({T, 1}) : at::arange(start, start + T, long_opts).view({T, 1});
    at::Tensor allowed = key_slot.le(query_slot).unsqueeze(0).logical_and(valid.unsqueeze(1));  // [B, T, S]
    c.blocked = AttentionMaskFor(attention_.kernel, allowed.logical_not().view({B, 1, 1, T, c.keys}), dtype_);
    if (config_.sliding_window > 0) {
      at::Tensor in_window = (query_slot - key_slot).lt(config_.sliding_window).unsqueeze(0);
      c.blocked_sliding = AttentionMaskFor(
          attention_.kernel, allowed.logical_and(in_window).logical_not().view({B, 1, 1, T, c.keys}), dtype_);
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

// lm_head (LlamaForCausalLM).
at::Tensor CausalLM::Logits(const at::Tensor& hidden, const LoraBinding* lora, bool training) const {
  return Apply(lm_head_, hidden, lora ? lora->lm_head : nullptr, training);
}

Result<at::Tensor> CausalLM::Forward(const ForwardArgs& args) const {
  FERRY_ASSIGN_OR_RETURN(at::Tensor hidden, Hidden(args));
  return GuardTorch("lm_head", [&] { return Logits(hidden, args.lora, args.training); });
}

}  // namespace ferry::runtime
