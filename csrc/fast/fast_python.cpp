// The eager fast path: a Python callable per operator that goes straight to
// the operator's CPU or CUDA kernel.
//
// Calling a TORCH_LIBRARY operator from Python through torch.ops parses the
// arguments generically and, for an operator whose autograd formula is
// registered from Python, runs that Python autograd kernel on every call, even
// when nothing needs a gradient: 13.5 and 24 us per call on an H200 where
// torch.add takes 7.6 us. FastOp skips both when it may: every tensor
// argument is a plain torch.Tensor, no __torch_function__ mode is active, the
// arguments are positional. It then calls the operator through the dispatcher
// below autograd, so the backend kernel runs, as do whatever modes sit above
// autograd (autocast, vmap, fake and Python dispatch modes). When an input
// needs a gradient it records the graph itself: one C++ node whose backward is
// the spec's Python backward, fed by the spec's setup_context, with the saved
// tensors kept as SavedVariables (version-checked, and no reference cycle
// through a saved output), as torch.autograd.Function does. Otherwise it returns NotImplemented
// and the Python caller takes the full torch.ops path: the answer is the same
// either way, only the cost differs. An operator that writes an argument (an
// out= form) takes the fast path when no argument needs a gradient or carries
// a tangent and inference mode is off: the written tensors' versions are bumped
// after the call, as its Autograd kernel (writes_arguments) does.
//
// The module also holds the autograd kernel of the operators that write an
// argument (writes_arguments): it needs autograd's state (grad mode, forward
// AD tangents, version counters), which the stable ABI of the operators'
// own library does not reach.
//
// A Python module of its own, built for one torch (it uses torch's private
// autograd headers): the op library stays on the stable ABI, and this module
// is optional (opforge.fast).
#ifdef TORCH_EXTENSION_NAME

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/LegacyTypeDispatch.h>  // at::AutoDispatchBelowADInplaceOrView (not included by the others in torch 2.11)
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <structmember.h>

#include <algorithm>
#include <memory>
#include <stdexcept>

#include <string>
#include <type_traits>
#include <utility>
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
  // The spec's autograd (set_autograd); null: an input that needs a gradient
  // sends the call to torch.ops.
  PyObject* setup_context;
  PyObject* backward;
  PyObject* ctx_type;
  // Where ctx_type's __slots__ keep needs_input_grad and to_save (byte offsets into the ctx), or -1:
  // read and written directly, a ctx needs no __dict__ unless setup_context sets more attributes,
  // and nothing saved is a null slot rather than an AttributeError raised and cleared.
  Py_ssize_t needs_slot;
  Py_ssize_t to_save_slot;
  bool plain_ctx;  // ctx_type has neither __new__ nor __init__ of its own: allocated without calling it
  // What a setup_context opforge recognised saves (set_autograd's `saves`), done here instead of
  // calling it: kSavesNothing (setup_context None), kSavesOutput, the position of the one input
  // it saves, or kSavesAttributes (it only sets ctx attributes to non-tensor inputs: names in
  // attr_names, positions in attr_positions). kSetupInPython: setup_context is called. Unless it
  // is called, the ctx is made when the backward runs, not on every recording call.
  Py_ssize_t saves;
  PyObject* attr_names;  // a tuple of str (owned), or null
  std::vector<Py_ssize_t>* attr_positions;
  std::shared_ptr<const struct NodeInfo>* node_info;
  std::vector<size_t>* writes;  // positions of the arguments the schema marks written (Tensor(a!))
  // needs_input_grad tuples by the mask of the tensor arguments that need a gradient (owned; built on
  // first use): a recording call shares one instead of building a tuple of bools per call.
  std::vector<PyObject*>* needs_cache;
};

PyObject* not_implemented() { Py_RETURN_NOTIMPLEMENTED; }

constexpr Py_ssize_t kSavesAttributes = -4;
constexpr Py_ssize_t kSetupInPython = -3;
constexpr Py_ssize_t kSavesNothing = -2;
constexpr Py_ssize_t kSavesOutput = -1;

// What every node of one operator shares: one reference count per call instead of copying a name
// and a vector into each node (each its own allocation).
struct NodeInfo {
  std::string name;
  std::vector<bool> tensor_arg;  // per argument: does it have an edge
};

