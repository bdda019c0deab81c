#pragma once
// qqq_gemm on Hopper (sm_90a): a warp-specialised kernel with wgmma s8, from
// M = 8 per channel and from M = 1 per group when the group scales fold
// (qqq_dispatch.cuh says where).
//
// The product is computed transposed: out^T [N, M] = W^T [N, K] x a^T [K, M],
// so that the weights are wgmma's register A operand (64 weight columns x 32 k
// per m64 wgmma: LAYOUT.md's words, converted in registers, are exactly its A
// fragments) and the activations its shared-memory B operand (N of the wgmma =
// BM rows of `a`, K-major, as TMA's 128-byte swizzle writes them). 8-bit wgmma
// takes B only K-major, which is how `a` is stored.
//
// A CTA has 1 + CONSUMERS warpgroups. Warpgroup 0 is the producer: one thread
// fills a ring of STAGES slots, each 128 k deep: the activations [BM x 128] by
// one TMA box, the weights of the tile's stripes (4 units, 2 KB each,
// contiguous in the layout) by one box of a second tensor map (WTMA) or one
// bulk copy per stripe, and per group one row of group scales per k32 unit;
// all complete on the slot's "full" mbarrier. Each consumer warpgroup owns
// 128 weight columns (warp w: stripe w, the rows of its m64 blocks) and per
// k32 unit converts its lane's 16 bytes and issues two m64nBMk32 wgmmas;
// FRAGS sets of A registers let FRAGS - 1 units' wgmmas run while the next
// unit is converted. A slot goes back to the producer (its "empty" mbarrier,
// one arrive per consumer thread) once the wgmmas reading it are complete.
// No barrier of the whole CTA inside the loop. Split-K and the epilogue as the
// other kernels.

#include <cstdint>

#include "opforge/sm90a.cuh"
#include "qqq_common.cuh"
#include "qqq_wgmma_ops.cuh"

