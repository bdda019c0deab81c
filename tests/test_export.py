"""torch.export and AOTInductor packages of models on opforge's and users' operators:
the export check, packages that carry their op libraries and call generated C shims,
a fresh Python process and a C++ program that run them."""

from __future__ import annotations

import ctypes
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import opforge
import opforge.export
from opforge.check.export import check_export
from opforge.check.run import CHECK_FUNCTIONS, CHECKS
from opforge.check.values import tensors
from opforge.registry import all_specs

from .conftest import DEVICES

FIXTURES = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).resolve().parent.parent
SRC = str(ROOT / "src")
DEPLOY = ROOT / "examples" / "deploy"

CPU = torch.device("cpu")
LIBRARY_OPS = sorted(s.name for s in all_specs() if s.namespace == "opforge")


# --- the export check ---


def test_export_is_a_check_of_opforge_check():
    assert "export" in CHECKS and CHECK_FUNCTIONS["export"] is check_export
    assert CHECKS.index("export") == CHECKS.index("compile") + 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", LIBRARY_OPS)
def test_the_export_check_passes_for_every_library_operator_with_a_dynamic_batch(name, device, seed):
    (spec,) = [s for s in all_specs() if s.name == name]
    result = check_export(spec, torch.device(device), seed)
    assert result.status == "pass", result.failures
    assert result.count == 1
    # Every library operator leaves its batch to the caller: dimension 0 of the first input stays symbolic.
    assert result.note.startswith("dynamic: inputs_0[0]"), result.note


def _python_op(name: str, fake=None):
    """A torch.library operator defined in Python (x * 2), with ``fake`` as its fake kernel if given."""
    lib = torch.library.Library("opforge_test_export", "FRAGMENT")
    lib.define(f"{name}(Tensor x) -> Tensor")
    lib.impl(name, lambda x: x * 2, "CPU")
    if fake is not None:
        torch.library.register_fake(f"opforge_test_export::{name}", fake, lib=lib)
    return lib, getattr(torch.ops.opforge_test_export, name).default


def test_an_operator_without_a_fake_kernel_fails_the_export_check_with_the_fix(seed):
    lib, op = _python_op(f"no_fake_{seed}")
    spec = opforge.spec(op, reference=lambda x: x * 2, dtypes=(torch.float32,))
    result = check_export(spec, CPU, seed)
    assert result.status == "fail" and len(result.failures) == 1, result.failures
    assert result.failures[0].startswith(f"opforge_test_export::no_fake_{seed} has no fake kernel, which export needs")
    assert f'torch.library.register_fake("opforge_test_export::no_fake_{seed}")' in result.failures[0]
    assert result.tag == "no fake kernel"
    del lib


@pytest.mark.parametrize("lie", ["dtype", "rank", "size"])
def test_a_fake_kernel_that_disagrees_with_the_kernel_fails_the_export_check(lie, seed):
    fakes = {
        "dtype": lambda x: x.new_empty(x.shape, dtype=torch.float64),
        "rank": lambda x: x.new_empty((*x.shape, 1)),
        "size": lambda x: x.new_empty((x.shape[0], 1)),
    }
    lib, op = _python_op(f"lying_{lie}_{seed}", fakes[lie])
    spec = opforge.spec(op, reference=lambda x: x * 2, dtypes=(torch.float32,))
    result = check_export(spec, CPU, seed)
    assert result.status == "fail", result.note
    expected = {"dtype": "dtype torch.float64 traced, torch.float32 computed", "rank": "3 dimensions traced, 2 computed",
                "size": "size 1 traced in dimension 1"}[lie]  # fmt: skip
    assert any("differs from the kernel's: " + expected in f for f in result.failures), result.failures
    del lib


@pytest.mark.parametrize(
    ("name", "schema", "kernel", "dynamic"),
    [
        ("stacked", "(Tensor[] xs) -> Tensor", lambda xs: torch.stack(xs).sum(0), "dynamic: inputs_0_0[0], inputs_0_1[0]"),
        ("scaled_stack", "(Tensor x, Tensor[] ys, float a) -> Tensor", lambda x, ys, a: x + a * torch.stack(ys).sum(0),
         "dynamic: inputs_0[0], inputs_1_0[0], inputs_1_1[0]"),
    ],
)  # fmt: skip
def test_an_operator_with_a_tensor_list_argument_passes_the_export_check_each_tensor_dynamic(name, schema, kernel, dynamic, seed):
    lib = torch.library.Library("opforge_test_export", "FRAGMENT")
    lib.define(f"{name}_{seed}{schema}")
    lib.impl(f"{name}_{seed}", kernel, "CPU")
    torch.library.register_fake(f"opforge_test_export::{name}_{seed}", lambda *args: torch.empty_like(tensors(args)[0]), lib=lib)
    spec = opforge.spec(getattr(torch.ops.opforge_test_export, f"{name}_{seed}").default, reference=kernel, dtypes=(torch.float32,))
    result = check_export(spec, CPU, seed)
    assert result.status == "pass", result.failures
    # Each tensor of the list is an input of the program, its batch left dynamic like any other.
    assert result.note == dynamic, result.note
    del lib


def _exported_round_trip(module, args, dynamic_shapes, other_args):
    """The program exported with ``dynamic_shapes``, and again after save and load: each run on
    ``args`` and ``other_args`` (another batch) must equal eager."""
    with torch.no_grad():
        ep = torch.export.export(module, args, dynamic_shapes=dynamic_shapes)
        buf = io.BytesIO()
        torch.export.save(ep, buf)
        buf.seek(0)
        loaded = torch.export.load(buf)
        for program in (ep, loaded):
            for a in (args, other_args):
                want, got = module(*a), program.module()(*a)
                for w, g in zip(torch.utils._pytree.tree_leaves(want), torch.utils._pytree.tree_leaves(got), strict=True):
                    assert w.shape == g.shape and torch.equal(w, g)
    return ep


