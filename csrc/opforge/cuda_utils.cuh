#pragma once
// Pure-CUDA helpers for opforge kernels: no torch header, so every kernel file
// compiles with plain nvcc (CI compiles them for sm_80 and sm_90a and reads the
// ptxas report).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

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

// Threads per block for the grid-stride elementwise kernels. Correctness-first
// choice (issue 2); the tuned, vectorised kernels come with issue 6.
constexpr int kThreads = 256;

// A grid-stride loop needs no more blocks than keep every SM full: 8 blocks of
// 256 threads fill an SM's 2048 thread slots on sm_80/sm_90.
inline unsigned grid_for(int64_t n) {
  int device = 0;
  int sms = 1;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int64_t needed = (n + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(sms) * 8;
  return static_cast<unsigned>(needed < cap ? needed : cap);
}

// nullptr on success, else CUDA's message for the launch error.
inline const char* last_error() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// out[i] = f(x[i]), 64-bit indices, grid-stride.
template <typename T, typename F>
__global__ void unary_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t n, F f) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = from_opmath<T>(f(to_opmath(x[i])));
  }
}

// out[i] = f(a[i], b[i]), 64-bit indices, grid-stride.
template <typename T, typename F>
__global__ void binary_kernel(T* __restrict__ out, const T* __restrict__ a, const T* __restrict__ b,
                              int64_t n, F f) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = from_opmath<T>(f(to_opmath(a[i]), to_opmath(b[i])));
  }
}

template <typename T, typename F>
const char* launch_unary(void* out, const void* x, int64_t n, void* stream, F f) {
  unary_kernel<T><<<grid_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<T*>(out), static_cast<const T*>(x), n, f);
  return last_error();
}

template <typename T, typename F>
const char* launch_binary(void* out, const void* a, const void* b, int64_t n, void* stream, F f) {
  binary_kernel<T><<<grid_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<T*>(out), static_cast<const T*>(a), static_cast<const T*>(b), n, f);
  return last_error();
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
