// gemm_pybind.cpp: the GEMM tutorial's pybind11 interface, over opforge's GEMM.
//
// The tutorial's wrapper (gemm_torch_wrapper(c, a, b)) casts three float32 CUDA
// tensors to raw pointers and launches its kernel. Here the function bound is
// opforge::gemm from csrc/ops/gemm/gemm.h: the operator's own C++ function,
// with its checks, every floating dtype, the CPU kernel and the CUDA one. It
// returns C instead of writing into a c the caller allocated.
//
// A pybind11 function is called directly, not through the dispatcher: no
// autograd, no torch.compile. The same library also registers the operator
// (gemm.cpp's STABLE_TORCH_LIBRARY_FRAGMENT), which is the way to get both.
//
// opforge::gemm is on PyTorch's stable ABI: it takes and returns
// torch::stable::Tensor, while pybind11's tensor caster (torch/csrc/utils/
// pybind.h) speaks at::Tensor. The adapter below converts between the two:
// a stable tensor is a handle to an at::Tensor, as in AOTInductor's shim.
// This file stays on ATen and takes only the stable Tensor class, not gemm.h:
// gemm.h brings in opforge's stable helpers, which define TORCH_TARGET_VERSION,
// and with it defined torch's ATen and Python headers compile to nothing.

#include <c10/util/Exception.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <stdexcept>

namespace opforge {
// gemm.h's declaration (opforge::Tensor is torch::stable::Tensor), compiled
// in gemm.cpp.
torch::stable::Tensor gemm(const torch::stable::Tensor& a, const torch::stable::Tensor& b);
}  // namespace opforge

namespace {

// A stable tensor that holds a new reference to `t`: the handle is an
// at::Tensor* of its own, deleted with the stable tensor.
torch::stable::Tensor to_stable(const at::Tensor& t) {
  return torch::stable::Tensor(torch::aot_inductor::new_tensor_handle(at::Tensor(t)));
}

at::Tensor gemm(const at::Tensor& a, const at::Tensor& b) {
  try {
    const torch::stable::Tensor c = opforge::gemm(to_stable(a), to_stable(b));
    return *torch::aot_inductor::tensor_handle_to_tensor_pointer(c.get());
  } catch (const std::invalid_argument& e) {
    // The stable ABI has no c10 error types: a wrong dtype comes as
    // std::invalid_argument, which torch.ops raises as ValueError but torch's
    // pybind11 translation would raise as RuntimeError. As c10's ValueError
    // both doors raise the same.
    C10_THROW_ERROR(ValueError, e.what());
  }
}

}  // namespace

// TORCH_EXTENSION_NAME: each route sets it to the module's file name (opforge's
// JIT build and setuptools from the extension's name, CMake by a definition).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // wrap_pybind_function_no_gil: torch's error translation, and the GIL
  // released while it runs.
  m.def("gemm", torch::wrap_pybind_function_no_gil(&gemm),
        "C = a @ b for a [M, K] and b [K, N] (opforge::gemm's C++ function, called directly)",
        pybind11::arg("a"), pybind11::arg("b"));
}
