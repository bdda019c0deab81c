#pragma once
// Launchers of the axpby kernels: the autograd tutorial's my_op (3x - y) generalised to
// alpha * x + beta * y, with its fused backward.

#include <cstdint>

#include "opforge/dtype.h"

namespace opforge {

// out[i] = alpha * x[i] + beta * y[i]. Returns nullptr or the CUDA error.
const char* axpby_cuda(DType dtype, void* out, const void* x, const void* y, double alpha,
                       double beta, int64_t n, void* stream);

// grad_x[i] = alpha * grad[i], grad_y[i] = beta * grad[i], one pass over grad.
const char* axpby_backward_cuda(DType dtype, void* grad_x, void* grad_y, const void* grad,
                                double alpha, double beta, int64_t n, void* stream);

}  // namespace opforge
