"""Operators that write an argument (out= forms) under autograd behave as
torch's own out= functions: no argument may require grad while gradients are
on (the write would be invisible to backward), every written tensor's version
is bumped (a backward that saved it then refuses to run on the new values),
and under no_grad they write, leaves included. Through both entry points: the
public function and torch.ops.

The rules are written twice: the fast path's C++ autograd kernel, which such an
operator gets when the fast path is on, and opforge.autograd's Python one, which
it gets when the fast path is off. This file runs once in this process (the fast
path on) and once in a child with ``OPFORGE_FAST=0``; each run asserts which
kernel its calls went through."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import opforge
from opforge.check.run import generator
from opforge.registry import all_specs

from .conftest import DEVICES, FAST, SRC

WRITERS = [s for s in all_specs() if s.mutated_args]

#: The run with the fast path off: the out= operators' autograd kernel is the Python one.
PYTHON_ROUTE = os.environ.get("OPFORGE_FAST") == "0"
_PYTHON_KERNEL = Path(opforge.autograd.__file__).resolve()


def _assert_route(excinfo: pytest.ExceptionInfo, spec, entry: str) -> None:
    """The refusal came from the kernel this run expects: the Python one leaves its frame in the
    traceback, the C++ one none."""
    python_frame = any(Path(str(e.path)).resolve() == _PYTHON_KERNEL for e in excinfo.traceback)
    assert python_frame == PYTHON_ROUTE, f"{spec.qualname} through {entry}: the {'C++' if python_frame else 'Python'} kernel ran"


def test_each_run_has_the_autograd_kernel_it_is_meant_to():
    if PYTHON_ROUTE:
        assert FAST is None and opforge.fast.why_off == "OPFORGE_FAST=0"
    else:
        assert FAST is not None, f"the fast path is off here ({opforge.fast.why_off}): its C++ autograd kernel goes untested"


@pytest.mark.skipif(PYTHON_ROUTE, reason="the run with the fast path off itself")
def test_the_python_kernel_passes_the_same_tests():
    """This file again in a process of its own with the fast path off: every test through the
    Python kernel (the op library is built already; nothing compiles)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env |= {"PYTHONPATH": SRC, "OPFORGE_FAST": "0"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", __file__]
    proc = subprocess.run(cmd, env=env, cwd=Path(SRC).parent, capture_output=True, text=True, timeout=600)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary


def _args(spec, device, seed):
    gen = generator(torch.device(device), seed)
    sample = next(iter(spec.samples(torch.device(device), torch.float32, gen)))
    return list(sample.args)


def test_the_library_has_a_writer():
    assert [s.name for s in WRITERS] == ["add_out"]


def _setup(spec, entry, device, seed):
    """The entry point, the written argument's position, and a sample's arguments."""
    call = spec.function if entry == "public" else spec.overload
    (written,) = spec.mutated_args
    return call, written, _args(spec, device, seed)


def _each_call(test):
    """Each writer, on each device, through each entry point."""
    test = pytest.mark.parametrize("device", DEVICES)(test)
    test = pytest.mark.parametrize("entry", ["public", "torch.ops"])(test)
    return pytest.mark.parametrize("spec", WRITERS, ids=lambda s: s.name)(test)


@_each_call
def test_no_argument_may_require_grad(spec, entry, device, seed):
    call, written, base = _setup(spec, entry, device, seed)
    for i, arg in enumerate(base):
        if not isinstance(arg, torch.Tensor):
            continue
        name = spec.schema.arguments[i].name
        args = list(base)
        if i == written:
            # Part of a graph: the output of an op that saved it.
            leaf = torch.randn_like(arg).requires_grad_()
            args[i] = leaf.sigmoid()
        else:
            args[i] = arg.detach().clone().requires_grad_()
        before = args[written].detach().clone()
        with pytest.raises(RuntimeError, match=rf"^{spec.qualname}: {name} requires grad, but this operator writes") as excinfo:
            call(*args)
        _assert_route(excinfo, spec, entry)
        assert torch.equal(args[written].detach(), before)  # refused before anything was written
        if i == written:
            leaf_out = arg.detach().clone().requires_grad_()
            args[i] = leaf_out
            with pytest.raises(RuntimeError, match=rf"^{spec.qualname}: {name} requires grad") as excinfo:
                call(*args)
            _assert_route(excinfo, spec, entry)


@_each_call
def test_a_write_bumps_the_version_and_backward_sees_it(spec, entry, device, seed, monkeypatch):
    call, written, args = _setup(spec, entry, device, seed)
    # The Python kernel bumps a version through torch.autograd.graph.increment_version, the C++
    # kernel (and the fast path's own call, which the public function takes here) directly.
    bumps = []
    increment_version = torch.autograd.graph.increment_version
    monkeypatch.setattr(torch.autograd.graph, "increment_version", lambda t: bumps.append(t) or increment_version(t))
    out = args[written]
    version = out._version
    call(*args)
    assert out._version == version + 1
    assert len(bumps) == (1 if PYTHON_ROUTE else 0), f"{spec.qualname} through {entry}: {len(bumps)} bumps through Python"
    # The reproduction: y saved by sigmoid's backward, then overwritten under no_grad.
    x = torch.randn_like(out).requires_grad_()
    y = x.sigmoid()
    args[written] = y
    with torch.no_grad():
        call(*args)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", WRITERS, ids=lambda s: s.name)
def test_under_no_grad_a_leaf_that_requires_grad_is_written(spec, device, seed):
    (written,) = spec.mutated_args
    args = _args(spec, device, seed)
    leaf = args[written].detach().clone().requires_grad_()
    args[written] = leaf
    want = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
    spec.reference(*want)
    with torch.no_grad():
        spec.function(*args)
    torch.testing.assert_close(leaf.detach(), want[written])
    assert leaf.requires_grad and leaf.grad_fn is None


def test_add_out_reproduction_raises():
    x = torch.zeros(3, requires_grad=True)
    y = x.sigmoid()
    with pytest.raises(RuntimeError, match=r"^opforge::add_out: out requires grad"):
        opforge.add_out(torch.ones(3), torch.ones(3), y)
