// Times the CPU rank-r merge (kernels/lora_merge.h) on a 4096x4096 fp32 W with r = 16 against
// a plain memcpy of W, the memory-bound floor: the merge reads and writes W once, as memcpy
// reads one buffer and writes another. Prints the ratio, for 1 and 2 threads.
// Then times the fused BF16 merge (LoraMergeRows16, r = 16) on the TinyLlama projection
// shapes, median and minimum of the repeats, against a memcpy of the BF16 weight.
//
// Usage: ferry_bench_merge [out in r repeats]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/lora_merge.h"

namespace {

template <typename Fn>
std::vector<double> SortedSeconds(int repeats, Fn fn) {
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t;
}

// LoraMergeRows16 on a BF16 [out, in] weight with rank r, 1 and 2 threads.
void BenchRows16(int64_t out, int64_t in, int64_t r, int repeats) {
  std::mt19937 rng(2);
  std::normal_distribution<float> dist(0.0f, 0.02f);
  std::vector<float> A(static_cast<size_t>(r * in)), B(static_cast<size_t>(out * r));
  for (auto& x : A) x = dist(rng);
  for (auto& x : B) x = dist(rng);
  std::vector<uint16_t> W(static_cast<size_t>(out * in)), dst(W.size()), copy(W.size());
  for (auto& h : W) {
    const float x = dist(rng);
    uint32_t u;
    std::memcpy(&u, &x, 4);
    h = static_cast<uint16_t>(u >> 16);
  }
  const auto t_copy = SortedSeconds(repeats, [&] { std::memcpy(copy.data(), W.data(), W.size() * 2); });
  std::printf("  bf16 %5lldx%-5lld r=%lld  memcpy med %7.3f ms", static_cast<long long>(out),
              static_cast<long long>(in), static_cast<long long>(r), t_copy[t_copy.size() / 2] * 1e3);
  for (int threads : {1, 2}) {
    const auto t = SortedSeconds(repeats, [&] {
      ferry::kernels::LoraMergeRows16(W.data(), ferry::kernels::Float16Kind::kBF16, A.data(), B.data(), out, in, r,
                                      0.5f, dst.data(), threads);
    });
    std::printf(" | %d thread%s med %7.3f min %7.3f ms", threads, threads == 1 ? " " : "s", t[t.size() / 2] * 1e3,
                t[0] * 1e3);
  }
  std::printf("\n");
}

template <typename Fn>
double BestSeconds(int repeats, Fn fn) {
  double best = 1e30;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t out = 4096, in = 4096, r = 16;
  int repeats = 10;
  if (argc == 5) {
    out = std::atoll(argv[1]);
    in = std::atoll(argv[2]);
    r = std::atoll(argv[3]);
    repeats = std::atoi(argv[4]);
  } else if (argc != 1) {
    std::fprintf(stderr, "usage: %s [out in r repeats]\n", argv[0]);
    return 2;
  }
  if (out <= 0 || in <= 0 || r <= 0 || repeats <= 0) {
    std::fprintf(stderr, "out, in, r and repeats must be positive\n");
    return 2;
  }
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> A(r * in), B(out * r), W(out * in), copy(out * in);
  for (auto& x : A) x = dist(rng);
  for (auto& x : B) x = dist(rng);
  for (auto& x : W) x = dist(rng);

  const double bytes = static_cast<double>(out * in) * sizeof(float);
  const double t_copy = BestSeconds(repeats, [&] { std::memcpy(copy.data(), W.data(), W.size() * sizeof(float)); });
  std::printf("W %lldx%lld fp32 (%.1f MiB), r=%lld, best of %d\n", static_cast<long long>(out),
              static_cast<long long>(in), bytes / (1 << 20), static_cast<long long>(r), repeats);
  std::printf("  memcpy            %8.3f ms  %6.2f GB/s read+write\n", t_copy * 1e3, 2 * bytes / t_copy / 1e9);
  double t_single = 0;
  for (int threads : {1, 2}) {
    const double t = BestSeconds(
        repeats, [&] { ferry::kernels::LoraDeltaAccumulate(A.data(), B.data(), out, in, r, 0.5f, W.data(), threads); });
    if (threads == 1) t_single = t;
    const double gflops = 2.0 * static_cast<double>(out * in * r) / t / 1e9;
    std::printf("  merge %d thread%s  %8.3f ms  %6.2f GB/s  %6.2f GFLOP/s  %.2fx memcpy  %.2fx speedup\n", threads,
                threads == 1 ? " " : "s", t * 1e3, 2 * bytes / t / 1e9, gflops, t / t_copy, t_single / t);
  }
  std::printf("LoraMergeRows16, TinyLlama projection shapes, %d repeats\n", repeats);
  const int64_t shapes[][2] = {{2048, 2048}, {256, 2048}, {5632, 2048}, {2048, 5632}};
  for (const auto& shape : shapes) BenchRows16(shape[0], shape[1], r, repeats);
  return 0;
}
