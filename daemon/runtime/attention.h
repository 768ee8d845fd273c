// The attention backend: softmax(q k^T / sqrt(d), masked) v over grouped query heads, the
// arithmetic between the model's projections and its output projection (vLLM keeps it apart
// from the model files the same way). The projections, RoPE and the KV cache are the model's
// (model.cpp, kv_cache.h).
//
// As transformers' eager attention computes it: scores = q k^T * (1 / sqrt(D)) in q's dtype,
// masked with the dtype's lowest value, softmax in fp32, cast back, times v. GQA groups the
// query heads of each KV head by reshaping (no repeat of K/V). Queries are processed in chunks
// so memory grows linearly with the context, not quadratically.
//
// The per-head products q k^T and p v, batched over [batch, KV head]: LibTorch 1.13's CPU bmm
// makes one BLAS call per batch item, about a microsecond each on top of the arithmetic, which
// is most of the cost when the items are tiny (short contexts: decoding, a small model's rows).
// Up to `small_product` multiply-adds per item, F32 on the CPU, they run as plain loops over the
// items instead (kernels/small_products.h), forward and backward as one custom autograd node,
// split across threads by item. BF16 and CUDA stay on bmm, as do items above `small_product`,
// where BLAS's blocking pays; without autograd the CPU bmm is split across the intra-op threads.
//
// The fused kernel (AttentionKernel::kFused, the default on CUDA where the LibTorch has it):
// LibTorch's own at::scaled_dot_product_attention (PyTorch >= 2.5), as transformers' "sdpa"
// attention calls it: the KV heads repeated to the query heads, the mask additive (0 where a key
// is visible, the dtype's lowest value where blocked, so a row with every key blocked averages
// the values as the eager path does instead of giving NaN), the scale 1 / sqrt(D). On CUDA it
// runs the memory-efficient kernel: no [T, S] scores or probabilities are kept for the backward
// pass, which recomputes them. Debian's LibTorch 1.13 has no such function (kEager only there).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string_view>

namespace ferry::runtime {

enum class AttentionKernel {
  kAuto,   // kFused on CUDA where this LibTorch has it, kEager otherwise
  kEager,  // the chunked softmax of this file (transformers' eager attention)
  kFused,  // at::scaled_dot_product_attention. REQUIRES: FusedAttentionAvailable()
};

// Whether this LibTorch has at::scaled_dot_product_attention with a scale (PyTorch >= 2.5).
bool FusedAttentionAvailable();

// The kernel `kernel` resolves to for tensors on `device`.
AttentionKernel ResolveAttentionKernel(AttentionKernel kernel, const at::Device& device);

std::string_view AttentionKernelName(AttentionKernel kernel);

struct AttentionOptions {
  // Which kernel runs (see the top). Default: kAuto.
  AttentionKernel kernel = AttentionKernel::kAuto;
  // Queries processed per chunk (memory ~ chunk x keys). REQUIRES: >= 1.
  int64_t query_chunk = 1024;
  // F32 CPU products of at most this many multiply-adds per (row, KV head) (queries x keys x
  // head_dim) run as loops instead of a batched matmul. 0: always bmm.
  int64_t small_product = 4096;
};

// The mask in the form `kernel` (resolved) reads: `blocked` itself for the eager kernel; for the
// fused one, additive in `dtype` (0 where visible, the dtype's lowest value where blocked), the
// same shape. A forward makes it once for all its layers.
at::Tensor AttentionMaskFor(AttentionKernel kernel, const at::Tensor& blocked, at::ScalarType dtype);

// Attention output [B, T, nH * D] for queries q [B, T, nH, D] (RoPE applied) over keys and
// values [B, nKV, S, D], where `blocked` [B, 1, 1, T, S] (bool) marks each key a query may not
// see; the fused kernel also takes AttentionMaskFor's additive form of it, in q's dtype. Query
// head h reads KV head h / (nH / nKV). Gradients flow to q, keys and values.
// REQUIRES: nKV divides nH; one dtype and device throughout.
at::Tensor ScaledDotProductAttention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                     const at::Tensor& blocked, const AttentionOptions& options);

}  // namespace ferry::runtime
