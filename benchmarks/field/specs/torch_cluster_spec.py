"""torch_cluster's grid (voxel-grid cluster ids) against the voxel arithmetic in plain PyTorch."""

from collections.abc import Iterator

import torch
import torch_cluster  # noqa: F401  (its import loads the operators)

import opforge
from opforge.opspec import Sample


def _reference(pos: torch.Tensor, size: torch.Tensor, start: torch.Tensor | None, end: torch.Tensor | None) -> torch.Tensor:
    pos = pos.view(pos.size(0), -1)
    start = pos.min(0).values if start is None else start
    end = pos.max(0).values if end is None else end
    voxels = ((end - start) / size).long() + 1
    strides = torch.cat([torch.ones(1, dtype=torch.long), voxels.cumprod(0)])[: size.numel()]
    return (((pos - start) / size.view(1, -1)).long() * strides).sum(1)


def _samples(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Iterator[Sample]:
    for n, d in ((7, 2), (97, 3), (1, 1), (1025, 3)):
        pos = (torch.rand(n, d, generator=gen, device=device) * 10).to(dtype)
        size = torch.full((d,), 0.7, device=device, dtype=dtype)
        yield Sample((pos, size, None, None), desc=f"{n} points in {d}-d")


def _bench(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Iterator[Sample]:
    pos = (torch.rand(1 << 20, 3, generator=gen, device=device) * 10).to(dtype)
    yield Sample((pos, torch.full((3,), 0.1, device=device, dtype=dtype), None, None), desc="2^20 points in 3-d")


SPECS = [
    opforge.spec(
        torch.ops.torch_cluster.grid.default,
        reference=_reference,
        samples=_samples,
        bench_cases=_bench,
        dtypes=("float32", "float64"),
    )
]
