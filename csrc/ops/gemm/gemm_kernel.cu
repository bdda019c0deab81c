// The GEMM launcher behind gemm_kernel.h: gemm_dispatch.cuh picks the kernel.
#include "gemm_dispatch.cuh"
#include "gemm_kernel.h"

namespace opforge {

const char* gemm_cuda(DType dtype, const void* a, const void* b, void* c, int64_t M, int64_t N, int64_t K,
                      void* stream) {
  const gemm::Problem p{a, b, c, M, N, K};
  return gemm::dispatch(dtype, p, static_cast<cudaStream_t>(stream));
}

}  // namespace opforge
