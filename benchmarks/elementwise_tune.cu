// Tuning the elementwise kernels of csrc/opforge/cuda_utils.cuh: threads per
// block, vectors per thread per step (loads in flight) and blocks per SM, on
// add (2 loads + 1 store per element) and square (1 + 1), float32 and
// bfloat16, against the device-to-device copy of the same bytes.
//
//   nvcc -std=c++17 -O3 -Icsrc -gencode=arch=compute_90a,code=sm_90a \
//        benchmarks/elementwise_tune.cu -o /tmp/tune && /tmp/tune [sweep|sigmoid|small|aligned|hints|multi|bulk]...
//
// sweep (the default): the table above. sigmoid: the arithmetic of sigmoid's
// forms (libm + IEEE division, libm + approximate reciprocal, ex2/rcp
// approximations) in each dtype at 2^26 and 2^28, beside square (the same
// bytes, one instruction). small: device time of add at 2^12-2^16 elements for
// 64, 128 and 256 threads a block, from a CUDA graph of 256 launches (no
// launch overhead in the figure). aligned: add at 2^26/2^28 through the aligned
// kernel at 128/256/512 threads a block, rounds interleaved. bulk: add at
// 2^26/2^28 staged through shared memory by Hopper's bulk copies (add_bulk),
// beside the op's kernel, after a bit-exact check against it.
//
// Times: CUDA events around each call, median of 30 calls after 5 warm-ups.
// Every size here is at least 4x the 50 MB L2 of an H200 (bf16 2^24 and up),
// except the 2^20 latency case. It also checks head/tail handling at every
// misalignment before timing anything.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "opforge/cuda_utils.cuh"
#include "opforge/sm90a.cuh"
#include "tune_common.cuh"

namespace cu = opforge::cuda;


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

// The three forms of sigmoid compared (in float32 opmath; the 2-byte types convert around them).
struct SigmoidLibmDiv {  // torch's own form: expf and the IEEE division
  __device__ float operator()(float x) const { return 1.0f / (1.0f + expf(-x)); }
};
struct SigmoidLibmRcp {  // the float32 kernel's: expf, approximate reciprocal
  __device__ float operator()(float x) const { return cu::rcp_approx(1.0f + expf(-x)); }
};
struct SigmoidApprox {  // the 2-byte kernels': ex2 and rcp approximations
  __device__ float operator()(float x) const { return cu::rcp_approx(1.0f + cu::ex2_approx(-1.4426950408889634f * x)); }
};

template <typename T>
__global__ void fill(T* p, int64_t n, float scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    p[i] = static_cast<T>(static_cast<float>((i * 7919) % 1009) * scale);
  }
}

template <typename F>
float median_us(F launch) {
  EventTimer timer;
  for (int i = 0; i < 5; ++i) launch();
  std::vector<float> ts;
  for (int i = 0; i < 30; ++i) ts.push_back(timer.us(launch));
  return median_of(ts);
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

template <typename T, typename F>
float unary_us(int64_t n, T* a, T* o, F f) {
  return median_us([&] { cu::launch_elementwise(cu::Pointers<T, 1, 1>{{a}, {o}}, n, nullptr, cu::Unary<F>{f}); });
}

template <typename T>
void sigmoid_forms(const char* dtype) {
  for (int log2n : {26, 28}) {
    const int64_t n = int64_t{1} << log2n;
    T *a, *o;
    CHECK(cudaMalloc(&a, n * sizeof(T)));
    CHECK(cudaMalloc(&o, n * sizeof(T)));
    fill<<<1024, 256>>>(a, n, 1e-2f);
    const float copy = median_us([&] { cudaMemcpyAsync(o, a, n * sizeof(T), cudaMemcpyDeviceToDevice); });
    const float sq = unary_us(n, a, o, SquareOp{});
    const float div = unary_us(n, a, o, SigmoidLibmDiv{});
    const float rcp = unary_us(n, a, o, SigmoidLibmRcp{});
    const float apx = unary_us(n, a, o, SigmoidApprox{});
    std::printf("%-8s 2^%-3d copy %8.1f | square %8.1f (%5.1f%%) | libm+div %8.1f (%5.1f%%) | libm+rcp %8.1f (%5.1f%%) | "
                "ex2+rcp %8.1f (%5.1f%%) us (%% of copy)\n",
                dtype, log2n, copy, sq, 100 * copy / sq, div, 100 * copy / div, rcp, 100 * copy / rcp, apx, 100 * copy / apx);
    cudaFree(a);
    cudaFree(o);
  }
}

// Device time per launch: a graph of kLaunches back-to-back launches, replayed; its time over kLaunches.
template <int Threads>
float add_graph_us(int64_t n, float* a, float* b, float* o) {
  constexpr int kLaunches = 256;
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kLaunches; ++i) {
    cu::launch_elementwise<Threads, 1>(cu::Pointers<float, 2, 1>{{a, b}, {o}}, n, s, cu::Binary<AddOp>{});
  }
  CHECK(cudaStreamEndCapture(s, &g));
  CHECK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::vector<float> ts;
  for (int rep = 0; rep < 25; ++rep) {
    CHECK(cudaEventRecord(e0, s));
    CHECK(cudaGraphLaunch(ge, s));
    CHECK(cudaEventRecord(e1, s));
    CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (rep >= 5) ts.push_back(ms * 1000.f / kLaunches);
  }
  std::sort(ts.begin(), ts.end());
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  cudaStreamDestroy(s);
  return ts[ts.size() / 2];
}

