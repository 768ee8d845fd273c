#include "core/dtype.h"

#include <array>
#include <utility>

namespace ferry {
namespace {

struct DTypeEntry {
  DType dtype;
  std::string_view name;
  int bits;
};

constexpr std::array<DTypeEntry, 22> kTable = {{
    {DType::kBool, "BOOL", 8},
    {DType::kU8, "U8", 8},
    {DType::kI8, "I8", 8},
    {DType::kI16, "I16", 16},
    {DType::kU16, "U16", 16},
    {DType::kF16, "F16", 16},
    {DType::kBF16, "BF16", 16},
    {DType::kI32, "I32", 32},
    {DType::kU32, "U32", 32},
    {DType::kF32, "F32", 32},
    {DType::kF64, "F64", 64},
    {DType::kI64, "I64", 64},
    {DType::kU64, "U64", 64},
    {DType::kC64, "C64", 64},
    {DType::kF8E4M3, "F8_E4M3", 8},
    {DType::kF8E5M2, "F8_E5M2", 8},
    {DType::kF8E8M0, "F8_E8M0", 8},
    {DType::kF8E4M3FNUZ, "F8_E4M3FNUZ", 8},
    {DType::kF8E5M2FNUZ, "F8_E5M2FNUZ", 8},
    {DType::kF4, "F4", 4},
    {DType::kF6E2M3, "F6_E2M3", 6},
    {DType::kF6E3M2, "F6_E3M2", 6},
}};

const DTypeEntry& Entry(DType d) { return kTable[static_cast<size_t>(d)]; }

}  // namespace

std::string_view DTypeName(DType dtype) { return Entry(dtype).name; }

std::optional<DType> ParseDType(std::string_view name) {
  for (const auto& e : kTable) {
    if (e.name == name) return e.dtype;
  }
  return std::nullopt;
}

int DTypeBits(DType dtype) { return Entry(dtype).bits; }

bool IsFloatingPoint(DType dtype) {
  switch (dtype) {
    case DType::kF16:
    case DType::kBF16:
    case DType::kF32:
    case DType::kF64:
    case DType::kF8E4M3:
    case DType::kF8E5M2: return true;
    default: return false;
  }
}

bool CanReadAsF32(DType dtype) { return IsFloatingPoint(dtype); }

bool CanWriteFromF32(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16 || dtype == DType::kF64;
}

}  // namespace ferry
