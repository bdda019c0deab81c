#pragma once
// The GEMM as a C++ function: the checks, the output and the CPU or CUDA
// kernel. The opforge::gemm operator (gemm.cpp's TORCH_LIBRARY_FRAGMENT) runs
// it for the CPU and CUDA dispatch keys; a pybind11 module may call it directly
// (examples/gemm), without the dispatcher, and so without autograd.

#include <ATen/core/Tensor.h>

namespace opforge {

// C [M, N] = a [M, K] @ b [K, N], one floating dtype, a new row-major tensor.
at::Tensor gemm(const at::Tensor& a, const at::Tensor& b);

}  // namespace opforge
