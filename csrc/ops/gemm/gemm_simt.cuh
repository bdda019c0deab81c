#pragma once
// GEMM on the CUDA cores: float32 (the SGEMM the issue asks for), float64 (for
// gradcheck) and, on GPUs older than sm_80, float16/bfloat16 with float32
// accumulation.
//
// A CTA computes a BM x BN tile of C; each warp a WM x WN part of it; each
// thread TM x TN outputs, as (TM/4) x (TN/4) blocks of 4 x 4 spread over the
// warp's tile. The warp's lanes form a (WM/TM) x (WN/TN) grid, and a lane's
// 4 x 4 blocks sit at rows lane_row*4 + i*(WM/(TM/4)), columns likewise, so
// that at every k the lanes of a warp read a few consecutive 16-byte vectors
// of A and of B from shared memory (no bank conflicts; lanes in one row or
// column get the same vector as a broadcast) and each thread does TM*TN FMAs
// for (TM+TN)/4 16-byte shared loads.
//
// Shared memory holds A transposed (As[k][m], each row padded by 4 elements)
// and B as it is (Bs[k][n]), two buffers of each: while the CTA computes on
// one, the next K-slice has been loaded into registers and is stored into the
// other afterwards (one __syncthreads per K-slice). Global loads are 16 bytes
// (4 floats along K for A, along N for B) when every row is 16-byte aligned
// (kVec: K and N multiples of 4 and 16-byte aligned pointers), else single
// elements; out-of-range elements (M, N and K tails) load as zeros and are not
// stored. Indices into A, B and C are 64-bit.
//
// Split-K (kSplit): a grid of (tiles, splits) CTAs. CTA y sums only K range
// [y * chunk, min(K, (y + 1) * chunk)) (chunk a multiple of BK, so every
// range starts on a K-slice and, in the 16-byte path, on a float4) and writes
// its Acc partial tile, through the same epilogue, into slice y of a
// [splits][M][N] workspace; splitk_reduce_kernel then adds the slices into C
// in the order y = 0, 1, ...: the same bits on every run, no atomics. It
// gives a grid of few tiles (a few rows of A against a long K) several CTAs
// per SM, and so more loads in flight (gemm_dispatch.cuh, plan_simt).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "gemm_common.cuh"

