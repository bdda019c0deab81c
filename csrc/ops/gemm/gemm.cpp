// gemm: C = A @ B for A [M, K] and B [K, N], the GEMM tutorial's GEMM operator.
//
//   gemm(Tensor a, Tensor b) -> Tensor
//
// One dtype for A, B and C (float32, float16, bfloat16 or float64), any M, N,
// K (an empty C returns at once; K == 0 gives zeros). Accumulation is in
// float32 (float64 for float64) and a half-type result is rounded once.
// CUDA: gemm_cuda (gemm_kernel.h), pure-CUDA kernels, with the workspace it
// asks for (gemm_cuda_workspace) from torch's caching allocator. CPU: the blocked,
// threaded kernel of gemm_cpu.h, compiled here once per x86 instruction set
// and chosen at run time; it never calls ATen's matmul.
//
// The CPU kernel against torch.matmul (MKL) on this project's 2-core AMD EPYC
// (Zen 4, AVX-512; torch 2.13, 2 threads, best of 30 calls, GFLOP/s, a
// machine shared with other jobs: +-5 %):
//   float32  1024^3 170 vs 188 (0.90x), 512^3 180 vs 183 (0.98x),
//            253x259x509 156 vs 163 (0.96x)
//   float64  1024^3 77 vs 84 (0.91x), 512^3 84 vs 68 (1.24x)
//   bfloat16 1024^3 193 vs 414 (0.46x): MKL-DNN uses AVX512-BF16 dot products;
//            here the blocks are widened to float32
//   float16  512^3 202 vs 2.6 (78x): torch has no fast float16 CPU GEMM here

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <type_traits>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
// GCC on x86-64: the kernel is also compiled for AVX2 and AVX-512 (below).
// Other compilers and architectures build the generic version alone.
#define OPFORGE_GEMM_X86 1
#include <immintrin.h>
#else
#define OPFORGE_GEMM_X86 0
#endif

#include "gemm.h"
#include "gemm_kernel.h"
#include "opforge/stable/common.h"

