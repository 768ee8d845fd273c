// Element types of tensors, with the names safetensors uses on disk.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace ferry {

enum class DType : uint8_t {
  kBool,
  kU8,
  kI8,
  kI16,
  kU16,
  kF16,
  kBF16,
  kI32,
  kU32,
  kF32,
  kF64,
  kI64,
  kU64,
  kC64,
  kF8E4M3,
  kF8E5M2,
  kF8E8M0,
  kF8E4M3FNUZ,
  kF8E5M2FNUZ,
  kF4,
  kF6E2M3,
  kF6E3M2,
};

// The safetensors spelling ("F32", "BF16", "F8_E4M3", ...).
std::string_view DTypeName(DType dtype);

// Parses a safetensors dtype name; nullopt when unknown.
std::optional<DType> ParseDType(std::string_view name);

// Bits per element (4 for F4, 6 for F6_*).
int DTypeBits(DType dtype);

// True for F16, BF16, F32, F64 and the F8 formats Ferry can read as numbers.
bool IsFloatingPoint(DType dtype);

// True when Ferry can convert values of this type to and from F32 (F32, F16, BF16, F64;
// F8_E4M3 and F8_E5M2 can be read but not written).
bool CanReadAsF32(DType dtype);
bool CanWriteFromF32(DType dtype);

}  // namespace ferry