@pytest.mark.parametrize("device", DEVICES)
def test_lltm_exports_with_a_dynamic_batch_and_round_trips(device, seed):
    torch.manual_seed(seed)
    cell = opforge.nn.LLTM(24, 16).to(device)

    def inputs(batch):
        return (torch.randn(batch, 24, device=device), (torch.randn(batch, 16, device=device), torch.randn(batch, 16, device=device)))

    b = torch.export.Dim("batch", min=2, max=1024)
    ep = _exported_round_trip(cell, inputs(7), ({0: b}, ({0: b}, {0: b})), inputs(13))
    assert "opforge.lltm_forward.default" in str(ep.graph)


@pytest.mark.parametrize("device", DEVICES)
def test_qqq_linear_exports_with_a_dynamic_batch_and_round_trips(device, seed):
    torch.manual_seed(seed)
    dtype = torch.float32 if device == "cpu" else torch.float16
    layer = opforge.nn.QQQLinear.from_linear(torch.nn.Linear(64, 96).to(device, dtype))
    b = torch.export.Dim("batch", min=2, max=4096)
    ep = _exported_round_trip(layer, (torch.randn(5, 64, device=device, dtype=dtype),), ({0: b},),
                              (torch.randn(33, 64, device=device, dtype=dtype),))  # fmt: skip
    assert "opforge.qqq_gemm.default" in str(ep.graph)


# --- packages that carry their libraries and call C shims ---

sys.path.insert(0, str(DEPLOY))
import model as deploy_model  # noqa: E402 - the example's model: an LLTM step, a gemm, a W4A8 linear

PROXY_CALL = "aoti_torch_proxy_executor_call_function"
SHIMMED = ("lltm_forward", "gemm", "qqq_gemm")

# Run in a fresh interpreter: whether the package's operators exist before it is loaded, then the
# package's outputs on the inputs written beside it, each compared bitwise with the eager ones there,
# and how many calls the shim library served.
FRESH = """
import sys, torch
import numpy as np
import opforge.export as ox
from opforge.export.shims import shim_calls
path, prefix, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
ops = [op.split(".")[:2] for op in ox.manifest(path)["ops"]]
print("defined before load:", [hasattr(getattr(torch.ops, ns), name) for ns, name in ops])
model = ox.load(path)
rows = [line.split() for line in open(prefix + ".io.txt")]
arrays = {n: torch.from_numpy(np.fromfile(f"{prefix}.{n}.bin", dtype=getattr(np, d)).reshape([int(s) for s in sh]))
          for n, d, *sh in rows}
device = sys.argv[4]
inputs = [arrays[n].to(device) for n, *_ in rows if not n.startswith("out")]
for _ in range(runs):
    outs = model(*inputs)
outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
print("equal:", [torch.equal(o.cpu(), arrays[f"out{i}"]) for i, o in enumerate(outs)])
shims = [p for p, role in ox.extract_libraries(path) if role == "shims"]
print("shim calls:", shim_calls(shims[0]) if shims else 0)
"""


def fresh_python(*args: str, autoload: bool = False) -> subprocess.CompletedProcess:
    """A new interpreter; opforge's library not loaded unless ``autoload``: the package must bring it."""
    env = {**os.environ, "PYTHONPATH": SRC, "OPFORGE_NO_AUTOLOAD": "0" if autoload else "1"}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600)


def wrapper_source(path: Path) -> str:
    with zipfile.ZipFile(path) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".wrapper.cpp")]
        return z.read(name).decode()


@pytest.fixture(scope="module", params=DEVICES)
def packaged(request, tmp_path_factory):
    """The example's model packaged (batch dynamic, exported at 8 rows), and another batch's
    inputs (13 rows) with their eager outputs written beside it."""
    device = request.param
    if device == "cuda":
        from .conftest import HAS_CUDA

        if not HAS_CUDA:
            pytest.skip("no CUDA GPU visible, or the op library has no CUDA kernels")
    root = tmp_path_factory.mktemp(f"package-{device}")
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    model, args, dynamic = deploy_model.example(batch=8, device=device)
    result = opforge.export.package(model, args, root / "model.pt2", dynamic_shapes=dynamic)
    _, other, _ = deploy_model.example(batch=13, device=device)
    with torch.no_grad():
        out = model(*other)
    deploy_model.write_arrays(
        root / "model.pt2", {"x": other[0], "h": other[1], "c": other[2], **{f"out{i}": o for i, o in enumerate(out)}}
    )
    return root / "model.pt2", result, device


def test_the_package_carries_the_op_library_and_the_shim_library(packaged):
    path, result, _ = packaged
    assert result.ops == [f"opforge.{op}.default" for op in SHIMMED]
    assert result.shims == result.ops and result.proxied == {}
    info = opforge.export.manifest(path)
    roles = {e["file"]: e["role"] for e in info["libraries"]}
    assert roles == {Path(opforge.library.path).name: "ops", result.libraries[-1]: "shims"}, roles
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
    assert all(any(n.endswith(f"/opforge/{f}") for n in names) for f in roles)


