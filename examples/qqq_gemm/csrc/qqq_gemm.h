#pragma once
// Seed 000's qqq_gemm as a plain torch function for a pybind11 module: int8
// activations [M, K] x int4 weights packed by opforge.quant -> float16 [M, N].
// On CUDA tensors it runs opforge's kernel (csrc/ops/qqq_gemm/qqq_gemm_kernel.cu,
// compiled into this extension by setup.py); on CPU tensors, a short loop here.

#include <torch/extension.h>

#include <optional>

torch::Tensor qqq_gemm(const torch::Tensor& a, const torch::Tensor& w_packed, const torch::Tensor& s_tok,
                       const torch::Tensor& s_ch, const std::optional<torch::Tensor>& s_group, int64_t group_size);
