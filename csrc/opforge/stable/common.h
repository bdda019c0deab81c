#pragma once
// Helpers every operator wrapper of opforge's own library uses, on PyTorch's
// stable ABI: the library calls libtorch only through the stable C shim
// (torch/csrc/stable) and header-only code (torch/headeronly), so one build
// loads in every torch from TORCH_TARGET_VERSION on. No ATen or c10 header.
//
// What is here: input checks whose messages start with the operator's name
// and show the offending value (opforge/messages.h's words, shared with the ATen kit
// of users' builds and opforge/ops/_rules.py), the
// dtype mapping for the pure-CUDA launchers, output allocation, and kernel
// registration for every backend the build has.

// The oldest torch the library runs on: the headers hide every API newer than
// it, so code that would need a newer torch does not compile. The build passes
// it (opforge.builder.LIBRARY_TARGET); this default serves a bare compile.
#ifndef TORCH_TARGET_VERSION
#define TORCH_TARGET_VERSION (((0ULL + 2) << 56) | ((0ULL + 10) << 48))
#endif

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/Dispatch.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <dlfcn.h>

#include "opforge/dtype.h"
#include "opforge/messages.h"

namespace opforge {

using Tensor = torch::stable::Tensor;
using ScalarType = torch::headeronly::ScalarType;
using IntArrayRef = torch::headeronly::IntHeaderOnlyArrayRef;
using Library = torch::stable::detail::StableLibrary;

// The type a kernel computes in: float for the half types (rounded once on
// the way out), the type itself otherwise; ATen's opmath_type.
template <typename T>
struct OpMath {
  using type = T;
};
template <>
struct OpMath<c10::Half> {
  using type = float;
};
template <>
struct OpMath<c10::BFloat16> {
  using type = float;
};
template <typename T>
using opmath_t = typename OpMath<T>::type;

// A shape or stride list as torch prints it: [3, 4].
struct Dims {
  IntArrayRef v;
};
inline std::ostream& operator<<(std::ostream& os, const Dims& d) {
  os << '[';
  for (size_t i = 0; i < d.v.size(); ++i) os << (i ? ", " : "") << d.v[i];
  return os << ']';
}
inline Dims dims(IntArrayRef v) { return Dims{v}; }

// torch turns std::runtime_error into RuntimeError and std::invalid_argument
// into ValueError; a wrong dtype is the latter (the stable ABI has no way to
// raise TypeError).
#define OPFORGE_CHECK(cond, ...)                                            \
  do {                                                                      \
    if (!(cond)) throw std::runtime_error(::opforge::message(__VA_ARGS__)); \
  } while (0)
#define OPFORGE_CHECK_VALUE(cond, ...)                                         \
  do {                                                                         \
    if (!(cond)) throw std::invalid_argument(::opforge::message(__VA_ARGS__)); \
  } while (0)

inline DType to_dtype(ScalarType st) {
  switch (st) {
    case ScalarType::Float: return DType::Float32;
    case ScalarType::Half: return DType::Float16;
    case ScalarType::BFloat16: return DType::BFloat16;
    default: return DType::Float64;  // callers ran check_floating first
  }
}

// t.scalar_type() for the four floating dtypes without the stable conversion's chain of shim
// calls (one per dtype before the one found: seven for float32), read on every call of a kernel,
// several times; any other dtype through that conversion.
inline ScalarType dtype_of(const Tensor& t) {
  static const int32_t float32 = aoti_torch_dtype_float32();
  static const int32_t float16 = aoti_torch_dtype_float16();
  static const int32_t bfloat16 = aoti_torch_dtype_bfloat16();
  static const int32_t float64 = aoti_torch_dtype_float64();
  int32_t code = 0;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(t.get(), &code));
  if (code == float32) return ScalarType::Float;
  if (code == float16) return ScalarType::Half;
  if (code == bfloat16) return ScalarType::BFloat16;
  if (code == float64) return ScalarType::Double;
  return t.scalar_type();
}

// t's data as T, for a kernel dispatched on the dtype that its checks gave every operand: the
// stable typed accessors check the dtype again on every call, through the slow conversion.
template <typename T>
inline const T* data_as(const Tensor& t) {
  return static_cast<const T*>(t.const_data_ptr());
}
template <typename T>
inline T* mutable_data_as(const Tensor& t) {
  return static_cast<T*>(t.mutable_data_ptr());
}

// A device as torch prints it: cpu, cuda:0.
inline std::string device_name(const Tensor& t) {
  if (t.is_cpu()) return "cpu";
  if (t.is_cuda()) return message("cuda:", static_cast<int>(t.get_device_index()));
  return message("device ", static_cast<int>(t.get_device_index()));
}

