#pragma once
// Which kernel runs a GEMM: by dtype, by what the device and the build can do,
// by alignment, and by size class. gemm_kernel.cu's gemm_cuda is this; the
// tuning driver (benchmarks/gemm_tune.cu) times it beside every variant.
//
// The tile shapes below are the tuning constants; each carries the
// measurement that chose it (benchmarks/gemm_notes.md has the tables).

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "gemm_common.cuh"
#include "gemm_mma.cuh"
#include "gemm_simt.cuh"
#include "gemm_wgmma.cuh"
#include "opforge/dtype.h"

namespace opforge::gemm {

template <class Tile>
inline int64_t tiles_of(const Problem& p) {
  return ceil_div(p.M, Tile::BM) * ceil_div(p.N, Tile::BN);
}

// ---- float32 / float64 on the CUDA cores (gemm_simt.cuh)
// Rows 16-byte aligned: 128 x 256 CTA tile, 64 x 64 warp tile, 8 x 16 outputs a
// thread, K-slices of 16 (4096^3: 92.5 % of cuBLAS; 256 x 128 x 8: 91.1 %).
using SimtLarge = SimtTile<128, 256, 16, 64, 64, 8, 16>;
// Element loads (K or N not a multiple of 4): 256 x 128, 16 x 8 a thread,
// K-slices of 8 (4095 x 4097 x 4093: 88.2 %; the 128 x 256 x 16 tile: 74.1 %).
using SimtLargeScalar = SimtTile<256, 128, 8, 64, 64, 16, 8>;
// 64 x 64, for grids that large tiles would leave short of one CTA per SM
// (1024^3: 86.8 %, against 33 % for 128 x 256 tiles: 32 CTAs).
using SimtSmall = SimtTile<64, 64, 16, 32, 32, 4, 8>;
// A few rows: narrow tiles and many CTAs streaming B (16 x 8192 x 8192:
// 16 x 64 x 32 65.8 %, 32 x 32 x 32 62.2 %; K-slices of 64 lost: 45.6 %).
using SimtSkinny16 = SimtTile<16, 64, 32, 16, 32, 4, 4>;
using SimtSkinny32 = SimtTile<32, 32, 32, 32, 16, 4, 4>;
using SimtF64 = SimtTile<64, 64, 8, 32, 32, 4, 8>;

template <bool kVec>
inline const char* dispatch_f32(const Problem& p, const DeviceInfo& info, cudaStream_t s) {
  using Large = std::conditional_t<kVec, SimtLarge, SimtLargeScalar>;
  // Large tiles while they fill at least 90 % of the SMs (2048^3: 128 tiles
  // on 132 SMs, 92.0 %); then narrow ones.
  if (tiles_of<Large>(p) * 10 >= int64_t{info.sms} * 9) return launch_simt<float, float, Large, kVec>(p, info.sms, s);
  if (p.M <= 16) return launch_simt<float, float, SimtSkinny16, kVec>(p, info.sms, s);
  if (p.M <= 32) return launch_simt<float, float, SimtSkinny32, kVec>(p, info.sms, s);
  return launch_simt<float, float, SimtSmall, kVec>(p, info.sms, s);
}

// ---- float16 / bfloat16 through mma.sync (gemm_mma.cuh): the sm_80 path and
// the fallback. On the H200 it reaches 30-45 % of cuBLAS (which uses wgmma
// there). 128 x 256 tiles were 1-3 % faster than 128 x 128 at 4096^3 and
// 8192^3 but far slower at 1024^3 (24 % vs 37 %) and M = 16 (21 % vs 32 %):
// 128 x 128 x 32 with 4 cp.async stages is kept; 64 x 64 below one tile per SM.
using MmaLarge = MmaTile<128, 128, 64, 32, 4>;
using MmaSmall = MmaTile<64, 64, 32, 32, 4>;

// ---- float16 / bfloat16 through wgmma + TMA on sm_90a (gemm_wgmma.cuh), C
// stored by TMA from shared memory. 128 x 256, 3 stages (the C staging takes
// the 4th), 2 consumer warpgroups: 4096^3 99.6-100 %, 8192^3 102-103 %,
// 8192 x 8192 x 512 100 % of cuBLAS (128 x 128: 96-102 %; 256 x 128: 92-101 %).
using WgmmaLarge = WgmmaTile<128, 256, 3, 2>;
// 128 x 128, 6 stages: 2048^3 99.3 % (128 x 256 leaves 4 of 132 SMs idle: 98.7 %).
using WgmmaMedium = WgmmaTile<128, 128, 6, 2>;
// 64 x 128, 8 stages, one consumer: grids of few tiles and small M
// (1024^3 102.7 %, 16 x 8192 x 8192 90-101 %; 64 x 64: 83-95 %).
using WgmmaSmallM = WgmmaTile<64, 128, 8, 1>;
// Misaligned operands (padded copies) and C written directly: 4095 x 4097 x
// 4093 at 200-230 % of cuBLAS (which runs a slow kernel there, 150 TFLOP/s).
using WgmmaPackedLarge = WgmmaTile<128, 256, 4, 2, false>;
using WgmmaPackedMedium = WgmmaTile<128, 128, 6, 2, false>;
using WgmmaPackedSmallM = WgmmaTile<64, 128, 8, 1, false>;

template <typename T>
inline const char* dispatch_half(const Problem& p, const DeviceInfo& info, cudaStream_t s) {
  if (wgmma_dims_ok(p) && wgmma_available(info)) {
    // The largest tile that still gives every SM a tile.
    const bool large = tiles_of<WgmmaLarge>(p) >= info.sms, medium = tiles_of<WgmmaMedium>(p) >= info.sms;
    if (wgmma_ok(p)) {
      if (large) return launch_wgmma<T, WgmmaLarge>(p, info, s);
      if (medium) return launch_wgmma<T, WgmmaMedium>(p, info, s);
      return launch_wgmma<T, WgmmaSmallM>(p, info, s);
    }
    bool fell_back = false;
    const char* err = large    ? launch_wgmma_packed<T, WgmmaPackedLarge>(p, info, s, 0, &fell_back)
                      : medium ? launch_wgmma_packed<T, WgmmaPackedMedium>(p, info, s, 0, &fell_back)
                               : launch_wgmma_packed<T, WgmmaPackedSmallM>(p, info, s, 0, &fell_back);
    if (!fell_back) return err;
  }
  if (info.major >= 8) {
    const bool large = tiles_of<MmaLarge>(p) >= info.sms;
    if (mma_async_ok(p)) {
      return large ? launch_mma<T, MmaLarge, true>(p, s) : launch_mma<T, MmaSmall, true>(p, s);
    }
    return large ? launch_mma<T, MmaLarge, false>(p, s) : launch_mma<T, MmaSmall, false>(p, s);
  }
  // Before sm_80 there is no bf16 mma.sync: CUDA cores, float32 accumulation.
  return launch_simt<T, float, SimtSmall, false>(p, info.sms, s);
}

inline const char* dispatch(DType dtype, const Problem& p, cudaStream_t s) {
  if (p.M < 1 || p.N < 1 || p.K < 1) return "opforge: gemm: M, N and K must be >= 1";
  DeviceInfo info;
  if (const char* err = device_info(info)) return err;
  switch (dtype) {
    case DType::Float32:
      return simt_vec_ok(p) ? dispatch_f32<true>(p, info, s) : dispatch_f32<false>(p, info, s);
    case DType::Float64:
      return launch_simt<double, double, SimtF64, false>(p, info.sms, s);
    case DType::Float16:
      return dispatch_half<__half>(p, info, s);
    case DType::BFloat16:
      return dispatch_half<__nv_bfloat16>(p, info, s);
  }
  return "opforge: gemm: unsupported dtype in the CUDA launcher";
}

}  // namespace opforge::gemm
