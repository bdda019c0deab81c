// Checks and times every GEMM kernel variant of csrc/ops/gemm against cuBLAS.
//
//   nvcc -std=c++17 -O3 -Icsrc -gencode=arch=compute_90a,code=sm_90a \
//        benchmarks/gemm_tune.cu -lcublas -o /tmp/gemm_tune && /tmp/gemm_tune [--quick] [--no-time]
//
// Correctness, for every variant on every shape it accepts (odd sizes 1, 7,
// 59, 97, 1025, tails in M, N and K, and the target shapes): fresh
// random inputs in [-1, 1) (never zeros), C poisoned with NaN before each run,
// then (1) every element against cuBLAS float32 (TF32 off) on the same
// inputs upcast, ||C - ref|| / ||ref|| over the whole matrix, NaN or Inf
// anywhere a failure, and (2) 512 sampled entries (the four corners among
// them) against a float64 dot product on the device.
// Variants that need a workspace (split-K, padded operands) get one of the
// size they ask for, allocated once per problem, outside the timed calls;
// each must also refuse one a byte short (an error, never a wrong result).
// Timing: CUDA events around each call, L2 flushed before each (a kernel that
// reads 256 MB: a memset would leave the L2 full of dirty lines, whose
// write-back the timed call would pay for), median of up to 50 calls after 3
// warm-ups; cuBLAS (cublasGemmEx, or cublasSgemm/Dgemm with
// CUBLAS_DEFAULT_MATH: no TF32) timed the same way. The split-K variants
// (_sk<splits>) are timed on the few-row shapes they are for.
//
// Built with -DOPF_TUNE_NO_CUBLAS (scripts/nvcc_check.sh, where the toolkit
// has no cuBLAS headers) every variant still compiles, and the driver refuses
// to run: cuBLAS is its reference and its baseline.
#ifndef OPF_TUNE_NO_CUBLAS
#include <cublas_v2.h>
#endif
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <string>
#include <vector>

#include "ops/gemm/gemm_dispatch.cuh"
#include "tune_common.cuh"

using namespace opforge;
using namespace opforge::gemm;

#ifndef OPF_TUNE_NO_CUBLAS
#define CHECK_BLAS(x)                                                      \
  do {                                                                     \
    cublasStatus_t s_ = (x);                                               \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                     \
      std::printf("cuBLAS error %d at %s:%d\n", int(s_), __FILE__, __LINE__); \
      std::exit(1);                                                        \
    }                                                                      \
  } while (0)
#endif

// ---------------------------------------------------------------------------
// Device helpers

__device__ __forceinline__ uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

template <typename T>
__device__ __forceinline__ T cvt(float x);
template <>
__device__ __forceinline__ float cvt<float>(float x) { return x; }
template <>
__device__ __forceinline__ double cvt<double>(float x) { return x; }
template <>
__device__ __forceinline__ __half cvt<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 cvt<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ double wide(float x) { return x; }
__device__ __forceinline__ double wide(double x) { return x; }
__device__ __forceinline__ double wide(__half x) { return __half2float(x); }
__device__ __forceinline__ double wide(__nv_bfloat16 x) { return __bfloat162float(x); }

// Uniform in [-1, 1), rounded to T; `up` gets the exact value as float32 (or
// double for T = double) for the cuBLAS reference.
template <typename T, typename U>
__global__ void fill_random(T* x, U* up, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const uint64_t h = mix(seed * 0x9e3779b97f4a7c15ULL + static_cast<uint64_t>(i));
    const float v = static_cast<float>(static_cast<double>(h >> 11) * (1.0 / 9007199254740992.0) * 2.0 - 1.0);
    const T t = cvt<T>(v);
    x[i] = t;
    if (up != nullptr) up[i] = static_cast<U>(wide(t));
  }
}

// sums[0] += (c - ref)^2, sums[1] += ref^2; bad += non-finite c.
template <typename T, typename U>
__global__ void compare_full(const T* c, const U* ref, int64_t n, double* sums, unsigned long long* bad) {
  double d2 = 0, r2 = 0;
  unsigned long long nbad = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const double v = wide(c[i]), r = static_cast<double>(ref[i]);
    if (!isfinite(v)) {
      ++nbad;
      continue;
    }
    d2 += (v - r) * (v - r);
    r2 += r * r;
  }
  for (int o = 16; o > 0; o /= 2) {
    d2 += __shfl_down_sync(0xffffffff, d2, o);
    r2 += __shfl_down_sync(0xffffffff, r2, o);
    nbad += __shfl_down_sync(0xffffffff, nbad, o);
  }
  if (threadIdx.x % 32 == 0) {
    atomicAdd(&sums[0], d2);
    atomicAdd(&sums[1], r2);
    atomicAdd(bad, nbad);
  }
}

