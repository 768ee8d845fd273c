// 4-bit (bitsandbytes NF4 / FP4) dequantization: hand-packed data, the code tables, and the
// real bitsandbytes checkpoints under fixtures/cases/llama_{nf4,fp4}{,_dq}.
#include "kernels/dequant_4bit.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cast.h"

namespace ferry::kernels {
namespace {

TEST(Dequant4bit, CodeTablesMatchReference) {
  // docs: /work/shared/reference/bnb-4bit.md (bitsandbytes get_4bit_type).
  const float nf4[16] = {-1.0f,
                         -0.6961928009986877f,
                         -0.5250730514526367f,
                         -0.39491748809814453f,
                         -0.28444138169288635f,
                         -0.18477343022823334f,
                         -0.09105003625154495f,
                         0.0f,
                         0.07958029955625534f,
                         0.16093020141124725f,
                         0.24611230194568634f,
                         0.33791524171829224f,
                         0.44070982933044434f,
                         0.5626170039176941f,
                         0.7229568362236023f,
                         1.0f};
  // The fp32 values bitsandbytes writes to quant_map for fp4 (0.0625/12, 8/12, ... rounded).
  // Entry 8 is -0: bitsandbytes' kernels decode the sign bit separately (the stored quant_map
  // has +0 there).
  const float fp4[16] = {0.0f,
                         0.0052083334885537624f,
                         0.6666666865348816f,
                         1.0f,
                         0.3333333432674408f,
                         0.5f,
                         0.1666666716337204f,
                         0.25f,
                         -0.0f,
                         -0.0052083334885537624f,
                         -0.6666666865348816f,
                         -1.0f,
                         -0.3333333432674408f,
                         -0.5f,
                         -0.1666666716337204f,
                         -0.25f};
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(F32Bits(kNf4Code[i]), F32Bits(nf4[i])) << "nf4 " << i;
    EXPECT_EQ(F32Bits(kFp4Code[i]), F32Bits(fp4[i])) << "fp4 " << i;
  }
  EXPECT_EQ(F32Bits(kFp4Code[8]), 0x80000000u) << "fp4 entry 8 is -0";
}

TEST(Dequant4bit, SelectCodePrefersBuiltinWhenEqualByValue) {
  std::vector<float> stored(kFp4Code, kFp4Code + 16);
  stored[8] = 0.0f;  // as bitsandbytes writes the fp4 quant_map
  EXPECT_EQ(Select4bitCode("fp4", stored.data()), kFp4Code);
  EXPECT_EQ(Select4bitCode("nf4", kNf4Code), kNf4Code);
  EXPECT_EQ(Select4bitCode("nf4", nullptr), kNf4Code);
  EXPECT_EQ(Select4bitCode("fp4", nullptr), kFp4Code);
  EXPECT_EQ(Select4bitCode("int4", nullptr), nullptr);
  stored[3] = 0.9f;  // a custom map is honoured
  EXPECT_EQ(Select4bitCode("fp4", stored.data()), stored.data());
  EXPECT_EQ(Select4bitCode("nf4", stored.data()), stored.data());
  EXPECT_EQ(Select4bitCode("int4", stored.data()), stored.data());
}

// A code table whose entries are easy to recognise: code[i] = i + 0.25.
std::vector<float> IndexCode() {
  std::vector<float> c(16);
  for (int i = 0; i < 16; ++i) c[i] = static_cast<float>(i) + 0.25f;
  return c;
}

TEST(Dequant4bit, HighNibbleIsFirstElement) {
  const auto code = IndexCode();
  const uint8_t packed[1] = {0x1F};
  const float absmax[1] = {2.0f};
  float out[2] = {-7, -7};
  ASSERT_EQ(Dequantize4bit(packed, 2, absmax, 64, code.data(), out), Dequant4bitStatus::kOk);
  EXPECT_EQ(out[0], 1.25f * 2.0f);   // code[1]
  EXPECT_EQ(out[1], 15.25f * 2.0f);  // code[15]

  // With the NF4 table: 0x1F -> [code[1], code[15]] * absmax.
  ASSERT_EQ(Dequantize4bit(packed, 2, absmax, 64, kNf4Code, out), Dequant4bitStatus::kOk);
  EXPECT_EQ(out[0], -0.6961928009986877f * 2.0f);
  EXPECT_EQ(out[1], 2.0f);
}

TEST(Dequant4bit, OddCountIgnoresPaddingNibble) {
  const auto code = IndexCode();
  const uint8_t packed[2] = {0x3A, 0x7C};  // elements 3, 10, 7; nibble C is padding
  const float absmax[1] = {0.5f};
  float out[4] = {-1, -1, -1, -1};
  ASSERT_EQ(Dequantize4bit(packed, 3, absmax, 32, code.data(), out), Dequant4bitStatus::kOk);
  EXPECT_EQ(out[0], 3.25f * 0.5f);
  EXPECT_EQ(out[1], 10.25f * 0.5f);
  EXPECT_EQ(out[2], 7.25f * 0.5f);
  EXPECT_EQ(out[3], -1.0f) << "wrote past n";
}

TEST(Dequant4bit, BlocksUseTheirOwnAbsmax) {
  // 3 blocks of 32 plus a partial fourth of 5 elements (n = 101, odd).
  const int64_t bs = 32, n = 101;
  const auto code = IndexCode();
  std::vector<uint8_t> q(n);
  for (int64_t e = 0; e < n; ++e) q[e] = static_cast<uint8_t>((e * 7 + 3) % 16);
  std::vector<uint8_t> packed(Packed4bitBytes(n), 0);
  for (int64_t e = 0; e < n; ++e) packed[e / 2] |= static_cast<uint8_t>(e % 2 == 0 ? q[e] << 4 : q[e]);
  const std::vector<float> absmax = {1.0f, -3.0f, 0.125f, 1000.0f};
  ASSERT_EQ(Num4bitBlocks(n, bs), 4);
  ASSERT_EQ(Validate4bitLayout(n, bs, static_cast<int64_t>(packed.size()), 4), Dequant4bitStatus::kOk);
  std::vector<float> out(n + 1, 42.0f);
  ASSERT_EQ(Dequantize4bit(packed.data(), n, absmax.data(), bs, code.data(), out.data()), Dequant4bitStatus::kOk);
  for (int64_t e = 0; e < n; ++e) {
    EXPECT_EQ(out[e], code[q[e]] * absmax[e / bs]) << "element " << e;
  }
  EXPECT_EQ(out[n], 42.0f) << "wrote past n";
}

TEST(Dequant4bit, NestedAbsmaxFormula) {
  std::vector<float> nested_code(256);
  for (int i = 0; i < 256; ++i) nested_code[i] = static_cast<float>(i) / 256.0f;
  const uint8_t q[5] = {0, 128, 255, 64, 32};
  const float nested_absmax[3] = {2.0f, 4.0f, 0.5f};
  float out[5];
  // nested_blocksize 2: blocks {0,1}, {2,3}, {4}.
  ASSERT_EQ(DequantizeAbsmaxNested(q, 5, nested_code.data(), nested_absmax, 2, 0.25f, out), Dequant4bitStatus::kOk);
  EXPECT_EQ(out[0], 0.0f * 2.0f + 0.25f);
  EXPECT_EQ(out[1], 0.5f * 2.0f + 0.25f);               // 1.25
  EXPECT_EQ(out[2], (255.0f / 256.0f) * 4.0f + 0.25f);  // 4.234375
  EXPECT_EQ(out[3], 0.25f * 4.0f + 0.25f);              // 1.25
  EXPECT_EQ(out[4], 0.125f * 0.5f + 0.25f);             // 0.3125
  EXPECT_EQ(out[2], 4.234375f);
}

TEST(Dequant4bit, RejectsInvalidArguments) {
  const uint8_t packed[1] = {0x12};
  const float absmax[1] = {1.0f};
  float out[2] = {9, 9};
  for (int64_t bs : {0, 16, 31, 48, 100, 8192, -64}) {
    EXPECT_EQ(Dequantize4bit(packed, 2, absmax, bs, kNf4Code, out), Dequant4bitStatus::kInvalidBlocksize) << bs;
    EXPECT_EQ(Validate4bitLayout(2, bs, 1, 1), Dequant4bitStatus::kInvalidBlocksize) << bs;
  }
  EXPECT_EQ(out[0], 9.0f) << "wrote output on error";
  for (int64_t bs : {32, 64, 4096}) EXPECT_EQ(Validate4bitLayout(2, bs, 1, 1), Dequant4bitStatus::kOk) << bs;
  EXPECT_EQ(Dequantize4bit(packed, -1, absmax, 64, kNf4Code, out), Dequant4bitStatus::kInvalidSize);
  EXPECT_EQ(Validate4bitLayout(-1, 64, 1, 1), Dequant4bitStatus::kInvalidSize);
  EXPECT_EQ(Validate4bitLayout(3, 64, 1, 1), Dequant4bitStatus::kInvalidSize) << "3 elements need 2 bytes";
  EXPECT_EQ(Validate4bitLayout(65, 64, 33, 1), Dequant4bitStatus::kInvalidSize) << "65 elements need 2 blocks";
  EXPECT_EQ(Validate4bitLayout(65, 64, 33, 2), Dequant4bitStatus::kOk);
  const uint8_t q[1] = {0};
  EXPECT_EQ(DequantizeAbsmaxNested(q, 1, kNf4Code, absmax, 0, 0.0f, out), Dequant4bitStatus::kInvalidNestedBlocksize);
  EXPECT_EQ(DequantizeAbsmaxNested(q, -1, kNf4Code, absmax, 256, 0.0f, out), Dequant4bitStatus::kInvalidSize);
  EXPECT_STREQ(Dequant4bitStatusMessage(Dequant4bitStatus::kInvalidBlocksize),
               "blocksize must be a power of two in [32, 4096]");
  EXPECT_STREQ(Dequant4bitStatusMessage(Dequant4bitStatus::kOk), "ok");
}

// ---- Real bitsandbytes checkpoints -------------------------------------------------------

// A minimal safetensors reader (8-byte little-endian header length, JSON header, data).
struct RawTensor {
  std::string dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

std::map<std::string, RawTensor> ReadSafetensors(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f.good()) << "cannot open " << path;
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string data = ss.str();
  std::map<std::string, RawTensor> out;
  if (data.size() < 8) return out;
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(data[i]);
  const auto header = nlohmann::json::parse(data.substr(8, header_len));
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") continue;
    RawTensor t;
    t.dtype = info.at("dtype").get<std::string>();
    t.shape = info.at("shape").get<std::vector<int64_t>>();
    const auto offs = info.at("data_offsets").get<std::vector<uint64_t>>();
    t.bytes = data.substr(8 + header_len + offs[0], offs[1] - offs[0]);
    out.emplace(name, std::move(t));
  }
  return out;
}

