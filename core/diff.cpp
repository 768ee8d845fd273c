#include "core/diff.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>

#include "core/text.h"
#include "kernels/cast.h"

namespace ferry {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

bool IsIntegerLike(DType d) {
  switch (d) {
    case DType::kBool:
    case DType::kU8:
    case DType::kI8:
    case DType::kI16:
    case DType::kU16:
    case DType::kI32:
    case DType::kU32:
    case DType::kI64:
    case DType::kU64: return true;
    default: return false;
  }
}

// Mantissa bits of the float formats values can be read from; decides which is coarser.
int MantissaBits(DType d) {
  switch (d) {
    case DType::kF64: return 52;
    case DType::kF32: return 23;
    case DType::kF16: return 10;
    case DType::kBF16: return 7;
    case DType::kF8E4M3: return 3;
    case DType::kF8E5M2: return 2;
    default: return 0;
  }
}

// Maps a sign-magnitude float bit pattern of `bits` bits to a monotonic integer order in
// which neighbouring representable values are 1 apart and +0 == -0.
int64_t OrderKey(uint64_t pattern, int bits) {
  const uint64_t sign = uint64_t{1} << (bits - 1);
  const int64_t mag = static_cast<int64_t>(pattern & (sign - 1));
  return (pattern & sign) != 0 ? -mag : mag;
}

// |ka - kb| without overflow, saturated to INT64_MAX.
uint64_t KeyDistance(int64_t ka, int64_t kb) {
  const uint64_t d = ka >= kb ? static_cast<uint64_t>(ka) - static_cast<uint64_t>(kb)
                              : static_cast<uint64_t>(kb) - static_cast<uint64_t>(ka);
  return std::min<uint64_t>(d, static_cast<uint64_t>(std::numeric_limits<int64_t>::max()));
}

uint64_t LoadBits(const std::byte* p, size_t esize) {
  switch (esize) {
    case 1: return static_cast<uint8_t>(*p);
    case 2: {
      uint16_t v;
      std::memcpy(&v, p, 2);
      return v;
    }  // little-endian host, as the format
    case 4: {
      uint32_t v;
      std::memcpy(&v, p, 4);
      return v;
    }
    default: {
      uint64_t v;
      std::memcpy(&v, p, 8);
      return v;
    }
  }
}

// Running statistics of one tensor comparison.
struct Acc {
  int64_t mismatched = 0;
  int64_t outside = 0;
  int64_t nan_mismatches = 0;
  int64_t inf_mismatches = 0;
  double max_abs = 0;
  int64_t max_idx = -1;
  double a_at = 0;
  double b_at = 0;
  int64_t first_nan = -1;
  double nan_a = 0;
  double nan_b = 0;
  uint64_t max_ulp = 0;
  long double ssq_a = 0;
  long double ssq_d = 0;

  void UpdateMax(double d, int64_t idx, double a, double b) {
    if (max_idx < 0 || d > max_abs) {
      max_abs = d;
      max_idx = idx;
      a_at = a;
      b_at = b;
    }
  }
};

// ULP order keys in the coarser dtype, computed on demand for the (rare) differing pairs.
class UlpKeys {
 public:
  UlpKeys(const Tensor& a, const Tensor& b) : a_(a), b_(b) {
    coarse_ = MantissaBits(a.dtype()) <= MantissaBits(b.dtype()) ? a.dtype() : b.dtype();
    enabled_ = a.dtype() == b.dtype() || coarse_ == DType::kF32 || coarse_ == DType::kBF16 || coarse_ == DType::kF16;
    bits_ = DTypeBits(coarse_);
  }
  bool enabled() const { return enabled_; }
  // REQUIRES: enabled(). `av`, `bv`: the decoded values at flat index `i`.
  uint64_t Distance(int64_t i, double av, double bv) const { return KeyDistance(Key(a_, i, av), Key(b_, i, bv)); }

 private:
  int64_t Key(const Tensor& t, int64_t i, double v) const {
    if (t.dtype() == coarse_) {
      const size_t esize = static_cast<size_t>(bits_ / 8);
      return OrderKey(LoadBits(t.data() + static_cast<size_t>(i) * esize, esize), bits_);
    }
    const float f = static_cast<float>(v);  // the finer value, rounded to nearest even
    switch (coarse_) {
      case DType::kF32: return OrderKey(kernels::F32Bits(f), bits_);
      case DType::kBF16: return OrderKey(kernels::F32ToBF16(f), bits_);
      case DType::kF16: return OrderKey(kernels::F32ToF16(f), bits_);
      default: return 0;
    }
  }

