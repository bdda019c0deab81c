#pragma once
// Pure-CUDA helpers for opforge kernels: no torch header, so every kernel file
// compiles with plain nvcc (CI compiles them for sm_80 and sm_90a and reads the
// ptxas report).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "opforge/dtype.h"

namespace opforge::cuda {

// Half types are computed in float32 and rounded once at the store, as
// PyTorch's own elementwise kernels do.
template <typename T>
struct OpMath {
  using type = T;
};
template <>
struct OpMath<__half> {
  using type = float;
};
template <>
struct OpMath<__nv_bfloat16> {
  using type = float;
};
template <typename T>
using opmath_t = typename OpMath<T>::type;

__device__ __forceinline__ float to_opmath(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_opmath(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_opmath(float x) { return x; }
__device__ __forceinline__ double to_opmath(double x) { return x; }

template <typename T>
__device__ __forceinline__ T from_opmath(opmath_t<T> x);
template <>
__device__ __forceinline__ __half from_opmath<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_opmath<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ float from_opmath<float>(float x) { return x; }
template <>
__device__ __forceinline__ double from_opmath<double>(double x) { return x; }

// One-instruction approximations (MUFU): 2^v and 1/v, each within 2 ulp of
// float32 per the PTX ISA; .ftz flushes subnormal inputs and results to zero.
// For ops that round the result to a 2-byte type, or that bound the error
// themselves (sigmoid's comment says how).
__device__ __forceinline__ float ex2_approx(float v) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
}
// ex2_approx without .ftz: subnormal results kept (bfloat16 has float32's
// exponent range, so its sigmoid is subnormal for x < -87.3).
__device__ __forceinline__ float ex2_approx_subnormal(float v) {
  float r;
  asm("ex2.approx.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
}
__device__ __forceinline__ float rcp_approx(float v) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
}

// ---------------------------------------------------------------------------
// Elementwise kernels: NIN inputs, NOUT outputs, one dtype, contiguous memory.
//
// Memory-bound: the work is moving bytes, so every thread moves 16-byte
// vectors (8 half, 4 float, 2 double elements), and issues UNROLL of them per
// input before the first use, so that enough bytes are in flight to cover DRAM
// latency. The pointers need not be 16-byte aligned: when they share their
// offset modulo 16 (slices of contiguous tensors usually do), a scalar head
// brings them to the boundary, the body runs on vectors and a scalar tail ends
// it; when they do not, the same kernel runs with 1-element "vectors" (the
// loads then stay coalesced across the warp, 4 bytes a thread).
// Indices are 64-bit.
//
// Tuning constants, measured with benchmarks/elementwise_tune.cu on an H200
// (2026-11-22, benchmarks/results/elementwise-tune_nvidia-h200_2026-11-22.txt):
// one 16-byte vector per input per thread, 256 threads, and as many blocks as
// the data needs (no persistent grid). At 2^28 float32 elements that runs add
// at 4,339 GB/s and square at 4,227 GB/s (the copy: 4,220); capping the grid at
// one wave (8 blocks of 256 per SM) with 4 vectors per thread lost 7 % (4,051
// and 3,847 GB/s); 2 to 8 vectors per thread with a capped grid lost 3-10 %;
// 128 threads x 2 vectors matched 256 x 1 within 1 %.
constexpr int kThreads = 256;
constexpr int kUnroll = 1;
// No cap in practice: the grid-stride loop stays only for grids past CUDA's limit.
constexpr int kBlocksPerSm = 1 << 24;

// Devices the per-device caches below hold; a device past it is asked every time.
constexpr int kMaxDevices = 64;

// Multiprocessors of the current device; cached, since a launch is a few
// microseconds and two driver queries a call would be a visible part of it.
inline int sm_count() {
  static int cached[kMaxDevices] = {};
  int device = 0;
  cudaGetDevice(&device);
  if (device < 0 || device >= kMaxDevices) {
    int sms = 1;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    return sms;
  }
  // A race writes the same value twice: harmless.
  int sms = cached[device];
  if (sms == 0) {
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    cached[device] = sms;
  }
  return sms;
}

// Blocks for `work_items` of `per_block` each (at least one: the scalar head
// and tail run in block 0), at most `blocks_per_sm` per multiprocessor.
inline unsigned grid_for(int64_t work_items, int64_t per_block = int64_t{kThreads} * kUnroll,
                         int blocks_per_sm = kBlocksPerSm) {
  const int64_t needed = (work_items + per_block - 1) / per_block;
  int64_t cap = static_cast<int64_t>(sm_count()) * blocks_per_sm;
  cap = cap < 0x7fffffff ? cap : 0x7fffffff;  // gridDim.x's limit
  return static_cast<unsigned>(needed < 1 ? 1 : (needed < cap ? needed : cap));
}

// nullptr for cudaSuccess, else CUDA's message: the launchers' return value.
inline const char* error_string(cudaError_t err) { return err == cudaSuccess ? nullptr : cudaGetErrorString(err); }

// nullptr on success, else CUDA's message for the launch error.
inline const char* last_error() { return error_string(cudaGetLastError()); }

// A kernel that wants more than 48 KB of dynamic shared memory must say so,
// once per device (the attribute is per device and per function): each kernel
// (the template argument) keeps its own flags. `static`: opforge's library and
// a user's build of the same sources (examples/gemm, examples/qqq_gemm) name
// their kernels alike, and one process-wide flag (what an inline function's
// static local becomes: a GNU unique symbol) would let the second library
// skip the opt-in for its own kernel, whose launch then fails ("invalid
// argument", seen on the H200).
template <auto kernel>
static const char* allow_smem(int bytes) {
  static std::atomic<int> done[kMaxDevices];  // the byte count set, 0: not yet
  if (bytes <= 48 * 1024) return nullptr;
  int dev = 0;
  if (const char* e = error_string(cudaGetDevice(&dev))) return e;
  const bool cached = dev >= 0 && dev < kMaxDevices;
  if (cached && done[dev].load(std::memory_order_acquire) >= bytes) return nullptr;
  if (const char* e = error_string(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes))) {
    return e;
  }
  if (cached) done[dev].store(bytes, std::memory_order_release);
  return nullptr;
}

template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

template <typename T, int NIN, int NOUT>
struct Pointers {
  const T* in[NIN];
  T* out[NOUT];
};

// One element: f(const U* in, U* out) in opmath.
template <typename T, int NIN, int NOUT, typename F>
__device__ __forceinline__ void apply_one(const Pointers<T, NIN, NOUT>& p, int64_t i, const F& f) {
  opmath_t<T> x[NIN];
  opmath_t<T> y[NOUT];
#pragma unroll
  for (int k = 0; k < NIN; ++k) x[k] = to_opmath(p.in[k][i]);
  f(x, y);
#pragma unroll
  for (int k = 0; k < NOUT; ++k) p.out[k][i] = from_opmath<T>(y[k]);
}

// V elements of each of NIN input vectors through f, into NOUT output vectors.
template <typename T, int V, int NIN, int NOUT, typename F>
__device__ __forceinline__ void apply_vec(const Vec<T, V> (&in)[NIN], Vec<T, V> (&out)[NOUT], const F& f) {
#pragma unroll
  for (int e = 0; e < V; ++e) {
    opmath_t<T> x[NIN];
    opmath_t<T> y[NOUT];
#pragma unroll
    for (int k = 0; k < NIN; ++k) x[k] = to_opmath(in[k].v[e]);
    f(x, y);
#pragma unroll
    for (int k = 0; k < NOUT; ++k) out[k].v[e] = from_opmath<T>(y[k]);
  }
}

// Elements [0, head) and [head + nvec * V, n) one by one; [head, head + nvec * V)
// as nvec vectors of V elements, whose addresses are multiples of V elements.
template <typename T, int V, int NIN, int NOUT, int Threads, int Unroll, typename F>
__global__ void __launch_bounds__(Threads) elementwise_kernel(Pointers<T, NIN, NOUT> p, int64_t head,
                                                                int64_t nvec, int64_t n, F f) {
  static_assert(Threads >= 2 * V, "block 0 runs the head and the tail in one pass");
  if (blockIdx.x == 0) {
    const int64_t tail_start = head + nvec * V;
    const int t = threadIdx.x;
    if (t < head) {
      apply_one(p, t, f);
    } else if (t >= V && tail_start + (t - V) < n) {
      apply_one(p, tail_start + (t - V), f);
    }
  }
  using VecT = Vec<T, V>;
  const int64_t step = static_cast<int64_t>(gridDim.x) * Threads * Unroll;
  // The grid covers the data (grid_for), so a thread makes one pass: the loop
  // is only for grids past CUDA's limit. `unroll 1`, because otherwise the
  // compiler unrolls it by 4 and, to do so, divides (nvec - base) by step, a
  // 64-bit division (~40 dependent instructions) before the first load: at
  // 2^12-2^16 elements that made add's kernel 1.11 us against torch's 0.89
  // (H200, CUPTI kernel durations, benchmarks/host_overhead.py).
#pragma unroll 1
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * Threads * Unroll + threadIdx.x; base < nvec;
       base += step) {
    // All loads first: Unroll * NIN independent 16-byte loads in flight.
    VecT in[Unroll][NIN];
#pragma unroll
    for (int u = 0; u < Unroll; ++u) {
      const int64_t j = base + static_cast<int64_t>(u) * Threads;
      if (j < nvec) {
#pragma unroll
        for (int k = 0; k < NIN; ++k) in[u][k] = reinterpret_cast<const VecT*>(p.in[k] + head)[j];
      }
    }
#pragma unroll
    for (int u = 0; u < Unroll; ++u) {
      const int64_t j = base + static_cast<int64_t>(u) * Threads;
      if (j < nvec) {
        VecT out[NOUT];
        apply_vec(in[u], out, f);
#pragma unroll
        for (int k = 0; k < NOUT; ++k) reinterpret_cast<VecT*>(p.out[k] + head)[j] = out[k];
      }
    }
  }
}

