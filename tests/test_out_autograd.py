"""Operators that write an argument (out= forms) under autograd behave as
torch's own out= functions: no argument may require grad while gradients are
on (the write would be invisible to backward), every written tensor's version
is bumped (a backward that saved it then refuses to run on the new values),
and under no_grad they write, leaves included. Through both entry points: the
public function and torch.ops."""

from __future__ import annotations

import pytest
import torch

import opforge
from opforge.check.run import generator
from opforge.registry import all_specs

from .conftest import DEVICES

WRITERS = [s for s in all_specs() if s.mutated_args]


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
        with pytest.raises(RuntimeError, match=rf"^{spec.qualname}: {name} requires grad, but this operator writes"):
            call(*args)
        assert torch.equal(args[written].detach(), before)  # refused before anything was written
        if i == written:
            leaf_out = arg.detach().clone().requires_grad_()
            args[i] = leaf_out
            with pytest.raises(RuntimeError, match=rf"^{spec.qualname}: {name} requires grad"):
                call(*args)


@_each_call
def test_a_write_bumps_the_version_and_backward_sees_it(spec, entry, device, seed):
    call, written, args = _setup(spec, entry, device, seed)
    out = args[written]
    version = out._version
    call(*args)
    assert out._version == version + 1
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
