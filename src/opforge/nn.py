"""``nn.Module`` wrappers of the differentiable operators, as the autograd tutorial writes by
hand with ``torch.autograd.Function``; here autograd comes from the op's spec."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from opforge.autograd import no_derivative_error
from opforge.quant import quantize_act_int8, quantize_weight_w4
from opforge.registry import get_specs


class Add(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.ops.opforge.add(a, b)


class Square(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.opforge.square(x)


class AXPBY(nn.Module):
    """alpha * x + beta * y; the defaults are the autograd tutorial's my_op, 3x - y."""

    def __init__(self, alpha: float = 3.0, beta: float = -1.0) -> None:
        super().__init__()
        self.alpha = alpha
        self.beta = beta

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.ops.opforge.axpby(x, y, self.alpha, self.beta)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, beta={self.beta}"


class Sigmoid(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.opforge.sigmoid(x)


class LLTM(nn.Module):
    """The LLTM cell of the PyTorch C++/CUDA extension tutorial, on
    ``opforge::lltm_forward`` (and its backward operator).

    ``forward(input, (h, c)) -> (new_h, new_cell)``, input ``[batch, input_features]``,
    h and c ``[batch, state_size]``. Parameters as in the tutorial: ``weights``
    ``[3 * state_size, input_features + state_size]`` and ``bias`` ``[3 * state_size]``,
    both uniform in (-1/sqrt(state_size), 1/sqrt(state_size)).
    """

    def __init__(self, input_features: int, state_size: int) -> None:
        super().__init__()
        self.input_features = input_features
        self.state_size = state_size
        self.weights = nn.Parameter(torch.empty(3 * state_size, input_features + state_size))
        self.bias = nn.Parameter(torch.empty(3 * state_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        stdv = 1.0 / math.sqrt(self.state_size)
        for weight in self.parameters():
            nn.init.uniform_(weight, -stdv, stdv)

    def forward(self, input: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        old_h, old_cell = state
        new_h, new_cell, _gates = torch.ops.opforge.lltm_forward(input, self.weights, self.bias, old_h, old_cell)
        return new_h, new_cell

    def extra_repr(self) -> str:
        return f"input_features={self.input_features}, state_size={self.state_size}"


class _NoDerivative(torch.autograd.Function):
    """The W4A8 layer's output, tied to its input in the graph: the int8
    quantisation cuts the input off, and a backward would otherwise give x a
    gradient with the layer's term silently left out. A gradient through it
    raises, as one through qqq_gemm does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        raise no_derivative_error(
            get_specs(["qqq_gemm"])[0], "the input of opforge.nn.QQQLinear requires grad, and backward reached the layer's output"
        )


class QQQLinear(nn.Module):
    """A W4A8 linear layer on ``opforge::qqq_gemm`` (the QQQ method):
    int4 weights packed for the kernel, activations quantised to int8 per token
    on the fly, integer tensor-core products, output in ``out_dtype``.

    ``QQQLinear.from_linear(linear, group_size=-1 | 128)`` quantises an
    ``nn.Linear`` (``opforge.quant.quantize_weight_w4``); ``in_features`` and
    ``out_features`` must be multiples of 32. Inference only: a gradient through
    the layer to an input that requires grad raises an error naming qqq_gemm.
    A cast of the layer (``.half()``, ``.to(torch.bfloat16)``) sets its output
    dtype; a token holding NaN or Inf gives NaN outputs in its row.
    """

    w_packed: torch.Tensor
    s_ch: torch.Tensor
    s_group: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        group_size: int = -1,
        out_dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        self.out_dtype = out_dtype
        # Placeholders of the right shapes (a zero weight); from_linear fills them.
        qw = quantize_weight_w4(torch.zeros(in_features, out_features, device=device), group_size)
        self.register_buffer("w_packed", qw.w_packed)
        self.register_buffer("s_ch", qw.s_ch)
        self.register_buffer("s_group", qw.s_group)
        self.register_buffer("bias", torch.zeros(out_features, device=device, dtype=out_dtype) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = -1, out_dtype: torch.dtype | None = None) -> QQQLinear:
        """The layer of ``linear``, quantised. ``out_dtype`` defaults to the
        linear's dtype where the kernel writes it (float16, bfloat16, float32),
        else float16."""
        w = linear.weight.detach()
        if out_dtype is None:
            out_dtype = w.dtype if w.dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float16
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, group_size=group_size,
                    out_dtype=out_dtype, device=w.device)  # fmt: skip
        qw = quantize_weight_w4(w.t(), group_size)
        layer.w_packed, layer.s_ch, layer.s_group = qw.w_packed, qw.s_ch, qw.s_group
        if linear.bias is not None:
            layer.bias = linear.bias.detach().to(out_dtype).clone()
        return layer

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 - nn.Module's protocol
        # A dtype cast (.half(), .to(torch.bfloat16)) means "outputs of that
        # dtype", as for nn.Linear; the kernel's scales stay float32 and the
        # packed weights int32, whatever the cast.
        bias_dtype = None if self.bias is None else self.bias.dtype
        super()._apply(fn, recurse)
        cast = self.s_ch.dtype if self.s_ch.dtype != torch.float32 else None
        if cast is None and self.bias is not None and self.bias.dtype != bias_dtype:
            cast = self.bias.dtype
        if cast is None:
            return self
        self.s_ch = self.s_ch.to(torch.float32)
        if cast not in (torch.float16, torch.bfloat16, torch.float32):
            if self.bias is not None:
                self.bias = self.bias.to(bias_dtype)  # the layer stays usable as it was
            raise TypeError(f"QQQLinear: the kernel writes float16, bfloat16 or float32 outputs, cannot cast the layer to {cast}")
        self.out_dtype = cast
        if self.bias is not None:
            self.bias = self.bias.to(cast)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"QQQLinear: input must have {self.in_features} features in its last dimension, got shape {list(x.shape)}")
        a, s_tok = quantize_act_int8(x)
        if _k_sharded(self.w_packed):
            from torch.distributed.tensor import Replicate  # lazy: import time (torch.distributed.tensor, 0.75 s; loaded here)

            # Row-parallel (opforge.tensor_parallel.RowwiseParallel): each rank's product over its share of
            # K is a partial sum. Reduced in float32, then rounded once to out_dtype, as on one device.
            out = torch.ops.opforge.qqq_gemm(a, self.w_packed, s_tok, self.s_ch, self.s_group, self.group_size, torch.float32)
            out = out.redistribute(placements=[Replicate() if p.is_partial() else p for p in out.placements]).to(self.out_dtype)
        else:
            out = torch.ops.opforge.qqq_gemm(a, self.w_packed, s_tok, self.s_ch, self.s_group, self.group_size, self.out_dtype)
        if x.requires_grad and torch.is_grad_enabled():
            out = _NoDerivative.apply(x, out)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        scheme = "per channel" if self.group_size == -1 else f"group_size={self.group_size}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {scheme}, "
                f"out_dtype={self.out_dtype}")  # fmt: skip


def _k_sharded(w_packed: torch.Tensor) -> bool:
    """A DTensor stripe view sharded on its units of K (dimension 1): a row-parallel layer."""
    placements = getattr(w_packed, "placements", None)
    return placements is not None and w_packed.dim() == 3 and any(p.is_shard(1) for p in placements)


__all__ = ["AXPBY", "LLTM", "Add", "QQQLinear", "Sigmoid", "Square"]
