// add2.cpp: the torch wrapper and the pybind11 module (the add2 tutorial's torch_launch_add2).
//
// The wrapper checks its tensors, then dispatches on their device: CUDA tensors
// go to the kernel in add2.cu, CPU tensors to a plain loop. opforge's pybind
// route (opforge.builder.inline.build_pybind_folder) compiles add2.cu and defines
// OPFORGE_WITH_CUDA only when it builds with CUDA; without it the CUDA branch
// is left out and this file alone makes the module.
#include <torch/extension.h>

#ifdef OPFORGE_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "add2.h"
#endif

namespace {

void add2_cpu(float* c, const float* a, const float* b, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        c[i] = a[i] + b[i];
    }
}

// The kernel reads raw pointers, so everything it assumes is checked here:
// a wrong tensor gives a Python error instead of wrong numbers or a crash.
void check_tensor(const torch::Tensor& t, const char* name, const torch::Tensor& c, int64_t n) {
    TORCH_CHECK(t.scalar_type() == torch::kFloat, "torch_launch_add2: ", name, " must be float32, got ", t.scalar_type());
    TORCH_CHECK(t.is_contiguous(), "torch_launch_add2: ", name, " must be contiguous");
    TORCH_CHECK(t.device() == c.device(), "torch_launch_add2: ", name, " is on ", t.device(), " but c is on ", c.device());
    TORCH_CHECK(t.numel() >= n, "torch_launch_add2: n = ", n, " but ", name, " has only ", t.numel(), " elements");
}

}  // namespace

// c[:n] = a[:n] + b[:n]. The tensors are handles: `const` keeps the handle, not the data, from changing.
void torch_launch_add2(const torch::Tensor& c, const torch::Tensor& a, const torch::Tensor& b, int64_t n) {
    TORCH_CHECK(n >= 0, "torch_launch_add2: n must be >= 0, got ", n);
    check_tensor(c, "c", c, n);
    check_tensor(a, "a", c, n);
    check_tensor(b, "b", c, n);
    if (c.is_cuda()) {
#ifdef OPFORGE_WITH_CUDA
        // The kernel runs on c's GPU, on the stream torch is using there.
        const c10::cuda::CUDAGuard guard(c.device());
        const cudaError_t err =
            launch_add2(c.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(), n, c10::cuda::getCurrentCUDAStream());
        TORCH_CHECK(err == cudaSuccess, "torch_launch_add2: kernel launch failed: ", cudaGetErrorString(err));
#else
        TORCH_CHECK(false, "torch_launch_add2: the tensors are on ", c.device(), " but this module was built without CUDA");
#endif
    } else {
        TORCH_CHECK(c.is_cpu(), "torch_launch_add2: unsupported device ", c.device());
        add2_cpu(c.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(), n);
    }
}

// The module's name is left to the build (TORCH_EXTENSION_NAME): opforge names the built file, and the two must match.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("torch_launch_add2", &torch_launch_add2, "c[:n] = a[:n] + b[:n] for float32 tensors on the CPU or a CUDA GPU", py::arg("c"),
          py::arg("a"), py::arg("b"), py::arg("n"));
}