// out[s] = (float64 dot product of row rows[s] of A and column cols[s] of B, c value)
template <typename T>
__global__ void sample_ref(const T* a, const T* b, const T* c, int64_t N, int64_t K, const int64_t* rows,
                           const int64_t* cols, int n, double* out) {
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= n) return;
  const int64_t i = rows[s], j = cols[s];
  double acc = 0;
  for (int64_t k = 0; k < K; ++k) acc += wide(a[i * K + k]) * wide(b[k * N + j]);
  out[2 * s] = acc;
  out[2 * s + 1] = wide(c[i * N + j]);
}

// ---------------------------------------------------------------------------
// Variants

using Applies = std::function<bool(const Problem&)>;
using WorkspaceBytes = std::function<size_t(const Problem&)>;

struct Variant {
  std::string name;
  DType dtype;
  Applies applies;
  std::function<const char*(const Problem&, Workspace, cudaStream_t)> run;
  WorkspaceBytes workspace;  // bytes `run` needs for a problem (empty: none)
  int64_t time_max_m = INT64_MAX;  // timed only on shapes with M up to this
};

static DeviceInfo g_info;

static bool any_problem(const Problem&) { return true; }

// Split-K variants check the odd shapes but not the large ones: their
// workspace is splits x M x N partial sums (16 splits of 4096^2: 1 GB), and
// the shapes they are for have a few rows.
constexpr int64_t kSplitCheckMaxMN = int64_t{1} << 22;
constexpr int64_t kSplitTimeMaxM = 64;

template <typename T>
using SimtAcc = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T, class Tile, bool kVec>
void add_simt(std::vector<Variant>& v, const std::string& name, DType dt) {
  v.push_back({name, dt, kVec ? Applies(simt_vec_ok) : Applies(any_problem),
               [](const Problem& p, Workspace, cudaStream_t s) {
                 return launch_simt<T, SimtAcc<T>, Tile, kVec>(p, g_info.sms, s);
               }});
}

// The split-K launcher asked for `splits` K ranges (split_k may run fewer).
template <typename T, class Tile, bool kVec>
void add_simt_split(std::vector<Variant>& v, const std::string& name, DType dt, int splits) {
  v.push_back({name, dt, [](const Problem& p) { return (!kVec || simt_vec_ok(p)) && p.M * p.N <= kSplitCheckMaxMN; },
               [splits](const Problem& p, Workspace ws, cudaStream_t s) {
                 return launch_simt<T, SimtAcc<T>, Tile, kVec, true>(p, g_info.sms, s, splits, ws);
               },
               [splits](const Problem& p) { return simt_workspace_bytes<SimtAcc<T>, Tile>(p, splits); },
               kSplitTimeMaxM});
}

// One SIMT tile split 2, 4, 8 and 16 ways (16-byte loads), named
// <name>_sk<splits>; and unsplit, named <name>, where asked.
template <class Tile>
void add_simt_splits(std::vector<Variant>& v, const std::string& name, bool with_unsplit = false) {
  if (with_unsplit) {
    add_simt<float, Tile, true>(v, name, DType::Float32);
    v.back().time_max_m = kSplitTimeMaxM;
  }
  for (int splits : {2, 4, 8, 16}) {
    add_simt_split<float, Tile, true>(v, name + "_sk" + std::to_string(splits), DType::Float32, splits);
  }
}

template <typename T, class Tile, bool kAsync>
void add_mma(std::vector<Variant>& v, const std::string& name, DType dt) {
  const Applies ok = kAsync ? Applies(mma_async_ok) : Applies(any_problem);
  v.push_back({name, dt, ok,
               [](const Problem& p, Workspace, cudaStream_t s) { return launch_mma<T, Tile, kAsync>(p, s); }});
}

template <typename T, class Tile>
void add_wgmma(std::vector<Variant>& v, const std::string& name, DType dt, int max_ctas = 0) {
  v.push_back({name, dt, [](const Problem& p) { return wgmma_ok(p) && wgmma_available(g_info); },
               [max_ctas](const Problem& p, Workspace, cudaStream_t s) {
                 return launch_wgmma<T, Tile>(p, g_info, s, max_ctas);
               }});
}

template <typename T, class Tile>
void add_wgmma_packed(std::vector<Variant>& v, const std::string& name, DType dt) {
  v.push_back({name, dt, [](const Problem& p) { return wgmma_dims_ok(p) && wgmma_available(g_info); },
               [](const Problem& p, Workspace ws, cudaStream_t s) {
                 return launch_wgmma_packed<T, Tile>(p, g_info, s, ws);
               },
               packed_workspace_bytes});
}