// Attribute names, interned once: the *AttrString functions make a new str on every call.
struct Names {
  PyObject* needs_input_grad;
  PyObject* to_save;
  PyObject* saved_tensors;
};
Names names{};

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;
// std::shared_ptr<Node> before torch 2.12, c10::intrusive_ptr<Node> since.
using NodePtr = decltype(std::declval<torch::autograd::Edge>().function);

// ctx.needs_input_grad for `mask` (bit t: the t-th tensor argument needs a gradient): a new
// tuple, or null with a Python error set.
PyObject* needs_tuple(const std::vector<bool>& tensor_arg, size_t mask) {
  const auto total = static_cast<Py_ssize_t>(tensor_arg.size());
  PyObject* needs = PyTuple_New(total);
  if (needs == nullptr) return nullptr;
  size_t t = 0;
  for (Py_ssize_t i = 0; i < total; ++i) {
    bool needs_grad = false;
    if (tensor_arg[static_cast<size_t>(i)]) needs_grad = ((mask >> t++) & 1U) != 0;
    PyTuple_SET_ITEM(needs, i, PyBool_FromLong(needs_grad));
  }
  return needs;
}

// The PyObject* member of `o` at byte offset `offset` (a __slots__ entry).
PyObject** object_slot(PyObject* o, Py_ssize_t offset) {
  return reinterpret_cast<PyObject**>(reinterpret_cast<char*>(o) + offset);
}

// Sets ctx.needs_input_grad, in its slot (the byte offset `slot`) or as an attribute (`slot` -1),
// taking the reference to `needs`; -1 with a Python error set.
int set_needs_input_grad(PyObject* ctx, Py_ssize_t slot, PyObject* needs) {
  if (slot >= 0) {
    Py_XSETREF(*object_slot(ctx, slot), needs);
    return 0;
  }
  const int set = PyObject_SetAttr(ctx, names.needs_input_grad, needs);
  Py_DECREF(needs);
  return set;
}

// The backward of one fast-path call: the spec's Python backward(ctx, *grads).
struct PyBackward : Node {
  PyObject* backward = nullptr;  // the spec's function (lives as long as the process)
  PyObject* ctx = nullptr;       // owned; null until the backward makes it (lazy_ctx)
  std::vector<SavedVariable> saved;
  // What the backward needs to make the ctx itself: ctx_type lives as long as the process (opforge.fast.Context).
  PyObject* ctx_type = nullptr;
  bool plain_ctx = false;
  Py_ssize_t needs_slot = -1;
  size_t needs_mask = 0;  // bit t: the t-th tensor argument needs a gradient
  std::shared_ptr<const NodeInfo> info;
  bool released = false;
  // kSavesAttributes: the attributes' names (a tuple) and values (a tuple, the inputs as
  // setup_context would have seen them), set on the ctx when the backward makes it. Owned.
  PyObject* attr_names = nullptr;
  PyObject* attr_values = nullptr;

  std::string name() const override { return info->name; }

  void release_variables() override {
    saved.clear();
    released = true;
  }

