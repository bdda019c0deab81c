#pragma once
// The W4A8 GEMM's mma.sync tiles as templates over their configuration (the
// tuning driver, benchmarks/qqq_tune.cu, instantiates variants): the path on
// every GPU without sm_90a code, and at small M the direct kernel's
// configuration (qqq_direct.cuh).
//
// One CTA = 8 warps computes a BM x BN tile of the output over a contiguous
// range of K (its split), streaming the packed weights, the int8 activations
// and (per group) the group scales through a STAGES-deep cp.async pipeline in
// shared memory. Warp (wm, wn, wk) owns MBW m16 blocks x one 32-column stripe
// and UK of the stage's k32 units; its B fragments are one 16-byte shared load
// per unit (LAYOUT.md), converted INT4 -> INT8 in registers, A fragments come
// from ldmatrix, and mma.sync m16n8k32 s8 accumulates in int32. The warps of
// one (wm, wn) that split K add up through shared memory; the CTAs that split
// K (split-K, sized from the SM count) leave int32 partial tiles in a
// workspace, and the last one to arrive (an atomic counter per tile) adds them
// and runs the epilogue. Integer sums are exact, so the order of arrival
// cannot change a bit of the result.

#include "qqq_common.cuh"

namespace opforge::qqq {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

template <int MBW_, int WM_, int WN_, int WK_, int UK_, int STAGES_, int MINB_ = 2, bool DIRECT_ = false,
          bool FOLD_ = false>
struct Config {
  static constexpr int MBW = MBW_;        // m16 blocks per warp
  static constexpr int WM = WM_;          // warps along M
  static constexpr int WN = WN_;          // warps along N (one 32-column stripe each)
  static constexpr int WK = WK_;          // warps along K (reduced through shared memory)
  static constexpr int UK = UK_;          // k32 units per warp per stage
  static constexpr int STAGES = STAGES_;  // cp.async pipeline depth
  static constexpr int MINB = MINB_;      // CTAs per SM the registers must allow
  // DIRECT: qqq_direct_kernel (weights from global memory straight into
  // registers, STAGES units ahead; the activations of the CTA's K range in
  // shared memory, loaded once) instead of the cp.async stage pipeline.
  static constexpr bool DIRECT = DIRECT_;
  // FOLD (direct kernel only): per group, when every group spans whole blocks
  // of 4 units (group_size a multiple of 128), each warp takes its units in
  // such blocks, converts them as per channel into partial sums and adds
  // scale * sum once per block, instead of scaling every weight byte.
  static constexpr bool FOLD = FOLD_;
  static_assert(!FOLD || DIRECT, "the staged tiles apply the group scales in the conversion");
  static constexpr int kFoldUnits = 4;
  static constexpr bool folds(int64_t group_size) {
    return FOLD && group_size > 0 && group_size % (32 * kFoldUnits) == 0;
  }
  static constexpr bool WS = false;  // qqq_ws_kernel's configurations are WsConfig
  static constexpr int THREADS = kThreads;
  static_assert(WM * WN * WK == kWarps, "8 warps per CTA");
  static constexpr int BM = 16 * MBW * WM;
  static constexpr int BN = 32 * WN;
  static constexpr int BK = 32 * WK * UK;
  static constexpr int KU = BK / 32;  // k32 units per stage
  static_assert(BK >= 128, "the A swizzle permutes 8 chunks of 16 bytes per row");
  static constexpr int B_STAGE = BN * BK / 2;
  static constexpr int A_STAGE = BM * BK;
  static constexpr int G_STAGE = KU * BN;  // one row of group scales per k32 unit
  static constexpr int STAGE = B_STAGE + A_STAGE + G_STAGE;
  static constexpr int ACC = MBW * 4 * 4;  // int32 accumulators per thread
  static constexpr int RED = (WK - 1) * WM * WN * ACC * 32 * 4;
  static constexpr int SMEM = STAGE * STAGES > RED ? STAGE * STAGES : RED;
};

// What every kernel does after its main loop: the warps that split K inside
// the CTA add up through shared memory (after a barrier, which the caller has
// passed), the CTAs that split K meet in the workspace (the last to arrive adds
// the others' partials), and warps wk == 0 write the output.
template <class C, bool GROUPED>
__device__ __forceinline__ void finish(const Params& p, int32_t (&acc)[C::MBW][4][4], uint32_t bad, uint8_t* smem,
                                       int& s_last, int tile, int split, int m0, int n0, int wm, int wn, int wk,
                                       int lane, bool stripe_ok) {
  const int wmn = wm * C::WN + wn;
  int32_t* flat = &acc[0][0][0];
  if constexpr (C::WK > 1) {
    int32_t* red = reinterpret_cast<int32_t*>(smem);
    if (wk > 0) {
#pragma unroll
      for (int r = 0; r < C::ACC; ++r) red[(((wk - 1) * C::WM * C::WN + wmn) * C::ACC + r) * 32 + lane] = flat[r];
    }
    __syncthreads();
    if (wk == 0) {
#pragma unroll
      for (int w2 = 1; w2 < C::WK; ++w2)
#pragma unroll
        for (int r = 0; r < C::ACC; ++r) flat[r] += red[(((w2 - 1) * C::WM * C::WN + wmn) * C::ACC + r) * 32 + lane];
    }
  }

  // Warps wk == 0 hold the CTA's sums.
  if (p.splits > 1 && !meet_splits<C::ACC, GROUPED>(p, flat, bad, s_last, tile, split, wk == 0, wmn * 32 + lane,
                                                     C::WM * C::WN * 32, threadIdx.x == 0, [] { __syncthreads(); })) {
    return;
  }

  // --- epilogue: out = cvt(((float)acc * s_tok[m]) * s_ch[n]), as the CPU kernel ---
  if (wk != 0 || !stripe_ok) return;
  const int col0 = n0 + wn * 32 + (lane % 4) * 8;  // 8 consecutive columns per row (LAYOUT.md)
  const float4 sc0 = __ldg(reinterpret_cast<const float4*>(p.s_ch + col0));
  const float4 sc1 = __ldg(reinterpret_cast<const float4*>(p.s_ch + col0 + 4));
  const float sc[8] = {sc0.x, sc0.y, sc0.z, sc0.w, sc1.x, sc1.y, sc1.z, sc1.w};
#pragma unroll
  for (int mb = 0; mb < C::MBW; ++mb) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = m0 + (wm * C::MBW + mb) * 16 + lane / 4 + half * 8;
      if (row >= p.M) continue;
      const float st = __ldg(p.s_tok + row);
      float o[8];
#pragma unroll
      for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          int32_t v = acc[mb][j][half * 2 + e];
          if constexpr (!GROUPED) v >>= 4;  // the MMA summed 16 * q: exact
          o[e * 4 + j] = (static_cast<float>(v) * st) * sc[e * 4 + j];
        }
      if (bad) {
#pragma unroll
        for (int x = 0; x < 8; ++x) o[x] = __int_as_float(0x7fffffff);
      }
      store_row(p, static_cast<int64_t>(row) * p.N + col0, o);
    }
  }
}

