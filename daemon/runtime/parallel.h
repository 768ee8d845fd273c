// at::parallel_for for the runtime's own loops. LibTorch's header splits the range across its
// intra-op threads only in units compiled with OpenMP (INTRA_OP_PARALLEL, set where _OPENMP is);
// elsewhere it quietly runs the whole range on the calling thread. A unit that includes this
// header refuses to compile in that case (ferry_runtime links OpenMP::OpenMP_CXX). Until it did,
// every such loop ran on one core (docs/daemon.md, "Generation speed against transformers").
#pragma once

#include <ATen/Parallel.h>

#if AT_PARALLEL_OPENMP && !defined(INTRA_OP_PARALLEL)
#error "compile this unit with OpenMP (-fopenmp): without it at::parallel_for runs on one thread"
#endif
