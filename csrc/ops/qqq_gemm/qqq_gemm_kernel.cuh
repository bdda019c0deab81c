#pragma once
// The W4A8 GEMM kernel as templates over its tile configuration, so that the
// tuning driver (benchmarks/qqq_tune.cu) can instantiate variants; the op's
// launcher (qqq_gemm_kernel.cu) picks one per M. Pure CUDA, no torch headers.
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
// cannot change a bit of the result. At small M (per channel, and per group
// when the group scales fold) a second kernel, qqq_direct_kernel, loads the
// weights straight into registers instead of staging them; both end in
// finish(). On sm_90a a third, qqq_ws_kernel.cuh, takes over from M = 8.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "opforge/cuda_utils.cuh"
#include "opforge/dtype.h"
#include "qqq_gemm_kernel.h"

// Everything here has internal linkage (the anonymous namespace): a second
// library built from these sources (examples/qqq_gemm's extension) must not
// share a symbol with opforge's (cuda::allow_smem says what went wrong on the
// H200 when one did).
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

struct Params {
  const int8_t* a;
  const int32_t* w;
  const float* s_tok;
  const float* s_ch;
  const int8_t* s_group;
  void* out;
  int M, N, K, group_size;
  DType out_dtype;
  int tiles_m, tiles_n, splits, k_iters;
  int a_stride;       // qqq_direct_kernel: bytes per activation row in shared memory
  int32_t* counters;  // [tiles_m * tiles_n], zero on entry, zero again on exit
  int32_t* flags;     // [tiles * splits]: a bad group scale seen by that split
  int32_t* partials;  // [tiles][splits][WM * WN][ACC][32]
};

// --- PTX wrappers ---

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  // src-size 0 reads nothing and fills the 16 bytes with zeros: rows past M,
  // units past K and stripes past N contribute exact zeros.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(pred ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