template <typename T>
void add_half_variants(std::vector<Variant>& v, DType dt) {
  // TMA-store epilogue (staged C), then the direct epilogue for comparison.
  add_wgmma<T, WgmmaTile<128, 256, 3, 2>>(v, "wgmma128x256s3", dt);
  add_wgmma<T, WgmmaTile<128, 128, 6, 2>>(v, "wgmma128x128s6", dt);
  add_wgmma<T, WgmmaTile<128, 128, 5, 2>>(v, "wgmma128x128s5", dt);
  add_wgmma<T, WgmmaTile<256, 128, 3, 2>>(v, "wgmma256x128s3", dt);
  add_wgmma<T, WgmmaTile<128, 128, 6, 1>>(v, "wgmma128x128s6c1", dt);
  add_wgmma<T, WgmmaTile<64, 128, 8, 1>>(v, "wgmma64x128s8", dt);
  add_wgmma<T, WgmmaTile<64, 64, 8, 1>>(v, "wgmma64x64s8", dt);
  add_wgmma<T, WgmmaTile<128, 256, 4, 2, false>>(v, "wgmma128x256s4d", dt);
  add_wgmma<T, WgmmaTile<64, 128, 8, 1, false>>(v, "wgmma64x128s8d", dt);
  // Any shape on sm_90a: misaligned operands padded into the workspace first.
  add_wgmma_packed<T, WgmmaTile<128, 256, 4, 2, false>>(v, "packed128x256s4", dt);
  add_wgmma_packed<T, WgmmaTile<128, 128, 6, 2, false>>(v, "packed128x128s6", dt);
  add_wgmma_packed<T, WgmmaTile<64, 128, 8, 1, false>>(v, "packed64x128s8", dt);
  add_mma<T, MmaTile<128, 128, 64, 32, 4>, true>(v, "mma128x128s4", dt);
  add_mma<T, MmaTile<128, 256, 64, 64, 3>, true>(v, "mma128x256s3", dt);
  add_mma<T, MmaTile<64, 64, 32, 32, 4>, true>(v, "mma64x64s4", dt);
  add_mma<T, MmaTile<128, 128, 64, 32, 4>, false>(v, "mma128x128_unal", dt);
  add_mma<T, MmaTile<64, 64, 32, 32, 4>, false>(v, "mma64x64_unal", dt);
}

static std::vector<Variant> make_variants() {
  std::vector<Variant> v;
  add_simt<float, SimtTile<128, 128, 8, 64, 32, 8, 8>, true>(v, "simt128x128x8", DType::Float32);
  add_simt<float, SimtTile<128, 128, 16, 64, 32, 8, 8>, true>(v, "simt128x128x16", DType::Float32);
  add_simt<float, SimtTile<128, 256, 8, 64, 64, 8, 16>, true>(v, "simt128x256x8", DType::Float32);
  add_simt<float, SimtTile<256, 128, 8, 64, 64, 16, 8>, true>(v, "simt256x128x8", DType::Float32);
  add_simt<float, SimtTile<256, 128, 16, 64, 64, 16, 8>, true>(v, "simt256x128x16", DType::Float32);
  add_simt<float, SimtTile<128, 256, 16, 64, 64, 8, 16>, true>(v, "simt128x256x16", DType::Float32);
  add_simt<float, SimtTile<16, 64, 32, 16, 32, 4, 4>, true>(v, "simt16x64x32", DType::Float32);
  add_simt<float, SimtTile<32, 32, 32, 32, 16, 4, 4>, true>(v, "simt32x32x32", DType::Float32);
  add_simt<float, SimtTile<16, 64, 64, 16, 32, 4, 4>, true>(v, "simt16x64x64", DType::Float32);
  add_simt<float, SimtTile<32, 32, 64, 32, 16, 4, 4>, true>(v, "simt32x32x64", DType::Float32);
  add_simt<float, SimtTile<128, 256, 16, 64, 64, 8, 16>, false>(v, "simt128x256x16_scalar", DType::Float32);
  add_simt<float, SimtTile<256, 128, 8, 64, 64, 16, 8>, false>(v, "simt256x128x8_scalar", DType::Float32);
  add_simt<float, SimtTile<64, 64, 16, 32, 32, 4, 8>, true>(v, "simt64x64x16", DType::Float32);
  add_simt<float, SimtTile<128, 128, 8, 64, 32, 8, 8>, false>(v, "simt128x128x8_scalar", DType::Float32);
  add_simt<float, SimtTile<64, 64, 16, 32, 32, 4, 8>, false>(v, "simt64x64x16_scalar", DType::Float32);
  // Split-K on the few-row tiles: the dispatcher's 16 x 64 x 32, 32 x 32 x
  // 32 and 64 x 64 x 16 (unsplit above), and 16 x 128 x 32 with 4 warps (the
  // same 4 x 4 outputs a thread, twice the B columns per CTA).
  add_simt_splits<SimtSkinny16>(v, "simt16x64x32");
  add_simt_splits<SimtTile<16, 128, 32, 16, 32, 4, 4>>(v, "simt16x128x32", true);
  add_simt_splits<SimtSkinny32>(v, "simt32x32x32");
  add_simt_splits<SimtSmall>(v, "simt64x64x16");
  // Element loads and float64 through the split path (K, N odd; checked, and
  // timed only where they are the only choice).
  add_simt_split<float, SimtSkinny16, false>(v, "simt16x64x32_sk4_scalar", DType::Float32, 4);
  add_simt_split<float, SimtSmall, false>(v, "simt64x64x16_sk4_scalar", DType::Float32, 4);
  add_simt_split<double, SimtF64, false>(v, "simt64x64x8_sk4", DType::Float64, 4);
  add_half_variants<__nv_bfloat16>(v, DType::BFloat16);
  add_half_variants<__half>(v, DType::Float16);
  add_simt<__half, SimtTile<64, 64, 16, 32, 32, 4, 8>, false>(v, "simt64x64x16_scalar", DType::Float16);
  // gemm_cuda's own plan: the same two calls (gemm_cuda_workspace, gemm_cuda).
  for (DType dt : {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16}) {
    v.push_back({"auto", dt, any_problem,
                 [dt](const Problem& p, Workspace ws, cudaStream_t s) { return dispatch(dt, p, ws, s); },
                 [dt](const Problem& p) { return workspace_bytes(dt, p); }});
  }
  return v;
}

