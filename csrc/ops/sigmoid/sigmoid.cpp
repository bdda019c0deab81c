// sigmoid: seed 004's custom sigmoid, y = 1 / (1 + exp(-x)), with its own
// backward kernel grad * y * (1 - y) that needs only the saved output.

#include <cmath>

#include "opforge/common.h"
#include "sigmoid_kernel.h"

namespace opforge {
namespace {

constexpr const char* kSigmoid = "opforge::sigmoid";
constexpr const char* kSigmoidBackward = "opforge::sigmoid_backward";

at::Tensor sigmoid(const at::Tensor& x) {
  check_floating(kSigmoid, "x", x);
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t n = out.numel();
  run_kernel(
      kSigmoid, out,
      [&](auto stream) {
        return sigmoid_cuda(to_dtype(out.scalar_type()), out.data_ptr(), xc.const_data_ptr(), n,
                            stream);
      },
      [&] {
        OPFORGE_DISPATCH_FLOATING(out.scalar_type(), "opforge::sigmoid", [&] {
          using acc_t = at::opmath_type<scalar_t>;
          scalar_t* o = out.data_ptr<scalar_t>();
          const scalar_t* v = xc.const_data_ptr<scalar_t>();
          parallel_for_each(n, [=](int64_t i) {
            o[i] = static_cast<scalar_t>(acc_t(1) / (acc_t(1) + std::exp(-static_cast<acc_t>(v[i]))));
          });
        });
      });
  return out;
}

at::Tensor sigmoid_backward(const at::Tensor& grad, const at::Tensor& y) {
  check_floating(kSigmoidBackward, "grad", grad);
  check_same(kSigmoidBackward, "grad", grad, "y", y);
  const at::Tensor gc = grad.contiguous();
  const at::Tensor yc = y.contiguous();
  at::Tensor out = at::empty(grad.sizes(), grad.options());
  const int64_t n = out.numel();
  run_kernel(
      kSigmoidBackward, out,
      [&](auto stream) {
        return sigmoid_backward_cuda(to_dtype(out.scalar_type()), out.data_ptr(),
                                     gc.const_data_ptr(), yc.const_data_ptr(), n, stream);
      },
      [&] {
        OPFORGE_DISPATCH_FLOATING(out.scalar_type(), "opforge::sigmoid_backward", [&] {
          using acc_t = at::opmath_type<scalar_t>;
          scalar_t* o = out.data_ptr<scalar_t>();
          const scalar_t* g = gc.const_data_ptr<scalar_t>();
          const scalar_t* s = yc.const_data_ptr<scalar_t>();
          parallel_for_each(n, [=](int64_t i) {
            const acc_t t = static_cast<acc_t>(s[i]);
            o[i] = static_cast<scalar_t>(static_cast<acc_t>(g[i]) * t * (acc_t(1) - t));
          });
        });
      });
  return out;
}

void register_kernels(torch::Library& m) {
  m.impl("sigmoid", &sigmoid);
  m.impl("sigmoid_backward", &sigmoid_backward);
}

}  // namespace
}  // namespace opforge

TORCH_LIBRARY_FRAGMENT(opforge, m) {
  m.def("sigmoid(Tensor x) -> Tensor");
  m.def("sigmoid_backward(Tensor grad, Tensor y) -> Tensor");
}

OPFORGE_REGISTER_KERNELS(opforge, opforge::register_kernels)
