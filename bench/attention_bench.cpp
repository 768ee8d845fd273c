// The runtime's attention kernels on short contexts, the same model three ways, alternated in one
// run: the eager kernel with the tiny products as plain batched loops (kernels/small_products.h;
// ModelOptions::small_attention_product, the CPU's default), the eager kernel with every product
// on LibTorch's batched matmul (small_attention_product = 0), and, where the LibTorch has it, the
// fused kernel (at::scaled_dot_product_attention, attention.h; the default on CUDA).
//
// Usage: ferry_bench_attention [--model fixtures/demo/model] [--rows 128] [--prompt 7]
//          [--completion 3] [--threads 2] [--reps 40]
// Two workloads of the GRPO demo's shape, each timed per repetition (medians printed):
//   decode: without autograd, a prefill of --rows x --prompt tokens, then --completion decoding
//           steps of one token per row on the KV cache (the decoding steps are timed);
//   train:  with autograd and a LoRA adapter on every projection, a prefill of the prompts into a
//           cache, then --completion tokens per row against it, and the backward of the logits'
//           sum (the trainer's shared-prompt forward, daemon/grpo/rollout.cpp).
// Prints a GEMM calibration, one JSON object, the time ratios `small/bmm` and `fused/small` (below
// 1: the first is faster), and the calibration again.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "bench/torch_calibration.h"
#include "convert/peft_config.h"
#include "daemon/runtime/lora.h"
#include "daemon/runtime/model.h"
#include "daemon/runtime/torch_util.h"

namespace {

using ferry::bench::CalibrationGflops;
using ferry::bench::Median;
using ferry::bench::Now;
using ferry::runtime::CausalLM;

at::Tensor Positions(int64_t rows, int64_t start, int64_t count) {
  return at::arange(start, start + count, at::kLong).view({1, count}).expand({rows, count}).contiguous();
}

struct Case {
  const char* name = "";
  std::unique_ptr<CausalLM> model;
  std::unique_ptr<ferry::runtime::LoraAdapter> adapter;
  std::vector<double> decode_s, train_s;
};

// Seconds of `steps` decoding steps after a prefill, without autograd.
double Decode(const CausalLM& m, const at::Tensor& prompt, int64_t steps) {
  at::NoGradGuard no_grad;
  const int64_t rows = prompt.size(0), p = prompt.size(1);
  ferry::runtime::KvCache cache(m.config(), rows, p + steps, m.dtype(), m.device());
  ferry::runtime::ForwardArgs a;
  a.cache = &cache;
  a.input_ids = prompt;
  a.positions = Positions(rows, 0, p);
  auto logits = m.Forward(a);
  if (!logits.ok()) {
    std::fprintf(stderr, "ferry_bench_attention: %s\n", logits.status().ToString().c_str());
    std::exit(1);
  }
  const double t0 = Now();
  for (int64_t t = 0; t < steps; ++t) {
    a.input_ids = logits->select(1, logits->size(1) - 1).argmax(-1).view({rows, 1});
    a.positions = Positions(rows, p + t, 1);
    logits = m.Forward(a);
    if (!logits.ok()) std::exit(1);
  }
  return Now() - t0;
}

// Seconds of the trainer's shared-prompt forward and its backward, with the adapter.
double Train(const CausalLM& m, const ferry::runtime::LoraAdapter& lora, const at::Tensor& prompt,
             const at::Tensor& completion) {
  const int64_t rows = prompt.size(0), p = prompt.size(1), c = completion.size(1);
  const double t0 = Now();
  ferry::runtime::KvCache cache(m.config(), rows, p + c, m.dtype(), m.device());
  ferry::runtime::ForwardArgs a;
  a.cache = &cache;
  a.lora = &lora.binding();
  a.training = true;
  a.input_ids = prompt;
  a.positions = Positions(rows, 0, p);
  auto h = m.Forward(a);
  if (!h.ok()) std::exit(1);
  a.input_ids = completion;
  a.positions = Positions(rows, p, c);
  auto logits = m.Forward(a);
  if (!logits.ok()) std::exit(1);
  (h->select(1, p - 1).sum() + logits->sum()).backward();
  return Now() - t0;
}

int Usage() {
  std::fprintf(stderr,
               "usage: ferry_bench_attention [--model fixtures/demo/model] [--rows 128] [--prompt 7]\n"
               "                             [--completion 3] [--threads 2] [--reps 40]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir = "fixtures/demo/model";
  int64_t rows = 128, prompt_len = 7, completion_len = 3, threads = 2, reps = 40;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      Usage();
      return 0;
    }
    if (i + 1 >= argc) return Usage();
    const char* v = argv[++i];
    if (arg == "--model") {
      model_dir = v;
    } else if (arg == "--rows") {
      rows = std::atoll(v);
    } else if (arg == "--prompt") {
      prompt_len = std::atoll(v);
    } else if (arg == "--completion") {
      completion_len = std::atoll(v);
    } else if (arg == "--threads") {
      threads = std::atoll(v);
    } else if (arg == "--reps") {
      reps = std::atoll(v);
    } else {
      return Usage();
    }
  }
  if (rows < 1 || prompt_len < 1 || completion_len < 1 || threads < 1 || reps < 1) return Usage();
  ferry::runtime::SetTorchThreads(static_cast<int>(threads));
  ferry::runtime::KeepFreedTensorMemory();

