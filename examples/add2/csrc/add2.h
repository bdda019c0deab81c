// add2.h: the CUDA launcher, declared for add2.cpp (which calls it) and defined in add2.cu.
//
// Only the CUDA runtime's header, no torch: nvcc compiles add2.cu without
// pulling in torch's headers, and the host compiler reads this file only
// when the module is built with CUDA (OPFORGE_WITH_CUDA, see add2.cpp).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

// c[i] = a[i] + b[i] for 0 <= i < n; all three are device pointers. The kernel
// is enqueued on `stream` and the call returns at once, before it has run
// (CUDA launches are asynchronous). Returns the launch's error, cudaSuccess
// when it was accepted.
cudaError_t launch_add2(float* c, const float* a, const float* b, int64_t n, cudaStream_t stream);
