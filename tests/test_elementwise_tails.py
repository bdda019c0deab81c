"""Elementwise operators at the ends of their dtypes' ranges: where exp under-
and overflows, where results are subnormal, where they reach infinity. Each
result must be the float64 reference rounded to the dtype within a few units in
the last place, counted at the reference's own magnitude (a subnormal's unit is
the dtype's smallest subnormal), so a kernel that flushes subnormals to zero,
saturates early or plateaus fails. Both entry points (``opforge.<op>`` and
``torch.ops.opforge.<op>``), on sizes that run the vector loops and their
scalar tails."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import opforge

from .conftest import DEVICES

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# The vector body (16 lanes, 4 vectors a step on the CPU) and a scalar tail of 13.
SIZE = 64 * 16 + 13


def ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of the last place of ``want`` (its dtype's), a
    subnormal's unit being the smallest subnormal; NaN against NaN and equal
    infinities are 0, any other non-finite mismatch inf."""
    dtype = want.dtype
    info = torch.finfo(dtype)
    w = want.double()
    g = got.double()
    exponent = torch.floor(torch.log2(w.abs().clamp(min=info.tiny)))
    unit = torch.exp2(exponent - (info.bits - 1 - _exponent_bits(dtype)))
    diff = (g - w).abs() / unit
    same = (g == w) | (g.isnan() & w.isnan())
    return torch.where(same, torch.zeros_like(diff), torch.where(diff.isnan(), torch.full_like(diff, float("inf")), diff))


def _exponent_bits(dtype: torch.dtype) -> int:
    return {torch.float64: 11, torch.float32: 8, torch.bfloat16: 8, torch.float16: 5}[dtype]


def tail_inputs(dtype: torch.dtype, gen: torch.Generator, lo: float, hi: float) -> torch.Tensor:
    """SIZE values spread over [lo, hi] at random (fresh each run), in ``dtype``."""
    u = torch.rand(SIZE, generator=gen, dtype=torch.float64)
    return (lo + (hi - lo) * u).to(dtype)


# exp(-x) overflows float32 below -88.72; sigmoid is subnormal in float32 and
# bfloat16 from -87.3 down to -103.9, in float16 from -9.7 down to -17.3; float64's
# own thresholds are near -709 and -745.
SIGMOID_RANGES = {
    torch.float32: [(-110.0, -80.0), (-20.0, 20.0), (80.0, 110.0)],
    torch.bfloat16: [(-110.0, -80.0), (-20.0, 20.0), (80.0, 110.0)],
    torch.float16: [(-20.0, -8.0), (-12.0, 12.0), (8.0, 20.0)],
    torch.float64: [(-760.0, -700.0), (-40.0, 40.0), (700.0, 760.0)],
}
# float32's and bfloat16's kernels compute in float32 within 4 ulp (the spec's
# tolerance); the 2-byte types round once, within 1 ulp of their own.
SIGMOID_ULPS = {torch.float32: 4.0, torch.float64: 4.0, torch.bfloat16: 1.0, torch.float16: 1.0}


def sigmoid_reference(x: torch.Tensor) -> torch.Tensor:
    """The sigmoid in float64, e^x / (1 + e^x) below 0: torch's own float64
    sigmoid gives 0 where e^-x overflows (x < -709.8), above float64's
    smallest subnormal."""
    x = x.double()
    e = torch.exp(-x.abs())
    return torch.where(x < 0, e, torch.ones_like(e)) / (1 + e)