// Two shim calls for CPU tensors (is_cuda() and is_cpu() are two each, per tensor): every kernel asks.
inline bool same_device(const Tensor& a, const Tensor& b) {
  static const int32_t cpu = aoti_torch_device_type_cpu();
  int32_t type_a = 0;
  int32_t type_b = 0;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(a.get(), &type_a));
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(b.get(), &type_b));
  if (type_a != type_b) return false;
  return type_a == cpu || a.get_device_index() == b.get_device_index();
}

inline bool same_dims(IntArrayRef a, IntArrayRef b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}

inline void check_defined(const char* op, const char* name, const Tensor& t) {
  OPFORGE_CHECK(t.defined(), msg::undefined(op, name));
}

inline void check_floating(const char* op, const char* name, const Tensor& t) {
  check_defined(op, name, t);
  OPFORGE_CHECK_VALUE(is_floating(dtype_of(t)), msg::not_floating(op, name, dtype_of(t)));
}

// Device and dtype of `t` equal to those of `ref`, shapes free: for ops
// whose tensors have different shapes (lltm, gemm), where check_same does not fit.
inline void check_like(const char* op, const char* ref_name, const Tensor& ref, const char* name, const Tensor& t) {
  check_defined(op, name, t);
  OPFORGE_CHECK(same_device(ref, t), msg::devices_differ(op, ref_name, name, device_name(ref), device_name(t)));
  OPFORGE_CHECK_VALUE(dtype_of(ref) == dtype_of(t),
                      msg::dtypes_differ(op, ref_name, name, dtype_of(ref), dtype_of(t)));
}

// `layout` names the dimensions, e.g. "[batch, input_features]".
inline void check_2d(const char* op, const char* name, const Tensor& t, const char* layout) {
  OPFORGE_CHECK(t.dim() == 2, msg::not_2d(op, name, layout, dims(t.sizes())));
}

// `t` has exactly `want`; `how` says where the expected sizes come from.
inline void check_shape(const char* op, const char* name, const Tensor& t, IntArrayRef want, const char* how) {
  OPFORGE_CHECK(same_dims(t.sizes(), want), msg::wrong_shape(op, name, how, dims(want), dims(t.sizes())));
}

// Same device, dtype and shape: what every elementwise operator of two or more
// tensors asks. No broadcasting: a shape mismatch is almost always a bug in
// the caller, and silent broadcasting would hide it.
inline void check_same(const char* op, const char* name_a, const Tensor& a, const char* name_b, const Tensor& b) {
  check_like(op, name_a, a, name_b, b);
  OPFORGE_CHECK(same_dims(a.sizes(), b.sizes()), msg::shapes_differ(op, name_a, name_b, dims(a.sizes()), dims(b.sizes())));
}

// Whether some element of `t` is stored twice: a dimension of more than one
// element with stride 0 (an expanded view). Other overlapping layouts are not
// looked for, as ATen's has_internal_overlap answers "too hard" for them.
inline bool has_internal_overlap(const Tensor& t) {
  const IntArrayRef sizes = t.sizes();
  const IntArrayRef strides = t.strides();
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] > 1 && strides[d] == 0) return true;
  }
  return false;
}

// The bytes [first, last] a tensor's elements span; empty for no elements.
inline std::pair<uintptr_t, uintptr_t> byte_span(const Tensor& t) {
  const auto base = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  int64_t last = 0;
  const IntArrayRef sizes = t.sizes();
  const IntArrayRef strides = t.strides();
  for (size_t d = 0; d < sizes.size(); ++d) last += (sizes[d] - 1) * strides[d];
  return {base, base + static_cast<uintptr_t>((last + 1) * static_cast<int64_t>(t.element_size())) - 1};
}

// Whether two tensors may share memory: their byte spans intersect. Tensors
// of different storages never do; within one storage this refuses whatever
// ATen's overlap check would not call disjoint.
inline bool may_overlap(const Tensor& a, const Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto [a0, a1] = byte_span(a);
  const auto [b0, b1] = byte_span(b);
  return a0 <= b1 && b0 <= a1;
}

