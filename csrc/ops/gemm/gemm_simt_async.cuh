#pragma once
// float32 GEMM on the CUDA cores, sm_80 and later: both operands go global ->
// shared by cp.async (16 bytes, zero-filled past the edges) into a ring of
// STAGES slots, so no register holds a tile on its way and no shared store is
// issued; gemm_simt.cuh's kernel instead loads the next K-slice into registers
// and stores A transposed, one element at a time.
//
// A stays K-major in shared memory ([m][k], rows padded to an odd number of
// 16-byte chunks) and B as it is ([k][n]). Per group of 4 k a thread reads, for
// each of its TM rows, one 16-byte vector of A (4 k) and, per k, TN / 4
// vectors of B: TM + TN 16-byte loads for 4 * TM * TN FMAs, as the other
// kernel. A thread's rows are lane_row + i * (WM / TM): the 8 (or 4) rows a
// warp reads at once are consecutive, which the odd chunk count spreads over
// the banks; its columns are 4-wide blocks as in gemm_simt.cuh.
//
// Needs 16-byte rows (simt_vec_ok): K and N multiples of 4, aligned pointers.

#include <cuda_runtime.h>

#include <cstdint>

#include "gemm_common.cuh"
#include "gemm_mma.cuh"

namespace opforge::gemm {

template <int BM_, int BN_, int BK_, int WM_, int WN_, int TM_, int TN_, int STAGES_>
struct SimtAsyncTile {
  static constexpr int BM = BM_, BN = BN_, BK = BK_, WM = WM_, WN = WN_, TM = TM_, TN = TN_, STAGES = STAGES_;
  static constexpr int kThreads = (BM / WM) * (BN / WN) * 32;
  static constexpr int kLda = BK + 4;  // (BK + 4) / 4 chunks a row: odd for BK = 8, 16, 32
  static constexpr int kStageFloats = BM * kLda + BK * BN;
  static constexpr int smem_bytes() { return STAGES * kStageFloats * static_cast<int>(sizeof(float)); }
};

__device__ __forceinline__ float lane_of(const float4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

template <class Tile>
__global__ void __launch_bounds__(Tile::kThreads, 1)
    simt_async_kernel(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, int64_t M,
                      int64_t N, int64_t K) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using namespace mma_detail;
  constexpr int BM = Tile::BM, BN = Tile::BN, BK = Tile::BK, WM = Tile::WM, WN = Tile::WN;
  constexpr int TM = Tile::TM, TN = Tile::TN, S = Tile::STAGES, kThreads = Tile::kThreads;
  constexpr int kLaneRows = WM / TM, kLaneCols = WN / TN, NI = TN / 4, kLda = Tile::kLda;
  static_assert(kLaneRows * kLaneCols == 32, "a warp's lanes must tile its WM x WN part");
  static_assert(TN % 4 == 0 && BK % 4 == 0 && S >= 2, "4-wide column blocks, 4-k groups, two slots or more");
  constexpr int kAPer = BM * BK / 4 / kThreads, kBPer = BK * BN / 4 / kThreads;
  static_assert(kAPer * kThreads * 4 == BM * BK && kBPer * kThreads * 4 == BK * BN, "whole copies per thread");

  extern __shared__ __align__(16) float async_smem[];
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int wm0 = (warp / (BN / WN)) * WM, wn0 = (warp % (BN / WN)) * WN;
  const int lr = lane / kLaneCols, lc = lane % kLaneCols;
  const int64_t tiles_m = ceil_div(M, BM), tiles_n = ceil_div(N, BN);
  const int64_t KT = ceil_div(K, BK);

  for (int64_t t = blockIdx.x; t < tiles_m * tiles_n; t += gridDim.x) {
    int64_t tm, tn;
    tile_coords<8>(t, tiles_m, tiles_n, tm, tn);
    const int64_t m0 = tm * BM, n0 = tn * BN;

    // K-slice kt into slot kt % S. K % 4 == 0: a 4-k chunk is wholly in range or out.
    auto load = [&](int64_t kt) {
      float* As = async_smem + static_cast<int>(kt % S) * Tile::kStageFloats;
      float* Bs = As + BM * kLda;
      const int64_t k0 = kt * BK;
#pragma unroll
      for (int q = 0; q < kAPer; ++q) {
        const int c = tid + q * kThreads;
        const int row = c / (BK / 4), kq = (c % (BK / 4)) * 4;
        const int64_t gm = m0 + row, gk = k0 + kq;
        const bool ok = gm < M && gk < K;
        cp_async16(smem_u32(As + row * kLda + kq), ok ? A + gm * K + gk : A, ok);
      }
#pragma unroll
      for (int q = 0; q < kBPer; ++q) {
        const int c = tid + q * kThreads;
        const int kr = c / (BN / 4), nq = (c % (BN / 4)) * 4;
        const int64_t gk = k0 + kr, gn = n0 + nq;
        const bool ok = gk < K && gn < N;
        cp_async16(smem_u32(Bs + kr * BN + nq), ok ? B + gk * N + gn : B, ok);
      }
    };

    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) acc[i][j] = 0.f;

    // One commit group per slice (empty past the end), so that wait<S - 2>
    // always means "slice kt has landed".
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
      if (s < KT) load(s);
      cp_async_commit();
    }
    for (int64_t kt = 0; kt < KT; ++kt) {
      cp_async_wait<S - 2>();
      __syncthreads();  // slice kt visible to all; slot (kt - 1) % S read by all
      if (kt + S - 1 < KT) load(kt + S - 1);
      cp_async_commit();
      const float* As = async_smem + static_cast<int>(kt % S) * Tile::kStageFloats;
      const float* Bs = As + BM * kLda;
#pragma unroll
      for (int kk = 0; kk < BK; kk += 4) {
        float4 a[TM];
#pragma unroll
        for (int i = 0; i < TM; ++i) a[i] = *reinterpret_cast<const float4*>(As + (wm0 + lr + i * kLaneRows) * kLda + kk);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          float4 b[NI];
#pragma unroll
          for (int j = 0; j < NI; ++j) b[j] = *reinterpret_cast<const float4*>(Bs + (kk + k) * BN + wn0 + j * (WN / NI) + lc * 4);
#pragma unroll
          for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int j = 0; j < NI; ++j)
#pragma unroll
              for (int jj = 0; jj < 4; ++jj) acc[i][j * 4 + jj] += lane_of(a[i], k) * lane_of(b[j], jj);
        }
      }
    }
    // The next tile's first copies go into slots this one may still be reading.
    cp_async_wait<0>();
    __syncthreads();