std::vector<float> AsF32(const RawTensor& t) {
  std::vector<float> v;
  if (t.dtype == "F32") {
    v.resize(t.bytes.size() / 4);
    std::memcpy(v.data(), t.bytes.data(), t.bytes.size());
  } else if (t.dtype == "BF16" || t.dtype == "F16") {
    std::vector<uint16_t> h(t.bytes.size() / 2);
    std::memcpy(h.data(), t.bytes.data(), t.bytes.size());
    for (uint16_t x : h) v.push_back(t.dtype == "BF16" ? BF16ToF32(x) : F16ToF32(x));
  } else {
    ADD_FAILURE() << "unexpected dtype " << t.dtype;
  }
  return v;
}

class Bnb4bitFixture : public ::testing::TestWithParam<const char*> {};

// Dequantizes every 4-bit weight of base/ from its quant_state JSON and checks that
//  - rounded to the quant_state dtype it equals base_dequant/ (bitsandbytes' own
//    dequantize_4bit) bit for bit;
//  - it is within the 4-bit error bound of the original weights in base_fp/:
//    |w - dq| <= (max code gap / 2) * absmax_true + |absmax_true - absmax_used|, where
//    absmax_true = max |w| over the block (and, without double quantization, the stored
//    absmax must equal it exactly).
TEST_P(Bnb4bitFixture, DequantizesLikeBitsandbytes) {
  const std::string dir = std::string(FERRY_FIXTURES_DIR) + "/cases/" + GetParam();
  auto base = ReadSafetensors(dir + "/base/model.safetensors");
  auto ref_dq = ReadSafetensors(dir + "/base_dequant/model.safetensors");
  auto ref_fp = ReadSafetensors(dir + "/base_fp/model.safetensors");
  ASSERT_FALSE(base.empty()) << dir;
  int checked = 0;
  for (const auto& [key, state] : base) {
    const auto pos = key.find(".quant_state.bitsandbytes__");
    if (pos == std::string::npos) continue;
    const std::string w = key.substr(0, pos);
    SCOPED_TRACE(dir + " tensor " + w);
    const auto qs = nlohmann::json::parse(state.bytes);
    const int64_t blocksize = qs.at("blocksize").get<int64_t>();
    const auto shape = qs.at("shape").get<std::vector<int64_t>>();
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    const RawTensor& packed = base.at(w);
    const auto quant_map = AsF32(base.at(w + ".quant_map"));
    ASSERT_EQ(quant_map.size(), 16u);
    const float* code = Select4bitCode(qs.at("quant_type").get<std::string>(), quant_map.data());
    ASSERT_EQ(code, qs.at("quant_type") == "nf4" ? kNf4Code : kFp4Code) << "quant_map differs from the built-in table";
    const RawTensor& absmax_t = base.at(w + ".absmax");
    const int64_t nblocks = absmax_t.shape.at(0);
    ASSERT_EQ(Validate4bitLayout(n, blocksize, static_cast<int64_t>(packed.bytes.size()), nblocks),
              Dequant4bitStatus::kOk);

    std::vector<float> absmax(nblocks);
    const bool nested = qs.contains("nested_blocksize");
    if (nested) {
      ASSERT_EQ(absmax_t.dtype, "U8");
      const auto nested_code = AsF32(base.at(w + ".nested_quant_map"));
      const auto nested_absmax = AsF32(base.at(w + ".nested_absmax"));
      ASSERT_EQ(nested_code.size(), 256u);
      const int64_t nbs = qs.at("nested_blocksize").get<int64_t>();
      ASSERT_EQ(static_cast<int64_t>(nested_absmax.size()), (nblocks + nbs - 1) / nbs);
      ASSERT_EQ(
          DequantizeAbsmaxNested(reinterpret_cast<const uint8_t*>(absmax_t.bytes.data()), nblocks, nested_code.data(),
                                 nested_absmax.data(), nbs, qs.at("nested_offset").get<float>(), absmax.data()),
          Dequant4bitStatus::kOk);
    } else {
      absmax = AsF32(absmax_t);
    }

    std::vector<float> out(n);
    ASSERT_EQ(Dequantize4bit(reinterpret_cast<const uint8_t*>(packed.bytes.data()), n, absmax.data(), blocksize, code,
                             out.data()),
              Dequant4bitStatus::kOk);
    // The stored quant_map gives the same values (it may differ only in the sign of zero).
    std::vector<float> out_map(n);
    ASSERT_EQ(Dequantize4bit(reinterpret_cast<const uint8_t*>(packed.bytes.data()), n, absmax.data(), blocksize,
                             quant_map.data(), out_map.data()),
              Dequant4bitStatus::kOk);
    for (int64_t e = 0; e < n; ++e) ASSERT_EQ(out_map[e], out[e]) << "element " << e;

    // Bit-exact against bitsandbytes' dequantize_4bit (rounded to the storage dtype).
    const RawTensor& dq = ref_dq.at(w);
    ASSERT_EQ(dq.shape, shape);
    const std::string dtype = qs.at("dtype").get<std::string>();
    ASSERT_TRUE(dtype == "bfloat16" || dtype == "float16") << dtype;
    ASSERT_EQ(dq.dtype, dtype == "bfloat16" ? "BF16" : "F16");
    std::vector<uint16_t> dq_bits(n);
    std::memcpy(dq_bits.data(), dq.bytes.data(), n * 2);
    for (int64_t e = 0; e < n; ++e) {
      const uint16_t mine = dtype == "bfloat16" ? F32ToBF16(out[e]) : F32ToF16(out[e]);
      ASSERT_EQ(mine, dq_bits[e]) << "element " << e;
    }

    // Within the quantization error of the original weights.
    std::vector<float> sorted = quant_map;
    std::sort(sorted.begin(), sorted.end());
    float max_gap = 0;
    for (size_t i = 1; i < sorted.size(); ++i) max_gap = std::max(max_gap, sorted[i] - sorted[i - 1]);
    const auto fp = AsF32(ref_fp.at(w));
    ASSERT_EQ(static_cast<int64_t>(fp.size()), n);
    for (int64_t j = 0; j < nblocks; ++j) {
      const int64_t b = j * blocksize, e_end = std::min(n, b + blocksize);
      float amax = 0;
      for (int64_t e = b; e < e_end; ++e) amax = std::max(amax, std::fabs(fp[e]));
      if (!nested) {
        ASSERT_EQ(absmax[j], amax) << "block " << j;
      }
      const double bound = 0.5 * max_gap * amax * (1 + 1e-6) + std::fabs(static_cast<double>(absmax[j]) - amax) + 1e-7;
      for (int64_t e = b; e < e_end; ++e) {
        ASSERT_LE(std::fabs(static_cast<double>(out[e]) - fp[e]), bound) << "element " << e << " block " << j;
      }
    }
    ++checked;
  }
  EXPECT_GT(checked, 0) << "no 4-bit weights in " << dir;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Bnb4bitFixture,
                         ::testing::Values("llama_nf4", "llama_nf4_dq", "llama_fp4", "llama_fp4_dq"));

}  // namespace
}  // namespace ferry::kernels
