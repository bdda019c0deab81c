// add and add_out: seed 003's add2 (torch_launch_add2(c, a, b, n)) as a
// dispatcher operator, with a functional form and the seed's out= form.

#include "add_kernel.h"
#include "opforge/common.h"

namespace opforge {
namespace {

constexpr const char* kAdd = "opforge::add";
constexpr const char* kAddOut = "opforge::add_out";

// out = a + b over contiguous tensors of one dtype, device and size.
void add_into(const char* op, const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  const int64_t n = out.numel();
  run_kernel(
      op, out,
      [&](auto stream) {
        return add_cuda(to_dtype(out.scalar_type()), out.data_ptr(), a.const_data_ptr(),
                        b.const_data_ptr(), n, stream);
      },
      [&] {
        OPFORGE_DISPATCH_FLOATING(out.scalar_type(), "opforge::add", [&] {
          using acc_t = at::opmath_type<scalar_t>;
          scalar_t* o = out.data_ptr<scalar_t>();
          const scalar_t* x = a.const_data_ptr<scalar_t>();
          const scalar_t* y = b.const_data_ptr<scalar_t>();
          parallel_for_each(n, [=](int64_t i) {
            o[i] = static_cast<scalar_t>(static_cast<acc_t>(x[i]) + static_cast<acc_t>(y[i]));
          });
        });
      });
}

void check_inputs(const char* op, const at::Tensor& a, const at::Tensor& b) {
  check_floating(op, "a", a);
  check_same(op, "a", a, "b", b);
}

at::Tensor add(const at::Tensor& a, const at::Tensor& b) {
  check_inputs(kAdd, a, b);
  at::Tensor out = at::empty(a.sizes(), a.options());
  add_into(kAdd, out, a.contiguous(), b.contiguous());
  return out;
}

void add_out(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  check_inputs(kAddOut, a, b);
  check_out(kAddOut, out, a, {{"a", &a}, {"b", &b}});
  if (out.is_contiguous()) {
    add_into(kAddOut, out, a.contiguous(), b.contiguous());
  } else {
    // The kernels walk memory linearly: compute into a dense buffer, then let
    // copy_ scatter it into out's layout.
    at::Tensor dense = at::empty(a.sizes(), a.options());
    add_into(kAddOut, dense, a.contiguous(), b.contiguous());
    out.copy_(dense);
  }
}

void register_kernels(torch::Library& m) {
  m.impl("add", &add);
  m.impl("add_out", &add_out);
}

}  // namespace
}  // namespace opforge

TORCH_LIBRARY_FRAGMENT(opforge, m) {
  m.def("add(Tensor a, Tensor b) -> Tensor");
  m.def("add_out(Tensor a, Tensor b, Tensor(a!) out) -> ()");
}

OPFORGE_REGISTER_KERNELS(opforge, opforge::register_kernels)
