// The edge between Ferry's types and LibTorch's: dtypes, zero-copy tensor views both ways,
// c10::Error turned into Status, threads and the BLAS LibTorch runs on.
//
// LibTorch types stay inside daemon/: what crosses into sync/ and store/ is a ferry::Tensor
// whose owner keeps the at::Tensor (or the mapped file, or the snapshot) alive.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "core/dtype.h"
#include "core/status.h"
#include "core/tensor.h"

namespace ferry::runtime {

// F32, F16, BF16, F64, I64, I32, I16, I8, U8, Bool. kUnsupported for the others.
Result<at::ScalarType> TorchDType(DType dtype);
Result<DType> CoreDType(at::ScalarType type);

// `t` as an at::Tensor on `device`. On the CPU it is a view of t's bytes (no copy; the view
// keeps t's owner alive and must never be written: mapped weights are read-only pages); on
// another device it is one copy there. kUnsupported for dtypes LibTorch lacks.
Result<at::Tensor> ToTorch(const Tensor& t, const at::Device& device);

// A ferry::Tensor view of `t` (made contiguous and moved to the CPU first when it is not
// already): the bytes are t's own storage when possible, and the result's owner keeps it
// alive. REQUIRES: nobody writes `t` while the view is used.
Result<Tensor> ToCore(const at::Tensor& t);

// Runs `fn` (returning T, Result<T> or Status) and turns a c10::Error or std::exception thrown
// inside LibTorch into kInternal with `what` in front of its first line.
Status TorchError(std::string_view what, const std::exception& e);

namespace internal {
template <typename T>
struct AsResult {
  using type = Result<T>;
};
template <typename T>
struct AsResult<Result<T>> {
  using type = Result<T>;
};
template <>
struct AsResult<Status> {
  using type = Status;
};
}  // namespace internal

template <typename Fn>
auto GuardTorch(std::string_view what, Fn&& fn) -> typename internal::AsResult<decltype(fn())>::type {
  try {
    return fn();
  } catch (const std::exception& e) {
    return TorchError(what, e);
  }
}

// Intra-op threads for LibTorch (Debian's build starts with one). `threads` <= 0: one per
// hardware thread. Returns the number set. Also turns OpenMP's dynamic thread adjustment off
// for the calling thread, the one that then runs the model (OMP_DYNAMIC=true): with it, on a loaded machine, libgomp
// gives a parallel region fewer threads than OpenBLAS's threaded GEMM asked for, and the one thread it runs spins
// forever waiting for a partner that never starts (a hang, seen with Debian's libopenblas0-openmp).
int SetTorchThreads(int threads);

// Makes the C heap keep the memory that large tensors free for the next ones. glibc serves each
// block over its mmap threshold (32 MB at most while it adapts) from a mapping of its own, unmapped
// again on free, and hands the heap's free top back to the kernel: a batch-16 prefill's 40 MB
// activations were then mapped, faulted in and zeroed page by page at every layer (the kernel's
// clear_page took 9% of a batch-16 generation's cycles; the prefill ran 1.2x slower). Raises both
// thresholds to 1 GiB for the whole process, so the heap stays at its high-water mark.
void KeepFreedTensorMemory();

// Whether OpenMP's dynamic thread adjustment is on (omp_get_dynamic), or nullopt when no
// OpenMP runtime is loaded.
std::optional<bool> OpenMpDynamic();

// The BLAS library LibTorch's sgemm resolves to (a path), and whether it is the netlib
// reference implementation (15x slower; install libopenblas0-openmp).
struct BlasInfo {
  std::string library;
  bool reference = false;
};
BlasInfo LoadedBlas();

}  // namespace ferry::runtime
