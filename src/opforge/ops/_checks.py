"""Checks for fake kernels: the same rules and words as csrc/opforge/common.h,
raised at trace time (torch.compile, FakeTensor) instead of from C++. Every
op's spec uses these, so a message reads the same from either side."""

from __future__ import annotations

from typing import Any

import torch

from opforge.spec import FLOAT_DTYPES

_DTYPE_WORDS = "float32, float16, bfloat16 or float64"


def expect_floating(op: str, name: str, t: torch.Tensor) -> None:
    torch._check_type(t.dtype in FLOAT_DTYPES, lambda: f"{op}: {name} must be {_DTYPE_WORDS}, got {t.dtype}")


def expect_same(op: str, name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    expect_like(op, name_a, a, name_b, b)
    torch._check(
        a.shape == b.shape, lambda: f"{op}: {name_a} and {name_b} must have the same shape, got {list(a.shape)} and {list(b.shape)}"
    )


def expect_like(op: str, ref_name: str, ref: torch.Tensor, name: str, t: torch.Tensor) -> None:
    """Same device and dtype (common.h's check_like); shapes may differ."""
    torch._check(ref.device == t.device, lambda: f"{op}: {ref_name} and {name} must be on the same device, got {ref.device} and {t.device}")
    torch._check_type(ref.dtype == t.dtype, lambda: f"{op}: {ref_name} and {name} must have the same dtype, got {ref.dtype} and {t.dtype}")


def expect_2d(op: str, name: str, t: torch.Tensor, layout: str) -> None:
    torch._check(t.dim() == 2, lambda: f"{op}: {name} must be 2-D {layout}, got shape {list(t.shape)}")


def expect_shape(op: str, name: str, t: torch.Tensor, want: list[Any], how: str) -> None:
    torch._check(list(t.shape) == want, lambda: f"{op}: {name} must have shape {how} = {want}, got {list(t.shape)}")


def expect_out(op: str, out: torch.Tensor, ref: torch.Tensor) -> None:
    torch._check(out.device == ref.device, lambda: f"{op}: out must be on {ref.device}, got {out.device}")
    torch._check_type(out.dtype == ref.dtype, lambda: f"{op}: out must have dtype {ref.dtype}, got {out.dtype}")
    torch._check(out.shape == ref.shape, lambda: f"{op}: out must have shape {list(ref.shape)}, got {list(out.shape)}")
