// The GEMM launcher behind gemm_kernel.h: gemm_dispatch.cuh plans and runs it.
#include "gemm_dispatch.cuh"
#include "gemm_kernel.h"

namespace opforge {

size_t gemm_cuda_workspace(DType dtype, int64_t M, int64_t N, int64_t K, const void* a, const void* b,
                           const void* c) {
  return gemm::workspace_bytes(dtype, gemm::Problem{a, b, const_cast<void*>(c), M, N, K});
}

const char* gemm_cuda(DType dtype, const void* a, const void* b, void* c, int64_t M, int64_t N, int64_t K,
                      void* workspace, size_t workspace_bytes, void* stream) {
  const gemm::Problem p{a, b, c, M, N, K};
  return gemm::dispatch(dtype, p, gemm::Workspace{workspace, workspace_bytes}, static_cast<cudaStream_t>(stream));
}

}  // namespace opforge