  variable_list apply(variable_list&& grads) override {
    pybind11::gil_scoped_acquire gil;
    const std::string& node_name = info->name;
    const std::vector<bool>& tensor_arg = info->tensor_arg;
    TORCH_CHECK(!released, node_name,
                ": trying to backward through the graph a second time (or to read saved tensors after they were freed); "
                "pass retain_graph=True to the first backward");
    if (ctx == nullptr) make_ctx();
    PyObject* saved_tuple = PyTuple_New(static_cast<Py_ssize_t>(saved.size()));
    if (saved_tuple == nullptr) throw python_error();
    for (size_t i = 0; i < saved.size(); ++i) {
      PyTuple_SET_ITEM(saved_tuple, static_cast<Py_ssize_t>(i), THPVariable_Wrap(saved[i].unpack(getptr())));
    }
    const int set = PyObject_SetAttr(ctx, names.saved_tensors, saved_tuple);
    Py_DECREF(saved_tuple);
    if (set < 0) throw python_error();
    PyObject* call_args = PyTuple_New(static_cast<Py_ssize_t>(grads.size()) + 1);
    if (call_args == nullptr) throw python_error();
    Py_INCREF(ctx);
    PyTuple_SET_ITEM(call_args, 0, ctx);
    for (size_t i = 0; i < grads.size(); ++i) {
      // Materialised, as autograd.Function does: a backward never sees None.
      at::Tensor g = grads[i].defined() ? grads[i] : input_metadata(i).zeros_like();
      PyTuple_SET_ITEM(call_args, static_cast<Py_ssize_t>(i) + 1, THPVariable_Wrap(std::move(g)));
    }
    PyObject* result = PyObject_CallObject(backward, call_args);
    Py_DECREF(call_args);
    if (result == nullptr) throw python_error();
    // One gradient per argument (None for non-tensors), as register_autograd's backward returns.
    PyObject* seq = PyTuple_Check(result) ? result : PyTuple_Pack(1, result);
    if (seq != result) Py_DECREF(result);
    if (seq == nullptr) throw python_error();
    const auto n = static_cast<size_t>(PyTuple_GET_SIZE(seq));
    if (n != tensor_arg.size()) {
      Py_DECREF(seq);
      TORCH_CHECK(false, node_name, ": the backward returned ", n, " gradients for ", tensor_arg.size(), " inputs");
    }
    variable_list out;
    for (size_t i = 0; i < n; ++i) {
      if (!tensor_arg[i]) continue;
      PyObject* g = PyTuple_GET_ITEM(seq, static_cast<Py_ssize_t>(i));
      out.push_back(g == Py_None ? at::Tensor() : THPVariable_Unpack(g));
    }
    Py_DECREF(seq);
    return out;
  }

  // The ctx of a call whose setup_context was not called: what it would have held then
  // (needs_input_grad; saved_tensors are set by apply).
  void make_ctx() {
    auto* type = reinterpret_cast<PyTypeObject*>(ctx_type);
    PyObject* made = plain_ctx ? type->tp_alloc(type, 0) : PyObject_CallNoArgs(ctx_type);
    if (made == nullptr) throw python_error();
    PyObject* needs = needs_tuple(info->tensor_arg, needs_mask);
    if (needs == nullptr || set_needs_input_grad(made, needs_slot, needs) < 0) {
      Py_DECREF(made);
      throw python_error();
    }
    if (attr_names != nullptr) {
      for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(attr_names); ++i) {
        if (PyObject_SetAttr(made, PyTuple_GET_ITEM(attr_names, i), PyTuple_GET_ITEM(attr_values, i)) < 0) {
          Py_DECREF(made);
          throw python_error();
        }
      }
    }
    ctx = made;
  }

  ~PyBackward() override {
    if (ctx != nullptr || attr_names != nullptr) {
      // Mostly freed with the GIL held (the output's Python object died): PyGILState is cheaper
      // than pybind11's guard there.
      const PyGILState_STATE gil = PyGILState_Ensure();
      Py_XDECREF(ctx);
      Py_XDECREF(attr_names);
      Py_XDECREF(attr_values);
      PyGILState_Release(gil);
    }
  }
};

// N is a template parameter so that the branch for the other torch is never instantiated.
template <typename Ptr, typename N = PyBackward>
Ptr make_node() {
  if constexpr (std::is_same_v<Ptr, std::shared_ptr<Node>>) {
    return std::make_shared<N>();
  } else {
    return c10::make_intrusive<N>();
  }
}

// The argument as Python sees it in setup_context's `inputs`: given or defaulted.
PyObject* input_object(const FastOp* f, PyObject* const* args, Py_ssize_t n, Py_ssize_t i) {
  if (i < n) {
    Py_INCREF(args[i]);
    return args[i];
  }
  const c10::IValue& v = (*f->defaults)[static_cast<size_t>(i)];
  if (v.isDouble()) return PyFloat_FromDouble(v.toDouble());
  if (v.isInt()) return PyLong_FromLongLong(v.toInt());
  if (v.isBool()) return PyBool_FromLong(v.toBool());
  Py_RETURN_NONE;
}

// The tensor arguments of a recording call, in argument order (no heap allocation for the usual few).
using Tensors = c10::SmallVector<at::Tensor, 4>;

// The byte offset of `type`'s __slots__ entry `name` (an object slot), or -1.
Py_ssize_t slot_offset(PyObject* type, PyObject* name) {
  PyObject* descr = _PyType_Lookup(reinterpret_cast<PyTypeObject*>(type), name);  // borrowed
  if (descr == nullptr || !Py_IS_TYPE(descr, &PyMemberDescr_Type)) return -1;
  const PyMemberDef* member = reinterpret_cast<PyMemberDescrObject*>(descr)->d_member;
  return member->type == T_OBJECT_EX && (member->flags & READONLY) == 0 ? member->offset : -1;
}

