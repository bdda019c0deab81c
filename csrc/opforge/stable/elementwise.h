#pragma once
// Operands of an elementwise operator laid out for kernels that walk memory
// linearly, with the result in the layout torch's own elementwise ops give it
// (TensorIterator's rules): a transposed, channels_last or permuted input is
// read where it lies and the result comes back in its layout. Only inputs
// that are really scattered in another order (a strided slice, an expanded
// tensor, one operand laid out unlike the others) are copied, once, into the
// result's layout.

#include <algorithm>
#include <array>
#include <cstddef>
#include <iterator>
#include <utility>
#include <vector>

#include "opforge/stable/common.h"

namespace opforge {

// A shape or stride list: inline up to kInline dimensions (no allocation for the usual tensor,
// where a kernel call builds two of them), on the heap beyond.
class Strides {
 public:
  static constexpr size_t kInline = 8;
  Strides() = default;
  explicit Strides(size_t n) : n_(n) {
    if (n > kInline) heap_.resize(n);
    std::fill(data(), data() + n, int64_t{0});
  }
  template <typename It>
  Strides(It first, It last) : Strides(static_cast<size_t>(std::distance(first, last))) {
    std::copy(first, last, data());
  }
  // From a row-major stride list of common.h.
  Strides(const std::vector<int64_t>& v) : Strides(v.begin(), v.end()) {}  // NOLINT(google-explicit-constructor)
  Strides(const Strides& o) : Strides(o.begin(), o.end()) {}
  Strides& operator=(const Strides& o) {
    if (this != &o) *this = Strides(o);
    return *this;
  }
  Strides(Strides&& o) noexcept : n_(o.n_), inline_(o.inline_), heap_(std::move(o.heap_)) {}
  Strides& operator=(Strides&& o) noexcept {
    n_ = o.n_;
    inline_ = o.inline_;
    heap_ = std::move(o.heap_);
    return *this;
  }

  int64_t* data() { return n_ > kInline ? heap_.data() : inline_.data(); }
  const int64_t* data() const { return n_ > kInline ? heap_.data() : inline_.data(); }
  size_t size() const { return n_; }
  int64_t* begin() { return data(); }
  int64_t* end() { return data() + n_; }
  const int64_t* begin() const { return data(); }
  const int64_t* end() const { return data() + n_; }
  int64_t& operator[](size_t i) { return data()[i]; }
  const int64_t& operator[](size_t i) const { return data()[i]; }

 private:
  size_t n_ = 0;
  std::array<int64_t, kInline> inline_{};
  std::vector<int64_t> heap_;
};

// Row-major strides of `sizes`, without common.h's vector.
inline Strides row_major_strides(IntArrayRef sizes) {
  Strides strides(sizes.size());
  int64_t next = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    strides[i] = next;
    next *= sizes[i] > 1 ? sizes[i] : 1;
  }
  return strides;
}

inline IntArrayRef ref(const Strides& s) { return IntArrayRef(s.data(), s.size()); }

// channels_last strides of a 4-D shape (N, C, H, W): C varies fastest.
inline Strides channels_last_strides(IntArrayRef sizes) {
  Strides s(4);
  s[1] = 1;
  s[3] = sizes[1];
  s[2] = s[3] * sizes[3];
  s[0] = s[2] * sizes[2];
  return s;
}

// Whether a 4-D tensor is channels_last-contiguous, as torch decides it.
inline bool is_channels_last(IntArrayRef sizes, IntArrayRef strides) {
  if (sizes.size() != 4) return false;
  int64_t expected = 1;
  for (const int d : {1, 3, 2, 0}) {
    if (sizes[d] == 1) continue;
    if (strides[d] != expected) return false;
    expected *= sizes[d];
  }
  return true;
}

// Whether every element has its own place and the places fill one block:
// some order of the dimensions walks memory densely.
inline bool is_non_overlapping_and_dense(IntArrayRef sizes, IntArrayRef strides) {
  const size_t nd = sizes.size();
  std::vector<size_t> order(nd);
  for (size_t i = 0; i < nd; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (sizes[a] < 2) return false;
    if (sizes[b] < 2) return true;
    return strides[a] < strides[b];
  });
  int64_t next = 1;
  for (const size_t d : order) {
    if (sizes[d] == 1) continue;
    if (strides[d] != next) return false;
    next *= sizes[d];
  }
  return true;
}

// Whether every tensor of `ts` is contiguous (torch's own test: an empty tensor is).
// The operands of a call, held (Tensor) or pointed to (const Tensor*: no reference-count traffic).
inline const Tensor& deref(const Tensor& t) { return t; }
inline const Tensor& deref(const Tensor* t) { return *t; }

template <typename E, size_t N>
bool all_contiguous(const std::array<E, N>& ts) {
  for (const E& t : ts) {
    if (!deref(t).is_contiguous()) return false;
  }
  return true;
}

