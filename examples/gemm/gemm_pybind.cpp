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
// (gemm.cpp's TORCH_LIBRARY_FRAGMENT), which is the way to get both.

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include "gemm.h"

// TORCH_EXTENSION_NAME: each route sets it to the module's file name (opforge's
// JIT build and setuptools from the extension's name, CMake by a definition).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // wrap_pybind_function_no_gil: torch's error translation (a TORCH_CHECK_TYPE
  // is a TypeError, as through torch.ops), and the GIL released while it runs.
  m.def("gemm", torch::wrap_pybind_function_no_gil(&opforge::gemm),
        "C = a @ b for a [M, K] and b [K, N] (opforge::gemm's C++ function, called directly)",
        pybind11::arg("a"), pybind11::arg("b"));
}
