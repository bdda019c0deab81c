#pragma once
// What the standalone tuning drivers (elementwise_tune.cu, gemm_tune.cu,
// qqq_tune.cu) share: a CUDA error check that stops the run, and a kernel
// that reads a buffer and writes nothing.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CHECK(x)                                                                          \
  do {                                                                                    \
    cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                              \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

// Reads n 16-byte words and writes nothing unless their checksum equals
// `salt` with the top bit set (the drivers fill their buffers so that it never
// does): the loads cannot be dropped. Two uses: the streaming-read floor of a
// buffer, and an L2 flush that leaves the cache full of clean lines, which the
// next call evicts for free (zeroing a buffer instead leaves dirty lines whose
// write-back is charged to the timed call).
static __global__ void read_all(const uint4* __restrict__ p, size_t n, unsigned salt, unsigned* sink) {
  unsigned x = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = p[i], b = p[i + stride], c = p[i + 2 * stride], d = p[i + 3 * stride];
    x ^= a.x ^ b.y ^ c.z ^ d.w;
  }
  for (; i < n; i += stride) x ^= p[i].x;
  if (x == (salt | 0x80000000u)) *sink = x;
}