  const Tensor& a_;
  const Tensor& b_;
  DType coarse_ = DType::kF32;
  bool enabled_ = false;
  int bits_ = 32;
};

// Sum of squares of the finite values (4 partial sums to shorten the dependency chain).
// S is double for float inputs (each square is exact) and long double for double inputs.
template <typename T, typename S>
S SumSquaresFinite(const T* a, size_t n) {
  S s[4] = {0, 0, 0, 0};
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (size_t k = 0; k < 4; ++k) {
      const S x = a[i + k];
      s[k] += std::isfinite(a[i + k]) ? x * x : S{0};
    }
  }
  for (; i < n; ++i) {
    const S x = a[i];
    s[0] += std::isfinite(a[i]) ? x * x : S{0};
  }
  return (s[0] + s[1]) + (s[2] + s[3]);
}

// Compares n decoded values starting at flat index `base`.
template <typename T, typename S>
void CompareFloats(const T* a, const T* b, size_t n, int64_t base, const UlpKeys& keys, const DiffOptions& o, Acc& s) {
  S ssq_a = 0;
  for (size_t i = 0; i < n; ++i) {
    const T x = a[i];
    const T y = b[i];
    if (x == y) {
      if (std::isfinite(x)) ssq_a += static_cast<S>(x) * static_cast<S>(x);
      continue;
    }
    const bool xn = std::isnan(x);
    const bool yn = std::isnan(y);
    if (xn && yn) continue;
    ++s.mismatched;
    const int64_t idx = base + static_cast<int64_t>(i);
    if (xn || yn) {
      ++s.nan_mismatches;
      ++s.outside;
      if (s.first_nan < 0) {
        s.first_nan = idx;
        s.nan_a = x;
        s.nan_b = y;
      }
      continue;
    }
    if (std::isinf(x) || std::isinf(y)) {
      ++s.inf_mismatches;
      ++s.outside;
      s.UpdateMax(kInf, idx, x, y);
      continue;
    }
    const double xd = x;
    const double yd = y;
    const double d = std::fabs(xd - yd);
    ssq_a += static_cast<S>(x) * static_cast<S>(x);
    const long double ld = static_cast<long double>(xd) - static_cast<long double>(yd);
    s.ssq_d += ld * ld;
    s.UpdateMax(d, idx, xd, yd);
    bool ok = d <= o.atol + o.rtol * std::fabs(yd);
    if (keys.enabled()) {
      const uint64_t u = keys.Distance(idx, xd, yd);
      s.max_ulp = std::max(s.max_ulp, u);
      if (!ok && o.max_ulp >= 0 && u <= static_cast<uint64_t>(o.max_ulp)) ok = true;
    }
    if (!ok) ++s.outside;
  }
  s.ssq_a += ssq_a;
}

// An integer element: exact as (negative, magnitude).
struct IntValue {
  bool neg = false;
  uint64_t mag = 0;
  bool operator==(const IntValue&) const = default;
  long double AsLongDouble() const {
    const auto m = static_cast<long double>(mag);
    return neg ? -m : m;
  }
};

IntValue LoadInt(const std::byte* p, DType d) {
  auto load_signed = [](int64_t v) {
    return v < 0 ? IntValue{true, uint64_t{0} - static_cast<uint64_t>(v)} : IntValue{false, static_cast<uint64_t>(v)};
  };
  switch (d) {
    case DType::kBool:
    case DType::kU8: return {false, static_cast<uint8_t>(*p)};
    case DType::kI8: return load_signed(static_cast<int8_t>(*p));
    case DType::kU16: {
      uint16_t v;
      std::memcpy(&v, p, 2);
      return {false, v};
    }
    case DType::kI16: {
      int16_t v;
      std::memcpy(&v, p, 2);
      return load_signed(v);
    }
    case DType::kU32: {
      uint32_t v;
      std::memcpy(&v, p, 4);
      return {false, v};
    }
    case DType::kI32: {
      int32_t v;
      std::memcpy(&v, p, 4);
      return load_signed(v);
    }
    case DType::kU64: {
      uint64_t v;
      std::memcpy(&v, p, 8);
      return {false, v};
    }
    case DType::kI64: {
      int64_t v;
      std::memcpy(&v, p, 8);
      return load_signed(v);
    }
    default: return {};
  }
}

