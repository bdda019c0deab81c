#pragma once
// qqq_gemm at small M: the weights straight into registers, no stage ring;
// the configuration is qqq_mma.cuh's Config with DIRECT (and FOLD), the end
// its finish().

#include "qqq_mma.cuh"

namespace opforge::qqq {
namespace {

// At M <= 16 the MMAs are few and the kernel only has to stream the weights.
// Each warp owns one 32-column stripe and every WK-th k32 unit of the CTA's
// K range in it (warp wk takes units wk, wk + WK, ...: the CTA's reads of a
// stripe stay in one window); a lane's 16 bytes per unit are its B fragments
// (LAYOUT.md), loaded from global memory STAGES units ahead into registers,
// so no barrier ever waits on a weight. The activations of the CTA's K range
// (M rows, at most BM) are copied into shared memory once, at a row stride of
// 16 bytes past a multiple of 128 so that the 8 rows of an A fragment load
// fall in 8 different bank groups; rows past M are zero registers, not
// zero-filled copies. On the H200 this beats the staged kernel by 7-13 % at
// M = 1 per channel.
//
// FOLD (per group, group_size a multiple of 128): warp wk takes blocks of 4
// consecutive units instead (blocks wk, wk + WK, ...), each inside one group;
// the block's MMAs write partial sums (16 x the sum of q * a, as per channel)
// and its end adds (sum >> 4) * scale into the accumulators: the same integers
// as the conversion with the scales, so the same bits.
template <class C, bool GROUPED, bool FOLD = false>
__global__ void __launch_bounds__(kThreads, C::MINB) qqq_direct_kernel(const Params p) {
  static_assert(C::WM == 1, "one warp along M");
  static_assert(!FOLD || (GROUPED && C::FOLD && C::STAGES % C::kFoldUnits == 0), "a fold is per group, whole blocks ahead");
  constexpr int FU = C::kFoldUnits;
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int s_last;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int wn = warp % C::WN;
  const int wk = warp / C::WN;
  const int g = lane / 4, t = lane % 4;

  const Place place = place_of<C>(p);
  const int tile = place.tile, split = place.split, m0 = place.m0, n0 = place.n0;
  const int it_begin = place.it_begin, it_end = place.it_end;
  const int KB = p.K / 32;
  const int NB = p.N / 32;
  const int u_begin = min(it_begin * C::KU, KB);
  const int u_end = min(it_end * C::KU, KB);
  const int range = u_end - u_begin;
  const int rows = min(p.M - m0, C::BM);
  const int stripe = n0 / 32 + wn;
  const bool stripe_ok = stripe < NB;

  // The warp's units: first + i * WK, i in [0, count); FOLD: unit i is unit
  // i % 4 of block (i / 4) * WK + wk of the CTA's range. A folded range is
  // whole blocks: group_size (a multiple of 128) divides K (the op's check),
  // and a split's bounds are multiples of BK.
  static_assert(!FOLD || C::BK % (32 * FU) == 0, "splits of whole blocks");
  const int first = u_begin + wk * (FOLD ? FU : 1);
  const int items = FOLD ? range / FU : range;  // blocks or units, dealt round the WK warps
  const int count = stripe_ok && items > wk ? (items - wk + C::WK - 1) / C::WK * (FOLD ? FU : 1) : 0;
  // Offset (in units, from `first`) of the warp's unit i.
  auto uoff = [](int i) { return FOLD ? (i / FU) * C::WK * FU + i % FU : i * C::WK; };

  // The first STAGES units' weights (and group scales) are requested before
  // the activations, so that DRAM is busy from the start. No load is
  // predicated: a predicated load into buf[d] becomes a select whose move
  // waits for the load, and the prefetch turns into one DRAM round trip per
  // unit (3x slower on the H200). Loads past the warp's last unit read that
  // unit again.
  constexpr int D = C::STAGES;
  const uint8_t* wsrc =
      reinterpret_cast<const uint8_t*>(p.w) + ((static_cast<int64_t>(stripe) * KB + first) * 32 + lane) * 16;
  // Per group in the conversion: the 4 columns of the lane's B fragments
  // (g * 4 + tile); folded: the 8 of its accumulators (t * 8 + e * 4 + tile).
  const int8_t* gsrc = GROUPED ? p.s_group + stripe * 32 + (FOLD ? t * 8 : g * 4) : nullptr;
  auto load_scales = [&](int i) {
    const int u = first + uoff(i);
    return __ldg(reinterpret_cast<const uint32_t*>(gsrc + static_cast<int64_t>(u * 32 / p.group_size) * p.N));
  };
  auto load_fold_scales = [&](int i) {
    const int u = first + uoff(i);
    return __ldg(reinterpret_cast<const uint2*>(gsrc + static_cast<int64_t>(u * 32 / p.group_size) * p.N));
  };
  uint4 buf[D];
  uint32_t sbuf[FOLD ? 1 : D] = {};
  uint2 fbuf[FOLD ? D / FU : 1] = {};  // the scales of the blocks in buf
  if (count > 0) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      const int i = d < count ? d : count - 1;
      buf[d] = ldg_stream(wsrc + uoff(i) * 512);
      if constexpr (FOLD) {
        if (d % FU == 0) fbuf[d / FU] = load_fold_scales(i);
      } else if constexpr (GROUPED) {
        sbuf[d] = load_scales(i);
      }
    }
  }

