#pragma once
// The ATen kit that users' own (non-stable) builds include: input checks whose
// messages start with the operator's name and show the offending value (the words
// are opforge/messages.h's, shared with the library's stable kit), the dtype
// mapping for the pure-CUDA launchers, a CPU loop, and kernel registration for
// every backend the build has.
//
// Minimal headers on purpose: ATen/core/Tensor.h + torch/library.h compile in a
// fraction of the time torch/extension.h takes (6 s vs 24 s per file measured
// on 2 cores).

#include <ATen/Dispatch.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include <string>

#include "opforge/dtype.h"
#include "opforge/messages.h"

namespace opforge {

inline DType to_dtype(at::ScalarType st) {
  switch (st) {
    case at::kFloat: return DType::Float32;
    case at::kHalf: return DType::Float16;
    case at::kBFloat16: return DType::BFloat16;
    default: return DType::Float64;  // callers ran check_floating first
  }
}

inline void check_defined(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), msg::undefined(op, name));
}

inline void check_floating(const char* op, const char* name, const at::Tensor& t) {
  check_defined(op, name, t);
  TORCH_CHECK_VALUE(is_floating(t.scalar_type()), msg::not_floating(op, name, t.scalar_type()));
}

// Device and dtype of `t` equal to those of `ref`, shapes free: for ops
// whose tensors have different shapes (lltm, gemm), where check_same does not fit.
inline void check_like(const char* op, const char* ref_name, const at::Tensor& ref, const char* name,
                       const at::Tensor& t) {
  check_defined(op, name, t);
  TORCH_CHECK(ref.device() == t.device(), msg::devices_differ(op, ref_name, name, ref.device(), t.device()));
  TORCH_CHECK_VALUE(ref.scalar_type() == t.scalar_type(),
                    msg::dtypes_differ(op, ref_name, name, ref.scalar_type(), t.scalar_type()));
}

// `layout` names the dimensions, e.g. "[batch, input_features]".
inline void check_2d(const char* op, const char* name, const at::Tensor& t, const char* layout) {
  TORCH_CHECK(t.dim() == 2, msg::not_2d(op, name, layout, t.sizes()));
}

// `t` has exactly `want`; `how` says where the expected sizes come from.
inline void check_shape(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef want,
                        const char* how) {
  TORCH_CHECK(t.sizes() == want, msg::wrong_shape(op, name, how, want, t.sizes()));
}

// Same device, dtype and shape: what every elementwise operator of two or more
// tensors asks. No broadcasting: a shape mismatch is almost always a bug in
// the caller, and silent broadcasting would hide it.
inline void check_same(const char* op, const char* name_a, const at::Tensor& a, const char* name_b,
                       const at::Tensor& b) {
  check_like(op, name_a, a, name_b, b);
  TORCH_CHECK(a.sizes() == b.sizes(), msg::shapes_differ(op, name_a, name_b, a.sizes(), b.sizes()));
}

// An out= tensor must match the result exactly and must not share memory with
// an input: the kernels read and write in an order that only holds for
// disjoint buffers, so an overlap would be a silent wrong answer.
inline void check_out(const char* op, const at::Tensor& out, const at::Tensor& like,
                      std::initializer_list<std::pair<const char*, const at::Tensor*>> inputs) {
  check_defined(op, "out", out);
  TORCH_CHECK(out.device() == like.device(), msg::out_device(op, like.device(), out.device()));
  TORCH_CHECK_VALUE(out.scalar_type() == like.scalar_type(), msg::out_dtype(op, like.scalar_type(), out.scalar_type()));
  TORCH_CHECK(out.sizes() == like.sizes(), msg::out_shape(op, like.sizes(), out.sizes()));
  TORCH_CHECK(at::has_internal_overlap(out) != at::MemOverlap::Yes, msg::out_self_overlap(op, out.strides()));
  for (const auto& [name, input] : inputs) {
    // Different storages cannot overlap. Within one storage, ATen answers
    // TooHard for strided views; we refuse those too rather than guess.
    const bool shared = out.storage().is_alias_of(input->storage());
    const auto status = shared ? at::get_overlap_status(out, *input) : at::MemOverlapStatus::No;
    TORCH_CHECK(status == at::MemOverlapStatus::No, msg::out_shares(op, name, out.data_ptr()));
  }
}

// A CPU elementwise loop over [0, n): real parallel work through ATen's thread
// pool, not a call to the matching ATen operator.
template <typename F>
inline void parallel_for_each(int64_t n, F&& f) {
  // 32K elements per task: below that, waking the OpenMP team costs more
  // than the loop itself on these streaming kernels.
  constexpr int64_t kGrain = 32768;
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) f(i);
  });
}

// Dispatch on the four floating dtypes the operators accept.
#define OPFORGE_DISPATCH_FLOATING(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)

#ifdef OPFORGE_WITH_CUDA
// The current CUDA stream of the tensor's device, as an opaque pointer for the
// pure-CUDA launchers (defined in cuda_stream.cpp, the one file of the library
// that includes c10/cuda headers).
void* current_cuda_stream(const at::Device& device);
#endif

// Runs an operator's kernel over `out`'s elements: on a CUDA tensor, the
// launcher under a guard for its device with the current stream
// (`launch(void* stream)` returns nullptr or CUDA's error string); on the CPU,
// `cpu_loop()`. Nothing runs for an empty tensor (a zero-block grid is a
// launch error). `launch` is a generic lambda so a CPU-only build never
// instantiates it and needs no launcher symbols.
template <typename Launch, typename CpuLoop>
void run_kernel(const char* op, const at::Tensor& out, Launch&& launch, CpuLoop&& cpu_loop) {
  if (out.numel() == 0) return;
#ifdef OPFORGE_WITH_CUDA
  if (out.is_cuda()) {
    const c10::DeviceGuard guard(out.device());
    const char* error = launch(current_cuda_stream(out.device()));
    if (error != nullptr && std::string(error).find("no kernel image") != std::string::npos) {
      // The most common launch failure of a JIT-built library: it was built
      // for other archs than this GPU's (TORCH_CUDA_ARCH_LIST set elsewhere).
      TORCH_CHECK(false, op, ": CUDA kernel failed: ", error,
                  ". The op library has no code for this GPU's architecture: rebuild with "
                  "TORCH_CUDA_ARCH_LIST including it (or unset it to target the GPUs found); "
                  "`opforge doctor` lists both");
    }
    TORCH_CHECK(error == nullptr, op, ": CUDA kernel failed: ", error);
    return;
  }
#endif
  cpu_loop();
}

}  // namespace opforge

// Registers one device-agnostic wrapper set, `register_fn(torch::Library&)`,
// for the CPU and (in a CUDA build) the CUDA dispatch keys, so an operator
// writes its registrations once.
#ifdef OPFORGE_WITH_CUDA
#define OPFORGE_REGISTER_KERNELS(ns, register_fn)          \
  TORCH_LIBRARY_IMPL(ns, CPU, m) { register_fn(m); }       \
  TORCH_LIBRARY_IMPL(ns, CUDA, m) { register_fn(m); }
#else
#define OPFORGE_REGISTER_KERNELS(ns, register_fn) \
  TORCH_LIBRARY_IMPL(ns, CPU, m) { register_fn(m); }
#endif
