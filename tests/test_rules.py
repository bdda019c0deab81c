"""The input rules are written once (opforge.ops._rules): the C++ kernels, the
fake kernels and the specs' bad inputs must all say the same words."""

from __future__ import annotations

import re

import pytest
import torch

import opforge  # noqa: F401 - registers the library's specs
from opforge.check.run import fake_call
from opforge.ops import _rules as rules
from opforge.registry import all_specs

_LIBRARY = sorted((s for s in all_specs() if s.namespace == "opforge"), key=lambda s: s.name)
_CASES = [pytest.param(s, b, id=f"{s.name}[{b.desc}]") for s in _LIBRARY for b in s.bad_inputs(torch.device("cpu")) if b.traced]


def test_every_operator_declares_traced_bad_inputs():
    assert {s.name for s, *_ in (p.values for p in _CASES)} == {s.name for s in _LIBRARY if list(s.bad_inputs(torch.device("cpu")))}


@pytest.mark.parametrize(("spec", "bad"), _CASES)
def test_the_fake_kernel_refuses_what_the_kernel_refuses(spec, bad):
    """torch.compile sees the same refusal, in the same words, as an eager call."""
    with pytest.raises(bad.error) as info:
        fake_call(spec, bad.args, dict(bad.kwargs))
    assert re.search(bad.match, str(info.value)), f"{str(info.value).splitlines()[0]!r} !~ {bad.match!r}"


def test_a_pattern_matches_its_own_message_and_no_other():
    msg = rules.SAME_SHAPE.message("opforge::add", a="a", b="b", got_a=torch.Size([3, 4]), got_b=[4])
    assert msg == "opforge::add: a and b must have the same shape, got [3, 4] and [4]"
    pattern = rules.SAME_SHAPE.pattern("opforge::add", a="a", b="b", got_a=[3, 4], got_b=[4])
    assert re.search(pattern, msg)
    assert not re.search(pattern, msg.replace("[4]", "[5]"))
    assert not re.search(pattern, "x" + msg), "the pattern is anchored at the operator's name"


def test_a_pattern_field_may_be_a_regex():
    pattern = rules.SAME_DEVICE.pattern("opforge::gemm", a="a", b="b", got_a=rules.ANY_CUDA, got_b="cpu")
    assert re.search(pattern, "opforge::gemm: a and b must be on the same device, got cuda:3 and cpu")
    assert not re.search(pattern, "opforge::gemm: a and b must be on the same device, got meta and cpu")


@pytest.mark.parametrize("dtype", [torch.int32, torch.complex64, torch.bool])
def test_a_failed_check_raises_the_rules_error_type_and_words(dtype):
    with pytest.raises(ValueError, match=rules.FLOATING.pattern("opforge::x", name="t", got=dtype)):
        rules.expect_floating("opforge::x", "t", torch.ones(3).to(dtype))


def test_a_passing_check_builds_no_message():
    calls = []
    rule = rules.Rule("{name} is fine")
    rule.check(True, "opforge::x", name=type("Loud", (), {"__str__": lambda self: calls.append(1) or "x"})())
    assert not calls