// The strides of the result torch's elementwise ops (TensorIterator) give to
// `inputs` of one shape: contiguous, channels_last or the one shared dense
// layout when every input has it; otherwise a dense layout whose dimension
// order follows the inputs' strides, the first input deciding ties it can.
template <typename E, size_t N>
Strides result_strides(const std::array<E, N>& inputs) {
  const IntArrayRef sizes = deref(inputs[0]).sizes();
  // The common case first, without the layout tests below (a vector and a sort per input).
  if (all_contiguous(inputs)) return row_major_strides(sizes);
  const IntArrayRef first = deref(inputs[0]).strides();
  bool channels_last = true;
  bool shared_dense = true;
  for (const E& e : inputs) {
    const IntArrayRef s = deref(e).strides();
    channels_last = channels_last && is_channels_last(sizes, s);
    shared_dense = shared_dense && same_dims(s, first) && is_non_overlapping_and_dense(sizes, s);
  }
  if (channels_last) return channels_last_strides(sizes);
  if (shared_dense) return Strides(first.begin(), first.end());

  // perm[0] is the dimension that varies fastest in memory. An insertion
  // sort that leaves dimensions in place where no input orders them
  // (a broadcast stride 0, equal strides and sizes), as TensorIterator does.
  const auto nd = static_cast<int64_t>(sizes.size());
  std::vector<int64_t> perm(nd);
  for (int64_t i = 0; i < nd; ++i) perm[i] = nd - 1 - i;
  std::array<Strides, N> own;
  for (size_t k = 0; k < N; ++k) own[k] = Strides(deref(inputs[k]).strides().begin(), deref(inputs[k]).strides().end());
  auto should_swap = [&](int64_t d0, int64_t d1) {
    for (const Strides& s : own) {
      const int64_t s0 = s[d0];
      const int64_t s1 = s[d1];
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
  if (row_major) return row_major_strides(sizes);
  Strides strides(nd);
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
inline bool walks_like(const Tensor& t, const Strides& strides) {
  if (t.numel() == 0) return true;
  const IntArrayRef sizes = t.sizes();
  const IntArrayRef own = t.strides();
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
  template <typename E, size_t N>
  explicit DenseLayout(const std::array<E, N>& inputs)
      : contiguous_(all_contiguous(inputs)),
        sizes_(deref(inputs[0]).sizes().begin(), deref(inputs[0]).sizes().end()),
        strides_(contiguous_ ? row_major_strides(opforge::ref(sizes_)) : result_strides(inputs)) {}
  explicit DenseLayout(const Tensor& input) : DenseLayout(std::array<const Tensor*, 1>{&input}) {}
  DenseLayout(const Tensor& a, const Tensor& b) : DenseLayout(std::array<const Tensor*, 2>{&a, &b}) {}
  // `t`'s own layout; `t` must be non-overlapping and dense.
  static DenseLayout of(const Tensor& t) {
    return DenseLayout(Strides(t.sizes().begin(), t.sizes().end()), Strides(t.strides().begin(), t.strides().end()));
  }

  // `t` itself when it already walks in this layout, else a copy that does.
  Tensor input(const Tensor& t) const {
    // A contiguous input of a contiguous layout (the usual case): one shim call, not walks_like's three.
    if (contiguous_ && t.is_contiguous()) return t;
    if (walks_like(t, strides_)) return t;
    Tensor copy = empty_strided(ref(sizes_), ref(strides_), dtype_of(t), t);
    torch::stable::copy_(copy, t);
    return copy;
  }
  bool fits(const Tensor& t) const { return walks_like(t, strides_); }
  // A new result in this layout, of `like`'s dtype and device.
  Tensor new_output(const Tensor& like) const { return empty_strided(ref(sizes_), ref(strides_), dtype_of(like), like); }

 private:
  DenseLayout(Strides sizes, Strides strides) : sizes_(std::move(sizes)), strides_(std::move(strides)) {}

  bool contiguous_ = false;  // every input contiguous, so the layout is row-major
  Strides sizes_;
  Strides strides_;
};

// Runs `kernel(dst, dense_inputs...)` (every tensor dense in one layout) so
// that the result lands in `out`, which keeps its own strides as torch's out=
// ops do. The kernel runs in out's layout when out is dense and that copies
// no more than computing in the inputs' layout and copying the result into
// out afterwards would.
template <typename Kernel, typename... Inputs>
void into_out(Tensor& out, Kernel&& kernel, const Inputs&... inputs) {
  const std::array<const Tensor*, sizeof...(Inputs)> in{&inputs...};
  // The common case first, without the layout tests below: all contiguous, the kernel writes out.
  if (out.is_contiguous() && all_contiguous(in)) {
    kernel(out, inputs...);
    return;
  }
  const DenseLayout natural(in);
  int natural_copies = 0;
  for (const Tensor* t : in) natural_copies += natural.fits(*t) ? 0 : 1;
  if (is_non_overlapping_and_dense(out.sizes(), out.strides())) {
    const DenseLayout own = DenseLayout::of(out);
    int own_copies = 0;
    for (const Tensor* t : in) own_copies += own.fits(*t) ? 0 : 1;
    if (own_copies <= natural_copies + (natural.fits(out) ? 0 : 1)) {
      kernel(out, own.input(inputs)...);
      return;
    }
  }
  const Tensor dense = natural.new_output(out);
  kernel(dense, natural.input(inputs)...);
  torch::stable::copy_(out, dense);
}

}  // namespace opforge
