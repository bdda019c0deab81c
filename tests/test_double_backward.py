"""Second derivatives: every operator with a cheap derivative of its backward
has one (sigmoid_backward, axpby_backward), so double backward through the
public functions is right, not silently zero; gradgradcheck in float64."""

from __future__ import annotations

import pytest
import torch

import opforge
from opforge.check.run import generator
from opforge.registry import get_specs

from .conftest import DEVICES

TWICE = ["add", "square", "sigmoid", "sigmoid_backward", "axpby", "axpby_backward", "gemm"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", TWICE)
def test_gradgradcheck(name, device, seed):
    (spec,) = get_specs([name])
    gen = generator(torch.device(device), seed)
    samples = [s for s in spec.samples(torch.device(device), torch.float64, gen) if all(
        a.numel() > 0 for a in s.args if isinstance(a, torch.Tensor))][:3]  # fmt: skip
    assert samples
    for sample in samples:
        args = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in sample.args]
        assert torch.autograd.gradgradcheck(spec.function, args, fast_mode=True), sample.desc


@pytest.mark.parametrize("device", DEVICES)
def test_second_derivatives_match_torch(device):
    x = torch.tensor([1.0, -0.5], device=device, requires_grad=True)
    y = torch.tensor([2.0, 0.25], device=device)
    (g,) = torch.autograd.grad((opforge.axpby(x, y) ** 2).sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    torch.testing.assert_close(gg, torch.full_like(x, 18.0))  # d2/dx2 (3x - y)^2 = 18
    z = torch.randn(64, device=device, requires_grad=True)
    (a,) = torch.autograd.grad(opforge.sigmoid(z).sum(), z, create_graph=True)
    (aa,) = torch.autograd.grad(a.sum(), z)
    w = z.detach().clone().requires_grad_()
    (b,) = torch.autograd.grad(torch.sigmoid(w).sum(), w, create_graph=True)
    (bb,) = torch.autograd.grad(b.sum(), w)
    assert aa.abs().max() > 0
    torch.testing.assert_close(aa, bb)