// Bit t: the t-th tensor argument needs a gradient.
size_t grad_mask(const Tensors& tensors) {
  size_t mask = 0;
  for (size_t t = 0; t < tensors.size(); ++t) mask |= static_cast<size_t>(tensors[t].requires_grad()) << t;
  return mask;
}

// ctx.needs_input_grad: a new reference, or null with a Python error set. One tuple per mask of
// the tensor arguments that need a gradient, shared by the calls (tuples are immutable).
PyObject* needs_input_grad(const FastOp* f, const Tensors& tensors) {
  const std::vector<bool>& tensor_arg = (*f->node_info)->tensor_arg;
  const size_t mask = grad_mask(tensors);
  std::vector<PyObject*>& cache = *f->needs_cache;
  const bool cacheable = mask < cache.size();
  if (cacheable && cache[mask] != nullptr) {
    Py_INCREF(cache[mask]);
    return cache[mask];
  }
  PyObject* needs = needs_tuple(tensor_arg, mask);
  if (needs == nullptr) return nullptr;
  if (cacheable) {
    Py_INCREF(needs);
    cache[mask] = needs;
  }
  return needs;
}

// Records the call in the autograd graph: out's grad_fn is a PyBackward whose
// saved tensors are what the spec's setup_context saves.
PyObject* record(const FastOp* f, PyObject* const* args, Py_ssize_t n, const Tensors& tensors, at::Tensor out) {
  const auto total = static_cast<Py_ssize_t>(f->kinds->size());
  NodePtr node_ptr = make_node<NodePtr>();
  auto* node = static_cast<PyBackward*>(node_ptr.get());
  node->backward = f->backward;
  node->info = *f->node_info;
  node->set_next_edges(torch::autograd::collect_next_edges(at::ArrayRef<at::Tensor>(tensors)));
  torch::autograd::set_history(out, node_ptr);

  if (f->saves != kSetupInPython && tensors.size() <= 64) {
    // A setup_context opforge recognised: what it saves goes straight into SavedVariables, and
    // the ctx waits for the backward (most graphs are freed without one running per node).
    node->ctx_type = f->ctx_type;
    node->plain_ctx = f->plain_ctx;
    node->needs_slot = f->needs_slot;
    node->needs_mask = grad_mask(tensors);
    if (f->saves == kSavesOutput) {
      node->saved.emplace_back(out, /*is_output=*/true);
    } else if (f->saves == kSavesAttributes) {
      const auto k = static_cast<Py_ssize_t>(f->attr_positions->size());
      PyObject* values = PyTuple_New(k);
      if (values == nullptr) return nullptr;
      for (Py_ssize_t i = 0; i < k; ++i) {
        PyObject* v = input_object(f, args, n, (*f->attr_positions)[static_cast<size_t>(i)]);
        if (v == nullptr) {
          Py_DECREF(values);
          return nullptr;
        }
        PyTuple_SET_ITEM(values, i, v);
      }
      Py_INCREF(f->attr_names);
      node->attr_names = f->attr_names;
      node->attr_values = values;
    } else if (f->saves >= 0) {
      const at::Tensor& v = THPVariable_Unpack(args[f->saves]);
      node->saved.emplace_back(v, /*is_output=*/v.is_same(out));
    }
    return THPVariable_Wrap(std::move(out));
  }

  auto* type = reinterpret_cast<PyTypeObject*>(f->ctx_type);
  PyObject* ctx = f->plain_ctx ? type->tp_alloc(type, 0) : PyObject_CallNoArgs(f->ctx_type);
  if (ctx == nullptr) return nullptr;
  node->ctx = ctx;  // the node owns it from here
  PyObject* needs = needs_input_grad(f, tensors);
  if (needs == nullptr) return nullptr;
  if (set_needs_input_grad(ctx, f->needs_slot, needs) < 0) return nullptr;
  PyObject* py_out = THPVariable_Wrap(out);
  if (py_out == nullptr) return nullptr;
  if (f->setup_context == Py_None) return py_out;  // a setup_context that does nothing (opforge.spec tells)
  PyObject* in = PyTuple_New(total);
  if (in == nullptr) {
    Py_DECREF(py_out);
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < total; ++i) PyTuple_SET_ITEM(in, i, input_object(f, args, n, i));
  PyObject* call_args[] = {ctx, in, py_out};
  PyObject* ok = PyObject_Vectorcall(f->setup_context, call_args, 3, nullptr);
  Py_DECREF(in);
  if (ok == nullptr) {
    Py_DECREF(py_out);
    return nullptr;
  }
  Py_DECREF(ok);
  // What setup_context saved moves into SavedVariables; the ctx keeps no tensor,
  // so a saved output does not hold its own grad_fn alive through Python. Read from
  // the ctx's own dict: a getattr that misses (nothing saved) would build an
  // AttributeError on every call.
  PyObject* dict = nullptr;
  PyObject* to_save = nullptr;  // borrowed
  if (f->to_save_slot >= 0) {
    to_save = *object_slot(ctx, f->to_save_slot);
  } else {
    dict = PyObject_GenericGetDict(ctx, nullptr);
    if (dict == nullptr) {
      Py_DECREF(py_out);
      return nullptr;
    }
    to_save = PyDict_GetItemWithError(dict, names.to_save);
  }
  if (to_save != nullptr) {
    if (PyTuple_Check(to_save)) {
      node->saved.reserve(static_cast<size_t>(PyTuple_GET_SIZE(to_save)));
      for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(to_save); ++i) {
        PyObject* item = PyTuple_GET_ITEM(to_save, i);
        if (item == Py_None) {
          node->saved.emplace_back(at::Tensor(), /*is_output=*/false);
          continue;
        }
        if (!THPVariable_Check(item)) {
          Py_XDECREF(dict);
          Py_DECREF(py_out);
          PyErr_Format(PyExc_TypeError, "%s: save_for_backward takes tensors or None, got %.100s",
                       node->info->name.c_str(), Py_TYPE(item)->tp_name);
          return nullptr;
        }
        const at::Tensor& v = THPVariable_Unpack(item);
        node->saved.emplace_back(v, /*is_output=*/v.is_same(out));
      }
    }
    if (dict == nullptr) {
      Py_CLEAR(*object_slot(ctx, f->to_save_slot));
    } else if (PyDict_DelItem(dict, names.to_save) < 0) {
      PyErr_Clear();
    }
  } else if (PyErr_Occurred()) {
    Py_XDECREF(dict);
    Py_DECREF(py_out);
    return nullptr;
  }
  Py_XDECREF(dict);
  return py_out;
}

