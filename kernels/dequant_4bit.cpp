#include "kernels/dequant_4bit.h"

#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__) && defined(__GNUC__) && \
    !defined(__clang__)
#define FERRY_MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define FERRY_MULTIVERSION
#endif

namespace ferry::kernels {

// bitsandbytes functional.get_4bit_type("nf4"), as stored in quant_map.
const float kNf4Code[16] = {
    -1.0f,
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
    1.0f,
};

// bitsandbytes' FP4 as its dequantize kernels decode it (csrc dDequantizeFP4Tree: a magnitude
// from bits 0..2 times the sign of bit 3): [0, 0.0625, 8, 12, 4, 6, 2, 3] / 12 in fp32, then
// negated. Entry 8 is therefore -0.0f; the quant_map bitsandbytes writes has +0.0f there
// (get_4bit_type's "-0" is a Python int), which is the only difference.
const float kFp4Code[16] = {
    0.0f,  0.0625f / 12.0f,  8.0f / 12.0f,  12.0f / 12.0f,  4.0f / 12.0f,  6.0f / 12.0f,  2.0f / 12.0f,  3.0f / 12.0f,
    -0.0f, -0.0625f / 12.0f, -8.0f / 12.0f, -12.0f / 12.0f, -4.0f / 12.0f, -6.0f / 12.0f, -2.0f / 12.0f, -3.0f / 12.0f,
};

namespace {

bool ValidBlocksize(int64_t blocksize) {
  return blocksize >= 32 && blocksize <= 4096 && (blocksize & (blocksize - 1)) == 0;
}

// out[2t], out[2t+1] from packed[t] for t in [0, nbytes), all scaled by a.
FERRY_MULTIVERSION
void DequantBytes(const uint8_t* packed, int64_t nbytes, float a, const float* code, float* out) {
  for (int64_t t = 0; t < nbytes; ++t) {
    const uint8_t b = packed[t];
    out[2 * t] = code[b >> 4] * a;
    out[2 * t + 1] = code[b & 0x0f] * a;
  }
}

}  // namespace

const float* Select4bitCode(std::string_view quant_type, const float* quant_map) {
  const float* builtin = quant_type == "nf4" ? kNf4Code : quant_type == "fp4" ? kFp4Code : nullptr;
  if (quant_map == nullptr) return builtin;
  if (builtin == nullptr) return quant_map;
  for (int i = 0; i < 16; ++i) {
    if (!(quant_map[i] == builtin[i])) return quant_map;
  }
  return builtin;
}

const char* Dequant4bitStatusMessage(Dequant4bitStatus status) {
  switch (status) {
    case Dequant4bitStatus::kOk: return "ok";
    case Dequant4bitStatus::kInvalidBlocksize: return "blocksize must be a power of two in [32, 4096]";
    case Dequant4bitStatus::kInvalidNestedBlocksize: return "nested_blocksize must be at least 1";
    case Dequant4bitStatus::kInvalidSize: return "element count or buffer size does not match the 4-bit layout";
  }
  return "unknown 4-bit dequantization status";
}

Dequant4bitStatus Validate4bitLayout(int64_t n, int64_t blocksize, int64_t packed_bytes, int64_t num_absmax) {
  if (!ValidBlocksize(blocksize)) return Dequant4bitStatus::kInvalidBlocksize;
  if (n < 0 || packed_bytes < Packed4bitBytes(n) || num_absmax < Num4bitBlocks(n, blocksize)) {
    return Dequant4bitStatus::kInvalidSize;
  }
  return Dequant4bitStatus::kOk;
}

Dequant4bitStatus Dequantize4bit(const uint8_t* packed, int64_t n, const float* absmax, int64_t blocksize,
                                 const float* code, float* out) {
  if (!ValidBlocksize(blocksize)) return Dequant4bitStatus::kInvalidBlocksize;
  if (n < 0) return Dequant4bitStatus::kInvalidSize;
  // blocksize is even, so every block starts on a byte boundary.
  const int64_t full_blocks = n / blocksize;
  for (int64_t j = 0; j < full_blocks; ++j) {
    DequantBytes(packed + j * (blocksize / 2), blocksize / 2, absmax[j], code, out + j * blocksize);
  }
  const int64_t done = full_blocks * blocksize;
  const int64_t rest = n - done;
  if (rest > 0) {
    const float a = absmax[full_blocks];
    const uint8_t* p = packed + done / 2;
    DequantBytes(p, rest / 2, a, code, out + done);
    if (rest % 2 != 0) out[n - 1] = code[p[rest / 2] >> 4] * a;  // low nibble is padding
  }
  return Dequant4bitStatus::kOk;
}

Dequant4bitStatus DequantizeAbsmaxNested(const uint8_t* absmax_q, int64_t nblocks, const float* nested_code,
                                         const float* nested_absmax, int64_t nested_blocksize, float offset,
                                         float* absmax_out) {
  if (nblocks < 0) return Dequant4bitStatus::kInvalidSize;
  if (nested_blocksize < 1) return Dequant4bitStatus::kInvalidNestedBlocksize;
  for (int64_t i = 0; i < nblocks; ++i) {
    const float scaled = nested_code[absmax_q[i]] * nested_absmax[i / nested_blocksize];
    absmax_out[i] = scaled + offset;
  }
  return Dequant4bitStatus::kOk;
}

}  // namespace ferry::kernels
