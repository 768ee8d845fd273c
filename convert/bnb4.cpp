#include "convert/bnb4.h"

#include <cmath>
#include <cstring>

#include <nlohmann/json.hpp>

#include "core/text.h"
#include "kernels/dequant_4bit.h"

namespace ferry {
namespace {

constexpr std::string_view kStateInfix = ".quant_state.bitsandbytes__";

Result<DType> TorchDTypeName(const std::string& s) {
  if (s == "bfloat16") return DType::kBF16;
  if (s == "float16") return DType::kF16;
  if (s == "float32") return DType::kF32;
  return Status::Unsupported("quant_state dtype " + Quote(s) + " is not one of bfloat16, float16, float32");
}

Result<Tensor> Need(const Checkpoint& c, const std::string& key, DType dtype, int64_t numel, const std::string& where) {
  if (!c.Contains(key)) return Status::Corruption(where + ": missing companion tensor " + Quote(key));
  FERRY_ASSIGN_OR_RETURN(Tensor t, c.Get(key));
  if (t.dtype() != dtype) {
    return Status::Corruption(where + ": " + Quote(key) + " is " + std::string(DTypeName(t.dtype())) + ", expected " +
                              std::string(DTypeName(dtype)));
  }
  if (numel >= 0 && t.numel() != numel) {
    return Status::Corruption(where + ": " + Quote(key) + " has " + std::to_string(t.numel()) + " elements, expected " +
                              std::to_string(numel));
  }
  return t;
}

Result<QuantState4bit> ParseState(const Checkpoint& c, const std::string& state_key) {
  const std::string where = c.FileOf(state_key).string();
  QuantState4bit qs;
  const size_t pos = state_key.find(kStateInfix);
  qs.weight = state_key.substr(0, pos);
  const std::string type_suffix = state_key.substr(pos + kStateInfix.size());
  FERRY_ASSIGN_OR_RETURN(Tensor st, c.Get(state_key));
  if (st.dtype() != DType::kU8 || st.nbytes() > (1u << 20)) {
    return Status::Corruption(where + ": " + Quote(state_key) + " must be a small U8 tensor of JSON");
  }
  auto j = nlohmann::json::parse(reinterpret_cast<const char*>(st.data()),
                                 reinterpret_cast<const char*>(st.data()) + st.nbytes(), nullptr, false);
  if (j.is_discarded() || !j.is_object())
    return Status::Corruption(where + ": " + Quote(state_key) + " is not a JSON object");
  auto str = [&](const char* k) -> Result<std::string> {
    auto it = j.find(k);
    if (it == j.end() || !it->is_string())
      return Status::Corruption(where + ": " + Quote(state_key) + ": field " + Quote(k) + " missing or not a string");
    return it->get<std::string>();
  };
  FERRY_ASSIGN_OR_RETURN(qs.quant_type, str("quant_type"));
  if (qs.quant_type != "nf4" && qs.quant_type != "fp4") {
    return Status::Unsupported(where + ": " + Quote(state_key) + ": quant_type " + Quote(qs.quant_type) +
                               " is not nf4 or fp4");
  }
  if (qs.quant_type != type_suffix) {
    return Status::Corruption(where + ": " + Quote(state_key) + " says quant_type " + Quote(qs.quant_type));
  }
  FERRY_ASSIGN_OR_RETURN(std::string dtype_name, str("dtype"));
  auto dt = TorchDTypeName(dtype_name);
  if (!dt.ok()) return dt.status().WithContext(where + ": " + Quote(state_key));
  qs.dtype = *dt;
  auto bs = j.find("blocksize");
  if (bs == j.end() || !bs->is_number_unsigned())
    return Status::Corruption(where + ": " + Quote(state_key) + ": 'blocksize' missing");
  qs.blocksize = bs->get<int64_t>();
  if (qs.blocksize < 32 || qs.blocksize > 4096 || (qs.blocksize & (qs.blocksize - 1)) != 0) {
    return Status::Corruption(where + ": " + Quote(state_key) + ": blocksize " + std::to_string(qs.blocksize) +
                              " is not a power of two in [32, 4096]");
  }
  auto shape = j.find("shape");
  if (shape == j.end() || !shape->is_array() || shape->empty() || shape->size() > 8) {
    return Status::Corruption(where + ": " + Quote(state_key) + ": 'shape' missing or invalid");
  }
  for (const auto& d : *shape) {
    if (!d.is_number_unsigned() || d.get<uint64_t>() > (uint64_t{1} << 40)) {
      return Status::Corruption(where + ": " + Quote(state_key) + ": 'shape' entries must be non-negative integers");
    }
    qs.shape.push_back(d.get<int64_t>());
  }
  FERRY_ASSIGN_OR_RETURN(int64_t n, CheckedNumel(qs.shape));
  qs.nested = j.contains("nested_blocksize") || c.Contains(qs.weight + ".nested_absmax");
  if (qs.nested) {
    auto nb = j.find("nested_blocksize");
    auto off = j.find("nested_offset");
    if (nb == j.end() || !nb->is_number_unsigned() || off == j.end() || !off->is_number()) {
      return Status::Corruption(where + ": " + Quote(state_key) +
                                ": double quantization needs 'nested_blocksize' and 'nested_offset'");
    }
    qs.nested_blocksize = nb->get<int64_t>();
    if (qs.nested_blocksize < 1 || qs.nested_blocksize > 65536) {
      return Status::Corruption(where + ": " + Quote(state_key) + ": nested_blocksize out of range");
    }
    qs.nested_offset = off->get<float>();
    if (!std::isfinite(qs.nested_offset))
      return Status::Corruption(where + ": " + Quote(state_key) + ": nested_offset is not finite");
  }
  // Validate companions.
  const int64_t nblocks = (n + qs.blocksize - 1) / qs.blocksize;
  FERRY_ASSIGN_OR_RETURN(Tensor packed, c.Get(qs.weight));
  if (static_cast<int64_t>(packed.nbytes()) != (n + 1) / 2) {
    return Status::Corruption(where + ": " + Quote(qs.weight) + " holds " + std::to_string(packed.nbytes()) +
                              " bytes but shape " + ShapeToString(qs.shape) + " packs into " +
                              std::to_string((n + 1) / 2));
  }
  FERRY_RETURN_IF_ERROR(Need(c, qs.weight + ".absmax", qs.nested ? DType::kU8 : DType::kF32, nblocks, where).status());
  FERRY_RETURN_IF_ERROR(Need(c, qs.weight + ".quant_map", DType::kF32, 16, where).status());
  qs.aux_keys = {state_key, qs.weight + ".absmax", qs.weight + ".quant_map"};
  if (qs.nested) {
    const int64_t nested_blocks = (nblocks + qs.nested_blocksize - 1) / qs.nested_blocksize;
    FERRY_RETURN_IF_ERROR(Need(c, qs.weight + ".nested_absmax", DType::kF32, nested_blocks, where).status());
    FERRY_RETURN_IF_ERROR(Need(c, qs.weight + ".nested_quant_map", DType::kF32, 256, where).status());
    qs.aux_keys.push_back(qs.weight + ".nested_absmax");
    qs.aux_keys.push_back(qs.weight + ".nested_quant_map");
  }
  return qs;
}

}  // namespace

Result<std::map<std::string, QuantState4bit>> FindQuantized4bit(const Checkpoint& ckpt) {
  std::map<std::string, QuantState4bit> out;
  for (const auto& name : ckpt.names()) {
    if (name.find(kStateInfix) == std::string::npos) continue;
    FERRY_ASSIGN_OR_RETURN(QuantState4bit qs, ParseState(ckpt, name));
    if (out.count(qs.weight)) {
      return Status::Corruption(ckpt.FileOf(name).string() + ": weight " + Quote(qs.weight) +
                                " has more than one quant_state");
    }
    out.emplace(qs.weight, std::move(qs));
  }
  return out;
}

std::set<std::string> QuantAuxKeys(const std::map<std::string, QuantState4bit>& states) {
  std::set<std::string> keys;
  for (const auto& [w, qs] : states) keys.insert(qs.aux_keys.begin(), qs.aux_keys.end());
  return keys;
}

Status Dequantize4bitWeight(const Checkpoint& c, const QuantState4bit& qs, std::span<float> out) {
  FERRY_ASSIGN_OR_RETURN(int64_t n, CheckedNumel(qs.shape));
  if (static_cast<int64_t>(out.size()) != n) {
    return Status::InvalidArgument("Dequantize4bitWeight: output for " + Quote(qs.weight) + " has " +
                                   std::to_string(out.size()) + " elements, expected " + std::to_string(n));
  }
  const int64_t nblocks = (n + qs.blocksize - 1) / qs.blocksize;
  FERRY_ASSIGN_OR_RETURN(Tensor packed, c.Get(qs.weight));
  FERRY_ASSIGN_OR_RETURN(Tensor code, c.Get(qs.weight + ".quant_map"));
  FERRY_ASSIGN_OR_RETURN(Tensor absmax_t, c.Get(qs.weight + ".absmax"));
  // Safetensors data may sit at any offset: copy the small F32 tables to aligned memory.
  std::vector<float> code_f(16);
  std::memcpy(code_f.data(), code.data(), 64);
  std::vector<float> absmax(static_cast<size_t>(nblocks));
  if (qs.nested) {
    FERRY_ASSIGN_OR_RETURN(Tensor nested_code, c.Get(qs.weight + ".nested_quant_map"));
    FERRY_ASSIGN_OR_RETURN(Tensor nested_absmax, c.Get(qs.weight + ".nested_absmax"));
    std::vector<float> ncode(256), nabs(static_cast<size_t>(nested_absmax.numel()));
    std::memcpy(ncode.data(), nested_code.data(), 256 * 4);
    std::memcpy(nabs.data(), nested_absmax.data(), nabs.size() * 4);
    auto rc = kernels::DequantizeAbsmaxNested(absmax_t.data_as<uint8_t>(), nblocks, ncode.data(), nabs.data(),
                                              qs.nested_blocksize, qs.nested_offset, absmax.data());
    if (rc != kernels::Dequant4bitStatus::kOk) {
      return Status::Corruption(c.FileOf(qs.weight).string() + ": cannot dequantize absmax of " + Quote(qs.weight) +
                                ": " + kernels::Dequant4bitStatusMessage(rc));
    }
  } else {
    std::memcpy(absmax.data(), absmax_t.data(), absmax.size() * 4);
  }
  // bitsandbytes decodes with its built-in table (FP4 code 8 is -0.0 there, +0.0 in the stored
  // quant_map): use it when the stored map equals it by value, so the output matches bit for bit.
  const float* table = kernels::Select4bitCode(qs.quant_type, code_f.data());
  auto rc = kernels::Dequantize4bit(packed.data_as<uint8_t>(), n, absmax.data(), qs.blocksize, table, out.data());
  if (rc != kernels::Dequant4bitStatus::kOk) {
    return Status::Corruption(c.FileOf(qs.weight).string() + ": cannot dequantize " + Quote(qs.weight) + ": " +
                              kernels::Dequant4bitStatusMessage(rc));
  }
  return Status::OK();
}

Result<std::vector<float>> Dequantize4bitAsLoaded(const Checkpoint& c, const QuantState4bit& qs) {
  FERRY_ASSIGN_OR_RETURN(int64_t n, CheckedNumel(qs.shape));
  std::vector<float> w(static_cast<size_t>(n));
  FERRY_RETURN_IF_ERROR(Dequantize4bitWeight(c, qs, w));
  if (qs.dtype == DType::kF32) return w;
  // Round to the quant state's dtype and back.
  std::vector<std::byte> rounded(w.size() * static_cast<size_t>(DTypeBits(qs.dtype) / 8));
  FERRY_RETURN_IF_ERROR(WriteFromF32(w, qs.dtype, rounded));
  FERRY_ASSIGN_OR_RETURN(Tensor t, Tensor::Wrap(qs.dtype, {n}, rounded, nullptr));
  FERRY_RETURN_IF_ERROR(ReadAsF32(t, w));
  return w;
}

}  // namespace ferry