namespace opforge::gemm {

template <typename Acc>
struct alignas(4 * sizeof(Acc)) Quad {
  Acc v[4];
};

template <int BM_, int BN_, int BK_, int WM_, int WN_, int TM_, int TN_>
struct SimtTile {
  static constexpr int BM = BM_, BN = BN_, BK = BK_, WM = WM_, WN = WN_, TM = TM_, TN = TN_;
  static constexpr int kThreads = (BM / WM) * (BN / WN) * 32;
  // Two buffers of A^T [BK][BM + 4] and B [BK][BN].
  template <typename Acc>
  static constexpr int smem_bytes() {
    return 2 * BK * (BM + 4 + BN) * static_cast<int>(sizeof(Acc));
  }
};

// The split kernel is there to put several CTAs on each SM, so ptxas is told
// to leave room for them: 128 registers a thread for float32 (256 for
// float64, whose values take two), 65536 / (threads * 128) CTAs an SM, 8 for
// the 64-thread skinny tiles: the occupancy that the split plan aims at
// (gemm_dispatch.cuh, kSplitCtasPerSm). The unsplit skinny kernels use
// 105-128 registers by themselves (ptxas -v, sm_90a); left free, ptxas gave
// the split 64 x 64 x 16 kernel 96 registers and a spill. 0: no bound.
template <class Tile, typename Acc>
constexpr int split_min_ctas() {
  return 65536 / (Tile::kThreads * 32 * static_cast<int>(sizeof(Acc)));
}

// C: the output, or (kSplit) the workspace of Acc partial tiles. K is A's row
// stride and the length of the sum; chunk, the K range of one split (kSplit).
template <typename T, typename Acc, class Tile, bool kVec, bool kSplit = false>
__global__ void __launch_bounds__(Tile::kThreads, kSplit ? split_min_ctas<Tile, Acc>() : 0)
    simt_gemm_kernel(const T* __restrict__ A, const T* __restrict__ B,
                     std::conditional_t<kSplit, Acc, T>* __restrict__ C, int64_t M, int64_t N, int64_t K,
                     int64_t chunk) {
  using Out = std::conditional_t<kSplit, Acc, T>;
  constexpr int BM = Tile::BM, BN = Tile::BN, BK = Tile::BK, WM = Tile::WM, WN = Tile::WN;
  constexpr int TM = Tile::TM, TN = Tile::TN, kThreads = Tile::kThreads;
  constexpr int kLaneRows = WM / TM, kLaneCols = WN / TN;
  static_assert(kLaneRows * kLaneCols == 32, "a warp's lanes must tile its WM x WN part");
  static_assert(TM % 4 == 0 && TN % 4 == 0, "threads own 4 x 4 blocks");
  constexpr int MI = TM / 4, NI = TN / 4;
  constexpr int kLda = BM + 4;  // the pad spreads the transposed stores of A over the banks
  static_assert((BM * BK / 4) % kThreads == 0 && (BK * BN / 4) % kThreads == 0, "whole loads per thread");
  constexpr int kAPer = BM * BK / 4 / kThreads, kBPer = BK * BN / 4 / kThreads;
  static_assert(!kVec || sizeof(T) == 4, "16-byte loads are float4");

  // Dynamic: 256 x 128 tiles with K-slices of 16 need more than 48 KB.
  extern __shared__ __align__(16) unsigned char simt_smem[];
  auto As = reinterpret_cast<Acc(*)[BK][kLda]>(simt_smem);
  auto Bs = reinterpret_cast<Acc(*)[BK][BN]>(simt_smem + 2 * BK * kLda * sizeof(Acc));

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int wm0 = (warp / (BN / WN)) * WM, wn0 = (warp % (BN / WN)) * WN;
  const int lr = lane / kLaneCols, lc = lane % kLaneCols;

  // This CTA's part of the sum: all of K, or (kSplit) K range
  // [y * chunk, min(K, (y + 1) * chunk)) as A and B moved to its start and a
  // length. K stays A's row stride.
  int64_t k_len = K;
  if constexpr (kSplit) {
    const int64_t k0 = blockIdx.y * chunk;
    k_len = K - k0 < chunk ? K - k0 : chunk;
    A += k0;
    B += k0 * N;
  } else {
    (void)chunk;
  }
  const int64_t tiles_m = ceil_div(M, BM), tiles_n = ceil_div(N, BN);
  const int64_t KT = ceil_div(k_len, BK);
  for (int64_t t = blockIdx.x; t < tiles_m * tiles_n; t += gridDim.x) {
    int64_t tm, tn;
    tile_coords<8>(t, tiles_m, tiles_n, tm, tn);
    const int64_t m0 = tm * BM, n0 = tn * BN;

    Acc ra[kAPer][4], rb[kBPer][4];
    auto load = [&](int64_t k0) {
#pragma unroll
      for (int p = 0; p < kAPer; ++p) {
        const int g = tid + p * kThreads;
        const int64_t gm = m0 + g / (BK / 4), gk = k0 + (g % (BK / 4)) * 4;
        if constexpr (kVec) {
          float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
          if (gm < M && gk < k_len) v = *reinterpret_cast<const float4*>(A + gm * K + gk);
          ra[p][0] = v.x, ra[p][1] = v.y, ra[p][2] = v.z, ra[p][3] = v.w;
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e) ra[p][e] = (gm < M && gk + e < k_len) ? cuda::to_opmath(A[gm * K + gk + e]) : Acc(0);
        }
      }
#pragma unroll
      for (int p = 0; p < kBPer; ++p) {
        const int g = tid + p * kThreads;
        const int64_t gk = k0 + g / (BN / 4), gn = n0 + (g % (BN / 4)) * 4;
        if constexpr (kVec) {
          float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
          if (gk < k_len && gn < N) v = *reinterpret_cast<const float4*>(B + gk * N + gn);
          rb[p][0] = v.x, rb[p][1] = v.y, rb[p][2] = v.z, rb[p][3] = v.w;
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e) rb[p][e] = (gk < k_len && gn + e < N) ? cuda::to_opmath(B[gk * N + gn + e]) : Acc(0);
        }
      }
    };
    auto store = [&](int buf) {
#pragma unroll
      for (int p = 0; p < kAPer; ++p) {
        const int g = tid + p * kThreads;
        const int row = g / (BK / 4), kq = (g % (BK / 4)) * 4;
#pragma unroll
        for (int e = 0; e < 4; ++e) As[buf][kq + e][row] = ra[p][e];
      }
#pragma unroll
      for (int p = 0; p < kBPer; ++p) {
        const int g = tid + p * kThreads;
        *reinterpret_cast<Quad<Acc>*>(&Bs[buf][g / (BN / 4)][(g % (BN / 4)) * 4]) =
            Quad<Acc>{{rb[p][0], rb[p][1], rb[p][2], rb[p][3]}};
      }
    };

