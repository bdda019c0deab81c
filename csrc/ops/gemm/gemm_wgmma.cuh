#pragma once
// float16 / bfloat16 GEMM for Hopper (sm_90a): TMA loads into 128-byte-swizzled
// shared memory, warpgroup MMA (wgmma) from shared-memory descriptors, float32
// accumulators, a warp-specialised pipeline and a persistent grid.
//
// A CTA has 1 + CONSUMERS warpgroups. Warpgroup 0 is the producer: one thread
// walks the CTA's tiles and K-slices and issues cp.async.bulk.tensor loads of
// A [BM x 64] and B [64 x BN] into a ring of STAGES shared-memory slots; each
// load completes on the slot's "full" mbarrier (expect_tx counts the bytes).
// The consumers wait on "full", run BM/CONSUMERS x BN of the tile through
// m64nBNk16 wgmma (4 per K-slice per 64 rows), and, once the tensor cores are
// done reading a slot, arrive on its "empty" mbarrier so the producer refills
// it. The producer shrinks to 40 registers and the consumers grow to 232
// (setmaxnreg), which is what lets a consumer keep a 64 x 256 float32
// accumulator (128 registers a thread) without spilling. The grid is one CTA
// per SM (grid-stride over tiles in grouped order): the producer runs ahead
// into the next tile while the consumers finish the last one, and (kTmaStore)
// the consumers only write C into shared memory: the copy engine stores it
// while they start the next tile. That overlap took 8192 x 8192 x 512 from
// 62 % to 100 % of cuBLAS and 4096^3 from 90 % to 100 % (benchmarks/gemm_notes.md).
//
// Shared-memory layout, as the TMA 128-byte swizzle writes it and as the
// wgmma descriptors describe it (PTX ISA, "Shared Memory Matrix Layout" and
// "Matrix Descriptor Format"):
//   A slot, K-major: row m of the tile is 64 elements = 128 bytes at m * 128;
//     8 rows form one 1024-byte swizzle atom. Descriptor: SBO = 1024 (from one
//     8-row group to the next), LBO unused for swizzled K-major (1), and the
//     k-th 16-wide K step starts 32 * k bytes further (the swizzle is applied
//     to the absolute address bits, so a start inside the atom is valid while
//     the atom itself is 1024-byte aligned).
//   B slot, N-major (wgmma imm-trans-b = 1): BN/64 TMA boxes of [64 K rows x
//     64 N] = 8192 bytes each; row k of a box is 128 bytes at k * 128.
//     Descriptor: LBO = 8192 (from one 64-column box to the next along N),
//     SBO = 1024 (from one group of 8 K rows to the next), and the k-th K step
//     starts 16 rows = 2048 bytes further.
// Both slots sit on 1024-byte boundaries, so the descriptors' base offset is 0.
//
// Requirements (checked by wgmma_ok): TMA needs 16-byte aligned base
// addresses and row strides that are multiples of 16 bytes (K % 8 == 0 and
// N % 8 == 0); C is stored as pairs (4-byte aligned). Out-of-range rows and
// columns of A and B load as zeros (TMA), so M, N and K tails need no code
// in the main loop; the epilogue checks rows and columns against M and N.

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "gemm_common.cuh"
#include "gemm_wgmma_ops.cuh"
#include "opforge/sm90a.cuh"

