"""torch.export and AOTInductor packages of models on opforge's and users' operators:
the export check, packages that carry their op libraries and call generated C shims,
a fresh Python process and a C++ program that run them."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

import opforge
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
