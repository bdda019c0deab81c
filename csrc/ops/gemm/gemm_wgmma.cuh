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
// into the next tile while the consumers store the last one.
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

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "gemm_common.cuh"
#include "gemm_wgmma_ops.cuh"

namespace opforge::gemm {

template <int BM_, int BN_, int STAGES_, int CONSUMERS_>
struct WgmmaTile {
  static constexpr int BM = BM_, BN = BN_, BK = 64, STAGES = STAGES_, CONSUMERS = CONSUMERS_;
  static constexpr int kThreads = 128 * (CONSUMERS + 1);
  static constexpr int kRowsPerConsumer = BM / CONSUMERS;
  static constexpr int kMI = kRowsPerConsumer / 64;  // m64 wgmmas per consumer per K step
  static constexpr int kABytes = BM * BK * 2, kBBytes = BK * BN * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  // Slack to align the dynamic shared memory to 1024 bytes, then the slots,
  // then a full and an empty mbarrier per slot.
  static constexpr int kSmemBytes = 1024 + STAGES * kStageBytes + STAGES * 16;
  static_assert(kRowsPerConsumer % 64 == 0, "each consumer owns whole m64 blocks");
  static_assert(BN % 64 == 0 && BN <= 256, "B is loaded in 64-column boxes; wgmma N <= 256");
};

namespace wgmma_detail {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Returns once the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Ties accumulator registers to this point: the compiler must not move reads
// or writes of them across a wgmma wait (they are written asynchronously).
template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
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
struct Pair2;
template <>
struct Pair2<__half> {
  using type = __half2;
  static __device__ __forceinline__ type make(float a, float b) { return __floats2half2_rn(a, b); }
};
template <>
struct Pair2<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static __device__ __forceinline__ type make(float a, float b) { return __floats2bfloat162_rn(a, b); }
};

}  // namespace wgmma_detail

// Whether the loaded image of this translation unit has the sm_90a code: its
// static shared memory says so (4096 bytes in the sm_90a build, 4 otherwise;
// the reported size may add alignment padding for the dynamic shared memory
// and, on sm_90, 1 KB reserved by the system, both well under 4096), read by
// cudaFuncGetAttributes without a launch or a synchronisation. A build without
// sm_90a (a 9.0 GPU running compute_80 or compute_90 PTX) must never launch
// wgmma_gemm_kernel, whose body is then a trap.
constexpr int kProbeSm90aInts = 1024;
__global__ void wgmma_probe_kernel(int* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __shared__ int s[kProbeSm90aInts];
#else
  __shared__ int s[1];
#endif
  constexpr int n = sizeof(s) / sizeof(int);
  s[threadIdx.x % n] = threadIdx.x;
  __syncthreads();
  if (out != nullptr) out[threadIdx.x] = s[(threadIdx.x + 1) % n];
}

template <typename T, class Tile>
__global__ void __launch_bounds__(Tile::kThreads, 1)
    wgmma_gemm_kernel(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b,
                      T* __restrict__ C, int M, int N, int K, int tiles_m, int tiles_n) {
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
  const uint32_t full_bars = base + STAGES * Tile::kStageBytes;
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
            if (col < N) {
              *reinterpret_cast<typename Pair2<T>::type*>(crow + col) =
                  Pair2<T>::make(d[i][4 * j + 2 * h], d[i][4 * j + 2 * h + 1]);
            }
          }
        }
      }
    }
  }
#else
  // This image has no sm_90a code (see wgmma_probe_kernel): never launched.
  __trap();
#endif
}

// ---------------------------------------------------------------------------
// Host side: tensor maps through the driver's cuTensorMapEncodeTiled, fetched
// from the runtime (no -lcuda), and the launcher.

inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &p, cudaEnableDefault, &found);
#endif
    return (err == cudaSuccess && found == cudaDriverEntryPointSuccess)
               ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p)
               : nullptr;
  }();
  return fn;
}

// A row-major [rows, cols] matrix of 2-byte elements, read in boxes of
// [box_rows, 64 columns] into 128-byte-swizzled shared memory.
inline bool make_tensor_map(CUtensorMap* map, bool bf16, const void* ptr, int64_t rows, int64_t cols, int box_rows) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * 2};
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
                            const_cast<void*>(ptr), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

// Whether this device and this build can run the wgmma kernel at all.
inline bool wgmma_available(const DeviceInfo& info) {
  if (info.major != 9 || info.minor != 0) return false;
  static std::atomic<int> state[kMaxDevices];  // 0 unknown, 1 yes, 2 no
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  const bool cached = dev >= 0 && dev < kMaxDevices;
  if (cached && state[dev].load(std::memory_order_acquire) != 0) return state[dev].load() == 1;
  cudaFuncAttributes attr{};
  const bool yes = cudaFuncGetAttributes(&attr, wgmma_probe_kernel) == cudaSuccess &&
                   attr.sharedSizeBytes >= kProbeSm90aInts * sizeof(int) && tensor_map_encoder() != nullptr;
  if (cached) state[dev].store(yes ? 1 : 2, std::memory_order_release);
  return yes;
}

// TMA's rules: 16-byte aligned bases, row strides multiples of 16 bytes;
// every dimension within int (coordinates are 32-bit); C stored as pairs.
inline bool wgmma_ok(const Problem& p) {
  return p.K % 8 == 0 && p.N % 8 == 0 && aligned(p.a, 16) && aligned(p.b, 16) && aligned(p.c, 4) &&
         p.M < (int64_t{1} << 31) && p.N < (int64_t{1} << 31) && p.K < (int64_t{1} << 31);
}

// max_ctas: the persistent grid's size (0: one CTA per SM).
template <typename T, class Tile>
const char* launch_wgmma(const Problem& p, const DeviceInfo& info, cudaStream_t stream, int max_ctas = 0) {
  constexpr auto kernel = wgmma_gemm_kernel<T, Tile>;
  if (const char* err = allow_smem<kernel>(Tile::kSmemBytes)) return err;
  constexpr bool bf16 = std::is_same_v<T, __nv_bfloat16>;
  CUtensorMap map_a, map_b;
  if (!make_tensor_map(&map_a, bf16, p.a, p.M, p.K, Tile::BM) ||
      !make_tensor_map(&map_b, bf16, p.b, p.K, p.N, Tile::BK)) {
    return "opforge: gemm: cuTensorMapEncodeTiled failed";
  }
  const int64_t tiles_m = ceil_div(p.M, Tile::BM), tiles_n = ceil_div(p.N, Tile::BN);
  const int64_t tiles = tiles_m * tiles_n;
  if (tiles >= (int64_t{1} << 31)) return "opforge: gemm: too many tiles for the wgmma kernel";
  const int64_t cap = max_ctas > 0 ? max_ctas : info.sms;
  const int grid = static_cast<int>(tiles < cap ? tiles : cap);
  kernel<<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(map_a, map_b, static_cast<T*>(p.c),
                                                              static_cast<int>(p.M), static_cast<int>(p.N),
                                                              static_cast<int>(p.K), static_cast<int>(tiles_m),
                                                              static_cast<int>(tiles_n));
  return launch_error();
}

}  // namespace opforge::gemm
