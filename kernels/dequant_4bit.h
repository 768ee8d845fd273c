// bitsandbytes 4-bit (NF4 / FP4) dequantization (CPU reference; CUDA in cuda/dequant_4bit.cuh).
//
// Layout (bitsandbytes functional.py, backends/default/ops.py):
//   - n elements, flattened row-major, packed two per byte: byte i = (q[2i] << 4) | q[2i+1],
//     i.e. the FIRST element is in the HIGH nibble. When n is odd the low nibble of the last
//     byte is padding and is ignored. packed holds ceil(n/2) bytes.
//   - absmax[j] scales elements [j*blocksize, (j+1)*blocksize); there are ceil(n/blocksize).
//   - w[e] = code[nibble(e)] * absmax[e / blocksize], one fp32 multiply (bit-identical to
//     bitsandbytes before its cast to the storage dtype).
//   - Double quantization stores absmax as uint8 codes:
//     absmax[i] = nested_code[q[i]] * nested_absmax[i / nested_blocksize] + offset, fp32,
//     the multiply and the add rounded separately (the file is built with -ffp-contract=off).
// All functions are thread-safe (no shared state). Buffers must not overlap.
#pragma once

#include <cstdint>
#include <string_view>

namespace ferry::kernels {

// Result of a 4-bit kernel; kOk is 0.
enum class Dequant4bitStatus : int {
  kOk = 0,
  kInvalidBlocksize = 1,        // blocksize not a power of two in [32, 4096]
  kInvalidNestedBlocksize = 2,  // nested_blocksize < 1
  kInvalidSize = 3,             // negative count, or a buffer shorter than the layout needs
};

// A short English description of `status` ("ok", "blocksize must be a power of two in
// [32, 4096]", ...) for error messages; never null.
const char* Dequant4bitStatusMessage(Dequant4bitStatus status);

// The 16-entry code tables bitsandbytes' dequantize kernels use (they select the table by
// quant_type and never read the stored quant_map). kNf4Code equals the NF4 quant_map bit for
// bit. kFp4Code equals the FP4 quant_map by value, but entry 8 is -0.0f where quant_map holds
// +0.0f: bitsandbytes decodes the sign bit separately, so code 8 dequantizes to -0.
extern const float kNf4Code[16];
extern const float kFp4Code[16];

// The code table to dequantize with, for a weight whose quant_state says `quant_type`
// ("nf4" or "fp4") and whose file stores `quant_map` (16 floats; nullptr when absent):
// the built-in table when quant_map is absent or equal to it by value (so that the output
// matches bitsandbytes bit for bit, -0 included), otherwise the file's quant_map (a custom
// map; honoured as stored). Returns nullptr for another quant_type without a quant_map.
const float* Select4bitCode(std::string_view quant_type, const float* quant_map);

// Bytes of packed data for n 4-bit elements: ceil(n / 2). REQUIRES: n >= 0.
constexpr int64_t Packed4bitBytes(int64_t n) { return n / 2 + (n % 2); }
// Number of absmax blocks for n elements: ceil(n / blocksize). REQUIRES: n >= 0, blocksize > 0.
constexpr int64_t Num4bitBlocks(int64_t n, int64_t blocksize) { return n / blocksize + (n % blocksize != 0); }

// Checks that a stored 4-bit tensor is consistent: blocksize is a power of two in
// [32, 4096], n >= 0, packed_bytes >= Packed4bitBytes(n) and num_absmax >=
// Num4bitBlocks(n, blocksize). Callers pass the sizes of the tensors they read from the file
// before calling Dequantize4bit.
[[nodiscard]] Dequant4bitStatus Validate4bitLayout(int64_t n, int64_t blocksize, int64_t packed_bytes,
                                                   int64_t num_absmax);

// out[e] = code[nibble e of packed] * absmax[e / blocksize] for e in [0, n).
// packed: Packed4bitBytes(n) bytes. absmax: Num4bitBlocks(n, blocksize) floats.
// code: 16 floats (the file's quant_map, or kNf4Code / kFp4Code). out: n floats.
// Returns kInvalidBlocksize / kInvalidSize (and writes nothing) when blocksize or n is
// invalid. Buffer lengths cannot be checked here: use Validate4bitLayout first.
[[nodiscard]] Dequant4bitStatus Dequantize4bit(const uint8_t* packed, int64_t n, const float* absmax, int64_t blocksize,
                                               const float* code, float* out);

// Double-quantized absmax: absmax_out[i] = nested_code[absmax_q[i]] *
// nested_absmax[i / nested_blocksize] + offset for i in [0, nblocks).
// absmax_q: nblocks bytes. nested_code: 256 floats (nested_quant_map). nested_absmax:
// ceil(nblocks / nested_blocksize) floats. absmax_out: nblocks floats.
// Returns kInvalidSize when nblocks < 0, kInvalidNestedBlocksize when nested_blocksize < 1
// (and writes nothing).
[[nodiscard]] Dequant4bitStatus DequantizeAbsmaxNested(const uint8_t* absmax_q, int64_t nblocks,
                                                       const float* nested_code, const float* nested_absmax,
                                                       int64_t nested_blocksize, float offset, float* absmax_out);

}  // namespace ferry::kernels
