// CausalLM: Llama, Mistral and Qwen2 decoders in LibTorch, one module for the trainer (full
// forward with autograd through LoRA) and the generator (prefill + decode on a KV cache).
//
// The maths, per layer (as transformers' modeling_llama.py / modeling_qwen2.py):
//   h = x + o( Attention( rope(q(n1(x))), rope(k(n1(x))), v(n1(x)) ) )      n = RMSNorm
//   y = h + down( silu(gate(n2(h))) * up(n2(h)) )
//   logits = lm_head(norm(y_last))
// RMSNorm upcasts to fp32 (x * rsqrt(mean(x^2) + eps)), casts back, then scales. RoPE angles
// are computed per forward in fp32 exactly as transformers computes them (inv_freq = 1 /
// theta^(2i/d) once, Llama-3 scaling applied to it; angle = position * inv_freq), and their
// cos/sin cast to the compute dtype. Attention is written out
// (no fused kernel: LibTorch 1.13 has none on the CPU): scores = q k^T / sqrt(d) in the compute
// dtype, masked with the dtype's lowest value, softmax in fp32, cast back, times v. GQA groups
// query heads per KV head by reshaping (no repeat of K/V). Queries are processed in chunks so
// memory grows linearly with the context, not quadratically (attention.h).
//
// Weights are views, never copies, where the device and dtype allow: a model directory's
// safetensors stay memory-mapped (read-only pages), a sync Snapshot's buffers are used in place.
// A 4-bit weight stays packed and is unpacked per layer inside the forward. Every tensor of the
// model lives on the one device given at load.
//
// LoRA: a LoraBinding (daemon/runtime/lora.h makes one) adds s * B(A(dropout(x))) to chosen
// linear outputs, computed in the adapter's dtype and added as PEFT does. A forward without a
// binding is the base model: the reference policy needs no copy.
//
// Thread-safety: a CausalLM is immutable after load; concurrent forwards are safe (each with
// its own KvCache).
//
// Files, one block each as vLLM's model files read: model.h this API; model.cpp the forward
// (linear layer, attention block, MLP, decoder layer, model, lm_head); weight_loader.cpp the
// loading (checkpoint -> tensors); attention.h the attention backend and its custom autograd
// product; kv_cache.h the cache; fused_ops.h the single-node LoRA linear, RMSNorm and RoPE;
// model_internal.h the decoder layer's weights, shared by model.cpp and weight_loader.cpp.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/checkpoint.h"
#include "core/status.h"
#include "daemon/runtime/attention.h"
#include "daemon/runtime/kv_cache.h"
#include "daemon/runtime/model_config.h"
#include "daemon/runtime/quant4.h"
#include "kernels/skinny_gemm.h"

