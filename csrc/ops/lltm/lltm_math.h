#pragma once
// The LLTM cell's elementwise math, written once for both backends: lltm.cpp's
// CPU loop and lltm_kernel.cu's CUDA kernels include this header, so the two
// cannot drift apart. No torch header, so plain nvcc compiles it (CI).
//
// U is the opmath type (float for float32/float16/bfloat16, double for
// float64): half types are loaded, computed in float32 and rounded once at the
// store, as PyTorch's own elementwise kernels do.

#include <math.h>

#ifdef __CUDACC__
#define OPFORGE_LLTM_HD __host__ __device__ __forceinline__
#else
#define OPFORGE_LLTM_HD inline
#endif

namespace opforge::lltm {

// Overloads rather than <cmath>'s std:: templates: these names resolve to
// CUDA's device functions inside kernels and to libm on the host.
OPFORGE_LLTM_HD float exp_u(float x) { return ::expf(x); }
OPFORGE_LLTM_HD double exp_u(double x) { return ::exp(x); }
OPFORGE_LLTM_HD float expm1_u(float x) { return ::expm1f(x); }
OPFORGE_LLTM_HD double expm1_u(double x) { return ::expm1(x); }
OPFORGE_LLTM_HD float tanh_u(float x) { return ::tanhf(x); }
OPFORGE_LLTM_HD double tanh_u(double x) { return ::tanh(x); }
OPFORGE_LLTM_HD float abs_u(float x) { return ::fabsf(x); }
OPFORGE_LLTM_HD double abs_u(double x) { return ::fabs(x); }

// 1 / (1 + e^-x) for x >= 0, e^x / (1 + e^x) for x < 0: e^-|x| never
// overflows, and far below 0 the result is e^x itself, subnormal in float
// below -87.3 (1 / (1 + e^-x) would give 0 once e^-x overflows, below -88.72).
template <typename U>
OPFORGE_LLTM_HD U sigmoid(U x) {
  const U e = exp_u(-abs_u(x));
  return (x < U(0) ? e : U(1)) / (U(1) + e);
}

// ELU with alpha = 1. expm1, not exp - 1: near 0 the subtraction would cancel
// every significant bit that torch's elu (which uses expm1) keeps.
template <typename U>
OPFORGE_LLTM_HD U elu(U x) {
  return x > U(0) ? x : expm1_u(x);
}

// One (row, state) element of the forward: the three gate pre-activations
// (from the matmul) and the old cell in; the activated gates, the new cell and
// the new hidden state out.
template <typename U>
struct ForwardElement {
  U input_gate, output_gate, candidate_cell, new_cell, new_h;
};

template <typename U>
OPFORGE_LLTM_HD ForwardElement<U> forward_element(U g_input, U g_output, U g_cell, U old_cell) {
  ForwardElement<U> r;
  r.input_gate = sigmoid(g_input);
  r.output_gate = sigmoid(g_output);
  r.candidate_cell = elu(g_cell);
  r.new_cell = old_cell + r.candidate_cell * r.input_gate;
  // From the unrounded cell: in half types new_h must not inherit new_cell's
  // storage rounding on top of its own.
  r.new_h = tanh_u(r.new_cell) * r.output_gate;
  return r;
}

// One (row, state) element of the backward. Inputs: the incoming gradients of
// new_h and new_cell, the saved new_cell and activated gates, and the incoming
// gradients of the gates output (zero when the caller has none). Outputs: the
// gradients of the three gate pre-activations and of old_cell.
template <typename U>
struct BackwardElement {
  U d_input_gate, d_output_gate, d_candidate_cell, d_old_cell;
};

template <typename U>
OPFORGE_LLTM_HD BackwardElement<U> backward_element(U grad_h, U grad_cell, U new_cell, U input_gate,
                                                    U output_gate, U candidate_cell, U grad_ig,
                                                    U grad_og, U grad_cc) {
  // tanh is recomputed rather than saved: one transcendental per element is
  // cheaper than a [batch, state] tensor written in the forward and read here.
  const U t = tanh_u(new_cell);
  const U d_new_cell = grad_cell + grad_h * output_gate * (U(1) - t * t);
  const U d_ig = d_new_cell * candidate_cell + grad_ig;
  const U d_og = grad_h * t + grad_og;
  const U d_cc = d_new_cell * input_gate + grad_cc;
  // Each derivative from the activation's output, so the pre-activations need
  // not be saved: sigmoid' = s (1 - s); elu'(z) = 1 for z > 0, else
  // exp(z) = elu(z) + 1 (and elu(z) > 0 exactly when z > 0).
  BackwardElement<U> r;
  r.d_input_gate = d_ig * input_gate * (U(1) - input_gate);
  r.d_output_gate = d_og * output_gate * (U(1) - output_gate);
  r.d_candidate_cell = d_cc * (candidate_cell > U(0) ? U(1) : candidate_cell + U(1));
  r.d_old_cell = d_new_cell;
  return r;
}

}  // namespace opforge::lltm
