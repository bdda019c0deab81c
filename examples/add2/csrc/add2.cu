// add2.cu: the kernel and its launcher (the add2 tutorial's add2_kernel / launch_add2).
#include "add2.h"

#include <algorithm>

namespace {

constexpr int kThreadsPerBlock = 256;
// More blocks than this add nothing: the grid-stride loop below covers any n.
constexpr int64_t kMaxBlocks = 1 << 16;

__global__ void add2_kernel(float* __restrict__ c, const float* __restrict__ a, const float* __restrict__ b, int64_t n) {
    // 64-bit indices, so that n past 2^31 neither overflows nor wraps.
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        c[i] = a[i] + b[i];
    }
}

}  // namespace

cudaError_t launch_add2(float* c, const float* a, const float* b, int64_t n, cudaStream_t stream) {
    if (n <= 0) {
        return cudaSuccess;  // a grid of 0 blocks is an invalid launch
    }
    const int64_t blocks = std::min<int64_t>((n + kThreadsPerBlock - 1) / kThreadsPerBlock, kMaxBlocks);
    add2_kernel<<<static_cast<unsigned int>(blocks), kThreadsPerBlock, 0, stream>>>(c, a, b, n);
    return cudaGetLastError();
}
