// Digests (tensor, manifest), their hex form, per-tensor statistics and small encoders.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "kernels/cast.h"
#include "kernels/cpu_features.h"
#include "store/internal.h"

namespace ferry::store {
namespace internal {
// tensor_stats_avx2.cpp (compiled with -mavx2).
size_t StatsF32Avx2(const std::byte* p, size_t n, double* lanes, int32_t* nf_lanes, int32_t* nz_lanes);
size_t StatsBF16Avx2(const std::byte* p, size_t n, double* lanes, int32_t* nf_lanes, int32_t* nz_lanes);
}  // namespace internal

namespace {

using internal::StatsBF16Avx2;
using internal::StatsF32Avx2;

constexpr char kHexDigits[] = "0123456789abcdef";

void PutU32Le(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutU64Le(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutU64Be(std::string& out, uint64_t v) {
  for (int i = 7; i >= 0; --i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// dtype name || "\0" || u32le(ndim) || i64le dims: the part both digests share.
void PutTypeAndShape(std::string& out, DType dtype, const Shape& shape) {
  out.append(DTypeName(dtype));
  out.push_back('\0');
  PutU32Le(out, static_cast<uint32_t>(shape.size()));
  for (int64_t d : shape) PutU64Le(out, static_cast<uint64_t>(d));
}

Digest FromHash(kernels::Hash128 h) { return Digest{h.hi, h.lo}; }

// ---- statistics kernels -------------------------------------------------------------
// SSE2 (every x86-64) with a scalar fallback elsewhere. Both sum in the same fixed lane
// order, so results do not depend on the path taken. Squares of floats are exact in double.

struct Accum {
  double sum_squares = 0;
  int64_t nonfinite = 0;
  bool any_nonzero = false;
};

void AccumulateScalarF32Bits(uint32_t b, double& sum, int64_t& nf, bool& nz) {
  if ((b & 0x7f800000u) == 0x7f800000u) {
    ++nf;
  } else {
    const double x = kernels::F32FromBits(b);
    sum += x * x;
  }
  nz = nz || (b & 0x7fffffffu) != 0;
}

// Eight lanes of partial results: lane j holds the elements whose index is j mod 8.
struct Lanes8 {
  double sum[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int32_t nonfinite[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int32_t nonzero[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  void AddTo(double& s, int64_t& nf, bool& nz) const {
    s += ((sum[0] + sum[4]) + (sum[1] + sum[5])) + ((sum[2] + sum[6]) + (sum[3] + sum[7]));
    int32_t z = 0;
    for (int j = 0; j < 8; ++j) {
      nf += nonfinite[j];
      z |= nonzero[j];
    }
    nz = nz || z != 0;
  }
};

#if defined(__SSE2__)
// Four F32 lanes (as bits): counts NaN/Inf, ORs magnitudes, adds finite squares to acc_lo
// (lanes 0-1) and acc_hi (lanes 2-3).
inline void Step4(__m128i b, __m128d& acc_lo, __m128d& acc_hi, __m128i& nf, __m128i& nz) {
  const __m128i exp_mask = _mm_set1_epi32(0x7f800000);
  const __m128i abs_mask = _mm_set1_epi32(0x7fffffff);
  const __m128i is_nf = _mm_cmpeq_epi32(_mm_and_si128(b, exp_mask), exp_mask);
  nf = _mm_sub_epi32(nf, is_nf);
  nz = _mm_or_si128(nz, _mm_and_si128(b, abs_mask));
  const __m128 x = _mm_castsi128_ps(_mm_andnot_si128(is_nf, b));
  const __m128d lo = _mm_cvtps_pd(x);
  const __m128d hi = _mm_cvtps_pd(_mm_movehl_ps(x, x));
  acc_lo = _mm_add_pd(acc_lo, _mm_mul_pd(lo, lo));
  acc_hi = _mm_add_pd(acc_hi, _mm_mul_pd(hi, hi));
}

// The SSE2 loop over whole groups of 8; `widen` turns group g into two vectors of F32 bits.
template <typename Widen>
size_t LanesSse2(size_t n, Lanes8& out, Widen widen) {
  __m128d a0 = _mm_setzero_pd(), a1 = _mm_setzero_pd(), a2 = _mm_setzero_pd(), a3 = _mm_setzero_pd();
  __m128i nf0 = _mm_setzero_si128(), nz0 = _mm_setzero_si128(), nf1 = _mm_setzero_si128(), nz1 = _mm_setzero_si128();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i first, second;
    widen(i, first, second);
    Step4(first, a0, a1, nf0, nz0);
    Step4(second, a2, a3, nf1, nz1);
  }
  _mm_storeu_pd(out.sum, a0);
  _mm_storeu_pd(out.sum + 2, a1);
  _mm_storeu_pd(out.sum + 4, a2);
  _mm_storeu_pd(out.sum + 6, a3);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out.nonfinite), nf0);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out.nonfinite + 4), nf1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out.nonzero), nz0);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out.nonzero + 4), nz1);
  return i;
}
#endif

bool g_stats_avx2_allowed = true;  // tests turn it off to compare the two paths

bool StatsUseAvx2() { return g_stats_avx2_allowed && kernels::CpuHasAvx2(); }

// F32 (bf16 = false) or BF16 values, any alignment. REQUIRES: n < 2^31.
void AccumulateFloat(const std::byte* p, size_t n, bool bf16, Accum& a) {
  Lanes8 lanes;
  size_t i = 0;
#if defined(__x86_64__)
  if (StatsUseAvx2()) {
    i = bf16 ? StatsBF16Avx2(p, n, lanes.sum, lanes.nonfinite, lanes.nonzero)
             : StatsF32Avx2(p, n, lanes.sum, lanes.nonfinite, lanes.nonzero);
  } else
#endif
  {
#if defined(__SSE2__)
    if (bf16) {
      const __m128i zero = _mm_setzero_si128();
      i = LanesSse2(n, lanes, [&](size_t g, __m128i& x0, __m128i& x1) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * g));
        x0 = _mm_unpacklo_epi16(zero, h);
        x1 = _mm_unpackhi_epi16(zero, h);
      });
    } else {
      i = LanesSse2(n, lanes, [&](size_t g, __m128i& x0, __m128i& x1) {
        x0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4 * g));
        x1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4 * g + 16));
      });
    }