    Acc acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) acc[i][j] = Acc(0);

    load(0);
    store(0);
    __syncthreads();
    for (int64_t kt = 0; kt < KT; ++kt) {
      const int buf = static_cast<int>(kt & 1);
      if (kt + 1 < KT) load((kt + 1) * BK);
#pragma unroll
      for (int k = 0; k < BK; ++k) {
        Quad<Acc> a[MI], b[NI];
#pragma unroll
        for (int i = 0; i < MI; ++i) a[i] = *reinterpret_cast<const Quad<Acc>*>(&As[buf][k][wm0 + i * (WM / MI) + lr * 4]);
#pragma unroll
        for (int j = 0; j < NI; ++j) b[j] = *reinterpret_cast<const Quad<Acc>*>(&Bs[buf][k][wn0 + j * (WN / NI) + lc * 4]);
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
          for (int ii = 0; ii < 4; ++ii)
#pragma unroll
            for (int j = 0; j < NI; ++j)
#pragma unroll
              for (int jj = 0; jj < 4; ++jj) acc[i * 4 + ii][j * 4 + jj] += a[i].v[ii] * b[j].v[jj];
      }
      if (kt + 1 < KT) store(buf ^ 1);
      __syncthreads();
    }

    // Split y's partial tile goes to slice y of the workspace (computed here,
    // not kept live through the main loop: that cost the 64 x 64 x 16 kernel
    // a spill).
    Out* const Cy = kSplit ? C + blockIdx.y * M * N : C;
#pragma unroll
    for (int i = 0; i < MI; ++i) {
#pragma unroll
      for (int ii = 0; ii < 4; ++ii) {
        const int64_t row = m0 + wm0 + i * (WM / MI) + lr * 4 + ii;
        if (row >= M) continue;
#pragma unroll
        for (int j = 0; j < NI; ++j) {
          const int64_t col = n0 + wn0 + j * (WN / NI) + lc * 4;
          const Acc* v = acc[i * 4 + ii] + j * 4;
          if constexpr (kVec) {
            if (col < N) *reinterpret_cast<float4*>(Cy + row * N + col) = make_float4(v[0], v[1], v[2], v[3]);
          } else {
#pragma unroll
            for (int jj = 0; jj < 4; ++jj)
              if (col + jj < N) Cy[row * N + col + jj] = cuda::from_opmath<Out>(v[jj]);
          }
        }
      }
    }
  }
}

// C[i] = ws[0][i] + ws[1][i] + ... + ws[splits - 1][i], added in that order
// (the same bits on every run) and rounded once to T; n = M * N, the slice
// size. kVec: four outputs a thread (float32, n % 4 == 0, 16-byte aligned C
// and workspace), else one.
constexpr int kReduceThreads = 256;
template <typename T, typename Acc, bool kVec>
__global__ void __launch_bounds__(kReduceThreads)
    splitk_reduce_kernel(const Acc* __restrict__ ws, T* __restrict__ C, int64_t n, int splits) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  const int64_t first = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if constexpr (kVec) {
    static_assert(sizeof(T) == 4 && sizeof(Acc) == 4, "16-byte path: float32");
    const int64_t n4 = n / 4;
    const float4* w = reinterpret_cast<const float4*>(ws);
    for (int64_t i = first; i < n4; i += stride) {
      float4 s = w[i];
      for (int y = 1; y < splits; ++y) {
        const float4 v = w[y * n4 + i];
        s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
      }
      reinterpret_cast<float4*>(C)[i] = s;
    }
  } else {
    for (int64_t i = first; i < n; i += stride) {
      Acc s = ws[i];
      for (int y = 1; y < splits; ++y) s += ws[y * n + i];
      C[i] = cuda::from_opmath<T>(s);
    }
  }
}

