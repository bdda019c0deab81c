// The W4A8 GEMM's launcher: which tile configuration and how many splits of
// K, per call (the kernel is in qqq_gemm_kernel.cuh, the layout in LAYOUT.md).

#include "qqq_gemm_kernel.cuh"

namespace opforge {
namespace {

using qqq::Config;
using qqq::Plan;

// Tile configurations <MBW, WM, WN, WK, UK, STAGES, MINB>, chosen from the
// sweep of benchmarks/qqq_tune.cu on an H200 (K = N = 8192, 4096 x 11008,
// 11008 x 4096; benchmarks/results/qqq-tune_nvidia-h200_2026-11-23.txt).
// Small M streams weights: 16 rows, 16 KB of weights per stage, 4 stages.
//   Narrow: 64 columns x 512 k, fastest at K = N = 8192 (19.7 us at M = 1
//           against 21.8 us for Wide, 21.3 for 64 x 256, 24.0 for 128 x 128);
//   Wide:   128 columns x 256 k, fastest at 4096 x 11008 (15.2 us against
//           ~17.5 us for the others, which need splits there).
// The launcher models both (make_plan) and takes the cheaper.
using Narrow = Config<1, 1, 2, 4, 4, 4>;  // M <= 16
using Wide = Config<1, 1, 4, 2, 4, 4>;    // M <= 16
// Small M: the weights straight into registers (qqq_direct_kernel),
// 8 units ahead, the CTA's K range of activations in shared memory; one
// stripe per CTA with 8 warps along K when the stripes fit in one wave, two
// with 4 warps each otherwise. H200, qqq_tune --direct (benchmarks/results/
// qqq-direct_nvidia-h200_2026-11-23.txt), M = 1: K = N = 8192 14.9 us
// (Narrow 16.3), 4096 x 11008 12.4 (Wide 13.3), 11008 x 4096 12.8 (Narrow
// 14.8). Only without a split: a split's counter memset and partial sums cost
// 2-5 us there, more than the direct kernel gains, and the staged tiles
// split better. Per group with the scales in the conversion it is no faster
// (the group scales' arithmetic, not the loads, is the bound: 20.2 against
// 21.1 us at M = 1, K = N = 8192). With group_size a multiple of 128 it folds
// them instead, once per block of 4 units (Config's FOLD), and wins per group
// up to M = 8 (qqq_tune --dfold, qqq-dfold_nvidia-h200_2026-11-23.txt), K = N
// = 8192 / 4096 x 11008 / 11008 x 4096: M = 1 16.9 / 14.0 / 14.3 us (the
// wgmma kernel's fold 19.1 / 17.1 / 17.2; per channel 14.9 / 12.6 / 12.9),
// M = 8 18.4 / 14.9 / 15.8 (18.9 / 16.4 / 17.1); at M = 16 not (20.4 / 16.2
// / 18.9 against 19.0 / 16.2 / 17.4). The pair shape runs more CTAs than SMs,
// so it is held to 128 registers, two CTAs per SM (the fold's partial sums
// took it to 150, one CTA per SM: 18.1 us at M = 1, 4096 x 11008).
using DirectStripe = Config<1, 1, 1, 8, 4, 8, 1, true, true>;
using DirectPair = Config<1, 1, 2, 4, 4, 8, 2, true, true>;
// Larger M on an H100/H200 with sm_90a code (from where: the launcher below):
// the warp-specialised wgmma kernel (qqq_ws_kernel.cuh), its activations and
// weights each one TMA box per slot. <BM, consumer warpgroups, stages,
// fragment sets, CTAs per SM, true>.
// H200, qqq_tune --ws (benchmarks/results/qqq-ws_nvidia-h200_2026-11-23.txt),
// against the mma.sync tiles below, K = N = 8192 / 4096 x 11008 / 11008 x 4096:
//   per channel, M = 32:  32 rows x 128 columns, 16.9 / 14.3 / 16.1 us (22.8 / 17.3 / 19.3);
//   per group,   M = 32:  the same at 2 CTAs per SM, 26.3 / 21.9 / 22.5 (26.9 / 23.1 / 23.2);
//   M = 64:               64 x 128 at 2 CTAs per SM, per channel 21.8 / 18.8 / 21.3
//                         (27.3 / 23.3 / 22.8), per group 29.9 / 24.6 / 26.3 (35.0 / 31.0 / 28.7);
//   per channel, M = 128: 128 x 128, 27.4 / 22.7 / 26.0 (40.4 / 37.0 / 33.2);
//   per group,   M = 128: 128 x 256 (two consumers), 36.6 / 30.2 / 35.9 (50.4 / 44.4 / 39.9).
// 4 or 8 slots instead of 6, or 3 units' wgmmas in flight instead of 1: within
// 5 %; the weights by one bulk copy per stripe instead of one TMA box: up to
// 14 % slower per group (qqq-ws-first_..., qqq-ws-probe_...).
// Per group with groups of whole slots (group_size a multiple of 128), the
// last template argument folds the group scales into per-slot partial sums
// (one set) instead of applying them in every weight byte's conversion; then
// the wgmma kernel also takes M <= 16 per group. qqq_tune --fold
// (qqq-fold_nvidia-h200_2026-11-23.txt), per group 128, against the kernels
// before it, K = N = 8192 / 4096 x 11008 / 11008 x 4096:
//   M = 1:  19.6 / 16.2 / 17.4 us (staged tiles 20.9 / 19.1 / 18.7);
//   M = 16: 18.9 / 15.9 / 17.2 (22.2 / 19.7 / 19.9);
//   M = 32: 19.3 / 16.8 / 17.6 (the conversion 26.3 / 21.4 / 22.6);
//   M = 64: 22.8 / 20.1 / 20.6 (29.5 / 24.1 / 26.0).
// Two sets of partial sums (the next slot's wgmmas running during the fold)
// were slower, 19.8-22.9 us at M = 32: ptxas serialises the wgmmas when
// other instructions read accumulators between a wgmma and its wait_group 0.
using Ws32 = qqq::WsConfig<32, 1, 8, 2, 1, true>;
using Ws32Group = qqq::WsConfig<32, 1, 8, 2, 2, true, 0, true>;
using Ws64 = qqq::WsConfig<64, 1, 4, 2, 2, true, 0, true>;
using Ws128 = qqq::WsConfig<128, 1, 6, 2, 1, true>;
using Ws128Group = qqq::WsConfig<128, 2, 4, 2, 1, true>;
// Elsewhere (no sm_90a code, another GPU), mma.sync tiles:
// 32 rows, 128 x 256 per stage: 25.1 us at K = N = 8192 (64 x 256: 26.9, two
// warps along M: 26.2).
using M32 = Config<2, 1, 4, 2, 4, 4>;
// 64 rows: per channel, two warps along M (29.4 us at K = N = 8192, 4 m16
// blocks per warp: 30.5); per group, 4 m16 blocks per warp and one CTA per
// SM, where the group scales' arithmetic is done once per 4 blocks (34.6 us
// against 39.9).
using M64Channel = Config<2, 2, 4, 1, 4, 4>;
using M64Group = Config<4, 1, 4, 2, 2, 4, 1>;
// Above 64 rows, 128 x 128 tiles, 4 m16 blocks per warp, one CTA per SM:
// 40.8 us at M = 128, K = N = 8192 (128 x 64 at two CTAs per SM: 53.4).
using Large = Config<4, 2, 4, 1, 4, 4, 1>;

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
  // folds, and per channel from 8 rows. qqq_tune --fold (qqq-fold_...txt), per
  // channel, Ws32 against the direct kernel, K = N = 8192 / 4096 x 11008 /
  // 11008 x 4096: M = 16 16.5 / 13.2 / 15.2 us (18.8 / 15.4 / 16.2), M = 8
  // 16.7 / 12.9 / 14.9 (16.4 / 13.6 / 15.6), M = 4 17.6 / 13.1 / 16.0 (15.6 / 13.2 / 14.3).
  const bool wgmma_small = grouped ? fold : wgmma && M >= 8;
  // The direct kernel: per channel below 8 rows, per group (folded) up to 8,
  // where the wgmma kernel is there to take over; else up to 16.
  static_assert(DirectStripe::FOLD && DirectPair::FOLD, "both direct shapes fold");
  const bool direct_ok = !grouped || DirectStripe::folds(group_size);
  if (M <= 16 && direct_ok && !(wgmma && M >= (grouped ? 9 : 8))) {
    if (N / 32 <= sms) {
      const Plan direct = qqq::make_plan<DirectStripe>(M, N, K, sms);
      if (direct.splits == 1) return f(DirectStripe{}, direct);
    } else {
      const Plan direct = qqq::make_plan<DirectPair>(M, N, K, sms);
      if (direct.splits == 1) return f(DirectPair{}, direct);
    }
  }
  if (M <= 16 && !wgmma_small) {
    int64_t cost_narrow = 0, cost_wide = 0;
    const Plan narrow = qqq::make_plan<Narrow>(M, N, K, sms, 0, &cost_narrow);
    const Plan wide = qqq::make_plan<Wide>(M, N, K, sms, 0, &cost_wide);
    return cost_wide <= cost_narrow ? f(Wide{}, wide) : f(Narrow{}, narrow);
  }
  if (wgmma) {
    if (M <= 32) {
      return grouped ? f(Ws32Group{}, qqq::make_plan<Ws32Group>(M, N, K, sms))
                     : f(Ws32{}, qqq::make_plan<Ws32>(M, N, K, sms));
    }
    // Per channel up to 64 rows, two 32-row tiles at two CTAs per SM (Ws32Group's
    // shape; per channel it does not fold) beat one of 64: M = 64 20.1 / 16.6 /
    // 17.9 us against 21.9 / 19.0 / 21.4 (qqq_tune --rows32,
    // qqq-rows32_...txt; Ws32 at one CTA per SM 20.1 / 16.7 / 19.3). Folded per
    // group they do not (24.1 / 21.2 / 19.4 against 23.5 / 20.3 / 21.7), nor at
    // M = 128 (25.2 / 27.9 / 22.9 against 24.7 / 20.4 / 22.3 per channel).
    if (!grouped && M <= 64) return f(Ws32Group{}, qqq::make_plan<Ws32Group>(M, N, K, sms));
    // Up to 128 rows, 64-row tiles (two CTAs per SM) beat 128-row ones (one):
    // per channel at M = 128 24.3 / 19.6 / 21.7 us against 28.4 / 22.6 / 25.6,
    // at M = 80 27.2 / 20.6 / 21.8 against 33.5 / 21.8 / 24.5 (qqq_tune --m128,
    // qqq-m128_...txt; three CTAs per SM: 26.3 / 24.0 / 25.2 at M = 128);
    // folded per group 30.8 / 27.1 / 25.6 against 37.3 / 31.7 / 36.1
    // (qqq-fold_...txt). Per group without the fold (group sizes that are not
    // multiples of 128) keeps Ws128Group there (not measured); M > 128 keeps
    // the 128-row tiles, where the loads of `a` weigh more (not measured).
    if (M <= 64 || ((fold || !grouped) && M <= 128)) return f(Ws64{}, qqq::make_plan<Ws64>(M, N, K, sms));
    return grouped ? f(Ws128Group{}, qqq::make_plan<Ws128Group>(M, N, K, sms))
                   : f(Ws128{}, qqq::make_plan<Ws128>(M, N, K, sms));
  }
  if (M <= 32) return f(M32{}, qqq::make_plan<M32>(M, N, K, sms));
  if (M <= 64) {
    return grouped ? f(M64Group{}, qqq::make_plan<M64Group>(M, N, K, sms))
                   : f(M64Channel{}, qqq::make_plan<M64Channel>(M, N, K, sms));
  }
  // Compute-heavier: on a tie of the bandwidth model, more CTAs.
  return f(Large{}, qqq::make_plan<Large>(M, N, K, sms, 0, nullptr, true));
}

}  // namespace

int64_t qqq_gemm_workspace_bytes(int64_t M, int64_t N, int64_t K, int64_t group_size) {
  return with_plan(M, N, K, group_size, [](auto, const Plan& plan) { return plan.workspace_bytes(); });
}

const char* qqq_gemm_cuda(const QqqGemmArgs& args, void* stream) {
  const bool grouped = args.s_group != nullptr;
  return with_plan(args.M, args.N, args.K, args.group_size, [&](auto c, const Plan& plan) -> const char* {
    using C = decltype(c);
    return grouped ? qqq::launch<C, true>(args, plan, stream) : qqq::launch<C, false>(args, plan, stream);
  });
}

}  // namespace opforge