def _entry_points(name: str) -> list[tuple[str, Callable[..., torch.Tensor]]]:
    return [(f"opforge.{name}", getattr(opforge, name)), (f"torch.ops.opforge.{name}", getattr(torch.ops.opforge, name))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sigmoid_tails_are_the_reference_rounded(device, dtype):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    for lo, hi in SIGMOID_RANGES[dtype]:
        x = tail_inputs(dtype, gen, lo, hi).to(device)
        want = sigmoid_reference(x).to(dtype)
        for label, fn in _entry_points("sigmoid"):
            got = fn(x)
            err = ulps(got.cpu(), want.cpu())
            worst = int(err.argmax())
            assert err.max() <= SIGMOID_ULPS[dtype], (
                f"{label} {dtype} on [{lo}, {hi}]: x = {x[worst].item()!r} gives {got[worst].item()!r}, "
                f"the reference rounded is {want[worst].item()!r} ({err.max().item():.1f} ulp)"
            )


@pytest.mark.parametrize("device", DEVICES)
def test_sigmoid_named_values(device):
    """The values found plateauing: x = -88.5 and -88.7 are subnormal results, not the saturated exp's 6.05e-39."""
    x = torch.tensor([-88.5, -88.7, -90.0, -103.0, -104.5, 88.9, float("inf"), float("-inf"), float("nan")], device=device)
    want = sigmoid_reference(x).float()
    for label, fn in _entry_points("sigmoid"):
        got = fn(x).cpu()
        assert ulps(got, want.cpu()).max() <= 4, f"{label}: {got.tolist()} vs {want.tolist()}"
        assert got[0].item() == pytest.approx(3.6723e-39, rel=1e-4) and got[1].item() == pytest.approx(3.0066e-39, rel=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_square_subnormal_and_overflowing_results(device, dtype):
    """x * x where the product is subnormal (x near the square root of the smallest normal) or past the largest finite."""
    info = torch.finfo(dtype)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    small = info.tiny**0.5
    big = info.max**0.5
    for lo, hi in ((small / 64, small * 2), (big / 2, big * 2), (-small * 2, -small / 64)):
        x = tail_inputs(dtype, gen, lo, hi).to(device)
        want = (x.double() * x.double()).to(dtype)
        for label, fn in _entry_points("square"):
            err = ulps(fn(x).cpu(), want.cpu())
            assert err.max() <= 0.5 + 1e-9, f"{label} {dtype} on [{lo:.3g}, {hi:.3g}]: {err.max().item():.2f} ulp"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sigmoid_backward_with_subnormal_results(device, dtype):
    """grad * y * (1 - y) for sigmoid outputs y near 0: the products are subnormal."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    lo, hi = SIGMOID_RANGES[dtype][0]
    y = sigmoid_reference(tail_inputs(torch.float64, gen, lo, hi)).to(dtype).to(device)
    grad = tail_inputs(dtype, gen, 0.25, 2.0).to(device)
    want = (grad.double() * y.double() * (1 - y.double())).to(dtype)
    for label, fn in _entry_points("sigmoid_backward"):
        err = ulps(fn(grad, y).cpu(), want.cpu())
        # two roundings in the kernel's own type (float32 for the 2-byte ones): within 2 ulp
        assert err.max() <= 2.0, f"{label} {dtype}: {err.max().item():.2f} ulp"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_lltm_gates_at_the_ends_of_sigmoid(device, dtype):
    """The LLTM cell's input and output gates are sigmoids of the gate pre-activations,
    which here are the bias alone (weights of zero, so the matmul adds nothing):
    subnormal gates in float32 and bfloat16, as the reference's."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    batch, features, state = 3, 5, SIZE // 3
    bias = tail_inputs(torch.float64, gen, -105.0, -80.0)[: 3 * state].to(dtype).to(device)
    weights = torch.zeros(3 * state, features + state, dtype=dtype, device=device)
    x = torch.randn(batch, features, generator=gen, dtype=torch.float64).to(dtype).to(device)
    h = torch.randn(batch, state, generator=gen, dtype=torch.float64).to(dtype).to(device)
    c = torch.randn(batch, state, generator=gen, dtype=torch.float64).to(dtype).to(device)
    out = opforge.lltm_forward(x, weights, bias, h, c)
    gates = sigmoid_reference(bias).to(dtype).cpu()
    input_gate, output_gate = out[2][:, :state], out[2][:, state : 2 * state]
    for name, got, want in (("input gate", input_gate, gates[:state]), ("output gate", output_gate, gates[state : 2 * state])):
        err = ulps(got.cpu(), want.expand(batch, state))
        assert err.max() <= SIGMOID_ULPS[dtype], f"lltm_forward {dtype} {name}: {err.max().item():.1f} ulp"