namespace opforge::qqq {
namespace {

template <int BM_, int CONSUMERS_, int STAGES_, int FRAGS_, int MINB_ = 1, bool WTMA_ = false, int PROBE_ = 0,
          bool FOLD_ = false>
struct WsConfig {
  // WTMA: the slot's weights (all its stripes) by one TMA box of a second
  // tensor map instead of one bulk copy per stripe.
  static constexpr bool WTMA = WTMA_;
  static constexpr int PROBE = PROBE_;  // tuning only: 1 skips the conversion, 2 the wgmmas (wrong results)
  // Per group, when a group spans whole slots (group_size a multiple of BK):
  // per-slot partial sums, converted as per channel and scaled once per slot,
  // instead of the group scale in every weight byte's conversion. (A second
  // set of partial sums, for the next slot's wgmmas to run during the fold,
  // was slower: ptxas serialises wgmmas whose accumulators other instructions
  // read before a wait_group 0.)
  static constexpr bool FOLD = FOLD_;
  // Whether a launch with this group_size (-1: per channel) folds.
  static constexpr bool folds(int64_t group_size) { return FOLD && group_size > 0 && group_size % BK == 0; }
  static constexpr int BM = BM_;  // rows of `a` per tile: the wgmma's N
  static constexpr int CONSUMERS = CONSUMERS_;
  static constexpr int STAGES = STAGES_;
  static constexpr int FRAGS = FRAGS_;  // register sets of A fragments (units in flight + 1)
  static constexpr int MINB = MINB_;
  static constexpr bool DIRECT = false, WS = true;
  static_assert(BM == 32 || BM == 64 || BM == 128, "wgmma n32, n64 or n128");
  static_assert(FRAGS == 1 || FRAGS == 2 || FRAGS == 4, "the set of a unit known at compile time");
  static constexpr int THREADS = 128 * (1 + CONSUMERS);
  static constexpr int BN = 128 * CONSUMERS;
  static constexpr int KU = 4;  // k32 units per stage: 128 bytes of a row, one swizzle span
  static constexpr int BK = 32 * KU;
  static constexpr int A_STAGE = BM * BK;  // a multiple of 1024: the swizzle atoms stay aligned
  static constexpr int B_STAGE = BN * BK / 2;
  static constexpr int G_STAGE = KU * BN;
  static constexpr int ACC = BM;  // int32 accumulators per consumer thread: two m64nBM wgmmas
  static constexpr int RED = 0;
  // 1 KB of slack to align the ring to the swizzle atom, the slots, the mbarriers.
  static constexpr int SMEM = 1024 + STAGES * (A_STAGE + B_STAGE + G_STAGE) + STAGES * 16;
  // Registers: the launch gives each thread R0; the producer gives back all
  // but 40 and the consumers take them (setmaxnreg), when that is more.
  static constexpr int R0 = (65536 / (THREADS * MINB) > 255 ? 255 : 65536 / (THREADS * MINB)) / 8 * 8;
  static constexpr int RC_RAW = (R0 * (CONSUMERS + 1) - 40) / CONSUMERS / 8 * 8;
  static constexpr int RC = RC_RAW > 240 ? 240 : RC_RAW;
  static constexpr bool REBALANCE = RC > R0;
};

// Accumulator flat[h * BM / 2 + nb * 4 + i] of wgmma h (D fragment: row g +
// 8 (i / 2) of the warp's 16, column nb * 8 + 2 t + i % 2) is weight column
// col0 + 2 h + i / 2 (n8 tile 2 h + i / 2 of the stripe, MMA column g:
// LAYOUT.md's logical column g * 4 + tile) and row m0 + nb * 8 + 2 t + i % 2
// of `a`: 4 consecutive output columns per row.
template <class C, bool GROUPED>
__device__ __forceinline__ void ws_epilogue(const Params& p, const int32_t* flat, int m0, int col0, uint32_t bad) {
  const int t = threadIdx.x % 4;
  const float4 sc = __ldg(reinterpret_cast<const float4*>(p.s_ch + col0));
  const float scs[4] = {sc.x, sc.y, sc.z, sc.w};
#pragma unroll
  for (int nb = 0; nb < C::BM / 8; ++nb) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int row = m0 + nb * 8 + 2 * t + e;
      if (row >= p.M) continue;
      const float st = __ldg(p.s_tok + row);
      float o[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        int32_t v = flat[(j / 2) * (C::BM / 2) + nb * 4 + (j % 2) * 2 + e];
        if constexpr (!GROUPED) v >>= 4;  // the MMA summed 16 * q: exact
        o[j] = bad ? __int_as_float(0x7fffffff) : (static_cast<float>(v) * st) * scs[j];
      }
      store_row(p, static_cast<int64_t>(row) * p.N + col0, o);
    }
  }
}

