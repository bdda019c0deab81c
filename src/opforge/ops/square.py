"""square: the load_inline tutorial's square_matrix, elementwise over any shape."""

from __future__ import annotations

import torch

from opforge.ops._elementwise import (
    bad_elementwise,
    elementwise_bench,
    elementwise_samples,
    expect_floating,
    result_like,
    streaming_cost,
)
from opforge.opspec import OpSpec


def _fake(x: torch.Tensor) -> torch.Tensor:
    expect_floating("opforge::square", "x", x)
    return result_like(x)


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001 - torch's protocol
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN202
    (x,) = ctx.saved_tensors
    return grad * 2 * x


def _jvp(inputs, tangents, output):  # noqa: ANN001, ANN202
    (x,), (t,) = inputs, tangents
    return t * 2 * x


SPECS = [
    OpSpec(
        name="square",
        jvp=_jvp,
        doc="x * x, elementwise.",
        reference=lambda x: x * x,
        samples=elementwise_samples(1),
        bad_inputs=lambda device: bad_elementwise("square", ("x",), device),
        cost=lambda x: streaming_cost(x, x, flops_per_element=1),
        bench_cases=elementwise_bench(1),
        sweep_cases=elementwise_bench(1, sweep=True),
        fake=_fake,
        backward=_backward,
        setup_context=_setup_context,
        # x * x is not linear: (x1 + x2)^2 != x1^2 + x2^2, so never Partial.
        sharding="pointwise",
    ),
]