#endif
  }
  double sum = 0;
  int64_t nf = 0;
  bool nz = false;
  lanes.AddTo(sum, nf, nz);
  for (; i < n; ++i) {
    uint32_t b;
    if (bf16) {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      b = static_cast<uint32_t>(h) << 16;
    } else {
      std::memcpy(&b, p + 4 * i, 4);
    }
    AccumulateScalarF32Bits(b, sum, nf, nz);
  }
  a.sum_squares += sum;
  a.nonfinite += nf;
  a.any_nonzero = a.any_nonzero || nz;
}

void AccumulateF64(const std::byte* p, size_t n, Accum& a) {
  double s0 = 0, s1 = 0;
  for (size_t i = 0; i < n; ++i) {
    uint64_t b;
    std::memcpy(&b, p + 8 * i, 8);
    double x;
    std::memcpy(&x, &b, 8);
    if ((b & 0x7ff0000000000000ull) == 0x7ff0000000000000ull) {
      ++a.nonfinite;
    } else {
      ((i & 1) ? s1 : s0) += x * x;
    }
    a.any_nonzero = a.any_nonzero || (b & 0x7fffffffffffffffull) != 0;
  }
  a.sum_squares += s0 + s1;
}

}  // namespace

std::string Digest::Hex() const {
  std::string s(32, '0');
  for (int i = 0; i < 16; ++i) {
    s[i] = kHexDigits[(hi >> (60 - 4 * i)) & 0xf];
    s[16 + i] = kHexDigits[(lo >> (60 - 4 * i)) & 0xf];
  }
  return s;
}

std::string ShortId(const Digest& id) { return id.Hex().substr(0, 12); }

Result<Digest> Digest::FromHex(std::string_view hex) {
  if (hex.size() != 32) {
    return Status::InvalidArgument("digest '" + std::string(hex) + "': expected 32 hex characters, got " +
                                   std::to_string(hex.size()));
  }
  Digest d;
  for (size_t i = 0; i < 32; ++i) {
    char c = hex[i];
    uint64_t v;
    if (c >= '0' && c <= '9') {
      v = static_cast<uint64_t>(c - '0');
    } else if (c >= 'a' && c <= 'f') {
      v = static_cast<uint64_t>(c - 'a' + 10);
    } else if (c >= 'A' && c <= 'F') {
      v = static_cast<uint64_t>(c - 'A' + 10);
    } else {
      return Status::InvalidArgument("digest '" + std::string(hex) + "': '" + std::string(1, c) + "' at position " +
                                     std::to_string(i) + " is not a hex digit");
    }
    uint64_t& word = i < 16 ? d.hi : d.lo;
    word = (word << 4) | v;
  }
  return d;
}

