// ferryd's generator on one model: prefill and decode throughput and peak memory, one line of
// JSON per run. bench/generate_compare.py runs it side by side with transformers' generate
// (bench/hf_generate_peer.py) on the same model, threads and shapes, and prints the ratios.
//
// Usage: ferry_bench_generate --model DIR [--batch 16] [--prompt-len 128] [--new-tokens 128]
//          [--threads 2] [--dtype f32|bf16|model] [--device cpu|cuda] [--seed 1] [--skinny-rows N]
//          [--small-attention N] [--attention auto|eager|fused] [--finish-check-every N] [--static-shapes]
//          [--cuda-graphs]
// --skinny-rows: ModelOptions::skinny_linear_rows (0: every linear layer on the BLAS).
// --small-attention: ModelOptions::small_attention_product (0: every attention product on bmm).
// --attention: ModelOptions::attention_kernel (auto: fused on CUDA where the LibTorch has it).
// --finish-check-every: GeneratorOptions::finish_check_every (0: the default, 1 on the CPU, 16 on
// CUDA); --static-shapes: GeneratorOptions::static_shapes; --cuda-graphs: GeneratorOptions::cuda_graphs
// (each decoding step replayed from a CUDA graph; its one eager step and capture per batch size
// are inside generate_s). The JSON line names all four.
// Prompts are random token ids (seeded); EOS is ignored so every row decodes exactly
// --new-tokens tokens; decoding is greedy. kv_cache_bytes: the generator's cache for the run
// (keys and values of every layer for batch x (prompt + new) positions in the compute dtype);
// with weight_bytes (a 4-bit base counted packed) it is the floor peak memory is compared with.
// Memory (CPU): rss_before_load_bytes is VmRSS after LibTorch has started (a small matmul on
// --threads threads has run, so its code pages, BLAS and thread pool are resident) and before the
// model is loaded; load_peak_rss_bytes is VmHWM after the load; peak_rss_bytes is VmHWM at the
// end (whole process). model_peak_bytes = peak_rss_bytes - rss_before_load_bytes (what loading and
// generating added at its peak, the mapped weight pages included) and memory_ratio =
// model_peak_bytes / (weight_bytes + kv_cache_bytes).
// On CUDA the timings wait for the device (results are copied back).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>

#include "bench/bench_util.h"
#include "daemon/runtime/generator.h"
#include "daemon/runtime/torch_util.h"

namespace {

using ferry::bench::Now;
using ferry::runtime::CausalLM;

// A "Vm...:" field of /proc/self/status in bytes (0 when absent).
int64_t StatusBytes(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const size_t n = std::strlen(field);
  while (std::getline(f, line)) {
    if (line.compare(0, n, field) == 0) return std::atoll(line.c_str() + n) * 1024;
  }
  return 0;
}
int64_t PeakRssBytes() { return StatusBytes("VmHWM:"); }
int64_t RssBytes() { return StatusBytes("VmRSS:"); }

int Usage() {
  std::fprintf(stderr,
               "usage: ferry_bench_generate --model DIR [--batch 16] [--prompt-len 128] [--new-tokens 128]\n"
               "                            [--threads 2] [--dtype f32|bf16|model] [--device cpu|cuda] [--seed 1]\n"
               "                            [--skinny-rows N] [--small-attention N] [--attention auto|eager|fused]\n"
               "                            [--finish-check-every N] [--static-shapes] [--cuda-graphs]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir, dtype = "f32", device = "cpu";
  int64_t batch = 16, prompt_len = 128, new_tokens = 128, threads = 2;
  uint64_t seed = 1;
  int64_t skinny_rows = ferry::runtime::ModelOptions().skinny_linear_rows;
  int64_t small_attention = ferry::runtime::ModelOptions().small_attention_product;
  std::string attention = "auto";
  int64_t finish_check_every = 0;
  bool static_shapes = false, cuda_graphs = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--model") model_dir = next();
    else if (a == "--batch") batch = std::atoll(next().c_str());
    else if (a == "--prompt-len") prompt_len = std::atoll(next().c_str());
    else if (a == "--new-tokens") new_tokens = std::atoll(next().c_str());
    else if (a == "--threads") threads = std::atoll(next().c_str());
    else if (a == "--dtype") dtype = next();
    else if (a == "--device") device = next();
    else if (a == "--seed") seed = std::strtoull(next().c_str(), nullptr, 10);
    else if (a == "--skinny-rows") skinny_rows = std::atoll(next().c_str());
    else if (a == "--small-attention") small_attention = std::atoll(next().c_str());
    else if (a == "--attention") attention = next();
    else if (a == "--finish-check-every") finish_check_every = std::atoll(next().c_str());
    else if (a == "--static-shapes") static_shapes = true;
    else if (a == "--cuda-graphs") cuda_graphs = true;
    else return Usage();
  }
  if (model_dir.empty() || batch < 1 || prompt_len < 1 || new_tokens < 1) return Usage();
  if (device != "cpu" && device != "cuda") return Usage();
  if (attention != "auto" && attention != "eager" && attention != "fused") return Usage();
  if (finish_check_every < 0) return Usage();
  if (device == "cuda" && !at::hasCUDA()) {
    std::fprintf(stderr, "ferry_bench_generate: --device cuda, but this LibTorch or machine has no CUDA device\n");
    return 1;
  }
  ferry::runtime::SetTorchThreads(static_cast<int>(threads));
  ferry::runtime::KeepFreedTensorMemory();
  ferry::runtime::ModelOptions opts;
  opts.device = device == "cuda" ? at::Device(at::kCUDA) : at::Device(at::kCPU);
  if (dtype == "f32") opts.dtype = at::kFloat;
  if (dtype == "bf16") opts.dtype = at::kBFloat16;
  opts.skinny_linear_rows = skinny_rows;
  opts.small_attention_product = small_attention;
  if (attention == "eager") opts.attention_kernel = ferry::runtime::AttentionKernel::kEager;
  if (attention == "fused") opts.attention_kernel = ferry::runtime::AttentionKernel::kFused;
  {
    // Start LibTorch's CPU side (BLAS, thread pool) before the baseline.
    at::Tensor w = at::ones({64, 64});
    (void)at::matmul(w, w).sum().item<float>();
  }
  const int64_t rss_before_load = RssBytes();
  const double t_load = Now();
  auto model = CausalLM::Load(model_dir, opts);
  if (!model.ok()) {
    std::fprintf(stderr, "ferry_bench_generate: %s\n", model.status().ToString().c_str());
    return 1;
  }
  const double load_s = Now() - t_load;
  const int64_t rss_after_load = RssBytes(), load_peak_rss = PeakRssBytes();
  const CausalLM& m = **model;
  std::mt19937_64 rng(seed);
  std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(batch));
  for (auto& p : prompts) {
    for (int64_t t = 0; t < prompt_len; ++t) {
      p.push_back(static_cast<int32_t>(rng() % static_cast<uint64_t>(m.config().vocab_size)));
    }
  }