// The common case on its own: every pointer 16-byte aligned, n a multiple of
// V, fewer than 2^31 vectors. No head or tail, no loop (the grid covers the
// data) and 32-bit indices: the fewest instructions before the first load,
// which is what a small call's device time is made of. At 2^12-2^16 float32
// elements the general kernel's add took 0.97-1.03 us a call against torch's
// 0.88-0.99 (H200, CUPTI kernel durations): its block-0 head/tail branch and
// 64-bit index arithmetic come before the loads.
template <typename T, int V, int NIN, int NOUT, int Threads, typename F>
__global__ void __launch_bounds__(Threads) elementwise_kernel_aligned(Pointers<T, NIN, NOUT> p, uint32_t nvec, F f) {
  using VecT = Vec<T, V>;
  const uint32_t j = blockIdx.x * Threads + threadIdx.x;
  if (j >= nvec) return;
  VecT in[NIN];
#pragma unroll
  for (int k = 0; k < NIN; ++k) in[k] = reinterpret_cast<const VecT*>(p.in[k])[j];
  VecT out[NOUT];
  apply_vec(in, out, f);
#pragma unroll
  for (int k = 0; k < NOUT; ++k) reinterpret_cast<VecT*>(p.out[k])[j] = out[k];
}

// Launches elementwise_kernel over n elements: 16-byte vectors when every
// pointer has the same offset modulo 16 bytes, else one element at a time.
// Threads, Unroll and blocks_per_sm are parameters only for the tuning
// benchmark; the ops use the defaults.
template <int Threads = kThreads, int Unroll = kUnroll, typename T, int NIN, int NOUT, typename F>
const char* launch_elementwise(const Pointers<T, NIN, NOUT>& p, int64_t n, void* stream, F f,
                               int blocks_per_sm = kBlocksPerSm) {
  constexpr int64_t kPerBlock = int64_t{Threads} * Unroll;
  constexpr int V = 16 / sizeof(T);
  const auto offset = reinterpret_cast<uintptr_t>(p.out[0]) % 16;
  bool aligned = offset % sizeof(T) == 0;
#pragma unroll
  for (int k = 0; k < NIN; ++k) aligned = aligned && reinterpret_cast<uintptr_t>(p.in[k]) % 16 == offset;
#pragma unroll
  for (int k = 0; k < NOUT; ++k) aligned = aligned && reinterpret_cast<uintptr_t>(p.out[k]) % 16 == offset;
  const auto s = static_cast<cudaStream_t>(stream);
  if (aligned && offset == 0 && n > 0 && n % V == 0 && n / V <= INT32_MAX && Unroll == 1 && blocks_per_sm == kBlocksPerSm) {
    const int64_t nvec = n / V;
    const auto blocks = static_cast<unsigned>((nvec + Threads - 1) / Threads);
    elementwise_kernel_aligned<T, V, NIN, NOUT, Threads><<<blocks, Threads, 0, s>>>(p, static_cast<uint32_t>(nvec), f);
  } else if (aligned) {
    int64_t head = static_cast<int64_t>((16 - offset) % 16 / sizeof(T));
    head = head < n ? head : n;
    const int64_t nvec = (n - head) / V;
    elementwise_kernel<T, V, NIN, NOUT, Threads, Unroll>
        <<<grid_for(nvec, kPerBlock, blocks_per_sm), Threads, 0, s>>>(p, head, nvec, n, f);
  } else {
    elementwise_kernel<T, 1, NIN, NOUT, Threads, Unroll>
        <<<grid_for(n, kPerBlock, blocks_per_sm), Threads, 0, s>>>(p, int64_t{0}, n, n, f);
  }
  return last_error();
}

