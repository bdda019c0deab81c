#pragma once
// Launchers of the sigmoid kernels (the autograd tutorial's custom sigmoid, forward and
// backward).

#include <cstdint>

#include "opforge/dtype.h"

namespace opforge {

// out[i] = 1 / (1 + exp(-x[i])). Returns nullptr or the CUDA error.
const char* sigmoid_cuda(DType dtype, void* out, const void* x, int64_t n, void* stream);

// grad_x[i] = grad[i] * y[i] * (1 - y[i]), y the forward's output.
const char* sigmoid_backward_cuda(DType dtype, void* grad_x, const void* grad, const void* y,
                                  int64_t n, void* stream);

}  // namespace opforge
