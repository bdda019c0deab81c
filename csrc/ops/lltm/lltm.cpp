// lltm: the LLTM cell of the PyTorch C++/CUDA extension tutorial (the autograd tutorial
// points to it), as two operators:
//
//   lltm_forward(input, weights, bias, old_h, old_cell) -> (new_h, new_cell, gates)
//   lltm_backward(grad_h?, grad_cell?, grad_gates?, new_cell, gates, input, old_h, weights,
//                 output_mask) -> (d_old_h, d_input, d_weights, d_bias, d_old_cell)
//
// The gate matmul (and the backward's four) go through ATen, so cuBLAS on a
// GPU; everything elementwise is one fused kernel each way (lltm_math.h holds
// the formulas both backends share).
//
// What is saved for the backward: the tutorial's forward returns seven
// tensors (X, gate_weights and the three gates separately). Here the forward
// returns one extra tensor, `gates` [batch, 3 * state], the activated gates
// written over the matmul's own output buffer (no allocation beyond it); the
// backward takes new_cell (an output anyway) and the inputs input, old_h and
// weights, which autograd keeps by reference. X = [old_h, input] is never
// kept: the backward's matmuls read the two halves in place. And since
// `gates` is an output, its gradient is honoured (grad_gates), so every output
// of lltm_forward is differentiable and gradcheck sees the true Jacobian.
// Autograd's None gradients stay None (a zero the kernel never reads), and
// output_mask (autograd's needs_input_grad) skips the matmuls of gradients
// nobody wants: with the parameters alone requiring grad, as in training on
// data, the backward does one of its two [B, 3S] x [3S, F + S] products.

#include <ATen/ops/addmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sum.h>

#include <array>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "lltm_kernel.h"
#include "lltm_math.h"
#include "opforge/common.h"

