// What the CPU running this process supports, for the run-time dispatch between compiled
// copies of a kernel (the baseline x86-64 build and one built with -mavx2).
#pragma once

namespace ferry::kernels {

// True when the CPU supports AVX2 (checked once, then cached; thread-safe). False on
// non-x86 builds.
bool CpuHasAvx2();

}  // namespace ferry::kernels