void small_sizes() {
  for (int log2n : {12, 14, 16, 18}) {
    const int64_t n = int64_t{1} << log2n;
    float *a, *b, *o;
    CHECK(cudaMalloc(&a, n * 4));
    CHECK(cudaMalloc(&b, n * 4));
    CHECK(cudaMalloc(&o, n * 4));
    fill<<<64, 256>>>(a, n, 1.f);
    fill<<<64, 256>>>(b, n, 2.f);
    const float t64 = add_graph_us<64>(n, a, b, o);
    const float t128 = add_graph_us<128>(n, a, b, o);
    const float t256 = add_graph_us<256>(n, a, b, o);
    std::printf("add float32 2^%-3d per launch in a graph: 64 thr %.2f us | 128 thr %.2f us | 256 thr %.2f us\n", log2n,
                t64, t128, t256);
    cudaFree(a);
    cudaFree(b);
    cudaFree(o);
  }
}

// add at 2^26 and 2^28 through the aligned kernel at 128, 256 (the default) and
// 512 threads a block, and through the general kernel with 2 vectors a thread:
// rounds interleaved so that drift in the clocks hits every variant alike; the
// median over rounds of each round's median.
template <typename T, int Threads, int Unroll>
float add_us(int64_t n, T* a, T* b, T* o) {
  return median_us([&] {
    cu::launch_elementwise<Threads, Unroll>(cu::Pointers<T, 2, 1>{{a, b}, {o}}, n, nullptr, cu::Binary<AddOp>{});
  });
}

// add's three buffers of 2^log2n elements, filled (never zeros), freed on scope exit.
template <typename T>
struct AddBuffers {
  int64_t n;
  T *a = nullptr, *b = nullptr, *o = nullptr;
  explicit AddBuffers(int log2n) : n(int64_t{1} << log2n) {
    CHECK(cudaMalloc(&a, n * sizeof(T)));
    CHECK(cudaMalloc(&b, n * sizeof(T)));
    CHECK(cudaMalloc(&o, n * sizeof(T)));
    fill<<<1024, 256>>>(a, n, 1e-3f);
    fill<<<1024, 256>>>(b, n, 2e-3f);
  }
  ~AddBuffers() {
    cudaFree(a);
    cudaFree(b);
    cudaFree(o);
  }
};

// Each variant's median time over 7 rounds, the variants interleaved within a
// round so that drift in the clocks hits them alike.
std::vector<float> interleaved_medians(const std::vector<std::function<float()>>& variants) {
  std::vector<std::vector<float>> r(variants.size());
  for (int round = 0; round < 7; ++round) {
    for (size_t k = 0; k < variants.size(); ++k) r[k].push_back(variants[k]());
  }
  std::vector<float> med;
  for (const auto& v : r) med.push_back(median_of(v));
  return med;
}

