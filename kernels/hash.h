// XXH3-128: the streaming hash under every digest Ferry computes (store/store.h defines the
// digests themselves).
//
// The xxHash code is compiled twice, inline (XXH_INLINE_ALL): once for baseline x86-64
// (SSE2) and once with AVX2; the AVX2 build is chosen at run time when the CPU has AVX2.
// Both produce the same digests as the reference XXH3_128bits (the algorithm does not
// depend on the vector width), so the choice changes speed only.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ferry::kernels {

// A 128-bit XXH3 hash, as XXH128_hash_t: `hi` is high64, `lo` is low64.
struct Hash128 {
  uint64_t hi = 0;
  uint64_t lo = 0;
};

// Which compiled copy of xxHash to use.
enum class HashImpl {
  kAuto,      // AVX2 when the CPU supports it, else baseline
  kBaseline,  // SSE2 (every x86-64)
  kAvx2,      // REQUIRES: HashImplAvailable(kAvx2)
};

// True when `impl` can run on this CPU (kAuto and kBaseline always can).
bool HashImplAvailable(HashImpl impl);
// The implementation kAuto resolves to on this CPU.
HashImpl ResolvedHashImpl();

// XXH3_128bits(data, size) with seed 0.
Hash128 Xxh3_128(const void* data, size_t size, HashImpl impl = HashImpl::kAuto);

// Streaming XXH3-128 (seed 0): Update() any number of times, then Digest(). Digest() does
// not consume the state: more Update() calls may follow. Move-only; not thread-safe.
class Xxh3_128Stream {
 public:
  // REQUIRES: HashImplAvailable(impl).
  explicit Xxh3_128Stream(HashImpl impl = HashImpl::kAuto);
  ~Xxh3_128Stream();
  Xxh3_128Stream(Xxh3_128Stream&& other) noexcept;
  Xxh3_128Stream& operator=(Xxh3_128Stream&& other) noexcept;
  Xxh3_128Stream(const Xxh3_128Stream&) = delete;
  Xxh3_128Stream& operator=(const Xxh3_128Stream&) = delete;

  // Starts over, as if newly constructed.
  void Reset();
  void Update(const void* data, size_t size);
  Hash128 Digest() const;

  // The function table each compiled copy of xxHash exports (implementation detail).
  struct Ops {
    void* (*create)();
    void (*destroy)(void* state);
    void (*reset)(void* state);
    void (*update)(void* state, const void* data, size_t size);
    void (*digest)(const void* state, uint64_t* hi, uint64_t* lo);
    void (*oneshot)(const void* data, size_t size, uint64_t* hi, uint64_t* lo);
  };

 private:
  const Ops* ops_ = nullptr;
  void* state_ = nullptr;
};

namespace detail {
// Defined in hash.cpp (baseline) and hash_avx2.cpp (compiled with -mavx2).
const Xxh3_128Stream::Ops& Xxh3BaselineOps();
const Xxh3_128Stream::Ops& Xxh3Avx2Ops();
}  // namespace detail

}  // namespace ferry::kernels
