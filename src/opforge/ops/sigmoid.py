"""sigmoid: the autograd tutorial's custom sigmoid, 1 / (1 + exp(-x)), with its own
backward operator grad * y * (1 - y) that needs only the saved output."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from opforge.autograd import add_tangents
from opforge.ops._elementwise import (
    bad_elementwise,
    bench_tensors,
    elementwise_bench,
    elementwise_samples,
    expect_floating,
    expect_same,
    result_like,
    streaming_cost,
    tensor_samples,
)
from opforge.opspec import DEFAULT_TOLERANCES, OpSpec, Sample, SampleFn

OP = "opforge::sigmoid"
OP_BACKWARD = "opforge::sigmoid_backward"

# expf is within 2 ulp in float32 (CUDA's documented bound; glibc's is lower),
# and 1 + e and the division add one rounding each: 4 ulp of float32 is 5e-7.
_TOLERANCES = {**DEFAULT_TOLERANCES, torch.float32: (1e-6, 2e-6)}


def _fake(x: torch.Tensor) -> torch.Tensor:
    expect_floating(OP, "x", x)
    return result_like(x)


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001 - torch's protocol
    ctx.save_for_backward(output)


def _backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN202
    (y,) = ctx.saved_tensors
    return torch.ops.opforge.sigmoid_backward(grad, y)


def _setup_context_backward(ctx, inputs, output) -> None:  # noqa: ANN001 - torch's protocol
    ctx.save_for_backward(*inputs)


def _backward_backward(ctx, gg: torch.Tensor):  # noqa: ANN001, ANN202
    # sigmoid_backward(grad, y) = grad * y * (1 - y): d/dgrad = y (1 - y), d/dy = grad (1 - 2y).
    # The first term is the operator itself, so third derivatives keep working.
    grad, y = ctx.saved_tensors
    return torch.ops.opforge.sigmoid_backward(gg, y), gg * grad * (1 - 2 * y)


def _fake_backward(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    expect_floating(OP_BACKWARD, "grad", grad)
    expect_same(OP_BACKWARD, "grad", grad, "y", y)
    return result_like(grad, y)


def _samples_backward(device: torch.device, dtype: torch.dtype, gen: torch.Generator):  # noqa: ANN202
    # y is a sigmoid output, in (0, 1), laid out like grad.
    grads = tensor_samples(1, device, dtype, gen)
    outputs = tensor_samples(1, device, dtype, gen, values=torch.sigmoid)
    for (desc, (g,)), (_, (y,)) in zip(grads, outputs, strict=True):
        yield Sample((g, y), desc=desc)


def _bench_backward(sweep: bool) -> SampleFn:
    def cases(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Iterator[Sample]:
        for desc, (g, x) in bench_tensors(2, device, dtype, gen, sweep=sweep):
            yield Sample((g, torch.sigmoid(x)), desc=desc)

    return cases


def _jvp(inputs, tangents, output):  # noqa: ANN001, ANN202
    return torch.ops.opforge.sigmoid_backward(tangents[0], output)


def _jvp_backward(inputs, tangents, output):  # noqa: ANN001, ANN202
    # d sigmoid_backward(grad, y) = y (1 - y) dgrad + grad (1 - 2y) dy
    (grad, y), (t_grad, t_y) = inputs, tangents
    return add_tangents(
        None if t_grad is None else torch.ops.opforge.sigmoid_backward(t_grad, y),
        None if t_y is None else t_y * grad * (1 - 2 * y),
    )


SPECS = [
    OpSpec(
        name="sigmoid",
        jvp=_jvp,
        doc="1 / (1 + exp(-x)), elementwise; differentiable through opforge::sigmoid_backward.",
        reference=torch.sigmoid,
        # Scaled so the tails, where exp(-x) over- or underflows, are sampled too.
        samples=elementwise_samples(1, values=lambda t: t * 8),
        bad_inputs=lambda device: bad_elementwise("sigmoid", ("x",), device),
        cost=lambda x: streaming_cost(x, x, flops_per_element=4),
        bench_cases=elementwise_bench(1),
        sweep_cases=elementwise_bench(1, sweep=True),
        fake=_fake,
        backward=_backward,
        setup_context=_setup_context,
        tolerances=_TOLERANCES,
        # Not linear: sigmoid(x1 + x2) != sigmoid(x1) + sigmoid(x2), so never Partial.
        sharding="pointwise",
    ),
    OpSpec(
        name="sigmoid_backward",
        jvp=_jvp_backward,
        doc="grad * y * (1 - y): the gradient of sigmoid from its output y.",
        reference=lambda grad, y: grad * y * (1 - y),
        samples=_samples_backward,
        bad_inputs=lambda device: bad_elementwise("sigmoid_backward", ("grad", "y"), device),
        cost=lambda grad, y: streaming_cost(grad, y, grad, flops_per_element=3),
        bench_cases=_bench_backward(sweep=False),
        sweep_cases=_bench_backward(sweep=True),
        fake=_fake_backward,
        backward=_backward_backward,
        setup_context=_setup_context_backward,
        # grad * y * (1 - y) is linear in grad alone, not in (grad, y) together: no Partial declared
        # (opforge check lists Partial grad with Replicate y as valid).
        sharding="pointwise",
    ),
]
