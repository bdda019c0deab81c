"""axpby: the autograd tutorial's my_op (3x - y) generalised to alpha * x + beta * y, with
a fused backward operator that writes both gradients in one pass."""

from __future__ import annotations

import torch

from opforge.ops._elementwise import (
    bad_elementwise,
    elementwise_bench,
    expect_floating,
    expect_same,
    result_like,
    streaming_cost,
    tensor_samples,
)
from opforge.opspec import OpSpec, Sample

OP = "opforge::axpby"
OP_BACKWARD = "opforge::axpby_backward"


def _reference(x: torch.Tensor, y: torch.Tensor, alpha: float = 3.0, beta: float = -1.0) -> torch.Tensor:
    return alpha * x + beta * y


def _fake(x: torch.Tensor, y: torch.Tensor, alpha: float = 3.0, beta: float = -1.0) -> torch.Tensor:
    expect_floating(OP, "x", x)
    expect_same(OP, "x", x, "y", y)
    return result_like(x, y)


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001 - torch's protocol
    _, _, ctx.alpha, ctx.beta = inputs


def _backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN202
    grad_x, grad_y = torch.ops.opforge.axpby_backward(grad, ctx.alpha, ctx.beta)
    return grad_x, grad_y, None, None


def _backward_backward(ctx, g_x: torch.Tensor | None, g_y: torch.Tensor | None):  # noqa: ANN001, ANN202
    # axpby_backward(grad) = (alpha grad, beta grad), linear in grad: its own gradient is
    # alpha g_x + beta g_y, which is axpby itself (differentiable again).
    if g_x is None and g_y is None:
        return None, None, None
    if g_x is None:
        return ctx.beta * g_y, None, None
    if g_y is None:
        return ctx.alpha * g_x, None, None
    return torch.ops.opforge.axpby(g_x, g_y, ctx.alpha, ctx.beta), None, None


def _setup_context_backward(ctx, inputs, output) -> None:  # noqa: ANN001 - torch's protocol
    _, ctx.alpha, ctx.beta = inputs


def _coefficients(gen: torch.Generator) -> tuple[float, float]:
    # Drawn fresh, and kept exactly representable in every dtype's opmath so
    # the float32 kernel and the float64 reference scale by the same number.
    a, b = (torch.randint(-64, 64, (2,), generator=gen, device=gen.device) / 16).tolist()
    return a or 0.5, b or -0.25


def _samples(device: torch.device, dtype: torch.dtype, gen: torch.Generator):  # noqa: ANN202
    for i, (desc, (x, y)) in enumerate(tensor_samples(2, device, dtype, gen)):
        if i % 3 == 0:
            yield Sample((x, y), desc=f"{desc}, default alpha=3 beta=-1")
        else:
            alpha, beta = _coefficients(gen)
            yield Sample((x, y), {"alpha": alpha, "beta": beta}, desc=f"{desc}, alpha={alpha} beta={beta}")


def _fake_backward(grad: torch.Tensor, alpha: float, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    expect_floating(OP_BACKWARD, "grad", grad)
    return result_like(grad), result_like(grad)


def _samples_backward(device: torch.device, dtype: torch.dtype, gen: torch.Generator):  # noqa: ANN202
    for desc, (g,) in tensor_samples(1, device, dtype, gen):
        alpha, beta = _coefficients(gen)
        yield Sample((g, alpha, beta), desc=f"{desc}, alpha={alpha} beta={beta}")


def _jvp(inputs, tangents, output):  # noqa: ANN001, ANN202
    (_, _, alpha, beta), (t_x, t_y, _, _) = inputs, tangents
    if t_x is not None and t_y is not None:
        return torch.ops.opforge.axpby(t_x, t_y, alpha, beta)
    return alpha * t_x if t_y is None else beta * t_y


def _jvp_backward(inputs, tangents, output):  # noqa: ANN001, ANN202
    # Linear in grad: the tangent goes through the operator itself.
    (_, alpha, beta), (t_grad, _, _) = inputs, tangents
    return torch.ops.opforge.axpby_backward(t_grad, alpha, beta)


SPECS = [
    OpSpec(
        name="axpby",
        jvp=_jvp,
        doc="alpha * x + beta * y, elementwise (the autograd tutorial's my_op is the default, 3x - y).",
        reference=_reference,
        samples=_samples,
        bad_inputs=lambda device: bad_elementwise("axpby", ("x", "y"), device),
        cost=lambda x, y, alpha=3.0, beta=-1.0: streaming_cost(x, y, x, flops_per_element=3),
        # alpha and beta positional: the eager entry's fast path takes positional
        # arguments only, and the bench times the kernel, not keyword parsing.
        bench_cases=elementwise_bench(2, 1.5, -0.5),
        sweep_cases=elementwise_bench(2, 1.5, -0.5, sweep=True),
        fake=_fake,
        backward=_backward,
        setup_context=_setup_context,
        # alpha * x + beta * y is linear in (x, y) together: Partial in, Partial out.
        sharding="pointwise-linear",
    ),
    OpSpec(
        name="axpby_backward",
        jvp=_jvp_backward,
        doc="(alpha * grad, beta * grad): axpby's gradients with respect to x and y, in one pass over grad.",
        reference=lambda grad, alpha, beta: (alpha * grad, beta * grad),
        samples=_samples_backward,
        bad_inputs=lambda device: bad_elementwise("axpby_backward", ("grad",), device, extra=(1.0, 2.0)),
        cost=lambda grad, alpha, beta: streaming_cost(grad, grad, grad, flops_per_element=2),
        bench_cases=elementwise_bench(1, 1.5, -0.5),
        sweep_cases=elementwise_bench(1, 1.5, -0.5, sweep=True),
        fake=_fake_backward,
        backward=_backward_backward,
        setup_context=_setup_context_backward,
        # (alpha * grad, beta * grad): linear in grad.
        sharding="pointwise-linear",
    ),
]
