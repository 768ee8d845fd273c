// LoRA / DoRA merge kernels (CPU reference; CUDA versions in cuda/lora_merge.cuh).
//
// Merge maths (peft/tuners/lora/layer.py): W' = W + scaling * transpose(B @ A, fan_in_fan_out).
// All kernels work on fp32 arrays; the caller casts 16-bit weights to fp32 first (core/tensor.h),
// merges, and rounds ONCE when it writes the result back.
//
// Arithmetic, exactly (the same on every thread count and on the CUDA kernels):
//   d       = ((B[o,0]*A[0,i] + B[o,1]*A[1,i]) + ...) + B[o,r-1]*A[r-1,i]
//             an fp32 sum in the natural order k = 0..r-1, starting from 0.0f,
//   W[o,i] += scaling * d        (one fp32 multiply, one fp32 add).
// Every product and sum is rounded separately (the file is built with -ffp-contract=off, so
// no FMA contraction), which makes the result deterministic and independent of threading and
// of the instruction set the CPU kernels pick at load time. One caveat, as in IEEE 754: where
// two NaNs with different payloads or signs meet in one operation, which of them the result
// carries is unspecified (it is always a quiet NaN).
//
// Layouts are dense, row-major, without padding. Pointers must not alias each other except
// where a contract says so. All functions are thread-safe (no shared state); concurrent calls
// must not write the same W. A worker thread that cannot be started is replaced by work on
// the calling thread; the only exception that can escape is std::bad_alloc from the small
// temporaries (r floats per thread, r*out floats for fan_in_fan_out, out doubles for DoRA).
#pragma once

#include <cstdint>
#include <vector>

namespace ferry::kernels {

// Linear layer: W [out, in] += scaling * (B [out, r] @ A [r, in]).
// A: lora_A.weight, [r, in]. B: lora_B.weight, [out, r]. W: fp32 base weight, updated in place.
// num_threads: worker threads (std::thread over row ranges); values < 1 mean 1. The result is
// bit-identical for every thread count.
// REQUIRES: out, in, r >= 0; W does not overlap A or B. Zero-sized inputs are a no-op.
void LoraDeltaAccumulate(const float* A, const float* B, int64_t out, int64_t in, int64_t r, float scaling, float* W,
                         int num_threads = 1);

// fan_in_fan_out layer (GPT-2 Conv1D): the base weight is stored transposed, W [in, out], and
// W += scaling * (B @ A)^T, i.e. W[i,o] += scaling * sum_k B[o,k] * A[k,i]. A [r, in], B [out, r].
// Same arithmetic as LoraDeltaAccumulate (element (i,o) here equals element (o,i) there, bit
// for bit). Allocates a temporary r*out floats (B transposed).
// REQUIRES: as LoraDeltaAccumulate.
void LoraDeltaAccumulateFanInFanOut(const float* A, const float* B, int64_t out, int64_t in, int64_t r, float scaling,
                                    float* W, int num_threads = 1);

// Embedding layer: A = lora_embedding_A [r, num_embeddings], B = lora_embedding_B [dim, r],
// W = embedding weight [num_embeddings, dim]; W += scaling * (B @ A)^T. This is the
// fan_in_fan_out update with out = dim, in = num_embeddings.
// REQUIRES: as LoraDeltaAccumulate.
void LoraEmbeddingDeltaAccumulate(const float* A, const float* B, int64_t num_embeddings, int64_t dim, int64_t r,
                                  float scaling, float* W, int num_threads = 1);

// 16-bit storage types for the fused merge.
enum class Float16Kind { kF16, kBF16 };

// Fused merge of a 16-bit weight, in one cache-resident pass per block of rows:
//   dst[o, i] = round16(decode16(W[o, i]) + scaling * d[o, i]),  W and dst [out, in],
// with d exactly as in LoraDeltaAccumulate and round16 round-to-nearest-even (NaN kept).
// The result is bit-identical to: cast W to fp32, LoraDeltaAccumulate, cast back with
// CastF32ToF16/CastF32ToBF16 — without materialising the fp32 matrix (the memory traffic
// is one read and one write of 2 bytes per element). W and dst need no alignment (a
// safetensors tensor may start at an odd offset). num_threads as in LoraDeltaAccumulate.
// REQUIRES: out, in, r >= 0; dst does not overlap W, A or B.
void LoraMergeRows16(const uint16_t* W, Float16Kind kind, const float* A, const float* B, int64_t out, int64_t in,
                     int64_t r, float scaling, uint16_t* dst, int num_threads = 1);

// LoraMergeRows16 a range of rows at a time, for a caller that uses each range while it is
// still in cache (the receiver hashes it and writes it out): the shared factor is prepared
// once, here, not per range. Merging every row in any ranges gives LoraMergeRows16's bits. A
// and B must outlive the merger; W is the whole [out, in] matrix.
class LoraRowMerger16 {
 public:
  LoraRowMerger16(Float16Kind kind, const float* A, const float* B, int64_t out, int64_t in, int64_t r, float scaling);
  // Rows [row_begin, row_end) (clamped to [0, out)) of the merged matrix, made from the same
  // rows of W, into dst_rows: row row_begin at dst_rows, the next `in` elements later, and so
  // on (so a whole output matrix takes dst + row_begin * in). dst_rows must hold them all.
  void Merge(const uint16_t* W, uint16_t* dst_rows, int64_t row_begin, int64_t row_end, int num_threads = 1) const;

 private:
  Float16Kind kind_;
  const float* a_;
  const float* b_;
  int64_t out_, in_, r_;
  float scaling_;
  std::vector<float> panel_;  // BF16: A with the columns of each vector group permuted
};

// DoRA: W' = (m / ||W + delta||) * (W + delta), where W_merged already holds W + delta.
// Without fan_in_fan_out W_merged is [out, in] and the norm is taken per output row over the
// input axis; with fan_in_fan_out it is stored [in, out] and the norm is per output column
// (over the input axis, i.e. over rows), the factor applied per output column.
// Arithmetic: the squared norm is summed in double (natural order over the input index), the
// factor is computed in double as m[o] / sqrt(sumsq) and rounded to fp32, then every element is
// multiplied by it in fp32. A row (column) whose norm is 0 is left all-zero (PEFT would produce
// NaN there). magnitude: lora_magnitude_vector, [out].
// REQUIRES: out, in >= 0; magnitude does not overlap W_merged.
void DoraApply(float* W_merged, const float* magnitude, int64_t out, int64_t in, bool fan_in_fan_out);

}  // namespace ferry::kernels