// Adapters from the ops' functors, f(a) -> y and f(a, b) -> y, to the array form.
template <typename F>
struct Unary {
  F f;
  template <typename U>
  __device__ __forceinline__ void operator()(const U* x, U* y) const {
    y[0] = f(x[0]);
  }
};
template <typename F>
struct Binary {
  F f;
  template <typename U>
  __device__ __forceinline__ void operator()(const U* x, U* y) const {
    y[0] = f(x[0], x[1]);
  }
};

template <typename T, typename F>
const char* launch_unary(void* out, const void* x, int64_t n, void* stream, F f) {
  Pointers<T, 1, 1> p{{static_cast<const T*>(x)}, {static_cast<T*>(out)}};
  return launch_elementwise(p, n, stream, Unary<F>{f});
}

template <typename T, typename F>
const char* launch_binary(void* out, const void* a, const void* b, int64_t n, void* stream, F f) {
  Pointers<T, 2, 1> p{{static_cast<const T*>(a), static_cast<const T*>(b)}, {static_cast<T*>(out)}};
  return launch_elementwise(p, n, stream, Binary<F>{f});
}

}  // namespace opforge::cuda

// Runs the body with T bound to the CUDA element type of `dtype`.
#define OPFORGE_CUDA_DISPATCH(dtype, T, ...)        \
  switch (dtype) {                                  \
    case ::opforge::DType::Float32: {               \
      using T = float;                              \
      __VA_ARGS__                                   \
    }                                               \
    case ::opforge::DType::Float16: {               \
      using T = __half;                             \
      __VA_ARGS__                                   \
    }                                               \
    case ::opforge::DType::BFloat16: {              \
      using T = __nv_bfloat16;                      \
      __VA_ARGS__                                   \
    }                                               \
    case ::opforge::DType::Float64: {               \
      using T = double;                             \
      __VA_ARGS__                                   \
    }                                               \
  }                                                 \
  return "opforge: unsupported dtype in CUDA launcher";
