"""add and add_out: the add2 tutorial's add2, functional and out= forms."""

from __future__ import annotations

import torch

from opforge.autograd import add_tangents
from opforge.ops import _rules as rules
from opforge.ops._elementwise import (
    OUT_LAYOUTS,
    bad_elementwise,
    elementwise_bench,
    elementwise_samples,
    expect_floating,
    expect_out,
    expect_same,
    like,
    result_like,
    streaming_cost,
    tensor_samples,
)
from opforge.opspec import BadInput, OpSpec, Sample

OP = "opforge::add"
OP_OUT = "opforge::add_out"


def _check(op: str, a: torch.Tensor, b: torch.Tensor) -> None:
    expect_floating(op, "a", a)
    expect_same(op, "a", a, "b", b)


def _fake(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    _check(OP, a, b)
    return result_like(a, b)


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001 - torch's protocol
    pass


def _backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN202
    return grad, grad


def _cost(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None):  # noqa: ANN202
    return streaming_cost(a, b, a, flops_per_element=1)


def _fake_out(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    _check(OP_OUT, a, b)
    expect_out(OP_OUT, out, a, {"a": a, "b": b})


def _reference_out(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    torch.add(a, b, out=out)


def _samples_out(device: torch.device, dtype: torch.dtype, gen: torch.Generator):  # noqa: ANN202
    for desc, (a, b) in tensor_samples(2, device, dtype, gen, OUT_LAYOUTS):
        yield Sample((a, b, like(a, gen)), desc=desc)


def _bad_out(device: torch.device) -> list[BadInput]:
    a, b = torch.randn(4, device=device), torch.randn(4, device=device)
    buf = torch.randn(5, device=device)
    cases = bad_elementwise("add_out", ("a", "b"), device, extra=(torch.empty(4, device=device),))
    cases += [
        rules.OUT_SHAPE.bad("out of the wrong shape", (a, b, torch.empty(5, device=device)), OP_OUT, want=[4], got=[5]),
        rules.OUT_DTYPE.bad(
            "out of the wrong dtype",
            (a, b, torch.empty(4, device=device, dtype=torch.float64)),
            OP_OUT,
            want=torch.float32,
            got=torch.float64,
        ),
        rules.OUT_SHARES.bad("out is an input", (a, b, a), OP_OUT, name="a"),
        rules.OUT_SHARES.bad("out partly overlaps an input", (buf[:4], b, buf[1:]), OP_OUT, name="a"),
        rules.OUT_SELF_OVERLAP.bad(
            "out with self-overlapping elements", (a, b, torch.randn(1, device=device).expand(4)), OP_OUT, strides=[0]
        ),
    ]
    if device.type == "cuda":
        cases.append(rules.OUT_DEVICE.bad("out on another device", (a, b, torch.empty(4)), OP_OUT, want=rules.ANY_CUDA, got="cpu"))
    return cases


def _jvp(inputs, tangents, output):  # noqa: ANN001, ANN202
    return add_tangents(*tangents)


SPECS = [
    OpSpec(
        name="add",
        jvp=_jvp,
        doc="a + b, elementwise, for two tensors of one shape, dtype and device.",
        reference=torch.add,
        samples=elementwise_samples(2),
        bad_inputs=lambda device: bad_elementwise("add", ("a", "b"), device),
        cost=_cost,
        bench_cases=elementwise_bench(2),
        sweep_cases=elementwise_bench(2, sweep=True),
        fake=_fake,
        backward=_backward,
        setup_context=_setup_context,
        # Linear: Partial(a) + Partial(b) is Partial(a + b).
        sharding="pointwise-linear",
    ),
    OpSpec(
        name="add_out",
        doc="Writes a + b into out (the add2 tutorial's torch_launch_add2(c, a, b, n)); out must not overlap a or b.",
        reference=_reference_out,
        samples=_samples_out,
        bad_inputs=_bad_out,
        cost=_cost,
        bench_cases=elementwise_bench(3),
        sweep_cases=elementwise_bench(3, sweep=True),
        fake=_fake_out,
        # out keeps its placement (DTensor does not move a written argument): a and b come to it.
        sharding="pointwise-linear",
    ),
]