namespace ferry::runtime {

// The seven projections of a decoder layer, in this order (kAllProj); they index a layer's
// linears (CausalLM::layer_linear) and a LoraBinding's modules.
enum class Proj : int { kQ = 0, kK, kV, kO, kGate, kUp, kDown };
inline constexpr int kNumProj = 7;
inline constexpr std::array<Proj, kNumProj> kAllProj = {Proj::kQ,    Proj::kK,  Proj::kV,   Proj::kO,
                                                        Proj::kGate, Proj::kUp, Proj::kDown};
// "self_attn.q_proj", ..., "mlp.down_proj".
std::string_view ProjName(Proj p);

// y = x W^T + b. Exactly one of `weight` and `quant` is set.
struct Linear {
  std::string name;  // module name: "model.layers.0.self_attn.q_proj", "lm_head"
  int64_t in = 0, out = 0;
  at::Tensor weight;  // [out, in]
  std::shared_ptr<const Quant4Weight> quant;
  at::Tensor bias;  // [out] or undefined
};

// A LoRA module on one linear layer: delta = scaling * (dropout(x) A^T) B^T.
struct LoraModule {
  at::Tensor a;  // [r, in]
  at::Tensor b;  // [out, r]
  double scaling = 1.0;
  double dropout = 0.0;
};

// Which LoRA module (if any) applies to each projection of each layer, and to lm_head.
struct LoraBinding {
  std::vector<std::array<const LoraModule*, kNumProj>> layers;
  const LoraModule* lm_head = nullptr;
};

struct ModelOptions {
  at::Device device = at::kCPU;  // Default: cpu
  // Compute dtype. Default: unset = the weights' own (the dtype of model.embed_tokens.weight;
  // for 4-bit bases the quant state's dtype). A different dtype costs one converted copy.
  std::optional<at::ScalarType> dtype;
  // The attention kernel (attention.h): kFused is LibTorch's scaled_dot_product_attention,
  // refused where this LibTorch lacks it. Default: kAuto (fused on CUDA where available).
  AttentionKernel attention_kernel = AttentionKernel::kAuto;
  // Queries processed per eager attention chunk (memory ~ chunk x context). Default: 1024.
  int64_t attention_chunk = 1024;
  // F32 attention products on the CPU with at most this many multiply-adds per (row, KV head)
  // (queries x keys x head_dim) run as plain batched loops (kernels/small_products.h) instead of
  // a batched matmul, whose per-item BLAS calls dominate tiny products (short contexts,
  // decoding). 0: always bmm.
  // Default: 4096.
  int64_t small_attention_product = 4096;
  // Linear layers over at most this many rows (tokens) with a frozen F32 weight, on a CPU with
  // AVX-512 or AVX2 + FMA, run as kernels/skinny_gemm.h loops instead of a BLAS GEMM (decoding a
  // few sequences: the BLAS packs the whole weight for a handful of rows); an adapter's delta is
  // added to their result. 0: always the BLAS.
  // Default: as many as pay on this CPU (64 with AVX-512, 8 with AVX2, 0 otherwise).
  int64_t skinny_linear_rows = kernels::SkinnyLinearRowsThatPay();
};

// One forward's inputs. Positions are RoPE positions; `attention_mask` says which key slots are
// real tokens: [B, S] where S = cache length before the call + T (without a cache, S = T).
struct ForwardArgs {
  at::Tensor input_ids;               // long [B, T]
  at::Tensor positions;               // long [B, T]
  at::Tensor attention_mask;          // bool [B, S]; undefined = all real
  const LoraBinding* lora = nullptr;  // null: the base model
  bool training = false;              // LoRA dropout on
  KvCache* cache = nullptr;           // when set: the T tokens are appended to it (slots length..length+T)
  // Recompute each decoder layer in the backward pass instead of keeping its activations.
  bool checkpoint_layers = false;
  // With a cache, no autograd: the T tokens' slots as a long tensor [T] on the model's device
  // (they must be length() .. length() + T - 1). The forward then writes them there by index and
  // attends over the cache's whole capacity (slots not yet filled are masked), so every decoding
  // step has the same shapes and reads its offsets from device memory: what a captured CUDA
  // graph needs. Undefined: the offsets come from length() and only the filled slots are read.
  at::Tensor cache_slots;
  // The caller knows every id lies in the vocabulary (a token this model sampled): the range
  // check, which waits for the device to read the ids' minimum and maximum, is skipped.
  bool ids_in_vocab = false;
};

class CausalLM;

// What a model built from earlier weights lends the next one: every tensor `unchanged` names
// (byte for byte the same in both checkpoints: equal digests) that `model` holds as a copy
// of its own (converted to the compute dtype, or copied to the device) is shared with the new
// model instead of being converted again. A tensor `model` holds as a view of its checkpoint
// is never lent (the view would keep that checkpoint's owner alive).
struct WeightReuse {
  const CausalLM* model = nullptr;
  std::function<bool(const std::string& name)> unchanged;
};

class CausalLM {
 public:
  // Loads `dir` (config.json + safetensors, single or sharded). Errors name the file and tensor:
  // a missing, extra or mis-shaped tensor, a dtype the runtime cannot compute in, and every
  // refusal of ParseModelConfig.
  static Result<std::unique_ptr<CausalLM>> Load(const std::filesystem::path& dir, const ModelOptions& options);
  // The same over tensors already open: a Checkpoint (a model directory's, or a sync
  // Snapshot's). `keep_alive` is held for the model's life (e.g. the Snapshot owning the bytes).
  // `reuse`: converted tensors taken from an earlier model (see WeightReuse); null: none.
  static Result<std::unique_ptr<CausalLM>> FromCheckpoint(const ModelConfig& config, const Checkpoint& weights,
                                                          const ModelOptions& options,
                                                          std::shared_ptr<const void> keep_alive = nullptr,
                                                          const WeightReuse* reuse = nullptr);
  CausalLM(const CausalLM&) = delete;
  CausalLM& operator=(const CausalLM&) = delete;
  ~CausalLM();

