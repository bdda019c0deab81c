// my_op.cpp: my_op's forward and backward with ATen (so they run on whatever
// device their tensors are on), bound to Python by pybind11.
//
// torch's header first, though my_op.h includes it too: a file that begins with
// torch headers gets them precompiled, once, shared through opforge's cache.
#include <torch/extension.h>

#include "my_op.h"

torch::Tensor my_op_forward(const torch::Tensor& x, const torch::Tensor& y) {
    TORCH_CHECK(x.sizes() == y.sizes(), "my_op: x and y must have the same shape, got ", x.sizes(), " and ", y.sizes());
    TORCH_CHECK(x.scalar_type() == y.scalar_type(), "my_op: x and y must have the same dtype, got ", x.scalar_type(), " and ",
                y.scalar_type());
    TORCH_CHECK(x.device() == y.device(), "my_op: x and y must be on the same device, got ", x.device(), " and ", y.device());
    return x.mul(3).sub(y);
}

std::vector<torch::Tensor> my_op_backward(const torch::Tensor& grad_output) {
    // Scalars, not a torch::ones(sizes) factor: that would be a float32 CPU tensor,
    // wrong for a gradient on a GPU and a needless allocation everywhere.
    return {grad_output.mul(3), grad_output.neg()};
}

// TORCH_EXTENSION_NAME: the build names the module.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("forward", &my_op_forward, "my_op forward: 3 * x - y", py::arg("x"), py::arg("y"));
    m.def("backward", &my_op_backward, "my_op backward: [3 * grad, -grad]", py::arg("grad_output"));
}