namespace opforge {
namespace {

constexpr const char* kGemm = "opforge::gemm";

// M, N and K of at most 2^31 - 1: TMA's tile coordinates are signed 32-bit
// (cp.async.bulk.tensor) and CUDA grids count blocks in 32 bits, so the GPU
// kernels may rely on it. The CPU kernel indexes in 64 bits and would not need
// it; one limit on every device keeps a program that runs on the CPU valid on a GPU.
constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();

void check_dim(const char* what, int64_t value, const Tensor& a, const Tensor& b) {
  OPFORGE_CHECK(value <= kMaxDim, kGemm, ": ", what, " = ", value,
                " is past the kernels' limit of 2^31 - 1 (a has shape ", dims(a.sizes()), ", b ",
                dims(b.sizes()), ")");
}

}  // namespace

// --- the CPU kernel: shared pieces, compiled for the baseline ISA ---
namespace gemm_cpu {

template <typename S>
struct Accumulate {
  using type = float;
};
template <>
struct Accumulate<double> {
  using type = double;
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// A cache-line aligned array: the packed panels are read by full-width vector
// loads, which cost two cache accesses when they straddle a line.
template <typename T>
class Buffer {
 public:
  explicit Buffer(int64_t n)
      : p_(static_cast<T*>(::operator new[](static_cast<size_t>(n) * sizeof(T),
                                            std::align_val_t{64}))) {}
  ~Buffer() { ::operator delete[](p_, std::align_val_t{64}); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  T* get() const { return p_; }

 private:
  T* p_;
};

// The cache blocks, per accumulation type. A task's working set, the packed
// B panel (KC x NC) + the packed A block (MC x KC) + the C tile (MC x NC), is
// 780 KiB in float32 and 888 KiB in float64 (NC halved): under the 1 MiB L2 of
// a Zen 4 core; A's MR x KC micro-panel (9 KiB, 18 in float64) stays in L1.
// Chosen by a sweep on this project's 2-core AMD EPYC (Zen 4, AVX-512),
// best of 8 rounds on a shared machine, geometric mean over 1024^3,
// 513x257x1025 and 256x2048x512 (float32, GFLOP/s; torch.matmul/MKL 188):
// MC,NC,KC = 144,512,192: 172; 192,512,128: 167; 192,512,256: 167;
// 96,256,256: 159. MC is a multiple of every MR (6 and 12).
template <typename T>
struct CacheBlocks {
  static constexpr int64_t MC = 144, NC = 512 * 4 / sizeof(T), KC = 192;
};

struct TileGrid {
  int64_t mc, nc, kc, tiles, grain;
};

// Products under this many multiply-adds run on one thread: waking the
// OpenMP team costs about what a second core saves there (measured on the
// 2-core EPYC: 64^3 = 2^18 takes 13.2 us on one thread, 11.4 us on two;
// 128^3 63.5 vs 44.0 us).
constexpr int64_t kSerialMacs = 1 << 18;

// `n` cut into `parts` blocks of equal size rounded up to a multiple of
// `unit` (the last one shorter): 257 columns in 2 parts are 2 x 136 with
// NR = 8, not 256 + 1, so no block is a sliver that costs as much as a full one.
inline int64_t split(int64_t n, int64_t parts, int64_t unit) {
  return round_up(ceil_div(n, parts), unit);
}

// The work of the busiest thread when C is cut into mc x nc tiles (row tiles
// fastest) and torch's parallel_for hands each of `threads` a contiguous run of
// ceil(tiles / threads) of them. A tile costs its padded area (the
// micro-kernel computes the padding too) plus the packing of its A and B
// slices, about 16 multiply-adds per element copied (one AVX-512 FMA does 16).
inline double busiest(int64_t M, int64_t N, int64_t mc, int64_t nc, int64_t MR, int64_t NR,
                      int64_t threads) {
  const int64_t mt = ceil_div(M, mc), nt = ceil_div(N, nc), tiles = mt * nt;
  const int64_t chunk = ceil_div(tiles, threads);
  double worst = 0;
  for (int64_t begin = 0; begin < tiles; begin += chunk) {
    double work = 0;
    for (int64_t t = begin; t < std::min(tiles, begin + chunk); ++t) {
      const double m = static_cast<double>(round_up(std::min(mc, M - (t % mt) * mc), MR));
      const double n = static_cast<double>(round_up(std::min(nc, N - (t / mt) * nc), NR));
      work += m * n + 16 * (m + n);
    }
    worst = std::max(worst, work);
  }
  return worst;
}

// The C tiles and the K slices. K: the fewest slices of at most KC, equal.
// C: the fewest tiles of at most MC x NC give mt0 x nt0; up to 3 more row and
// column cuts are tried (when there are few tiles), and the grid whose busiest thread has the least work
// wins (fewer tiles on a tie), among those that give every thread a tile when
// one does. 253 x 259 x 509 float32 on 2 threads: 2 x 1 tiles of 132 x 288
// (11 MR panels each) instead of 2 x 2 with columns of 160 and 99 (one thread
// got the 160s): 0.79x -> 0.96x of torch.matmul's speed here.
inline TileGrid tile_grid(int64_t M, int64_t N, int64_t K, int64_t MR, int64_t NR, int64_t MC,
                          int64_t NC, int64_t KC) {
  const int64_t kc = split(K, ceil_div(K, KC), 1);
  // In double: M * N * K of three 31-bit sizes can overflow int64.
  const bool serial = static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K) <
                      static_cast<double>(kSerialMacs);
  const int64_t threads = serial ? 1 : static_cast<int64_t>(torch::stable::get_num_threads());
  const int64_t mt0 = ceil_div(M, MC), nt0 = ceil_div(N, NC);
  int64_t mc = split(M, mt0, MR), nc = split(N, nt0, NR);
  double best = -1;
  bool best_fills = false;
  // With 16 tiles per thread or more, one run of tiles more or less is a few
  // per cent, and the search (over every tile) would only cost time.
  const int64_t extra = mt0 * nt0 >= 16 * threads ? 0 : 3;
  for (int64_t mt = mt0; mt <= mt0 + extra; ++mt) {
    for (int64_t nt = nt0; nt <= nt0 + extra; ++nt) {
      const int64_t m = split(M, mt, MR), n = split(N, nt, NR);
      const bool fills = ceil_div(M, m) * ceil_div(N, n) >= threads;
      const double work = busiest(M, N, m, n, MR, NR, threads);
      const bool fewer = ceil_div(M, m) * ceil_div(N, n) < ceil_div(M, mc) * ceil_div(N, nc);
      if (best < 0 || (fills && !best_fills) ||
          (fills == best_fills && (work < best || (work == best && fewer)))) {
        best = work, best_fills = fills, mc = m, nc = n;
      }
    }
  }
  // A C too small for a tile per thread even so: halve the tiles further.
  while (!serial && ceil_div(M, mc) * ceil_div(N, nc) < threads && (mc > MR || nc > NR)) {
    if (nc > NR && (nc >= mc || mc <= MR)) {
      nc = round_up(ceil_div(nc, 2), NR);
    } else {
      mc = round_up(ceil_div(mc, 2), MR);
    }
  }
  const int64_t tiles = ceil_div(M, mc) * ceil_div(N, nc);
  return {mc, nc, kc, tiles, serial ? tiles : 1};
}

// float <-> bfloat16 by bits: a bfloat16 is a float's upper half.
inline float bf16_bits_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  // Round to nearest even (c10::BFloat16's rule); any NaN becomes a quiet NaN.
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return f != f ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

}  // namespace gemm_cpu

// The conversions every ISA shares: the same type (a copy) and bfloat16 (bit
// operations that vectorise as they are).
#define OPFORGE_GEMM_COMMON_CONVERSIONS                                                 \
  template <typename T>                                                                 \
  inline void widen(const T* s, T* d, int64_t n) {                                      \
    for (int64_t i = 0; i < n; ++i) d[i] = s[i];                                        \
  }                                                                                     \
  template <typename T>                                                                 \
  inline void narrow(const T* s, T* d, int64_t n) {                                     \
    for (int64_t i = 0; i < n; ++i) d[i] = s[i];                                        \
  }                                                                                     \
  inline void widen(const c10::BFloat16* s, float* d, int64_t n) {                      \
    const auto* bits = reinterpret_cast<const uint16_t*>(s);                            \
    for (int64_t i = 0; i < n; ++i) d[i] = bf16_bits_to_float(bits[i]);                 \
  }                                                                                     \
  inline void narrow(const float* s, c10::BFloat16* d, int64_t n) {                     \
    auto* bits = reinterpret_cast<uint16_t*>(d);                                        \
    for (int64_t i = 0; i < n; ++i) bits[i] = float_to_bf16_bits(s[i]);                 \
  }

// --- generic: GCC/Clang vector extensions, 16 bytes (SSE2 on x86-64, NEON on ARM) ---
namespace gemm_cpu::generic {

template <typename T>
struct Vec {
  static constexpr int W = 16 / sizeof(T);
  typedef T V __attribute__((vector_size(16)));
  static V zero() { return V{}; }
  static V load(const T* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static V bcast(T x) { return V{} + x; }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V add(V a, V b) { return a + b; }
  static void store(T* p, V v) { std::memcpy(p, &v, sizeof v); }
};

// 6 x 2 vectors: 12 accumulators + 2 B vectors + 1 broadcast of the 16 SSE
// registers.
template <typename T>
struct Blocking : CacheBlocks<T> {
  static constexpr int MR = 6, NV = 2;
};

OPFORGE_GEMM_COMMON_CONVERSIONS
inline void widen(const c10::Half* s, float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<float>(s[i]);
}
inline void narrow(const float* s, c10::Half* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = c10::Half(s[i]);
}

#include "gemm_cpu.h"

}  // namespace gemm_cpu::generic

#if OPFORGE_GEMM_X86
// --- AVX2 + FMA + F16C: 16 ymm registers ---
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace gemm_cpu::avx2 {

template <typename T>
struct Vec;
template <>
struct Vec<float> {
  static constexpr int W = 8;
  using V = __m256;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V bcast(float x) { return _mm256_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
};
template <>
struct Vec<double> {
  static constexpr int W = 4;
  using V = __m256d;
  static V zero() { return _mm256_setzero_pd(); }
  static V load(const double* p) { return _mm256_loadu_pd(p); }
  static V bcast(double x) { return _mm256_set1_pd(x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_pd(a, b, c); }
  static V add(V a, V b) { return _mm256_add_pd(a, b); }
  static void store(double* p, V v) { _mm256_storeu_pd(p, v); }
};

// 6 x 2 vectors: 12 accumulators + 2 B vectors + 1 broadcast of 16 registers.
template <typename T>
struct Blocking : CacheBlocks<T> {
  static constexpr int MR = 6, NV = 2;
};

OPFORGE_GEMM_COMMON_CONVERSIONS
inline void widen(const c10::Half* s, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) d[i] = static_cast<float>(s[i]);
}
inline void narrow(const float* s, c10::Half* d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) d[i] = c10::Half(s[i]);
}

#include "gemm_cpu.h"

}  // namespace gemm_cpu::avx2
#pragma GCC pop_options

// --- AVX-512F: 32 zmm registers ---
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
namespace gemm_cpu::avx512 {

template <typename T>
struct Vec;
template <>
struct Vec<float> {
  static constexpr int W = 16;
  using V = __m512;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V bcast(float x) { return _mm512_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
};
template <>
struct Vec<double> {
  static constexpr int W = 8;
  using V = __m512d;
  static V zero() { return _mm512_setzero_pd(); }
  static V load(const double* p) { return _mm512_loadu_pd(p); }
  static V bcast(double x) { return _mm512_set1_pd(x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_pd(a, b, c); }
  static V add(V a, V b) { return _mm512_add_pd(a, b); }
  static void store(double* p, V v) { _mm512_storeu_pd(p, v); }
};

// 12 x 2 vectors: 24 accumulators + 2 B vectors + 1 broadcast of 32
// registers. Measured against 6 x 4 and 8 x 3 (same 24 accumulators) and
// 14 x 2 (28): within the machine's noise of each other (+-5 %), so the
// shape that loads the fewest B vectors per FMA of the 32-register ones.
template <typename T>
struct Blocking : CacheBlocks<T> {
  static constexpr int MR = 12, NV = 2;
};

OPFORGE_GEMM_COMMON_CONVERSIONS
inline void widen(const c10::Half* s, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    _mm512_storeu_ps(d + i, _mm512_cvtph_ps(h));
  }
  for (; i < n; ++i) d[i] = static_cast<float>(s[i]);
}
inline void narrow(const float* s, c10::Half* d, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) d[i] = c10::Half(s[i]);
}

#include "gemm_cpu.h"

}  // namespace gemm_cpu::avx512
#pragma GCC pop_options
#endif  // OPFORGE_GEMM_X86

#undef OPFORGE_GEMM_COMMON_CONVERSIONS

namespace gemm_cpu {

enum class Isa { Generic, Avx2, Avx512 };

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    default: return "generic";
  }
}

Isa best_isa() {
#if OPFORGE_GEMM_X86
  // __builtin_cpu_supports also checks that the OS saves the wide registers.
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return Isa::Avx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return Isa::Avx2;
  }
#endif
  return Isa::Generic;
}

// The best the CPU has, or OPFORGE_GEMM_CPU_ISA (generic, avx2, avx512) for
// tests that run every version on one machine; read once.
Isa selected_isa() {
  static const Isa isa = [] {
    const Isa best = best_isa();
    const char* env = std::getenv("OPFORGE_GEMM_CPU_ISA");
    if (env == nullptr || *env == '\0') return best;
    const std::string want(env);
    for (Isa isa : {Isa::Generic, Isa::Avx2, Isa::Avx512}) {
      if (want == isa_name(isa)) {
        OPFORGE_CHECK(static_cast<int>(isa) <= static_cast<int>(best), kGemm,
                      ": OPFORGE_GEMM_CPU_ISA=", want, " but this CPU (or build) supports at most ",
                      isa_name(best));
        return isa;
      }
    }
    OPFORGE_CHECK(false, kGemm, ": OPFORGE_GEMM_CPU_ISA must be generic, avx2 or avx512, got '",
                  want, "'");
    return best;
  }();
  return isa;
}

template <typename S>
void run(const S* a, const S* b, S* c, int64_t M, int64_t N, int64_t K) {
  switch (selected_isa()) {
#if OPFORGE_GEMM_X86
    case Isa::Avx512: return avx512::gemm<S>(a, b, c, M, N, K);
    case Isa::Avx2: return avx2::gemm<S>(a, b, c, M, N, K);
#endif
    default: return generic::gemm<S>(a, b, c, M, N, K);
  }
}

}  // namespace gemm_cpu

