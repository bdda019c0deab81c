"""The input rules every operator shares, as one table of messages.

Each rule is written here once and read three ways: the fake kernels check it
at trace time (``Rule.check``), the specs' bad inputs expect its message
(``Rule.bad`` builds the anchored pattern from the same words), and the C++
wrappers raise the same words from csrc/opforge/stable/common.h, which
``opforge check`` compares against these patterns on every bad input, on every
device. A change of wording is therefore one edit here and one in stable/common.h,
and a test fails until both agree.

Why the C++ checks are not the only source: a C++ Meta kernel that runs the
wrapper's checks keeps shapes symbolic under ``torch.compile(dynamic=True)``
only through ATen's SymInt accessors; on the stable ABI, which has none,
every size read specialises the graph (see docs/adding-an-op.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from opforge.opspec import FLOAT_DTYPES, BadInput

DTYPE_WORDS = "float32, float16, bfloat16 or float64"


@dataclass(frozen=True)
class Pattern:
    """A field value given as a regular expression (``cuda:\\d+``), not as text."""

    regex: str


def show(value: Any) -> str:
    """A value as the C++ side prints it: shapes as ``[3, 4]``, dtypes as ``torch.float32``."""
    if isinstance(value, torch.Size | tuple):
        return str(list(value))
    return str(value)


@dataclass(frozen=True)
class Rule:
    """One rule's message: ``template`` with ``str.format`` fields, and the exception type.

    A wrong dtype is a ValueError: the stable ABI carries C++'s
    std::invalid_argument to Python as ValueError and has no way to raise TypeError."""

    template: str
    error: type[Exception] = RuntimeError

    def message(self, op: str, **fields: Any) -> str:
        return f"{op}: " + self.template.format(**{k: show(v) for k, v in fields.items()})

    def pattern(self, op: str, **fields: Any) -> str:
        """The anchored regular expression of the message for these fields."""

        def field(v: Any) -> str:
            return v.regex if isinstance(v, Pattern) else re.escape(show(v))

        literal = re.split(r"(\{\w+\})", self.template)
        parts = [field(fields[p[1:-1]]) if p.startswith("{") else re.escape(p) for p in literal]
        return f"^{re.escape(op)}: " + "".join(parts)

    def check(self, cond: Any, op: str, **fields: Any) -> None:
        """``torch._check`` (or ``_check_value``) with this rule's message, built only when it fails."""
        checker: Callable[..., None] = torch._check_value if self.error is ValueError else torch._check
        checker(cond, lambda: self.message(op, **fields))

    def bad(self, desc: str, args: tuple[Any, ...], op: str, kwargs: Mapping[str, Any] | None = None, **fields: Any) -> BadInput:
        """A bad input whose call must fail with this rule's message."""
        return BadInput(desc, args, dict(kwargs or {}), match=self.pattern(op, **fields), error=self.error)


FLOATING = Rule("{name} must be " + DTYPE_WORDS + ", got {got}", ValueError)
SAME_DEVICE = Rule("{a} and {b} must be on the same device, got {got_a} and {got_b}")
SAME_DTYPE = Rule("{a} and {b} must have the same dtype, got {got_a} and {got_b}", ValueError)
SAME_SHAPE = Rule("{a} and {b} must have the same shape, got {got_a} and {got_b}")
TWO_D = Rule("{name} must be 2-D {layout}, got shape {got}")
SHAPE = Rule("{name} must have shape {how} = {want}, got {got}")
OUT_DEVICE = Rule("out must be on {want}, got {got}")
OUT_DTYPE = Rule("out must have dtype {want}, got {got}", ValueError)
OUT_SHAPE = Rule("out must have shape {want}, got {got}")
OUT_SHARES = Rule("out shares memory with input {name}")  # C++ adds the address
OUT_SELF_OVERLAP = Rule("out has elements that share memory (strides {strides}); pass a tensor with distinct elements")

ANY_CUDA = Pattern(r"cuda:\d+")


# --- the checks of the fake kernels, one per rule or pair of rules ---


def expect_floating(op: str, name: str, t: torch.Tensor) -> None:
    FLOATING.check(t.dtype in FLOAT_DTYPES, op, name=name, got=t.dtype)


def expect_like(op: str, ref_name: str, ref: torch.Tensor, name: str, t: torch.Tensor) -> None:
    """Same device and dtype (common.h's check_like); shapes may differ."""
    SAME_DEVICE.check(ref.device == t.device, op, a=ref_name, b=name, got_a=ref.device, got_b=t.device)
    SAME_DTYPE.check(ref.dtype == t.dtype, op, a=ref_name, b=name, got_a=ref.dtype, got_b=t.dtype)


def expect_same(op: str, name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    expect_like(op, name_a, a, name_b, b)
    SAME_SHAPE.check(a.shape == b.shape, op, a=name_a, b=name_b, got_a=a.shape, got_b=b.shape)


def expect_2d(op: str, name: str, t: torch.Tensor, layout: str) -> None:
    TWO_D.check(t.dim() == 2, op, name=name, layout=layout, got=t.shape)


def expect_shape(op: str, name: str, t: torch.Tensor, want: list[Any], how: str) -> None:
    SHAPE.check(list(t.shape) == want, op, name=name, how=how, want=want, got=t.shape)


def expect_out(op: str, out: torch.Tensor, ref: torch.Tensor, inputs: Mapping[str, torch.Tensor] | None = None) -> None:
    """common.h's check_out: out like ``ref``, no element of out twice in memory
    (an expanded view), and no memory shared with any of ``inputs``. Fake
    tensors keep strides and storages, so the trace sees what the kernel would."""
    OUT_DEVICE.check(out.device == ref.device, op, want=ref.device, got=out.device)
    OUT_DTYPE.check(out.dtype == ref.dtype, op, want=ref.dtype, got=out.dtype)
    OUT_SHAPE.check(out.shape == ref.shape, op, want=ref.shape, got=out.shape)
    OUT_SELF_OVERLAP.check(
        torch._debug_has_internal_overlap(out) != 1, op, strides=list(out.stride())
    )  # 1: overlap for sure; 2: too hard to tell, as C++
    for name, t in (inputs or {}).items():
        OUT_SHARES.check(not torch._C._overlaps(out, t), op, name=name)
