#pragma once
#include <cstdint>
#include "opforge/dtype.h"
namespace opforge {
// C[M, N] = A[M, K] @ B[K, N]. A, B and C are row-major and contiguous, one dtype
// (float32, float16, bfloat16 or float64); accumulation in float32 (float64 for
// float64). M, N, K >= 1: the caller returns early for an empty C and writes
// zeros itself when K == 0. Returns nullptr or CUDA's / opforge's error message.
const char* gemm_cuda(DType dtype, const void* a, const void* b, void* c, int64_t M, int64_t N,
                      int64_t K, void* stream);
}  // namespace opforge
