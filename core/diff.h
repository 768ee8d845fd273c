// Tensor-by-tensor comparison of two checkpoints (`ferry diff`).
//
// Every tensor name of A and B is reported once, in sorted order. For a name present in
// both, with the same shape, values are compared element by element in C order:
//   - floating-point dtypes Ferry can read (F32, F16, BF16, F64, F8_E4M3, F8_E5M2) as
//     doubles, with tolerances (see DiffOptions);
//   - integer and BOOL dtypes exactly (as exact 64-bit integer values);
//   - any other dtype (C64, F8_E8M0, the FNUZ F8s, F4, F6) bytewise, element by element
//     (byte by byte for the sub-byte F4 and F6, whose counts and indexes are then in bytes).
// Tensors of equal dtype whose bytes are identical are reported kEqual without decoding.
// An element pair is "equal" when a == b (so -0 == +0 and inf == inf) or both are NaN:
// NaN equals NaN only at the same position. A pair is "within tolerance" when it is equal,
// or both values are finite and |a - b| <= atol + rtol * |b| (B is the reference, as in
// numpy.isclose), or max_ulp >= 0 and the ULP distance is <= max_ulp. A NaN against a
// non-NaN, or an infinity against anything but the same infinity, is never within
// tolerance.
//
// Tensors are read one at a time through zero-copy views and compared in chunks of
// DiffOptions::chunk_elements, so memory use is O(chunk), not O(model).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/checkpoint.h"
#include "core/dtype.h"
#include "core/status.h"
#include "core/tensor.h"

namespace ferry {

struct DiffOptions {
  // Absolute tolerance. Default: 0.
  double atol = 0;
  // Relative tolerance, relative to |b|. Default: 0.
  double rtol = 0;
  // Largest ULP distance accepted as within tolerance (an alternative to atol/rtol: an
  // element passes when either test passes). -1: not used. Default: -1.
  int64_t max_ulp = -1;
  // Compare the values of tensors whose dtypes differ (both floating point, or both
  // integer) instead of reporting kDTypeChanged. Default: false.
  bool ignore_dtype = false;
  // Elements compared per step; bounds the memory used. Must be > 0. Default: 65536.
  size_t chunk_elements = 65536;
  // Called after each tensor with the bytes of A and B it covered (for progress bars).
  // Default: none.
  std::function<void(uint64_t bytes)> on_progress;
};

enum class DiffStatus {
  kEqual,            // same dtype and shape, every element equal
  kWithinTolerance,  // some elements differ, all within tolerance
  kDifferent,        // some element is outside tolerance
  kDTypeChanged,     // dtypes differ (and ignore_dtype is off, or the kinds cannot be compared)
  kShapeChanged,     // shapes differ (checked before dtypes)
  kMissingInB,       // in A only
  kExtraInB,         // in B only
};

// "equal", "within_tolerance", "different", "dtype_changed", "shape_changed",
// "missing_in_b", "extra_in_b".
std::string_view DiffStatusName(DiffStatus status);

// How the values of a tensor were compared.
enum class CompareMode {
  kNone,   // not compared (missing, shape change, dtype change)
  kFloat,  // as floating-point values, with tolerances
  kExact,  // as integers, exactly
  kBytes,  // bytewise, element by element
};

// "none", "float", "exact", "bytes".
std::string_view CompareModeName(CompareMode mode);

struct TensorDiff {
  std::string name;
  DiffStatus status = DiffStatus::kEqual;
  // nullopt on the side where the tensor is absent.
  std::optional<DType> dtype_a;
  std::optional<DType> dtype_b;
  Shape shape_a;
  Shape shape_b;
  CompareMode compared = CompareMode::kNone;
  // Elements compared (0 when not compared).
  int64_t numel = 0;
  // Elements that are not equal (see the top of this file).
  int64_t mismatched = 0;
  // Elements outside tolerance (equal to `mismatched` for exact and bytewise comparisons).
  int64_t outside_tolerance = 0;
  // Largest |a - b| over pairs that are not NaN (infinity when an infinity meets a different
  // value). 0 for bytewise comparisons.
  double max_abs_diff = 0;
  // Largest ULP distance over pairs of finite values, in units of the coarser of the two
  // dtypes (fewer mantissa bits), computed on that dtype's bit patterns mapped to a
  // monotonic integer order (+0 and -0 are 0 apart). When the dtypes differ, the finer
  // value is first rounded to the coarser dtype (to nearest even). Saturates at INT64_MAX.
  // -1: not computed (integers, bytewise, or a coarser dtype Ferry cannot write, e.g. F8).
  int64_t max_ulp_diff = -1;
  // ||b - a||_2 / ||a||_2 over pairs of finite values; 0 when both norms are zero,
  // infinity when ||a|| is zero and ||b - a|| is not.
  double rel_norm = 0;
  // Flat C-order index of the largest |a - b| (the first such); if no non-NaN pair differs,
  // the first NaN mismatch; for bytewise comparisons the first mismatch. -1: none.
  int64_t max_diff_index = -1;
  // The values at max_diff_index (0 for bytewise comparisons or when there is none).
  double a_at_max = 0;
  double b_at_max = 0;
  // Positions where exactly one side is NaN.
  int64_t nan_mismatches = 0;
  // Positions where a side is infinite and the other is not the same infinity (NaN aside).
  int64_t inf_mismatches = 0;
  // Why values were not compared, when that is not evident from `status` ("" otherwise).
  std::string note;
};

struct DiffCounts {
  int64_t equal = 0;
  int64_t within_tolerance = 0;
  int64_t different = 0;
  int64_t dtype_changed = 0;
  int64_t shape_changed = 0;
  int64_t missing_in_b = 0;
  int64_t extra_in_b = 0;
};

struct DiffReport {
  // One entry per name in A or B, sorted by name.
  std::vector<TensorDiff> tensors;
  DiffCounts counts;
  // True when A and B have the same names, dtypes (unless ignored) and shapes and every
  // tensor is kEqual or kWithinTolerance.
  bool equal_within_tolerance = true;
};

// Compares every tensor of `a` with the tensor of the same name in `b`. Errors: kInvalidArgument
// for bad options (negative tolerances, chunk_elements == 0); a failure to read a tensor,
// with a message naming the checkpoint and tensor.
[[nodiscard]] Result<DiffReport> DiffCheckpoints(const Checkpoint& a, const Checkpoint& b, const DiffOptions& options);

// The multi-dimensional index of flat C-order index `flat` in `shape` (empty for scalars).
// REQUIRES: 0 <= flat < numel(shape).
std::vector<int64_t> UnravelIndex(int64_t flat, const Shape& shape);

}  // namespace ferry
