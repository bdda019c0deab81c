// axpby: the autograd tutorial's my_op (3x - y, with its hand-written backward) generalised
// to alpha * x + beta * y. The backward is an operator of its own so that
// autograd, torch.compile and export see one fused kernel for both gradients.

#include <tuple>

#include "axpby_kernel.h"
#include "opforge/stable/common.h"
#include "opforge/stable/cpu_vec.h"
#include "opforge/stable/elementwise.h"

namespace opforge {
namespace {

constexpr const char* kAxpby = "opforge::axpby";
constexpr const char* kAxpbyBackward = "opforge::axpby_backward";

template <typename A>
struct AxpbyOp {
  static constexpr int kIn = 2;
  static constexpr int kOut = 1;
  A alpha;
  A beta;
  void operator()(const A* x, A* y) const { y[0] = alpha * x[0] + beta * x[1]; }
#ifdef OPFORGE_X86_AVX2
  OPFORGE_AVX2 void operator()(const __m256* x, __m256* y) const {
    const __m256 by = _mm256_mul_ps(_mm256_set1_ps(beta), x[1]);
    y[0] = _mm256_fmadd_ps(_mm256_set1_ps(alpha), x[0], by);
  }
  static constexpr bool kAvx512 = true;
  OPFORGE_AVX512 void operator()(const __m512* x, __m512* y) const {
    const __m512 by = _mm512_mul_ps(_mm512_set1_ps(beta), x[1]);
    y[0] = _mm512_fmadd_ps(_mm512_set1_ps(alpha), x[0], by);
  }
#endif
};

// Reads grad once and writes both gradients: 3 tensors of traffic instead of
// the 4 that two separate scalings would move.
template <typename A>
struct AxpbyBackwardOp {
  static constexpr int kIn = 1;
  static constexpr int kOut = 2;
  A alpha;
  A beta;
  void operator()(const A* x, A* y) const {
    y[0] = alpha * x[0];
    y[1] = beta * x[0];
  }
#ifdef OPFORGE_X86_AVX2
  OPFORGE_AVX2 void operator()(const __m256* x, __m256* y) const {
    y[0] = _mm256_mul_ps(_mm256_set1_ps(alpha), x[0]);
    y[1] = _mm256_mul_ps(_mm256_set1_ps(beta), x[0]);
  }
  static constexpr bool kAvx512 = true;
  OPFORGE_AVX512 void operator()(const __m512* x, __m512* y) const {
    y[0] = _mm512_mul_ps(_mm512_set1_ps(alpha), x[0]);
    y[1] = _mm512_mul_ps(_mm512_set1_ps(beta), x[0]);
  }
#endif
};

Tensor axpby(const Tensor& x, const Tensor& y, double alpha, double beta) {
  check_floating(kAxpby, "x", x);
  check_same(kAxpby, "x", x, "y", y);
  const DenseLayout layout(x, y);
  const Tensor xd = layout.input(x);
  const Tensor yd = layout.input(y);
  Tensor out = layout.new_output(x);
  const int64_t n = out.numel();
  run_kernel(
      kAxpby, out,
      [&](auto stream) {
        return axpby_cuda(to_dtype(dtype_of(out)), out.mutable_data_ptr(), xd.const_data_ptr(),
                          yd.const_data_ptr(), alpha, beta, n, stream);
      },
      [&] {
        OPFORGE_DISPATCH_FLOATING(dtype_of(out), "opforge::axpby", [&] {
          using A = opmath_t<scalar_t>;
          const AxpbyOp<A> f{static_cast<A>(alpha), static_cast<A>(beta)};
          cpu::for_each_element<scalar_t>(
              f, n, {data_as<scalar_t>(xd), data_as<scalar_t>(yd)},
              {mutable_data_as<scalar_t>(out)});
        });
      });
  return out;
}

std::tuple<Tensor, Tensor> axpby_backward(const Tensor& grad, double alpha,
                                                  double beta) {
  check_floating(kAxpbyBackward, "grad", grad);
  const DenseLayout layout(grad);
  const Tensor gd = layout.input(grad);
  Tensor grad_x = layout.new_output(grad);
  Tensor grad_y = layout.new_output(grad);
  const int64_t n = gd.numel();
  run_kernel(
      kAxpbyBackward, grad_x,
      [&](auto stream) {
        return axpby_backward_cuda(to_dtype(dtype_of(gd)), grad_x.mutable_data_ptr(), grad_y.mutable_data_ptr(),
                                   gd.const_data_ptr(), alpha, beta, n, stream);
      },
      [&] {
        OPFORGE_DISPATCH_FLOATING(dtype_of(gd), "opforge::axpby_backward", [&] {
          using A = opmath_t<scalar_t>;
          const AxpbyBackwardOp<A> f{static_cast<A>(alpha), static_cast<A>(beta)};
          cpu::for_each_element<scalar_t>(
              f, n, {data_as<scalar_t>(gd)},
              {mutable_data_as<scalar_t>(grad_x), mutable_data_as<scalar_t>(grad_y)});
        });
      });
  return {grad_x, grad_y};
}

void register_axpby_kernels(Library& m) {
  m.impl("axpby", TORCH_BOX(&axpby));
  m.impl("axpby_backward", TORCH_BOX(&axpby_backward));
}

}  // namespace
}  // namespace opforge

OPFORGE_LIBRARY_FRAGMENT(opforge, m) {
  m.def("axpby(Tensor x, Tensor y, float alpha=3.0, float beta=-1.0) -> Tensor");
  m.def("axpby_backward(Tensor grad, float alpha, float beta) -> (Tensor, Tensor)");
}

OPFORGE_REGISTER_KERNELS(opforge, opforge::register_axpby_kernels)
