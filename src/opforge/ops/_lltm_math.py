"""The LLTM cell's math, apart from its spec (``opforge.ops.lltm``): the
plain-PyTorch reference of the forward and the backward, the fake (meta)
kernels that check their inputs in the C++ wrapper's words, and the autograd
formula that makes ``lltm_backward`` the forward's backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from opforge.ops._rules import expect_2d, expect_floating, expect_like, expect_shape

OP = "opforge::lltm_forward"
OP_BACKWARD = "opforge::lltm_backward"


# --- the plain-PyTorch LLTM: the reference ---


def reference_forward(
    input: torch.Tensor, weights: torch.Tensor, bias: torch.Tensor, old_h: torch.Tensor, old_cell: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tutorial's Python LLTM, returning the activated gates as well.
    One sigmoid over the first two gate blocks: the same kernel count as the
    tutorial's (which calls sigmoid twice) although it also builds ``gates``."""
    S = old_h.shape[1]
    X = torch.cat([old_h, input], dim=1)
    gate_weights = torch.addmm(bias, X, weights.t())
    sig = torch.sigmoid(gate_weights[:, : 2 * S])
    candidate_cell = F.elu(gate_weights[:, 2 * S :])
    input_gate, output_gate = sig[:, :S], sig[:, S:]
    new_cell = old_cell + candidate_cell * input_gate
    new_h = torch.tanh(new_cell) * output_gate
    return new_h, new_cell, torch.cat([sig, candidate_cell], dim=1)