__device__ __forceinline__ void mma_s8(int32_t (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d = a b (a zero C): the first unit of a folded block.
__device__ __forceinline__ void mma_s8_set(int32_t (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %10, %10, %10};\n"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
}

// --- INT4 -> INT8 (LAYOUT.md) ---

// Per channel: 16 * q in each byte; b0 from the even nibbles, b1 from the odd.
__device__ __forceinline__ void dequant_channel(uint32_t w, uint32_t& b0, uint32_t& b1) {
  b0 = (w << 4) & 0xF0F0F0F0u;
  b1 = w & 0xF0F0F0F0u;
}

// 1 when a byte of `w` (four group scales) lies outside [1, 16], else 0: no
// byte of (w - 1 per byte) reaches 16 exactly when all are in range (a zero
// byte borrows and turns 0xFF, a large one keeps its high nibble).
__device__ __forceinline__ uint32_t scales_out_of_range(uint32_t w) {
  return static_cast<uint32_t>(((w - 0x01010101u) & 0xF0F0F0F0u) != 0);
}

// Per group: q * s in each byte, s in [1, 16]; `c` = (128 - 8 s) * 0x01010101.
// (q + 8) * s + 128 - 8 s = q s + 128 lies in [0, 240]: no carry between bytes.
__device__ __forceinline__ void dequant_group(uint32_t w, uint32_t s, uint32_t c, uint32_t& b0, uint32_t& b1) {
  b0 = (((w ^ 0x88888888u) & 0x0F0F0F0Fu) * s + c) ^ 0x80808080u;
  b1 = ((((w >> 4) ^ 0x08080808u) & 0x0F0F0F0Fu) * s + c) ^ 0x80808080u;
}

// --- the kernel ---

// Two floats rounded to a 16-bit pair, as one 32-bit word.
__device__ __forceinline__ uint32_t pack2(__half, float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t pack2(__nv_bfloat16, float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// W (4 or 8) consecutive outputs at out[off], rounded to the output dtype:
// one 8- or 16-byte store of a 16-bit type, one or two float4 of float32.
template <int W>
__device__ __forceinline__ void store_row(const Params& p, int64_t off, const float (&o)[W]) {
  static_assert(W == 4 || W == 8, "whole float4s, 16-bit pairs");
  uint32_t v[W / 2];
  if (p.out_dtype == DType::Float32) {
#pragma unroll
    for (int x = 0; x < W / 4; ++x)
      reinterpret_cast<float4*>(static_cast<float*>(p.out) + off)[x] =
          make_float4(o[4 * x], o[4 * x + 1], o[4 * x + 2], o[4 * x + 3]);
    return;
  }
#pragma unroll
  for (int x = 0; x < W / 2; ++x)
    v[x] = p.out_dtype == DType::Float16 ? pack2(__half{}, o[2 * x], o[2 * x + 1])
                                          : pack2(__nv_bfloat16{}, o[2 * x], o[2 * x + 1]);
  // Either 16-bit type: the same byte offset.
  uint16_t* dst = static_cast<uint16_t*>(p.out) + off;
  if constexpr (W == 8) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(v[0], v[1], v[2], v[3]);
  } else {
    *reinterpret_cast<uint2*>(dst) = make_uint2(v[0], v[1]);
  }
}

// The CTAs that split a tile's K meet in the workspace: each publishes its
// partial sums (R values per thread that holds them, `holder`; value r of
// thread `who` at r * `threads` + who) and its bad-scale flag, and the last
// to arrive (an atomic counter per tile) adds the others' into `flat` and
// returns true: it runs the epilogue. Integer sums: the order of arrival
// cannot change a bit. `sync` is the barrier of the CTA's participating
// threads, `leader` one of them.
template <int R, bool GROUPED, class Sync>
__device__ __forceinline__ bool meet_splits(const Params& p, int32_t* flat, uint32_t& bad, int& s_last, int tile,
                                            int split, bool holder, int who, int threads, bool leader, Sync sync) {
  const int64_t tile_ints = int64_t{R} * threads;
  int32_t* mine = p.partials + (static_cast<int64_t>(tile) * p.splits + split) * tile_ints;
  if (holder) {
#pragma unroll
    for (int r = 0; r < R; ++r) __stcg(mine + r * threads + who, flat[r]);
  }
  if (leader) p.flags[tile * p.splits + split] = static_cast<int32_t>(bad);
  // The classic last-block pattern: publish the partial, then count arrivals.
  __threadfence();
  sync();
  if (leader) s_last = atomicAdd(p.counters + tile, 1) == p.splits - 1;
  sync();
  if (!s_last) return false;
  __threadfence();
  if (leader) p.counters[tile] = 0;  // as found, for the next call
  for (int s = 0; s < p.splits; ++s) {
    if (s == split) continue;
    if constexpr (GROUPED) bad |= static_cast<uint32_t>(__ldcg(p.flags + tile * p.splits + s));
    if (holder) {
      const int32_t* other = p.partials + (static_cast<int64_t>(tile) * p.splits + s) * tile_ints;
#pragma unroll
      for (int r = 0; r < R; ++r) flat[r] += __ldcg(other + r * threads + who);
    }
  }
  return true;
}

// Which output tile and which split of K a CTA computes: m fastest, so that
// CTAs reading the same weights run side by side and share them in L2.
struct Place {
  int tile, split, m0, n0, it_begin, it_end;
};
template <class C>
__device__ __forceinline__ Place place_of(const Params& p) {
  int bid = blockIdx.x;
  const int tm = bid % p.tiles_m;
  bid /= p.tiles_m;
  const int tn = bid % p.tiles_n;
  const int split = bid / p.tiles_n;
  return Place{tn * p.tiles_m + tm,
               split,
               tm * C::BM,
               tn * C::BN,
               static_cast<int>(static_cast<int64_t>(split) * p.k_iters / p.splits),
               static_cast<int>(static_cast<int64_t>(split + 1) * p.k_iters / p.splits)};
}

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

// --- small M: the weights straight into registers ---

// A 16-byte load that bypasses L1 (each weight is read once).
__device__ __forceinline__ uint4 ldg_stream(const void* gmem) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(gmem));
  return v;
}
__device__ __forceinline__ uint32_t lds32(const uint8_t* smem) { return *reinterpret_cast<const uint32_t*>(smem); }

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
// M = 1 per channel (benchmarks/results/qqq-direct_...).
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

// The warp-specialised wgmma kernel (sm_90a) for larger M.
#include "qqq_ws_kernel.cuh"

namespace opforge::qqq {
namespace {

// --- the host side: a plan per call, then the launch ---

struct Plan {
  int tiles_m = 0, tiles_n = 0, splits = 1, k_iters = 0;
  int smem = 0, a_stride = 0;  // dynamic shared memory; qqq_direct_kernel's activation row stride
  int64_t counters_bytes = 0, flags_bytes = 0, partials_bytes = 0;
  int64_t workspace_bytes() const { return counters_bytes + flags_bytes + partials_bytes; }
};

inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

// Splits of K per output tile, and the plan's modelled cost. The model is
// bandwidth-first: per SM, (CTAs it runs) x (weight bytes each streams + a
// fixed kFixedBytes for the pipeline's fill and the epilogue), plus
// kSplitBytes when K is split (the counters' memset node and the partial
// sums' round trip). Constants from benchmarks/qqq_tune.cu on an H200
// (benchmarks/results/qqq-tune_nvidia-h200_2026-11-23.txt): the fill is
// worth about two 16 KB stages and a split about three (S = 1 at 86 CTAs
// ran 15.2 us, S = 3 at 258 CTAs 17.7 us, for K = 4096, N = 11008, M = 1).
// `force_splits` > 0 overrides (the tuning driver). Ties go to the fewer
// splits, or with `prefer_more_ctas` (compute-heavier large M) to the more.
constexpr int64_t kFixedBytes = 2 * 16384;
constexpr int64_t kSplitBytes = 3 * 16384;
// qqq_direct_kernel's activations (rows x the CTA's K range) stay under
// sm_80's 163 KB opt-in; a longer K range is split.
constexpr int kDirectSmem = 160 * 1024;

// Shared memory of a plan: the stage ring, or the direct kernel's activation
// rows at a stride of 16 bytes past a multiple of 128; at least the
// reduction's room. Sets plan.smem and plan.a_stride.
template <class C>
void size_smem(Plan& plan, int64_t M, int64_t K) {
  if constexpr (C::DIRECT) {
    const int64_t iters = (plan.k_iters + plan.splits - 1) / plan.splits;
    const int64_t bytes = std::min<int64_t>(iters * C::BK, K);
    plan.a_stride = static_cast<int>((bytes + 127) / 128 * 128 + 16);
    const int64_t rows = std::min<int64_t>(M, C::BM);
    const int64_t need = rows * plan.a_stride;
    plan.smem = static_cast<int>(need > C::RED ? need : C::RED);
  } else {
    plan.a_stride = 0;
    plan.smem = C::SMEM;
  }
}

template <class C>
Plan make_plan(int64_t M, int64_t N, int64_t K, int sms, int force_splits = 0, int64_t* cost_out = nullptr,
               bool prefer_more_ctas = false) {
  Plan plan;
  plan.tiles_m = static_cast<int>((M + C::BM - 1) / C::BM);
  plan.tiles_n = static_cast<int>((N + C::BN - 1) / C::BN);
  plan.k_iters = static_cast<int>((K + C::BK - 1) / C::BK);
  const int64_t tiles = static_cast<int64_t>(plan.tiles_m) * plan.tiles_n;
  // CTAs that run at once: the wgmma kernel's configurations state theirs
  // (MINB); the others were tuned with the model as it stands, one per SM.
  const int64_t slots = C::WS ? int64_t{sms} * C::MINB : sms;
  auto cost = [&](int s) {
    const int64_t per_sm = (tiles * s + slots - 1) / slots;
    return per_sm * ((plan.k_iters + s - 1) / s * int64_t{C::B_STAGE} + kFixedBytes) + (s > 1 ? kSplitBytes : 0);
  };
  auto fits = [&](int s) {
    Plan q = plan;
    q.splits = s;
    size_smem<C>(q, M, K);
    return q.smem <= kDirectSmem || !C::DIRECT;
  };
  int fewest = 1;  // the fewest splits whose shared memory fits
  while (!fits(fewest) && fewest < plan.k_iters) ++fewest;
  int best = fewest;
  if (force_splits > 0) {
    best = force_splits > fewest ? force_splits : fewest;
  } else if (plan.k_iters > 1 && tiles < 4 * slots) {
    int64_t best_cost = cost(best);
    const int max_splits = plan.k_iters < 64 ? plan.k_iters : 64;
    for (int s = fewest + 1; s <= max_splits; ++s) {
      const int64_t c = cost(s);
      if (c < best_cost || (prefer_more_ctas && c == best_cost)) best_cost = c, best = s;
    }
  }
  plan.splits = best < 1 ? 1 : (best > plan.k_iters && plan.k_iters > 0 ? plan.k_iters : best);
  size_smem<C>(plan, M, K);
  if (cost_out != nullptr) *cost_out = cost(plan.splits);
  if (plan.splits > 1) {
    plan.counters_bytes = round16(tiles * 4);
    plan.flags_bytes = round16(tiles * plan.splits * 4);
    plan.partials_bytes = tiles * plan.splits * C::BM * C::BN * 4;
  }
  return plan;
}

template <class C, bool GROUPED, bool FOLD = false>
constexpr auto kernel_of() {
  if constexpr (C::DIRECT) {
    return qqq_direct_kernel<C, GROUPED, FOLD>;
  } else {
    return qqq_gemm_kernel<C, GROUPED>;
  }
}

// The mma.sync kernels' launch (staged or direct): their shared memory.
template <class C, bool GROUPED, bool FOLD>
const char* launch_tiles(const Params& p, const Plan& plan, int64_t blocks, cudaStream_t s) {
  constexpr auto kernel = kernel_of<C, GROUPED, FOLD>();
  if (const char* e = cuda::allow_smem<kernel>(plan.smem)) return e;
  kernel<<<static_cast<unsigned>(blocks), C::THREADS, plan.smem, s>>>(p);
  return cuda::error_string(cudaGetLastError());
}

// The wgmma kernel's launch: its shared memory, the tensor maps.
template <class C, bool GROUPED, bool FOLD>
const char* launch_ws(const Params& p, const Plan& plan, int64_t blocks, cudaStream_t s) {
  if (!sm90::sm90a_code_loaded()) return "opforge::qqq_gemm: the wgmma kernel needs a 9.0 GPU and sm_90a code";
  constexpr auto kernel = qqq_ws_kernel<C, GROUPED, FOLD>;
  if (const char* e = cuda::allow_smem<kernel>(plan.smem)) return e;
  CUtensorMap map_a, map_w;
  std::memset(&map_a, 0, sizeof map_a);  // K = 0: no load is issued
  std::memset(&map_w, 0, sizeof map_w);
  if (p.K > 0 && (!make_a_map(&map_a, p.a, p.M, p.K, C::BM) ||
                  (C::WTMA && !make_w_map(&map_w, p.w, p.N, p.K, C::BN / 32)))) {
    return "opforge::qqq_gemm: cuTensorMapEncodeTiled failed";
  }
  kernel<<<static_cast<unsigned>(blocks), C::THREADS, plan.smem, s>>>(p, map_a, map_w);
  return cuda::error_string(cudaGetLastError());
}

template <class C, bool GROUPED>
const char* launch(const QqqGemmArgs& args, const Plan& plan, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  Params p;
  p.a = args.a;
  p.w = args.w;
  p.s_tok = args.s_tok;
  p.s_ch = args.s_ch;
  p.s_group = args.s_group;
  p.out = args.out;
  p.M = static_cast<int>(args.M);
  p.N = static_cast<int>(args.N);
  p.K = static_cast<int>(args.K);
  p.group_size = static_cast<int>(args.group_size);
  p.out_dtype = args.out_dtype;
  p.tiles_m = plan.tiles_m;
  p.tiles_n = plan.tiles_n;
  p.splits = plan.splits;
  p.k_iters = plan.k_iters;
  p.a_stride = plan.a_stride;
  auto* ws = static_cast<uint8_t*>(args.workspace);
  p.counters = reinterpret_cast<int32_t*>(ws);
  p.flags = reinterpret_cast<int32_t*>(ws + plan.counters_bytes);
  p.partials = reinterpret_cast<int32_t*>(ws + plan.counters_bytes + plan.flags_bytes);
  const int64_t blocks = static_cast<int64_t>(plan.tiles_m) * plan.tiles_n * plan.splits;
  if (blocks == 0) return nullptr;
  if (blocks > 0x7fffffff) return "opforge::qqq_gemm: too many output tiles for one grid";
  if (plan.splits > 1) {
    if (const char* e = cuda::error_string(cudaMemsetAsync(p.counters, 0, plan.counters_bytes, s))) return e;
  }
  if constexpr (C::WS) {
    // Group scales once per slot when every group spans whole slots.
    if constexpr (GROUPED && C::FOLD) {
      if (C::folds(p.group_size)) return launch_ws<C, true, true>(p, plan, blocks, s);
    }
    return launch_ws<C, GROUPED, false>(p, plan, blocks, s);
  } else {
    // The direct kernel's group scales once per block when every group spans whole blocks.
    if constexpr (GROUPED && C::FOLD) {
      if (C::folds(p.group_size)) return launch_tiles<C, true, true>(p, plan, blocks, s);
    }
    return launch_tiles<C, GROUPED, false>(p, plan, blocks, s);
  }
}

}  // namespace
}  // namespace opforge::qqq
