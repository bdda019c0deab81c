#pragma once
// Which kernel and tile configuration run a qqq_gemm call, and how many
// splits of K: with_plan() makes the plan, and both entry points call it
// (workspace_bytes: how many bytes of workspace the call needs; dispatch:
// run it), so that the workspace the caller allocates and the kernel that
// runs can never disagree. qqq_gemm_kernel.cu's entry points are these two;
// the tuning driver (benchmarks/qqq_tune.cu) times every configuration beside
// them. The measurements behind each choice: benchmarks/qqq_notes.md.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "opforge/cuda_utils.cuh"
#include "opforge/sm90a.cuh"
#include "qqq_direct.cuh"
#include "qqq_gemm_kernel.h"
#include "qqq_mma.cuh"
#include "qqq_ws.cuh"

namespace opforge::qqq {
namespace {

// ---- the plan of one configuration, and its launch

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
// sums' round trip). Measured with qqq_tune on an H200: the fill is worth
// about two 16 KB stages and a split about three (M = 1, K = 4096, N = 11008:
// 1 split, 86 CTAs, 15.2 us; 3 splits, 258 CTAs, 17.7 us).
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

// ---- the tile configurations, timed by qqq_tune on an H200 (K = N = 8192 unless
// said; the other shapes in benchmarks/qqq_notes.md)

// M <= 16, staged tiles <MBW, WM, WN, WK, UK, STAGES, MINB>: 16 rows, 16 KB of
// weights per stage, 4 stages; the launcher models both and takes the cheaper.
using Narrow = Config<1, 1, 2, 4, 4, 4>;  // 64 x 512 k: 19.7 us at M = 1 (Wide 21.8, 128 x 128 24.0)
using Wide = Config<1, 1, 4, 2, 4, 4>;    // 128 x 256 k: 15.2 us at M = 1, 4096 x 11008 (others ~17.5, split)
// M <= 16, the weights straight into registers (qqq_direct_kernel), 8 units
// ahead: 14.9 us at M = 1 against Narrow's 16.3. Only without a split of K
// (a split's memset and partial sums cost 2-5 us there). Per group only
// folded (FOLD, group_size a multiple of 128): 16.9 us at M = 1 against the
// wgmma kernel's fold 19.1; in the conversion no faster than the staged tiles
// (the scales' arithmetic is the bound). One stripe per CTA with 8 warps
// along K while the stripes fit one wave, else two with 4 warps each, held to
// two CTAs per SM (at one, with 150 registers: 18.1 against 14.0 us at M = 1,
// 4096 x 11008).
using DirectStripe = Config<1, 1, 1, 8, 4, 8, 1, true, true>;
using DirectPair = Config<1, 1, 2, 4, 4, 8, 2, true, true>;
// sm_90a: the warp-specialised wgmma kernel <BM, consumer warpgroups, stages,
// fragment sets, CTAs per SM, weights by TMA box, probe, fold>; the weights
// by one bulk copy per stripe instead of a box: up to 14 % slower per group.
using Ws32 = WsConfig<32, 1, 8, 2, 1, true>;  // M <= 32 per channel: 16.9 us against M32's 22.8
// Two CTAs per SM, folded per group: M = 32 19.3 us (26.3 with the scales in the conversion).
using Ws32Group = WsConfig<32, 1, 8, 2, 2, true, 0, true>;
using Ws64 = WsConfig<64, 1, 4, 2, 2, true, 0, true>;  // M = 64 per group, folded: 22.8 us (in the conversion 29.5)
using Ws128 = WsConfig<128, 1, 6, 2, 1, true>;  // M = 128 per channel: 27.4 us against Large's 40.4
using Ws128Group = WsConfig<128, 2, 4, 2, 1, true>;  // M = 128 per group, unfolded: 36.6 us against Large's 50.4
// Elsewhere (no sm_90a code, another GPU), mma.sync tiles:
using M32 = Config<2, 1, 4, 2, 4, 4>;  // 128 x 256 per stage: 25.1 us at M = 32 (64 x 256: 26.9)
// 64 rows: per channel two warps along M (29.4 us; 4 m16 blocks per warp 30.5);
// per group 4 m16 blocks per warp, the scales' arithmetic once per 4 (34.6 against 39.9).
using M64Channel = Config<2, 2, 4, 1, 4, 4>;
using M64Group = Config<4, 1, 4, 2, 2, 4, 1>;
using Large = Config<4, 2, 4, 1, 4, 4, 1>;  // 128 x 128, one CTA per SM: 40.8 us at M = 128 (128 x 64: 53.4)

// ---- the choice

// Calls f(config, plan) with the configuration and plan for this problem.
template <class F>
auto with_plan(int64_t M, int64_t N, int64_t K, int64_t group_size, F&& f) {
  const bool grouped = group_size > 0;
  // Cached per device (cuda_utils.cuh): the plan runs on every call.
  const int sms = cuda::sm_count();
  // Cached per device too: is this library's sm_90a code what runs here?
  const bool wgmma = K > 0 && sm90::sm90a_code_loaded();
  static_assert(Ws64::FOLD && Ws64::BK == Ws32Group::BK, "Ws32Group and Ws64 fold the same group sizes");
  const bool fold = wgmma && Ws32Group::folds(group_size);
  // Below 17 rows the wgmma kernel (32-row tiles) also wins per group when it
  // folds, and per channel from 8 rows (M = 16: 16.5 us against the direct
  // kernel's 18.8; M = 8: ahead on two of the three shapes).
  const bool wgmma_small = grouped ? fold : wgmma && M >= 8;
  // The direct kernel: per channel below 8 rows, per group (folded) up to 8,
  // where the wgmma kernel is there to take over; else up to 16.
  static_assert(DirectStripe::FOLD && DirectPair::FOLD, "both direct shapes fold");
  const bool direct_ok = !grouped || DirectStripe::folds(group_size);
  if (M <= 16 && direct_ok && !(wgmma && M >= (grouped ? 9 : 8))) {
    if (N / 32 <= sms) {
      const Plan direct = make_plan<DirectStripe>(M, N, K, sms);
      if (direct.splits == 1) return f(DirectStripe{}, direct);
    } else {
      const Plan direct = make_plan<DirectPair>(M, N, K, sms);
      if (direct.splits == 1) return f(DirectPair{}, direct);
    }
  }
  if (M <= 16 && !wgmma_small) {
    int64_t cost_narrow = 0, cost_wide = 0;
    const Plan narrow = make_plan<Narrow>(M, N, K, sms, 0, &cost_narrow);
    const Plan wide = make_plan<Wide>(M, N, K, sms, 0, &cost_wide);
    return cost_wide <= cost_narrow ? f(Wide{}, wide) : f(Narrow{}, narrow);
  }
  if (wgmma) {
    if (M <= 32) {
      return grouped ? f(Ws32Group{}, make_plan<Ws32Group>(M, N, K, sms)) : f(Ws32{}, make_plan<Ws32>(M, N, K, sms));
    }
    // Per channel up to 64 rows, two 32-row tiles at two CTAs per SM (Ws32Group's
    // shape; per channel it does not fold) beat one of 64: 20.1 against 21.9 us
    // at M = 64. Folded per group they do not, nor at M = 128.
    if (!grouped && M <= 64) return f(Ws32Group{}, make_plan<Ws32Group>(M, N, K, sms));
    // Up to 128 rows, 64-row tiles (two CTAs per SM) beat 128-row ones (one):
    // 24.3 against 28.4 us per channel at M = 128, 30.8 against 37.3 folded per
    // group. Per group unfolded, and above 128 rows, not measured: 128-row tiles.
    if (M <= 64 || ((fold || !grouped) && M <= 128)) return f(Ws64{}, make_plan<Ws64>(M, N, K, sms));
    return grouped ? f(Ws128Group{}, make_plan<Ws128Group>(M, N, K, sms))
                   : f(Ws128{}, make_plan<Ws128>(M, N, K, sms));
  }
  if (M <= 32) return f(M32{}, make_plan<M32>(M, N, K, sms));
  if (M <= 64) {
    return grouped ? f(M64Group{}, make_plan<M64Group>(M, N, K, sms))
                   : f(M64Channel{}, make_plan<M64Channel>(M, N, K, sms));
  }
  // Compute-heavier: on a tie of the bandwidth model, more CTAs.
  return f(Large{}, make_plan<Large>(M, N, K, sms, 0, nullptr, true));
}

// ---- the launcher's two entry points (qqq_gemm_kernel.h)

inline int64_t workspace_bytes(int64_t M, int64_t N, int64_t K, int64_t group_size) {
  return with_plan(M, N, K, group_size, [](auto, const Plan& plan) { return plan.workspace_bytes(); });
}

inline const char* dispatch(const QqqGemmArgs& args, void* stream) {
  const bool grouped = args.s_group != nullptr;
  return with_plan(args.M, args.N, args.K, args.group_size, [&](auto c, const Plan& plan) -> const char* {
    using C = decltype(c);
    return grouped ? launch<C, true>(args, plan, stream) : launch<C, false>(args, plan, stream);
  });
}

}  // namespace
}  // namespace opforge::qqq
