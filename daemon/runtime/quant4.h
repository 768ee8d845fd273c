// A frozen bitsandbytes 4-bit (NF4 / FP4, optionally double-quantised) weight that stays
// packed in memory and is dequantised inside the forward, on the device the model lives on.
//
// Numerics follow bitsandbytes' Linear4bit: w = code[nibble] * absmax[block] in fp32 (the
// absmax itself decoded from its nested quantisation first), rounded once to the quant
// state's dtype (what dequantize_4bit returns), then cast to the compute dtype.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <vector>

#include "convert/bnb4.h"
#include "core/checkpoint.h"
#include "core/status.h"

namespace ferry::runtime {

class Quant4Weight {
 public:
  // Takes the packed data and companions of `state` from `ckpt`: zero-copy views on the
  // CPU, one copy on another device. The checkpoint's files stay mapped while the weight
  // lives. Errors: the companions' validation (convert/bnb4.h), kUnsupported dtypes.
  static Result<std::shared_ptr<const Quant4Weight>> Load(const Checkpoint& ckpt, const QuantState4bit& state,
                                                          const at::Device& device);

  // The dense [out, in] weight in `dtype` on the weight's device, made afresh each call
  // (the caller drops it after use, so only one layer's weight is ever unpacked).
  at::Tensor Dequantize(at::ScalarType dtype) const;
  // The same through LibTorch operators only (the path for non-CPU devices; public so the
  // CPU tests can check both paths agree bit for bit).
  at::Tensor DequantizeWithTorchOps(at::ScalarType dtype) const;

  const QuantState4bit& state() const { return state_; }
  // Bytes held: packed data + absmax (+ nested tables).
  int64_t bytes() const;
  // Every tensor held (packed data, absmax, code, nested tables): all on the weight's device.
  std::vector<at::Tensor> tensors() const;

 private:
  Quant4Weight() = default;
  at::Tensor Absmax() const;  // fp32 [nblocks]

  QuantState4bit state_;
  at::Device device_ = at::kCPU;
  at::ScalarType state_dtype_ = at::kFloat;
  at::Tensor packed_;         // uint8 [ceil(n/2)]
  at::Tensor absmax_;         // fp32 [nblocks], or uint8 codes when nested
  at::Tensor code_;           // fp32 [16]
  at::Tensor nested_absmax_;  // fp32, nested only
  at::Tensor nested_code_;    // fp32 [256], nested only
};

}  // namespace ferry::runtime