// Elements from which a CPU kernel runs without the GIL.
constexpr int64_t kReleaseGilNumel = int64_t{1} << 15;

// Converts one positional argument, or returns false to leave the call to torch.ops.
bool push_argument(Kind kind, PyObject* arg, bool grad_mode, torch::jit::Stack& stack) {
  switch (kind) {
    case Kind::Tensor: {
      if (!THPVariable_CheckExact(arg)) return false;  // subclasses, None, numbers: the full path decides
      const at::Tensor& t = THPVariable_Unpack(arg);
      // Neither a gradient nor a tangent without autograd metadata: most calls skip both lookups.
      if (t.unsafeGetTensorImpl()->autograd_meta() != nullptr) {
        if (grad_mode && t.requires_grad()) return false;
        if (t._fw_grad(/*level=*/0).defined()) return false;  // a tangent: forward AD, as torch's isFwGradDefined
      }
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
  const bool writes = !f->writes->empty();
  // Inference mode leaves versions alone for some tensors and refuses writes to others: torch.ops decides.
  if (writes && c10::InferenceMode::is_enabled()) return not_implemented();
  const bool grad_mode = at::GradMode::is_enabled();
  // With an autograd formula, inputs that need a gradient stay on the fast path.
  const bool can_record = f->backward != nullptr && f->returns == 1 && !writes;
  // One stack per thread, reused: a call allocates none. A kernel that calls back into a fast
  // operator on the same thread (through Python) gets a stack of its own.
  thread_local torch::jit::Stack reused;
  thread_local bool reused_busy = false;
  torch::jit::Stack local;
  const bool reuse = !reused_busy;
  torch::jit::Stack& stack = reuse ? reused : local;
  struct Release {
    torch::jit::Stack& stack;
    bool reuse;
    ~Release() {
      stack.clear();  // no tensor outlives the call in the reused stack
      if (reuse) reused_busy = false;
    }
  } release{stack, reuse};
  if (reuse) reused_busy = true;
  stack.reserve(static_cast<size_t>(total));
  for (Py_ssize_t i = 0; i < total; ++i) {
    if (i >= n) {
      stack.push_back((*f->defaults)[static_cast<size_t>(i)]);
    } else if (!push_argument((*f->kinds)[static_cast<size_t>(i)], args[i], grad_mode && !can_record, stack)) {
      return not_implemented();
    }
  }
  bool needs_grad = false;
  // Whether to let other Python threads run during the kernel: a CPU kernel over a large tensor
  // runs for a while, but for a small one handing the GIL over and back costs more than the kernel.
  bool release_gil = false;
  Tensors tensors;
  for (const auto& v : stack) {
    if (!v.isTensor()) continue;
    const at::Tensor& t = v.toTensor();
    needs_grad = needs_grad || (grad_mode && t.requires_grad());
    release_gil = release_gil || !t.is_cpu() || t.numel() >= kReleaseGilNumel;
  }
  if (needs_grad) {
    for (const auto& v : stack) {
      if (v.isTensor()) tensors.push_back(v.toTensor());
    }
  }
  try {
    // Raw save/restore: pybind11's guard also looks up its internals on every call.
    struct NoGil {
      PyThreadState* state;
      ~NoGil() {
        if (state != nullptr) PyEval_RestoreThread(state);
      }
    } no_gil{release_gil ? PyEval_SaveThread() : nullptr};
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    f->op->callBoxed(&stack);
  } catch (const std::invalid_argument& e) {
    // A stable-ABI kernel's ValueError, as torch.ops (pybind11) raises it.
    PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  } catch (const std::out_of_range& e) {
    PyErr_SetString(PyExc_IndexError, e.what());
    return nullptr;
  }
  // What the Autograd kernel of a writing operator does after the call; for an inference tensor
  // written outside inference mode the bump raises, as it does there.
  for (const size_t i : *f->writes) THPVariable_Unpack(args[i]).unsafeGetTensorImpl()->bump_version();
  if (needs_grad) return record(f, args, n, tensors, std::move(stack[0]).toTensor());
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
  delete f->node_info;
  delete f->writes;
  if (f->needs_cache != nullptr) {
    for (PyObject* o : *f->needs_cache) Py_XDECREF(o);
  }
  delete f->needs_cache;
  Py_XDECREF(f->setup_context);
  Py_XDECREF(f->backward);
  Py_XDECREF(f->ctx_type);
  Py_XDECREF(f->attr_names);
  delete f->attr_positions;
  Py_TYPE(self)->tp_free(self);
}

// set_autograd(setup_context, backward, ctx_type[, saves]): the spec's formula, for calls
// whose inputs need a gradient (torch.library.register_autograd's protocol).
// setup_context None: one that does nothing, not called. `saves` ("output", or the position
// of a tensor argument): setup_context only saves that tensor, which is done here instead
// of calling it (it is still called for an operator of more than 64 tensor arguments).
// `saves` a tuple of (name, position) pairs: setup_context only sets those ctx attributes to
// those non-tensor arguments, which the backward does instead when it makes the ctx.
PyObject* set_autograd(PyObject* self, PyObject* const* args, Py_ssize_t n) {
  if (n != 3 && n != 4) {
    PyErr_SetString(PyExc_TypeError, "set_autograd(setup_context, backward, ctx_type[, saves])");
    return nullptr;
  }
  auto* f = reinterpret_cast<FastOp*>(self);
  for (PyObject** slot : {&f->setup_context, &f->backward, &f->ctx_type}) Py_XDECREF(*slot);
  f->setup_context = args[0];
  f->backward = args[1];
  f->ctx_type = args[2];
  for (PyObject* o : {args[0], args[1], args[2]}) Py_INCREF(o);
  f->needs_slot = f->to_save_slot = -1;
  f->plain_ctx = false;
  f->saves = kSetupInPython;
  Py_CLEAR(f->attr_names);
  f->attr_positions->clear();
  if (!PyType_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError, "set_autograd: ctx_type must be a class");
    return nullptr;
  }
  auto* type = reinterpret_cast<PyTypeObject*>(args[2]);
  // A node that makes its ctx in the backward keeps ctx_type without a reference of its own (so
  // that freeing it needs no GIL): the type is kept for the process's lifetime instead.
  Py_INCREF(args[2]);
  f->plain_ctx = type->tp_new == PyBaseObject_Type.tp_new && type->tp_init == PyBaseObject_Type.tp_init;
  f->needs_slot = slot_offset(args[2], names.needs_input_grad);
  f->to_save_slot = slot_offset(args[2], names.to_save);
  const PyObject* saves = n == 4 ? args[3] : Py_None;
  if (args[0] == Py_None) {
    f->saves = kSavesNothing;
  } else if (saves != Py_None) {
    if (PyUnicode_Check(saves) && PyUnicode_CompareWithASCIIString(const_cast<PyObject*>(saves), "output") == 0) {
      f->saves = kSavesOutput;
    } else if (PyLong_CheckExact(saves)) {
      const Py_ssize_t i = PyLong_AsSsize_t(const_cast<PyObject*>(saves));
      if (i < 0 || i >= f->required || (*f->kinds)[static_cast<size_t>(i)] != Kind::Tensor) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "set_autograd: saves=%zd is not a required tensor argument", i);
        return nullptr;
      }
      f->saves = i;
    } else if (PyTuple_Check(saves) && PyTuple_GET_SIZE(saves) > 0) {
      const Py_ssize_t k = PyTuple_GET_SIZE(saves);
      PyObject* attr_names = PyTuple_New(k);
      if (attr_names == nullptr) return nullptr;
      std::vector<Py_ssize_t> positions;
      for (Py_ssize_t j = 0; j < k; ++j) {
        PyObject* pair = PyTuple_GET_ITEM(saves, j);
        const bool pair_ok = PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2 &&
                             PyUnicode_Check(PyTuple_GET_ITEM(pair, 0)) && PyLong_CheckExact(PyTuple_GET_ITEM(pair, 1));
        const Py_ssize_t i = pair_ok ? PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 1)) : -1;
        if (!pair_ok || i < 0 || i >= static_cast<Py_ssize_t>(f->kinds->size()) ||
            (*f->kinds)[static_cast<size_t>(i)] == Kind::Tensor) {
          PyErr_Clear();
          Py_DECREF(attr_names);
          PyErr_SetString(PyExc_ValueError,
                          "set_autograd: saves as attributes takes (name, position) pairs of non-tensor arguments");
          return nullptr;
        }
        PyObject* name = PyTuple_GET_ITEM(pair, 0);
        Py_INCREF(name);
        PyTuple_SET_ITEM(attr_names, j, name);
        positions.push_back(i);
      }
      f->attr_names = attr_names;
      *f->attr_positions = std::move(positions);
      f->saves = kSavesAttributes;
    } else {
      PyErr_SetString(PyExc_TypeError,
                      "set_autograd: saves must be None, \"output\", an argument's position or (name, position) pairs");
      return nullptr;
    }
  }
  Py_RETURN_NONE;
}