  // Prefill alone: one forward of the whole batch into a KV cache, logits of the last position.
  at::NoGradGuard no_grad;
  const double t_prefill = Now();
  {
    ferry::runtime::KvCache cache(m.config(), batch, prompt_len, m.dtype(), m.device());
    ferry::runtime::ForwardArgs a;
    std::vector<int64_t> flat;
    for (const auto& p : prompts) flat.insert(flat.end(), p.begin(), p.end());
    a.input_ids = at::tensor(flat, at::kLong).view({batch, prompt_len}).to(m.device());
    a.positions =
        at::arange(prompt_len, at::kLong).view({1, prompt_len}).expand({batch, prompt_len}).contiguous().to(m.device());
    a.cache = &cache;
    auto h = m.Hidden(a);
    if (!h.ok()) {
      std::fprintf(stderr, "ferry_bench_generate: %s\n", h.status().ToString().c_str());
      return 1;
    }
    (void)m.Logits(h->narrow(1, prompt_len - 1, 1)).cpu();  // the copy back waits for the device
  }
  const double prefill_s = Now() - t_prefill;
  const int64_t kv_cache_bytes =
      ferry::runtime::KvCache(m.config(), batch, prompt_len + new_tokens, m.dtype(), m.device()).bytes();

  ferry::runtime::GeneratorOptions gopts;
  gopts.max_batch = batch;
  gopts.finish_check_every = finish_check_every;
  gopts.static_shapes = static_shapes;
  gopts.cuda_graphs = cuda_graphs;
  ferry::runtime::Generator gen(m, gopts);
  ferry::runtime::SamplingParams p;
  p.temperature = 0;
  p.max_new_tokens = new_tokens;
  const double t_gen = Now();
  auto out = gen.Generate(prompts, 1, p);
  const double generate_s = Now() - t_gen;
  if (!out.ok()) {
    std::fprintf(stderr, "ferry_bench_generate: %s\n", out.status().ToString().c_str());
    return 1;
  }
  const int64_t peak_rss = PeakRssBytes();
  const int64_t model_peak = peak_rss - rss_before_load;
  const int64_t floor_bytes = m.weight_bytes() + kv_cache_bytes;
  int64_t generated = 0;
  for (const auto& c : *out) generated += static_cast<int64_t>(c.token_ids.size());
  std::printf(
      "{\"system\": \"ferry\", \"device\": \"%s\", \"batch\": %lld, \"prompt_len\": %lld, \"new_tokens\": %lld, "
      "\"threads\": %lld, \"dtype\": \"%s\", \"load_s\": %.4f, \"prefill_s\": %.4f, \"prefill_tokens_per_s\": %.2f, "
      "\"generate_s\": %.4f, \"generated_tokens\": %lld, \"generate_tokens_per_s\": %.2f, \"peak_rss_bytes\": %lld, "
      "\"rss_before_load_bytes\": %lld, \"rss_after_load_bytes\": %lld, \"load_peak_rss_bytes\": %lld, "
      "\"model_peak_bytes\": %lld, \"weight_bytes\": %lld, \"kv_cache_bytes\": %lld, \"memory_ratio\": %.4f, "
      "\"blas\": \"%s\", \"attention\": \"%s\", \"finish_check_every\": %lld, \"static_shapes\": %s, "
      "\"cuda_graphs\": %s}\n",
      device.c_str(), static_cast<long long>(batch), static_cast<long long>(prompt_len),
      static_cast<long long>(new_tokens), static_cast<long long>(threads), c10::toString(m.dtype()), load_s, prefill_s,
      static_cast<double>(batch * prompt_len) / prefill_s, generate_s, static_cast<long long>(generated),
      static_cast<double>(generated) / generate_s, static_cast<long long>(peak_rss),
      static_cast<long long>(rss_before_load), static_cast<long long>(rss_after_load),
      static_cast<long long>(load_peak_rss), static_cast<long long>(model_peak),
      static_cast<long long>(m.weight_bytes()), static_cast<long long>(kv_cache_bytes),
      static_cast<double>(model_peak) / static_cast<double>(floor_bytes), ferry::runtime::LoadedBlas().library.c_str(),
      std::string(ferry::runtime::AttentionKernelName(m.attention_kernel())).c_str(),
      static_cast<long long>(finish_check_every), static_shapes ? "true" : "false", cuda_graphs ? "true" : "false");
  return 0;
}
