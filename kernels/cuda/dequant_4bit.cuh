// CUDA versions of kernels/dequant_4bit.h. Pointers are device pointers (code tables too);
// each call is asynchronous on `stream` (nullptr: the default stream) and returns a CUDA
// error code: 0 on success, cudaErrorInvalidValue (1) for an invalid blocksize /
// nested_blocksize or a negative count (nothing is launched then).
// Results are bit-identical to the CPU reference: one fp32 multiply per element (and one add
// for the nested absmax), rounded separately (__fmul_rn / __fadd_rn, never an FMA).
#pragma once

#include <cstdint>

namespace ferry::kernels::cuda {

// out[e] = code[nibble e] * absmax[e / blocksize]; layout as ferry::kernels::Dequantize4bit
// (first element in the high nibble). REQUIRES: buffer sizes checked with
// ferry::kernels::Validate4bitLayout.
int Dequantize4bit(const uint8_t* packed, int64_t n, const float* absmax, int64_t blocksize, const float* code,
                   float* out, void* stream = nullptr);

// absmax_out[i] = nested_code[absmax_q[i]] * nested_absmax[i / nested_blocksize] + offset.
// See ferry::kernels::DequantizeAbsmaxNested.
int DequantizeAbsmaxNested(const uint8_t* absmax_q, int64_t nblocks, const float* nested_code,
                           const float* nested_absmax, int64_t nested_blocksize, float offset, float* absmax_out,
                           void* stream = nullptr);

}  // namespace ferry::kernels::cuda
