// How fast can any kernel read a W4A8 GEMM's packed weights once, under the
// timing that qqq_gemm is held to (an L2 flush by reading 256 MB before each
// call, CUDA events around the call, the median)? The weight-read floor of
// the W4A8 target is the bytes at the device's copy rate; this times kernels
// that only read those bytes, by three routes:
//   read_all     the tuning drivers' read-only kernel (tune_common.cuh);
//   ldg<U>       16-byte loads, U independent ones in flight per thread, no L1 allocation;
//   bulk<S, B>   one CTA per SM (or two), a ring of S shared-memory slots of B bytes
//                filled by Hopper bulk copies (cp.async.bulk + mbarrier), each slot
//                read once by the CTA's threads before it is refilled.
// Build and run on an sm_90a GPU:
//   nvcc -std=c++17 -O3 -Icsrc -Ibenchmarks -gencode=arch=compute_90a,code=sm_90a \
//     benchmarks/experiments/read_floor.cu -o /tmp/read_floor && /tmp/read_floor
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "opforge/sm90a.cuh"
#include "tune_common.cuh"

namespace {

// Nothing to read: what the timing charges any kernel before and after its work.
__global__ void empty_kernel(unsigned* sink, unsigned salt) {
  if (salt == 0x80000000u) *sink = salt;
}

template <int U>
__global__ void ldg_kernel(const uint4* __restrict__ p, size_t n, unsigned salt, unsigned* sink) {
  unsigned x = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (U - 1) * stride < n; i += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w)
                   : "l"(p + i + u * stride));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) x ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) x ^= p[i].x;
  if (x == (salt | 0x80000000u)) *sink = x;
}

constexpr int kBulkThreads = 128;

// The CTA's contiguous share of the buffer, S slots of B bytes in flight.
template <int S, int B>
__global__ void __launch_bounds__(kBulkThreads) bulk_kernel(const uint8_t* __restrict__ p, size_t bytes, unsigned salt,
                                                            unsigned* sink) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace opforge::sm90;
  extern __shared__ __align__(128) uint8_t ring[];
  __shared__ __align__(8) uint64_t bars[S];
  const size_t per = (bytes / gridDim.x + B - 1) / B * B;
  const size_t begin = per * blockIdx.x;
  const size_t end = begin + per < bytes ? begin + per : bytes;
  const int chunks = begin < end ? static_cast<int>((end - begin + B - 1) / B) : 0;
  auto issue = [&](int c) {
    const size_t off = begin + static_cast<size_t>(c) * B;
    const uint32_t len = static_cast<uint32_t>(end - off < B ? end - off : B);
    const uint32_t bar = smem_addr(&bars[c % S]);
    mbar_expect_tx(bar, len);
    bulk_load(smem_addr(ring + (c % S) * B), p + off, len, bar);
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) mbar_init(smem_addr(&bars[s]), 1);
    mbar_init_fence();
    for (int c = 0; c < S && c < chunks; ++c) issue(c);
  }
  __syncthreads();
  unsigned x = 0;
  for (int c = 0; c < chunks; ++c) {
    mbar_wait(smem_addr(&bars[c % S]), (c / S) & 1);
    const uint4* slot = reinterpret_cast<const uint4*>(ring + (c % S) * B);
    for (int j = threadIdx.x; j < B / 16; j += kBulkThreads) x ^= slot[j].x;
    __syncthreads();  // the slot is read: refill it
    if (threadIdx.x == 0 && c + S < chunks) issue(c + S);
  }
  if (x == (salt | 0x80000000u)) *sink = x;
#else
  (void)p, (void)bytes, (void)salt, (void)sink;
  __trap();
#endif
}

constexpr size_t kFlushBytes = size_t{256} << 20;

}  // namespace