namespace opforge {
namespace {

constexpr const char* kForward = "opforge::lltm_forward";
constexpr const char* kBackward = "opforge::lltm_backward";

// The forward's (and the backward's) view of the cell's sizes, checked.
struct Sizes {
  int64_t batch, features, state;
};

Sizes check_cell(const char* op, const at::Tensor& input, const at::Tensor& old_h,
                 const at::Tensor& weights) {
  check_floating(op, "input", input);
  check_2d(op, "input", input, "[batch, input_features]");
  check_like(op, "input", input, "old_h", old_h);
  check_like(op, "input", input, "weights", weights);
  check_2d(op, "old_h", old_h, "[batch, state_size]");
  const Sizes z{input.size(0), input.size(1), old_h.size(1)};
  TORCH_CHECK(old_h.size(0) == z.batch, op, ": old_h must have input's batch size ", z.batch,
              " in dim 0, got shape ", old_h.sizes());
  // Weights of a whole cell for input's features ([3S, F + S] for some S)
  // point at old_h when it disagrees: blame the one that is wrong.
  if (weights.dim() == 2 && weights.size(0) % 3 == 0 &&
      weights.size(1) == z.features + weights.size(0) / 3) {
    const int64_t state = weights.size(0) / 3;
    TORCH_CHECK(z.state == state, op, ": old_h must have shape [batch, state_size] = [", z.batch,
                ", ", state, "] (state_size from weights ", weights.sizes(), "), got ",
                old_h.sizes());
  }
  check_shape(op, "weights", weights, {3 * z.state, z.features + z.state},
              "[3 * state_size, input_features + state_size]");
  return z;
}

// The CPU loop over batch * state elements; row b's gates are at b * 3S.
template <typename F>
void for_each_cell(int64_t batch, int64_t state, F&& f) {
  parallel_for_each(batch * state, [=](int64_t i) {
    const int64_t b = i / state;
    f(i, b * 3 * state + (i - b * state));
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lltm_forward(const at::Tensor& input,
                                                            const at::Tensor& weights,
                                                            const at::Tensor& bias,
                                                            const at::Tensor& old_h,
                                                            const at::Tensor& old_cell) {
  const Sizes z = check_cell(kForward, input, old_h, weights);
  check_like(kForward, "input", input, "bias", bias);
  check_like(kForward, "input", input, "old_cell", old_cell);
  check_shape(kForward, "bias", bias, {3 * z.state}, "[3 * state_size]");
  check_shape(kForward, "old_cell", old_cell, old_h.sizes(), "[batch, state_size] (old_h's)");

  // One GEMM over K = F + S rather than two (one per half of X): cat costs a
  // copy of [B, F + S], the second GEMM a re-read and re-write of [B, 3S].
  const at::Tensor X = at::cat({old_h, input}, 1);
  // addmm's output is fresh and row-major, so it is used in place as `gates`.
  at::Tensor gates = at::addmm(bias, X, weights.t()).contiguous();
  const at::Tensor cell = old_cell.contiguous();
  at::Tensor new_h = at::empty({z.batch, z.state}, input.options());
  at::Tensor new_cell = at::empty({z.batch, z.state}, input.options());
  run_kernel(
      kForward, new_h,
      [&](auto stream) {
        return lltm_forward_cuda(to_dtype(gates.scalar_type()), gates.data_ptr(),
                                 cell.const_data_ptr(), new_h.data_ptr(), new_cell.data_ptr(),
                                 z.batch, z.state, stream);
      },
      [&] {
        OPFORGE_DISPATCH_FLOATING(gates.scalar_type(), "opforge::lltm_forward", [&] {
          using acc_t = at::opmath_type<scalar_t>;
          scalar_t* g = gates.data_ptr<scalar_t>();
          const scalar_t* c = cell.const_data_ptr<scalar_t>();
          scalar_t* h_out = new_h.data_ptr<scalar_t>();
          scalar_t* c_out = new_cell.data_ptr<scalar_t>();
          const int64_t S = z.state;
          for_each_cell(z.batch, S, [=](int64_t i, int64_t k) {
            const auto r = lltm::forward_element<acc_t>(
                static_cast<acc_t>(g[k]), static_cast<acc_t>(g[k + S]),
                static_cast<acc_t>(g[k + 2 * S]), static_cast<acc_t>(c[i]));
            g[k] = static_cast<scalar_t>(r.input_gate);
            g[k + S] = static_cast<scalar_t>(r.output_gate);
            g[k + 2 * S] = static_cast<scalar_t>(r.candidate_cell);
            c_out[i] = static_cast<scalar_t>(r.new_cell);
            h_out[i] = static_cast<scalar_t>(r.new_h);
          });
        });
      });
  return {new_h, new_cell, gates};
}

// An incoming gradient: absent (autograd's None, a zero gradient) or checked
// against the shape it must have.
void check_grad(const char* name, const std::optional<at::Tensor>& t, const at::Tensor& input,
                at::IntArrayRef shape, const char* how) {
  if (!t.has_value() || !t->defined()) return;
  check_like(kBackward, "input", input, name, *t);
  check_shape(kBackward, name, *t, shape, how);
}

const at::Tensor* present(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? &*t : nullptr;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> lltm_backward(
    const std::optional<at::Tensor>& grad_h, const std::optional<at::Tensor>& grad_cell,
    const std::optional<at::Tensor>& grad_gates, const at::Tensor& new_cell,
    const at::Tensor& gates, const at::Tensor& input, const at::Tensor& old_h,
    const at::Tensor& weights, const c10::List<bool>& mask) {
  // bool[] rather than bool[5] in the schema: the dispatcher's own length
  // error does not name the operator.
  TORCH_CHECK(mask.size() == 5, kBackward,
              ": output_mask must have 5 entries (d_old_h, d_input, d_weights, d_bias, "
              "d_old_cell), got ",
              mask.size());
  const std::array<bool, 5> output_mask{mask[0], mask[1], mask[2], mask[3], mask[4]};
  const Sizes z = check_cell(kBackward, input, old_h, weights);
  const std::vector<int64_t> cell_shape{z.batch, z.state};
  const std::vector<int64_t> gates_shape{z.batch, 3 * z.state};
  constexpr const char* kCellHow = "[batch, state_size]";
  constexpr const char* kGatesHow = "[batch, 3 * state_size]";
  check_grad("grad_h", grad_h, input, cell_shape, kCellHow);
  check_grad("grad_cell", grad_cell, input, cell_shape, kCellHow);
  check_grad("grad_gates", grad_gates, input, gates_shape, kGatesHow);
  check_like(kBackward, "input", input, "new_cell", new_cell);
  check_shape(kBackward, "new_cell", new_cell, cell_shape, kCellHow);
  check_like(kBackward, "input", input, "gates", gates);
  check_shape(kBackward, "gates", gates, gates_shape, kGatesHow);
  const auto [want_old_h, want_input, want_weights, want_bias, want_old_cell] = output_mask;

  // grad_h and grad_cell are read through their strides: the gradient of a
  // sum() is one value expanded (strides 0, 0), and copying it to a dense
  // tensor first would cost a kernel per gradient.
  const at::Tensor* gh = present(grad_h);
  const at::Tensor* gc = present(grad_cell);
  const at::Tensor gg = present(grad_gates) ? grad_gates->contiguous() : at::Tensor();
  const at::Tensor nc = new_cell.contiguous();
  const at::Tensor ga = gates.contiguous();
  // Outputs not in output_mask come back as empty tensors: a custom
  // operator's outputs must be tensors, and autograd discards them.
  const auto empty = [&] { return at::empty({0}, input.options()); };
  at::Tensor d_gates = at::empty(gates_shape, input.options());
  at::Tensor d_old_cell = want_old_cell ? at::empty(cell_shape, input.options()) : empty();
  LltmBackwardArgs args{};
  args.d_gates = d_gates.data_ptr();
  args.d_old_cell = want_old_cell ? d_old_cell.data_ptr() : nullptr;
  args.grad_h = gh != nullptr ? gh->const_data_ptr() : nullptr;
  args.grad_h_strides[0] = gh != nullptr ? gh->stride(0) : 0;
  args.grad_h_strides[1] = gh != nullptr ? gh->stride(1) : 0;
  args.grad_cell = gc != nullptr ? gc->const_data_ptr() : nullptr;
  args.grad_cell_strides[0] = gc != nullptr ? gc->stride(0) : 0;
  args.grad_cell_strides[1] = gc != nullptr ? gc->stride(1) : 0;
  args.grad_gates = gg.defined() ? gg.const_data_ptr() : nullptr;
  args.new_cell = nc.const_data_ptr();
  args.gates = ga.const_data_ptr();
  args.batch = z.batch;
  args.state = z.state;
  run_kernel(
      kBackward, d_gates,
      [&](auto stream) { return lltm_backward_cuda(to_dtype(d_gates.scalar_type()), args, stream); },
      [&] {
        OPFORGE_DISPATCH_FLOATING(d_gates.scalar_type(), "opforge::lltm_backward", [&] {
          using acc_t = at::opmath_type<scalar_t>;
          scalar_t* dg = static_cast<scalar_t*>(args.d_gates);
          scalar_t* dc = static_cast<scalar_t*>(args.d_old_cell);
          const auto* h = static_cast<const scalar_t*>(args.grad_h);
          const auto* c = static_cast<const scalar_t*>(args.grad_cell);
          const auto* x = static_cast<const scalar_t*>(args.grad_gates);
          const auto* n = static_cast<const scalar_t*>(args.new_cell);
          const auto* a = static_cast<const scalar_t*>(args.gates);
          const int64_t hb = args.grad_h_strides[0], hs = args.grad_h_strides[1];
          const int64_t cb = args.grad_cell_strides[0], cs = args.grad_cell_strides[1];
          const int64_t S = z.state;
          for_each_cell(z.batch, S, [=](int64_t i, int64_t k) {
            const int64_t b = i / S;
            const int64_t s = i - b * S;
            const acc_t gh_v = h != nullptr ? static_cast<acc_t>(h[b * hb + s * hs]) : acc_t(0);
            const acc_t gc_v = c != nullptr ? static_cast<acc_t>(c[b * cb + s * cs]) : acc_t(0);
            acc_t gi(0), go(0), gcc(0);
            if (x != nullptr) {
              gi = static_cast<acc_t>(x[k]);
              go = static_cast<acc_t>(x[k + S]);
              gcc = static_cast<acc_t>(x[k + 2 * S]);
            }
            const auto r = lltm::backward_element<acc_t>(
                gh_v, gc_v, static_cast<acc_t>(n[i]), static_cast<acc_t>(a[k]),
                static_cast<acc_t>(a[k + S]), static_cast<acc_t>(a[k + 2 * S]), gi, go, gcc);
            dg[k] = static_cast<scalar_t>(r.d_input_gate);
            dg[k + S] = static_cast<scalar_t>(r.d_output_gate);
            dg[k + 2 * S] = static_cast<scalar_t>(r.d_candidate_cell);
            if (dc != nullptr) dc[i] = static_cast<scalar_t>(r.d_old_cell);
          });
        });
      });

  // gate_weights = X @ W^T + b with X = [old_h | input], so
  //   d_W = d_gates^T @ X, d_b = sum of d_gates over the batch, d_X = d_gates @ W.
  // Each is split along X's halves: the column blocks of W and of d_W are
  // strided views that BLAS reads and writes in place (leading dimension
  // F + S), so neither X nor d_X is ever materialised, and an unwanted half
  // (usually d_input: the data needs no gradient) costs nothing.
  at::Tensor d_weights = empty();
  if (want_weights) {
    d_weights = at::empty({3 * z.state, z.features + z.state}, input.options());
    const at::Tensor d_gates_t = d_gates.t();
    at::Tensor d_weights_h = d_weights.narrow(1, 0, z.state);
    at::Tensor d_weights_x = d_weights.narrow(1, z.state, z.features);
    at::mm_out(d_weights_h, d_gates_t, old_h);
    at::mm_out(d_weights_x, d_gates_t, input);
  }
  at::Tensor d_bias = want_bias ? at::empty({3 * z.state}, input.options()) : empty();
  if (want_bias) {
    run_kernel(
        kBackward, d_bias,
        [&](auto stream) {
          return lltm_column_sum_cuda(to_dtype(d_gates.scalar_type()), d_gates.const_data_ptr(), d_bias.data_ptr(),
                                      z.batch, 3 * z.state, stream);
        },
        [&] { at::sum_out(d_bias, d_gates, 0); });
  }
  at::Tensor d_old_h = want_old_h ? at::mm(d_gates, weights.narrow(1, 0, z.state)) : empty();
  at::Tensor d_input = want_input ? at::mm(d_gates, weights.narrow(1, z.state, z.features)) : empty();
  return {d_old_h, d_input, d_weights, d_bias, d_old_cell};
}

void register_lltm_kernels(torch::Library& m) {
  m.impl("lltm_forward", &lltm_forward);
  m.impl("lltm_backward", &lltm_backward);
}

}  // namespace
}  // namespace opforge

TORCH_LIBRARY_FRAGMENT(opforge, m) {
  m.def(
      "lltm_forward(Tensor input, Tensor weights, Tensor bias, Tensor old_h, Tensor old_cell) "
      "-> (Tensor new_h, Tensor new_cell, Tensor gates)");
  m.def(
      "lltm_backward(Tensor? grad_h, Tensor? grad_cell, Tensor? grad_gates, Tensor new_cell, "
      "Tensor gates, Tensor input, Tensor old_h, Tensor weights, "
      "bool[] output_mask=[True, True, True, True, True]) "
      "-> (Tensor d_old_h, Tensor d_input, Tensor d_weights, Tensor d_bias, Tensor d_old_cell)");
}

OPFORGE_REGISTER_KERNELS(opforge, opforge::register_lltm_kernels)