// ---------------------------------------------------------------------------
// Buffers for one (shape, dtype)

static const char* dname(DType d) {
  switch (d) {
    case DType::Float32: return "float32";
    case DType::Float16: return "float16";
    case DType::BFloat16: return "bfloat16";
    case DType::Float64: return "float64";
  }
  return "?";
}
static size_t dsize(DType d) { return d == DType::Float64 ? 8 : d == DType::Float32 ? 4 : 2; }

struct Case {
  DType dt;
  int64_t M, N, K;
  void *a = nullptr, *b = nullptr, *c = nullptr;
  void *a_up = nullptr, *b_up = nullptr, *ref = nullptr;  // float32 (float64 for float64)
  Problem p() const { return Problem{a, b, c, M, N, K}; }
};

#ifndef OPF_TUNE_NO_CUBLAS
static cublasHandle_t g_blas;
#endif
static uint64_t g_seed = 1;

template <typename T, typename U>
static void fill(Case& cs) {
  fill_random<T, U><<<1024, 256>>>(static_cast<T*>(cs.a), static_cast<U*>(cs.a_up), cs.M * cs.K, g_seed++);
  fill_random<T, U><<<1024, 256>>>(static_cast<T*>(cs.b), static_cast<U*>(cs.b_up), cs.K * cs.N, g_seed++);
  CHECK(cudaGetLastError());
}

static void alloc_case(Case& cs, bool with_ref) {
  const size_t e = dsize(cs.dt), u = cs.dt == DType::Float64 ? 8 : 4;
  CHECK(cudaMalloc(&cs.a, cs.M * cs.K * e));
  CHECK(cudaMalloc(&cs.b, cs.K * cs.N * e));
  CHECK(cudaMalloc(&cs.c, cs.M * cs.N * e));
  if (with_ref) {
    CHECK(cudaMalloc(&cs.a_up, cs.M * cs.K * u));
    CHECK(cudaMalloc(&cs.b_up, cs.K * cs.N * u));
    CHECK(cudaMalloc(&cs.ref, cs.M * cs.N * u));
  }
  switch (cs.dt) {
    case DType::Float32: fill<float, float>(cs); break;
    case DType::Float64: fill<double, double>(cs); break;
    case DType::Float16: fill<__half, float>(cs); break;
    case DType::BFloat16: fill<__nv_bfloat16, float>(cs); break;
  }
}

static void free_case(Case& cs) {
  for (void* p : {cs.a, cs.b, cs.c, cs.a_up, cs.b_up, cs.ref})
    if (p) CHECK(cudaFree(p));
}

// The workspace a variant asks for, as gemm.cpp gives it: cudaMalloc'd once
// per problem (a block at least as large is kept for the next variant), so
// that no allocation falls inside a timed call. Freed by release().
struct Scratch {
  void* ptr = nullptr;
  size_t bytes = 0;
  Workspace get(size_t need) {
    if (need == 0) return {};
    if (need > bytes) {
      release();
      CHECK(cudaMalloc(&ptr, need));
      bytes = need;
    }
    return {ptr, need};
  }
  void release() {
    if (ptr != nullptr) CHECK(cudaFree(ptr));
    ptr = nullptr, bytes = 0;
  }
};
static Scratch g_scratch;

static size_t workspace_of(const Variant& v, const Problem& p) { return v.workspace ? v.workspace(p) : 0; }

#ifdef OPF_TUNE_NO_CUBLAS
static void blas_ref(Case&) {}
static void blas_native(const Case&) {}
#else
// Row-major C = A B is column-major C^T = B^T A^T: cuBLAS gets (B, A) and (N, M).
static void blas_ref(Case& cs) {
  if (cs.dt == DType::Float64) {
    const double one = 1, zero = 0;
    CHECK_BLAS(cublasDgemm(g_blas, CUBLAS_OP_N, CUBLAS_OP_N, cs.N, cs.M, cs.K, &one, static_cast<double*>(cs.b_up),
                           cs.N, static_cast<double*>(cs.a_up), cs.K, &zero, static_cast<double*>(cs.ref), cs.N));
  } else {
    const float one = 1, zero = 0;
    CHECK_BLAS(cublasSgemm(g_blas, CUBLAS_OP_N, CUBLAS_OP_N, cs.N, cs.M, cs.K, &one, static_cast<float*>(cs.b_up),
                           cs.N, static_cast<float*>(cs.a_up), cs.K, &zero, static_cast<float*>(cs.ref), cs.N));
  }
}

