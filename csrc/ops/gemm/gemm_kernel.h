#pragma once
// The CUDA GEMM launcher: pure CUDA behind these declarations (gemm_kernel.cu
// and the gemm_*.cuh kernel headers), no torch headers, so CI compiles it with
// plain nvcc for sm_80 and sm_90a. gemm.cpp does the checks, allocates the
// workspace and calls it.
#include <cstddef>
#include <cstdint>
#include "opforge/dtype.h"
namespace opforge {
// Bytes of device workspace gemm_cuda needs for this call on the current
// device (0: none). It depends on the sizes, on the alignment of a, b and c
// (operands that TMA cannot read are padded into it) and on the device (its
// SM count decides whether float32/float64 split K, whose partial sums live
// in it). The same plan (gemm_dispatch.cuh, plan()) decides both this size and
// what gemm_cuda runs. Returns 0 where gemm_cuda will fail anyway (no device,
// a size < 1): gemm_cuda then says why.
size_t gemm_cuda_workspace(DType dtype, int64_t M, int64_t N, int64_t K, const void* a, const void* b,
                           const void* c);
// C[M, N] = A[M, K] @ B[K, N]. A, B and C are row-major and contiguous, one dtype
// (float32, float16, bfloat16 or float64); accumulation in float32 (float64 for
// float64). M, N, K >= 1: the caller returns early for an empty C and writes
// zeros itself when K == 0. workspace: at least gemm_cuda_workspace(...) bytes
// of device memory, 16-byte aligned, that nothing else uses until the work
// queued on `stream` is done (nullptr when that size is 0); with less, an
// error and nothing runs. The result does not depend on its contents.
// Returns nullptr or CUDA's / opforge's error message.
const char* gemm_cuda(DType dtype, const void* a, const void* b, void* c, int64_t M, int64_t N, int64_t K,
                      void* workspace, size_t workspace_bytes, void* stream);
}  // namespace opforge
