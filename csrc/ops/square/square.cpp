// square: the load_inline tutorial's square_matrix kernel (load_inline) as an elementwise
// dispatcher operator over any shape.

#include "opforge/stable/common.h"
#include "opforge/stable/cpu_vec.h"
#include "opforge/stable/elementwise.h"
#include "square_kernel.h"

namespace opforge {
namespace {

constexpr const char* kSquare = "opforge::square";

struct SquareOp {
  static constexpr int kIn = 1;
  static constexpr int kOut = 1;
  template <typename A>
  void operator()(const A* x, A* y) const {
    y[0] = x[0] * x[0];
  }
#ifdef OPFORGE_X86_AVX2
  OPFORGE_AVX2 void operator()(const __m256* x, __m256* y) const {
    y[0] = _mm256_mul_ps(x[0], x[0]);
  }
  static constexpr bool kAvx512 = true;
  OPFORGE_AVX512 void operator()(const __m512* x, __m512* y) const { y[0] = _mm512_mul_ps(x[0], x[0]); }
#endif
};

Tensor square(const Tensor& x) {
  check_floating(kSquare, "x", x);
  const DenseLayout layout(x);
  const Tensor xd = layout.input(x);
  Tensor out = layout.new_output(x);
  const int64_t n = out.numel();
  run_kernel(
      kSquare, out,
      [&](auto stream) {
        return square_cuda(to_dtype(dtype_of(out)), out.mutable_data_ptr(), xd.const_data_ptr(), n,
                           stream);
      },
      [&] {
        OPFORGE_DISPATCH_FLOATING(dtype_of(out), "opforge::square", [&] {
          cpu::for_each_element<scalar_t>(SquareOp{}, n, {data_as<scalar_t>(xd)},
                                          {mutable_data_as<scalar_t>(out)});
        });
      });
  return out;
}

void register_square_kernels(Library& m) { m.impl("square", TORCH_BOX(&square)); }

}  // namespace
}  // namespace opforge

OPFORGE_LIBRARY_FRAGMENT(opforge, m) { m.def("square(Tensor x) -> Tensor"); }

OPFORGE_REGISTER_KERNELS(opforge, opforge::register_square_kernels)
