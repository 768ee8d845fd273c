// CUDA graphs (cuda_graph.h): at::cuda::CUDAGraph on a side stream where the LibTorch has CUDA,
// refusals elsewhere.
#include "daemon/runtime/cuda_graph.h"

#include <torch/version.h>

#include <exception>
#include <optional>
#include <string>
#include <vector>

#if FERRY_TORCH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace ferry::runtime {

#if FERRY_TORCH_CUDA

bool CudaGraphsAvailable() { return true; }

struct SideStream::Impl {
  c10::cuda::CUDAStream previous;
  c10::cuda::CUDAStream side;
};

namespace {

// One side stream per thread and device: the caching allocator keeps freed blocks for the
// stream that allocated them, so a fresh pool stream per call would strand cached memory on
// streams never used again.
c10::cuda::CUDAStream ThreadSideStream(c10::DeviceIndex device) {
  thread_local std::vector<std::optional<c10::cuda::CUDAStream>> streams;
  const auto i = static_cast<size_t>(device);
  if (streams.size() <= i) streams.resize(i + 1);
  if (!streams[i]) streams[i] = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device);
  return *streams[i];
}

}  // namespace

SideStream::SideStream(const at::Device& device) {
  if (!device.is_cuda()) return;
  const c10::DeviceIndex index = device.has_index() ? device.index() : c10::cuda::current_device();
  impl_ = std::make_unique<Impl>(Impl{c10::cuda::getCurrentCUDAStream(index), ThreadSideStream(index)});
  at::cuda::CUDAEvent queued;
  queued.record(impl_->previous);
  queued.block(impl_->side);
  c10::cuda::setCurrentCUDAStream(impl_->side);
}

SideStream::~SideStream() {
  if (!impl_) return;
  at::cuda::CUDAEvent done;
  done.record(impl_->side);
  done.block(impl_->previous);
  c10::cuda::setCurrentCUDAStream(impl_->previous);
}

struct CudaGraph::Impl {
  at::cuda::CUDAGraph graph;
};

CudaGraph::CudaGraph() : impl_(std::make_unique<Impl>()) {}
CudaGraph::~CudaGraph() = default;

Result<std::unique_ptr<CudaGraph>> CudaGraph::Capture(const at::Device& device, const std::function<Status()>& work) {
  if (!device.is_cuda()) {
    return Status::Unsupported("CUDA graphs need a CUDA device (the model is on " + device.str() + ")");
  }
  std::unique_ptr<CudaGraph> g(new CudaGraph());
  Status status;
  try {
    // Thread-local mode: another thread's unrelated CUDA calls neither join nor break it.
    g->impl_->graph.capture_begin(/*pool=*/{0, 0}, cudaStreamCaptureModeThreadLocal);
  } catch (const std::exception& e) {
    return Status::Internal(std::string("capturing a CUDA graph: ") + e.what());
  }
  try {
    status = work();
  } catch (const std::exception& e) {
    status = Status::Internal(std::string("capturing a CUDA graph: ") + e.what());
  }
  try {
    // Ends the capture whatever the work did, so the stream is usable again.
    g->impl_->graph.capture_end();
  } catch (const std::exception& e) {
    if (status.ok()) status = Status::Internal(std::string("capturing a CUDA graph: ") + e.what());
  }
  if (!status.ok()) return status;
  return g;
}

void CudaGraph::Replay() { impl_->graph.replay(); }

#else  // !FERRY_TORCH_CUDA

bool CudaGraphsAvailable() { return false; }

struct SideStream::Impl {};
SideStream::SideStream(const at::Device&) {}
SideStream::~SideStream() = default;

struct CudaGraph::Impl {};
CudaGraph::CudaGraph() = default;
CudaGraph::~CudaGraph() = default;

Result<std::unique_ptr<CudaGraph>> CudaGraph::Capture(const at::Device& device, const std::function<Status()>&) {
  return Status::Unsupported("CUDA graphs need a CUDA LibTorch (this build's LibTorch " + std::string(TORCH_VERSION) +
                             " has no CUDA; the model is on " + device.str() + ")");
}

void CudaGraph::Replay() {}

#endif  // FERRY_TORCH_CUDA

}  // namespace ferry::runtime