// K cut into `splits` ranges of `chunk` elements (a multiple of BK; the last
// range may be shorter): the split launch_simt runs when asked for
// `requested`. Never an empty range: asking for more splits than K has
// K-slices gives fewer. At most 65535 (gridDim.y).
struct SplitK {
  int splits;
  int64_t chunk;
};
template <class Tile>
inline SplitK split_k(int64_t K, int requested) {
  if (requested <= 1 || K <= Tile::BK) return {1, K};
  const int64_t want = requested < 65535 ? requested : 65535;
  const int64_t chunk = ceil_div(ceil_div(K, want), Tile::BK) * Tile::BK;
  return {static_cast<int>(ceil_div(K, chunk)), chunk};
}

// Workspace bytes launch_simt<.., Tile, ..> needs to run `requested` splits:
// the [splits][M][N] Acc partial sums, 0 when it runs unsplit; SIZE_MAX when
// that would not fit a size_t (no workspace can be that large).
template <typename Acc, class Tile>
inline size_t simt_workspace_bytes(const Problem& p, int requested) {
  const SplitK sk = split_k<Tile>(p.K, requested);
  if (sk.splits <= 1) return 0;
  const double bytes =
      static_cast<double>(sk.splits) * static_cast<double>(p.M) * static_cast<double>(p.N) * sizeof(Acc);
  if (bytes >= 0x1p62) return SIZE_MAX;
  return static_cast<size_t>(sk.splits) * static_cast<size_t>(p.M) * static_cast<size_t>(p.N) * sizeof(Acc);
}

// splits: the number of K ranges asked for (split_k says how many run); ws:
// simt_workspace_bytes of it or more, else an error and nothing launched.
// kMaySplit: whether the split kernel is compiled at all (the large tiles,
// which fill the SMs by themselves, do without it).
template <typename T, typename Acc, class Tile, bool kVec, bool kMaySplit = false>
const char* launch_simt(const Problem& p, int sms, cudaStream_t stream, int splits = 1, Workspace ws = {}) {
  constexpr int smem = Tile::template smem_bytes<Acc>();
  const int64_t tiles = ceil_div(p.M, Tile::BM) * ceil_div(p.N, Tile::BN);
  // One CTA per tile; the kernel's tile loop only matters past gridDim.x's limit.
  const unsigned grid = static_cast<unsigned>(tiles < 0x7fffffff ? tiles : 0x7fffffff);
  const T* a = static_cast<const T*>(p.a);
  const T* b = static_cast<const T*>(p.b);
  const SplitK sk = split_k<Tile>(p.K, splits);
  if (sk.splits == 1) {
    constexpr auto kernel = simt_gemm_kernel<T, Acc, Tile, kVec>;
    if (const char* err = allow_smem<kernel>(smem)) return err;
    kernel<<<grid, Tile::kThreads, smem, stream>>>(a, b, static_cast<T*>(p.c), p.M, p.N, p.K, p.K);
    return cuda::last_error();
  }
  if constexpr (!kMaySplit) {
    (void)sms, (void)ws;
    return "opforge: gemm: split-K asked of a SIMT launcher compiled without it";
  } else {
    if (const char* err = check_workspace(ws, simt_workspace_bytes<Acc, Tile>(p, splits))) return err;
    constexpr auto kernel = simt_gemm_kernel<T, Acc, Tile, kVec, true>;
    if (const char* err = allow_smem<kernel>(smem)) return err;
    Acc* partial = static_cast<Acc*>(ws.ptr);
    kernel<<<dim3(grid, static_cast<unsigned>(sk.splits)), Tile::kThreads, smem, stream>>>(a, b, partial, p.M, p.N,
                                                                                           p.K, sk.chunk);
    if (const char* err = cuda::last_error()) return err;
    // One wave: 8 CTAs of 256 threads fill an sm_80 / sm_90 SM (2048
    // threads); the grid-stride loop covers the rest.
    const int64_t n = p.M * p.N, items = kVec ? n / 4 : n;
    const int64_t blocks = std::min<int64_t>(ceil_div(items, kReduceThreads), int64_t{sms > 0 ? sms : 1} * 8);
    splitk_reduce_kernel<T, Acc, kVec><<<static_cast<unsigned>(blocks), kReduceThreads, 0, stream>>>(
        partial, static_cast<T*>(p.c), n, sk.splits);
    return cuda::last_error();
  }
}

// Whether the 16-byte float32 path applies: every row of A, B and C starts on
// a 16-byte boundary.
inline bool simt_vec_ok(const Problem& p) {
  return p.K % 4 == 0 && p.N % 4 == 0 && aligned(p.a, 16) && aligned(p.b, 16) && aligned(p.c, 16);
}

}  // namespace opforge::gemm
