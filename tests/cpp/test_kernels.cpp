// ctest's test of the CMake-built op library: the CPU kernels reached through
// the dispatcher only (as torch.ops does), on odd sizes, against ATen, and the
// error a shape mismatch raises. Exit status: 0 when everything passed.
//
// It uses no symbol of libopforge_ops: the operators exist here only because
// loading that library ran its STABLE_TORCH_LIBRARY registrations
// (CMakeLists.txt links it with --no-as-needed so the linker keeps it). The
// library is on the stable ABI; this test is ATen code and links all of torch.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/sigmoid.h>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

int failures = 0;
int passed = 0;

void expect(bool ok, const std::string& what) {
  if (ok) {
    ++passed;
  } else {
    ++failures;
    std::printf("FAIL %s\n", what.c_str());
  }
}

std::string shape_str(at::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? "," : "") + std::to_string(sizes[i]);
  return s + "]";
}

c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

}  // namespace

int main() {
  const std::vector<const char*> names = {"opforge::add",           "opforge::add_out",
                                          "opforge::square",        "opforge::axpby",
                                          "opforge::axpby_backward", "opforge::sigmoid",
                                          "opforge::sigmoid_backward"};
  for (const char* name : names) {
    const auto schema = c10::Dispatcher::singleton().findOp(c10::OperatorName(name, ""));
    expect(schema.has_value(), std::string(name) + " is registered");
    if (schema) {
      expect(schema->hasKernelForDispatchKey(c10::DispatchKey::CPU),
             std::string(name) + " has a CPU kernel");
    }
  }
  if (failures) {
    std::printf("%d failed: the op library's registrations did not run (was it linked?)\n", failures);
    return 1;
  }

  auto add = op("opforge::add").typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  auto sigmoid = op("opforge::sigmoid").typed<at::Tensor(const at::Tensor&)>();
  auto axpby =
      op("opforge::axpby").typed<at::Tensor(const at::Tensor&, const at::Tensor&, double, double)>();

  const std::vector<std::vector<int64_t>> shapes = {{1025}, {97, 3}, {1}, {0}, {3, 5, 7}, {70001}};
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    const auto opts = at::TensorOptions().dtype(dtype);
    const std::string tag = dtype == at::kFloat ? " float32" : " float64";
    for (const auto& shape : shapes) {
      const std::string where = shape_str(shape) + tag;
      const at::Tensor a = at::randn(shape, opts);
      const at::Tensor b = at::randn(shape, opts);

      const at::Tensor sum = add.call(a, b);
      expect(sum.sizes() == a.sizes() && sum.scalar_type() == dtype, "add shape/dtype " + where);
      expect(at::allclose(sum, at::add(a, b)), "add " + where);

      const at::Tensor sig = sigmoid.call(a);
      expect(sig.sizes() == a.sizes() && sig.scalar_type() == dtype,
             "sigmoid shape/dtype " + where);
      expect(at::allclose(sig, at::sigmoid(a), 1e-5, 1e-6), "sigmoid " + where);

      const at::Tensor lin = axpby.call(a, b, 2.5, -0.5);
      expect(at::allclose(lin, at::add(at::mul(a, 2.5), at::mul(b, -0.5)), 1e-5, 1e-6),
             "axpby " + where);
    }
  }

  // A non-contiguous input: the wrappers make it contiguous first.
  const at::Tensor t = at::randn({97, 3}).t();
  expect(at::allclose(add.call(t, t), at::add(t, t)), "add non-contiguous [3,97]");
  expect(at::allclose(sigmoid.call(t), at::sigmoid(t), 1e-5, 1e-6), "sigmoid non-contiguous [3,97]");

  // A shape mismatch: the stable ABI's checks throw std::runtime_error (no
  // c10::Error: that is libc10's), which torch turns into RuntimeError; it
  // reaches the dispatcher's caller as it was thrown, naming the operator and
  // both shapes.
  const std::string expected = "opforge::add: a and b must have the same shape";
  bool threw = false;
  try {
    add.call(at::randn({3}), at::randn({4}));
  } catch (const std::runtime_error& e) {
    threw = true;
    const std::string msg = e.what();
    expect(msg.rfind(expected, 0) == 0, "shape mismatch message starts with '" + expected +
                                            "', got '" + msg + "'");
    expect(msg.find("[3] and [4]") != std::string::npos,
           "shape mismatch message shows both shapes, got '" + msg + "'");
  }
  expect(threw, "add of shapes [3] and [4] throws std::runtime_error");

  std::printf("%d passed, %d failed\n", passed, failures);
  return failures ? 1 : 0;
}