  std::printf("calibration before: F32 GEMM 512x1024x1024 %.1f GFLOP/s\n", CalibrationGflops());
  std::vector<Case> cases;
  for (const char* name : {"small", "bmm", "fused"}) {
    ferry::runtime::ModelOptions o;
    o.attention_kernel = ferry::runtime::AttentionKernel::kEager;
    if (std::strcmp(name, "bmm") == 0) o.small_attention_product = 0;  // every product on bmm
    if (std::strcmp(name, "fused") == 0) {
      if (!ferry::runtime::FusedAttentionAvailable()) {
        std::printf("fused: this LibTorch has no scaled_dot_product_attention (not measured)\n");
        continue;
      }
      o.attention_kernel = ferry::runtime::AttentionKernel::kFused;
    }
    Case c;
    c.name = name;
    auto m = CausalLM::Load(model_dir, o);
    if (!m.ok()) {
      std::fprintf(stderr, "ferry_bench_attention: %s\n", m.status().ToString().c_str());
      return 1;
    }
    c.model = std::move(*m);
    auto peft = ferry::ParsePeftConfig(
        R"({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": "all-linear"})", "bench adapter");
    if (!peft.ok()) return 1;
    auto a = ferry::runtime::LoraAdapter::Create(*c.model, *peft, 1);
    if (!a.ok()) {
      std::fprintf(stderr, "ferry_bench_attention: %s\n", a.status().ToString().c_str());
      return 1;
    }
    c.adapter = std::move(*a);
    cases.push_back(std::move(c));
  }
  const int64_t vocab = cases[0].model->config().vocab_size;
  at::manual_seed(1);
  const at::Tensor prompt = at::randint(0, vocab, {rows, prompt_len}, at::kLong);
  const at::Tensor completion = at::randint(0, vocab, {rows, completion_len}, at::kLong);
  for (int64_t r = -3; r < reps; ++r) {  // 3 warm-up repetitions
    for (Case& c : cases) {
      const double d = Decode(*c.model, prompt, completion_len);
      const double t = Train(*c.model, *c.adapter, prompt, completion);
      for (auto& p : c.adapter->parameters()) p.mutable_grad().reset();
      if (r >= 0) {
        c.decode_s.push_back(d);
        c.train_s.push_back(t);
      }
    }
  }
  std::printf(
      "{\"model\": \"%s\", \"rows\": %lld, \"prompt\": %lld, \"completion\": %lld, \"threads\": %lld, "
      "\"reps\": %lld",
      model_dir.c_str(), static_cast<long long>(rows), static_cast<long long>(prompt_len),
      static_cast<long long>(completion_len), static_cast<long long>(threads), static_cast<long long>(reps));
  for (const Case& c : cases) {
    std::printf(", \"%s_decode_s\": %.6f, \"%s_train_s\": %.6f", c.name, Median(c.decode_s), c.name, Median(c.train_s));
  }
  std::printf("}\n");
  auto ratio = [&](const char* what, size_t a, size_t b) {
    std::printf("%s (%lld steps): %s/%s %.2f; train forward + backward: %s/%s %.2f\n", what,
                static_cast<long long>(completion_len), cases[a].name, cases[b].name,
                Median(cases[a].decode_s) / Median(cases[b].decode_s), cases[a].name, cases[b].name,
                Median(cases[a].train_s) / Median(cases[b].train_s));
  };
  ratio("decode", 0, 1);
  if (cases.size() == 3) ratio("decode", 2, 0);
  std::printf("calibration after: F32 GEMM 512x1024x1024 %.1f GFLOP/s\n", CalibrationGflops());
  return 0;
}
