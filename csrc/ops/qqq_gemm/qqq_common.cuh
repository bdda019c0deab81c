#pragma once
// What qqq_gemm's kernels share (LAYOUT.md has the packed layout they read):
// the launch parameters, the PTX wrappers, INT4 -> INT8 in registers, the
// output stores, the split-K meeting in the workspace and which tile a CTA
// computes. Pure CUDA, no torch headers.
//
// The kernels: qqq_mma.cuh (the staged mma.sync tiles, any GPU from sm_80),
// qqq_direct.cuh (small M: the weights straight into registers), qqq_ws.cuh
// (sm_90a: warp-specialised wgmma); qqq_dispatch.cuh picks one per call.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "opforge/cuda_utils.cuh"
#include "opforge/dtype.h"

// Everything in these headers has internal linkage (the anonymous namespace): a second
// library built from these sources (examples/qqq_gemm's extension) must not
// share a symbol with opforge's (cuda::allow_smem says what went wrong on the
// H200 when one did).
namespace opforge::qqq {
namespace {

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

// A 16-byte load that bypasses L1 (each weight is read once).
__device__ __forceinline__ uint4 ldg_stream(const void* gmem) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(gmem));
  return v;
}
__device__ __forceinline__ uint32_t lds32(const uint8_t* smem) { return *reinterpret_cast<const uint32_t*>(smem); }

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

// --- the output ---

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
}  // namespace
}  // namespace opforge::qqq