PyMethodDef fast_op_methods[] = {
    {"set_autograd", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(set_autograd)), METH_FASTCALL,
     "set_autograd(setup_context, backward, ctx_type)"},
    {nullptr, nullptr, 0, nullptr}};

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
  std::vector<size_t> writes;
  Py_ssize_t required = 0;
  for (const auto& a : schema.arguments()) {
    if (a.kwarg_only()) Py_RETURN_NONE;
    const auto& type = *a.type();
    if (a.alias_info() != nullptr && a.alias_info()->isWrite()) {
      if (type != *c10::TensorType::get() || a.default_value().has_value()) Py_RETURN_NONE;
      writes.push_back(kinds.size());
    }
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
  f->setup_context = f->backward = f->ctx_type = nullptr;
  f->needs_slot = f->to_save_slot = -1;
  f->plain_ctx = false;
  f->saves = kSetupInPython;
  f->attr_names = nullptr;
  f->attr_positions = new std::vector<Py_ssize_t>();
  std::vector<bool> tensor_arg;
  for (const Kind k : *f->kinds) tensor_arg.push_back(k == Kind::Tensor);
  const auto tensor_count = static_cast<size_t>(std::count(tensor_arg.begin(), tensor_arg.end(), true));
  f->node_info = new std::shared_ptr<const NodeInfo>(
      std::make_shared<const NodeInfo>(NodeInfo{std::string(qualname) + "Backward", std::move(tensor_arg)}));
  f->writes = new std::vector<size_t>(std::move(writes));
  // Up to 6 tensor arguments (64 masks); beyond, each call builds its own tuple.
  f->needs_cache = new std::vector<PyObject*>(tensor_count <= 6 ? size_t{1} << tensor_count : 0, nullptr);
  return reinterpret_cast<PyObject*>(f);
  END_HANDLE_TH_ERRORS
}