  const int row_chunks = range * 2;  // 16-byte chunks per activation row
  for (int c = threadIdx.x; c < rows * row_chunks; c += kThreads) {
    const int r = c / row_chunks, cc = c % row_chunks;
    cp_async16(smem + r * p.a_stride + cc * 16, p.a + static_cast<int64_t>(m0 + r) * p.K + u_begin * 32 + cc * 16, true);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  int32_t acc[C::MBW][4][4];
#pragma unroll
  for (int mb = 0; mb < C::MBW; ++mb)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mb][j][e] = 0;
  uint32_t bad = 0;

  // Row offsets of this lane's A fragments, or -1 past M (a zero register).
  int a_off[C::MBW][2];
#pragma unroll
  for (int mb = 0; mb < C::MBW; ++mb)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = mb * 16 + h * 8 + g;
      a_off[mb][h] = r < rows ? r * p.a_stride + t * 4 : -1;
    }

  // FOLD: the current block's partial sums; its rows 8-15 are only folded
  // when they exist.
  [[maybe_unused]] int32_t part[FOLD ? C::MBW : 1][4][4];
  auto fold = [&](uint2 s8) {
    bad |= scales_out_of_range(s8.x) | scales_out_of_range(s8.y);
#pragma unroll
    for (int mb = 0; mb < C::MBW; ++mb)
#pragma unroll
      for (int e4 = 0; e4 < 4; ++e4) {
        if (e4 >= 2 && rows <= mb * 16 + 8) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int32_t sc = static_cast<int32_t>(((e4 % 2 ? s8.y : s8.x) >> (8 * j)) & 0xFFu);
          acc[mb][j][e4] += (part[mb][j][e4] >> 4) * sc;
        }
      }
  };

  auto compute = [&](const uint4& wv, uint32_t sg, int i, bool block_start) {
    (void)block_start;
    const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
    uint32_t b[4][2];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (GROUPED && !FOLD) {
        const uint32_t s = (sg >> (8 * j)) & 0xFFu;
        bad |= (s - 1u) > 15u;
        dequant_group(words[j], s, (128u - 8u * s) * 0x01010101u, b[j][0], b[j][1]);
      } else {
        dequant_channel(words[j], b[j][0], b[j][1]);
      }
    }
    const uint8_t* sA = smem + (first - u_begin + uoff(i)) * 32;
#pragma unroll
    for (int mb = 0; mb < C::MBW; ++mb) {
      uint32_t af[4];
      af[0] = a_off[mb][0] >= 0 ? lds32(sA + a_off[mb][0]) : 0u;
      af[1] = a_off[mb][1] >= 0 ? lds32(sA + a_off[mb][1]) : 0u;
      af[2] = a_off[mb][0] >= 0 ? lds32(sA + a_off[mb][0] + 16) : 0u;
      af[3] = a_off[mb][1] >= 0 ? lds32(sA + a_off[mb][1] + 16) : 0u;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if constexpr (FOLD) {
          if (block_start) {
            mma_s8_set(part[mb][j], af, b[j][0], b[j][1]);
          } else {
            mma_s8(part[mb][j], af, b[j][0], b[j][1]);
          }
        } else {
          mma_s8(acc[mb][j], af, b[j][0], b[j][1]);
        }
      }
    }
  };

  // Blocks of D units whose next D loads all lie within the warp's units
  // (addresses at fixed offsets from one pointer), then the last block or
  // two with clamped loads and a test per unit.
  // (i0 stays a multiple of D, so unit i0 + d starts a block exactly when d % 4 == 0.)
  int i0 = 0;
  [[maybe_unused]] uint2 s_block = make_uint2(0, 0);
  for (; i0 + 2 * D <= count; i0 += D) {
    const uint8_t* next = wsrc + uoff(i0 + D) * 512;
#pragma unroll
    for (int d = 0; d < D; ++d) {
      const uint4 wv = buf[d];
      const uint32_t sg = sbuf[FOLD ? 0 : d];
      buf[d] = ldg_stream(next + uoff(d) * 512);
      if constexpr (FOLD) {
        if (d % FU == 0) {
          s_block = fbuf[d / FU];
          fbuf[d / FU] = load_fold_scales(i0 + D + d);
        }
      } else if constexpr (GROUPED) {
        sbuf[d] = load_scales(i0 + D + d);
      }
      compute(wv, sg, i0 + d, d % FU == 0);
      if constexpr (FOLD) {
        if (d % FU == FU - 1) fold(s_block);
      }
    }
  }
  for (; i0 < count; i0 += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      const int i = i0 + d;
      const uint4 wv = buf[d];
      const uint32_t sg = sbuf[FOLD ? 0 : d];
      const int ni = i + D < count ? i + D : count - 1;
      buf[d] = ldg_stream(wsrc + uoff(ni) * 512);
      if constexpr (FOLD) {
        if (d % FU == 0) {
          s_block = fbuf[d / FU];
          fbuf[d / FU] = load_fold_scales(ni);
        }
      } else if constexpr (GROUPED) {
        sbuf[d] = load_scales(ni);
      }
      if (i < count) {
        compute(wv, sg, i, d % FU == 0);
        if constexpr (FOLD) {
          if (d % FU == FU - 1) fold(s_block);
        }
      }
    }
  }
  if constexpr (GROUPED) {
    bad = __syncthreads_or(bad);
  } else {
    __syncthreads();
  }
  finish<C, GROUPED>(p, acc, bad, smem, s_last, tile, split, m0, n0, 0, wn, wk, lane, stripe_ok);
}

}  // namespace
}  // namespace opforge::qqq
