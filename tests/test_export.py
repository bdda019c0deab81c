"""torch.export and AOTInductor packages of models on opforge's and users' operators:
the export check, packages that carry their op libraries and call generated C shims,
a fresh Python process and a C++ program that run them."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import opforge
import opforge.export
from opforge.check import CHECK_FUNCTIONS, CHECKS
from opforge.check_export import check_export
from opforge.spec import all_specs

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
    assert "needs a fake kernel, torch.library.register_fake or the spec's fake=" in result.failures[0]
    assert result.failures[0].startswith(f"no_fake_{seed} float32 [")
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
