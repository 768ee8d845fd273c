// The AVX2 copy of xxHash (this file is compiled with -mavx2; see kernels/CMakeLists.txt).
// Only reached through detail::Xxh3Avx2Ops() after a run-time CPU check. Keep this file
// free of C++ library templates: anything inline it instantiated would be compiled with
// AVX2 and could be picked by the linker for callers on CPUs without it.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "kernels/hash.h"

namespace ferry::kernels::detail {
namespace {

void* Create() { return XXH3_createState(); }
void Destroy(void* s) { XXH3_freeState(static_cast<XXH3_state_t*>(s)); }
void Reset(void* s) { (void)XXH3_128bits_reset(static_cast<XXH3_state_t*>(s)); }
void Update(void* s, const void* data, size_t size) {
  (void)XXH3_128bits_update(static_cast<XXH3_state_t*>(s), data, size);
}
void Digest(const void* s, uint64_t* hi, uint64_t* lo) {
  XXH128_hash_t h = XXH3_128bits_digest(static_cast<const XXH3_state_t*>(s));
  *hi = h.high64;
  *lo = h.low64;
}
void OneShot(const void* data, size_t size, uint64_t* hi, uint64_t* lo) {
  XXH128_hash_t h = XXH3_128bits(data, size);
  *hi = h.high64;
  *lo = h.low64;
}

const Xxh3_128Stream::Ops kOps = {Create, Destroy, Reset, Update, Digest, OneShot};

}  // namespace

const Xxh3_128Stream::Ops& Xxh3Avx2Ops() { return kOps; }

}  // namespace ferry::kernels::detail