template <class C, bool GROUPED>
__global__ void __launch_bounds__(kThreads, C::MINB) qqq_gemm_kernel(const Params p) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int s_last;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int wn = warp % C::WN;
  const int wm = (warp / C::WN) % C::WM;
  const int wk = warp / (C::WN * C::WM);

  const Place place = place_of<C>(p);
  const int tile = place.tile, split = place.split, m0 = place.m0, n0 = place.n0;
  const int it_begin = place.it_begin, it_end = place.it_end;
  const int n_iters = it_end - it_begin;
  const int KB = p.K / 32;
  const int NB = p.N / 32;

  auto load_stage = [&](int slot, int it) {
    uint8_t* sB = smem + slot * C::STAGE;
    uint8_t* sA = sB + C::B_STAGE;
    uint8_t* sG = sA + C::A_STAGE;
    const int kb0 = it * C::KU;
#pragma unroll
    for (int i = 0; i < (C::B_STAGE / 16 + kThreads - 1) / kThreads; ++i) {
      const int c = i * kThreads + threadIdx.x;
      if (C::B_STAGE / 16 % kThreads != 0 && c >= C::B_STAGE / 16) break;
      const int s = c / (C::KU * 32);
      const int u = (c / 32) % C::KU;
      const int nb = n0 / 32 + s;
      const int kb = kb0 + u;
      const bool ok = nb < NB && kb < KB;
      const uint8_t* src = reinterpret_cast<const uint8_t*>(p.w);
      if (ok) src += ((static_cast<int64_t>(nb) * KB + kb) * 32 + c % 32) * 16;
      cp_async16(sB + c * 16, src, ok);
    }
#pragma unroll
    for (int i = 0; i < (C::A_STAGE / 16 + kThreads - 1) / kThreads; ++i) {
      const int c = i * kThreads + threadIdx.x;
      if (C::A_STAGE / 16 % kThreads != 0 && c >= C::A_STAGE / 16) break;
      const int r = c / (C::BK / 16);
      const int cc = c % (C::BK / 16);
      const int m = m0 + r;
      const int k = kb0 * 32 + cc * 16;
      const bool ok = m < p.M && k < p.K;
      const int8_t* src = ok ? p.a + static_cast<int64_t>(m) * p.K + k : p.a;
      // 16-byte chunk cc of row r goes to chunk cc ^ (r % 8): ldmatrix's 8
      // rows then hit 8 different bank groups.
      cp_async16(sA + r * C::BK + ((cc ^ (r & 7)) * 16), src, ok);
    }
    if constexpr (GROUPED) {
#pragma unroll
      for (int i = 0; i < (C::G_STAGE / 16 + kThreads - 1) / kThreads; ++i) {
        const int c = i * kThreads + threadIdx.x;
        if (C::G_STAGE / 16 % kThreads != 0 && c >= C::G_STAGE / 16) break;
        const int u = c / (C::BN / 16);
        const int n = n0 + (c % (C::BN / 16)) * 16;
        const int kb = kb0 + u;
        const bool ok = kb < KB && n < p.N;
        const int8_t* src = ok ? p.s_group + static_cast<int64_t>(kb * 32 / p.group_size) * p.N + n : p.s_group;
        cp_async16(sG + u * C::BN + (c % (C::BN / 16)) * 16, src, ok);
      }
    }
  };

  int32_t acc[C::MBW][4][4];