size_t ElementBytes(DType d) { return static_cast<size_t>(DTypeBits(d) / 8); }

std::span<const std::byte> ChunkBytes(const Tensor& t, int64_t start, size_t n) {
  const size_t esize = ElementBytes(t.dtype());
  return t.bytes().subspan(static_cast<size_t>(start) * esize, n * esize);
}

// Decodes elements [start, start + n) of a readable float tensor.
Status Decode(const Tensor& t, int64_t start, size_t n, float* out) {
  FERRY_ASSIGN_OR_RETURN(Tensor piece,
                         Tensor::Wrap(t.dtype(), {static_cast<int64_t>(n)}, ChunkBytes(t, start, n), nullptr));
  return ReadAsF32(piece, std::span<float>(out, n));
}

Status Decode(const Tensor& t, int64_t start, size_t n, double* out) {
  if (t.dtype() == DType::kF64) {
    std::memcpy(out, ChunkBytes(t, start, n).data(), n * 8);
    return Status::OK();
  }
  std::vector<float> tmp(n);
  FERRY_RETURN_IF_ERROR(Decode(t, start, n, tmp.data()));
  std::copy(tmp.begin(), tmp.end(), out);
  return Status::OK();
}

bool SameBytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && (a.nbytes() == 0 || std::memcmp(a.data(), b.data(), a.nbytes()) == 0);
}

// T: the decoded type (float unless a side is F64); S: the sum-of-squares type for T.
template <typename T, typename S>
Status CompareChunks(const Tensor& a, const Tensor& b, const DiffOptions& o, int64_t total, Acc& s) {
  const UlpKeys keys(a, b);
  const size_t chunk = o.chunk_elements;
  std::vector<T> va(chunk), vb(chunk);
  const bool same_dtype = a.dtype() == b.dtype();
  for (int64_t start = 0; start < total; start += static_cast<int64_t>(chunk)) {
    const size_t n = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(chunk), total - start));
    FERRY_RETURN_IF_ERROR(Decode(a, start, n, va.data()).WithContext("A"));
    if (same_dtype) {
      const auto ba = ChunkBytes(a, start, n);
      if (std::memcmp(ba.data(), ChunkBytes(b, start, n).data(), ba.size()) == 0) {
        s.ssq_a += SumSquaresFinite<T, S>(va.data(), n);
        continue;
      }
    }
    FERRY_RETURN_IF_ERROR(Decode(b, start, n, vb.data()).WithContext("B"));
    CompareFloats<T, S>(va.data(), vb.data(), n, start, keys, o, s);
  }
  return Status::OK();
}

Status CompareFloatTensor(const Tensor& a, const Tensor& b, const DiffOptions& o, TensorDiff& out) {
  out.compared = CompareMode::kFloat;
  const bool ulp_ok = UlpKeys(a, b).enabled();
  if (a.dtype() == b.dtype() && SameBytes(a, b)) {
    out.status = DiffStatus::kEqual;
    out.max_ulp_diff = 0;
    return Status::OK();
  }
  Acc s;
  if (a.dtype() == DType::kF64 || b.dtype() == DType::kF64) {
    FERRY_RETURN_IF_ERROR((CompareChunks<double, long double>(a, b, o, out.numel, s)));
  } else {
    FERRY_RETURN_IF_ERROR((CompareChunks<float, double>(a, b, o, out.numel, s)));
  }
  out.mismatched = s.mismatched;
  out.outside_tolerance = s.outside;
  out.nan_mismatches = s.nan_mismatches;
  out.inf_mismatches = s.inf_mismatches;
  out.max_abs_diff = s.max_abs;
  out.max_ulp_diff = ulp_ok ? static_cast<int64_t>(s.max_ulp) : -1;
  if (s.max_idx >= 0) {
    out.max_diff_index = s.max_idx;
    out.a_at_max = s.a_at;
    out.b_at_max = s.b_at;
  } else if (s.first_nan >= 0) {
    out.max_diff_index = s.first_nan;
    out.a_at_max = s.nan_a;
    out.b_at_max = s.nan_b;
  }
  if (s.ssq_a == 0) {
    out.rel_norm = s.ssq_d == 0 ? 0.0 : kInf;
  } else {
    out.rel_norm = static_cast<double>(std::sqrt(s.ssq_d) / std::sqrt(s.ssq_a));
  }
  out.status = s.mismatched == 0 ? DiffStatus::kEqual
               : s.outside == 0  ? DiffStatus::kWithinTolerance
                                 : DiffStatus::kDifferent;
  return Status::OK();
}

