// The eager fast path: a Python callable per operator that goes straight to
// the operator's CPU or CUDA kernel.
//
// Calling a TORCH_LIBRARY operator from Python through torch.ops parses the
// arguments generically and, for an operator whose autograd formula is
// registered from Python, runs that Python autograd kernel on every call, even
// when nothing needs a gradient: 13.5 and 24 us per call on an H200 where
// torch.add takes 7.6 us (issue 6). FastOp skips both when it may: every tensor
// argument is a plain torch.Tensor, none needs a gradient (or grad mode is
// off), no __torch_function__ mode is active, the arguments are positional. It
// then calls the operator through the dispatcher below autograd, so the
// backend kernel runs, as do whatever modes sit above autograd (autocast,
// vmap, fake and Python dispatch modes). Otherwise it returns NotImplemented
// and the Python caller takes the full torch.ops path: the answer is the same
// either way, only the cost differs. Operators that write an argument are not
// offered (their version counters are bumped above autograd).
//
// The same file is the library's Python module init when the build names one
// (TORCH_EXTENSION_NAME: the JIT and setuptools routes); the CMake build of
// the library leaves this file out.
#ifdef TORCH_EXTENSION_NAME

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/LegacyTypeDispatch.h>  // at::AutoDispatchBelowADInplaceOrView (not included by the others in torch 2.11)
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <string>
#include <vector>

