// Digest definitions (store.h) checked against digests computed here independently, with
// the system libxxhash over bytes laid out by hand; the XXH3 kernel's two compiled copies.
#include <xxhash.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include <gtest/gtest.h>

#include "kernels/cast.h"
#include "kernels/hash.h"
#include "store/internal.h"
#include "store/store.h"
#include "tests/store/test_util.h"

namespace ferry::store {
namespace {

using testing::F32;
using testing::TempDir;

void AppendU32Le(std::string& s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>(v >> (8 * i)));
}
void AppendI64Le(std::string& s, int64_t v) {
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>(static_cast<uint64_t>(v) >> (8 * i)));
}
void AppendHashBe(std::string& s, XXH128_hash_t h) {
  for (int i = 7; i >= 0; --i) s.push_back(static_cast<char>(h.high64 >> (8 * i)));
  for (int i = 7; i >= 0; --i) s.push_back(static_cast<char>(h.low64 >> (8 * i)));
}
XXH128_hash_t Ref(const std::string& bytes) { return XXH3_128bits(bytes.data(), bytes.size()); }
std::string RefHex(XXH128_hash_t h) {
  char buf[33];
  std::snprintf(buf, sizeof(buf), "%016llx%016llx", static_cast<unsigned long long>(h.high64),
                static_cast<unsigned long long>(h.low64));
  return buf;
}

// ---- kernels/hash ------------------------------------------------------------------------

TEST(Xxh3Kernel, BothCopiesMatchLibxxhashForEveryLengthClassAndChunking) {
  std::mt19937 rng(42);
  std::vector<unsigned char> data(3 * 1024 * 1024 + 77);
  for (auto& b : data) b = static_cast<unsigned char>(rng());
  std::vector<kernels::HashImpl> impls = {kernels::HashImpl::kBaseline, kernels::HashImpl::kAuto};
  if (kernels::HashImplAvailable(kernels::HashImpl::kAvx2)) impls.push_back(kernels::HashImpl::kAvx2);
  for (size_t len : {size_t{0}, size_t{1}, size_t{3}, size_t{16}, size_t{17}, size_t{128}, size_t{129}, size_t{240},
                     size_t{241}, size_t{1023}, size_t{1024}, size_t{65537}, data.size()}) {
    XXH128_hash_t want = XXH3_128bits(data.data(), len);
    for (auto impl : impls) {
      kernels::Hash128 one = kernels::Xxh3_128(data.data(), len, impl);
      EXPECT_EQ(one.hi, want.high64) << "len " << len << " impl " << static_cast<int>(impl);
      EXPECT_EQ(one.lo, want.low64) << "len " << len << " impl " << static_cast<int>(impl);
      kernels::Xxh3_128Stream s(impl);
      size_t off = 0;
      while (off < len) {
        size_t n = std::min(len - off, static_cast<size_t>(rng() % 5000 + 1));
        s.Update(data.data() + off, n);
        off += n;
      }
      kernels::Hash128 streamed = s.Digest();
      EXPECT_EQ(streamed.hi, want.high64) << "streamed len " << len;
      EXPECT_EQ(streamed.lo, want.low64) << "streamed len " << len;
    }
  }
}

TEST(Xxh3Kernel, ResetStartsOverAndMovedStreamKeepsState) {
  const char text[] = "hello, ferry";
  kernels::Xxh3_128Stream a;
  a.Update("garbage", 7);
  a.Reset();
  a.Update(text, 5);
  kernels::Xxh3_128Stream b(std::move(a));
  b.Update(text + 5, sizeof(text) - 1 - 5);
  XXH128_hash_t want = XXH3_128bits(text, sizeof(text) - 1);
  EXPECT_EQ(b.Digest().hi, want.high64);
  EXPECT_EQ(b.Digest().lo, want.low64);
}

// ---- Digest text -------------------------------------------------------------------------

TEST(DigestHex, RoundTripsAndRejectsBadText) {
  Digest d{0x0123456789abcdefull, 0xfedcba9876543210ull};
  EXPECT_EQ(d.Hex(), "0123456789abcdeffedcba9876543210");
  auto back = Digest::FromHex("0123456789ABCDEFfedcba9876543210");
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, d);
  auto short_hex = Digest::FromHex("abc");
  EXPECT_EQ(short_hex.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(short_hex.status().message().find("'abc'"), std::string::npos) << short_hex.status().message();
  auto bad = Digest::FromHex("0123456789abcdefXedcba9876543210");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("position 16"), std::string::npos) << bad.status().message();
}

