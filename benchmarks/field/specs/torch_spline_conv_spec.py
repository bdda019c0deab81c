"""torch_spline_conv's spline_basis (degree 1, open and closed B-splines) against the basis in plain PyTorch."""

from collections.abc import Iterator

import torch
import torch_spline_conv  # noqa: F401  (its import loads the operators)

import opforge
from opforge.opspec import Sample


def _reference(
    pseudo: torch.Tensor, kernel_size: torch.Tensor, is_open_spline: torch.Tensor, degree: int
) -> tuple[torch.Tensor, torch.Tensor]:
    assert degree == 1, "this reference is degree 1's"
    d = pseudo.size(1)
    k_mod = (torch.arange(2**d)[:, None] >> torch.arange(d)) & 1  # (S, D): which end of each interval
    v = pseudo[:, None, :] * (kernel_size - is_open_spline.long())
    offsets = torch.cat([torch.ones(1, dtype=torch.long), kernel_size.cumprod(0)[:-1]])
    weight_index = (((v.long() + k_mod) % kernel_size) * offsets).sum(-1)
    frac = v - v.floor()
    basis = (1 - frac - k_mod + 2 * frac * k_mod).prod(-1)
    return basis, weight_index


def _samples(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Iterator[Sample]:
    for e, sizes, is_open in ((7, (5, 5), (1, 1)), (97, (3, 4, 5), (1, 0, 1)), (1, (2,), (0,))):
        pseudo = torch.rand(e, len(sizes), generator=gen, device=device).to(dtype)
        kernel_size = torch.tensor(sizes, device=device)
        yield Sample((pseudo, kernel_size, torch.tensor(is_open, dtype=torch.uint8, device=device), 1), desc=f"{e} edges, kernel {sizes}")


def _bench(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Iterator[Sample]:
    pseudo = torch.rand(1 << 18, 3, generator=gen, device=device).to(dtype)
    ks = torch.tensor((5, 5, 5), device=device)
    yield Sample((pseudo, ks, torch.ones(3, dtype=torch.uint8, device=device), 1), desc="2^18 edges, kernel (5, 5, 5)")


SPECS = [
    opforge.spec(
        torch.ops.torch_spline_conv.spline_basis.default,
        reference=_reference,
        samples=_samples,
        bench_cases=_bench,
        dtypes=("float32", "float64"),
    )
]
