#pragma once
// float16 / bfloat16 GEMM on the tensor cores through warp-level mma.sync
// (m16n8k16, float32 accumulators): the path for sm_80 and every arch that is
// not sm_90a, and on sm_90a the fallback when TMA's alignment rules fail.
//
// A CTA computes BM x BN of C over K-slices of BK = 32; each warp WM x WN,
// as (WM/16) x (WN/8) mma tiles. Shared memory holds STAGES K-slices of A
// ([BM][32], 64-byte rows) and of B ([32][BN], as B is laid out: N contiguous).
// Fragments come out of shared memory with ldmatrix (A) and ldmatrix.trans
// (B, which turns N-contiguous rows into the k-pairs mma's "col" B operand
// wants). Both tiles are XOR-swizzled in 16-byte chunks so that the 8 row
// addresses of every 8x8 ldmatrix matrix fall in 8 different bank groups:
//   A: chunk' = chunk ^ ((row >> 1) & 3)   (4 chunks a row: rows 2 apart
//                                           would otherwise share banks)
//   B: chunk' = chunk ^ (row & 7)           (BN/8 >= 8 chunks a row: every row
//                                           would otherwise start on bank 0)
//
// kAsync (every row 16-byte aligned: K % 8 == 0, N % 8 == 0, aligned
// pointers): cp.async 16-byte copies, STAGES deep, zero-filled past M, N and
// K. Otherwise (odd K or N, e.g. 4095 x 4097 x 4093): element loads into
// registers while the tensor cores work on the current slice, stored to the
// other of two shared buffers after it, zeros past the edges. The epilogue
// stores pairs of elements when N is even and C 4-byte aligned, single ones
// otherwise.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "gemm_common.cuh"

namespace opforge::gemm {

template <int BM_, int BN_, int WM_, int WN_, int STAGES_>
struct MmaTile {
  static constexpr int BM = BM_, BN = BN_, BK = 32, WM = WM_, WN = WN_, STAGES = STAGES_;
  static constexpr int kThreads = (BM / WM) * (BN / WN) * 32;
  template <bool kAsync>
  static constexpr int smem_bytes(int elem) {
    return (kAsync ? STAGES : 2) * (BM * BK + BK * BN) * elem;
  }
};

namespace mma_detail {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (sizeof(T) == 2 && std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}
// 16 bytes global -> shared, or 16 zero bytes when !valid (src-size 0).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
#endif

}  // namespace mma_detail

template <typename T, class Tile, bool kAsync>
__global__ void __launch_bounds__(Tile::kThreads)
    mma_gemm_kernel(const T* __restrict__ A, const T* __restrict__ B, T* __restrict__ C, int64_t M, int64_t N,
                    int64_t K, bool pairs) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using namespace mma_detail;
  constexpr int BM = Tile::BM, BN = Tile::BN, BK = Tile::BK, WM = Tile::WM, WN = Tile::WN;
  constexpr int kThreads = Tile::kThreads;
  constexpr int kStages = kAsync ? Tile::STAGES : 2;
  constexpr int MI = WM / 16, NI = WN / 8;
  static_assert(NI % 2 == 0, "B fragments load two n8 tiles at a time");
  static_assert(BN / 8 >= 8, "B's swizzle needs at least 8 chunks a row");
  constexpr int kAChunks = BM * BK / 8, kBChunks = BK * BN / 8;
  static_assert(kAChunks % kThreads == 0 && kBChunks % kThreads == 0, "whole chunks per thread");
  constexpr int kAPer = kAChunks / kThreads, kBPer = kBChunks / kThreads;