namespace opforge {
namespace {

enum class Kind { Tensor, Float, Int, Bool };

struct FastOp {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  const c10::OperatorHandle* op;
  std::vector<Kind>* kinds;
  std::vector<c10::IValue>* defaults;  // None where the argument has no default
  Py_ssize_t required;                 // arguments without a default
  Py_ssize_t returns;
};

PyObject* not_implemented() { Py_RETURN_NOTIMPLEMENTED; }

// Converts one positional argument, or returns false to leave the call to torch.ops.
bool push_argument(Kind kind, PyObject* arg, bool grad_mode, torch::jit::Stack& stack) {
  switch (kind) {
    case Kind::Tensor: {
      if (!THPVariable_CheckExact(arg)) return false;  // subclasses, None, numbers: the full path decides
      const at::Tensor& t = THPVariable_Unpack(arg);
      if (grad_mode && t.requires_grad()) return false;
      stack.emplace_back(t);
      return true;
    }
    case Kind::Float:
      if (PyFloat_CheckExact(arg)) {
        stack.emplace_back(PyFloat_AS_DOUBLE(arg));
        return true;
      }
      if (PyLong_CheckExact(arg)) {
        const double v = PyLong_AsDouble(arg);
        if (v == -1.0 && PyErr_Occurred()) {
          PyErr_Clear();
          return false;
        }
        stack.emplace_back(v);
        return true;
      }
      return false;
    case Kind::Int:
      if (PyLong_CheckExact(arg)) {
        const long long v = PyLong_AsLongLong(arg);
        if (v == -1 && PyErr_Occurred()) {
          PyErr_Clear();
          return false;
        }
        stack.emplace_back(static_cast<int64_t>(v));
        return true;
      }
      return false;
    case Kind::Bool:
      if (PyBool_Check(arg)) {
        stack.emplace_back(arg == Py_True);
        return true;
      }
      return false;
  }
  return false;
}

PyObject* fast_call(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  HANDLE_TH_ERRORS
  auto* f = reinterpret_cast<FastOp*>(self);
  const Py_ssize_t n = PyVectorcall_NARGS(nargsf);
  const auto total = static_cast<Py_ssize_t>(f->kinds->size());
  if ((kwnames != nullptr && PyTuple_GET_SIZE(kwnames) > 0) || n < f->required || n > total ||
      at::impl::torch_function_mode_enabled()) {
    return not_implemented();
  }
  const bool grad_mode = at::GradMode::is_enabled();
  torch::jit::Stack stack;
  stack.reserve(static_cast<size_t>(total));
  for (Py_ssize_t i = 0; i < total; ++i) {
    if (i >= n) {
      stack.push_back((*f->defaults)[static_cast<size_t>(i)]);
    } else if (!push_argument((*f->kinds)[static_cast<size_t>(i)], args[i], grad_mode, stack)) {
      return not_implemented();
    }
  }
  {
    // A CPU kernel over a large tensor runs for a while: other Python threads go on meanwhile.
    pybind11::gil_scoped_release no_gil;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    f->op->callBoxed(&stack);
  }
  if (f->returns == 0) Py_RETURN_NONE;
  if (f->returns == 1) return THPVariable_Wrap(std::move(stack[0]).toTensor());
  PyObject* out = PyTuple_New(f->returns);
  if (out == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < f->returns; ++i) {
    PyTuple_SET_ITEM(out, i, THPVariable_Wrap(std::move(stack[static_cast<size_t>(i)]).toTensor()));
  }
  return out;
  END_HANDLE_TH_ERRORS
}

void fast_dealloc(PyObject* self) {
  auto* f = reinterpret_cast<FastOp*>(self);
  delete f->kinds;
  delete f->defaults;
  Py_TYPE(self)->tp_free(self);
}

PyTypeObject FastOpType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// fast_op("ns::name") -> a FastOp, or None when the operator is not one the
// fast path can call (it writes an argument, or takes or returns other types).
PyObject* make_fast_op(PyObject* /*module*/, PyObject* arg) {
  HANDLE_TH_ERRORS
  const char* qualname = PyUnicode_AsUTF8(arg);
  if (qualname == nullptr) return nullptr;
  auto handle = c10::Dispatcher::singleton().findSchema({qualname, ""});
  if (!handle.has_value()) Py_RETURN_NONE;
  const c10::FunctionSchema& schema = handle->schema();
  std::vector<Kind> kinds;
  std::vector<c10::IValue> defaults;
  Py_ssize_t required = 0;
  for (const auto& a : schema.arguments()) {
    if (a.alias_info() != nullptr && a.alias_info()->isWrite()) Py_RETURN_NONE;
    if (a.kwarg_only()) Py_RETURN_NONE;
    const auto& type = *a.type();
    if (type == *c10::TensorType::get()) {
      kinds.push_back(Kind::Tensor);
    } else if (type == *c10::FloatType::get()) {
      kinds.push_back(Kind::Float);
    } else if (type == *c10::IntType::get()) {
      kinds.push_back(Kind::Int);
    } else if (type == *c10::BoolType::get()) {
      kinds.push_back(Kind::Bool);
    } else {
      Py_RETURN_NONE;
    }
    defaults.push_back(a.default_value().value_or(c10::IValue()));
    if (!a.default_value().has_value()) required = static_cast<Py_ssize_t>(kinds.size());
  }
  for (const auto& r : schema.returns()) {
    if (*r.type() != *c10::TensorType::get() || r.alias_info() != nullptr) Py_RETURN_NONE;
  }
  auto* f = PyObject_New(FastOp, &FastOpType);
  if (f == nullptr) return nullptr;
  f->vectorcall = fast_call;
  // Operator handles live as long as the process (the dispatcher never frees them).
  f->op = new c10::OperatorHandle(*handle);
  f->kinds = new std::vector<Kind>(std::move(kinds));
  f->defaults = new std::vector<c10::IValue>(std::move(defaults));
  f->required = required;
  f->returns = static_cast<Py_ssize_t>(schema.returns().size());
  return reinterpret_cast<PyObject*>(f);
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"fast_op", make_fast_op, METH_O, "fast_op(qualname) -> a callable for the eager fast path, or None"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace
}  // namespace opforge

#define OPFORGE_STR2(x) #x
#define OPFORGE_STR(x) OPFORGE_STR2(x)
#define OPFORGE_CONCAT2(a, b) a##b
#define OPFORGE_CONCAT(a, b) OPFORGE_CONCAT2(a, b)

static PyModuleDef opforge_fast_module = {PyModuleDef_HEAD_INIT, OPFORGE_STR(TORCH_EXTENSION_NAME),
                                          "opforge's eager fast path", -1, opforge::methods};

PyMODINIT_FUNC OPFORGE_CONCAT(PyInit_, TORCH_EXTENSION_NAME)() {
  auto& type = opforge::FastOpType;
  type.tp_name = "opforge.FastOp";
  type.tp_basicsize = sizeof(opforge::FastOp);
  type.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL;
  type.tp_vectorcall_offset = offsetof(opforge::FastOp, vectorcall);
  type.tp_call = PyVectorcall_Call;
  type.tp_dealloc = opforge::fast_dealloc;
  if (PyType_Ready(&type) < 0) return nullptr;
  return PyModule_Create(&opforge_fast_module);
}

#endif  // TORCH_EXTENSION_NAME
