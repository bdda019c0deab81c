// add and add_out: the add2 tutorial's add2 (torch_launch_add2(c, a, b, n)) as a
// dispatcher operator, with a functional form and the tutorial's out= form.

#include "add_kernel.h"
#include "opforge/stable/common.h"
#include "opforge/stable/cpu_vec.h"
#include "opforge/stable/elementwise.h"

namespace opforge {
namespace {

constexpr const char* kAdd = "opforge::add";
constexpr const char* kAddOut = "opforge::add_out";

struct AddOp {
  static constexpr int kIn = 2;
  static constexpr int kOut = 1;
  template <typename A>
  void operator()(const A* x, A* y) const {
    y[0] = x[0] + x[1];
  }
#ifdef OPFORGE_X86_AVX2
  OPFORGE_AVX2 void operator()(const __m256* x, __m256* y) const {
    y[0] = _mm256_add_ps(x[0], x[1]);
  }
  static constexpr bool kAvx512 = true;
  OPFORGE_AVX512 void operator()(const __m512* x, __m512* y) const { y[0] = _mm512_add_ps(x[0], x[1]); }
#endif
};

// out = a + b over tensors of one dtype, device, size and dense layout.
void add_into(const char* op, const Tensor& out, const Tensor& a, const Tensor& b) {
  const int64_t n = out.numel();
  run_kernel(
      op, out,
      [&](auto stream) {
        return add_cuda(to_dtype(dtype_of(out)), out.mutable_data_ptr(), a.const_data_ptr(),
                        b.const_data_ptr(), n, stream);
      },
      [&] {
        OPFORGE_DISPATCH_FLOATING(dtype_of(out), "opforge::add", [&] {
          cpu::for_each_element<scalar_t>(
              AddOp{}, n, {data_as<scalar_t>(a), data_as<scalar_t>(b)},
              {mutable_data_as<scalar_t>(out)});
        });
      });
}

void check_inputs(const char* op, const Tensor& a, const Tensor& b) {
  check_floating(op, "a", a);
  check_same(op, "a", a, "b", b);
}

Tensor add(const Tensor& a, const Tensor& b) {
  check_inputs(kAdd, a, b);
  const DenseLayout layout(a, b);
  Tensor out = layout.new_output(a);
  add_into(kAdd, out, layout.input(a), layout.input(b));
  return out;
}

void add_out(const Tensor& a, const Tensor& b, Tensor& out) {
  check_inputs(kAddOut, a, b);
  check_out(kAddOut, out, a, {{"a", &a}, {"b", &b}});
  into_out(
      out,
      [](const Tensor& dst, const Tensor& x, const Tensor& y) {
        add_into(kAddOut, dst, x, y);
      },
      a, b);
}

void register_add_kernels(Library& m) {
  m.impl("add", TORCH_BOX(&add));
  m.impl("add_out", TORCH_BOX(&add_out));
}

}  // namespace
}  // namespace opforge

OPFORGE_LIBRARY_FRAGMENT(opforge, m) {
  m.def("add(Tensor a, Tensor b) -> Tensor");
  m.def("add_out(Tensor a, Tensor b, Tensor(a!) out) -> ()");
}

OPFORGE_REGISTER_KERNELS(opforge, opforge::register_add_kernels)