template <class C, bool GROUPED, bool FOLD = false>
__global__ void __launch_bounds__(C::THREADS, C::MINB)
    qqq_ws_kernel(const Params p, const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_w) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace opforge::sm90;
  constexpr int STAGES = C::STAGES, KU = C::KU;
  constexpr int kConsumerThreads = 128 * C::CONSUMERS;
  static_assert(!FOLD || (GROUPED && C::FOLD), "a fold is per group, in a configuration with partial sums");
  extern __shared__ __align__(1024) uint8_t ws_smem[];
  __shared__ int s_last;
  __shared__ uint32_t s_bad;
  // The swizzle atoms must start on 1024-byte boundaries; dynamic shared
  // memory is only guaranteed 16.
  const uint32_t raw = smem_addr(ws_smem);
  const uint32_t base = (raw + 1023) & ~1023u;
  uint8_t* const gbase = ws_smem + (base - raw);  // the same byte, as a generic pointer
  constexpr uint32_t kW = STAGES * C::A_STAGE, kG = kW + STAGES * C::B_STAGE, kBars = kG + STAGES * C::G_STAGE;
  const uint32_t full = base + kBars, empty = full + 8 * STAGES;

  const Place place = place_of<C>(p);
  const int n_iters = place.it_end - place.it_begin;
  const int KB = p.K / 32;
  const int NB = p.N / 32;
  const int stripes = min(C::BN / 32, NB - place.n0 / 32);

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full + 8 * s, 1);                   // the producer's arrive.expect_tx
      mbar_init(empty + 8 * s, kConsumerThreads);  // one arrive per consumer thread
    }
    s_bad = 0;
    mbar_init_fence();
  }
  __syncthreads();

  if (threadIdx.x < 128) {
    // --- producer ---
    if constexpr (C::REBALANCE) setmaxnreg_dec<40>();
    if (threadIdx.x == 0) {
      const uint8_t* w_bytes = reinterpret_cast<const uint8_t*>(p.w);
      for (int i = 0; i < n_iters; ++i) {
        const int slot = i % STAGES;
        mbar_wait(empty + 8 * slot, ((i / STAGES) & 1) ^ 1);
        const int kb0 = (place.it_begin + i) * KU;
        const int units = min(KU, KB - kb0);
        const uint32_t bar = full + 8 * slot;
        const uint32_t w_bytes_in = C::WTMA ? C::B_STAGE : stripes * units * 512;
        mbar_expect_tx(bar, C::A_STAGE + w_bytes_in + (FOLD ? stripes * 32 : GROUPED ? units * stripes * 32 : 0));
        // Rows past M and k past K arrive as zeros (a TMA box counts in full).
        tma_load_2d(base + slot * C::A_STAGE, &tma_a, bar, kb0 * 32, place.m0);
        if constexpr (C::WTMA) {
          tma_load_2d(base + kW + slot * C::B_STAGE, &tma_w, bar, kb0 * 64, place.n0 / 32);
        } else {
          for (int s = 0; s < stripes; ++s) {
            const int64_t unit0 = static_cast<int64_t>(place.n0 / 32 + s) * KB + kb0;
            bulk_load(base + kW + slot * C::B_STAGE + s * KU * 512, w_bytes + unit0 * 512, units * 512, bar);
          }
        }
        if constexpr (FOLD) {
          // One group row serves the whole slot.
          const int64_t row = static_cast<int64_t>(kb0) * 32 / p.group_size;
          bulk_load(base + kG + slot * C::G_STAGE, p.s_group + row * p.N + place.n0, stripes * 32, bar);
        } else if constexpr (GROUPED) {
          for (int u = 0; u < units; ++u) {
            const int64_t row = static_cast<int64_t>(kb0 + u) * 32 / p.group_size;
            bulk_load(base + kG + slot * C::G_STAGE + u * C::BN, p.s_group + row * p.N + place.n0, stripes * 32, bar);
          }
        }
      }
    }
    return;
  }

  // --- consumers ---
  if constexpr (C::REBALANCE) setmaxnreg_inc<C::RC>();
  const int ct = threadIdx.x - 128;  // consumer thread
  const int wn = ct / 32;            // the warp's stripe in the tile
  const int lane = ct % 32;
  const bool stripe_ok = wn < stripes;
  int32_t acc[C::ACC];
#pragma unroll
  for (int r = 0; r < C::ACC; ++r) acc[r] = 0;
  uint32_t frag[C::FRAGS][2][4];
  uint32_t bad = 0;
  // FOLD: the partial sums of a slot (per-channel conversion: 16 x the sum of
  // q * a over its 128 k) and the scale word of the slot waiting to be folded.
  int32_t part[FOLD ? C::ACC : 1];