template <typename T>
void aligned_threads(const char* dtype) {
  for (int log2n : {26, 28}) {
    AddBuffers<T> m(log2n);
    const auto med = interleaved_medians({[&] { return add_us<T, 128, 1>(m.n, m.a, m.b, m.o); },
                                          [&] { return add_us<T, 256, 1>(m.n, m.a, m.b, m.o); },
                                          [&] { return add_us<T, 512, 1>(m.n, m.a, m.b, m.o); },
                                          [&] { return add_us<T, 256, 2>(m.n, m.a, m.b, m.o); }});
    const double gb = 3.0 * m.n * sizeof(T) / 1e3;
    std::printf("add %-8s 2^%-3d aligned 128 thr %7.1f us (%4.0f GB/s) | 256 thr %7.1f (%4.0f) | 512 thr %7.1f (%4.0f) | "
                "general 256x2 %7.1f (%4.0f)\n",
                dtype, log2n, med[0], gb / med[0], med[1], gb / med[1], med[2], gb / med[2], med[3], gb / med[3]);
  }
}

// add's variants for the hints and multi modes: VPT 16-byte vectors per input
// per thread, one tile of Threads * VPT vectors per block, loads and stores
// with cache hint H, the op's arithmetic (cu::apply_vec). Hints: plain; the
// stores evict-first (st.global.cs); loads and stores streaming (ld.global.cs
// / st.global.cs); loads through the read-only path, stores evict-first; loads
// with the L2::256B prefetch (Hopper: the L2 fetches the 256-byte block around
// each access). The questions: does keeping the output's lines out of L2's
// way, more work per thread (PyTorch's shape for 2-byte types) or a wider L2
// fetch move add's 2-byte types past eager?
enum class Hint { kPlain, kStoreCs, kBothCs, kLdgStoreCs, kL2Prefetch };

template <Hint H>
__device__ __forceinline__ uint4 load_hinted(const uint4* p) {
  if constexpr (H == Hint::kBothCs) {
    return __ldcs(p);
  } else if constexpr (H == Hint::kLdgStoreCs) {
    return __ldg(p);
  } else if constexpr (H == Hint::kL2Prefetch) {
    uint4 r;
    asm volatile("ld.global.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
  } else {
    return *p;
  }
}

template <Hint H>
__device__ __forceinline__ void store_hinted(uint4* p, uint4 v) {
  if constexpr (H == Hint::kStoreCs || H == Hint::kBothCs || H == Hint::kLdgStoreCs) {
    __stcs(p, v);
  } else {
    *p = v;
  }
}

template <typename T, int Threads, int VPT, Hint H>
__global__ void __launch_bounds__(Threads) add_variant(const uint4* __restrict__ a, const uint4* __restrict__ b,
                                                        uint4* __restrict__ o, uint32_t nvec) {
  constexpr int V = 16 / sizeof(T);
  using VecT = cu::Vec<T, V>;
  const uint32_t base = blockIdx.x * (Threads * VPT) + threadIdx.x;
  VecT in[VPT][2];
#pragma unroll
  for (int v = 0; v < VPT; ++v) {
    const uint32_t j = base + v * Threads;
    if (j < nvec) {
      const uint4 x = load_hinted<H>(a + j), y = load_hinted<H>(b + j);
      in[v][0] = *reinterpret_cast<const VecT*>(&x);
      in[v][1] = *reinterpret_cast<const VecT*>(&y);
    }
  }
#pragma unroll
  for (int v = 0; v < VPT; ++v) {
    const uint32_t j = base + v * Threads;
    if (j >= nvec) break;
    VecT out[1];
    cu::apply_vec<T, V, 2, 1>(in[v], out, cu::Binary<AddOp>{});
    store_hinted<H>(o + j, *reinterpret_cast<const uint4*>(&out[0]));
  }
}

template <typename T, int Threads, int VPT, Hint H>
float variant_us(int64_t n, T* a, T* b, T* o) {
  const auto nvec = static_cast<uint32_t>(n * sizeof(T) / 16);
  return median_us([&] {
    add_variant<T, Threads, VPT, H><<<(nvec + Threads * VPT - 1) / (Threads * VPT), Threads>>>(
        reinterpret_cast<const uint4*>(a), reinterpret_cast<const uint4*>(b), reinterpret_cast<uint4*>(o), nvec);
  });
}

template <typename T>
void cache_hints(const char* dtype) {
  for (int log2n : {26, 28}) {
    AddBuffers<T> m(log2n);
    const auto med = interleaved_medians({[&] { return add_us<T, 256, 1>(m.n, m.a, m.b, m.o); },
                                          [&] { return variant_us<T, 256, 1, Hint::kPlain>(m.n, m.a, m.b, m.o); },
                                          [&] { return variant_us<T, 256, 1, Hint::kStoreCs>(m.n, m.a, m.b, m.o); },
                                          [&] { return variant_us<T, 256, 1, Hint::kBothCs>(m.n, m.a, m.b, m.o); },
                                          [&] { return variant_us<T, 256, 1, Hint::kLdgStoreCs>(m.n, m.a, m.b, m.o); }});
    std::printf("add %-8s 2^%-3d op's kernel %7.1f us | plain %7.1f | st.cs %7.1f | ld.cs+st.cs %7.1f | ldg+st.cs %7.1f\n",
                dtype, log2n, med[0], med[1], med[2], med[3], med[4]);
  }
}

// Each variant's every output element, bit for bit, against the op's kernel's;
// exits on the first that differs (or fails to launch).
template <typename T>
void check_against_op(const char* dtype, const AddBuffers<T>& m, const std::vector<std::function<float()>>& variants) {
  T* want = nullptr;
  CHECK(cudaMalloc(&want, m.n * sizeof(T)));
  add_us<T, 256, 1>(m.n, m.a, m.b, want);
  std::vector<uint8_t> ref(m.n * sizeof(T)), got(m.n * sizeof(T));
  CHECK(cudaMemcpy(ref.data(), want, ref.size(), cudaMemcpyDeviceToHost));
  CHECK(cudaFree(want));
  for (size_t k = 0; k < variants.size(); ++k) {
    CHECK(cudaMemset(m.o, 0xFF, m.n * sizeof(T)));
    variants[k]();
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(got.data(), m.o, got.size(), cudaMemcpyDeviceToHost));
    if (std::memcmp(got.data(), ref.data(), got.size()) != 0) {
      std::printf("FAIL add %s variant %zu differs from the op's kernel\n", dtype, k);
      std::exit(1);
    }
  }
}