namespace opforge::gemm {

// kTmaStore: the epilogue writes C through shared memory and TMA stores (C
// row-aligned: N % 8 == 0, 16-byte aligned base); otherwise straight from the
// accumulators with st.global (any N).
template <int BM_, int BN_, int STAGES_, int CONSUMERS_, bool kTmaStore_ = true>
struct WgmmaTile {
  static constexpr int BM = BM_, BN = BN_, BK = 64, STAGES = STAGES_, CONSUMERS = CONSUMERS_;
  static constexpr bool kTmaStore = kTmaStore_;
  static constexpr int kThreads = 128 * (CONSUMERS + 1);
  static constexpr int kRowsPerConsumer = BM / CONSUMERS;
  static constexpr int kMI = kRowsPerConsumer / 64;  // m64 wgmmas per consumer per K step
  static constexpr int kABytes = BM * BK * 2, kBBytes = BK * BN * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  // The C tile staged for the TMA store: [64 rows x 64 columns] boxes, 8 KB each.
  static constexpr int kCBytes = kTmaStore ? BM * BN * 2 : 0;
  // Slack to align the dynamic shared memory to 1024 bytes, then the slots,
  // the C staging, then a full and an empty mbarrier per slot.
  static constexpr int kSmemBytes = 1024 + STAGES * kStageBytes + kCBytes + STAGES * 16;
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than an H100/H200 block can have");
  static_assert(kRowsPerConsumer % 64 == 0, "each consumer owns whole m64 blocks");
  static_assert(BN % 64 == 0 && BN <= 256, "B is loaded in 64-column boxes; wgmma N <= 256");
};

namespace wgmma_detail {

// The pipeline's mbarrier, TMA and wgmma wrappers are opforge/sm90a.cuh's.
using sm90::fence_regs;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
using sm90::fence_proxy_async;
using sm90::mbar_arrive;
using sm90::mbar_expect_tx;
using sm90::mbar_init;
using sm90::mbar_wait;
using sm90::setmaxnreg_dec;
using sm90::setmaxnreg_inc;
using sm90::tma_load_2d;
using sm90::wgmma_commit;
using sm90::wgmma_fence;
using sm90::wgmma_wait;
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, uint32_t src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(src)
               : "memory");
}
using sm90::bulk_commit;
using sm90::bulk_wait;
using sm90::bulk_wait_read;
// A barrier for the 128 threads of one consumer warpgroup (id 0 is __syncthreads).
__device__ __forceinline__ void warpgroup_bar(int id) { sm90::named_bar(id, 128); }
__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
#endif

// Shared-memory matrix descriptor (PTX ISA, wgmma "Matrix Descriptor Format"):
// start address, leading and stride byte offsets (each >> 4, 14 bits),
// base offset 0, swizzle mode 1 = 128-byte swizzle in bits 62-63.
__device__ __forceinline__ uint64_t make_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32) | (uint64_t{1} << 62);
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  const typename Pair<T>::type v = Pair<T>::make(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <typename T>
__device__ __forceinline__ T round1(float a) {
  if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(a);
  } else {
    return __float2bfloat16_rn(a);
  }
}

}  // namespace wgmma_detail

