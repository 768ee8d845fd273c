// The baseline (SSE2) copy of xxHash and the run-time dispatch between it and the AVX2
// copy in hash_avx2.cpp.
#define FERRY_XXH3_OPS Xxh3BaselineOps
#include "kernels/xxh3_ops.inc"

#include "kernels/hash.h"

#include "kernels/cpu_features.h"

namespace ferry::kernels {
namespace {

const Xxh3_128Stream::Ops& OpsFor(HashImpl impl) {
  switch (impl) {
    case HashImpl::kAvx2: return detail::Xxh3Avx2Ops();
    case HashImpl::kBaseline: return detail::Xxh3BaselineOps();
    case HashImpl::kAuto: break;
  }
  static const Xxh3_128Stream::Ops& best = CpuHasAvx2() ? detail::Xxh3Avx2Ops() : detail::Xxh3BaselineOps();
  return best;
}

}  // namespace

bool HashImplAvailable(HashImpl impl) { return impl != HashImpl::kAvx2 || CpuHasAvx2(); }

HashImpl ResolvedHashImpl() { return CpuHasAvx2() ? HashImpl::kAvx2 : HashImpl::kBaseline; }

Hash128 Xxh3_128(const void* data, size_t size, HashImpl impl) {
  Hash128 h;
  OpsFor(impl).oneshot(data, size, &h.hi, &h.lo);
  return h;
}

Xxh3_128Stream::Xxh3_128Stream(HashImpl impl) : ops_(&OpsFor(impl)), state_(ops_->create()) { ops_->reset(state_); }

Xxh3_128Stream::~Xxh3_128Stream() {
  if (state_ != nullptr) ops_->destroy(state_);
}

Xxh3_128Stream::Xxh3_128Stream(Xxh3_128Stream&& other) noexcept : ops_(other.ops_), state_(other.state_) {
  other.state_ = nullptr;
}

Xxh3_128Stream& Xxh3_128Stream::operator=(Xxh3_128Stream&& other) noexcept {
  if (this != &other) {
    if (state_ != nullptr) ops_->destroy(state_);
    ops_ = other.ops_;
    state_ = other.state_;
    other.state_ = nullptr;
  }
  return *this;
}

void Xxh3_128Stream::Reset() { ops_->reset(state_); }

void Xxh3_128Stream::Update(const void* data, size_t size) {
  if (size > 0) ops_->update(state_, data, size);
}

Hash128 Xxh3_128Stream::Digest() const {
  Hash128 h;
  ops_->digest(state_, &h.hi, &h.lo);
  return h;
}

}  // namespace ferry::kernels