template <typename T>
void multi_vectors(const char* dtype) {
  for (int log2n : {26, 28}) {
    AddBuffers<T> m(log2n);
    const std::vector<std::function<float()>> variants = {
        [&] { return variant_us<T, 128, 2, Hint::kPlain>(m.n, m.a, m.b, m.o); },
        [&] { return variant_us<T, 128, 4, Hint::kPlain>(m.n, m.a, m.b, m.o); },
        [&] { return variant_us<T, 256, 2, Hint::kPlain>(m.n, m.a, m.b, m.o); },
        [&] { return variant_us<T, 256, 1, Hint::kL2Prefetch>(m.n, m.a, m.b, m.o); },
        [&] { return variant_us<T, 128, 2, Hint::kL2Prefetch>(m.n, m.a, m.b, m.o); }};
    if (log2n == 26) check_against_op(dtype, m, variants);
    std::vector<std::function<float()>> timed = {[&] { return add_us<T, 256, 1>(m.n, m.a, m.b, m.o); }};
    timed.insert(timed.end(), variants.begin(), variants.end());
    const auto med = interleaved_medians(timed);
    std::printf("add %-8s 2^%-3d op's kernel %7.1f us | 128x2 %7.1f | 128x4 %7.1f | 256x2 %7.1f | 256x1 L2::256B %7.1f | "
                "128x2 L2::256B %7.1f\n",
                dtype, log2n, med[0], med[1], med[2], med[3], med[4], med[5]);
  }
}

// bulk: add through Hopper's 1-D bulk copies (cp.async.bulk, TMA without a
// tensor map) instead of LDG/STG. The question: with the copy engine moving
// whole chunks between global and shared memory (no registers or LSU slots
// held per load in flight), does add reach more of the bandwidth than the op's
// kernel? A persistent grid; each block walks chunks blockIdx.x, +gridDim.x,
// ... through a ring of Stages slots (a, b and out, ChunkBytes each) in dynamic
// shared memory, thread 0 issuing the copies.

