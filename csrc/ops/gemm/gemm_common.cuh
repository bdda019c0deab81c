#pragma once
// Pieces every GEMM kernel family shares: problem description, workspace, tile
// order, cached per-device facts, the once-per-device shared-memory opt-in and
// the occupancy a plan reads.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "opforge/cuda_utils.cuh"

namespace opforge::gemm {

// One GEMM: C[M, N] = A[M, K] @ B[K, N], all row-major and contiguous.
struct Problem {
  const void* a;
  const void* b;
  void* c;
  int64_t M, N, K;
};

inline bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Device memory the caller gives a launcher for its intermediate results
// (split-K partial sums, padded copies of operands TMA cannot read). The
// launcher never allocates: gemm.cpp takes it from ATen's caching allocator,
// on the stream the GEMM runs on, so that it is reused like any tensor.
struct Workspace {
  void* ptr = nullptr;
  size_t bytes = 0;
};

// Whether `ws` holds `need` bytes at a 16-byte boundary (float4 and TMA
// addresses): nullptr, or the error a launcher returns before launching.
inline const char* check_workspace(const Workspace& ws, size_t need) {
  if (need == 0) return nullptr;
  if (ws.ptr == nullptr || ws.bytes < need) {
    return "opforge: gemm: the workspace is smaller than the plan needs (gemm_cuda_workspace gives its size)";
  }
  if (!aligned(ws.ptr, 16)) return "opforge: gemm: the workspace must be 16-byte aligned";
  return nullptr;
}

__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Tile `t` of a tiles_m x tiles_n grid in grouped order: GROUP consecutive
// tile-rows are walked column by column, so that the CTAs resident at one time
// share a few A row-panels and B column-panels in L2 instead of streaming all
// of B once per tile-row.
template <int GROUP>
__device__ __forceinline__ void tile_coords(int64_t t, int64_t tiles_m, int64_t tiles_n, int64_t& tm,
                                            int64_t& tn) {
  const int64_t per_group = static_cast<int64_t>(GROUP) * tiles_n;
  const int64_t group = t / per_group;
  const int64_t first_m = group * GROUP;
  const int64_t rows = tiles_m - first_m < GROUP ? tiles_m - first_m : GROUP;
  const int64_t in_group = t - group * per_group;
  tm = first_m + in_group % rows;
  tn = in_group / rows;
}

// Facts about a device the launchers read on every call, read once.
struct DeviceInfo {
  int sms = 0;
  int major = 0;
  int minor = 0;
  int max_smem_optin = 0;
};

using cuda::allow_smem;
using cuda::kMaxDevices;

inline const char* device_info(DeviceInfo& out) {
  static DeviceInfo cache[kMaxDevices];
  static std::atomic<bool> ready[kMaxDevices];
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  if (dev >= 0 && dev < kMaxDevices && ready[dev].load(std::memory_order_acquire)) {
    out = cache[dev];
    return nullptr;
  }
  DeviceInfo info;
  if ((err = cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor, dev)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&info.minor, cudaDevAttrComputeCapabilityMinor, dev)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&info.max_smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)) !=
          cudaSuccess) {
    return cudaGetErrorString(err);
  }
  if (dev >= 0 && dev < kMaxDevices) {
    // Two threads racing here store the same facts.
    cache[dev] = info;
    ready[dev].store(true, std::memory_order_release);
  }
  out = info;
  return nullptr;
}

// How many CTAs of `kernel` (threads, dynamic shared memory bytes) one SM
// holds at once, read once per device; 1 if the runtime cannot say (a plan
// then asks for fewer CTAs, never for a second wave). `static`: the answer is
// this library's build of the kernel (its registers), so its cache must be
// too, as wgmma_available's: an inline function's static local is one
// process-wide symbol shared by every library built from these sources.
template <auto kernel>
static int resident_ctas(int threads, int smem) {
  static std::atomic<int> cache[kMaxDevices];  // 0: not yet read
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 1;
  const bool cached = dev >= 0 && dev < kMaxDevices;
  if (cached) {
    if (const int n = cache[dev].load(std::memory_order_acquire)) return n;
  }
  if (allow_smem<kernel>(smem) != nullptr) return 1;
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess || n < 1) {
    cudaGetLastError();  // not sticky: clear it
    return 1;
  }
  if (cached) cache[dev].store(n, std::memory_order_release);
  return n;
}

// The 32-bit shared-memory address of a generic pointer into shared memory
// (what ldmatrix, cp.async, mbarriers and wgmma descriptors take).
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Two float32 values rounded into one 32-bit pair of the 2-byte type: the
// tensor-core kernels' epilogues store C two columns at a time.
template <typename T>
struct Pair;
template <>
struct Pair<__half> {
  using type = __half2;
  static __device__ __forceinline__ type make(float a, float b) { return __floats2half2_rn(a, b); }
};
template <>
struct Pair<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static __device__ __forceinline__ type make(float a, float b) { return __floats2bfloat162_rn(a, b); }
};

}  // namespace opforge::gemm