// pairs (direct epilogue only): N even and C 4-byte aligned, so two outputs
// go out as one word.
template <typename T, class Tile>
__global__ void __launch_bounds__(Tile::kThreads, 1)
    wgmma_gemm_kernel(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b,
                      const __grid_constant__ CUtensorMap tma_c, T* __restrict__ C, int M, int N, int K, int tiles_m,
                      int tiles_n, bool pairs) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace wgmma_detail;
  constexpr int BM = Tile::BM, BN = Tile::BN, BK = Tile::BK, STAGES = Tile::STAGES;
  constexpr int MI = Tile::kMI;

  extern __shared__ __align__(1024) unsigned char wgmma_smem[];
  // The swizzle atoms must start on 1024-byte boundaries; dynamic shared
  // memory is only guaranteed 16.
  const uint32_t raw = smem_u32(wgmma_smem);
  const uint32_t base = (raw + 1023) & ~1023u;
  const uint32_t a_slots = base;
  const uint32_t b_slots = base + STAGES * Tile::kABytes;
  const uint32_t c_stage = base + STAGES * Tile::kStageBytes;  // Tile::kCBytes, 1024-aligned
  const uint32_t full_bars = c_stage + Tile::kCBytes;
  const uint32_t empty_bars = full_bars + STAGES * 8;

  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full_bars + 8 * s, 1);  // the producer's arrive.expect_tx
      mbar_init(empty_bars + 8 * s, 4 * Tile::CONSUMERS);  // one arrive per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();

  const int num_tiles = tiles_m * tiles_n;
  const int k_tiles = (K + BK - 1) / BK;

  if (wg == 0) {
    setmaxnreg_dec<40>();
    if (threadIdx.x == 0) {
      int stage = 0;
      uint32_t phase = 0;
      for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
        int64_t tm, tn;
        tile_coords<16>(t, tiles_m, tiles_n, tm, tn);
        const int m0 = static_cast<int>(tm) * BM, n0 = static_cast<int>(tn) * BN;
        for (int kt = 0; kt < k_tiles; ++kt) {
          mbar_wait(empty_bars + 8 * stage, phase ^ 1);
          const uint32_t full = full_bars + 8 * stage;
          mbar_expect_tx(full, Tile::kStageBytes);
          tma_load_2d(a_slots + stage * Tile::kABytes, &tma_a, full, kt * BK, m0);
#pragma unroll
          for (int j = 0; j < BN / 64; ++j) {
            tma_load_2d(b_slots + stage * Tile::kBBytes + j * (BK * 128), &tma_b, full, n0 + 64 * j, kt * BK);
          }
          if (++stage == STAGES) stage = 0, phase ^= 1;
        }
      }
    }
  } else {
    setmaxnreg_inc<232>();
    const int consumer = wg - 1;
    const int tw = threadIdx.x % 128, warp = tw / 32, lane = tw % 32;
    float d[MI][BN / 2];
    int stage = 0;
    uint32_t phase = 0;
    for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      int64_t tm, tn;
      tile_coords<16>(t, tiles_m, tiles_n, tm, tn);
      const int m0 = static_cast<int>(tm) * BM, n0 = static_cast<int>(tn) * BN;
      int prev = -1;
      for (int kt = 0; kt < k_tiles; ++kt) {
        mbar_wait(full_bars + 8 * stage, phase);
        const uint32_t a_slot = a_slots + stage * Tile::kABytes + consumer * Tile::kRowsPerConsumer * 128;
        const uint32_t b_slot = b_slots + stage * Tile::kBBytes;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
          const uint64_t db = make_desc(b_slot + kk * 2048, BK * 128, 1024);
#pragma unroll
          for (int i = 0; i < MI; ++i) {
            const uint64_t da = make_desc(a_slot + i * 64 * 128 + kk * 32, 16, 1024);
            Wgmma<BN, T>::mma(d[i], da, db, (kt > 0 || kk > 0) ? 1 : 0);
          }
        }
        wgmma_commit();
        // The previous slot's wgmmas are done once at most this K-slice's are
        // in flight: hand that slot back while this one runs.
        wgmma_wait<1>();
#pragma unroll
        for (int i = 0; i < MI; ++i) fence_regs(d[i]);
        if (prev >= 0 && lane == 0) mbar_arrive(empty_bars + 8 * prev);
        prev = stage;
        if (++stage == STAGES) stage = 0, phase ^= 1;
      }
      wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < MI; ++i) fence_regs(d[i]);
      if (prev >= 0 && lane == 0) mbar_arrive(empty_bars + 8 * prev);

      // Epilogue: accumulator register 4j + 2h + e of a thread holds row
      // 16 * warp + lane / 4 + 8h, column 8j + 2 * (lane % 4) + e of its m64
      // block (the wgmma D fragment layout).
      if constexpr (Tile::kTmaStore) {
        // Through shared memory: this consumer's rows, as [64 x 64] boxes in
        // the TMA 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8):
        // the 8 rows a warp writes at once land in 8 different bank groups),
        // then one thread stores the boxes with TMA, which clips rows >= M and
        // columns >= N, and the consumers go on to the next tile while the
        // copy engine writes this one.
        constexpr int kBoxes = BN / 64;
        const uint32_t mine = c_stage + consumer * MI * kBoxes * 8192;
        if (tw == 0) bulk_wait_read();  // the previous tile's stores are done with the staging
        warpgroup_bar(1 + consumer);
        const int r = warp * 16 + lane / 4;  // + 8h
#pragma unroll
        for (int i = 0; i < MI; ++i) {
#pragma unroll
          for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int rr = r + 8 * h;
              const uint32_t addr = mine + (i * kBoxes + j / 8) * 8192 + rr * 128 + (((j % 8) ^ (rr % 8)) << 4) +
                                    4 * (lane % 4);
              st_shared_u32(addr, pack2<T>(d[i][4 * j + 2 * h], d[i][4 * j + 2 * h + 1]));
            }
          }
        }
        fence_proxy_async();
        warpgroup_bar(1 + consumer);
        if (tw == 0) {
          const int row0 = m0 + consumer * Tile::kRowsPerConsumer;
#pragma unroll
          for (int i = 0; i < MI; ++i)
#pragma unroll
            for (int b = 0; b < kBoxes; ++b) tma_store_2d(&tma_c, mine + (i * kBoxes + b) * 8192, n0 + 64 * b, row0 + 64 * i);
          bulk_commit();
        }
      } else {
        const int row_base = m0 + consumer * Tile::kRowsPerConsumer + warp * 16 + lane / 4;
        const int col_base = n0 + 2 * (lane % 4);
#pragma unroll
        for (int i = 0; i < MI; ++i) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = row_base + i * 64 + 8 * h;
            if (row >= M) continue;
            T* crow = C + static_cast<int64_t>(row) * N;
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
              const int col = col_base + 8 * j;
              const float x = d[i][4 * j + 2 * h], y = d[i][4 * j + 2 * h + 1];
              if (pairs) {
                if (col < N) *reinterpret_cast<typename Pair<T>::type*>(crow + col) = Pair<T>::make(x, y);
              } else {
                if (col < N) crow[col] = round1<T>(x);
                if (col + 1 < N) crow[col + 1] = round1<T>(y);
              }
            }
          }
        }
      }
    }
    // The CTA's shared memory must outlive the last stores' reads of it.
    if constexpr (Tile::kTmaStore) {
      if (tw == 0) bulk_wait();
    }
  }
