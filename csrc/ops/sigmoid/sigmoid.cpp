// sigmoid: the autograd tutorial's custom sigmoid, y = 1 / (1 + exp(-x)), with its own
// backward kernel grad * y * (1 - y) that needs only the saved output.

#include <cmath>

#include "opforge/stable/common.h"
#include "opforge/stable/cpu_vec.h"
#include "opforge/stable/elementwise.h"
#include "sigmoid_kernel.h"

namespace opforge {
namespace {

constexpr const char* kSigmoid = "opforge::sigmoid";
constexpr const char* kSigmoidBackward = "opforge::sigmoid_backward";

// 1 / (1 + exp(-x)), as e^x / (1 + e^x) for x < 0 (cpu_vec.h's sigmoid8 says
// why), with an exact division: at most 2.4 ulp from the float64 sigmoid over
// [-87, 87] (5.2M points), as torch's own, inside the float32 tolerance of 4
// ulp; below that, the subnormal e^x.
struct SigmoidOp {
  static constexpr int kIn = 1;
  static constexpr int kOut = 1;
  template <typename A>
  void operator()(const A* x, A* y) const {
    const A e = std::exp(-std::abs(x[0]));
    y[0] = (x[0] < A(0) ? e : A(1)) / (A(1) + e);
  }
#ifdef OPFORGE_X86_AVX2
  OPFORGE_AVX2 void operator()(const __m256* x, __m256* y) const { y[0] = cpu::sigmoid8(x[0]); }
  static constexpr bool kAvx512 = true;
  OPFORGE_AVX512 void operator()(const __m512* x, __m512* y) const { y[0] = cpu::sigmoid16(x[0]); }
#endif
};

struct SigmoidBackwardOp {
  static constexpr int kIn = 2;
  static constexpr int kOut = 1;
  template <typename A>
  void operator()(const A* x, A* y) const {
    y[0] = x[0] * x[1] * (A(1) - x[1]);
  }
#ifdef OPFORGE_X86_AVX2
  OPFORGE_AVX2 void operator()(const __m256* x, __m256* y) const {
    const __m256 rest = _mm256_sub_ps(_mm256_set1_ps(1.0f), x[1]);
    y[0] = _mm256_mul_ps(_mm256_mul_ps(x[0], x[1]), rest);
  }
  static constexpr bool kAvx512 = true;
  OPFORGE_AVX512 void operator()(const __m512* x, __m512* y) const {
    const __m512 rest = _mm512_sub_ps(_mm512_set1_ps(1.0f), x[1]);
    y[0] = _mm512_mul_ps(_mm512_mul_ps(x[0], x[1]), rest);
  }
#endif
};

Tensor sigmoid(const Tensor& x) {
  check_floating(kSigmoid, "x", x);
  const DenseLayout layout(x);
  const Tensor xd = layout.input(x);
  Tensor out = layout.new_output(x);
  const int64_t n = out.numel();
  run_kernel(
      kSigmoid, out,
      [&](auto stream) {
        return sigmoid_cuda(to_dtype(dtype_of(out)), out.mutable_data_ptr(), xd.const_data_ptr(), n,
                            stream);
      },
      [&] {
        OPFORGE_DISPATCH_FLOATING(dtype_of(out), "opforge::sigmoid", [&] {
          cpu::for_each_element<scalar_t>(SigmoidOp{}, n, {data_as<scalar_t>(xd)},
                                          {mutable_data_as<scalar_t>(out)});
        });
      });
  return out;
}

Tensor sigmoid_backward(const Tensor& grad, const Tensor& y) {
  check_floating(kSigmoidBackward, "grad", grad);
  check_same(kSigmoidBackward, "grad", grad, "y", y);
  const DenseLayout layout(grad, y);
  const Tensor gd = layout.input(grad);
  const Tensor yd = layout.input(y);
  Tensor out = layout.new_output(grad);
  const int64_t n = out.numel();
  run_kernel(
      kSigmoidBackward, out,
      [&](auto stream) {
        return sigmoid_backward_cuda(to_dtype(dtype_of(out)), out.mutable_data_ptr(),
                                     gd.const_data_ptr(), yd.const_data_ptr(), n, stream);
      },
      [&] {
        OPFORGE_DISPATCH_FLOATING(dtype_of(out), "opforge::sigmoid_backward", [&] {
          cpu::for_each_element<scalar_t>(
              SigmoidBackwardOp{}, n,
              {data_as<scalar_t>(gd), data_as<scalar_t>(yd)},
              {mutable_data_as<scalar_t>(out)});
        });
      });
  return out;
}

void register_sigmoid_kernels(Library& m) {
  m.impl("sigmoid", TORCH_BOX(&sigmoid));
  m.impl("sigmoid_backward", TORCH_BOX(&sigmoid_backward));
}

}  // namespace
}  // namespace opforge

OPFORGE_LIBRARY_FRAGMENT(opforge, m) {
  m.def("sigmoid(Tensor x) -> Tensor");
  m.def("sigmoid_backward(Tensor grad, Tensor y) -> Tensor");
}

OPFORGE_REGISTER_KERNELS(opforge, opforge::register_sigmoid_kernels)
