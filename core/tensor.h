// Tensor: dtype, shape and bytes, without any dependency on LibTorch.
//
// A Tensor refers to bytes it does not necessarily own: a region of a memory-mapped
// file, an owned heap buffer, or the storage of a LibTorch tensor. `owner` keeps that
// backing store alive for as long as any copy of the Tensor exists, so wrapping a
// torch::Tensor (keep the at::Tensor inside a std::shared_ptr and pass it as owner) or a
// mapped file costs no copy. Data is little-endian, C order (row-major, contiguous).
//
// Tensors are cheap to copy (a shared_ptr and a shape). They are immutable through the
// const interface; mutable_data() is for buffers the caller created with Empty().
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"

namespace ferry {

using Shape = std::vector<int64_t>;

// Number of elements of `shape`, or an error when a dimension is negative or the product
// overflows int64. The empty shape is a scalar (1 element).
Result<int64_t> CheckedNumel(const Shape& shape);

// Bytes needed for `numel` elements of `dtype` (sub-byte types must end on a byte
// boundary), or an error on overflow / misalignment.
Result<uint64_t> CheckedByteSize(DType dtype, const Shape& shape);

// "[2, 3]"
std::string ShapeToString(const Shape& shape);

class Tensor {
 public:
  Tensor() = default;

  // Wraps `bytes` of existing memory. REQUIRES: bytes.size() == CheckedByteSize(dtype, shape).
  // `owner` is kept alive by every copy of the result (may be null for static memory).
  static Result<Tensor> Wrap(DType dtype, Shape shape, std::span<const std::byte> bytes,
                             std::shared_ptr<const void> owner);

  // A new zero-initialised buffer owned by the tensor.
  static Result<Tensor> Empty(DType dtype, Shape shape);

  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t numel() const;
  size_t nbytes() const { return bytes_.size(); }
  std::span<const std::byte> bytes() const { return bytes_; }
  const std::byte* data() const { return bytes_.data(); }
  template <typename T>
  const T* data_as() const {
    return reinterpret_cast<const T*>(bytes_.data());
  }

  // Writable access; only valid for tensors made by Empty() (returns nullptr otherwise).
  std::byte* mutable_data() const { return writable_ ? const_cast<std::byte*>(bytes_.data()) : nullptr; }
  template <typename T>
  T* mutable_data_as() const {
    return reinterpret_cast<T*>(mutable_data());
  }

  const std::shared_ptr<const void>& owner() const { return owner_; }

 private:
  DType dtype_ = DType::kF32;
  Shape shape_;
  std::span<const std::byte> bytes_;
  std::shared_ptr<const void> owner_;
  bool writable_ = false;
};

// Converts floating-point values to F32. Supports F32, F16, BF16, F64, F8_E4M3, F8_E5M2;
// other dtypes give kUnsupported. `out.size()` must equal t.numel().
Status ReadAsF32(const Tensor& t, std::span<float> out);

// Converts F32 values into `dtype` (F32, F16, BF16, F64), rounding to nearest even.
// `out.size()` must equal in.size() * element size.
Status WriteFromF32(std::span<const float> in, DType dtype, std::span<std::byte> out);

// A new tensor of `dtype` holding t's values (round to nearest even). Same dtype: a copy.
Result<Tensor> CastTensor(const Tensor& t, DType dtype);

}  // namespace ferry
