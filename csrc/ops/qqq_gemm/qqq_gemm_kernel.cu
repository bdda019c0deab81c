// The W4A8 GEMM's launcher: one tile configuration per range of M (the
// kernel is in qqq_gemm_kernel.cuh, the layout in LAYOUT.md).

#include "qqq_gemm_kernel.cuh"

namespace opforge {
namespace {

using qqq::Config;
using qqq::Plan;

// Tile configurations <MBW, WM, WN, WK, UK, STAGES>, by M. Small M is a
// weight stream: 16 rows (the MMA's minimum), 128 columns x 256 k per stage
// (16 KB of weights), the 8 warps split 4 stripes x 2 halves of K. Larger M
// keeps more rows per CTA so that each weight byte feeds more MMAs, the warps
// splitting M instead of K; two m16 blocks per warp at most, so that 128
// registers (two CTAs per SM) hold the accumulators without spilling.
using Small = Config<1, 1, 4, 2, 4, 4>;  // M <= 16
using M32 = Config<2, 1, 4, 2, 4, 4>;    // M <= 32
using M64 = Config<2, 2, 4, 1, 4, 4>;    // M <= 64
using Large = Config<2, 4, 2, 1, 4, 4>;  // M > 64: 128 x 64 tiles

template <class F>
auto with_config(int64_t M, F&& f) {
  if (M <= 16) return f(Small{});
  if (M <= 32) return f(M32{});
  if (M <= 64) return f(M64{});
  return f(Large{});
}

// The SM count of the current device, cached: the plan runs on every call.
int sm_count() {
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices] = {};
  int device = 0;
  cudaGetDevice(&device);
  if (device < 0 || device >= kMaxDevices) return qqq::device_sm_count();
  if (cached[device] == 0) cached[device] = qqq::device_sm_count();
  return cached[device];
}

}  // namespace

int64_t qqq_gemm_workspace_bytes(int64_t M, int64_t N, int64_t K, bool grouped) {
  (void)grouped;
  return with_config(M, [&](auto c) { return qqq::make_plan<decltype(c)>(M, N, K, sm_count()).workspace_bytes(); });
}

const char* qqq_gemm_cuda(const QqqGemmArgs& args, void* stream) {
  return with_config(args.M, [&](auto c) -> const char* {
    using C = decltype(c);
    const Plan plan = qqq::make_plan<C>(args.M, args.N, args.K, sm_count());
    return args.s_group != nullptr ? qqq::launch<C, true>(args, plan, stream)
                                   : qqq::launch<C, false>(args, plan, stream);
  });
}

}  // namespace opforge
