// bitsandbytes 4-bit (NF4 / FP4) weights in a safetensors checkpoint, as transformers
// saves a pre-quantized model.
//
// For a quantized weight "W.weight" the checkpoint holds:
//   W.weight                                  packed 4-bit data (raw bytes; first element in the HIGH nibble)
//   W.weight.absmax                           per-block scale: F32, or U8 when double-quantized
//   W.weight.quant_map                        16 F32 code values
//   W.weight.nested_absmax, .nested_quant_map only when double-quantized (F32, 256 F32)
//   W.weight.quant_state.bitsandbytes__nf4    U8 bytes of UTF-8 JSON: quant_type, blocksize, dtype,
//   (or __fp4)                                shape, and nested_blocksize, nested_offset when nested
// Dequantized value of element i: quant_map[code_i] * absmax[i / blocksize], where absmax is,
// when double-quantized, nested_quant_map[absmax_u8[b]] * nested_absmax[b / nested_blocksize]
// + nested_offset (bitsandbytes' dequantize_4bit, reproduced bit for bit: fixtures/README.md).
#pragma once

#include <map>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "core/checkpoint.h"
#include "core/status.h"
#include "core/tensor.h"

namespace ferry {

struct QuantState4bit {
  std::string weight;      // "model.layers.0.self_attn.q_proj.weight"
  std::string quant_type;  // "nf4" or "fp4"
  int64_t blocksize = 64;
  DType dtype = DType::kBF16;  // the dtype the weight had before quantization
  Shape shape;                 // the unpacked (out, in) shape
  bool nested = false;
  int64_t nested_blocksize = 256;
  float nested_offset = 0.0f;
  std::vector<std::string> aux_keys;  // every companion key, quant_state included
};

// Finds every 4-bit weight of `ckpt` (keyed by weight name) and validates its companion
// tensors (presence, dtypes, sizes against shape and blocksize). Errors name the file and key.
Result<std::map<std::string, QuantState4bit>> FindQuantized4bit(const Checkpoint& ckpt);

// The set of companion keys of all quantized weights (they disappear from a 16-bit export).
std::set<std::string> QuantAuxKeys(const std::map<std::string, QuantState4bit>& states);

// Dequantizes one weight into `out` (numel(shape) floats) in fp32, exactly as bitsandbytes
// does: double-quantized absmax first, then code[nibble] * absmax[block].
Status Dequantize4bitWeight(const Checkpoint& ckpt, const QuantState4bit& qs, std::span<float> out);

// The weight as bitsandbytes hands it to the model it is loaded into, as fp32 values:
// Dequantize4bitWeight, then rounded once to the quant state's dtype (qs.dtype). This is the
// base an adapter was trained against and what every Ferry merge onto a 4-bit base starts
// from (the converter and sync's snapshots). Errors as Dequantize4bitWeight's.
Result<std::vector<float>> Dequantize4bitAsLoaded(const Checkpoint& ckpt, const QuantState4bit& qs);

}  // namespace ferry