// An out= tensor must match the result exactly and must not share memory with
// an input: the kernels read and write in an order that only holds for
// disjoint buffers, so an overlap would be a silent wrong answer.
inline void check_out(const char* op, const Tensor& out, const Tensor& like,
                      std::initializer_list<std::pair<const char*, const Tensor*>> inputs) {
  check_defined(op, "out", out);
  OPFORGE_CHECK(same_device(out, like), msg::out_device(op, device_name(like), device_name(out)));
  OPFORGE_CHECK_VALUE(dtype_of(out) == dtype_of(like), msg::out_dtype(op, dtype_of(like), dtype_of(out)));
  OPFORGE_CHECK(same_dims(out.sizes(), like.sizes()), msg::out_shape(op, dims(like.sizes()), dims(out.sizes())));
  OPFORGE_CHECK(!has_internal_overlap(out), msg::out_self_overlap(op, dims(out.strides())));
  for (const auto& [name, input] : inputs) {
    OPFORGE_CHECK(!may_overlap(out, *input), msg::out_shares(op, name, out.const_data_ptr()));
  }
}

// The shim's code of a dtype.
inline int32_t shim_dtype(ScalarType st) {
  switch (st) {
    case ScalarType::Float: return aoti_torch_dtype_float32();
    case ScalarType::Half: return aoti_torch_dtype_float16();
    case ScalarType::BFloat16: return aoti_torch_dtype_bfloat16();
    case ScalarType::Double: return aoti_torch_dtype_float64();
    case ScalarType::Char: return aoti_torch_dtype_int8();
    case ScalarType::Byte: return aoti_torch_dtype_uint8();
    case ScalarType::Int: return aoti_torch_dtype_int32();
    case ScalarType::Long: return aoti_torch_dtype_int64();
    default: break;
  }
  throw std::invalid_argument(message("opforge: no tensor of dtype ", dtype_name(st), " is allocated here"));
}

// A new tensor of `sizes` and `strides` on `like`'s device. The shim allocates
// a CPU tensor straight from the allocator (as TensorIterator does torch's own
// results), not through the dispatcher.
inline Tensor empty_strided(IntArrayRef sizes, IntArrayRef strides, ScalarType dtype, const Tensor& like) {
  AtenTensorHandle handle = nullptr;
  const bool cuda = like.is_cuda();
  const int32_t device_type = cuda ? aoti_torch_device_type_cuda() : aoti_torch_device_type_cpu();
  TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(static_cast<int64_t>(sizes.size()), sizes.data(), strides.data(),
                                                  shim_dtype(dtype), device_type, cuda ? like.get_device_index() : 0,
                                                  &handle));
  return Tensor(handle);
}

// Row-major strides of `sizes`.
inline std::vector<int64_t> contiguous_strides(IntArrayRef sizes) {
  std::vector<int64_t> strides(sizes.size());
  int64_t next = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    strides[i] = next;
    next *= sizes[i] > 1 ? sizes[i] : 1;
  }
  return strides;
}

// A new row-major tensor of `sizes` and `dtype` on `like`'s device.
inline Tensor empty(std::initializer_list<int64_t> sizes, ScalarType dtype, const Tensor& like) {
  const IntArrayRef s(sizes.begin(), sizes.size());
  const std::vector<int64_t> strides = contiguous_strides(s);
  return empty_strided(s, IntArrayRef(strides.data(), strides.size()), dtype, like);
}
inline Tensor empty_like_shape(IntArrayRef sizes, const Tensor& like) {
  const std::vector<int64_t> strides = contiguous_strides(sizes);
  return empty_strided(sizes, IntArrayRef(strides.data(), strides.size()), dtype_of(like), like);
}

// Calls an ATen operator through the dispatcher (the shim's boxed call), for
// the few a wrapper hands to torch (matrix products, a concatenation): each
// argument is converted as TORCH_BOX converts a kernel's; a Scalar argument
// (addmm's alpha and beta) is not among them. Returns the first output; an
// out= overload's output is the out tensor itself.
template <typename... Args>
Tensor call_aten(const char* name, const char* overload, const Args&... args) {
  std::array<StableIValue, sizeof...(Args) == 0 ? 1 : sizeof...(Args)> stack{torch::stable::detail::from(args)...};
  TORCH_ERROR_CODE_CHECK(torch_call_dispatcher(name, overload, stack.data(), TORCH_ABI_VERSION));
  return torch::stable::detail::to<Tensor>(stack[0]);
}

// `t` itself when contiguous, else a contiguous copy: the check first, so the
// usual case costs no call through the dispatcher (as ATen's contiguous()).
inline Tensor dense(const Tensor& t) { return t.is_contiguous() ? t : torch::stable::contiguous(t); }

// A CPU elementwise loop over [0, n) on torch's thread pool (through the shim).
template <typename F>
inline void parallel_for_each(int64_t n, F&& f) {
  // torch's own elementwise grain: below 32K elements waking the thread team
  // costs more than these streaming loops.
  constexpr int64_t kGrain = 32768;
  torch::stable::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) f(i);
  });
}