// ---- Tensor digest -------------------------------------------------------------------------

TEST(TensorDigest, EqualsHandBuiltBytesHashedByLibxxhash) {
  Tensor t = F32({2, 3}, {1, 2, 3, 4, 5, -6.5f});
  std::string bytes("ferry.tensor.v1\0", 16);
  bytes += "F32";
  bytes.push_back('\0');
  AppendU32Le(bytes, 2);
  AppendI64Le(bytes, 2);
  AppendI64Le(bytes, 3);
  const float vals[] = {1, 2, 3, 4, 5, -6.5f};
  bytes.append(reinterpret_cast<const char*>(vals), sizeof(vals));
  XXH128_hash_t want = Ref(bytes);
  Digest got = TensorDigest(t);
  EXPECT_EQ(got.hi, want.high64);
  EXPECT_EQ(got.lo, want.low64);
  EXPECT_EQ(got.Hex(), RefHex(want));
  EXPECT_EQ(TensorDigest(t.dtype(), t.shape(), t.bytes()), got);
}

TEST(TensorDigest, ScalarHasZeroDims) {
  Tensor t = F32({}, {7});
  std::string bytes("ferry.tensor.v1\0", 16);
  bytes += std::string("F32\0", 4);
  AppendU32Le(bytes, 0);
  const float v = 7;
  bytes.append(reinterpret_cast<const char*>(&v), 4);
  EXPECT_EQ(TensorDigest(t).Hex(), RefHex(Ref(bytes)));
}

TEST(TensorDigest, BindsDtypeAndShape) {
  Tensor t = F32({2, 3}, {1, 2, 3, 4, 5, 6});
  Digest base = TensorDigest(t);
  EXPECT_NE(TensorDigest(DType::kI32, {2, 3}, t.bytes()), base);  // same bytes, other dtype
  EXPECT_NE(TensorDigest(DType::kF32, {3, 2}, t.bytes()), base);  // same bytes, other shape
  EXPECT_NE(TensorDigest(DType::kF32, {6}, t.bytes()), base);
  EXPECT_NE(TensorDigest(DType::kF32, {1, 2, 3}, t.bytes()), base);
  EXPECT_NE(TensorDigest(DType::kU8, {24}, t.bytes()), base);
  EXPECT_EQ(TensorDigest(DType::kF32, {2, 3}, t.bytes()), base);
}

// ---- Manifest digest -----------------------------------------------------------------------

TEST(ManifestDigest, EqualsHandBuiltManifestAndIgnoresOrder) {
  TempDir tmp;
  Tensor a = F32({2}, {1, 2});
  Tensor b = F32({1, 1}, {3});
  const std::string config = "{\"model_type\": \"llama\"}";
  const std::string tok = "{\"x\": 1}";
  testing::WriteModel(tmp / "m1", {{"a", a}, {"b", b}}, {{"config.json", config}, {"tokenizer.json", tok}},
                      "model.safetensors", {"b", "a"});  // declared in the other order
  testing::WriteModel(tmp / "m2", {{"a", a}, {"b", b}}, {{"tokenizer.json", tok}, {"config.json", config}});

  std::string m("ferry.manifest.v1\0", 18);
  for (auto& [name, t] : std::vector<std::pair<std::string, Tensor>>{{"a", a}, {"b", b}}) {
    m += name;
    m.push_back('\0');
    m += std::string("F32\0", 4);
    AppendU32Le(m, static_cast<uint32_t>(t.shape().size()));
    for (int64_t d : t.shape()) AppendI64Le(m, d);
    std::string tb("ferry.tensor.v1\0", 16);
    tb += std::string("F32\0", 4);
    AppendU32Le(tb, static_cast<uint32_t>(t.shape().size()));
    for (int64_t d : t.shape()) AppendI64Le(tb, d);
    tb.append(reinterpret_cast<const char*>(t.data()), t.nbytes());
    AppendHashBe(m, Ref(tb));
  }
  m += std::string("ferry.aux.v1\0", 13);
  m += std::string("config.json\0", 12);
  AppendHashBe(m, Ref(config));
  m += std::string("tokenizer.json\0", 15);
  AppendHashBe(m, Ref(tok));

  auto r1 = HashPath(tmp / "m1");
  auto r2 = HashPath(tmp / "m2");
  ASSERT_TRUE(r1.ok()) << r1.status().ToString();
  ASSERT_TRUE(r2.ok()) << r2.status().ToString();
  EXPECT_EQ(r1->id.Hex(), RefHex(Ref(m)));
  EXPECT_EQ(r2->id, r1->id);
  ASSERT_EQ(r1->aux.size(), 2u);
  EXPECT_EQ(r1->aux[0].name, "config.json");
  EXPECT_EQ(r1->aux[0].size, config.size());
  EXPECT_EQ(r1->aux[0].digest.Hex(), RefHex(Ref(config)));
  EXPECT_EQ(r1->total_bytes, 12u);

  // Aux order given to the hashing pass does not matter either.
  auto ckpt = Checkpoint::FromTensors("mem", {{"a", a}, {"b", b}});
  auto h1 = internal::HashCheckpoint(ckpt, {{"config.json", config}, {"tokenizer.json", tok}}, internal::HashOptions{});
  auto h2 = internal::HashCheckpoint(ckpt, {{"tokenizer.json", tok}, {"config.json", config}}, internal::HashOptions{});
  ASSERT_TRUE(h1.ok() && h2.ok());
  EXPECT_EQ(h1->id, r1->id);
  EXPECT_EQ(h2->id, r1->id);
}