int main() {
  int dev = 0, sms = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, dev));
  unsigned* sink = nullptr;
  void* flush = nullptr;
  CHECK(cudaMalloc(&sink, 4));
  CHECK(cudaMalloc(&flush, kFlushBytes));
  CHECK(cudaMemset(flush, 1, kFlushBytes));
  auto clean_flush = [&] { read_all<<<sms * 4, 512>>>(static_cast<const uint4*>(flush), kFlushBytes / 16, 7, sink); };

  // The copy rate as opforge bench measures it: the fastest of 20 copies, bytes read plus written.
  const size_t copy_bytes = size_t{512} << 20;
  void *src = nullptr, *dst = nullptr;
  CHECK(cudaMalloc(&src, copy_bytes));
  CHECK(cudaMalloc(&dst, copy_bytes));
  CHECK(cudaMemset(src, 3, copy_bytes));
  EventTimer timer;
  float best = 1e30f;
  for (int i = 0; i < 21; ++i) {
    const float us = timer.us([&] { CHECK(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice)); });
    if (i > 0 && us < best) best = us;
  }
  const double copy_gbps = 2.0 * copy_bytes / (best * 1e3);
  CHECK(cudaFree(src));
  CHECK(cudaFree(dst));
  std::printf("%s, %d SMs; copy rate %.0f GB/s (fastest of 20 copies of 512 MiB, read + written)\n", prop.name, sms,
              copy_gbps);

  struct Size {
    const char* name;
    size_t bytes;
  };
  const Size sizes[] = {{"K=N=8192", size_t{8192} * 8192 / 2}, {"4096x11008", size_t{4096} * 11008 / 2}};
  for (const Size& sz : sizes) {
    uint8_t* w = nullptr;
    CHECK(cudaMalloc(&w, sz.bytes));
    CHECK(cudaMemset(w, 5, sz.bytes));
    const double floor_us = sz.bytes / (copy_gbps * 1e3);
    std::printf("\n%s: %.1f MB, floor at the copy rate %.2f us\n", sz.name, sz.bytes / 1e6, floor_us);
    auto time = [&](const std::string& name, auto launch) {
      for (int i = 0; i < 3; ++i) launch();
      std::vector<float> ts;
      for (int i = 0; i < 41; ++i) {
        clean_flush();
        ts.push_back(timer.us(launch));
      }
      CHECK(cudaGetLastError());
      const float med = median_of(ts);
      std::printf("  %-28s %7.2f us  %5.2fx floor\n", name.c_str(), med, med / floor_us);
    };
    const auto* w4 = reinterpret_cast<const uint4*>(w);
    time("empty, 1/SM x 128", [&] { empty_kernel<<<sms, 128>>>(sink, 1); });
    time("read_all 1 block (16 KB)", [&] { read_all<<<1, 1024>>>(w4, 1024, 1, sink); });
    const size_t n16 = sz.bytes / 16;
    time("read_all 4/SM x 512", [&] { read_all<<<sms * 4, 512>>>(w4, n16, 1, sink); });
    time("ldg<4> 8/SM x 256", [&] { ldg_kernel<4><<<sms * 8, 256>>>(w4, n16, 1, sink); });
    time("ldg<8> 4/SM x 256", [&] { ldg_kernel<8><<<sms * 4, 256>>>(w4, n16, 1, sink); });
    time("ldg<8> 2/SM x 512", [&] { ldg_kernel<8><<<sms * 2, 512>>>(w4, n16, 1, sink); });
    time("ldg<16> 2/SM x 256", [&] { ldg_kernel<16><<<sms * 2, 256>>>(w4, n16, 1, sink); });
    time("ldg<16> 1/SM x 512", [&] { ldg_kernel<16><<<sms, 512>>>(w4, n16, 1, sink); });
    auto bulk = [&](const char* name, auto kernel, int slots, int slot_bytes, int per_sm) {
      const int smem = slots * slot_bytes;
      CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      time(name, [&] { kernel<<<sms * per_sm, kBulkThreads, smem>>>(w, sz.bytes, 1, sink); });
    };
    bulk("bulk 4 x 32 KB, 1/SM", bulk_kernel<4, 32768>, 4, 32768, 1);
    bulk("bulk 6 x 32 KB, 1/SM", bulk_kernel<6, 32768>, 6, 32768, 1);
    bulk("bulk 8 x 16 KB, 1/SM", bulk_kernel<8, 16384>, 8, 16384, 1);
    bulk("bulk 12 x 16 KB, 1/SM", bulk_kernel<12, 16384>, 12, 16384, 1);
    bulk("bulk 4 x 16 KB, 2/SM", bulk_kernel<4, 16384>, 4, 16384, 2);
    bulk("bulk 6 x 16 KB, 2/SM", bulk_kernel<6, 16384>, 6, 16384, 2);
    bulk("bulk 12 x 8 KB, 2/SM", bulk_kernel<12, 8192>, 12, 8192, 2);
    CHECK(cudaFree(w));
  }
  return 0;
}
