// The W4A8 GEMM's launcher behind qqq_gemm_kernel.h: qqq_dispatch.cuh plans
// and runs it (the kernels in qqq_mma.cuh, qqq_direct.cuh and qqq_ws.cuh, the
// packed layout in LAYOUT.md).
#include "qqq_dispatch.cuh"
#include "qqq_gemm_kernel.h"

namespace opforge {

int64_t qqq_gemm_workspace_bytes(int64_t M, int64_t N, int64_t K, int64_t group_size) {
  return qqq::workspace_bytes(M, N, K, group_size);
}

const char* qqq_gemm_cuda(const QqqGemmArgs& args, void* stream) { return qqq::dispatch(args, stream); }

}  // namespace opforge