#pragma unroll
  for (int mb = 0; mb < C::MBW; ++mb)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mb][j][e] = 0;
  uint32_t bad = 0;
  const bool stripe_ok = n0 / 32 + wn < NB;

  // A group scale word (4 columns) -> the 4 scales and their multiply-add
  // constants; a scale outside [1, 16] of a real unit (not zero-fill) marks the tile bad.
  uint32_t gs_s[4] = {0, 0, 0, 0}, gs_c[4] = {0, 0, 0, 0};
  auto group_scales = [&](const uint8_t* sG, int ku, int it) {
    const uint32_t sg = *reinterpret_cast<const uint32_t*>(sG + ku * C::BN + wn * 32 + (lane / 4) * 4);
    const bool valid = stripe_ok && it * C::KU + ku < KB;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      gs_s[j] = (sg >> (8 * j)) & 0xFFu;
      if (valid) bad |= (gs_s[j] - 1u) > 15u;
      gs_c[j] = (128u - 8u * gs_s[j]) * 0x01010101u;
    }
  };
  // The warp's UK units of a stage start at a multiple of UK: when the group
  // size is a multiple of UK * 32 they share one group, and the scales are
  // read and unpacked once per stage instead of once per unit.
  const bool one_group_per_stage = GROUPED && p.group_size % (C::UK * 32) == 0;

  auto compute_stage = [&](int slot, int it) {
    const uint8_t* sB = smem + slot * C::STAGE;
    const uint8_t* sA = sB + C::B_STAGE;
    const uint8_t* sG = sA + C::A_STAGE;
    if constexpr (GROUPED) {
      if (one_group_per_stage) group_scales(sG, wk * C::UK, it);
    }
#pragma unroll
    for (int u = 0; u < C::UK; ++u) {
      const int ku = wk * C::UK + u;
      const uint4 wv = *reinterpret_cast<const uint4*>(sB + ((wn * C::KU + ku) * 32 + lane) * 16);
      const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
      uint32_t b[4][2];
      if constexpr (GROUPED) {
        if (!one_group_per_stage) group_scales(sG, ku, it);
#pragma unroll
        for (int j = 0; j < 4; ++j) dequant_group(words[j], gs_s[j], gs_c[j], b[j][0], b[j][1]);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) dequant_channel(words[j], b[j][0], b[j][1]);
      }
#pragma unroll
      for (int mb = 0; mb < C::MBW; ++mb) {
        const int r = (wm * C::MBW + mb) * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
        const int cc = ku * 2 + lane / 16;
        uint32_t af[4];
        ldmatrix_x4(af, sA + r * C::BK + ((cc ^ (r & 7)) * 16));
#pragma unroll
        for (int j = 0; j < 4; ++j) mma_s8(acc[mb][j], af, b[j][0], b[j][1]);
      }
    }
  };

  // --- the pipeline: STAGES - 1 stages in flight while one is computed ---
#pragma unroll
  for (int s = 0; s < C::STAGES - 1; ++s) {
    if (s < n_iters) load_stage(s, it_begin + s);
    cp_async_commit();
  }
  for (int i = 0; i < n_iters; ++i) {
    cp_async_wait<C::STAGES - 2>();
    // Stage i has landed for every thread, and every warp is done with the
    // slot of stage i - 1, which the next load overwrites.
    __syncthreads();
    const int next = i + C::STAGES - 1;
    if (next < n_iters) load_stage(next % C::STAGES, it_begin + next);
    cp_async_commit();
    compute_stage(i % C::STAGES, it_begin + i);
  }
  cp_async_wait<0>();
  if constexpr (GROUPED) {
    bad = __syncthreads_or(bad);
  } else {
    __syncthreads();
  }

  finish<C, GROUPED>(p, acc, bad, smem, s_last, tile, split, m0, n0, wm, wn, wk, lane, stripe_ok);
}

}  // namespace
}  // namespace opforge::qqq