  const ModelConfig& config() const { return config_; }
  const at::Device& device() const { return device_; }
  at::ScalarType dtype() const { return dtype_; }
  // The attention kernel its forwards run (ModelOptions::attention_kernel resolved).
  AttentionKernel attention_kernel() const { return attention_.kernel; }
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  // The linear layers LoRA may target (q..down of every layer, then lm_head), with their
  // names as PEFT sees them ("model.layers.0.self_attn.q_proj"). REQUIRES: !fused().
  std::vector<const Linear*> Linears() const;
  const Linear& layer_linear(int layer, Proj p) const;
  // True when the weights came in the fused layout (self_attn.qkv_proj, mlp.gate_up_proj):
  // such a model runs, but LoRA cannot be bound to it.
  bool fused() const { return fused_; }
  const Linear& lm_head() const { return lm_head_; }
  // Bytes of the weights as held (packed 4-bit counted packed).
  int64_t weight_bytes() const;
  // Every tensor the model holds: weights and biases (a 4-bit weight's packed data and its
  // companions), norms and the RoPE table. All live on device(): the check that nothing of
  // the model ended up elsewhere.
  std::vector<at::Tensor> tensors() const;

  // Runs the decoder; returns the final hidden states [B, T, hidden] (after the final norm).
  // Errors (kInvalidArgument): shapes that do not fit, ids outside the vocabulary, no room
  // in the cache. LibTorch errors become kInternal.
  Result<at::Tensor> Hidden(const ForwardArgs& args) const;
  // lm_head over hidden states [..., hidden] -> logits [..., vocab] in the compute dtype.
  at::Tensor Logits(const at::Tensor& hidden, const LoraBinding* lora = nullptr, bool training = false) const;
  // Logits for every position: Logits(Hidden(args)).
  Result<at::Tensor> Forward(const ForwardArgs& args) const;

  // Internal: one decoder layer (public for activation checkpointing).
  struct Layer;
  struct Context;

 private:
  CausalLM() = default;
  Status Init(const ModelConfig& config, const Checkpoint& weights, const ModelOptions& options,
              const WeightReuse* reuse);
  at::Tensor LayerForward(const Layer& layer, int index, const at::Tensor& x, const Context& ctx) const;
  at::Tensor Attention(const Layer& layer, int index, const at::Tensor& x, const Context& ctx) const;
  at::Tensor Mlp(const Layer& layer, int index, const at::Tensor& x, const Context& ctx) const;
  at::Tensor Apply(const Linear& linear, const at::Tensor& x, const LoraModule* lora, bool training) const;

  ModelConfig config_;
  at::Device device_ = at::kCPU;
  at::ScalarType dtype_ = at::kFloat;
  AttentionOptions attention_;
  int64_t skinny_linear_rows_ = 0;
  bool fused_ = false;
  std::shared_ptr<const void> keep_alive_;
  Checkpoint weights_;  // keeps the mapped files open
  at::Tensor embed_;    // [vocab, hidden]
  at::Tensor norm_;     // [hidden]
  Linear lm_head_;      // weight shares embed_ when tied
  std::vector<std::unique_ptr<Layer>> layers_;
  at::Tensor inv_freq_;  // fp32 [head_dim / 2] on the device
  // The dense tensors held as copies of their own (converted or moved to the device), by
  // checkpoint name: what a WeightReuse may lend the next model.
  std::map<std::string, at::Tensor> copies_;
};

// The RoPE inverse frequencies [head_dim / 2] in fp32, as transformers computes them for
// `config` (with Llama-3 scaling when configured). Exposed for tests.
at::Tensor RopeInverseFrequencies(const ModelConfig& config);

}  // namespace ferry::runtime
