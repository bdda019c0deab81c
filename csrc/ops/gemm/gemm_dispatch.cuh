#pragma once
// Which kernel runs a GEMM: by dtype, by what the device and the build can do,
// by alignment, and by size class. The choice is a Plan, made by one function,
// plan(), which both gemm_cuda_workspace (how many bytes of workspace the
// call needs) and gemm_cuda (which runs it) call: the size that the caller
// allocates and the kernel that runs can never disagree. gemm_kernel.cu's
// gemm_cuda is dispatch(); the tuning driver (benchmarks/gemm_tune.cu) times
// it beside every variant.
//
// The tile shapes and split-K constants below are the tuning constants; each
// carries the measurement that chose it (benchmarks/gemm_notes.md has the
// tables).

#include <cuda_runtime.h>

#include <algorithm>
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

// Large tiles are kept while their grid fills at least 90 % of the SMs: 2048^3 makes 128 of
// them on 132 SMs (97 %), where they led (float32 here; bf16 / fp16 beside WgmmaMedium).
template <class Tile>
inline bool fills_most_sms(const Problem& p, const DeviceInfo& info) {
  return tiles_of<Tile>(p) * 10 >= int64_t{info.sms} * 9;
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
// A few rows: narrow tiles and many CTAs streaming B (16 x 8192 x 8192,
// unsplit: 16 x 64 x 32 65.8 %, 32 x 32 x 32 62.2 %; K-slices of 64 lost:
// 45.6 %). Split-K (below) gives them several CTAs per SM.
using SimtSkinny16 = SimtTile<16, 64, 32, 16, 32, 4, 4>;
using SimtSkinny32 = SimtTile<32, 32, 32, 32, 16, 4, 4>;
using SimtF64 = SimtTile<64, 64, 8, 32, 32, 4, 8>;

// ---- split-K for the SIMT tiles (gemm_simt.cuh). Measured on the H200
// (gemm_tune --only simt; benchmarks/gemm_notes.md, "Split-K" has the tables
// and the arithmetic behind each constant): the three give 145.5 %, 105.4 %
// and 80.6 % of cuBLAS on 16 x 8192 x 8192, 32 x 8192 x 8192 and 64 x 4096 x
// 4096, each within 3 % of the best of 1-16 splits over four tiles.
//
// Split only below 2 CTAs per SM: one CTA per SM keeps ~10 KB in flight, and
// 16 x 8192 x 8192 unsplit streams B at 1.2 of the 4.3 TB/s the H200 copies at.
constexpr int64_t kSplitBelowTilesPerSm = 2;
// 8 resident CTAs per SM (fewer where the kernel's registers and shared memory
// allow fewer), so that the split grid is one wave: ~80 KB in flight per SM.
constexpr int kSplitCtasPerSm = 8;
// At least 1024 of K per split: the unoverlapped first load and the partial
// tile's round trip stay a few % of a split's work, and 1024^3 stays unsplit.
constexpr int64_t kSplitMinK = 1024;

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
// 128 x 128, 6 stages: grids where 128 x 256 tiles fill under 90 % of the SMs. At 2048^3 (128
// large tiles on 132 SMs) the large tile is kept: H100 bf16 101.3 % against 85.5 %, fp16 97.7 %
// against 93.4 %; H200 98.7 % against 99.3 %.
using WgmmaMedium = WgmmaTile<128, 128, 6, 2>;
// 64 x 128, 8 stages, one consumer: grids of few tiles and small M
// (1024^3 102.7 %, 16 x 8192 x 8192 90-101 %; 64 x 64: 83-95 %).
using WgmmaSmallM = WgmmaTile<64, 128, 8, 1>;
// Misaligned operands (padded copies in the workspace) and C written
// directly: 4095 x 4097 x 4093 at 200-230 % of cuBLAS (which runs a slow
// kernel there, 150 TFLOP/s).
using WgmmaPackedLarge = WgmmaTile<128, 256, 4, 2, false>;
using WgmmaPackedMedium = WgmmaTile<128, 128, 6, 2, false>;
using WgmmaPackedSmallM = WgmmaTile<64, 128, 8, 1, false>;

// ---- the plan

enum class Kernel : uint8_t {
  SimtLarge,
  SimtLargeScalar,
  SimtSmall,
  SimtSkinny16,
  SimtSkinny32,
  SimtF64,
  WgmmaLarge,
  WgmmaMedium,
  WgmmaSmallM,
  WgmmaPackedLarge,
  WgmmaPackedMedium,
  WgmmaPackedSmallM,
  MmaLarge,
  MmaSmall,
};

// Each kind's tile and, for the SIMT ones, which float32 load widths and
// whether the split-K kernel are compiled for it (the large tiles fill the
// SMs by themselves, and each has one load width): one table that plan() and
// run() both read, so that no kernel is built that no plan can pick.
template <Kernel k>
struct KernelTile;
enum Loads : int { kScalarLoads = 1, kVecLoads = 2, kBothLoads = 3 };
template <class TileT, bool kMaySplitT = false, int kLoadsT = kBothLoads>
struct TileIs {
  using Tile = TileT;
  static constexpr bool kMaySplit = kMaySplitT;
  static constexpr int kLoads = kLoadsT;
};
template <> struct KernelTile<Kernel::SimtLarge> : TileIs<SimtLarge, false, kVecLoads> {};
template <> struct KernelTile<Kernel::SimtLargeScalar> : TileIs<SimtLargeScalar, false, kScalarLoads> {};
template <> struct KernelTile<Kernel::SimtSmall> : TileIs<SimtSmall, true> {};
template <> struct KernelTile<Kernel::SimtSkinny16> : TileIs<SimtSkinny16, true> {};
template <> struct KernelTile<Kernel::SimtSkinny32> : TileIs<SimtSkinny32, true> {};
template <> struct KernelTile<Kernel::SimtF64> : TileIs<SimtF64, true, kScalarLoads> {};
template <> struct KernelTile<Kernel::WgmmaLarge> : TileIs<WgmmaLarge> {};
template <> struct KernelTile<Kernel::WgmmaMedium> : TileIs<WgmmaMedium> {};
template <> struct KernelTile<Kernel::WgmmaSmallM> : TileIs<WgmmaSmallM> {};
template <> struct KernelTile<Kernel::WgmmaPackedLarge> : TileIs<WgmmaPackedLarge> {};
template <> struct KernelTile<Kernel::WgmmaPackedMedium> : TileIs<WgmmaPackedMedium> {};
template <> struct KernelTile<Kernel::WgmmaPackedSmallM> : TileIs<WgmmaPackedSmallM> {};
template <> struct KernelTile<Kernel::MmaLarge> : TileIs<MmaLarge> {};
template <> struct KernelTile<Kernel::MmaSmall> : TileIs<MmaSmall> {};

inline const char* kernel_name(Kernel k) {
  switch (k) {
    case Kernel::SimtLarge: return "simt128x256x16";
    case Kernel::SimtLargeScalar: return "simt256x128x8";
    case Kernel::SimtSmall: return "simt64x64x16";
    case Kernel::SimtSkinny16: return "simt16x64x32";
    case Kernel::SimtSkinny32: return "simt32x32x32";
    case Kernel::SimtF64: return "simt64x64x8";
    case Kernel::WgmmaLarge: return "wgmma128x256s3";
    case Kernel::WgmmaMedium: return "wgmma128x128s6";
    case Kernel::WgmmaSmallM: return "wgmma64x128s8";
    case Kernel::WgmmaPackedLarge: return "packed128x256s4";
    case Kernel::WgmmaPackedMedium: return "packed128x128s6";
    case Kernel::WgmmaPackedSmallM: return "packed64x128s8";
    case Kernel::MmaLarge: return "mma128x128s4";
    case Kernel::MmaSmall: return "mma64x64s4";
  }
  return "?";
}

// What one GEMM call runs and the workspace it needs.
struct Plan {
  Kernel kernel = Kernel::SimtSmall;
  bool vec = false;      // SIMT: 16-byte loads (simt_vec_ok); mma.sync: cp.async (mma_async_ok)
  int splits = 1;        // SIMT: K ranges, as split_k runs them (1: unsplit)
  size_t workspace = 0;  // bytes of Workspace the call needs
};

// A SIMT tile, split along K when its grid leaves the SMs short (the
// constants above): as many splits as fill the SMs once with kSplitCtasPerSm
// CTAs each (fewer where the kernel cannot have that many resident), each at
// least kSplitMinK long.
template <typename T, typename Acc, Kernel kKernel, bool kVec>
inline Plan plan_simt(const Problem& p, const DeviceInfo& info) {
  using Kind = KernelTile<kKernel>;
  using Tile = typename Kind::Tile;
  Plan plan{kKernel, kVec, 1, 0};
  if constexpr (Kind::kMaySplit) {
    const int64_t tiles = tiles_of<Tile>(p);
    if (tiles < kSplitBelowTilesPerSm * info.sms && p.K >= 2 * kSplitMinK) {
      constexpr auto kernel = simt_gemm_kernel<T, Acc, Tile, kVec, true>;
      const int resident = resident_ctas<kernel>(Tile::kThreads, Tile::template smem_bytes<Acc>());
      const int64_t per_sm = std::min(kSplitCtasPerSm, resident);
      const int64_t wanted = std::min(per_sm * info.sms / tiles, p.K / kSplitMinK);
      if (wanted >= 2) plan.splits = split_k<Tile>(p.K, static_cast<int>(std::min<int64_t>(wanted, 65535))).splits;
    }
    plan.workspace = simt_workspace_bytes<Acc, Tile>(p, plan.splits);
  }
  return plan;
}

template <bool kVec>
inline Plan plan_f32(const Problem& p, const DeviceInfo& info) {
  constexpr Kernel large = kVec ? Kernel::SimtLarge : Kernel::SimtLargeScalar;
  // Large tiles while they fill most of the SMs (2048^3: 92.0 % of cuBLAS); then narrow ones.
  if (fills_most_sms<typename KernelTile<large>::Tile>(p, info)) {
    return plan_simt<float, float, large, kVec>(p, info);
  }
  if (p.M <= 16) return plan_simt<float, float, Kernel::SimtSkinny16, kVec>(p, info);
  if (p.M <= 32) return plan_simt<float, float, Kernel::SimtSkinny32, kVec>(p, info);
  return plan_simt<float, float, Kernel::SimtSmall, kVec>(p, info);
}

template <typename T>
inline Plan plan_half(const Problem& p, const DeviceInfo& info) {
  if (wgmma_dims_ok(p) && wgmma_available(info)) {
    // The largest tile that gives every SM a tile. TMA's path keeps 128 x 256 while it fills most
    // of the SMs, as plan_f32 does; the packed path was not timed in that band.
    const bool large = tiles_of<WgmmaLarge>(p) >= info.sms, medium = tiles_of<WgmmaMedium>(p) >= info.sms;
    if (wgmma_ok(p)) {
      const bool most = fills_most_sms<WgmmaLarge>(p, info);
      return {most ? Kernel::WgmmaLarge : medium ? Kernel::WgmmaMedium : Kernel::WgmmaSmallM};
    }
    // Operands TMA cannot read as they are: padded copies in the workspace.
    // (It is about the size of A and B: where it cannot be had, the caller's
    // allocation fails with an out-of-memory error of its own.)
    return {large ? Kernel::WgmmaPackedLarge : medium ? Kernel::WgmmaPackedMedium : Kernel::WgmmaPackedSmallM,
            false, 1, packed_workspace_bytes(p)};
  }
  if (info.major >= 8) {
    return {tiles_of<MmaLarge>(p) >= info.sms ? Kernel::MmaLarge : Kernel::MmaSmall, mma_async_ok(p)};
  }
  // Before sm_80 there is no bf16 mma.sync: CUDA cores, float32 accumulation.
  return plan_simt<T, float, Kernel::SimtSmall, false>(p, info);
}

// The plan for one call; M, N, K >= 1.
inline Plan plan(DType dtype, const Problem& p, const DeviceInfo& info) {
  switch (dtype) {
    case DType::Float32:
      return simt_vec_ok(p) ? plan_f32<true>(p, info) : plan_f32<false>(p, info);
    case DType::Float64:
      return plan_simt<double, double, Kernel::SimtF64, false>(p, info);
    case DType::Float16:
      return plan_half<__half>(p, info);
    case DType::BFloat16:
      return plan_half<__nv_bfloat16>(p, info);
  }
  return {};
}

// ---- running a plan

template <typename T, typename Acc, Kernel kKernel>
inline const char* run_simt(const Plan& plan, const Problem& p, const DeviceInfo& info, Workspace ws,
                            cudaStream_t s) {
  using Kind = KernelTile<kKernel>;
  using Tile = typename Kind::Tile;
  if constexpr (std::is_same_v<T, float> && (Kind::kLoads & kVecLoads)) {
    if (plan.vec) return launch_simt<T, Acc, Tile, true, Kind::kMaySplit>(p, info.sms, s, plan.splits, ws);
  }
  if constexpr (Kind::kLoads & kScalarLoads) {
    if (!plan.vec) return launch_simt<T, Acc, Tile, false, Kind::kMaySplit>(p, info.sms, s, plan.splits, ws);
  }
  return "opforge: gemm: the plan asks for a load width its SIMT tile is not compiled with";
}

template <typename T>
inline const char* run_half(const Plan& plan, const Problem& p, const DeviceInfo& info, Workspace ws,
                            cudaStream_t s) {
  switch (plan.kernel) {
    case Kernel::WgmmaLarge: return launch_wgmma<T, WgmmaLarge>(p, info, s);
    case Kernel::WgmmaMedium: return launch_wgmma<T, WgmmaMedium>(p, info, s);
    case Kernel::WgmmaSmallM: return launch_wgmma<T, WgmmaSmallM>(p, info, s);
    case Kernel::WgmmaPackedLarge: return launch_wgmma_packed<T, WgmmaPackedLarge>(p, info, s, ws);
    case Kernel::WgmmaPackedMedium: return launch_wgmma_packed<T, WgmmaPackedMedium>(p, info, s, ws);
    case Kernel::WgmmaPackedSmallM: return launch_wgmma_packed<T, WgmmaPackedSmallM>(p, info, s, ws);
    case Kernel::MmaLarge:
      return plan.vec ? launch_mma<T, MmaLarge, true>(p, s) : launch_mma<T, MmaLarge, false>(p, s);
    case Kernel::MmaSmall:
      return plan.vec ? launch_mma<T, MmaSmall, true>(p, s) : launch_mma<T, MmaSmall, false>(p, s);
    case Kernel::SimtSmall: return run_simt<T, float, Kernel::SimtSmall>(plan, p, info, ws, s);
    default: return "opforge: gemm: a plan for another dtype (float16/bfloat16 run wgmma, mma.sync or simt64x64x16)";
  }
}

inline const char* run(DType dtype, const Plan& plan, const Problem& p, const DeviceInfo& info, Workspace ws,
                       cudaStream_t s) {
  switch (dtype) {
    case DType::Float32:
      switch (plan.kernel) {
        case Kernel::SimtLarge: return run_simt<float, float, Kernel::SimtLarge>(plan, p, info, ws, s);
        case Kernel::SimtLargeScalar: return run_simt<float, float, Kernel::SimtLargeScalar>(plan, p, info, ws, s);
        case Kernel::SimtSmall: return run_simt<float, float, Kernel::SimtSmall>(plan, p, info, ws, s);
        case Kernel::SimtSkinny16: return run_simt<float, float, Kernel::SimtSkinny16>(plan, p, info, ws, s);
        case Kernel::SimtSkinny32: return run_simt<float, float, Kernel::SimtSkinny32>(plan, p, info, ws, s);
        default: return "opforge: gemm: a plan for another dtype (float32 runs the SIMT tiles)";
      }
    case DType::Float64:
      if (plan.kernel != Kernel::SimtF64) return "opforge: gemm: a plan for another dtype (float64 runs simt64x64x8)";
      return run_simt<double, double, Kernel::SimtF64>(plan, p, info, ws, s);
    case DType::Float16:
      return run_half<__half>(plan, p, info, ws, s);
    case DType::BFloat16:
      return run_half<__nv_bfloat16>(plan, p, info, ws, s);
  }
  return "opforge: gemm: unsupported dtype in the CUDA launcher";
}

// ---- the launcher's two entry points (gemm_kernel.h)

// Bytes of workspace dispatch() will need for this call on the current
// device; 0 where it will fail anyway (bad sizes, no device): dispatch then
// says why.
inline size_t workspace_bytes(DType dtype, const Problem& p) {
  if (p.M < 1 || p.N < 1 || p.K < 1) return 0;
  DeviceInfo info;
  if (device_info(info) != nullptr) return 0;
  return plan(dtype, p, info).workspace;
}

inline const char* dispatch(DType dtype, const Problem& p, Workspace ws, cudaStream_t s) {
  if (p.M < 1 || p.N < 1 || p.K < 1) return "opforge: gemm: M, N and K must be >= 1";
  DeviceInfo info;
  if (const char* err = device_info(info)) return err;
  return run(dtype, plan(dtype, p, info), p, info, ws, s);
}

}  // namespace opforge::gemm