TEST(ManifestDigest, ChangesWithAnyAuxFileChange) {
  auto ckpt = Checkpoint::FromTensors("mem", {{"w", F32({1}, {1})}});
  auto id = [&](AuxFiles aux) {
    auto r = internal::HashCheckpoint(ckpt, aux, internal::HashOptions{});
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r->id;
  };
  Digest base = id({{"config.json", "{}"}});
  EXPECT_NE(id({{"config.json", "{} "}}), base);                     // contents
  EXPECT_NE(id({{"generation_config.json", "{}"}}), base);           // name
  EXPECT_NE(id({{"config.json", "{}"}, {"merges.txt", ""}}), base);  // an added file
  EXPECT_NE(id({}), base);                                           // a removed file
  EXPECT_EQ(id({{"config.json", "{}"}}), base);
  auto dup = internal::HashCheckpoint(ckpt, {{"config.json", "{}"}, {"config.json", "{}"}}, internal::HashOptions{});
  EXPECT_EQ(dup.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(dup.status().message().find("config.json"), std::string::npos);
  auto slash = internal::HashCheckpoint(ckpt, {{"../config.json", "{}"}}, internal::HashOptions{});
  EXPECT_EQ(slash.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(slash.status().message().find("../config.json"), std::string::npos);
}

// ---- Statistics ------------------------------------------------------------------------------

TensorRow StatsOf(const Tensor& t) {
  auto r = internal::HashCheckpoint(Checkpoint::FromTensors("mem", {{"t", t}}), {}, internal::HashOptions{});
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r->tensors.at(0);
}

TEST(TensorStats, F32CountsNonfiniteAndSumsFiniteSquares) {
  const float inf = std::numeric_limits<float>::infinity();
  TensorRow row = StatsOf(F32({7}, {3, 4, std::nanf(""), inf, -inf, 0, -0.0f}));
  EXPECT_DOUBLE_EQ(row.l2_norm, 5.0);
  EXPECT_EQ(row.nonfinite, 3);
  EXPECT_FALSE(row.all_zero);
  TensorRow zeros = StatsOf(F32({5}, {0, -0.0f, 0, 0, -0.0f}));
  EXPECT_EQ(zeros.l2_norm, 0.0);
  EXPECT_EQ(zeros.nonfinite, 0);
  EXPECT_TRUE(zeros.all_zero);
}

TEST(TensorStats, LargeF32MatchesNaiveDoubleSum) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0, 3);
  std::vector<float> v(3 * 1024 * 1024 / 4 + 13);  // several chunks and a ragged tail
  for (auto& x : v) x = nd(rng);
  v[1000] = std::nanf("");
  v[2001] = -std::numeric_limits<float>::infinity();
  double naive = 0;
  for (float x : v) {
    if (std::isfinite(x)) naive += static_cast<double>(x) * x;
  }
  TensorRow row = StatsOf(F32({static_cast<int64_t>(v.size())}, v));
  EXPECT_NEAR(row.l2_norm, std::sqrt(naive), std::sqrt(naive) * 1e-12);
  EXPECT_EQ(row.nonfinite, 2);
  EXPECT_FALSE(row.all_zero);
}