#else
  // This image has no sm_90a code (sm90::sm90a_code_loaded): never launched.
  __trap();
#endif
}

// ---------------------------------------------------------------------------
// Host side: tensor maps through the driver's cuTensorMapEncodeTiled, fetched
// from the runtime (no -lcuda), and the launcher.

// A row-major [rows, cols] matrix of 2-byte elements, `pitch` elements from
// one row to the next (a multiple of 8), moved in boxes of [box_rows, 64
// columns] to or from 128-byte-swizzled shared memory; out-of-range elements
// of a box read as zeros and are not written.
inline bool make_tensor_map(CUtensorMap* map, bool bf16, const void* ptr, int64_t rows, int64_t cols, int64_t pitch,
                            int box_rows) {
  const auto encode = sm90::tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(pitch) * 2};
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
                            const_cast<void*>(ptr), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

// Whether this device and this build can run the wgmma kernel at all: a 9.0
// GPU, this library's sm_90a code loaded, a driver that encodes tensor maps.
// `static`, like sm90a_code_loaded: each library built from these sources
// (examples/gemm beside opforge) must ask about its own image, and an inline
// function would be one process-wide symbol.
static bool wgmma_available(const DeviceInfo& info) {
  return info.major == 9 && info.minor == 0 && sm90::sm90a_code_loaded();
}

// Coordinates are 32-bit: every dimension within int.
inline bool wgmma_dims_ok(const Problem& p) {
  return p.M < (int64_t{1} << 31) && p.N < (int64_t{1} << 31) && p.K < (int64_t{1} << 31);
}
// TMA's rules, for A, B and C as they are: 16-byte aligned bases, row strides
// multiples of 16 bytes (K % 8 == 0, N % 8 == 0).
inline bool wgmma_ok(const Problem& p) {
  return p.K % 8 == 0 && p.N % 8 == 0 && aligned(p.a, 16) && aligned(p.b, 16) && aligned(p.c, 16) &&
         wgmma_dims_ok(p);
}

// The wgmma kernel on A [M, K] and B [K, N] with row pitches lda and ldb
// (multiples of 8, 16-byte aligned bases): the caller's matrices or padded
// copies of them. max_ctas: the persistent grid's size (0: one CTA per SM).
template <typename T, class Tile>
const char* launch_wgmma_on(const Problem& p, const void* a, int64_t lda, const void* b, int64_t ldb,
                            const DeviceInfo& info, cudaStream_t stream, int max_ctas) {
  constexpr auto kernel = wgmma_gemm_kernel<T, Tile>;
  if (const char* err = allow_smem<kernel>(Tile::kSmemBytes)) return err;
  constexpr bool bf16 = std::is_same_v<T, __nv_bfloat16>;
  CUtensorMap map_a, map_b, map_c;
  std::memset(&map_c, 0, sizeof map_c);
  if (!make_tensor_map(&map_a, bf16, a, p.M, p.K, lda, Tile::BM) ||
      !make_tensor_map(&map_b, bf16, b, p.K, p.N, ldb, Tile::BK) ||
      (Tile::kTmaStore && !make_tensor_map(&map_c, bf16, p.c, p.M, p.N, p.N, 64))) {
    return "opforge: gemm: cuTensorMapEncodeTiled failed";
  }
  const int64_t tiles_m = ceil_div(p.M, Tile::BM), tiles_n = ceil_div(p.N, Tile::BN);
  const int64_t tiles = tiles_m * tiles_n;
  if (tiles >= (int64_t{1} << 31)) return "opforge: gemm: too many tiles for the wgmma kernel";
  const int64_t cap = max_ctas > 0 ? max_ctas : info.sms;
  const int grid = static_cast<int>(tiles < cap ? tiles : cap);
  const bool pairs = p.N % 2 == 0 && aligned(p.c, 4);
  kernel<<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(
      map_a, map_b, map_c, static_cast<T*>(p.c), static_cast<int>(p.M), static_cast<int>(p.N), static_cast<int>(p.K),
      static_cast<int>(tiles_m), static_cast<int>(tiles_n), pairs);
  return cuda::last_error();
}

template <typename T, class Tile>
const char* launch_wgmma(const Problem& p, const DeviceInfo& info, cudaStream_t stream, int max_ctas = 0) {
  return launch_wgmma_on<T, Tile>(p, p.a, p.K, p.b, p.N, info, stream, max_ctas);
}

