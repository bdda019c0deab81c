"""``nn.Module`` wrappers of the differentiable operators, as seed 004 writes by
hand with ``torch.autograd.Function``; here autograd comes from the op's spec."""

from __future__ import annotations

import math

import torch
from torch import nn


class Add(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.ops.opforge.add(a, b)


class Square(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.opforge.square(x)


class AXPBY(nn.Module):
    """alpha * x + beta * y; the defaults are seed 004's my_op, 3x - y."""

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


__all__ = ["AXPBY", "LLTM", "Add", "Sigmoid", "Square"]
