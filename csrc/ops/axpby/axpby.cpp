// axpby: seed 004's my_op (3x - y, with its hand-written backward) generalised
// to alpha * x + beta * y. The backward is an operator of its own so that
// autograd, torch.compile and export see one fused kernel for both gradients.

#include <tuple>

#include "axpby_kernel.h"
#include "opforge/common.h"

namespace opforge {
namespace {

constexpr const char* kAxpby = "opforge::axpby";
constexpr const char* kAxpbyBackward = "opforge::axpby_backward";

at::Tensor axpby(const at::Tensor& x, const at::Tensor& y, double alpha, double beta) {
  check_floating(kAxpby, "x", x);
  check_same(kAxpby, "x", x, "y", y);
  const at::Tensor xc = x.contiguous();
  const at::Tensor yc = y.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t n = out.numel();
  run_kernel(
      kAxpby, out,
      [&](auto stream) {
        return axpby_cuda(to_dtype(out.scalar_type()), out.data_ptr(), xc.const_data_ptr(),
                          yc.const_data_ptr(), alpha, beta, n, stream);
      },
      [&] {
        OPFORGE_DISPATCH_FLOATING(out.scalar_type(), "opforge::axpby", [&] {
          using acc_t = at::opmath_type<scalar_t>;
          const acc_t a = static_cast<acc_t>(alpha);
          const acc_t b = static_cast<acc_t>(beta);
          scalar_t* o = out.data_ptr<scalar_t>();
          const scalar_t* u = xc.const_data_ptr<scalar_t>();
          const scalar_t* v = yc.const_data_ptr<scalar_t>();
          parallel_for_each(n, [=](int64_t i) {
            o[i] = static_cast<scalar_t>(a * static_cast<acc_t>(u[i]) + b * static_cast<acc_t>(v[i]));
          });
        });
      });
  return out;
}

std::tuple<at::Tensor, at::Tensor> axpby_backward(const at::Tensor& grad, double alpha,
                                                  double beta) {
  check_floating(kAxpbyBackward, "grad", grad);
  const at::Tensor gc = grad.contiguous();
  at::Tensor grad_x = at::empty(grad.sizes(), grad.options());
  at::Tensor grad_y = at::empty(grad.sizes(), grad.options());
  const int64_t n = gc.numel();
  run_kernel(
      kAxpbyBackward, grad_x,
      [&](auto stream) {
        return axpby_backward_cuda(to_dtype(gc.scalar_type()), grad_x.data_ptr(), grad_y.data_ptr(),
                                   gc.const_data_ptr(), alpha, beta, n, stream);
      },
      [&] {
        OPFORGE_DISPATCH_FLOATING(gc.scalar_type(), "opforge::axpby_backward", [&] {
          using acc_t = at::opmath_type<scalar_t>;
          const acc_t a = static_cast<acc_t>(alpha);
          const acc_t b = static_cast<acc_t>(beta);
          scalar_t* gx = grad_x.data_ptr<scalar_t>();
          scalar_t* gy = grad_y.data_ptr<scalar_t>();
          const scalar_t* g = gc.const_data_ptr<scalar_t>();
          parallel_for_each(n, [=](int64_t i) {
            const acc_t t = static_cast<acc_t>(g[i]);
            gx[i] = static_cast<scalar_t>(a * t);
            gy[i] = static_cast<scalar_t>(b * t);
          });
        });
      });
  return {grad_x, grad_y};
}

void register_kernels(torch::Library& m) {
  m.impl("axpby", &axpby);
  m.impl("axpby_backward", &axpby_backward);
}

}  // namespace
}  // namespace opforge

TORCH_LIBRARY_FRAGMENT(opforge, m) {
  m.def("axpby(Tensor x, Tensor y, float alpha=3.0, float beta=-1.0) -> Tensor");
  m.def("axpby_backward(Tensor grad, float alpha, float beta) -> (Tensor, Tensor)");
}

OPFORGE_REGISTER_KERNELS(opforge, opforge::register_kernels)
