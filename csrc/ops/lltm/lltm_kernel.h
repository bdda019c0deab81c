#pragma once
// Launchers of the LLTM cell's fused elementwise kernels (the PyTorch C++/CUDA
// extension tutorial's example, which the autograd tutorial points to). The gate matmuls
// run in cuBLAS through ATen (lltm.cpp); these kernels do everything between
// and around them in one pass each. Raw pointers, contiguous row-major
// tensors, no torch headers.

#include <cstdint>

#include "opforge/dtype.h"

namespace opforge {

// gates [batch, 3 * state] holds the gate pre-activations on entry and the
// activated gates [input_gate | output_gate | candidate_cell] on return
// (in place: each element is read and then written by the same thread).
// old_cell, new_h and new_cell are [batch, state]. Returns nullptr or the CUDA
// error.
const char* lltm_forward_cuda(DType dtype, void* gates, const void* old_cell, void* new_h,
                              void* new_cell, int64_t batch, int64_t state, void* stream);

// The backward's elementwise pass. Null pointers stand for what autograd does
// not hand in or does not want: a null grad_h, grad_cell or grad_gates is a
// zero gradient, a null d_old_cell is not written. grad_h and grad_cell are
// read through their strides (the [1, 1]-expanded gradient of a sum() arrives
// with strides 0, 0 and is not copied first); every other tensor is
// contiguous: d_gates and grad_gates [batch, 3 * state], new_cell [batch,
// state], gates as the forward left it.
struct LltmBackwardArgs {
  void* d_gates;
  void* d_old_cell;
  const void* grad_h;
  int64_t grad_h_strides[2];
  const void* grad_cell;
  int64_t grad_cell_strides[2];
  const void* grad_gates;
  const void* new_cell;
  const void* gates;
  int64_t batch;
  int64_t state;
};

// Returns nullptr or the CUDA error.
const char* lltm_backward_cuda(DType dtype, const LltmBackwardArgs& args, void* stream);

// out[j] = sum over rows of x[r, j] (x [rows, cols] contiguous, out [cols]):
// d_bias from d_gates, accumulated in float32 (float64 for float64), in a
// fixed order. rows may be 0 (zeros). Returns nullptr or the CUDA error.
const char* lltm_column_sum_cuda(DType dtype, const void* x, void* out, int64_t rows, int64_t cols, void* stream);

}  // namespace opforge
