// CUDA graphs for the generator's decoding step: the step's kernels captured once and replayed
// in place, so a step costs one launch instead of one per kernel (a 0.5B model's step launches
// several hundred; on a GPU their launch overhead, not the arithmetic, sets the decoding pace).
//
// As PyTorch's torch.cuda.graph does it: the work runs on a side stream (capture needs a stream
// other than the default one), eagerly at least once before the capture (cuBLAS and the
// allocator set up outside the graph), then is captured into a graph whose tensors come from a
// private memory pool, and replayed. A replay reads and writes the very tensors the capture saw:
// inputs are copied into them, outputs read from them, and the host-side state the captured code
// kept (for example the KV cache's filled length) is the caller's to advance.
//
// Built for real against a CUDA LibTorch (FERRY_TORCH_CUDA, scripts/build-pytorch.sh); elsewhere
// (Debian's CPU LibTorch) CudaGraphsAvailable() is false, SideStream does nothing and Capture
// is refused saying why.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <memory>

#include "core/status.h"

namespace ferry::runtime {

// This build's LibTorch can capture CUDA graphs (a CUDA LibTorch).
bool CudaGraphsAvailable();

// While it lives, the current stream of `device` is a stream of its own (the same one for every
// SideStream of the thread and device), ordered after the work queued before it; when it ends,
// the stream that was current is ordered after everything queued on the side stream and is
// current again. Does nothing for a CPU device or where !CudaGraphsAvailable().
class SideStream {
 public:
  explicit SideStream(const at::Device& device);
  ~SideStream();
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A captured graph.
class CudaGraph {
 public:
  // Captures the kernels `work` queues on the current stream of `device` (nothing runs: a
  // capture only records). REQUIRES: a SideStream for `device` is current, and the same work at
  // the same shapes ran eagerly on it before. The tensors `work` allocates come from the graph's
  // own memory pool and stay valid (holding its outputs) as long as they are referenced.
  // Errors: kUnsupported where !CudaGraphsAvailable() or `device` is not CUDA; `work`'s own
  // error; kInternal naming LibTorch's message when the capture fails (an operation that waits
  // for the host or reads device memory on the host cannot be captured).
  static Result<std::unique_ptr<CudaGraph>> Capture(const at::Device& device, const std::function<Status()>& work);
  ~CudaGraph();
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;

  // Queues the captured kernels on the current stream, in place.
  void Replay();

 private:
  CudaGraph();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry::runtime
