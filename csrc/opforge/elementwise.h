#pragma once
// Operands of an elementwise operator laid out for kernels that walk memory
// linearly, with the result in the layout torch's own elementwise ops give it
// (TensorIterator's rules): a transposed, channels_last or permuted input is
// read where it lies and the result comes back in its layout. Only inputs
// that are really scattered in another order (a strided slice, an expanded
// tensor, one operand laid out unlike the others) are copied, once, into the
// result's layout.

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/MemoryFormat.h>
#include <c10/util/DimVector.h>
#include <c10/util/strides.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <utility>

namespace opforge {

// The strides of the result torch's elementwise ops (TensorIterator) give to
// `inputs` of one shape: contiguous, channels_last or the one shared dense
// layout when every input has it; otherwise a dense layout whose dimension
// order follows the inputs' strides, the first input deciding ties it can.
inline c10::DimVector result_strides(at::ArrayRef<at::Tensor> inputs) {
  const at::IntArrayRef sizes = inputs[0].sizes();
  bool contiguous = true;
  bool channels_last = true;
  bool shared_dense = true;
  for (const at::Tensor& t : inputs) {
    contiguous = contiguous && t.is_contiguous();
    channels_last = channels_last && t.is_contiguous(at::MemoryFormat::ChannelsLast);
    shared_dense = shared_dense && t.is_non_overlapping_and_dense() &&
                   t.strides() == inputs[0].strides();
  }
  if (contiguous) return c10::contiguous_strides(sizes);
  if (channels_last) {
    const auto s = c10::get_channels_last_strides_2d(sizes);
    return c10::DimVector(s.begin(), s.end());
  }
  if (shared_dense) return c10::DimVector(inputs[0].strides().begin(), inputs[0].strides().end());

  // perm[0] is the dimension that varies fastest in memory. An insertion
  // sort that leaves dimensions in place where no input orders them
  // (a broadcast stride 0, equal strides and sizes), as TensorIterator does.
  const auto nd = static_cast<int64_t>(sizes.size());
  c10::DimVector perm(nd);
  for (int64_t i = 0; i < nd; ++i) perm[i] = nd - 1 - i;
  auto should_swap = [&](int64_t d0, int64_t d1) {
    for (const at::Tensor& t : inputs) {
      const int64_t s0 = t.stride(d0);
      const int64_t s1 = t.stride(d1);
      if (s0 == 0 || s1 == 0) continue;
      if (s0 != s1) return s0 < s1 ? -1 : 1;
      if (sizes[d0] > sizes[d1]) return 1;
    }
    return 0;
  };
  for (int64_t i = 1; i < nd; ++i) {
    int64_t d1 = i;
    for (int64_t d0 = i - 1; d0 >= 0; --d0) {
      const int c = should_swap(perm[d0], perm[d1]);
      if (c > 0) {
        std::swap(perm[d0], perm[d1]);
        d1 = d0;
      } else if (c < 0) {
        break;
      }
    }
  }
  bool row_major = true;
  for (int64_t i = 0; i < nd; ++i) row_major = row_major && perm[i] == nd - 1 - i;
  if (row_major) return c10::contiguous_strides(sizes);
  c10::DimVector strides(nd);
  int64_t next = 1;
  for (int64_t i = 0; i < nd; ++i) {
    strides[perm[i]] = next;
    next *= sizes[perm[i]];
  }
  return strides;
}

// Whether `t` walks memory exactly as a dense tensor of `strides` does, so a
// linear kernel can read it in place: strides only matter where a dimension
// has more than one element, and an empty tensor has nothing to read.
inline bool walks_like(const at::Tensor& t, at::IntArrayRef strides) {
  if (t.numel() == 0) return true;
  const at::IntArrayRef sizes = t.sizes();
  const at::IntArrayRef own = t.strides();
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] > 1 && own[d] != strides[d]) return false;
  }
  return true;
}

// A dense layout that every operand of one elementwise call walks in the
// same order, so a kernel pairs element i of each buffer by memory position.
class DenseLayout {
 public:
  // The layout of the result torch would give for `inputs`.
  explicit DenseLayout(at::ArrayRef<at::Tensor> inputs)
      : sizes_(inputs[0].sizes()), strides_(result_strides(inputs)) {}
  // `t`'s own layout; `t` must be non-overlapping and dense.
  static DenseLayout of(const at::Tensor& t) { return DenseLayout(t.sizes(), t.strides()); }

  // `t` itself when it already walks in this layout, else a copy that does.
  at::Tensor input(const at::Tensor& t) const {
    if (walks_like(t, strides_)) return t;
    return at::empty_strided(sizes_, strides_, t.options()).copy_(t);
  }
  bool fits(const at::Tensor& t) const { return walks_like(t, strides_); }
  at::Tensor new_output(const at::TensorOptions& options) const {
    // On the CPU straight to the allocator, as TensorIterator allocates
    // torch's own results: through the dispatcher, a call after a cache flush
    // (the bench's way) took 3-7 us longer than torch's at 16 elements; this
    // way they are level (4 runs each, 2 cores).
    if (options.device().is_cpu()) return at::detail::empty_strided_cpu(sizes_, strides_, options);
    return at::empty_strided(sizes_, strides_, options);
  }

 private:
  DenseLayout(at::IntArrayRef sizes, at::IntArrayRef strides)
      : sizes_(sizes), strides_(strides.begin(), strides.end()) {}

  at::IntArrayRef sizes_;  // borrowed from an operand, which outlives the call
  c10::DimVector strides_;
};

// Runs `kernel(dst, dense_inputs...)` (every tensor dense in one layout) so
// that the result lands in `out`, which keeps its own strides as torch's out=
// ops do. The kernel runs in out's layout when out is dense and that copies
// no more than computing in the inputs' layout and copying the result into
// out afterwards would.
template <typename Kernel, typename... Inputs>
void into_out(const at::Tensor& out, Kernel&& kernel, const Inputs&... inputs) {
  const std::array<at::Tensor, sizeof...(Inputs)> in{inputs...};
  const DenseLayout natural(in);
  int natural_copies = 0;
  for (const at::Tensor& t : in) natural_copies += natural.fits(t) ? 0 : 1;
  if (out.is_non_overlapping_and_dense()) {
    const DenseLayout own = DenseLayout::of(out);
    int own_copies = 0;
    for (const at::Tensor& t : in) own_copies += own.fits(t) ? 0 : 1;
    if (own_copies <= natural_copies + (natural.fits(out) ? 0 : 1)) {
      kernel(out, own.input(inputs)...);
      return;
    }
  }
  const at::Tensor dense = natural.new_output(out.options());
  kernel(dense, natural.input(inputs)...);
  out.copy_(dense);
}

}  // namespace opforge