// The autograd kernel of an operator that writes an argument (`Tensor(a!)`),
// boxed so that one serves every such schema; it does what torch's own out=
// ops do. With gradients on, no argument may require grad: the op records no
// graph, so the gradient would silently miss the write (or flow through an
// output that was overwritten). Then it runs the kernel below autograd and
// bumps the version of every tensor it wrote, so that a backward that saved
// one of them refuses to run on the new values.
inline void writes_arguments_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                                      torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const auto& args = schema.arguments();
  const size_t first = stack->size() - args.size();
  std::vector<at::Tensor> written;
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& value = (*stack)[first + i];
    if (!value.isTensor()) continue;
    const at::Tensor& t = value.toTensor();
    if (!t.defined()) continue;
    const bool writes = args[i].alias_info() != nullptr && args[i].alias_info()->isWrite();
    TORCH_CHECK(!(c10::GradMode::is_enabled() && t.requires_grad()), schema.name(), ": ",
                args[i].name(), " requires grad, but this operator ",
                writes ? "writes into it" : "writes into an argument",
                " and has no derivative (as torch's out= functions). Call it under "
                "torch.no_grad(), on detached tensors, or use the functional form");
    TORCH_CHECK_NOT_IMPLEMENTED(!t._fw_grad(/*level=*/0).defined(), schema.name(), ": ", args[i].name(),
                                " has a tangent, but forward-mode AD is not supported by an operator that "
                                "writes an argument (as torch's out= functions)");
    if (writes) written.push_back(t);
  }
  {
    at::AutoDispatchBelowADInplaceOrView below;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const at::Tensor& t : written) t.unsafeGetTensorImpl()->bump_version();
}

