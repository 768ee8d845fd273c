#include "core/tensor.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <new>

#include "kernels/cast.h"

namespace ferry {

Result<int64_t> CheckedNumel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0)
      return Status::Corruption("negative dimension " + std::to_string(d) + " in shape " + ShapeToString(shape));
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d) {
      return Status::Corruption("shape " + ShapeToString(shape) + " overflows 64-bit element count");
    }
    n *= d;
  }
  return n;
}

Result<uint64_t> CheckedByteSize(DType dtype, const Shape& shape) {
  FERRY_ASSIGN_OR_RETURN(int64_t n, CheckedNumel(shape));
  const uint64_t bits_per = static_cast<uint64_t>(DTypeBits(dtype));
  const uint64_t un = static_cast<uint64_t>(n);
  if (un != 0 && un > std::numeric_limits<uint64_t>::max() / bits_per) {
    return Status::Corruption("shape " + ShapeToString(shape) + " of " + std::string(DTypeName(dtype)) +
                              " overflows 64-bit byte count");
  }
  const uint64_t bits = un * bits_per;
  if (bits % 8 != 0) {
    return Status::Corruption(std::string(DTypeName(dtype)) + " tensor of shape " + ShapeToString(shape) +
                              " does not end on a byte boundary");
  }
  return bits / 8;
}