def reference_backward(
    grad_h: torch.Tensor | None,
    grad_cell: torch.Tensor | None,
    grad_gates: torch.Tensor | None,
    new_cell: torch.Tensor,
    gates: torch.Tensor,
    input: torch.Tensor,
    old_h: torch.Tensor,
    weights: torch.Tensor,
    output_mask: Sequence[bool] = (True,) * 5,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tutorial's LLTM backward in plain PyTorch, with the gradient of the
    gates output added; a None gradient is zero. Returns (d_old_h, d_input,
    d_weights, d_bias, d_old_cell), an empty tensor where output_mask is False."""
    S = new_cell.shape[1]
    grad_h = torch.zeros_like(new_cell) if grad_h is None else grad_h
    grad_cell = torch.zeros_like(new_cell) if grad_cell is None else grad_cell
    input_gate, output_gate, candidate_cell = gates.split(S, dim=1)
    t = torch.tanh(new_cell)
    d_new_cell = grad_cell + grad_h * output_gate * (1 - t * t)
    d_input_gate = d_new_cell * candidate_cell
    d_output_gate = grad_h * t
    d_candidate_cell = d_new_cell * input_gate
    if grad_gates is not None:
        g_i, g_o, g_c = grad_gates.split(S, dim=1)
        d_input_gate, d_output_gate, d_candidate_cell = d_input_gate + g_i, d_output_gate + g_o, d_candidate_cell + g_c
    d_gates = torch.cat(
        [
            d_input_gate * input_gate * (1 - input_gate),
            d_output_gate * output_gate * (1 - output_gate),
            # elu'(z) from elu(z): 1 where z > 0, exp(z) = elu(z) + 1 elsewhere.
            d_candidate_cell * torch.where(candidate_cell > 0, 1.0, candidate_cell + 1),
        ],
        dim=1,
    )
    X = torch.cat([old_h, input], dim=1)
    d_X = d_gates @ weights
    grads = (d_X[:, :S], d_X[:, S:], d_gates.t() @ X, d_gates.sum(0), d_new_cell)
    empty = input.new_empty(0)
    return tuple(g if want else empty for g, want in zip(grads, output_mask, strict=True))  # type: ignore[return-value]


# --- fake kernels: the C++ checks, same words (csrc/ops/lltm/lltm.cpp) ---


def expect_cell(op: str, input: torch.Tensor, old_h: torch.Tensor, weights: torch.Tensor) -> tuple[Any, Any, Any]:
    expect_floating(op, "input", input)
    expect_2d(op, "input", input, "[batch, input_features]")
    expect_like(op, "input", input, "old_h", old_h)
    expect_like(op, "input", input, "weights", weights)
    expect_2d(op, "old_h", old_h, "[batch, state_size]")
    B, F_, S = input.shape[0], input.shape[1], old_h.shape[1]
    torch._check(old_h.shape[0] == B, lambda: f"{op}: old_h must have input's batch size {B} in dim 0, got shape {list(old_h.shape)}")
    # As the C++ check: weights of a whole cell for input's features point at old_h when it disagrees.
    if weights.dim() == 2 and weights.shape[0] % 3 == 0 and weights.shape[1] == F_ + weights.shape[0] // 3:
        state = weights.shape[0] // 3
        torch._check(
            state == S,
            lambda: (
                f"{op}: old_h must have shape [batch, state_size] = [{B}, {state}] (state_size from weights "
                f"{list(weights.shape)}), got {list(old_h.shape)}"
            ),
        )
    expect_shape(op, "weights", weights, [3 * S, F_ + S], "[3 * state_size, input_features + state_size]")
    return B, F_, S


def fake_forward(
    input: torch.Tensor, weights: torch.Tensor, bias: torch.Tensor, old_h: torch.Tensor, old_cell: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, _, S = expect_cell(OP, input, old_h, weights)
    expect_like(OP, "input", input, "bias", bias)
    expect_like(OP, "input", input, "old_cell", old_cell)
    expect_shape(OP, "bias", bias, [3 * S], "[3 * state_size]")
    expect_shape(OP, "old_cell", old_cell, list(old_h.shape), "[batch, state_size] (old_h's)")
    return input.new_empty(B, S), input.new_empty(B, S), input.new_empty(B, 3 * S)


def fake_backward(
    grad_h: torch.Tensor | None,
    grad_cell: torch.Tensor | None,
    grad_gates: torch.Tensor | None,
    new_cell: torch.Tensor,
    gates: torch.Tensor,
    input: torch.Tensor,
    old_h: torch.Tensor,
    weights: torch.Tensor,
    output_mask: Sequence[bool] = (True,) * 5,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch._check(
        len(output_mask) == 5,
        lambda: f"{OP_BACKWARD}: output_mask must have 5 entries (d_old_h, d_input, d_weights, d_bias, d_old_cell), got {len(output_mask)}",
    )
    B, F_, S = expect_cell(OP_BACKWARD, input, old_h, weights)
    for name, t, shape, how in (
        ("grad_h", grad_h, [B, S], "[batch, state_size]"),
        ("grad_cell", grad_cell, [B, S], "[batch, state_size]"),
        ("grad_gates", grad_gates, [B, 3 * S], "[batch, 3 * state_size]"),
        ("new_cell", new_cell, [B, S], "[batch, state_size]"),
        ("gates", gates, [B, 3 * S], "[batch, 3 * state_size]"),
    ):
        if t is not None:
            expect_like(OP_BACKWARD, "input", input, name, t)
            expect_shape(OP_BACKWARD, name, t, shape, how)
    shapes = ((B, S), (B, F_), (3 * S, F_ + S), (3 * S,), (B, S))
    return tuple(input.new_empty(shape if want else (0,)) for shape, want in zip(shapes, output_mask, strict=True))  # type: ignore[return-value]


# --- autograd: lltm_forward's backward is the lltm_backward operator ---


def autograd_setup_context(ctx, inputs, output) -> None:  # noqa: ANN001 - torch's protocol
    input, weights, _bias, old_h, _old_cell = inputs
    _new_h, new_cell, gates = output
    # An output nobody differentiates (gates, usually) then arrives as None,
    # and the kernel treats it as zero instead of reading a tensor of zeros.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(new_cell, gates, input, old_h, weights)


def autograd_backward(ctx, grad_h: torch.Tensor | None, grad_cell: torch.Tensor | None, grad_gates: torch.Tensor | None):  # noqa: ANN001, ANN202
    new_cell, gates, input, old_h, weights = ctx.saved_tensors
    if grad_h is None and grad_cell is None and grad_gates is None:
        return None, None, None, None, None
    # needs_input_grad follows lltm_forward's arguments, output_mask lltm_backward's outputs.
    n_input, n_weights, n_bias, n_old_h, n_old_cell = ctx.needs_input_grad
    d_old_h, d_input, d_weights, d_bias, d_old_cell = torch.ops.opforge.lltm_backward(
        grad_h, grad_cell, grad_gates, new_cell, gates, input, old_h, weights, [n_old_h, n_input, n_weights, n_bias, n_old_cell]
    )
    return (
        d_input if n_input else None,
        d_weights if n_weights else None,
        d_bias if n_bias else None,
        d_old_h if n_old_h else None,
        d_old_cell if n_old_cell else None,
    )