// cuBLAS on the case's own dtype: the timing baseline.
static void blas_native(const Case& cs) {
  const float one = 1, zero = 0;
  switch (cs.dt) {
    case DType::Float32:
      CHECK_BLAS(cublasSgemm(g_blas, CUBLAS_OP_N, CUBLAS_OP_N, cs.N, cs.M, cs.K, &one, static_cast<const float*>(cs.b),
                             cs.N, static_cast<const float*>(cs.a), cs.K, &zero, static_cast<float*>(cs.c), cs.N));
      break;
    case DType::Float64: {
      const double d1 = 1, d0 = 0;
      CHECK_BLAS(cublasDgemm(g_blas, CUBLAS_OP_N, CUBLAS_OP_N, cs.N, cs.M, cs.K, &d1, static_cast<const double*>(cs.b),
                             cs.N, static_cast<const double*>(cs.a), cs.K, &d0, static_cast<double*>(cs.c), cs.N));
      break;
    }
    case DType::Float16:
    case DType::BFloat16: {
      const cudaDataType t = cs.dt == DType::Float16 ? CUDA_R_16F : CUDA_R_16BF;
      CHECK_BLAS(cublasGemmEx(g_blas, CUBLAS_OP_N, CUBLAS_OP_N, cs.N, cs.M, cs.K, &one, cs.b, t, cs.N, cs.a, t, cs.K,
                              &zero, cs.c, t, cs.N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      break;
    }
  }
}
#endif

// Waits for the device, but gives up after 30 s: a kernel that deadlocks
// (an mbarrier phase never completing) must not eat the whole GPU run.
static cudaError_t sync_or_die(const char* what) {
  const auto start = std::chrono::steady_clock::now();
  cudaError_t st;
  while ((st = cudaStreamQuery(nullptr)) == cudaErrorNotReady) {
    if (std::chrono::steady_clock::now() - start > std::chrono::seconds(30)) {
      std::printf("HANG: %s did not finish in 30 s\n", what);
      std::fflush(stdout);
      std::_Exit(3);
    }
  }
  return st == cudaSuccess ? cudaDeviceSynchronize() : st;
}

struct CheckResult {
  double rel_full, rel_f64;
  unsigned long long bad;
};

static CheckResult check(const Case& cs) {
  double* sums;
  unsigned long long* bad;
  CHECK(cudaMalloc(&sums, 2 * sizeof(double)));
  CHECK(cudaMalloc(&bad, sizeof(unsigned long long)));
  CHECK(cudaMemset(sums, 0, 2 * sizeof(double)));
  CHECK(cudaMemset(bad, 0, sizeof(unsigned long long)));
  const int64_t n = cs.M * cs.N;
  switch (cs.dt) {
    case DType::Float32: compare_full<<<1024, 256>>>(static_cast<float*>(cs.c), static_cast<float*>(cs.ref), n, sums, bad); break;
    case DType::Float64: compare_full<<<1024, 256>>>(static_cast<double*>(cs.c), static_cast<double*>(cs.ref), n, sums, bad); break;
    case DType::Float16: compare_full<<<1024, 256>>>(static_cast<__half*>(cs.c), static_cast<float*>(cs.ref), n, sums, bad); break;
    case DType::BFloat16: compare_full<<<1024, 256>>>(static_cast<__nv_bfloat16*>(cs.c), static_cast<float*>(cs.ref), n, sums, bad); break;
  }
  CHECK(cudaGetLastError());
  double h[2];
  unsigned long long hb;
  CHECK(cudaMemcpy(h, sums, sizeof h, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(&hb, bad, sizeof hb, cudaMemcpyDeviceToHost));

  // Sampled float64 check.
  const int S = 512;
  std::vector<int64_t> rows(S), cols(S);
  uint64_t r = g_seed++ * 2654435761ULL + 12345;
  for (int s = 0; s < S; ++s) {
    r = r * 6364136223846793005ULL + 1442695040888963407ULL;
    rows[s] = static_cast<int64_t>((r >> 17) % static_cast<uint64_t>(cs.M));
    r = r * 6364136223846793005ULL + 1442695040888963407ULL;
    cols[s] = static_cast<int64_t>((r >> 17) % static_cast<uint64_t>(cs.N));
  }
  rows[0] = 0, cols[0] = 0, rows[1] = cs.M - 1, cols[1] = cs.N - 1, rows[2] = cs.M - 1, cols[2] = 0, rows[3] = 0,
  cols[3] = cs.N - 1;
  int64_t *drows, *dcols;
  double* dout;
  CHECK(cudaMalloc(&drows, S * sizeof(int64_t)));
  CHECK(cudaMalloc(&dcols, S * sizeof(int64_t)));
  CHECK(cudaMalloc(&dout, 2 * S * sizeof(double)));
  CHECK(cudaMemcpy(drows, rows.data(), S * sizeof(int64_t), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dcols, cols.data(), S * sizeof(int64_t), cudaMemcpyHostToDevice));
  switch (cs.dt) {
    case DType::Float32: sample_ref<<<S / 128, 128>>>(static_cast<float*>(cs.a), static_cast<float*>(cs.b), static_cast<float*>(cs.c), cs.N, cs.K, drows, dcols, S, dout); break;
    case DType::Float64: sample_ref<<<S / 128, 128>>>(static_cast<double*>(cs.a), static_cast<double*>(cs.b), static_cast<double*>(cs.c), cs.N, cs.K, drows, dcols, S, dout); break;
    case DType::Float16: sample_ref<<<S / 128, 128>>>(static_cast<__half*>(cs.a), static_cast<__half*>(cs.b), static_cast<__half*>(cs.c), cs.N, cs.K, drows, dcols, S, dout); break;
    case DType::BFloat16: sample_ref<<<S / 128, 128>>>(static_cast<__nv_bfloat16*>(cs.a), static_cast<__nv_bfloat16*>(cs.b), static_cast<__nv_bfloat16*>(cs.c), cs.N, cs.K, drows, dcols, S, dout); break;
  }
  CHECK(cudaGetLastError());
  std::vector<double> out(2 * S);
  CHECK(cudaMemcpy(out.data(), dout, 2 * S * sizeof(double), cudaMemcpyDeviceToHost));
  double d2 = 0, r2 = 0;
  for (int s = 0; s < S; ++s) {
    const double ref = out[2 * s], v = out[2 * s + 1];
    if (!std::isfinite(v)) ++hb;
    d2 += (v - ref) * (v - ref);
    r2 += ref * ref;
  }
  for (void* p : {static_cast<void*>(sums), static_cast<void*>(bad), static_cast<void*>(drows),
                  static_cast<void*>(dcols), static_cast<void*>(dout)})
    CHECK(cudaFree(p));
  return {std::sqrt(h[0] / h[1]), std::sqrt(d2 / r2), hb};
}

// Relative error bound per dtype. Inputs are exact in their dtype, so this is
// accumulation error plus the output's rounding: float32 far under 1e-3
// (the issue; about 4e-6 is expected at K = 8192), bfloat16 under 1e-2 (8-bit mantissa output), float16 under 2e-3.
static double tolerance(DType d) {
  switch (d) {
    case DType::Float32: return 1e-4;
    case DType::Float64: return 1e-12;
    case DType::Float16: return 2e-3;
    case DType::BFloat16: return 1e-2;
  }
  return 0;
}

// ---------------------------------------------------------------------------
// Timing

static void* g_flush = nullptr;
static unsigned* g_sink = nullptr;
static const size_t kFlushBytes = size_t{256} << 20;

// One call timed after an L2 flush (which also hides the host's launch work).
static float flushed_us(EventTimer& timer, const std::function<void()>& call, int salt) {
  read_all<<<g_info.sms * 4, 512>>>(static_cast<const uint4*>(g_flush), kFlushBytes / 16, static_cast<unsigned>(salt),
                                      g_sink);
  CHECK(cudaGetLastError());
  return timer.us(call);
}

// Median microseconds of `call` and, when given, of `base` timed in turn
// with it (one of each per round), so that both see the same clocks and
// temperature: the ratio of the two is what the table reports.
static std::pair<double, double> median_us(const std::function<void()>& call, const std::function<void()>& base,
                                           int max_reps, double budget_ms) {
  EventTimer timer;
  for (int i = 0; i < 3; ++i) {
    call();
    if (base) base();
  }
  CHECK(cudaDeviceSynchronize());
  std::vector<float> tc, tb;
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < max_reps; ++i) {
    tc.push_back(flushed_us(timer, call, 2 * i));
    if (base) tb.push_back(flushed_us(timer, base, 2 * i + 1));
    const double spent = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (i >= 9 && spent > budget_ms) break;
  }
  return {median_of(tc), base ? median_of(tb) : 0.0};
}

struct Row {
  std::string shape, dtype, variant;
  double us, tflops, pct;
};

int main(int argc, char** argv) {
  bool quick = false, time_it = true;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    if (!std::strcmp(argv[i], "--no-time")) time_it = false;
    if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  int drv = 0, rt = 0;
  CHECK(cudaDriverGetVersion(&drv));
  CHECK(cudaRuntimeGetVersion(&rt));
  int blas_ver = 0;
#ifdef OPF_TUNE_NO_CUBLAS
  std::printf("gemm_tune was built without cuBLAS (-DOPF_TUNE_NO_CUBLAS): nothing to compare with\n");
  return 2;
#else
  CHECK_BLAS(cublasCreate(&g_blas));
  CHECK_BLAS(cublasSetMathMode(g_blas, CUBLAS_DEFAULT_MATH));  // no TF32 for float32
  CHECK_BLAS(cublasGetVersion(g_blas, &blas_ver));
#endif
  if (const char* err = device_info(g_info)) {
    std::printf("device_info: %s\n", err);
    return 1;
  }
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  std::printf("device: %s, %d SMs, L2 %d MB, CC %d.%d; CUDA driver %d, runtime %d, cuBLAS %d; %s\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize >> 20, prop.major, prop.minor, drv, rt, blas_ver, date);
  std::printf("wgmma path available: %s\n", wgmma_available(g_info) ? "yes" : "no");
  CHECK(cudaMalloc(&g_flush, kFlushBytes));
  // Every byte 1: no checksum has the top bit that the sink's condition asks for.
  CHECK(cudaMemset(g_flush, 1, kFlushBytes));
  CHECK(cudaMalloc(&g_sink, sizeof(unsigned)));

  auto variants = make_variants();
  int failures = 0;

  // ---- correctness
  struct Shape {
    int64_t M, N, K;
  };
  std::vector<Shape> check_shapes = {
      {1, 1, 1},        {7, 7, 7},       {1, 8, 8},        {7, 16, 24},      {59, 97, 1025},    {97, 59, 33},
      {1, 1025, 97},    {1025, 1, 59},   {64, 64, 64},     {129, 257, 65},   {59, 1032, 1048},  {200, 72, 8},
      {1025, 1025, 1025}, {1024, 1024, 1024}, {255, 520, 1000}, {16, 8192, 8192}, {4095, 4097, 4093}, {8192, 8192, 512},
      {4096, 4096, 4096}, {300, 4104, 136}, {4097, 264, 4096},
      // Split-K's shapes: few rows, long K, M / N / K tails, odd K (element
      // loads), K not a multiple of the split chunk.
      {3, 1000, 4096}, {31, 4097, 8191}, {32, 8192, 8192}, {64, 4096, 4096}, {1, 520, 2049}};
  if (quick) check_shapes.resize(14);
  std::printf("\n== correctness (rel = ||C - ref|| / ||ref||; full: vs cuBLAS float32 on every element, f64: 512 "
              "sampled entries vs float64)\n");
  for (DType dt : {DType::Float32, DType::Float64, DType::BFloat16, DType::Float16}) {
    for (const Shape& sh : check_shapes) {
      if (dt == DType::Float64 && sh.M * sh.N * sh.K > (int64_t{1} << 33)) continue;  // float64 serves gradcheck
      Case cs{dt, sh.M, sh.N, sh.K};
      alloc_case(cs, true);
      blas_ref(cs);
      CHECK(cudaDeviceSynchronize());
      for (auto& v : variants) {
        if (v.dtype != dt || !v.applies(cs.p())) continue;
        if (!only.empty() && v.name.find(only) == std::string::npos && v.name != "auto") continue;
        const size_t need = workspace_of(v, cs.p());
        if (need > 0) {
          // One byte short, and none at all: an error before anything runs.
          const Workspace full = g_scratch.get(need);
          const char* e1 = v.run(cs.p(), Workspace{full.ptr, need - 1}, nullptr);
          const char* e2 = v.run(cs.p(), Workspace{}, nullptr);
          if (e1 == nullptr || e2 == nullptr) {
            std::printf("FAIL %-9s %5lldx%5lldx%5lld %-22s ran with a short workspace (%zu of %zu bytes)\n", dname(dt),
                        (long long)sh.M, (long long)sh.N, (long long)sh.K, v.name.c_str(), need - 1, need);
            ++failures;
          }
        }
        CHECK(cudaMemset(cs.c, 0xff, cs.M * cs.N * dsize(dt)));  // NaN in every dtype
        const char* err = v.run(cs.p(), g_scratch.get(need), nullptr);
        const std::string what = v.name + " " + dname(dt) + " " + std::to_string(sh.M) + "x" + std::to_string(sh.N) + "x" + std::to_string(sh.K);
        cudaError_t sync = sync_or_die(what.c_str());
        if (err != nullptr || sync != cudaSuccess) {
          std::printf("FAIL %-9s %5lldx%5lldx%5lld %-22s launch: %s / %s\n", dname(dt), (long long)sh.M, (long long)sh.N,
                      (long long)sh.K, v.name.c_str(), err ? err : "-", cudaGetErrorString(sync));
          ++failures;
          if (sync != cudaSuccess) return 2;  // the context is gone
          continue;
        }
        const CheckResult r = check(cs);
        const bool ok = r.bad == 0 && r.rel_f64 < tolerance(dt) && r.rel_full < tolerance(dt);
        if (!ok) ++failures;
        std::printf("%s %-9s %5lldx%5lldx%5lld %-22s full %.2e  f64 %.2e  nonfinite %llu\n", ok ? "ok  " : "FAIL",
                    dname(dt), (long long)sh.M, (long long)sh.N, (long long)sh.K, v.name.c_str(), r.rel_full, r.rel_f64,
                    r.bad);
      }
      free_case(cs);
      g_scratch.release();
    }
  }
  std::printf("correctness: %d failure(s)\n", failures);
  if (!time_it) return failures ? 1 : 0;

  // ---- ceilings: device copy bandwidth
  {
    void *x, *y;
    const size_t bytes = size_t{1} << 30;
    CHECK(cudaMalloc(&x, bytes));
    CHECK(cudaMalloc(&y, bytes));
    CHECK(cudaMemset(x, 1, bytes));
    const double us = median_us([&] { CHECK(cudaMemcpyAsync(y, x, bytes, cudaMemcpyDeviceToDevice)); }, {}, 20, 500).first;
    std::printf("\ndevice copy: %.0f GB/s (bytes read + written, 1 GiB)\n", 2.0 * bytes / us / 1e3);
    CHECK(cudaFree(x));
    CHECK(cudaFree(y));
  }

  // ---- timing
  std::vector<Shape> time_shapes = {{4096, 4096, 4096}, {8192, 8192, 8192}, {4095, 4097, 4093}, {8192, 8192, 512},
                                    {16, 8192, 8192},   {2048, 2048, 2048}, {1024, 1024, 1024}, {32, 8192, 8192},
                                    {64, 4096, 4096}};
  if (quick) time_shapes.resize(2);
  std::vector<Row> rows;
  std::vector<std::string> plans;
  for (DType dt : {DType::BFloat16, DType::Float16, DType::Float32}) {
    for (const Shape& sh : time_shapes) {
      Case cs{dt, sh.M, sh.N, sh.K};
      alloc_case(cs, false);
      CHECK(cudaDeviceSynchronize());
      const double flops = 2.0 * sh.M * sh.N * sh.K;
      const double budget = dt == DType::Float32 ? 400 : 150;
      char shape[64];
      std::snprintf(shape, sizeof shape, "%lldx%lldx%lld", (long long)sh.M, (long long)sh.N, (long long)sh.K);
      const std::function<void()> blas = [&] { blas_native(cs); };
      std::vector<double> blas_all;
      const size_t blas_row = rows.size();
      rows.push_back({shape, dname(dt), "cuBLAS", 0, 0, 100.0});
      for (auto& v : variants) {
        if (v.dtype != dt || !v.applies(cs.p())) continue;
        if (!only.empty() && v.name.find(only) == std::string::npos && v.name != "auto") continue;
        // Fallbacks are timed only where they are the only choice of their kind.
        if (v.name.find("_scalar") != std::string::npos && simt_vec_ok(cs.p())) continue;
        if (v.name.find("_unal") != std::string::npos && mma_async_ok(cs.p())) continue;
        if (v.name.find("packed") != std::string::npos && wgmma_ok(cs.p())) continue;
        if (sh.M > v.time_max_m) continue;
        const Problem p = cs.p();
        const Workspace ws = g_scratch.get(workspace_of(v, p));
        const auto [us, bus] = median_us(
            [&] {
              if (const char* err = v.run(p, ws, nullptr)) {
                std::printf("launch failed: %s\n", err);
                std::exit(1);
              }
            },
            blas, 50, budget);
        blas_all.push_back(bus);
        rows.push_back({shape, dname(dt), v.name, us, flops / us / 1e6, 100.0 * bus / us});
      }
      std::sort(blas_all.begin(), blas_all.end());
      const double blas_us = blas_all.empty() ? 0 : blas_all[blas_all.size() / 2];
      rows[blas_row].us = blas_us;
      rows[blas_row].tflops = blas_us > 0 ? flops / blas_us / 1e6 : 0;
      const Plan pl = plan(dt, cs.p(), g_info);
      char line[160];
      std::snprintf(line, sizeof line, "%-16s %-9s %-16s vec %d  splits %2d  workspace %8.2f MB", shape, dname(dt),
                    kernel_name(pl.kernel), pl.vec ? 1 : 0, pl.splits, pl.workspace / 1048576.0);
      plans.push_back(line);
      free_case(cs);
      g_scratch.release();
      CHECK(cudaGetLastError());
    }
  }
  std::printf("\n== timing (median, L2 flushed; %% = cuBLAS time / variant time, the two timed in turn; the cuBLAS "
              "row: median over those runs)\n");
  std::printf("%-16s %-9s %-22s %10s %9s %8s\n", "shape", "dtype", "variant", "us", "TFLOP/s", "% cuBLAS");
  for (const Row& r : rows) {
    std::printf("%-16s %-9s %-22s %10.1f %9.1f %7.1f%%\n", r.shape.c_str(), r.dtype.c_str(), r.variant.c_str(), r.us,
                r.tflops, r.pct);
  }
  std::printf("\n== auto's plan per timed shape (vec: 16-byte loads for SIMT, cp.async for mma.sync; splits: "
              "split-K's K ranges)\n");
  for (const std::string& line : plans) std::printf("%s\n", line.c_str());
  std::printf("correctness: %d failure(s)\n", failures);
  return failures ? 1 : 0;
}