  extern __shared__ __align__(128) unsigned char mma_smem[];
  T* const As = reinterpret_cast<T*>(mma_smem);
  T* const Bs = As + kStages * BM * BK;
  // Element offsets of 16-byte chunk c of row r, swizzled.
  auto a_off = [](int r, int c) { return r * BK + ((c ^ ((r >> 1) & 3)) << 3); };
  auto b_off = [](int k, int c) { return k * BN + ((c ^ (k & 7)) << 3); };

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wm0 = (warp / (BN / WN)) * WM, wn0 = (warp % (BN / WN)) * WN;
  const int64_t tiles_m = ceil_div(M, BM), tiles_n = ceil_div(N, BN);
  const int64_t KT = ceil_div(K, BK);

  for (int64_t t = blockIdx.x; t < tiles_m * tiles_n; t += gridDim.x) {
    int64_t tm, tn;
    tile_coords<8>(t, tiles_m, tiles_n, tm, tn);
    const int64_t m0 = tm * BM, n0 = tn * BN;

    float acc[MI][NI][4];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int j = 0; j < NI; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

    auto compute = [&](int stage) {
      const T* as = As + stage * BM * BK;
      const T* bs = Bs + stage * BK * BN;
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        uint32_t af[MI][4], bf[NI / 2][4];
        const int q = lane / 8;
#pragma unroll
        for (int i = 0; i < MI; ++i) {
          const int r = wm0 + i * 16 + (lane % 8) + 8 * (q % 2);
          ldmatrix_x4(af[i], smem_u32(as + a_off(r, kk * 2 + q / 2)));
        }
#pragma unroll
        for (int j = 0; j < NI / 2; ++j) {
          const int k = kk * 16 + (lane % 8) + 8 * (q % 2);
          ldmatrix_x4_trans(bf[j], smem_u32(bs + b_off(k, (wn0 + j * 16) / 8 + q / 2)));
        }
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
          for (int j = 0; j < NI; ++j) mma16816<T>(acc[i][j], af[i], bf[j / 2][(j % 2) * 2], bf[j / 2][(j % 2) * 2 + 1]);
      }
    };

    if constexpr (kAsync) {
      auto load = [&](int stage, int64_t kt) {
        const int64_t k0 = kt * BK;
#pragma unroll
        for (int p = 0; p < kAPer; ++p) {
          const int g = tid + p * kThreads;
          const int r = g / (BK / 8), c = g % (BK / 8);
          const int64_t gm = m0 + r, gk = k0 + c * 8;
          const bool ok = gm < M && gk < K;
          cp_async16(smem_u32(As + stage * BM * BK + a_off(r, c)), ok ? A + gm * K + gk : A, ok);
        }
#pragma unroll
        for (int p = 0; p < kBPer; ++p) {
          const int g = tid + p * kThreads;
          const int k = g / (BN / 8), c = g % (BN / 8);
          const int64_t gk = k0 + k, gn = n0 + c * 8;
          const bool ok = gk < K && gn < N;
          cp_async16(smem_u32(Bs + stage * BK * BN + b_off(k, c)), ok ? B + gk * N + gn : B, ok);
        }
      };
#pragma unroll
      for (int s = 0; s < kStages - 1; ++s) {
        if (s < KT) load(s, s);
        cp_async_commit();
      }
      for (int64_t kt = 0; kt < KT; ++kt) {
        cp_async_wait<kStages - 2>();
        __syncthreads();
        // The stage this refills was computed on in iteration kt - 1, which
        // every thread has finished: they all passed the barrier above.
        const int64_t next = kt + kStages - 1;
        if (next < KT) load(static_cast<int>(next % kStages), next);
        cp_async_commit();
        compute(static_cast<int>(kt % kStages));
      }
      cp_async_wait<0>();
      __syncthreads();
    } else {
      using Chunk = uint4;  // 8 elements
      Chunk ra[kAPer], rb[kBPer];
      auto load = [&](int64_t k0) {
#pragma unroll
        for (int p = 0; p < kAPer; ++p) {
          const int g = tid + p * kThreads;
          const int64_t gm = m0 + g / (BK / 8), gk = k0 + (g % (BK / 8)) * 8;
          T v[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) v[e] = (gm < M && gk + e < K) ? A[gm * K + gk + e] : cuda::from_opmath<T>(0.f);
          ra[p] = *reinterpret_cast<const Chunk*>(v);
        }
#pragma unroll
        for (int p = 0; p < kBPer; ++p) {
          const int g = tid + p * kThreads;
          const int64_t gk = k0 + g / (BN / 8), gn = n0 + (g % (BN / 8)) * 8;
          T v[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) v[e] = (gk < K && gn + e < N) ? B[gk * N + gn + e] : cuda::from_opmath<T>(0.f);
          rb[p] = *reinterpret_cast<const Chunk*>(v);
        }
      };
      auto store = [&](int stage) {
#pragma unroll
        for (int p = 0; p < kAPer; ++p) {
          const int g = tid + p * kThreads;
          *reinterpret_cast<Chunk*>(As + stage * BM * BK + a_off(g / (BK / 8), g % (BK / 8))) = ra[p];
        }
#pragma unroll
        for (int p = 0; p < kBPer; ++p) {
          const int g = tid + p * kThreads;
          *reinterpret_cast<Chunk*>(Bs + stage * BK * BN + b_off(g / (BN / 8), g % (BN / 8))) = rb[p];
        }
      };
      load(0);
      store(0);
      __syncthreads();
      for (int64_t kt = 0; kt < KT; ++kt) {
        if (kt + 1 < KT) load((kt + 1) * BK);
        compute(static_cast<int>(kt & 1));
        if (kt + 1 < KT) store(static_cast<int>((kt + 1) & 1));
        __syncthreads();
      }
    }