#pragma unroll
  for (int r = 0; r < (FOLD ? C::ACC : 1); ++r) part[r] = 0;
  uint32_t s_prev = 0;
  // acc += s * (t >> 4), s the group scale of each sum's column (byte j of the
  // lane's word: column col0 + j, as in ws_epilogue). The shift is exact and
  // keeps acc in the range of the in-conversion path (|acc| <= K * 128 * 128).
  auto fold = [&](auto& t, uint32_t s4) {
    fence_regs(t);
#pragma unroll
    for (int r = 0; r < C::ACC; ++r) {
      const int j = 2 * (r / (C::BM / 2)) + (r % 4) / 2;
      acc[r] += (t[r] >> 4) * static_cast<int32_t>((s4 >> (8 * j)) & 0xFFu);
    }
  };

  // Slot i into `cur`: the accumulators, or FOLD's partial sums, which unit 0
  // overwrites once slot i - 1's have been folded.
  auto run_slot = [&](int i, auto& cur) {
    const int slot = i % STAGES;
    mbar_wait(full + 8 * slot, (i / STAGES) & 1);
    const int kb0 = (place.it_begin + i) * KU;
    const int units = min(KU, KB - kb0);
    const uint8_t* sw = gbase + kW + slot * C::B_STAGE + (wn * KU * 32 + lane) * 16;
    [[maybe_unused]] const uint8_t* sg = gbase + kG + slot * C::G_STAGE + wn * 32 + (lane / 4) * 4;
    const uint32_t a_slot = base + slot * C::A_STAGE;
    // Every slot runs all KU units, without a branch around a wgmma (ptxas
    // serialises wgmmas on a divergent path): in a short last slot the units
    // past K meet zero activations (TMA's fill), so whatever their weight
    // bytes hold adds 0. Likewise a stripe past N (the last tile of an N that
    // is not a multiple of BN) is not loaded and not stored. Neither may
    // raise the bad-scale flag.
    [[maybe_unused]] const uint32_t live = stripe_ok ? (1u << units) - 1 : 0u;
    // The slot's weights (and scales) for all KU units first: one shared-memory
    // latency per slot instead of one per unit on the path to the next wgmma.
    uint4 wv[KU];
    [[maybe_unused]] uint32_t sgw[KU];
#pragma unroll
    for (int u = 0; u < KU; ++u) {
      wv[u] = *reinterpret_cast<const uint4*>(sw + u * 512);
      if constexpr (GROUPED && !FOLD) sgw[u] = *reinterpret_cast<const uint32_t*>(sg + u * C::BN);
    }
    [[maybe_unused]] uint32_t s_slot = 0;
    if constexpr (FOLD) {
      s_slot = *reinterpret_cast<const uint32_t*>(sg);
      bad |= scales_out_of_range(s_slot) & live & 1u;
      if (i > 0) {
        wgmma_wait<0>();
        fold(cur, s_prev);
      }
    }
#pragma unroll
    for (int u = 0; u < KU; ++u) {
      const uint32_t words[4] = {wv[u].x, wv[u].y, wv[u].z, wv[u].w};
      uint32_t b[4][2];
      if constexpr (GROUPED && !FOLD) {
        bad |= scales_out_of_range(sgw[u]) & (live >> u);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t s = __byte_perm(sgw[u], 0, 0x4440 + j);
          dequant_group(words[j], s, (128u - 8u * s) * 0x01010101u, b[j][0], b[j][1]);
        }
      } else if constexpr (C::PROBE == 1) {
#pragma unroll
        for (int j = 0; j < 4; ++j) b[j][0] = b[j][1] = words[j];
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) dequant_channel(words[j], b[j][0], b[j][1]);
      }
      // The warp's 16 rows of the m64 A operand of wgmma h: n8 tiles 2h and
      // 2h + 1 of its stripe (rows g and g + 8; a0/a2 the even nibbles, a1/a3 the odd).
      uint32_t (&f)[2][4] = frag[u % C::FRAGS];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        f[h][0] = b[2 * h][0];
        f[h][1] = b[2 * h + 1][0];
        f[h][2] = b[2 * h][1];
        f[h][3] = b[2 * h + 1][1];
      }
      const uint64_t desc = swizzled_desc(a_slot + u * 32);
      if constexpr (C::PROBE == 2) {
        cur[u] += f[0][0] ^ f[0][1] ^ f[0][2] ^ f[0][3] ^ f[1][0] ^ f[1][1] ^ f[1][2] ^ f[1][3] ^ static_cast<uint32_t>(desc);
        continue;
      }
      wgmma_fence();
      if constexpr (FOLD) {
        WgmmaS8<C::BM>::mma_or_set(cur, f[0], desc, u > 0);
        WgmmaS8<C::BM>::mma_or_set(cur + C::BM / 2, f[1], desc, u > 0);
      } else {
        WgmmaS8<C::BM>::mma(cur, f[0], desc);
        WgmmaS8<C::BM>::mma(cur + C::BM / 2, f[1], desc);
      }
      wgmma_commit();
      // At most FRAGS - 1 units' wgmmas in flight: the set written next is
      // free, and those still running read this slot (FRAGS - 1 < KU).
      wgmma_wait<C::FRAGS - 1>();
    }
    if constexpr (FOLD) s_prev = s_slot;
    // Slot i - 1 is read completely: back to the producer. Every consumer
    // thread arrives (release), so that its own shared-memory reads of the
    // slot come before the producer's next copy into it; with one arrive per
    // warp (lane 0, even after __syncwarp) racecheck saw the next bulk copy of
    // group scales race with the other lanes' reads (2,560 WAR hazards).
    if (i > 0) mbar_arrive(empty + 8 * ((i - 1) % STAGES));
  };

  if constexpr (FOLD) {
    for (int i = 0; i < n_iters; ++i) run_slot(i, part);
    wgmma_wait<0>();
    if (n_iters > 0) fold(part, s_prev);
  } else {
    for (int i = 0; i < n_iters; ++i) run_slot(i, acc);
    wgmma_wait<0>();
    fence_regs(acc);
  }

  // --- the CTA's bad-scale flag, split-K, epilogue (consumers only: the
  // producer warpgroup has left, so named barriers count consumer threads) ---
  if constexpr (GROUPED) {
    if (bad) atomicOr(&s_bad, 1u);
    named_bar(1, kConsumerThreads);
    bad = s_bad;
  }
  if (p.splits > 1 && !meet_splits<C::ACC, GROUPED>(p, acc, bad, s_last, place.tile, place.split, true, ct,
                                                     kConsumerThreads, ct == 0,
                                                     [] { named_bar(1, kConsumerThreads); })) {
    return;
  }
  if (!stripe_ok) return;
  ws_epilogue<C, GROUPED>(p, acc, place.m0, place.n0 + wn * 32 + (lane / 4) * 4, bad);
