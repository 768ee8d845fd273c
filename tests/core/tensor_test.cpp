#include "core/tensor.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/cast.h"

namespace ferry {
namespace {

TEST(Tensor, CheckedNumelAndByteSize) {
  EXPECT_EQ(*CheckedNumel({}), 1);
  EXPECT_EQ(*CheckedNumel({2, 3, 4}), 24);
  EXPECT_EQ(*CheckedNumel({5, 0, 7}), 0);
  auto overflow = CheckedNumel({std::numeric_limits<int64_t>::max(), 2});
  ASSERT_FALSE(overflow.ok());
  EXPECT_EQ(overflow.status().code(), StatusCode::kCorruption);
  EXPECT_NE(overflow.status().message().find("overflows"), std::string::npos);
  auto negative = CheckedNumel({3, -1});
  ASSERT_FALSE(negative.ok());
  EXPECT_NE(negative.status().message().find("negative dimension -1"), std::string::npos);

  EXPECT_EQ(*CheckedByteSize(DType::kBF16, {3, 5}), 30u);
  EXPECT_EQ(*CheckedByteSize(DType::kF4, {2, 3}), 3u);
  auto odd_f4 = CheckedByteSize(DType::kF4, {3});
  ASSERT_FALSE(odd_f4.ok());
  EXPECT_NE(odd_f4.status().message().find("byte boundary"), std::string::npos);
  // 2^62 elements of F64: 2^65 bytes overflows uint64.
  auto big = CheckedByteSize(DType::kF64, {int64_t{1} << 31, int64_t{1} << 31});
  ASSERT_FALSE(big.ok());
  EXPECT_NE(big.status().message().find("byte count"), std::string::npos);
}

TEST(Tensor, WrapChecksSizeAndKeepsOwnerAlive) {
  auto buf = std::make_shared<std::vector<float>>(std::vector<float>{1, 2, 3, 4, 5, 6});
  std::weak_ptr<std::vector<float>> weak = buf;
  std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(buf->data()), 24);
  auto bad = Tensor::Wrap(DType::kF32, {2, 2}, bytes, buf);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("needs 16 bytes, got 24"), std::string::npos);

  auto t = Tensor::Wrap(DType::kF32, {2, 3}, bytes, buf);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  buf.reset();
  ASSERT_FALSE(weak.expired());  // the tensor keeps the storage alive, no copy made
  EXPECT_EQ(t->data_as<float>()[5], 6.0f);
  EXPECT_EQ(t->mutable_data(), nullptr);  // wrapped memory is read-only
  Tensor copy = *t;
  t = Status::Internal("drop");  // NOLINT: release the first handle
  EXPECT_FALSE(weak.expired());
  copy = Tensor();
  EXPECT_TRUE(weak.expired());
}

TEST(Tensor, EmptyIsZeroedAligned) {
  auto t = Tensor::Empty(DType::kBF16, {3, 7});
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->nbytes(), 42u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t->data()) % 64, 0u);
  for (size_t i = 0; i < t->nbytes(); ++i) ASSERT_EQ(t->data()[i], std::byte{0});
  ASSERT_NE(t->mutable_data(), nullptr);
}

TEST(Tensor, CastTensorRoundsToNearestEven) {
  auto src = Tensor::Empty(DType::kF32, {4});
  float vals[4] = {1.0f, 1.0f + std::ldexp(1.0f, -8), 1.0f + 3 * std::ldexp(1.0f, -8), -2.5f};
  std::memcpy(src->mutable_data(), vals, sizeof vals);
  auto bf = CastTensor(*src, DType::kBF16);
  ASSERT_TRUE(bf.ok());
  const uint16_t* b = bf->data_as<uint16_t>();
  EXPECT_EQ(b[0], 0x3F80);
  EXPECT_EQ(b[1], 0x3F80);  // tie -> even
  EXPECT_EQ(b[2], 0x3F82);  // tie -> even
  EXPECT_EQ(b[3], kernels::F32ToBF16(-2.5f));
  auto back = CastTensor(*bf, DType::kF64);
  ASSERT_TRUE(back.ok());
  double d[4];
  std::memcpy(d, back->data(), sizeof d);
  EXPECT_EQ(d[0], 1.0);
  EXPECT_EQ(d[2], 1.0 + std::ldexp(1.0, -6));
  EXPECT_EQ(d[3], -2.5);

  auto ints = Tensor::Empty(DType::kI32, {2});
  auto refused = CastTensor(*ints, DType::kF32);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(refused.status().message().find("I32"), std::string::npos);
  auto no_write = CastTensor(*src, DType::kF8E4M3);
  ASSERT_FALSE(no_write.ok());
  EXPECT_EQ(no_write.status().code(), StatusCode::kUnsupported);
}

TEST(Status, ContextAndMacros) {
  Status s = Status::NotFound("x.safetensors: no tensor 'w'").WithContext("convert");
  EXPECT_EQ(s.ToString(), "not_found: convert: x.safetensors: no tensor 'w'");
  EXPECT_TRUE(Status::OK().WithContext("ignored").ok());
  auto f = []() -> Result<int> {
    FERRY_ASSIGN_OR_RETURN(int64_t n, CheckedNumel({2, -3}));
    return static_cast<int>(n);
  };
  EXPECT_EQ(f().status().code(), StatusCode::kCorruption);
  Result<int> from_ok = Status::OK();
  EXPECT_EQ(from_ok.status().code(), StatusCode::kInternal);
}

TEST(Status, UnavailableHasItsOwnCodeAndName) {
  Status s = Status::Unavailable("no reply from ipc:///tmp/s/requests within 10 ms");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_NE(s.code(), StatusCode::kIOError);
  EXPECT_EQ(StatusCodeName(StatusCode::kUnavailable), "unavailable");
  EXPECT_EQ(s.WithContext("sync").ToString(), "unavailable: sync: no reply from ipc:///tmp/s/requests within 10 ms");
  // Appended: the codes before it keep the values they have on the wire (sync ERROR frames).
  EXPECT_EQ(static_cast<int>(StatusCode::kInternal), 8);
  EXPECT_EQ(static_cast<int>(StatusCode::kUnavailable), 9);
}

}  // namespace
}  // namespace ferry
