#pragma once
// What the standalone tuning drivers (elementwise_tune.cu, gemm_tune.cu,
// qqq_tune.cu) share: a CUDA error check that stops the run, a call timed by
// CUDA events, the median of such times, and a kernel that reads a buffer and
// writes nothing.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

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

// Times one call at a time with a pair of CUDA events on the default stream.
class EventTimer {
 public:
  EventTimer() {
    CHECK(cudaEventCreate(&e0_));
    CHECK(cudaEventCreate(&e1_));
  }
  ~EventTimer() {
    cudaEventDestroy(e0_);
    cudaEventDestroy(e1_);
  }
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;

  // Microseconds between events recorded just before and just after launch().
  template <typename F>
  float us(F&& launch) {
    CHECK(cudaEventRecord(e0_));
    launch();
    CHECK(cudaEventRecord(e1_));
    CHECK(cudaEventSynchronize(e1_));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, e0_, e1_));
    return ms * 1e3f;
  }

 private:
  cudaEvent_t e0_, e1_;
};

// The median of v (the upper middle one of an even count).
inline float median_of(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
