// square: seed 002's square_matrix kernel (load_inline) as an elementwise
// dispatcher operator over any shape.

#include "opforge/common.h"
#include "square_kernel.h"

namespace opforge {
namespace {

constexpr const char* kSquare = "opforge::square";

at::Tensor square(const at::Tensor& x) {
  check_floating(kSquare, "x", x);
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t n = out.numel();
  run_kernel(
      kSquare, out,
      [&](auto stream) {
        return square_cuda(to_dtype(out.scalar_type()), out.data_ptr(), xc.const_data_ptr(), n,
                           stream);
      },
      [&] {
        OPFORGE_DISPATCH_FLOATING(out.scalar_type(), "opforge::square", [&] {
          using acc_t = at::opmath_type<scalar_t>;
          scalar_t* o = out.data_ptr<scalar_t>();
          const scalar_t* v = xc.const_data_ptr<scalar_t>();
          parallel_for_each(n, [=](int64_t i) {
            const acc_t t = static_cast<acc_t>(v[i]);
            o[i] = static_cast<scalar_t>(t * t);
          });
        });
      });
  return out;
}

void register_kernels(torch::Library& m) { m.impl("square", &square); }

}  // namespace
}  // namespace opforge

TORCH_LIBRARY_FRAGMENT(opforge, m) { m.def("square(Tensor x) -> Tensor"); }

OPFORGE_REGISTER_KERNELS(opforge, opforge::register_kernels)