// Dispatch on the four floating dtypes the operators accept; `scalar_t` is
// float, c10::Half, c10::BFloat16 or double.
#define OPFORGE_DISPATCH_FLOATING(TYPE, NAME, ...)                          \
  THO_DISPATCH_SWITCH(TYPE, NAME, THO_DISPATCH_CASE(ScalarType::Float, __VA_ARGS__) \
                                      THO_DISPATCH_CASE(ScalarType::Half, __VA_ARGS__) \
                                          THO_DISPATCH_CASE(ScalarType::BFloat16, __VA_ARGS__) \
                                              THO_DISPATCH_CASE(ScalarType::Double, __VA_ARGS__))

#ifdef OPFORGE_WITH_CUDA
// The current CUDA stream of `device`, as an opaque pointer for the pure-CUDA
// launchers. The shim function lives in libtorch_cuda, which a CPU build of
// torch lacks: it is looked up when first needed (a CUDA tensor means a CUDA
// torch), so that the same library also loads where torch has no CUDA.
inline void* current_cuda_stream(int32_t device) {
  using Get = AOTITorchError (*)(int32_t, void**);
  static const Get get = [] {
    void* fn = dlsym(RTLD_DEFAULT, "aoti_torch_get_current_cuda_stream");
    if (fn == nullptr) {
      // torch loads its libraries without RTLD_GLOBAL: ask the loaded one.
      if (void* lib = dlopen("libtorch_cuda.so", RTLD_LAZY | RTLD_NOLOAD)) fn = dlsym(lib, "aoti_torch_get_current_cuda_stream");
    }
    return reinterpret_cast<Get>(fn);
  }();
  OPFORGE_CHECK(get != nullptr, "opforge: a CUDA tensor, but this torch has no CUDA stream API (libtorch_cuda)");
  void* stream = nullptr;
  OPFORGE_CHECK(get(device, &stream) == AOTI_TORCH_SUCCESS, "opforge: no current CUDA stream for device ", device);
  return stream;
}
#endif

// Runs an operator's kernel over `out`'s elements: on a CUDA tensor, the
// launcher under a guard for its device with the current stream
// (`launch(void* stream)` returns nullptr or CUDA's error string); on the CPU,
// `cpu_loop()`. Nothing runs for an empty tensor (a zero-block grid is a
// launch error). `launch` is a generic lambda so a CPU-only build never
// instantiates it and needs no launcher symbols.
template <typename Launch, typename CpuLoop>
void run_kernel(const char* op, const Tensor& out, Launch&& launch, CpuLoop&& cpu_loop) {
  if (out.numel() == 0) return;
#ifdef OPFORGE_WITH_CUDA
  if (out.is_cuda()) {
    const int32_t device = out.get_device_index();
    const torch::stable::accelerator::DeviceGuard guard(device);
    const char* error = launch(current_cuda_stream(device));
    if (error != nullptr && std::string(error).find("no kernel image") != std::string::npos) {
      // The most common launch failure of a JIT-built library: it was built
      // for other archs than this GPU's (TORCH_CUDA_ARCH_LIST set elsewhere).
      OPFORGE_CHECK(false, op, ": CUDA kernel failed: ", error,
                    ". The op library has no code for this GPU's architecture: rebuild with "
                    "TORCH_CUDA_ARCH_LIST including it (or unset it to target the GPUs found); "
                    "`opforge doctor` lists both");
    }
    OPFORGE_CHECK(error == nullptr, op, ": CUDA kernel failed: ", error);
    return;
  }
#endif
  cpu_loop();
}

}  // namespace opforge

namespace opforge::detail {

// Whether this copy of the library found its operators defined already: a
// second copy of the file loaded into one process (torch.ops.load_library of a
// CMake build after `import opforge`). Its registrations then stop, and the
// copy registers nothing: the operators keep the first copy's kernels.
inline bool& registration_refused() {
  static bool refused = false;
  return refused;
}

// The file this code was loaded from, for the message.
inline const char* this_library() {
  Dl_info info{};
  return dladdr(reinterpret_cast<void*>(&registration_refused), &info) != 0 && info.dli_fname != nullptr
             ? info.dli_fname
             : "the op library";
}

// A fragment's definitions with each one's error raised. torch's StableLibrary::def drops the
// shim's error code in some versions (2.11's does): there a second copy of the library defined
// nothing, was not told, and went on to register its kernels over the first copy's.
class CheckedDefs final {
 public:
  CheckedDefs(const char* ns, const char* file, uint32_t line) {
    if (aoti_torch_library_init_fragment(ns, file, line, &lib_) != AOTI_TORCH_SUCCESS) {
      throw std::runtime_error(std::string("torch refused a library fragment of namespace ") + ns);
    }
  }
  CheckedDefs(const CheckedDefs&) = delete;
  CheckedDefs& operator=(const CheckedDefs&) = delete;
  ~CheckedDefs() {
    if (lib_ != nullptr) aoti_torch_delete_library_object(lib_);
  }
  CheckedDefs& def(const char* schema) {
    if (aoti_torch_library_def(lib_, schema) != AOTI_TORCH_SUCCESS) {
      // The shim returns no reason (2.11 logs it on stderr): for a second copy, defined already.
      throw std::runtime_error(std::string("torch refused the definition ") + schema);
    }
    return *this;
  }