template <typename T, int Threads, int Stages, int ChunkBytes>
__global__ void __launch_bounds__(Threads) add_bulk(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ o,
                                                     uint32_t chunks) {
  static_assert(Stages >= 2, "a slot's store is waited for one chunk later, with Stages - 2 groups left pending");
  static_assert(ChunkBytes % (16 * Threads) == 0, "every thread computes whole 16-byte vectors of a chunk");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  namespace sm = opforge::sm90;
  constexpr int V = 16 / sizeof(T);
  constexpr int kSlot = 3 * ChunkBytes;
  using VecT = cu::Vec<T, V>;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ uint64_t full[Stages];
  const auto* ga = reinterpret_cast<const uint8_t*>(a);
  const auto* gb = reinterpret_cast<const uint8_t*>(b);
  auto* go = reinterpret_cast<uint8_t*>(o);
  const uint32_t stride = gridDim.x;
  auto load = [&](uint32_t c, int s) {
    const uint32_t bar = sm::smem_addr(&full[s]), dst = sm::smem_addr(smem + s * kSlot);
    sm::mbar_expect_tx(bar, 2 * ChunkBytes);
    sm::bulk_load(dst, ga + size_t{c} * ChunkBytes, ChunkBytes, bar);
    sm::bulk_load(dst + ChunkBytes, gb + size_t{c} * ChunkBytes, ChunkBytes, bar);
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < Stages; ++s) sm::mbar_init(sm::smem_addr(&full[s]), 1);
    sm::mbar_init_fence();
    for (int s = 0; s < Stages && blockIdx.x + s * stride < chunks; ++s) load(blockIdx.x + s * stride, s);
  }
  __syncthreads();  // the barriers' inits, before anyone waits on them
  // Slot s's barrier completes one phase per chunk it holds; a slot is refilled
  // only after every thread has passed the __syncthreads that follows its wait,
  // so no thread is ever more than one phase behind and parity alone names it.
  int s = 0;
  uint32_t parity = 0;
  for (uint32_t c = blockIdx.x; c < chunks; c += stride) {
    uint8_t* slot = smem + s * kSlot;
    sm::mbar_wait(sm::smem_addr(&full[s]), parity);
    const auto* sa = reinterpret_cast<const VecT*>(slot);
    const auto* sb = reinterpret_cast<const VecT*>(slot + ChunkBytes);
    auto* so = reinterpret_cast<VecT*>(slot + 2 * ChunkBytes);
#pragma unroll
    for (int i = 0; i < ChunkBytes / 16 / Threads; ++i) {
      const int j = threadIdx.x + i * Threads;
      const VecT in[2] = {sa[j], sb[j]};
      VecT out[1];
      cu::apply_vec<T, V, 2, 1>(in, out, cu::Binary<AddOp>{});
      so[j] = out[0];
    }
    sm::fence_proxy_async();  // the bulk store (async proxy) reads what this thread just wrote
    // The next chunk writes the out buffer that the store of Stages - 1 chunks
    // ago reads: with this chunk's store not yet committed, Stages - 2 groups
    // may stay pending; the __syncthreads passes the wait on to every writer.
    if (threadIdx.x == 0) sm::bulk_wait_read<Stages - 2>();
    __syncthreads();
    if (threadIdx.x == 0) {
      sm::bulk_store(go + size_t{c} * ChunkBytes, sm::smem_addr(so), ChunkBytes);
      sm::bulk_commit();
      // Every thread has read this slot's inputs (the __syncthreads above).
      if (c + Stages * stride < chunks) load(c + Stages * stride, s);
    }
    if (++s == Stages) {
      s = 0;
      parity ^= 1;
    }
  }
  if (threadIdx.x == 0) sm::bulk_wait();  // shared memory must outlive the last stores' reads
#else
  __trap();  // bulk copies need sm_90a; bulk mode launches this only where sm90a_code_loaded()
#endif
}

