// Tuning the elementwise kernels of csrc/opforge/cuda_utils.cuh: threads per
// block, vectors per thread per step (loads in flight) and blocks per SM, on
// add (2 loads + 1 store per element) and square (1 + 1), float32 and
// bfloat16, against the device-to-device copy of the same bytes.
//
//   nvcc -std=c++17 -O3 -Icsrc -gencode=arch=compute_90a,code=sm_90a \
//        benchmarks/elementwise_tune.cu -o /tmp/tune && /tmp/tune
//
// Times: CUDA events around each call, median of 30 calls after 5 warm-ups.
// Every size here is at least 4x the 50 MB L2 of an H200 (bf16 2^24 and up),
// except the 2^20 latency case. It also checks head/tail handling at every
// misalignment before timing anything.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "opforge/cuda_utils.cuh"

namespace cu = opforge::cuda;

#define CHECK(x)                                                                     \
  do {                                                                               \
    cudaError_t e = (x);                                                             \
    if (e != cudaSuccess) {                                                          \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

struct AddOp {
  template <typename U>
  __device__ U operator()(U a, U b) const {
    return a + b;
  }
};
struct SquareOp {
  template <typename U>
  __device__ U operator()(U a) const {
    return a * a;
  }
};

template <typename T>
__global__ void fill(T* p, int64_t n, float scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    p[i] = static_cast<T>(static_cast<float>((i * 7919) % 1009) * scale);
  }
}

template <typename F>
float median_us(F launch) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 5; ++i) launch();
  std::vector<float> ts;
  for (int i = 0; i < 30; ++i) {
    CHECK(cudaEventRecord(a));
    launch();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms * 1000.f);
  }
  std::sort(ts.begin(), ts.end());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ts[ts.size() / 2];
}

// add over every misalignment and small size: the head, body and tail must cover each element once.
bool check_edges() {
  const int64_t cap = 5000;
  float *a, *b, *o;
  CHECK(cudaMalloc(&a, cap * 4));
  CHECK(cudaMalloc(&b, cap * 4));
  CHECK(cudaMalloc(&o, cap * 4));
  fill<<<8, 256>>>(a, cap, 1.f);
  fill<<<8, 256>>>(b, cap, 0.5f);
  std::vector<float> ha(cap), hb(cap), ho(cap);
  CHECK(cudaMemcpy(ha.data(), a, cap * 4, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(hb.data(), b, cap * 4, cudaMemcpyDeviceToHost));
  for (int off_in = 0; off_in < 4; ++off_in) {
    for (int off_out = 0; off_out < 4; ++off_out) {
      for (int64_t n : {0, 1, 3, 4, 5, 17, 1023, 1024, 1025, 4093}) {
        CHECK(cudaMemset(o, 0xff, cap * 4));  // NaN everywhere
        const char* err = cu::launch_binary<float>(o + off_out, a + off_in, b + off_in, n, nullptr, AddOp{});
        if (err) {
          std::printf("launch error %s\n", err);
          return false;
        }
        CHECK(cudaMemcpy(ho.data(), o, cap * 4, cudaMemcpyDeviceToHost));
        for (int64_t i = 0; i < cap; ++i) {
          const bool inside = i >= off_out && i < off_out + n;
          const float want = inside ? ha[i - off_out + off_in] + hb[i - off_out + off_in] : 0.f;
          const bool ok = inside ? ho[i] == want : ho[i] != ho[i];  // outside: still NaN
          if (!ok) {
            std::printf("edge check FAILED: off_in %d off_out %d n %lld at %lld: %f want %f\n", off_in, off_out,
                        static_cast<long long>(n), static_cast<long long>(i), ho[i], want);
            return false;
          }
        }
      }
    }
  }
  cudaFree(a);
  cudaFree(b);
  cudaFree(o);
  return true;
}

template <int Threads, int Unroll, typename T>
void row(const char* dtype, int64_t n, int bps, T* a, T* b, T* o, float copy_add_us, float copy_sq_us) {
  const float add = median_us([&] { cu::launch_elementwise<Threads, Unroll>(cu::Pointers<T, 2, 1>{{a, b}, {o}}, n, nullptr, cu::Binary<AddOp>{}, bps); });
  const float sq = median_us([&] { cu::launch_elementwise<Threads, Unroll>(cu::Pointers<T, 1, 1>{{a}, {o}}, n, nullptr, cu::Unary<SquareOp>{}, bps); });
  const double add_gbs = 3.0 * n * sizeof(T) / add / 1e3;
  const double sq_gbs = 2.0 * n * sizeof(T) / sq / 1e3;
  std::printf("%-8s 2^%-3d %4d %2d %5d | add %9.1f us %6.0f GB/s %5.1f%% | square %9.1f us %6.0f GB/s %5.1f%%\n", dtype,
              __builtin_ctzll(n), Threads, Unroll, bps, add, add_gbs, 100.0 * copy_add_us / add, sq, sq_gbs,
              100.0 * copy_sq_us / sq);
}

template <typename T>
void sweep(const char* dtype) {
  for (int log2n : {20, 24, 26, 28}) {
    const int64_t n = int64_t{1} << log2n;
    T *a, *b, *o;
    CHECK(cudaMalloc(&a, n * sizeof(T)));
    CHECK(cudaMalloc(&b, n * sizeof(T)));
    CHECK(cudaMalloc(&o, n * sizeof(T)));
    fill<<<1024, 256>>>(a, n, 1e-3f);
    fill<<<1024, 256>>>(b, n, 2e-3f);
    // The copy moving add's bytes (read 2n, write n ~ copy 1.5n elements) and square's (copy n).
    T* big;  // 3n elements: add's 3n elements of traffic is a copy of 1.5n
    CHECK(cudaMalloc(&big, 3 * n * sizeof(T)));
    const float copy_sq = median_us([&] { cudaMemcpyAsync(o, a, n * sizeof(T), cudaMemcpyDeviceToDevice); });
    const float copy_add = median_us([&] { cudaMemcpyAsync(big + n * 3 / 2, big, n * sizeof(T) * 3 / 2, cudaMemcpyDeviceToDevice); });
    std::printf("%-8s 2^%-3d copy: %.1f us (%.0f GB/s)\n", dtype, log2n, copy_sq, 2.0 * n * sizeof(T) / copy_sq / 1e3);
    row<256, 4>(dtype, n, 8, a, b, o, copy_add, copy_sq);
    row<256, 4>(dtype, n, 4, a, b, o, copy_add, copy_sq);
    row<256, 4>(dtype, n, 100000, a, b, o, copy_add, copy_sq);
    row<256, 2>(dtype, n, 8, a, b, o, copy_add, copy_sq);
    row<256, 8>(dtype, n, 8, a, b, o, copy_add, copy_sq);
    row<256, 1>(dtype, n, 100000, a, b, o, copy_add, copy_sq);
    row<128, 4>(dtype, n, 16, a, b, o, copy_add, copy_sq);
    row<512, 4>(dtype, n, 4, a, b, o, copy_add, copy_sq);
    row<128, 2>(dtype, n, 100000, a, b, o, copy_add, copy_sq);
    cudaFree(a);
    cudaFree(b);
    cudaFree(o);
    cudaFree(big);
  }
}

int main() {
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  if (!check_edges()) return 1;
  std::printf("edge check: every misalignment and size ok\n");
  std::printf("dtype    n     thr  U  bpsm | (%% = copy of the same bytes / kernel time)\n");
  sweep<float>("float32");
  sweep<__nv_bfloat16>("bfloat16");
  return 0;
}