void CompareIntTensor(const Tensor& a, const Tensor& b, TensorDiff& out) {
  out.compared = CompareMode::kExact;
  if (a.dtype() == b.dtype() && SameBytes(a, b)) {
    out.status = DiffStatus::kEqual;
    return;
  }
  const size_t ea = ElementBytes(a.dtype());
  const size_t eb = ElementBytes(b.dtype());
  Acc s;
  for (int64_t i = 0; i < out.numel; ++i) {
    const IntValue x = LoadInt(a.data() + static_cast<size_t>(i) * ea, a.dtype());
    const IntValue y = LoadInt(b.data() + static_cast<size_t>(i) * eb, b.dtype());
    const long double lx = x.AsLongDouble();
    if (x == y) {
      s.ssq_a += lx * lx;
      continue;
    }
    ++s.mismatched;
    const long double d = lx - y.AsLongDouble();
    s.ssq_a += lx * lx;
    s.ssq_d += d * d;
    s.UpdateMax(static_cast<double>(d < 0 ? -d : d), i, static_cast<double>(lx), static_cast<double>(y.AsLongDouble()));
  }
  out.mismatched = s.mismatched;
  out.outside_tolerance = s.mismatched;
  out.max_abs_diff = s.max_abs;
  if (s.max_idx >= 0) {
    out.max_diff_index = s.max_idx;
    out.a_at_max = s.a_at;
    out.b_at_max = s.b_at;
  }
  if (s.ssq_a == 0) {
    out.rel_norm = s.ssq_d == 0 ? 0.0 : kInf;
  } else {
    out.rel_norm = static_cast<double>(std::sqrt(s.ssq_d) / std::sqrt(s.ssq_a));
  }
  out.status = s.mismatched == 0 ? DiffStatus::kEqual : DiffStatus::kDifferent;
}

void CompareBytesTensor(const Tensor& a, const Tensor& b, TensorDiff& out) {
  out.compared = CompareMode::kBytes;
  if (SameBytes(a, b)) {
    out.status = DiffStatus::kEqual;
    return;
  }
  const int bits = DTypeBits(a.dtype());
  const size_t esize = bits % 8 == 0 ? static_cast<size_t>(bits / 8) : 1;
  const size_t count = a.nbytes() / esize;
  for (size_t i = 0; i < count; ++i) {
    if (std::memcmp(a.data() + i * esize, b.data() + i * esize, esize) != 0) {
      if (out.max_diff_index < 0) out.max_diff_index = static_cast<int64_t>(i);
      ++out.mismatched;
    }
  }
  out.outside_tolerance = out.mismatched;
  out.status = DiffStatus::kDifferent;
}

Status CompareTensor(const Checkpoint& ca, const Checkpoint& cb, const DiffOptions& o, TensorDiff& out) {
  const std::string& name = out.name;
  const TensorInfo* ia = ca.Info(name);
  const TensorInfo* ib = cb.Info(name);
  out.dtype_a = ia->dtype;
  out.dtype_b = ib->dtype;
  out.shape_a = ia->shape;
  out.shape_b = ib->shape;
  if (ia->shape != ib->shape) {
    out.status = DiffStatus::kShapeChanged;
    return Status::OK();
  }
  const DType da = ia->dtype;
  const DType db = ib->dtype;
  const bool both_float = CanReadAsF32(da) && CanReadAsF32(db);
  const bool both_int = IsIntegerLike(da) && IsIntegerLike(db);
  if (da != db) {
    if (!o.ignore_dtype) {
      out.status = DiffStatus::kDTypeChanged;
      return Status::OK();
    }
    if (!both_float && !both_int) {
      out.status = DiffStatus::kDTypeChanged;
      out.note = "values not compared: cannot compare " + std::string(DTypeName(da)) + " with " +
                 std::string(DTypeName(db)) + " values";
      return Status::OK();
    }
  }
  auto ta = ca.Get(name);
  if (!ta.ok()) return ta.status();
  auto tb = cb.Get(name);
  if (!tb.ok()) return tb.status();
  FERRY_ASSIGN_OR_RETURN(out.numel, CheckedNumel(ia->shape));
  if (both_float) {
    Status st = CompareFloatTensor(*ta, *tb, o, out);
    if (!st.ok()) return st.WithContext(ca.path().string() + " vs " + cb.path().string() + ": tensor " + Quote(name));
  } else if (both_int) {
    CompareIntTensor(*ta, *tb, out);
  } else {
    CompareBytesTensor(*ta, *tb, out);
  }
  return Status::OK();
}