std::string ShapeToString(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

Result<Tensor> Tensor::Wrap(DType dtype, Shape shape, std::span<const std::byte> bytes,
                            std::shared_ptr<const void> owner) {
  FERRY_ASSIGN_OR_RETURN(uint64_t need, CheckedByteSize(dtype, shape));
  if (need != bytes.size()) {
    return Status::InvalidArgument(std::string(DTypeName(dtype)) + " " + ShapeToString(shape) + " needs " +
                                   std::to_string(need) + " bytes, got " + std::to_string(bytes.size()));
  }
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.bytes_ = bytes;
  t.owner_ = std::move(owner);
  return t;
}

Result<Tensor> Tensor::Empty(DType dtype, Shape shape) {
  FERRY_ASSIGN_OR_RETURN(uint64_t need, CheckedByteSize(dtype, shape));
  if (need > std::numeric_limits<size_t>::max() - 64) {
    return Status::InvalidArgument("cannot allocate " + std::to_string(need) + " bytes for " + ShapeToString(shape));
  }
  // 64-byte aligned storage so vector kernels and casts to wider types are safe.
  const size_t alloc = static_cast<size_t>((need + 63) / 64 * 64);
  auto* raw = static_cast<std::byte*>(::operator new[](alloc == 0 ? 64 : alloc, std::align_val_t{64}, std::nothrow));
  if (raw == nullptr) {
    return Status::IOError("out of memory allocating " + std::to_string(need) + " bytes for " + ShapeToString(shape));
  }
  std::shared_ptr<std::byte[]> buf(raw, [](std::byte* p) { ::operator delete[](p, std::align_val_t{64}); });
  std::memset(buf.get(), 0, alloc == 0 ? 64 : alloc);
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.bytes_ = std::span<const std::byte>(buf.get(), static_cast<size_t>(need));
  t.owner_ = std::shared_ptr<const void>(buf, buf.get());
  t.writable_ = true;
  return t;
}

int64_t Tensor::numel() const {
  auto n = CheckedNumel(shape_);
  return n.ok() ? *n : 0;
}

namespace {

// Safetensors data may start at any byte offset, so 2-byte elements are not always
// aligned: casts go through an aligned bounce buffer in that case (no misaligned loads).
constexpr size_t kBounceElems = 4096;

bool Aligned(const void* p, size_t align) { return reinterpret_cast<uintptr_t>(p) % align == 0; }

void Cast16ToF32(DType dtype, const std::byte* src, float* dst, size_t n) {
  auto cast = dtype == DType::kF16 ? kernels::CastF16ToF32 : kernels::CastBF16ToF32;
  if (Aligned(src, alignof(uint16_t))) {
    cast(reinterpret_cast<const uint16_t*>(src), dst, n);
    return;
  }
  uint16_t bounce[kBounceElems];
  for (size_t i = 0; i < n; i += kBounceElems) {
    const size_t k = std::min(kBounceElems, n - i);
    std::memcpy(bounce, src + i * 2, k * 2);
    cast(bounce, dst + i, k);
  }
}

void CastF32To16(DType dtype, const float* src, std::byte* dst, size_t n) {
  auto cast = dtype == DType::kF16 ? kernels::CastF32ToF16 : kernels::CastF32ToBF16;
  if (Aligned(dst, alignof(uint16_t))) {
    cast(src, reinterpret_cast<uint16_t*>(dst), n);
    return;
  }
  uint16_t bounce[kBounceElems];
  for (size_t i = 0; i < n; i += kBounceElems) {
    const size_t k = std::min(kBounceElems, n - i);
    cast(src + i, bounce, k);
    std::memcpy(dst + i * 2, bounce, k * 2);
  }
}

}  // namespace

Status ReadAsF32(const Tensor& t, std::span<float> out) {
  const size_t n = static_cast<size_t>(t.numel());
  if (out.size() != n)
    return Status::InvalidArgument("ReadAsF32: output has " + std::to_string(out.size()) + " elements, tensor has " +
                                   std::to_string(n));
  auto need = CheckedByteSize(t.dtype(), t.shape());
  if (!need.ok() || *need != t.nbytes()) {
    return Status::InvalidArgument("ReadAsF32: tensor of " + ShapeToString(t.shape()) + " holds " +
                                   std::to_string(t.nbytes()) + " bytes, which does not match its shape");
  }
  if (!CanReadAsF32(t.dtype())) {
    return Status::Unsupported("cannot read " + std::string(DTypeName(t.dtype())) + " values as F32");
  }
  if (n == 0) return Status::OK();
  switch (t.dtype()) {
    case DType::kF32: std::memcpy(out.data(), t.data(), n * 4); return Status::OK();
    case DType::kF16:
    case DType::kBF16: Cast16ToF32(t.dtype(), t.data(), out.data(), n); return Status::OK();
    case DType::kF8E4M3: kernels::CastF8E4M3ToF32(t.data_as<uint8_t>(), out.data(), n); return Status::OK();
    case DType::kF8E5M2: kernels::CastF8E5M2ToF32(t.data_as<uint8_t>(), out.data(), n); return Status::OK();
    case DType::kF64: {
      for (size_t i = 0; i < n; ++i) {
        double d;
        std::memcpy(&d, t.data() + i * 8, 8);
        out[i] = static_cast<float>(d);
      }
      return Status::OK();
    }
    default: return Status::Unsupported("cannot read " + std::string(DTypeName(t.dtype())) + " values as F32");
  }
}

Status WriteFromF32(std::span<const float> in, DType dtype, std::span<std::byte> out) {
  if (!CanWriteFromF32(dtype))
    return Status::Unsupported("cannot write F32 values as " + std::string(DTypeName(dtype)));
  const size_t n = in.size();
  const size_t esize = static_cast<size_t>(DTypeBits(dtype) / 8);
  if (out.size() != n * esize) return Status::InvalidArgument("WriteFromF32: output size mismatch");
  if (n == 0) return Status::OK();
  switch (dtype) {
    case DType::kF32: std::memcpy(out.data(), in.data(), n * 4); break;
    case DType::kF16:
    case DType::kBF16: CastF32To16(dtype, in.data(), out.data(), n); break;
    case DType::kF64:
      for (size_t i = 0; i < n; ++i) {
        double d = in[i];
        std::memcpy(out.data() + i * 8, &d, 8);
      }
      break;
    default: break;
  }
  return Status::OK();
}

Result<Tensor> CastTensor(const Tensor& t, DType dtype) {
  FERRY_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(dtype, t.shape()));
  if (t.dtype() == dtype) {
    if (t.nbytes() != out.nbytes()) return Status::InvalidArgument("CastTensor: tensor bytes do not match its shape");
    if (t.nbytes() != 0) std::memcpy(out.mutable_data(), t.data(), t.nbytes());
    return out;
  }
  const size_t n = static_cast<size_t>(t.numel());
  std::vector<float> tmp(n);
  FERRY_RETURN_IF_ERROR(ReadAsF32(t, tmp));
  FERRY_RETURN_IF_ERROR(WriteFromF32(tmp, dtype, std::span<std::byte>(out.mutable_data(), out.nbytes())));
  return out;
}

}  // namespace ferry
