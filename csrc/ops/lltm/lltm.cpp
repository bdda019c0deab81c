// lltm: the LLTM cell of the PyTorch C++/CUDA extension tutorial (the autograd tutorial
// points to it), as two operators:
//
//   lltm_forward(input, weights, bias, old_h, old_cell) -> (new_h, new_cell, gates)
//   lltm_backward(grad_h?, grad_cell?, grad_gates?, new_cell, gates, input, old_h, weights,
//                 output_mask) -> (d_old_h, d_input, d_weights, d_bias, d_old_cell)
//
// The gate matmul (and the backward's four) go to ATen through the dispatcher, so
// cuBLAS on a GPU; everything elementwise is one fused kernel each way (lltm_math.h holds
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

#include <algorithm>
#include <array>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "lltm_kernel.h"
#include "lltm_math.h"
#include "opforge/stable/common.h"
#include "opforge/stable/cpu_vec.h"

namespace opforge {
namespace {

constexpr const char* kForward = "opforge::lltm_forward";
constexpr const char* kBackward = "opforge::lltm_backward";

// The forward's (and the backward's) view of the cell's sizes, checked.
struct Sizes {
  int64_t batch, features, state;
};

Sizes check_cell(const char* op, const Tensor& input, const Tensor& old_h, const Tensor& weights) {
  check_floating(op, "input", input);
  check_2d(op, "input", input, "[batch, input_features]");
  check_like(op, "input", input, "old_h", old_h);
  check_like(op, "input", input, "weights", weights);
  check_2d(op, "old_h", old_h, "[batch, state_size]");
  const Sizes z{input.size(0), input.size(1), old_h.size(1)};
  OPFORGE_CHECK(old_h.size(0) == z.batch, op, ": old_h must have input's batch size ", z.batch,
                " in dim 0, got shape ", dims(old_h.sizes()));
  // Weights of a whole cell for input's features ([3S, F + S] for some S)
  // point at old_h when it disagrees: blame the one that is wrong.
  if (weights.dim() == 2 && weights.size(0) % 3 == 0 &&
      weights.size(1) == z.features + weights.size(0) / 3) {
    const int64_t state = weights.size(0) / 3;
    OPFORGE_CHECK(z.state == state, op, ": old_h must have shape [batch, state_size] = [", z.batch,
                  ", ", state, "] (state_size from weights ", dims(weights.sizes()), "), got ",
                  dims(old_h.sizes()));
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

// The forward's elementwise part over a run of one row: the three gate
// pre-activations (overwritten in place) and the old cell in; the activated
// gates, the new cell and the new hidden state out.
struct ForwardOp {
  static constexpr int kIn = 4;
  static constexpr int kOut = 5;
  template <typename A>
  void operator()(const A* x, A* y) const {
    const auto r = lltm::forward_element<A>(x[0], x[1], x[2], x[3]);
    y[0] = r.input_gate;
    y[1] = r.output_gate;
    y[2] = r.candidate_cell;
    y[3] = r.new_cell;
    y[4] = r.new_h;
  }
#ifdef OPFORGE_X86_AVX2
  // lltm_math.h's forward_element, 8 lanes: three transcendentals an element
  // made the plain loop a quarter of the forward at B = F = S = 1024.
  OPFORGE_AVX2 void operator()(const __m256* x, __m256* y) const {
    y[0] = cpu::sigmoid8(x[0]);
    y[1] = cpu::sigmoid8(x[1]);
    const __m256 positive = _mm256_cmp_ps(x[2], _mm256_setzero_ps(), _CMP_GT_OQ);
    y[2] = _mm256_blendv_ps(cpu::expm1_8(x[2]), x[2], positive);
    y[3] = _mm256_add_ps(x[3], _mm256_mul_ps(y[2], y[0]));
    y[4] = _mm256_mul_ps(cpu::tanh8(y[3]), y[1]);
  }
#endif
};

std::tuple<Tensor, Tensor, Tensor> lltm_forward(const Tensor& input, const Tensor& weights,
                                                const Tensor& bias, const Tensor& old_h,
                                                const Tensor& old_cell) {
  const Sizes z = check_cell(kForward, input, old_h, weights);
  check_like(kForward, "input", input, "bias", bias);
  check_like(kForward, "input", input, "old_cell", old_cell);
  check_shape(kForward, "bias", bias, {3 * z.state}, "[3 * state_size]");
  check_shape(kForward, "old_cell", old_cell, old_h.sizes(), "[batch, state_size] (old_h's)");

  // One GEMM over K = F + S rather than two (one per half of X): cat costs a
  // copy of [B, F + S], the second GEMM a re-read and re-write of [B, 3S].
  const Tensor X = call_aten("aten::cat", "", std::vector<Tensor>{old_h, input}, int64_t{1});
  // linear of a 2-D input with a bias is addmm(bias, X, W^T), which cannot be
  // called itself: its beta and alpha are Scalars, a type the stable ABI does
  // not pass to the dispatcher. addmm's output is fresh and row-major, so it
  // is used in place as `gates`.
  Tensor gates = dense(call_aten("aten::linear", "", X, weights, std::optional<Tensor>(bias)));
  const Tensor cell = dense(old_cell);
  const ScalarType dtype = input.scalar_type();
  Tensor new_h = empty({z.batch, z.state}, dtype, input);
  Tensor new_cell = empty({z.batch, z.state}, dtype, input);
  run_kernel(
      kForward, new_h,
      [&](auto stream) {
        return lltm_forward_cuda(to_dtype(gates.scalar_type()), gates.mutable_data_ptr(),
                                 cell.const_data_ptr(), new_h.mutable_data_ptr(),
                                 new_cell.mutable_data_ptr(), z.batch, z.state, stream);
      },
      [&] {
        OPFORGE_DISPATCH_FLOATING(gates.scalar_type(), "opforge::lltm_forward", [&] {
          scalar_t* g = gates.mutable_data_ptr<scalar_t>();
          const scalar_t* c = cell.const_data_ptr<scalar_t>();
          scalar_t* h_out = new_h.mutable_data_ptr<scalar_t>();
          scalar_t* c_out = new_cell.mutable_data_ptr<scalar_t>();
          const int64_t S = z.state;
          // Row by row: a row's gates are three runs of S (at b * 3S), its cells one.
          const int64_t rows_per_task = std::max<int64_t>(1, cpu::kGrain / std::max<int64_t>(S, 1));
          torch::stable::parallel_for(0, z.batch, rows_per_task, [&](int64_t first, int64_t last) {
            for (int64_t b = first; b < last; ++b) {
              scalar_t* gb = g + b * 3 * S;
              cpu::for_each_element_in<scalar_t>(ForwardOp{}, {gb, gb + S, gb + 2 * S, c + b * S},
                                                 {gb, gb + S, gb + 2 * S, c_out + b * S, h_out + b * S}, 0, S);
            }
          });
        });
      });
  return {new_h, new_cell, gates};
}

// An incoming gradient: absent (autograd's None, a zero gradient) or checked
// against the shape it must have.
void check_grad(const char* name, const std::optional<Tensor>& t, const Tensor& input,
                IntArrayRef shape, const char* how) {
  if (!t.has_value() || !t->defined()) return;
  check_like(kBackward, "input", input, name, *t);
  check_shape(kBackward, name, *t, shape, how);
}

const Tensor* present(const std::optional<Tensor>& t) {
  return t.has_value() && t->defined() ? &*t : nullptr;
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> lltm_backward(
    const std::optional<Tensor>& grad_h, const std::optional<Tensor>& grad_cell,
    const std::optional<Tensor>& grad_gates, const Tensor& new_cell, const Tensor& gates,
    const Tensor& input, const Tensor& old_h, const Tensor& weights, const std::vector<bool>& mask) {
  // bool[] rather than bool[5] in the schema: the dispatcher's own length
  // error does not name the operator.
  OPFORGE_CHECK(mask.size() == 5, kBackward,
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
  const Tensor* gh = present(grad_h);
  const Tensor* gc = present(grad_cell);
  const std::optional<Tensor> gg =
      present(grad_gates) != nullptr ? std::optional<Tensor>(dense(*grad_gates)) : std::nullopt;
  const Tensor nc = dense(new_cell);
  const Tensor ga = dense(gates);
  const ScalarType dtype = input.scalar_type();
  // Outputs not in output_mask come back as empty tensors: a custom
  // operator's outputs must be tensors, and autograd discards them.
  const auto unwanted = [&] { return empty({0}, dtype, input); };
  Tensor d_gates = empty({z.batch, 3 * z.state}, dtype, input);
  Tensor d_old_cell = want_old_cell ? empty({z.batch, z.state}, dtype, input) : unwanted();
  LltmBackwardArgs args{};
  args.d_gates = d_gates.mutable_data_ptr();
  args.d_old_cell = want_old_cell ? d_old_cell.mutable_data_ptr() : nullptr;
  args.grad_h = gh != nullptr ? gh->const_data_ptr() : nullptr;
  args.grad_h_strides[0] = gh != nullptr ? gh->stride(0) : 0;
  args.grad_h_strides[1] = gh != nullptr ? gh->stride(1) : 0;
  args.grad_cell = gc != nullptr ? gc->const_data_ptr() : nullptr;
  args.grad_cell_strides[0] = gc != nullptr ? gc->stride(0) : 0;
  args.grad_cell_strides[1] = gc != nullptr ? gc->stride(1) : 0;
  args.grad_gates = gg.has_value() ? gg->const_data_ptr() : nullptr;
  args.new_cell = nc.const_data_ptr();
  args.gates = ga.const_data_ptr();
  args.batch = z.batch;
  args.state = z.state;
  run_kernel(
      kBackward, d_gates,
      [&](auto stream) { return lltm_backward_cuda(to_dtype(d_gates.scalar_type()), args, stream); },
      [&] {
        OPFORGE_DISPATCH_FLOATING(d_gates.scalar_type(), "opforge::lltm_backward", [&] {
          using acc_t = opmath_t<scalar_t>;
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
  Tensor d_weights = unwanted();
  if (want_weights) {
    d_weights = empty({3 * z.state, z.features + z.state}, dtype, input);
    const Tensor d_gates_t = torch::stable::transpose(d_gates, 0, 1);
    call_aten("aten::mm", "out", d_gates_t, old_h, torch::stable::narrow(d_weights, 1, 0, z.state));
    call_aten("aten::mm", "out", d_gates_t, input, torch::stable::narrow(d_weights, 1, z.state, z.features));
  }
  Tensor d_bias = want_bias ? empty({3 * z.state}, dtype, input) : unwanted();
  if (want_bias) {
    run_kernel(
        kBackward, d_bias,
        [&](auto stream) {
          return lltm_column_sum_cuda(to_dtype(d_gates.scalar_type()), d_gates.const_data_ptr(),
                                      d_bias.mutable_data_ptr(), z.batch, 3 * z.state, stream);
        },
        [&] {
          const int64_t dim0[] = {0};
          torch::stable::sum_out(d_bias, d_gates, IntArrayRef(dim0));
        });
  }
  // narrow() takes a non-const tensor; this copy shares weights' handle.
  Tensor w = weights;
  Tensor d_old_h =
      want_old_h ? call_aten("aten::mm", "", d_gates, torch::stable::narrow(w, 1, 0, z.state)) : unwanted();
  Tensor d_input =
      want_input ? call_aten("aten::mm", "", d_gates, torch::stable::narrow(w, 1, z.state, z.features)) : unwanted();
  return {d_old_h, d_input, d_weights, d_bias, d_old_cell};
}

void register_lltm_kernels(Library& m) {
  m.impl("lltm_forward", TORCH_BOX(&lltm_forward));
  m.impl("lltm_backward", TORCH_BOX(&lltm_backward));
}

}  // namespace
}  // namespace opforge

OPFORGE_LIBRARY_FRAGMENT(opforge, m) {
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
