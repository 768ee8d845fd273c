// The AVX2 copy of xxHash (this file is compiled with -mavx2; see kernels/CMakeLists.txt).
// Only reached through detail::Xxh3Avx2Ops() after a run-time CPU check. Keep this file
// free of C++ library templates: anything inline it instantiated would be compiled with
// AVX2 and could be picked by the linker for callers on CPUs without it.
#define FERRY_XXH3_OPS Xxh3Avx2Ops
#include "kernels/xxh3_ops.inc"
