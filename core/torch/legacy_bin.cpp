#include "core/torch/legacy_bin.h"

#include <torch/serialize.h>
#include <torch/torch.h>

#include "core/checkpoint.h"
#include "core/mapped_file.h"

namespace ferry::torchio {
namespace {

Result<DType> FromScalarType(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat: return DType::kF32;
    case c10::kHalf: return DType::kF16;
    case c10::kBFloat16: return DType::kBF16;
    case c10::kDouble: return DType::kF64;
    case c10::kByte: return DType::kU8;
    case c10::kChar: return DType::kI8;
    case c10::kShort: return DType::kI16;
    case c10::kInt: return DType::kI32;
    case c10::kLong: return DType::kI64;
    case c10::kBool: return DType::kBool;
    default: return Status::Unsupported(std::string("dtype ") + c10::toString(t) + " has no safetensors equivalent");
  }
}

}  // namespace

Result<std::map<std::string, Tensor>> LoadTorchPickle(const std::filesystem::path& path) {
  FERRY_ASSIGN_OR_RETURN(std::string bytes, ReadSmallFile(path, size_t{64} << 30));
  c10::IValue value;
  try {
    std::vector<char> data(bytes.begin(), bytes.end());
    value = torch::pickle_load(data);
  } catch (const std::exception& e) {
    std::string what = e.what();
    if (auto nl = what.find('\n'); nl != std::string::npos) what.resize(nl);
    return Status::Corruption(path.string() + ": not a loadable torch pickle: " + what);
  }
  if (!value.isGenericDict())
    return Status::Corruption(path.string() + ": torch pickle does not hold a dict of tensors");
  std::map<std::string, Tensor> out;
  for (const auto& kv : value.toGenericDict()) {
    if (!kv.key().isString()) return Status::Corruption(path.string() + ": dict key is not a string");
    const std::string name = kv.key().toStringRef();
    if (!kv.value().isTensor()) return Status::Corruption(path.string() + ": value of " + name + " is not a tensor");
    auto t = std::make_shared<at::Tensor>(kv.value().toTensor().contiguous().cpu());
    auto dtype = FromScalarType(t->scalar_type());
    if (!dtype.ok()) return dtype.status().WithContext(path.string() + ": tensor '" + name + "'");
    Shape shape(t->sizes().begin(), t->sizes().end());
    std::span<const std::byte> span(static_cast<const std::byte*>(t->data_ptr()), t->nbytes());
    FERRY_ASSIGN_OR_RETURN(Tensor wrapped, Tensor::Wrap(*dtype, std::move(shape), span, t));
    out.emplace(name, std::move(wrapped));
  }
  return out;
}

}  // namespace ferry::torchio

// The plugin's entry point, found by core/checkpoint.cpp with dlsym.
extern "C" __attribute__((visibility("default"))) const ferry::LegacyLoader* ferry_torchio_loader() {
  static const ferry::LegacyLoader loader = &ferry::torchio::LoadTorchPickle;
  return &loader;
}
