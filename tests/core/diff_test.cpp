#include "core/diff.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "core/checkpoint.h"
#include "core/safetensors.h"
#include "kernels/cast.h"
#include "tests/temp_dir.h"

namespace ferry {
namespace {

namespace fs = std::filesystem;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInfF = std::numeric_limits<float>::infinity();

template <typename T>
Tensor Make(DType dtype, Shape shape, const std::vector<T>& values) {
  auto t = Tensor::Empty(dtype, std::move(shape));
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->nbytes(), values.size() * sizeof(T));
  std::memcpy(t->mutable_data(), values.data(), t->nbytes());
  return *t;
}

Tensor F32(Shape shape, const std::vector<float>& v) { return Make(DType::kF32, std::move(shape), v); }
Tensor BF16Bits(Shape shape, const std::vector<uint16_t>& v) { return Make(DType::kBF16, std::move(shape), v); }

Checkpoint Ckpt(const std::string& origin, std::map<std::string, Tensor> tensors) {
  return Checkpoint::FromTensors(origin, std::move(tensors));
}

DiffReport Diff(const Checkpoint& a, const Checkpoint& b, const DiffOptions& o = {}) {
  auto r = DiffCheckpoints(a, b, o);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? *r : DiffReport{};
}

const TensorDiff& Find(const DiffReport& r, const std::string& name) {
  for (const auto& d : r.tensors) {
    if (d.name == name) return d;
  }
  ADD_FAILURE() << "no entry for " << name;
  static TensorDiff none;
  return none;
}

class TempDir : public testing::ScopedTempDir {
 public:
  TempDir() : ScopedTempDir("ferry_diff_") {}
};

void WriteSafetensors(const fs::path& dir, const std::map<std::string, Tensor>& tensors, uint64_t max_shard_bytes) {
  std::vector<TensorSpec> specs;
  for (const auto& [name, t] : tensors) specs.push_back({name, t.dtype(), t.shape()});
  WriterOptions opts;
  opts.max_shard_bytes = max_shard_bytes;
  opts.sync = false;
  auto w = SafetensorsWriter::CreateInDirectory(dir, specs, opts);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  for (const auto& [name, t] : tensors) ASSERT_TRUE((*w)->Write(name, t).ok());
  ASSERT_TRUE((*w)->Finish().ok());
}

TEST(Diff, IdenticalFilesOnDiskAreEqualSingleVsSharded) {
  TempDir tmp;
  std::vector<float> big(1000);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(i) * 0.25f - 7.0f;
  std::map<std::string, Tensor> tensors = {
      {"a.weight", F32({10, 100}, big)},
      {"b.weight", BF16Bits({4}, {0x3f80, 0xbf80, 0x0000, 0x7fc0})},  // 1, -1, 0, NaN
      {"c.ids", Make<int64_t>(DType::kI64, {3}, {1, -2, int64_t{1} << 62})},
  };
  fs::create_directories(tmp.path() / "single");
  fs::create_directories(tmp.path() / "sharded");
  WriteSafetensors(tmp.path() / "single", tensors, 0);
  WriteSafetensors(tmp.path() / "sharded", tensors, 2000);  // 4000 bytes of F32 alone: >= 2 shards
  ASSERT_TRUE(fs::exists(tmp.path() / "sharded" / "model.safetensors.index.json"));

  auto a = Checkpoint::Open(tmp.path() / "single" / "model.safetensors");
  auto b = Checkpoint::Open(tmp.path() / "sharded");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  DiffReport r = Diff(*a, *b);
  EXPECT_TRUE(r.equal_within_tolerance);
  ASSERT_EQ(r.tensors.size(), 3u);
  EXPECT_EQ(r.counts.equal, 3);
  EXPECT_EQ(r.counts.different + r.counts.within_tolerance + r.counts.missing_in_b + r.counts.extra_in_b, 0);
  for (const auto& d : r.tensors) {
    EXPECT_EQ(d.status, DiffStatus::kEqual) << d.name;
    EXPECT_EQ(d.mismatched, 0) << d.name;
    EXPECT_EQ(d.rel_norm, 0.0) << d.name;
    EXPECT_EQ(d.max_diff_index, -1) << d.name;
  }
  EXPECT_EQ(Find(r, "a.weight").compared, CompareMode::kFloat);
  EXPECT_EQ(Find(r, "a.weight").max_ulp_diff, 0);
  EXPECT_EQ(Find(r, "c.ids").compared, CompareMode::kExact);
  EXPECT_EQ(Find(r, "c.ids").max_ulp_diff, -1);
}

TEST(Diff, OneBf16UlpIsWithinMaxUlpOneButNotZero) {
  // 1.0 = 0x3F80; one BF16 ulp above is 0x3F81 = 1 + 2^-7.
  std::vector<uint16_t> av = {0x3f80, 0x4000, 0xc040, 0x3e80, 0x0000, 0x3f80, 0x4120, 0x0001};
  std::vector<uint16_t> bv = av;
  bv[5] = 0x3f81;
  Checkpoint a = Ckpt("a", {{"w", BF16Bits({2, 4}, av)}});
  Checkpoint b = Ckpt("b", {{"w", BF16Bits({2, 4}, bv)}});

  DiffOptions ulp1;
  ulp1.max_ulp = 1;
  DiffReport r1 = Diff(a, b, ulp1);
  const TensorDiff& d = Find(r1, "w");
  EXPECT_EQ(d.status, DiffStatus::kWithinTolerance);
  EXPECT_TRUE(r1.equal_within_tolerance);
  EXPECT_EQ(d.max_ulp_diff, 1);
  EXPECT_EQ(d.max_abs_diff, 0.0078125);
  EXPECT_EQ(d.max_diff_index, 5);
  EXPECT_EQ(UnravelIndex(d.max_diff_index, d.shape_a), (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(d.a_at_max, 1.0);
  EXPECT_EQ(d.b_at_max, 1.0078125);
  EXPECT_EQ(d.mismatched, 1);
  EXPECT_EQ(d.outside_tolerance, 0);
  EXPECT_EQ(d.numel, 8);

  DiffOptions ulp0;
  ulp0.max_ulp = 0;
  DiffReport r0 = Diff(a, b, ulp0);
  EXPECT_EQ(Find(r0, "w").status, DiffStatus::kDifferent);
  EXPECT_EQ(Find(r0, "w").outside_tolerance, 1);
  EXPECT_FALSE(r0.equal_within_tolerance);
  EXPECT_EQ(r0.counts.different, 1);

  // The same element passes by atol exactly at the difference, not just below it.
  DiffOptions at;
  at.atol = 0.0078125;
  EXPECT_EQ(Find(Diff(a, b, at), "w").status, DiffStatus::kWithinTolerance);
  at.atol = 0.0078;
  EXPECT_EQ(Find(Diff(a, b, at), "w").status, DiffStatus::kDifferent);
}

TEST(Diff, UlpDistanceCountsAcrossZeroAndTreatsSignedZerosAsEqual) {
  // +0 vs -0: equal. Smallest positive vs smallest negative subnormal: 2 ulps apart.
  Checkpoint a = Ckpt("a", {{"z", BF16Bits({2}, {0x0000, 0x0001})}});
  Checkpoint b = Ckpt("b", {{"z", BF16Bits({2}, {0x8000, 0x8001})}});
  DiffOptions o;
  o.max_ulp = 2;
  const TensorDiff d = Find(Diff(a, b, o), "z");
  EXPECT_EQ(d.mismatched, 1);
  EXPECT_EQ(d.max_diff_index, 1);
  EXPECT_EQ(d.max_ulp_diff, 2);
  EXPECT_EQ(d.status, DiffStatus::kWithinTolerance);
  o.max_ulp = 1;
  EXPECT_EQ(Find(Diff(a, b, o), "z").status, DiffStatus::kDifferent);
}

TEST(Diff, RtolIsRelativeToB) {
  Checkpoint a = Ckpt("a", {{"w", F32({1}, {100.0f})}});
  Checkpoint b = Ckpt("b", {{"w", F32({1}, {101.0f})}});
  DiffOptions o;
  o.rtol = 0.01;  // 0.01 * 101 = 1.01 >= 1
  EXPECT_EQ(Find(Diff(a, b, o), "w").status, DiffStatus::kWithinTolerance);
  o.rtol = 0.0099;  // 0.0099 * 101 = 0.9999 < 1
  EXPECT_EQ(Find(Diff(a, b, o), "w").status, DiffStatus::kDifferent);
  // F32 ulp at 100 is 2^-17; 1.0 apart is 2^17 ulps.
  EXPECT_EQ(Find(Diff(a, b, o), "w").max_ulp_diff, 131072);
}

TEST(Diff, MissingAndExtraKeys) {
  Checkpoint a = Ckpt("a", {{"x", F32({1}, {1})}, {"y", F32({1}, {2})}});
  Checkpoint b = Ckpt("b", {{"y", F32({1}, {2})}, {"z", F32({2}, {3, 4})}});
  DiffReport r = Diff(a, b);
  ASSERT_EQ(r.tensors.size(), 3u);
  EXPECT_EQ(r.tensors[0].name, "x");
  EXPECT_EQ(r.tensors[0].status, DiffStatus::kMissingInB);
  EXPECT_EQ(r.tensors[0].dtype_a, DType::kF32);
  EXPECT_FALSE(r.tensors[0].dtype_b.has_value());
  EXPECT_EQ(r.tensors[1].status, DiffStatus::kEqual);
  EXPECT_EQ(r.tensors[2].name, "z");
  EXPECT_EQ(r.tensors[2].status, DiffStatus::kExtraInB);
  EXPECT_EQ(r.tensors[2].shape_b, (Shape{2}));
  EXPECT_FALSE(r.tensors[2].dtype_a.has_value());
  EXPECT_EQ(r.counts.missing_in_b, 1);
  EXPECT_EQ(r.counts.extra_in_b, 1);
  EXPECT_EQ(r.counts.equal, 1);
  EXPECT_FALSE(r.equal_within_tolerance);
}

TEST(Diff, DTypeChangeIsReportedUnlessIgnored) {
  // 1 + 3*2^-9 is not a BF16 value: it rounds up to 1 + 2^-7, one BF16 ulp above 1.
  const float x = 1.0f + 3.0f / 512.0f;
  Checkpoint a = Ckpt("a", {{"w", F32({3}, {0.5f, x, -2.0f})}});
  Checkpoint b = Ckpt("b", {{"w", BF16Bits({3}, {0x3f00, 0x3f80, 0xc000})}});  // 0.5, 1, -2
  DiffReport r = Diff(a, b);
  const TensorDiff& d = Find(r, "w");
  EXPECT_EQ(d.status, DiffStatus::kDTypeChanged);
  EXPECT_EQ(d.dtype_a, DType::kF32);
  EXPECT_EQ(d.dtype_b, DType::kBF16);
  EXPECT_EQ(d.compared, CompareMode::kNone);
  EXPECT_FALSE(r.equal_within_tolerance);
  EXPECT_EQ(r.counts.dtype_changed, 1);

  DiffOptions o;
  o.ignore_dtype = true;
  const TensorDiff di = Find(Diff(a, b, o), "w");
  EXPECT_EQ(di.compared, CompareMode::kFloat);
  EXPECT_EQ(di.status, DiffStatus::kDifferent);
  EXPECT_EQ(di.max_abs_diff, 3.0 / 512.0);
  EXPECT_EQ(di.max_ulp_diff, 1);  // in BF16 units, the coarser dtype
  EXPECT_EQ(di.max_diff_index, 1);
  o.max_ulp = 1;
  EXPECT_EQ(Find(Diff(a, b, o), "w").status, DiffStatus::kWithinTolerance);

  // Values exactly representable in both: equal once the dtype is ignored.
  Checkpoint c = Ckpt("c", {{"w", F32({3}, {0.5f, 1.0f, -2.0f})}});
  DiffOptions ignore;
  ignore.ignore_dtype = true;
  DiffReport rc = Diff(c, b, ignore);
  EXPECT_EQ(Find(rc, "w").status, DiffStatus::kEqual);
  EXPECT_TRUE(rc.equal_within_tolerance);
}

TEST(Diff, IgnoreDtypeDoesNotCompareIntegersWithFloats) {
  Checkpoint a = Ckpt("a", {{"w", Make<int32_t>(DType::kI32, {2}, {1, 2})}});
  Checkpoint b = Ckpt("b", {{"w", F32({2}, {1, 2})}});
  DiffOptions o;
  o.ignore_dtype = true;
  const TensorDiff d = Find(Diff(a, b, o), "w");
  EXPECT_EQ(d.status, DiffStatus::kDTypeChanged);
  EXPECT_NE(d.note.find("cannot compare I32 with F32"), std::string::npos) << d.note;
}

TEST(Diff, ShapeChange) {
  Checkpoint a = Ckpt("a", {{"w", F32({2, 3}, {1, 2, 3, 4, 5, 6})}});
  Checkpoint b = Ckpt("b", {{"w", Make<uint16_t>(DType::kBF16, {3, 2}, {0, 0, 0, 0, 0, 0})}});
  DiffReport r = Diff(a, b);
  const TensorDiff& d = Find(r, "w");
  EXPECT_EQ(d.status, DiffStatus::kShapeChanged);  // shape is checked before dtype
  EXPECT_EQ(d.shape_a, (Shape{2, 3}));
  EXPECT_EQ(d.shape_b, (Shape{3, 2}));
  EXPECT_EQ(r.counts.shape_changed, 1);
  EXPECT_FALSE(r.equal_within_tolerance);
}

TEST(Diff, RelNormMatchesHandComputedValue) {
  // a = [3, 4, 0, 12] (norm 13); b - a = [0, -4, 3, 0] (norm 5): rel_norm = 5/13.
  Checkpoint a = Ckpt("a", {{"w", F32({4}, {3, 4, 0, 12})}});
  Checkpoint b = Ckpt("b", {{"w", F32({4}, {3, 0, 3, 12})}});
  const TensorDiff d = Find(Diff(a, b), "w");
  EXPECT_DOUBLE_EQ(d.rel_norm, 5.0 / 13.0);
  EXPECT_EQ(d.max_abs_diff, 4.0);
  EXPECT_EQ(d.max_diff_index, 1);  // |4| beats |3|
  EXPECT_EQ(d.mismatched, 2);

  // Both zero: 0. A zero, B not: infinity.
  Checkpoint z = Ckpt("z", {{"w", F32({2}, {0, 0})}});
  Checkpoint nz = Ckpt("nz", {{"w", F32({2}, {0, 1e-30f})}});
  EXPECT_EQ(Find(Diff(z, z), "w").rel_norm, 0.0);
  EXPECT_TRUE(std::isinf(Find(Diff(z, nz), "w").rel_norm));
}

TEST(Diff, ChunkedComparisonGivesSameResultAsOneChunk) {
  std::vector<float> av(1001), bv(1001);
  for (size_t i = 0; i < av.size(); ++i) {
    av[i] = std::sin(static_cast<float>(i));
    bv[i] = av[i];
  }
  bv[7] += 0.5f;
  bv[500] -= 0.75f;  // the largest difference, in a later chunk
  bv[1000] += 0.25f;
  Checkpoint a = Ckpt("a", {{"w", F32({7, 11, 13}, av)}});
  Checkpoint b = Ckpt("b", {{"w", F32({7, 11, 13}, bv)}});
  DiffOptions small;
  small.chunk_elements = 3;
  const TensorDiff d1 = Find(Diff(a, b, small), "w");
  const TensorDiff d2 = Find(Diff(a, b), "w");
  EXPECT_EQ(d1.max_diff_index, 500);
  EXPECT_EQ(UnravelIndex(500, {7, 11, 13}), (std::vector<int64_t>{3, 5, 6}));  // 3*143 + 5*13 + 6
  EXPECT_EQ(d1.mismatched, 3);
  EXPECT_EQ(d1.max_abs_diff, d2.max_abs_diff);
  EXPECT_DOUBLE_EQ(d1.rel_norm, d2.rel_norm);
  EXPECT_EQ(d1.max_ulp_diff, d2.max_ulp_diff);
}

TEST(Diff, NaNEqualsNaNOnlyAtTheSamePosition) {
  Checkpoint a = Ckpt("a", {{"same", F32({3}, {kNaN, 1, 2})}, {"moved", F32({3}, {kNaN, 1, 2})}});
  Checkpoint b = Ckpt("b", {{"same", F32({3}, {kNaN, 1, 2})}, {"moved", F32({3}, {1, kNaN, 2})}});
  DiffOptions loose;
  loose.atol = 1e30;
  loose.max_ulp = 1000000;
  DiffReport r = Diff(a, b, loose);
  EXPECT_EQ(Find(r, "same").status, DiffStatus::kEqual);
  const TensorDiff& m = Find(r, "moved");
  EXPECT_EQ(m.status, DiffStatus::kDifferent);
  EXPECT_EQ(m.nan_mismatches, 2);
  EXPECT_EQ(m.mismatched, 2);
  EXPECT_EQ(m.max_diff_index, 0);  // no non-NaN pair differs: the first NaN mismatch
  EXPECT_TRUE(std::isnan(m.a_at_max));
  EXPECT_EQ(m.b_at_max, 1.0);
  EXPECT_FALSE(r.equal_within_tolerance);
}

TEST(Diff, InfinityOnlyMatchesTheSameInfinity) {
  Checkpoint a = Ckpt("a", {{"w", F32({3}, {kInfF, -kInfF, 5})}});
  Checkpoint b = Ckpt("b", {{"w", F32({3}, {kInfF, 3e38f, 5})}});
  DiffOptions o;
  o.rtol = 1.0;  // would accept anything finite within 2x: must not accept infinity
  const TensorDiff d = Find(Diff(a, b, o), "w");
  EXPECT_EQ(d.status, DiffStatus::kDifferent);
  EXPECT_EQ(d.inf_mismatches, 1);
  EXPECT_EQ(d.mismatched, 1);
  EXPECT_TRUE(std::isinf(d.max_abs_diff));
  EXPECT_EQ(d.max_diff_index, 1);
}

TEST(Diff, IntegersAreComparedExactly) {
  const int64_t big = int64_t{1} << 60;  // beyond double precision: big + 1 == big as doubles
  Checkpoint a = Ckpt("a", {{"ids", Make<int64_t>(DType::kI64, {3}, {big, -5, 7})},
                            {"mask", Make<uint8_t>(DType::kBool, {4}, {1, 0, 1, 1})}});
  Checkpoint b = Ckpt("b", {{"ids", Make<int64_t>(DType::kI64, {3}, {big + 1, -5, 7})},
                            {"mask", Make<uint8_t>(DType::kBool, {4}, {1, 0, 0, 1})}});
  DiffOptions o;
  o.atol = 100;  // tolerances do not apply to integers
  o.max_ulp = 100;
  DiffReport r = Diff(a, b, o);
  const TensorDiff& ids = Find(r, "ids");
  EXPECT_EQ(ids.status, DiffStatus::kDifferent);
  EXPECT_EQ(ids.compared, CompareMode::kExact);
  EXPECT_EQ(ids.mismatched, 1);
  EXPECT_EQ(ids.max_diff_index, 0);
  EXPECT_EQ(ids.max_abs_diff, 1.0);
  const TensorDiff& mask = Find(r, "mask");
  EXPECT_EQ(mask.status, DiffStatus::kDifferent);
  EXPECT_EQ(mask.max_diff_index, 2);
  EXPECT_EQ(r.counts.different, 2);

  // I32 vs I64 holding the same values: equal when the dtype is ignored.
  Checkpoint c = Ckpt("c", {{"ids", Make<int32_t>(DType::kI32, {2}, {-3, 2000000000})}});
  Checkpoint e = Ckpt("e", {{"ids", Make<int64_t>(DType::kI64, {2}, {-3, 2000000000})}});
  DiffOptions ignore;
  ignore.ignore_dtype = true;
  EXPECT_EQ(Find(Diff(c, e, ignore), "ids").status, DiffStatus::kEqual);
  EXPECT_EQ(Find(Diff(c, e), "ids").status, DiffStatus::kDTypeChanged);
}

TEST(Diff, OtherDtypesAreComparedBytewise) {
  Checkpoint a = Ckpt("a", {{"s", Make<uint8_t>(DType::kF8E8M0, {4}, {127, 128, 1, 2})}});
  Checkpoint b = Ckpt("b", {{"s", Make<uint8_t>(DType::kF8E8M0, {4}, {127, 128, 9, 2})}});
  const TensorDiff d = Find(Diff(a, b), "s");
  EXPECT_EQ(d.compared, CompareMode::kBytes);
  EXPECT_EQ(d.status, DiffStatus::kDifferent);
  EXPECT_EQ(d.mismatched, 1);
  EXPECT_EQ(d.max_diff_index, 2);
  EXPECT_EQ(Find(Diff(a, a), "s").status, DiffStatus::kEqual);
}

TEST(Diff, F64UlpDistance) {
  const double one = 1.0;
  const double next = std::nextafter(1.0, 2.0);
  Checkpoint a = Ckpt("a", {{"d", Make<double>(DType::kF64, {2}, {one, -one})}});
  Checkpoint b = Ckpt("b", {{"d", Make<double>(DType::kF64, {2}, {next, -one})}});
  DiffOptions o;
  o.max_ulp = 1;
  const TensorDiff d = Find(Diff(a, b, o), "d");
  EXPECT_EQ(d.max_ulp_diff, 1);
  EXPECT_EQ(d.max_abs_diff, next - one);
  EXPECT_EQ(d.status, DiffStatus::kWithinTolerance);
}

TEST(Diff, RejectsBadOptions) {
  Checkpoint a = Ckpt("a", {});
  DiffOptions o;
  o.atol = -1;
  auto r = DiffCheckpoints(a, a, o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("atol"), std::string::npos);
  DiffOptions nan_rtol;
  nan_rtol.rtol = std::nan("");
  EXPECT_EQ(DiffCheckpoints(a, a, nan_rtol).status().code(), StatusCode::kInvalidArgument);
  DiffOptions ulp;
  ulp.max_ulp = -2;
  auto ru = DiffCheckpoints(a, a, ulp);
  ASSERT_FALSE(ru.ok());
  EXPECT_NE(ru.status().message().find("max_ulp"), std::string::npos);
  DiffOptions chunk;
  chunk.chunk_elements = 0;
  EXPECT_EQ(DiffCheckpoints(a, a, chunk).status().code(), StatusCode::kInvalidArgument);
}

TEST(Diff, EmptyCheckpointsAreEqualAndProgressCoversEveryTensor) {
  DiffReport r = Diff(Ckpt("a", {}), Ckpt("b", {}));
  EXPECT_TRUE(r.tensors.empty());
  EXPECT_TRUE(r.equal_within_tolerance);

  Checkpoint a = Ckpt("a", {{"x", F32({2}, {1, 2})}, {"y", F32({1}, {1})}});
  Checkpoint b = Ckpt("b", {{"x", F32({2}, {1, 2})}});
  uint64_t seen = 0;
  int calls = 0;
  DiffOptions o;
  o.on_progress = [&](uint64_t bytes) {
    seen += bytes;
    ++calls;
  };
  Diff(a, b, o);
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(seen, 16u);  // x in A and B; y is only in A and is not read
}

}  // namespace
}  // namespace ferry
