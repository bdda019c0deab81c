// The QQQ GEMM tutorial's module declaration. TORCH_EXTENSION_NAME is the extension's name
// from setup.py (qqq_gemm_ext), defined by torch's BuildExtension.
#include <torch/extension.h>

#include "qqq_gemm.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "W4A8 GEMM (int8 activations x int4 weights), opforge's kernel built by setup.py";
  m.def("qqq_gemm", &qqq_gemm, "INT8 x INT4 matmul (the QQQ method, Marlin-style kernel)", pybind11::arg("a"),
        pybind11::arg("w_packed"), pybind11::arg("s_tok"), pybind11::arg("s_ch"), pybind11::arg("s_group") = pybind11::none(),
        pybind11::arg("group_size") = -1);
}
