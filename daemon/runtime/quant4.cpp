#include "daemon/runtime/quant4.h"

#include <cstring>
#include <vector>

#include "daemon/runtime/torch_util.h"
#include "kernels/dequant_4bit.h"

namespace ferry::runtime {
namespace {

// A small F32 table copied out of the file (safetensors data may be unaligned).
at::Tensor CopyF32(const Tensor& t) {
  at::Tensor out = at::empty({t.numel()}, at::kFloat);
  std::memcpy(out.data_ptr<float>(), t.data(), t.nbytes());
  return out;
}

}  // namespace

Result<std::shared_ptr<const Quant4Weight>> Quant4Weight::Load(const Checkpoint& ckpt, const QuantState4bit& state,
                                                               const at::Device& device) {
  std::shared_ptr<Quant4Weight> w(new Quant4Weight());
  w->state_ = state;
  w->device_ = device;
  FERRY_ASSIGN_OR_RETURN(w->state_dtype_, TorchDType(state.dtype));
  FERRY_ASSIGN_OR_RETURN(Tensor packed, ckpt.Get(state.weight));
  FERRY_ASSIGN_OR_RETURN(Tensor absmax, ckpt.Get(state.weight + ".absmax"));
  FERRY_ASSIGN_OR_RETURN(Tensor quant_map, ckpt.Get(state.weight + ".quant_map"));
  FERRY_ASSIGN_OR_RETURN(at::Tensor packed_t, ToTorch(packed, device));
  w->packed_ = packed_t.view({-1});
  if (state.nested) {
    FERRY_ASSIGN_OR_RETURN(w->absmax_, ToTorch(absmax, device));
    FERRY_ASSIGN_OR_RETURN(Tensor nested_absmax, ckpt.Get(state.weight + ".nested_absmax"));
    FERRY_ASSIGN_OR_RETURN(Tensor nested_code, ckpt.Get(state.weight + ".nested_quant_map"));
    w->nested_absmax_ = CopyF32(nested_absmax).to(device);
    w->nested_code_ = CopyF32(nested_code).to(device);
  } else {
    w->absmax_ = CopyF32(absmax).to(device);
  }
  at::Tensor map = CopyF32(quant_map);
  const float* table = kernels::Select4bitCode(state.quant_type, map.data_ptr<float>());
  if (!table)
    return Status::Unsupported(ckpt.FileOf(state.weight).string() + ": '" + state.weight + "': no code table");
  w->code_ = at::from_blob(const_cast<float*>(table), {16}, at::kFloat).clone().to(device);
  return std::shared_ptr<const Quant4Weight>(std::move(w));
}

int64_t Quant4Weight::bytes() const {
  int64_t b = packed_.nbytes() + absmax_.nbytes() + code_.nbytes();
  if (state_.nested) b += nested_absmax_.nbytes() + nested_code_.nbytes();
  return b;
}

std::vector<at::Tensor> Quant4Weight::tensors() const {
  std::vector<at::Tensor> out = {packed_, absmax_, code_};
  if (state_.nested) {
    out.push_back(nested_absmax_);
    out.push_back(nested_code_);
  }
  return out;
}

at::Tensor Quant4Weight::Absmax() const {
  if (!state_.nested) return absmax_;
  const int64_t nblocks = absmax_.numel();
  at::Tensor scale = nested_absmax_.repeat_interleave(state_.nested_blocksize).narrow(0, 0, nblocks);
  // Two roundings, as bitsandbytes: (code * scale) then + offset.
  at::Tensor prod = nested_code_.index_select(0, absmax_.to(at::kLong)).mul(scale);
  return prod.add(state_.nested_offset);
}

at::Tensor Quant4Weight::DequantizeWithTorchOps(at::ScalarType dtype) const {
  const int64_t n = state_.shape[0] * state_.shape[1];
  at::Tensor hi = packed_.bitwise_right_shift(4);
  at::Tensor lo = packed_.bitwise_and(15);
  at::Tensor idx = at::stack({hi, lo}, 1).view({-1}).narrow(0, 0, n).to(at::kLong);
  at::Tensor scale = Absmax().repeat_interleave(state_.blocksize).narrow(0, 0, n);
  at::Tensor w = code_.index_select(0, idx).mul(scale);
  return w.to(state_dtype_).to(dtype).view({state_.shape[0], state_.shape[1]});
}

at::Tensor Quant4Weight::Dequantize(at::ScalarType dtype) const {
  if (!device_.is_cpu()) return DequantizeWithTorchOps(dtype);
  const int64_t n = state_.shape[0] * state_.shape[1];
  at::Tensor absmax = Absmax().contiguous();
  at::Tensor out = at::empty({state_.shape[0], state_.shape[1]}, at::kFloat);
  // Validated at load (FindQuantized4bit checks sizes against shape and blocksize).
  const auto rc = kernels::Dequantize4bit(packed_.data_ptr<uint8_t>(), n, absmax.data_ptr<float>(), state_.blocksize,
                                          code_.data_ptr<float>(), out.data_ptr<float>());
  TORCH_CHECK(rc == kernels::Dequant4bitStatus::kOk, "dequantizing ", state_.weight, ": ",
              kernels::Dequant4bitStatusMessage(rc));
  if (state_dtype_ == at::kFloat && dtype == at::kFloat) return out;
  return out.to(state_dtype_).to(dtype);
}

}  // namespace ferry::runtime
