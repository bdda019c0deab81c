// my_op.h: the autograd tutorial's operator z = 3x - y, its forward and its backward.
#pragma once

#include <torch/extension.h>

#include <vector>

// z = 3 * x - y, for x and y of one shape, dtype and device.
torch::Tensor my_op_forward(const torch::Tensor& x, const torch::Tensor& y);

// The gradients of x and y given dL/dz: dz/dx = 3 and dz/dy = -1, so {3 * grad, -grad}.
std::vector<torch::Tensor> my_op_backward(const torch::Tensor& grad_output);