// Time of add_bulk over n elements, BlocksPerSm blocks on every SM. Exits if
// the chunk does not divide the data or the grid would not be resident at once
// (the persistent walk assumes it).
template <typename T, int Threads, int Stages, int ChunkBytes, int BlocksPerSm>
float bulk_us(int64_t n, T* a, T* b, T* o) {
  constexpr int kSmem = Stages * 3 * ChunkBytes;
  static const int grid = [] {
    CHECK(cudaFuncSetAttribute(add_bulk<T, Threads, Stages, ChunkBytes>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               kSmem));
    int sms = 0, resident = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, add_bulk<T, Threads, Stages, ChunkBytes>, Threads,
                                                        kSmem));
    if (resident < BlocksPerSm) {
      std::printf("FAIL bulk %d thr %d x %d B: %d blocks resident per SM, want %d\n", Threads, Stages, ChunkBytes,
                  resident, BlocksPerSm);
      std::exit(1);
    }
    return sms * BlocksPerSm;
  }();
  if (n * sizeof(T) % ChunkBytes != 0) {
    std::printf("FAIL bulk: %lld bytes not a multiple of the %d-byte chunk\n", static_cast<long long>(n * sizeof(T)),
                ChunkBytes);
    std::exit(1);
  }
  const auto chunks = static_cast<uint32_t>(n * sizeof(T) / ChunkBytes);
  return median_us([&] { add_bulk<T, Threads, Stages, ChunkBytes><<<grid, Threads, kSmem>>>(a, b, o, chunks); });
}

// Each variant fills 192 KB of an SM's 228 KB of shared memory (3 buffers a
// slot): one deep block of 16 KB chunks; two blocks of 16 KB (room for 2
// stages) or 8 KB chunks (4 stages); four blocks of 128 threads on 4 KB chunks.
template <typename T>
void bulk_copies(const char* dtype) {
  for (int log2n : {26, 28}) {
    AddBuffers<T> m(log2n);
    const std::vector<std::function<float()>> variants = {
        [&] { return bulk_us<T, 256, 4, 16384, 1>(m.n, m.a, m.b, m.o); },
        [&] { return bulk_us<T, 256, 2, 16384, 2>(m.n, m.a, m.b, m.o); },
        [&] { return bulk_us<T, 256, 4, 8192, 2>(m.n, m.a, m.b, m.o); },
        [&] { return bulk_us<T, 128, 4, 4096, 4>(m.n, m.a, m.b, m.o); }};
    if (log2n == 26) check_against_op(dtype, m, variants);
    std::vector<std::function<float()>> timed = {[&] { return add_us<T, 256, 1>(m.n, m.a, m.b, m.o); }};
    timed.insert(timed.end(), variants.begin(), variants.end());
    const auto med = interleaved_medians(timed);
    std::printf("add %-8s 2^%-3d op's kernel %7.1f us | bulk 256thr 4x16K 1/SM %7.1f | 256thr 2x16K 2/SM %7.1f | "
                "256thr 4x8K 2/SM %7.1f | 128thr 4x4K 4/SM %7.1f\n",
                dtype, log2n, med[0], med[1], med[2], med[3], med[4]);
  }
}

int main(int argc, char** argv) {
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  if (!check_edges()) return 1;
  std::printf("edge check: every misalignment and size ok\n");
  std::vector<std::string> modes(argv + 1, argv + argc);
  if (modes.empty()) modes.push_back("sweep");
  for (const auto& mode : modes) {
    if (mode == "sweep") {
      std::printf("dtype    n     thr  U  bpsm | (%% = copy of the same bytes / kernel time)\n");
      sweep<float>("float32");
      sweep<__nv_bfloat16>("bfloat16");
    } else if (mode == "sigmoid") {
      sigmoid_forms<float>("float32");
      sigmoid_forms<__half>("float16");
      sigmoid_forms<__nv_bfloat16>("bfloat16");
    } else if (mode == "small") {
      small_sizes();
    } else if (mode == "hints") {
      cache_hints<float>("float32");
      cache_hints<__half>("float16");
      cache_hints<__nv_bfloat16>("bfloat16");
    } else if (mode == "multi") {
      multi_vectors<float>("float32");
      multi_vectors<__half>("float16");
      multi_vectors<__nv_bfloat16>("bfloat16");
    } else if (mode == "bulk") {
      if (!opforge::sm90::sm90a_code_loaded()) {
        std::printf("bulk: needs this binary's sm_90a code on a 9.0 GPU; skipped\n");
        continue;
      }
      bulk_copies<float>("float32");
      bulk_copies<__half>("float16");
      bulk_copies<__nv_bfloat16>("bfloat16");
    } else if (mode == "aligned") {
      aligned_threads<float>("float32");
      aligned_threads<__half>("float16");
      aligned_threads<__nv_bfloat16>("bfloat16");
    } else {
      std::printf("unknown mode %s (sweep, sigmoid, small, aligned, hints, multi, bulk)\n", mode.c_str());
      return 2;
    }
  }
  return 0;
}
