#pragma once
// The GEMM as a C++ function: the checks, the output and the CPU or CUDA
// kernel. The opforge::gemm operator (gemm.cpp's OPFORGE_LIBRARY_FRAGMENT)
// runs it for the CPU and CUDA dispatch keys; other C++ may call it directly,
// without the dispatcher, and so without autograd. It takes and returns
// torch::stable::Tensor: the library is built on the stable ABI.

#include "opforge/stable/common.h"

namespace opforge {

// C [M, N] = a [M, K] @ b [K, N], one floating dtype, a new row-major tensor.
Tensor gemm(const Tensor& a, const Tensor& b);

}  // namespace opforge