Tensor gemm(const Tensor& a, const Tensor& b) {
  check_floating(kGemm, "a", a);
  check_like(kGemm, "a", a, "b", b);
  check_2d(kGemm, "a", a, "[M, K]");
  check_2d(kGemm, "b", b, "[K, N]");
  OPFORGE_CHECK(a.size(1) == b.size(0), kGemm,
                ": a [M, K] and b [K, N] must agree in K: a.size(1) must equal b.size(0), got shapes ",
                dims(a.sizes()), " and ", dims(b.sizes()));
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  // Checked on the sizes, before any copy: an expanded operand can be huge in
  // shape and take no memory.
  check_dim("M (a.size(0))", M, a, b);
  check_dim("K (a.size(1))", K, a, b);
  check_dim("N (b.size(1))", N, a, b);

  if (M == 0 || N == 0) return empty({M, N}, a.scalar_type(), a);
  if (K == 0) {  // an empty sum
    Tensor zeros = empty({M, N}, a.scalar_type(), a);
    // The shim's zero_ calls Tensor::zero_ directly: torch::stable::zero_
    // boxes it through the dispatcher, about 1 us more per call.
    TORCH_ERROR_CODE_CHECK(aoti_torch_zero_(zeros.get()));
    return zeros;
  }
  // Both launchers take row-major, densely packed operands: a transposed or
  // strided view is copied here (O(MK + KN), small against the 2MNK product).
  // A dense operand is taken as it is, without a call through the dispatcher.
  const Tensor A = a.is_contiguous() ? a : torch::stable::contiguous(a);
  const Tensor B = b.is_contiguous() ? b : torch::stable::contiguous(b);
  Tensor C = empty({M, N}, a.scalar_type(), a);
  run_kernel(
      kGemm, C,
      [&](auto stream) {
        const DType dtype = to_dtype(C.scalar_type());
        // The launcher's scratch (split-K partial sums, padded copies of
        // operands TMA cannot read) comes from the caching allocator, on the
        // current stream: once this tensor is freed, the allocator hands its
        // block only to later work on that stream, which runs after the GEMM.
        const size_t bytes = gemm_cuda_workspace(dtype, M, N, K, A.const_data_ptr(),
                                                 B.const_data_ptr(), C.const_data_ptr());
        std::optional<Tensor> workspace;
        if (bytes > 0) {
          workspace = empty({static_cast<int64_t>(bytes)}, ScalarType::Byte, a);
        }
        return gemm_cuda(dtype, A.const_data_ptr(), B.const_data_ptr(), C.mutable_data_ptr(), M, N,
                         K, workspace ? workspace->mutable_data_ptr() : nullptr, bytes, stream);
      },
      [&] {
        OPFORGE_DISPATCH_FLOATING(C.scalar_type(), "opforge::gemm", [&] {
          gemm_cpu::run<scalar_t>(A.const_data_ptr<scalar_t>(), B.const_data_ptr<scalar_t>(),
                                  C.mutable_data_ptr<scalar_t>(), M, N, K);
        });
      });
  return C;
}

namespace {

void register_gemm_kernels(Library& m) { m.impl("gemm", TORCH_BOX(&gemm)); }

}  // namespace
}  // namespace opforge

OPFORGE_LIBRARY_FRAGMENT(opforge, m) { m.def("gemm(Tensor a, Tensor b) -> Tensor"); }

OPFORGE_REGISTER_KERNELS(opforge, opforge::register_gemm_kernels)