#pragma unroll
    for (int i = 0; i < TM; ++i) {
      const int64_t row = m0 + wm0 + lr + i * kLaneRows;
      if (row >= M) continue;
#pragma unroll
      for (int j = 0; j < NI; ++j) {
        const int64_t col = n0 + wn0 + j * (WN / NI) + lc * 4;
        if (col < N) {
          *reinterpret_cast<float4*>(C + row * N + col) =
              make_float4(acc[i][j * 4], acc[i][j * 4 + 1], acc[i][j * 4 + 2], acc[i][j * 4 + 3]);
        }
      }
    }
  }
#else
  (void)A, (void)B, (void)C, (void)M, (void)N, (void)K;
  __trap();
#endif
}

// Runs the kernel over p (float32, simt_vec_ok(p)); nullptr or CUDA's error.
template <class Tile>
const char* launch_simt_async(const Problem& p, cudaStream_t stream) {
  constexpr int smem = Tile::smem_bytes();
  constexpr auto kernel = simt_async_kernel<Tile>;
  if (const char* err = allow_smem<kernel>(smem)) return err;
  const int64_t tiles = ceil_div(p.M, Tile::BM) * ceil_div(p.N, Tile::BN);
  const unsigned grid = static_cast<unsigned>(tiles < 0x7fffffff ? tiles : 0x7fffffff);
  kernel<<<grid, Tile::kThreads, smem, stream>>>(static_cast<const float*>(p.a), static_cast<const float*>(p.b),
                                                   static_cast<float*>(p.c), p.M, p.N, p.K);
  return cuda::last_error();
}

}  // namespace opforge::gemm