TEST(TensorStats, Avx2AndSse2PathsGiveBitIdenticalResults) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0, 1e3f);
  std::vector<float> v(1 << 18 | 5);
  for (auto& x : v) x = nd(rng);
  v[77] = std::numeric_limits<float>::infinity();
  Tensor f = F32({static_cast<int64_t>(v.size())}, v);
  auto bf = *CastTensor(f, DType::kBF16);
  const bool has_avx2 = internal::SetStatsAvx2ForTesting(true);
  TensorRow f_avx2 = StatsOf(f), b_avx2 = StatsOf(bf);
  internal::SetStatsAvx2ForTesting(false);
  TensorRow f_sse2 = StatsOf(f), b_sse2 = StatsOf(bf);
  internal::SetStatsAvx2ForTesting(true);
  if (has_avx2) {                               // without AVX2 both runs took the SSE2 path
    EXPECT_EQ(f_avx2.l2_norm, f_sse2.l2_norm);  // exact equality, not near
    EXPECT_EQ(b_avx2.l2_norm, b_sse2.l2_norm);
  }
  EXPECT_EQ(f_avx2.nonfinite, 1);
  EXPECT_EQ(f_sse2.nonfinite, 1);
  EXPECT_EQ(b_sse2.nonfinite, 1);
  double naive = 0;
  for (int64_t i = 0; i < bf.numel(); ++i) {
    const float x = kernels::BF16ToF32(bf.data_as<uint16_t>()[i]);
    if (std::isfinite(x)) naive += static_cast<double>(x) * x;
  }
  EXPECT_NEAR(b_sse2.l2_norm, std::sqrt(naive), std::sqrt(naive) * 1e-12);
}

TEST(TensorStats, Bf16AndF16AndF64AndIntegers) {
  auto bf = *Tensor::Empty(DType::kBF16, {4});
  const uint16_t bf_bits[] = {kernels::F32ToBF16(1.5f), kernels::F32ToBF16(-2.0f), 0x7fc0 /*NaN*/, 0x8000 /*-0*/};
  std::memcpy(bf.mutable_data(), bf_bits, sizeof(bf_bits));
  TensorRow b = StatsOf(bf);
  EXPECT_DOUBLE_EQ(b.l2_norm, std::sqrt(1.5 * 1.5 + 4.0));
  EXPECT_EQ(b.nonfinite, 1);
  EXPECT_FALSE(b.all_zero);

  auto h = *Tensor::Empty(DType::kF16, {3});
  const uint16_t h_bits[] = {kernels::F32ToF16(0.5f), 0x7c00 /*+inf*/, kernels::F32ToF16(2.0f)};
  std::memcpy(h.mutable_data(), h_bits, sizeof(h_bits));
  TensorRow hr = StatsOf(h);
  EXPECT_DOUBLE_EQ(hr.l2_norm, std::sqrt(0.25 + 4.0));
  EXPECT_EQ(hr.nonfinite, 1);

  auto d = *Tensor::Empty(DType::kF64, {3});
  const double dv[] = {1e200, 3, std::nan("")};
  std::memcpy(d.mutable_data(), dv, sizeof(dv));
  TensorRow dr = StatsOf(d);
  EXPECT_EQ(dr.nonfinite, 1);
  EXPECT_TRUE(std::isinf(dr.l2_norm));  // 1e400 overflows a double: recorded as is

  auto bz = *Tensor::Empty(DType::kBF16, {1000});
  EXPECT_TRUE(StatsOf(bz).all_zero);

  auto i = *Tensor::Empty(DType::kI32, {2});
  i.mutable_data_as<int32_t>()[0] = 5;
  TensorRow ir = StatsOf(i);
  EXPECT_EQ(ir.l2_norm, 0.0);
  EXPECT_EQ(ir.nonfinite, 0);
  EXPECT_FALSE(ir.all_zero);  // integers carry no statistics
}

TEST(VersionNames, KindsSourcesAndEvents) {
  EXPECT_EQ(KindName(VersionKind::kAdapter), "adapter");
  EXPECT_EQ(SourceName(VersionSource::kDaemon), "daemon");
  EXPECT_EQ(EventTypeName(Event::Type::kAcknowledged), "acknowledged");
  auto k = ParseKind("merged");
  ASSERT_TRUE(k.ok());
  EXPECT_EQ(*k, VersionKind::kMerged);
  auto bad = ParseKind("lora");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("'lora'"), std::string::npos);
}

}  // namespace
}  // namespace ferry::store
