// Times the CPU rank-r merge (kernels/lora_merge.h) on a 4096x4096 fp32 W with r = 16 against
// a plain memcpy of W, the memory-bound floor: the merge reads and writes W once, as memcpy
// reads one buffer and writes another. Prints the ratio, for 1 and 2 threads.
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
  return 0;
}