// writes_arguments(qualname): registers writes_arguments_autograd
// (what torch's own out= functions do: no argument may require grad or carry a
// tangent; written tensors get a new version) as the operator's Autograd
// kernel, for as long as the process lives. opforge.autograd has the same rules
// in Python, for when this module is not there.
PyObject* register_writes_arguments(PyObject* /*module*/, PyObject* arg) {
  HANDLE_TH_ERRORS
  const char* qualname = PyUnicode_AsUTF8(arg);
  if (qualname == nullptr) return nullptr;
  const std::string q(qualname);
  const auto sep = q.find("::");
  TORCH_CHECK(sep != std::string::npos, "opforge: writes_arguments takes ns::name, got ", q);
  // Libraries hold their registrations; kept for the process's lifetime.
  static std::vector<std::unique_ptr<torch::Library>> libraries;
  libraries.push_back(std::make_unique<torch::Library>(torch::Library::IMPL, q.substr(0, sep),
                                                       c10::DispatchKey::Autograd, __FILE__, __LINE__));
  libraries.back()->impl(q.substr(sep + 2).c_str(),
                         torch::CppFunction::makeFromBoxedFunction<&writes_arguments_autograd>());
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"fast_op", make_fast_op, METH_O, "fast_op(qualname) -> a callable for the eager fast path, or None"},
    {"writes_arguments", register_writes_arguments, METH_O,
     "writes_arguments(qualname): the autograd kernel of an operator that writes an argument"},
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
  type.tp_methods = opforge::fast_op_methods;
  if (PyType_Ready(&type) < 0) return nullptr;
  auto& names = opforge::names;
  names.needs_input_grad = PyUnicode_InternFromString("needs_input_grad");
  names.to_save = PyUnicode_InternFromString("to_save");
  names.saved_tensors = PyUnicode_InternFromString("saved_tensors");
  if (names.needs_input_grad == nullptr || names.to_save == nullptr || names.saved_tensors == nullptr) return nullptr;
  return PyModule_Create(&opforge_fast_module);
}

#endif  // TORCH_EXTENSION_NAME
