// AVX2 copies of the statistics kernels in digest.cpp (this file is compiled with -mavx2;
// reached only after a run-time CPU check). Lane j of the accumulators sums the elements
// whose index is j mod 8, and the lanes are combined in the same order as the SSE2 path,
// so both give bit-identical results. No C++ library code here: anything inline it
// instantiated would be compiled with AVX2 and could be picked by the linker elsewhere.
#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace ferry::store::internal {

namespace {

inline void Step8(__m256i b, __m256d& acc_lo, __m256d& acc_hi, __m256i& nf, __m256i& nz) {
  const __m256i exp_mask = _mm256_set1_epi32(0x7f800000);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i is_nf = _mm256_cmpeq_epi32(_mm256_and_si256(b, exp_mask), exp_mask);
  nf = _mm256_sub_epi32(nf, is_nf);
  nz = _mm256_or_si256(nz, _mm256_and_si256(b, abs_mask));
  const __m256 x = _mm256_castsi256_ps(_mm256_andnot_si256(is_nf, b));
  const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
  const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
  acc_lo = _mm256_add_pd(acc_lo, _mm256_mul_pd(lo, lo));
  acc_hi = _mm256_add_pd(acc_hi, _mm256_mul_pd(hi, hi));
}

void Store(__m256d lo, __m256d hi, __m256i nf, __m256i nz, double* lanes, int32_t* nf_lanes, int32_t* nz_lanes) {
  _mm256_storeu_pd(lanes, lo);
  _mm256_storeu_pd(lanes + 4, hi);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(nf_lanes), nf);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(nz_lanes), nz);
}

}  // namespace

// Processes the first n - n % 8 elements of F32 data; writes 8 partial sums (lane j: the
// elements with index j mod 8) and 8 lane counters. Returns the number of elements done.
size_t StatsF32Avx2(const std::byte* p, size_t n, double* lanes, int32_t* nf_lanes, int32_t* nz_lanes) {
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  __m256i nf = _mm256_setzero_si256(), nz = _mm256_setzero_si256();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) Step8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 4 * i)), lo, hi, nf, nz);
  Store(lo, hi, nf, nz, lanes, nf_lanes, nz_lanes);
  return i;
}

// The same for BF16 data.
size_t StatsBF16Avx2(const std::byte* p, size_t n, double* lanes, int32_t* nf_lanes, int32_t* nz_lanes) {
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  __m256i nf = _mm256_setzero_si256(), nz = _mm256_setzero_si256();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i));
    const __m256i b = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
    Step8(b, lo, hi, nf, nz);
  }
  Store(lo, hi, nf, nz, lanes, nf_lanes, nz_lanes);
  return i;
}

}  // namespace ferry::store::internal
