"""torchpairwise's Bray-Curtis distances against broadcasting in plain PyTorch."""

from collections.abc import Iterator

import torch
import torchpairwise  # noqa: F401  (its import loads the operators)

import opforge
from opforge.opspec import Sample


def _reference(x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    return (x1[:, None] - x2[None]).abs().sum(-1) / (x1[:, None] + x2[None]).abs().sum(-1)


def _samples(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Iterator[Sample]:
    for n, m, d in ((5, 7, 3), (97, 3, 59), (1, 1, 1), (33, 65, 4)):
        x1 = torch.rand(n, d, generator=gen, device=device).to(dtype) + 0.1
        x2 = torch.rand(m, d, generator=gen, device=device).to(dtype) + 0.1
        yield Sample((x1, x2), desc=f"{n}x{d} by {m}x{d}")


def _bench(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Iterator[Sample]:
    x1 = torch.rand(1024, 64, generator=gen, device=device).to(dtype) + 0.1
    yield Sample((x1, x1.flip(0).contiguous()), desc="1024x64 by 1024x64")


SPECS = [
    opforge.spec(
        torch.ops.torchpairwise._braycurtis.default,
        reference=_reference,
        samples=_samples,
        bench_cases=_bench,
        dtypes=("float32", "float64"),
    )
]
