"""lltm: the LLTM cell of the PyTorch C++/CUDA extension tutorial (the autograd tutorial
points to it), forward and backward as opforge operators.

    X = [old_h | input]; gate_weights = X @ W^T + b            (W: [3S, F + S], b: [3S])
    input_gate, output_gate = sigmoid(g0), sigmoid(g1); candidate_cell = elu(g2)
    new_cell = old_cell + candidate_cell * input_gate; new_h = tanh(new_cell) * output_gate

``lltm_forward`` returns ``(new_h, new_cell, gates)``, ``gates`` being the
activated gates ``[input_gate | output_gate | candidate_cell]`` ([B, 3S]) that
the backward needs; it is an ordinary differentiable output (its gradient
reaches ``lltm_backward`` as ``grad_gates``). The backward saves nothing else
but the inputs ``input``, ``old_h``, ``weights`` and the output ``new_cell``.

The reference, fake kernels and autograd formula are in ``_lltm_math``; this
module holds the rest of the spec: samples, bad inputs, cost, bench cases and
tolerances.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from opforge.ops._elementwise import randn
from opforge.ops._lltm_math import (
    OP,
    OP_BACKWARD,
    autograd_backward,
    autograd_setup_context,
    fake_backward,
    fake_forward,
    reference_backward,
    reference_forward,
)
from opforge.opspec import BadInput, Cost, OpSpec, Sample, SampleFn

Cell = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


# --- samples ---

# (batch, input_features, state_size, layout): odd sizes, B = 1, F != S, F == S,
# F = 0, an empty batch, and sizes past one CPU task (32K elements) and past one
# CUDA grid of the kernels (8 blocks of 256 threads per SM: 270K on an H100).
_SAMPLES: tuple[tuple[int, int, int, str], ...] = (
    (1, 5, 3, "contiguous"),
    (3, 7, 11, "contiguous"),
    (5, 1, 9, "contiguous"),
    (7, 13, 5, "transposed input and weights"),
    (2, 6, 6, "strided bias, old_h and old_cell"),
    (9, 17, 7, "offset by one element"),
    (6, 11, 4, "expanded old_h and old_cell"),
    (4, 0, 5, "contiguous"),
    (0, 5, 3, "contiguous"),
    (33, 59, 97, "contiguous"),
    (1, 97, 59, "transposed input and weights"),
    (300, 50, 127, "contiguous"),
    (1025, 63, 300, "contiguous"),
)


def _tensor(shape: tuple[int, ...], layout: str, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """Random values of ``shape`` laid out as ``layout`` says (2-D shapes for the
    transposed and expanded layouts)."""
    match layout:
        case "transposed":
            return randn(shape[::-1], dtype, device, gen).t()
        case "strided":
            return randn((*shape[:-1], 2 * shape[-1]), dtype, device, gen)[..., ::2]
        case "offset":
            n = math.prod(shape)
            return randn((n + 1,), dtype, device, gen)[1:].view(shape)
        case "expanded":
            return randn((1, shape[1]), dtype, device, gen).expand(shape)
        case _:
            return randn(shape, dtype, device, gen)


def make_cell(B: int, F_: int, S: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator, layout: str = "contiguous") -> Cell:
    """(input, weights, bias, old_h, old_cell) with gate pre-activations of
    roughly unit scale, so every gate sees both its saturated and its linear range."""
    kind = {
        "transposed input and weights": {"input": "transposed", "weights": "transposed"},
        "strided bias, old_h and old_cell": {"bias": "strided", "old_h": "strided", "old_cell": "strided"},
        "offset by one element": dict.fromkeys(("input", "weights", "bias", "old_h", "old_cell"), "offset"),
        "expanded old_h and old_cell": {"old_h": "expanded", "old_cell": "expanded"},
    }.get(layout, {})
    shapes = {"input": (B, F_), "weights": (3 * S, F_ + S), "bias": (3 * S,), "old_h": (B, S), "old_cell": (B, S)}
    t = {name: _tensor(shape, kind.get(name, ""), dtype, device, gen) for name, shape in shapes.items()}
    # Scaled in place (views keep their layout): W ~ N(0, 1.5^2 / (F + S)) makes
    # each gate's pre-activation about N(0, 1.5^2 + 1) with the N(0, 1) bias.
    with torch.no_grad():
        t["weights"].mul_(1.5 / math.sqrt(max(F_ + S, 1)))
    return t["input"], t["weights"], t["bias"], t["old_h"], t["old_cell"]


def _samples(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Iterator[Sample]:
    for B, F_, S, layout in _SAMPLES:
        yield Sample(make_cell(B, F_, S, dtype, device, gen, layout), desc=f"B={B} F={F_} S={S}, {layout}")


def backward_args(cell: Cell, gen: torch.Generator, *, grad_gates: bool, layout: str = "contiguous") -> tuple[Any, ...]:
    """lltm_backward's arguments for a forward call on ``cell``: new_cell and
    gates from the float64 reference (then rounded to the cell's dtype), fresh
    random incoming gradients."""
    input, weights, _bias, old_h, _old_cell = cell
    dtype, device = input.dtype, input.device
    B, S = old_h.shape
    with torch.no_grad():
        _, new_cell, gates = reference_forward(*(t.to(torch.float64) for t in cell))
    new_cell, gates = new_cell.to(dtype), gates.to(dtype)
    # Gradients of a batch-mean loss are O(1 / B) per row; 1 / sqrt(B) keeps
    # d_weights and d_bias, sums over the batch, O(1) at every batch size.
    scale = 1 / math.sqrt(max(B, 1))
    # Scaled at the draw's precision (all of float64's bits for float64), rounded once.
    wide = torch.float64 if dtype == torch.float64 else torch.float32

    def grad(*shape: int) -> torch.Tensor:
        return (randn(shape, wide, device, gen) * scale).to(dtype)

    if layout == "expanded grad_h, transposed grad_cell":
        # What y.sum().backward() hands in: one value, stride 0.
        grad_h = grad(1, 1).expand(B, S)
        grad_cell = grad(S, B).t()
    else:
        grad_h, grad_cell = grad(B, S), grad(B, S)
    g_gates = grad(B, 3 * S) if grad_gates else None
    return grad_h, grad_cell, g_gates, new_cell, gates, input, old_h, weights


# Per backward sample (cycled): which incoming gradients are given, and the
# output_mask. grad_h is always given here because opforge.check reads the
# first argument's device; tests/test_lltm.py covers a None grad_h (new_cell
# or gates used alone) through autograd.
_GRAD_CASES: tuple[tuple[tuple[bool, bool, bool], tuple[bool, ...]], ...] = (
    ((True, True, False), (True,) * 5),
    ((True, True, True), (True,) * 5),
    ((True, False, False), (True, False, True, True, False)),  # new_h alone; data and old_cell need no gradient
    ((True, False, True), (False, True, True, False, True)),
    ((True, True, False), (False, False, True, True, False)),  # the parameters alone: training on data
)


def _samples_backward(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Iterator[Sample]:
    for k, (B, F_, S, layout) in enumerate(_SAMPLES):
        cell = make_cell(B, F_, S, dtype, device, gen, layout)
        (has_h, has_c, has_g), mask = _GRAD_CASES[k % len(_GRAD_CASES)]
        grads = "expanded grad_h, transposed grad_cell" if k in (2, 6) else "contiguous"
        args = list(backward_args(cell, gen, grad_gates=has_g, layout=grads))
        args[0], args[1] = (args[0] if has_h else None), (args[1] if has_c else None)
        given = "+".join(n for n, has in (("grad_h", has_h), ("grad_cell", has_c), ("grad_gates", has_g)) if has)
        desc = f"B={B} F={F_} S={S}, {layout}, {grads} {given}, output_mask {''.join('1' if m else '0' for m in mask)}"
        yield Sample((*args, list(mask)), desc=desc)


# --- bad inputs: each names the op and the bad value ---


def _bad_forward(device: torch.device) -> list[BadInput]:
    gen = torch.Generator(device=device).manual_seed(0)
    B, F_, S = 4, 5, 3
    x, w, b, h, c = make_cell(B, F_, S, torch.float32, device, gen)
    f32 = lambda *shape: torch.randn(shape, device=device)  # noqa: E731
    words = "float32, float16, bfloat16 or float64"
    q = OP

    def bad(desc: str, args: tuple[Any, ...], match: str, error: type[Exception] = RuntimeError) -> BadInput:
        return BadInput(desc, args, match=rf"^{q}: {match}", error=error)

    cases = [
        bad("int32 input", (x.int(), w, b, h, c), rf"input must be {words}, got torch\.int32", ValueError),
        bad("complex input", (x.to(torch.complex64), w, b, h, c), rf"input must be {words}, got torch\.complex64", ValueError),
        bad(
            "float64 weights",
            (x, w.double(), b, h, c),
            r"input and weights must have the same dtype, got torch\.float32 and torch\.float64",
            ValueError,
        ),
        bad(
            "float16 bias",
            (x, w, b.half(), h, c),
            r"input and bias must have the same dtype, got torch\.float32 and torch\.float16",
            ValueError,
        ),
        bad(
            "bfloat16 old_cell",
            (x, w, b, h, c.bfloat16()),
            r"input and old_cell must have the same dtype, got torch\.float32 and torch\.bfloat16",
            ValueError,
        ),
        bad("1-D input", (f32(F_), w, b, h, c), r"input must be 2-D \[batch, input_features\], got shape \[5\]"),
        bad("3-D old_h", (x, w, b, f32(1, B, S), c), r"old_h must be 2-D \[batch, state_size\], got shape \[1, 4, 3\]"),
        bad(
            "old_h batch != input batch", (x, w, b, f32(B + 1, S), c), r"old_h must have input's batch size 4 in dim 0, got shape \[5, 3\]"
        ),
        bad(
            "weights for other input_features",
            (x, f32(3 * S, F_ + S - 1), b, h, c),
            r"weights must have shape \[3 \* state_size, input_features \+ state_size\] = \[9, 8\], got \[9, 7\]",
        ),
        bad(
            "weights for another state_size", (x, f32(3 * S + 3, F_ + S), b, h, c), r"weights must have shape .* = \[9, 8\], got \[12, 8\]"
        ),
        bad("weights transposed", (x, w.t(), b, h, c), r"weights must have shape .* = \[9, 8\], got \[8, 9\]"),
        bad("2-D bias [1, 3S]", (x, w, b[None], h, c), r"bias must have shape \[3 \* state_size\] = \[9\], got \[1, 9\]"),
        bad(
            "old_h of another state_size than weights",
            (x, w, b, f32(B, S + 1), c),
            r"old_h must have shape \[batch, state_size\] = \[4, 3\] \(state_size from weights \[9, 8\]\), got \[4, 4\]",
        ),
        bad(
            "old_cell shape != old_h shape",
            (x, w, b, h, f32(B, S + 1)),
            r"old_cell must have shape \[batch, state_size\] \(old_h's\) = \[4, 3\], got \[4, 4\]",
        ),
    ]
    if device.type == "cuda":
        cpu = torch.device("cpu")
        cases += [
            bad("weights on the CPU", (x, w.to(cpu), b, h, c), r"input and weights must be on the same device, got cuda:\d+ and cpu"),
            bad("old_cell on the CPU", (x, w, b, h, c.to(cpu)), r"input and old_cell must be on the same device, got cuda:\d+ and cpu"),
        ]
    else:
        # No second device on a CPU-only machine: a meta tensor stands in for one.
        cases.append(
            bad("weights on the meta device", (x, w.to("meta"), b, h, c), r"input and weights must be on the same device, got cpu and meta")
        )
    return cases


def _bad_backward(device: torch.device) -> list[BadInput]:
    gen = torch.Generator(device=device).manual_seed(0)
    B, F_, S = 4, 5, 3
    args = backward_args(make_cell(B, F_, S, torch.float32, device, gen), gen, grad_gates=True)
    q = OP_BACKWARD
    f32 = lambda *shape: torch.randn(shape, device=device)  # noqa: E731
    names = ("grad_h", "grad_cell", "grad_gates", "new_cell", "gates", "input", "old_h", "weights")

    def bad(desc: str, error: type[Exception] = RuntimeError, match: str = "", **replace: Any) -> BadInput:
        call = tuple(replace.get(n, a) for n, a in zip(names, args, strict=True))
        return BadInput(desc, call, match=rf"^{q}: {match}", error=error)

    cases = [
        bad("int32 input", ValueError, r"input must be float32, float16, bfloat16 or float64, got torch\.int32", input=args[5].int()),
        bad(
            "float64 grad_h",
            ValueError,
            r"input and grad_h must have the same dtype, got torch\.float32 and torch\.float64",
            grad_h=args[0].double(),
        ),
        bad(
            "float16 gates",
            ValueError,
            r"input and gates must have the same dtype, got torch\.float32 and torch\.float16",
            gates=args[4].half(),
        ),
        bad(
            "grad_cell of another shape",
            match=r"grad_cell must have shape \[batch, state_size\] = \[4, 3\], got \[4, 2\]",
            grad_cell=f32(B, S - 1),
        ),
        bad("1-D new_cell", match=r"new_cell must have shape \[batch, state_size\] = \[4, 3\], got \[12\]", new_cell=f32(B * S)),
        bad("gates of two gates", match=r"gates must have shape \[batch, 3 \* state_size\] = \[4, 9\], got \[4, 6\]", gates=f32(B, 2 * S)),
        bad(
            "grad_gates of another batch",
            match=r"grad_gates must have shape \[batch, 3 \* state_size\] = \[4, 9\], got \[3, 9\]",
            grad_gates=f32(B - 1, 3 * S),
        ),
        bad(
            "weights for other input_features", match=r"weights must have shape .* = \[9, 8\], got \[9, 9\]", weights=f32(3 * S, F_ + S + 1)
        ),
        bad("old_h batch != input batch", match=r"old_h must have input's batch size 4 in dim 0, got shape \[2, 3\]", old_h=f32(2, S)),
        bad(
            "old_h of another state_size than weights",
            match=r"old_h must have shape \[batch, state_size\] = \[4, 3\] \(state_size from weights \[9, 8\]\), got \[4, 2\]",
            old_h=f32(B, S - 1),
        ),
        BadInput(
            "output_mask of 4 entries",
            (*args, [True] * 4),
            match=rf"^{q}: output_mask must have 5 entries \(d_old_h, d_input, d_weights, d_bias, d_old_cell\), got 4",
        ),
    ]
    if device.type == "cuda":
        cases.append(
            bad("grad_h on the CPU", match=r"input and grad_h must be on the same device, got cuda:\d+ and cpu", grad_h=args[0].cpu())
        )
    else:
        cases.append(
            bad("gates on the meta device", match=r"input and gates must be on the same device, got cpu and meta", gates=args[4].to("meta"))
        )
    return cases


# --- cost and benchmark cases ---


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _cost(input: torch.Tensor, weights: torch.Tensor, bias: torch.Tensor, old_h: torch.Tensor, old_cell: torch.Tensor) -> Cost:
    # Reads every input once and writes new_h, new_cell and gates once; the gate
    # pre-activations need not leave the chip, so they are not counted. FLOPs:
    # the gate matmul, [B, F + S] x [F + S, 3S] (the elementwise part is ~20 per
    # state element, under 1 % of it at the bench sizes).
    B, S = old_h.shape
    elt = input.element_size()
    out_bytes = (2 * B * S + 3 * B * S) * elt
    return Cost(bytes=_nbytes(input, weights, bias, old_h, old_cell) + out_bytes, flops=2 * B * weights.shape[1] * weights.shape[0])


def _cost_backward(
    grad_h: torch.Tensor | None,
    grad_cell: torch.Tensor | None,
    grad_gates: torch.Tensor | None,
    new_cell: torch.Tensor,
    gates: torch.Tensor,
    input: torch.Tensor,
    old_h: torch.Tensor,
    weights: torch.Tensor,
    output_mask: Sequence[bool] = (True,) * 5,
) -> Cost:
    # Reads every argument given once (old_h and input only for d_W, weights
    # only for d_X); writes each wanted gradient once (d_gates, [B, 3S], could
    # stay on chip). FLOPs: d_W = d_gates^T X and d_X = d_gates W, each
    # 2 * B * 3S * (F + S) when both halves are wanted.
    want_h, want_x, want_w = output_mask[:3]
    B, F_, S = input.shape[0], input.shape[1], old_h.shape[1]
    elt = input.element_size()
    reads = _nbytes(grad_h, grad_cell, grad_gates, new_cell, gates)
    reads += _nbytes(old_h, input) if want_w else 0
    reads += 3 * S * ((S if want_h else 0) + (F_ if want_x else 0)) * elt
    shapes = (B * S, B * F_, 3 * S * (F_ + S), 3 * S, B * S)
    writes = sum(n for n, want in zip(shapes, output_mask, strict=True) if want) * elt
    flops = 2 * B * 3 * S * ((F_ + S if want_w else 0) + (S if want_h else 0) + (F_ if want_x else 0))
    return Cost(bytes=reads + writes, flops=flops)


# Two sizes: B=16, F=32, S=128 (launch-bound) and B=1024, F=S=1024 (matmul-bound).
BENCH_SIZES: tuple[tuple[int, int, int], ...] = ((16, 32, 128), (1024, 1024, 1024))


def _bench(backward: bool) -> SampleFn:
    def cases(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Iterator[Sample]:
        for B, F_, S in BENCH_SIZES:
            cell = make_cell(B, F_, S, dtype, device, gen)
            desc = f"B={B} F={F_} S={S}"
            if not backward:
                yield Sample(cell, desc=desc)
            elif device.type == "meta":  # bench counts cases on meta: no reference run there
                yield Sample((*cell[:2], None, *cell[3:]), desc=desc)
            else:
                yield Sample(backward_args(cell, gen, grad_gates=False), desc=desc)

    return cases


# --- tolerances ---

# (atol, rtol) against the float64 reference. The outputs come out of matmuls
# over K = F + S (forward, d_X) or K = B (d_W, d_b) products, whose rounding
# error grows with K and with the terms rather than with the output, and in
# half types the gate pre-activations are rounded before the activations, so
# the elementwise ops' half-ulp defaults cannot hold. Each value is about twice
# the largest error that PyTorch's own LLTM (reference_forward and
# reference_backward run in that dtype) shows against float64, as
# |err| / (1 + |ref|), over the samples and 10 seeds on the CPU (2026-11-22):
# forward 2.9e-6 (float32), 2.5e-3 (float16), 1.9e-2 (bfloat16); backward
# 1.4e-6, 1.7e-3, 1.25e-2. opforge's own errors there were 1x, 0.5x and 0.6x
# of those. Except float32's forward: `opforge bench` checks each bench case
# too, and at B=1024, F=S=1024 (K = 2048) cuBLAS's float32 error on an H200
# reached 1.5e-5, so 3e-5. tests/test_lltm.py checks, per run, that the
# kernels stay within twice PyTorch's own error on the same inputs.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-12, 1e-10),
    torch.float32: (3e-5, 3e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (4e-2, 4e-2),
}
TOLERANCES_BACKWARD: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-12, 1e-10),
    torch.float32: (3e-6, 3e-6),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


# --- sharding: the batch (data and sequence parallel), or everything replicated ---


def _sharding_forward(*args: Any) -> list[tuple[list[Any], list[Any]]]:
    """input, old_h and old_cell sharded over the batch, weights and bias replicated: each rank
    computes its rows of new_h, new_cell and gates."""
    # lazy: import time (torch.distributed.tensor, 0.75 s, only for sharding)
    from torch.distributed.tensor import Replicate, Shard

    R, B = Replicate(), Shard(0)
    return [([B, B, B], [B, R, R, B, B]), ([R, R, R], [R, R, R, R, R])]


def _sharding_backward(*args: Any) -> list[tuple[list[Any], list[Any]]]:
    """Batch-sharded: d_old_h, d_input and d_old_cell are rows of the batch; d_weights and
    d_bias are sums over it, a partial sum on each rank."""
    # lazy: import time (torch.distributed.tensor, 0.75 s, only for sharding)
    from torch.distributed.tensor import Partial, Replicate, Shard

    R, B, P = Replicate(), Shard(0), Partial()
    return [([B, B, P, P, B], [B, B, B, B, B, B, B, R, None]), ([R] * 5, [R] * 8 + [None])]


SPECS = [
    OpSpec(
        name="lltm_forward",
        doc=(
            "The LLTM cell (the PyTorch C++/CUDA extension tutorial's): (new_h, new_cell, gates) from input [B, F], "
            "weights [3S, F + S], bias [3S], old_h and old_cell [B, S]; gates [B, 3S] are the activated "
            "[input_gate | output_gate | candidate_cell]. One matmul (cuBLAS on a GPU) and one fused elementwise "
            "kernel; differentiable through opforge::lltm_backward."
        ),
        reference=reference_forward,
        samples=_samples,
        bad_inputs=_bad_forward,
        cost=_cost,
        bench_cases=_bench(backward=False),
        fake=fake_forward,
        backward=autograd_backward,
        setup_context=autograd_setup_context,
        tolerances=TOLERANCES,
        # Inputs go through a matmul (see gemm: special values there have no one answer).
        special_values=False,
        # lltm_backward has no autograd formula of its own.
        double_backward=False,
        sharding=_sharding_forward,
    ),
    OpSpec(
        name="lltm_backward",
        no_derivative="it is lltm_forward's gradient: lltm has no second derivative",
        doc=(
            "The LLTM cell's backward: (d_old_h, d_input, d_weights, d_bias, d_old_cell) from the gradients of new_h, "
            "new_cell and gates (each optional, None meaning zero), the saved new_cell and gates, and the inputs input, "
            "old_h and weights. One fused elementwise kernel, then only the matmuls output_mask asks for, on the column "
            "blocks of X and W; unwanted outputs are empty tensors."
        ),
        reference=reference_backward,
        samples=_samples_backward,
        bad_inputs=_bad_backward,
        cost=_cost_backward,
        bench_cases=_bench(backward=True),
        fake=fake_backward,
        tolerances=TOLERANCES_BACKWARD,
        # Its gradients go through matmuls (see gemm: special values there have no one answer).
        special_values=False,
        sharding=_sharding_backward,
    ),
]