Digest TensorDigest(const Tensor& t) { return TensorDigest(t.dtype(), t.shape(), t.bytes()); }

Digest TensorDigest(DType dtype, const Shape& shape, std::span<const std::byte> bytes) {
  internal::TensorDigester d(dtype, shape);
  d.Update(bytes);
  return d.Finish();
}

std::string_view KindName(VersionKind k) {
  switch (k) {
    case VersionKind::kBase: return "base";
    case VersionKind::kAdapter: return "adapter";
    case VersionKind::kMerged: return "merged";
    case VersionKind::kFull: return "full";
  }
  return "unknown";
}

std::string_view SourceName(VersionSource s) {
  switch (s) {
    case VersionSource::kConvert: return "convert";
    case VersionSource::kImport: return "import";
    case VersionSource::kDaemon: return "daemon";
    case VersionSource::kSync: return "sync";
  }
  return "unknown";
}

Result<VersionKind> ParseKind(std::string_view s) {
  for (VersionKind k : {VersionKind::kBase, VersionKind::kAdapter, VersionKind::kMerged, VersionKind::kFull}) {
    if (KindName(k) == s) return k;
  }
  return Status::InvalidArgument("version kind '" + std::string(s) + "': expected base, adapter, merged or full");
}

std::string_view EventTypeName(Event::Type t) {
  switch (t) {
    case Event::Type::kPublished: return "published";
    case Event::Type::kAcknowledged: return "acknowledged";
    case Event::Type::kActivated: return "activated";
    case Event::Type::kAnomaly: return "anomaly";
    case Event::Type::kCheckpoint: return "checkpoint";
    case Event::Type::kEngine: return "engine";
  }
  return "unknown";
}