// dst[r, c] = src[r, c] for c < cols, 0 for cols <= c < ld (ld % 8 == 0):
// one 16-byte chunk of dst a thread, read element by element (src rows need
// not be aligned at all).
template <typename T>
__global__ void pad_rows_kernel(const T* __restrict__ src, T* __restrict__ dst, int64_t rows, int64_t cols,
                                int64_t ld) {
  const int64_t chunks = ld / 8, n = rows * chunks;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / chunks, c = (i - r * chunks) * 8;
    alignas(16) T v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = c + e < cols ? src[r * cols + c + e] : T{};
    *reinterpret_cast<uint4*>(dst + r * ld + c) = *reinterpret_cast<const uint4*>(v);
  }
}

template <typename T>
inline const char* pad_rows(const void* src, void* dst, int64_t rows, int64_t cols, int64_t ld, int sms,
                            cudaStream_t s) {
  const int64_t n = rows * (ld / 8);
  const int64_t blocks = std::min<int64_t>(ceil_div(n, 256), int64_t{sms} * 16);
  pad_rows_kernel<T><<<static_cast<unsigned>(blocks), 256, 0, s>>>(static_cast<const T*>(src), static_cast<T*>(dst),
                                                                    rows, cols, ld);
  return cuda::last_error();
}

// Where launch_wgmma_packed puts the padded copies in its workspace: A's
// [M, lda] first (rounded up to 256 bytes, so that B's copy starts aligned),
// then B's [K, ldb]; only the operands TMA cannot read as they are (K or N
// not a multiple of 8, or a base not 16-byte aligned) are copied. Sizes in
// size_t: M * lda * 2 of two 31-bit sizes can pass int64_t's range.
struct PackedLayout {
  bool pad_a, pad_b;
  int64_t lda, ldb;
  size_t bytes_a, bytes_b;
};
inline PackedLayout packed_layout(const Problem& p) {
  PackedLayout l{};
  l.pad_a = p.K % 8 != 0 || !aligned(p.a, 16);
  l.pad_b = p.N % 8 != 0 || !aligned(p.b, 16);
  l.lda = l.pad_a ? ceil_div(p.K, 8) * 8 : p.K;
  l.ldb = l.pad_b ? ceil_div(p.N, 8) * 8 : p.N;
  l.bytes_a = l.pad_a ? (static_cast<size_t>(p.M) * static_cast<size_t>(l.lda) * 2 + 255) / 256 * 256 : 0;
  l.bytes_b = l.pad_b ? static_cast<size_t>(p.K) * static_cast<size_t>(l.ldb) * 2 : 0;
  return l;
}
// The workspace launch_wgmma_packed needs for this problem.
inline size_t packed_workspace_bytes(const Problem& p) {
  const PackedLayout l = packed_layout(p);
  return l.bytes_a + l.bytes_b;
}

// The wgmma kernel for A and B that TMA cannot read as they are (K or N not
// a multiple of 8, unaligned bases): each such operand is copied first into
// the workspace (packed_workspace_bytes of it, from the caller) with its rows
// padded to a multiple of 8 elements, at the cost of one read and one write
// of it (4095 x 4097 x 4093: 67 MB moved, about 20 us at the H200's copy
// rate, against 1 ms for cuBLAS on that shape). C is written in place by the
// direct epilogue (any N). A workspace too small: an error, nothing launched.
template <typename T, class Tile>
const char* launch_wgmma_packed(const Problem& p, const DeviceInfo& info, cudaStream_t s, Workspace ws,
                                int max_ctas = 0) {
  static_assert(!Tile::kTmaStore, "C may be unaligned here: the direct epilogue");
  const PackedLayout l = packed_layout(p);
  if (const char* err = check_workspace(ws, l.bytes_a + l.bytes_b)) return err;
  const void* a = p.a;
  const void* b = p.b;
  if (l.pad_a) {
    if (const char* err = pad_rows<T>(p.a, ws.ptr, p.M, p.K, l.lda, info.sms, s)) return err;
    a = ws.ptr;
  }
  if (l.pad_b) {
    void* dst = static_cast<char*>(ws.ptr) + l.bytes_a;
    if (const char* err = pad_rows<T>(p.b, dst, p.K, p.N, l.ldb, info.sms, s)) return err;
    b = dst;
  }
  return launch_wgmma_on<T, Tile>(p, a, l.lda, b, l.ldb, info, s, max_ctas);
}

}  // namespace opforge::gemm