 private:
  TorchLibraryHandle lib_ = nullptr;
};

// STABLE_TORCH_LIBRARY_FRAGMENT / _IMPL's static initialiser, whose error
// would escape a static constructor and end the process (std::terminate):
// here it is caught, said once on stderr, and every later registration of
// this copy is skipped. `args` are the library's constructor's.
template <typename Lib>
class GuardedLibraryInit final {
 public:
  template <typename... Args>
  GuardedLibraryInit(void (*fn)(Lib&), const char* ns, Args... args) {
    if (registration_refused()) {
      return;
    }
    try {
      lib_.emplace(args...);
      fn(*lib_);
    } catch (const std::exception& e) {
      lib_.reset();  // undoes what this block registered before the error
      registration_refused() = true;
      std::string why = e.what();
      why = why.substr(0, why.find('\n'));
      std::fprintf(stderr,
                   "opforge: %s registers nothing: its operators in namespace '%s' are defined already, most "
                   "likely by another copy of the op library loaded first (import opforge loads one; load one "
                   "copy per process, or set OPFORGE_LIBRARY to this file before import opforge). The error: %s\n",
                   this_library(), ns, why.c_str());
    }
  }

 private:
  std::optional<Lib> lib_;
};

}  // namespace opforge::detail

// STABLE_TORCH_LIBRARY_FRAGMENT / STABLE_TORCH_LIBRARY_IMPL through
// GuardedLibraryInit; the static objects keep the stable macros' names, which
// opforge.builder.registrations reads from the symbol table before a load.
// The trailing arguments are the library's constructor's.
#define OPFORGE_GUARDED_INIT(prefix, Lib, ns, m, uid, ...)                                                 \
  static void C10_CONCATENATE(prefix##_init_##ns##_, uid)(Lib&);                                          \
  static const opforge::detail::GuardedLibraryInit<Lib> C10_CONCATENATE(prefix##_static_init_##ns##_, uid)( \
      &C10_CONCATENATE(prefix##_init_##ns##_, uid), #ns, __VA_ARGS__);                                    \
  void C10_CONCATENATE(prefix##_init_##ns##_, uid)(Lib & m)

// The library's operator definitions: STABLE_TORCH_LIBRARY_FRAGMENT, guarded.
#define OPFORGE_LIBRARY_FRAGMENT(ns, m)                                                             \
  OPFORGE_GUARDED_INIT(STABLE_TORCH_LIBRARY_FRAGMENT, opforge::detail::CheckedDefs, ns, m, C10_UID, #ns, \
                       __FILE__, __LINE__)
#define OPFORGE_LIBRARY_IMPL(ns, k, m)                                                                 \
  OPFORGE_GUARDED_INIT(STABLE_TORCH_LIBRARY_IMPL, torch::stable::detail::StableLibrary, ns, m,           \
                       C10_CONCATENATE(k##_, C10_UID), torch::stable::detail::StableLibrary::Kind::IMPL, \
                       #ns, #k, __FILE__, __LINE__)

// Registers one device-agnostic wrapper set, `register_fn(opforge::Library&)`,
// for the CPU and (in a CUDA build) the CUDA dispatch keys, so an operator
// writes its registrations once. An operator that writes an argument gets its
// autograd kernel outside this library (opforge.autograd: the fast-path
// module's C++ one, else a Python one), as the stable ABI does not reach
// autograd's state.
#ifdef OPFORGE_WITH_CUDA
#define OPFORGE_REGISTER_KERNELS(ns, register_fn)           \
  OPFORGE_LIBRARY_IMPL(ns, CPU, m) { register_fn(m); } \
  OPFORGE_LIBRARY_IMPL(ns, CUDA, m) { register_fn(m); }
#else
#define OPFORGE_REGISTER_KERNELS(ns, register_fn) \
  OPFORGE_LIBRARY_IMPL(ns, CPU, m) { register_fn(m); }
#endif
