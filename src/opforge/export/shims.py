"""AOTInductor C shims generated from operator schemas.

Without a C shim, AOTInductor's C++ wrapper calls a custom operator through
its proxy executor: a generic boxed call, laid out from a JSON description of
each call that the package carries. Inductor calls a C function
instead for each operator listed in ``aot_inductor.custom_ops_to_c_shims``
(its declaration) and links the libraries of ``aot_inductor.custom_op_libs``.
Those functions are written by hand elsewhere; here they are generated from
the schema: ``aoti_torch_<device>_<name>`` (Inductor's own naming: the
operator's name without its namespace or overload) over ``AtenTensorHandle``,
each argument in the C type Inductor's wrapper passes (``Tensor?`` a pointer to
a handle, ``int`` ``int64_t``, ``bool`` and ``ScalarType`` ``int32_t``, a list
a pointer and a length), new tensors returned through out pointers. The body
calls the operator through the stable ABI's boxed dispatcher call, so the shim
library is itself on the stable ABI: one build serves every torch from 2.10 on,
and CPU and CUDA alike (the dispatcher picks the kernel by device).

An operator gets no shim (the proxy stays) where its schema holds an argument
or return type outside that set, or where its shim's name would be taken: by a
function libtorch already exports, or by another operator of the same name in
another namespace or overload.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from opforge.builder.config import LIBRARY_TARGET
from opforge.builder.jit import BuildConfig, build_library, cache_root
from opforge.builder.stable import target_flag

DEVICES: tuple[str, ...] = ("cpu", "cuda")
#: Exported by every shim library: how many shim calls it served (what proves that a package ran no proxy).
COUNTER = "opforge_aoti_shim_calls"


@dataclass(frozen=True)
class Shim:
    """One operator's C shim: its declarations (one per device) and its definitions' source."""

    op: torch._ops.OpOverload
    declarations: tuple[str, ...]
    source: str

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.split("(")[0].split()[-1] for d in self.declarations)


class NoShim(ValueError):
    """Why an operator cannot have a C shim (its calls then go through the proxy)."""


# schema type -> (C parameter(s), expression giving the StableIValue); {n} is the argument's name.
_SCALARS: dict[str, tuple[str, str]] = {
    "Tensor": ("AtenTensorHandle {n}", "opforge_shim::tensor({n})"),
    "Optional[Tensor]": ("AtenTensorHandle* {n}", "opforge_shim::optional_tensor({n})"),
    "int": ("int64_t {n}", "opforge_shim::box({n})"),
    "SymInt": ("int64_t {n}", "opforge_shim::box({n})"),
    "Optional[int]": ("int64_t* {n}", "opforge_shim::optional({n})"),
    "Optional[SymInt]": ("int64_t* {n}", "opforge_shim::optional({n})"),
    "float": ("double {n}", "opforge_shim::box({n})"),
    "Optional[float]": ("double* {n}", "opforge_shim::optional({n})"),
    "bool": ("int32_t {n}", "opforge_shim::box(static_cast<bool>({n}))"),
    "Optional[bool]": ("int32_t* {n}", "opforge_shim::optional_bool({n})"),
    "ScalarType": ("int32_t {n}", "opforge_shim::dtype({n})"),
    "Optional[ScalarType]": ("int32_t* {n}", "opforge_shim::optional_dtype({n})"),
    "List[int]": ("const int64_t* {n}, int64_t {n}_len_", "opforge_shim::int_list({n}, {n}_len_)"),
    "List[SymInt]": ("const int64_t* {n}, int64_t {n}_len_", "opforge_shim::int_list({n}, {n}_len_)"),
    "List[bool]": ("const int32_t* {n}, int64_t {n}_len_", "opforge_shim::bool_list({n}, {n}_len_)"),
}


def shim_for(op: torch._ops.OpOverload, taken: Iterable[str] = ()) -> Shim:
    """The C shim of ``op``; NoShim (naming the operator and the cause) where it cannot have one.
    ``taken``: shim names already in use (other operators'), which this one must not reuse."""
    schema = op._schema
    qualname = f"{schema.name}{'.' + schema.overload_name if schema.overload_name else ''}"
    params: list[str] = []
    values: list[str] = []
    for i, a in enumerate(schema.arguments):
        # real_type: a ScalarType (an int to TorchScript) is passed as int32_t, an int as int64_t.
        kind = str(a.real_type)
        if kind not in _SCALARS:
            raise NoShim(f"{qualname}: argument {a.name} is a {a.real_type}, a type the generated shims do not pass")
        name = f"a{i}_{a.name}"
        param, value = _SCALARS[kind]
        params.append(param.format(n=name))
        values.append(value.format(n=name))
    for k, r in enumerate(schema.returns):
        if str(r.type) != "Tensor":
            raise NoShim(f"{qualname}: return {k} is a {r.type}, not a Tensor")
        params.append(f"AtenTensorHandle* ret{k}")
    short = schema.name.split("::")[-1]
    names = [f"aoti_torch_{device}_{short}" for device in DEVICES]
    taken = set(taken)
    for name in names:
        if name in taken:
            raise NoShim(f"{qualname}: its shim's name {name} (Inductor names a shim by the operator's name alone) is another operator's")
        if _libtorch_exports(name):
            raise NoShim(f"{qualname}: its shim's name {name} is a function libtorch already exports")
    signature = ", ".join(params) or "void"
    declarations = tuple(f"AOTITorchError {name}({signature})" for name in names)
    stack = max(len(values), len(schema.returns), 1)
    body = [f"  std::array<StableIValue, {stack}> stack{{}};"]
    body += [f"  stack[{i}] = {v};" for i, v in enumerate(values)]
    body.append(f'  opforge_shim::call("{schema.name}", "{schema.overload_name}", stack.data());')
    body += [f"  opforge_shim::put(stack[{k}], ret{k});" for k in range(len(schema.returns))]
    impl = f"opforge_shim_{hashlib.sha1(qualname.encode()).hexdigest()[:12]}"
    source = [f"// {schema}", f"static void {impl}({signature}) {{", *body, "}"]
    args = ", ".join(p.split()[-1] for p in ", ".join(params).split(", ")) if params else ""
    for decl in declarations:
        source += [
            f'extern "C" OPFORGE_SHIM_EXPORT {decl} {{',
            f'  return opforge_shim::guarded("{qualname}", [&] {{ {impl}({args}); }});',
            "}",
        ]
    return Shim(op, declarations, "\n".join(source) + "\n")


_PRELUDE = r"""// Generated by opforge from operator schemas: AOTInductor C shims that call
// each operator through the stable ABI's boxed dispatcher call.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/stableivalue_conversions.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <optional>
#include <vector>

#define OPFORGE_SHIM_EXPORT __attribute__((visibility("default")))

static std::atomic<int64_t> shim_calls{0};

extern "C" OPFORGE_SHIM_EXPORT int64_t opforge_aoti_shim_calls() { return shim_calls.load(); }

namespace opforge_shim {

// Named apart from the global box() that the stable headers keep for older callers: a call on a
// handle would find both.
template <typename T>
inline StableIValue box(const T& v) {
  return torch::stable::detail::from(v);
}

// The wrapper lends its handles: the stack takes a new reference to each, which the call consumes.
inline StableIValue tensor(AtenTensorHandle h) {
  AtenTensorHandle owned = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_new_tensor_handle(h, &owned));
  return box(owned);
}
inline StableIValue optional_tensor(AtenTensorHandle* h) {
  if (h == nullptr || *h == nullptr) return box(std::nullopt);
  AtenTensorHandle owned = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_new_tensor_handle(*h, &owned));
  return box(std::optional<torch::stable::Tensor>(torch::stable::Tensor(owned)));
}
template <typename T>
inline StableIValue optional(T* v) {
  return v == nullptr ? box(std::nullopt) : box(std::optional<T>(*v));
}
inline StableIValue optional_bool(int32_t* v) {
  return v == nullptr ? box(std::nullopt) : box(std::optional<bool>(*v != 0));
}
// The wrapper passes a dtype as libtorch's ScalarType code, which the header-only enum shares.
inline StableIValue dtype(int32_t v) { return box(static_cast<torch::headeronly::ScalarType>(v)); }
inline StableIValue optional_dtype(int32_t* v) {
  return v == nullptr ? box(std::nullopt)
                      : box(std::optional<torch::headeronly::ScalarType>(static_cast<torch::headeronly::ScalarType>(*v)));
}
inline StableIValue int_list(const int64_t* p, int64_t n) { return box(std::vector<int64_t>(p, p + n)); }
inline StableIValue bool_list(const int32_t* p, int64_t n) {
  StableListHandle list = nullptr;
  TORCH_ERROR_CODE_CHECK(torch_new_list_reserve_size(n, &list));
  for (int64_t i = 0; i < n; ++i) TORCH_ERROR_CODE_CHECK(torch_list_push_back(list, box(p[i] != 0)));
  return box(list);
}
inline void call(const char* name, const char* overload, StableIValue* stack) {
  TORCH_ERROR_CODE_CHECK(torch_call_dispatcher(name, overload, stack, TORCH_ABI_VERSION));
}
// A returned tensor: handed to the wrapper, or released where it passes no pointer (an output it does not use).
inline void put(StableIValue v, AtenTensorHandle* ret) {
  auto h = torch::stable::detail::to<AtenTensorHandle>(v);
  if (ret != nullptr) {
    *ret = h;
  } else {
    TORCH_ERROR_CODE_CHECK(aoti_torch_delete_tensor_object(h));
  }
}
template <typename F>
inline AOTITorchError guarded(const char* op, F&& f) {
  shim_calls.fetch_add(1, std::memory_order_relaxed);
  try {
    f();
    return AOTI_TORCH_SUCCESS;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "opforge C shim of %s: %s\n", op, e.what());
  } catch (...) {
    std::fprintf(stderr, "opforge C shim of %s: unknown exception\n", op);
  }
  return AOTI_TORCH_FAILURE;
}

}  // namespace opforge_shim

"""


def shims_source(shims: Iterable[Shim]) -> str:
    """The C++ source of a shim library holding ``shims``."""
    return _PRELUDE + "\n".join(s.source for s in shims)


def plan(ops: Iterable[torch._ops.OpOverload]) -> tuple[list[Shim], dict[str, str]]:
    """The shims of ``ops`` (in order, each once), and why each other one has none (qualified name -> reason).
    Two operators whose shims would share a name both keep the proxy: Inductor would call one for the other."""
    ops = list(dict.fromkeys(ops))
    short = [op._schema.name.split("::")[-1] for op in ops]
    shims: list[Shim] = []
    refused: dict[str, str] = {}
    for op, name in zip(ops, short, strict=True):
        qualname = f"{op._schema.name}.{op._overloadname}"
        others = [str(o) for o, n in zip(ops, short, strict=True) if n == name and o is not op]
        if others:
            why = "Inductor names a shim by the operator's name alone"
            refused[qualname] = f"{qualname}: its shim would be named as {', '.join(others)}'s ({why})"
            continue
        try:
            shims.append(shim_for(op))
        except NoShim as exc:
            refused[qualname] = str(exc)
    return shims, refused


@dataclass(frozen=True)
class ShimLibrary:
    """A built shim library: its file, and the shims it defines."""

    path: Path
    shims: tuple[Shim, ...]

    @property
    def link_name(self) -> str:
        """What ``custom_op_libs`` takes: ``-l:<file>`` finds the file on the library path by its name."""
        return f":{self.path.name}"

    def c_shims_config(self) -> dict[torch._ops.OpOverload, list[str]]:
        """``aot_inductor.custom_ops_to_c_shims`` for these shims."""
        return {s.op: list(s.declarations) for s in self.shims}


def build_shim_library(shims: list[Shim], *, quiet: bool = True) -> ShimLibrary:
    """The shim library of ``shims``, built once into opforge's build cache (named by its source's digest)."""
    source = shims_source(shims)
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    name = f"opforge_aoti_shims_{digest}"
    src_dir = cache_root() / f"{name}.src"
    src_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    src = src_dir / f"{name}.cpp"
    if not src.is_file() or src.read_text() != source:
        tmp = src.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source)
        tmp.replace(src)
    cfg = BuildConfig(
        name,
        (src,),
        (),
        cflags=("-O2", target_flag(LIBRARY_TARGET)),
        # A package's model library records this name (DT_NEEDED): loaded first, by path, the
        # library is found by it in the same process.
        ldflags=(f"-Wl,-soname,{name}.so",),
        stable=LIBRARY_TARGET,
        extension_name=name,
    )
    lib = build_library(cfg, quiet=quiet)
    return ShimLibrary(lib.path, tuple(shims))


def shim_calls(path: str | os.PathLike[str]) -> int:
    """How many calls the loaded shim library at ``path`` has served in this process."""
    lib = ctypes.CDLL(str(path))
    fn = getattr(lib, COUNTER)
    fn.restype = ctypes.c_int64
    return int(fn())


_LIBTORCH: list[ctypes.CDLL] = []


def _libtorch_exports(name: str) -> bool:
    if not _LIBTORCH:
        lib_dir = Path(torch.__file__).parent / "lib"
        _LIBTORCH.extend(ctypes.CDLL(str(p)) for p in (lib_dir / "libtorch_cpu.so", lib_dir / "libtorch_cuda.so") if p.is_file())
    return any(hasattr(lib, name) for lib in _LIBTORCH)


__all__ = ["COUNTER", "DEVICES", "NoShim", "Shim", "ShimLibrary", "build_shim_library", "plan", "shim_calls", "shim_for", "shims_source"]
