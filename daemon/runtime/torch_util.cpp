#include "daemon/runtime/torch_util.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <malloc.h>

#include <memory>
#include <thread>
#include <vector>

namespace ferry::runtime {

Result<at::ScalarType> TorchDType(DType dtype) {
  switch (dtype) {
    case DType::kF32: return at::kFloat;
    case DType::kF16: return at::kHalf;
    case DType::kBF16: return at::kBFloat16;
    case DType::kF64: return at::kDouble;
    case DType::kI64: return at::kLong;
    case DType::kI32: return at::kInt;
    case DType::kI16: return at::kShort;
    case DType::kI8: return at::kChar;
    case DType::kU8: return at::kByte;
    case DType::kBool: return at::kBool;
    default: break;
  }
  return Status::Unsupported("dtype " + std::string(DTypeName(dtype)) + " has no LibTorch equivalent");
}

Result<DType> CoreDType(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return DType::kF32;
    case at::kHalf: return DType::kF16;
    case at::kBFloat16: return DType::kBF16;
    case at::kDouble: return DType::kF64;
    case at::kLong: return DType::kI64;
    case at::kInt: return DType::kI32;
    case at::kShort: return DType::kI16;
    case at::kChar: return DType::kI8;
    case at::kByte: return DType::kU8;
    case at::kBool: return DType::kBool;
    default: break;
  }
  return Status::Unsupported(std::string("LibTorch dtype ") + c10::toString(type) + " has no safetensors equivalent");
}

Result<at::Tensor> ToTorch(const Tensor& t, const at::Device& device) {
  FERRY_ASSIGN_OR_RETURN(at::ScalarType type, TorchDType(t.dtype()));
  return GuardTorch("wrapping a tensor", [&]() -> at::Tensor {
    std::vector<int64_t> sizes(t.shape().begin(), t.shape().end());
    // The deleter holds t's owner: the view keeps the mapping / snapshot buffer alive.
    auto owner = std::make_shared<std::shared_ptr<const void>>(t.owner());
    at::Tensor view = at::from_blob(
        const_cast<std::byte*>(t.data()), sizes, [owner](void*) mutable { owner.reset(); },
        at::TensorOptions().dtype(type).device(at::kCPU));
    if (t.nbytes() == 0) view = at::empty(sizes, at::TensorOptions().dtype(type));
    if (!device.is_cpu()) return view.to(device);
    return view;
  });
}

Result<Tensor> ToCore(const at::Tensor& t) {
  FERRY_ASSIGN_OR_RETURN(DType dtype, CoreDType(t.scalar_type()));
  FERRY_ASSIGN_OR_RETURN(at::Tensor cpu,
                         GuardTorch("reading a tensor", [&] { return t.detach().to(at::kCPU).contiguous(); }));
  auto holder = std::make_shared<at::Tensor>(std::move(cpu));
  Shape shape(holder->sizes().begin(), holder->sizes().end());
  std::span<const std::byte> bytes(static_cast<const std::byte*>(holder->data_ptr()), holder->nbytes());
  return Tensor::Wrap(dtype, std::move(shape), bytes, holder);
}

Status TorchError(std::string_view what, const std::exception& e) {
  std::string msg = e.what();
  if (auto nl = msg.find('\n'); nl != std::string::npos) msg.resize(nl);
  return Status::Internal(std::string(what) + ": " + msg);
}

int SetTorchThreads(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  // Looked up, not linked: the OpenMP runtime is LibTorch's and OpenBLAS's (libgomp on Debian).
  using SetDynamic = void (*)(int);
  if (auto set_dynamic = reinterpret_cast<SetDynamic>(::dlsym(RTLD_DEFAULT, "omp_set_dynamic"))) set_dynamic(0);
  at::set_num_threads(threads);
  return threads;
}

void KeepFreedTensorMemory() {
  constexpr int kThreshold = 1 << 30;
  ::mallopt(M_MMAP_THRESHOLD, kThreshold);
  ::mallopt(M_TRIM_THRESHOLD, kThreshold);
}

std::optional<bool> OpenMpDynamic() {
  using GetDynamic = int (*)();
  auto get_dynamic = reinterpret_cast<GetDynamic>(::dlsym(RTLD_DEFAULT, "omp_get_dynamic"));
  if (!get_dynamic) return std::nullopt;
  return get_dynamic() != 0;
}

BlasInfo LoadedBlas() {
  BlasInfo info;
  Dl_info dl{};
  void* sym = ::dlsym(RTLD_DEFAULT, "sgemm_");
  if (sym && ::dladdr(sym, &dl) && dl.dli_fname) {
    char resolved[4096];
    info.library = ::realpath(dl.dli_fname, resolved) ? resolved : dl.dli_fname;
  }
  // Debian's reference BLAS lives in .../blas/libblas.so.3; OpenBLAS in .../openblas-*/.
  info.reference = info.library.find("/blas/") != std::string::npos;
  return info;
}

}  // namespace ferry::runtime
