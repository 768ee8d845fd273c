// The attention backend (attention.h): the grouped, chunked, masked softmax, and the per-head
// products it runs on: plain loops with their own autograd node for tiny F32 CPU products
// (SmallProductFunction), bmm split across the intra-op threads otherwise.
#include "daemon/runtime/attention.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "daemon/runtime/parallel.h"
#include "kernels/small_products.h"

// at::scaled_dot_product_attention with its `scale` argument: PyTorch 2.1; 2.5 is the first whose
// CPU and CUDA kernels take an additive mask on every path transformers uses.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
#define FERRY_HAVE_SDPA 1
#else
#define FERRY_HAVE_SDPA 0
#endif

namespace ferry::runtime {
namespace {

// The dtype's lowest finite value, what a blocked score becomes (transformers: torch.finfo(dtype).min).
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

// q [.., M, D] with keys [.., N, D] gives q k^T [.., M, N] (kDot); p [.., M, N] with values
// [.., N, D] gives p v [.., M, D] (kWeighted).
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

// The product `kind` of a and b, batched over their leading dimensions: as loops
// (SmallProductFunction) for F32 CPU items of at most `small` multiply-adds, through bmm otherwise.
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

at::Tensor AttentionMaskFor(AttentionKernel kernel, const at::Tensor& blocked, at::ScalarType dtype) {
  if (kernel != AttentionKernel::kFused) return blocked;
  return at::zeros(blocked.sizes(), blocked.options().dtype(dtype)).masked_fill_(blocked, Lowest(dtype));
}

namespace {

#if FERRY_HAVE_SDPA
// transformers' sdpa_attention_forward: keys and values repeated to the query heads (repeat_kv;
// the GQA flag would send a masked call to the math kernel on CUDA), an additive mask, no dropout.
at::Tensor FusedAttention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                          const at::Tensor& blocked) {
  const int64_t B = q.size(0), T = q.size(1), nH = q.size(2), D = q.size(3);
  const int64_t nKV = keys.size(1), S = keys.size(2);
  const int64_t G = nH / nKV;
  at::Tensor k = keys, v = values;
  if (G > 1) {
    k = keys.unsqueeze(2).expand({B, nKV, G, S, D}).reshape({B, nH, S, D});
    v = values.unsqueeze(2).expand({B, nKV, G, S, D}).reshape({B, nH, S, D});
  }
  const at::Tensor mask = blocked.scalar_type() == at::kBool
                              ? AttentionMaskFor(AttentionKernel::kFused, blocked, q.scalar_type())
                              : blocked;
  const at::Tensor out = at::scaled_dot_product_attention(q.transpose(1, 2), k, v, mask.view({B, 1, T, S}),
                                                          /*dropout_p=*/0.0,
                                                          /*is_causal=*/false, 1.0 / std::sqrt(static_cast<double>(D)));
  return out.transpose(1, 2).reshape({B, T, nH * D});
}
#endif

}  // namespace

bool FusedAttentionAvailable() { return FERRY_HAVE_SDPA != 0; }

AttentionKernel ResolveAttentionKernel(AttentionKernel kernel, const at::Device& device) {
  if (kernel != AttentionKernel::kAuto) return kernel;
  return FusedAttentionAvailable() && device.is_cuda() ? AttentionKernel::kFused : AttentionKernel::kEager;
}

std::string_view AttentionKernelName(AttentionKernel kernel) {
  switch (kernel) {
    case AttentionKernel::kAuto: return "auto";
    case AttentionKernel::kEager: return "eager";
    case AttentionKernel::kFused: return "fused";
  }
  return "?";
}

at::Tensor ScaledDotProductAttention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                     const at::Tensor& blocked, const AttentionOptions& options) {
  const int64_t B = q.size(0), T = q.size(1), nH = q.size(2), D = q.size(3);
  const int64_t nKV = keys.size(1), S = keys.size(2);
  const int64_t G = nH / nKV;
#if FERRY_HAVE_SDPA
  if (ResolveAttentionKernel(options.kernel, q.device()) == AttentionKernel::kFused) {
    return FusedAttention(q, keys, values, blocked);
  }
#endif
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  at::Tensor qg = q.view({B, T, nKV, G, D}).permute({0, 2, 3, 1, 4});  // [B, nKV, G, T, D]
  const at::Scalar lowest = Lowest(q.scalar_type());
  std::vector<at::Tensor> outs;
  for (int64_t t0 = 0; t0 < T; t0 += options.query_chunk) {
    const int64_t tc = std::min(options.query_chunk, T - t0);
    at::Tensor qc = (tc == T ? qg : qg.narrow(3, t0, tc)).reshape({B, nKV, G * tc, D});
    at::Tensor scores = HeadProduct(Product::kDot, qc, keys, options.small_product) * scale;
    scores = scores.view({B, nKV, G, tc, S}).masked_fill(tc == T ? blocked : blocked.narrow(3, t0, tc), lowest);
    at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
    outs.push_back(HeadProduct(Product::kWeighted, probs.view({B, nKV, G * tc, S}), values, options.small_product)
                       .view({B, nKV, G, tc, D}));
  }
  at::Tensor out = outs.size() == 1 ? outs[0] : at::cat(outs, 3);
  return out.permute({0, 3, 1, 2, 4}).reshape({B, T, nH * D});
}

}  // namespace ferry::runtime