namespace internal {

TensorStats::TensorStats(DType dtype) : dtype_(dtype) {
  switch (dtype) {
    case DType::kF32:
    case DType::kF64:
    case DType::kF16:
    case DType::kBF16:
    case DType::kF8E4M3:
    case DType::kF8E5M2: enabled_ = true; break;
    default: break;
  }
}

bool SetStatsAvx2ForTesting(bool allowed) {
  g_stats_avx2_allowed = allowed;
  return kernels::CpuHasAvx2();
}

void TensorStats::Update(std::span<const std::byte> bytes) {
  if (!enabled_) return;
  Accum a{sum_squares_, nonfinite_, any_nonzero_};
  constexpr size_t kBlock = 16384;  // elements per call: keeps lane counters small
  const size_t elem = static_cast<size_t>(DTypeBits(dtype_) / 8);
  const size_t n = bytes.size() / elem;
  const std::byte* p = bytes.data();
  for (size_t i = 0; i < n; i += kBlock) {
    const size_t m = std::min(kBlock, n - i);
    const std::byte* q = p + i * elem;
    switch (dtype_) {
      case DType::kF32: AccumulateFloat(q, m, /*bf16=*/false, a); break;
      case DType::kBF16: AccumulateFloat(q, m, /*bf16=*/true, a); break;
      case DType::kF64: AccumulateF64(q, m, a); break;
      default: {
        scratch_.resize(m);
        if (dtype_ == DType::kF16) {
          halves_.resize(m);
          std::memcpy(halves_.data(), q, m * 2);
          kernels::CastF16ToF32(halves_.data(), scratch_.data(), m);
        } else if (dtype_ == DType::kF8E4M3) {
          kernels::CastF8E4M3ToF32(reinterpret_cast<const uint8_t*>(q), scratch_.data(), m);
        } else {
          kernels::CastF8E5M2ToF32(reinterpret_cast<const uint8_t*>(q), scratch_.data(), m);
        }
        AccumulateFloat(reinterpret_cast<const std::byte*>(scratch_.data()), m, /*bf16=*/false, a);
        break;
      }
    }
  }
  sum_squares_ = a.sum_squares;
  nonfinite_ = a.nonfinite;
  any_nonzero_ = a.any_nonzero;
}

void TensorStats::Finish(TensorRow& row) const {
  row.l2_norm = enabled_ ? std::sqrt(sum_squares_) : 0;
  row.nonfinite = enabled_ ? nonfinite_ : 0;
  row.all_zero = enabled_ && !any_nonzero_;
}

std::string DigestKey(const Digest& d) {
  std::string k;
  k.reserve(16);
  PutU64Be(k, d.hi);
  PutU64Be(k, d.lo);
  return k;
}

Result<Digest> DigestFromKey(std::string_view key) {
  if (key.size() < 16) return Status::Corruption("digest key of " + std::to_string(key.size()) + " bytes");
  return Digest{ReadU64Be(key.substr(0, 8)), ReadU64Be(key.substr(8, 8))};
}

Digest HashBytes(std::span<const std::byte> bytes) { return FromHash(kernels::Xxh3_128(bytes.data(), bytes.size())); }

Digest HashString(std::string_view s) { return FromHash(kernels::Xxh3_128(s.data(), s.size())); }

std::string U64Be(uint64_t v) {
  std::string s;
  PutU64Be(s, v);
  return s;
}

uint64_t ReadU64Be(std::string_view bytes) {
  uint64_t v = 0;
  for (size_t i = 0; i < 8; ++i) v = (v << 8) | static_cast<uint8_t>(bytes[i]);
  return v;
}

std::string U64Le(uint64_t v) {
  std::string s;
  PutU64Le(s, v);
  return s;
}

std::string FileObjectRow(uint64_t size) { return U64Le(size); }

std::string SmallObjectRow(std::span<const std::byte> bytes) {
  std::string row = U64Le(bytes.size());
  row.append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  return row;
}

Result<std::string_view> SmallObjectBytes(std::string_view row, uint64_t nbytes) {
  uint64_t size = 0;
  if (row.size() >= 8) {
    for (int i = 7; i >= 0; --i) size = (size << 8) | static_cast<unsigned char>(row[static_cast<size_t>(i)]);
  }
  if (row.size() < 8 || size != nbytes || (row.size() != 8 && row.size() - 8 != nbytes)) {
    return Status::Corruption("its \"objects\" row has " + std::to_string(row.size()) + " bytes for a tensor of " +
                              std::to_string(nbytes) + " (expected 8, or 8 + " + std::to_string(nbytes) + ")");
  }
  return row.substr(8);
}

Status CheckSmallObject(const TensorRow& row, std::string_view bytes) {
  TensorDigester digester(row.dtype, row.shape);
  digester.Update(std::as_bytes(std::span<const char>(bytes.data(), bytes.size())));
  if (const Digest got = digester.Finish(); got != row.digest) {
    return Status::Corruption("its small object hashes to " + got.Hex() + ", expected " + row.digest.Hex());
  }
  return Status::OK();
}

std::string RunKey(const std::string& run, uint64_t sequence) {
  std::string k = run;
  k.push_back('\0');
  PutU64Be(k, sequence);
  return k;
}

std::string TensorKey(const Digest& version, const std::string& name) { return DigestKey(version) + name; }

std::string EventKey(int64_t time_ns, uint64_t counter) {
  std::string k;
  PutU64Be(k, static_cast<uint64_t>(time_ns));
  PutU64Be(k, counter);
  return k;
}

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace internal

TensorDigester::TensorDigester(DType dtype, const Shape& shape) {
  std::string head("ferry.tensor.v1", 16);  // including the terminating NUL
  PutTypeAndShape(head, dtype, shape);
  hash_.Update(head.data(), head.size());
}

Digest TensorDigester::Finish() const { return FromHash(hash_.Digest()); }

Digest AuxDigest(std::string_view contents) { return internal::HashString(contents); }

std::vector<AuxFile> AuxFileRows(const AuxFiles& aux) {
  std::vector<AuxFile> rows;
  rows.reserve(aux.size());
  for (const auto& [name, contents] : aux) rows.push_back(AuxFile{name, AuxDigest(contents), contents.size()});
  return rows;
}

Digest ManifestDigest(const std::vector<TensorRow>& tensors, const std::vector<AuxFile>& aux) {
  kernels::Xxh3_128Stream h;
  std::string buf("ferry.manifest.v1", 18);  // including the terminating NUL
  for (const TensorRow& t : tensors) {
    buf.append(t.name);
    buf.push_back('\0');
    PutTypeAndShape(buf, t.dtype, t.shape);
    buf.append(internal::DigestKey(t.digest));
    if (buf.size() > 60000) {
      h.Update(buf.data(), buf.size());
      buf.clear();
    }
  }
  buf.append("ferry.aux.v1", 13);  // including the terminating NUL
  for (const AuxFile& a : aux) {
    buf.append(a.name);
    buf.push_back('\0');
    buf.append(internal::DigestKey(a.digest));
  }
  h.Update(buf.data(), buf.size());
  return FromHash(h.Digest());
}

}  // namespace ferry::store
