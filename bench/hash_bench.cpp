// Hashing throughput: the store's tensor digest vs raw XXH3-128 over the same buffer, in
// the same run.
//
//   (a) raw:    kernels::Xxh3_128 (XXH3_128bits, run-time AVX2 dispatch) over the buffer
//   (b) digest: store::TensorDigest (the streamed "ferry.tensor.v1" digest) over the same
//               bytes as a U8 tensor.
//   Target: digest / raw throughput >= 0.90 (PASS/FAIL, exit 0/1).
// For information it also prints the baseline (SSE2) and AVX2 copies separately, Debian's
// shared libxxhash, and the statistics pass the import runs beside the hash (F32, BF16).
// Buffers are warm (touched before timing); each figure is the best of --reps runs,
// interleaved (raw, digest, raw, digest, ...).
//
// Usage: ferry_bench_hash [--mb N] [--reps N]   (defaults: 512 MiB, 9 reps)
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "kernels/hash.h"
#include "store/internal.h"
#include "store/store.h"

namespace {

using ferry::bench::Seconds;

volatile uint64_t g_sink = 0;

}  // namespace

int main(int argc, char** argv) {
  size_t mb = 512;
  int reps = 9;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--mb" && i + 1 < argc) {
      mb = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--reps" && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--mb N] [--reps N]\n", argv[0]);
      return 2;
    }
  }
  const size_t n = mb << 20;
  std::vector<std::byte> buf(n);
  uint64_t x = 88172645463325252ull;
  for (size_t i = 0; i < n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(buf.data() + i, &x, std::min<size_t>(8, n - i));
  }
  auto tensor = ferry::Tensor::Wrap(ferry::DType::kU8, {static_cast<int64_t>(n)}, buf, nullptr);
  if (!tensor.ok()) {
    std::fprintf(stderr, "%s\n", tensor.status().ToString().c_str());
    return 2;
  }
  const double gb = static_cast<double>(n) / 1e9;
  double raw = 1e30, digest = 1e30, base = 1e30, avx2 = 1e30, shared = 1e30, f32 = 1e30, bf16 = 1e30;
  const bool has_avx2 = ferry::kernels::HashImplAvailable(ferry::kernels::HashImpl::kAvx2);
  for (int r = 0; r < reps; ++r) {
    raw = std::min(raw, Seconds([&] { g_sink = g_sink + ferry::kernels::Xxh3_128(buf.data(), n).lo; }));
    digest = std::min(digest, Seconds([&] { g_sink = g_sink + ferry::store::TensorDigest(*tensor).lo; }));
  }
  for (int r = 0; r < reps; ++r) {
    base = std::min(base, Seconds([&] {
                      g_sink = g_sink + ferry::kernels::Xxh3_128(buf.data(), n, ferry::kernels::HashImpl::kBaseline).lo;
                    }));
    if (has_avx2) {
      avx2 = std::min(avx2, Seconds([&] {
                        g_sink = g_sink + ferry::kernels::Xxh3_128(buf.data(), n, ferry::kernels::HashImpl::kAvx2).lo;
                      }));
    }
    shared = std::min(shared, Seconds([&] { g_sink = g_sink + XXH3_128bits(buf.data(), n).low64; }));
    f32 = std::min(f32, Seconds([&] {
                     ferry::store::internal::TensorStats s(ferry::DType::kF32);
                     s.Update(std::span<const std::byte>(buf.data(), n / 4 * 4));
                   }));
    bf16 = std::min(bf16, Seconds([&] {
                      ferry::store::internal::TensorStats s(ferry::DType::kBF16);
                      s.Update(std::span<const std::byte>(buf.data(), n / 2 * 2));
                    }));
  }
  const double ratio = raw / digest;  // throughput ratio digest / raw
  std::printf("buffer %zu MiB, best of %d, dispatch: %s\n", mb, reps,
              ferry::kernels::ResolvedHashImpl() == ferry::kernels::HashImpl::kAvx2 ? "avx2" : "baseline");
  std::printf("  raw XXH3_128bits (dispatched) %7.2f GB/s\n", gb / raw);
  std::printf("  TensorDigest                  %7.2f GB/s\n", gb / digest);
  std::printf("  baseline (SSE2) copy          %7.2f GB/s\n", gb / base);
  if (has_avx2) std::printf("  AVX2 copy                     %7.2f GB/s\n", gb / avx2);
  std::printf("  libxxhash.so XXH3_128bits     %7.2f GB/s\n", gb / shared);
  std::printf("  stats pass F32 / BF16         %7.2f / %.2f GB/s\n", gb / f32, gb / bf16);
  std::printf("digest/raw = %.3f (target >= 0.90): %s\n", ratio, ratio >= 0.90 ? "PASS" : "FAIL");
  return ratio >= 0.90 ? 0 : 1;
}
