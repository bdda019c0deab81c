#pragma once
// The W4A8 GEMM's CUDA launcher (qqq_gemm_kernel.cu): raw pointers, no torch
// headers. The packed layout and the quantisation scheme are in LAYOUT.md.

#include <cstdint>

#include "opforge/dtype.h"

namespace opforge {

struct QqqGemmArgs {
  const int8_t* a;          // [M, K] row-major, 16-byte aligned
  const int32_t* w;         // [K / 8, N] in the tiled layout, 16-byte aligned
  const float* s_tok;       // [M]
  const float* s_ch;        // [N], 16-byte aligned
  const int8_t* s_group;    // [K / group_size, N] row-major, 16-byte aligned; null per channel
  void* out;                // [M, N] row-major, of out_dtype (Float16, BFloat16 or Float32)
  int64_t M, N, K;          // N, K multiples of 32, K <= 131040
  int64_t group_size;       // -1 per channel, else a multiple of 32 dividing K
  DType out_dtype;
  void* workspace;          // qqq_gemm_workspace_bytes(...) bytes, 16-byte aligned (may be null if 0)
};

// Bytes of device workspace the launch needs on the current device (split-K
// partial sums and arrival counters; 0 when no split is needed). group_size as
// in QqqGemmArgs: the kernel, hence its splits, depends on it.
int64_t qqq_gemm_workspace_bytes(int64_t M, int64_t N, int64_t K, int64_t group_size);

// Enqueues the GEMM on `stream` (a cudaStream_t). Returns nullptr or the CUDA error.
const char* qqq_gemm_cuda(const QqqGemmArgs& args, void* stream);

}  // namespace opforge
