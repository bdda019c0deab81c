"""torch_scatter's scatter_sum against index_add in plain PyTorch."""

from collections.abc import Iterator

import torch
import torch_scatter  # noqa: F401  (its import loads the operators)

import opforge
from opforge.opspec import Sample

_SIZES = ((5, 7, 4), (97, 3, 11), (1, 65, 1), (0, 3, 2))


def _reference(src: torch.Tensor, index: torch.Tensor, dim: int, out: torch.Tensor | None, dim_size: int) -> torch.Tensor:
    return torch.zeros((dim_size, *src.shape[1:]), dtype=src.dtype).scatter_add_(0, index, src)


def _samples(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Iterator[Sample]:
    for rows, cols, size in _SIZES:
        src = torch.randn(rows, cols, generator=gen, device=device).to(dtype)
        index = torch.randint(0, size, (rows, cols), generator=gen, device=device)
        yield Sample((src, index, 0, None, size), desc=f"{rows}x{cols} into {size}")


def _bench(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Iterator[Sample]:
    src = torch.randn(1 << 16, 64, generator=gen, device=device).to(dtype)
    index = torch.randint(0, 1024, (1 << 16, 64), generator=gen, device=device)
    yield Sample((src, index, 0, None, 1024), desc="65536x64 into 1024")


SPECS = [
    opforge.spec(
        torch.ops.torch_scatter.scatter_sum.default,
        reference=_reference,
        samples=_samples,
        bench_cases=_bench,
        dtypes=("float32", "float64"),
    )
]