def test_the_compiled_model_calls_the_generated_shims_and_never_the_proxy(packaged):
    path, _, device = packaged
    source = wrapper_source(path)
    for op in SHIMMED:
        assert f"aoti_torch_{device}_{op}(" in source
    assert PROXY_CALL not in source and "custom_op_wrapper" not in source and "py::" not in source
    with zipfile.ZipFile(path) as z:
        # The proxy executor's instructions (the extern kernels' JSON): none, as no call needs it.
        assert not [n for n in z.namelist() if n.endswith(".json") and "/aotinductor/" in n and not n.endswith("_metadata.json")]


def test_a_fresh_process_loads_the_package_and_its_libraries_and_runs_it_equal_to_eager(packaged):
    path, _, device = packaged
    res = fresh_python("-c", FRESH, str(path), str(path), "2", device)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert "defined before load: [False, False, False]" in lines, res.stdout
    assert "equal: [True, True, True]" in lines, res.stdout
    # Two runs of three operators, every call through a shim.
    assert "shim calls: 6" in lines, res.stdout


def test_loading_beside_an_imported_opforge_keeps_its_library(packaged):
    path, _, device = packaged
    res = fresh_python("-c", FRESH, str(path), str(path), "1", device, autoload=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "defined before load: [True, True, True]" in res.stdout and "equal: [True, True, True]" in res.stdout


# --- a user's operator ---

USER_OP = FIXTURES / "export_op"
# The user's whole spec: five lines, as a user writes it.
USER_SPEC = """\
import torch, opforge  # noqa: E401
SPECS = [opforge.spec(torch.ops.export_ops.scale_add.default,
                      reference=lambda x, y, alpha=2.0: x + alpha * y, dtypes=(torch.float32,),
                      fake=lambda x, y, alpha=2.0: x.new_empty(x.shape))]  # fmt: skip
"""


class UserModel(torch.nn.Module):
    """A user's operator after one of opforge's: two op libraries in one package."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.ops.export_ops.scale_add(opforge.square(x), y, 0.5)


@pytest.fixture(scope="module")
def user_op(tmp_path_factory):
    """The fixture's stable-ABI operator built and loaded as `opforge build` builds a folder, and its five-line spec loaded."""
    from opforge.builder import folder_config
    from opforge.builder.jit import load_library
    from opforge.project import load_spec_file

    lib = load_library(folder_config(USER_OP, with_cuda=False), quiet=True)
    assert len(USER_SPEC.splitlines()) <= 5
    spec_file = tmp_path_factory.mktemp("user-spec") / "export_op_spec.py"
    spec_file.write_text(USER_SPEC)
    (spec,) = load_spec_file(spec_file)
    return lib.path, spec


def test_a_users_operator_with_a_five_line_spec_passes_the_export_check(user_op, seed):
    _, spec = user_op
    result = check_export(spec, CPU, seed)
    assert result.status == "pass" and result.note.startswith("dynamic: inputs_0[0], inputs_1[0]"), (result.failures, result.note)


def test_a_users_operator_packages_with_its_library_and_a_shim_and_runs_in_a_fresh_process(user_op, tmp_path):
    lib_path, _ = user_op
    x, y = torch.randn(6, 5), torch.randn(6, 5)
    b = torch.export.Dim("batch", min=2, max=512)
    result = opforge.export.package(UserModel(), (x, y), tmp_path / "user.pt2", dynamic_shapes=({0: b}, {0: b}))
    assert result.ops == ["opforge.square.default", "export_ops.scale_add.default"]
    assert result.shims == result.ops and result.proxied == {}
    assert result.libraries[:2] == [Path(opforge.library.path).name, Path(lib_path).name]
    assert "aoti_torch_cpu_scale_add(" in wrapper_source(tmp_path / "user.pt2")
    x, y = torch.randn(11, 5), torch.randn(11, 5)
    deploy_model.write_arrays(tmp_path / "user.pt2", {"x": x, "y": y, "out0": UserModel()(x, y)})
    res = fresh_python("-c", FRESH, str(tmp_path / "user.pt2"), str(tmp_path / "user.pt2"), "1", "cpu")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "defined before load: [False, False]" in res.stdout and "equal: [True]" in res.stdout, res.stdout
    assert "shim calls: 2" in res.stdout, res.stdout


# --- the compiler of the model's own library ---

# A package made in a process whose CXX links libstdc++ statically (a GPU image's CXX=/opt/gcc/bin/g++):
# whether its model library carries its own libstdc++, then the package loaded and run in a fresh process.
STATIC_CXX_PACKAGE = """
import sys, zipfile, tempfile, torch
from pathlib import Path
import opforge, opforge.export
from opforge.builder.toolchain import links_libstdcxx_statically
path = Path(sys.argv[1])
class Square(torch.nn.Module):
    def forward(self, x):
        return opforge.square(x)
opforge.export.package(Square(), (torch.randn(6, 5),), path)
with zipfile.ZipFile(path) as z, tempfile.TemporaryDirectory() as tmp:
    libs = [n for n in z.namelist() if "/aotinductor/" in n and n.endswith(".so")]
    own = []
    for n in libs:
        (Path(tmp) / "m.so").write_bytes(z.read(n))
        own.append(links_libstdcxx_statically(Path(tmp) / "m.so"))
print("model libraries:", len(libs), "own libstdc++:", own)
"""


def _static_at_link(folder: Path) -> Path:
    """A g++ that links libstdc++ statically into shared libraries, as a devtoolset-style GCC does (only
    there: Inductor also precompiles a header with it)."""
    wrapper = folder / "g++"
    wrapper.write_text('#!/bin/sh\ncase " $* " in *" -shared "*) exec g++ "$@" -static-libstdc++ ;; esac\nexec g++ "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


@pytest.mark.slow
def test_a_package_made_under_a_static_libstdcxx_compiler_links_it_dynamically_and_loads(tmp_path):
    static = _static_at_link(tmp_path)
    env = {**os.environ, "PYTHONPATH": SRC, "CXX": str(static), "OPFORGE_CACHE_DIR": os.environ.get("OPFORGE_CACHE_DIR", "")}
    env = {k: v for k, v in env.items() if v}
    made = subprocess.run([sys.executable, "-c", STATIC_CXX_PACKAGE, str(tmp_path / "m.pt2")], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr
    assert "model libraries: 1 own libstdc++: [False]" in made.stdout, made.stdout + made.stderr
    x = torch.randn(9, 5)
    deploy_model.write_arrays(tmp_path / "m.pt2", {"x": x, "out0": x * x})
    res = fresh_python("-c", FRESH, str(tmp_path / "m.pt2"), str(tmp_path / "m.pt2"), "1", "cpu")
    assert res.returncode == 0 and "equal: [True]" in res.stdout, res.stdout + res.stderr


@pytest.mark.slow
def test_a_model_library_with_its_own_libstdcxx_is_refused_before_it_can_crash_the_loader(tmp_path, monkeypatch):
    static = _static_at_link(tmp_path)
    path = tmp_path / "static.pt2"
    x, configs = torch.randn(6, 5), {"cpp.cxx": (None, str(static))}
    with pytest.raises(RuntimeError, match=r"package: the compiled model .*links libstdc\+\+ statically"):
        opforge.export.package(SquareModel(), (x,), path, inductor_configs=configs)
    assert not path.exists()
    # The same archive, had it been made elsewhere: load refuses it instead of crashing in it.
    with monkeypatch.context() as m:
        m.setattr(opforge.export, "_own_libstdcxx", lambda path: None)
        opforge.export.package(SquareModel(), (x,), path, inductor_configs=configs)
    pattern = r"refusing the package: .*static.pt2: its model library .*links libstdc\+\+ statically.*CXX=g\+\+"
    with pytest.raises(opforge.export.PackageError, match=pattern):
        opforge.export.load(path)


class SquareModel(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return opforge.square(x)


# --- the generated shims, called as the compiled model calls them ---


@pytest.fixture(scope="module")
def library_shims():
    from opforge.export.shims import build_shim_library, plan

    shims, refused = plan([s.overload for s in all_specs() if s.namespace == "opforge"])
    assert refused == {}
    lib = build_shim_library(shims)
    return ctypes.CDLL(str(lib.path)), {s.op: s for s in shims}


_LIBTORCH = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))


def _dtype_code(dtype: torch.dtype) -> int:
    fn = getattr(_LIBTORCH, f"aoti_torch_dtype_{str(dtype).removeprefix('torch.')}")
    fn.restype = ctypes.c_int32
    return fn()


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype, _capsule_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype, _capsule_new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def _handle(t: torch.Tensor) -> ctypes.c_void_p:
    """A new AtenTensorHandle of ``t`` (the wrapper lends its handles; this one is left to the process)."""
    return ctypes.c_void_p(_capsule_pointer(torch._C._aoti.unsafe_alloc_void_ptr_from_tensor(t), None))


def call_shim(lib: ctypes.CDLL, name: str, op: torch._ops.OpOverload, args: tuple) -> list[torch.Tensor]:
    """Calls the shim ``name`` with ``args`` passed in the C types Inductor's wrapper passes them; its new tensors."""
    c_args: list = []
    keep: list = []
    for a, value in zip(op._schema.arguments, args, strict=True):
        kind = str(a.real_type)
        if kind == "Tensor":
            c_args.append(_handle(value))
        elif kind == "Optional[Tensor]":
            handle = None if value is None else _handle(value)
            keep.append(handle)
            c_args.append(None if handle is None else ctypes.pointer(handle))
        elif kind == "float":
            c_args.append(ctypes.c_double(value))
        elif kind == "int":
            c_args.append(ctypes.c_int64(value))
        elif kind == "Optional[ScalarType]":
            code = None if value is None else ctypes.c_int32(_dtype_code(value))
            keep.append(code)
            c_args.append(None if code is None else ctypes.pointer(code))
        elif kind == "List[bool]":
            c_args += [(ctypes.c_int32 * len(value))(*value), ctypes.c_int64(len(value))]
        else:
            raise AssertionError(f"{op}: the test passes no {kind}")
    rets = [ctypes.c_void_p() for _ in op._schema.returns]
    fn = getattr(lib, name)
    fn.restype = ctypes.c_int32
    assert fn(*c_args, *[ctypes.byref(r) for r in rets]) == 0, f"{name} failed"
    return [torch._C._aoti.alloc_tensor_by_stealing_from_void_ptr(_capsule_new(r.value, None, None)) for r in rets]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", LIBRARY_OPS)
def test_each_library_operators_shim_computes_what_the_operator_does(library_shims, name, device, seed):
    from opforge.check.export import export_sample
    from opforge.check.grad import compile_dtype

    lib, shims = library_shims
    (spec,) = [s for s in all_specs() if s.name == name]
    shim = shims[spec.overload]
    assert shim.names == (f"aoti_torch_cpu_{name}", f"aoti_torch_cuda_{name}")
    sample = export_sample(list(spec.samples(torch.device(device), compile_dtype(spec), torch.Generator(device).manual_seed(seed))))
    bound = spec.signature().bind(*sample.args, **sample.kwargs)
    bound.apply_defaults()  # the wrapper passes every argument, defaults included
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in bound.arguments.values())
    want = spec.overload(*sample.args, **sample.kwargs)
    got = call_shim(lib, f"aoti_torch_{device}_{name}", spec.overload, args)
    want = [want] if isinstance(want, torch.Tensor) else list(want or ())
    want += [sample.args[i] for i in spec.mutated_args]
    got += [args[i] for i in spec.mutated_args]
    assert len(got) == len(want)
    for w, g in zip(want, got, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype and torch.equal(g, w)


def test_a_shim_reports_the_operators_error_and_returns_failure(library_shims, capfd):
    lib, _ = library_shims
    a, b = torch.randn(3), torch.randn(4)
    fn = lib.aoti_torch_cpu_add
    fn.restype = ctypes.c_int32
    handles = [_handle(t) for t in (a, b)]
    ret = ctypes.c_void_p()
    assert fn(*handles, ctypes.byref(ret)) == 1 and ret.value is None
    assert "opforge C shim of opforge::add: " in capfd.readouterr().err


def _schema_op(ns: str, schema: str) -> torch._ops.OpOverload:
    lib = torch.library.Library(ns, "FRAGMENT")
    lib.define(schema)
    _KEEP.append(lib)
    name = schema.split("(")[0]
    return getattr(getattr(torch.ops, ns), name).default


_KEEP: list = []


@pytest.mark.parametrize(
    ("schema", "why"),
    [
        ("scaled(Tensor x, Scalar s) -> Tensor", "argument s is a number, a type the generated shims do not pass"),
        ("named(Tensor x, str mode) -> Tensor", "argument mode is a str, a type the generated shims do not pass"),
        ("stacked(Tensor[] xs) -> Tensor", "argument xs is a List[Tensor], a type the generated shims do not pass"),
        ("counted(Tensor x) -> int", "return 0 is a int, not a Tensor"),
        ("add_Tensor(Tensor x) -> Tensor", "its shim's name aoti_torch_cpu_add_Tensor is a function libtorch already exports"),
    ],
)
def test_an_operator_that_cannot_have_a_shim_keeps_the_proxy_and_says_why(schema, why):
    from opforge.export.shims import NoShim, plan, shim_for

    ns = f"opforge_test_noshim_{os.getpid()}"
    op = _schema_op(ns, schema)
    with pytest.raises(NoShim, match=re.escape(why)):
        shim_for(op)
    shims, refused = plan([op, torch.ops.opforge.square.default])
    assert [str(s.op) for s in shims] == ["opforge.square.default"]
    assert list(refused) == [f"{ns}::{schema.split('(')[0]}.default"] and why in refused[f"{ns}::{schema.split('(')[0]}.default"]


def test_two_operators_of_one_name_in_two_namespaces_both_keep_the_proxy():
    from opforge.export.shims import plan

    other = _schema_op(f"opforge_test_twin_{os.getpid()}", "gemm(Tensor a, Tensor b) -> Tensor")
    shims, refused = plan([torch.ops.opforge.gemm.default, other, torch.ops.opforge.add.default])
    assert [str(s.op) for s in shims] == ["opforge.add.default"]
    assert set(refused) == {"opforge::gemm.default", f"{other.namespace}::gemm.default"}
    assert all("Inductor names a shim by the operator's name alone" in r for r in refused.values())


# --- without Python: the C++ runner ---


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    """examples/deploy built with CMake and g++ against this torch."""
    if shutil.which("cmake") is None or shutil.which("g++") is None:
        pytest.skip("cmake and g++ are needed to build the C++ runner")
    build = tmp_path_factory.mktemp("deploy-build")
    prefix = torch.utils.cmake_prefix_path
    # g++ by name: a default compiler that links libstdc++ statically cannot share libtorch's.
    env = {**os.environ, "CXX": "g++"}
    for cmd in (["cmake", "-S", str(DEPLOY), "-B", str(build), f"-DCMAKE_PREFIX_PATH={prefix}"], ["cmake", "--build", str(build)]):
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return build / "deploy_runner"


@pytest.mark.slow
def test_the_cpp_runner_runs_the_package_without_python_equal_to_eager(packaged, runner, tmp_path):
    path, _, device = packaged
    libs = [str(p) for p, _ in opforge.export.extract_libraries(path, tmp_path / "libs")]
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    # No PYTHONPATH, no interpreter: only the runner, the package and its libraries.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    res = subprocess.run([str(runner), str(path), str(path), str(out_dir), device, *libs], env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [line.split() for line in Path(f"{path}.io.txt").read_text().splitlines()]
    expected = [r for r in rows if r[0].startswith("out")]
    assert res.stdout.split("\n")[:-1] == [" ".join(r) for r in expected]
    for name, *_ in expected:
        assert (out_dir / f"{name}.bin").read_bytes() == Path(f"{path}.{name}.bin").read_bytes(), name


@pytest.mark.slow
def test_the_cpp_runner_refuses_a_library_it_cannot_load(runner, tmp_path):
    bogus = tmp_path / "not_a_library.so"
    bogus.write_text("not ELF")
    res = subprocess.run([str(runner), "x.pt2", "x", str(tmp_path), "cpu", str(bogus)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and f"deploy_runner: cannot load {bogus}" in res.stderr


# --- the proxy, where no shim is asked for ---


@pytest.mark.slow
def test_without_shims_the_package_calls_the_proxy_and_no_shim(tmp_path):
    x = torch.randn(9, 4)
    result = opforge.export.package(opforge.nn.Square(), (x,), tmp_path / "proxied.pt2", shims=False)
    assert result.shims == [] and result.proxied == {"opforge::square.default": "shims=False"}
    source = wrapper_source(tmp_path / "proxied.pt2")
    assert PROXY_CALL in source and "aoti_torch_cpu_square(" not in source
    assert [e["role"] for e in opforge.export.manifest(tmp_path / "proxied.pt2")["libraries"]] == ["ops"]
    got = opforge.export.load(tmp_path / "proxied.pt2")(x)
    assert torch.equal(got, x * x)


def test_the_operators_page_lists_every_library_operators_shims():
    from opforge.export.shims import plan

    shims, refused = plan([s.overload for s in all_specs() if s.namespace == "opforge"])
    text = (ROOT / "docs" / "operators.md").read_text()
    section = text.split("## AOTInductor C shims", 1)[1]
    rows = {
        line.split("|")[1].strip(): line.split("|")[2].strip() for line in section.splitlines() if line.startswith("| ") and "`" in line
    }
    assert refused == {}
    assert rows == {s.op._schema.name.split("::")[1]: ", ".join(f"`{n}`" for n in s.names) for s in shims}


# --- what load verifies before it loads anything: hostile and damaged packages ---

PackageError = opforge.export.PackageError
HOSTILE = pytest.mark.xdist_group("hostile-package")  # one worker builds the package they are all made from


@pytest.fixture(scope="module")
def small_package(tmp_path_factory) -> Path:
    """opforge's square packaged on the CPU (opforge's op library and a shim library): what each hostile package is made from."""
    path = tmp_path_factory.mktemp("small-package") / "square.pt2"
    opforge.export.package(opforge.nn.Square(), (torch.randn(9, 4),), path)
    return path


Members = dict[str, tuple[bytes, int]]  # member name -> (bytes, file mode)


def _members(path: Path) -> tuple[str, Members]:
    with zipfile.ZipFile(path) as z:
        members = {i.filename: (z.read(i), i.external_attr >> 16) for i in z.infolist()}
    (fmt,) = [n for n in members if n.endswith("/archive_format")]
    return fmt.rsplit("/", 1)[0], members


def _library(members: Members, root: str, role: str) -> str:
    """The member name of the package's library of ``role``."""
    info = json.loads(members[f"{root}/{opforge.export.MANIFEST}"][0])
    (file,) = [e["file"] for e in info["libraries"] if e["role"] == role]
    return f"{root}/opforge/{file}"


def hostile(base: Path, dst: Path, change, manifest_edit=None) -> Path:
    """A copy of the package ``base`` with its members changed by ``change(members, root)`` and its
    manifest's JSON by ``manifest_edit(info, root)``, written as a zip archive, each member with its mode."""
    root, members = _members(base)
    if change is not None:
        change(members, root)
    name = f"{root}/{opforge.export.MANIFEST}"
    if manifest_edit is not None:
        info = json.loads(members[name][0])
        manifest_edit(info, root)
        members[name] = (json.dumps(info).encode(), 0o600)
    with zipfile.ZipFile(dst, "w") as z:
        for member, (data, mode) in members.items():
            info = zipfile.ZipInfo(member)
            info.external_attr = mode << 16
            z.writestr(info, data)
    return dst


def _entry(info: dict, role: str) -> dict:
    (e,) = [e for e in info["libraries"] if e["role"] == role]
    return e


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _escape(members: Members, root: str, file: str) -> None:
    """The op library also stored under ``opforge/<file>``, ``file`` a path that leaves the folder."""
    members[f"{root}/opforge/{file}"] = members[_library(members, root, "ops")]


def _point_at(file: str):
    def edit(info: dict, root: str) -> None:
        _entry(info, "ops")["file"] = file

    return edit


def _symlink(members: Members, root: str) -> None:
    members[_library(members, root, "ops")] = (b"/usr/lib/x86_64-linux-gnu/libc.so.6", 0o120777)


# (how the package escapes, change, manifest edit, the offending entry the error names); "ESC" is
# replaced by the file outside the extraction folder that the package aims at.
ESCAPES = {
    "a manifest file and its member climbing with ..": (lambda m, r: _escape(m, r, "../../ESC"), _point_at("../../ESC"), "/../../ESC'"),
    "a manifest file climbing with .., no member": (None, _point_at("../../ESC"), "'../../ESC'"),
    "an absolute manifest file and its member": (lambda m, r: _escape(m, r, "ABS"), _point_at("ABS"), "names the library 'ABS'"),
    "an archive member climbing with ..": (lambda m, r: m.__setitem__("../../ESC", (b"x", 0o100644)), None, "'../../ESC'"),
    "an absolute archive member": (lambda m, r: m.__setitem__("ABS", (b"x", 0o100644)), None, "'ABS'"),
    "a library that is a symbolic link": (_symlink, None, "is a symbolic link"),
}


@HOSTILE
@pytest.mark.parametrize("case", list(ESCAPES))
def test_a_package_that_would_write_outside_its_folder_is_refused_and_nothing_is_written(small_package, tmp_path, case):
    change, edit, named = ESCAPES[case]
    outside = tmp_path / "a" / "escaped.so"  # where ../../ leads from the extraction folder
    absolute = tmp_path / "absolute_escape.so"

    def subst(text: str) -> str:
        return text.replace("ABS", str(absolute)).replace("ESC", "escaped.so")

    def change_here(members: Members, root: str) -> None:
        before = set(members)
        change(members, root)
        for name in set(members) - before:
            members[subst(name)] = members.pop(name)

    def edit_here(info: dict, root: str) -> None:
        edit(info, root)
        e = _entry(info, "ops")
        e["file"] = subst(e["file"])

    path = hostile(small_package, tmp_path / "evil.pt2", change and change_here, edit and edit_here)
    directory = tmp_path / "a" / "b" / "libs"
    for call in (lambda: opforge.export.load(path, directory=directory), lambda: opforge.export.extract_libraries(path, directory)):
        with pytest.raises(PackageError, match=re.escape(str(path)) + ".*" + re.escape(subst(named))):
            call()
    assert not outside.exists() and not absolute.exists()
    assert not (tmp_path / "a").exists()  # nothing written at all, not even the extraction folder


def _damaged(members: Members, root: str) -> None:
    name = _library(members, root, "ops")
    data, mode = members[name]
    middle = len(data) // 2
    members[name] = (data[:middle] + bytes(b ^ 0xFF for b in data[middle : middle + 64]) + data[middle + 64 :], mode)


def _wrong_sha(info: dict, root: str) -> None:
    _entry(info, "shims")["sha256"] = "0123456789abcdef" * 4


@HOSTILE
@pytest.mark.parametrize("case", ["a damaged library", "a wrong sha256 in the manifest"])
def test_a_library_that_differs_from_its_manifests_sha256_is_refused_naming_both_hashes(small_package, tmp_path, case):
    change, edit, role = {"a damaged library": (_damaged, None, "ops"), "a wrong sha256 in the manifest": (None, _wrong_sha, "shims")}[case]
    path = hostile(small_package, tmp_path / "damaged.pt2", change, edit)
    root, members = _members(path)
    name = _library(members, root, role)
    recorded = _entry(json.loads(members[f"{root}/{opforge.export.MANIFEST}"][0]), role)["sha256"]
    directory = tmp_path / "libs"
    with pytest.raises(PackageError) as err:
        opforge.export.load(path, directory=directory)
    message = str(err.value)
    assert message.startswith(f"{path}: refusing the library {name.rsplit('/', 1)[1]}: "), message
    assert f"its sha256 is {_sha(members[name][0])}, the package's manifest says {recorded}" in message
    assert not (directory / name.rsplit("/", 1)[1]).exists()


# Loads each package given in a process without opforge's library: a library that kills the process
# when loaded must be refused before it is.
LOAD_EACH = """
import sys
import opforge.export as ox
for path in sys.argv[1:]:
    try:
        ox.load(path, directory=path + ".libs")
        print("loaded:", path)
    except ox.PackageError as exc:
        print("refused:", exc)
"""


@HOSTILE
def test_a_library_cut_to_a_third_is_refused_in_a_fresh_process_with_or_without_its_sha256(small_package, tmp_path):
    root, members = _members(small_package)
    name = _library(members, root, "shims")
    data, mode = members[name]

    def cut(members: Members, root: str) -> None:
        members[name] = (data[: len(data) // 3], mode)

    def recorded(info: dict, root: str) -> None:
        _entry(info, "shims")["sha256"] = _sha(data[: len(data) // 3])

    cut_only = hostile(small_package, tmp_path / "cut.pt2", cut)
    cut_and_hashed = hostile(small_package, tmp_path / "cut-hashed.pt2", cut, recorded)
    res = fresh_python("-c", LOAD_EACH, str(cut_only), str(cut_and_hashed))
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("refused: ") for line in lines), res.stdout
    shims = "refusing the library opforge_aoti_shims_"
    assert lines[0].startswith(f"refused: {cut_only}: {shims}") and ", the package's manifest says " in lines[0], lines[0]
    assert lines[1].startswith(f"refused: {cut_and_hashed}: {shims}") and " is truncated: " in lines[1], lines[1]


@HOSTILE
def test_the_same_build_of_its_operators_already_loaded_is_used_silently(small_package, tmp_path):
    model = opforge.export.load(small_package, directory=tmp_path / "libs")
    x = torch.randn(9, 4)
    assert torch.equal(model(x), x * x)


@HOSTILE
def test_another_build_of_its_operators_already_loaded_is_refused_naming_both_files(small_package, tmp_path):
    root, members = _members(small_package)
    name = _library(members, root, "ops")
    data, mode = members[name]
    other = data + b"\0" * 64  # another build: a library that loads, other bytes

    def rebuilt(members: Members, root: str) -> None:
        members[name] = (other, mode)

    def rehashed(info: dict, root: str) -> None:
        _entry(info, "ops")["sha256"] = _sha(other)

    path = hostile(small_package, tmp_path / "other-build.pt2", rebuilt, rehashed)
    loaded = Path(opforge.library.path)
    packaged = tmp_path / "libs" / name.rsplit("/", 1)[1]
    with pytest.raises(PackageError) as err:
        opforge.export.load(path, directory=tmp_path / "libs")
    message = str(err.value)
    assert message.startswith(f"{path}: refusing to run it with another build of its operators: "), message
    assert f"namespace 'opforge' from {loaded} (sha256 {_sha(loaded.read_bytes())})" in message
    assert f"the package carries {packaged} (sha256 {_sha(packaged.read_bytes())})" in message


@HOSTILE
def test_a_namespace_defined_from_python_is_refused_as_it_cannot_be_compared(small_package, tmp_path):
    ns = f"opforge_test_pyns_{os.getpid()}"
    lib = torch.library.Library(ns, "DEF")
    lib.define("square(Tensor x) -> Tensor")

    def elsewhere(info: dict, root: str) -> None:
        _entry(info, "ops")["namespaces"] = [ns]

    path = hostile(small_package, tmp_path / "python-ns.pt2", None, elsewhere)
    with pytest.raises(PackageError, match=re.escape(f"{path}: refusing to run it with other operators of namespace {ns!r}: ")):
        opforge.export.load(path, directory=tmp_path / "libs")
    del lib


def _raw(data: bytes):
    def change(members: Members, root: str) -> None:
        members[f"{root}/{opforge.export.MANIFEST}"] = (data, 0o600)

    return change


def _set(key: str, value):
    def edit(info: dict, root: str) -> None:
        info[key] = value

    return edit


def _set_entry(key: str, value, role: str = "ops"):
    def edit(info: dict, root: str) -> None:
        if value is None:
            del _entry(info, role)[key]
        else:
            _entry(info, role)[key] = value

    return edit


def _without(role: str):
    def change(members: Members, root: str) -> None:
        del members[_library(members, root, role)]

    return change


def _no_manifest(members: Members, root: str) -> None:
    del members[f"{root}/{opforge.export.MANIFEST}"]


def _first_library_twice(info: dict, root: str) -> None:
    info["libraries"].append(dict(info["libraries"][0]))


# (change, manifest edit, what the error says after "<package>: ")
MALFORMED = {
    "not JSON": (_raw(b'{"libraries": ['), None, "its manifest {m} is not JSON: "),
    "not UTF-8": (_raw(b'{"libraries": [], "ops": ["\xff"]}'), None, "its manifest {m} is not UTF-8 text (byte 27: b'\\xff')"),
    "a list": (_raw(b"[]"), None, "its manifest {m} is a JSON list, not an object"),
    "no libraries": (None, lambda info, root: info.pop("libraries"), "its manifest {m} has no 'libraries' list"),
    "libraries a string": (None, _set("libraries", "x.so"), "its manifest {m} has 'libraries' = 'x.so', not a list"),
    "no ops": (None, lambda info, root: info.pop("ops"), "its manifest {m} has no 'ops' list"),
    "an operator a number": (None, _set("ops", [7]), "its manifest {m} lists the operator 7, not one as namespace.name.overload"),
    "a library a string": (None, _set("libraries", ["x.so"]), "its manifest {m} has libraries[0] = 'x.so', not an object"),
    "no sha256": (None, _set_entry("sha256", None), "its manifest {m} has no libraries[0]['sha256'] string"),
    "file a number": (None, _set_entry("file", 3), "its manifest {m} has libraries[0]['file'] = 3, not a string"),
    "an unknown role": (None, _set_entry("role", "plugin"), "its manifest {m} has libraries[0]['role'] = 'plugin', not 'ops' or 'shims'"),
    "a sha256 not hex": (None, _set_entry("sha256", "abc"), "its manifest {m} has libraries[0]['sha256'] = 'abc', not a sha256"),
    "namespaces a string": (None, _set_entry("namespaces", "opforge"),
                            "its manifest {m} has libraries[0]['namespaces'] = 'opforge', not a list of operator namespaces"),
    "a library named twice": (None, _first_library_twice, "its manifest {m} names the library 'opforge_ops_"),
    "a named library missing from the archive": (_without("shims"), None, "the library '{r}/opforge/opforge_aoti_shims_"),
    "no manifest": (_no_manifest, None, "not made by opforge.export.package (no {m} in it)"),
}  # fmt: skip


@HOSTILE
@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_manifest_is_one_clear_error_naming_the_package_and_the_field(small_package, tmp_path, case):
    change, edit, says = MALFORMED[case]
    path = hostile(small_package, tmp_path / "malformed.pt2", change, edit)
    root, _ = _members(small_package)
    expected = f"{path}: " + says.format(m=f"{root}/{opforge.export.MANIFEST}", r=root)
    calls = [lambda: opforge.export.load(path, directory=tmp_path / "libs")]
    if case != "a named library missing from the archive":  # the manifest itself is right there
        calls.append(lambda: opforge.export.manifest(path))
    for call in calls:
        with pytest.raises(PackageError) as err:
            call()
        assert str(err.value).startswith(expected), str(err.value)


def _not_a_package(tmp_path: Path, case: str):
    """The argument given to load, and what the error says."""
    if case == "None":
        return None, "opforge.export: a package is the path of a .pt2 file, got None (a NoneType)"
    if case == "a number":
        return 3.5, "opforge.export: a package is the path of a .pt2 file, got 3.5 (a float)"
    path = tmp_path / "model.pt2"
    if case == "a text file":
        path.write_text("not a zip archive\n")
        return path, f"{path}: not an AOTInductor package, which is a zip archive (File is not a zip file)"
    if case == "an empty archive":
        zipfile.ZipFile(path, "w").close()
        return path, f"{path}: the archive is empty, not an AOTInductor package"
    if case == "a folder":
        path.mkdir()
        return path, f"{path}: not an AOTInductor package, which is a zip archive ("
    assert case == "a missing file"
    return path, f"{path}: no such package file"


@pytest.mark.parametrize("case", ["None", "a number", "a text file", "an empty archive", "a folder", "a missing file"])
@pytest.mark.parametrize("fn", ["load", "manifest", "extract_libraries"])
def test_what_is_not_a_package_is_one_clear_error(tmp_path, case, fn):
    arg, says = _not_a_package(tmp_path, case)
    with pytest.raises(PackageError) as err:
        getattr(opforge.export, fn)(arg)
    assert str(err.value).startswith(says), str(err.value)
