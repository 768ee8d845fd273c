// CUDA versions of kernels/cast.h. Pointers are device pointers; each call is
// asynchronous on `stream` (nullptr: the default stream). Results are bit-identical to
// the CPU reference (tests/kernels/cast_cuda_test.cpp checks that).
#pragma once

#include <cstddef>
#include <cstdint>

namespace ferry::kernels::cuda {

// Returns the number of visible CUDA devices (0 when there is no driver or device).
int DeviceCount();

// Each returns a CUDA error code (0 = success).
int CastF16ToF32(const uint16_t* src, float* dst, size_t n, void* stream = nullptr);
int CastBF16ToF32(const uint16_t* src, float* dst, size_t n, void* stream = nullptr);
int CastF32ToF16(const float* src, uint16_t* dst, size_t n, void* stream = nullptr);
int CastF32ToBF16(const float* src, uint16_t* dst, size_t n, void* stream = nullptr);

}  // namespace ferry::kernels::cuda
