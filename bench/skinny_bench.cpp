// The few-row linear (kernels/skinny_gemm.h, through runtime::SkinnyLinearOrUndefined: what the model
// runs) against at::linear (LibTorch's BLAS, what it runs otherwise) on one weight shape, for a list
// of row counts, alternated in one run.
//
// Usage: ferry_bench_skinny [--out 4864] [--in 896] [--rows 1,4,8,12,16,24,32,48,64] [--threads 2]
//          [--memory-mb 256] [--reps 5]
// The weight is copied until the copies fill --memory-mb, and each call takes the next copy, so every
// call reads its weight from memory as a decoding step does. Per row count: the best of --reps
// passes over the copies, in ms per call, GFLOP/s, the weight's GB/s, and blas/skinny (above 1: the
// few-row loops are faster). Also prints the rows from which the BLAS is faster, and
// kernels::SkinnyLinearRowsThatPay() (the model's default), for comparison.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "daemon/runtime/fused_ops.h"
#include "daemon/runtime/torch_util.h"
#include "kernels/skinny_gemm.h"

namespace {

using ferry::bench::Now;

std::vector<int64_t> ParseList(const char* s) {
  std::vector<int64_t> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(std::atoll(item.c_str()));
  return out;
}

int Usage(FILE* to = stderr) {
  std::fprintf(to,
               "usage: ferry_bench_skinny [--out 4864] [--in 896] [--rows 1,4,8,12,16,24,32,48,64] [--threads 2]\n"
               "                          [--memory-mb 256] [--reps 5]\n");
  return to == stdout ? 0 : 2;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t out = 4864, in = 896, threads = 2, memory_mb = 256, reps = 5;
  std::vector<int64_t> rows_list = {1, 4, 8, 12, 16, 24, 32, 48, 64};
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      Usage(stdout);
      return 0;
    }
    if (i + 1 >= argc) return Usage();
    const char* value = argv[++i];
    if (flag == "--out") {
      out = std::atoll(value);
    } else if (flag == "--in") {
      in = std::atoll(value);
    } else if (flag == "--rows") {
      rows_list = ParseList(value);
    } else if (flag == "--threads") {
      threads = std::atoll(value);
    } else if (flag == "--memory-mb") {
      memory_mb = std::atoll(value);
    } else if (flag == "--reps") {
      reps = std::atoll(value);
    } else {
      return Usage();
    }
  }
  if (out < 1 || in < 1 || threads < 1 || memory_mb < 1 || reps < 1 || rows_list.empty()) return Usage();
  for (int64_t r : rows_list) {
    if (r < 1) return Usage();
  }
  ferry::runtime::SetTorchThreads(static_cast<int>(threads));
  ferry::runtime::KeepFreedTensorMemory();
  if (!ferry::kernels::SkinnyLinearFast()) {
    std::fprintf(stderr, "ferry_bench_skinny: this CPU has neither AVX-512 nor AVX2 + FMA: the model uses the BLAS\n");
    return 1;
  }
  at::NoGradGuard no_grad;
  at::manual_seed(1);
  const int64_t weight_bytes = out * in * int64_t{sizeof(float)};
  const int64_t copies = std::max<int64_t>(1, (memory_mb << 20) / weight_bytes);
  std::vector<at::Tensor> weights;
  for (int64_t c = 0; c < copies; ++c) weights.push_back(at::randn({out, in}) * 0.05);
  const int64_t max_rows = *std::max_element(rows_list.begin(), rows_list.end());

  std::printf("weight [%lld, %lld] F32 (%.1f MB), %lld copies, %lld threads, best of %lld passes; BLAS: %s\n",
              static_cast<long long>(out), static_cast<long long>(in), weight_bytes / 1e6,
              static_cast<long long>(copies), static_cast<long long>(threads), static_cast<long long>(reps),
              ferry::runtime::LoadedBlas().library.c_str());
  std::printf("%5s  %10s %8s %8s  %10s %8s %8s  %11s\n", "rows", "skinny ms", "GFLOP/s", "GB/s", "blas ms", "GFLOP/s",
              "GB/s", "blas/skinny");
  int64_t blas_from = 0;
  for (int64_t rows : rows_list) {
    const at::Tensor x = at::randn({rows, in});
    double skinny = 1e30, blas = 1e30;
    double max_diff = 0;
    for (int64_t r = 0; r < reps; ++r) {
      // Alternated per pass, so that drift in the machine's speed touches both.
      double t0 = Now();
      for (const at::Tensor& w : weights) {
        const at::Tensor y = ferry::runtime::SkinnyLinearOrUndefined(x, w, at::Tensor(), max_rows);
        if (!y.defined()) {
          std::fprintf(stderr, "ferry_bench_skinny: the few-row path refused %lld rows\n",
                       static_cast<long long>(rows));
          return 1;
        }
      }
      skinny = std::min(skinny, (Now() - t0) / static_cast<double>(copies));
      t0 = Now();
      for (const at::Tensor& w : weights) (void)at::linear(x, w);
      blas = std::min(blas, (Now() - t0) / static_cast<double>(copies));
    }
    const at::Tensor want = at::linear(x, weights[0]);
    const at::Tensor got = ferry::runtime::SkinnyLinearOrUndefined(x, weights[0], at::Tensor(), max_rows);
    max_diff = (want - got).abs().max().item<double>();
    if (max_diff > 1e-3) {
      std::fprintf(stderr, "ferry_bench_skinny: %lld rows: results differ by %g\n", static_cast<long long>(rows),
                   max_diff);
      return 1;
    }
    const double flop = 2.0 * static_cast<double>(rows * out * in);
    std::printf("%5lld  %10.3f %8.0f %8.1f  %10.3f %8.0f %8.1f  %11.2f\n", static_cast<long long>(rows), skinny * 1e3,
                flop / skinny / 1e9, weight_bytes / skinny / 1e9, blas * 1e3, flop / blas / 1e9,
                weight_bytes / blas / 1e9, blas / skinny);
    if (blas < skinny && blas_from == 0) blas_from = rows;
  }
  if (blas_from > 0) {
    std::printf("the BLAS is faster from %lld rows", static_cast<long long>(blas_from));
  } else {
    std::printf("the few-row loops are faster at every row count measured");
  }
  std::printf("; SkinnyLinearRowsThatPay() = %lld\n",
              static_cast<long long>(ferry::kernels::SkinnyLinearRowsThatPay()));
  return 0;
}