void Count(DiffStatus st, DiffCounts& c) {
  switch (st) {
    case DiffStatus::kEqual: ++c.equal; break;
    case DiffStatus::kWithinTolerance: ++c.within_tolerance; break;
    case DiffStatus::kDifferent: ++c.different; break;
    case DiffStatus::kDTypeChanged: ++c.dtype_changed; break;
    case DiffStatus::kShapeChanged: ++c.shape_changed; break;
    case DiffStatus::kMissingInB: ++c.missing_in_b; break;
    case DiffStatus::kExtraInB: ++c.extra_in_b; break;
  }
}

}  // namespace

std::string_view DiffStatusName(DiffStatus status) {
  switch (status) {
    case DiffStatus::kEqual: return "equal";
    case DiffStatus::kWithinTolerance: return "within_tolerance";
    case DiffStatus::kDifferent: return "different";
    case DiffStatus::kDTypeChanged: return "dtype_changed";
    case DiffStatus::kShapeChanged: return "shape_changed";
    case DiffStatus::kMissingInB: return "missing_in_b";
    case DiffStatus::kExtraInB: return "extra_in_b";
  }
  return "unknown";
}

std::string_view CompareModeName(CompareMode mode) {
  switch (mode) {
    case CompareMode::kNone: return "none";
    case CompareMode::kFloat: return "float";
    case CompareMode::kExact: return "exact";
    case CompareMode::kBytes: return "bytes";
  }
  return "unknown";
}

Result<DiffReport> DiffCheckpoints(const Checkpoint& a, const Checkpoint& b, const DiffOptions& options) {
  if (!(options.atol >= 0) || !(options.rtol >= 0)) {
    return Status::InvalidArgument("tolerances must be non-negative numbers (atol " + std::to_string(options.atol) +
                                   ", rtol " + std::to_string(options.rtol) + ")");
  }
  if (options.max_ulp < -1) {
    return Status::InvalidArgument("max_ulp must be >= 0, or -1 for unused (got " + std::to_string(options.max_ulp) +
                                   ")");
  }
  if (options.chunk_elements == 0) return Status::InvalidArgument("chunk_elements must be > 0");
  std::set<std::string> names(a.names().begin(), a.names().end());
  names.insert(b.names().begin(), b.names().end());
  DiffReport report;
  report.tensors.reserve(names.size());
  for (const std::string& name : names) {
    TensorDiff d;
    d.name = name;
    const TensorInfo* ia = a.Info(name);
    const TensorInfo* ib = b.Info(name);
    uint64_t covered = 0;
    if (ib == nullptr) {
      d.status = DiffStatus::kMissingInB;
      d.dtype_a = ia->dtype;
      d.shape_a = ia->shape;
    } else if (ia == nullptr) {
      d.status = DiffStatus::kExtraInB;
      d.dtype_b = ib->dtype;
      d.shape_b = ib->shape;
    } else {
      FERRY_RETURN_IF_ERROR(CompareTensor(a, b, options, d));
      covered = ia->nbytes() + ib->nbytes();
    }
    Count(d.status, report.counts);
    if (d.status != DiffStatus::kEqual && d.status != DiffStatus::kWithinTolerance) {
      report.equal_within_tolerance = false;
    }
    report.tensors.push_back(std::move(d));
    if (options.on_progress) options.on_progress(covered);
  }
  return report;
}

std::vector<int64_t> UnravelIndex(int64_t flat, const Shape& shape) {
  std::vector<int64_t> idx(shape.size(), 0);
  for (size_t k = shape.size(); k-- > 0;) {
    const int64_t dim = shape[k];
    if (dim <= 0) continue;
    idx[k] = flat % dim;
    flat /= dim;
  }
  return idx;
}

}  // namespace ferry