    const int g = lane / 4, c2 = (lane % 4) * 2;
#pragma unroll
    for (int i = 0; i < MI; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t row = m0 + wm0 + i * 16 + g + 8 * h;
        if (row >= M) continue;
        T* crow = C + row * N;
#pragma unroll
        for (int j = 0; j < NI; ++j) {
          const int64_t col = n0 + wn0 + j * 8 + c2;
          const float x = acc[i][j][2 * h], y = acc[i][j][2 * h + 1];
          if (pairs) {
            if (col < N) *reinterpret_cast<typename Pair<T>::type*>(crow + col) = Pair<T>::make(x, y);
          } else {
            if (col < N) crow[col] = cuda::from_opmath<T>(x);
            if (col + 1 < N) crow[col + 1] = cuda::from_opmath<T>(y);
          }
        }
      }
    }
  }
#else
  // Built for an arch without ldmatrix/cp.async/bf16 mma: the launcher never
  // picks this kernel there (gemm_kernel.cu checks the compute capability).
  __trap();
#endif
}

// Rows of A and B start on 16-byte boundaries: the cp.async path applies.
inline bool mma_async_ok(const Problem& p) {
  return p.K % 8 == 0 && p.N % 8 == 0 && aligned(p.a, 16) && aligned(p.b, 16);
}

template <typename T, class Tile, bool kAsync>
const char* launch_mma(const Problem& p, cudaStream_t stream) {
  constexpr auto kernel = mma_gemm_kernel<T, Tile, kAsync>;
  constexpr int smem = Tile::template smem_bytes<kAsync>(sizeof(T));
  if (const char* err = allow_smem<kernel>(smem)) return err;
  // Pairs of outputs go out as one 4-byte word where every row allows it.
  const bool pairs = p.N % 2 == 0 && aligned(p.c, 4);
  const int64_t tiles = ceil_div(p.M, Tile::BM) * ceil_div(p.N, Tile::BN);
  const int64_t grid = tiles < 0x7fffffff ? tiles : 0x7fffffff;
  kernel<<<static_cast<unsigned>(grid), Tile::kThreads, smem, stream>>>(
      static_cast<const T*>(p.a), static_cast<const T*>(p.b), static_cast<T*>(p.c), p.M, p.N, p.K, pairs);
  return cuda::last_error();
}

}  // namespace opforge::gemm
