#pragma once
// The QQQ GEMM tutorial's qqq_gemm as a plain torch function for a pybind11 module: int8
// activations [M, K] x int4 weights packed by opforge.quant -> float16 [M, N].
// On CUDA tensors it runs opforge's kernel (csrc/ops/qqq_gemm/qqq_gemm_kernel.cu,
// compiled into this extension by setup.py); on CPU tensors, a short loop here.

// Only ATen's Tensor here, not torch/extension.h: qqq_gemm.cpp then compiles
// in seconds; pybind.cpp, which needs pybind11 and torch's type casters,
// includes the heavy header once.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

at::Tensor qqq_gemm(const at::Tensor& a, const at::Tensor& w_packed, const at::Tensor& s_tok, const at::Tensor& s_ch,
                    const std::optional<at::Tensor>& s_group, int64_t group_size);