#else
  (void)p;
  (void)tma_a;
  (void)tma_w;
  __trap();  // never launched without sm_90a code (launch checks sm90a_code_loaded)
#endif
}

// The tensor map of `a` [M, K] int8 for the producer: boxes of [BM rows x 128
// bytes] into 128-byte-swizzled shared memory; out-of-range rows and k read
// as zeros. False when the driver cannot encode it.
inline bool make_a_map(CUtensorMap* map, const int8_t* a, int64_t M, int64_t K, int box_rows) {
  const auto encode = sm90::tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(K), static_cast<cuuint64_t>(M)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(K)};
  const cuuint32_t box[2] = {128, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<int8_t*>(a), dims, strides, box, elem_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The tensor map of the packed weights for WTMA: one row of 8-byte elements
// per 32-column stripe (K / 32 units of 512 bytes), boxes of [stripes rows x
// 4 units], no swizzle (the consumers read 16 bytes a lane, as staged);
// stripes past N and units past K read as zeros.
inline bool make_w_map(CUtensorMap* map, const int32_t* w, int64_t N, int64_t K, int box_stripes) {
  const auto encode = sm90::tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(K / 32 * 64), static_cast<cuuint64_t>(N / 32)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(K / 32 * 512)};
  const cuuint32_t box[2] = {256, static_cast<cuuint32_t>(box_stripes)};
  const cuuint32_t elem_strides[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT64, 2, const_cast<int32_t*>(w), dims, strides, box, elem_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace
}  // namespace opforge::qqq
